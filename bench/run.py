"""Side-by-side throughput of forkserve and its peers, in one run, on this machine (issue 16).

    python bench/run.py                    # every installed server; hello, json, sleep; c=50
    python bench/run.py --quick            # smoke: hello, c=50, ka+close, 3 s, 1 run
    python bench/run.py --full             # every workload × ka/close × c=2,50,500
    python bench/run.py --servers fs-sync,gu-sync,granian --workloads hello,file --conns 2,500
    python bench/run.py --client python    # the built-in load generator, not wrk
    python bench/run.py --json out.json --markdown bench/RESULTS.md
    python bench/run.py --lifecycle        # also bench/lifecycle_figures.run(args), if present

Servers (each on 127.0.0.1, a port picked by binding port 0; 2 workers where it has workers):
``fs-sync``, ``fs-thread`` (4 threads), ``fs-gevent``: ``python -m forkserve -w 2 --log-level
warning -k …``; ``fs-thread-pin``: ``fs-thread`` with ``--cpu-affinity`` (each worker on a CPU
of its own); ``fs-thread-tuned``: with ``--cpu-affinity --sched-batch``; ``fs-sync-defer``: ``fs-sync`` with ``--defer-accept 1``; ``gu-sync``, ``gu-gthread`` (4 threads), ``gu-gevent``: gunicorn the same;
``granian`` (``--interface wsgi --workers 2 --no-log``); ``bjoern`` (one process: it has no
workers); ``uwsgi`` (pyuwsgi's binary, ``--master --processes 2 --disable-logging
--http11-socket``: ``--http-socket`` answers HTTP/1.1 and then resets a reused connection);
``waitress`` (``--threads 4``, one process). A peer is run only where it is installed (``pip
install forkserve[bench]``); gunicorn is always expected.

What each server does with a client's ``Connection: close`` is checked at its start: one that
keeps the connection (uWSGI's ``--http11-socket``) gets the note "ignores Connection: close" on
its close rows, where wrk then reuses the connection (the Python client closes it itself). The
Python client also counts connections that got no response at all in a run (uWSGI serves two
keep-alive clients to exhaustion while the other 48 wait): a cell with any is flagged ``!``.

Workloads (bench/apps_bench.py; every server gets the same callable): ``hello`` (examples/hello.py,
14 bytes), ``big`` (64 KiB), ``file`` (1 MiB through ``wsgi.file_wrapper``), ``json`` (a 1 KiB JSON
POST echoed), ``sleep`` (10 ms ``time.sleep``; cooperative under gevent), ``flask``
(examples/flask_app, ``GET /api/hello``). Modes: ``ka`` (keep-alive) and ``close``
(``Connection: close`` on every request).

Order: for each repetition, for each workload, every selected server is started (and answers a
request, and takes 1 s of warm-up load); then for each (mode, conns) cell every server is run in
turn, so machine drift hits every server alike; then they are all stopped. Keeping a server up
across its workload's cells saves a start per cell; a server per workload keeps the hello
figures (RSS above all) free of Flask. The idle servers wait meanwhile: their CPU over 2 s of
no load is measured and printed when over 2 % of a core (each uses ≤ 2 % here). TERM, HUP and
Ctrl-C stop every server started.

Noise: /proc/stat's busy time over a run, minus the server's process tree and the load
generator (our rusage), is CPU someone else used. Over ``--noise`` (10 % of one core) the run
is repeated, twice at most; a cell still noisy is marked ``~``. A cell with socket errors or
non-2xx responses is marked ``!`` and listed under the table: fast errors must not look good.

Columns: req/s (median of runs), p50 and p99 (medians), socket errors and non-2xx (sums), RSS
and PSS (mean per worker process after the load, /proc/PID/smaps_rollup), CPU per request (the
server tree's utime+stime over the run / responses). Then the ratio of each forkserve config's
req/s to gunicorn's matching class and to every other peer, per cell.
"""

from __future__ import annotations

import argparse
import compileall
import importlib.metadata
import importlib.util
import json
import multiprocessing
import os
import platform
import re
import resource
import selectors
import shlex
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.apps_bench import json_body  # noqa: E402
from tests.harness import children  # noqa: E402  (no pytest in it: bench/drain_latency.py's too)

BIN = Path(sys.executable).parent
CLK_TCK = os.sysconf("SC_CLK_TCK")
WORKERS = 2
THREADS = 4
WARMUP_SECONDS = 1.0
START_TIMEOUT = 30.0
REQUEST_TIMEOUT = 5.0  # a response slower than this is a timeout (wrk --timeout too)
FILE_SIZE = 1 << 20


@dataclass(frozen=True)
class Workload:
    app: str
    path: str = "/"
    method: str = "GET"
    body: bytes = b""


WORKLOADS: dict[str, Workload] = {
    "hello": Workload("examples.hello:app"),
    "big": Workload("bench.apps_bench:big"),
    "file": Workload("bench.apps_bench:file"),
    "json": Workload("bench.apps_bench:json_echo", method="POST", body=json_body()),
    "sleep": Workload("bench.apps_bench:sleep"),
    "flask": Workload("examples.flask_app.app:app", path="/api/hello"),
}


@dataclass(frozen=True)
class ServerSpec:
    name: str
    needs: tuple[str, ...]  # importable modules
    one_process: bool = False
    note: str = ""


