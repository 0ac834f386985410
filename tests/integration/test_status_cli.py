"""``forkserve status`` against real servers: the table, ``--json``, ``--watch`` through a drain.

The command runs as its own process (``python -m forkserve status``), asking the server's
control socket (``--control-socket``) or its status server (``--url``, the ``--status-bind``
address). Every call has a timeout. ``--watch`` output goes to a pipe a thread reads; a test
waits for the frame it expects with ``wait_for``, never for time. Requests are held in flight
on FIFO gates.
"""

from __future__ import annotations

import json
import os
import re
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest

from tests.harness import ROOT, Server, get, read_response, send_get, wait_for, worker_set

COLUMNS = ["PID", "WORKER", "GEN", "STATE", "AGE", "REQUESTS", "IN FLIGHT", "CONNS", "BG", "RSS",
           "HEARTBEAT"]
HEADER = re.compile(r"forkserve (?P<version>\S+)  pid (?P<pid>\d+)  (?P<state>[a-z]+) "
                    r"\((?P<ready>ready|not ready)\)  generation (?P<generation>\d+)  "
                    r"up (?P<up>\S+)  (?P<worker_class>[a-z]+) workers (?P<workers>\d+)")
TOTALS = re.compile(r"in flight (?P<in_flight>\d+)  connections (?P<connections>\d+)  "
                    r"background (?P<background>\d+)(?P<paused>  PAUSED)?")
STAMP = re.compile(r"(?m)^(?=\d\d:\d\d:\d\d  (?:forkserve |no answer: ))")  # where each --watch frame starts
STOPPED = "forkserve has stopped\n"
RUN_TIMEOUT = 20.0  # one `forkserve status` call: a Python start and one request, on a busy box


# -- running the command ------------------------------------------------------------------------

def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def status(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "forkserve", "status", *args], cwd=str(ROOT),
                          env=_env(), stdin=subprocess.DEVNULL, capture_output=True, text=True,
                          timeout=RUN_TIMEOUT)


@dataclass
class Table:
    header: dict[str, str]
    totals: dict[str, str]
    rows: list[dict[str, str]]

    @property
    def in_flight(self) -> int:
        return int(self.totals["in_flight"])


def parse_table(text: str) -> Table:
    """The table ``forkserve status`` prints; fails on anything that is not one."""
    lines = text.rstrip("\n").split("\n")
    assert len(lines) >= 4, text
    header = HEADER.fullmatch(lines[0])
    totals = TOTALS.fullmatch(lines[1])
    assert header and totals and lines[2] == "", text
    names = re.findall(r"\S+(?: \S+)*", lines[3])
    assert names == COLUMNS, text
    rows = []
    for line in lines[4:]:
        cells = line.split()
        assert len(cells) == len(COLUMNS), f"row {line!r} of\n{text}"
        rows.append(dict(zip(COLUMNS, cells)))
    assert int(header["workers"]) == len(rows), text
    return Table(header.groupdict(), totals.groupdict(), rows)


