"""/metrics on the status server against real ``python -m forkserve`` process groups.

The app (``tests.apps.metrics``) has its own prometheus_client metrics (``app_hits_total``, a
counter; ``app_worker_up``, a ``liveall`` gauge), so every test also checks that they come out
merged with forkserve's. Expositions are parsed with prometheus_client's own parsers.

Port 0 for both listeners, no sleeps: requests are held in flight on FIFO gates, and every wait
is a deadline-bounded ``wait_for`` or log wait. A worker records a request's metrics just after
the response went out, so a count is awaited (``wait_for``) and then checked exactly.
"""

from __future__ import annotations

import collections
import contextlib
import fcntl
import glob
import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest
from prometheus_client.mmap_dict import MmapedDict, mmap_key
from prometheus_client.openmetrics.parser import \
    text_string_to_metric_families as parse_openmetrics
from prometheus_client.parser import text_string_to_metric_families

from tests.harness import (Server, get, open_fds, raw_request, read_response, send_get, wait_for,
                           worker_set)

APP = "tests.apps.metrics:app"
OPENMETRICS = "application/openmetrics-text; version=1.0.0"
REQUESTS = "forkserve_requests_total"
DURATIONS = "forkserve_request_duration_seconds_count"
HITS = "app_hits_total"
PER_WORKER = ("forkserve_active_connections", "forkserve_in_flight_requests",
              "forkserve_background_tasks", "forkserve_worker_rss_bytes",
              "forkserve_worker_heartbeat_age_seconds")
RESTART_REASONS = ("max_requests", "crashed", "timeout", "boot_failed")
METRIC = re.compile(r"(counter|gauge|histogram|summary)_[^/]*\.db\Z")  # prometheus_client's


# -- helpers ------------------------------------------------------------------------------------

def start(server_factory: Callable[..., Server], *args: str, workers: int = 2,
          env: dict[str, str] | None = None, app: str = APP) -> Server:
    """A ready server of the metrics app (or ``app``) with a status server. An empty
    PROMETHEUS_MULTIPROC_DIR unless ``env`` gives one: one set where the tests run must not
    leak in (empty means unset to forkserve)."""
    server = server_factory("--status-bind", "127.0.0.1:0", *args, app=app, workers=workers,
                            env={"PROMETHEUS_MULTIPROC_DIR": "", **(env or {})})
    return server.wait_ready()


def scrape(server: Server, accept: str | None = None) -> tuple[str, str]:
    """GET /metrics: its content type and its body. A failure shows the server's log (and,
    if the arbiter died, its traceback)."""
    request = urllib.request.Request(f"{server.status_url}/metrics",
                                     headers={"Accept": accept} if accept else {})
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            assert response.status == 200
            return response.headers["Content-Type"], response.read().decode()
    except OSError as exc:  # URLError, a reset or closed connection, a timeout
        try:
            wait_for(lambda: server.proc.poll() is not None, 5, "the arbiter to exit")
        except AssertionError:
            pass  # still running: the log is all there is
        raise AssertionError(f"GET /metrics failed: {exc!r}; server exit code "
                             f"{server.proc.poll()}\n{server.log_text()[-8000:]}") from None


class Metrics:
    """One parsed Prometheus text exposition."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.samples = [s for family in text_string_to_metric_families(text)
                        for s in family.samples]

    def select(self, name: str, **labels: str) -> list[Any]:
        return [s for s in self.samples if s.name == name
                and all(s.labels.get(k) == v for k, v in labels.items())]

    def value(self, name: str, **labels: str) -> float:
        """The sum over every series of ``name`` that has ``labels`` (0 when there is none)."""
        return sum(s.value for s in self.select(name, **labels))

    def pids(self, name: str) -> set[int]:
        return {int(s.labels["pid"]) for s in self.select(name)}

    def states(self) -> list[str]:
        """forkserve_state's states at 1 (one-hot: exactly one, checked by the caller)."""
        return [s.labels["state"] for s in self.select("forkserve_state") if s.value == 1.0]

    def __repr__(self) -> str:
        return self.text


def metrics(server: Server) -> Metrics:
    content_type, text = scrape(server)
    assert content_type.startswith("text/plain"), content_type
    return Metrics(text)