SERVERS: dict[str, ServerSpec] = {spec.name: spec for spec in (
    ServerSpec("fs-sync", ("forkserve",)),
    ServerSpec("fs-sync-defer", ("forkserve",), note="--defer-accept 1"),
    ServerSpec("fs-thread", ("forkserve",), note="4 threads"),
    ServerSpec("fs-thread-pin", ("forkserve",), note="4 threads, --cpu-affinity"),
    ServerSpec("fs-thread-tuned", ("forkserve",),
               note="4 threads, --cpu-affinity --sched-batch"),
    ServerSpec("fs-gevent", ("forkserve", "gevent")),
    ServerSpec("gu-sync", ("gunicorn",)),
    ServerSpec("gu-gthread", ("gunicorn",), note="4 threads"),
    ServerSpec("gu-gevent", ("gunicorn", "gevent")),
    ServerSpec("granian", ("granian",)),
    ServerSpec("bjoern", ("bjoern",), one_process=True, note="1 process"),
    ServerSpec("uwsgi", ("pyuwsgi",)),
    ServerSpec("waitress", ("waitress",), one_process=True, note="1 process, 4 threads"),
)}
MATCHING = {"fs-sync": "gu-sync", "fs-sync-defer": "gu-sync", "fs-thread": "gu-gthread", "fs-thread-pin": "gu-gthread",
            "fs-thread-tuned": "gu-gthread", "fs-gevent": "gu-gevent"}
# A forkserve configuration's name past its worker class: the flags it adds.
VARIANTS = {"": [], "pin": ["--cpu-affinity"], "tuned": ["--cpu-affinity", "--sched-batch"],
            "defer": ["--defer-accept", "1"]}
PEERS = ("granian", "bjoern", "uwsgi", "waitress")
VERSIONS = ("forkserve", "gunicorn", "gevent", "granian", "bjoern", "pyuwsgi", "waitress",
            "flask", "httptools")

BJOERN = ("import importlib, sys, bjoern\n"
          "module, _, name = sys.argv[1].partition(':')\n"
          "bjoern.run(getattr(importlib.import_module(module), name), '127.0.0.1', int(sys.argv[2]))")


def tool(name: str) -> str:
    """The venv's console script ``name`` (the one beside this Python), else the PATH's."""
    script = BIN / name
    return str(script) if script.exists() else (shutil.which(name) or name)


def argv_for(server: str, app: str, port: int) -> list[str]:
    bind = f"127.0.0.1:{port}"
    if server.startswith("fs-"):
        kind, _, variant = server[3:].partition("-")
        return [sys.executable, "-m", "forkserve", "-b", bind, "-w", str(WORKERS),
                "--log-level", "warning", "-k", kind,
                *(["--threads", str(THREADS)] if kind == "thread" else []),
                *VARIANTS[variant], app]
    if server.startswith("gu-"):
        kind = server[3:]
        # --no-control-socket: gunicorn 24+ opens one at a fixed path in $HOME otherwise, and
        # two masters up at once (ours all are) would fight over it.
        return [tool("gunicorn"), "-b", bind, "-w", str(WORKERS), "--log-level", "warning",
                "--no-control-socket", "-k", kind,
                *(["--threads", str(THREADS)] if kind == "gthread" else []), app]
    if server == "granian":
        return [tool("granian"), "--interface", "wsgi", "--workers", str(WORKERS), "--no-log",
                "--host", "127.0.0.1", "--port", str(port), app]
    if server == "bjoern":
        return [sys.executable, "-c", BJOERN, app, str(port)]
    if server == "uwsgi":
        # --die-on-term: uWSGI 2.0's TERM reloads. --http11-socket, not --http-socket: the
        # latter answers HTTP/1.1 with no Connection: close, then resets a reused connection.
        return [tool("uwsgi"), "--http11-socket", bind, "--master", "--processes", str(WORKERS),
                "--disable-logging", "--die-on-term", "--need-app", "--wsgi", app]
    if server == "waitress":
        return [tool("waitress-serve"), "--threads", str(THREADS), "--listen", bind, app]
    raise SystemExit(f"unknown server {server}")


def installed(server: str) -> bool:
    return all(importlib.util.find_spec(module) is not None for module in SERVERS[server].needs)


def free_port() -> int:
    # A benchmark may pick a port this way (bjoern, uWSGI and waitress cannot report a port 0
    # bind); the tests never do.
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# -- /proc readings -----------------------------------------------------------------------------

def stat_fields(pid: int) -> list[str] | None:
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as fh:
            return fh.read().rsplit(")", 1)[1].split()
    except OSError:
        return None




def tree(pid: int) -> list[int]:
    """``pid`` and its descendants (the walk of /proc/PID/task/*/children)."""
    found, todo = [], [pid]
    while todo:
        current = todo.pop()
        found.append(current)
        todo.extend(children(current))
    return found


def tree_cpu(pid: int) -> float:
    """CPU seconds of a process tree: utime+stime of each, plus the reaped children's (cutime,
    cstime), so a worker that exits during a run still counts."""
    ticks = 0
    for member in tree(pid):
        fields = stat_fields(member)
        if fields is not None:
            ticks += sum(int(fields[i]) for i in (11, 12, 13, 14))
    return ticks / CLK_TCK


def machine_cpu() -> float:
    """Busy CPU seconds of the whole machine since boot (user, nice, system, steal), from
    /proc/stat.

    irq and softirq are left out: with IRQ time accounting the loopback traffic of the run
    itself lands there, in no process's stime, and would make every run look noisy. Steal is
    in: it is time a hypervisor gave someone else."""
    with open("/proc/stat", encoding="ascii") as fh:
        values = [int(v) for v in fh.readline().split()[1:]]
    user, nice, system, _idle, _iowait, _irq, _softirq, steal = values[:8]
    return (user + nice + system + steal) / CLK_TCK


