"""Hostile clients: what slow, silent, greedy or broken peers do to each server configuration.

    python bench/hostile.py                                # every probe × every server (~15 min)
    python bench/hostile.py --quick                        # probes 1-4 run 10 s, not 30 s
    python bench/hostile.py --servers fs-sync,gu-sync --probes 1,2,slowloris --json
    python bench/hostile.py --probes trailer --servers fs-gevent

Servers (2 workers each, on 127.0.0.1, each server's defaults otherwise; the app is
``bench/apps_hostile.py``: ``/`` hello (reads any body first), ``/big`` 50 MiB, ``/sleep`` 10 s):
``fs-sync`` (forkserve ``-k sync``), ``fs-thread`` (``-k thread --threads 4``), ``fs-gevent``,
``gu-sync`` (gunicorn sync) and ``gu-gevent`` (gunicorn gevent). Every probe starts a fresh
server, and the server's whole process group is SIGKILLed after it, whatever happened.

"Legitimate load" below is one ``GET /`` on a new connection every 0.5 s for ``--duration``
seconds (30; ``--quick``: 10), each in its own thread with a 10 s bound; the figure is the
requests answered 200 (with the right body) within 1 s / sent, and the p99 latency over all
sent (an unanswered request counts as infinite, shown ``>10s``).

| # | probe | what it does | figure |
|---|---|---|---|
| 1 | slowloris | 500 connections each sending one more header byte every 2 s; one the server closes is reopened 1 s later, as slowloris does | legitimate load |
| 2 | slow-body | 500 connections sending a whole head with ``Content-Length: 100000``, then one body byte every 2 s (reopened likewise) | legitimate load |
| 3 | no-read | 10 clients (4 KiB receive buffer) that ``GET /big`` (50 MiB) and never read (reopened if the server closes) | legitimate load |
| 4 | silent | 10 connections that send nothing (reopened likewise) | legitimate load |
| 5 | fd-exhaust | the server runs with RLIMIT_NOFILE 64 (soft and hard, set before exec); 200 idle connections are held for 5 s | CPU% of all server processes (utime+stime from /proc/PID/stat, 100% = one core), bytes written to its stderr in the 5 s, whether a request made meanwhile is answered (3 s bound), and whether one is answered within 2 s of closing the 200 |
| 6 | trailer | one chunked POST whose trailer section is 64 MiB (65,536 fields of ~1 KiB) | the status (or close/reset) and the time to it, the largest VmRSS growth of a worker, the CPU seconds of the workers |
| 7 | kill-arbiter | SIGKILL of the arbiter/master while ``/sleep`` is in flight | how long the workers outlive it (/proc polled, 20 s bound), and the time until we can bind+listen the same port with SO_REUSEADDR as a new instance would (20 s bound) |
| 8 | full-disk | the access log is ``/dev/full`` (forkserve ``--access-log``, gunicorn ``--access-logfile``); 1,200 ``GET /`` from 4 threads | requests answered / 1,200, and the lines the server wrote to stderr meanwhile |

The attackers of probes 1-4 run in a child process of their own (a poll loop over
non-blocking sockets), so they do not take the GIL from the legitimate clients. The machine
is shared: the 1-minute load average before and after every cell is printed with the table.
``--json`` saves everything (cells, details, log excerpts, the first traceback a server
wrote) under ``bench/results/``; a cell whose server wrote tracebacks says so under the table.
"""

from __future__ import annotations

import argparse
import errno
import json
import math
import multiprocessing
import os
import platform
import re
import resource
import select
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.apps_hostile import HELLO  # noqa: E402
from tests.harness import children, process_group, wait_for  # noqa: E402

APP = "bench.apps_hostile:app"
WORKERS = 2
SERVERS: dict[str, tuple[str, list[str]]] = {
    "fs-sync": ("forkserve", ["-k", "sync"]),
    "fs-thread": ("forkserve", ["-k", "thread", "--threads", "4"]),
    "fs-gevent": ("forkserve", ["-k", "gevent"]),
    "gu-sync": ("gunicorn", ["-k", "sync"]),
    "gu-gevent": ("gunicorn", ["-k", "gevent"]),
}
PROBES = ("slowloris", "slow-body", "no-read", "silent", "fd-exhaust", "trailer", "kill-arbiter",
          "full-disk")
PORT_LINE = {"forkserve": re.compile(r"Starting forkserve listening=127\.0\.0\.1:(\d+)"),
             "gunicorn": re.compile(r"Listening at: http://127\.0\.0\.1:(\d+)")}

LEGIT_INTERVAL = 0.5
LEGIT_TIMEOUT = 10.0
SERVED_WITHIN = 1.0
SWARM = {"slowloris": 500, "slow-body": 500, "no-read": 10, "silent": 10}
DRIP_INTERVAL = 2.0  # one byte per connection this often
REOPEN_AFTER = 1.0
FD_LIMIT = 64
FD_CONNECTIONS = 200
FD_WINDOW = 5.0
TRAILER_BYTES = 64 << 20
KILL_BOUND = 20.0
FULL_DISK_REQUESTS = 1200
FULL_DISK_THREADS = 4
CLK_TCK = os.sysconf("SC_CLK_TCK")

