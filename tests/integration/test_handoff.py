"""Handoff between two separately started instances (HAProxy's -sf / -st), and TTOU / TTIN.

The old instance answers ``old PID``, the new one ``new PID`` (``tests.apps.reload`` with two
version files), so the load shows who served every request. The load uses a fresh connection
per request: a connection refused or reset during the handoff is a failed request.
"""

from __future__ import annotations

import os
import signal
import socket
import time
from pathlib import Path
from typing import Any

import pytest

from tests.integration.test_reload import pid_of, version_of
from tests.harness import worker_set, Server, closed_without_response, get, read_response, refused, send_get, usr2_with_its_check_held, wait_for
from tests.load import Load

APP = "tests.apps.reload:app"
THREADS = 4


# -- helpers ------------------------------------------------------------------------------------



def version_file(tmp_path: Path, name: str) -> Path:
    path = tmp_path / f"version-{name}"
    path.write_text(name)
    return path


def set_version(path: Path, text: str) -> None:
    """Rewrite a version file in one step (a rename): a worker importing the app meanwhile
    reads the old text or the new, never the empty file write_text leaves for a moment (a
    failed generation retries its boot at any time)."""
    staged = path.with_name(path.name + ".new")
    staged.write_text(text)
    os.replace(staged, path)


def start_old(server_factory: Any, tmp_path: Path, *args: str) -> Server:
    server = server_factory(*args, app=APP, env={"RELOAD_VERSION_FILE": str(version_file(tmp_path, "old"))})
    return server.wait_ready()  # type: ignore[no-any-return]


def start_new(server_factory: Any, tmp_path: Path, old: Server, *args: str,
              bind: str | None = None) -> Server:
    """The new instance, on the old one's port. The app comes before the options so that a
    ``-sf PID...`` list cannot swallow it."""
    return server_factory(APP, *args, app="", bind=bind or f"127.0.0.1:{old.port}",  # type: ignore[no-any-return]
                          env={"RELOAD_VERSION_FILE": str(version_file(tmp_path, "new"))})




def new_generation(server: Server, before: set[int], count: int = 2) -> set[int]:
    """Until the server's workers are ``count`` new ones, none of ``before`` left."""
    def current() -> set[int] | None:
        workers = set(server.workers())
        return workers if len(workers) == count and not workers & before else None
    return wait_for(current, 15, f"{count} workers of a new generation")  # type: ignore[no-any-return]


def errors(server: Server) -> list[dict[str, Any]]:
    return [r for r in server.records() if r.get("level") == "ERROR"]


def listening(server: Server) -> str:
    return str(server.wait_log("Starting forkserve")["listening"])


def report(name: str, load: Load) -> None:
    print(f"\n[{name}] {load.summary()}")


def soft_handoff_under_load(server_factory: Any, tmp_path: Path, old: Server, *new_args: str,
                            name: str) -> None:
    """Start a new instance with ``new_args`` ``-sf OLDPID`` while the load runs against the port;
    the old one must exit 0 and the new one serve, without one failed request."""
    old_workers = worker_set(old, 2)
    load = Load(old.port, threads=THREADS, seconds=60).start()
    try:
        load.wait_requests(1000)  # under way well before the handoff...
        mark = time.monotonic()
        new = start_new(server_factory, tmp_path, old, *new_args, "-sf", str(old.pid))
        new.wait_ready()
        assert listening(new) == f"127.0.0.1:{old.port}"
        assert old.wait_exit(20) == 0, old.log_text()
        gone = time.monotonic()
        new_workers = worker_set(new, 2)
        load.wait_body(lambda b: version_of(b) == "new", mark, 10, "a response from the new instance")
        load.wait_requests(1000)  # ...and until well after it
        assert not [b for b in load.since(gone + 0.5) if version_of(b) == "old"], \
            "the old instance answered after it exited"
    finally:
        load.stop()
    report(name, load)
    assert load.failures == [], f"{load.summary()}: {load.failures[:20]}"
    who = {pid: "old" for pid in old_workers} | {pid: "new" for pid in new_workers}
    wrong = [b for _, b in load.bodies if who.get(pid_of(b)) != version_of(b)]
    assert not wrong, f"responses from unknown workers: {wrong[:10]}"
    old.wait_log("Server stopped", timeout=5)
    assert errors(old) == [], old.log_text()
    assert errors(new) == [], new.log_text()
    assert new.proc.poll() is None
    assert version_of(get(old.port, "/").body) == "new"


