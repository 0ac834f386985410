"""The processes of a lifecycle-matrix cell: forkserve, gunicorn and HAProxy, always killed.

forkserve runs through ``tests.harness.Server`` (JSON logs read line by line, port 0 read back
from the log); gunicorn through the same reader with its text log; HAProxy as a foreground
process (``-db``) on a port picked here. ``Procs`` owns every process group started for a cell
and kills what is left on any exit path (an exception, Ctrl-C): TERM first, so forkserve removes
its metrics directory, then SIGKILL of the whole group after a bounded wait.

An arbiter's exit is watched with a pidfd, which wakes the moment the process exits (no
polling), so "exit N ms after the last response" is measured, not sampled. gunicorn's USR2
makes a new master that is not our child: a pidfd works for it too (its exit code is not ours
to read).
"""

from __future__ import annotations

import os
import re
import select
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tests.harness import Server, children, process_group, wait_for  # noqa: E402

from bench.lifecycle_client import probe  # noqa: E402

APPS = {"hello": "bench.apps_lifecycle:hello", "sleep": "bench.apps_lifecycle:sleep",
        "stream": "bench.apps_lifecycle:stream"}
GUNICORN_CLASS = {"sync": "sync", "thread": "gthread", "gevent": "gevent"}
WORKERS = 2
THREADS = 4


def free_port() -> int:
    # The bench may pick a port this way (HAProxy's frontend cannot report a port 0 bind);
    # the servers themselves bind port 0 and report it.
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_exit(pid: int, timeout: float) -> float | None:
    """The monotonic time ``pid`` exited at (None if it still runs after ``timeout``)."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return time.monotonic()
    try:
        readable, _, _ = select.select([fd], [], [], timeout)
        return time.monotonic() if readable else None
    finally:
        os.close(fd)


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


class Gunicorn(Server):
    """gunicorn's master as a harness ``Server``: its text log read the same way."""

    def __init__(self, worker_class: str, app: str, *extra: str) -> None:
        script = Path(sys.executable).parent / "gunicorn"
        # gunicorn 24+ opens a control socket at one path in $HOME by default: two instances
        # (parallel cells, or the new master of a USR2) would fight over it.
        argv = [str(script) if script.exists() else "gunicorn", "-b", "127.0.0.1:0",
                "-w", str(WORKERS), "-k", GUNICORN_CLASS[worker_class], "--no-control-socket"]
        if worker_class == "thread":
            argv += ["--threads", str(THREADS)]
        argv += [*extra, app]
        self._launch(argv, dict(os.environ), None, ROOT, ())

    @property
    def port(self) -> int:
        if self._port is None:
            text = self.wait_text("Listening at:")
            match = re.search(r"Listening at: http://127\.0\.0\.1:(\d+)", text)
            assert match, text
            self._port = int(match.group(1))
        return self._port

    def count_log(self, message: str) -> int:
        with self._lock:
            return sum(1 for line in self.lines if message in line)

    def masters(self) -> list[int]:
        """Every master that logged ``Listening at`` (the first, then each USR2's), in order."""
        return [int(m) for m in re.findall(r"Listening at: \S+ \((\d+)\)", self.log_text())]


class Instance:
    """One running server: its master (which, after gunicorn's USR2, is not the process we
    started), ports, control socket."""

    def __init__(self, kind: str, server: Server, control: Path | None = None) -> None:
        self.kind = kind
        self.server = server
        self.master = server.pid
        self.control = control

    @property
    def port(self) -> int:
        return self.server.port

    @property
    def check_port(self) -> int:
        """Where a balancer checks readiness: forkserve's status server, gunicorn's app."""
        return self.server.status_port if self.kind == "forkserve" else self.server.port

    def workers(self) -> list[int]:
        return children(self.master)

    def signal(self, signum: int) -> None:
        os.kill(self.master, signum)

    def exit_code(self) -> int | None:
        """Ours to read only for the process we started."""
        if self.master != self.server.pid:
            return None
        try:
            return self.server.proc.wait(5)
        except subprocess.TimeoutExpired:
            return None


