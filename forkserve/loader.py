"""Loading the WSGI application from ``MODULE:NAME`` or ``MODULE:factory(args)``.

Owns: resolving the spec and turning any failure into one readable line, ``sys.exit()`` and
(where the caller asks) ``os._exit()`` called by the application while it is imported
included. The line names what was tried (the module, the directory it was looked up from,
the attribute), a hint for the usual mistakes (a missing or wrong ``--chdir``, a name the
module does not define), and where the application failed: its own frame, never one of
forkserve's or of the import machinery (issue 14). Imports only the standard library.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import os
import sys
import traceback
from collections import deque
from contextlib import contextmanager
from types import ModuleType
from typing import Any, Callable, Iterator, NoReturn

# The application could not be loaded (forkserve.counters.ExitCode.APP_LOAD_ERROR; this
# module imports only the standard library, and a unit test keeps the two equal).
APP_LOAD_EXIT = 4
MAX_EXIT_TEXT = 500  # a sys.exit() message is shown on one line, and fits a counter record


class AppLoadError(Exception):
    """The application could not be loaded: exit code 4, one line."""


# Frames that are not the application's: forkserve's own (this loader calling the import or
# the factory) and the import machinery's (frozen importlib, and importlib.import_module).
_MACHINERY = (os.path.dirname(os.path.abspath(__file__)) + os.sep,
              os.path.dirname(os.path.abspath(importlib.__file__)) + os.sep)
# Installed code: the standard library and site-packages. A frame there is the library the
# application called; the application's own frame (the line its operator can change) is
# the innermost one outside them, when there is one.
_INSTALLED = ("stdlib", "platstdlib", "purelib", "platlib")
# Looking below (and above) the current directory for a module that was not found: bounded,
# so that a server started from / or a home directory answers at once.
SEARCH_DEPTH = 3
SEARCH_DIRS = 2000
MAX_SHOWN = 6  # names listed in the hint for a missing attribute


def _shown_path(path: str) -> str:
    """A file as the operator finds it: relative to the current directory when below it."""
    relative = os.path.relpath(path)
    return path if relative.startswith(os.pardir) else relative


def _installed_dirs() -> tuple[str, ...]:
    import sysconfig  # only to word an import error

    paths = sysconfig.get_paths()
    return tuple(os.path.realpath(paths[name]) + os.sep for name in _INSTALLED if name in paths)


def _app_frame(exc: BaseException) -> traceback.FrameSummary | None:
    """The application's frame where ``exc`` was raised: the innermost one outside forkserve
    and the import machinery, preferring the application's own code over the installed
    libraries it called. None when no frame is the application's (a module not found, a
    factory called with the wrong arguments)."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__)
              if not f.filename.startswith("<frozen ")
              and not os.path.abspath(f.filename).startswith(_MACHINERY)]
    installed = _installed_dirs()
    own = [f for f in frames if not os.path.realpath(f.filename).startswith(installed)]
    chosen = own or frames
    return chosen[-1] if chosen else None


def _where(exc: BaseException) -> str:
    """`` (app.py:3)``: where the application failed, or "" if nowhere of its own."""
    if isinstance(exc, SyntaxError) and exc.filename:
        return f" ({_shown_path(exc.filename)}:{exc.lineno})"
    frame = _app_frame(exc)
    return f" ({_shown_path(frame.filename)}:{frame.lineno})" if frame else ""


def _describe(exc: BaseException, where: str | None = None) -> str:
    text = str(exc).strip().splitlines()
    place = _where(exc) if where is None else where
    return f"{type(exc).__name__}: {text[0] if text else ''}{place}".rstrip()


def _exit_call(exc: SystemExit) -> tuple[str, str]:
    """What the application called, as the operator would write it (``sys.exit()``,
    ``sys.exit(3)``, ``sys.exit(...)``), and its message on one line ("" if none)."""
    code = exc.code
    if code is None:
        return "sys.exit()", ""
    if isinstance(code, int):
        return f"sys.exit({code})", ""
    text = " ".join(str(code).split())  # a multi-line message becomes one line
    if len(text) > MAX_EXIT_TEXT:
        text = text[:MAX_EXIT_TEXT] + "..."
    return "sys.exit(...)", text


def _exited(exc: SystemExit, during: str) -> str:
    """``the application called sys.exit(...) while being imported: FATAL: ... (app.py:3)``"""
    call, text = _exit_call(exc)
    return f"the application called {call} {during}{': ' + text if text else ''}{_where(exc)}"