# The file limits this process started with: the servers get them back (the bench raises its
# own soft limit for the 500 attackers; a server should not run with a limit it would not have).
ORIGINAL_NOFILE = resource.getrlimit(resource.RLIMIT_NOFILE)


# -- /proc readings -----------------------------------------------------------------------------

def cpu_ticks(pid: int) -> int | None:
    """utime + stime of ``pid`` in clock ticks (None once it is gone or a zombie)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as fh:
            fields = fh.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    if fields[0] == "Z":
        return None
    return int(fields[11]) + int(fields[12])


def vm_kib(pid: int, key: str = "VmRSS") -> int | None:
    """``VmRSS`` (resident now) or ``VmHWM`` (the peak resident so far) of ``pid``, in KiB."""
    try:
        with open(f"/proc/{pid}/status", encoding="ascii", errors="replace") as fh:
            for line in fh:
                if line.startswith(key + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


class Sampler(threading.Thread):
    """CPU ticks and VmRSS of a process group, every ``interval`` s, until ``stop()``.

    Sampling (not one reading at each end) keeps the CPU of a process that dies in the window:
    its last reading counts. A process first seen during the window counts from zero."""

    def __init__(self, pgid: int, interval: float = 0.05) -> None:
        super().__init__(daemon=True)
        self.pgid = pgid
        self.interval = interval
        self.first: dict[int, int] = {}
        self.last: dict[int, int] = {}
        self.rss_first: dict[int, int] = {}
        self.rss_max: dict[int, int] = {}
        self.hwm_first: dict[int, int] = {}
        self.hwm_last: dict[int, int] = {}
        self.started = time.monotonic()
        self.ended = self.started
        self._halt = threading.Event()
        self.sample(initial=True)

    def sample(self, initial: bool = False) -> None:
        for pid in process_group(self.pgid):
            ticks = cpu_ticks(pid)
            if ticks is not None:
                self.first.setdefault(pid, ticks if initial else 0)
                self.last[pid] = ticks
            rss, hwm = vm_kib(pid), vm_kib(pid, "VmHWM")
            if rss is not None and hwm is not None:
                self.rss_first.setdefault(pid, rss)
                self.rss_max[pid] = max(rss, self.rss_max.get(pid, 0))
                self.hwm_first.setdefault(pid, hwm)
                self.hwm_last[pid] = hwm

    def run(self) -> None:
        while not self._halt.wait(self.interval):
            self.sample()

    def stop(self) -> None:
        self._halt.set()
        self.join(5)
        self.sample()
        self.ended = time.monotonic()

    def cpu_seconds(self, pids: set[int] | None = None) -> float:
        return sum(self.last[p] - self.first[p] for p in self.last
                   if pids is None or p in pids) / CLK_TCK

    def cpu_percent(self) -> float:
        return 100.0 * self.cpu_seconds() / max(self.ended - self.started, 1e-9)

    def rss_growth_kib(self, pids: set[int]) -> int:
        """The largest peak-over-baseline of ``pids``. A peak between two samples is not
        lost: a high-water mark (VmHWM) that rose in the window is that window's peak."""
        def peak(p: int) -> int:
            rose = self.hwm_last[p] > self.hwm_first[p]
            return self.hwm_last[p] if rose else self.rss_max[p]
        return max((peak(p) - self.rss_first[p] for p in self.rss_max if p in pids), default=0)


# -- servers ------------------------------------------------------------------------------------

