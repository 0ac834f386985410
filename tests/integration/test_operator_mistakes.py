"""Operator mistakes, with real ``python -m forkserve`` processes: each is one readable line and
the documented exit code, before anything is forked where it can be known then, and never a
traceback or a fork loop.

- an application that calls ``sys.exit(...)`` or ``os._exit(n)`` while it is imported: exit 4,
  with and without --preload, on every worker class, and from --check;
- an access, span or error log that cannot be opened (missing directory, a directory given as
  the file, no permission): exit 2 from --check and from a start, nothing forked;
- a bad --access-log-format: exit 2 from --check too;
- a status or control address that cannot be bound: exit 1.

"No permission" as root: the server runs without CAP_DAC_OVERRIDE (setpriv), as a non-root
operator would meet it.
"""

from __future__ import annotations

import os
import pwd
import shutil
import socket
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any, Iterator

import pytest

from tests.harness import Server, get
from tests.integration.test_cli import forkserve

WORKER_CLASSES = ["sync", "thread", "gevent"]
# --preload with gevent is refused (exit 2): the app would import before gevent patches.
BOOTS = [(k, False) for k in WORKER_CLASSES] + [("sync", True), ("thread", True)]
BOOT_IDS = [f"{k}-{'preload' if p else 'workers'}" for k, p in BOOTS]
USAGE, ERROR, APP_LOAD_ERROR = 2, 1, 4
SETPRIV = shutil.which("setpriv")
FORKSERVE = [sys.executable, "-m", "forkserve"]


def without(*caps: str) -> list[str]:
    """The forkserve command, run without these capabilities when we are root (a non-root
    user has none of them anyway)."""
    if os.geteuid() != 0:
        return FORKSERVE
    if SETPRIV is None:
        pytest.skip("root without setpriv: cannot take a permission away")
    dropped = ",".join(f"-{c}" for c in caps)
    return [SETPRIV, f"--inh-caps={dropped}", f"--bounding-set={dropped}", *FORKSERVE]


NO_DAC = ("dac_override", "dac_read_search")


def error_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.strip()]


def assert_exit_before_forking(result: subprocess.CompletedProcess[str], code: int,
                               *expected: str) -> str:
    """Exit ``code``, one line on stderr holding ``expected``, no traceback, no worker."""
    lines = error_lines(result.stderr)
    assert result.returncode == code, (result.returncode, result.stderr)
    assert len(lines) == 1, lines
    assert "Traceback" not in result.stderr and "Spawned worker" not in result.stderr
    for text in expected:
        assert text in lines[0], lines[0]
    return lines[0]


# -- an application that exits while it is imported -----------------------------------------------

def boot_and_exit(server: Server) -> tuple[int, list[dict[str, Any]]]:
    code = server.wait_exit(20)
    server.close()
    return code, server.records()


@pytest.mark.parametrize("worker_class, preload", BOOTS, ids=BOOT_IDS)
def test_sys_exit_at_import_is_one_line_and_exit_4(server_factory: Any, worker_class: str,
                                                   preload: bool) -> None:
    server = server_factory("-k", worker_class, *(["--preload"] if preload else []),
                            app="tests.apps.exit_at_import:app")
    code, records = boot_and_exit(server)
    assert code == APP_LOAD_ERROR, server.log_text()
    errors = [r["message"] for r in records if r["level"] == "ERROR"]
    assert len(errors) == 1, server.log_text()
    assert ("the application called sys.exit(...) while being imported: FATAL: DATABASE_URL "
            "is not set (tests/apps/exit_at_import.py:") in errors[0], errors[0]
    # Never a fork loop: the first generation failing to boot ends the server.
    assert server.count_log("Spawned worker") == (0 if preload else 2), server.log_text()
    assert "Traceback" not in server.log_text()


