"""``tests.apps.metrics``'s app, plus a counter of how many processes imported it.

Metrics (besides those of ``tests.apps.metrics``)
- ``app_imports_total`` (counter): incremented once at import, so each worker that loads the
  app adds 1; so would any other process that imports it with the same
  ``PROMETHEUS_MULTIPROC_DIR`` (an upgrade's ``--check`` does import the app).

With ``APP_IMPORTS_LOG`` set, every import also appends ``PID PROMETHEUS_MULTIPROC_DIR`` as a
line to that file: the test learns which processes imported the app, and where their metric
files went.
"""

from __future__ import annotations

import os

from prometheus_client import Counter

from tests.apps.metrics import app

__all__ = ["app"]

IMPORTS = Counter("app_imports", "Processes that imported the app")
IMPORTS.inc()

if os.environ.get("APP_IMPORTS_LOG"):
    with open(os.environ["APP_IMPORTS_LOG"], "a", encoding="utf-8") as _log:
        _log.write(f"{os.getpid()} {os.environ.get('PROMETHEUS_MULTIPROC_DIR', '')}\n")
