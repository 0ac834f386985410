"""An app for the status-server tests whose import waits on a gate only once the test made one.

``STATUS_BOOT_GATE=PATH``: if PATH exists when a worker imports this module (the test creates it
as a FIFO), the import waits until the test opens and closes it (``tests.apps.wait_gate``). The
first generation boots at once (PATH does not exist yet); a generation started by HUP after the
test created the FIFO stays booting until the test releases it. No sleeping.

Routes: those of ``tests.apps.app``.
"""

from __future__ import annotations

import os

from tests.apps import app, wait_gate  # noqa: F401

_gate = os.environ.get("STATUS_BOOT_GATE")
if _gate and os.path.exists(_gate):
    wait_gate(_gate)
