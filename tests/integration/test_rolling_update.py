"""A rolling update behind a real HAProxy, the way Kubernetes rolls a Deployment (issue 14).

HAProxy (the Debian package; `.ci/run` installs it) on 127.0.0.1 balances two forkserve
instances, each health-checked with ``option httpchk GET /readyz`` on its status port every
100 ms, with backend keep-alive (``http-reuse always``) and deliberately no ``retry-on`` and no
``option redispatch``: a request lost on a backend connection reaches the client. Continuous
load goes through it (keep-alive clients and a new connection per request, every request
tagged with its own ``X-Request-ID``) while each instance in turn is rolled:

1. TERM with ``--lameduck``: its /readyz fails at once, HAProxy takes it out of rotation while
   it still serves; then it drains and exits;
2. its replacement starts: on a new port (HAProxy is told the new address through its runtime
   API, as an ingress controller does for a new pod), or on the same port with
   ``--reuse-port`` (both listen while the old one drains);
3. the replacement is ready (HAProxy sees /readyz 200) before the next instance is rolled.

Five rounds of both instances. Pass: not one failed request at the client, every old instance
exits 0, and every request answered is in exactly one instance's access log (so none was
served twice, and none lost after being logged). The in-place HUP and USR2 behind HAProxy are
in test_readiness_handoff.py (``test_haproxy_never_runs_out_of_servers``).
"""

from __future__ import annotations

import shutil
import signal
import socket
import subprocess
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from tests.harness import Server, read_response, wait_for

WORKER_CLASSES = ["sync", "thread", "gevent"]
ROUNDS = 5
LAMEDUCK = "1"  # seconds: HAProxy's checks (100 ms, fall 2) see /readyz fail well within it
CLIENT_TIMEOUT = 10.0

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(shutil.which("haproxy") is None, reason="haproxy is not installed"),
]


def haproxy_config(front: int, admin: Path, backends: list[tuple[int, int]]) -> str:
    servers = "\n".join(
        f"    server s{n} 127.0.0.1:{port} check port {status} inter 100ms fastinter 100ms "
        f"downinter 100ms rise 1 fall 2"
        for n, (port, status) in enumerate(backends))
    from bench.lifecycle_servers import haproxy_head

    return haproxy_head(f"    stats socket {admin} level admin\n") + f"""\
frontend fe
    bind 127.0.0.1:{front}
    default_backend be

backend be
    balance roundrobin
    http-reuse always
    option httpchk GET /readyz
    http-check expect status 200
{servers}
"""


class HAProxy:
    def __init__(self, tmp: Path, backends: list[tuple[int, int]]) -> None:
        self.admin = tmp / "haproxy.sock"
        probe = socket.socket()
        probe.bind(("127.0.0.1", 0))  # a port for HAProxy's frontend, bound by HAProxy itself
        self.port = probe.getsockname()[1]
        probe.close()
        config = tmp / "haproxy.cfg"
        config.write_text(haproxy_config(self.port, self.admin, backends))
        self.log_path = tmp / "haproxy.log"
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(["haproxy", "-db", "-f", str(config)],
                                         stdin=subprocess.DEVNULL, stdout=log,
                                         stderr=subprocess.STDOUT, start_new_session=True)
        wait_for(lambda: self.proc.poll() is not None or self.up() == len(backends), 15,
                 lambda: f"HAProxy to see every backend up: {self.log_path.read_text()[-2000:]}")
        assert self.proc.poll() is None, self.log_path.read_text()[-2000:]

    def command(self, line: str) -> str:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(5)
            sock.connect(str(self.admin))
            sock.sendall(line.encode() + b"\n")
            data = b""
            while chunk := sock.recv(65536):
                data += chunk
        return data.decode()

    def states(self) -> dict[str, str]:
        """Each server's operational state (``show servers state``: srv_op_state 2 = up)."""
        if not self.admin.exists():
            return {}
        found = {}
        for line in self.command("show servers state be").splitlines():
            fields = line.split()
            if len(fields) > 5 and fields[1] == "be":
                found[fields[3]] = fields[5]
        return found

    def up(self) -> int:
        try:
            return sum(1 for state in self.states().values() if state == "2")
        except OSError:
            return 0

    def is_up(self, name: str) -> bool:
        return self.states().get(name) == "2"

    def move(self, name: str, port: int, status: int) -> None:
        """The server's new address, as an ingress controller sets a new pod's."""
        for line in (f"set server be/{name} addr 127.0.0.1 port {port}",
                     f"set server be/{name} check-port {status}"):
            answer = self.command(line)
            assert "not" not in answer.lower() or "changed" in answer.lower(), answer

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