def wait_metrics(server: Server, predicate: Callable[[Metrics], bool], what: str,
                 timeout: float = 10.0) -> Metrics:
    """Scrape until ``predicate`` holds; the last scrape is in the failure message."""
    last: list[Metrics] = []

    def check() -> Metrics | None:
        m = metrics(server)
        last[:] = [m]
        return m if predicate(m) else None
    try:
        return wait_for(check, timeout, what)  # type: ignore[no-any-return]
    except AssertionError as exc:
        raise AssertionError(f"{exc}\nlast scrape:\n{last[0] if last else '-'}\n"
                             f"{server.log_text()}") from None


def fire(port: int, count: int, threads: int = 4, path: str = "/") -> collections.Counter[int]:
    """``count`` GETs, each on its own connection (Connection: close), from ``threads``
    client threads; each must answer 200 with its worker's pid. The pids, counted."""
    def one(_: int) -> int:
        response = get(port, path)
        assert response.status == 200, response.body
        return int(response.body)
    with ThreadPoolExecutor(threads) as pool:
        return collections.Counter(pool.map(one, range(count)))


def counted(server: Server, total: int, hits: int | None = None, timeout: float = 10.0
            ) -> Metrics:
    """Until forkserve has recorded ``total`` requests and the app ``hits`` (default: the
    same), then exactly that many: no request counted twice. A worker records a request
    just after its response went out, the counter then the histogram, so all are awaited.
    Requests the server refused itself are counted but not timed: only the app's are."""
    hits = total if hits is None else hits
    m = wait_metrics(server, lambda m: m.value(REQUESTS) >= total
                     and m.value(DURATIONS) >= hits and m.value(HITS) >= hits,
                     f"{total} requests and {hits} app hits counted", timeout)
    assert m.value(REQUESTS) == total, m
    assert m.value(DURATIONS) == hits, m
    assert m.value(HITS) == hits, m
    return m


class Rising:
    """Checks that counters never go down from one scrape to the next."""

    NAMES = (REQUESTS, DURATIONS, HITS)

    def __init__(self) -> None:
        self.last = {name: 0.0 for name in self.NAMES}
        self.scrapes = 0

    def check(self, m: Metrics) -> Metrics:
        for name, previous in self.last.items():
            value = m.value(name)
            assert value >= previous, f"{name} went down: {previous} -> {value}\n{m}"
            self.last[name] = value
        self.scrapes += 1
        return m


def restarts(m: Metrics) -> dict[str, float]:
    return {reason: m.value("forkserve_worker_restarts_total", reason=reason)
            for reason in RESTART_REASONS}


def lock_held(directory: Path | str) -> bool:
    """Does some process hold the directory's lock (shared: a forkserve using it)? Tried from
    here, as a third party, and let go at once."""
    fd = os.open(os.path.join(directory, ".forkserve.lock"), os.O_RDWR | os.O_CLOEXEC)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # and with it our lock, if we got it
    return False


def private_dirs(tmpdir: Path) -> set[str]:
    """The private metrics directories in ``tmpdir`` (the servers' TMPDIR)."""
    return {os.path.basename(p) for p in glob.glob(str(tmpdir / "forkserve-metrics-*"))}


def stale_counter(path: Path, value: float) -> None:
    """A metric file as an earlier run leaves it: ``value`` requests, were it ever read."""
    earlier = MmapedDict(str(path))
    name = "forkserve_requests"
    earlier.write_value(mmap_key(name, name + "_total", ["method", "status"], ["GET", "200"],
                                 "stale"), value, 0.0)
    earlier.close()


@contextlib.contextmanager
def replaced_by_a_file(path: str) -> Iterator[None]:
    """A regular file where the directory ``path`` was: creating anything in it fails with
    ENOTDIR (tests run as root, which no mode bits stop). The directory is put back after."""
    away = path + ".away"
    os.rename(path, away)
    try:
        Path(path).write_text("not a directory\n")
        yield
    finally:
        if os.path.isfile(path):
            os.remove(path)
        os.rename(away, path)


# -- counting across workers ------------------------------------------------------------------

