"""WSGI app for the request property tests and the connection fuzzer: it answers with what
reached it, so the client can check that against what it sent.

Every request's body is read whole; the answer is ``200`` with ``X-Digest``, a digest of the
method, the target as sent (``RAW_URI``) and the body (``tests.http.invariants.digest``: in a
header, so a HEAD answer carries it too), and a JSON body saying the same in clear. Behind
wsgiref's PEP 3333 validator: an environ the spec does not allow is a 500 the tests see.

When ``DIGEST_RECORD`` names a file, each call appends its digest as one line before
it answers: requests that reached the app and were never answered show there.
"""

from __future__ import annotations

import hashlib
import json
import os
from wsgiref.validate import validator


def _digest(method, target, body):
    # As tests.http.invariants.digest (not imported: the app must not depend on the oracle).
    return hashlib.sha256(method.encode("ascii") + b"\0" + target + b"\0" + body).hexdigest()[:32]


def _record(line):
    path = os.environ.get("DIGEST_RECORD")
    if not path:
        return
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line.encode("ascii") + b"\n")
    finally:
        os.close(fd)


def _inner(environ, start_response):
    stream = environ["wsgi.input"]
    body = b"".join(iter(lambda: stream.read(65536), b""))  # (the validator wants a size)
    method = environ["REQUEST_METHOD"]
    target = environ["RAW_URI"].encode("latin-1")
    digest = _digest(method, target, body)
    _record(digest)
    seen = {"method": method, "target": environ["RAW_URI"],
            "protocol": environ["SERVER_PROTOCOL"], "length": len(body), "digest": digest}
    data = json.dumps(seen).encode("ascii") + b"\n"
    start_response("200 OK", [("Content-Type", "application/json"),
                              ("Content-Length", str(len(data))), ("X-Digest", digest)])
    return [data]


app = validator(_inner)
