"""Readiness means "send me traffic" (issue 10, task 3).

/readyz stays 200 through HUP reloads and USR2 in-place upgrades while old workers serve (the
exec window included: the status listener and its queue are handed to the new image, which
answers at once), and fails only when the server is going away or cannot serve.

Real ``python -m forkserve`` process groups with ``--status-bind 127.0.0.1:0``, real signals,
steady load (``tests.load.Load``), and a prober thread sending /readyz on a fresh connection
per probe for the whole run (bounded in time), recording every answer or failure.
"""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Any

import pytest

from tests.harness import read_response, send_get, wait_for, worker_set
from tests.load import Load, Prober, readyz

STATUS = ("--status-bind", "127.0.0.1:0")
WORKER_CLASSES = ["sync", "thread", "gevent"]


@pytest.mark.parametrize("worker_class", WORKER_CLASSES)
def test_readyz_is_200_through_hups_and_usr2s_and_503_at_term(server_factory: Any,
                                                              tmp_path: Path, gates: Any,
                                                              worker_class: str) -> None:
    version = tmp_path / "version"
    version.write_text("v1")
    server = server_factory(*STATUS, "-k", worker_class, app="tests.apps.reload:app",
                            env={"RELOAD_VERSION_FILE": str(version)}).wait_ready()
    port = server.status_port
    assert readyz(port)[0] == 200
    load = Load(server.port, threads=4, seconds=120).start()
    with Prober(port) as prober:
        load.wait_requests(20)
        for n in range(1, 6):
            old = worker_set(server, 2)
            before = len(prober.answers)
            server.signal(signal.SIGHUP)
            wait_for(lambda: server.count_log("Reload complete") >= n, 20,
                     lambda: f"reload {n}\n{server.log_text()}")
            wait_for(lambda: not set(server.workers()) & old, 20, "the old workers to go")
            wait_for(lambda: len(prober.answers) > before + 2, 10, "probes during the reload")
        hup_probes = len(prober.answers)
        for n in range(1, 4):
            old = worker_set(server, 2)
            version.write_text(f"v{n + 1}")
            server.signal(signal.SIGUSR2)
            wait_for(lambda: server.count_log("Upgrade complete") >= n, 30,
                     lambda: f"upgrade {n}\n{server.log_text()}")
            wait_for(lambda: not set(server.workers()) & old, 20, "the old workers to go")
            before = len(prober.answers)
            wait_for(lambda: len(prober.answers) > before + 2, 10, "probes after the upgrade")
    reloading = prober.count(lambda a: a[1]["reloading"])
    print(f"\n[readyz, {worker_class}] {len(prober.answers)} probes ({hup_probes} over 5 HUPs), "
          f"{reloading} of them during a reload or upgrade, {len(prober.failures)} failed; "
          f"load {load.summary()}")
    assert prober.failures == [], prober.failures[:10]
    not_ready = [a for a in prober.answers if a[0] != 200]
    assert not_ready == [], not_ready[:10]
    assert reloading > 0, "no probe landed during a reload: the test proves nothing"
    assert server.count_log("Upgrade: re-executing") == 3

    # Going away: 503 from the TERM on (a request held in flight keeps the drain going). The
    # load stops first: a sync worker serves one request at a time, and a load client it had
    # accepted just before the held request, whose own request came a moment after its
    # handshake (on a loaded machine, tens of ms), waits behind the held one (README:
    # Security); stopping the load with the gate shut would wait out that client's timeout.
    load.stop()
    gate = gates()
    with send_get(server.port, gate.route) as held:
        gate.wait_entered()
        server.signal(signal.SIGTERM)
        server.wait_log("Received shutdown signal")
        status, body = readyz(port)
        assert status == 503 and body["ready"] is False, body
        assert body["state"] in ("lameduck", "draining"), body
        gate.release()
        assert read_response(held).status == 200
    assert server.wait_exit(20) == 0
    assert load.failures == [], f"{load.summary()}: {load.failures[:20]}"


def test_new_image_is_ready_at_once_while_the_adopted_workers_serve(server_factory: Any,
                                                                    tmp_path: Path,
                                                                    gates: Any) -> None:
    """After the exec, the new image's workers are held booting (their import waits on a
    gate): the new image is BOOTING, the adopted workers serve, and /readyz says 200."""
    boot = tmp_path / "boot"  # absent: the first generation boots at once
    server = server_factory(*STATUS, app="tests.apps.status:app", workers=1,
                            env={"STATUS_BOOT_GATE": str(boot)}).wait_ready()
    port = server.status_port
    (old,) = worker_set(server, 1)
    gate = gates("boot")  # from now on an import of the app waits on it
    server.signal(signal.SIGUSR2)
    gate.wait_entered()  # the upgrade's check imports the app
    assert readyz(port) == (200, {"ready": True, "state": "running", "generation": 1,
                                  "reloading": True})
    gate.release()
    server.wait_log("Upgrade: re-executing")
    gate.wait_entered()  # the new image's worker imports the app
    assert server.count_log("Starting forkserve") == 2
    # The old image's status stand-in answered through the exec. The new arbiter stops it
    # after it forks its workers, so a probe sent once a new worker imports may still reach
    # the stand-in (seen in a loaded suite: "upgrading", generation 1). Each probe is ready;
    # the new image's own answer follows.
    booting = (200, {"ready": True, "state": "booting", "generation": 2, "reloading": True})
    answers: list[tuple[int, dict[str, Any]]] = []

    def new_image_answers() -> bool:
        answers.append(readyz(port))
        return answers[-1] == booting

    wait_for(new_image_answers, 10, lambda: f"the new image's /readyz; last {answers[-3:]}")
    assert all(status == 200 and body["ready"] is True for status, body in answers), answers
    with send_get(server.port, "/pid") as sock:
        assert int(read_response(sock).body) == old  # the adopted worker serves
    gate.release()
    server.wait_log("Upgrade complete")
    wait_for(lambda: old not in server.workers(), 10, "the adopted worker to go")
    assert readyz(port) == (200, {"ready": True, "state": "running", "generation": 2,
                                  "reloading": False})
    server.signal(signal.SIGTERM)
    assert server.wait_exit(20) == 0


@pytest.mark.parametrize("worker_class", WORKER_CLASSES)
def test_readyz_stays_200_while_max_requests_recycles_every_worker(server_factory: Any,
                                                                   worker_class: str) -> None:
    """--max-requests 20 under load retires both workers every few dozen requests, often both
    at once: their replacements boot while the listeners stay open and the queue waits for
    them. That is no reason to tell a balancer to go away (behind HAProxy it answered 503
    "no server" to clients that would have been served a moment later)."""
    server = server_factory(*STATUS, "-k", worker_class, "--max-requests", "20",
                            app="tests.apps.reload:app").wait_ready()
    load = Load(server.port, threads=8, seconds=120).start()
    with Prober(server.status_port) as prober:
        wait_for(lambda: server.count_log("retired") >= 20 and len(prober.answers) >= 100, 60,
                 lambda: f"20 recycled workers and 100 probes\n{server.log_text()[-3000:]}")
    load.stop()
    recycled = server.count_log("retired")
    print(f"\n[readyz, max-requests, {worker_class}] {len(prober.answers)} probes while "
          f"{recycled} workers were recycled; load {load.summary()}")
    assert prober.failures == [], prober.failures[:10]
    not_ready = [a for a in prober.answers if a[0] != 200]
    assert not_ready == [], not_ready[:10]
    assert load.failures == [], load.failures[:10]
