"""What the drain accounting costs on the hot path, as a share of a request's CPU time.

    python bench/accounting.py            # needs Debian's wrk

1. The worker's CPU time per request, measured: one sync worker serves the hello-world app
   under wrk (keep-alive, 2 connections); its utime+stime from /proc before and after,
   divided by the requests served.
2. The accounting's CPU time per request, measured: the exact per-request operations the sync
   worker adds for in-flight accounting and the request context (counter updates, the
   RequestContext, the ContextVar set/reset, the report() checks, running the empty list of
   shutdown functions), timed in a loop with the real classes.

Prints both and the ratio; the target is under 5%.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
import timeit
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from forkserve.context import CURRENT, RequestContext  # noqa: E402
from forkserve.counters import Writer  # noqa: E402
from forkserve.logs import Log  # noqa: E402


def accounting_seconds(n: int = 200_000) -> float:
    read_fd, write_fd = os.pipe()
    counters = Writer(write_fd, 1)
    log = Log("-", "warning")
    running = True

    def report() -> None:
        if not running:
            counters.snapshot()

    def one() -> None:
        counters.active_connections += 1
        counters.in_flight_requests += 1
        context = RequestContext(lambda: None, None, None)
        environ = {}
        environ["forkserve.finish_request"] = context.finish
        token = CURRENT.set(context)
        context.run_shutdown_functions(log)
        CURRENT.reset(token)
        counters.in_flight_requests -= 1
        report()
        counters.active_connections -= 1
        report()

    best = min(timeit.repeat(one, number=n, repeat=5)) / n
    os.close(read_fd)
    os.close(write_fd)
    return best


def worker_cpu_per_request(seconds: int = 5) -> tuple[float, int]:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "forkserve", "-w", "1", "-b", f"127.0.0.1:{port}",
                             "--log-level", "warning", "examples.hello:app"], cwd=ROOT,
                            start_new_session=True)
    try:
        deadline = time.monotonic() + 20
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise SystemExit("forkserve did not start")
                time.sleep(0.05)
        with open(f"/proc/{proc.pid}/task/{proc.pid}/children") as fh:
            worker = int(fh.read().split()[0])
        subprocess.run(["wrk", "-t1", "-c2", "-d1s", f"http://127.0.0.1:{port}/"],
                       capture_output=True, check=True)  # warm-up

        def cpu() -> float:
            with open(f"/proc/{worker}/stat") as fh:
                fields = fh.read().rsplit(")", 1)[1].split()
            return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

        before = cpu()
        out = subprocess.run(["wrk", "-t1", "-c2", f"-d{seconds}s", f"http://127.0.0.1:{port}/"],
                             capture_output=True, text=True, check=True).stdout
        used = cpu() - before
        requests = int(re.search(r"(\d+) requests in", out).group(1))  # type: ignore[union-attr]
        return used / requests, requests
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(30)


def main() -> None:
    accounting = accounting_seconds()
    per_request, requests = worker_cpu_per_request()
    print(f"worker CPU per request:     {per_request * 1e6:7.2f} us  ({requests} requests, 1 sync worker, wrk -c2)")
    print(f"accounting per request:     {accounting * 1e6:7.2f} us")
    print(f"accounting share:           {accounting / per_request * 100:6.2f} %  (target < 5 %)")


if __name__ == "__main__":
    main()
