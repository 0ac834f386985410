"""What the distribution says of itself: typed (PEP 561's marker shipped), classified, with its
URLs and the optional extras the README names (issue 15's packaging polish)."""

from __future__ import annotations

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))


def test_the_pep_561_marker_exists_and_is_packaged() -> None:
    assert (ROOT / "forkserve" / "py.typed").is_file()
    assert "py.typed" in PROJECT["tool"]["setuptools"]["package-data"]["forkserve"]


def test_classifiers_say_what_it_is() -> None:
    classifiers = set(PROJECT["project"]["classifiers"])
    assert {"Typing :: Typed", "Topic :: Internet :: WWW/HTTP :: WSGI :: Server",
            "Operating System :: POSIX :: Linux"} <= classifiers
    # Every Python the project claims to support is classified, and none it does not.
    versions = {c.rsplit(" ", 1)[1] for c in classifiers
                if c.startswith("Programming Language :: Python :: 3.")}
    oldest = PROJECT["project"]["requires-python"].removeprefix(">=")
    assert min(versions, key=lambda v: tuple(map(int, v.split(".")))) == oldest


def test_project_urls_and_the_extras_the_readme_names() -> None:
    assert {"Homepage", "Documentation", "Source", "Issues"} <= set(PROJECT["project"]["urls"])
    extras = PROJECT["project"]["optional-dependencies"]
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    for extra in ("gevent", "reload", "otel"):
        assert extra in extras
        assert f"forkserve[{extra}]" in readme, extra
