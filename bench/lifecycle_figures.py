"""The life-cycle figures a user compares (issue 16), for each worker class: one row each.

    python bench/lifecycle_figures.py                    # all three classes, full size (~15 min)
    python bench/lifecycle_figures.py --quick            # 10 HUPs, 2 USR2s, 3 stops, 2 s runs
    python bench/lifecycle_figures.py --lifecycle-classes sync --lifecycle-figures stop,accounting
    python bench/lifecycle_figures.py --json rows.json

``run(args)`` returns the rows (``add_arguments(parser)`` adds the options, so bench/run.py can
offer them); each row is ``{"figure", "server", "value", "unit", "target", "ok", "detail"}``.
Every server has 2 workers (the thread worker 4 threads each) and serves the hello-world app.

Figures (``--lifecycle-figures``, all by default):

- ``hup``, ``usr2``: failed requests over ``--hups`` HUPs (0.5 s apart) and ``--usr2s`` USR2s
  (1 s apart) under full load: one lifecycle-matrix cell each (``bench/lifecycle.py``'s
  ``run_cell``): the classifying raw-socket clients of ``bench/lifecycle_client.py``,
  ``--lifecycle-concurrency`` of them (16: the matrix's figure for hello; 2 workers always have
  a queue, so they never wait for work), half keep-alive and half ``Connection: close`` (the
  ``mix`` clients; ``--lifecycle-clients close,keepalive`` runs a cell for each instead). Then
  the same cell for gunicorn's matching class (sync, gthread, gevent); its USR2 is its own
  documented upgrade (USR2 makes a new master, then TERM the old one once the new one serves).
  Target: 0.
- ``stop``: TERM -> exit of an idle server (target <= 100 ms) and last in-flight response ->
  exit (target <= 20 ms), ``--stop-runs`` times each, median and worst
  (``bench/drain_latency.py``'s functions; the exit is seen through a pidfd).
- ``accounting``: the in-flight accounting, on vs. off in the same run: forkserve, and
  ``bench/unaccounted.py`` (the same server with the accounting statements taken out of the
  request path), both up at once, driven by ``wrk -t2 -cN --latency`` (keep-alive) in
  alternating runs (on, off, off, on, ...: drift hits both alike), ``--accounting-runs`` of
  each, at each of ``--accounting-connections``. Reported: the median req/s of each and the
  cost in %, and the server tree's CPU per request (utime+stime of the arbiter and its workers
  from /proc over the run, divided by the requests wrk counted), which a shared machine
  disturbs less than req/s. Target: < 5 %. Plus ``bench/accounting.py``'s micro-benchmark
  (the accounting's operations timed in a loop) as a share of the measured CPU per request,
  and, where valgrind and hey are installed, the instructions per request of one worker on
  vs. off counted by callgrind (``--callgrind-requests``): a count that a busy machine does
  not disturb (it still moves by about 2 points between runs, with the reconnects and poll
  wake-ups a run happens to have), so the figure to trust when the wrk runs scatter.

The machine is shared: each accounting run also notes the CPU that neither the server nor
wrk used (``foreign``, from /proc/stat), so a disturbed run can be told from a slow server.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench import drain_latency  # noqa: E402
from bench.lifecycle import DEFAULT_CLIENTS, Cell, fmt_failures, run_cell  # noqa: E402
from bench.lifecycle_servers import GUNICORN_CLASS, THREADS, WORKERS  # noqa: E402
from tests.harness import Server, children  # noqa: E402

CLASSES = ("sync", "thread", "gevent")
FIGURES = ("hup", "usr2", "stop", "accounting")
CLIENT_MODES = ("mix", "close", "keepalive")
MODE_TEXT = {"mix": "keep-alive + close clients", "close": "close clients",
             "keepalive": "keep-alive clients"}
# Full size, and --quick: explicit options override either.
SIZES = {
    "full": {"hups": 100, "usr2s": 10, "stop_runs": 10, "accounting_seconds": 5,
             "accounting_runs": 3, "callgrind_requests": 2000},
    "quick": {"hups": 10, "usr2s": 2, "stop_runs": 3, "accounting_seconds": 2,
              "accounting_runs": 2, "callgrind_requests": 500},
}
# The issue's targets.
FAILED_TARGET = 0
IDLE_EXIT_TARGET = 0.100
TAIL_EXIT_TARGET = 0.020
ACCOUNTING_TARGET = 5.0  # % of throughput
APP = "examples.hello:app"
WRK_TIMEOUT = 30.0
# A run during which other processes used more than this share of the machine's CPU is run
# again (at most RETRIES more times; the least disturbed try is kept).
MAX_FOREIGN = 0.2
RETRIES = 2
CALLGRIND_START = 300.0  # seconds for a server under valgrind to start, or a run to finish
CLK_TCK = os.sysconf("SC_CLK_TCK")

Row = dict[str, Any]


def row(figure: str, server: str, value: float, unit: str, target: str, ok: bool,
        detail: str) -> Row:
    return {"figure": figure, "server": server, "value": value, "unit": unit, "target": target,
            "ok": bool(ok), "detail": detail}


def fs_name(worker_class: str) -> str:
    return f"fs-{worker_class}"


def gunicorn_name(worker_class: str) -> str:
    return f"gunicorn-{GUNICORN_CLASS[worker_class]}"


def progress(text: str) -> None:
    print(f"# {text}", file=sys.stderr, flush=True)


# -- options ----------------------------------------------------------------------------------

def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of these figures (prefixed where a harness could have its own). ``--quick``
    is added only where the parser has none yet: a harness's own --quick then sizes these too."""
    group = parser.add_argument_group("life-cycle figures")
    group.add_argument("--lifecycle-classes", default=",".join(CLASSES), metavar="sync,thread,gevent",
                       help="forkserve worker classes (gunicorn's matching ones alongside)")
    group.add_argument("--lifecycle-figures", default=",".join(FIGURES),
                       metavar=",".join(FIGURES), help="which figures (default: all)")
    group.add_argument("--hups", type=int, help="HUPs per cell (100; --quick 10)")
    group.add_argument("--usr2s", type=int, help="USR2s per cell (10; --quick 2)")
    group.add_argument("--lifecycle-clients", default="mix", metavar="mix,close,keepalive",
                       help="client modes for the HUP/USR2 cells, a cell each (default mix: "
                            "half keep-alive, half close, in one cell)")
    group.add_argument("--lifecycle-concurrency", type=int, default=DEFAULT_CLIENTS["hello"],
                       help="client threads in a HUP/USR2 cell (default %(default)s)")
    group.add_argument("--lifecycle-gunicorn", action=argparse.BooleanOptionalAction, default=True,
                       help="also run the HUP and USR2 cells for gunicorn (default: yes)")
    group.add_argument("--stop-runs", type=int, help="runs of each stop figure (10; --quick 3)")
    group.add_argument("--accounting-seconds", type=int, help="seconds per wrk run (5; --quick 2)")
    group.add_argument("--accounting-runs", type=int,
                       help="wrk runs of each side, on and off (3; --quick 2)")
    group.add_argument("--accounting-connections", default="50,2", metavar="50,2",
                       help="wrk connection counts (default %(default)s)")
    group.add_argument("--callgrind-requests", type=int,
                       help="requests counted under callgrind, on and off (2000; --quick 500; "
                            "0: skip that figure)")
    try:
        group.add_argument("--quick", action="store_true",
                           help="10 HUPs, 2 USR2s, 3 stop runs, 2 runs of 2 s (explicit options win)")
    except argparse.ArgumentError:
        pass  # the harness has its own --quick: it sizes these figures too


