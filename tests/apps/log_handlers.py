"""A logging handler for --log-config tests: one file per process that builds it, so a test
sees which processes applied the configuration (the arbiter and each worker after fork)."""

from __future__ import annotations

import logging
import os


class PerProcessHandler(logging.FileHandler):
    def __init__(self, directory: str) -> None:
        super().__init__(os.path.join(directory, f"lines.{os.getpid()}"))