def test_thousand_requests_over_two_workers_are_counted_once(server_factory: Any) -> None:
    server = start(server_factory)
    pids = worker_set(server, 2)
    served = fire(server.port, 1000, threads=8)
    assert sum(served.values()) == 1000
    assert set(served) == pids, f"both workers must serve; served by {served}"
    m = counted(server, 1000)
    assert m.value(REQUESTS, method="GET", status="200") == 1000, m
    assert m.value("forkserve_request_duration_seconds_bucket", le="+Inf") == 1000, m
    assert m.value("forkserve_request_duration_seconds_sum") > 0, m
    # The app's counter lives in each worker's own file: /metrics shows their sum.
    assert len(m.select(HITS)) == 1, m
    # Per-worker series, for the live workers only; the app's liveall gauge likewise.
    for name in PER_WORKER:
        assert m.pids(name) == pids, (name, m)
    assert m.pids("app_worker_up") == pids, m
    assert m.value("forkserve_workers", state="running") == 2, m
    assert restarts(m) == dict.fromkeys(RESTART_REASONS, 0.0), m
    # Idle again: the live gauges come back to zero (a scrape asks every worker afresh).
    wait_metrics(server, lambda m: m.value("forkserve_in_flight_requests") == 0
                 and m.value("forkserve_active_connections") == 0, "idle workers to show 0")


@pytest.mark.parametrize("worker_class", ["thread", "gevent"])
def test_thread_and_gevent_workers_count_requests(server_factory: Any, worker_class: str) -> None:
    server = start(server_factory, "-k", worker_class)
    pids = worker_set(server, 2)
    served = fire(server.port, 200, threads=4)
    assert set(served) <= pids
    m = counted(server, 200)
    assert m.value(REQUESTS, method="GET", status="200") == 200, m
    assert m.pids("forkserve_in_flight_requests") == pids, m
    assert m.pids("app_worker_up") == pids, m


@pytest.mark.parametrize("worker_class", ["sync", "thread", "gevent"])
def test_unknown_methods_and_refusals_count_as_other(server_factory: Any,
                                                     worker_class: str) -> None:
    server = start(server_factory, "-k", worker_class, workers=1)
    port = server.port
    assert get(port, "/").status == 200
    # A method llhttp knows but forkserve does not list: it reaches the app.
    assert raw_request(port, b"PROPFIND / HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n"
                       ).startswith(b"HTTP/1.1 200 ")
    # Refused by the server itself, before any app: never a method label of their own.
    refusals = {
        501: b"FOO / HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n",
        414: b"GET /" + b"a" * 9000 + b" HTTP/1.1\r\nHost: t\r\n\r\n",
        431: b"GET / HTTP/1.1\r\nHost: t\r\nX-Big: " + b"b" * 9000 + b"\r\n\r\n",
        400: b"GET / HTTP/1.1\r\nHost: t\r\nContent-Length: nope\r\n\r\n",
    }
    for status, data in refusals.items():
        assert raw_request(port, data).startswith(f"HTTP/1.1 {status} ".encode()), status
    m = counted(server, 6, hits=2)  # refusals never reach the app
    # Counted, never timed: the histogram holds the two requests the app answered, and
    # nothing of the refusals, in any bucket.
    assert m.value("forkserve_request_duration_seconds_bucket", le="+Inf") == 2, m
    assert m.value(REQUESTS, method="GET", status="200") == 1, m
    assert m.value(REQUESTS, method="other", status="200") == 1, m
    for status in refusals:
        assert m.value(REQUESTS, method="other", status=str(status)) == 1, (status, m)
    assert {s.labels["method"] for s in m.select(REQUESTS)} == {"GET", "other"}, m


# -- counters across worker exits ---------------------------------------------------------------

def test_counters_never_go_down_while_max_requests_recycles_workers(server_factory: Any) -> None:
    server = start(server_factory, "--max-requests", "50")
    total = 400
    rising = Rising()
    with ThreadPoolExecutor(1) as pool:
        load = pool.submit(fire, server.port, total, 4)
        deadline = time.monotonic() + 30
        while not load.done():
            assert time.monotonic() < deadline, "the load did not finish within 30 s"
            rising.check(metrics(server))
        served = load.result()
    assert sum(served.values()) == total
    assert len(served) > 2, f"no worker was recycled: served by {served}"
    assert rising.scrapes >= 3, f"only {rising.scrapes} scrapes during the load"
    m = rising.check(counted(server, total))
    # Exactly one restart per retirement the arbiter logged; every worker that served and is
    # not one of the two live ones retired. (Not a count from 400 / 50: a retiring sync
    # worker still answers the clients it had accepted, whose requests were on their way, so
    # a retiree may serve a few more than 50. Seen on a loaded machine: six retirees, and two
    # live workers under 50.)
    def settled(m: Metrics) -> bool:
        return (restarts(m)["max_requests"] == server.count_log("retired:")
                and restarts(m)["max_requests"] >= len(served) - 2
                and m.value("forkserve_workers", state="running") == 2
                and m.value("forkserve_workers") == 2)
    m = rising.check(wait_metrics(server, settled, "one restart counted per retirement, and "
                                  "two workers running"))
    assert restarts(m) == {**dict.fromkeys(RESTART_REASONS, 0.0),
                           "max_requests": restarts(m)["max_requests"]}, m
    assert m.value(REQUESTS) == total, m
    # The retired workers' app gauges are gone with them.
    live = m.pids("forkserve_in_flight_requests")
    assert len(live) == 2 and m.pids("app_worker_up") == live, m