def split(text: str, allowed: tuple[str, ...], what: str) -> list[str]:
    values = [v for v in text.split(",") if v]
    bad = [v for v in values if v not in allowed]
    if bad:
        raise SystemExit(f"unknown {what} {bad}; choose from {', '.join(allowed)}")
    return values


def size(args: argparse.Namespace, name: str) -> int:
    value = getattr(args, name, None)
    if value is not None:
        return int(value)
    return SIZES["quick" if getattr(args, "quick", False) else "full"][name]


# -- HUP and USR2 under load --------------------------------------------------------------------

def lifecycle_rows(worker_class: str, event: str, times: int, modes: list[str], concurrency: int,
                   gunicorn: bool, tmp: Path) -> list[Row]:
    rows = []
    what = "HUPs" if event == "hup" else "USR2s"
    servers = ["forkserve"] + (["gunicorn"] if gunicorn else [])
    for mode in modes:
        for server in servers:
            name = fs_name(worker_class) if server == "forkserve" else gunicorn_name(worker_class)
            progress(f"{name}: {times} {what}, {concurrency} {MODE_TEXT[mode]}")
            cell = run_cell(Cell(server, worker_class, event, times, mode, "hello", concurrency), tmp)
            rows.append(cell_row(cell, name, f"failed requests over {times} {what} under load "
                                             f"({MODE_TEXT[mode]})"))
    return rows