class ServerProc:
    """One server as a process group of its own; stderr goes to a file, so the bytes and lines
    it writes can be counted at any moment without a reader thread."""

    def __init__(self, name: str, tmp: Path, tag: str, extra: list[str] | None = None,
                 nofile: int | None = None) -> None:
        self.name = name
        self.family, class_args = SERVERS[name]
        argv = [sys.executable, "-m", self.family, "-b", "127.0.0.1:0", "-w", str(WORKERS)]
        if self.family == "gunicorn":
            # gunicorn 24+ opens a control socket at one path in $HOME by default.
            argv.append("--no-control-socket")
        self.argv = [*argv, *class_args, *(extra or []), APP]
        self.stderr_path = tmp / f"{tag}-{name}.stderr"
        env = dict(os.environ)
        for var in ("PORT", "WEB_CONCURRENCY", "FORWARDED_ALLOW_IPS", "GUNICORN_CMD_ARGS"):
            env.pop(var, None)
        env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
        env["HOSTILE_MARK_DIR"] = str(tmp)
        limits = (nofile, nofile) if nofile else ORIGINAL_NOFILE

        def preexec() -> None:  # runs in the child between fork and exec
            resource.setrlimit(resource.RLIMIT_NOFILE, limits)

        with open(self.stderr_path, "wb") as err, open(tmp / f"{tag}-{name}.stdout", "wb") as out:
            self.proc = subprocess.Popen(self.argv, cwd=ROOT, env=env, stdin=subprocess.DEVNULL,
                                         stdout=out, stderr=err, start_new_session=True,
                                         preexec_fn=preexec)
        self.pid = self.proc.pid
        self.port = 0

    def stderr_text(self) -> str:
        return self.stderr_path.read_text(errors="replace")

    def stderr_size(self) -> int:
        return self.stderr_path.stat().st_size

    def workers(self) -> list[int]:
        return children(self.pid)

    def ready(self, timeout: float = 30.0) -> "ServerProc":
        """Until the port is logged, both workers exist, and ``GET /`` is answered."""
        def port() -> int | None:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited {self.proc.returncode}: "
                                   f"{self.stderr_text()[-1500:]}")
            match = PORT_LINE[self.family].search(self.stderr_text())
            return int(match.group(1)) if match else None
        self.port = wait_for(port, timeout, f"{self.name} to log its port")
        wait_for(lambda: len(self.workers()) == WORKERS, timeout, f"{self.name}'s workers")
        wait_for(lambda: http_get(self.port, timeout=2.0).ok, timeout, f"{self.name} to answer")
        return self

    def kill(self) -> list[str]:
        """SIGKILL the whole process group (the arbiter may already be dead, its workers not);
        return a note for anything left."""
        notes = []
        if process_group(self.pid):
            try:
                os.killpg(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                notes.append("process group vanished before the kill")
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            notes.append(f"pid {self.pid} not reaped in 10 s")
        try:
            wait_for(lambda: not process_group(self.pid), 10, "the process group to be gone")
        except AssertionError:
            notes.append(f"left in group {self.pid}: {process_group(self.pid)}")
        return notes


# -- legitimate clients -------------------------------------------------------------------------

@dataclass
class Reply:
    ok: bool
    latency: float | None  # seconds to the whole response; None: none came
    status: int | None = None
    error: str = ""
    pid: str = ""


def http_get(port: int, path: str = "/", timeout: float = LEGIT_TIMEOUT) -> Reply:
    """One ``GET`` on a new connection, read whole (Content-Length or EOF), within ``timeout``."""
    start = time.monotonic()
    deadline = start + timeout
    buf = b""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
            sock.sendall(f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                         "Connection: close\r\n\r\n".encode())
            while True:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return Reply(False, None, error="timeout")
                sock.settimeout(remaining)
                data = sock.recv(65536)
                if not data:
                    break
                buf += data
                head, sep, body = buf.partition(b"\r\n\r\n")
                length = re.search(rb"(?im)^content-length:\s*(\d+)", head) if sep else None
                if length and len(body) >= int(length.group(1)):
                    break
    except (socket.timeout, TimeoutError):
        return Reply(False, None, error="timeout")
    except OSError as exc:
        return Reply(False, None, error=errno.errorcode.get(exc.errno or 0, str(exc)))
    elapsed = time.monotonic() - start
    head, _, body = buf.partition(b"\r\n\r\n")
    match = re.match(rb"HTTP/1\.[01] (\d{3})", head)
    if not match:
        return Reply(False, None, error="empty" if not buf else "garbled")
    pid = re.search(rb"(?im)^x-pid:\s*(\d+)", head)
    status = int(match.group(1))
    return Reply(status == 200 and body == HELLO, elapsed, status,
                 "" if status == 200 else f"status {status}", pid.group(1).decode() if pid else "")


def legit_load(port: int, duration: float) -> list[Reply]:
    """A ``GET /`` every LEGIT_INTERVAL s for ``duration`` s, each in its own thread (so a
    stuck one delays none after it); returns once every one ended (each is bounded)."""
    replies: list[Reply] = []
    lock = threading.Lock()

    def shoot() -> None:
        reply = http_get(port)
        with lock:
            replies.append(reply)

    threads = []
    start = time.monotonic()
    for i in range(int(duration / LEGIT_INTERVAL)):
        # A schedule, not a wait for a condition: request i leaves at start + i * interval.
        time.sleep(max(0.0, start + i * LEGIT_INTERVAL - time.monotonic()))
        thread = threading.Thread(target=shoot, daemon=True)
        thread.start()
        threads.append(thread)
    for thread in threads:
        thread.join(LEGIT_TIMEOUT + 5)
    with lock:
        return list(replies) + [Reply(False, None, error="thread stuck")] * (len(threads) - len(replies))


def p99(latencies: list[float | None]) -> float:
    ordered = sorted(math.inf if x is None else x for x in latencies)
    return ordered[max(0, math.ceil(0.99 * len(ordered)) - 1)] if ordered else math.nan


def fmt_seconds(x: float | None, bound: float = LEGIT_TIMEOUT) -> str:
    if x is None or math.isinf(x):
        return f">{bound:g}s"
    return f"{x * 1000:.0f}ms" if x < 1 else f"{x:.1f}s"


def legit_summary(replies: list[Reply]) -> tuple[str, dict[str, Any]]:
    within = sum(1 for r in replies if r.ok and r.latency is not None and r.latency <= SERVED_WITHIN)
    late = sum(1 for r in replies if r.ok and r.latency is not None and r.latency > SERVED_WITHIN)
    errors: dict[str, int] = {}
    for r in replies:
        if not r.ok:
            errors[r.error] = errors.get(r.error, 0) + 1
    tail = p99([r.latency if r.ok else None for r in replies])
    cell = f"{within}/{len(replies)}, p99 {fmt_seconds(tail)}"
    return cell, {"served_within_1s": within, "sent": len(replies), "served_late": late,
                  "failures": errors, "p99_s": None if math.isinf(tail) else tail}


# -- attackers (run in a child process) ---------------------------------------------------------

SLOWLORIS_HEAD = b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: "
SLOW_BODY_HEAD = b"POST / HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 100000\r\n\r\n"
NO_READ_REQUEST = b"GET /big HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"
CONNECT_TIMEOUT = 5.0


def swarm_main(port: int, kind: str, count: int, control: Any) -> None:
    """``count`` connections of ``kind`` kept open until ``control`` says stop; one the server
    closes is reopened REOPEN_AFTER s later. Sends ``{"ramped": n}`` once all are connected (or
    after 15 s), and the counters when stopped."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    poller = select.poll()
    conns: dict[int, dict[str, Any]] = {}
    reopen_at: list[float] = [time.monotonic()] * count
    stats = {"connected": 0, "connect_failed": 0, "closed_by_server": 0, "bytes_received": 0,
             "peak_open": 0}
    closed_mask = select.POLLERR | select.POLLHUP | select.POLLRDHUP
    # The no-read clients must not be woken by the data they refuse to read.
    open_mask = closed_mask if kind == "no-read" else closed_mask | select.POLLIN
    ramp_deadline = time.monotonic() + 15
    ramped = False
    poller.register(control.fileno(), select.POLLIN)

    def open_one() -> None:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        if kind == "no-read":
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.setblocking(False)
        err = sock.connect_ex(("127.0.0.1", port))
        if err not in (0, errno.EINPROGRESS):
            sock.close()
            stats["connect_failed"] += 1
            reopen_at.append(time.monotonic() + REOPEN_AFTER)
            return
        conns[sock.fileno()] = {"sock": sock, "state": "connecting", "since": time.monotonic(),
                                "sent": 0, "next": math.inf}
        poller.register(sock, select.POLLOUT | closed_mask)

    def drop(fd: int, by_server: bool) -> None:
        conn = conns.pop(fd)
        poller.unregister(fd)
        conn["sock"].close()
        stats["closed_by_server" if by_server else "connect_failed"] += 1
        reopen_at.append(time.monotonic() + REOPEN_AFTER)

    def drip(conn: dict[str, Any]) -> bool:
        """Send the next byte; False if the connection is gone."""
        i = conn["sent"]
        byte = SLOWLORIS_HEAD[i:i + 1] if kind == "slowloris" and i < len(SLOWLORIS_HEAD) else b"a"
        try:
            conn["sent"] += conn["sock"].send(byte)
        except BlockingIOError:
            return True  # its send buffer is full: the server stopped reading; still open
        except OSError:
            return False
        return True

    while True:
        now = time.monotonic()
        due = [t for t in reopen_at if t <= now]
        reopen_at[:] = [t for t in reopen_at if t > now]
        for _ in due:
            open_one()
        open_count = sum(1 for c in conns.values() if c["state"] == "open")
        stats["peak_open"] = max(stats["peak_open"], open_count)
        if not ramped and (open_count >= count or now > ramp_deadline):
            control.send({"ramped": open_count})
            ramped = True
        for fd, conn in list(conns.items()):
            if conn["state"] == "connecting" and now - conn["since"] > CONNECT_TIMEOUT:
                drop(fd, by_server=False)
            elif conn["state"] == "open" and conn["next"] <= now:
                conn["next"] = now + DRIP_INTERVAL
                if not drip(conn):
                    drop(fd, by_server=True)
        wake = min([c["next"] for c in conns.values()] + reopen_at + [now + 0.2])
        for fd, event in poller.poll(max(0.0, wake - time.monotonic()) * 1000):
            if fd == control.fileno():
                control.recv()
                for held in conns.values():
                    held["sock"].close()
                stats["open_at_stop"] = sum(1 for c in conns.values() if c["state"] == "open")
                control.send(stats)
                return
            if fd not in conns:
                continue  # dropped earlier in this same batch of events
            conn = conns[fd]
            if conn["state"] == "connecting":
                if conn["sock"].getsockopt(socket.SOL_SOCKET, socket.SO_ERROR):
                    drop(fd, by_server=False)
                    continue
                conn["state"] = "open"
                stats["connected"] += 1
                poller.modify(fd, open_mask)
                first = {"slow-body": SLOW_BODY_HEAD, "no-read": NO_READ_REQUEST}.get(kind, b"")
                if first:
                    conn["sock"].send(first)  # fits any empty send buffer
                if kind in ("slowloris", "slow-body"):
                    conn["next"] = time.monotonic()
                    if not drip(conn):
                        drop(fd, by_server=True)
                continue
            if event & select.POLLIN:
                try:
                    data = conn["sock"].recv(65536)
                except OSError:
                    data = b""
                stats["bytes_received"] += len(data)
                if not data:
                    drop(fd, by_server=True)
            elif event & closed_mask:
                drop(fd, by_server=True)


class Swarm:
    """The attackers' child process (spawned: a fresh interpreter, no inherited threads)."""

    def __init__(self, port: int, kind: str, count: int) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.control, child_end = ctx.Pipe()
        self.proc = ctx.Process(target=swarm_main, args=(port, kind, count, child_end), daemon=True)
        self.proc.start()
        child_end.close()
        self.ramped: int | None = None

    def wait_ramped(self, timeout: float = 30.0) -> int | None:
        if self.control.poll(timeout):
            self.ramped = int(self.control.recv()["ramped"])
        return self.ramped

    def stop(self) -> dict[str, Any]:
        stats: dict[str, Any] = {}
        try:
            self.control.send("stop")
            if self.control.poll(10):
                stats = self.control.recv()
        except (OSError, EOFError) as exc:
            stats = {"error": f"swarm: {exc}"}
        self.proc.join(10)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5)
            stats["killed"] = True
        self.control.close()
        return stats


