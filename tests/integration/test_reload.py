"""Zero-downtime reloads under load: 20 HUPs in a row, and USR2 in-place upgrades, on every
worker class, with clients that open a new connection per request and with keep-alive clients.

The app (``tests.apps.reload``) answers ``VERSION PID`` with the version read from a file at
import, so every response tells which code and which worker served it. The load
(``tests.load.Load``): with a fresh connection per request a refused or reset connection during a
reload is a failure; with keep-alive, a kept connection closed under a request (an empty reply,
a reset) is one too.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest

from tests.harness import worker_set, Server, get, open_fds, wait_for
from tests.load import Load

APP = "tests.apps.reload:app"
THREADS = 4
CLASS_ARGS = {"sync": (), "thread": ("-k", "thread", "--threads", "4"), "gevent": ("-k", "gevent")}
by_worker_class = pytest.mark.parametrize("worker_class", list(CLASS_ARGS))
by_clients = pytest.mark.parametrize("keepalive", [False, True], ids=["close", "keepalive"])


# -- helpers ------------------------------------------------------------------------------------

def start(server_factory: Any, version_file: Path, *args: str, workers: int = 2) -> Server:
    server = server_factory(*args, app=APP, workers=workers,
                            env={"RELOAD_VERSION_FILE": str(version_file)})
    return server.wait_ready()  # type: ignore[no-any-return]


def version_of(body: bytes) -> str:
    return body.split()[0].decode()


def pid_of(body: bytes) -> int:
    return int(body.split()[1])



def replaced(server: Server, old: set[int], count: int = 2, timeout: float = 15.0) -> set[int]:
    """Until the arbiter's children are ``count`` workers, none of them in ``old``."""
    return set(wait_for(lambda: (w := set(server.workers())) and len(w) == count and not w & old and w,
                        timeout, f"the old workers {old} to be replaced, have {server.workers()}"))


def errors(server: Server) -> list[dict[str, Any]]:
    return [r for r in server.records() if r.get("level") == "ERROR"]


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def check_versions(load: Load, expected: dict[int, str]) -> None:
    """Every response came from a known worker and carried that worker's code version."""
    wrong = [(pid_of(b), version_of(b), expected.get(pid_of(b))) for _, b in list(load.bodies)
             if expected.get(pid_of(b)) != version_of(b)]
    assert not wrong, f"{len(wrong)} responses with an unexpected (pid, version, expected): {wrong[:10]}"


def report(name: str, load: Load) -> None:
    print(f"\n[{name}] {load.summary()}")


# -- HUP ----------------------------------------------------------------------------------------

@by_worker_class
@by_clients
def test_twenty_hups_under_load(server_factory: Any, tmp_path: Path, worker_class: str,
                                keepalive: bool) -> None:
    version = tmp_path / "version"
    version.write_text("v0")
    server = start(server_factory, version, *CLASS_ARGS[worker_class])
    current = "v0"
    expected = {pid: current for pid in worker_set(server, 2)}
    load = Load(server.port, threads=THREADS, seconds=90, keepalive=keepalive).start()
    try:
        load.wait_requests(20)
        for n in range(1, 21):
            old = worker_set(server, 2)
            if n % 4:  # every fourth reload changes nothing in the code
                current = f"v{n}"
                version.write_text(current)
            mark = time.monotonic()
            server.signal(signal.SIGHUP)
            wait_for(lambda: server.count_log("Reload complete") >= n, 15,
                     lambda: f"reload {n} to complete\n{server.log_text()}")
            new = replaced(server, old)
            expected.update((pid, current) for pid in new)
            body = load.wait_body(lambda b: pid_of(b) in new, mark, 10,
                                  f"a response from the new workers {new} after reload {n}")
            assert version_of(body) == current
    finally:
        load.stop()
    report(f"HUP x20 {worker_class}", load)
    assert load.failures == [], f"{load.summary()}: {load.failures[:20]}"
    check_versions(load, expected)
    assert server.count_log("Reload complete") == 20
    assert server.count_log("Reload failed") == 0
    assert errors(server) == [], server.log_text()
    server.signal(signal.SIGTERM)
    assert server.wait_exit(10) == 0