def cell_row(cell: Cell, name: str, figure: str) -> Row:
    parts = [f"{cell.concurrency} clients: {cell.sent} sent, {cell.ok} ok, "
             f"failures {fmt_failures(cell)}", f"max latency {cell.max_latency * 1000:.0f} ms"
             + (f", {cell.slow} over 1 s" if cell.slow else ""), f"{cell.seconds:.0f} s"]
    parts += cell.notes
    if cell.error:
        parts.append(f"error: {cell.error}")
    if cell.lost:
        parts += [f"e.g. {sample}" for sample in cell.samples[:3]]
    if cell.server == "gunicorn" and cell.event == "usr2":
        parts.append("gunicorn's upgrade: USR2, then TERM of the old master once the new one serves")
    return row(figure, name, cell.lost, "requests", str(FAILED_TARGET),
               cell.verdict == "pass" and cell.lost == FAILED_TARGET, "; ".join(parts))


# -- the stop ---------------------------------------------------------------------------------

def stop_rows(worker_class: str, runs: int) -> list[Row]:
    rows = []
    name = fs_name(worker_class)
    figures: list[tuple[str, Callable[[int, str], float], float]] = [
        ("TERM → exit, idle server", drain_latency.idle_stop, IDLE_EXIT_TARGET),
        ("last in-flight response → exit", drain_latency.tail_stop, TAIL_EXIT_TARGET)]
    for figure, measure, target in figures:
        progress(f"{name}: {figure}, {runs} runs")
        samples = [measure(WORKERS, worker_class) for _ in range(runs)]
        all_ms = ", ".join(f"{s * 1000:.1f}" for s in samples)
        for how, value in (("median", statistics.median(samples)), ("worst", max(samples))):
            rows.append(row(f"{figure} ({how} of {runs})", name, round(value * 1000, 1), "ms",
                            f"≤ {target * 1000:.0f} ms", value <= target,
                            f"{runs} runs (ms): {all_ms}"))
    return rows


# -- the accounting, on vs. off -----------------------------------------------------------------

class Unaccounted(Server):
    """forkserve through bench/unaccounted.py (the accounting taken out), watched the same way;
    ``prefix``: a command to run it under (valgrind)."""

    def __init__(self, *args: str, workers: int = WORKERS, accounted: bool = False,
                 prefix: tuple[str, ...] = ()) -> None:
        entry = ["-m", "forkserve"] if accounted else [str(ROOT / "bench" / "unaccounted.py")]
        argv = [*prefix, sys.executable, *entry, "-b", "127.0.0.1:0", "-w", str(workers),
                "--log-format", "json", *args, APP]
        self._launch(argv, dict(os.environ), None, ROOT, ())


def tree_cpu(pid: int) -> dict[int, float]:
    """CPU seconds (user + system) so far of ``pid`` and of each of its live children."""
    seconds = {}
    for each in [pid, *children(pid)]:
        try:
            with open(f"/proc/{each}/stat", encoding="ascii", errors="replace") as fh:
                fields = fh.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        seconds[each] = (int(fields[11]) + int(fields[12])) / CLK_TCK
    return seconds


