"""The lifecycle matrix: no request lost under load, for every worker class, event and client.

    python bench/lifecycle.py --quick                    # a few minutes: the core cells
    python bench/lifecycle.py                            # the whole matrix (hours)
    python bench/lifecycle.py --server both --worker-class thread --event hup:20 \\
        --clients close,keepalive,haproxy --app hello,sleep --json out.json

A cell is worker class × event × clients × app. For each, a fresh forkserve (2 workers, JSON
logs, a status server and a control socket; all on 127.0.0.1) is started, loaded by the
classifying client of ``bench/lifecycle_client.py`` (real sockets, bounded in count and time),
given the event, and its results are judged; then, where gunicorn has the same event, the same
cell runs for gunicorn's matching class (sync, gthread, gevent) in the same run.

Events (``NAME`` or ``NAME:N`` for N repetitions; gunicorn's equivalent in brackets):

| event | what happens | default N |
|---|---|---|
| term | TERM under load; the exit code and the time to exit are measured [TERM] | 1 |
| hup | N × HUP, 0.5 s apart [HUP] | 20 |
| usr2 | N × USR2, 1 s apart [USR2, then TERM of the old master once the new one serves] | 10 |
| usr2-hup, usr2-usr1 | N × (USR2, then HUP / USR1 the moment ``Upgrade: re-executing`` is logged) | 3 |
| sf-takeover | N × a new instance ``--takeover OLD.sock -sf OLDPID`` | 3 |
| sf-reuseport | N × a new instance ``--reuse-port -sf OLDPID`` (both with ``--reuse-port``) | 3 |
| ttou-ttin | N × TTOU, 0.5 s paused, TTIN (gunicorn's TTOU/TTIN scale workers: see scale) | 3 |
| max-requests | ``--max-requests 50`` under load until N workers were recycled [the same] | 10 |
| scale | control socket ``scale 4``, ``scale 1``, ``scale 2`` [TTIN ×2, TTOU ×3, TTIN] | 1 |
| kill-worker | N × SIGKILL of one worker, 2 s apart [the same] | 1 |

Clients: ``close`` (a new connection per request, ``Connection: close``), ``keepalive``,
``mix`` (half of each), ``haproxy`` (keep-alive clients to a real HAProxy on 127.0.0.1 with
backend keep-alive, ``http-reuse always``, ``option httpchk GET /readyz`` on forkserve's status
port — gunicorn's app port — every 100 ms, and no ``retry-on`` / ``option redispatch``).
Apps (``bench/apps_lifecycle.py``): ``hello`` (examples/hello.py), ``sleep`` (200 ms), ``stream``
(1 MiB in 64 KiB chunks).

Judging (the issue's pass criteria): every failure is a lost request, except
- term: ``refused`` after the TERM (the listener is closed: that is the point); and the server
  must exit 0, stop accepting within 100 ms (``accepted_until``: the last connect() the kernel
  completed after the TERM) and refuse the later clients (``refused_from``: the first
  ECONNREFUSED, reported, not judged: forkserve drops new SYNs at the stop by design, so a client
  that tried meanwhile is refused at its SYN retransmission, 1 s later), and exit within 20 ms
  of the last response (``after_last``);
- ttou-ttin: ``refused`` while paused (between TTOU and the ``Resumed`` line);
- kill-worker: reset/empty/partial within 1 s of the SIGKILL, at most one per client (the
  requests in flight on that worker); and a new worker must serve within 1 s.
Every wait is bounded; every process is killed (its process group) on any exit path.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.apps_lifecycle import EXPECTED  # noqa: E402
from bench.lifecycle_client import KINDS, Load, Tally, probe  # noqa: E402
from bench.lifecycle_servers import WORKERS, Gunicorn, Instance, Procs, alive, wait_exit  # noqa: E402
from forkserve.control import request as control_request  # noqa: E402
from tests.harness import children, process_group, wait_for  # noqa: E402

CLASSES = ("sync", "thread", "gevent")
EVENTS = {"term": 1, "hup": 20, "usr2": 10, "usr2-hup": 3, "usr2-usr1": 3, "sf-takeover": 3,
          "sf-reuseport": 3, "ttou-ttin": 3, "max-requests": 10, "scale": 1, "kill-worker": 1}
GUNICORN_EVENTS = {"term", "hup", "usr2", "max-requests", "scale", "kill-worker"}
CLIENT_MODES = ("close", "keepalive", "mix", "haproxy")
APP_NAMES = ("hello", "sleep", "stream")
DEFAULT_CLIENTS = {"hello": 16, "sleep": 8, "stream": 4}
QUICK = dict(events=["term", "hup:5", "usr2:2", "kill-worker"], clients=["close", "keepalive"],
             apps=["hello"])

# The pass criteria.
ACCEPT_STOP = 0.100      # TERM -> the first refused connection
EXIT_AFTER_LAST = 0.020  # the last response -> the arbiter's exit
REPLACEMENT = 1.0        # SIGKILL of a worker -> a new worker answers
KILL_WINDOW = 1.0        # failures this soon after the SIGKILL are the killed worker's
TERM_EXIT_TIMEOUT = 40.0
WARMUP = 1.5  # seconds of load before the event (spawning the clients included)  # drain timeout (25 s) + cancel grace + flushing, with room


@dataclass
class Window:
    """Failures of these kinds between ``start`` and ``end`` are expected (up to ``most``)."""
    kinds: frozenset[str]
    start: float
    end: float
    most: int | None = None


@dataclass
class Cell:
    server: str
    worker_class: str
    event: str
    times: int
    clients: str
    app: str
    concurrency: int
    # results
    sent: int = 0
    ok: int = 0
    failures: dict[str, int] = field(default_factory=dict)
    lost: int = 0  # failures not explained by a window
    max_latency: float = 0.0
    slow: int = 0  # requests over 1 s
    exit_code: int | None = None
    exit_after_event: float | None = None
    exit_after_last_response: float | None = None
    accept_stop: float | None = None  # TERM -> the first ECONNREFUSED a client saw
    accepting_until: float | None = None  # TERM -> the last connect() the kernel completed
    replacement: list[float | None] = field(default_factory=list)
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)
    samples: list[str] = field(default_factory=list)
    error: str | None = None
    verdict: str = ""
    # bookkeeping, not reported
    windows: list[Window] = field(default_factory=list, repr=False)
    event_at: float = field(default=0.0, repr=False)

    @property
    def name(self) -> str:
        times = f"×{self.times}" if self.times != 1 else ""
        return f"{self.worker_class} {self.event}{times} {self.clients} {self.app}"

    def report(self) -> dict[str, Any]:
        skip = {"windows", "event_at"}
        return {k: v for k, v in self.__dict__.items() if k not in skip}


class Context:
    """What an event works with: the cell, its processes, the current instance and the load."""

    def __init__(self, cell: Cell, procs: Procs, instance: Instance, load: Load, extra: list[str]) -> None:
        self.cell = cell
        self.procs = procs
        self.instance = instance
        self.load = load
        self.extra = extra
        self.port = instance.port
        self.front = load.port  # what the clients connect to: the server, or HAProxy before it

    def mark(self) -> float:
        now = time.monotonic()
        if not self.cell.event_at:
            self.cell.event_at = now
        return now

    def note(self, text: str) -> None:
        self.cell.notes.append(text)

    def count(self, message: str) -> int:
        return self.instance.server.count_log(message)

    def wait_count(self, message: str, n: int, timeout: float) -> bool:
        """Until the current instance has logged ``message`` ``n`` times (False if it exited
        or the time ran out)."""
        deadline = time.monotonic() + timeout
        while self.count(message) < n:
            if time.monotonic() >= deadline or not alive(self.instance.master):
                return self.count(message) >= n
            time.sleep(0.01)
        return True

    def wait_all_done(self, started: str, ended: tuple[str, ...], timeout: float = 60.0) -> None:
        """Until every reload or upgrade the server started (coalesced ones start after the one
        in progress) has ended, completed or failed; bounded."""
        def done() -> bool:
            return sum(self.count(e) for e in ended) >= self.count(started)
        deadline = time.monotonic() + timeout
        while not done() and time.monotonic() < deadline and alive(self.instance.master):
            time.sleep(0.05)

    def settle(self, workers: int = WORKERS, timeout: float = 40.0) -> None:
        """Until the master has exactly its workers (old generations and checks gone), then
        until the load has been served a little more."""
        instance = self.instance
        try:
            wait_for(lambda: not alive(instance.master) or len(instance.workers()) == workers,
                     timeout, f"{workers} workers")
        except AssertionError:
            self.note(f"still {len(instance.workers())} workers {timeout:.0f}s after the event")
        if not alive(instance.master):
            self.note("the server is gone")
            return
        if not self.load.wait_ok(self.cell.concurrency * 2, 15):
            self.note("no progress after the event")


# -- events ------------------------------------------------------------------------------------

def ev_term(ctx: Context, n: int) -> None:
    master = ctx.instance.master
    sent = ctx.mark()
    ctx.instance.signal(signal.SIGTERM)
    # Once the only server is going away, nobody is left to serve: the kernel refuses, and a
    # balancer in front answers its own "no server" 503 (the request reached no server).
    ctx.cell.windows.append(Window(frozenset({"refused", "unavailable"}), sent, float("inf")))
    exited = wait_exit(master, TERM_EXIT_TIMEOUT)
    if exited is None:
        ctx.note(f"did not exit within {TERM_EXIT_TIMEOUT:.0f}s of TERM")
        return
    ctx.cell.exit_after_event = exited - sent
    ctx.cell.exit_code = ctx.instance.exit_code()
    ctx.load.wait_ok(1 << 30, 0.3)  # the clients see the closed port for a moment
    try:
        wait_for(lambda: not process_group(ctx.instance.server.pid), 3, "the workers")
    except AssertionError:
        ctx.note(f"processes outlived the arbiter: {process_group(ctx.instance.server.pid)}")
    ctx.cell.__dict__["_exited_at"] = exited


def ev_hup(ctx: Context, n: int) -> None:
    for i in range(n):
        ctx.mark()
        ctx.instance.signal(signal.SIGHUP)
        time.sleep(0.5)  # the spacing, not a synchronisation
    if ctx.instance.kind == "forkserve":
        ctx.wait_all_done("Reloading: starting", ("Reload complete", "Reload failed"))
        ctx.note(f"{n} HUPs: {ctx.count('Reload complete')} reloads completed, "
                 f"{ctx.count('Reload requested during')} HUPs coalesced into the next one, "
                 f"{ctx.count('Reload failed')} failed")
    ctx.settle()


def ev_usr2(ctx: Context, n: int) -> None:
    if ctx.instance.kind == "gunicorn":
        return gunicorn_usr2(ctx, n)
    for i in range(n):
        ctx.mark()
        ctx.instance.signal(signal.SIGUSR2)
        time.sleep(1.0)  # the spacing
    ctx.wait_all_done("Upgrade requested: checking",
                      ("Upgrade complete", "Upgrade aborted", "Upgrade failed", "Upgrade abandoned"))
    ctx.settle()
    ctx.note(f"{n} USR2s: {ctx.count('Upgrade complete')} upgrades completed, "
             f"{ctx.count('Upgrade requested during')} USR2s coalesced into the next one, "
             f"{ctx.count('Upgrade aborted') + ctx.count('Upgrade failed')} failed")


def gunicorn_usr2(ctx: Context, n: int) -> None:
    """gunicorn's documented upgrade: USR2 starts a new master (it logs ``Listening at`` with
    its pid); once the new master's workers serve, TERM the old master."""
    instance = ctx.instance
    server = instance.server
    assert isinstance(server, Gunicorn)
    for i in range(n):
        old = instance.master
        ctx.mark()
        os.kill(old, signal.SIGUSR2)
        new = wait_for(lambda: len(server.masters()) > i + 1 and server.masters()[i + 1], 30,
                       "gunicorn's new master")
        wait_for(lambda: len(set(children(new))) >= WORKERS, 30,
                 "the new master's workers")
        wait_for(lambda: probe(ctx.port, "/readyz", 2.0).pid in set(children(new)),
                 30, "a new worker to answer")
        code_owner = old == instance.server.pid
        os.kill(old, signal.SIGTERM)
        if wait_exit(old, TERM_EXIT_TIMEOUT) is None:
            ctx.note(f"old master {old} did not exit")
        elif code_owner:
            ctx.note(f"old master exit code {instance.server.proc.wait(5)}")
        instance.master = new
        time.sleep(1.0)  # the spacing
    ctx.settle()


