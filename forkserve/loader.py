"""Loading the WSGI application from ``MODULE:NAME`` or ``MODULE:factory(args)``.

Owns: resolving the spec and turning any failure into one readable line. Imports only the
standard library.
"""

from __future__ import annotations

import ast
import importlib
import os
import sys
import traceback
from typing import Any, Callable


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
    except Exception as exc:
        raise AppLoadError(f"the factory in {spec!r} failed: {_describe(exc)}") from exc


def load_app(spec: str) -> Callable[..., Any]:
    module_name, _, attr = spec.partition(":")
    attr = attr.strip() or "application"
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())  # as python -m does: `forkserve myapp:app` finds ./myapp.py
    try:
        module = importlib.import_module(module_name)
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
