"""The per-worker background pool: ``forkserve.background.submit(fn, *args, **kwargs)``.

Owns: a small pool of daemon threads in each worker for work not tied to a response (send an
email, warm a cache). Tasks count in the worker's ``background_tasks`` (queued and running),
the drain waits for them, and when the pool is closed the tasks that never started are
reported by name, never dropped silently. Threads start on the first submit: a worker that
never uses the pool has none.

# -- runs in pool threads -----------------------------------------------------------------------
``_run`` runs in the pool's threads; everything it shares with the worker's main thread is
under ``_lock``, and it tells the main thread about a finished task through ``notify``.
"""

from __future__ import annotations

import threading
from collections import deque
from typing import Any, Callable

from forkserve.context import CURRENT, RequestContext, current
from forkserve.counters import Writer
from forkserve.logs import Log


class PoolClosed(RuntimeError):
    """submit() after the worker began shutting down its pool."""


class BackgroundPool:
    def __init__(self, threads: int, counters: Writer, log: Log, notify: Callable[[], None],
                 spans: Any = None) -> None:
        self.size = threads
        self.spans = spans  # tasks record spans into the worker's sink, as requests do
        self.counters = counters
        self.log = log
        self.notify = notify
        self._lock = threading.Condition()
        self._queue: deque[tuple[Callable[..., Any], tuple[Any, ...], dict[str, Any]]] = deque()
        self._threads: list[threading.Thread] = []
        self._running: dict[int, str] = {}  # thread id -> task name
        self._closed = False

    def submit(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
        with self._lock:
            if self._closed:
                raise PoolClosed(f"the background pool is closed; {_name(fn)} was not queued")
            self._queue.append((fn, args, kwargs))
            self.counters.background_tasks += 1
            idle_threads = len(self._threads) - len(self._running)
            if len(self._threads) < self.size and len(self._queue) > idle_threads:
                thread = threading.Thread(target=self._run, name="forkserve-background", daemon=True)
                self._threads.append(thread)
                thread.start()
            self._lock.notify()
        self.notify()

    def _run(self) -> None:
        me = threading.get_ident()
        while True:
            with self._lock:
                while not self._queue and not self._closed:
                    self._lock.wait()
                if not self._queue:
                    return
                fn, args, kwargs = self._queue.popleft()
                self._running[me] = _name(fn)
            # A task runs in a context of its own: spans go to the worker's sink, and shutdown
            # functions it registers run when it ends.
            context = RequestContext(_nothing, self, self.spans)
            token = CURRENT.set(context)
            try:
                fn(*args, **kwargs)
            except BaseException as exc:  # a task's failure is logged, never kills the pool
                self.log.exception(f"Background task {_name(fn)} failed", exc)
            finally:
                context.run_shutdown_functions(self.log)
                CURRENT.reset(token)
                with self._lock:
                    del self._running[me]
                    self.counters.background_tasks -= 1
                self.notify()

    @property
    def idle(self) -> bool:
        with self._lock:
            return not self._queue and not self._running

    def close(self) -> list[str]:
        """No more tasks: report (and drop) the queued ones; running ones may finish."""
        with self._lock:
            self._closed = True
            unstarted = [_name(fn) for fn, _, _ in self._queue]
            self._queue.clear()
            self.counters.background_tasks -= len(unstarted)
            self._lock.notify_all()
        for name in unstarted:
            self.log.warning("Background task not started before shutdown", task=name)
        return unstarted

    def running(self) -> list[str]:
        with self._lock:
            return list(self._running.values())


def submit(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
    """Run ``fn(*args, **kwargs)`` in this worker's background pool (from inside a request)."""
    pool = current().pool
    if pool is None:
        raise PoolClosed("this worker has no background pool")
    pool.submit(fn, *args, **kwargs)


def _nothing() -> None:
    return None  # finish_request() in a background task: there is no response to finish


def _name(fn: Callable[..., Any]) -> str:
    return getattr(fn, "__qualname__", None) or repr(fn)
