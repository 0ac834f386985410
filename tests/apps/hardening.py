"""WSGI app for tests/integration/test_http_hardening.py, behind wsgiref's PEP 3333 validator
(so an environ the spec does not allow, such as PATH_INFO "*", is a 500 the tests see).

Routes: ``/pid`` (the worker serving this connection), ``/upload`` (reads the body in 64 KiB
pieces, never whole, and answers its length), ``/environ`` (the request's keys the tests
check, as JSON), anything else ``hello``. ``OPTIONS *`` answers like ``/environ``.
"""

from __future__ import annotations

import json
import os
from wsgiref.validate import validator

KEYS = ("REQUEST_METHOD", "PATH_INFO", "QUERY_STRING", "RAW_URI", "SERVER_PROTOCOL", "HTTP_HOST",
        "CONTENT_TYPE")


def _respond(start_response, body, status="200 OK"):
    start_response(status, [("Content-Type", "text/plain"), ("Content-Length", str(len(body)))])
    return [body]


def _inner(environ, start_response):
    path = environ["PATH_INFO"]
    if path == "/pid":
        return _respond(start_response, str(os.getpid()).encode())
    if path == "/upload":
        stream, total = environ["wsgi.input"], 0
        while True:
            piece = stream.read(65536)
            if not piece:
                break
            total += len(piece)
        return _respond(start_response, str(total).encode())
    if path == "/environ" or environ.get("RAW_URI") == "*":
        seen = {key: environ.get(key) for key in KEYS}
        return _respond(start_response, json.dumps(seen).encode())
    return _respond(start_response, b"hello\n")


app = validator(_inner)