def own_cpu() -> float:
    """CPU seconds of this process and of its reaped children (wrk, the Python clients)."""
    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


def memory_mib(pid: int) -> tuple[float, float] | None:
    """(Rss, Pss) of ``pid`` in MiB, from /proc/PID/smaps_rollup."""
    values: dict[str, int] = {}
    try:
        with open(f"/proc/{pid}/smaps_rollup", encoding="ascii") as fh:
            for line in fh:
                key, _, rest = line.partition(":")
                if key in ("Rss", "Pss"):
                    values[key] = int(rest.split()[0])
    except OSError:
        return None
    return values.get("Rss", 0) / 1024, values.get("Pss", 0) / 1024


# -- servers ------------------------------------------------------------------------------------

@dataclass
class Running:
    name: str
    workload: str
    port: int
    proc: subprocess.Popen[bytes]
    log: Path
    notes: list[str] = field(default_factory=list)

    def workers(self) -> list[int]:
        """The worker processes (the process itself for a one-process server)."""
        if SERVERS[self.name].one_process:
            return [self.proc.pid]
        return [pid for pid in children(self.proc.pid) if (stat_fields(pid) or ["Z"])[0] != "Z"]

    def log_tail(self) -> str:
        try:
            return self.log.read_text(errors="replace")[-2000:]
        except OSError:
            return ""


def request_bytes(workload: Workload, port: int, close: bool) -> bytes:
    head = f"{workload.method} {workload.path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
    if close:
        head += "Connection: close\r\n"
    if workload.body:
        head += f"Content-Type: application/json\r\nContent-Length: {len(workload.body)}\r\n"
    return head.encode() + b"\r\n" + workload.body


