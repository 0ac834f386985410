"""Answers ``FROZEN PID``: ``gc.get_freeze_count()`` in the worker that serves the request.

With ``--preload`` the arbiter freezes (gc.freeze) what it imported before forking, and a
worker inherits that permanent generation; every worker freezes what it inherited as it
starts; ``--no-gc-freeze``: nothing is frozen anywhere.

``/cycle``: builds a reference cycle, drops it and runs a full collection; answers
``collected`` when the collection freed it (what the app builds is never frozen).
"""

from __future__ import annotations

import gc
import os
import weakref


class Node:
    pass


def app(environ, start_response):
    if environ["PATH_INFO"] == "/cycle":
        node = Node()
        node.self = node
        alive = weakref.ref(node)
        del node
        gc.collect()
        body = b"collected" if alive() is None else b"leaked"
    else:
        body = f"{gc.get_freeze_count()} {os.getpid()}".encode()
    start_response("200 OK", [("Content-Type", "text/plain"), ("Content-Length", str(len(body)))])
    return [body]