def machine_busy() -> float:
    """CPU seconds the whole machine has spent busy so far (all cores)."""
    with open("/proc/stat", encoding="ascii") as fh:
        fields = [int(v) for v in fh.readline().split()[1:]]
    idle = fields[3] + fields[4]  # idle, iowait
    return (sum(fields[:8]) - idle) / CLK_TCK


@dataclass
class WrkRun:
    rps: float
    requests: int
    p50_ms: float | None
    p99_ms: float | None
    errors: int  # socket errors and non-2xx/3xx responses
    cpu_per_request: float  # seconds, the server tree's
    foreign: float  # share of the machine's CPU that neither the server nor wrk used
    busiest: float  # the busiest worker's share of the workers' CPU (0.5: an even split)


def latency_ms(text: str, percentile: str) -> float | None:
    match = re.search(rf"^\s*{percentile}%\s+([\d.]+)(us|ms|s)\b", text, re.M)
    if not match:
        return None
    scale = {"us": 0.001, "ms": 1.0, "s": 1000.0}[match.group(2)]
    return float(match.group(1)) * scale


def wrk(server: Server, connections: int, seconds: int) -> WrkRun:
    argv = ["wrk", "-t2", f"-c{connections}", f"-d{seconds}s", "--latency",
            f"http://127.0.0.1:{server.port}/"]
    cpu_before, busy_before = tree_cpu(server.pid), machine_busy()
    ours_before = resource.getrusage(resource.RUSAGE_CHILDREN)
    began = time.monotonic()
    out = subprocess.run(argv, capture_output=True, text=True, timeout=seconds + WRK_TIMEOUT,
                         check=True).stdout
    wall = time.monotonic() - began
    ours_after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu_after, busy = tree_cpu(server.pid), machine_busy() - busy_before
    used = {pid: cpu_after[pid] - cpu_before.get(pid, 0.0) for pid in cpu_after}
    cpu = sum(used.values())
    workers = [used[pid] for pid in used if pid != server.pid]
    wrk_cpu = (ours_after.ru_utime + ours_after.ru_stime) - (ours_before.ru_utime + ours_before.ru_stime)
    requests = int(re.search(r"(\d+) requests in", out).group(1))  # type: ignore[union-attr]
    rps = float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1))  # type: ignore[union-attr]
    errors = sum(int(n) for n in re.findall(r"(?:connect|read|write|timeout) (\d+)", out))
    non2xx = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
    errors += int(non2xx.group(1)) if non2xx else 0
    cores = os.cpu_count() or 1
    foreign = max(busy - cpu - wrk_cpu, 0.0) / (wall * cores)
    busiest = max(workers) / sum(workers) if workers and sum(workers) > 0 else 1.0
    return WrkRun(rps, requests, latency_ms(out, "50"), latency_ms(out, "99"), errors,
                  cpu / max(requests, 1), foreign, busiest)


def accounting_rows(worker_class: str, connection_counts: list[int], runs: int,
                    seconds: int, micro: float | None) -> list[Row]:
    name = fs_name(worker_class)
    args = ["-k", worker_class] + (["--threads", str(THREADS)] if worker_class == "thread" else [])
    rows: list[Row] = []
    on: Server | None = None
    off: Server | None = None
    try:
        on = Server(*args, app=APP, workers=WORKERS)
        off = Unaccounted(*args)
        on.wait_ready()
        off.wait_ready()
        sides = {"on": on, "off": off}
        for connections in connection_counts:
            progress(f"{name}: accounting on vs. off, wrk -c{connections}, {runs} × {seconds} s each")
            for server in (on, off):
                wrk(server, connections, 1)  # warm-up
            results: dict[str, list[WrkRun]] = {"on": [], "off": []}
            retried = {"on": 0, "off": 0}
            for i in range(runs):
                order = ("on", "off") if i % 2 == 0 else ("off", "on")
                for side in order:
                    tries = [wrk(sides[side], connections, seconds)]
                    while tries[-1].foreign > MAX_FOREIGN and len(tries) <= RETRIES:
                        tries.append(wrk(sides[side], connections, seconds))
                    retried[side] += len(tries) - 1
                    results[side].append(min(tries, key=lambda r: r.foreign))
            smallest = connections == min(connection_counts)
            rows += accounting_figures(name, connections, results, sum(retried.values()),
                                       micro if smallest else None)
    finally:
        for started in (on, off):
            if started is not None:
                started.close()
    return rows


