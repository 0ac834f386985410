"""A gunicorn user's command line, environment and working directory, served by forkserve
(issue 15): the copied flags work, -n names the processes, -e and --pythonpath reach the app
before it is loaded, GUNICORN_CMD_ARGS is read with a note, a ./gunicorn.conf.py that is not
read is named, a Python -c is refused, and --print-config prints and exits without binding.

Parametrized over the worker classes wherever the worker runs the feature (the titles, the
environment, the path and the limits are the worker's); the start-up checks (warnings,
refusals, --print-config) happen before any worker exists and run once."""

from __future__ import annotations

import json
import re
import signal
import socket
from pathlib import Path
from typing import Any

import pytest
import requests

from tests.harness import Server, wait_for, worker_set

APP = "tests.apps.gunicorn_compat:app"
# gunicorn's names for forkserve's three workers.
KCLASSES = {"sync": "sync", "thread": "gthread", "gevent": "gevent"}


def _accepts_gunicorn_atoms() -> bool:
    """The access-log parser takes gunicorn's %(h)s atoms once helper B's work is merged
    (issue 15); until then the copied command line uses forkserve's own template."""
    from forkserve.config import BY_NAME
    try:
        BY_NAME["access_log_format"].parse('%(h)s "%(r)s" %(s)s')
    except ValueError:
        return False
    return True


if _accepts_gunicorn_atoms():
    ACCESS_FORMAT, ACCESS_LINE = '%(h)s "%(r)s" %(s)s', '127.0.0.1 "GET /seen HTTP/1.1" 200'
else:
    ACCESS_FORMAT, ACCESS_LINE = "{remote_addr} {method} {target} {status}", "127.0.0.1 GET /seen 200"


def cmdline(pid: int) -> str:
    with open(f"/proc/{pid}/cmdline", "rb") as fh:
        return fh.read().replace(b"\0", b" ").decode("utf-8", "replace").strip()


def extra_module(directory: Path, value: str) -> None:
    directory.mkdir(parents=True)
    (directory / "compat_extra.py").write_text(f"VALUE = {value!r}\n")


def seen(server: Server) -> dict[str, Any]:
    response = requests.get(server.url + "/seen", timeout=10)
    assert response.status_code == 200, response.text
    return response.json()  # type: ignore[no-any-return]


@pytest.mark.parametrize("worker_class", list(KCLASSES))
def test_a_gunicorn_command_line_serves(server_factory: Any, tmp_path: Path,
                                        worker_class: str) -> None:
    extra_module(tmp_path / "X", "from X")
    # As a gunicorn user has it (the harness adds -b 127.0.0.1:0 -w 2 --log-format json).
    server = server_factory(
        "--keep-alive", "2", "--access-logfile", "-", "--error-logfile", "-",
        "--access-logformat", ACCESS_FORMAT, "-k", KCLASSES[worker_class],
        "--limit-request-field_size", "8190", "-n", "myname", "-e", "FOO=bar",
        "--pythonpath", "X", app=APP, cwd=tmp_path).wait_ready()
    start = server.wait_log("Starting forkserve")
    assert start["worker_class"] == worker_class
    applied = server.wait_log("Set for the application")
    assert (applied["env"], applied["pythonpath"]) == ("FOO", str(tmp_path / "X"))

    view = seen(server)
    assert view["foo_at_import"] == "bar" and view["foo"] == "bar", view
    assert view["extra_at_import"] == "from X", "--pythonpath was not on sys.path at import"
    assert view["sys_path_head"][0] == str(tmp_path / "X")

    # The process titles carry the name (ps, top), the arbiter's and every worker's.
    assert cmdline(server.pid) == "forkserve: arbiter [myname]"
    workers = worker_set(server, 2)
    titles = {pid: cmdline(pid) for pid in workers}
    assert all(re.fullmatch(r"forkserve: worker \d+ \[myname\]", t) for t in titles.values()), titles

    # The access log, on stdout, in the given format.
    wait_for(lambda: any(ACCESS_LINE in line for line in server.stdout_lines), 10,
             lambda: f"{ACCESS_LINE!r} on stdout: {server.stdout_lines}")

    # --limit-request-field_size is forkserve's --limit-request-field-size.
    big = requests.get(server.url + "/seen", headers={"X-Big": "a" * 8190}, timeout=10)
    assert big.status_code == 431
    assert seen(server)["foo"] == "bar", "the server still serves"


