"""The app of the hostile-client probes (bench/hostile.py): hello, a 50 MiB body, a 10 s sleep.

- ``/``: reads the whole request body (as a form-parsing app would: a slow upload holds
  whoever reads it), then answers ``Hello, World!``.
- ``/big``: 50 MiB with a Content-Length, in 1 MiB chunks (the same chunk object each time,
  so the app itself holds 1 MiB, not 50).
- ``/sleep``: creates ``$HOSTILE_MARK_DIR/inflight-PID`` (the bench waits for that file, not
  for a guessed delay, to know the request is in flight), then sleeps 10 s (cooperative under
  gevent: the worker monkey-patches ``time``).

Every response carries ``X-Pid``, the worker that answered.
"""

from __future__ import annotations

import os
import time
from typing import Any, Callable, Iterable

HELLO = b"Hello, World!\n"
BIG_CHUNK = b"x" * (1 << 20)
BIG_CHUNKS = 50
SLEEP_SECONDS = 10.0

StartResponse = Callable[..., Any]


def app(environ: dict[str, Any], start_response: StartResponse) -> Iterable[bytes]:
    path = environ.get("PATH_INFO", "/")
    pid = ("X-Pid", str(os.getpid()))
    if path == "/big":
        start_response("200 OK", [("Content-Type", "application/octet-stream"),
                                  ("Content-Length", str(len(BIG_CHUNK) * BIG_CHUNKS)), pid])
        return (BIG_CHUNK for _ in range(BIG_CHUNKS))
    if path == "/sleep":
        mark_dir = environ.get("HOSTILE_MARK_DIR") or os.environ.get("HOSTILE_MARK_DIR")
        if mark_dir:
            with open(os.path.join(mark_dir, f"inflight-{os.getpid()}"), "w", encoding="ascii"):
                pass
        time.sleep(SLEEP_SECONDS)
        body = b"slept\n"
    else:
        stream = environ["wsgi.input"]
        while stream.read(65536):
            continue
        body = HELLO
    start_response("200 OK", [("Content-Type", "text/plain"), ("Content-Length", str(len(body))),
                              pid])
    return [body]
