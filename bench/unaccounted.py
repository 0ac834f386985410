"""forkserve without its in-flight accounting: the "off" side of the accounting's cost (bench only).

    python bench/unaccounted.py -w 2 -k sync -b 127.0.0.1:8080 examples.hello:app

Takes forkserve's own command line and runs forkserve's CLI in this process, after taking the
drain accounting out of the request path: the statements themselves are removed from
``Pipeline.serve_request`` and ``Pipeline.release`` (their source, recompiled without them), so
the "off" server pays nothing for them, not even a call to a no-op:

- ``counters.in_flight_requests += 1`` and ``-= 1``;
- ``RequestContext(...)``: replaced by one shared stand-in (``NoContext``) with the attributes
  the pipeline reads of a context (``finish``, ``cancelled``, ``timed_out``);
- ``token = set_current(context)`` and ``reset_current(token)`` (``CURRENT``'s set and reset);
- ``context.run_shutdown_functions(self.log)``;
- ``self.report()`` (and ``Worker.report`` is a no-op for its other callers).

Kept: ``counters.active_connections`` in ``admit``/``release``. It is part of the accounting,
but the sync and thread workers' admission reads it (``active_connections < limit``), so
without it they would accept without bound: another server, not the same one unaccounted.

The workers are forked from this arbiter (no exec on the way: only a USR2 upgrade re-executes,
as ``python -m forkserve``, which would drop the patch), so they run the patched class. The
server stays correct for plain serving (the hello-world app) but has no drain accounting:
never run it for anything but the throughput comparison. Each removal is counted and a
mismatch with the expected count stops the launcher, so a change to the pipeline cannot make
the comparison silently measure nothing.
"""

from __future__ import annotations

import ast
import inspect
import sys
import textwrap
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

# The statements taken out, as ast.unparse writes them, and how many times each is expected.
REMOVED = {
    "serve_request": {
        "counters.in_flight_requests += 1": 1,
        "counters.in_flight_requests -= 1": 1,
        "token = set_current(context)": 1,
        "reset_current(token)": 1,
        "context.run_shutdown_functions(self.log)": 1,
        "self.report()": 1,
    },
    "release": {"self.report()": 1},
}
CONTEXT_CALL = "RequestContext"  # `context = RequestContext(...)` -> `context = _NO_CONTEXT`
STAND_IN = "_NO_CONTEXT"


class NoContext:
    """What the pipeline reads of a RequestContext, with no request behind it."""

    __slots__ = ()
    finished = False
    cancelled = False
    timed_out = False
    functions: tuple[()] = ()  # no shutdown functions (serve_request looks before running them)

    def finish(self) -> None:
        """forkserve.finish_request(): nothing to end early (the hello-world app never calls it)."""


class Strip(ast.NodeTransformer):
    """Drops the statements in ``removed`` wherever they are in a block; replaces the
    RequestContext(...) call of an assignment with the stand-in."""

    def __init__(self, removed: dict[str, int]) -> None:
        self.removed = removed
        self.seen = {text: 0 for text in removed}
        self.contexts = 0

    def generic_visit(self, node: ast.AST) -> ast.AST:
        for name in ("body", "orelse", "finalbody"):
            block = getattr(node, name, None)
            if isinstance(block, list) and block and isinstance(block[0], ast.stmt):
                kept = []
                for stmt in block:
                    text = ast.unparse(stmt)
                    if text in self.seen:
                        self.seen[text] += 1
                    else:
                        kept.append(stmt)
                setattr(node, name, kept or [ast.Pass()])
        return super().generic_visit(node)

    def visit_Assign(self, node: ast.Assign) -> ast.AST:
        call = node.value
        if (isinstance(call, ast.Call) and isinstance(call.func, ast.Name)
                and call.func.id == CONTEXT_CALL):
            self.contexts += 1
            node.value = ast.copy_location(ast.Name(STAND_IN, ast.Load()), call)
        return node


def stripped(function: Callable[..., Any], removed: dict[str, int],
             module_globals: dict[str, Any]) -> Callable[..., Any]:
    """``function`` recompiled without the statements in ``removed`` (the counts checked)."""
    lines, first = inspect.getsourcelines(function)
    tree = ast.parse(textwrap.dedent("".join(lines)))
    ast.increment_lineno(tree, first - 1)  # tracebacks point at the real file's lines
    strip = Strip(removed)
    tree = ast.fix_missing_locations(strip.visit(tree))
    wrong = {text: (seen, removed[text]) for text, seen in strip.seen.items() if seen != removed[text]}
    if wrong:
        raise SystemExit(f"unaccounted: {function.__qualname__} changed; removed (found, expected): "
                         f"{wrong}")
    if function.__name__ == "serve_request" and strip.contexts != 1:
        raise SystemExit(f"unaccounted: {strip.contexts} RequestContext(...) assignments in "
                         f"serve_request, expected 1")
    namespace: dict[str, Any] = {}
    code = compile(tree, inspect.getsourcefile(function) or "<unaccounted>", "exec")
    exec(code, module_globals, namespace)  # noqa: S102 - our own source, minus some lines
    new = namespace[function.__name__]
    new.__qualname__ = function.__qualname__
    return new  # type: ignore[no-any-return]


def patch() -> None:
    """Take the accounting out of the request path (in this process and the ones it forks)."""
    from forkserve.workers import base, pipeline

    # A copy of the module's namespace plus the stand-in: the functions find the same
    # modules and classes (none of it is mutable state), and the real module is untouched.
    module_globals = dict(vars(pipeline), **{STAND_IN: NoContext()})
    for name, removed in REMOVED.items():
        setattr(pipeline.Pipeline, name,
                stripped(getattr(pipeline.Pipeline, name), removed, module_globals))
    base.Worker.report = lambda self: None  # type: ignore[method-assign]


def main(argv: list[str] | None = None) -> None:
    patch()
    from forkserve.cli import run

    sys.argv = ["forkserve", *(sys.argv[1:] if argv is None else argv)]
    run()


if __name__ == "__main__":
    main()
