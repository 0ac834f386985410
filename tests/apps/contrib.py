"""The app of the contrib tests (issue 14): ``/orphan?fifo=PATH`` leaves an orphan behind, as
an app that runs ``cmd &`` through a shell does; everything else is ``tests.apps.basic.app``.

The shell starts ``cat FIFO`` in the background and exits at once (the worker reaps the
shell); the ``cat`` is then nobody's child but PID 1's, which must reap it when it ends: it
ends when the test opens the FIFO and closes it again. The body is the ``cat``'s pid as seen
in the server's own PID namespace.
"""

from __future__ import annotations

import subprocess
from urllib.parse import parse_qs

from tests.apps.basic import app as basic_app


def app(environ, start_response):
    if environ["PATH_INFO"] == "/orphan":
        fifo = parse_qs(environ.get("QUERY_STRING", ""))["fifo"][0]
        shell = subprocess.run(["sh", "-c", 'cat "$1" >/dev/null & echo $!', "sh", fifo],
                               stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                               stderr=subprocess.DEVNULL, check=True, timeout=10)
        body = shell.stdout.strip()
        start_response("200 OK", [("Content-Type", "text/plain"),
                                  ("Content-Length", str(len(body)))])
        return [body]
    return basic_app(environ, start_response)