# -- -sf ----------------------------------------------------------------------------------------

def test_takeover_handoff_under_load(server_factory: Any, tmp_path: Path, ctl_dir: Path) -> None:
    control = ctl_dir / "old.sock"
    old = start_old(server_factory, tmp_path, "--control-socket", str(control))
    wait_for(control.exists, 5, "the old instance's control socket")
    soft_handoff_under_load(server_factory, tmp_path, old, "--takeover", str(control),
                            name="-sf --takeover")


def test_reuse_port_handoff_under_load(server_factory: Any, tmp_path: Path) -> None:
    old = start_old(server_factory, tmp_path, "--reuse-port")
    soft_handoff_under_load(server_factory, tmp_path, old, "--reuse-port", name="-sf --reuse-port")


# -- -st ----------------------------------------------------------------------------------------

def test_st_stops_the_old_instance_at_once(server_factory: Any, tmp_path: Path, ctl_dir: Path,
                                           gates: Any) -> None:
    control = ctl_dir / "old.sock"
    # A request stuck in the old instance: a graceful stop would wait up to the drain timeout.
    old = start_old(server_factory, tmp_path, "--control-socket", str(control), "--drain-timeout", "30")
    wait_for(control.exists, 5, "the old instance's control socket")
    gate = gates()
    with send_get(old.port, gate.route) as stuck:
        gate.wait_entered()
        new = start_new(server_factory, tmp_path, old, "--takeover", str(control), "-st", str(old.pid))
        new.wait_ready()
        ready = time.monotonic()
        assert old.wait_exit(5) == 0, old.log_text()
        assert time.monotonic() - ready < 5
        old.wait_log("Hard stop")
        assert closed_without_response(stuck, 5)
    assert version_of(get(old.port, "/").body) == "new"
    assert new.proc.poll() is None


# -- the failure path ---------------------------------------------------------------------------

def test_port_held_by_a_foreign_process(server_factory: Any, tmp_path: Path, gates: Any) -> None:
    """The new instance wants two addresses: the old instance's port and one a foreign process
    holds (bound and listening without SO_REUSEPORT). Its bind fails; it sends TTOU, the old one
    frees its port, the retry still fails on the foreign one; it sends TTIN and exits 1 with one
    error line. The old instance serves what it had in flight throughout, and serves after."""
    old = start_old(server_factory, tmp_path)
    old_port = old.port
    with socket.socket() as foreign:
        foreign.bind(("127.0.0.1", 0))
        foreign.listen(8)
        foreign_port = foreign.getsockname()[1]
        gate = gates()
        with send_get(old_port, gate.route) as in_flight:
            gate.wait_entered()
            new = start_new(server_factory, tmp_path, old, "-b", f"127.0.0.1:{foreign_port}",
                            "-sf", str(old.pid))
            assert new.wait_exit(20) == 1, new.log_text()
            wait_for(lambda: errors(new), 5, "the new instance's error line")
            lines = errors(new)
            assert len(lines) == 1, new.log_text()
            assert f":{foreign_port}" in lines[0]["message"], lines
            assert not [l for l in new.lines if not l.startswith("{")], new.log_text()
            paused = old.wait_log("Paused: not listening")
            resumed = old.wait_log("Resumed: listening again")
            records = old.records()
            assert records.index(paused) < records.index(resumed)
            # The request in flight during the pause is served.
            gate.release()
            response = read_response(in_flight)
            assert response.status == 200 and response.body == b"released"
    wait_for(lambda: not refused(old_port), 5, "the old instance to listen again")
    for _ in range(4):
        response = get(old_port, "/")
        assert response.status == 200 and version_of(response.body) == "old"
    assert old.proc.poll() is None
    assert old.count_log("Received shutdown signal") == 0
    assert errors(old) == [], old.log_text()


