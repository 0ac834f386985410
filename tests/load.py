"""A small, bounded load generator for the reload and handoff tests.

``Load(port, threads=4, seconds=30)`` runs ``threads`` client threads, each sending ``GET path``
on a fresh connection (``Connection: close``) in a loop until ``stop()`` is called or ``seconds``
have passed. Every request has its own timeout. It records the successes (status 200, with the
response body and when it arrived) and every failure with its exception or status, so a test can
assert ``load.failures == []`` and look at which code answered when.

Fresh connections on purpose: what a reload can break is the accept queue (a connection refused,
or reset in a listener that closed), and every request here goes through it.
"""

from __future__ import annotations

import threading
import time
from typing import Callable

from tests.harness import get, wait_for


class Load:
    def __init__(self, port: int, path: str = "/", threads: int = 4, seconds: float = 30.0,
                 timeout: float = 5.0) -> None:
        self.port = port
        self.path = path
        self.threads = threads
        self.seconds = seconds
        self.timeout = timeout
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self.bodies: list[tuple[float, bytes]] = []  # (monotonic time of the response, body)
        self.failures: list[str] = []
        self.started_at = 0.0
        self.stopped_at: float | None = None
        self._threads = [threading.Thread(target=self._run, name=f"load-{i}", daemon=True)
                         for i in range(threads)]

    # -- running --------------------------------------------------------------------------
    def start(self) -> "Load":
        self.started_at = time.monotonic()
        for thread in self._threads:
            thread.start()
        return self

    def _run(self) -> None:
        deadline = self.started_at + self.seconds
        while not self._stop.is_set() and time.monotonic() < deadline:
            try:
                response = get(self.port, self.path, timeout=self.timeout)
            except Exception as exc:  # noqa: BLE001 - every failure is recorded, none hidden
                with self._lock:
                    self.failures.append(f"{time.monotonic() - self.started_at:.3f}s {exc!r}")
                continue
            with self._lock:
                if response.status == 200:
                    self.bodies.append((time.monotonic(), response.body))
                else:
                    self.failures.append(f"{time.monotonic() - self.started_at:.3f}s "
                                         f"status {response.status}: {response.body[:200]!r}")

    def stop(self, timeout: float = 10.0) -> "Load":
        self._stop.set()
        deadline = time.monotonic() + timeout
        for thread in self._threads:
            thread.join(max(deadline - time.monotonic(), 0.0))
        alive = [t.name for t in self._threads if t.is_alive()]
        if self.stopped_at is None:
            self.stopped_at = time.monotonic()
        assert not alive, f"load threads did not stop within {timeout}s: {alive}"
        return self

    def __enter__(self) -> "Load":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- results --------------------------------------------------------------------------
    @property
    def successes(self) -> int:
        with self._lock:
            return len(self.bodies)

    def since(self, moment: float) -> list[bytes]:
        """Bodies of the responses that arrived after ``moment`` (a ``time.monotonic()``)."""
        with self._lock:
            return [body for at, body in self.bodies if at > moment]

    def wait_requests(self, count: int, timeout: float = 10.0) -> None:
        """Until ``count`` more requests have succeeded than now."""
        target = self.successes + count
        wait_for(lambda: self.successes >= target or self.failures, timeout,
                 f"{count} more successful requests")

    def wait_body(self, predicate: Callable[[bytes], bool], after: float, timeout: float = 10.0,
                  what: str = "a matching response") -> bytes:
        """The first body after ``after`` for which ``predicate`` holds."""
        def find() -> bytes | None:
            return next((b for b in self.since(after) if predicate(b)), None)
        return wait_for(find, timeout, what)  # type: ignore[no-any-return]

    @property
    def elapsed(self) -> float:
        end = self.stopped_at if self.stopped_at is not None else time.monotonic()
        return end - self.started_at

    @property
    def rate(self) -> float:
        return self.successes / self.elapsed if self.elapsed > 0 else 0.0

    def summary(self) -> str:
        return (f"{self.successes} ok, {len(self.failures)} failed in {self.elapsed:.1f}s "
                f"({self.rate:.0f} req/s, {self.threads} client threads, a new connection each)")