class TaggedLoad:
    """Client threads through HAProxy, half keep-alive and half a new connection per request;
    each request carries its own X-Request-ID, and every answer or failure is recorded."""

    def __init__(self, port: int, threads: int = 4) -> None:
        self.port = port
        self.stop_event = threading.Event()
        self.lock = threading.Lock()
        self.ok: list[str] = []
        self.failures: list[str] = []
        self.threads = [threading.Thread(target=self._run, args=(n, n % 2 == 0), daemon=True)
                        for n in range(threads)]

    def __enter__(self) -> "TaggedLoad":
        for thread in self.threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        self.stop_event.set()
        for thread in self.threads:
            thread.join(CLIENT_TIMEOUT + 5)
        alive = [t.name for t in self.threads if t.is_alive()]
        assert not alive, f"load threads did not stop: {alive}"

    def wait_more(self, count: int, timeout: float = 20.0) -> None:
        target = len(self.ok) + count
        wait_for(lambda: len(self.ok) >= target or self.failures, timeout,
                 lambda: f"{count} more answers through HAProxy ({self.summary()})")

    def summary(self) -> str:
        return f"{len(self.ok)} ok, {len(self.failures)} failed"

    def _run(self, n: int, keepalive: bool) -> None:
        sock: socket.socket | None = None
        seq = 0
        while not self.stop_event.is_set():
            seq += 1
            tag = f"t{n}-{seq}"
            request = (f"GET /?id={tag} HTTP/1.1\r\nHost: roll\r\nX-Request-ID: {tag}\r\n"
                       f"{'' if keepalive else 'Connection: close' + chr(13) + chr(10)}\r\n")
            began = time.monotonic()
            try:
                if sock is None:
                    sock = socket.create_connection(("127.0.0.1", self.port),
                                                    timeout=CLIENT_TIMEOUT)
                sock.sendall(request.encode())
                response = read_response(sock, CLIENT_TIMEOUT)
                if response.status != 200:
                    raise AssertionError(f"status {response.status}: {response.body[:200]!r}")
                if not keepalive or response.headers.get("connection", "").lower() == "close":
                    sock.close()
                    sock = None
            except Exception as exc:  # noqa: BLE001 - every failure is recorded, none hidden
                if sock is not None:
                    sock.close()
                    sock = None
                with self.lock:
                    self.failures.append(f"{tag} after {time.monotonic() - began:.3f}s: {exc!r}")
                continue
            with self.lock:
                self.ok.append(tag)
        if sock is not None:
            sock.close()


def start(server_factory: Any, worker_class: str, log: Path, bind: str = "127.0.0.1:0",
          status: str = "127.0.0.1:0", reuse_port: bool = False) -> Server:
    args = ["-k", worker_class, "--status-bind", status, "--lameduck", LAMEDUCK,
            "--access-log", str(log), "--access-log-format", "{request_id} {status}"]
    if reuse_port:
        args.append("--reuse-port")
    server = server_factory(*args, app="bench.apps_lifecycle:hello", bind=bind)
    return server.wait_ready(30)  # type: ignore[no-any-return]


@pytest.mark.parametrize("worker_class", WORKER_CLASSES)
@pytest.mark.parametrize("placement", ["new-port", "same-port"])
def test_rolling_update_behind_haproxy_loses_nothing(server_factory: Any, tmp_path: Path,
                                                     worker_class: str, placement: str) -> None:
    logs: list[Path] = []

    def log_path() -> Path:
        logs.append(tmp_path / f"access-{len(logs)}.log")
        return logs[-1]

    same = placement == "same-port"
    instances = [start(server_factory, worker_class, log_path(), reuse_port=same)
                 for _ in range(2)]
    haproxy = HAProxy(tmp_path, [(s.port, s.status_port) for s in instances])
    old_exits: list[int | None] = []
    try:
        with TaggedLoad(haproxy.port) as load:
            load.wait_more(50)
            for _ in range(ROUNDS):
                for slot, old in enumerate(instances):
                    name = f"s{slot}"
                    old.signal(signal.SIGTERM)
                    old.wait_log("Received shutdown signal")
                    if same:
                        # The replacement joins the same ports while the old one drains.
                        new = start(server_factory, worker_class, log_path(),
                                    bind=f"127.0.0.1:{old.port}",
                                    status=f"127.0.0.1:{old.status_port}", reuse_port=True)
                        old_exits.append(old.wait_exit(30))
                    else:
                        # Kubernetes: the old pod is out of the endpoints (not ready) and
                        # drains; the new pod has a new address.
                        wait_for(lambda: not haproxy.is_up(name), 10,
                                 lambda: f"HAProxy to take {name} out ({haproxy.states()})")
                        new = start(server_factory, worker_class, log_path())
                        old_exits.append(old.wait_exit(30))
                        haproxy.move(name, new.port, new.status_port)
                    wait_for(lambda: haproxy.is_up(name), 15,
                             lambda: f"HAProxy to see {name} up again ({haproxy.states()})")
                    instances[slot] = new
                    load.wait_more(20)
        for server in instances:
            server.signal(signal.SIGTERM)
        final_exits = [server.wait_exit(30) for server in instances]
    finally:
        haproxy.close()
    print(f"\n[rolling update, {placement}, {worker_class}] {ROUNDS} rounds x 2 instances: "
          f"{load.summary()}")
    assert load.failures == [], f"{load.summary()}: {load.failures[:20]}"
    assert old_exits == [0] * (2 * ROUNDS), old_exits
    assert final_exits == [0, 0], final_exits
    logged: Counter[str] = Counter()
    for path in logs:
        for line in path.read_text().splitlines():
            tag, status = line.split()
            assert status == "200", line
            logged[tag] += 1
    twice = [tag for tag, n in logged.items() if n > 1]
    assert twice == [], f"served more than once: {twice[:10]}"
    missing = set(load.ok) - set(logged)
    assert not missing, f"{len(missing)} answered requests in no access log: {sorted(missing)[:10]}"
    assert set(logged) == set(load.ok), sorted(set(logged) - set(load.ok))[:10]

