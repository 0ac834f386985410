"""The stop's first log lines carry the true numbers (issue 10, task 4).

A busy sync worker reports only between requests, so at TERM the arbiter's last numbers for it
may say nothing is in flight. The transition lines "Received shutdown signal" and "Stopped
accepting" are written once the workers' live numbers are in (their answers to SIGWINCH, their
DRAINING records), bounded; the transitions themselves are not delayed.

Real ``python -m forkserve`` process groups, JSON logs, a request held in flight on a FIFO gate
(``/block?fifo=`` of tests.apps.basic), real signals.
"""

from __future__ import annotations

import signal
from typing import Any

import pytest

from tests.harness import read_response, refused, send_get, wait_for

WORKER_CLASSES = ["sync", "thread", "gevent"]


@pytest.mark.parametrize("worker_class", WORKER_CLASSES)
@pytest.mark.parametrize("lameduck", ["0", "0.3"])
def test_drain_lines_count_the_request_in_flight(server_factory: Any, gates: Any,
                                                 worker_class: str, lameduck: str) -> None:
    server = server_factory("-k", worker_class, "--lameduck", lameduck).wait_ready()
    gate = gates()
    with send_get(server.port, gate.route) as held:
        gate.wait_entered()
        server.signal(signal.SIGTERM)
        received = server.wait_log("Received shutdown signal")
        stopped = server.wait_log("Stopped accepting")
        # The drain was not held up by the wait for numbers: accepting has stopped already.
        wait_for(lambda: refused(server.port), 5, "new connections to be refused")
        assert server.proc.poll() is None, "nothing may exit while the request is in flight"
        gate.release()
        response = read_response(held)
        assert response.status == 200 and response.body == b"released"
    assert server.wait_exit(15) == 0
    assert received["state"] == "lameduck" and stopped["state"] == "draining"
    for record in (received, stopped):
        assert record["in_flight_requests"] == 1, record
        assert record["active_connections"] == 1, record
    log = [r.get("message", "") for r in server.records()]
    # One line per transition, in order.
    assert [m for m in log if m.startswith(("Received shutdown", "Stopped accepting",
                                            "All connections drained"))] == [
        "Received shutdown signal, draining connections",
        "Stopped accepting; draining in-flight work", "All connections drained"]
