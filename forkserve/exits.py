"""A worker's exit-time cleanup: ``forkserve.on_worker_exit(fn)``, the application's
``atexit`` handlers and ``logging.shutdown()``, run within a budget.

Workers end with ``os._exit`` (no interpreter teardown, whose module and object destruction
a stop would wait for), so nothing Python runs at a normal exit would run there. On every
graceful exit (the end of a TERM drain, a HUP replacement, a max-requests recycle, a pause
or scale-down retirement) the worker runs, in this order, after its own access log and
spans are written out:

1. the functions given to ``on_worker_exit``, in registration order, each one's failure
   logged and contained;
2. the ``worker_exit`` server hook (forkserve.hooks);
3. the ``atexit`` handlers, last registered first, as Python runs them (``logging``
   registers ``logging.shutdown`` when it is first imported, so it normally runs after the
   application's own handlers and flushes every handler, a ``MemoryHandler`` included).

The whole is bounded by ``--cancel-grace``: past it the worker writes one line and exits,
whatever is still running (a stuck handler must not hold the stop; the arbiter kills the
worker at its own deadline anyway). A hard stop (QUIT, a second INT, the timeout kill, the
arbiter's death) runs none of it.

The registry is per process by nature, as ``atexit``'s is: the one module-level list in
forkserve. A function registered before the fork (an app loaded with ``--preload``) runs in
every worker. Imports only the standard library and forkserve.logs.
"""

from __future__ import annotations

import atexit
import os
import signal
import time
from typing import Any, Callable

from forkserve.logs import Log

# (fn, args, kwargs) registered by on_worker_exit, in order. Module-level on purpose (see
# the docstring): app code registers from anywhere, at import or in a request.
_FUNCTIONS: list[tuple[Callable[..., Any], tuple[Any, ...], dict[str, Any]]] = []


def on_worker_exit(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Callable[..., Any]:
    """Run ``fn(*args, **kwargs)`` when this worker exits gracefully (see the module's
    docstring for when and in which order), within ``--cancel-grace``. Returns ``fn``, so
    it also works as a decorator. Outside forkserve it only registers."""
    _FUNCTIONS.append((fn, args, kwargs))
    return fn


def registered() -> int:
    return len(_FUNCTIONS)


class Budget:
    """A deadline for the exit's cleanup, kept by SIGALRM: when it passes the handler
    writes one line and ends the process at once with ``code``.

    -- runs in a signal handler: a log write and ``os._exit``. The documented exception to
    the handler rules: the worker is leaving, and whatever holds its main thread (a handler
    stuck in a blocking call, interrupted by the alarm) must not hold the exit."""

    def __init__(self, seconds: float, log: Log, worker_id: int, code: int) -> None:
        self.seconds = seconds
        self.log = log
        self.worker_id = worker_id
        self.code = code
        self.step = "on_worker_exit functions"
        self.started = time.monotonic()

    def __enter__(self) -> "Budget":
        signal.signal(signal.SIGALRM, self._expired)
        signal.setitimer(signal.ITIMER_REAL, max(self.seconds, 0.001))
        return self

    def __exit__(self, *exc: Any) -> None:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, signal.SIG_DFL)

    def _expired(self, signum: int, frame: Any) -> None:
        self.log.from_handler(40, f"Worker {self.worker_id} exit-time cleanup still running "
                              f"after {self.seconds:g}s (--cancel-grace), in its {self.step}; "
                              "exiting without waiting for it",
                              {"worker": self.worker_id, "step": self.step})
        os._exit(self.code)


def run_exit_functions(log: Log) -> None:
    """The on_worker_exit functions, in registration order, each contained."""
    functions = list(_FUNCTIONS)
    del _FUNCTIONS[:]
    for fn, args, kwargs in functions:
        try:
            fn(*args, **kwargs)
        except (Exception, SystemExit) as exc:
            log.exception(f"on_worker_exit function {_name(fn)} raised", exc,
                          function=_name(fn))


def run_atexit() -> None:
    """The interpreter's exit-time callbacks (the application's, and logging.shutdown),
    last registered first; Python reports a failing one itself and runs the rest."""
    atexit._run_exitfuncs()


def _name(fn: Callable[..., Any]) -> str:
    return getattr(fn, "__qualname__", None) or repr(fn)


__all__ = ["Budget", "on_worker_exit", "registered", "run_atexit", "run_exit_functions"]
