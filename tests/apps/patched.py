"""An app that imports ``ssl``, ``threading`` and ``requests`` at module level, as real apps
do: gunicorn's classic gevent bug is an app (or a library it imports) binding ``ssl`` or
``threading`` objects before the worker monkey-patched them. Under ``-k gevent`` this module
must be imported after the patching, so every object captured below must be gevent's.

This module deliberately does not import gevent at import time (the worker must have done the
patching on its own); gevent is looked up inside the request.

Routes
- ``/patched``: JSON: ``modules`` (``gevent.monkey.is_module_patched`` for socket, ssl,
  threading, time, select), ``captured`` (for each object this module captured at import time,
  whether it is still the unpatched original), ``thread`` (``threading.current_thread()``'s
  class, and whether ``get_ident()`` is the current greenlet's id).
- ``/ident?fifo=PATH``: waits cooperatively on the gate, then answers with ``get_ident()`` and
  the current thread's name: concurrent requests must each have their own.
- ``/``: ``{"hello": true}``.
- ``/self?port=N``: a ``requests.get`` of this same server's ``/``: with one worker, that only
  completes if ``requests`` sockets are cooperative.
"""

from __future__ import annotations

import select
import socket
import ssl
import threading
import time
from ssl import SSLContext, SSLSocket
from threading import Lock, Thread, get_ident
from time import sleep

import requests

from tests.apps.basic import _json, _qs, wait_gate  # stdlib only; wait_gate looks its modules up at call time

CAPTURED = {
    # (module, attribute): the object as this module saw it at import time
    ("ssl", "SSLContext"): SSLContext,
    ("ssl", "SSLSocket"): SSLSocket,
    ("socket", "socket"): socket.socket,
    ("socket", "create_connection"): socket.create_connection,
    ("threading", "Lock"): Lock,
    ("threading", "get_ident"): get_ident,
    ("threading", "Thread"): Thread,
    ("time", "sleep"): sleep,
    ("select", "select"): select.select,
}
IMPORT_THREAD = threading.current_thread()
SESSION = requests.Session()


def app(environ, start_response):
    from gevent import getcurrent, monkey

    path = environ["PATH_INFO"]
    q = _qs(environ)
    if path == "/patched":
        current = threading.current_thread()
        return _json(start_response, {
            "modules": {name: bool(monkey.is_module_patched(name))
                        for name in ("socket", "ssl", "threading", "time", "select")},
            "captured_original": {
                f"{mod}.{attr}": obj is monkey.get_original(mod, attr)
                for (mod, attr), obj in CAPTURED.items()},
            "captured_is_current": {
                f"{mod}.{attr}": obj is getattr(__import__(mod), attr)
                for (mod, attr), obj in CAPTURED.items()},
            "thread_class": f"{type(current).__module__}.{type(current).__qualname__}",
            "ident_is_greenlet": threading.get_ident() == id(getcurrent()),
            "import_thread": IMPORT_THREAD.name,
            "ssl_context_module": ssl.SSLContext.__module__,
        })
    if path == "/ident":
        wait_gate(q["fifo"])
        return _json(start_response, {"ident": threading.get_ident(),
                                         "greenlet": id(getcurrent()),
                                         "thread": threading.current_thread().name})
    if path == "/self":
        started = time.monotonic()
        response = SESSION.get(f"http://127.0.0.1:{q['port']}/", timeout=5)
        return _json(start_response, {"status": response.status_code,
                                         "body": response.text,
                                         "seconds": time.monotonic() - started})
    if path == "/":
        return _json(start_response, {"hello": True})
    return _json(start_response, {"error": "not found"}, "404 Not Found")