def usr2_then(signum: int) -> Callable[[Context, int], None]:
    def event(ctx: Context, n: int) -> None:
        for i in range(n):
            ctx.mark()
            ctx.instance.signal(signal.SIGUSR2)
            if not ctx.wait_count("Upgrade: re-executing", i + 1, 30):
                ctx.note(f"no 'Upgrade: re-executing' for USR2 #{i + 1}")
                break
            ctx.instance.signal(signum)
            done = ctx.wait_count("Upgrade complete", i + 1, 30)
            if not alive(ctx.instance.master):
                code = ctx.instance.exit_code()
                how = (f"killed by {signal.Signals(-code).name}" if code is not None and code < 0
                       else f"exit code {code}")
                ctx.note(f"the arbiter died after USR2 #{i + 1} + {signal.Signals(signum).name} ({how})")
                ctx.cell.exit_code = code
                ctx.load.wait_ok(1 << 30, 1.0)  # what the clients see then
                return
            if not done:
                ctx.note(f"upgrade #{i + 1} did not complete")
            ctx.settle()
    return event


def sf_handoff(reuse_port: bool) -> Callable[[Context, int], None]:
    def event(ctx: Context, n: int) -> None:
        status_port = ctx.instance.server.status_port
        for i in range(n):
            old = ctx.instance
            args = ["--reuse-port"] if reuse_port else ["--takeover", str(old.control)]
            ctx.mark()
            new = ctx.procs.forkserve(ctx.cell.worker_class, ctx.cell.app, *ctx.extra, *args,
                                      "-sf", str(old.master), bind=f"127.0.0.1:{ctx.port}",
                                      status_bind=f"127.0.0.1:{status_port}")
            try:
                ctx.procs.ready(new)
            except AssertionError as exc:
                ctx.note(f"handoff #{i + 1}: the new instance did not get ready: "
                         f"{str(exc).splitlines()[0]}")
                return
            exited = wait_exit(old.master, TERM_EXIT_TIMEOUT)
            code = old.exit_code() if exited is not None else None
            if code != 0:
                ctx.note(f"handoff #{i + 1}: the old instance exited {code}")
            ctx.instance = new
            ctx.settle()
    return event