# -- probes -------------------------------------------------------------------------------------

@dataclass
class Cell:
    probe: str
    server: str
    figure: str = ""
    details: dict[str, Any] = field(default_factory=dict)
    load_before: float = 0.0
    load_after: float = 0.0
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)
    stderr_excerpt: str = ""


def stderr_lines(server: ServerProc, since: int) -> list[str]:
    with open(server.stderr_path, "rb") as fh:
        fh.seek(since)
        return fh.read().decode("utf-8", "replace").splitlines()


def excerpt(lines: list[str], first: int = 12) -> str:
    """The first lines, then each distinct line shape (digits folded) not shown yet, bounded."""
    shown = lines[:first]
    seen = {re.sub(r"\d+", "N", line) for line in shown}
    for line in lines[first:]:
        shape = re.sub(r"\d+", "N", line)
        if shape not in seen and len(shown) < first + 12:
            seen.add(shape)
            shown.append(line)
    more = len(lines) - len(shown)
    return "\n".join(shown) + (f"\n... ({more} more lines)" if more > 0 else "")


def first_traceback(text: str, most: int = 80) -> str:
    """The server's first traceback whole (with the log line before it), up to the next log
    record: the excerpt folds repeated lines, which would cut a traceback short."""
    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith("Traceback")), None)
    if start is None:
        return ""
    shown = lines[max(0, start - 1):start + 1]
    for line in lines[start + 1:start + most]:
        if line.startswith(("[20", "--- Logging error ---")):
            break
        shown.append(line)
    return "\n".join(shown)


