"""Spans: ``forkserve.telemetry.span(name, **attributes)`` and the sinks that buffer them.

A span recorded inside a request goes to the worker's span sink, buffered in memory and
written when the worker goes idle, when the buffer is large, and always before the worker
exits (every path but SIGKILL). ``SpanLog`` writes one JSON object per line; when the
``opentelemetry-sdk`` package is installed, ``OpenTelemetrySink`` hands spans to an SDK
tracer provider instead and ``flush`` is its ``force_flush``.
"""

from __future__ import annotations

import json
import os
import time
from contextlib import contextmanager
from typing import Any, Iterator

from forkserve.context import CURRENT

FLUSH_AT = 256  # spans


class SpanLog:
    def __init__(self, path: str) -> None:
        self.path = path
        self.fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o644)
        self._spans: list[dict[str, Any]] = []
        self._next_flush = 0.0

    def emit(self, record: dict[str, Any]) -> None:
        self._spans.append(record)
        if len(self._spans) >= FLUSH_AT:
            self.flush()

    def flush(self) -> None:
        if not self._spans:
            return
        self._next_flush = time.monotonic() + 1.0
        # Swapped, not cleared: background threads may emit while this runs.
        spans, self._spans = self._spans, []
        data = "".join(json.dumps(r, default=str, separators=(",", ":")) + "\n"
                       for r in spans).encode("utf-8")
        while data:
            data = data[os.write(self.fd, data):]

    def flush_if_due(self) -> None:
        """After each request: write when a second has passed since the last write."""
        if self._spans and time.monotonic() >= self._next_flush:
            self.flush()

    def reopen(self) -> None:
        self.flush()
        old = self.fd
        self.fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o644)
        os.close(old)

    def close(self) -> None:
        self.flush()
        os.close(self.fd)
        self.fd = -1


class Span:
    """What the ``with`` block gets: add attributes while the span is open."""

    __slots__ = ("name", "attributes", "start")

    def __init__(self, name: str, attributes: dict[str, Any]) -> None:
        self.name = name
        self.attributes = attributes
        self.start = time.time()

    def set_attribute(self, key: str, value: Any) -> None:
        self.attributes[key] = value


@contextmanager
def span(name: str, **attributes: Any) -> Iterator[Span]:
    """Record a span around a block. Outside a request, or with no sink, it costs a clock read."""
    record = Span(name, attributes)
    try:
        yield record
    except BaseException as exc:
        record.attributes.setdefault("error", type(exc).__name__)
        raise
    finally:
        context = CURRENT.get()
        sink = context.spans if context is not None else None
        if sink is not None:
            end = time.time()
            sink.emit({"name": record.name, "start": record.start, "end": end,
                       "duration": end - record.start, "attributes": record.attributes,
                       "pid": os.getpid()})