def test_killed_worker_vanishes_but_its_counts_remain(server_factory: Any) -> None:
    server = start(server_factory)
    pids = worker_set(server, 2)
    made = 0
    served: collections.Counter[int] = collections.Counter()

    def both_served() -> bool:
        nonlocal made
        served.update(fire(server.port, 20, threads=4))
        made += 20
        return set(served) == pids
    wait_for(both_served, 20, f"both workers to serve, served by {served}", interval=0)
    m = counted(server, made)
    victim = min(pids)
    assert victim in m.pids("forkserve_in_flight_requests"), m
    assert victim in m.pids("app_worker_up"), m

    os.kill(victim, signal.SIGKILL)
    server.wait_log(f"(pid {victim}) was killed by signal 9")
    # The arbiter folded the victim's files before it logged that; the replacement's own
    # series come once it has booted.
    m = wait_metrics(server, lambda m: m.value("forkserve_workers", state="running") == 2
                     and len(m.pids("app_worker_up")) == 2, "a replacement worker, booted")
    now = set(server.workers())
    assert victim not in now and len(now) == 2
    left = [s for s in m.samples if s.labels.get("pid") == str(victim)]
    assert left == [], f"series of the killed worker {victim} remain: {left}"
    for name in PER_WORKER:
        assert m.pids(name) == now, (name, m)
    assert m.pids("app_worker_up") == now, m
    assert restarts(m) == {**dict.fromkeys(RESTART_REASONS, 0.0), "crashed": 1.0}, m
    # What the killed worker counted is still counted; the sums go on from there.
    assert m.value(REQUESTS) == made and m.value(HITS) == made, m
    fire(server.port, 10)
    counted(server, made + 10)


def test_reload_keeps_counters_and_counts_the_reload(server_factory: Any) -> None:
    server = start(server_factory)
    old = worker_set(server, 2)
    fire(server.port, 30)
    rising = Rising()
    m = rising.check(counted(server, 30))
    assert m.value("forkserve_generation") == 1, m
    assert m.value("forkserve_reloads_total") == 0, m

    server.signal(signal.SIGHUP)

    def reloaded() -> bool:
        m = rising.check(metrics(server))
        return (m.value("forkserve_reloads_total", outcome="succeeded") == 1
                and not set(server.workers()) & old and len(server.workers()) == 2)
    wait_for(reloaded, 15, f"the reload to complete and the old workers {old} to exit",
             interval=0)
    m = rising.check(counted(server, 30))  # the old workers' counts, folded
    assert m.value("forkserve_generation") == 2, m
    assert m.value("forkserve_reloads_total", outcome="failed") == 0, m
    assert sum(restarts(m).values()) == 0, m  # a reload is not a restart
    new = set(server.workers())
    assert m.pids("forkserve_in_flight_requests") == new, m
    assert m.pids("app_worker_up") == new, m
    fire(server.port, 20)
    rising.check(counted(server, 50))


# -- life-cycle gauges --------------------------------------------------------------------------

