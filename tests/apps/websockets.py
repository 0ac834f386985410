"""WebSocket apps for tests/integration/test_websockets.py (issue 15): the same echo served by a
plain WSGI app on ``simple_websocket.Server(environ)`` (``app``) and by flask-sock
(``flask_app``), each taking the client's socket from the environ (``werkzeug.socket`` /
``gunicorn.socket``) as they would under gunicorn.

``/ws?out=PATH``: a WebSocket that echoes every message, except ``pid`` (answered with the
worker's pid, so a test sees which worker holds it). ``out`` (optional) is a file the app
appends to: ``opened``, then, once the socket ends (the client closed, or the server cut it at
the drain deadline), ``closed <how>`` from the app's ``finally`` and ``shutdown`` from a
forkserve shutdown function. Every other path: ``tests.apps.basic.app`` (the HTTP load).

The forkserve API is looked up at request time (the module imports on any server).
"""

from __future__ import annotations

import os
from urllib.parse import parse_qs

from tests.apps.basic import app as basic_app


def _append(path, text):
    if path:
        with open(path, "a", encoding="utf-8") as fh:
            fh.write(text + "\n")


def _echo(ws, out):
    """The echo loop both apps share; ``out`` records how it ended."""
    import forkserve

    forkserve.register_shutdown_function(_append, out, "shutdown")
    _append(out, "opened")
    how = "returned"
    try:
        while True:
            message = ws.receive()
            ws.send(str(os.getpid()) if message == "pid" else message)
    except BaseException as exc:  # ConnectionClosed, or RequestCancelled at the deadline
        how = type(exc).__name__
        raise
    finally:
        _append(out, f"closed {how}")


def _out(environ):
    return parse_qs(environ.get("QUERY_STRING", "")).get("out", [""])[0]


def app(environ, start_response):
    if environ["PATH_INFO"] != "/ws":
        return basic_app(environ, start_response)
    import simple_websocket

    ws = simple_websocket.Server(environ)
    try:
        _echo(ws, _out(environ))
    except simple_websocket.ConnectionClosed:
        pass
    return []  # no start_response: the app answered (101) on the socket itself


def _make_flask_app():
    from flask import Flask, request
    from flask_sock import Sock

    flask = Flask(__name__)
    sock = Sock(flask)

    @sock.route("/ws")
    def ws(ws):  # flask-sock closes it and returns its own "response" after this
        _echo(ws, request.args.get("out", ""))

    @flask.route("/")
    def index():
        return "hello from flask\n"

    return flask


flask_app = _make_flask_app()
