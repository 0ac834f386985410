"""forkserve.lifecycle: the (state, event) -> state table and the errors it raises."""

from __future__ import annotations

import itertools

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
