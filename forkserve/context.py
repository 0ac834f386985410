"""The request context: finish_request, shutdown functions and cancellation.

Owns: :class:`RequestContext` (one per request), the ``ContextVar`` that finds the current one
(per thread in the thread worker, per greenlet in the gevent worker), and
:class:`RequestCancelled`. Imports only the standard library and forkserve.logs.

- ``finish_request()`` ends the response for the client now (PHP-FPM's
  ``fastcgi_finish_request``); the request stays in flight until the app returns.
- ``register_shutdown_function(fn, *args, **kwargs)``: run when the request ends — normally,
  with an exception, or cancelled at the drain deadline or by --request-timeout
  (``RequestTimedOut``, a ``RequestCancelled``) — in registration order; an
  exception in one is logged and the next still runs.
"""

from __future__ import annotations

from contextvars import ContextVar
from typing import Any, Callable, Sequence

from forkserve.logs import Log


class RequestCancelled(BaseException):
    """Raised inside a request cancelled at the drain deadline (like trio's ``Cancelled``).

    A BaseException, so that an app's ``except Exception`` does not swallow it; its shutdown
    functions still run.
    """

    def __init__(self, reason: str = "cancelled at the drain deadline") -> None:
        super().__init__(reason)
        self.reason = reason


class RequestTimedOut(RequestCancelled):
    """The ``RequestCancelled`` of a request that ran past --request-timeout (catch
    ``RequestCancelled`` for both). Raised without arguments where it is thrown into a
    thread (an asynchronous exception can only be a class), so the reason is the class's."""

    def __init__(self, reason: str = "cancelled: its --request-timeout passed") -> None:
        super().__init__(reason)


class NoRequest(RuntimeError):
    """forkserve.finish_request() or register_shutdown_function() outside a request."""


class RequestContext:
    __slots__ = ("finisher", "finish_args", "functions", "finished", "cancelled", "timed_out",
                 "pool", "spans")

    def __init__(self, finisher: Callable[..., None], pool: Any = None, spans: Any = None,
                 finish_args: tuple[Any, ...] = ()) -> None:
        self.finisher = finisher  # finish(): finisher(*finish_args), once
        self.finish_args = finish_args
        self.pool = pool  # the worker's BackgroundPool (forkserve.background.submit)
        self.spans = spans  # the worker's span sink, or None (forkserve.telemetry.span)
        # The shutdown functions: none (an empty tuple, no list made) until one is registered.
        self.functions: Sequence[tuple[Callable[..., Any], tuple[Any, ...], dict[str, Any]]] = ()
        self.finished = False
        self.cancelled = False  # a cancel was sent into it (the drain's or the timeout's)
        self.timed_out = False  # that cancel was --request-timeout's

    def finish(self) -> None:
        if not self.finished:
            self.finished = True
            self.finisher(*self.finish_args)

    def run_shutdown_functions(self, log: Log) -> None:
        functions, self.functions = self.functions, ()
        for fn, args, kwargs in functions:
            try:
                try:
                    fn(*args, **kwargs)
                except Exception as exc:
                    log.exception(f"Shutdown function {_name(fn)} failed", exc)
            except RequestCancelled as exc:
                # Cancelled while cleaning up (a second cancel), in the function or while its
                # failure was being logged: stop this one, run the rest.
                log.exception(f"Shutdown function {_name(fn)} was cancelled", exc)


CURRENT: ContextVar[RequestContext | None] = ContextVar("forkserve_request", default=None)
# CURRENT's set and reset, bound once: CPython 3.11 specializes no method load on a
# ContextVar (its type has no generic getattr), so ``CURRENT.set(...)`` made a bound method
# object and threw it away, twice a request (70 ns of the pair's 170).
set_current = CURRENT.set
reset_current = CURRENT.reset


def current() -> RequestContext:
    context = CURRENT.get()
    if context is None:
        raise NoRequest("not inside a request served by forkserve")
    return context


def finish_request() -> None:
    """The response is complete for the client now; the app may go on working."""
    current().finish()


def register_shutdown_function(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
    """Run ``fn(*args, **kwargs)`` when the current request ends, however it ends."""
    context = current()
    functions = context.functions
    if not isinstance(functions, list):
        functions = context.functions = []
    functions.append((fn, args, kwargs))


def _name(fn: Callable[..., Any]) -> str:
    return getattr(fn, "__qualname__", None) or repr(fn)