def probe_swarm(cell: Cell, server: ServerProc, kind: str, duration: float) -> None:
    count = SWARM[kind]
    err0 = server.stderr_size()
    swarm = Swarm(server.port, kind, count)
    try:
        ramped = swarm.wait_ramped()
        replies = legit_load(server.port, duration)
    finally:
        stats = swarm.stop()
    cell.figure, cell.details = legit_summary(replies)
    cell.details["attackers"] = {"wanted": count, "open_before_load": ramped, **stats}
    lines = stderr_lines(server, err0)
    cell.details["stderr_lines"] = len(lines)
    cell.stderr_excerpt = excerpt(lines)
    if ramped is not None and ramped < count:
        cell.notes.append(f"only {ramped}/{count} attackers connected before the load began")


def probe_fd_exhaust(cell: Cell, server: ServerProc) -> None:
    held: list[socket.socket] = []
    connect_errors: dict[str, int] = {}
    try:
        deadline = time.monotonic() + 20
        while len(held) + sum(connect_errors.values()) < FD_CONNECTIONS and time.monotonic() < deadline:
            try:
                held.append(socket.create_connection(("127.0.0.1", server.port), timeout=2))
            except OSError as exc:
                name = "timeout" if isinstance(exc, TimeoutError) else errno.errorcode.get(exc.errno or 0, str(exc))
                connect_errors[name] = connect_errors.get(name, 0) + 1
        err0 = server.stderr_size()
        sampler = Sampler(server.pid, interval=0.25)
        sampler.start()
        during: list[Reply] = []
        shot = threading.Thread(target=lambda: during.append(http_get(server.port, timeout=3.0)),
                                daemon=True)
        shot.start()
        time.sleep(FD_WINDOW)  # the window being measured, not a wait for a condition
        sampler.stop()
        err_bytes = server.stderr_size() - err0
        shot.join(5)
    finally:
        for sock in held:
            sock.close()
    closed_at = time.monotonic()
    recovered: Reply | None = None
    while time.monotonic() - closed_at < 2.0:
        reply = http_get(server.port, timeout=max(0.05, 2.0 - (time.monotonic() - closed_at)))
        if reply.ok:
            recovered = reply
            break
        time.sleep(0.05)  # between tries of a server that answered badly or not at all
    recovered_after = time.monotonic() - closed_at if recovered else None
    answered = bool(during and during[0].ok)
    lines = stderr_lines(server, err0)
    cell.figure = (f"CPU {sampler.cpu_percent():.0f}%, stderr {human_bytes(err_bytes)}, "
                   f"during: {'yes' if answered else 'no'}"
                   f"{'' if answered else ' (' + (during[0].error if during else 'stuck') + ')'}, "
                   f"after: {'yes ' + fmt_seconds(recovered_after) if recovered else 'no (2s)'}")
    cell.details = {"held": len(held), "connect_errors": connect_errors,
                    "cpu_percent": sampler.cpu_percent(), "stderr_bytes": err_bytes,
                    "stderr_lines_window": len(lines),
                    "during": asdict(during[0]) if during else None,
                    "recovered_after_s": recovered_after,
                    "workers_after": server.workers()}
    cell.stderr_excerpt = excerpt(lines)


