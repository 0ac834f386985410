"""The app of the /metrics tests: its own prometheus_client metrics, served by forkserve workers.

forkserve sets ``PROMETHEUS_MULTIPROC_DIR`` before any worker imports this module, so the
metrics below live in the shared directory and come out merged in the status server's
/metrics, next to forkserve's own.

Metrics
- ``app_hits_total`` (counter): one per request this app answers, on every route.
- ``app_worker_up`` (gauge, ``multiprocess_mode="liveall"``): 1 per live worker, with a ``pid``
  label; set at import, so each worker has its series from boot.

Routes
- ``/`` and ``/pid``: the worker's pid.
- ``/metrics-dir``: the worker's ``PROMETHEUS_MULTIPROC_DIR``.
- ``/block?fifo=PATH``: held in flight until the test releases the FIFO gate.
- ``/cancel-then-hold?fifo=A&hold=B``: waits on gate A; its shutdown function waits on gate B.
  Cancelled at the drain deadline, the request is counted as cancelled, then its worker stays
  alive in the shutdown function until the test releases B (or the cancel grace runs out).
"""

from __future__ import annotations

import os
from urllib.parse import parse_qs

import forkserve
from prometheus_client import Counter, Gauge

from tests.apps.basic import wait_gate

HITS = Counter("app_hits", "Requests this app answered")
WORKER_UP = Gauge("app_worker_up", "1 per live worker", multiprocess_mode="liveall")
WORKER_UP.set(1)


def _qs(environ):
    return {k: v[0] for k, v in parse_qs(environ.get("QUERY_STRING", "")).items()}


def _text(start_response, body, status="200 OK"):
    data = body.encode()
    start_response(status, [("Content-Type", "text/plain"), ("Content-Length", str(len(data)))])
    return [data]


def app(environ, start_response):
    HITS.inc()
    path = environ["PATH_INFO"]
    q = _qs(environ)
    if path in ("/", "/pid"):
        return _text(start_response, str(os.getpid()))
    if path == "/metrics-dir":
        return _text(start_response, os.environ.get("PROMETHEUS_MULTIPROC_DIR", ""))
    if path == "/block":
        wait_gate(q["fifo"])
        return _text(start_response, "released")
    if path == "/cancel-then-hold":
        forkserve.register_shutdown_function(wait_gate, q["hold"])
        wait_gate(q["fifo"])
        return _text(start_response, "released")
    return _text(start_response, "not found\n", "404 Not Found")
