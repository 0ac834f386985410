"""Rollouts and rollbacks, without forking: an arbiter whose spawn makes a handle instead of
a process and whose signals are recorded. Each case is a generation's life as the rollout
table and the worker table decide it."""

from __future__ import annotations

import itertools
import signal
from typing import Any

import pytest

from forkserve.arbiter import Arbiter
from forkserve.arbiter.workers import WorkerHandle
from forkserve.config import parse_args, resolve
from forkserve.counters import ExitCode, Kind, Record
from forkserve.lifecycle import Rollout, State, Step
from forkserve.logs import Log
from forkserve.workers.base import WorkerSettings


class Fake(Arbiter):
    """spawn() records a handle (pids from 10**7 up, never a real process); send() records."""

    def spawn(self, worker_id: int, now: float) -> None:
        pid = next(self.pids)
        self.workers[pid] = WorkerHandle(worker_id, self.generation, pid=pid, spawned_at=now,
                                         last_seen=now, deaf=self.paused)

    def send(self, handle: WorkerHandle, signum: int) -> None:
        self.sent.append((handle.pid, signum))


def arbiter(*argv: str) -> Fake:
    cli, _ = parse_args(["-w", "2", *argv, "tests.apps.basic:app"], "test")
    a = Fake(resolve(cli, {}), cli, [], Log("-", "critical"))
    a.pids, a.sent = itertools.count(10**7), []  # type: ignore[attr-defined]
    a.worker_cls = object  # type: ignore[attr-defined]  (never forked)
    a.settings = WorkerSettings.of(a.config)  # type: ignore[attr-defined]
    return a


def boot(a: Fake, generation: int) -> None:
    for handle in list(a.workers.values()):
        if handle.generation == generation and not handle.booted:
            a.on_record(handle, Record(Kind.BOOTED, handle.worker_id, handle.pid), 0.0)


def running() -> Fake:
    a = arbiter()
    a.spawn_missing(0.0)
    boot(a, 1)
    assert a.state is State.RUNNING and a.rollout is Rollout.IDLE
    return a


def of(a: Fake, generation: int) -> list[WorkerHandle]:
    return [h for h in a.workers.values() if h.generation == generation]


def exited(code: int) -> int:
    return code << 8


def test_a_reload_boots_a_generation_then_retires_the_old(monkeypatch: Any) -> None:
    a = running()
    a.reload()
    assert a.rollout is Rollout.RELOADING and a.generation == 2 and len(of(a, 2)) == 2
    a.reload()  # a second HUP meanwhile: coalesced, not a third generation
    assert a.reload_wanted and a.generation == 2
    boot(a, 2)
    assert a.rollout is Rollout.IDLE
    assert sorted(a.sent) == sorted((h.pid, signal.SIGTERM) for h in of(a, 1)), "old retired"
    assert all(h.stopping for h in of(a, 1))
    a.carry_out_wanted()  # the coalesced one follows
    assert a.rollout is Rollout.RELOADING and a.generation == 3 and not a.reload_wanted


def test_a_reload_whose_workers_cannot_boot_rolls_back() -> None:
    a = running()
    before = a.config
    a.reload()
    failed = of(a, 2)[0]
    a.workers.pop(failed.pid)
    a.on_exit(failed, exited(ExitCode.APP_LOAD_ERROR))
    assert a.rollout is Rollout.IDLE and a.generation == 1
    assert a.config is before, "back to the configuration the old workers run"
    assert sorted(a.sent) == sorted((h.pid, signal.SIGQUIT) for h in of(a, 2))
    assert all(not h.stopping for h in of(a, 1)), "the old generation keeps serving"
    assert a.state is State.RUNNING and a.ready()


def test_a_resume_generation_that_cannot_boot_is_retried_with_backoff() -> None:
    """Paused workers serve nobody new, so there is nothing to roll back to: retry, slower
    and slower, still reloading (and not ready)."""
    a = running()
    for handle in a.workers.values():
        handle.deaf = True  # paused: they closed their listeners
    a.step(Step.RESUME)  # what resume() does once it has bound the port again
    a.start_generation("Resume")
    failed = of(a, 2)[0]
    a.workers.pop(failed.pid)
    a.on_exit(failed, exited(1))
    assert a.rollout is Rollout.RELOADING and a.generation == 2
    assert a.boot_failures == 1 and a.respawn_after > 0
    assert not any(signum == signal.SIGQUIT for _, signum in a.sent), "nothing rolled back"


def test_an_upgrades_new_image_rolls_back_to_the_old_workers() -> None:
    """The new image adopted the old image's workers (generation 1) and boots generation 2:
    when that cannot boot, the old workers keep serving and the server is ready."""
    from forkserve.handover import HandedWorker

    a = arbiter()
    a.adopt_old_workers([HandedWorker(1, 1, 1), HandedWorker(2, 2, 1)], 1)
    assert a.rollout is Rollout.ADOPTING and a.generation == 2 and a.ready()
    a.spawn_missing(0.0)
    failed = of(a, 2)[0]
    a.workers.pop(failed.pid)
    a.on_exit(failed, exited(ExitCode.APP_LOAD_ERROR))
    assert a.rollout is Rollout.IDLE and a.generation == 1 and a.state is State.RUNNING
    assert a.exit_code == ExitCode.OK, "the service stays up"
    assert {pid for pid, signum in a.sent if signum == signal.SIGQUIT} == {h.pid for h in of(a, 2)}


def test_the_first_generation_that_cannot_boot_stops_the_server() -> None:
    a = arbiter()
    a.spawn_missing(0.0)
    failed = next(iter(a.workers.values()))
    a.workers.pop(failed.pid)
    a.on_exit(failed, exited(ExitCode.APP_LOAD_ERROR))
    assert a.state is State.HALTING and a.exit_code == ExitCode.APP_LOAD_ERROR


@pytest.mark.parametrize("rollout", [Rollout.RELOADING, Rollout.CHECKING, Rollout.ADOPTING])
def test_a_reload_during_a_rollout_is_coalesced(rollout: Rollout) -> None:
    a = running()
    a.rollout = rollout
    a.reload()
    a.upgrade()
    assert a.rollout is rollout and a.reload_wanted and a.upgrade_wanted
    assert a.generation == 1, "nothing started"
