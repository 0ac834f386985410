"""The dependency direction of STYLE.md section 2, read from the source with ast (nothing is
imported, so a module's import-time side effects cannot hide or fake an edge)."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent.parent / "forkserve"
STDLIB = sys.stdlib_module_names


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def imports(name: str) -> set[str]:
    """Every module ``name`` imports, anywhere in the file (lazy imports in functions too),
    with relative imports resolved. ``from pkg import sub`` yields ``pkg.sub`` when it is a
    module of ours, else ``pkg``."""
    path = MODULES[name]
    tree = ast.parse(path.read_text(), str(path))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - (node.level - 1)]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            for alias in node.names:
                candidate = f"{source}.{alias.name}"
                found.add(candidate if candidate in MODULES else source)
    return found


def ours(names: set[str]) -> set[str]:
    return {n for n in names if n == "forkserve" or n.startswith("forkserve.")}


def top(name: str) -> str:
    return name.partition(".")[0]


def test_the_walk_sees_the_package() -> None:
    # Guards the other tests against passing vacuously on an empty or mis-rooted walk.
    for name in ("forkserve.arbiter", "forkserve.config", "forkserve.lifecycle", "forkserve.http",
                 "forkserve.workers.base", "forkserve.workers.sync"):
        assert name in MODULES
    assert "forkserve.workers.base" in imports("forkserve.workers.sync")
    assert "forkserve.lifecycle" in imports("forkserve.arbiter")
    assert "yaml" in imports("forkserve.config")
    assert "forkserve.arbiter" in imports("forkserve.cli")  # a lazy import inside main()


@pytest.mark.parametrize("name", [n for n in MODULES if n.startswith("forkserve.workers")])
def test_workers_never_import_the_arbiter(name: str) -> None:
    assert not {i for i in imports(name) if i == "forkserve.arbiter" or i.startswith("forkserve.arbiter.")}


@pytest.mark.parametrize("name", [n for n in MODULES if n == "forkserve.http" or n.startswith("forkserve.http.")])
def test_http_imports_only_itself(name: str) -> None:
    foreign = {i for i in ours(imports(name)) if not i.startswith("forkserve.http")}
    assert not foreign, f"{name} imports {foreign}"
    assert "socket" not in imports(name)


def test_config_imports_only_stdlib_and_yaml() -> None:
    """STYLE's rule, with one part of ours that keeps it: forkserve.machine (the CPU quota
    the default worker count follows), which itself imports only the standard library."""
    found = imports("forkserve.config")
    leaves = {"forkserve.machine", "forkserve.gunicorn_flags"}
    assert ours(found) <= leaves, ours(found)
    assert {top(i) for i in found - leaves} - set(STDLIB) - {"__future__"} <= {"yaml"}
    for leaf in leaves:
        found = imports(leaf)
        assert not ours(found) and {top(i) for i in found} - set(STDLIB) - {"__future__"} == set()


def test_lifecycle_is_pure() -> None:
    found = imports("forkserve.lifecycle")
    assert not ours(found), ours(found)
    forbidden = {"os", "socket", "select", "signal", "subprocess", "time", "selectors"}
    assert not {top(i) for i in found} & forbidden


@pytest.mark.parametrize("name", ["forkserve.counters", "forkserve.signals", "forkserve.sockets",
                                  "forkserve.logs", "forkserve.loader", "forkserve.pidfile"])
def test_leaf_modules_import_only_the_standard_library(name: str) -> None:
    found = imports(name)
    assert {top(i) for i in found} - set(STDLIB) - {"__future__"} == set(), found


@pytest.mark.parametrize("name", sorted(n for n in MODULES if n not in ("forkserve.cli", "forkserve.__main__")))
def test_nothing_imports_the_cli(name: str) -> None:
    assert "forkserve.cli" not in imports(name)


def test_only_the_cli_imports_the_arbiter() -> None:
    """The arbiter package's modules import each other; from outside, only the cli does."""
    def arbiter(name: str) -> bool:
        return name == "forkserve.arbiter" or name.startswith("forkserve.arbiter.")

    importers = sorted(n for n in MODULES if not arbiter(n) and any(arbiter(i) for i in imports(n)))
    assert importers == ["forkserve.cli"]
    assert "forkserve.arbiter.workers" in imports("forkserve.arbiter")  # the walk sees them