def accounting_figures(name: str, connections: int, results: dict[str, list[WrkRun]],
                       retried: int, micro: float | None) -> list[Row]:
    rps = {side: statistics.median(r.rps for r in runs) for side, runs in results.items()}
    cpu = {side: statistics.median(r.cpu_per_request for r in runs) for side, runs in results.items()}
    # The least CPU a request took in any run: what other processes (cache, scheduling) add
    # only ever makes a run costlier, so the best run is the least disturbed one.
    best = {side: min(r.cpu_per_request for r in runs) for side, runs in results.items()}
    errors = sum(r.errors for runs in results.values() for r in runs)
    foreign = max(r.foreign for runs in results.values() for r in runs)

    def runs_text(side: str) -> str:
        return ", ".join(f"{r.rps:,.0f}" for r in results[side])

    def p99(side: str) -> str:
        values = [r.p99_ms for r in results[side] if r.p99_ms is not None]
        return f"{statistics.median(values):.2f} ms" if values else "?"

    busiest = max(r.busiest for runs in results.values() for r in runs)
    common = (f"{len(results['on'])} runs each, alternating; errors {errors}; "
              f"busiest worker's share of the workers' CPU at most {busiest * 100:.0f} %; "
              f"most foreign CPU in a run {foreign * 100:.0f} %"
              + (f" ({retried} runs retried for foreign CPU over {MAX_FOREIGN * 100:.0f} %)"
                 if retried else ""))
    load = "wrk -t2 -c{} keep-alive".format(connections)
    rps_cost = (rps["off"] - rps["on"]) / rps["off"] * 100
    cpu_cost = (cpu["on"] - cpu["off"]) / cpu["off"] * 100
    best_cost = (best["on"] - best["off"]) / best["off"] * 100
    per_run = {side: ", ".join(f"{r.cpu_per_request * 1e6:.1f}" for r in results[side])
               for side in results}
    rows = [
        row(f"in-flight accounting cost, req/s ({load})", name, round(rps_cost, 1), "%",
            f"< {ACCOUNTING_TARGET:g} %", rps_cost < ACCOUNTING_TARGET and errors == 0,
            f"on {rps['on']:,.0f} req/s ({runs_text('on')}; p99 {p99('on')}), off "
            f"{rps['off']:,.0f} req/s ({runs_text('off')}; p99 {p99('off')}); {common}"),
        row(f"in-flight accounting cost, CPU per request ({load})", name, round(cpu_cost, 1), "%",
            f"< {ACCOUNTING_TARGET:g} %", cpu_cost < ACCOUNTING_TARGET and errors == 0,
            f"server tree (arbiter + workers) on {cpu['on'] * 1e6:.1f} µs, off "
            f"{cpu['off'] * 1e6:.1f} µs per request (medians; runs on {per_run['on']}, off "
            f"{per_run['off']}); {common}"),
        row(f"in-flight accounting cost, best CPU per request ({load})", name, round(best_cost, 1),
            "%", f"< {ACCOUNTING_TARGET:g} %", best_cost < ACCOUNTING_TARGET and errors == 0,
            f"the least CPU per request of any run: on {best['on'] * 1e6:.1f} µs, off "
            f"{best['off'] * 1e6:.1f} µs; {common}"),
    ]
    if micro is not None:
        share = micro / cpu["on"] * 100
        rows.append(row(f"in-flight accounting, micro-benchmark share ({load})", name,
                        round(share, 1), "%", f"< {ACCOUNTING_TARGET:g} %",
                        share < ACCOUNTING_TARGET,
                        f"bench/accounting.py's loop of the accounting's operations: "
                        f"{micro * 1e6:.2f} µs, of the measured {cpu['on'] * 1e6:.1f} µs per request"))
    return rows