def test_env_and_pythonpath_come_before_a_preloaded_app_relative_to_chdir(
        server_factory: Any, tmp_path: Path) -> None:
    site = tmp_path / "site"
    extra_module(site / "lib", "from site/lib")
    server = server_factory("--preload", "--chdir", "site", "--pythonpath", "lib",
                            "-e", "FOO=early", "-e", "FOO_TWO=a=b c", app=APP,
                            cwd=tmp_path).wait_ready()
    view = seen(server)
    # Imported once, in the arbiter, before forking: -e and --pythonpath were applied first.
    assert view["foo_at_import"] == "early" and view["extra_at_import"] == "from site/lib"
    assert view["env"]["FOO_TWO"] == "a=b c"
    assert view["sys_path_head"][0] == str(site / "lib"), "relative to --chdir, as gunicorn"


def test_gunicorn_cmd_args_is_read_with_a_note_below_the_command_line(
        server_factory: Any) -> None:
    text = "--workers 3 -n fromenv --keep-alive 1"
    server = server_factory(env={"GUNICORN_CMD_ARGS": text}, app=APP).wait_ready()
    note = server.wait_log("read GUNICORN_CMD_ARGS")
    assert note["message"] == f"read GUNICORN_CMD_ARGS: {text}" and note["level"] == "INFO"
    records = server.records()
    assert records.index(note) < next(i for i, r in enumerate(records)
                                      if "Starting forkserve" in r.get("message", ""))
    # The command line's -w 2 wins over its --workers 3; its -n applies.
    assert len(worker_set(server, 2)) == 2
    assert server.wait_log("Starting forkserve")["workers"] == 2
    assert cmdline(server.pid) == "forkserve: arbiter [fromenv]"


def test_a_flag_gunicorn_cmd_args_has_and_forkserve_lacks_is_one_line(
        server_factory: Any) -> None:
    server = server_factory(env={"GUNICORN_CMD_ARGS": "--workers 3 --statsd-host 127.0.0.1:8125"},
                            app=APP)
    assert server.wait_exit() == 2
    assert server.lines == [
        "forkserve: error: GUNICORN_CMD_ARGS: --statsd-host 127.0.0.1:8125: gunicorn's "
        "statsd_host setting has no equivalent here: forkserve has no StatsD client: its "
        "status server serves Prometheus metrics (--status-bind HOST:PORT, then /metrics)"]


def test_an_unread_gunicorn_conf_py_is_named(server_factory: Any, tmp_path: Path) -> None:
    conf = tmp_path / "gunicorn.conf.py"
    conf.write_text("workers = 5\n\ndef post_fork(server, worker):\n    pass\n")
    server = server_factory(app=APP, cwd=tmp_path).wait_ready()
    record = server.wait_log("gunicorn.conf.py is not read")
    assert record["level"] == "WARNING" and record["file"] == str(conf)
    assert record["message"] == (
        "gunicorn.conf.py is not read: forkserve reads no Python configuration: put its "
        "settings in a YAML file (-c forkserve.yaml) or in flags, and use its server hooks "
        "with --hooks gunicorn.conf.py")
    assert len(worker_set(server, 2)) == 2, "its workers = 5 is not applied"
    assert seen(server)["foo"] is None


def test_a_gunicorn_conf_py_in_chdir_is_named_too(server_factory: Any, tmp_path: Path) -> None:
    site = tmp_path / "site"
    site.mkdir()
    conf = site / "gunicorn.conf.py"
    conf.write_text("bind = '0.0.0.0:80'\n")
    server = server_factory("--chdir", "site", app=APP, cwd=tmp_path).wait_ready()
    record = server.wait_log("is not read")
    assert record["file"] == str(conf)
    assert record["message"].startswith("site/gunicorn.conf.py is not read: ")
    assert record["message"].endswith(f"--hooks {conf}"), "a path that holds from --chdir"
    assert server.count_log("is not read") == 1


def test_a_python_config_file_is_refused(server_factory: Any, tmp_path: Path) -> None:
    (tmp_path / "gunicorn.conf.py").write_text("workers = 5\n")
    server = server_factory("-c", "gunicorn.conf.py", app=APP, cwd=tmp_path)
    assert server.wait_exit() == 2
    assert server.lines == [
        "forkserve: error: -c gunicorn.conf.py: forkserve reads no Python configuration: put "
        "its settings in a YAML file (-c forkserve.yaml) or in flags, and use its server "
        "hooks with --hooks gunicorn.conf.py"]


