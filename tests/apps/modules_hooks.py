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
    with open(os.environ["MODULES_FILE"], "w", encoding="utf-8") as fh:
        json.dump({"modules": sorted(sys.modules), "socket_patched": patched}, fh)