@pytest.mark.parametrize("worker_class, preload", BOOTS, ids=BOOT_IDS)
def test_os_exit_at_import_is_named_and_exit_4(server_factory: Any, worker_class: str,
                                               preload: bool) -> None:
    server = server_factory("-k", worker_class, *(["--preload"] if preload else []),
                            app="tests.apps.os_exit_at_import:app",
                            env={"FORKSERVE_TEST_EXIT_CODE": "7"})
    code, records = boot_and_exit(server)
    assert code == APP_LOAD_ERROR, server.log_text()
    errors = [r["message"] for r in records if r["level"] == "ERROR"]
    assert len(errors) == 1, server.log_text()
    expected = ("the application called os._exit(7) while being imported" if preload else
                "a worker exited with code 7 while importing the application (os._exit?)")
    assert expected in errors[0], errors[0]
    assert server.count_log("Spawned worker") == (0 if preload else 2), server.log_text()


@pytest.mark.parametrize("app, expected", [
    ("tests.apps.exit_at_import:app",
     "the application called sys.exit(...) while being imported: FATAL: DATABASE_URL is not set"),
    ("tests.apps.os_exit_at_import:app", "the application called os._exit(7) while being imported"),
])
def test_check_reports_an_exit_at_import(app: str, expected: str) -> None:
    result = forkserve("--check", app)
    assert_exit_before_forking(result, APP_LOAD_ERROR, "Application could not be loaded", expected)
    assert result.stdout == ""


# -- log files that cannot be opened -----------------------------------------------------------

LOG_FLAGS = ["--access-log", "--span-log", "--error-log"]


@pytest.fixture
def locked_dir(tmp_path: Path) -> Iterator[Path]:
    """A directory nobody but its owner's DAC override may create files in."""
    path = tmp_path / "locked"
    path.mkdir()
    path.chmod(0o500)
    yield path
    path.chmod(0o700)


@pytest.mark.parametrize("check", [True, False], ids=["check", "start"])
@pytest.mark.parametrize("flag", LOG_FLAGS)
@pytest.mark.parametrize("case", ["missing-directory", "directory", "no-permission"])
def test_a_log_that_cannot_be_opened_is_one_line_and_exit_2(tmp_path: Path, locked_dir: Path,
                                                             flag: str, case: str, check: bool) -> None:
    command = FORKSERVE
    if case == "missing-directory":
        path, why = str(tmp_path / "no-such-dir" / "x.log"), "No such file or directory"
    elif case == "directory":
        path, why = str(tmp_path), "Is a directory"
    else:
        path, why, command = str(locked_dir / "x.log"), "Permission denied", without(*NO_DAC)
    args = ["-b", "127.0.0.1:0", "-w", "2", *(["--check"] if check else []), flag, path,
            "tests.apps.basic:app"]
    result = forkserve(*args, command=command)
    line = assert_exit_before_forking(result, USAGE, f"error: {flag} {path}: {why}")
    assert line.startswith("forkserve: error:")
    assert result.stdout == ""
    assert not (tmp_path / "no-such-dir").exists()


@pytest.mark.parametrize("worker_class", WORKER_CLASSES)
def test_a_missing_access_log_directory_is_refused_before_forking(worker_class: str,
                                                                  tmp_path: Path) -> None:
    path = str(tmp_path / "missing" / "access.log")
    result = forkserve("-b", "127.0.0.1:0", "-k", worker_class, "--access-log", path,
                       "tests.apps.basic:app")
    assert_exit_before_forking(result, USAGE, f"--access-log {path}", "(no directory ")


def test_check_creates_no_log_file(tmp_path: Path) -> None:
    access, spans = tmp_path / "access.log", tmp_path / "spans.log"
    result = forkserve("--check", "--access-log", str(access), "--span-log", str(spans),
                       "tests.apps.basic:app")
    assert result.returncode == 0, result.stderr
    assert not access.exists() and not spans.exists()