def one_request(port: int, workload: Workload, timeout: float = 2.0,
                close_wait: float = 0.0) -> tuple[int, dict[str, str], bool]:
    """One request with ``Connection: close`` on a new connection: (status, headers, whether
    the server closed the connection within ``close_wait`` s of the body). Raises OSError."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        sock.sendall(request_bytes(workload, port, close=True))
        data = b""
        while b"\r\n\r\n" not in data:
            chunk = sock.recv(65536)
            if not chunk:
                raise OSError("closed before a response head")
            data += chunk
        raw, body = data.split(b"\r\n\r\n", 1)
        head = raw.decode("latin-1").split("\r\n")
        headers = {k.strip().lower(): v.strip() for k, _, v in (h.partition(":") for h in head[1:])}
        remaining = int(headers.get("content-length", "0")) - len(body)
        while remaining > 0:
            chunk = sock.recv(1 << 20)
            if not chunk:
                raise OSError("closed before the end of the body")
            remaining -= len(chunk)
        closed = False
        if close_wait:
            sock.settimeout(close_wait)
            try:
                closed = sock.recv(1) == b""
            except TimeoutError:
                closed = False
        return int(head[0].split()[1]), headers, closed


def start_server(name: str, workload_name: str, env: dict[str, str], logdir: Path) -> Running:
    workload = WORKLOADS[workload_name]
    port = free_port()
    log = logdir / f"{name}-{workload_name}-{port}.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(argv_for(name, workload.app, port), cwd=ROOT, env=env,
                                stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    running = Running(name, workload_name, port, proc, log)
    deadline = time.monotonic() + START_TIMEOUT
    while True:
        if proc.poll() is not None:
            stop_server(running)  # what is left of its process group
            raise RuntimeError(f"{name} exited ({proc.returncode}):\n{running.log_tail()}")
        try:
            status, headers, _ = one_request(port, workload)
        except OSError:
            status, headers = 0, {}
        if status == 200:
            break
        if time.monotonic() > deadline:
            stop_server(running)
            raise RuntimeError(f"{name} gave no 200 in {START_TIMEOUT:.0f}s (last {status}):\n"
                               f"{running.log_tail()}")
        time.sleep(0.1)
    if headers.get("x-file-wrapper") == "no":
        running.notes.append("no wsgi.file_wrapper")
    if not one_request(port, workload, close_wait=1.0)[2]:
        # uWSGI's --http11-socket: wrk then reuses the connection, and its "close" is keep-alive.
        running.notes.append("close: ignores Connection: close")
    return running


def stop_server(running: Running) -> None:
    try:
        os.killpg(running.proc.pid, signal.SIGTERM)
        running.proc.wait(15)
    except subprocess.TimeoutExpired:
        pass
    except ProcessLookupError:
        return
    try:
        os.killpg(running.proc.pid, signal.SIGKILL)  # whatever is left of the group
    except ProcessLookupError:
        pass
    running.proc.wait()


# -- load generators ----------------------------------------------------------------------------

@dataclass
class Load:
    requests: int = 0
    seconds: float = 0.0
    rps: float = 0.0
    p50_ms: float = 0.0
    p99_ms: float = 0.0
    errors: dict[str, int] = field(default_factory=lambda: dict.fromkeys(
        ("connect", "read", "write", "timeout"), 0))
    non2xx: int = 0
    statuses: dict[str, int] = field(default_factory=dict)
    starved: int | None = None  # connections never answered (the Python client's count only)


UNITS = {"us": 1e-3, "ms": 1.0, "s": 1e3, "m": 60e3}


def wrk_ms(text: str) -> float:
    match = re.fullmatch(r"([\d.]+)(us|ms|s|m)", text)
    if match is None:
        raise ValueError(f"wrk latency {text!r}")
    return float(match.group(1)) * UNITS[match.group(2)]


def run_wrk(port: int, workload: Workload, close: bool, conns: int, seconds: float,
            tmpdir: Path) -> Load:
    argv = ["wrk", f"-t{min(2, conns)}", f"-c{conns}", f"-d{max(1, round(seconds))}s", "--latency",
            f"--timeout={REQUEST_TIMEOUT:.0f}s"]
    if close:
        argv += ["-H", "Connection: close"]
    if workload.body:
        script = tmpdir / "post.lua"
        if not script.exists():
            script.write_text('wrk.method = "POST"\n'
                              'wrk.headers["Content-Type"] = "application/json"\n'
                              f"wrk.body = [==[{workload.body.decode()}]==]\n")
        argv += ["-s", str(script)]
    argv.append(f"http://127.0.0.1:{port}{workload.path}")
    out = subprocess.run(argv, capture_output=True, text=True, timeout=seconds + 30).stdout
    load = Load()
    match = re.search(r"(\d+) requests in ([\d.]+)(\w+)", out)
    rps = re.search(r"Requests/sec:\s+([\d.]+)", out)
    if match is None or rps is None:
        raise RuntimeError(f"wrk printed no result:\n{out}")
    load.requests, load.rps = int(match.group(1)), float(rps.group(1))
    load.seconds = load.requests / load.rps if load.rps else seconds
    for pct in ("50", "99"):
        found = re.search(rf"^\s+{pct}%\s+(\S+)", out, re.M)
        setattr(load, f"p{pct}_ms", wrk_ms(found.group(1)) if found else float("nan"))
    errors = re.search(r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)", out)
    if errors:
        load.errors = dict(zip(("connect", "read", "write", "timeout"), map(int, errors.groups())))
    non2xx = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
    load.non2xx = int(non2xx.group(1)) if non2xx else 0
    load.statuses = {"2xx": load.requests - load.non2xx, "other": load.non2xx}
    return load


class Conn:
    """One client connection of the Python load generator (a small state machine)."""

    __slots__ = ("sock", "out", "started", "head", "remaining", "status", "closing", "answered")

    def __init__(self) -> None:
        self.sock: socket.socket | None = None
        self.out = b""
        self.started = 0.0
        self.head = b""
        self.remaining = -1  # body bytes still due; -1 while the head is read
        self.status = 0
        self.closing = False
        self.answered = 0  # responses on this slot (a closed connection's successor included)


def client_process(port: int, request: bytes, close: bool, conns: int, seconds: float,
                   result: Any) -> None:
    """A load-generator process: ``conns`` sockets in one selector loop for ``seconds``.

    Sends ``result`` (a Connection) {latencies, statuses, errors, starved: the connections
    never answered in the run (a server serving a few keep-alive clients to exhaustion while the
    others wait looks fast to a client that only counts responses)}. Latency is measured from the
    request's first byte, as wrk does (a new connection's connect is not in it)."""
    sel = selectors.DefaultSelector()
    latencies: list[float] = []
    statuses: dict[str, int] = {}
    errors = dict.fromkeys(("connect", "read", "write", "timeout"), 0)
    end = time.monotonic() + seconds

    def connect(conn: Conn) -> None:
        sock = socket.socket()
        sock.setblocking(False)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.connect_ex(("127.0.0.1", port))
        conn.sock, conn.out, conn.started = sock, b"", 0.0
        sel.register(sock, selectors.EVENT_WRITE, conn)

    def drop(conn: Conn, kind: str | None) -> None:
        if kind:
            errors[kind] += 1
        assert conn.sock is not None
        sel.unregister(conn.sock)
        conn.sock.close()
        conn.sock = None
        if time.monotonic() < end:
            connect(conn)

    def send(conn: Conn) -> None:
        assert conn.sock is not None
        if not conn.out:
            conn.out, conn.started = request, time.monotonic()
            conn.head, conn.remaining, conn.closing = b"", -1, close
        try:
            sent = conn.sock.send(conn.out)
        except OSError:
            drop(conn, "write")
            return
        conn.out = conn.out[sent:]
        sel.modify(conn.sock, selectors.EVENT_WRITE if conn.out else selectors.EVENT_READ, conn)

    def receive(conn: Conn) -> None:
        assert conn.sock is not None
        try:
            data = conn.sock.recv(262144)
        except OSError:
            drop(conn, "read")
            return
        if not data:
            drop(conn, "read")  # closed before the response was whole
            return
        if conn.remaining < 0:
            conn.head += data
            end_of_head = conn.head.find(b"\r\n\r\n")
            if end_of_head < 0:
                return
            head, data = conn.head[:end_of_head].lower(), conn.head[end_of_head + 4:]
            conn.status = int(head[9:12])
            length = re.search(rb"\r\ncontent-length:\s*(\d+)", head)
            if length is None:
                drop(conn, "read")  # every bench app sends a Content-Length
                return
            conn.remaining = int(length.group(1))
            conn.closing = conn.closing or b"\r\nconnection: close" in head
        conn.remaining -= len(data)
        if conn.remaining > 0:
            return
        latencies.append(time.monotonic() - conn.started)
        conn.answered += 1
        key = f"{conn.status // 100}xx"
        statuses[key] = statuses.get(key, 0) + 1
        if conn.closing:
            drop(conn, None)
        elif time.monotonic() < end:
            send(conn)

    pool = [Conn() for _ in range(conns)]
    for conn in pool:
        connect(conn)
    next_scan = time.monotonic() + 0.2
    while (now := time.monotonic()) < end:
        for key, events in sel.select(timeout=min(0.2, end - now)):
            conn = key.data
            if conn.sock is None:
                continue
            if conn.out or (events & selectors.EVENT_WRITE and conn.started == 0.0):
                if conn.started == 0.0 and conn.sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR):
                    drop(conn, "connect")
                else:
                    send(conn)
            else:
                receive(conn)
        now = time.monotonic()
        if now < next_scan:
            continue
        next_scan = now + 0.2
        for conn in pool:  # a request outstanding too long counts as a timeout, as wrk's does
            if conn.sock is not None and conn.started and now - conn.started > REQUEST_TIMEOUT:
                drop(conn, "timeout")
    result.send({"latencies": latencies, "statuses": statuses, "errors": errors,
                 "starved": sum(1 for conn in pool if not conn.answered)})
    result.close()


def run_python(port: int, workload: Workload, close: bool, conns: int, seconds: float) -> Load:
    """The built-in load generator: 2 spawned processes (fewer for fewer connections)."""
    ctx = multiprocessing.get_context("spawn")
    request = request_bytes(workload, port, close)
    nprocs = min(2, conns)
    shares = [conns // nprocs + (i < conns % nprocs) for i in range(nprocs)]
    procs, pipes = [], []
    for share in shares:
        recv_end, send_end = ctx.Pipe(duplex=False)
        proc = ctx.Process(target=client_process,
                           args=(port, request, close, share, seconds, send_end), daemon=True)
        proc.start()
        send_end.close()
        procs.append(proc)
        pipes.append(recv_end)
    load, latencies = Load(starved=0), []
    for proc, pipe in zip(procs, pipes):
        # The clients stop themselves at `seconds`; the bound is for a client that hangs.
        if pipe.poll(seconds + REQUEST_TIMEOUT + 30):
            part = pipe.recv()
            latencies.extend(part["latencies"])
            for key, count in part["statuses"].items():
                load.statuses[key] = load.statuses.get(key, 0) + count
            for key, count in part["errors"].items():
                load.errors[key] += count
            load.starved = (load.starved or 0) + part["starved"]
        else:
            proc.kill()
            load.errors["timeout"] += 1
        proc.join(10)
    load.seconds = seconds
    load.requests = len(latencies)
    load.rps = load.requests / seconds
    load.non2xx = load.requests - load.statuses.get("2xx", 0)
    if latencies:
        latencies.sort()
        load.p50_ms = latencies[len(latencies) // 2] * 1e3
        load.p99_ms = latencies[min(len(latencies) - 1, int(len(latencies) * 0.99))] * 1e3
    return load


# -- one measured run ---------------------------------------------------------------------------

@dataclass
class Run:
    server: str
    workload: str
    mode: str
    conns: int
    repetition: int
    attempts: int
    load: Load
    foreign_cores: float  # CPU used by others during the run, in cores (1.0 = one core)
    noisy: bool
    server_cpu_s: float
    client_cpu_s: float
    cpu_us_per_request: float
    rss_mib: float
    pss_mib: float
    workers: int


def drive(running: Running, mode: str, conns: int, seconds: float, client: str,
          tmpdir: Path) -> tuple[Load, float, float, float]:
    """One load run: (load, server CPU s, load-generator CPU s, foreign CPU in cores)."""
    workload, close = WORKLOADS[running.workload], mode == "close"
    busy0 = machine_cpu()
    server0, own0, wall0 = tree_cpu(running.proc.pid), own_cpu(), time.monotonic()
    if client == "wrk":
        load = run_wrk(running.port, workload, close, conns, seconds, tmpdir)
    else:
        load = run_python(running.port, workload, close, conns, seconds)
    busy1 = machine_cpu()
    server1, own1, wall1 = tree_cpu(running.proc.pid), own_cpu(), time.monotonic()
    server_s, client_s = server1 - server0, own1 - own0
    foreign = max(0.0, (busy1 - busy0) - server_s - client_s) / (wall1 - wall0)
    return load, server_s, client_s, foreign


def measure(running: Running, mode: str, conns: int, repetition: int, args: argparse.Namespace,
            tmpdir: Path) -> Run:
    """A run, repeated (twice at most) while others use more than ``--noise`` of a core; the
    quietest attempt is kept."""
    best: tuple[Load, float, float, float] | None = None
    attempts = 0
    for attempts in range(1, 4):
        result = drive(running, mode, conns, args.duration, args.client, tmpdir)
        if best is None or result[3] < best[3]:
            best = result
        if result[3] <= args.noise:
            break
        print(f"    noisy: others used {result[3]:.0%} of a core; "
              f"{'again' if attempts < 3 else 'kept the quietest'}", flush=True)
        if attempts < 3:
            time.sleep(min(3.0, args.duration / 2))  # a pause: a burst of someone's may pass
    assert best is not None
    load, server_s, client_s, foreign = best
    mems = [m for m in map(memory_mib, running.workers()) if m is not None]
    return Run(running.name, running.workload, mode, conns, repetition, attempts, load, foreign,
               foreign > args.noise, server_s, client_s,
               server_s / load.requests * 1e6 if load.requests else float("nan"),
               statistics.fmean(m[0] for m in mems) if mems else float("nan"),
               statistics.fmean(m[1] for m in mems) if mems else float("nan"), len(mems))


def idle_cpu(servers: list[Running], seconds: float = 2.0) -> dict[str, float]:
    """Each server tree's CPU, as a share of one core, over ``seconds`` of no load."""
    before = {r.name: tree_cpu(r.proc.pid) for r in servers}
    time.sleep(seconds)  # measuring an interval, not waiting for a condition
    return {r.name: (tree_cpu(r.proc.pid) - before[r.name]) / seconds for r in servers}


