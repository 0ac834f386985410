"""Load errors as a new user meets them (issue 14), with real ``python -m forkserve`` processes
started in a tmp_path holding small projects: one line on stderr naming what was tried (the
module, the directory it was looked up from, the attribute), a hint for the usual mistakes
(a missing --chdir, a file path instead of a module), the application's own file:line, and
the documented exit code: 4 for an application that cannot be loaded, 2 for a file path
given as the app (bad usage). From --check, from a start (the workers import the app), and
with --preload (the arbiter does).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.integration.test_cli import forkserve

USAGE, APP_LOAD_ERROR = 2, 4
NOT_HERE = "is the project in another directory? try --chdir DIR"
# How each mode tells the loader's line: --check and --preload load in the arbiter; a plain
# start has its workers load it, and the arbiter logs the record they send (then its fields).
MODES = {
    "check": (["--check"], "Application could not be loaded: "),
    "workers": (["-b", "127.0.0.1:0", "-w", "1"], "Application failed to boot: "),
    "preload": (["-b", "127.0.0.1:0", "-w", "1", "--preload"], "Application could not be loaded: "),
}

DJANGO_SETTINGS = """\
SECRET_KEY = "test-only"
DEBUG = False
ALLOWED_HOSTS = ["*"]
INSTALLED_APPS: list[str] = []
ROOT_URLCONF = "mysite.urls"
"""
DJANGO_WSGI = """\
import os

from django.core.wsgi import get_wsgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "mysite.{settings}")

application = get_wsgi_application()
"""


def write(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


@pytest.fixture
def projects(tmp_path: Path) -> Path:
    """A directory a new user would start forkserve from: a Django project one level down
    (as `django-admin startproject mysite` makes it), and small apps beside it."""
    return write(tmp_path, {
        "mysite/manage.py": "",
        "mysite/mysite/__init__.py": "",
        "mysite/mysite/settings.py": DJANGO_SETTINGS,
        "mysite/mysite/urls.py": "urlpatterns: list[object] = []\n",
        "mysite/mysite/wsgi.py": DJANGO_WSGI.format(settings="settings"),
        "mysite/mysite/wsgi_typo.py": DJANGO_WSGI.format(settings="setings"),
        "needs_dependency.py": "import os\nimport not_installed_xyz\n\napp = None\n",
        "factory_app.py": ("import json\n\n\n"
                           "def create_app():\n"
                           "    return json.loads('{not json')\n\n\n"
                           "def application(environ, start_response):\n"
                           "    return []\n"),
    })


def run(mode: str, *args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    flags, _ = MODES[mode]
    return forkserve(*flags, *args, cwd=cwd)


def the_error(result: subprocess.CompletedProcess[str], mode: str) -> str:
    """The loader's line: the one ERROR line, exit 4, no traceback."""
    assert result.returncode == APP_LOAD_ERROR, (result.returncode, result.stderr)
    assert "Traceback" not in result.stderr, result.stderr
    errors = [line for line in result.stderr.splitlines() if "[ERROR]" in line]
    assert len(errors) == 1, result.stderr
    if mode != "workers":
        # Nothing was forked: the line is all there is.
        assert result.stderr.splitlines() == errors, result.stderr
    assert result.stdout == ""
    _, prefix = MODES[mode]
    message = errors[0].partition(" [ERROR] ")[2]
    assert message.startswith(prefix), message
    message = message[len(prefix):]
    # A worker's line is followed by the arbiter's fields (state=halting ...).
    return message.partition(" state=")[0] if mode == "workers" else message


# -- a module not found -----------------------------------------------------------------------

@pytest.mark.parametrize("mode", MODES)
def test_a_django_project_without_chdir_gets_the_chdir_to_use(projects: Path, mode: str) -> None:
    line = the_error(run(mode, "mysite.wsgi:application", cwd=projects), mode)
    assert line == (f"cannot import 'mysite.wsgi' from {projects} (the current directory): "
                    "ModuleNotFoundError: No module named 'mysite.wsgi'; "
                    "found mysite/mysite/wsgi.py: try --chdir mysite")


