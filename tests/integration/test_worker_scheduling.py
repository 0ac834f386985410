"""Where and how the kernel runs the workers.

--cpu-affinity pins each worker process, every thread of it, to one CPU of those the server
may run on, chosen by worker number (worker 1 the first, worker 2 the next, round again);
without it a worker may run wherever the arbiter may. --sched-batch puts every thread of each
worker (not the arbiter) under the SCHED_BATCH policy. Seen from outside: the affinity and
the policy of each of a worker's threads (sched_getaffinity, sched_getscheduler of its
thread ids), read while the workers serve a load of keep-alive clients. What they are for,
the thread worker's speed, is measured by bench/run.py (its fs-thread-pin and fs-thread-tuned
rows), not here.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import pytest

from tests.harness import Server, get, wait_for, wait_for_threads, worker_set
from tests.load import Load

EVERY_CLASS = {"sync": (), "thread": ("-k", "thread", "--threads", "4"), "gevent": ("-k", "gevent")}
# The threads a worker of each class runs once it serves: the thread worker's poll loop and
# its 4 request threads (see wait_for_threads).
STARTED_THREADS = {"sync": 1, "thread": 5, "gevent": 1}
by_every_class = pytest.mark.parametrize("worker_class", list(EVERY_CLASS))


def thread_affinities(pid: int) -> dict[int, set[int]]:
    """Each thread of process ``pid``: the CPUs it may run on (a thread that ended meanwhile
    is left out)."""
    found = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            found[int(tid)] = os.sched_getaffinity(int(tid))
        except ProcessLookupError:
            continue
    return found


def worker_number(pid: int) -> int | None:
    """The worker's number from its process title; None before it has one (just forked, it
    still bears the arbiter's), or once it is gone."""
    try:
        title = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode()
    except FileNotFoundError:
        return None
    if not title.startswith("forkserve: worker "):
        return None
    return int(title.split()[2])


def under_load(server: Server, requests: int = 300) -> Load:
    """16 keep-alive clients, running once they have had ``requests`` responses."""
    load = Load(server.port, threads=16, seconds=60, keepalive=True).start()
    load.wait_requests(requests, timeout=30)
    return load


@by_every_class
def test_each_worker_runs_on_its_own_cpu_every_thread_of_it(server_factory: Any,
                                                            worker_class: str) -> None:
    cpus = sorted(os.sched_getaffinity(0))
    server = server_factory("--cpu-affinity", *EVERY_CLASS[worker_class]).wait_ready()
    load = under_load(server)
    try:
        pinned = {}
        for pid in worker_set(server, 2):
            number = worker_number(pid)
            assert number is not None, pid
            started = STARTED_THREADS[worker_class]
            wait_for_threads(pid, started)
            threads = thread_affinities(pid)
            assert len(threads) >= started, threads
            expected = cpus[(number - 1) % len(cpus)]
            assert all(cpu_set == {expected} for cpu_set in threads.values()), (number, threads)
            pinned[number] = expected
        if len(cpus) > 1:
            assert pinned[1] != pinned[2], pinned
        assert os.sched_getaffinity(server.pid) == set(cpus)  # the arbiter is not pinned
    finally:
        load.stop()
    assert load.failures == [], load.failures[:5]


def test_without_it_a_worker_runs_where_the_arbiter_may(server_factory: Any) -> None:
    server = server_factory(*EVERY_CLASS["thread"]).wait_ready()
    load = under_load(server)
    try:
        arbiter = os.sched_getaffinity(server.pid)
        for pid in worker_set(server, 2):
            threads = thread_affinities(pid)
            assert all(cpu_set == arbiter for cpu_set in threads.values()), threads
    finally:
        load.stop()
    assert load.failures == [], load.failures[:5]


def test_the_cpus_given_to_the_server_are_kept(server_factory: Any) -> None:
    """Started on one CPU only (as under taskset, or a container's cpuset), both workers are
    pinned there: the set the server was given is where it picks from."""
    mine = os.sched_getaffinity(0)
    only = max(mine)
    os.sched_setaffinity(0, {only})  # (this thread's, which the server inherits)
    try:
        server = server_factory("--cpu-affinity", *EVERY_CLASS["thread"])
    finally:
        os.sched_setaffinity(0, mine)
    server.wait_ready()
    load = under_load(server)
    try:
        for pid in worker_set(server, 2):
            assert all(cpu_set == {only} for cpu_set in thread_affinities(pid).values())
    finally:
        load.stop()
    assert load.failures == [], load.failures[:5]


def test_a_replaced_worker_runs_where_the_one_it_replaces_did(server_factory: Any) -> None:
    server = server_factory("--cpu-affinity", *EVERY_CLASS["thread"]).wait_ready()
    wait_for(lambda: all(worker_number(pid) for pid in worker_set(server, 2)), 15,
             "both workers titled")
    before = {worker_number(pid): (pid, os.sched_getaffinity(pid))
              for pid in worker_set(server, 2)}
    killed, cpu_set = before[1]
    os.kill(killed, signal.SIGKILL)

    def replaced() -> int | None:
        for pid in server.workers():
            if pid != killed and pid != before[2][0] and worker_number(pid) == 1:
                return int(pid)
        return None

    new = wait_for(replaced, 15, "a new worker 1")
    wait_for(lambda: get(server.port, "/").status == 200, 15, "a response")
    assert all(found == cpu_set for found in thread_affinities(new).values())


def thread_policies(pid: int) -> dict[int, int]:
    found = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            found[int(tid)] = os.sched_getscheduler(int(tid))
        except ProcessLookupError:
            continue
    return found


@by_every_class
def test_sched_batch_covers_every_thread_of_every_worker(server_factory: Any,
                                                         worker_class: str) -> None:
    server = server_factory("--sched-batch", *EVERY_CLASS[worker_class]).wait_ready()
    load = under_load(server)
    try:
        for pid in worker_set(server, 2):
            started = STARTED_THREADS[worker_class]
            wait_for_threads(pid, started)
            policies = thread_policies(pid)
            assert len(policies) >= started, policies
            assert set(policies.values()) == {os.SCHED_BATCH}, policies
        assert os.sched_getscheduler(server.pid) == os.SCHED_OTHER  # not the arbiter
    finally:
        load.stop()
    assert load.failures == [], load.failures[:5]


def test_without_sched_batch_workers_keep_the_default_policy(server_factory: Any) -> None:
    server = server_factory("--cpu-affinity", *EVERY_CLASS["thread"]).wait_ready()
    load = under_load(server)
    try:
        for pid in worker_set(server, 2):
            assert set(thread_policies(pid).values()) == {os.SCHED_OTHER}
    finally:
        load.stop()
    assert load.failures == [], load.failures[:5]