# -- TTOU / TTIN by signal ----------------------------------------------------------------------

def test_ttou_pauses_and_ttin_resumes(server_factory: Any, tmp_path: Path, gates: Any) -> None:
    old = start_old(server_factory, tmp_path)
    port = old.port
    before = worker_set(old, 2)
    gate = gates()
    with send_get(port, gate.route) as in_flight:
        gate.wait_entered()
        old.signal(signal.SIGTTOU)
        old.wait_log("Paused: not listening")
        wait_for(lambda: refused(port), 5, "connections to be refused while paused")
        with socket.socket() as probe:  # closed in every process: the port is free
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            probe.bind(("127.0.0.1", port))
            probe.listen(1)
        gate.release()
        response = read_response(in_flight)
        assert response.status == 200 and response.body == b"released"
    old.signal(signal.SIGTTIN)
    old.wait_log("Resumed: listening again")
    assert not refused(port)
    after = worker_set(old, 2)
    assert not after & before, "resuming starts a new generation of workers"
    response = get(port, "/")
    assert response.status == 200 and pid_of(response.body) in after
    assert errors(old) == [], old.log_text()
    old.signal(signal.SIGTERM)
    assert old.wait_exit(10) == 0


@pytest.mark.parametrize("worker_class", ["sync", "thread", "gevent"])
def test_pause_and_resume_under_keepalive_load(server_factory: Any, tmp_path: Path,
                                              worker_class: str) -> None:
    """TTOU then TTIN while keep-alive clients keep sending: the paused workers let the port go
    (a sync worker answers its kept-alive client with Connection: close rather than serving it
    for as long as it sends, which held the port, so the TTIN waited and the clients who
    reconnected were never served), the server listens again, and no request fails but by
    being refused while paused."""
    extra = ["-k", worker_class, *(["--threads", str(THREADS)] if worker_class == "thread" else [])]
    old = start_old(server_factory, tmp_path, *extra)
    # (A with block: a failed wait stops the load too; left running, its sockets were every
    # later test's "leaked descriptors".) The bounds are for a hang: a resume boots a new
    # generation, which beside two loaded suites took longer than 10 s.
    with Load(old.port, threads=8, keepalive=True, seconds=90) as load:
        load.wait_requests(50)
        for n in range(1, 4):
            old.signal(signal.SIGTTOU)
            wait_for(lambda: old.count_log("Paused: not listening") >= n, 30, f"pause {n}")
            old.signal(signal.SIGTTIN)
            wait_for(lambda: old.count_log("Resumed: listening again") >= n, 30,
                     lambda: f"resume {n}\n{old.log_text()[-3000:]}")
            load.wait_requests(50, allowed="refused")  # (see test_defer_accept's pauses)
    assert load.failures_except("refused", 0) == [], load.summary()  # refused: while paused
    assert errors(old) == [], old.log_text()
    old.signal(signal.SIGTERM)
    assert old.wait_exit(10) == 0


@pytest.mark.parametrize("worker_class", ["sync", "thread", "gevent"])
def test_a_resume_that_cannot_boot_retries_instead_of_keeping_the_paused_workers(
        server_factory: Any, tmp_path: Path, worker_class: str) -> None:
    """TTIN reopens the port and boots a new generation; if that generation fails to boot, the
    paused workers cannot stand in for it as a reload's old workers do (they closed their
    listeners for good): the server keeps retrying, slower and slower, and once the app
    imports again the clients queued meanwhile are served. It used to 'keep the old workers
    serving': nobody accepted on the reopened port."""
    extra = ["-k", worker_class, *(["--threads", str(THREADS)] if worker_class == "thread" else [])]
    old = start_old(server_factory, tmp_path, *extra)
    version = tmp_path / "version-old"
    old.signal(signal.SIGTTOU)
    old.wait_log("Paused: not listening")
    set_version(version, "broken")
    old.signal(signal.SIGTTIN)
    old.wait_log("Resumed: listening again")
    old.wait_log("failed to boot", 15)
    assert old.count_log("Reload failed") == 0, old.log_text()
    with send_get(old.port, "/") as waiting:  # queued: nobody can take it yet
        set_version(version, "fixed")
        response = read_response(waiting, 20)
    assert response.status == 200 and response.body.startswith(b"fixed "), response
    old.wait_log("Reload complete")  # the retried generation booted; the paused ones retire
    old.signal(signal.SIGTERM)
    assert old.wait_exit(10) == 0


