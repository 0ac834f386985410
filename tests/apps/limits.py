"""The app of the worker-recycling and request-timeout tests (issue 15).

Every route answers with the worker's pid (or says what it did) and takes its parameters from
the query string. ``out=PATH`` is a file the app and its shutdown functions append lines to, so
the test sees after the fact what ran: ``entered`` as the slow work begins, ``cancelled`` from
its ``except RequestCancelled`` clause (with the exception's class), ``shutdown`` from its
shutdown function.

Routes
- ``/grow?mib=5&upto=150``: keeps one more ``mib`` MiB bytearray (touched, so resident) in
  this worker, unless it keeps ``upto`` MiB already; answers the pid.
- ``/slow?out=&how=busy|chunks|sleep&seconds=60``: a request that outlives any timeout, inside
  a function named after how it waits: ``slow_busy_loop`` (a Python loop computing, never
  calling into C for long), ``slow_sleep_in_chunks`` (``time.sleep(0.05)`` over and over),
  ``slow_one_long_sleep`` (one ``time.sleep(seconds)``: a C call).
- ``/stream-hang?out=&seconds=60``: a chunked response whose first chunk is sent, then it
  hangs (sleep in chunks) inside ``stream_hangs_after_first_chunk``.
- anything else: the pid.

``alarmed()``: a factory that installs the app's own SIGALRM handler, then returns ``app``.
"""

from __future__ import annotations

import os
import signal
import time
from urllib.parse import parse_qs

import forkserve

KEPT: list[bytearray] = []  # what /grow keeps (a test app: module state is the point)


def _qs(environ):
    return {k: v[0] for k, v in parse_qs(environ.get("QUERY_STRING", "")).items()}


def _append(path, text):
    with open(path, "a", encoding="utf-8") as fh:
        fh.write(text + "\n")


def _respond(start_response, body, status="200 OK"):
    start_response(status, [("Content-Type", "text/plain"), ("Content-Length", str(len(body)))])
    return [body]


def _shutdown(out):
    _append(out, "shutdown")


def slow_busy_loop(seconds):
    end = time.monotonic() + seconds
    total = 0
    while time.monotonic() < end:
        for i in range(1000):
            total += i
    return total


def slow_sleep_in_chunks(seconds):
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        time.sleep(0.05)


def slow_one_long_sleep(seconds):
    time.sleep(seconds)


SLOW = {"busy": slow_busy_loop, "chunks": slow_sleep_in_chunks, "sleep": slow_one_long_sleep}


def stream_hangs_after_first_chunk(out, seconds):
    yield b"first chunk\n"
    _append(out, "entered")
    try:
        slow_sleep_in_chunks(seconds)
    except forkserve.RequestCancelled as exc:
        _append(out, f"cancelled {type(exc).__name__}")
        raise
    yield b"never sent\n"


def app(environ, start_response):
    path = environ["PATH_INFO"]
    q = _qs(environ)
    pid = str(os.getpid()).encode()
    if path == "/grow":
        mib = int(q.get("mib", "5"))
        if len(KEPT) * mib < int(q.get("upto", "150")):
            KEPT.append(bytearray(b"\x01" * (mib << 20)))
        return _respond(start_response, pid)
    if path == "/slow":
        out = q["out"]
        forkserve.register_shutdown_function(_shutdown, out)
        _append(out, "entered")
        try:
            SLOW[q.get("how", "chunks")](float(q.get("seconds", "60")))
        except forkserve.RequestCancelled as exc:
            _append(out, f"cancelled {type(exc).__name__}")
            raise
        return _respond(start_response, b"finished: no timeout")
    if path == "/stream-hang":
        out = q["out"]
        forkserve.register_shutdown_function(_shutdown, out)
        start_response("200 OK", [("Content-Type", "text/plain")])
        return stream_hangs_after_first_chunk(out, float(q.get("seconds", "60")))
    return _respond(start_response, pid)


def alarmed():
    signal.signal(signal.SIGALRM, lambda signum, frame: None)
    return app