class Watcher:
    """``forkserve status --watch`` with its stdout and stderr read by threads."""

    def __init__(self, *args: str) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", "forkserve", "status", "--watch", *args],
                                     cwd=str(ROOT), env=_env(), stdin=subprocess.DEVNULL,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        self._lock = threading.Lock()
        self._out: list[bytes] = []
        self._err: list[bytes] = []
        self._readers = [threading.Thread(target=self._read, args=(stream, sink), daemon=True)
                         for stream, sink in ((self.proc.stdout, self._out),
                                              (self.proc.stderr, self._err))]
        for reader in self._readers:
            reader.start()

    def _read(self, stream: Any, sink: list[bytes]) -> None:
        while chunk := os.read(stream.fileno(), 65536):
            with self._lock:
                sink.append(chunk)

    @property
    def out(self) -> str:
        with self._lock:
            return b"".join(self._out).decode()

    @property
    def err(self) -> str:
        with self._lock:
            return b"".join(self._err).decode()

    def frames(self) -> list[Table]:
        """The frames written so far. Each starts with HH:MM:SS and ends with a blank line; the
        last one may still be on its way (then it is left out)."""
        out = self.out
        if out.endswith(STOPPED):
            out = out[: -len(STOPPED)]
        head, *chunks = STAMP.split(out)
        assert head == "", f"output before the first frame: {head!r}"
        if chunks and not chunks[-1].endswith("\n\n"):
            chunks.pop()
        frames = []
        for chunk in chunks:
            assert chunk.endswith("\n\n"), f"a frame without its blank separator: {chunk!r}"
            if chunk[len("HH:MM:SS  "):].startswith("no answer: "):
                continue  # the server did not answer in time: a note, not a table
            frames.append(parse_table(chunk[len("HH:MM:SS  "):-1]))
        return frames

    def wait_frame(self, predicate: Callable[[Table], bool], what: str, after: int = 0,
                   timeout: float = 15.0) -> int:
        """The index of the first frame from ``after`` on that satisfies ``predicate``."""
        def find() -> int | None:
            for index, frame in enumerate(self.frames()[after:], after):
                if predicate(frame):
                    return index + 1  # truthy even for the first frame
            assert self.proc.poll() is None, f"the watcher exited ({self.proc.returncode}) " \
                                             f"before {what}:\n{self.out}{self.err}"
            return None
        return wait_for(find, timeout, f"a frame with {what}:\n{self.out}") - 1

    def wait(self, timeout: float = 15.0) -> int:
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"the watcher did not exit within {timeout}s:\n{self.out}") from None
        for reader in self._readers:
            reader.join(5)
        return code

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)
        for reader in self._readers:
            reader.join(5)
        for stream in (self.proc.stdout, self.proc.stderr):
            if stream is not None:
                stream.close()


@pytest.fixture
def watchers() -> Iterator[Callable[..., Watcher]]:
    started: list[Watcher] = []

    def start(*args: str) -> Watcher:
        watcher = Watcher(*args)
        started.append(watcher)
        return watcher

    yield start
    for watcher in started:
        watcher.close()