def _call(expr: str, obj: Any, spec: str) -> Any:
    """``factory(1, debug=True)``: arguments must be literals, never evaluated code."""
    try:
        node = ast.parse(expr, mode="eval").body
    except SyntaxError:
        raise AppLoadError(f"cannot parse {spec!r}: expected MODULE:NAME or MODULE:factory(...)") from None
    if not isinstance(node, ast.Call):
        raise AppLoadError(f"cannot parse {spec!r}: expected MODULE:NAME or MODULE:factory(...)")
    try:
        args = [ast.literal_eval(a) for a in node.args]
        kwargs = {k.arg: ast.literal_eval(k.value) for k in node.keywords if k.arg}
    except ValueError:
        raise AppLoadError(f"{spec!r}: factory arguments must be literals") from None
    try:
        return obj(*args, **kwargs)
    except SystemExit as exc:
        raise AppLoadError(_exited(exc, f"in the factory {spec!r}")) from exc
    except Exception as exc:
        # Failing before any line of the factory ran (wrong arguments, not callable): where
        # the factory is defined, not this call.
        where = None if _app_frame(exc) else _defined_at(obj)
        raise AppLoadError(f"the factory in {spec!r} failed: {_describe(exc, where)}") from exc


def _defined_at(obj: Any) -> str:
    code = getattr(obj, "__code__", None)
    if code is None:
        return ""
    return f" (defined at {_shown_path(code.co_filename)}:{code.co_firstlineno})"


def load_app(spec: str, chdir: str | None = None) -> Callable[..., Any]:
    """The application of ``spec``; AppLoadError (one line) if it cannot be had. ``chdir``
    is the --chdir setting the current directory came from (named in the messages, and
    what a suggested --chdir is relative to), None when the server was started here."""
    module_name, _, attr = spec.partition(":")
    attr = attr.strip() or "application"
    here = os.getcwd()
    if here not in sys.path and "" not in sys.path:
        sys.path.insert(0, here)  # as python -m does: `forkserve myapp:app` finds ./myapp.py
    try:
        module = importlib.import_module(module_name)
    except SystemExit as exc:
        # A settings module refusing to start (sys.exit("FATAL: DATABASE_URL is not set")):
        # an application that cannot be loaded like any other, not an exit of the server or
        # of a worker that would leave the message unread.
        raise AppLoadError(_exited(exc, "while being imported")) from exc
    except ModuleNotFoundError as exc:
        if _is_the_lookup(exc, module_name):
            raise AppLoadError(_not_found(exc, module_name, here, chdir)) from exc
        # A module the application imports was not found: its error, at its line. A package
        # that is nowhere to be found is a dependency not installed for this interpreter
        # (another virtualenv?); one of a package that is there (mysite.settings) is not.
        top = (exc.name or "").partition(".")[0]
        hint = "" if not top or top in sys.modules else f"; not installed for {sys.executable}?"
        raise AppLoadError(f"cannot import {module_name!r}: {_describe(exc)}{hint}") from exc
    except Exception as exc:
        raise AppLoadError(f"cannot import {module_name!r}: {_describe(exc)}") from exc
    name, paren, _ = attr.partition("(")
    name = name.strip()
    try:
        obj: Any = module
        for part in name.split("."):
            obj = getattr(obj, part)
    except AttributeError:
        raise AppLoadError(_no_attribute(module, name)) from None
    if paren:
        obj = _call("_f" + attr[len(name):], obj, spec)
    if not callable(obj):
        raise AppLoadError(f"{spec!r} is not callable (got {type(obj).__name__})")
    app: Callable[..., Any] = obj
    return app


# -- a module not found ---------------------------------------------------------------------

def _is_the_lookup(exc: ModuleNotFoundError, module_name: str) -> bool:
    """True when the module of the spec (or a package above it) does not exist; False when it
    was found and a module that its code imports was not (no frame of its own otherwise)."""
    missing = exc.name or ""
    return ((module_name == missing or module_name.startswith(missing + "."))
            and _app_frame(exc) is None)


def _not_found(exc: ModuleNotFoundError, module_name: str, here: str, chdir: str | None) -> str:
    """``cannot import 'mysite.wsgi' from /srv (the current directory): ModuleNotFoundError:
    No module named 'mysite.wsgi'; found mysite/mysite/wsgi.py: try --chdir mysite``"""
    origin = f"--chdir {chdir}" if chdir else "the current directory"
    line = f"cannot import {module_name!r} from {here} ({origin}): {_describe(exc, '')}"
    found = _find_module_dir(here, module_name)
    if found is not None:
        directory, file = found
        relative = os.path.relpath(directory, here)
        suggested = os.path.normpath(os.path.join(chdir, relative)) if chdir else relative
        return f"{line}; found {_shown_path(file)}: try --chdir {suggested}"
    return f"{line}; is the project in another directory? try --chdir DIR"


def _module_file(directory: str, parts: list[str]) -> str | None:
    """The file (or package directory) ``parts`` names below ``directory``, if any."""
    path = os.path.join(directory, *parts)
    for candidate in (path + ".py", os.path.join(path, "__init__.py")):
        if os.path.isfile(candidate):
            return candidate
    return None


