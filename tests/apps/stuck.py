"""``/stuck`` blocks the whole worker in a real sleep (under gevent too: the original
``time.sleep``, which never yields to the hub), so its heartbeats stop and the arbiter's
--timeout kill comes; the signal interrupts the sleep. Anything else answers the pid."""

from __future__ import annotations

import os
import time


def _real_sleep():
    try:
        from gevent import monkey
    except ImportError:
        return time.sleep
    return monkey.get_original("time", "sleep") if monkey.is_module_patched("time") else time.sleep


def stuck_in_the_app(seconds):
    _real_sleep()(seconds)


def app(environ, start_response):
    if environ["PATH_INFO"] == "/stuck":
        stuck_in_the_app(60)
    body = str(os.getpid()).encode()
    start_response("200 OK", [("Content-Type", "text/plain"), ("Content-Length", str(len(body)))])
    return [body]