def test_state_through_drain_and_cancel(server_factory: Any, gates: Any) -> None:
    before = time.time()
    server = start(server_factory, "--drain-timeout", "3", "--cancel-grace", "20", workers=1)
    m = metrics(server)
    assert m.states() == ["running"], m
    assert m.value("forkserve_ready") == 1, m
    assert m.value("forkserve_generation") == 1, m
    assert before - 1 <= m.value("forkserve_start_time_seconds") <= time.time(), m
    assert m.value("forkserve_drain_cancelled_requests_total") == 0, m

    request, hold = gates("request"), gates("hold")
    with send_get(server.port, f"/cancel-then-hold?fifo={request.path}&hold={hold.path}") as sock:
        request.wait_entered()
        m = wait_metrics(server, lambda m: m.value("forkserve_in_flight_requests") == 1,
                         "the request in flight")
        server.signal(signal.SIGTERM)
        m = wait_metrics(server, lambda m: m.states() == ["draining"]
                         and m.value("forkserve_workers", state="draining") == 1,
                         "the draining state, in the arbiter and its worker", 2.5)
        assert m.value("forkserve_in_flight_requests") == 1, m
        assert m.value("forkserve_ready") == 0, m
        assert m.value("forkserve_workers") == 1, m
        # The drain deadline cancels the request (503); its shutdown function then holds
        # the worker, and so the server, until the test releases it.
        assert read_response(sock, 15).status == 503
        hold.wait_entered()
        m = wait_metrics(server,
                         lambda m: m.value("forkserve_drain_cancelled_requests_total") == 1,
                         "the cancelled request to be counted")
        assert m.states() == ["cancelling"], m
        hold.release()
        assert server.wait_exit(10) == 0
    server.wait_log("Server stopped", timeout=5)


# -- the exposition ------------------------------------------------------------------------------

def test_promtool_accepts_the_exposition(server_factory: Any) -> None:
    promtool = shutil.which("promtool")
    if promtool is None:
        if "CI" in os.environ:  # skipped only where CI is not set at all
            pytest.fail("promtool is missing under CI (.ci/run installs Debian's prometheus)")
        pytest.skip("promtool not found (Debian package prometheus); CI installs it")
    server = start(server_factory)
    fire(server.port, 20)
    bad = b"GET / HTTP/1.1\r\nHost: t\r\nContent-Length: nope\r\n\r\n"
    assert raw_request(server.port, bad).startswith(b"HTTP/1.1 400 ")
    m = counted(server, 21, hits=20)
    result = subprocess.run([promtool, "check", "metrics"], input=m.text.encode(),
                            capture_output=True, timeout=30)
    assert (result.returncode, result.stdout, result.stderr) == (0, b"", b""), m


def test_openmetrics_when_asked(server_factory: Any) -> None:
    server = start(server_factory)
    fire(server.port, 5)
    counted(server, 5)
    content_type, text = scrape(server, OPENMETRICS)
    assert content_type.startswith("application/openmetrics-text; version=1.0.0"), content_type
    assert text.endswith("# EOF\n"), text[-200:]
    families = {f.name: f for f in parse_openmetrics(text)}  # strict: fails on a bad line
    requests = families["forkserve_requests"]
    assert requests.type == "counter"
    assert sum(s.value for s in requests.samples if s.name == REQUESTS) == 5
    assert families["forkserve_request_duration_seconds"].type == "histogram"
    assert families["forkserve_state"].type == "gauge"
    assert "app_hits" in families and "app_worker_up" in families
    # Without the Accept header: the Prometheus text format.
    content_type, text = scrape(server)
    assert content_type.startswith("text/plain; version=0.0.4"), content_type
    assert "# EOF" not in text


# -- the directory -------------------------------------------------------------------------------

def test_private_directory_lives_as_long_as_the_server(server_factory: Any) -> None:
    server = start(server_factory)
    path = get(server.port, "/metrics-dir").body.decode()
    assert os.path.basename(path).startswith(f"forkserve-metrics-{server.pid}-"), path
    assert os.path.isdir(path)
    assert any(f.startswith(path + os.sep) for f in open_fds(server.pid)), open_fds(server.pid)
    fire(server.port, 5)
    counted(server, 6)  # and /metrics-dir
    assert any(name.endswith(".db") for name in os.listdir(path))
    server.signal(signal.SIGTERM)
    assert server.wait_exit(10) == 0
    assert not os.path.exists(path), os.listdir(path)