# -- aggregation and output ---------------------------------------------------------------------

def cells_of(runs: list[Run], notes: dict[str, list[str]]) -> list[dict[str, Any]]:
    """One row per (server, workload, mode, conns): medians and sums over the repetitions."""
    groups: dict[tuple[str, str, str, int], list[Run]] = {}
    for run in runs:
        groups.setdefault((run.server, run.workload, run.mode, run.conns), []).append(run)
    rows = []
    for (server, workload, mode, conns), group in groups.items():
        errors = {k: sum(r.load.errors[k] for r in group) for k in group[0].load.errors}
        rows.append({
            "server": server, "workload": workload, "mode": mode, "conns": conns,
            "runs": len(group),
            "rps": statistics.median(r.load.rps for r in group),
            "p50_ms": statistics.median(r.load.p50_ms for r in group),
            "p99_ms": statistics.median(r.load.p99_ms for r in group),
            "requests": sum(r.load.requests for r in group),
            "errors": sum(errors.values()), "error_kinds": errors,
            "non2xx": sum(r.load.non2xx for r in group),
            "starved": max((r.load.starved for r in group if r.load.starved is not None),
                           default=None),
            "rss_mib": statistics.median(r.rss_mib for r in group),
            "pss_mib": statistics.median(r.pss_mib for r in group),
            "workers": group[-1].workers,
            "cpu_us_per_request": statistics.median(r.cpu_us_per_request for r in group),
            "noisy": any(r.noisy for r in group),
            "foreign_cores_max": max(r.foreign_cores for r in group),
            "notes": [SERVERS[server].note] * bool(SERVERS[server].note)
            + [n.removeprefix("close: ") for n in notes.get(f"{server}/{workload}", [])
               if mode == "close" or not n.startswith("close: ")],
        })
    return rows


