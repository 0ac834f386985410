"""WSGI app for the HTTP/WSGI integration tests: ``tests.apps.basic:app`` plus a few routes, and a
record of every call.

When ``FORKSERVE_TEST_RECORD`` names a file, each call of the app appends one line
``METHOD PATH`` to it before anything else happens. A request the server refuses must leave
no line there: that is how the tests prove it never reached the application. The line is
written before the app can respond, so once a client holds a response, the record of that
request is complete.
"""

from __future__ import annotations

import json
import os

from tests.apps.basic import app as base_app


def _record(environ):
    path = os.environ.get("FORKSERVE_TEST_RECORD")
    if not path:
        return
    line = f"{environ['REQUEST_METHOD']} {environ['PATH_INFO']}\n".encode("latin-1", "replace")
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line)
    finally:
        os.close(fd)


def app(environ, start_response):
    _record(environ)
    path = environ["PATH_INFO"]
    if path == "/read-past-end":
        # Read the whole body, then keep reading: every further read must be b"" at once.
        stream = environ["wsgi.input"]
        body = stream.read()
        after = {
            "read()": stream.read().decode("latin-1"),
            "read(5)": stream.read(5).decode("latin-1"),
            "readline()": stream.readline().decode("latin-1"),
            "readlines()": [line.decode("latin-1") for line in stream.readlines()],
        }
        data = json.dumps({"body": body.decode("latin-1"), "after": after}).encode()
        start_response("200 OK", [("Content-Type", "application/json"),
                                  ("Content-Length", str(len(data)))])
        return [data]
    if path == "/echo-stream":
        # Each line goes back (through write()) as soon as it is read, so a client that waits
        # for the echo of line 1 before sending line 2 proves the body is streamed.
        write = start_response("200 OK", [("Content-Type", "text/plain")])
        for line in environ["wsgi.input"]:
            write(line)
        return []
    if path == "/len":
        # The body's length, read in small pieces.
        stream, total = environ["wsgi.input"], 0
        while True:
            piece = stream.read(4096)
            if not piece:
                break
            total += len(piece)
        return _text(start_response, str(total))
    return base_app(environ, start_response)


def _text(start_response, body):
    data = body.encode()
    start_response("200 OK", [("Content-Type", "text/plain"), ("Content-Length", str(len(data)))])
    return [data]
