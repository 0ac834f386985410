"""A worker's graceful exit runs the application's cleanup (issue 15): its atexit handlers,
logging.shutdown() (a MemoryHandler's buffered lines reach their file), and the functions
given to forkserve.on_worker_exit, on every graceful path (max-requests recycle, HUP
replacement, TERM), on every worker class; within --cancel-grace (a stuck handler does not
hold the exit, and forkserve's own access log is written first); and a hard stop does not
pretend to run them. The app is tests.apps.cleanup: each step leaves a file per worker pid."""

from __future__ import annotations

import json
import signal
from pathlib import Path
from typing import Any

import pytest

from tests.harness import get, wait_for

CLASSES = ["sync", "thread", "gevent"]
APP = "tests.apps.cleanup:app"


def cleaned(directory: Path, pid: int, paths: list[str], timeout: float = 15.0) -> None:
    """Worker ``pid`` ran the app's whole cleanup: on_worker_exit, then atexit, and the
    logging shutdown that wrote out the buffered line of each request it served."""
    log = directory / f"log-{pid}"
    wait_for(lambda: (directory / f"atexit-{pid}").exists(), timeout,
             f"worker {pid}'s atexit handler to run; files: {sorted(p.name for p in directory.iterdir())}")
    assert (directory / f"on_worker_exit-{pid}").exists()
    # (The handler writes its file, then appends its name to the order file: waited for too.)
    order = directory / f"order-{pid}"
    wait_for(lambda: order.read_text().split() == ["on_worker_exit", "atexit"], timeout,
             lambda: f"worker {pid}'s cleanup order; the file has {order.read_text()!r}")
    # logging.shutdown() is an atexit handler too, registered before the app's and so run
    # after it: the buffered lines reach the file a moment after the atexit file appears
    # (read at once, a loaded machine showed it still empty).
    lines = [f"served {pid} {path}\n" for path in paths]
    wait_for(lambda: all(line in log.read_text() for line in lines), timeout,
             lambda: f"worker {pid}'s buffered log lines {lines}; the file has {log.read_text()!r}")


@pytest.mark.parametrize("worker_class", CLASSES)
def test_every_graceful_exit_runs_the_apps_cleanup(server_factory: Any, tmp_path: Path,
                                                   worker_class: str) -> None:
    server = server_factory("-k", worker_class, "--max-requests", "2", app=APP, workers=1,
                            env={"CLEANUP_DIR": str(tmp_path)}).wait_ready()
    # A max-requests recycle: the second request retires the worker.
    first = int(get(server.port, "/a").body)
    assert int(get(server.port, "/b").body) == first
    cleaned(tmp_path, first, ["/a", "/b"])
    server.wait_log(f"(pid {first}) retired")
    # A HUP replacement.
    second = int(get(server.port, "/c").body)
    assert second != first
    server.signal(signal.SIGHUP)
    server.wait_log("Reload complete")
    server.wait_log(f"(pid {second}) exited with code 0")
    cleaned(tmp_path, second, ["/c"])
    # The end of a TERM drain.
    third = int(get(server.port, "/d").body)
    assert third not in (first, second)
    server.signal(signal.SIGTERM)
    assert server.wait_exit(20) == 0
    cleaned(tmp_path, third, ["/d"])
    assert not [r for r in server.records() if r.get("level") == "ERROR"], server.log_text()


@pytest.mark.parametrize("worker_class", CLASSES)
def test_a_hard_stop_runs_no_cleanup_but_the_hooks_say_so(server_factory: Any, tmp_path: Path,
                                                           worker_class: str) -> None:
    hooks_log = tmp_path / "hooks.jsonl"
    server = server_factory("-k", worker_class, "--hooks", "tests.apps.hooks_record", app=APP,
                            workers=1, env={"CLEANUP_DIR": str(tmp_path),
                                            "HOOKS_LOG": str(hooks_log)}).wait_ready()
    pid = int(get(server.port, "/a").body)
    server.signal(signal.SIGQUIT)
    assert server.wait_exit(15) == 0
    # QUIT: the worker_int and worker_exit hooks ran in the worker, and nothing of the app's
    # graceful cleanup (its buffered log line stays unwritten: the exit was not graceful).
    calls = [json.loads(line) for line in hooks_log.read_text().splitlines()]
    mine = [c["hook"] for c in calls if c["pid"] == pid]
    assert mine[-2:] == ["worker_int", "worker_exit"], calls
    assert calls[-1]["hook"] == "on_exit"
    assert not (tmp_path / f"atexit-{pid}").exists()
    assert not (tmp_path / f"on_worker_exit-{pid}").exists()
    assert (tmp_path / f"log-{pid}").read_text() == ""


@pytest.mark.parametrize("worker_class", ["sync", "gevent"])
def test_a_stuck_atexit_handler_is_cut_at_the_cancel_grace(server_factory: Any, tmp_path: Path,
                                                           worker_class: str) -> None:
    # gevent too: the budget's alarm must end a handler waiting in the hub (a patched sleep).
    # The thread worker exits through the same code as sync, in its main thread.
    access = tmp_path / "access.log"
    server = server_factory("-k", worker_class, "--cancel-grace", "1", "--access-log",
                            str(access), app=APP, workers=1,
                            env={"CLEANUP_DIR": str(tmp_path), "CLEANUP_STUCK": "1"}).wait_ready()
    pid = int(get(server.port, "/a").body)
    server.signal(signal.SIGTERM)
    record = server.wait_log("exit-time cleanup still running after 1s", timeout=15)
    assert record["step"] == "atexit handlers"
    assert server.wait_exit(15) == 0
    # on_worker_exit ran (before the stuck handler), the stuck handler never finished, and
    # the access log had been written before any of it.
    assert (tmp_path / f"on_worker_exit-{pid}").exists()
    assert not (tmp_path / f"atexit-{pid}").exists()
    assert '"GET /a HTTP/1.1" 200' in access.read_text()
    assert server.wait_log(f"(pid {pid}) exited with code 0")
