"""The arbiter's state machines, each a table of allowed transitions.

Owns: the server's life cycle (``State``, ``Event``, ``TRANSITIONS``), a rollout of a new
generation (``Rollout``, ``Step``, ``ROLLOUT``) and the pause protocol (``Pause``, ``Cue``,
``PAUSE``). Pure code: no os, no sockets, no clocks. The arbiter asks ``next_*`` and applies
the answer; a change that a table does not list is a bug and raises, so no transition
happens by accident (the h11 way).
"""

from __future__ import annotations

import enum
from typing import TypeVar


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


K = TypeVar("K", bound=enum.Enum)
V = TypeVar("V", bound=enum.Enum)


def _look_up(table: dict[tuple[K, V], K], state: K, event: V, what: str) -> K:
    try:
        return table[(state, event)]
    except KeyError:
        raise InvalidTransition(f"no {what} from {state.value} on {event.value}") from None


def next_state(state: State, event: Event) -> State:
    return _look_up(TRANSITIONS, state, event, "transition")


def accepts(state: State, event: Event) -> bool:
    return (state, event) in TRANSITIONS


# -- machine: a rollout (a new generation replacing the one serving) ----------------------------
# At most one at a time. A reload or upgrade asked for while one is in progress (or while the
# first generation boots) is not dropped: the table keeps the state, the arbiter remembers
# the request and carries it out once the rollout is IDLE again.

class Rollout(enum.Enum):
    IDLE = "idle"  # one generation serves
    RELOADING = "reloading"  # a new generation boots (HUP, or TTIN's resume); the old serves
    CHECKING = "checking"  # USR2: the new code and configuration are checked in a child
    ADOPTING = "adopting"  # after the exec: our generation boots, the old image's serves


class Step(enum.Enum):
    RELOAD = "reload requested"  # HUP, `ctl reload`
    RESUME = "resume: new listeners"  # TTIN: a new generation gets the new sockets
    UPGRADE = "upgrade requested"  # USR2, `ctl upgrade`
    CHECK_FAILED = "the upgrade's check failed"
    EXEC_FAILED = "the upgrade's exec failed"  # (a passed check otherwise leaves this image)
    ABANDONED = "the upgrade is called off"  # the server stops or pauses
    BOOTED = "the new generation booted"  # the old one retires
    ROLLED_BACK = "the new generation failed to boot; the old one keeps serving"


R, T = Rollout, Step

ROLLOUT: dict[tuple[Rollout, Step], Rollout] = {
    (R.IDLE, T.RELOAD): R.RELOADING,
    (R.IDLE, T.RESUME): R.RELOADING,
    (R.IDLE, T.UPGRADE): R.CHECKING,
    (R.RELOADING, T.RELOAD): R.RELOADING,  # coalesced
    (R.RELOADING, T.UPGRADE): R.RELOADING,  # coalesced
    (R.RELOADING, T.RESUME): R.RELOADING,  # paused and resumed again: a newer generation
    (R.RELOADING, T.BOOTED): R.IDLE,
    (R.RELOADING, T.ROLLED_BACK): R.IDLE,
    (R.CHECKING, T.RELOAD): R.CHECKING,  # coalesced
    (R.CHECKING, T.UPGRADE): R.CHECKING,  # coalesced
    (R.CHECKING, T.CHECK_FAILED): R.IDLE,
    (R.CHECKING, T.EXEC_FAILED): R.IDLE,
    (R.CHECKING, T.ABANDONED): R.IDLE,  # stopping, or paused (a successor takes the port)
    (R.ADOPTING, T.RELOAD): R.ADOPTING,  # coalesced
    (R.ADOPTING, T.UPGRADE): R.ADOPTING,  # coalesced
    (R.ADOPTING, T.BOOTED): R.IDLE,
    (R.ADOPTING, T.ROLLED_BACK): R.IDLE,
}


def next_rollout(state: Rollout, step: Step) -> Rollout:
    return _look_up(ROLLOUT, state, step, "rollout step")


# -- machine: pause (TTOU / TTIN, HAProxy's handoff protocol) -------------------------------------

class Pause(enum.Enum):
    LISTENING = "listening"
    PAUSED = "paused"  # TTOU: our listeners closed; the workers serve what was queued
    RESUMING = "resuming"  # TTIN while our own paused workers still hold the port: retrying


class Cue(enum.Enum):
    PAUSE = "TTOU"
    BOUND = "TTIN: the port is ours again"
    PORT_HELD = "TTIN: our paused workers still hold the port"
    GAVE_UP = "the port stayed taken"


P, C = Pause, Cue

PAUSE: dict[tuple[Pause, Cue], Pause] = {
    (P.LISTENING, C.PAUSE): P.PAUSED,
    (P.PAUSED, C.BOUND): P.LISTENING,
    (P.PAUSED, C.PORT_HELD): P.RESUMING,
    (P.PAUSED, C.GAVE_UP): P.PAUSED,  # someone else holds it: still paused, logged
    (P.RESUMING, C.BOUND): P.LISTENING,
    (P.RESUMING, C.PORT_HELD): P.RESUMING,
    (P.RESUMING, C.PAUSE): P.PAUSED,  # the last word is TTOU's: stay paused
    (P.RESUMING, C.GAVE_UP): P.PAUSED,
}


def next_pause(state: Pause, cue: Cue) -> Pause:
    return _look_up(PAUSE, state, cue, "pause change")
