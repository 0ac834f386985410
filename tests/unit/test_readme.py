"""The README documents what the code does: its settings table is the registry's."""

import re
from pathlib import Path

from forkserve.config import SETTINGS, build_argparser, settings_table

README = Path(__file__).resolve().parents[2] / "README.md"


def test_readme_settings_table_matches_registry():
    text = README.read_text(encoding="utf-8")
    match = re.search(r"<!-- settings-table:start -->\n(.*?)<!-- settings-table:end -->", text, re.S)
    assert match, "README lost its settings-table markers"
    assert match.group(1) == settings_table(), "README settings table is stale: python -m forkserve.config"


def test_help_lists_every_setting():
    help_text = build_argparser("test").format_help()
    for setting in SETTINGS:
        for flag in setting.flags:
            assert flag in help_text, f"{flag} missing from --help"


def test_readme_setup_commands_are_what_ci_runs():
    text = README.read_text(encoding="utf-8")
    ci = (README.parent / ".ci" / "run").read_text(encoding="utf-8")
    assert ".venv/bin/python -m pytest" in text
    assert ".venv/bin/python -m pytest" in ci
    assert "pip install -e '.[test]'" in text and "pip install -q -e '.[test]'" in ci
