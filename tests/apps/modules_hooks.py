"""A --hooks module: when the server is ready, the arbiter's ``sys.modules`` and whether gevent
patched its socket module, as JSON in $MODULES_FILE."""

from __future__ import annotations

import json
import os
import sys
from typing import Any


def when_ready(server: Any) -> None:
    monkey = sys.modules.get("gevent.monkey")
    patched = bool(monkey and monkey.is_module_patched("socket"))  # type: ignore[attr-defined]
    # Written whole, then renamed: the test reads the file as soon as it exists (on a loaded
    # machine it once read it between the open and the write).
    path = os.environ["MODULES_FILE"]
    with open(path + ".tmp", "w", encoding="utf-8") as fh:
        json.dump({"modules": sorted(sys.modules), "socket_patched": patched}, fh)
    os.replace(path + ".tmp", path)