def test_with_the_suggested_chdir_the_django_project_loads(projects: Path) -> None:
    result = forkserve("--check", "--chdir", "mysite", "mysite.wsgi:application", cwd=projects)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("forkserve: configuration OK;")


@pytest.mark.parametrize("mode", MODES)
def test_a_module_that_is_nowhere_asks_whether_the_project_is_elsewhere(projects: Path,
                                                                        mode: str) -> None:
    line = the_error(run(mode, "--chdir", "mysite", "shop.wsgi", cwd=projects), mode)
    assert line == (f"cannot import 'shop.wsgi' from {projects / 'mysite'} (--chdir mysite): "
                    f"ModuleNotFoundError: No module named 'shop'; {NOT_HERE}")


def test_started_inside_the_package_suggests_its_parent(projects: Path) -> None:
    line = the_error(run("check", "mysite.wsgi", cwd=projects / "mysite" / "mysite"), "check")
    assert line.endswith("No module named 'mysite'; found wsgi.py: try --chdir .."), line


# -- the application's own errors: its file and line ------------------------------------------

@pytest.mark.parametrize("mode", MODES)
def test_a_missing_dependency_is_the_apps_error_at_its_line(projects: Path, mode: str) -> None:
    line = the_error(run(mode, "needs_dependency:app", cwd=projects), mode)
    assert line == ("cannot import 'needs_dependency': ModuleNotFoundError: No module named "
                    f"'not_installed_xyz' (needs_dependency.py:2); not installed for {sys.executable}?")


@pytest.mark.parametrize("mode", MODES)
def test_a_failing_factory_is_placed_in_the_factory_not_in_forkserve(projects: Path,
                                                                     mode: str) -> None:
    line = the_error(run(mode, "factory_app:create_app()", cwd=projects), mode)
    assert line.startswith("the factory in 'factory_app:create_app()' failed: JSONDecodeError: ")
    assert line.endswith(" (factory_app.py:5)"), line
    assert "forkserve/" not in line and "json/" not in line


def test_a_misspelled_django_settings_module_is_placed_in_the_projects_wsgi(projects: Path) -> None:
    # Django imports the settings module: the line to change is the project's, not Django's.
    line = the_error(run("check", "--chdir", "mysite", "mysite.wsgi_typo", cwd=projects), "check")
    assert line == ("cannot import 'mysite.wsgi_typo': ModuleNotFoundError: No module named "
                    "'mysite.setings' (mysite/wsgi_typo.py:7)")


# -- an attribute the module does not have ----------------------------------------------------

@pytest.mark.parametrize("mode", MODES)
def test_a_missing_attribute_lists_what_the_module_has(projects: Path, mode: str) -> None:
    line = the_error(run(mode, "factory_app:app", cwd=projects), mode)
    assert line == ("module 'factory_app' (factory_app.py) has no attribute 'app'; "
                    "it has: application, create_app()")


def test_a_django_wsgi_module_offers_its_application(projects: Path) -> None:
    line = the_error(run("check", "--chdir", "mysite", "mysite.wsgi:app", cwd=projects), "check")
    assert line == ("module 'mysite.wsgi' (mysite/wsgi.py) has no attribute 'app'; "
                    "it has: application")


# -- a file path where a module is expected: bad usage, exit 2 -----------------------------------

@pytest.mark.parametrize("mode", ["check", "workers"])
@pytest.mark.parametrize("args, suggestion", [
    (["mysite/mysite/wsgi.py"], "try --chdir mysite mysite.wsgi"),
    (["--chdir", "mysite", "mysite/wsgi.py"], "try mysite.wsgi"),
    (["./factory_app.py"], "try factory_app"),
    (["factory_app.py:create_app()"], "try factory_app:create_app()"),
])
def test_a_file_path_is_refused_with_the_module_spelling(projects: Path, mode: str,
                                                         args: list[str], suggestion: str) -> None:
    result = run(mode, *args, cwd=projects)
    assert result.returncode == USAGE, (result.returncode, result.stderr)
    assert result.stderr.splitlines() == [
        f"forkserve: error: app: {args[-1]!r} is a file path, not a module: {suggestion}"]
    assert result.stdout == ""