def ev_ttou_ttin(ctx: Context, n: int) -> None:
    for i in range(n):
        paused_at = ctx.mark()
        ctx.instance.signal(signal.SIGTTOU)
        if not ctx.wait_count("Paused: not listening", i + 1, 15):
            ctx.note(f"TTOU #{i + 1}: not paused")
        time.sleep(0.5)
        ctx.instance.signal(signal.SIGTTIN)
        resumed = ctx.wait_count("Resumed: listening again", i + 1, 15)
        if ctx.cell.clients == "haproxy":
            # Paused is not ready (nobody accepts new connections): the balancer has no server
            # until its check sees the resumed generation ready again.
            try:
                wait_for(lambda: probe(ctx.front, "/", 1.0).kind == "ok", 10, "HAProxy to serve again")
            except AssertionError:
                ctx.note(f"TTIN #{i + 1}: HAProxy did not serve again within 10 s")
        ctx.cell.windows.append(Window(frozenset({"refused", "unavailable"}), paused_at,
                                       time.monotonic() + 0.05))
        if not resumed:
            ctx.note(f"TTIN #{i + 1}: not resumed")
        ctx.settle()


def ev_max_requests(ctx: Context, n: int) -> None:
    ctx.mark()
    message = "retired" if ctx.instance.kind == "forkserve" else "Autorestarting worker"
    deadline = time.monotonic() + 60
    while ctx.count(message) < n and time.monotonic() < deadline and alive(ctx.instance.master):
        time.sleep(0.05)
    ctx.note(f"{ctx.count(message)} workers recycled")
    ctx.settle()


