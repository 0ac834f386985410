"""Answers ``FROZEN PID``: ``gc.get_freeze_count()`` in the worker that serves the request.

With ``--preload`` the arbiter freezes (gc.freeze) what it imported before forking, and a
worker inherits that permanent generation; without it, nothing is frozen anywhere.
"""

from __future__ import annotations

import gc
import os


def app(environ, start_response):
    body = f"{gc.get_freeze_count()} {os.getpid()}".encode()
    start_response("200 OK", [("Content-Type", "text/plain"), ("Content-Length", str(len(body)))])
    return [body]