def trailer_blocks() -> Any:
    yield (b"POST / HTTP/1.1\r\nHost: 127.0.0.1\r\nTransfer-Encoding: chunked\r\n\r\n"
           b"5\r\nhello\r\n0\r\n")
    line_body = b"a" * 1000
    sent, n, block = 0, 0, []
    while sent < TRAILER_BYTES:
        line = b"X-Trailer-%06d: %s\r\n" % (n, line_body)
        block.append(line)
        sent += len(line)
        n += 1
        if len(block) == 256:
            yield b"".join(block)
            block = []
    yield b"".join(block) + b"\r\n"


def probe_trailer(cell: Cell, server: ServerProc) -> None:
    workers = set(server.workers())
    sampler = Sampler(server.pid)
    sampler.start()
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=5)
    result: dict[str, Any] = {"sent": 0, "send_error": ""}
    start = time.monotonic()
    deadline = start + 90

    def send() -> None:
        try:
            for block in trailer_blocks():
                if time.monotonic() > deadline:
                    result["send_error"] = "bench deadline"
                    return
                sock.sendall(block)
                result["sent"] += len(block)
        except OSError as exc:
            result["send_error"] = errno.errorcode.get(exc.errno or 0, str(exc))
        result["send_done"] = time.monotonic() - start

    sender = threading.Thread(target=send, daemon=True)
    sender.start()
    answer, answered_at, buf = "", None, b""
    try:
        while time.monotonic() < deadline:
            sock.settimeout(max(0.1, deadline - time.monotonic()))
            data = sock.recv(65536)
            if not data:
                answer = "closed, no status" if not buf else answer
                answered_at = answered_at or time.monotonic() - start
                break
            buf += data
            match = re.match(rb"HTTP/1\.[01] (\d{3})", buf)
            if match and not answer:
                answer = match.group(1).decode()
                answered_at = time.monotonic() - start
    except (socket.timeout, TimeoutError):
        answer = answer or "no answer (90s)"
    except OSError as exc:
        answer = answer or ("reset" if exc.errno == errno.ECONNRESET else
                            errno.errorcode.get(exc.errno or 0, str(exc)))
        answered_at = answered_at or time.monotonic() - start
    finally:
        sock.close()
        sender.join(10)
        sampler.stop()
    growth = sampler.rss_growth_kib(workers)
    cpu = sampler.cpu_seconds(workers)
    cell.figure = (f"{answer} after {fmt_seconds(answered_at, 90)}, RSS +{growth / 1024:.0f} MiB, "
                   f"CPU {cpu:.1f}s")
    cell.details = {"answer": answer, "answered_after_s": answered_at,
                    "bytes_sent": result["sent"], "send_error": result["send_error"],
                    "send_done_s": result.get("send_done"), "rss_growth_kib": growth,
                    "worker_cpu_s": cpu, "workers_before": sorted(workers),
                    "workers_after": server.workers(), "response_head": buf[:300].decode("latin-1")}
    if not set(server.workers()) >= workers:
        cell.notes.append(f"a worker died: before {sorted(workers)}, after {server.workers()}")
    cell.stderr_excerpt = excerpt(server.stderr_text().splitlines()[-40:])


