"""The apps of the lifecycle matrix (bench/lifecycle.py): hello, a 200 ms sleep, a 1 MiB stream.

Every response carries ``X-Pid`` (the worker that answered), so the bench can tell when a
replacement or a new generation serves; ``/readyz`` answers 200 from the app itself (HAProxy's
health check for servers without a status server, i.e. gunicorn). The bodies are fixed, so the
client checks every byte: a short or wrong body is a failure, never an ok.

- ``hello``: ``examples.hello:app`` as is, plus the ``X-Pid`` header.
- ``sleep``: ``time.sleep(0.2)`` then a short body (cooperative under gevent: the worker
  monkey-patches ``time``).
- ``stream``: 1 MiB in 16 chunks of 64 KiB and no Content-Length, so HTTP/1.1 responses are
  chunked and a stream cut short is seen by the client's framing.
"""

from __future__ import annotations

import os
import time
from typing import Any, Callable, Iterable

from examples.hello import app as _hello

SLEEP_SECONDS = 0.2
SLEPT = b"slept 200 ms\n"
CHUNK = bytes(range(256)) * 256  # 64 KiB
CHUNKS = 16
STREAM = CHUNK * CHUNKS  # 1 MiB
HELLO = b"Hello, World!\n"

StartResponse = Callable[..., Any]


def _pid_header() -> tuple[str, str]:
    return ("X-Pid", str(os.getpid()))


def _readyz(start_response: StartResponse) -> list[bytes]:
    start_response("200 OK", [("Content-Type", "text/plain"), ("Content-Length", "6"), _pid_header()])
    return [b"ready\n"]


def hello(environ: dict[str, Any], start_response: StartResponse) -> Iterable[bytes]:
    if environ.get("PATH_INFO") == "/readyz":
        return _readyz(start_response)

    def with_pid(status: str, headers: list[tuple[str, str]], *exc: Any) -> Any:
        return start_response(status, [*headers, _pid_header()], *exc)
    return _hello(environ, with_pid)  # type: ignore[no-any-return]


def sleep(environ: dict[str, Any], start_response: StartResponse) -> Iterable[bytes]:
    if environ.get("PATH_INFO") == "/readyz":
        return _readyz(start_response)
    time.sleep(SLEEP_SECONDS)
    start_response("200 OK", [("Content-Type", "text/plain"), ("Content-Length", str(len(SLEPT))),
                              _pid_header()])
    return [SLEPT]


def stream(environ: dict[str, Any], start_response: StartResponse) -> Iterable[bytes]:
    if environ.get("PATH_INFO") == "/readyz":
        return _readyz(start_response)
    start_response("200 OK", [("Content-Type", "application/octet-stream"), _pid_header()])
    return (CHUNK for _ in range(CHUNKS))


# What each app answers to GET /: the client compares the whole body with it.
EXPECTED = {"hello": HELLO, "sleep": SLEPT, "stream": STREAM}
