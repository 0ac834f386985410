"""One span per request, as whoever the worker runs as (the --user log-file tests).

Imports only what the server imported before forking (see tests.apps.identity): a worker
dropped to ``nobody`` may not read the interpreter's own files."""

from __future__ import annotations

import os

import forkserve.telemetry


def app(environ, start_response):
    with forkserve.telemetry.span("as-user", uid=os.getuid()):
        body = str(os.getuid()).encode()
    start_response("200 OK", [("Content-Type", "text/plain"), ("Content-Length", str(len(body)))])
    return [body]
