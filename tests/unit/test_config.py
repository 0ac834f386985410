"""forkserve.config: precedence defaults < YAML < environment < command line, with sources."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from forkserve.config import (BY_NAME, SETTINGS, ConfigError, build_argparser, parse_args,
                              reloadable_changes, resolve, unknown_env)

APP = "tests.apps.basic:app"


def cli(*argv: str) -> dict[str, Any]:
    values, check = parse_args(list(argv), "test")
    assert check is False
    return values


def yaml_file(tmp_path: Path, text: str) -> str:
    path = tmp_path / "forkserve.yaml"
    path.write_text(text)
    return str(path)


# -- precedence and provenance --------------------------------------------------------------------

def test_defaults() -> None:
    config = resolve(cli(APP), {})
    # The worker count's default is the machine's: derived, and saying from what.
    assert set(config.derived) == {"workers"} and config.derived["workers"].startswith("from ")
    for setting in SETTINGS:
        if setting.name != "app":
            if setting.name not in config.derived:
                assert config.values[setting.name] == setting.default, setting.name
            assert config.sources[setting.name] == "default", setting.name
    assert config.app == APP and config.sources["app"] == "cli"
    assert config.bind == ["127.0.0.1:8000"]
    assert config.worker_count >= 1


def test_precedence_defaults_yaml_env_cli(tmp_path: Path) -> None:
    path = yaml_file(tmp_path, "workers: 3\ntimeout: 10\nkeepalive: 7\nmax_requests: 100\n")
    environ = {"FORKSERVE_TIMEOUT": "20", "FORKSERVE_KEEPALIVE": "8"}
    config = resolve(cli("-c", path, "--timeout", "40", APP), environ)
    assert (config.workers, config.sources["workers"]) == (3, "file")
    assert (config.max_requests, config.sources["max_requests"]) == (100, "file")
    assert (config.keepalive, config.sources["keepalive"]) == (8.0, "env")
    assert (config.timeout, config.sources["timeout"]) == (40.0, "cli")
    assert (config.backlog, config.sources["backlog"]) == (2048, "default")
    assert (config.config, config.sources["config"]) == (path, "cli")


def test_env_beats_yaml_and_cli_beats_env_for_each_layer(tmp_path: Path) -> None:
    path = yaml_file(tmp_path, "workers: 3\n")
    assert resolve(cli("-c", path, APP), {}).workers == 3
    assert resolve(cli("-c", path, APP), {"FORKSERVE_WORKERS": "4"}).workers == 4
    assert resolve(cli("-c", path, "-w", "5", APP), {"FORKSERVE_WORKERS": "4"}).workers == 5


def test_config_path_from_the_environment(tmp_path: Path) -> None:
    path = yaml_file(tmp_path, "workers: 6\napp: tests.apps.basic:validated\n")
    config = resolve(cli(), {"FORKSERVE_CONFIG": path})
    assert config.workers == 6 and config.sources["workers"] == "file"
    assert config.app == "tests.apps.basic:validated" and config.sources["app"] == "file"
    assert config.sources["config"] == "env"


def test_cli_config_path_beats_the_environment(tmp_path: Path) -> None:
    cli_path = yaml_file(tmp_path, "workers: 2\n")
    env_path = tmp_path / "other.yaml"
    env_path.write_text("workers: 9\n")
    assert resolve(cli("-c", cli_path, APP), {"FORKSERVE_CONFIG": str(env_path)}).workers == 2


def test_yaml_keys_may_use_dashes(tmp_path: Path) -> None:
    path = yaml_file(tmp_path, "drain-timeout: 3\nmax-requests: 7\n")
    config = resolve(cli("-c", path, APP), {})
    assert config.drain_timeout == 3.0 and config.max_requests == 7


def test_empty_yaml_file_is_all_defaults(tmp_path: Path) -> None:
    config = resolve(cli("-c", yaml_file(tmp_path, ""), APP), {})
    assert config.sources["workers"] == "default"


# -- errors ----------------------------------------------------------------------------------------

def test_unknown_yaml_key_is_named(tmp_path: Path) -> None:
    path = yaml_file(tmp_path, "workers: 2\nwrokers: 3\n")
    with pytest.raises(ConfigError, match="wrokers"):
        resolve(cli("-c", path, APP), {})


def test_yaml_cannot_name_another_config_file(tmp_path: Path) -> None:
    path = yaml_file(tmp_path, "config: other.yaml\n")
    with pytest.raises(ConfigError, match="config"):
        resolve(cli("-c", path, APP), {})


@pytest.mark.parametrize("text", ["workers: [1, 2\n", "a: b: c\n", "\tworkers: 2\n"])
def test_bad_yaml(tmp_path: Path, text: str) -> None:
    path = yaml_file(tmp_path, text)
    with pytest.raises(ConfigError, match="not valid YAML"):
        resolve(cli("-c", path, APP), {})


@pytest.mark.parametrize("text", ["- workers\n- 2\n", "just a string\n", "42\n"])
def test_yaml_must_be_a_mapping(tmp_path: Path, text: str) -> None:
    with pytest.raises(ConfigError, match="mapping"):
        resolve(cli("-c", yaml_file(tmp_path, text), APP), {})


def test_missing_yaml_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read config file"):
        resolve(cli("-c", str(tmp_path / "missing.yaml"), APP), {})


@pytest.mark.parametrize("text, name", [
    ("workers: 0\n", "workers"),
    ("workers: two\n", "workers"),
    ("workers: true\n", "workers"),
    ("timeout: -1\n", "timeout"),
    ("preload: maybe\n", "preload"),
    ("bind: {a: 1}\n", "bind"),
    ("log_level: loud\n", "log_level"),
])
def test_bad_yaml_value_names_the_setting(tmp_path: Path, text: str, name: str) -> None:
    with pytest.raises(ConfigError, match=f"config file, {name}"):
        resolve(cli("-c", yaml_file(tmp_path, text), APP), {})


@pytest.mark.parametrize("variable, value", [
    ("FORKSERVE_WORKERS", "zero"),
    ("FORKSERVE_WORKERS", "0"),
    ("FORKSERVE_TIMEOUT", "soon"),
    ("FORKSERVE_TIMEOUT", "nan"),
    ("FORKSERVE_TIMEOUT", "inf"),
    ("FORKSERVE_DRAIN_TIMEOUT", "-inf"),
    ("FORKSERVE_PRELOAD", "perhaps"),
    ("FORKSERVE_BIND", "127.0.0.1:99999"),
    ("FORKSERVE_LOG_FORMAT", "xml"),
])
def test_bad_env_value_names_the_variable(variable: str, value: str) -> None:
    with pytest.raises(ConfigError, match=variable):
        resolve(cli(APP), {variable: value})


@pytest.mark.parametrize("argv, flag", [
    (["-w", "0"], "--workers"),
    (["--timeout", "abc"], "--timeout"),
    (["-b", "host:notaport"], "--bind"),
    (["--max-requests", "-1"], "--max-requests"),
    (["--timeout", "inf"], "--timeout"),
    (["--drain-timeout", "infinity"], "--drain-timeout"),
])
def test_bad_cli_value_names_the_option(argv: list[str], flag: str) -> None:
    with pytest.raises(ConfigError, match=flag):
        resolve(cli(*argv, APP), {})


def test_unknown_option_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="--frobnicate"):
        parse_args(["--frobnicate", APP], "test")


def test_no_app_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="no application"):
        resolve(cli(), {})


def test_unknown_env_variables_are_reported() -> None:
    environ = {"FORKSERVE_WORKERS": "2", "FORKSERVE_WROKERS": "3", "PATH": "/bin"}
    assert unknown_env(environ) == ["FORKSERVE_WROKERS"]


# -- particular settings ---------------------------------------------------------------------------

def test_env_bind_with_several_addresses() -> None:
    environ = {"FORKSERVE_BIND": "127.0.0.1:8001, [::1]:8002 unix:/tmp/fs.sock"}
    config = resolve(cli(APP), environ)
    assert config.bind == ["127.0.0.1:8001", "[::1]:8002", "unix:/tmp/fs.sock"]
    assert config.sources["bind"] == "env"


def test_cli_bind_is_repeatable_and_replaces_the_environment() -> None:
    config = resolve(cli("-b", "127.0.0.1:1", "-b", "127.0.0.1:2", APP),
                     {"FORKSERVE_BIND": "127.0.0.1:3"})
    assert config.bind == ["127.0.0.1:1", "127.0.0.1:2"] and config.sources["bind"] == "cli"


def test_yaml_bind_as_a_list_or_a_string(tmp_path: Path) -> None:
    path = yaml_file(tmp_path, "bind:\n  - 127.0.0.1:1\n  - unix:/tmp/x.sock\n")
    assert resolve(cli("-c", path, APP), {}).bind == ["127.0.0.1:1", "unix:/tmp/x.sock"]
    path = yaml_file(tmp_path, "bind: 127.0.0.1:5\n")
    assert resolve(cli("-c", path, APP), {}).bind == ["127.0.0.1:5"]


@pytest.mark.parametrize("given, expected", [
    ("127.0.0.1:0", "127.0.0.1:0"),
    (":8080", "0.0.0.0:8080"),
    ("localhost", "localhost:8000"),
    ("[::1]:8080", "[::1]:8080"),
    ("unix:/run/app.sock", "unix:/run/app.sock"),
    ("fd://3", "fd://3"),
])
def test_bind_forms(given: str, expected: str) -> None:
    assert resolve(cli("-b", given, APP), {}).bind == [expected]


@pytest.mark.parametrize("given", ["unix:", "fd://x", "[::1:80", "host:notaport", "host:-1"])
def test_bad_bind_forms(given: str) -> None:
    with pytest.raises(ConfigError, match="--bind"):
        resolve(cli("-b", given, APP), {})


def test_graceful_timeout_is_an_alias_of_drain_timeout() -> None:
    config = resolve(cli("--graceful-timeout", "7", APP), {})
    assert config.drain_timeout == 7.0 and config.sources["drain_timeout"] == "cli"
    assert "graceful_timeout" not in config.values
    # the last spelling given wins, whichever it is
    assert resolve(cli("--drain-timeout", "3", "--graceful-timeout", "4", APP), {}).drain_timeout == 4.0
    assert resolve(cli("--graceful-timeout", "4", "--drain-timeout", "3", APP), {}).drain_timeout == 3.0


def test_boolean_flag_and_env() -> None:
    assert resolve(cli("--preload", APP), {}).preload is True
    for text, value in [("1", True), ("yes", True), ("on", True), ("0", False), ("off", False)]:
        config = resolve(cli(APP), {"FORKSERVE_PRELOAD": text})
        assert config.preload is value and config.sources["preload"] == "env"


def test_check_flag_is_not_a_setting() -> None:
    values, check = parse_args(["--check", APP], "test")
    assert check is True and "check" not in values


def test_every_setting_has_an_option_and_env_name() -> None:
    parser_help = build_argparser("test").format_help()
    for setting in SETTINGS:
        assert setting.env == "FORKSERVE_" + setting.name.upper()
        if setting.secret:
            assert not setting.flags, setting.name  # never on the command line
        elif setting.name != "app":
            assert setting.flags and all(flag in parser_help for flag in setting.flags), setting.name


def test_reloadable_changes_lists_only_restart_settings() -> None:
    old = resolve(cli("-w", "2", "-b", "127.0.0.1:1", APP), {})
    new = resolve(cli("-w", "4", "-b", "127.0.0.1:2", APP), {})
    assert not BY_NAME["bind"].reloadable and BY_NAME["workers"].reloadable
    assert list(reloadable_changes(old, new)) == ["bind"]
