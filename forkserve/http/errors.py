"""Errors raised while reading a request: each carries the status the client gets."""

from __future__ import annotations


class HTTPError(Exception):
    """A request the server refuses before it reaches the application."""

    def __init__(self, status: int, reason: str) -> None:
        super().__init__(f"{status} {reason}")
        self.status = status
        self.reason = reason
