"""An app whose code "version" is read at import time, for the reload and upgrade tests.

``RELOAD_VERSION_FILE=PATH``: the import reads PATH (stripped) as the version; a test writes a
new version there and reloads, and every response then shows which code served it. A version
file that reads ``broken`` makes the import raise (a broken deploy).

Routes: ``/`` answers ``VERSION PID``; everything else is ``tests.apps.basic.app`` (/pid,
/block...).
"""

from __future__ import annotations

import os

from tests.apps.basic import app as _base

_path = os.environ.get("RELOAD_VERSION_FILE")
if _path:
    with open(_path, encoding="utf-8") as _fh:
        VERSION = _fh.read().strip()
else:
    VERSION = "unversioned"
if VERSION == "broken":
    raise RuntimeError("broken deploy on purpose (the version file says 'broken')")


def app(environ, start_response):
    if environ["PATH_INFO"] == "/":
        body = f"{VERSION} {os.getpid()}".encode()
        start_response("200 OK", [("Content-Type", "text/plain"),
                                  ("Content-Length", str(len(body)))])
        return [body]
    return _base(environ, start_response)
