"""forkserve.reloader: what --reload watches and which changes count (no watcher started),
and the settings of --reload and --no-gc-freeze through every source of the registry."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from forkserve.config import ConfigError, parse_args, resolve
from forkserve.reloader import ChangeFilter, watch_plan


def cli(*argv: str) -> dict[str, Any]:
    values, _ = parse_args(list(argv), "test")
    return values


# -- the plan -------------------------------------------------------------------------------------

def test_plan_watches_the_directory_and_a_package_found_elsewhere(tmp_path: Path) -> None:
    project, libs = tmp_path / "project", tmp_path / "libs"
    (libs / "mysite").mkdir(parents=True)
    (libs / "mysite" / "__init__.py").write_text("raise RuntimeError('never imported')\n")
    project.mkdir()
    plan = watch_plan("mysite.wsgi:application", str(project), [], [str(libs)])
    assert plan.roots == (str(project), str(libs / "mysite"))
    assert plan.watched == plan.roots and plan.extra == ()


def test_plan_a_package_inside_the_directory_is_not_watched_twice(tmp_path: Path) -> None:
    (tmp_path / "app").mkdir()
    (tmp_path / "app" / "__init__.py").write_text("")
    plan = watch_plan("app:wsgi", str(tmp_path), [], [])
    assert plan.roots == (str(tmp_path),)


def test_plan_extra_files_inside_and_outside(tmp_path: Path) -> None:
    project, conf = tmp_path / "project", tmp_path / "conf"
    project.mkdir()
    conf.mkdir()
    (conf / "a.yaml").write_text("")
    plan = watch_plan("app:app", str(project), ["settings.toml", "../conf/a.yaml", "../conf"], [])
    assert plan.extra == (str(project / "settings.toml"), str(conf / "a.yaml"), str(conf))
    # A file outside through its directory (editors rename over it); inside: the root has it.
    assert plan.watched == (str(project), str(conf))


def test_plan_never_watches_the_root_directory() -> None:
    plan = watch_plan("nosuchmodule_xyz:app", os.sep, [], [])
    assert plan.roots == () and plan.watched == ()


# -- the filter -----------------------------------------------------------------------------------

@pytest.fixture
def project(tmp_path: Path) -> Path:
    return tmp_path


def counts(root: Path, relative: str, *, includes: tuple[str, ...] = (),
           excludes: tuple[str, ...] = (), extra: tuple[str, ...] = ()) -> bool:
    plan = watch_plan("app:app", str(root), extra, [])
    return ChangeFilter(plan, includes, excludes).counts(os.path.join(str(root), relative))


@pytest.mark.parametrize("relative, expected", [
    ("app.py", True),
    ("pkg/sub/models.py", True),
    ("README.md", False),
    ("templates/page.html", False),
    ("__pycache__/app.cpython-311.pyc", False),
    ("pkg/__pycache__/models.cpython-311.pyc", False),
    (".git/hooks/pre-commit.py", False),
    (".venv/lib/python3.11/site-packages/flask/app.py", False),
    ("venv/lib/site.py", False),
    ("node_modules/x/build.py", False),
    ("app.py~", False),
    (".app.py.swp", False),
    (".#app.py", False),
    ("#app.py#", False),
    ("app.pyc", False),
])
def test_the_defaults(project: Path, relative: str, expected: bool) -> None:
    assert counts(project, relative) is expected


def test_includes_add_to_python_source(project: Path) -> None:
    assert counts(project, "templates/page.html", includes=("*.html",))
    assert counts(project, "conf/app.yaml", includes=("conf/*",))
    assert counts(project, "app.py", includes=("*.html",))
    assert not counts(project, "static/site.css", includes=("*.html",))


def test_excludes_add_to_the_defaults(project: Path) -> None:
    assert not counts(project, "scratch_1.py", excludes=("scratch_*.py",))
    assert not counts(project, "migrations/0001_initial.py", excludes=("migrations",))
    assert not counts(project, ".git/x.py", excludes=("migrations",))
    assert counts(project, "app.py", excludes=("migrations",))


def test_including_a_default_exclude_by_name_drops_it(project: Path) -> None:
    assert counts(project, "app.pyc", includes=("*.pyc",))


def test_an_extra_file_always_counts(tmp_path: Path) -> None:
    outside = tmp_path / "conf" / "extra.txt"
    plan = watch_plan("app:app", str(tmp_path / "project"), [str(outside)], [])
    accepts = ChangeFilter(plan)
    assert accepts.counts(str(outside))
    assert not accepts.counts(str(tmp_path / "conf" / "other.py")), "only the named file"
    assert accepts(object(), str(outside))  # as watchfiles calls it: (change, path)


def test_an_extra_directory_counts_less_the_excludes(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    plan = watch_plan("app:app", str(tmp_path / "project"), [str(shared)], [])
    accepts = ChangeFilter(plan)
    assert accepts.counts(str(shared / "schema.graphql"))
    assert not accepts.counts(str(shared / "__pycache__" / "x.pyc"))


# -- the settings ---------------------------------------------------------------------------------

def test_reload_settings_from_yaml_and_env(tmp_path: Path) -> None:
    path = tmp_path / "forkserve.yaml"
    path.write_text("reload: true\nreload_extra_file: [a.yaml, b.yaml]\nreload_include: ['*.html']\n")
    config = resolve(cli("-c", str(path), "app:app"), {"FORKSERVE_RELOAD_EXCLUDE": "tmp_*,*.log"})
    assert config.reload is True and config.sources["reload"] == "file"
    assert config.reload_extra_file == ["a.yaml", "b.yaml"]
    assert config.reload_include == ["*.html"]
    assert (config.reload_exclude, config.sources["reload_exclude"]) == (["tmp_*", "*.log"], "env")


def test_reload_settings_from_the_command_line() -> None:
    config = resolve(cli("--reload", "--reload-extra-file", "a.yaml", "--reload-extra-file", "b",
                         "--reload-include", "*.html", "--reload-exclude", "tmp", "app:app"), {})
    assert (config.reload, config.reload_extra_file) == (True, ["a.yaml", "b"])
    assert (config.reload_include, config.reload_exclude) == (["*.html"], ["tmp"])


def test_reload_with_preload_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="--reload cannot be used with --preload"):
        resolve(cli("--reload", "--preload", "app:app"), {})


def test_reload_without_watchfiles_is_a_config_error(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "watchfiles" else real(name, *a))
    with pytest.raises(ConfigError) as raised:
        resolve(cli("--reload", "app:app"), {})
    assert str(raised.value) == "--reload needs watchfiles: pip install 'forkserve[reload]'"
    resolve(cli("app:app"), {})  # without --reload it is not needed


@pytest.mark.parametrize("argv, environ, expected", [
    ((), {}, True),
    (("--no-gc-freeze",), {}, False),
    ((), {"FORKSERVE_GC_FREEZE": "0"}, False),
    ((), {"FORKSERVE_GC_FREEZE": "false"}, False),
])
def test_gc_freeze_is_on_unless_turned_off(argv: tuple[str, ...], environ: dict[str, str],
                                           expected: bool) -> None:
    assert resolve(cli(*argv, "app:app"), environ).gc_freeze is expected


def test_gc_freeze_off_in_yaml(tmp_path: Path) -> None:
    path = tmp_path / "forkserve.yaml"
    path.write_text("gc_freeze: false\n")
    assert resolve(cli("-c", str(path), "app:app"), {}).gc_freeze is False


def test_plan_an_extra_file_in_a_missing_directory_is_left_out(tmp_path: Path) -> None:
    plan = watch_plan("app:app", str(tmp_path), ["/nonexistent-dir-xyz/a.yaml", "later.yaml"], [])
    assert plan.missing == ("/nonexistent-dir-xyz/a.yaml",)
    assert plan.watched == (str(tmp_path),)  # later.yaml: in the root, seen once created
