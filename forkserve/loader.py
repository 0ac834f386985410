"""Loading the WSGI application from ``MODULE:NAME`` or ``MODULE:factory(args)``.

Owns: resolving the spec and turning any failure into one readable line, ``sys.exit()`` and
(where the caller asks) ``os._exit()`` called by the application while it is imported
included. Imports only the standard library.
"""

from __future__ import annotations

import ast
import importlib
import os
import sys
import traceback
from contextlib import contextmanager
from typing import Any, Callable, Iterator, NoReturn

# The application could not be loaded (forkserve.counters.ExitCode.APP_LOAD_ERROR; this
# module imports only the standard library, and a unit test keeps the two equal).
APP_LOAD_EXIT = 4
MAX_EXIT_TEXT = 500  # a sys.exit() message is shown on one line, and fits a counter record


class AppLoadError(Exception):
    """The application could not be loaded: exit code 4, one line."""


def _describe(exc: BaseException) -> str:
    where = ""
    frames = traceback.extract_tb(exc.__traceback__)
    if isinstance(exc, SyntaxError) and exc.filename:
        where = f" ({os.path.relpath(exc.filename)}:{exc.lineno})"
    elif frames:
        last = frames[-1]
        where = f" ({os.path.relpath(last.filename)}:{last.lineno})"
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}{where}".rstrip()


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
    frames = traceback.extract_tb(exc.__traceback__)
    where = f" ({os.path.relpath(frames[-1].filename)}:{frames[-1].lineno})" if frames else ""
    return f"the application called {call} {during}{': ' + text if text else ''}{where}"


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
        raise AppLoadError(f"the factory in {spec!r} failed: {_describe(exc)}") from exc


def load_app(spec: str) -> Callable[..., Any]:
    module_name, _, attr = spec.partition(":")
    attr = attr.strip() or "application"
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())  # as python -m does: `forkserve myapp:app` finds ./myapp.py
    try:
        module = importlib.import_module(module_name)
    except SystemExit as exc:
        # A settings module refusing to start (sys.exit("FATAL: DATABASE_URL is not set")):
        # an application that cannot be loaded like any other, not an exit of the server or
        # of a worker that would leave the message unread.
        raise AppLoadError(_exited(exc, "while being imported")) from exc
    except Exception as exc:
        raise AppLoadError(f"cannot import {module_name!r}: {_describe(exc)}") from exc
    name, paren, _ = attr.partition("(")
    name = name.strip()
    try:
        obj: Any = module
        for part in name.split("."):
            obj = getattr(obj, part)
    except AttributeError:
        raise AppLoadError(f"module {module_name!r} has no attribute {name!r}") from None
    if paren:
        obj = _call("_f" + attr[len(name):], obj, spec)
    if not callable(obj):
        raise AppLoadError(f"{spec!r} is not callable (got {type(obj).__name__})")
    app: Callable[..., Any] = obj
    return app


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