@pytest.fixture
def ctl_dir() -> Iterator[Path]:
    """A short directory for the control socket (sun_path holds 107 bytes; pytest's tmp_path can
    be longer than that)."""
    path = Path(tempfile.mkdtemp(prefix="fsst-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def start(server_factory: Any, ctl_dir: Path, *args: str, workers: int = 2) -> tuple[Server, Path]:
    """A ready server with both a status server and a control socket."""
    path = ctl_dir / "ctl.sock"
    server = server_factory("--status-bind", "127.0.0.1:0", "--control-socket", str(path), *args,
                            workers=workers).wait_ready()
    wait_for(path.exists, 5, f"the control socket {path}")
    return server, path


def where(server: Server, path: Path, via: str) -> list[str]:
    return ["--url", server.status_url] if via == "url" else ["--control-socket", str(path)]


def fetch_status(server: Server) -> dict[str, Any]:
    with urllib.request.urlopen(server.status_url + "/status", timeout=5) as response:
        return dict(json.loads(response.read()))


VIA = pytest.mark.parametrize("via", ["url", "control-socket"])


# -- one look -----------------------------------------------------------------------------------

def test_table_shows_the_real_workers_and_counts_the_requests(server_factory: Any,
                                                              ctl_dir: Path) -> None:
    server, path = start(server_factory, ctl_dir)
    pids = worker_set(server, 2)
    for _ in range(5):
        assert get(server.port, "/").status == 200
    # The counters reach the arbiter asynchronously: wait until it has all 5, then look.
    wait_for(lambda: sum(w["requests_served"] for w in fetch_status(server)["workers"]) == 5, 10,
             "the arbiter to count the 5 requests")
    for via in ("url", "control-socket"):
        done = status(*where(server, path, via))
        assert done.returncode == 0, done.stderr
        assert done.stderr == ""
        table = parse_table(done.stdout)
        assert table.header["pid"] == str(server.pid), done.stdout
        assert (table.header["state"], table.header["ready"]) == ("running", "ready"), done.stdout
        assert table.header["generation"] == "1"
        assert table.header["worker_class"] == "sync"
        assert table.totals == {"in_flight": "0", "connections": "0", "background": "0",
                                "paused": None}
        assert {int(r["PID"]) for r in table.rows} == pids, done.stdout
        assert sorted(r["WORKER"] for r in table.rows) == ["1", "2"]
        assert sum(int(r["REQUESTS"]) for r in table.rows) == 5, done.stdout
        for row in table.rows:
            assert (row["GEN"], row["STATE"], row["IN FLIGHT"], row["CONNS"], row["BG"]) == \
                ("1", "running", "0", "0", "0"), done.stdout
            assert re.fullmatch(r"\d+(\.\d)?[BKMG]", row["RSS"]) and row["RSS"] != "0B", row
            assert re.fullmatch(r"\d+\.\ds", row["HEARTBEAT"]), row


def test_table_shows_a_request_in_flight(server_factory: Any, ctl_dir: Path, gates: Any) -> None:
    server, path = start(server_factory, ctl_dir, workers=1)
    gate = gates()
    with send_get(server.port, gate.route) as sock:
        gate.wait_entered()
        # A busy sync worker reports when asked; wait until the arbiter has heard, then look.
        wait_for(lambda: fetch_status(server)["in_flight_requests"] == 1, 10,
                 "the arbiter to count the request in flight")
        for via in ("url", "control-socket"):
            done = status(*where(server, path, via))
            assert done.returncode == 0, done.stderr
            table = parse_table(done.stdout)
            assert (table.in_flight, table.totals["connections"]) == (1, "1"), done.stdout
            assert (table.rows[0]["IN FLIGHT"], table.rows[0]["CONNS"]) == ("1", "1"), done.stdout
        gate.release()
        assert read_response(sock).body == b"released"


def test_json_is_the_raw_snapshot(server_factory: Any, ctl_dir: Path) -> None:
    server, path = start(server_factory, ctl_dir)
    pids = worker_set(server, 2)
    for via in ("url", "control-socket"):
        done = status(*where(server, path, via), "--json")
        assert done.returncode == 0, done.stderr
        snapshot = json.loads(done.stdout)
        assert snapshot["pid"] == server.pid
        assert snapshot["state"] == "running" and snapshot["ready"] is True
        assert {w["pid"] for w in snapshot["workers"]} == pids
        assert sorted(w["worker_id"] for w in snapshot["workers"]) == [1, 2]
        for worker in snapshot["workers"]:
            assert {"generation", "requests_served", "in_flight_requests", "rss_bytes",
                    "seconds_since_heartbeat", "state"} <= set(worker), worker


# -- --watch ------------------------------------------------------------------------------------

@VIA
def test_watch_a_drain_until_the_server_is_gone(server_factory: Any, ctl_dir: Path, gates: Any,
                                                watchers: Any, via: str) -> None:
    server, path = start(server_factory, ctl_dir)
    worker_set(server, 2)
    first, second = gates("first"), gates("second")
    # One request held in each sync worker.
    with send_get(server.port, first.route) as sock_first, \
            send_get(server.port, second.route) as sock_second:
        first.wait_entered()
        second.wait_entered()
        watch = watchers(*where(server, path, via), "--interval", "0.2")
        watch.wait_frame(lambda f: f.header["state"] == "running" and f.in_flight == 2,
                         "both requests in flight while running")

        server.signal(signal.SIGTERM)
        draining = watch.wait_frame(lambda f: f.header["state"] == "draining" and f.in_flight == 2,
                                    "draining with 2 in flight")

        first.release()
        assert read_response(sock_first).body == b"released"
        one = watch.wait_frame(lambda f: f.header["state"] == "draining" and f.in_flight == 1,
                               "draining with 1 in flight", after=draining)

        second.release()
        assert read_response(sock_second).body == b"released"
    assert server.wait_exit(15) == 0
    assert watch.wait(15) == 0, watch.err
    assert watch.out.endswith("\n\n" + STOPPED), watch.out
    assert watch.err == ""
    assert "\x1b" not in watch.out  # stdout is a pipe: no screen clearing

    frames = watch.frames()
    after_term = frames[draining:]
    counts = [f.in_flight for f in after_term]
    assert counts == sorted(counts, reverse=True), f"in flight went up during the drain: {counts}"
    assert 2 in counts and 1 in counts, counts
    for frame in after_term:
        assert frame.header["ready"] == "not ready", frame
        # Asked to stop, then (once it took the stop) draining.
        assert {row["STATE"] for row in frame.rows} <= {"stopping", "draining"}, frame
    # By the time one request is left, at most one worker can still be holding it.
    assert sum(int(r["IN FLIGHT"]) for r in frames[one].rows) == 1, frames[one]


@VIA
def test_sigint_stops_watching(server_factory: Any, ctl_dir: Path, watchers: Any, via: str) -> None:
    server, path = start(server_factory, ctl_dir)
    watch = watchers(*where(server, path, via), "--interval", "0.2")
    watch.wait_frame(lambda f: f.header["state"] == "running", "a first frame")
    os.kill(watch.proc.pid, signal.SIGINT)
    assert watch.wait(15) == 0, watch.err
    assert watch.err == "", watch.err  # no traceback
    assert STOPPED not in watch.out
    assert server.proc.poll() is None  # only the watcher stopped
    assert get(server.port, "/").status == 200


def test_watch_with_json_prints_one_snapshot_per_frame(server_factory: Any, ctl_dir: Path,
                                                       watchers: Any) -> None:
    server, path = start(server_factory, ctl_dir)
    watch = watchers("--url", server.status_url, "--json", "--interval", "0.2")
    stamp = re.compile(r"(?m)^\d\d:\d\d:\d\d  (?=\{)")
    wait_for(lambda: len(stamp.findall(watch.out)) >= 2, 15, "two frames")
    server.signal(signal.SIGTERM)
    assert server.wait_exit(15) == 0
    assert watch.wait(15) == 0, watch.err
    assert watch.out.endswith("\n\n" + STOPPED), watch.out
    head, *frames = stamp.split(watch.out[: -len(STOPPED)])
    assert head == "" and len(frames) >= 2, watch.out
    for frame in frames:
        assert frame.endswith("}\n\n"), frame
        assert json.loads(frame)["pid"] == server.pid


def test_watch_ends_quietly_when_its_reader_leaves(server_factory: Any, ctl_dir: Path) -> None:
    # `forkserve status --watch | head -1`
    server, _ = start(server_factory, ctl_dir)
    proc = subprocess.Popen([sys.executable, "-m", "forkserve", "status", "--watch", "--url",
                             server.status_url, "--interval", "0.2"], cwd=str(ROOT), env=_env(),
                            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        assert proc.stdout is not None and proc.stderr is not None
        readable, _, _ = select.select([proc.stdout], [], [], 15)
        assert readable, "no first frame within 15s"
        assert os.read(proc.stdout.fileno(), 65536)
        proc.stdout.close()
        assert proc.wait(15) == 0
        assert proc.stderr.read() == b""  # no BrokenPipeError traceback
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(10)
        if proc.stderr is not None:
            proc.stderr.close()


FETCH_TIMEOUT = 5.0  # forkserve.statusview.fetch's default: how long one look waits for an answer


@pytest.mark.slow
def test_watch_outlasts_a_server_that_does_not_answer_for_a_while(server_factory: Any,
                                                                  ctl_dir: Path,
                                                                  watchers: Any) -> None:
    """A server that is alive but does not answer (here: its arbiter SIGSTOPped for longer
    than one look waits) is not gone: the watcher must not say it stopped."""
    server, path = start(server_factory, ctl_dir)
    watches = [watchers(*where(server, path, via), "--interval", "0.2")
               for via in ("url", "control-socket")]
    for watch in watches:
        watch.wait_frame(lambda f: f.header["state"] == "running", "a first frame")
    server.signal(signal.SIGSTOP)
    try:
        # Time is the point here: longer than one look's timeout, with margin for a busy box.
        end = time.monotonic() + FETCH_TIMEOUT + 2.0
        for watch in watches:
            try:
                watch.proc.wait(max(end - time.monotonic(), 0.0))
            except subprocess.TimeoutExpired:
                pass
        gave_up = [f"{watch.proc.args[5]}: exit code {watch.proc.returncode}, "
                   f"output ending {watch.out[-60:]!r}"
                   for watch in watches if watch.proc.poll() is not None or STOPPED in watch.out]
        assert not gave_up, ("a watcher said the server stopped while it was alive (SIGSTOPped "
                             f"pid {server.pid}):\n" + "\n".join(gave_up))
    finally:
        server.signal(signal.SIGCONT)
    counts = [len(watch.frames()) for watch in watches]
    for watch, count in zip(watches, counts):
        watch.wait_frame(lambda f: f.header["state"] == "running", "a frame after SIGCONT",
                         after=count)
    server.signal(signal.SIGTERM)
    assert server.wait_exit(15) == 0
    for watch in watches:
        assert watch.wait(15) == 0, watch.err
        assert watch.out.endswith(STOPPED)


def test_watch_follows_an_in_place_upgrade(server_factory: Any, ctl_dir: Path,
                                           watchers: Any) -> None:
    """USR2 re-executes the arbiter, which closes and re-creates its control socket: a moment
    without it is an upgrade, not a stop. Both watchers see generation 2 and go on."""
    server, path = start(server_factory, ctl_dir)
    watches = [watchers(*where(server, path, via), "--interval", "0.1")
               for via in ("url", "control-socket")]
    for watch in watches:
        watch.wait_frame(lambda f: f.header["generation"] == "1", "generation 1")
    server.signal(signal.SIGUSR2)
    server.wait_log("Upgrade complete", timeout=30)
    for watch in watches:
        watch.wait_frame(lambda f: f.header["generation"] == "2"
                         and f.header["pid"] == str(server.pid), "generation 2, same pid")
        assert watch.proc.poll() is None and STOPPED not in watch.out, watch.out
    server.signal(signal.SIGTERM)
    assert server.wait_exit(15) == 0
    for watch in watches:
        assert watch.wait(15) == 0, watch.err
        assert watch.out.endswith(STOPPED)


# -- failures -----------------------------------------------------------------------------------

def one_line_error(done: subprocess.CompletedProcess[str]) -> None:
    assert done.returncode == 1, (done.returncode, done.stdout, done.stderr)
    assert done.stdout == ""
    assert done.stderr.count("\n") == 1 and done.stderr.endswith("\n"), done.stderr
    assert done.stderr.startswith("forkserve status:"), done.stderr


@pytest.mark.parametrize("watch", [False, True], ids=["once", "watch"])
def test_unreachable_url(watch: bool) -> None:
    # A port bound but not listening refuses connections for as long as the test holds it.
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        port = held.getsockname()[1]
        one_line_error(status("--url", f"http://127.0.0.1:{port}", *(["--watch"] if watch else [])))


def test_url_that_is_not_a_status_server(server: Server) -> None:
    # The application's port: /status there is the test app's, not JSON.
    one_line_error(status("--url", server.url))


@pytest.mark.parametrize("watch", [False, True], ids=["once", "watch"])
def test_missing_control_socket(tmp_path: Path, watch: bool) -> None:
    one_line_error(status("--control-socket", str(tmp_path / "nope.sock"),
                          *(["--watch"] if watch else [])))


def test_stale_control_socket(ctl_dir: Path) -> None:
    path = ctl_dir / "stale.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as stale:
        stale.bind(str(path))  # the file exists, nobody listens
        one_line_error(status("--control-socket", str(path)))


@pytest.mark.parametrize("args", [
    [],
    ["--url", "http://127.0.0.1:1", "--control-socket", "/tmp/x.sock"],
    ["--watch"],
    ["--url", "http://127.0.0.1:1", "--interval", "0"],
    ["--url", "http://127.0.0.1:1", "--interval", "soon"],
], ids=["neither", "both", "watch-only", "interval-0", "interval-not-a-number"])
def test_usage_errors(args: list[str]) -> None:
    done = status(*args)
    assert done.returncode == 2, (done.stdout, done.stderr)
    assert done.stdout == ""
    assert done.stderr.strip(), "a usage error says why"