def ev_scale(ctx: Context, n: int) -> None:
    for _ in range(n):
        for count in (4, 1, 2):
            ctx.mark()
            if ctx.instance.kind == "forkserve":
                answer, _ = control_request(str(ctx.instance.control), f"scale {count}")
                if not answer.get("ok"):
                    ctx.note(f"scale {count}: {answer}")

                def running() -> bool:
                    answer, _ = control_request(str(ctx.instance.control), "status")
                    states = [w["state"] for w in answer.get("workers", [])]
                    return states.count("running") == count and len(states) == count
                try:
                    wait_for(running, 40, f"{count} running workers")
                except AssertionError:
                    ctx.note(f"scale {count}: not reached")
            else:
                have = len(ctx.instance.workers())
                signum = signal.SIGTTIN if count > have else signal.SIGTTOU
                for _ in range(abs(count - have)):
                    ctx.instance.signal(signum)
                    time.sleep(0.05)  # gunicorn handles one queued signal per loop turn
            ctx.settle(workers=count)


def ev_kill_worker(ctx: Context, n: int) -> None:
    for i in range(n):
        workers = ctx.instance.workers()
        if not workers:
            ctx.note("no worker to kill")
            return
        before = set(workers)
        at = ctx.mark()
        os.kill(workers[0], signal.SIGKILL)
        ctx.cell.windows.append(Window(frozenset({"reset", "empty", "partial"}), at,
                                       at + KILL_WINDOW, ctx.cell.concurrency))
        # The load's keep-alive connections may all stay with the surviving worker, so fresh
        # connections look for the replacement too (bounded; the load's sightings count too).
        # forkserve's control socket also says when the replacement has booted (it accepts from
        # then on): a probe can keep landing on the surviving worker, whose accept loop is hot
        # while the new one boots (the thread worker with the 200 ms app).
        seen = None
        deadline = at + 2.0
        while seen is None and time.monotonic() < deadline:
            answer = probe(ctx.port, "/readyz", 1.0)
            if (answer.pid is not None and answer.pid not in before) or booted_new(ctx, before):
                seen = time.monotonic()
            else:
                time.sleep(0.005)
        ctx.cell.__dict__.setdefault("_kills", []).append((at, before, seen))
        time.sleep(max(0.0, deadline - time.monotonic()))  # spacing between kills
        ctx.settle()


