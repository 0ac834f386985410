"""How long a stop takes: TERM to exit for an idle server, and last response to exit.

    python bench/drain_latency.py [-n RUNS] [-w WORKERS] [-k sync|thread|gevent]

1. idle: a ready server with nothing in flight gets TERM; time until the process has exited.
2. tail: a request is held in the app (on a FIFO), TERM is sent, the request is released;
   time from the client having the whole response to the process having exited.
Prints the median and the worst of each over the runs.

The exit is seen through a pidfd (``bench.lifecycle_servers.wait_exit``), which wakes the moment
the arbiter exits: ``Popen.wait(timeout)`` polls with sleeps of up to 50 ms on this Python, which
would add up to that much to a figure whose target is 20 ms.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.lifecycle_servers import THREADS, wait_exit  # noqa: E402
from tests.harness import Gate, Server, read_response, send_get  # noqa: E402

EXIT_TIMEOUT = 30.0


def start(workers: int, worker_class: str) -> Server:
    args = ["-k", worker_class] + (["--threads", str(THREADS)] if worker_class == "thread" else [])
    return Server(*args, workers=workers).wait_ready()


def exited_after(server: Server, since: float) -> float:
    """Seconds from ``since`` to the arbiter's exit (it must exit within EXIT_TIMEOUT)."""
    exited = wait_exit(server.pid, EXIT_TIMEOUT)
    if exited is None:
        raise RuntimeError(f"forkserve did not exit within {EXIT_TIMEOUT:.0f}s of TERM")
    server.proc.wait(5)  # reaped (it has exited: no wait)
    return exited - since


def idle_stop(workers: int, worker_class: str = "sync") -> float:
    server = start(workers, worker_class)
    try:
        start_at = time.monotonic()
        server.signal(signal.SIGTERM)
        return exited_after(server, start_at)
    finally:
        server.close()


def tail_stop(workers: int, worker_class: str = "sync") -> float:
    server = start(workers, worker_class)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            gate = Gate(Path(tmp) / "gate")
            sock = send_get(server.port, gate.route)
            gate.wait_entered()
            server.signal(signal.SIGTERM)
            server.wait_log("Received shutdown signal")
            gate.release()
            response = read_response(sock)
            done = time.monotonic()
            sock.close()
            assert response.status == 200
            return exited_after(server, done)
    finally:
        server.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-n", "--runs", type=int, default=10)
    parser.add_argument("-w", "--workers", type=int, default=2)
    parser.add_argument("-k", "--worker-class", default="sync", choices=["sync", "thread", "gevent"])
    args = parser.parse_args()
    os.chdir(ROOT)
    for name, fn in (("TERM to exit, idle", idle_stop), ("last response to exit", tail_stop)):
        samples = [fn(args.workers, args.worker_class) for _ in range(args.runs)]
        print(f"{name:24} median {statistics.median(samples) * 1000:7.1f} ms   "
              f"worst {max(samples) * 1000:7.1f} ms   ({args.runs} runs, {args.workers} "
              f"{args.worker_class} workers)")


if __name__ == "__main__":
    main()
