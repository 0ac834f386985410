"""docs/operations.md names only flags forkserve has.

Every ``--flag`` in the guide must be an option of forkserve's parser (built from the settings
registry, plus --check, --help and --version) or of ``forkserve status``. The exceptions: the
first column of the migration table (``<!-- migration-table:start -->`` ... ``end``), which is
gunicorn's, and a few other programs' flags the guide quotes, each allowed only in a paragraph
that names its program.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from forkserve import cli, statusview
from forkserve.config import ENV_PREFIX, SETTINGS, build_argparser

DOC = Path(__file__).resolve().parents[2] / "docs" / "operations.md"
FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9]*(?:[-_][a-z0-9]+)*")
TABLE = re.compile(r"<!-- migration-table:start -->\n(.*?)<!-- migration-table:end -->", re.S)
# Other programs' long flags the guide quotes: flag -> the program a paragraph using it names.
FOREIGN = {
    "--time": "docker",  # docker stop --time (also in --check's own output)
    "--stop-timeout": "docker",  # docker run --stop-timeout
    "--fdname": "systemd-socket-activate",
    "--pid": "unshare",
    "--fork": "unshare",
    "--mount-proc": "unshare",
}


def forkserve_flags(capsys: pytest.CaptureFixture[str]) -> set[str]:
    flags = {f for f in build_argparser("test")._option_string_actions if f.startswith("--")}
    registry = {f for s in SETTINGS for f in (*s.flags, *s.aliases) if f.startswith("--")}
    assert registry <= flags, "the parser lost a setting's flag"
    assert statusview.main(["--help"]) == 0  # `forkserve status`: its parser lives in main()
    flags |= set(FLAG.findall(capsys.readouterr().out))
    return flags


def migration_rows(text: str) -> list[list[str]]:
    match = TABLE.search(text)
    assert match, "docs/operations.md lost its migration-table markers"
    lines = [line for line in match.group(1).splitlines() if line.strip()]
    rows = [[cell.strip() for cell in line.strip().strip("|").split("|")] for line in lines]
    assert rows[0] == ["gunicorn", "forkserve", "notes"], "the migration table's header changed"
    assert set("".join(rows[1])) <= set("-: "), "the migration table lost its separator row"
    for row in rows[2:]:
        assert len(row) == 3, f"a migration row without exactly 3 cells (a | in a cell?): {row}"
    return rows[2:]


def text_without_gunicorn_column(text: str) -> str:
    """The guide, with the migration table's rows reduced to their forkserve and notes cells."""
    match = TABLE.search(text)
    assert match
    kept = "\n".join(" | ".join(row[1:]) for row in migration_rows(text))
    return text[:match.start(1)] + kept + "\n" + text[match.end(1):]


def test_every_flag_in_the_guide_exists(capsys: pytest.CaptureFixture[str]) -> None:
    known = forkserve_flags(capsys)
    text = text_without_gunicorn_column(DOC.read_text(encoding="utf-8"))
    unknown = []
    for paragraph in re.split(r"\n\s*\n", text):
        for flag in FLAG.findall(paragraph):
            if flag in known:
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
    assert len(rows) > 20
    named = {flag for row in rows for flag in FLAG.findall(row[1])}
    assert named and named <= known, sorted(named - known)


def test_the_gunicorn_column_names_gunicorn_flags() -> None:
    """Where gunicorn is installed (the benchmarks compare with it), its column is checked too."""
    gunicorn_config = pytest.importorskip("gunicorn.config")
    theirs = set(gunicorn_config.Config().parser()._option_string_actions)
    rows = migration_rows(DOC.read_text(encoding="utf-8"))
    named = {flag for row in rows for flag in FLAG.findall(row[0])}
    assert named and named <= theirs, sorted(named - theirs)


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
