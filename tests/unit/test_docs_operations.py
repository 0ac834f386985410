"""docs/operations.md names only flags forkserve has, and its gunicorn migration table is whole.

Every ``--flag`` in the guide must be an option of forkserve's parser (built from the settings
registry, plus --check, --print-config, --help and --version; not the hidden gunicorn-only
flags, which only say what to use instead) or of ``forkserve status``. The exceptions: the
first column of the migration table (``<!-- migration-table:start -->`` ... ``end``), which is
gunicorn's, a few other programs' flags the guide quotes, each allowed only in a paragraph that
names its program.

The migration table has a row for every gunicorn setting, in the group gunicorn's settings
reference puts it in (``GUNICORN_SETTINGS``, transcribed from gunicorn 27's reference; where
gunicorn is installed the test also reads its ``KNOWN_SETTINGS``, so an upgrade that adds one
fails here until the table has its row), and for every signal gunicorn's master and workers
handle.
"""

from __future__ import annotations

import argparse
import os
import re
from pathlib import Path

import pytest

from forkserve import cli, gunicorn_flags, statusview
from forkserve.config import ENV_PREFIX, SETTINGS, build_argparser

DOC = Path(__file__).resolve().parents[2] / "docs" / "operations.md"
FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9]*(?:[-_][a-z0-9]+)*")
SHORT = re.compile(r"(?<![\w-])-[a-zA-Z]{1,2}(?![\w-])")
MIGRATION = "## Migrating from gunicorn\n"  # the guide's last section
TABLE = re.compile(r"<!-- migration-table:start -->\n(.*?)<!-- migration-table:end -->", re.S)
CODE = re.compile(r"`([^`]+)`")
# Other programs' long flags the guide quotes: flag -> the program a paragraph using it names.
FOREIGN = {
    "--time": "docker",  # docker stop --time (also in --check's own output)
    "--stop-timeout": "docker",  # docker run --stop-timeout
    "--fdname": "systemd-socket-activate",
    "--pid": "unshare",
    "--fork": "unshare",
    "--mount-proc": "unshare",
}


# gunicorn's settings, by the group of its settings reference (gunicorn 27.0; its order).
GUNICORN_SETTINGS = {
    "Config File": [
        "config", "wsgi_app",
    ],
    "Server Socket": [
        "bind", "backlog",
    ],
    "Worker Processes": [
        "workers", "worker_class", "threads", "worker_connections", "max_requests",
        "max_requests_jitter", "timeout", "graceful_timeout", "keepalive", "asgi_loop",
        "asgi_lifespan", "asgi_disconnect_grace_period", "websocket_max_message_size",
        "http_parser",
    ],
    "Security": [
        "limit_request_line", "limit_request_fields", "limit_request_field_size",
    ],
    "Debugging": [
        "reload", "reload_engine", "reload_extra_files", "spew", "check_config", "print_config",
    ],
    "Server Mechanics": [
        "preload_app", "sendfile", "reuse_port", "chdir", "daemon", "raw_env", "pidfile",
        "worker_tmp_dir", "user", "group", "umask", "initgroups", "tmp_upload_dir",
        "secure_scheme_headers", "forwarded_allow_ips", "pythonpath", "paste", "proxy_protocol",
        "proxy_allow_ips", "protocol", "uwsgi_allow_ips", "raw_paste_global_conf",
        "permit_obsolete_folding", "strip_header_spaces", "permit_unconventional_http_method",
        "permit_unconventional_http_version", "casefold_http_method", "forwarder_headers",
        "header_map", "root_path",
    ],
    "Logging": [
        "accesslog", "disable_redirect_access_to_syslog", "access_log_format", "errorlog",
        "loglevel", "capture_output", "logger_class", "logconfig", "logconfig_dict",
        "logconfig_json", "syslog_addr", "syslog", "syslog_prefix", "syslog_facility",
        "enable_stdio_inheritance", "statsd_host", "dogstatsd_tags", "statsd_prefix",
        "enable_backlog_metric",
    ],
    "Process Naming": [
        "proc_name", "default_proc_name",
    ],
    "Server Hooks": [
        "on_starting", "on_reload", "when_ready", "pre_fork", "post_fork", "post_worker_init",
        "worker_int", "worker_abort", "pre_exec", "pre_request", "post_request", "child_exit",
        "worker_exit", "nworkers_changed", "on_exit", "ssl_context",
    ],
    "SSL": [
        "keyfile", "certfile", "ssl_version", "cert_reqs", "ca_certs", "suppress_ragged_eofs",
        "do_handshake_on_connect", "ciphers",
    ],
    "HTTP/2": [
        "http_protocols", "http2_cleartext", "http2_max_concurrent_streams",
        "http2_initial_window_size", "http2_max_frame_size", "http2_max_header_list_size",
    ],
    "Dirty Arbiters": [
        "dirty_apps", "dirty_workers", "dirty_timeout", "dirty_threads",
        "dirty_graceful_timeout",
    ],
    "Dirty Arbiter Hooks": [
        "on_dirty_starting", "dirty_post_fork", "dirty_worker_init", "dirty_worker_exit",
    ],
    "Control": [
        "control_socket", "control_socket_mode", "control_socket_disable",
    ],
}
# The signals gunicorn handles (its arbiter's SIGNALS; its workers' init_signals).
MASTER_SIGNALS = ["TERM", "INT", "QUIT", "HUP", "TTIN", "TTOU", "USR1", "USR2", "WINCH"]
WORKER_SIGNALS = ["TERM", "QUIT", "INT", "USR1", "ABRT", "WINCH"]
SIGNAL_GROUPS = {"Signals to the master": MASTER_SIGNALS, "Signals to a worker": WORKER_SIGNALS}
# gunicorn flags that forkserve's parser does not know (argparse's "unrecognized arguments",
# with a pointer to this guide): left to the branches whose area they are.
LEFT_UNRECOGNIZED = {"--disable-redirect-access-to-syslog"}


