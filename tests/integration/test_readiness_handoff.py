"""Readiness through in-place upgrades and handoffs (issue 10): /readyz answers 200 on every
probe while something serves the port.

- USR2: between the old image's exec and the new image's status server, a status stand-in
  (a child the old image forks just before the exec) answers on the status listener;
- ``-sf --takeover``: the status listener travels with the listeners over the control socket;
  the successor answers on it only once its workers are booted, the predecessor stops
  answering on it at its TERM;
- ``-sf --reuse-port``: the successor joins the status port only once its workers are booted;
  the predecessor leaves it at its TERM (another instance listens there).

Real ``python -m forkserve`` process groups on 127.0.0.1 (port 0, then the same ports for the
successors), real signals, steady load (``tests.load.Load``: keep-alive clients and clients on a
new connection per request, together), and a prober thread sending /readyz on a fresh
connection per probe with a short timeout, for the whole run. Every wait is on a log line, a
process exit or a counter, and bounded. The HAProxy tests put a real HAProxy in front (as
bench/lifecycle.py does: backend keep-alive, ``option httpchk GET /readyz`` every 100 ms,
``fall 2``, no retry-on): not one 503 "No server is available" over the run.
"""

from __future__ import annotations

import shutil
import signal
import socket
from pathlib import Path
from typing import Any

import pytest

from tests.harness import Server, parse_head, wait_for, worker_set
from tests.load import Load, Prober, readyz

WORKER_CLASSES = ["sync", "thread", "gevent"]
PROBE_TIMEOUT = 1.0  # a probe that waits longer is a failed check (HAProxy's wait 100 ms)
TIMES = 3




class Loads:
    """Keep-alive clients and new-connection clients on one port, together."""

    def __init__(self, port: int) -> None:
        self.loads = [Load(port, threads=2, seconds=150, keepalive=True),
                      Load(port, threads=2, seconds=150)]

    def __enter__(self) -> "Loads":
        for load in self.loads:
            load.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        for load in self.loads:
            load.stop()

    def wait_requests(self, count: int) -> None:
        for load in self.loads:
            load.wait_requests(count, 20)

    @property
    def failures(self) -> list[str]:
        return [f for load in self.loads for f in load.failures]

    def summary(self) -> str:
        return "; ".join(load.summary() for load in self.loads)


def check(name: str, prober: Prober, loads: Loads) -> None:
    print(f"\n[{name}] {len(prober.answers)} probes {prober.states()}, "
          f"{len(prober.failures)} failed; load: {loads.summary()}")
    assert prober.failures == [], prober.failures[:10]
    assert prober.not_ready() == [], prober.not_ready()[:10]
    assert loads.failures == [], f"{loads.summary()}: {loads.failures[:20]}"


def start(server_factory: Any, worker_class: str, *args: str, bind: str = "127.0.0.1:0",
          status_bind: str = "127.0.0.1:0", app: str = "tests.apps.basic:app") -> Server:
    """The app first: a trailing ``-sf PID`` list in ``args`` cannot swallow it."""
    return server_factory(app, "-k", worker_class, "--status-bind", status_bind,
                          *args, app="", bind=bind)  # type: ignore[no-any-return]


# -- USR2 -----------------------------------------------------------------------------------------

def usr2s(server: Server, prober: Prober | None, loads: Loads,
          signum: signal.Signals = signal.SIGUSR2) -> None:
    """TIMES USR2 upgrades (or, with ``signum`` SIGHUP, reloads) under the loads."""
    done = "Upgrade complete" if signum == signal.SIGUSR2 else "Reload complete"
    for n in range(1, TIMES + 1):
        old = worker_set(server, 2, 20)
        server.signal(signum)
        wait_for(lambda: server.count_log(done) >= n, 40,
                 lambda: f"{signum.name} {n}\n{server.log_text()}")
        wait_for(lambda: not set(server.workers()) & old, 30, "the old workers to go")
        loads.wait_requests(20)
        if prober is not None:
            prober.wait_more(3)


