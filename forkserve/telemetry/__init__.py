"""Telemetry sinks that buffer in a worker and are flushed before it exits.

A sink has ``emit``, ``flush``, ``close`` (and ``reopen`` for files that logrotate moves):
the access log, and the span log behind ``forkserve.telemetry.span``.
"""

from forkserve.telemetry.accesslog import AccessLog
from forkserve.telemetry.spans import Span, SpanLog, span

__all__ = ["AccessLog", "Span", "SpanLog", "span"]