def _find_module_dir(here: str, module_name: str) -> tuple[str, str] | None:
    """A directory near ``here`` from which ``module_name`` would import, and its file: the
    parents first (started inside the project), then the nearest below (a Django project
    one level down), breadth first, hidden directories and virtualenvs skipped."""
    parts = module_name.split(".")
    parent = here
    for _ in range(SEARCH_DEPTH):
        parent = os.path.dirname(parent)
        file = _module_file(parent, parts)
        if file is not None:
            return parent, file
    queue: deque[tuple[str, int]] = deque([(here, 0)])
    visited = 0
    while queue and visited < SEARCH_DIRS:
        directory, depth = queue.popleft()
        visited += 1
        if depth > 0:
            file = _module_file(directory, parts)
            if file is not None:
                return directory, file
        if depth == SEARCH_DEPTH:
            continue
        try:
            with os.scandir(directory) as entries:
                below = sorted(e.path for e in entries
                               if e.is_dir(follow_symlinks=False)
                               and not e.name.startswith((".", "__"))
                               and e.name not in ("node_modules", "site-packages")
                               and not os.path.exists(os.path.join(e.path, "pyvenv.cfg")))
        except OSError:
            continue  # unreadable: not where the operator's project is
        queue.extend((path, depth + 1) for path in below)
    return None


# -- an attribute the module does not have --------------------------------------------------

def _no_attribute(module: ModuleType, name: str) -> str:
    """``module 'mysite.wsgi' (mysite/wsgi.py) has no attribute 'app'; it has: application``"""
    file = getattr(module, "__file__", None)
    if file:
        where = _shown_path(file)
    else:  # a directory without __init__.py, found as a namespace package
        where = "a directory without __init__.py: " + ", ".join(
            _shown_path(p) for p in getattr(module, "__path__", []))
    line = f"module {module.__name__!r} ({where}) has no attribute {name!r}"
    if "." in name and hasattr(module, name.partition(".")[0]):
        return line  # found part of the way: the hint would list the wrong namespace
    names = _callables(module)
    if not names:
        return f"{line}; it defines no callable"
    shown = ", ".join(names[:MAX_SHOWN]) + (", ..." if len(names) > MAX_SHOWN else "")
    return f"{line}; it has: {shown}"


def _callables(module: ModuleType) -> list[str]:
    """What the module could serve, as the spec would name it: WSGI applications and
    instances by name (``application``, ``app`` first), factories with no required
    argument as ``create_app()``, others as ``make(...)``. Classes, modules and what the
    module imported (a function defined elsewhere) are left out."""
    found: list[str] = []
    assigned = _assigned_names(module)
    for key, value in vars(module).items():
        if key.startswith("_") or isinstance(value, (type, ModuleType)) or not callable(value):
            continue
        if inspect.isroutine(value):
            if getattr(value, "__module__", None) == module.__name__:
                found.append(key + _call_spelling(value))
        elif assigned is None or key in assigned:
            # An application object: Flask(...), get_wsgi_application(); not an imported
            # one (flask's request and g proxies are callable too).
            found.append(key)
    first = [n for n in ("application", "app") if n in found]
    return first + [n for n in found if n not in first]


def _assigned_names(module: ModuleType) -> set[str] | None:
    """The names the module's own top-level code assigns (not those it imports), from its
    source; None when it has none to read."""
    try:
        tree = ast.parse(inspect.getsource(module))
    except (OSError, TypeError, SyntaxError, ValueError):
        return None
    names: set[str] = set()
    pending: list[ast.AST] = list(tree.body)
    while pending:  # the module's own scope: into if and try blocks, not into functions
        node = pending.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
            continue
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        pending.extend(ast.iter_child_nodes(node))
    return names


def _call_spelling(function: Callable[..., Any]) -> str:
    """"" for a WSGI application (environ, start_response), "()" for a factory that needs no
    argument, "(...)" for one that does."""
    try:
        params = inspect.signature(function).parameters.values()
    except (TypeError, ValueError):
        return ""
    required = [p for p in params if p.default is p.empty
                and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    if len(required) == 2:
        return ""
    return "()" if not required else "(...)"


@contextmanager
def os_exit_reported(report: Callable[[str], None]) -> Iterator[None]:
    """Around loading the application in a process of ours that must say why it ends (the
    arbiter with --preload, --check): an ``os._exit(n)`` called meanwhile would end it
    with code n and no word. Here ``report`` gets one line naming the call, then the process
    exits with APP_LOAD_EXIT. ``os._exit`` is replaced for the duration only, for every
    thread (a thread the import started may be the one that calls it), and restored after;
    nothing else can intercept it (it runs no handler, atexit or finally)."""
    real = os._exit

    def exit_while_loading(status: int) -> NoReturn:
        try:
            report(f"the application called os._exit({status}) while being imported")
        finally:
            real(APP_LOAD_EXIT)

    os._exit = exit_while_loading
    try:
        yield
    finally:
        os._exit = real
