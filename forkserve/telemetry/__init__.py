"""Telemetry sinks that buffer in a worker and are flushed before it exits.

A sink has ``emit``, ``flush``, ``close`` (and ``reopen`` for files that logrotate moves).
"""

from forkserve.telemetry.accesslog import AccessLog

__all__ = ["AccessLog"]