@pytest.mark.parametrize("name", sorted(MODULES))
def test_gevent_is_imported_only_by_the_gevent_worker(name: str) -> None:
    if name != "forkserve.workers.gevent":
        assert "gevent" not in {top(i) for i in imports(name)}


@pytest.mark.parametrize("name", sorted(MODULES))
def test_watchfiles_is_imported_only_by_the_reloader(name: str) -> None:
    """The optional `reload` extra: one module imports it, and only when a watcher starts."""
    found = {top(i) for i in imports(name)}
    if name != "forkserve.reloader":
        assert "watchfiles" not in found
    else:
        assert found - set(STDLIB) - {"__future__"} == {"watchfiles"}
        tree = ast.parse(MODULES[name].read_text())
        assert not any(isinstance(n, ast.Import) and n.names[0].name == "watchfiles"
                       for n in tree.body), "imported at module level"


# -- the whole table, as data -------------------------------------------------------------------
# STYLE.md section 2 as the code has it: what each part of forkserve may import of forkserve
# (a part is the first name under forkserve: "arbiter" covers forkserve.arbiter.*). Its own
# modules are always allowed. Where the code grew a part STYLE does not name (handover,
# metrics, statusview...), it is listed here with its edges, so a new edge is a decision.
LEAVES = ("capture", "counters", "gunicorn_flags", "handover", "lifecycle", "loader", "logs", "machine",
          "pidfile", "procenv", "proxy", "reactor", "reloader", "signals", "sockets", "systemd",
          "tls")
ALLOWED: dict[str, set[str]] = {
    "__main__": {"cli"},
    "": {"background", "context", "exits", "telemetry"},  # forkserve/__init__: the app-facing API
    "cli": {"", "arbiter", "config", "control", "counters", "gunicorn_flags", "handover",
            "hooks", "loader", "logs", "metrics", "pidfile", "procenv", "sockets", "statusview",
            "systemd", "tls"},
    "arbiter": {"", "capture", "config", "control", "counters", "handover", "hooks",
                "lifecycle", "logs", "metrics", "procenv", "reactor", "reloader", "signals",
                "sockets", "standin", "status", "systemd", "tls", "workers"},
    "workers": {"background", "capture", "context", "counters", "exits", "hooks", "http",
                "loader", "logs", "metrics", "proxy", "signals", "sockets", "telemetry", "tls",
                "wsgi"},
    "wsgi": {"http"},
    # The default worker count reads the CPU quota (stdlib only, like config itself); gunicorn's
    # flags that are no settings, and its worker-class names.
    "config": {"gunicorn_flags", "machine"},
    "http": set(),
    "status": {"http", "reactor", "sockets"},
    "standin": {"reactor", "status"},
    "control": {"reactor"},  # the arbiter's one poll, which status and control register into
    "statusview": {"control"},
    "metrics": {"handover"},
    "background": {"context", "counters", "logs"},
    "context": {"logs"},
    # Server hooks (--hooks) and the worker's exit-time cleanup (on_worker_exit, atexit):
    # the standard library and the log only, so the arbiter, workers and cli may all use them.
    "hooks": {"logs"},
    "exits": {"logs"},
    "telemetry": {"context"},
    **{leaf: set() for leaf in LEAVES},
}


def part(name: str) -> str:
    rest = name[len("forkserve."):] if name.startswith("forkserve.") else ""
    return rest.partition(".")[0]


def test_the_table_names_every_part() -> None:
    assert {part(n) for n in MODULES} == set(ALLOWED)


@pytest.mark.parametrize("name", sorted(MODULES))
def test_every_import_is_in_the_table(name: str) -> None:
    here = part(name)
    found = {part(i) for i in ours(imports(name))} - {here}
    assert found <= ALLOWED[here], f"{name} imports {sorted(found - ALLOWED[here])}: not in the table"
