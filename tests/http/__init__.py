"""The HTTP parser corpus (``corpus/{valid,invalid}``) and a helper to read a parser's events."""

from __future__ import annotations

from forkserve.http import Event, RequestParser


def taken(parser: RequestParser) -> list[Event]:
    """Every event queued so far, taken off the parser's queue in order."""
    events = []
    event = parser.next_event()
    while event is not None:
        events.append(event)
        event = parser.next_event()
    return events
