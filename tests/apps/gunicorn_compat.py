"""What a worker's process sees of -e/--env and --pythonpath (issue 15: gunicorn's spellings).

At import time (before any request: in the worker, or in the arbiter with --preload) it reads
``FOO`` and imports ``compat_extra`` if it can: a module that exists only in the directory
the test gives to --pythonpath. ``/seen`` answers what it saw then and sees now.
"""

from __future__ import annotations

import json
import os
import sys

FOO_AT_IMPORT = os.environ.get("FOO")
try:
    import compat_extra  # only on the path --pythonpath gives
    EXTRA_AT_IMPORT: str | None = compat_extra.VALUE
except ImportError:
    EXTRA_AT_IMPORT = None


def app(environ, start_response):
    body = json.dumps({
        "pid": os.getpid(),
        "foo_at_import": FOO_AT_IMPORT,
        "foo": os.environ.get("FOO"),
        "env": {k: v for k, v in os.environ.items() if k.startswith(("FOO", "FORKSERVE_PROC_NAME", "FORKSERVE_MAX_REQUESTS"))},
        "extra_at_import": EXTRA_AT_IMPORT,
        "sys_path_head": sys.path[:3],
    }).encode()
    start_response("200 OK", [("Content-Type", "application/json"),
                              ("Content-Length", str(len(body)))])
    return [body]
