"""How much of an application's memory the workers share: gc.freeze on and off.

    python bench/memory.py [-w WORKERS] [--heap-mb MB] [--requests N]
    python bench/memory.py --no-preload [-k sync|thread|gevent] [--heap-mb MB]

Starts each server with ``--preload`` and WORKERS sync workers on ``bench.apps_memory:app``
(about MB of ordinary Python objects built at import, and Flask imported), one after the
other on this machine:

    forkserve                  gc.collect(); gc.freeze() before forking (the default)
    forkserve --no-gc-freeze   the same without it
    gunicorn --preload         for comparison (it does not freeze)

Each worker is warmed with N requests (fresh connections, until every worker has served
N), then its memory is read from /proc/PID/smaps_rollup: RSS, PSS (its proportional share of
the pages it shares) and USS (Private_Clean + Private_Dirty: what it alone holds, what its
exit would free). Then every worker runs one full ``gc.collect()`` (``/collect``), as a
long-lived worker eventually does by itself, and is read again. Printed: the mean per worker
in MB, and the sum of PSS over the arbiter and its workers (the memory the whole server
really costs).

``--no-preload`` (the default configuration of both servers): each worker imports the app
itself, so what is shared is what the arbiter had before forking (the server's own code and
configuration, and gevent with ``-k gevent``); a worker freezes what it inherited (the
default) or, with ``--no-gc-freeze``, leaves it to its collector. gunicorn runs without
``--preload`` too, with the matching worker class.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import sys
from importlib.metadata import version
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tests.harness import Server, children, get, wait_for  # noqa: E402

from bench.lifecycle_servers import Gunicorn  # noqa: E402

APP = "bench.apps_memory:app"
FIELDS = ("Rss", "Pss", "Private_Clean", "Private_Dirty")


def smaps_rollup(pid: int) -> dict[str, int]:
    """The kB fields of /proc/PID/smaps_rollup."""
    values: dict[str, int] = {}
    with open(f"/proc/{pid}/smaps_rollup", encoding="ascii") as fh:
        for line in fh:
            name, _, rest = line.partition(":")
            parts = rest.split()
            if len(parts) == 2 and parts[1] == "kB":
                values[name] = int(parts[0])
    return values


GUNICORN_CLASS = {"sync": "sync", "thread": "gthread", "gevent": "gevent"}
THREADS = ("--threads", "4")


class PlainGunicorn(Gunicorn):
    def __init__(self, workers: int, env: dict[str, str], worker_class: str,
                 preload: bool) -> None:
        script = Path(sys.executable).parent / "gunicorn"
        kind = GUNICORN_CLASS[worker_class]
        argv = [str(script) if script.exists() else "gunicorn", "-b", "127.0.0.1:0",
                "-w", str(workers), "-k", kind, *(THREADS if kind == "gthread" else ()),
                "--no-control-socket", *(("--preload",) if preload else ()), APP]
        self._launch(argv, dict(os.environ), env, ROOT, ())


def start(gunicorn: bool, freeze: bool, workers: int, heap_mb: float, worker_class: str,
          preload: bool) -> Server:
    env = {"BENCH_HEAP_MB": str(heap_mb)}
    if gunicorn:
        server: Server = PlainGunicorn(workers, env, worker_class, preload)
        server.wait_text("Booting worker", 120)
    else:
        extra = () if freeze else ("--no-gc-freeze",)
        server = Server(*(("--preload",) if preload else ()), *extra, "-k", worker_class,
                        *(THREADS if worker_class == "thread" else ()), app=APP,
                        workers=workers, env=env)
        server.wait_ready(120)
    wait_for(lambda: len(children(server.pid)) == workers, 120, f"{workers} workers")
    return server


def hit_every_worker(server: Server, path: str, times: int, workers: set[int]) -> None:
    """Requests on fresh connections until each worker has answered ``times`` of them."""
    served = dict.fromkeys(workers, 0)

    def one() -> bool:
        try:
            pid = int(get(server.port, path).body)
        except (OSError, ValueError):
            return False  # (a worker still booting its listener: ask again)
        served[pid] = served.get(pid, 0) + 1
        return min(served[p] for p in workers) >= times

    wait_for(one, 600, lambda: f"{times} answers of {path} from each worker, have {served}",
             interval=0)


def measure(server: Server, workers: set[int]) -> dict[str, float]:
    rows = [smaps_rollup(pid) for pid in sorted(workers)]
    arbiter = smaps_rollup(server.pid)
    n = len(rows)
    mb = 1024.0
    return {
        "rss": sum(r["Rss"] for r in rows) / n / mb,
        "pss": sum(r["Pss"] for r in rows) / n / mb,
        "uss": sum(r["Private_Clean"] + r["Private_Dirty"] for r in rows) / n / mb,
        "total_pss": (sum(r["Pss"] for r in rows) + arbiter["Pss"]) / mb,
    }


def run(gunicorn: bool, freeze: bool, workers: int, heap_mb: float, requests: int,
        worker_class: str, preload: bool) -> dict[str, dict[str, float]]:
    server = start(gunicorn, freeze, workers, heap_mb, worker_class, preload)
    try:
        pids = set(children(server.pid))
        hit_every_worker(server, "/", requests, pids)
        warm = measure(server, pids)
        hit_every_worker(server, "/collect", 1, pids)
        collected = measure(server, pids)
        assert set(children(server.pid)) == pids, "a worker was replaced during the run"
        return {"warm": warm, "collected": collected}
    finally:
        try:
            os.kill(server.pid, signal.SIGTERM)
            server.proc.wait(30)
        except (ProcessLookupError, OSError):
            pass
        server.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-w", "--workers", type=int, default=4)
    parser.add_argument("--heap-mb", type=float, default=100.0)
    parser.add_argument("--requests", type=int, default=200, help="per worker, to warm it")
    parser.add_argument("-k", "--worker-class", choices=sorted(GUNICORN_CLASS), default="sync")
    parser.add_argument("--no-preload", dest="preload", action="store_false",
                        help="each worker imports the app (both servers' default)")
    args = parser.parse_args()
    if args.preload and args.worker_class == "gevent":
        parser.error("forkserve refuses --preload with -k gevent: add --no-preload")
    preload = " --preload" if args.preload else ""
    # (the row's label, gunicorn?, forkserve's freeze on?)
    kinds = ((f"forkserve{preload}", False, True),
             (f"forkserve{preload} --no-gc-freeze", False, False),
             (f"gunicorn {version('gunicorn')}{preload} -k {GUNICORN_CLASS[args.worker_class]}",
              True, True))
    results = {label: run(gunicorn, freeze, args.workers, args.heap_mb, args.requests,
                          args.worker_class, args.preload)
               for label, gunicorn, freeze in kinds}
    print(f"\n{args.workers} {args.worker_class} workers,{preload or ' no --preload'}, "
          f"~{args.heap_mb:g} MB heap built at import; "
          f"mean per worker in MB, and the PSS of arbiter + workers")
    print("| server | phase | RSS | PSS | USS | total PSS |\n|---|---|---|---|---|---|")
    for kind, phases in results.items():
        for phase, label in (("warm", f"after {args.requests} requests each"),
                             ("collected", "after a full gc.collect() in each")):
            m = phases[phase]
            print(f"| {kind} | {label} | {m['rss']:.1f} | {m['pss']:.1f} | {m['uss']:.1f} | "
                  f"{m['total_pss']:.1f} |")
    return 0


if __name__ == "__main__":
    socket.setdefaulttimeout(30)
    sys.exit(main())
