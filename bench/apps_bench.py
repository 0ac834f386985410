"""The WSGI apps of bench/run.py's workloads: every server is given the same callable.

    hello   examples.hello:app (14 bytes; not here, the example itself)
    big     ``big``: a 64 KiB body in one bytes object
    file    ``file``: a 1 MiB file through ``environ['wsgi.file_wrapper']``; the path is
            ``$BENCH_FILE`` (bench/run.py writes the file in a temporary directory)
    json    ``json_echo``: the POST body (1 KiB of JSON) parsed and dumped back
    sleep   ``sleep``: ``time.sleep(0.01)``, then 2 bytes (an I/O-bound request: under
            gevent workers the monkey-patched sleep yields to other connections)
    flask   examples.flask_app.app:app, ``GET /api/hello`` (not here either)

Each answer has a Content-Length, so a keep-alive client can reuse the connection with every
server. Imports only the standard library (a server's RSS is not inflated by this module).
"""

from __future__ import annotations

import json
import os
import time
from typing import Any, Callable, Iterable

StartResponse = Callable[..., Any]
Environ = dict[str, Any]

BIG = b"x" * (64 * 1024)
BIG_HEADERS = [("Content-Type", "application/octet-stream"), ("Content-Length", str(len(BIG)))]
SLEPT = b"ok"
FILE_CHUNK = 64 * 1024


def big(environ: Environ, start_response: StartResponse) -> Iterable[bytes]:
    start_response("200 OK", BIG_HEADERS)
    return [BIG]


def file(environ: Environ, start_response: StartResponse) -> Iterable[bytes]:
    path = os.environ["BENCH_FILE"]
    fh = open(path, "rb")  # the server closes it through the iterable's close()
    size = os.fstat(fh.fileno()).st_size
    wrapper = environ.get("wsgi.file_wrapper")
    # X-File-Wrapper tells bench/run.py whether the server has one (PEP 3333 makes it optional).
    start_response("200 OK", [("Content-Type", "application/octet-stream"),
                              ("Content-Length", str(size)),
                              ("X-File-Wrapper", "no" if wrapper is None else "yes")])
    if wrapper is not None:
        return wrapper(fh, FILE_CHUNK)  # type: ignore[no-any-return]
    # A server without one gets the file in chunks (bench/run.py's table says which).
    return _chunks(fh)


def _chunks(fh: Any) -> Iterable[bytes]:
    with fh:
        while chunk := fh.read(FILE_CHUNK):
            yield chunk


def json_echo(environ: Environ, start_response: StartResponse) -> Iterable[bytes]:
    length = int(environ.get("CONTENT_LENGTH") or 0)
    body = environ["wsgi.input"].read(length)
    answer = json.dumps(json.loads(body)).encode()
    start_response("200 OK", [("Content-Type", "application/json"),
                              ("Content-Length", str(len(answer)))])
    return [answer]


def sleep(environ: Environ, start_response: StartResponse) -> Iterable[bytes]:
    time.sleep(0.01)
    start_response("200 OK", [("Content-Type", "text/plain"), ("Content-Length", "2")])
    return [SLEPT]


def json_body() -> bytes:
    """The 1 KiB JSON document the json workload POSTs (exactly 1,024 bytes)."""
    items = [{"id": i, "name": f"item-{i:04d}", "ok": i % 2 == 0} for i in range(20)]
    base = json.dumps({"items": items, "pad": ""}, separators=(",", ":")).encode()
    assert len(base) <= 1024, len(base)
    return json.dumps({"items": items, "pad": "p" * (1024 - len(base))},
                      separators=(",", ":")).encode()
