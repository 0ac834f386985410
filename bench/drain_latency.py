"""How long a stop takes: TERM to exit for an idle server, and last response to exit.

    python bench/drain_latency.py [-n RUNS] [-w WORKERS]

1. idle: a ready server with nothing in flight gets TERM; time until the process has exited.
2. tail: a request is held in the app (on a FIFO), TERM is sent, the request is released;
   time from the client having the whole response to the process having exited.
Prints the median and the worst of each over the runs.
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

from tests.harness import Gate, Server, read_response, send_get  # noqa: E402


def idle_stop(workers: int) -> float:
    server = Server(workers=workers).wait_ready()
    try:
        start = time.monotonic()
        server.signal(signal.SIGTERM)
        server.proc.wait(30)
        return time.monotonic() - start
    finally:
        server.close()


def tail_stop(workers: int) -> float:
    server = Server(workers=workers).wait_ready()
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
            server.proc.wait(30)
            return time.monotonic() - done
    finally:
        server.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-n", "--runs", type=int, default=10)
    parser.add_argument("-w", "--workers", type=int, default=2)
    args = parser.parse_args()
    os.chdir(ROOT)
    for name, fn in (("TERM to exit, idle", idle_stop), ("last response to exit", tail_stop)):
        samples = [fn(args.workers) for _ in range(args.runs)]
        print(f"{name:24} median {statistics.median(samples) * 1000:7.1f} ms   "
              f"worst {max(samples) * 1000:7.1f} ms   ({args.runs} runs, {args.workers} workers)")


if __name__ == "__main__":
    main()
