"""The one line a load error is (issue 14): what was tried (the module, the directory it was
looked up from, the attribute), a hint for the usual mistakes (a missing --chdir, a file
path, a name the module does not define), and the application's own file:line, never
forkserve's or the import machinery's. Loaded in-process from throwaway projects under
tmp_path; the real command line is tests/integration/test_load_errors.py's."""

from __future__ import annotations

import importlib
import os
import sys
from pathlib import Path
from typing import Callable, Iterator

import pytest

from forkserve.config import ConfigError, parse_args, resolve
from forkserve.loader import AppLoadError, load_app

NOT_HERE = "is the project in another directory? try --chdir DIR"

Project = Callable[[dict[str, str]], Path]


@pytest.fixture
def project(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Project]:
    """``project({"mysite/wsgi.py": "..."})`` writes the files under tmp_path and makes it the
    current directory; sys.path and the modules imported meanwhile are restored after."""
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", os.getcwd())])
    monkeypatch.chdir(tmp_path)
    before = set(sys.modules)

    def make(files: dict[str, str]) -> Path:
        for name, text in files.items():
            path = tmp_path / name
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
        importlib.invalidate_caches()
        return tmp_path

    yield make
    for name in set(sys.modules) - before:
        del sys.modules[name]


def failure(spec: str, chdir: str | None = None) -> str:
    with pytest.raises(AppLoadError) as caught:
        load_app(spec, chdir)
    text = str(caught.value)
    assert "\n" not in text, text
    return text


DJANGO = {"mysite/manage.py": "", "mysite/mysite/__init__.py": "",
          "mysite/mysite/wsgi.py": "def application(environ, start_response):\n    return []\n"}


# -- a module not found -------------------------------------------------------------------------

def test_not_found_names_the_directory_and_asks_for_a_chdir(project: Project) -> None:
    here = project({})
    assert failure("nosuch_app_xyz:app") == (
        f"cannot import 'nosuch_app_xyz' from {here} (the current directory): "
        f"ModuleNotFoundError: No module named 'nosuch_app_xyz'; {NOT_HERE}")


def test_not_found_names_the_chdir_it_was_looked_up_from(project: Project) -> None:
    here = project({"sub/readme.txt": ""})
    os.chdir(here / "sub")
    text = failure("nosuch_app_xyz:app", chdir="sub")
    assert text.startswith(f"cannot import 'nosuch_app_xyz' from {here / 'sub'} (--chdir sub): "
                           f"ModuleNotFoundError: No module named 'nosuch_app_xyz'; "), text
    assert text.endswith(NOT_HERE)
    assert "frozen" not in text and "loader.py" not in text


def test_a_django_project_one_level_down_suggests_its_chdir(project: Project) -> None:
    here = project(DJANGO)
    # ./mysite (no __init__.py) is found as a namespace package; ./mysite/wsgi.py is not there.
    assert failure("mysite.wsgi:application") == (
        f"cannot import 'mysite.wsgi' from {here} (the current directory): ModuleNotFoundError: "
        f"No module named 'mysite.wsgi'; found mysite/mysite/wsgi.py: try --chdir mysite")


def test_the_suggested_chdir_is_relative_to_the_given_one(project: Project) -> None:
    here = project({"deploy/src/shop/__init__.py": "", "deploy/src/shop/web.py": "app = 1\n"})
    os.chdir(here / "deploy")
    text = failure("shop.web:app", chdir="deploy")
    assert text.endswith("; found src/shop/web.py: try --chdir deploy/src"), text


def test_started_inside_the_package_suggests_the_parent(project: Project) -> None:
    here = project(DJANGO)
    os.chdir(here / "mysite" / "mysite")
    text = failure("mysite.wsgi")
    assert text.endswith("; found wsgi.py: try --chdir .."), text