def booted_new(ctx: Context, before: set[int]) -> bool:
    """Has a forkserve worker not in ``before`` booted (the control socket's status)?"""
    if ctx.instance.kind != "forkserve" or ctx.instance.control is None:
        return False
    try:
        answer, _ = control_request(str(ctx.instance.control), "status")
    except OSError:
        return False
    return any(w.get("booted") and w.get("pid") not in before for w in answer.get("workers", []))


EVENT_FUNCS: dict[str, Callable[[Context, int], None]] = {
    "term": ev_term, "hup": ev_hup, "usr2": ev_usr2,
    "usr2-hup": usr2_then(signal.SIGHUP), "usr2-usr1": usr2_then(signal.SIGUSR1),
    "sf-takeover": sf_handoff(False), "sf-reuseport": sf_handoff(True),
    "ttou-ttin": ev_ttou_ttin, "max-requests": ev_max_requests, "scale": ev_scale,
    "kill-worker": ev_kill_worker,
}


# -- one cell ----------------------------------------------------------------------------------

def wrk_rps(port: int, keepalive: bool, seconds: int = 3) -> str:
    """Throughput only (wrk counts no failure the way the classifying client does)."""
    if shutil.which("wrk") is None:
        return "wrk not installed"
    argv = ["wrk", "-t2", "-c16", f"-d{seconds}s", f"http://127.0.0.1:{port}/"]
    if not keepalive:
        argv[4:4] = ["-H", "Connection: close"]
    try:
        out = subprocess.run(argv, capture_output=True, text=True, timeout=seconds + 10).stdout
    except subprocess.TimeoutExpired:
        return "wrk timed out"
    match = re.search(r"Requests/sec:\s+([\d.]+)", out)
    return f"{float(match.group(1)):,.0f} req/s" if match else "wrk gave no rate"


