"""Who the worker serving a request is: its uid, gid and groups (the privilege-drop tests).

Imports only what the server itself has imported before it forks: a worker dropped to
``nobody`` may not be able to read the interpreter's own files (a pyenv under a private
/root), so a module it would load from disk after the drop is not this test's subject.
"""

from __future__ import annotations

import json
import os


def app(environ, start_response):
    body = json.dumps({"uid": os.getuid(), "euid": os.geteuid(), "gid": os.getgid(),
                       "groups": sorted(os.getgroups())}).encode()
    start_response("200 OK", [("Content-Type", "application/json"),
                              ("Content-Length", str(len(body)))])
    return [body]
