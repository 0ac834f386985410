"""The worker table's rules, without forking: how a worker's exit is classified, how a worker
that will not go is escalated, when one is hung, what its records change."""

from __future__ import annotations

import os
import signal

import pytest

from forkserve.arbiter.workers import KILL_GRACE, WorkerHandle, describe_status
from forkserve.counters import ExitCode, Kind, Record


def exited(code: int) -> int:
    return code << 8  # a wait status: exited with ``code``


def handle(**fields: object) -> WorkerHandle:
    return WorkerHandle(1, 1, pid=100, **fields)  # type: ignore[arg-type]


@pytest.mark.parametrize("fields, reason", [
    ({}, "crashed"),
    ({"stopping": True}, "stopped"),
    ({"retiring": "max-requests (50)", "stopping": True}, "max_requests"),
    ({"kill_reason": "a timeout (30s without a heartbeat)"}, "timeout"),
    ({"kill_reason": "a SIGKILL (it did not stop in time)", "stopping": True}, "killed"),
])
def test_exit_classification(fields: dict[str, object], reason: str) -> None:
    assert handle(booted=True, **fields).exit_reason() == reason


def test_a_boot_failure_tells_an_app_that_cannot_load_from_a_crash() -> None:
    assert handle(boot_error="ImportError: no module x").boot_failure(exited(1)) == \
        ("ImportError: no module x", ExitCode.APP_LOAD_ERROR)
    assert handle().boot_failure(exited(ExitCode.APP_LOAD_ERROR)) == \
        ("the application could not be loaded", ExitCode.APP_LOAD_ERROR)
    reason, code = handle().boot_failure(signal.SIGSEGV)
    assert code == ExitCode.WORKER_BOOT_ERROR
    assert reason == "a worker was killed by signal 11 (SIGSEGV) while booting"
    assert handle(kill_reason="a timeout (5s without a boot)").boot_failure(signal.SIGKILL)[0] == \
        "a timeout (5s without a boot)"


def test_escalation_keeps_the_earliest_plan() -> None:
    h = handle()
    h.escalate(20.0, signal.SIGQUIT)
    h.escalate(30.0, signal.SIGKILL)  # later: ignored
    assert (h.escalate_at, h.escalate_signal) == (20.0, signal.SIGQUIT)
    h.escalate(10.0, signal.SIGKILL)  # sooner: taken
    assert (h.escalate_at, h.escalate_signal) == (10.0, signal.SIGKILL)


def test_quit_then_kill_after_the_grace() -> None:
    h = handle(booted=True, stopping=True)
    h.escalate(20.0, signal.SIGQUIT)
    assert h.due(19.9) is None
    assert h.due(20.0) == signal.SIGQUIT
    assert (h.escalate_at, h.escalate_signal) == (20.0 + KILL_GRACE, signal.SIGKILL)
    assert h.due(20.0 + KILL_GRACE - 0.1) is None and not h.kill_reason
    assert h.due(20.0 + KILL_GRACE) == signal.SIGKILL
    assert h.escalate_at is None and h.kill_reason == "a SIGKILL (it did not stop in time)"
    assert h.due(1e9) is None, "nothing after the KILL"
    assert h.exit_reason() == "killed"


def test_a_worker_is_hung_after_timeout_without_a_heartbeat_unless_stopping() -> None:
    h = handle(booted=True, last_seen=100.0)
    assert not h.timed_out(129.9, 30.0)
    assert h.timed_out(130.0, 30.0)
    assert not h.timed_out(1e9, 0.0), "--timeout 0: never"
    assert not handle(stopping=True, last_seen=0.0).timed_out(1e9, 30.0)
    planned = handle(last_seen=0.0)
    planned.escalate(5.0, signal.SIGKILL)
    assert not planned.timed_out(1e9, 30.0), "already being escalated"


def test_records_update_the_handle() -> None:
    h = handle()
    h.take(Record(Kind.SNAPSHOT, 1, 100, 3, 2, 1, 40), 5.0)
    assert (h.last_seen, h.active_connections, h.in_flight_requests, h.background_tasks,
            h.requests_served, h.booted) == (5.0, 3, 2, 1, 40, False)
    assert h.state() == "booting"
    h.take(Record(Kind.BOOTED, 1, 100), 6.0)
    assert h.booted and h.state() == "running" and h.serves()
    h.take(Record(Kind.RETIRING, 1, 100, text="max-requests (50)"), 7.0)
    assert h.stopping and h.retiring == "max-requests (50)" and h.state() == "stopping"
    assert not h.serves()
    h.take(Record(Kind.DRAINING, 1, 100), 8.0)
    assert h.draining and h.state() == "draining"
    failed = handle()
    failed.take(Record(Kind.BOOT_ERROR, 1, 100, text="SyntaxError"), 1.0)
    assert failed.boot_error == "SyntaxError" and not failed.booted


def test_describe_status() -> None:
    assert describe_status(exited(3)) == "exited with code 3"
    assert describe_status(signal.SIGKILL) == "was killed by signal 9 (SIGKILL)"
    assert os.WIFSIGNALED(signal.SIGKILL)  # the encoding these tests rely on
