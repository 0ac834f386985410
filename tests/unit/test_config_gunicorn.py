"""gunicorn's spellings (issue 15): its flags as aliases of forkserve's settings, its worker
class names, -n/-e/--pythonpath, GUNICORN_CMD_ARGS and its place in the precedence, Python
config files refused, gunicorn-only flags ignored or refused with what to use instead, and the
provenance --print-config shows."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

import pytest

from forkserve import gunicorn_flags
from forkserve.config import (BY_NAME, GUNICORN, NOTES, SETTINGS, ConfigError, build_argparser,
                              parse_args, provenance, resolve)
from forkserve.procenv import ProcessEnv

from tests.unit.test_config import APP, cli, yaml_file


# -- aliases ------------------------------------------------------------------------------------

@pytest.mark.parametrize("argv, name, value", [
    (["--keep-alive", "2"], "keepalive", 2.0),
    (["--access-logfile", "-"], "access_log", "-"),
    (["--error-logfile", "/tmp/e.log"], "error_log", "/tmp/e.log"),
    (["--log-file", "/tmp/e.log"], "error_log", "/tmp/e.log"),
    (["--access-logformat", "{remote_addr} {status}"], "access_log_format", "{remote_addr} {status}"),
    (["--limit-request-field_size", "4000"], "limit_request_field_size", 4000),
    (["-p", "/tmp/f.pid"], "pidfile", "/tmp/f.pid"),
    (["--pid", "/tmp/f.pid"], "pidfile", "/tmp/f.pid"),
    (["--graceful-timeout", "7"], "drain_timeout", 7.0),
    (["-n", "shop"], "proc_name", "shop"),
    (["--name", "shop"], "proc_name", "shop"),
    (["--cert-reqs", "2"], "cert_reqs", "required"),
    (["--cert-reqs", "1"], "cert_reqs", "optional"),
    (["--cert-reqs", "0"], "cert_reqs", "none"),
    (["--keep-alive=3"], "keepalive", 3.0),
])
def test_a_gunicorn_spelling_sets_the_forkserve_setting(argv: list[str], name: str,
                                                        value: Any) -> None:
    config = resolve(cli(*argv, APP), {})
    assert config.values[name] == value and config.sources[name] == "cli"
    assert config.app == APP


def test_check_config_is_check() -> None:
    assert parse_args(["--check-config", APP], "test")[1] is True


@pytest.mark.parametrize("spelling, ours", [
    ("gthread", "thread"), ("sync", "sync"), ("gevent", "gevent"), ("GThread", "thread"),
    ("gunicorn.workers.gthread.ThreadWorker", "thread"),
    ("gunicorn.workers.sync.SyncWorker", "sync"),
    ("gunicorn.workers.ggevent.GeventWorker", "gevent"),
    ("egg:gunicorn#gthread", "thread"),
    ("gevent_pywsgi", "gevent"),
])
def test_gunicorn_worker_class_names(spelling: str, ours: str) -> None:
    assert resolve(cli("-k", spelling, APP), {}).worker_class == ours


@pytest.mark.parametrize("spelling, offered", [
    ("eventlet", "-k gevent"),
    ("gunicorn.workers.geventlet.EventletWorker", "-k gevent"),
    ("tornado", "Tornado's own server"),
    ("uvicorn.workers.UvicornWorker", "uvicorn or hypercorn"),
    ("uvicorn_worker.UvicornWorker", "uvicorn or hypercorn"),
    ("asgi", "uvicorn or hypercorn"),
])
def test_worker_classes_forkserve_lacks_say_what_it_offers(spelling: str, offered: str) -> None:
    with pytest.raises(ConfigError) as exc:
        resolve(cli("-k", spelling, APP), {})
    message = str(exc.value)
    assert message.startswith("--worker-class: ") and offered in message
    assert "sync, thread (gunicorn's gthread) and gevent" in message and "\n" not in message


def test_an_unknown_worker_class_lists_the_choices() -> None:
    with pytest.raises(ConfigError, match="must be sync, thread or gevent"):
        resolve(cli("-k", "fancy", APP), {})


# -- -e/--env and --pythonpath ----------------------------------------------------------------------

def test_env_pairs_from_the_command_line() -> None:
    config = resolve(cli("-e", "FOO=bar", "--env", "URL=a=b,c", "-e", "EMPTY=", APP), {})
    assert config.env == {"FOO": "bar", "URL": "a=b,c", "EMPTY": ""}


@pytest.mark.parametrize("bad", ["FOO", "=bar", " FOO=bar", "FOO"])
def test_env_without_key_value_is_one_line(bad: str) -> None:
    with pytest.raises(ConfigError) as exc:
        resolve(cli("-e", bad, APP), {})
    assert str(exc.value) == f"--env: expected KEY=VALUE, got {bad!r}"


def test_env_from_yaml_mapping_list_and_the_environment(tmp_path: Path) -> None:
    path = yaml_file(tmp_path, "env:\n  FOO: bar\n  PORT_OF_APP: 8000\n")
    assert resolve(cli("-c", path, APP), {}).env == {"FOO": "bar", "PORT_OF_APP": "8000"}
    path = yaml_file(tmp_path, "env: [A=1, 'B=two words']\n")
    assert resolve(cli("-c", path, APP), {}).env == {"A": "1", "B": "two words"}
    # Split as a shell would, not at commas (a Django ALLOWED_HOSTS list is a value).
    config = resolve(cli(APP), {"FORKSERVE_ENV": "HOSTS=a.com,b.com 'GREETING=hello world'"})
    assert config.env == {"HOSTS": "a.com,b.com", "GREETING": "hello world"}
    assert config.sources["env"] == "env"


def test_pythonpath_is_a_comma_separated_list(tmp_path: Path) -> None:
    assert resolve(cli("--pythonpath", "lib, vendor,", APP), {}).pythonpath == ["lib", "vendor"]
    path = yaml_file(tmp_path, "pythonpath: [lib, /opt/x]\n")
    assert resolve(cli("-c", path, APP), {}).pythonpath == ["lib", "/opt/x"]


def test_process_settings_need_a_restart() -> None:
    for name in ("proc_name", "env", "pythonpath"):
        assert BY_NAME[name].reloadable is False, name


def unset(monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    """``name`` unset for the test, and unset again after it whatever the test set: a bare
    ``delenv(name, raising=False)`` of a variable that is not set records nothing to undo."""
    monkeypatch.setenv(name, "")
    monkeypatch.delenv(name)


def test_process_env_applies_and_undoes(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("FS_TEST_KEPT", "original")
    unset(monkeypatch, "FS_TEST_NEW")
    monkeypatch.setattr(sys, "path", ["/already", str(tmp_path / "b")])
    monkeypatch.chdir(tmp_path)
    env = ProcessEnv()
    env.apply({"FS_TEST_KEPT": "changed", "FS_TEST_NEW": "1"}, ["a", str(tmp_path / "b"), "a"])
    assert os.environ["FS_TEST_KEPT"] == "changed" and os.environ["FS_TEST_NEW"] == "1"
    # First, in the order given, relative to the current directory (--chdir), each once.
    # (the current directory, which the loader puts on the path, after them)
    assert sys.path == [str(tmp_path / "a"), str(tmp_path / "b"), str(tmp_path), "/already"]
    assert env.paths == [str(tmp_path / "a"), str(tmp_path / "b")]
    pristine = env.pristine()
    assert pristine["FS_TEST_KEPT"] == "original" and "FS_TEST_NEW" not in pristine
    assert pristine["PATH"] == os.environ["PATH"]  # the rest as it is
    assert os.environ["FS_TEST_KEPT"] == "changed", "pristine() changes nothing"


def test_a_forkserve_variable_set_with_env_is_not_a_setting_of_a_reload(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """HUP and USR2 resolve from the pristine environment: -e FORKSERVE_WORKERS=9 is for the
    app, as it was at the start."""
    unset(monkeypatch, "FORKSERVE_WORKERS")
    env = ProcessEnv()
    env.apply({"FORKSERVE_WORKERS": "9"}, [])
    assert resolve(cli("-w", "2", "-e", "FORKSERVE_WORKERS=9", APP), env.pristine()).workers == 2
    assert resolve(cli(APP), env.pristine()).sources["workers"] == "default"


# -- GUNICORN_CMD_ARGS ------------------------------------------------------------------------------

def test_gunicorn_cmd_args_sits_between_the_file_and_the_environment(tmp_path: Path) -> None:
    path = yaml_file(tmp_path, "workers: 3\ntimeout: 10\nkeepalive: 7\nmax_requests: 5\n")
    environ = {"GUNICORN_CMD_ARGS": "--workers=4 --timeout 11 --keep-alive 8 -n gname",
               "FORKSERVE_TIMEOUT": "12"}
    config = resolve(cli("-c", path, "--keep-alive", "9", APP), environ)
    assert (config.max_requests, config.sources["max_requests"]) == (5, "file")
    assert (config.workers, config.sources["workers"]) == (4, GUNICORN)
    assert config.origins["workers"] == "GUNICORN_CMD_ARGS"
    assert (config.proc_name, config.sources["proc_name"]) == ("gname", GUNICORN)
    assert (config.timeout, config.sources["timeout"]) == (12.0, "env")
    assert config.origins["timeout"] == "FORKSERVE_TIMEOUT"
    assert (config.keepalive, config.sources["keepalive"]) == (9.0, "cli")
    assert "keepalive" not in config.origins
    assert ("info", "read GUNICORN_CMD_ARGS: --workers=4 --timeout 11 --keep-alive 8 -n gname",
            {"precedence": "above the config file, below FORKSERVE_* variables and the "
                           "command line"}) in config.notes


def test_gunicorn_cmd_args_beats_gunicorns_own_forwarded_allow_ips() -> None:
    environ = {"GUNICORN_CMD_ARGS": "--forwarded-allow-ips 10.0.0.1",
               "FORWARDED_ALLOW_IPS": "10.9.9.9"}
    config = resolve(cli(APP), environ)
    assert config.forwarded_allow_ips == ["10.0.0.1"] and config.sources["forwarded_allow_ips"] == GUNICORN
    environ["FORKSERVE_FORWARDED_ALLOW_IPS"] = "10.1.1.1"
    assert resolve(cli(APP), environ).forwarded_allow_ips == ["10.1.1.1"]
    assert resolve(cli(APP), {"FORWARDED_ALLOW_IPS": "10.9.9.9"}).forwarded_allow_ips == ["10.9.9.9"]


def test_gunicorn_cmd_args_may_name_the_app_and_the_config(tmp_path: Path) -> None:
    path = yaml_file(tmp_path, "workers: 6\n")
    config = resolve(cli(), {"GUNICORN_CMD_ARGS": f"-c {path} {APP}"})
    assert config.app == APP and config.sources["app"] == GUNICORN
    assert (config.workers, config.sources["workers"]) == (6, "file")
    assert config.sources["config"] == GUNICORN
    assert resolve(cli("tests.apps.basic:validated"),
                   {"GUNICORN_CMD_ARGS": APP}).app == "tests.apps.basic:validated"


@pytest.mark.parametrize("text, expected", [
    ("--bogus 1", "GUNICORN_CMD_ARGS: unrecognized arguments: --bogus"),
    ("--statsd-host localhost:8125", "GUNICORN_CMD_ARGS: --statsd-host localhost:8125: "
                                     "gunicorn's statsd_host setting has no equivalent here"),
    ("--workers many", "GUNICORN_CMD_ARGS, --workers: expected a whole number"),
    ("--name 'unclosed", "GUNICORN_CMD_ARGS: cannot split"),
    ("--help", "GUNICORN_CMD_ARGS: --help is a command, not a setting"),
    ("--version", "GUNICORN_CMD_ARGS: --version is a command, not a setting"),
    ("--check-config", "GUNICORN_CMD_ARGS: --check-config is a command"),
    ("--print-config", "GUNICORN_CMD_ARGS: --print-config is a command"),
])
def test_a_bad_gunicorn_cmd_args_is_one_line_naming_it(text: str, expected: str) -> None:
    # (--help and --version must not exit from inside the parser: a HUP resolves this too)
    with pytest.raises(ConfigError) as exc:
        resolve(cli(APP), {"GUNICORN_CMD_ARGS": text})
    assert str(exc.value).startswith(expected), str(exc.value)
    assert "\n" not in str(exc.value)


def test_an_empty_gunicorn_cmd_args_is_nothing() -> None:
    config = resolve(cli(APP), {"GUNICORN_CMD_ARGS": "  "})
    assert not config.notes and GUNICORN not in config.sources.values()


# -- Python configuration files ---------------------------------------------------------------------

@pytest.mark.parametrize("given, hooks", [
    ("gunicorn.conf.py", "gunicorn.conf.py"), ("deploy/gunicorn_prod.py", "deploy/gunicorn_prod.py"),
    ("python:myproject.gunicorn_conf", "myproject.gunicorn_conf"), ("file:conf.py", "conf.py"),
])
def test_a_python_config_is_refused_with_what_to_do(given: str, hooks: str) -> None:
    advice = ("forkserve reads no Python configuration: put its settings in a YAML file "
              f"(-c forkserve.yaml) or in flags, and use its server hooks with --hooks {hooks}")
    for config_cli, environ, where in (
            (cli("-c", given, APP), {}, f"-c {given}"),
            (cli(APP), {"FORKSERVE_CONFIG": given}, f"FORKSERVE_CONFIG={given}"),
            (cli(APP), {"GUNICORN_CMD_ARGS": f"-c {given}"}, f"GUNICORN_CMD_ARGS, -c {given}")):
        with pytest.raises(ConfigError) as exc:
            resolve(config_cli, environ)
        assert str(exc.value) == f"{where}: {advice}"


# -- gunicorn-only flags --------------------------------------------------------------------------

def _argv(entry: gunicorn_flags.GunicornOnly, value: str = "x") -> list[str]:
    return [entry.flags[-1], *([value] if entry.takes_value else []), APP]


@pytest.mark.parametrize("entry", [e for e in gunicorn_flags.GUNICORN_ONLY if e.ignored],
                         ids=lambda e: e.flags[-1])
def test_an_ignored_gunicorn_flag_is_a_warning(entry: gunicorn_flags.GunicornOnly) -> None:
    config = resolve(cli(*_argv(entry)), {})
    assert config.app == APP, "the flag's value was taken, not the app"
    shown = entry.flags[-1] + (" x" if entry.takes_value else "")
    assert config.notes == [("warning", f"gunicorn's {shown} is ignored: {entry.hint}", {})]


@pytest.mark.parametrize("entry", [e for e in gunicorn_flags.GUNICORN_ONLY if not e.ignored],
                         ids=lambda e: e.flags[-1])
def test_a_refused_gunicorn_flag_says_what_to_use_instead(
        entry: gunicorn_flags.GunicornOnly) -> None:
    for flag in entry.flags:
        with pytest.raises(ConfigError) as exc:
            cli(flag, *(["x"] if entry.takes_value else []), APP)
        shown = flag + (" x" if entry.takes_value else "")
        assert str(exc.value) == (f"{shown}: gunicorn's {entry.setting} setting has no "
                                  f"equivalent here: {entry.hint}")
    for value in entry.same:  # what forkserve always does: a warning only
        assert resolve(cli(*_argv(entry, value)), {}).notes[0][0] == "warning"


def test_gunicorn_only_flags_are_not_forkserve_flags_and_are_hidden() -> None:
    ours = {f for s in SETTINGS for f in (*s.flags, *s.aliases)}
    theirs = [f for e in gunicorn_flags.GUNICORN_ONLY for f in e.flags]
    assert len(theirs) == len(set(theirs)) and not ours & set(theirs)
    actions = build_argparser("test")._option_string_actions
    assert all(actions[f].help == argparse.SUPPRESS for f in theirs), "listed in --help"
    assert "--worker-tmp-dir" not in build_argparser("test").format_help()


def test_the_notes_do_not_become_settings() -> None:
    values = cli("--worker-tmp-dir", "/dev/shm", APP)
    assert NOTES in values and NOTES not in BY_NAME
    assert "gunicorn_notes" not in resolve(values, {}).values


@pytest.mark.parametrize("argv, on", [
    (["--proxy-protocol", APP], True),
    (["--proxy-protocol", "v2", APP], True),
    (["--proxy-protocol", "V1", APP], True),
    (["--proxy-protocol=auto", APP], True),
    (["--proxy-protocol", "auto", APP], True),
    (["--proxy-protocol", "off", APP], False),
    ([APP, "--proxy-protocol"], True),
])
def test_gunicorns_proxy_protocol_modes(argv: list[str], on: bool) -> None:
    config = resolve(cli(*argv), {})
    assert config.app == APP and config.proxy_protocol is on
    versions = [n for n in config.notes if "accepts v1 and v2" in n[1]]
    assert bool(versions) == any(a.lower() in ("v1", "v2") for a in argv)


def test_a_bad_proxy_protocol_mode_is_one_line() -> None:
    with pytest.raises(ConfigError, match="--proxy-protocol: expected no value, or gunicorn's"):
        cli("--proxy-protocol=v3", APP)


def test_unknown_flags_point_to_the_migration_notes() -> None:
    with pytest.raises(ConfigError) as exc:
        cli("--no-such-flag", APP)
    assert str(exc.value) == ("unrecognized arguments: --no-such-flag; forkserve --help lists "
                              "the options (docs/operations.md, Migrating from gunicorn, maps "
                              "gunicorn's)")


# -- provenance (--print-config) -------------------------------------------------------------------

def test_provenance_names_every_source(tmp_path: Path) -> None:
    path = yaml_file(tmp_path, "max_requests: 5\numask: '027'\nkeyfile_password: hunter2\n")
    environ = {"GUNICORN_CMD_ARGS": "--max-requests-jitter 3", "FORKSERVE_TIMEOUT": "12",
               "FORWARDED_ALLOW_IPS": "10.0.0.0/8", "PORT": "9000"}
    config = resolve(cli("-c", path, "--threads", "3", "-e", "DATABASE_URL=postgres://u:pw@db",
                         APP), environ)
    rows = {row["setting"]: row for row in provenance(config)}
    assert [row["setting"] for row in provenance(config)] == [s.name for s in SETTINGS]
    assert rows["max_requests"] == {"setting": "max_requests", "value": 5, "source": "file",
                                    "from": path}
    assert rows["max_requests_jitter"] == {"setting": "max_requests_jitter", "value": 3,
                                           "source": GUNICORN, "from": "GUNICORN_CMD_ARGS"}
    assert rows["timeout"] == {"setting": "timeout", "value": 12.0, "source": "env",
                               "from": "FORKSERVE_TIMEOUT"}
    assert rows["forwarded_allow_ips"]["from"] == "FORWARDED_ALLOW_IPS"
    assert rows["threads"] == {"setting": "threads", "value": 3, "source": "cli"}
    assert rows["backlog"] == {"setting": "backlog", "value": 2048, "source": "default"}
    assert rows["bind"] == {"setting": "bind", "value": ["0.0.0.0:9000"], "source": "derived",
                            "reason": "from $PORT"}
    assert rows["worker_class"]["source"] == "derived"
    assert rows["worker_class"]["reason"] == "from --threads 3"
    assert rows["workers"]["source"] == "derived"
    # Secrets masked: the key's password, and every value of --env.
    assert rows["keyfile_password"]["value"] == "********"
    assert rows["env"]["value"] == {"DATABASE_URL": "***"}
    assert "hunter2" not in repr(rows) and "pw@db" not in repr(rows)
    assert rows["umask"]["value"] == "027"