def probe_kill_arbiter(cell: Cell, server: ServerProc, tmp: Path) -> None:
    workers = server.workers()
    for mark in tmp.glob("inflight-*"):
        mark.unlink()
    inflight: list[Reply] = []
    request = threading.Thread(target=lambda: inflight.append(http_get(server.port, "/sleep", 25)),
                               daemon=True)
    request.start()
    wait_for(lambda: list(tmp.glob("inflight-*")), 10, "/sleep to be in flight")
    os.kill(server.pid, signal.SIGKILL)
    killed = time.monotonic()
    bound: dict[str, float | None] = {"rebind": None}

    def rebind() -> None:
        while time.monotonic() - killed < KILL_BOUND:
            with socket.socket() as sock:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                try:
                    sock.bind(("127.0.0.1", server.port))
                    sock.listen(16)
                except OSError:
                    time.sleep(0.01)  # EADDRINUSE: the next try
                    continue
                bound["rebind"] = time.monotonic() - killed
                return

    binder = threading.Thread(target=rebind, daemon=True)
    binder.start()
    gone: float | None = None
    while time.monotonic() - killed < KILL_BOUND:
        if not any(alive(pid) for pid in workers):
            gone = time.monotonic() - killed
            break
        time.sleep(0.01)  # /proc polled every 10 ms: the figure's resolution
    binder.join(KILL_BOUND + 1)
    request.join(15)
    server.proc.wait(5)  # the killed arbiter, our child
    reply = inflight[0] if inflight else None
    if reply is None:
        outcome = "no reply yet"
    else:
        outcome = f"{reply.status} after {fmt_seconds(reply.latency, 25)}" if reply.status else reply.error
    cell.figure = (f"workers outlive it {fmt_seconds(gone, KILL_BOUND)}, rebind "
                   f"{fmt_seconds(bound['rebind'], KILL_BOUND)}, in-flight: {outcome}")
    cell.details = {"workers": workers, "workers_gone_after_s": gone,
                    "rebind_after_s": bound["rebind"], "inflight": asdict(reply) if reply else None,
                    "left": [p for p in workers if alive(p)]}
    cell.stderr_excerpt = excerpt(server.stderr_text().splitlines()[-30:])


def probe_full_disk(cell: Cell, server: ServerProc) -> None:
    err0 = server.stderr_size()
    replies: list[Reply] = []
    lock = threading.Lock()

    def client(n: int) -> None:
        for _ in range(n):
            reply = http_get(server.port, timeout=5.0)
            with lock:
                replies.append(reply)

    threads = [threading.Thread(target=client, args=(FULL_DISK_REQUESTS // FULL_DISK_THREADS,),
                                daemon=True) for _ in range(FULL_DISK_THREADS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(300)
    # The last log lines may follow the last response: until stderr stops growing (bounded).
    sizes = [server.stderr_size()]

    def settled() -> bool:
        sizes.append(server.stderr_size())
        return sizes[-1] == sizes[-2]
    try:
        wait_for(settled, 3, "stderr to settle", interval=0.3)
    except AssertionError:
        cell.notes.append("stderr still growing 3 s after the last request")
    lines = stderr_lines(server, err0)
    ok = sum(1 for r in replies if r.ok)
    errors: dict[str, int] = {}
    for r in replies:
        if not r.ok:
            errors[r.error] = errors.get(r.error, 0) + 1
    cell.figure = f"{ok}/{FULL_DISK_REQUESTS} answered, {len(lines)} stderr lines"
    cell.details = {"answered": ok, "failures": errors, "stderr_lines": len(lines),
                    "stderr_bytes": server.stderr_size() - err0,
                    "worker_pids_seen": sorted({r.pid for r in replies if r.pid})}
    cell.stderr_excerpt = excerpt(lines)


def human_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024  # type: ignore[assignment]
    return f"{n} B"


def run_cell(probe: str, name: str, tmp: Path, duration: float) -> Cell:
    cell = Cell(probe, name, load_before=os.getloadavg()[0])
    started = time.monotonic()
    family = SERVERS[name][0]
    extra: list[str] = []
    if probe == "full-disk":
        extra = ["--access-log" if family == "forkserve" else "--access-logfile", "/dev/full"]
    server = ServerProc(name, tmp, probe, extra, nofile=FD_LIMIT if probe == "fd-exhaust" else None)
    try:
        server.ready()
        if probe in SWARM:
            probe_swarm(cell, server, probe, duration)
        elif probe == "fd-exhaust":
            probe_fd_exhaust(cell, server)
        elif probe == "trailer":
            probe_trailer(cell, server)
        elif probe == "kill-arbiter":
            probe_kill_arbiter(cell, server, tmp)
        elif probe == "full-disk":
            probe_full_disk(cell, server)
    except Exception as exc:  # one broken cell must not lose the others: report it in the table
        cell.figure = cell.figure or f"bench error: {type(exc).__name__}"
        cell.notes.append(f"{type(exc).__name__}: {str(exc)[:1500]}")
        cell.stderr_excerpt = cell.stderr_excerpt or excerpt(server.stderr_text().splitlines()[-30:])
    finally:
        cell.notes += server.kill()
    text = server.stderr_text()
    tracebacks = text.count("Traceback (most recent call last)")
    if tracebacks:
        cell.notes.append(f"{tracebacks} traceback(s) in the server's stderr")
        cell.details["first_traceback"] = first_traceback(text)
    cell.details["argv"] = " ".join(server.argv[1:])
    cell.load_after = os.getloadavg()[0]
    cell.seconds = time.monotonic() - started
    return cell


# -- output -------------------------------------------------------------------------------------

def table(rows: list[str], cols: list[str], value: Callable[[str, str], str]) -> str:
    out = ["| probe | " + " | ".join(cols) + " |", "|---" * (len(cols) + 1) + "|"]
    for row in rows:
        out.append(f"| {row} | " + " | ".join(value(row, col) for col in cols) + " |")
    return "\n".join(out)


def machine() -> dict[str, str]:
    def version(module: str) -> str:
        try:
            out = subprocess.run([sys.executable, "-c", f"import {module}; print({module}.__version__)"],
                                 capture_output=True, text=True, timeout=30, cwd=ROOT)
            return out.stdout.strip() or "not installed"
        except subprocess.TimeoutExpired:
            return "?"
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True, cwd=ROOT, timeout=10).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "forkserve"],
                           capture_output=True, text=True, cwd=ROOT, timeout=10).stdout.strip()
    return {"nproc": str(os.cpu_count()), "python": platform.python_version(),
            "kernel": platform.release(),
            "forkserve": f"{version('forkserve')} ({commit}{', dirty' if dirty else ''})",
            "gunicorn": version("gunicorn"), "gevent": version("gevent")}


