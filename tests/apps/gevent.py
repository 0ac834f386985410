"""The app of the gevent worker tests (issue 5). Everything here blocks cooperatively: under
``-k gevent`` ``time.sleep`` and sockets are patched; FIFO gates are waited on with a
non-blocking open and a poll (``tests.apps.drain``'s gate).

Routes (parameters in the query string)
- ``/fast``: answers at once.
- ``/sleep?s=SECONDS``: ``time.sleep`` then answers with the greenlet's ``get_ident()``.
- ``/sse?out=PATH&id=ID&interval=SECONDS``: a server-sent-event stream that never ends by
  itself: an event (``id: N`` / ``data: ID N``) every ``interval`` (0.2 s). Its shutdown
  function appends ``ended ID`` to ``out``; an exception leaving the generator appends
  ``exc ID NAME`` first (``GeneratorExit`` if the server closed the iterable, else what was
  raised inside it, e.g. ``RequestCancelled``).
- ``/upstream?url=URL&out=PATH``: ``requests.get(URL)`` (an upstream that never answers), with
  a shutdown function appending ``shutdown``; ``entered`` before the call, ``cancelled`` from
  the ``except RequestCancelled`` clause.
- anything else: ``tests.apps.drain.app`` (``/held?fifo=``, ``/cancel``...).
"""

from __future__ import annotations

import threading
import time

import requests

import forkserve
from tests.apps.basic import _json, _qs
from tests.apps.drain import app as drain_app


def _append(path, text):
    with open(path, "a", encoding="utf-8") as fh:
        fh.write(text + "\n")


def app(environ, start_response):
    path = environ["PATH_INFO"]
    q = _qs(environ)
    if path == "/fast":
        return _json(start_response, {"fast": True})
    if path == "/sleep":
        time.sleep(float(q.get("s", "0.5")))
        return _json(start_response, {"ident": threading.get_ident()})
    if path == "/sse":
        return _sse(start_response, q["out"], q["id"], float(q.get("interval", "0.2")))
    if path == "/upstream":
        return _upstream(start_response, q["url"], q["out"])
    return drain_app(environ, start_response)


def _sse(start_response, out, ident, interval):
    forkserve.register_shutdown_function(_append, out, f"ended {ident}")
    start_response("200 OK", [("Content-Type", "text/event-stream"),
                              ("Cache-Control", "no-cache")])

    def events():
        n = 0
        try:
            while True:
                # The emission time (wall clock: the test compares it with its own) tells the
                # test which events were sent after the stop, whenever it reads them.
                yield f"id: {n}\ndata: {ident} {n} {time.time():.6f}\n\n".encode()
                n += 1
                time.sleep(interval)
        except BaseException as exc:
            _append(out, f"exc {ident} {type(exc).__name__}")
            raise
    return events()


def _upstream(start_response, url, out):
    forkserve.register_shutdown_function(_append, out, "shutdown")
    _append(out, "entered")
    try:
        response = requests.get(url, timeout=60)
    except forkserve.RequestCancelled:
        _append(out, "cancelled")
        raise
    return _json(start_response, {"upstream": response.status_code})
