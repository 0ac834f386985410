"""An app whose import blocks until the test opens the FIFO named by ``SLOW_BOOT_FIFO`` for
writing: a worker that hangs while booting, without sleeping."""

from __future__ import annotations

import os

from tests.apps.basic import app  # noqa: F401

_fifo = os.environ.get("SLOW_BOOT_FIFO")
if _fifo:
    with open(_fifo, "rb") as _fh:
        _fh.read()