def ratios_of(cells: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """forkserve config ÷ peer req/s, per cell: gunicorn's matching class and each other peer."""
    by_key = {(c["server"], c["workload"], c["mode"], c["conns"]): c for c in cells}
    result = []
    for cell in cells:
        fs = cell["server"]
        if fs not in MATCHING:
            continue
        for peer in (MATCHING[fs], *PEERS):
            other = by_key.get((peer, cell["workload"], cell["mode"], cell["conns"]))
            if other is None or not other["rps"]:
                continue
            result.append({"forkserve": fs, "peer": peer, "workload": cell["workload"],
                           "mode": cell["mode"], "conns": cell["conns"],
                           "ratio": cell["rps"] / other["rps"],
                           "flagged": failing(cell) or failing(other)})
    return result


def failing(cell: dict[str, Any]) -> bool:
    return bool(cell["errors"] or cell["non2xx"] or cell["starved"])


def flag(cell: dict[str, Any]) -> str:
    return ("!" if failing(cell) else "") + ("~" if cell["noisy"] else "")


def tables(cells: list[dict[str, Any]], ratios: list[dict[str, Any]],
           lifecycle: list[dict[str, Any]] | None) -> tuple[list[list[str]], list[list[str]],
                                                            list[str], list[list[str]]]:
    """The rows of the main table, the ratio table, the flag list and the life-cycle table."""
    main = [["server", "workload", "mode", "conns", "req/s", "p50 ms", "p99 ms", "errors",
             "non-2xx", "RSS MiB", "PSS MiB", "CPU µs/req", "notes"]]
    for c in cells:
        main.append([flag(c) + c["server"], c["workload"], c["mode"], str(c["conns"]),
                     f"{c['rps']:,.0f}", f"{c['p50_ms']:.2f}", f"{c['p99_ms']:.2f}",
                     str(c["errors"]), str(c["non2xx"]),
                     f"{c['rss_mib']:.1f}", f"{c['pss_mib']:.1f}", f"{c['cpu_us_per_request']:.0f}",
                     ", ".join(c["notes"])])
    peers = [p for p in ("gunicorn", *PEERS) if any(r["peer"] == p or
             (p == "gunicorn" and r["peer"].startswith("gu-")) for r in ratios)]
    ratio_rows = [["forkserve", "workload", "mode", "conns",
                   *[("gunicorn (same class)" if p == "gunicorn" else p) for p in peers]]]
    grouped: dict[tuple[str, str, str, int], dict[str, str]] = {}
    for r in ratios:
        column = "gunicorn" if r["peer"].startswith("gu-") else r["peer"]
        grouped.setdefault((r["forkserve"], r["workload"], r["mode"], r["conns"]), {})[column] = \
            f"{r['ratio']:.2f}×" + ("!" if r["flagged"] else "")
    for (fs, workload, mode, conns), values in grouped.items():
        ratio_rows.append([fs, workload, mode, str(conns), *[values.get(p, "-") for p in peers]])
    flagged = []
    for c in cells:
        where = f"{c['server']} {c['workload']} {c['mode']} c={c['conns']}"
        if c["errors"] or c["non2xx"]:
            kinds = ", ".join(f"{k} {v}" for k, v in c["error_kinds"].items())
            flagged.append(f"! {where}: {c['non2xx']:,} non-2xx of {c['requests']:,} responses; "
                           f"socket errors {kinds}")
        if c["starved"]:
            flagged.append(f"! {where}: {c['starved']} of {c['conns']} connections had no "
                           "response in a run")
        if c["noisy"]:
            flagged.append(f"~ {c['server']} {c['workload']} {c['mode']} c={c['conns']}: others "
                           f"used up to {c['foreign_cores_max']:.0%} of a core during a run")
    life: list[list[str]] = []
    if lifecycle:
        keys = list(dict.fromkeys(k for row in lifecycle for k in row))
        life = [keys] + [[str(row.get(k, "")) for k in keys] for row in lifecycle]
    return main, ratio_rows, flagged, life


def text_table(rows: list[list[str]]) -> str:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(cell.ljust(w) if i < 4 or i == len(row) - 1 else cell.rjust(w)
                               for i, (cell, w) in enumerate(zip(row, widths))).rstrip()
                     for row in rows)


