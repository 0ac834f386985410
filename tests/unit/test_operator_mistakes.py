"""Operator mistakes and broken disks, without forking: an app that exits while it is
imported, log files that cannot be opened (told before forking, opened as the workers open
them), control sockets that cannot be bound, and sinks whose writes fail (dropped, counted,
told at a bounded rate, told again on recovery)."""

from __future__ import annotations

import errno
import os
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Iterator

import pytest

from forkserve import loader
from forkserve.arbiter.workers import WorkerHandle
from forkserve.control import ControlError, ControlServer
from forkserve.counters import ExitCode
from forkserve.loader import AppLoadError, load_app, os_exit_reported
from forkserve.logs import APPEND_FLAGS, FILE_MODE, Log, open_error, probe_append
from forkserve.reactor import Reactor
from forkserve.telemetry import losses
from forkserve.telemetry.accesslog import AccessLog
from forkserve.telemetry.losses import LostLines
from forkserve.telemetry.spans import SpanLog


# -- an application that exits while it is imported ---------------------------------------------

@pytest.fixture
def app_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A directory on sys.path for throwaway app modules (removed from sys.modules after)."""
    monkeypatch.syspath_prepend(str(tmp_path))
    before = set(sys.modules)
    yield tmp_path
    for name in set(sys.modules) - before:
        del sys.modules[name]


@pytest.mark.parametrize("call, shown", [
    ('sys.exit("FATAL: DATABASE_URL is not set")',
     "called sys.exit(...) while being imported: FATAL: DATABASE_URL is not set"),
    ('sys.exit("first line\\n  second line")',
     "called sys.exit(...) while being imported: first line second line"),
    ("sys.exit(3)", "called sys.exit(3) while being imported"),
    ("sys.exit()", "called sys.exit() while being imported"),
    ("raise SystemExit(0)", "called sys.exit(0) while being imported"),
])
def test_sys_exit_at_import_is_an_app_load_error_in_one_line(app_dir: Path, call: str,
                                                             shown: str) -> None:
    (app_dir / "exiting_app.py").write_text(f"import sys\n{call}\n")
    with pytest.raises(AppLoadError) as caught:
        load_app("exiting_app:app")
    text = str(caught.value)
    assert text.startswith("the application " + shown), text
    assert "\n" not in text and text.endswith("exiting_app.py:2)"), text


def test_a_long_exit_message_is_cut(app_dir: Path) -> None:
    (app_dir / "long_exit.py").write_text(f"import sys\nsys.exit({'x' * 5000!r})\n")
    with pytest.raises(AppLoadError) as caught:
        load_app("long_exit:app")
    assert len(str(caught.value)) < loader.MAX_EXIT_TEXT + 200


def test_sys_exit_in_a_factory(app_dir: Path) -> None:
    (app_dir / "exiting_factory.py").write_text(
        "import sys\ndef make():\n    sys.exit('no config')\n")
    with pytest.raises(AppLoadError, match=r"called sys.exit\(\.\.\.\) in the factory "
                                            r"'exiting_factory:make\(\)': no config"):
        load_app("exiting_factory:make()")


def test_the_loaders_exit_code_is_the_app_load_error_code() -> None:
    assert loader.APP_LOAD_EXIT == ExitCode.APP_LOAD_ERROR


class Exited(BaseException):
    def __init__(self, code: int) -> None:
        self.code = code


def test_os_exit_while_loading_is_reported_then_exits_4(monkeypatch: pytest.MonkeyPatch) -> None:
    def fake_exit(code: int) -> None:  # stands for the real os._exit (a unit test never exits)
        raise Exited(code)

    monkeypatch.setattr(os, "_exit", fake_exit)
    told: list[str] = []
    with pytest.raises(Exited) as caught:
        with os_exit_reported(told.append):
            os._exit(7)
    assert caught.value.code == ExitCode.APP_LOAD_ERROR
    assert told == ["the application called os._exit(7) while being imported"]
    assert os._exit is fake_exit  # restored: an os._exit after loading is the app's own again


def test_os_exit_guard_is_removed_after_an_import_error(monkeypatch: pytest.MonkeyPatch) -> None:
    real = os._exit
    with pytest.raises(AppLoadError):
        with os_exit_reported(lambda text: None):
            load_app("no_such_module_anywhere:app")
    assert os._exit is real


# -- the arbiter's account of a worker that never booted ------------------------------------------

def exited(code: int) -> int:
    return code << 8  # a wait status: exited with ``code``


def test_a_worker_gone_while_importing_without_a_record_is_named() -> None:
    reason, code = WorkerHandle(1, 1, pid=9).boot_failure(exited(7))
    assert reason == "a worker exited with code 7 while importing the application (os._exit?)"
    assert code == ExitCode.APP_LOAD_ERROR


def test_the_workers_own_boot_crash_code_is_not_taken_for_an_os_exit() -> None:
    reason, code = WorkerHandle(1, 1, pid=9).boot_failure(exited(ExitCode.WORKER_BOOT_ERROR))
    assert reason.startswith("a worker crashed while booting") and code == ExitCode.WORKER_BOOT_ERROR


def test_with_preload_an_early_exit_is_a_worker_boot_error() -> None:
    # The worker imports nothing: the app was loaded before forking.
    reason, code = WorkerHandle(1, 1, pid=9, imports_app=False).boot_failure(exited(7))
    assert reason == "a worker exited with code 7 while booting"
    assert code == ExitCode.WORKER_BOOT_ERROR


def test_a_boot_timeout_is_not_taken_for_an_os_exit() -> None:
    # A worker killed at the boot timeout exits 1 (HardStop) with the kill reason set.
    reason, code = WorkerHandle(1, 1, pid=9, kill_reason="a timeout (5s without a boot)"
                                ).boot_failure(exited(1))
    assert reason == "a timeout (5s without a boot)" and code == ExitCode.WORKER_BOOT_ERROR


def test_a_boot_error_record_still_wins() -> None:
    handle = WorkerHandle(1, 1, pid=9, boot_error="the application called sys.exit() ...")
    assert handle.boot_failure(exited(4)) == ("the application called sys.exit() ...",
                                              ExitCode.APP_LOAD_ERROR)


# -- log files: checked before forking, opened as the workers open them --------------------------

def test_probe_creates_as_a_worker_would_and_keeps_or_removes(tmp_path: Path) -> None:
    kept, removed = tmp_path / "kept.log", tmp_path / "removed.log"
    probe_append(str(kept))
    assert kept.exists() and kept.stat().st_size == 0
    probe_append(str(removed), keep=False)  # --check leaves nothing behind
    assert not removed.exists()


def test_probe_leaves_an_existing_file_alone(tmp_path: Path) -> None:
    path = tmp_path / "access.log"
    path.write_text("earlier line\n")
    probe_append(str(path), keep=False)
    assert path.read_text() == "earlier line\n"


def test_probe_follows_a_symlink_like_the_workers_open(tmp_path: Path) -> None:
    link = tmp_path / "access.log"
    link.symlink_to("/dev/full")
    probe_append(str(link), keep=False)
    assert link.is_symlink()


@pytest.mark.parametrize("make, code, hint", [
    (lambda d: str(d / "missing" / "access.log"), errno.ENOENT, "(no directory "),
    (lambda d: str(d), errno.EISDIR, "(give the path of a file in it)"),
    (lambda d: str(d / "file" / "access.log"), errno.ENOTDIR, "Not a directory"),
])
def test_probe_refuses_what_a_worker_could_not_open(tmp_path: Path, make: Any, code: int,
                                                    hint: str) -> None:
    (tmp_path / "file").write_text("")
    path = make(tmp_path)
    with pytest.raises(OSError) as caught:
        probe_append(path)
    assert caught.value.errno == code
    text = open_error(path, caught.value)
    assert hint in text and "\n" not in text


def test_every_log_file_is_opened_with_the_same_flags(tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """The arbiter's check opens as the workers' sinks open: neither refuses what they could
    open nor opens what they could not."""
    calls: list[tuple[int, int]] = []
    real_open = os.open

    def recording_open(path: Any, flags: int, mode: int = 0o777, **kw: Any) -> int:
        calls.append((flags & ~os.O_EXCL, mode))
        return real_open(path, flags, mode, **kw)

    monkeypatch.setattr(os, "open", recording_open)
    probe_append(str(tmp_path / "a"))
    AccessLog(str(tmp_path / "b")).close()
    SpanLog(str(tmp_path / "c")).close()
    os.close(Log(str(tmp_path / "d")).fd)
    assert calls and set(calls) == {(APPEND_FLAGS, FILE_MODE)}, calls


# -- the control socket ------------------------------------------------------------------------

@pytest.fixture
def short_dir() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="fs-", dir="/tmp") as path:
        yield Path(path)


@pytest.mark.parametrize("path, why", [
    ("{d}/missing/ctl", "No such file or directory"),
    ("{d}", "exists and is not a socket"),
    ("{d}/" + "x" * 120, "AF_UNIX path too long"),
])
def test_a_control_socket_that_cannot_be_bound_is_one_line(short_dir: Path, path: str,
                                                           why: str) -> None:
    target = path.format(d=short_dir)
    with pytest.raises(ControlError) as caught:
        ControlServer(target, lambda name, arg: ({}, []), Reactor())
    text = str(caught.value)
    assert text.startswith("cannot bind the control socket ") and why in text, text
    assert "\n" not in text


# -- sinks whose writes fail --------------------------------------------------------------------

class Collect:
    def __init__(self) -> None:
        self.lines: list[tuple[str, dict[str, Any]]] = []

    def error(self, message: str, **fields: Any) -> None:
        self.lines.append((message, fields))


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    now = [1000.0]
    monkeypatch.setattr(losses, "time", SimpleNamespace(monotonic=lambda: now[0]))
    return now


def test_lost_lines_first_at_once_then_once_per_interval_then_on_recovery(clock: list[float]) -> None:
    told = Collect()
    lost = LostLines("access log /x", told, interval=10.0)
    full = OSError(errno.ENOSPC, "No space left on device")
    lost.failed(3, full)
    assert len(told.lines) == 1
    assert told.lines[0][1] == {"lost_lines": 3, "lost_total": 3, "error": "No space left on device"}
    for _ in range(100):  # a busy worker fails on every flush: nothing more this interval
        clock[0] += 0.05
        lost.failed(1, full)
    assert len(told.lines) == 1
    clock[0] += 6.0
    lost.failed(2, full)
    assert len(told.lines) == 2
    assert told.lines[1][1]["lost_lines"] == 102 and told.lines[1][1]["lost_total"] == 105
    assert "access log /x" in told.lines[1][0]
    lost.failed(1, full)  # inside the new interval: counted, not told
    lost.succeeded()
    assert len(told.lines) == 3
    assert "written again" in told.lines[2][0] and told.lines[2][1] == {"lost_total": 106}
    lost.succeeded()  # once only
    lost.failed(1, full)  # a new outage is told at once
    assert len(told.lines) == 4 and told.lines[3][1]["lost_total"] == 1


def test_access_log_on_a_full_disk_serves_on_and_reports_once() -> None:
    told = Collect()
    log = AccessLog("/dev/full", "combined", told)
    for n in range(50):
        log.request("127.0.0.1", "GET", f"/{n}", "HTTP/1.1", 200, 5, None, None, 1.0, 0.001, "id")
        log.flush()  # must not raise
    log.close()
    assert len(told.lines) == 1 and "Cannot write the access log /dev/full" in told.lines[0][0]


def test_access_log_recovery_after_reopen(tmp_path: Path) -> None:
    """The operator frees the disk (here: the path now names a real file) and sends USR1."""
    told = Collect()
    path = tmp_path / "access.log"
    path.symlink_to("/dev/full")
    log = AccessLog(str(path), "combined", told)
    for n in range(3):
        log.request("127.0.0.1", "GET", f"/{n}", "HTTP/1.1", 200, 5, None, None, 1.0, 0.001, "id")
        log.flush()
    path.unlink()
    log.reopen()
    log.request("127.0.0.1", "GET", "/ok", "HTTP/1.1", 200, 5, None, None, 1.0, 0.001, "id")
    log.close()
    assert [fields.get("lost_total") for _, fields in told.lines] == [1, 3]
    assert "written again; 3 line(s) were lost" in told.lines[-1][0]
    assert "/ok" in path.read_text()


def test_span_log_on_a_full_disk_drops_and_reports() -> None:
    told = Collect()
    log = SpanLog("/dev/full", told)
    log.emit({"name": "a"})
    log.flush()  # raised OSError out of the request before
    log.emit({"name": "b"})
    log.close()
    assert len(told.lines) == 1 and "span log /dev/full" in told.lines[0][0]


def test_span_log_tells_its_recovery(tmp_path: Path) -> None:
    told = Collect()
    path = tmp_path / "spans.log"
    path.symlink_to("/dev/full")
    log = SpanLog(str(path), told)
    log.emit({"name": "lost"})
    log.flush()
    path.unlink()
    log.reopen()
    log.emit({"name": "kept"})
    log.close()
    assert "written again; 1 line(s) were lost" in told.lines[-1][0]
    assert '"kept"' in path.read_text()


def test_the_default_report_is_one_stderr_line(capfd: pytest.CaptureFixture[str]) -> None:
    log = AccessLog("/dev/full")
    log.emit("x\n")
    log.close()
    err = capfd.readouterr().err
    assert err.count("\n") == 1 and err.startswith("forkserve: Cannot write the access log")


def test_error_log_on_a_full_disk_counts_and_tells_on_recovery(tmp_path: Path) -> None:
    path = tmp_path / "error.log"
    path.symlink_to("/dev/full")
    log = Log(str(path), "info", "json")
    for n in range(5):
        log.info("lost", n=n)  # must not raise (and has nowhere to tell)
    assert log.lost == 5
    path.unlink()
    log.reopen()  # USR1 after the disk was freed: the count is told at once
    log.info("kept")
    lines = path.read_text().splitlines()
    assert len(lines) == 2, lines
    assert '"lost_lines":5' in lines[0] and "could not be written (No space left on device)" in lines[0]
    assert '"kept"' in lines[1] and log.lost == 0
    os.close(log.fd)


def test_error_log_tells_its_losses_at_the_next_good_write(tmp_path: Path) -> None:
    path = tmp_path / "error.log"
    log = Log(str(path), "info", "text")
    good = log.fd
    log.fd = os.open("/dev/full", os.O_WRONLY)
    log.info("lost")
    os.close(log.fd)
    log.fd = good
    log.info("kept")
    lines = path.read_text().splitlines()
    assert "kept" in lines[0] and "1 line(s) lost" in lines[1], lines
    os.close(good)