def pick(value: str, names: tuple[str, ...] | list[str], what: str) -> list[str]:
    chosen = []
    for item in value.split(","):
        item = item.strip()
        if item.isdigit() and 1 <= int(item) <= len(names):
            item = names[int(item) - 1]
        if item not in names:
            raise SystemExit(f"unknown {what} {item!r}; choose from {', '.join(names)}")
        if item not in chosen:
            chosen.append(item)
    return chosen


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--servers", default=",".join(SERVERS),
                        help=f"comma-separated subset of {', '.join(SERVERS)}")
    parser.add_argument("--probes", default=",".join(PROBES),
                        help=f"comma-separated subset, by name or number: {', '.join(PROBES)}")
    parser.add_argument("--duration", type=float, default=30.0,
                        help="seconds of legitimate load in probes 1-4 [default: 30]")
    parser.add_argument("--quick", action="store_true", help="--duration 10")
    parser.add_argument("--json", action="store_true", help="save the results under bench/results/")
    args = parser.parse_args()
    servers = pick(args.servers, list(SERVERS), "server")
    probes = pick(args.probes, PROBES, "probe")
    duration = 10.0 if args.quick else args.duration
    resource.setrlimit(resource.RLIMIT_NOFILE, (ORIGINAL_NOFILE[1], ORIGINAL_NOFILE[1]))

    info = machine()
    command = " ".join([Path(sys.executable).name, *sys.argv])
    print(f"command: {command}")
    print("machine: " + ", ".join(f"{k} {v}" for k, v in info.items()))
    print(f"load before: {' '.join(f'{x:.2f}' for x in os.getloadavg())}", flush=True)

    cells: dict[tuple[str, str], Cell] = {}
    with tempfile.TemporaryDirectory(prefix="hostile-") as tmpdir:
        tmp = Path(tmpdir)
        for probe in probes:
            for name in servers:
                print(f"  {probe} × {name} ...", end=" ", file=sys.stderr, flush=True)
                cell = run_cell(probe, name, tmp, duration)
                cells[(probe, name)] = cell
                print(f"{cell.figure} [{cell.seconds:.0f}s, load {cell.load_before:.1f}→"
                      f"{cell.load_after:.1f}]", file=sys.stderr, flush=True)

    labels = {p: f"{PROBES.index(p) + 1}. {p}" for p in probes}
    rows = [labels[p] for p in probes]
    by_label = {v: k for k, v in labels.items()}
    print()
    print(table(rows, servers, lambda r, c: cells[(by_label[r], c)].figure))
    print()
    print("1-minute load average before → after each cell:")
    print()
    print(table(rows, servers, lambda r, c: f"{cells[(by_label[r], c)].load_before:.1f} → "
                                            f"{cells[(by_label[r], c)].load_after:.1f}"))
    print(f"\nload after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    notes = [(k, c) for k, c in cells.items() if c.notes]
    if notes:
        print("\nnotes:")
        for (probe, name), cell in notes:
            for note in cell.notes:
                print(f"- {probe} × {name}: {note}")
    if args.json:
        results = ROOT / "bench" / "results"
        results.mkdir(parents=True, exist_ok=True)
        path = results / f"hostile-{time.strftime('%Y%m%d-%H%M%S')}.json"
        path.write_text(json.dumps({"command": command, "machine": info, "duration": duration,
                                    "cells": [asdict(c) for c in cells.values()]}, indent=1))
        print(f"\nsaved {path.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