def test_operator_directory_is_wiped_of_stale_files_and_kept(server_factory: Any,
                                                             tmp_path: Path) -> None:
    directory = tmp_path / "prom"
    directory.mkdir()
    # What an earlier run left: a worker's file that would add 1000 requests if it were read.
    stale = directory / "counter_fs_99999.db"
    earlier = MmapedDict(str(stale))
    name = "forkserve_requests"
    earlier.write_value(mmap_key(name, name + "_total", ["method", "status"], ["GET", "200"],
                                 "stale"), 1000.0, 0.0)
    earlier.close()
    unrelated = directory / "README"
    unrelated.write_text("not a metrics file\n")

    server = start(server_factory, env={"PROMETHEUS_MULTIPROC_DIR": str(directory)})
    record = server.wait_log("Removed metric files of an earlier run")
    assert record["files"] == 1 and record["directory"] == str(directory), record
    assert not stale.exists()
    assert get(server.port, "/metrics-dir").body.decode() == str(directory)
    fire(server.port, 4)
    counted(server, 5)
    assert any(p.suffix == ".db" for p in directory.iterdir())
    server.signal(signal.SIGTERM)
    assert server.wait_exit(10) == 0
    assert directory.is_dir()
    assert unrelated.read_text() == "not a metrics file\n"


def test_scrape_survives_a_metrics_file_being_created(server_factory: Any, tmp_path: Path) -> None:
    """prometheus_client creates a process's file empty, then sizes it (MmapedDict: open, then
    truncate). A worker booting (or any process sharing the directory) is in that window for
    an instant; a scrape then must neither fail nor take the arbiter down. The empty file is
    held here so that the window is not left to chance: --max-requests recycling under
    scrapes hits it within seconds (test_counters_never_go_down_while_max_requests_...)."""
    directory = tmp_path / "prom"
    server = start(server_factory, env={"PROMETHEUS_MULTIPROC_DIR": str(directory)})
    fire(server.port, 3)
    counted(server, 3)
    (directory / "counter_4242.db").touch()  # as MmapedDict leaves it before its truncate
    m = metrics(server)
    assert m.value(REQUESTS) == 3 and m.value(HITS) == 3, m
    assert server.proc.poll() is None, server.log_text()
    fire(server.port, 2)
    counted(server, 5)


def test_operator_directory_wipes_only_metric_files(server_factory: Any,
                                                    tmp_path: Path) -> None:
    """Of what an earlier run left in an operator's directory, only prometheus_client's
    metric files (``TYPE_*.db``, at the top) go; everything else stays, byte for byte."""
    directory = tmp_path / "prom"
    (directory / "keep").mkdir(parents=True)
    metric_files = ["counter_111.db", "counter_fs_111.db", "counter_arbiter-111.db",
                    "counter_arbiter-111-archive.db", "gauge_livesum_111.db", "gauge_all_111.db",
                    "histogram_111.db", "histogram_fs_111.db", "summary_111.db"]
    for name in metric_files:
        stale_counter(directory / name, 1000.0)
    # A metric file's name on a link: the link goes, never what it points to.
    outside = tmp_path / "outside.db"
    stale_counter(outside, 1000.0)
    (directory / "counter_222.db").symlink_to(outside)
    kept = {"app.db": b"SQLite format 3\x00 the app's own database",
            "notes.txt": b"the operator's notes\n",
            "counter_111.db.bak": b"a backup",
            "Counter_111.db": b"not prometheus_client's case",
            "mycounter_111.db": b"a prefix is not a type",
            "keep/counter_111.db": b"below the top: not ours"}
    for name, data in kept.items():
        (directory / name).write_bytes(data)
    outside_data = outside.read_bytes()

    server = start(server_factory, env={"PROMETHEUS_MULTIPROC_DIR": str(directory)})
    record = server.wait_log("Removed metric files of an earlier run")
    assert record["files"] == len(metric_files) + 1, record
    for name in [*metric_files, "counter_222.db"]:
        assert not os.path.lexists(directory / name), name
    fire(server.port, 7)
    counted(server, 7)  # nothing of the earlier run's 1000s
    server.signal(signal.SIGTERM)
    assert server.wait_exit(10) == 0
    for name, data in kept.items():
        assert (directory / name).read_bytes() == data, name
    assert outside.read_bytes() == outside_data


