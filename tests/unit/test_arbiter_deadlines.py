"""The arbiter's deadlines registry, without a loop or a fork: the loop sleeps until the
earliest moment any owner has registered, and not at all when nothing is due."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from forkserve.arbiter import Arbiter
from forkserve.arbiter.workers import WorkerHandle
from forkserve.config import parse_args, resolve
from forkserve.lifecycle import State
from forkserve.logs import Log


def arbiter(tmp_path: Path, *argv: str) -> Arbiter:
    cli, _ = parse_args([*argv, "tests.apps.basic:app"], "test")
    return Arbiter(resolve(cli, {}), cli, [], Log("-", "critical"))


def test_nothing_due_sleeps_without_a_deadline(tmp_path: Path) -> None:
    a = arbiter(tmp_path, "--timeout", "0")
    assert a.next_timeout(100.0) is None


def test_the_earliest_deadline_of_any_owner_wins(tmp_path: Path) -> None:
    a = arbiter(tmp_path, "--timeout", "30")
    a.state = State.RUNNING
    a.workers[1] = WorkerHandle(1, 1, pid=1, last_seen=100.0, booted=True)  # hung at 130
    assert a.next_timeout(110.0) == pytest.approx(20.0)
    a.workers[2] = WorkerHandle(2, 1, pid=2, last_seen=100.0, stopping=True)
    a.workers[2].escalate(115.0, signal.SIGKILL)  # a stopping worker: its escalation counts
    assert a.next_timeout(110.0) == pytest.approx(5.0)
    a.resume_retry_at = 112.0  # handoff
    assert a.next_timeout(110.0) == pytest.approx(2.0)
    a.held_until = 110.5  # the loop's own: held transition lines
    assert a.next_timeout(110.0) == pytest.approx(0.5)
    a.next_watchdog = 110.25  # observe: systemd's watchdog
    assert a.next_timeout(110.0) == pytest.approx(0.25)
    assert a.next_timeout(111.0) == 0.0, "past due: at once, never negative"


def test_a_past_respawn_backoff_is_no_deadline(tmp_path: Path) -> None:
    a = arbiter(tmp_path, "--timeout", "0")
    a.respawn_after = 50.0
    assert a.next_timeout(100.0) is None, "a backoff that is over must not spin the loop"
    assert a.next_timeout(40.0) == pytest.approx(10.0)


def test_the_drain_registers_its_deadline_lameduck_and_progress_line(tmp_path: Path) -> None:
    a = arbiter(tmp_path, "--timeout", "0")
    a.state = State.LAMEDUCK
    a.lameduck_until = 105.0
    assert a.next_timeout(100.0) == pytest.approx(5.0)
    a.state, a.lameduck_until = State.DRAINING, None
    a.deadline, a.next_progress = 125.0, 101.0
    assert a.next_timeout(100.0) == pytest.approx(1.0)
    a.state = State.FLUSHING  # no progress lines once drained; the deadline still holds
    assert a.next_timeout(100.0) == pytest.approx(25.0)