# -- USR2 ---------------------------------------------------------------------------------------

@by_worker_class
@by_clients
def test_usr2_upgrades_in_place_under_load(server_factory: Any, tmp_path: Path, worker_class: str,
                                           keepalive: bool) -> None:
    version = tmp_path / "version"
    version.write_text("v1")
    server = start(server_factory, version, *CLASS_ARGS[worker_class])
    first = server.wait_log("Starting forkserve")
    expected = {pid: "v1" for pid in worker_set(server, 2)}
    fd_counts = []
    load = Load(server.port, threads=THREADS, seconds=60, keepalive=keepalive).start()
    try:
        load.wait_requests(20)
        for n, new_version in enumerate(["v2", "v3"], 1):
            old = worker_set(server, 2)
            version.write_text(new_version)
            mark = time.monotonic()
            server.signal(signal.SIGUSR2)
            wait_for(lambda: server.count_log("Upgrade complete") >= n, 20,
                     lambda: f"upgrade {n} to complete\n{server.log_text()}")
            assert server.proc.poll() is None, "the arbiter's process exited: not an in-place upgrade"
            assert server.count_log("Upgrade: re-executing") == n
            starts = [r for r in server.records() if "Starting forkserve" in r.get("message", "")]
            assert len(starts) == n + 1, server.log_text()
            assert starts[-1]["listening"] == first["listening"], "the upgrade changed the listeners"
            new = replaced(server, old)
            assert not any(alive(pid) for pid in old), "an old worker outlived the upgrade"
            expected.update((pid, new_version) for pid in new)
            body = load.wait_body(lambda b: pid_of(b) in new, mark, 10,
                                  f"a response from the new image's workers {new}")
            assert version_of(body) == new_version
            fd_counts.append(len(open_fds(server.pid)))
    finally:
        load.stop()
    report(f"USR2 x2 {worker_class}", load)
    assert load.failures == [], f"{load.summary()}: {load.failures[:20]}"
    check_versions(load, expected)
    # The same process, and nothing leaked across exec: the second upgrade ends where the first did.
    assert fd_counts[0] == fd_counts[1], (fd_counts, open_fds(server.pid))
    assert errors(server) == [], server.log_text()
    server.signal(signal.SIGTERM)
    assert server.wait_exit(10) == 0
    server.wait_log("Server stopped", timeout=5)


def test_usr2_with_a_broken_app_keeps_serving(server_factory: Any, tmp_path: Path) -> None:
    version = tmp_path / "version"
    version.write_text("v1")
    server = start(server_factory, version)
    old = worker_set(server, 2)
    load = Load(server.port, threads=2, seconds=30).start()
    try:
        load.wait_requests(10)
        version.write_text("broken")
        server.signal(signal.SIGUSR2)
        record = server.wait_log("Upgrade aborted, still serving", timeout=15)
        assert record["level"] == "ERROR"
        assert "broken deploy on purpose" in json.dumps(record), record
        load.wait_requests(20)
        assert worker_set(server, 2) == old
    finally:
        load.stop()
    report("USR2 aborted", load)
    assert load.failures == [], f"{load.summary()}: {load.failures[:20]}"
    check_versions(load, {pid: "v1" for pid in old})
    assert server.proc.poll() is None
    assert server.count_log("Upgrade: re-executing") == 0
    assert server.count_log("Starting forkserve") == 1
    assert len(errors(server)) == 1, server.log_text()
    # The deploy is fixed: the next USR2 goes through.
    version.write_text("v2")
    server.signal(signal.SIGUSR2)
    server.wait_log("Upgrade complete", timeout=20)
    new = replaced(server, old)
    body = get(server.port, "/").body
    assert version_of(body) == "v2" and pid_of(body) in new
    assert os.getpgid(server.pid) == server.pid  # still the process (group) we started
