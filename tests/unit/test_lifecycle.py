"""forkserve.lifecycle: the (state, event) -> state table and the errors it raises."""

from __future__ import annotations

import itertools
from typing import Any

import pytest

from forkserve.lifecycle import TRANSITIONS, Event, InvalidTransition, State, accepts, next_state

PAIRS = list(itertools.product(State, Event))
LISTED = [pair for pair in PAIRS if pair in TRANSITIONS]
MISSING = [pair for pair in PAIRS if pair not in TRANSITIONS]


def pair_id(pair: object) -> str:
    state, event = pair  # type: ignore[misc]
    return f"{state.name}-{event.name}"


def test_the_table_is_not_trivial() -> None:
    assert LISTED and MISSING
    assert all(isinstance(state, State) and isinstance(event, Event) and isinstance(to, State)
               for (state, event), to in TRANSITIONS.items())


@pytest.mark.parametrize("pair", LISTED, ids=pair_id)
def test_every_listed_transition_is_allowed(pair: tuple[State, Event]) -> None:
    state, event = pair
    assert accepts(state, event)
    assert next_state(state, event) is TRANSITIONS[pair]


@pytest.mark.parametrize("pair", MISSING, ids=pair_id)
def test_every_missing_transition_raises(pair: tuple[State, Event]) -> None:
    state, event = pair
    assert not accepts(state, event)
    with pytest.raises(InvalidTransition) as info:
        next_state(state, event)
    assert state.value in str(info.value) and event.value in str(info.value)


@pytest.mark.parametrize("event", list(Event), ids=lambda e: e.name)
def test_stopped_has_no_exits(event: Event) -> None:
    assert not accepts(State.STOPPED, event)
    with pytest.raises(InvalidTransition):
        next_state(State.STOPPED, event)


def test_every_state_can_reach_stopped() -> None:
    reach = {State.STOPPED}
    changed = True
    while changed:
        changed = False
        for (state, _), to in TRANSITIONS.items():
            if to in reach and state not in reach:
                reach.add(state)
                changed = True
    assert reach == set(State)


def test_every_state_but_booting_is_entered_and_nothing_returns_to_booting() -> None:
    targets = set(TRANSITIONS.values())
    assert targets == set(State) - {State.BOOTING}


@pytest.mark.parametrize("state", [State.BOOTING, State.RUNNING, State.DRAINING, State.CANCELLING],
                         ids=lambda s: s.name)
def test_a_hard_stop_halts_from_every_live_state(state: State) -> None:
    assert next_state(state, Event.HARD_STOP) is State.HALTING


def test_the_normal_lives() -> None:
    def run(*events: Event) -> State:
        state = State.BOOTING
        for event in events:
            state = next_state(state, event)
        return state

    assert run(Event.BOOTED, Event.STOP, Event.LAMEDUCK_OVER, Event.DRAINED,
               Event.WORKERS_GONE) is State.STOPPED
    assert run(Event.BOOTED, Event.STOP, Event.LAMEDUCK_OVER, Event.DEADLINE, Event.DRAINED,
               Event.WORKERS_GONE) is State.STOPPED
    assert run(Event.BOOTED, Event.STOP, Event.LAMEDUCK_OVER, Event.DEADLINE,
               Event.WORKERS_GONE) is State.STOPPED
    assert run(Event.BOOTED, Event.STOP, Event.HARD_STOP, Event.WORKERS_GONE) is State.STOPPED
    assert run(Event.BOOTED, Event.STOP, Event.LAMEDUCK_OVER, Event.HARD_STOP,
               Event.WORKERS_GONE) is State.STOPPED
    assert run(Event.STOP, Event.DRAINED, Event.WORKERS_GONE) is State.STOPPED
    assert run(Event.BOOT_FAILED, Event.WORKERS_GONE) is State.STOPPED
    assert run(Event.BOOTED, Event.HARD_STOP, Event.WORKERS_GONE) is State.STOPPED


# -- the rollout table -------------------------------------------------------------------------

from forkserve.lifecycle import (PAUSE, ROLLOUT, Cue, Pause, Rollout, Step,  # noqa: E402
                                 next_pause, next_rollout)


def reaches(table: dict[Any, Any], start: Any) -> set[Any]:
    seen, frontier = {start}, [start]
    while frontier:
        here = frontier.pop()
        for (state, _), to in table.items():
            if state is here and to not in seen:
                seen.add(to)
                frontier.append(to)
    return seen


