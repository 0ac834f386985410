"""PaaS and container conventions (issue 12) on a real server: with no --bind, $PORT binds every
interface; WEB_CONCURRENCY sets the worker count; --threads alone means the thread worker. Each
decision is one log line saying where it came from, and the server serves under load on it."""

from __future__ import annotations

from typing import Any

import pytest

from tests.harness import wait_for, worker_set
from tests.load import Load

CASES = {  # worker class -> the options that give it (thread: --threads alone)
    "sync": (),
    "thread": ("--threads", "8"),
    "gevent": ("-k", "gevent"),
}


@pytest.mark.parametrize("worker_class", list(CASES))
def test_port_and_web_concurrency_under_load(server_factory: Any, worker_class: str) -> None:
    # PORT=0: the platform's port, chosen by the kernel here (never a probed "free" port).
    server = server_factory(*CASES[worker_class], bind=None, workers=0,
                            env={"PORT": "0", "WEB_CONCURRENCY": "3"}).wait_ready()
    server.wait_log("Using bind 0.0.0.0:0 (from $PORT)", setting="bind")
    server.wait_log("Using workers 3 (from WEB_CONCURRENCY)", setting="workers")
    started = server.wait_log("Starting forkserve")
    assert started["listening"].startswith("0.0.0.0:") and started["workers"] == 3
    assert started["worker_class"] == worker_class
    if worker_class == "thread":
        server.wait_log("Using worker_class thread (from --threads 8)", setting="worker_class")
    assert len(worker_set(server, 3)) == 3
    with Load(server.port, "/", threads=6, seconds=30, keepalive=True) as load:
        wait_for(lambda: len(load.bodies) >= 300, 30, lambda: f"300 responses; {load.failures[:3]}")
    assert load.failures == [], load.failures[:5]