def test_two_instances_share_an_operator_directory(server_factory: Any, tmp_path: Path) -> None:
    """As in an -sf handoff with the same environment: the second instance wipes nothing of
    the first's, both hold the directory's lock shared, and only once both are gone can it be
    taken."""
    directory = tmp_path / "prom"
    env = {"PROMETHEUS_MULTIPROC_DIR": str(directory)}
    first = start(server_factory, env=env)
    fire(first.port, 30)
    counted(first, 30)
    assert lock_held(directory)  # the first instance alone holds it
    files = set(os.listdir(directory))
    assert sum(METRIC.match(name) is not None for name in files) >= 4, files

    second = start(server_factory, env=env)
    assert second.count_log("Removed metric files") == 0, second.log_text()
    assert files <= set(os.listdir(directory)), (files, os.listdir(directory))
    counted(first, 30)  # its workers' files are still there, still read
    counted(second, 30)  # the directory merged: the first instance's counts too
    fire(second.port, 10)
    counted(first, 40)
    counted(second, 40)
    assert lock_held(directory)

    first.signal(signal.SIGTERM)
    assert first.wait_exit(10) == 0
    assert lock_held(directory), "the second instance does not hold the directory's lock"
    counted(second, 40)  # what the first instance counted is kept: no counter goes down
    second.signal(signal.SIGTERM)
    assert second.wait_exit(10) == 0
    assert not lock_held(directory), "the lock is held after both instances exited"
    assert directory.is_dir()  # the operator's: never removed


def test_orphaned_private_directories_are_swept(server_factory: Any, tmp_path: Path) -> None:
    """A private directory whose arbiter was SIGKILLed (so nobody holds its lock) is removed
    when the next server makes its own; one whose lock is held, or that has no lock file, is
    left alone."""
    tmpdir = tmp_path / "tmp"
    tmpdir.mkdir()
    env = {"TMPDIR": str(tmpdir)}
    killed = start(server_factory, env=env)
    orphan = get(killed.port, "/metrics-dir").body.decode()
    assert os.path.dirname(orphan) == str(tmpdir), orphan
    assert os.path.basename(orphan).startswith(f"forkserve-metrics-{killed.pid}-"), orphan
    killed.close()  # SIGKILL to the whole process group: nothing cleans up
    assert os.path.isfile(os.path.join(orphan, ".forkserve.lock")), orphan
    assert not lock_held(orphan)

    running = start(server_factory, env=env)
    alive = get(running.port, "/metrics-dir").body.decode()
    held = tempfile.mkdtemp(prefix="forkserve-metrics-999999-", dir=tmpdir)
    lock = os.open(os.path.join(held, ".forkserve.lock"), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC,
                   0o600)
    unlocked = tempfile.mkdtemp(prefix="forkserve-metrics-999998-", dir=tmpdir)  # no lock file
    try:
        fcntl.flock(lock, fcntl.LOCK_SH)
        sweeper = start(server_factory, env=env)
        own = get(sweeper.port, "/metrics-dir").body.decode()
        assert not os.path.exists(orphan), os.listdir(orphan)
        assert private_dirs(tmpdir) == {os.path.basename(p) for p in (alive, held, unlocked, own)}
        assert os.path.isfile(os.path.join(held, ".forkserve.lock"))
        # The running server lost nothing.
        fire(running.port, 3)
        counted(running, 4)  # and its /metrics-dir
        sweeper.signal(signal.SIGTERM)
        assert sweeper.wait_exit(10) == 0
        assert private_dirs(tmpdir) == {os.path.basename(p) for p in (alive, held, unlocked)}
    finally:
        os.close(lock)


def test_worker_that_cannot_create_its_metric_files_still_serves(server_factory: Any,
                                                                 tmp_path: Path) -> None:
    """Its replacement finds a regular file where the directory was: creating its files
    fails, and it serves without them. The app is one without metrics of its own: those
    would fail its import, as they should."""
    tmpdir = tmp_path / "tmp"
    tmpdir.mkdir()
    server = start(server_factory, workers=1, env={"TMPDIR": str(tmpdir)},
                   app="tests.apps.basic:app")
    (path,) = glob.glob(str(tmpdir / f"forkserve-metrics-{server.pid}-*"))
    (worker,) = worker_set(server, 1)
    for _ in range(3):
        assert int(get(server.port, "/pid").body) == worker
    wait_metrics(server, lambda m: m.value(REQUESTS) == 3, "3 requests counted")

    with replaced_by_a_file(path):
        os.kill(worker, signal.SIGKILL)
        server.wait_log(f"(pid {worker}) was killed by signal 9")
        record = server.wait_log("Worker cannot record metrics; serving without them")
        assert "Not a directory" in record["error"], record
        (replacement,) = wait_for(lambda: (w := server.workers()) and len(w) == 1
                                  and worker not in w and w, 10, "a replacement worker")
        for _ in range(5):
            response = get(server.port, "/pid")
            assert (response.status, int(response.body)) == (200, replacement)
        assert server.count_log("Worker cannot record metrics") == 1, server.log_text()
        assert server.proc.poll() is None
    # Whole again: what the killed worker counted is there; the replacement records nothing.
    m = metrics(server)
    assert m.value(REQUESTS) == 3 and m.value(DURATIONS) == 3, m
    assert restarts(m)["crashed"] == 1, m
    server.signal(signal.SIGTERM)
    assert server.wait_exit(10) == 0
    assert not os.path.exists(path)