def run_cell(cell: Cell, tmp: Path, warmup: int | None = None, throughput: bool = False) -> Cell:
    """Start the server (and HAProxy), load it, run the event, judge. Never leaves a process.
    ``throughput``: first measure the steady rate with wrk (a note; not the accounting)."""
    started = time.monotonic()
    procs = Procs(tmp)
    load: Load | None = None
    tally: Tally | None = None
    try:
        extra = ["--max-requests", "50"] if cell.event == "max-requests" else []
        if cell.event == "sf-reuseport":
            extra.append("--reuse-port")
        if cell.server == "forkserve":
            instance = procs.ready(procs.forkserve(cell.worker_class, cell.app, *extra))
        else:
            instance = procs.ready(procs.gunicorn(cell.worker_class, cell.app, *extra))
        port = instance.port
        if cell.clients == "haproxy":
            port = procs.haproxy(instance.port, instance.check_port)
        mode = "keepalive" if cell.clients == "haproxy" else cell.clients
        if throughput:
            cell.notes.append(f"wrk before the event: {wrk_rps(port, mode != 'close')}")
        load = Load(port, EXPECTED[cell.app], clients=cell.concurrency, mode=mode,
                    seconds=TERM_EXIT_TIMEOUT + 60 + 5 * cell.times)
        procs.loads.append(load)
        load.start()
        if not load.wait_ok(warmup or cell.concurrency * 4, 20):
            cell.notes.append("the load did not get going")
        time.sleep(max(0.0, load.started_at + WARMUP - time.monotonic()))  # a steady load first
        ctx = Context(cell, procs, instance, load, [a for a in extra if a != "--reuse-port"])
        ctx.port = instance.port
        EVENT_FUNCS[cell.event](ctx, cell.times)
        if cell.event != "term" and not alive(ctx.instance.master):
            cell.notes.append("the server is not running after the event")
        tally = load.stop()
        for name in load.missing:
            cell.notes.append(f"{name} did not report: its counts are missing")
        judge(cell, tally)
    except Exception as exc:  # noqa: BLE001 - a broken cell is reported, the matrix goes on
        cell.error = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        if load is not None and tally is None:
            tally = load.stop()
            judge(cell, tally)
    finally:
        cell.notes.extend(procs.close())
        cell.seconds = round(time.monotonic() - started, 1)
    cell.verdict = verdict(cell)
    return cell


def judge(cell: Cell, tally: Tally) -> None:
    cell.sent = tally.sent
    cell.ok = tally.counts["ok"]
    cell.max_latency = round(tally.max_latency, 3)
    cell.slow = tally.slow
    cell.failures = {k: tally.counts[k] for k in KINDS if tally.counts[k]}
    used = [0] * len(cell.windows)
    lost = 0
    for kind, times in tally.failure_times.items():
        for at in times:
            for i, window in enumerate(cell.windows):
                if (kind in window.kinds and window.start <= at <= window.end
                        and (window.most is None or used[i] < window.most)):
                    used[i] += 1
                    break
            else:
                lost += 1
    cell.lost = lost
    def excused(at: float, kind: str) -> bool:
        return any(kind in w.kinds and w.start <= at <= w.end for w in cell.windows)
    # The failures that count first: an excused kind (refusals after a TERM) can be thousands.
    ordered = sorted(tally.samples, key=lambda sample: excused(sample[0], sample[1]))
    cell.samples = [f"+{at - cell.event_at:.3f}s {kind}: {detail}" for at, kind, detail in
                    ordered if not (kind == "refused" and cell.event == "term")][:10]
    exited = cell.__dict__.pop("_exited_at", None)
    if exited is not None and tally.last_ok:
        cell.exit_after_last_response = exited - tally.last_ok
    if cell.event == "term":
        refused = [t for t in tally.failure_times.get("refused", []) if t >= cell.event_at]
        if refused:
            cell.accept_stop = min(refused) - cell.event_at
        cell.accepting_until = max(tally.last_connect - cell.event_at, 0.0)
    for at, before, seen in cell.__dict__.pop("_kills", []):
        new = [t for pid, t in tally.pids.items() if pid not in before and t >= at]
        new += [seen] if seen is not None else []
        cell.replacement.append(min(new) - at if new else None)