@pytest.mark.parametrize("worker_class", WORKER_CLASSES)
def test_readyz_is_200_on_every_probe_through_usr2s(server_factory: Any,
                                                    worker_class: str) -> None:
    server = start(server_factory, worker_class).wait_ready()
    port = server.status_port
    with Prober(port, timeout=PROBE_TIMEOUT) as prober, Loads(server.port) as loads:
        loads.wait_requests(20)
        prober.wait_more(3)
        usr2s(server, prober, loads)
    check(f"USR2 x{TIMES}, {worker_class}", prober, loads)
    # Someone answered through each exec window: the stand-in, from the old image's view.
    assert prober.states().get("upgrading", 0) > 0, prober.states()
    wait_for(lambda: server.count_log("the status stand-in stopped") >= TIMES, 20,
             "the stand-ins to stop")
    stopped = [r for r in server.records() if "the status stand-in stopped" in r["message"]]
    assert [r["reason"] for r in stopped] == ["the new image's status server listens"] * TIMES
    assert server.count_log("Status server listening") == 1
    # It is gone (reaped: only the workers are children). (503 at a plain TERM:
    # test_arbiter_readiness holds a request to keep the drain open long enough to look.)
    wait_for(lambda: len(server.workers()) == 2, 10, "only the two workers as children")
    server.signal(signal.SIGTERM)
    assert server.wait_exit(20) == 0


def test_stand_in_answers_in_the_exec_window_and_leaves_no_orphan(server_factory: Any) -> None:
    """What the stand-in answers, and that it goes by itself: with the new image held before
    it can answer (its first status answer comes after its config is read, so a config file
    it cannot read fast does not help; instead: SIGSTOP the arbiter right after the exec and
    look at the stand-in alone), /readyz and /healthz are 200 "upgrading", /metrics the last
    exposition, anything else 503 with Retry-After; then SIGCONT, and the stand-in is stopped
    and reaped."""
    server = start(server_factory, "sync").wait_ready()
    port = server.status_port
    server.signal(signal.SIGUSR2)
    record = server.wait_log("Upgrade: a status stand-in answers", timeout=30)
    stand_in = record["pid"]
    server.wait_log("Upgrade: re-executing")
    server.signal(signal.SIGSTOP)  # the new image, stopped wherever its start-up is
    try:
        assert stand_in in server.workers()
        status, body = readyz(port, 5.0)
        assert (status, body) == (200, {"ready": True, "state": "upgrading", "generation": 1,
                                        "reloading": True})
        def fetch(path: str, accept: str = "*/*") -> tuple[int, dict[str, str], bytes]:
            with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
                sock.sendall(f"GET {path} HTTP/1.1\r\nHost: s\r\nAccept: {accept}\r\n\r\n".encode())
                data = b""
                while chunk := sock.recv(65536):
                    data += chunk
            return parse_head(data)
        # A scrape gets the last numbers (valid, a moment old), in the format it asks for.
        status, headers, body = fetch("/metrics")
        assert status == 200 and b"forkserve_state" in body, (status, body[:200])
        assert headers["content-type"].startswith("text/plain"), headers
        status, headers, body = fetch("/metrics", "application/openmetrics-text")
        assert status == 200 and body.rstrip().endswith(b"# EOF"), (status, body[-200:])
        status, headers, _ = fetch("/nothing-here")
        assert status == 503 and headers["retry-after"] == "1", headers
        # It holds the status listener and the log, never a main listener or the pipes.
        fds = {Path(f"/proc/{stand_in}/fd/{fd}").readlink().as_posix()
               for fd in map(str, range(3, 64)) if Path(f"/proc/{stand_in}/fd/{fd}").exists()}
        assert len([f for f in fds if f.startswith("socket:")]) == 1, fds
    finally:
        server.signal(signal.SIGCONT)
    server.wait_log("Upgrade complete", timeout=30)
    wait_for(lambda: stand_in not in server.workers(), 10, "the stand-in to be reaped")
    assert readyz(port, 5.0)[1]["state"] == "running"


# -- -sf --takeover and -sf --reuse-port ----------------------------------------------------------

