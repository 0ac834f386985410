"""Answers how many requests its worker process has answered so far, this one included (a
number in ASCII): a response's place in the worker's order of service."""

from __future__ import annotations

import itertools
from typing import Any, Callable, Iterable

_served = itertools.count(1)  # (next() on it is atomic under the GIL: the thread worker)


def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
    body = str(next(_served)).encode()
    start_response("200 OK", [("Content-Type", "text/plain"),
                              ("Content-Length", str(len(body)))])
    return [body]