@pytest.mark.parametrize("state", list(Rollout), ids=lambda s: s.name)
def test_every_rollout_ends_idle(state: Rollout) -> None:
    assert Rollout.IDLE in reaches(ROLLOUT, state)


def test_every_rollout_state_is_reached_from_idle_or_the_exec() -> None:
    """ADOPTING is where the new image of an upgrade starts (it is a new process: no step
    leads there); everything else is reached from IDLE."""
    assert reaches(ROLLOUT, Rollout.IDLE) | {Rollout.ADOPTING} == set(Rollout)
    assert all(state is Rollout.ADOPTING for (state, _), to in ROLLOUT.items()
               if to is Rollout.ADOPTING)


@pytest.mark.parametrize("state", list(Rollout), ids=lambda s: s.name)
@pytest.mark.parametrize("step", [Step.RELOAD, Step.UPGRADE], ids=lambda s: s.name)
def test_a_reload_or_upgrade_is_never_refused(state: Rollout, step: Step) -> None:
    """Idle, it starts one; in progress, the table keeps the state (the arbiter coalesces the
    request and carries it out once idle): a `systemctl reload` is never lost."""
    expected = {Step.RELOAD: Rollout.RELOADING, Step.UPGRADE: Rollout.CHECKING}[step]
    assert next_rollout(state, step) is (expected if state is Rollout.IDLE else state)


def test_the_lives_of_a_rollout() -> None:
    def run(state: Rollout, *steps: Step) -> Rollout:
        for step in steps:
            state = next_rollout(state, step)
        return state

    assert run(Rollout.IDLE, Step.RELOAD, Step.BOOTED) is Rollout.IDLE
    assert run(Rollout.IDLE, Step.RELOAD, Step.ROLLED_BACK) is Rollout.IDLE
    assert run(Rollout.IDLE, Step.UPGRADE, Step.CHECK_FAILED) is Rollout.IDLE
    assert run(Rollout.IDLE, Step.UPGRADE, Step.EXEC_FAILED) is Rollout.IDLE
    # A HUP during a post-exec upgrade that then fails: coalesced, then idle (and carried out).
    assert run(Rollout.ADOPTING, Step.RELOAD, Step.ROLLED_BACK) is Rollout.IDLE
    assert run(Rollout.IDLE, Step.RESUME, Step.RESUME, Step.BOOTED) is Rollout.IDLE


@pytest.mark.parametrize("state, step", [(Rollout.IDLE, Step.BOOTED), (Rollout.IDLE, Step.CHECK_FAILED),
                                         (Rollout.CHECKING, Step.BOOTED),
                                         (Rollout.CHECKING, Step.RESUME),
                                         (Rollout.RELOADING, Step.CHECK_FAILED),
                                         (Rollout.ADOPTING, Step.RESUME)],
                         ids=lambda v: v.name)
def test_rollout_steps_the_table_does_not_list_raise(state: Rollout, step: Step) -> None:
    with pytest.raises(InvalidTransition) as info:
        next_rollout(state, step)
    assert state.value in str(info.value) and step.value in str(info.value)


# -- the pause table -------------------------------------------------------------------------

@pytest.mark.parametrize("state", list(Pause), ids=lambda s: s.name)
def test_every_pause_can_end_listening(state: Pause) -> None:
    assert Pause.LISTENING in reaches(PAUSE, state)
    assert reaches(PAUSE, Pause.LISTENING) == set(Pause)


def test_the_last_word_is_ttous() -> None:
    assert next_pause(Pause.RESUMING, Cue.PAUSE) is Pause.PAUSED
    assert next_pause(Pause.PAUSED, Cue.PORT_HELD) is Pause.RESUMING
    assert next_pause(Pause.RESUMING, Cue.GAVE_UP) is Pause.PAUSED
    assert next_pause(Pause.RESUMING, Cue.BOUND) is Pause.LISTENING


@pytest.mark.parametrize("state, cue", [(Pause.LISTENING, Cue.BOUND), (Pause.PAUSED, Cue.PAUSE),
                                        (Pause.LISTENING, Cue.PORT_HELD)],
                         ids=lambda v: v.name)
def test_pause_changes_the_table_does_not_list_raise(state: Pause, cue: Cue) -> None:
    with pytest.raises(InvalidTransition):
        next_pause(state, cue)
