"""An app for the status-server tests whose import waits on a gate only once the test made one.

``STATUS_BOOT_GATE=PATH``: if PATH exists when a worker imports this module (the test creates it
as a FIFO), the import waits until the test opens and closes it
(``tests.apps.basic.wait_gate``). The first generation boots at once (PATH does not exist yet);
a generation started by HUP after the test created the FIFO stays booting until the test
releases it. No sleeping.

``STATUS_REFUSE_FILE=PATH``: while PATH exists, importing this module fails (a worker started
then fails to boot); once the test removes it, the next worker boots.

Routes: those of ``tests.apps.basic.app``, and

- ``/spin?seconds=S&marker=PATH``: one long C call that never returns to Python (so a signal's
  Python handler cannot run in it) of about S seconds, calibrated here. PATH is written just
  before the call starts; the answer is JSON with the call's ``rounds`` and its ``start`` and
  ``end`` on the system-wide monotonic clock (``time.monotonic`` of any process here).
"""

from __future__ import annotations

import hashlib
import json
import os
import time

from tests.apps.basic import _qs, _text, wait_gate
from tests.apps.basic import app as _routes

_gate = os.environ.get("STATUS_BOOT_GATE")
if _gate and os.path.exists(_gate):
    wait_gate(_gate)

_refuse = os.environ.get("STATUS_REFUSE_FILE")
if _refuse and os.path.exists(_refuse):
    raise ImportError(f"refusing to load: {_refuse} exists (STATUS_REFUSE_FILE)")

SPIN_PROBE = 200_000  # pbkdf2 rounds timed to calibrate the long call


def _spin(environ, start_response):
    q = _qs(environ)
    seconds = float(q.get("seconds", "2.5"))
    # Timed in this thread's CPU time, not the wall clock: on a loaded machine the probe
    # waited for a CPU too, and a call calibrated on that wall time took 0.43 s, not 2.5.
    began = time.thread_time()
    hashlib.pbkdf2_hmac("sha256", b"x", b"y", SPIN_PROBE)
    per_round = max(time.thread_time() - began, 1e-6) / SPIN_PROBE
    rounds = max(SPIN_PROBE, int(seconds / per_round))
    with open(q["marker"], "w", encoding="ascii") as fh:
        fh.write(str(rounds))
    start = time.monotonic()
    # PKCS5_PBKDF2_HMAC in OpenSSL: no Python code and no system call until it returns.
    hashlib.pbkdf2_hmac("sha256", b"x", b"y", rounds)
    end = time.monotonic()
    return _text(start_response, "200 OK", json.dumps({"rounds": rounds, "start": start,
                                                       "end": end}))


def app(environ, start_response):
    if environ["PATH_INFO"] == "/spin":
        return _spin(environ, start_response)
    return _routes(environ, start_response)
