"""The app bench/memory.py preloads: a realistic heap built at import, for copy-on-write.

``BENCH_HEAP_MB`` (default 100): about that many MB of ordinary Python objects, as an
application's import-time state looks (a catalogue of dict rows with strings, numbers, lists
and tuples, and an index over them), plus Flask and its dependencies imported when present
(modules, functions, classes: the code objects a framework brings).

Routes: ``/`` reads a few rows (their reference counts change, as any request's do) and
builds a small response, answering with the worker's pid; ``/collect`` runs a full
``gc.collect()`` in the worker (what happens on its own sooner or later in a long-lived
worker, once enough objects outlive the young generations) and answers with the pid too.
"""

from __future__ import annotations

import gc
import os
import random

try:
    import flask  # noqa: F401  (a framework's import-time objects, as in a real app)
except ImportError:  # the bench still runs without it
    flask = None

ROW_BYTES = 1000  # about what one row below costs in CPython 3.11 (measured: RSS growth per row)
ROWS = int(float(os.environ.get("BENCH_HEAP_MB", "100")) * 1024 * 1024 / ROW_BYTES)

CATALOGUE = [
    {"id": i, "sku": f"SKU-{i:08d}", "name": f"product number {i}", "price": i * 0.25,
     "tags": [f"tag{i % 17}", f"group{i % 101}"], "dims": (i % 10, i % 20, i % 30),
     "stock": {"warehouse": i % 7, "count": i % 1000}}
    for i in range(ROWS)
]
BY_SKU = {row["sku"]: row for row in CATALOGUE}


def app(environ, start_response):
    if environ["PATH_INFO"] == "/collect":
        gc.collect()
    else:
        rows = [CATALOGUE[random.randrange(ROWS)] for _ in range(20)]
        _ = [(r["sku"], r["price"], list(r["tags"])) for r in rows]  # temporaries, as a view builds
    body = str(os.getpid()).encode()
    start_response("200 OK", [("Content-Type", "text/plain"), ("Content-Length", str(len(body)))])
    return [body]
