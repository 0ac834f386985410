"""Apps for tests/integration/test_logging_integration.py.

``flask_app``: Flask's documented recipe for running under gunicorn (its logger takes
gunicorn.error's handlers and level), so its lines land in the server's error log.
``printing``: a plain WSGI app that writes to stdout and stderr every way an app does.
``held_lock``: a preloaded app whose thread holds the error log handler's lock, and a lock of
an app handler on the same logger, across the fork, until the test releases them.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from typing import Any, Callable, Iterable

from flask import Flask, request

flask_app = Flask("logging_app")
gunicorn_logger = logging.getLogger("gunicorn.error")
flask_app.logger.handlers = gunicorn_logger.handlers
flask_app.logger.setLevel(gunicorn_logger.level)


@flask_app.route("/log")
def log_line() -> str:
    flask_app.logger.info("app says %s", request.args.get("msg", "hello"))
    return "logged\n"


@flask_app.route("/debug")
def debug_line() -> str:
    flask_app.logger.debug("app debug %s", request.args.get("msg", "hello"))
    return "logged\n"


@flask_app.route("/fail")
def fail() -> str:
    try:
        raise RuntimeError("app trouble")
    except RuntimeError:
        flask_app.logger.exception("app caught %s", "it")
    return "caught\n"


@flask_app.route("/headers")
def headers() -> tuple[str, int, dict[str, str]]:
    return "ok\n", 201, {"X-Custom": "custom value", "Content-Type": "text/plain; charset=x"}


Start = Callable[[str, list[tuple[str, str]]], Any]


def printing(environ: dict[str, Any], start_response: Start) -> Iterable[bytes]:
    path = environ["PATH_INFO"]
    tag = environ.get("QUERY_STRING", "")
    if path == "/print":
        print(f"printed {tag}")
        print(f"to stderr {tag}", file=sys.stderr)
    elif path == "/oswrite":
        os.write(1, f"fd one {tag}\nfd one again {tag}\n".encode())
        os.write(2, f"fd two {tag}\n".encode())
    elif path == "/partial":
        sys.stdout.write(f"partial {tag}")  # no newline: told when the worker exits
    elif path == "/long":
        os.write(1, b"L" * int(tag) + b"\n")
    elif path == "/many":
        for n in range(int(tag)):
            print(f"many {n}")
    start_response("200 OK", [("Content-Type", "text/plain")])
    return [b"ok\n"]


print("printed at import")

_release = os.environ.get("HOLD_RELEASE")


def _hold() -> None:
    """Holds the handler locks until the test creates the release file (the app's own
    polling: the test itself waits on log lines)."""
    assert _release is not None
    held = [h.lock for name in ("gunicorn.error", "heldapp")
            for h in logging.getLogger(name).handlers if h.lock is not None]
    for lock in held:
        lock.acquire()
    with open(_release + ".held", "w") as f:
        f.write(str(len(held)))
    while not os.path.exists(_release):
        time.sleep(0.02)
    for lock in held:
        lock.release()


if _release:
    # An app handler of its own (its lock is logging's usual RLock): on its own logger, as
    # one on gunicorn.error would block the arbiter's lines while held (logging's rule).
    held_logger = logging.getLogger("heldapp")
    held_logger.addHandler(logging.StreamHandler(sys.stderr))
    held_logger.propagate = False
    threading.Thread(target=_hold, daemon=True).start()
    while not os.path.exists(_release + ".held"):
        time.sleep(0.01)


def held_lock(environ: dict[str, Any], start_response: Start) -> Iterable[bytes]:
    message = "worker logs while the arbiter's thread held the handler locks at fork"
    logging.getLogger("gunicorn.error").warning(message)
    logging.getLogger("heldapp").warning(message)
    start_response("200 OK", [("Content-Type", "text/plain")])
    return [b"ok\n"]