def callgrind_rows(worker_class: str, requests: int, tmp: Path) -> list[Row]:
    """Instructions per request, on vs. off, counted by callgrind: one worker each, under
    valgrind, zeroed after a warm-up, dumped after ``requests`` keep-alive requests (hey -c 2).
    A count, not a time: what other processes do to the machine does not change it (what the
    worker does between requests still does: the cost moved by about 2 points between runs)."""
    name = fs_name(worker_class)
    if shutil.which("valgrind") is None or shutil.which("callgrind_control") is None \
            or shutil.which("hey") is None:
        return [row("in-flight accounting cost, instructions per request (callgrind)", name, 0.0,
                    "%", f"< {ACCOUNTING_TARGET:g} %", False, "needs valgrind and hey: not run")]
    progress(f"{name}: accounting on vs. off under callgrind, {requests} requests each")
    args = ["-k", worker_class] + (["--threads", str(THREADS)] if worker_class == "thread" else [])
    servers: dict[str, Server] = {}
    counts: dict[str, float] = {}
    try:
        for side in ("on", "off"):
            prefix = ("valgrind", "--tool=callgrind", "--trace-children=yes",
                      f"--callgrind-out-file={tmp}/{worker_class}-{side}-%p.out")
            servers[side] = Unaccounted(*args, workers=1, accounted=side == "on", prefix=prefix)
        for side, server in servers.items():
            server.wait_ready(CALLGRIND_START)
        for side, server in servers.items():
            url = f"http://127.0.0.1:{server.port}/"
            hey = ["hey", "-c", "2", url]
            subprocess.run(hey[:1] + ["-n", str(max(requests // 5, 50))] + hey[1:],
                           capture_output=True, check=True, timeout=CALLGRIND_START)  # warm-up
            worker = children(server.pid)[0]
            subprocess.run(["callgrind_control", "-z", str(worker)], capture_output=True,
                           check=True, timeout=60)
            out = subprocess.run(hey[:1] + ["-n", str(requests)] + hey[1:], capture_output=True,
                                 text=True, check=True, timeout=CALLGRIND_START).stdout
            subprocess.run(["callgrind_control", "-d", str(worker)], capture_output=True,
                           check=True, timeout=60)
            served = re.search(r"\[200\]\s+(\d+) responses", out)
            if served is None or int(served.group(1)) != requests:
                raise RuntimeError(f"hey: not {requests} 200s:\n{out[-1500:]}")
            # callgrind_control -d asks for the dump; the worker writes it when valgrind next
            # schedules it (seconds later on a loaded machine): wait for it, bounded.
            deadline = time.monotonic() + 60
            while True:
                dumps = sorted(tmp.glob(f"{worker_class}-{side}-{worker}.out.*"))
                text = dumps[-1].read_text(errors="replace") if dumps else ""
                summary = re.search(r"^summary:\s+(\d+)", text, re.M)
                if summary is not None:
                    break
                if time.monotonic() > deadline:
                    raise RuntimeError(f"no callgrind dump of worker {worker} within 60 s")
                time.sleep(0.1)
            counts[side] = int(summary.group(1)) / requests
    finally:
        for server in servers.values():
            server.close()
    cost = (counts["on"] - counts["off"]) / counts["off"] * 100
    return [row("in-flight accounting cost, instructions per request (callgrind)", name,
                round(cost, 1), "%", f"< {ACCOUNTING_TARGET:g} %", cost < ACCOUNTING_TARGET,
                f"1 worker, {requests} keep-alive requests (hey -c 2): on {counts['on']:,.0f}, "
                f"off {counts['off']:,.0f} instructions per request (the worker's; a count, so no "
                f"machine noise, but it moves with what the worker does between requests, "
                f"reconnects and poll wake-ups: about ±2 points from run to run)")]


def micro_seconds(quick: bool) -> float:
    from bench.accounting import accounting_seconds

    return accounting_seconds(50_000 if quick else 200_000)


# -- all of it ----------------------------------------------------------------------------------

def run(args: argparse.Namespace) -> list[Row]:
    classes = split(getattr(args, "lifecycle_classes", ",".join(CLASSES)), CLASSES, "worker class")
    figures = split(getattr(args, "lifecycle_figures", ",".join(FIGURES)), FIGURES, "figure")
    modes = split(getattr(args, "lifecycle_clients", "mix"), CLIENT_MODES, "client mode")
    concurrency = int(getattr(args, "lifecycle_concurrency", DEFAULT_CLIENTS["hello"]))
    gunicorn = bool(getattr(args, "lifecycle_gunicorn", True))
    connection_counts = [int(c) for c in getattr(args, "accounting_connections", "50,2").split(",") if c]
    quick = bool(getattr(args, "quick", False))
    rows: list[Row] = []
    micro = micro_seconds(quick) if "accounting" in figures else None
    with tempfile.TemporaryDirectory(prefix="fslf-", dir="/tmp") as tmp:  # short: unix sockets
        for worker_class in classes:
            if "hup" in figures:
                rows += lifecycle_rows(worker_class, "hup", size(args, "hups"), modes, concurrency,
                                       gunicorn, Path(tmp))
            if "usr2" in figures:
                rows += lifecycle_rows(worker_class, "usr2", size(args, "usr2s"), modes, concurrency,
                                       gunicorn, Path(tmp))
            if "stop" in figures:
                rows += stop_rows(worker_class, size(args, "stop_runs"))
            if "accounting" in figures:
                rows += accounting_rows(worker_class, connection_counts, size(args, "accounting_runs"),
                                        size(args, "accounting_seconds"),
                                        micro if worker_class == "sync" else None)
                if size(args, "callgrind_requests"):
                    try:
                        rows += callgrind_rows(worker_class, size(args, "callgrind_requests"),
                                               Path(tmp))
                    except RuntimeError as exc:  # (the dump did not come: said, not fatal)
                        rows.append(row("in-flight accounting cost, instructions per request "
                                        "(callgrind)", fs_name(worker_class), 0.0, "%",
                                        f"< {ACCOUNTING_TARGET:g} %", False, f"not run: {exc}"))
    return rows


def format_value(r: Row) -> str:
    value = r["value"]
    text = f"{value:,}" if isinstance(value, int) else f"{value:,.1f}"
    return f"{text} {r['unit']}"


def table(rows: list[Row]) -> str:
    figure_width = max([len(r["figure"]) for r in rows] + [6])
    server_width = max([len(r["server"]) for r in rows] + [6])
    lines = [f"{'figure':<{figure_width}}  {'server':<{server_width}}  {'value':>14}  "
             f"{'target':<9}  ok    detail"]
    for r in rows:
        lines.append(f"{r['figure']:<{figure_width}}  {r['server']:<{server_width}}  "
                     f"{format_value(r):>14}  {r['target']:<9}  {'yes' if r['ok'] else 'NO ':<4}  "
                     f"{r['detail']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="\n".join(__doc__.splitlines()[2:]))
    add_arguments(parser)
    parser.add_argument("--json", metavar="FILE", help="also write the rows here")
    args = parser.parse_args(argv)

    def interrupted(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt  # every started process is stopped on the way out
    signal.signal(signal.SIGTERM, interrupted)

    os.chdir(ROOT)
    started = time.monotonic()
    load = os.getloadavg()
    print(f"# life-cycle figures: {WORKERS} workers, {os.cpu_count()} CPUs, python "
          f"{sys.version.split()[0]}, load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}; "
          f"command: bench/lifecycle_figures.py "
          + " ".join(argv if argv is not None else sys.argv[1:]), flush=True)
    rows = run(args)
    load = os.getloadavg()
    print(table(rows))
    print(f"# {len(rows)} rows, {sum(not r['ok'] for r in rows)} missing their target; "
          f"{time.monotonic() - started:.0f} s; load average after {load[0]:.2f} {load[1]:.2f} "
          f"{load[2]:.2f}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")
    missed = [r for r in rows if not r["ok"] and r["server"].startswith("fs-")]
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