class Procs:
    """Every process group of a cell; ``close()`` leaves none, whatever happened."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.servers: list[Server] = []
        self.popens: list[subprocess.Popen[bytes]] = []
        self.loads: list[Any] = []
        self.haproxy_logs: list[Path] = []
        self.sequence = 0

    # -- starting -----------------------------------------------------------------------------
    def forkserve(self, worker_class: str, app: str, *extra: str, bind: str = "127.0.0.1:0",
                  status_bind: str = "127.0.0.1:0") -> Instance:
        self.sequence += 1
        control = self.tmp / f"fs{self.sequence}.sock"
        args = ["-k", worker_class]
        if worker_class == "thread":
            args += ["--threads", str(THREADS)]
        args += ["--status-bind", status_bind, "--control-socket", str(control)]
        # The app first: a trailing ``-sf PID...`` list in ``extra`` cannot swallow it.
        server = Server(APPS[app], *args, *extra, app="", bind=bind, workers=WORKERS)
        self.servers.append(server)
        return Instance("forkserve", server, control)

    def gunicorn(self, worker_class: str, app: str, *extra: str) -> Instance:
        server = Gunicorn(worker_class, APPS[app], *extra)
        self.servers.append(server)
        return Instance("gunicorn", server)

    def haproxy(self, backend_port: int, check_port: int, frontend: str = "",
                served: str = "/readyz", server_options: str = "") -> int:
        """A real HAProxy in front of the server; returns its frontend port once ``served``
        answers 200 through it. ``frontend``: more lines for its frontend section (``option
        forwardfor``...); ``server_options``: more for its server line (``send-proxy-v2``)."""
        if shutil.which("haproxy") is None:
            raise RuntimeError("haproxy is not installed (apt-get install haproxy)")
        front = free_port()
        self.sequence += 1
        cfg = self.tmp / f"haproxy{self.sequence}.cfg"
        cfg.write_text(haproxy_config(front, backend_port, check_port, frontend, server_options))
        self.haproxy_logs.append(self.tmp / f"haproxy{self.sequence}.log")
        log = open(self.haproxy_logs[-1], "wb")  # noqa: SIM115 - closed below
        try:
            proc = subprocess.Popen(["haproxy", "-db", "-f", str(cfg)], stdin=subprocess.DEVNULL,
                                    stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        finally:
            log.close()
        self.popens.append(proc)
        wait_for(lambda: proc.poll() is not None or probe(front, served, 2.0).kind == "ok", 15,
                 "HAProxy to forward to a healthy server")
        if proc.poll() is not None:
            raise RuntimeError(f"haproxy exited {proc.returncode}: "
                               f"{(self.tmp / f'haproxy{self.sequence}.log').read_text()[-2000:]}")
        return front

    def ready(self, instance: Instance, timeout: float = 30.0) -> Instance:
        """Until the instance serves: forkserve logs ``Server ready``; gunicorn has all its
        workers and answers."""
        if instance.kind == "forkserve":
            instance.server.wait_ready(timeout)
        else:
            port = instance.port
            wait_for(lambda: len(instance.workers()) == WORKERS, timeout, "gunicorn's workers")
            wait_for(lambda: probe(port, "/readyz", 2.0).kind == "ok", timeout, "gunicorn to answer")
        return instance

    # -- stopping -----------------------------------------------------------------------------
    def close(self) -> list[str]:
        """Stop the loads, TERM every group still there, SIGKILL what is left after a bounded
        wait; return notes about anything that needed the SIGKILL."""
        notes: list[str] = []
        for load in self.loads:
            load.kill()
        groups = [s.pid for s in self.servers] + [p.pid for p in self.popens]
        for pgid in groups:
            if process_group(pgid):
                try:
                    os.killpg(pgid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + 10
        for pgid in groups:
            while process_group(pgid) and time.monotonic() < deadline:
                time.sleep(0.05)
            left = process_group(pgid)
            if left:
                notes.append(f"group {pgid} needed SIGKILL ({len(left)} processes)")
                try:
                    os.killpg(pgid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        for server in self.servers:
            try:
                server.proc.wait(10)
            except subprocess.TimeoutExpired:
                notes.append(f"pid {server.pid} did not die")
            for reader in server._readers:
                reader.join(5)
            for stream in (server.proc.stdout, server.proc.stderr):
                if stream is not None:
                    stream.close()
        for proc in self.popens:
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                notes.append(f"pid {proc.pid} did not die")
        notes += haproxy_downs(self.tmp, self.haproxy_logs)
        return notes


def haproxy_downs(tmp: Path, logs: list[Path]) -> list[str]:
    """A note for each time HAProxy marked the server down, with its reason ("Layer7 wrong
    status, code: 503": the server said not ready; "Layer4/Layer7 timeout": no answer in time)."""
    notes = []
    for path in logs:
        try:
            text = path.read_text(errors="replace")
        except OSError:
            continue
        for match in re.finditer(r"Server \S+ is DOWN, reason: ([^,\n]+(?:, code: \d+)?)"
                                 r"(?:, info: \"[^\"]*\")?(?:, check duration: (\d+ms))?", text):
            reason, took = match.group(1), match.group(2)
            notes.append(f"HAProxy marked the server DOWN: {reason}" + (f" ({took})" if took else ""))
    return notes


def haproxy_head(global_lines: str = "") -> str:
    """The global and defaults sections of every HAProxy config the tests and benches run
    (see haproxy_config for why these timeouts)."""
    return f"""\
global
    maxconn 4096
{global_lines}
defaults
    mode http
    timeout connect 2s
    timeout client 30s
    timeout server 30s
    timeout http-keep-alive 30s
    timeout check 1s

"""


def haproxy_config(front: int, backend: int, check: int, frontend: str = "",
                   server_options: str = "") -> str:
    """HAProxy as deployed in front of an app server: backend keep-alive (``http-reuse always``)
    and a fast readiness check; deliberately no ``retry-on`` and no ``option redispatch``, so a
    request lost on a backend connection reaches the client (as a 502/503) instead of being
    hidden by a retry. (HAProxy's default ``retries 3`` still retries a failed *connect*, which
    is always safe.) The check runs every 100 ms, so a readiness that drops is seen at once; a
    check gets 1 s to be answered (``timeout check``: without it HAProxy would allow only the
    100 ms interval, and on a saturated machine, e.g. the matrix run once per class in parallel,
    the server is marked down for being scheduled late, not for saying it is not ready)."""
    return haproxy_head() + f"""\
frontend fe
    bind 127.0.0.1:{front}
    default_backend be
{frontend}
backend be
    http-reuse always
    option httpchk GET /readyz
    http-check expect status 200
    server app 127.0.0.1:{backend} check port {check} inter 100ms fastinter 100ms downinter 100ms rise 1 fall 2 {server_options}
"""
