"""What a process has imported: the app answers with the worker's ``sys.modules`` (JSON list),
and ``tests.apps.modules_hooks`` writes the arbiter's to $MODULES_FILE once it is ready."""

from __future__ import annotations

import json
import sys
from typing import Any, Callable, Iterable


def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
    body = json.dumps(sorted(sys.modules)).encode()
    start_response("200 OK", [("Content-Type", "application/json"),
                              ("Content-Length", str(len(body)))])
    return [body]
