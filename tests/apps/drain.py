"""The app of the graceful-drain tests (issue 3): finish_request, shutdown functions,
cancellation, the background pool and spans, each held in flight on a FIFO the test opens.

Every route takes its parameters from the query string. ``fifo=PATH`` is a gate: the app opens
the FIFO for reading and reads it to EOF, so it stays there until the test releases the gate.
``out=PATH`` is a file the app (or its shutdown functions, or its background tasks) appends
lines to, so the test can see after the fact what ran, and in which order.

The forkserve API is looked up at request time, not at import time, so that this module imports
(and the other routes work) on a forkserve that lacks part of it.

Routes
- ``/held?fifo=&size=N``: after the gate, a body of N bytes (``b"x" * N``).
- ``/stream?fifo=``: a chunked response: one chunk, then the gate, then two more chunks.
- ``/finish?fifo=&out=&mode=write|generator|module``: the whole response, then
  ``finish_request``, then the gate, then ``post-work-done`` into ``out``.
- ``/cancel?fifo=&out=&how=fifo|sleep|read``: registers three shutdown functions (the
  second raises), then blocks (on the gate, in ``time.sleep``, or reading a request body that
  never comes) inside a span named ``cancel-span``. ``out`` receives ``entered`` as it starts
  blocking, ``cancelled`` from the ``except RequestCancelled`` clause, then ``shutdown-1``,
  ``shutdown-3``.
- ``/shutdown-fns?out=``: the same three shutdown functions on a request that ends normally.
- ``/stuck?fifo=``: blocks every signal it can (all but KILL and STOP), then waits on the gate:
  no signal handler can run and no syscall is interrupted; only SIGKILL ends it.
- ``/background?fifo=&out=&n=N``: submits a task that waits on the gate and then writes
  ``gated``, then N quick tasks writing ``quick-I``; answers at once. The tasks record spans
  ``task-gated`` and ``task-quick-I``.
- ``/held-then-background?fifo=&task_fifo=&out=``: after the gate, submits the gated task
  (on ``task_fifo``) and answers: a task submitted while the server is already draining.
- ``/background-unstarted?fifo=&out=``: submits a task that waits on the gate and writes
  ``gated``, then ``never_started_task`` (writes ``never-started``); answers at once.
- ``/spans?n=N&tag=T``: records N spans ``span-T-I`` (attribute ``i``) and answers.
- anything else: ``tests.apps.basic.app``.
"""

from __future__ import annotations

import signal
import time
from urllib.parse import parse_qs

import forkserve
from tests.apps.basic import app as basic_app
from tests.apps.basic import wait_gate


def _qs(environ):
    return {k: v[0] for k, v in parse_qs(environ.get("QUERY_STRING", "")).items()}


def _append(path, text):
    with open(path, "a", encoding="utf-8") as fh:
        fh.write(text + "\n")


_wait_gate = wait_gate


def _respond(start_response, body, status="200 OK"):
    start_response(status, [("Content-Type", "text/plain"), ("Content-Length", str(len(body)))])
    return [body]


# -- shutdown functions -------------------------------------------------------------------------

def _first_shutdown_function(out):
    _append(out, "shutdown-1")


def _failing_shutdown_function(out):
    raise RuntimeError("shutdown function 2 fails on purpose")


def _third_shutdown_function(out, *, label):
    _append(out, label)


def _register_shutdown_functions(out):
    forkserve.register_shutdown_function(_first_shutdown_function, out)
    forkserve.register_shutdown_function(_failing_shutdown_function, out)
    forkserve.register_shutdown_function(_third_shutdown_function, out, label="shutdown-3")


# -- background tasks ---------------------------------------------------------------------------

def gated_task(fifo, out):
    with forkserve.telemetry.span("task-gated"):
        _wait_gate(fifo)
    _append(out, "gated")


def quick_task(out, i):
    with forkserve.telemetry.span(f"task-quick-{i}", i=i):
        _append(out, f"quick-{i}")


def never_started_task(out):
    _append(out, "never-started")


# -- the app ------------------------------------------------------------------------------------

def app(environ, start_response):
    path = environ["PATH_INFO"]
    q = _qs(environ)
    if path == "/held":
        _wait_gate(q["fifo"])
        return _respond(start_response, b"x" * int(q.get("size", "10")))
    if path == "/stream":
        return _stream(start_response, q["fifo"])
    if path == "/finish":
        return _finish(environ, start_response, q)
    if path == "/cancel":
        return _cancel(environ, start_response, q)
    if path == "/shutdown-fns":
        _register_shutdown_functions(q["out"])
        return _respond(start_response, b"registered")
    if path == "/stuck":
        # Every signal blocked: a handler can never run, a syscall never returns EINTR.
        signal.pthread_sigmask(signal.SIG_BLOCK, signal.valid_signals())
        _wait_gate(q["fifo"])
        return _respond(start_response, b"unstuck")
    if path == "/background":
        out = q["out"]
        forkserve.background.submit(gated_task, q["fifo"], out)
        for i in range(int(q.get("n", "0"))):
            forkserve.background.submit(quick_task, out, i)
        return _respond(start_response, b"submitted")
    if path == "/held-then-background":
        _wait_gate(q["fifo"])
        forkserve.background.submit(gated_task, q["task_fifo"], q["out"])
        return _respond(start_response, b"submitted late")
    if path == "/background-unstarted":
        out = q["out"]
        forkserve.background.submit(gated_task, q["fifo"], out)
        forkserve.background.submit(never_started_task, out)
        return _respond(start_response, b"submitted")
    if path == "/spans":
        tag = q.get("tag", "t")
        for i in range(int(q.get("n", "1"))):
            with forkserve.telemetry.span(f"span-{tag}-{i}", i=i, tag=tag):
                pass
        return _respond(start_response, b"spans")
    return basic_app(environ, start_response)


def _stream(start_response, fifo):
    start_response("200 OK", [("Content-Type", "text/plain")])

    def body():
        yield b"first "
        _wait_gate(fifo)
        yield b"second "
        yield b"third"
    return body()


FINISH_BODY = b"finished for the client"


def _finish(environ, start_response, q):
    fifo, out, mode = q["fifo"], q["out"], q.get("mode", "write")
    headers = [("Content-Type", "text/plain"), ("Content-Length", str(len(FINISH_BODY)))]
    if mode == "generator":
        start_response("200 OK", headers)

        def body():
            yield FINISH_BODY
            environ["forkserve.finish_request"]()
            with forkserve.telemetry.span("finish-post-work", mode=mode):
                _wait_gate(fifo)
            _append(out, "post-work-done")
        return body()
    write = start_response("200 OK", headers)
    write(FINISH_BODY)
    if mode == "module":
        forkserve.finish_request()
    else:
        environ["forkserve.finish_request"]()
    with forkserve.telemetry.span("finish-post-work", mode=mode):
        _wait_gate(fifo)
    _append(out, "post-work-done")
    return []


def _cancel(environ, start_response, q):
    out, how = q["out"], q.get("how", "fifo")
    _register_shutdown_functions(out)
    _append(out, "entered")
    try:
        with forkserve.telemetry.span("cancel-span", how=how):
            if how == "sleep":
                time.sleep(float(q.get("seconds", "60")))
            elif how == "read":
                # The client announced a body it never sends: a blocking socket read.
                environ["wsgi.input"].read()
            else:
                _wait_gate(q["fifo"])
    except forkserve.RequestCancelled:
        _append(out, "cancelled")
        raise
    return _respond(start_response, b"not cancelled")