def test_print_config_prints_every_source_and_exits_without_binding(
        server_factory: Any, tmp_path: Path) -> None:
    config = tmp_path / "forkserve.yaml"
    config.write_text("max_requests: 500\n")
    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen(1)
    port = holder.getsockname()[1]
    try:
        # The port is taken: a server that bound would exit 1.
        env = {"GUNICORN_CMD_ARGS": "--keep-alive 4", "FORKSERVE_TIMEOUT": "9",
               "FORKSERVE_KEYFILE_PASSWORD": "hunter2"}
        server = server_factory("--print-config", "-c", str(config), "-e", "FOO=secret-ish",
                                "--threads", "3", bind=f"127.0.0.1:{port}", json_logs=False,
                                env=env, app=APP)
        assert server.wait_exit() == 0, server.log_text()
        out = {line.split()[0]: line for line in server.stdout_lines}
        assert re.fullmatch(r"keepalive +4\.0 +GUNICORN_CMD_ARGS", out["keepalive"])
        assert re.fullmatch(r"timeout +9\.0 +env \(FORKSERVE_TIMEOUT\)", out["timeout"])
        assert re.fullmatch(rf"max_requests +500 +file \({re.escape(str(config))}\)",
                            out["max_requests"])
        assert re.fullmatch(rf"bind +127\.0\.0\.1:{port} +cli", out["bind"])
        assert re.fullmatch(r"worker_class +thread +derived \(from --threads 3\)",
                            out["worker_class"])
        assert re.fullmatch(r"backlog +2048 +default", out["backlog"])
        assert re.fullmatch(r"env +FOO=\*\*\* +cli", out["env"])
        assert re.fullmatch(r"keyfile_password +\*{8} +env \(FORKSERVE_KEYFILE_PASSWORD\)",
                            out["keyfile_password"])
        assert "hunter2" not in "\n".join(server.stdout_lines) + server.log_text()
        assert "secret-ish" not in "\n".join(server.stdout_lines)
        from forkserve.config import SETTINGS
        assert list(out) == [s.name for s in SETTINGS]
        assert "read GUNICORN_CMD_ARGS: --keep-alive 4" in server.log_text()
        assert "Starting forkserve" not in server.log_text()
    finally:
        holder.close()


def test_print_config_as_json_for_tools(server_factory: Any) -> None:
    server = server_factory("--print-config", "-n", "shop", env={"PORT": "9123"}, bind=None,
                            app=APP)
    assert server.wait_exit() == 0, server.log_text()
    assert len(server.stdout_lines) == 1
    rows = {row["setting"]: row for row in json.loads(server.stdout_lines[0])["settings"]}
    assert rows["proc_name"] == {"setting": "proc_name", "value": "shop", "source": "cli"}
    assert rows["bind"] == {"setting": "bind", "value": ["0.0.0.0:9123"], "source": "derived",
                            "reason": "from $PORT"}
    assert rows["workers"] == {"setting": "workers", "value": 2, "source": "cli"}


def test_env_is_applied_again_not_carried_over_by_hup_and_usr2(server_factory: Any) -> None:
    """-e FORKSERVE_...=X is for the app: not a setting at the start, nor after a HUP (which
    resolves its configuration from the environment of before -e) or an in-place upgrade
    (which re-executes with it, and applies -e again: neither doubled nor lost)."""
    server = server_factory("-e", "FOO=bar", "-e", "FORKSERVE_PROC_NAME=leaked",
                            "-e", "FORKSERVE_MAX_REQUESTS=1", app=APP,
                            env={"FOO": "from-the-shell"}).wait_ready()

    def check(workers: set[int]) -> None:
        assert cmdline(server.pid) == f"forkserve: arbiter [{APP}]"
        titles = {pid: cmdline(pid) for pid in workers}
        assert all(re.fullmatch(rf"forkserve: worker \d+ \[{re.escape(APP)}\]", t)
                   for t in titles.values()), titles
        views = [seen(server) for _ in range(6)]
        # (with max_requests 1 taken from -e, each would be a new worker's)
        assert {v["pid"] for v in views} <= workers, (views, workers)
        assert all(v["env"] == {"FOO": "bar", "FORKSERVE_PROC_NAME": "leaked",
                                "FORKSERVE_MAX_REQUESTS": "1"} for v in views), views

    first = worker_set(server, 2)
    check(first)
    server.signal(signal.SIGHUP)
    server.wait_log("Reload complete")
    reloaded = wait_for(lambda: (w := worker_set(server, 2)) and not w & first and w, 20,
                        "the new generation alone")
    check(reloaded)
    server.signal(signal.SIGUSR2)
    server.wait_log("Upgrade complete", timeout=30)
    upgraded = wait_for(lambda: (w := worker_set(server, 2)) and not w & reloaded and w, 20,
                        "the new image's workers alone")
    check(upgraded)
    assert server.count_log("Set for the application") == 2, "applied at each start, once"
    warned = [r for r in server.records() if r.get("message", "").startswith("-e FORKSERVE_")]
    assert sorted({r["variable"] for r in warned}) == ["FORKSERVE_MAX_REQUESTS",
                                                       "FORKSERVE_PROC_NAME"]
    assert warned[0]["message"] == ("-e FORKSERVE_PROC_NAME: set for the application only; "
                                    "forkserve's own settings were read before -e applies")