def forkserve_flags(capsys: pytest.CaptureFixture[str]) -> set[str]:
    parser = build_argparser("test")
    flags = {f for action in parser._actions if action.help != argparse.SUPPRESS
             for f in action.option_strings if f.startswith("--")}
    registry = {f for s in SETTINGS for f in (*s.flags, *s.aliases) if f.startswith("--")}
    assert registry <= flags, "the parser lost a setting's flag"
    assert statusview.main(["--help"]) == 0  # `forkserve status`: its parser lives in main()
    flags |= set(FLAG.findall(capsys.readouterr().out))
    return flags


def migration_rows(text: str) -> list[tuple[str, list[str]]]:
    """(group, [gunicorn, forkserve, notes]) for each row under a **group** row."""
    match = TABLE.search(text)
    assert match, "docs/operations.md lost its migration-table markers"
    lines = [line for line in match.group(1).splitlines() if line.strip()]
    rows = [[cell.strip() for cell in line.strip().strip("|").split("|")] for line in lines]
    assert rows[0] == ["gunicorn", "forkserve", "notes"], "the migration table's header changed"
    assert set("".join(rows[1])) <= set("-: "), "the migration table lost its separator row"
    out: list[tuple[str, list[str]]] = []
    group = None
    for row in rows[2:]:
        assert len(row) == 3, f"a migration row without exactly 3 cells (a | in a cell?): {row}"
        heading = re.fullmatch(r"\*\*(.+)\*\*", row[0])
        if heading and not row[1] and not row[2]:
            group = heading.group(1)
            continue
        assert group is not None, f"a row before the first group: {row}"
        assert row[1], f"a row that says nothing of forkserve (write none, and why): {row}"
        out.append((group, row))
    return out


def groups(text: str) -> list[str]:
    return list(dict.fromkeys(group for group, _ in migration_rows(text)))


def setting_names(cell: str) -> list[str]:
    """gunicorn's setting names in a first cell: the code spans that are lower-case names."""
    return [c for c in CODE.findall(cell) if re.fullmatch(r"[a-z][a-z0-9_]*", c)]


def text_without_gunicorn_column(text: str) -> str:
    """The guide, with the migration table's rows reduced to their forkserve and notes cells."""
    match = TABLE.search(text)
    assert match
    kept = "\n".join(" | ".join(row[1:]) for _, row in migration_rows(text))
    return text[:match.start(1)] + kept + "\n" + text[match.end(1):]


def test_every_flag_in_the_guide_exists(capsys: pytest.CaptureFixture[str]) -> None:
    known = forkserve_flags(capsys)
    text = text_without_gunicorn_column(DOC.read_text(encoding="utf-8"))
    # The migration notes may also name the gunicorn flags forkserve ignores or refuses (its
    # parser knows them, to say what to use instead), and only they.
    guide, migration = text.split(MIGRATION)
    gunicorn_only = {f for entry in gunicorn_flags.GUNICORN_ONLY for f in entry.flags}
    unknown = []
    for paragraph in [*re.split(r"\n\s*\n", guide),
                      *(MIGRATION + p for p in re.split(r"\n\s*\n", migration))]:
        for flag in FLAG.findall(paragraph):
            if flag in known or (flag in gunicorn_only and paragraph.startswith(MIGRATION)):
                continue
            program = FOREIGN.get(flag)
            if program is not None and program in paragraph:
                continue
            unknown.append(flag)
    assert not unknown, f"docs/operations.md names flags forkserve does not have: {sorted(set(unknown))}"