def verdict(cell: Cell) -> str:
    reasons = []
    if cell.error:
        reasons.append("error")
    if cell.lost:
        reasons.append(f"{cell.lost} lost")
    if cell.event == "term":
        if cell.exit_code != 0:
            reasons.append(f"exit {cell.exit_code}")
    if cell.event == "term" and cell.clients != "haproxy":
        # The clients' own connections show the server's listener; behind HAProxy they are
        # the balancer's, so only the exit is judged there.
        if cell.accepting_until is not None and cell.accepting_until > ACCEPT_STOP:
            reasons.append(f"accepted until +{cell.accepting_until * 1000:.0f}ms")
        if cell.accept_stop is None:
            reasons.append("never refused")  # refused_from itself is reported, not judged: see below
        if cell.exit_after_last_response is None or cell.exit_after_last_response > EXIT_AFTER_LAST:
            reasons.append("no exit" if cell.exit_after_last_response is None else
                           f"exit +{cell.exit_after_last_response * 1000:.0f}ms")
    if cell.event == "kill-worker":
        slow = [r for r in cell.replacement if r is None or r > REPLACEMENT]
        if slow or not cell.replacement:
            reasons.append("no replacement in 1s")
    if any("died" in n or "not running" in n or "is gone" in n or "outlived" in n
           for n in cell.notes):
        reasons.append("server died" if cell.event != "term" else "orphans")
    return "FAIL: " + ", ".join(reasons) if reasons else "pass"


# -- the matrix ---------------------------------------------------------------------------------

def parse_events(specs: list[str]) -> list[tuple[str, int]]:
    out = []
    for spec in specs:
        name, _, times = spec.partition(":")
        if name == "usr2-then-hup":
            out += [("usr2-hup", int(times or EVENTS["usr2-hup"])),
                    ("usr2-usr1", int(times or EVENTS["usr2-usr1"]))]
            continue
        if name not in EVENTS:
            raise SystemExit(f"unknown event {name!r}; one of {', '.join(EVENTS)}")
        out.append((name, int(times) if times else EVENTS[name]))
    return out


def split(values: list[str] | None) -> list[str]:
    return [v for value in values or [] for v in value.split(",") if v]


def fmt_failures(cell: Cell) -> str:
    if not cell.failures:
        return "-"
    return " ".join(f"{k}={n}" for k, n in cell.failures.items())


def fmt_side(cell: Cell | None) -> str:
    if cell is None:
        return "n/a"
    extra = []
    if cell.event == "term":
        extra.append(f"exit={cell.exit_code}")
        if cell.exit_after_event is not None:
            extra.append(f"t_exit={cell.exit_after_event:.3f}s")
        if cell.exit_after_last_response is not None:
            extra.append(f"after_last={cell.exit_after_last_response * 1000:.0f}ms")
        if cell.accepting_until is not None:
            extra.append(f"accepted_until=+{cell.accepting_until * 1000:.0f}ms")
        extra.append("refused_from=" + (f"+{cell.accept_stop * 1000:.0f}ms" if cell.accept_stop is not None
                                        else "never"))
    extra.append(f"max={cell.max_latency * 1000:.0f}ms" + (f" slow={cell.slow}" if cell.slow else ""))
    if cell.replacement:
        extra.append("replaced=" + ",".join("none" if r is None else f"{r * 1000:.0f}ms"
                                            for r in cell.replacement))
    return (f"{cell.sent:>7} {cell.ok:>7}  lost={cell.lost:<5} {fmt_failures(cell):<28} "
            f"{' '.join(extra):<44} {cell.verdict}")