def markdown_table(rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(rows[0]) + " |", "|" + "---|" * len(rows[0])]
    lines += ["| " + " | ".join(cell.replace("|", "\\|") for cell in row) + " |" for row in rows[1:]]
    return "\n".join(lines)


def machine() -> dict[str, Any]:
    model = "?"
    with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as fh:
        for line in fh:
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    versions = {}
    for name in VERSIONS:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = "not installed"
    wrk = subprocess.run(["wrk", "-v"], capture_output=True, text=True).stdout \
        .split("\n")[0].split(" Copyright")[0] if shutil.which("wrk") else "wrk not installed"
    return {"cpu": model, "cores": os.cpu_count(), "kernel": platform.release(),
            "python": platform.python_version(), "versions": versions, "wrk": wrk,
            "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
            "command": shlex.join([Path(sys.executable).name, *sys.argv])}


# -- main ---------------------------------------------------------------------------------------

def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="Servers: " + ", ".join(SERVERS)
                                     + ". Workloads: " + ", ".join(WORKLOADS) + ".")
    parser.add_argument("--servers", help="comma-separated (default: every installed one)")
    parser.add_argument("--workloads", help="comma-separated (default: hello,json,sleep)")
    parser.add_argument("--conns", help="comma-separated connection counts (default: 50)")
    parser.add_argument("--modes", help="ka, close or both (default: ka,close)")
    parser.add_argument("--duration", type=float, help="seconds per run (default: 8)")
    parser.add_argument("--runs", type=int, help="repetitions; medians are shown (default: 3)")
    parser.add_argument("--full", action="store_true",
                        help="every workload, ka and close, c=2,50,500")
    parser.add_argument("--quick", action="store_true",
                        help="a smoke run: hello, c=50, ka and close, 3 s, 1 run")
    parser.add_argument("--client", choices=("wrk", "python"),
                        help="the load generator (default: wrk where installed)")
    parser.add_argument("--noise", type=float, default=0.10,
                        help="foreign CPU (in cores) over which a run is repeated (0.10)")
    parser.add_argument("--json", metavar="FILE", help="write every run and row as JSON")
    parser.add_argument("--markdown", metavar="FILE",
                        help="write the tables, machine and command as markdown")
    parser.add_argument("--lifecycle", action="store_true",
                        help="also the life-cycle figures (bench/lifecycle_figures.py)")
    args = parser.parse_args(argv)
    preset = {"workloads": "hello,json,sleep", "conns": "50", "modes": "ka,close",
              "duration": 8.0, "runs": 3}
    if args.full:
        preset.update(workloads=",".join(WORKLOADS), conns="2,50,500")
    if args.quick:
        preset.update(workloads="hello", conns="50", duration=3.0, runs=1)
    for key, value in preset.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.workloads = args.workloads.split(",")
    args.conns = [int(c) for c in args.conns.split(",")]
    args.modes = args.modes.split(",")
    for name, values, known in (("workload", args.workloads, WORKLOADS),
                                ("mode", args.modes, ("ka", "close"))):
        unknown = [v for v in values if v not in known]
        if unknown:
            parser.error(f"unknown {name} {', '.join(unknown)}")
    wanted = args.servers.split(",") if args.servers else list(SERVERS)
    unknown = [s for s in wanted if s not in SERVERS]
    if unknown:
        parser.error(f"unknown server {', '.join(unknown)}")
    if importlib.util.find_spec("gunicorn") is None:
        print("gunicorn is not installed (pip install forkserve[bench]): no gunicorn rows")
    missing = [s for s in wanted if not installed(s)]
    if missing and args.servers:
        print(f"not installed, skipped: {', '.join(missing)}")
    args.servers = [s for s in wanted if s not in missing]
    if args.client is None:
        args.client = "wrk" if shutil.which("wrk") else "python"
    elif args.client == "wrk" and shutil.which("wrk") is None:
        parser.error("wrk is not installed (apt-get install wrk); --client python needs nothing")
    return args