def test_virtualenvs_and_hidden_directories_are_not_searched(project: Project) -> None:
    project({".git/proj/app.py": "app = 1\n", "venv/pyvenv.cfg": "", "venv/lib/proj/app.py": "",
             "node_modules/proj/app.py": ""})
    assert failure("proj.app:app").endswith(NOT_HERE)


def test_a_missing_dependency_is_the_apps_error_not_a_module_not_found(project: Project) -> None:
    project({"needsdep.py": "import os\nimport missing_dependency_xyz\napp = 1\n"})
    assert failure("needsdep:app") == (
        "cannot import 'needsdep': ModuleNotFoundError: No module named 'missing_dependency_xyz' "
        f"(needsdep.py:2); not installed for {sys.executable}?")


def test_a_missing_module_of_a_package_that_is_there_is_not_an_install_hint(
        project: Project) -> None:
    project({"shop/__init__.py": "", "shop/wsgi.py": "import shop.nosettings\napp = 1\n"})
    assert failure("shop.wsgi:app") == ("cannot import 'shop.wsgi': ModuleNotFoundError: No "
                                        "module named 'shop.nosettings' (shop/wsgi.py:1)")


def test_a_missing_module_of_the_apps_own_package_is_its_error(project: Project) -> None:
    project({"shop/__init__.py": "", "shop/web.py": "from shop import settings\napp = 1\n"})
    text = failure("shop.web:app")
    assert text.startswith("cannot import 'shop.web': ImportError: cannot import name "
                           "'settings' from 'shop'"), text
    assert text.endswith("(shop/web.py:1)"), text


# -- an attribute the module does not have --------------------------------------------------------

def test_a_missing_attribute_lists_what_the_module_has(project: Project) -> None:
    project({"site_app.py": (
        "import json\n"
        "from json import dumps\n"
        "class Middleware:\n    pass\n"
        "def helper(x):\n    return x\n"
        "def create_app(config=None):\n    return application\n"
        "def application(environ, start_response):\n    return []\n"
        "app = application\n"
        "_private = application\n"
        "DEBUG = True\n")})
    assert failure("site_app:wsgi") == (
        "module 'site_app' (site_app.py) has no attribute 'wsgi'; it has: application, app, "
        "helper(...), create_app()")


def test_a_callable_object_the_module_imports_is_not_listed(project: Project) -> None:
    # As flask's request and g proxies: callable, but not what the module could serve.
    project({"proxies.py": "class Proxy:\n    def __call__(self):\n        pass\n"
                           "request = Proxy()\n",
             "served.py": "from proxies import Proxy, request\nserver = Proxy()\n"
                          "if True:\n    fallback = Proxy()\n"
                          "def make():\n    inner = Proxy()\n    return inner\n"})
    assert failure("served").endswith("; it has: server, fallback, make()")


def test_a_missing_attribute_of_a_module_with_no_callable(project: Project) -> None:
    project({"settings_only.py": "DEBUG = True\n"})
    assert failure("settings_only") == (
        "module 'settings_only' (settings_only.py) has no attribute 'application'; "
        "it defines no callable")


def test_a_missing_attribute_lists_a_few_only(project: Project) -> None:
    project({"many.py": "".join(f"def f{n}(environ, start_response):\n    pass\n"
                                for n in range(10))})
    assert failure("many:nope").endswith("; it has: f0, f1, f2, f3, f4, f5, ...")


def test_a_missing_attribute_of_a_namespace_package(project: Project) -> None:
    here = project(DJANGO)
    assert failure("mysite") == (
        "module 'mysite' (a directory without __init__.py: mysite) has no attribute "
        "'application'; it defines no callable")
    assert (here / "mysite").is_dir()


# -- where the application failed ---------------------------------------------------------------

def test_an_exception_at_import_is_placed_in_the_apps_frame(project: Project) -> None:
    # json raises deep in the standard library: the line to change is the app's.
    project({"bad_import.py": "import json\n\nCONFIG = json.loads('{oops')\napp = 1\n"})
    text = failure("bad_import:app")
    assert text.startswith("cannot import 'bad_import': JSONDecodeError: "), text
    assert text.endswith("(bad_import.py:3)"), text


