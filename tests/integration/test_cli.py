"""The command line: real ``python -m forkserve`` (and ``forkserve``) processes, exit codes and
the one-line error contract."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any, Iterator

import pytest

from tests.harness import ROOT, process_group, wait_for
from tests.integration.test_lifecycle import get

USAGE = 2
APP_LOAD_ERROR = 4
VENV_BIN = Path(sys.executable).parent
CONSOLE_SCRIPT = VENV_BIN / "forkserve"


def env() -> dict[str, str]:
    full = {k: v for k, v in os.environ.items() if not k.startswith("FORKSERVE_")}
    full["PYTHONPATH"] = str(ROOT) + os.pathsep + full.get("PYTHONPATH", "")
    return full


def forkserve(*args: str, cwd: Path = ROOT, command: list[str] | None = None,
              extra_env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """Run a forkserve command that is expected to exit by itself."""
    argv = (command or [sys.executable, "-m", "forkserve"]) + list(args)
    run_env = env()
    run_env.update(extra_env or {})
    return subprocess.run(argv, cwd=str(cwd), env=run_env, stdin=subprocess.DEVNULL,
                          capture_output=True, text=True, timeout=20)


def one_line(text: str) -> str:
    lines = text.splitlines()
    assert len(lines) == 1, f"expected exactly one line, got {lines!r}"
    return lines[0]


@pytest.fixture
def busy_port() -> Iterator[int]:
    """A port held by a listening socket of ours: nobody else can bind it."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock.getsockname()[1]


# -- information ----------------------------------------------------------------------------------

def test_version() -> None:
    import forkserve as package

    result = forkserve("--version")
    assert result.returncode == 0
    assert result.stdout.strip() == f"forkserve {package.__version__}"


def test_help_lists_the_options() -> None:
    result = forkserve("--help")
    assert result.returncode == 0
    assert result.stdout.startswith("usage: forkserve")
    for option in ("--workers", "--bind", "--timeout", "--drain-timeout", "--graceful-timeout",
                   "--max-requests", "--pidfile", "--config", "--check", "MODULE:APP"):
        assert option in result.stdout, option
    assert result.stderr == ""


# -- --check -------------------------------------------------------------------------------------

def test_check_good_app_binds_nothing(busy_port: int) -> None:
    # The address is taken: if --check tried to bind it, it would fail.
    result = forkserve("--check", "-w", "3", "-b", f"127.0.0.1:{busy_port}", "tests.apps.basic:app")
    assert result.returncode == 0, result.stderr
    summary, proxies, budget = result.stdout.splitlines()
    assert "tests.apps.basic:app" in summary and "3" in summary and str(busy_port) in summary
    assert result.stderr == ""
    # Issue 12: whose proxy headers are believed, and for what.
    assert "believed from 127.0.0.1, ::1 and unix-socket peers" in proxies
    assert "REMOTE_ADDR is the peer's" in proxies
    # Issue 4: the shutdown budget and what it implies for the supervisors.
    assert "shutdown budget 27s" in budget
    assert "TimeoutStopSec=30" in budget and "terminationGracePeriodSeconds: 30" in budget
    assert "docker stop --time 30" in budget


def test_check_names_the_status_server_and_binds_nothing(busy_port: int) -> None:
    result = forkserve("--check", "--status-bind", f"127.0.0.1:{busy_port}", "tests.apps.basic:app")
    assert result.returncode == 0, result.stderr
    assert f"status server on 127.0.0.1:{busy_port}" in result.stdout.splitlines()[0]


def test_check_names_the_trusted_proxies() -> None:
    result = forkserve("--check", "--forwarded-allow-ips", "10.0.0.0/8", "--forwarded-for",
                       "tests.apps.basic:app")
    assert result.returncode == 0, result.stderr
    assert "believed from 10.0.0.0/8 and unix-socket peers; REMOTE_ADDR is the client's" in \
        result.stdout


def test_a_malformed_trusted_proxy_is_one_line_and_exit_2() -> None:
    result = forkserve("--forwarded-allow-ips", "10.0.0.0/33", "tests.apps.basic:app")
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "forkserve: error: --forwarded-allow-ips: expected IP addresses or CIDR networks (or *), "
        "got '10.0.0.0/33'"]


def test_check_budget_follows_the_settings() -> None:
    result = forkserve("--check", "--lameduck", "5", "--drain-timeout", "40", "--cancel-grace", "3",
                       "tests.apps.basic:app")
    assert result.returncode == 0, result.stderr
    assert "shutdown budget 48s" in result.stdout and "TimeoutStopSec=51" in result.stdout


@pytest.mark.parametrize("app, env_extra, expected", [
    ("tests.apps.basic:app", {"TESTAPP_FAIL_IMPORT": "1"}, "ImportError: failing on purpose"),
    ("tests.apps.basic:missing", {}, "missing"),
    ("no_such_module_here:app", {}, "No module named 'no_such_module_here'"),
    ("tests.apps.lifecycle:failing_factory()", {}, "ValueError: the factory refused on purpose"),
])
def test_check_broken_app_exits_4(app: str, env_extra: dict[str, str], expected: str) -> None:
    result = forkserve("--check", app, extra_env=env_extra)
    assert result.returncode == APP_LOAD_ERROR, result.stderr
    assert expected in one_line(result.stderr)
    assert result.stdout == ""


# -- usage errors: exit 2, one line ----------------------------------------------------------------

