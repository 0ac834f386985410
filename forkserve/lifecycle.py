"""The arbiter's life-cycle states and the table of allowed transitions.

Owns: the ``State`` and ``Event`` enums and ``TRANSITIONS``. Pure code: no os, no sockets, no
clocks. The arbiter asks :func:`next_state` and applies the answer; an event that the table does
not list for a state is a bug and raises, so no transition happens by accident (the h11 way).
"""

from __future__ import annotations

import enum


class State(enum.Enum):
    BOOTING = "booting"  # listeners bound, first workers loading the app
    RUNNING = "running"  # serving
    LAMEDUCK = "lameduck"  # TERM/INT: still serving and accepting, readiness failing
    DRAINING = "draining"  # accepting stopped, in-flight work finishing
    CANCELLING = "cancelling"  # drain deadline passed: what is left is being cancelled
    FLUSHING = "flushing"  # nothing in flight: workers flush telemetry and exit
    HALTING = "halting"  # QUIT, a second INT, or a failed boot: workers stopped now
    STOPPED = "stopped"  # every worker gone: the arbiter exits


class Event(enum.Enum):
    BOOTED = "all workers booted"
    STOP = "graceful stop requested"
    LAMEDUCK_OVER = "lameduck period over"
    DRAINED = "nothing left in flight"
    HARD_STOP = "hard stop requested"
    BOOT_FAILED = "workers failed to boot"
    WORKERS_GONE = "no worker left"
    DEADLINE = "deadline reached"


S, E = State, Event

TRANSITIONS: dict[tuple[State, Event], State] = {
    (S.BOOTING, E.BOOTED): S.RUNNING,
    (S.BOOTING, E.STOP): S.DRAINING,  # nothing is ready yet: no point in a lameduck
    (S.BOOTING, E.HARD_STOP): S.HALTING,
    (S.BOOTING, E.BOOT_FAILED): S.HALTING,
    (S.RUNNING, E.STOP): S.LAMEDUCK,
    (S.RUNNING, E.HARD_STOP): S.HALTING,
    (S.LAMEDUCK, E.LAMEDUCK_OVER): S.DRAINING,
    (S.LAMEDUCK, E.HARD_STOP): S.HALTING,
    (S.DRAINING, E.DRAINED): S.FLUSHING,
    (S.DRAINING, E.WORKERS_GONE): S.STOPPED,
    (S.DRAINING, E.DEADLINE): S.CANCELLING,
    (S.DRAINING, E.HARD_STOP): S.HALTING,
    (S.CANCELLING, E.DRAINED): S.FLUSHING,
    (S.CANCELLING, E.WORKERS_GONE): S.STOPPED,
    (S.CANCELLING, E.HARD_STOP): S.HALTING,
    (S.FLUSHING, E.WORKERS_GONE): S.STOPPED,
    (S.FLUSHING, E.DEADLINE): S.CANCELLING,
    (S.FLUSHING, E.HARD_STOP): S.HALTING,
    (S.HALTING, E.WORKERS_GONE): S.STOPPED,
}


class InvalidTransition(Exception):
    pass


def next_state(state: State, event: Event) -> State:
    try:
        return TRANSITIONS[(state, event)]
    except KeyError:
        raise InvalidTransition(f"no transition from {state.value} on {event.value}") from None


def accepts(state: State, event: Event) -> bool:
    return (state, event) in TRANSITIONS