@pytest.mark.skipif(os.geteuid() != 0, reason="--user needs root")
@pytest.mark.parametrize("worker_class", WORKER_CLASSES)
def test_with_user_a_root_only_log_directory_is_still_valid(server_factory: Any, tmp_path: Path,
                                                            worker_class: str) -> None:
    """The workers open their logs as root, before dropping privileges: the arbiter's check,
    root too, must not refuse a directory only root may write (/var/log/...)."""
    root_only = tmp_path / "root-only"
    root_only.mkdir(mode=0o700)
    access, spans = root_only / "access.log", root_only / "spans.log"
    nobody = pwd.getpwnam("nobody")
    server = server_factory("-k", worker_class, "--user", "nobody", "--group",
                            str(nobody.pw_gid), "--access-log", str(access),
                            "--span-log", str(spans), app="tests.apps.span_identity:app").wait_ready()
    response = get(server.port, "/")
    assert response.status == 200 and response.body == str(nobody.pw_uid).encode()
    server.signal(15)
    assert server.wait_exit() == 0
    assert "GET / " in access.read_text() and '"as-user"' in spans.read_text()
    for path in (access, spans):
        info = path.stat()
        assert info.st_uid == 0 and stat.S_IMODE(info.st_mode) == 0o644


# -- the access-log format --------------------------------------------------------------------

@pytest.mark.parametrize("template, named", [("{nope}", "nope"), ("{path", "{path"),
                                             ("{status:d} {method!z}", "method")])
def test_check_refuses_a_bad_access_log_format(tmp_path: Path, template: str, named: str) -> None:
    result = forkserve("--check", "--access-log", str(tmp_path / "a.log"),
                       "--access-log-format", template, "tests.apps.basic:app")
    assert_exit_before_forking(result, USAGE, "--access-log-format", named)


# -- status and control addresses that cannot be bound -------------------------------------------

@pytest.fixture
def busy_port() -> Iterator[int]:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock.getsockname()[1]


def start(*args: str, command: list[str] = FORKSERVE) -> subprocess.CompletedProcess[str]:
    return forkserve("-b", "127.0.0.1:0", "-w", "2", *args, "tests.apps.basic:app", command=command)


@pytest.mark.parametrize("case", ["in-use", "not-ours", "unknown-host", "no-permission"])
def test_a_status_address_that_cannot_be_bound_is_one_line_and_exit_1(busy_port: int,
                                                                      case: str) -> None:
    command = FORKSERVE
    if case == "in-use":
        address, why = f"127.0.0.1:{busy_port}", "Address already in use"
    elif case == "not-ours":
        address, why = "192.0.2.1:0", "Cannot assign requested address"  # TEST-NET-1
    elif case == "unknown-host":
        address, why = "no-such-host.invalid:0", "cannot bind the status server"
    else:
        # A privileged port without the capability to bind it (port 1 is nobody's service).
        address, why = "127.0.0.1:1", "Permission denied"
        command = without("net_bind_service")
    result = start("--status-bind", address, command=command)
    assert_exit_before_forking(result, ERROR, f"cannot bind the status server to {address}", why)


@pytest.mark.parametrize("case", ["missing-directory", "not-a-socket", "in-use",
                                  "no-permission", "too-long"])
def test_a_control_socket_that_cannot_be_bound_is_one_line_and_exit_1(ctl_dir: Path,
                                                                      case: str) -> None:
    command = FORKSERVE
    holder: socket.socket | None = None
    if case == "missing-directory":
        path, why = ctl_dir / "missing" / "ctl", "No such file or directory"
    elif case == "not-a-socket":
        path, why = ctl_dir / "file", "exists and is not a socket"
        path.write_text("")
    elif case == "in-use":
        path, why = ctl_dir / "ctl", "another process answers on it"
        holder = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        holder.bind(str(path))
        holder.listen()
    elif case == "no-permission":
        locked = ctl_dir / "locked"
        locked.mkdir(mode=0o500)
        path, why, command = locked / "ctl", "Permission denied", without(*NO_DAC)
    else:
        path, why = ctl_dir / ("x" * 120), "AF_UNIX path too long"
    try:
        result = start("--control-socket", str(path), command=command)
    finally:
        if holder is not None:
            holder.close()
    assert_exit_before_forking(result, ERROR, "cannot bind the control socket", why)
    if case == "in-use":
        assert path.exists()  # the other process's socket is left alone