def lifecycle_rows(args: argparse.Namespace) -> list[dict[str, Any]] | None:
    if not args.lifecycle:
        return None
    try:
        # Lazily, by name: the module is optional (another part of issue 16).
        figures = importlib.import_module("bench.lifecycle_figures")
    except ModuleNotFoundError as exc:
        if exc.name != "bench.lifecycle_figures":
            raise
        print("life-cycle figures skipped: bench/lifecycle_figures.py is not there")
        return None
    rows: list[dict[str, Any]] = figures.run(args)
    return rows


def precompile() -> None:
    """Write the bytecode of forkserve and the bench apps, as ``pip install`` does for every
    peer: a checkout whose ``__pycache__`` is stale (an edit since, or PYTHONDONTWRITEBYTECODE)
    would compile each changed module at every start, and the compiler's leftovers would count
    in forkserve's RSS (about 2 MiB a worker once config.py is stale) and in no peer's."""
    for folder in ("forkserve", "bench", "examples"):
        if not compileall.compile_dir(str(ROOT / folder), quiet=1):
            print(f"warning: could not write the bytecode of {ROOT / folder}", flush=True)


def benchmark(args: argparse.Namespace, tmpdir: Path) -> tuple[list[Run], dict[str, list[str]],
                                                              dict[str, float]]:
    precompile()
    data = tmpdir / "file.bin"
    data.write_bytes(os.urandom(FILE_SIZE))
    env = dict(os.environ, BENCH_FILE=str(data), PYTHONUNBUFFERED="1",
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    runs: list[Run] = []
    notes: dict[str, list[str]] = {}
    idle: dict[str, float] = {}
    cells = [(mode, conns) for mode in args.modes for conns in args.conns]
    for repetition in range(1, args.runs + 1):
        for workload in args.workloads:
            up: list[Running] = []
            try:
                for name in args.servers:
                    try:
                        running = start_server(name, workload, env, tmpdir)
                    except RuntimeError as exc:
                        print(f"skipped {name} for {workload}: {exc}", flush=True)
                        continue
                    up.append(running)
                    notes[f"{name}/{workload}"] = running.notes
                    drive(running, "ka", 50, WARMUP_SECONDS, args.client, tmpdir)
                for name, share in idle_cpu(up).items():
                    idle[name] = max(idle.get(name, 0.0), share)
                for mode, conns in cells:
                    for running in up:
                        print(f"[{repetition}/{args.runs}] {running.name:10} {workload:6} {mode:5} "
                              f"c={conns:<4}", end=" ", flush=True)
                        run = measure(running, mode, conns, repetition, args, tmpdir)
                        runs.append(run)
                        print(f"{run.load.rps:>9,.0f} req/s  p99 {run.load.p99_ms:7.2f} ms"
                              f"{'  non-2xx ' + str(run.load.non2xx) if run.load.non2xx else ''}"
                              f"{'  errors ' + str(sum(run.load.errors.values())) if any(run.load.errors.values()) else ''}",
                              flush=True)
            finally:
                for running in up:
                    stop_server(running)
    return runs, notes, idle


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # TERM and HUP (a `timeout`, a closed terminal) unwind like Ctrl-C, through the finally
    # that stops every server started: a default TERM would leave them all running.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    signal.signal(signal.SIGHUP, signal.default_int_handler)
    info = machine()
    print(f"{info['cpu']}, {info['cores']} cores, Linux {info['kernel']}, Python {info['python']}; "
          f"client {args.client}; servers {', '.join(args.servers)}", flush=True)
    with tempfile.TemporaryDirectory(prefix="forkserve-bench-") as tmp:
        runs, notes, idle = benchmark(args, Path(tmp))
    cells = cells_of(runs, notes)
    ratios = ratios_of(cells)
    lifecycle = lifecycle_rows(args)
    main_rows, ratio_rows, flagged, life_rows = tables(cells, ratios, lifecycle)
    busy_idle = {name: share for name, share in idle.items() if share > 0.02}
    print()
    print(text_table(main_rows))
    print()
    print("req/s ratio, forkserve ÷ peer (same cell, same run):")
    print(text_table(ratio_rows))
    for line in flagged:
        print(line)
    for name, share in busy_idle.items():
        print(f"idle: {name} used {share:.1%} of a core with no load")
    if life_rows:
        print()
        print(text_table(life_rows))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(
            {"machine": info, "client": args.client, "duration": args.duration,
             "repetitions": args.runs, "cells": cells, "ratios": ratios, "idle_cpu": idle,
             "runs": [asdict(r) for r in runs], "lifecycle": lifecycle}, indent=1) + "\n")
    if args.markdown:
        parts = [f"Machine: {info['cpu']}, {info['cores']} cores, Linux {info['kernel']}, "
                 f"Python {info['python']}; {info['wrk']}.",
                 "Versions: " + ", ".join(f"{k} {v}" for k, v in info["versions"].items()) + ".",
                 f"Command: `{info['command']}` ({info['date']}; client {args.client}, "
                 f"{args.duration:g} s runs, medians of {args.runs}).",
                 markdown_table(main_rows),
                 "req/s ratio, forkserve ÷ peer (same cell, same run):",
                 markdown_table(ratio_rows)]
        if flagged or busy_idle:
            parts.append("\n".join([f"- {line}" for line in flagged]
                                   + [f"- idle: {n} used {s:.1%} of a core with no load"
                                      for n, s in busy_idle.items()]))
        if life_rows:
            parts.append(markdown_table(life_rows))
        Path(args.markdown).parent.mkdir(parents=True, exist_ok=True)
        Path(args.markdown).write_text("\n\n".join(parts) + "\n")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        sys.exit("interrupted (every server started was stopped)")