def test_a_failing_factory_is_placed_in_the_factory(project: Project) -> None:
    project({"factory_app.py": "def create_app():\n    raise RuntimeError('no DATABASE_URL')\n"})
    assert failure("factory_app:create_app()") == (
        "the factory in 'factory_app:create_app()' failed: RuntimeError: no DATABASE_URL "
        "(factory_app.py:2)")


def test_a_factory_called_with_the_wrong_arguments_is_placed_at_its_definition(
        project: Project) -> None:
    project({"factory_args.py": "import os\n\ndef create_app(env):\n    return None\n"})
    text = failure("factory_args:create_app()")
    assert text == ("the factory in 'factory_args:create_app()' failed: TypeError: create_app() "
                    "missing 1 required positional argument: 'env' (defined at factory_args.py:3)")
    assert "loader.py" not in text


def test_a_syntax_error_is_placed_at_its_line(project: Project) -> None:
    project({"broken_syntax.py": "x = 1\napp = 1 +\n"})
    text = failure("broken_syntax:app")
    assert text.startswith("cannot import 'broken_syntax': SyntaxError: ")
    assert text.endswith("(broken_syntax.py:2)"), text


# -- a file path given where a module is expected (refused by the configuration, exit 2) ----------

def refused(*argv: str) -> str:
    cli, _ = parse_args(list(argv), "test")
    with pytest.raises(ConfigError) as caught:
        resolve(cli, {})
    return str(caught.value)


@pytest.mark.parametrize("argv, suggestion", [
    (["mysite/mysite/wsgi.py"], "try --chdir mysite mysite.wsgi"),
    (["mysite/mysite/wsgi.py:application"], "try --chdir mysite mysite.wsgi:application"),
    (["--chdir", "mysite", "mysite/wsgi.py"], "try mysite.wsgi"),  # from the --chdir
    (["--chdir", "mysite", "mysite/mysite/wsgi.py"], "try mysite.wsgi"),  # from here
    (["mysite/mysite/__init__.py"], "try --chdir mysite mysite"),
    (["./app.py"], "try app"),
    (["app.py:app"], "try app:app"),
    (["not/there.py"], "try --chdir not there"),
])
def test_a_file_path_is_refused_with_the_module_spelling(project: Project, argv: list[str],
                                                         suggestion: str) -> None:
    project({**DJANGO, "app.py": "app = 1\n"})
    assert refused(*argv) == f"app: {argv[-1]!r} is a file path, not a module: {suggestion}"


def test_a_file_path_from_elsewhere_gets_an_absolute_chdir(project: Project) -> None:
    here = project(DJANGO)
    path = str(here / "mysite" / "mysite" / "wsgi.py")
    os.chdir("/")
    assert refused(path) == (f"app: {path!r} is a file path, not a module: "
                             f"try --chdir {here / 'mysite'} mysite.wsgi")


def test_a_file_whose_name_is_not_a_module_name(project: Project) -> None:
    project({"my-app.py": "app = 1\n"})
    assert refused("my-app.py") == ("app: 'my-app.py' is a file path, not a module, and 'my-app' "
                                    "cannot be imported under that name")


def test_a_file_path_in_the_environment_names_the_variable(project: Project) -> None:
    project(DJANGO)
    cli, _ = parse_args([], "test")
    with pytest.raises(ConfigError, match=r"^FORKSERVE_APP: 'mysite/mysite/wsgi.py' is a file "
                                          r"path, not a module: try --chdir mysite mysite.wsgi$"):
        resolve(cli, {"FORKSERVE_APP": "mysite/mysite/wsgi.py"})


def test_a_module_spec_is_not_taken_for_a_path(project: Project) -> None:
    project({})
    cli, _ = parse_args(["mysite.wsgi:application"], "test")
    assert resolve(cli, {}).app == "mysite.wsgi:application"
