"""An app with exit-time cleanup of the usual kinds, each leaving a trace in CLEANUP_DIR:

- an ``atexit`` handler that writes ``atexit-PID``;
- a ``logging`` FileHandler behind a ``MemoryHandler`` that flushes only when full or at
  ``logging.shutdown()`` (as an SDK's batching exporter does): every request logs a line
  ``served PID PATH``, which reaches ``log-PID`` only if the worker's exit ran the shutdown;
- ``forkserve.on_worker_exit`` writing ``on_worker_exit-PID`` (and appending its name to
  ``order-PID``, as the atexit handler does: the order they ran in).

``CLEANUP_STUCK=1``: the atexit handler first blocks for a minute (interruptibly), so the
exit's budget must end it. ``/pid`` answers the worker's pid.
"""

from __future__ import annotations

import atexit
import logging
import logging.handlers
import os
import time

import forkserve

DIR = os.environ["CLEANUP_DIR"]
PID = os.getpid()  # (imported in the worker: no --preload)


def _touch(name: str) -> None:
    with open(os.path.join(DIR, f"{name}-{os.getpid()}"), "w") as fh:
        fh.write(name)
    with open(os.path.join(DIR, f"order-{os.getpid()}"), "a") as fh:
        fh.write(name + "\n")


def _at_exit() -> None:
    if os.environ.get("CLEANUP_STUCK"):
        time.sleep(60)
    _touch("atexit")


atexit.register(_at_exit)
forkserve.on_worker_exit(_touch, "on_worker_exit")

_target = logging.FileHandler(os.path.join(DIR, f"log-{PID}"))
_buffer = logging.handlers.MemoryHandler(10000, flushLevel=logging.CRITICAL + 1, target=_target)
log = logging.getLogger("tests.apps.cleanup")
log.addHandler(_buffer)
log.setLevel(logging.INFO)
log.propagate = False


def app(environ, start_response):
    log.info("served %s %s", os.getpid(), environ["PATH_INFO"])
    body = str(os.getpid()).encode()
    start_response("200 OK", [("Content-Type", "text/plain"), ("Content-Length", str(len(body)))])
    return [body]
