"""The basic WSGI apps most integration tests run (the other modules of tests.apps build on it).

``app`` routes on PATH_INFO. Requests are held in flight by blocking on a FIFO the test opens
(``/block?fifo=PATH``), never by sleeping.
"""

from __future__ import annotations

import json
import os
import select
import time
from urllib.parse import parse_qs
from wsgiref.validate import validator


def wait_gate(path):
    """Until the test has opened the FIFO and closed it again. Non-blocking open and a poll
    wait: cooperative under gevent (a blocking open() of a FIFO would freeze the whole
    worker), and interruptible by signals in a sync worker."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    try:
        poller = select.poll()
        poller.register(fd, select.POLLIN | select.POLLHUP)
        while True:
            poller.poll()
            try:
                if not os.read(fd, 4096):
                    return
            except BlockingIOError:
                continue
    finally:
        os.close(fd)


def _qs(environ):
    return {k: v[0] for k, v in parse_qs(environ.get("QUERY_STRING", "")).items()}


def _text(start_response, status, body, headers=()):
    data = body.encode() if isinstance(body, str) else body
    start_response(status, [("Content-Type", "text/plain"), ("Content-Length", str(len(data))),
                            *headers])
    return [data]


def _json(start_response, data, status="200 OK"):
    body = json.dumps(data).encode()
    start_response(status, [("Content-Type", "application/json"),
                            ("Content-Length", str(len(body)))])
    return [body]


def app(environ, start_response):
    path = environ["PATH_INFO"]
    q = _qs(environ)
    if path == "/":
        return _text(start_response, "200 OK", "hello\n")
    if path == "/pid":
        return _text(start_response, "200 OK", str(os.getpid()))
    if path == "/environ":
        safe = {k: v for k, v in environ.items() if isinstance(v, (str, bool, int, tuple, dict))}
        return _text(start_response, "200 OK", json.dumps(safe))
    if path == "/echo":
        body = environ["wsgi.input"].read()
        return _text(start_response, "200 OK", body)
    if path == "/echo-lines":
        lines = list(environ["wsgi.input"])
        return _text(start_response, "200 OK", json.dumps([l.decode("latin-1") for l in lines]))
    if path == "/read-some":
        # reads only part of the body; the server must discard the rest
        data = environ["wsgi.input"].read(int(q.get("n", "1")))
        return _text(start_response, "200 OK", data)
    if path == "/ignore-body":
        return _text(start_response, "200 OK", "ignored")
    if path == "/chunked":
        # no Content-Length: chunked on HTTP/1.1, close-delimited on HTTP/1.0
        start_response("200 OK", [("Content-Type", "text/plain")])
        return (part.encode() for part in ["one ", "two ", "three"])
    if path == "/write":
        write = start_response("200 OK", [("Content-Type", "text/plain")])
        write(b"written ")
        return [b"and returned"]
    if path == "/status":
        code = q.get("code", "200")
        start_response(f"{code} Custom", [("Content-Type", "text/plain")])
        return [b"body that must not be sent for 1xx/204/304"]
    if path == "/file":
        fh = open(q["path"], "rb")
        start_response("200 OK", [("Content-Type", "application/octet-stream")])
        return environ["wsgi.file_wrapper"](fh, 8192)
    if path == "/block":
        # Held in flight until the test opens the FIFO for writing and closes it again.
        wait_gate(q["fifo"])
        return _text(start_response, "200 OK", "released")
    if path == "/block-holding-log-locks":
        # What a handler for the arbiter's death may interrupt: a request inside logging's
        # module lock and the lock of a handler on forkserve.error (an app that adds its own,
        # gunicorn's Flask recipe), held while it waits. Only a worker that takes neither
        # lock to write its last line gets out.
        import logging

        error = logging.getLogger("forkserve.error")
        handler = logging.StreamHandler(open(os.devnull, "w"))
        error.addHandler(handler)
        error._cache.clear()  # the next level check of a logger takes the module lock
        logging._lock.acquire()
        handler.acquire()
        try:
            wait_gate(q["fifo"])
        finally:
            handler.release()
            logging._lock.release()
            error.removeHandler(handler)
            handler.stream.close()
        return _text(start_response, "200 OK", "released")
    if path == "/sleep":
        # A request that takes a while (the workload of the load tests, not a test's wait).
        time.sleep(int(q.get("ms", "200")) / 1000.0)
        return _text(start_response, "200 OK", "slept\n")
    if path == "/big":
        size = int(q.get("size", "1000000"))
        return _text(start_response, "200 OK", b"x" * size)
    if path == "/big-stream":
        # The same body streamed: a generator of 64 KiB pieces (the same object each time).
        size = int(q.get("size", "1000000"))
        piece = b"x" * 65536
        start_response("200 OK", [("Content-Type", "text/plain"), ("Content-Length", str(size))])
        return (piece[:min(65536, size - at)] for at in range(0, size, 65536))
    # -- misbehaving apps -----------------------------------------------------------------
    if path == "/raise":
        raise RuntimeError("the app failed on purpose")
    if path == "/raise-after-headers":
        start_response("200 OK", [("Content-Type", "text/plain")])

        def gen():
            yield b"partial"
            raise RuntimeError("failed mid-body")
        return gen()
    if path == "/no-start-response":
        return [b"never started"]
    if path == "/return-str":
        start_response("200 OK", [("Content-Type", "text/plain")])
        return "a str, not bytes"
    if path == "/header-injection":
        start_response("200 OK", [("X-Evil", "a\r\nSet-Cookie: pwned=1")])
        return [b"nope"]
    if path == "/header-control":
        start_response("200 OK", [("X-Ctl", "a\x1bb")])  # ESC: a control character
        return [b"nope"]
    if path == "/bad-header-name":
        start_response("200 OK", [("Bad Name", "x")])
        return [b"nope"]
    if path == "/too-long":
        start_response("200 OK", [("Content-Length", "5")])
        return [b"0123456789"]
    if path == "/too-short":
        start_response("200 OK", [("Content-Length", "10")])
        return [b"01234"]
    if path == "/exit":
        os._exit(3)
    return _text(start_response, "404 Not Found", "not found\n")


def validated(environ, start_response):
    """The same app behind wsgiref's PEP 3333 validator: any violation raises or warns."""
    return validator(_validated_inner)(environ, start_response)


def _validated_inner(environ, start_response):
    path = environ["PATH_INFO"]
    if path == "/echo":
        body = environ["wsgi.input"].read(int(environ.get("CONTENT_LENGTH") or 0))
        start_response("200 OK", [("Content-Type", "text/plain"), ("Content-Length", str(len(body)))])
        return [body]
    if path == "/stream":
        start_response("200 OK", [("Content-Type", "text/plain")])
        return iter([b"a", b"b", b"c"])
    if path == "/lines":
        lines = [environ["wsgi.input"].readline() for _ in range(2)]
        start_response("200 OK", [("Content-Type", "text/plain")])
        return lines
    environ["wsgi.errors"].write("validated request\n")
    start_response("200 OK", [("Content-Type", "text/plain")])
    return [b"ok"]


def factory(greeting="hi"):
    """For MODULE:factory(...) syntax."""
    def inner(environ, start_response):
        return _text(start_response, "200 OK", greeting)
    return inner


not_callable = 42

if "TESTAPP_FAIL_IMPORT" in os.environ:
    raise ImportError("failing on purpose (TESTAPP_FAIL_IMPORT)")