def test_the_migration_table_names_forkserve_flags_that_exist(
        capsys: pytest.CaptureFixture[str]) -> None:
    known = forkserve_flags(capsys)
    rows = migration_rows(DOC.read_text(encoding="utf-8"))
    assert len(rows) > 100
    named = {flag for _, row in rows for flag in FLAG.findall(row[1])}
    assert named and named <= known, sorted(named - known)
    shorts = {flag for _, row in rows for flag in SHORT.findall(row[1])}
    ours = {f for s in SETTINGS for f in (*s.flags, *s.aliases) if not f.startswith("--")}
    assert shorts and shorts <= ours, sorted(shorts - ours)


def test_every_gunicorn_setting_has_a_row_in_its_group() -> None:
    text = DOC.read_text(encoding="utf-8")
    assert groups(text) == [*GUNICORN_SETTINGS, *SIGNAL_GROUPS], "groups missing or out of order"
    rows = migration_rows(text)
    named = [(group, name) for group, row in rows if group in GUNICORN_SETTINGS
             for name in setting_names(row[0])]
    everything = {name for names in GUNICORN_SETTINGS.values() for name in names}
    unknown = sorted({name for _, name in named} - everything)
    assert not unknown, f"the table names gunicorn settings that do not exist: {unknown}"
    twice = sorted({name for _, name in named if [n for _, n in named].count(name) > 1})
    assert not twice, f"settings with more than one row: {twice}"
    for group, names in GUNICORN_SETTINGS.items():
        here = [name for g, name in named if g == group]
        missing = [name for name in names if name not in here]
        assert not missing, f"gunicorn's {group} settings without a row: {missing}"
        assert here == names, f"{group}: not in gunicorn's order"


def test_every_gunicorn_signal_has_a_row() -> None:
    rows = migration_rows(DOC.read_text(encoding="utf-8"))
    for group, signals in SIGNAL_GROUPS.items():
        named = [c for g, row in rows if g == group for c in CODE.findall(row[0])]
        assert sorted(named) == sorted(signals), (group, named)


def test_the_table_follows_the_installed_gunicorn() -> None:
    """Where gunicorn is installed (the benchmarks compare with it): its settings are the ones
    transcribed, and each row's gunicorn flags are exactly those of the settings it names."""
    gunicorn_config = pytest.importorskip("gunicorn.config")
    theirs: dict[str, list[str]] = {}
    for setting in gunicorn_config.KNOWN_SETTINGS:
        theirs.setdefault(setting.section, []).append(setting.name)
    assert theirs == GUNICORN_SETTINGS, "gunicorn's settings changed: update GUNICORN_SETTINGS " \
                                        "and docs/operations.md's migration table"
    cli_of = {s.name: list(s.cli or ()) for s in gunicorn_config.KNOWN_SETTINGS}
    for group, row in migration_rows(DOC.read_text(encoding="utf-8")):
        if group not in GUNICORN_SETTINGS:
            continue
        flags = [c for c in CODE.findall(row[0]) if c.startswith("-")]
        expected = [f for name in setting_names(row[0]) for f in cli_of[name]]
        assert flags == expected, f"{row[0]}: gunicorn's flags for it are {expected}"


def test_every_gunicorn_flag_gets_an_answer() -> None:
    """A flag copied from a gunicorn command line is a forkserve setting, an alias, or a
    gunicorn-only flag that is ignored or refused with what to use instead: never argparse's
    bare "unrecognized arguments" (but for the LEFT_UNRECOGNIZED few)."""
    known = set(build_argparser("test")._option_string_actions)
    rows = migration_rows(DOC.read_text(encoding="utf-8"))
    theirs = {c for _, row in rows for c in CODE.findall(row[0]) if c.startswith("-")}
    unanswered = sorted(theirs - known - LEFT_UNRECOGNIZED)
    assert not unanswered, f"gunicorn flags forkserve's parser does not know: {unanswered}"


def test_the_quoted_shutdown_budget_is_what_check_prints(
        capfd: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """(capfd, not capsys: the error log writes to the real stderr descriptor.)"""
    for name in list(os.environ):
        if name.startswith(ENV_PREFIX):
            monkeypatch.delenv(name)
    assert cli.main(["--check", "examples.hello:app"]) == 0
    budget = [line for line in capfd.readouterr().out.splitlines()
              if line.startswith("forkserve: shutdown budget")]
    assert len(budget) == 1
    assert budget[0] in DOC.read_text(encoding="utf-8"), \
        "docs/operations.md quotes a --check budget line the code no longer prints"
