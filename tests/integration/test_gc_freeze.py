"""--preload freezes the arbiter's objects (gc.collect(); gc.freeze()) before forking, and every
worker freezes what it inherited as it starts (the server's own objects, without --preload), so
that the workers' garbage collector leaves the shared pages alone; --no-gc-freeze (or
FORKSERVE_GC_FREEZE=0) turns both off. Seen from the workers: each one reports
gc.get_freeze_count(), the size of its permanent generation. The memory this saves is
measured by bench/memory.py, not here (no timing or sizes in a test).

--preload with sync and thread workers only: it is refused with -k gevent (the application
would be imported before gevent patches the standard library).
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.harness import Server, get, wait_for

APP = "tests.apps.gcfreeze:app"
CLASS_ARGS = {"sync": (), "thread": ("-k", "thread", "--threads", "2")}
by_worker_class = pytest.mark.parametrize("worker_class", list(CLASS_ARGS))
EVERY_CLASS = {**CLASS_ARGS, "gevent": ("-k", "gevent")}
by_every_class = pytest.mark.parametrize("worker_class", list(EVERY_CLASS))


def frozen_counts(server: Server, workers: int = 2) -> dict[int, int]:
    """gc.get_freeze_count() of every worker, asked until each one has answered."""
    seen: dict[int, int] = {}

    def ask() -> bool:
        frozen, pid = get(server.port, "/").body.split()
        seen[int(pid)] = int(frozen)
        return len(seen) == workers

    wait_for(ask, 15, lambda: f"an answer from each of {workers} workers, have {seen}",
             interval=0)
    assert set(seen) == set(server.workers())
    return seen


@by_worker_class
def test_preload_freezes_before_forking(server_factory: Any, worker_class: str) -> None:
    server = server_factory("--preload", "--log-level", "debug", *CLASS_ARGS[worker_class],
                            app=APP).wait_ready()
    record = server.wait_log("Preloaded application frozen for copy-on-write")
    assert record["frozen_objects"] > 1000, record  # the app, and forkserve's worker code
    counts = frozen_counts(server)
    assert all(n > 1000 for n in counts.values()), counts


@pytest.mark.parametrize("how", ["flag", "env"])
def test_no_gc_freeze_turns_it_off(server_factory: Any, how: str) -> None:
    args, env = (("--no-gc-freeze",), {}) if how == "flag" else ((), {"FORKSERVE_GC_FREEZE": "0"})
    server = server_factory("--preload", "--log-level", "debug", *args, app=APP,
                            env=env).wait_ready()
    assert set(frozen_counts(server).values()) == {0}
    assert server.count_log("frozen for copy-on-write") == 0


@by_every_class
def test_without_preload_each_worker_freezes_what_it_inherited(server_factory: Any,
                                                               worker_class: str) -> None:
    """The arbiter freezes nothing (it imported no application), each worker freezes the
    arbiter's objects it inherited (forkserve's code and configuration: thousands), and what
    the application builds after the fork stays collectable: a reference cycle it drops is
    collected by a full collection in the worker."""
    server = server_factory("--log-level", "debug", *EVERY_CLASS[worker_class],
                            app=APP).wait_ready()
    counts = frozen_counts(server)
    assert all(n > 1000 for n in counts.values()), counts
    assert server.count_log("frozen for copy-on-write") == 0
    answers = {get(server.port, "/cycle").body for _ in range(4)}
    assert answers == {b"collected"}, answers


@by_every_class
def test_no_gc_freeze_without_preload(server_factory: Any, worker_class: str) -> None:
    server = server_factory("--no-gc-freeze", *EVERY_CLASS[worker_class], app=APP).wait_ready()
    assert set(frozen_counts(server).values()) == {0}