@pytest.mark.parametrize("args, expected", [
    (["--no-such-option", "tests.apps.basic:app"], "--no-such-option"),
    (["-w", "0", "tests.apps.basic:app"], "workers"),
    (["--workers", "many", "tests.apps.basic:app"], "many"),
    (["--timeout", "abc", "tests.apps.basic:app"], "abc"),
    (["-b", "host:notaport", "tests.apps.basic:app"], "notaport"),
    (["-b", "127.0.0.1:70000", "tests.apps.basic:app"], "70000"),
    (["--log-level", "loud", "tests.apps.basic:app"], "loud"),
    (["tests.apps.basic:app", "extra-argument"], "extra-argument"),
    (["not a module:app"], "MODULE:APP"),
    ([], "no application"),
])
def test_bad_usage_exits_2_with_one_line(args: list[str], expected: str) -> None:
    result = forkserve(*args)
    assert result.returncode == USAGE, (result.stdout, result.stderr)
    line = one_line(result.stderr)
    assert expected in line
    assert result.stdout == ""


def test_bad_environment_value_exits_2() -> None:
    result = forkserve("tests.apps.basic:app", extra_env={"FORKSERVE_WORKERS": "zero"})
    assert result.returncode == USAGE
    assert "FORKSERVE_WORKERS" in one_line(result.stderr)


def test_config_file_with_unknown_key_exits_2(tmp_path: Path) -> None:
    config = tmp_path / "forkserve.yaml"
    config.write_text("workers: 2\nwrokers: 3\n")
    result = forkserve("-c", str(config), "tests.apps.basic:app")
    assert result.returncode == USAGE
    line = one_line(result.stderr)
    assert "wrokers" in line and str(config) in line


def test_config_file_that_is_not_yaml_exits_2(tmp_path: Path) -> None:
    config = tmp_path / "forkserve.yaml"
    config.write_text("workers: [1, 2\n")
    result = forkserve("-c", str(config), "tests.apps.basic:app")
    assert result.returncode == USAGE
    assert str(config) in one_line(result.stderr)


def test_missing_config_file_exits_2(tmp_path: Path) -> None:
    result = forkserve("-c", str(tmp_path / "nope.yaml"), "tests.apps.basic:app")
    assert result.returncode == USAGE
    assert "nope.yaml" in one_line(result.stderr)


def test_port_in_use_exits_1_with_one_line(busy_port: int) -> None:
    result = forkserve("-w", "1", "-b", f"127.0.0.1:{busy_port}", "tests.apps.basic:app")
    assert result.returncode == 1
    line = one_line(result.stderr)
    assert f"127.0.0.1:{busy_port}" in line and "in use" in line


# -- the app spec ----------------------------------------------------------------------------------

@pytest.mark.parametrize("spec, body", [
    ("tests.apps.basic:factory()", b"hi"),
    ("tests.apps.basic:factory('x')", b"x"),
    ("tests.apps.basic:factory(greeting='with: colon')", b"with: colon"),
])
def test_factory_call_syntax(server_factory: Any, spec: str, body: bytes) -> None:
    server = server_factory(app=spec, workers=1).wait_ready()
    response = get(server.port, "/")
    assert response.status == 200 and response.body == body


def test_factory_arguments_must_be_literals() -> None:
    result = forkserve("--check", "tests.apps.basic:factory(__import__('os').getpid())")
    assert result.returncode == APP_LOAD_ERROR
    assert "literals" in one_line(result.stderr)


# -- the console script ----------------------------------------------------------------------------

def test_console_script_matches_python_m() -> None:
    assert CONSOLE_SCRIPT.exists(), f"no console script at {CONSOLE_SCRIPT}"
    for args in (["--version"], ["--help"], ["--check", "-w", "1", "tests.apps.basic:app"]):
        script = forkserve(*args, command=[str(CONSOLE_SCRIPT)])
        module = forkserve(*args)
        assert (script.returncode, script.stdout, script.stderr) == \
               (module.returncode, module.stdout, module.stderr), args
    bad = forkserve("-w", "0", "tests.apps.basic:app", command=[str(CONSOLE_SCRIPT)])
    assert bad.returncode == USAGE and "workers" in one_line(bad.stderr)


def test_console_script_serves(tmp_path: Path) -> None:
    """``forkserve`` run from the app's directory (no PYTHONPATH) serves and stops cleanly."""
    error_log = tmp_path / "error.log"
    run_env = {k: v for k, v in env().items() if k != "PYTHONPATH"}
    proc = subprocess.Popen(
        [str(CONSOLE_SCRIPT), "-b", "127.0.0.1:0", "-w", "1", "--log-format", "json",
         "--error-log", str(error_log), "tests.apps.basic:app"],
        cwd=str(ROOT), env=run_env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        def record(message: str) -> dict[str, Any] | None:
            if not error_log.exists():
                return None
            for line in error_log.read_text().splitlines():
                item = json.loads(line)
                if message in item["message"]:
                    return item  # type: ignore[no-any-return]
            return None

        started = wait_for(lambda: record("Starting forkserve"), 10, "the server to start")
        wait_for(lambda: record("Server ready"), 10, "the server to be ready")
        port = int(str(started["listening"]).rsplit(":", 1)[1])
        assert get(port, "/").body == b"hello\n"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(10) == 0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
        wait_for(lambda: not process_group(proc.pid), 5, "the process group to be gone")
