"""Spans: ``forkserve.telemetry.span(name, **attributes)`` and the sinks that buffer them.

A span recorded inside a request goes to the worker's span sink, buffered in memory and
written when the worker goes idle, when the buffer is large, and always before the worker
exits (every path but SIGKILL). ``SpanLog`` writes one JSON object per line; when the
``opentelemetry-sdk`` package is installed, ``OpenTelemetrySink`` hands spans to an SDK
tracer provider instead and ``flush`` is its ``force_flush``.

A span log that cannot be written (a full disk) drops the spans and serving goes on; the loss
is counted and told at a bounded rate (:mod:`forkserve.telemetry.losses`).
"""

from __future__ import annotations

import json
import os
import sys
import time
from contextlib import contextmanager
from typing import Any, Iterator

from forkserve.context import CURRENT
from forkserve.telemetry.losses import ErrorSink, LostLines, write_all

FLUSH_AT = 256  # spans


class SpanLog:
    def __init__(self, path: str, errors: ErrorSink | None = None) -> None:
        self.path = path
        self.losses = LostLines(f"span log {path}", errors)
        # As forkserve.logs.open_append (the arbiter's check before forking opens it so).
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
        try:
            write_all(self.fd, data)
        except OSError as exc:
            # Raised here, it would end the request (or the worker's exit path) over a log.
            self.losses.failed(len(spans), exc)
            return
        self.losses.succeeded()

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


class OpenTelemetrySink:
    """The app's OpenTelemetry SDK tracer provider, as a sink.

    Apps that use OpenTelemetry configure a global ``TracerProvider`` whose
    ``BatchSpanProcessor`` buffers spans in the worker and exports them every few seconds: a
    worker that exits without ``force_flush`` loses the last batch. Whenever the app has
    imported the SDK, this sink records ``forkserve.telemetry.span`` spans into that provider
    and flushes (then shuts down) the provider before the worker exits.
    """

    def __init__(self) -> None:
        from opentelemetry import trace

        self._trace = trace

    @staticmethod
    def wanted() -> bool:
        return "opentelemetry.sdk.trace" in sys.modules

    def emit(self, record: dict[str, Any]) -> None:
        tracer = self._trace.get_tracer("forkserve")
        attributes = {k: v if isinstance(v, (str, bool, int, float)) else str(v)
                      for k, v in record["attributes"].items()}
        otel_span = tracer.start_span(record["name"], start_time=int(record["start"] * 1e9),
                                      attributes=attributes)
        otel_span.end(end_time=int(record["end"] * 1e9))

    def flush(self) -> None:
        """While serving, the SDK's processor exports on its own schedule (a force_flush
        here would block the worker on the exporter's network calls)."""
        return None

    def close(self) -> None:
        provider = self._trace.get_tracer_provider()
        force_flush = getattr(provider, "force_flush", None)
        if force_flush is not None:
            force_flush(5000)
        shutdown = getattr(self._trace.get_tracer_provider(), "shutdown", None)
        if shutdown is not None:
            shutdown()


class Sinks:
    """Several span sinks behind one: emit to each, flush and close each."""

    def __init__(self, sinks: list[Any]) -> None:
        self.sinks = sinks

    def emit(self, record: dict[str, Any]) -> None:
        for sink in self.sinks:
            sink.emit(record)

    def flush(self) -> None:
        for sink in self.sinks:
            sink.flush()

    def flush_if_due(self) -> None:
        for sink in self.sinks:
            due = getattr(sink, "flush_if_due", None)
            if due is not None:
                due()

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()


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
