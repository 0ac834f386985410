"""The worker's own state table: total (a signal handler never meets a pair nobody listed),
and its few changes are the ones the drain relies on."""

from __future__ import annotations

import itertools

from forkserve.workers.base import WORKER_TRANSITIONS, WorkerEvent, WorkerState

WS, WE = WorkerState, WorkerEvent


def test_the_table_is_total() -> None:
    assert set(WORKER_TRANSITIONS) == set(itertools.product(WS, WE))


def test_what_changes() -> None:
    changes = {pair: to for pair, to in WORKER_TRANSITIONS.items() if to is not pair[0]}
    assert changes == {
        (WS.BOOTING, WE.BOOTED): WS.RUNNING,
        (WS.BOOTING, WE.STOP): WS.STOPPING,
        (WS.RUNNING, WE.STOP): WS.STOPPING,
        (WS.RUNNING, WE.RETIRE): WS.STOPPING,
        # The arbiter gone: out at once, whatever the worker was doing (see Worker.arbiter_gone).
        (WS.BOOTING, WE.ARBITER_GONE): WS.HALTING,
        (WS.RUNNING, WE.ARBITER_GONE): WS.HALTING,
        (WS.STOPPING, WE.ARBITER_GONE): WS.HALTING,
        (WS.CANCELLED, WE.ARBITER_GONE): WS.HALTING,
        (WS.BOOTING, WE.CANCEL): WS.CANCELLED,
        (WS.RUNNING, WE.CANCEL): WS.CANCELLED,
        (WS.STOPPING, WE.CANCEL): WS.CANCELLED,
        (WS.BOOTING, WE.HALT): WS.HALTING,
        (WS.RUNNING, WE.HALT): WS.HALTING,
        (WS.STOPPING, WE.HALT): WS.HALTING,
        (WS.CANCELLED, WE.HALT): WS.HALTING,
    }


def test_nothing_leads_back() -> None:
    """A stop is for good: no event returns a stopping worker to running, and halting is
    where every path ends."""
    order = [WS.BOOTING, WS.RUNNING, WS.STOPPING, WS.CANCELLED, WS.HALTING]
    for (state, _), to in WORKER_TRANSITIONS.items():
        assert order.index(to) >= order.index(state), (state, to)
    assert all(WORKER_TRANSITIONS[(WS.HALTING, event)] is WS.HALTING for event in WE)


def test_each_worker_class_inherits_the_pipeline_not_another_class() -> None:
    """sync, thread and gevent hold only their concurrency model: a drain fix made in the
    pipeline holds for all three, and none changes by a change to another."""
    from forkserve.workers import WORKER_CLASSES, worker_class
    from forkserve.workers.pipeline import Pipeline

    for name in WORKER_CLASSES:
        assert worker_class(name).__bases__ == (Pipeline,), name