def print_row(fs: Cell | None, gu: Cell | None, servers: list[str]) -> None:
    ref = fs or gu
    assert ref is not None
    sides = []
    if "forkserve" in servers:
        sides.append(fmt_side(fs))
    if "gunicorn" in servers:
        sides.append(fmt_side(gu))
    print(f"{ref.name:<40} | " + " | ".join(sides), flush=True)
    for cell in (fs, gu):
        if cell is None:
            continue
        for note in cell.notes:
            print(f"{'':40} |   {cell.server}: {note}", flush=True)
        if cell.error:
            print(f"{'':40} |   {cell.server} error: {cell.error}", flush=True)
        for sample in cell.samples[:3] if cell.lost else []:
            print(f"{'':40} |   {cell.server} e.g. {sample}", flush=True)


def header(servers: list[str]) -> str:
    side = f"{'sent':>7} {'ok':>7}  {'lost':<10} {'failures by kind':<28} {'exit / timing':<44} verdict"
    names = "  ".join(f"[{s}]" for s in servers)
    return f"{'cell (class event clients app)':<40} | " + " | ".join(side for _ in servers) + f"\n{names}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="\n".join(__doc__.splitlines()[2:]))
    parser.add_argument("--server", choices=["forkserve", "gunicorn", "both"], default="both")
    parser.add_argument("--worker-class", action="append", metavar="sync,thread,gevent")
    parser.add_argument("--event", action="append", metavar="NAME[:N],...")
    parser.add_argument("--clients", action="append", metavar="close,keepalive,mix,haproxy")
    parser.add_argument("--app", action="append", metavar="hello,sleep,stream")
    parser.add_argument("--concurrency", type=int, help="client threads per cell (default: "
                        + ", ".join(f"{k} {v}" for k, v in DEFAULT_CLIENTS.items()) + ")")
    parser.add_argument("--quick", action="store_true",
                        help="each class x {term, hup:5, usr2:2, kill-worker} x {close, keepalive} x hello")
    parser.add_argument("--wrk", action="store_true",
                        help="measure each cell's steady throughput with wrk first (a note)")
    parser.add_argument("--json", metavar="FILE", help="also write every cell's results here")
    args = parser.parse_args(argv)

    classes = split(args.worker_class) or list(CLASSES)
    events = parse_events(split(args.event) or (QUICK["events"] if args.quick else list(EVENTS)))
    modes = split(args.clients) or (QUICK["clients"] if args.quick else list(CLIENT_MODES))
    apps = split(args.app) or (QUICK["apps"] if args.quick else list(APP_NAMES))
    for value, allowed in ((classes, CLASSES), (modes, CLIENT_MODES), (apps, APP_NAMES)):
        bad = [v for v in value if v not in allowed]
        if bad:
            parser.error(f"unknown {bad}; choose from {', '.join(allowed)}")
    servers = ["forkserve", "gunicorn"] if args.server == "both" else [args.server]

    def interrupted(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt  # the cell's finally kills its processes
    signal.signal(signal.SIGTERM, interrupted)

    print(f"# lifecycle matrix: {WORKERS} workers, {os.cpu_count()} CPUs, "
          f"python {sys.version.split()[0]}; command: bench/lifecycle.py "
          + " ".join(argv if argv is not None else sys.argv[1:]), flush=True)
    print(header(servers), flush=True)
    results: list[dict[str, Any]] = []
    try:
        with tempfile.TemporaryDirectory(prefix="fslc-", dir="/tmp") as tmp:  # short: unix sockets
            for cls in classes:
                for event, times in events:
                    for mode in modes:
                        for app in apps:
                            row: dict[str, Cell | None] = {}
                            for server in servers:
                                if server == "gunicorn" and event not in GUNICORN_EVENTS:
                                    row[server] = None
                                    continue
                                cell = Cell(server, cls, event, times, mode, app,
                                            args.concurrency or DEFAULT_CLIENTS[app])
                                row[server] = run_cell(cell, Path(tmp), throughput=args.wrk)
                                results.append(cell.report())
                            print_row(row.get("forkserve"), row.get("gunicorn"), servers)
    except KeyboardInterrupt:
        print("# interrupted", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1, default=str) + "\n")
    failed = [r for r in results if r["server"] == "forkserve" and r["verdict"] != "pass"]
    print(f"# {len(results)} cells; forkserve: {len(failed)} failing", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