@pytest.mark.parametrize("worker_class", ["sync", "thread", "gevent"])
def test_ttin_soon_after_ttou_waits_for_the_paused_workers(server_factory: Any, tmp_path: Path,
                                                           gates: Any, worker_class: str) -> None:
    """A TTIN that comes while the paused workers still hold the port (serving what was queued
    at the pause; a sync worker inside a request keeps its copy until the request is done)
    waits until they let it go, then listens again. It used to fail at once ("Address already
    in use") and leave the server paused for good: the lifecycle matrix's ttou-ttin cell with
    the 200 ms app. Every client queued at the pause is answered."""
    extra = ["-k", worker_class, *(["--threads", str(THREADS)] if worker_class == "thread" else [])]
    old = start_old(server_factory, tmp_path, *extra)
    port = old.port
    before = worker_set(old, 2)
    held_gates = [gates(f"gate{i}") for i in range(2)]
    held = []
    for gate in held_gates:  # with sync, both workers are inside a request
        held.append(send_get(port, gate.route))
        gate.wait_entered()
    queued = [send_get(port, "/") for _ in range(3)]  # connected: in the accept queue or served
    try:
        old.signal(signal.SIGTTOU)
        old.wait_log("Paused: not listening")
        old.signal(signal.SIGTTIN)
        if worker_class == "sync":  # its workers hold the port until the gates open
            old.wait_log("Resume: the paused workers still hold the port")
            assert old.count_log("Resumed: listening again") == 0
        for gate in held_gates:
            gate.release()
        old.wait_log("Resumed: listening again", 15)
        for sock in held + queued:
            assert read_response(sock).status == 200
    finally:
        for sock in held + queued:
            sock.close()  # (a failure must not leave them to a later test's garbage collector)
    # Resuming starts a new generation of workers; the paused ones are retired once it serves.
    after = new_generation(old, before)
    response = get(port, "/")
    assert response.status == 200 and pid_of(response.body) in after
    assert errors(old) == [], old.log_text()
    old.signal(signal.SIGTERM)
    assert old.wait_exit(10) == 0


@pytest.mark.parametrize("worker_class", ["sync", "thread", "gevent"])
def test_a_ttou_during_an_upgrades_check_calls_the_upgrade_off(server_factory: Any, tmp_path: Path,
                                                               gates: Any, worker_class: str) -> None:
    """A successor's TTOU while USR2's check runs: the upgrade would exec into an image with
    no listeners of ours, binding the ports the successor is taking. It is called off (the
    check stopped, nothing re-executed); TTIN then resumes as after any pause."""
    server, gate, boot = usr2_with_its_check_held(server_factory, gates, tmp_path, "-k", worker_class)
    port = server.port
    server.signal(signal.SIGTTOU)
    server.wait_log("Paused: not listening")
    server.wait_log("Upgrade abandoned: the server is paused")
    gate.release()
    boot.unlink()  # the resume's generation boots at once
    wait_for(lambda: refused(port), 10, "the paused workers to let the port go")
    server.signal(signal.SIGTTIN)
    server.wait_log("Resumed: listening again")
    server.wait_log("Reload complete")  # the resume's generation serves
    assert get(port, "/").status == 200
    assert server.count_log("Upgrade: re-executing") == 0
    assert errors(server) == [], server.log_text()
    server.signal(signal.SIGTERM)
    assert server.wait_exit(15) == 0