def test_upgrade_check_import_is_not_counted(server_factory: Any, tmp_path: Path) -> None:
    """USR2 first runs ``--check``, which imports the app: its metrics go to a scratch
    directory, so a counter the app increments at import shows exactly one per worker ever
    booted (the old workers' folded, the new ones'), never one more for the check."""
    tmpdir = tmp_path / "tmp"
    tmpdir.mkdir()
    imports = tmp_path / "imports"
    server = start(server_factory, app="tests.apps.metrics_import:app",
                   env={"TMPDIR": str(tmpdir), "APP_IMPORTS_LOG": str(imports)})
    old = worker_set(server, 2)
    path = get(server.port, "/metrics-dir").body.decode()
    m = wait_metrics(server, lambda m: m.value("app_imports_total") >= 2, "2 imports counted")
    assert m.value("app_imports_total") == 2, m

    server.signal(signal.SIGUSR2)
    seen: list[float] = []

    def upgraded() -> bool:
        value = metrics(server).value("app_imports_total")
        assert value <= 4 and value >= (seen[-1] if seen else 2), (seen, value)
        seen.append(value)
        return (server.count_log("Upgrade complete") == 1 and len(server.workers()) == 2
                and not set(server.workers()) & old)
    wait_for(upgraded, 20, lambda: f"the upgrade, and the old workers {old} gone\n{server.log_text()}")
    new = set(server.workers())
    m = wait_metrics(server, lambda m: m.value("app_imports_total") >= 4
                     and m.value("forkserve_reloads_total", outcome="succeeded") == 1,
                     "4 imports and the upgrade counted")
    assert m.value("app_imports_total") == 4, m
    assert m.pids("app_worker_up") == new, m

    # Who imported the app, and where its files went: the check did import it, elsewhere.
    where = dict(line.split(" ", 1) for line in imports.read_text().splitlines())
    others = set(map(int, where)) - old - new
    assert len(where) == 5 and len(others) == 1, (where, old, new)
    check = others.pop()
    assert where[str(check)] not in ("", path), where
    assert {where[str(pid)] for pid in old | new} == {path}, where
    # At the top of the directory, files of live workers only: the old workers' were folded,
    # the check's never there.
    pids = {int(match.group(1)) for name in os.listdir(path)
            if (match := re.fullmatch(r"[a-z]+_(?:[a-z]+_)?(\d+)\.db", name))}
    assert pids == new, (os.listdir(path), new, check)
    server.signal(signal.SIGTERM)
    assert server.wait_exit(10) == 0


def test_upgrade_with_an_unusable_metrics_directory_keeps_serving(server_factory: Any,
                                                                  tmp_path: Path) -> None:
    """USR2 while nothing can be created in the metrics directory (here a file stands where
    it was; in life a full or read-only file system, or a stray file where the upgrade's
    check wants its scratch directory): the upgrade may complete or be aborted, but the
    server serves on either way. Metrics are an extra."""
    tmpdir = tmp_path / "tmp"
    tmpdir.mkdir()
    server = start(server_factory, workers=1, env={"TMPDIR": str(tmpdir)},
                   app="tests.apps.basic:app")
    (path,) = glob.glob(str(tmpdir / f"forkserve-metrics-{server.pid}-*"))
    outcomes = ("Upgrade complete", "Upgrade aborted", "Upgrade failed")
    with replaced_by_a_file(path):
        server.signal(signal.SIGUSR2)
        wait_for(lambda: server.proc.poll() is not None
                 or any(server.count_log(outcome) for outcome in outcomes), 20,
                 lambda: f"the upgrade's outcome\n{server.log_text()}")
        assert server.proc.poll() is None, f"USR2 took the server down\n{server.log_text()}"
        assert get(server.port, "/pid").status == 200
    server.signal(signal.SIGTERM)
    assert server.wait_exit(10) == 0