def handoffs(server_factory: Any, first: Server, worker_class: str, prober: Prober | None,
             loads: Loads, ctl_dir: Path, how: str,
             app: str = "tests.apps.basic:app") -> list[Server]:
    """TIMES successive ``-sf`` handoffs on the same ports; returns every instance, in order."""
    chain = [first]
    for n in range(1, TIMES + 1):
        old = chain[-1]
        args = ["--reuse-port"] if how == "reuse-port" else \
            ["--takeover", str(ctl_dir / f"i{n - 1}.sock"), "--control-socket",
             str(ctl_dir / f"i{n}.sock")]
        new = start(server_factory, worker_class, *args, "-sf", str(old.pid), app=app,
                    bind=f"127.0.0.1:{first.port}", status_bind=f"127.0.0.1:{first.status_port}")
        chain.append(new)
        new.wait_ready(30)
        assert old.wait_exit(30) == 0, old.log_text()
        assert new.status_port == first.status_port
        loads.wait_requests(20)
        if prober is not None:
            prober.wait_more(3)
    return chain


@pytest.mark.parametrize("how", ["takeover", "reuse-port"])
@pytest.mark.parametrize("worker_class", WORKER_CLASSES)
def test_readyz_is_200_on_every_probe_through_sf_handoffs(server_factory: Any, ctl_dir: Path,
                                                          worker_class: str, how: str) -> None:
    args = ["--reuse-port"] if how == "reuse-port" else ["--control-socket",
                                                          str(ctl_dir / "i0.sock")]
    first = start(server_factory, worker_class, *args).wait_ready()
    with Prober(first.status_port, timeout=PROBE_TIMEOUT) as prober, Loads(first.port) as loads:
        loads.wait_requests(20)
        prober.wait_more(3)
        chain = handoffs(server_factory, first, worker_class, prober, loads, ctl_dir, how)
    check(f"-sf --{how} x{TIMES}, {worker_class}", prober, loads)
    last = chain[-1]
    for old in chain[:-1]:  # each left the port to its successor at its stop, answering no 503
        old.wait_log("Left the status port to the successor", timeout=5)
    # Every instance answered in its turn, the last one now; none answered while booting.
    assert prober.states().get("booting", 0) == 0, prober.states()
    assert readyz(last.status_port, 5.0) == (200, {"ready": True, "state": "running",
                                                   "generation": 1, "reloading": False})
    if how == "takeover":  # one listener all along: handed from instance to instance
        taken = [r for s in chain[1:] for r in s.records()
                 if "Took the status listener over" in r["message"]]
        assert len(taken) == TIMES, [s.log_text() for s in chain[1:]]
    last.signal(signal.SIGTERM)
    assert last.wait_exit(20) == 0


# -- behind a real HAProxy ------------------------------------------------------------------------

@pytest.mark.skipif(shutil.which("haproxy") is None, reason="haproxy is not installed")
@pytest.mark.parametrize("event", ["hup", "usr2", "takeover"])
@pytest.mark.parametrize("worker_class", WORKER_CLASSES)
def test_haproxy_never_runs_out_of_servers(server_factory: Any, ctl_dir: Path,
                                           worker_class: str, event: str) -> None:
    """HAProxy as bench/lifecycle.py runs it (backend keep-alive, /readyz on the status port
    every 100 ms, fall 2, no retry-on) in front of one instance: 3 HUPs, 3 USR2s or 3 ``-sf
    --takeover`` handoffs under keep-alive and new-connection load through it, and not one
    503 "No server is available" (nor any other failure)."""
    from bench.lifecycle_servers import Procs

    app = "bench.apps_lifecycle:hello"
    args = ["--control-socket", str(ctl_dir / "i0.sock")] if event == "takeover" else []
    first = start(server_factory, worker_class, *args, app=app).wait_ready()
    procs = Procs(ctl_dir)
    try:
        front = procs.haproxy(first.port, first.status_port)
        with Loads(front) as loads:
            loads.wait_requests(50)
            if event == "hup":
                usr2s(first, None, loads, signal.SIGHUP)
            elif event == "usr2":
                usr2s(first, None, loads)
            else:
                handoffs(server_factory, first, worker_class, None, loads, ctl_dir, "takeover",
                         app=app)
            loads.wait_requests(50)
    finally:
        notes = procs.close()
    print(f"\n[HAProxy, {event} x{TIMES}, {worker_class}] {loads.summary()} {notes}")
    no_server = [f for f in loads.failures if "No server is available" in f]
    assert no_server == [], f"{len(no_server)} x 503 No server is available; {loads.summary()}"
    assert loads.failures == [], f"{loads.summary()}: {loads.failures[:20]}"
