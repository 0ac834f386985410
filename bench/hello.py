"""Hello-world throughput and latency: forkserve (and, if installed, gunicorn) under wrk.

    python bench/hello.py                       # forkserve, 2 workers, c=2 and c=100
    python bench/hello.py --server gunicorn     # the same for gunicorn's sync worker
    python bench/hello.py -c 2 -c 50 -d 10
    python bench/hello.py --with=--status-bind=127.0.0.1:0   # forkserve with metrics on

Needs Debian's ``wrk``. Both servers get the same app (examples/hello.py), worker count and
client load; wrk shares the machine's cores with the server, as in the brief's figures.
Prints one line per run: server, connections, requests/s, p50, p99, socket errors.
Non-2xx responses or socket errors are reported, never hidden.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    # Benchmarks may pick a port this way; tests never do (they bind port 0 in the server).
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start(server: str, port: int, workers: int, extra: list[str]) -> subprocess.Popen[bytes]:
    if server == "forkserve":
        argv = [sys.executable, "-m", "forkserve", "-b", f"127.0.0.1:{port}", "-w", str(workers),
                "--log-level", "warning", "examples.hello:app"]
    elif server == "forkserve-thread":
        argv = [sys.executable, "-m", "forkserve", "-k", "thread", "--threads", "4", "-b",
                f"127.0.0.1:{port}", "-w", str(workers), "--log-level", "warning",
                "examples.hello:app"]
    elif server == "gunicorn-thread":
        argv = [sys.executable, "-m", "gunicorn", "-k", "gthread", "--threads", "4", "-b",
                f"127.0.0.1:{port}", "-w", str(workers), "--log-level", "warning",
                "examples.hello:app"]
    elif server == "forkserve-gevent":
        argv = [sys.executable, "-m", "forkserve", "-k", "gevent", "-b", f"127.0.0.1:{port}",
                "-w", str(workers), "--log-level", "warning", "examples.hello:app"]
    elif server == "gunicorn":
        argv = [sys.executable, "-m", "gunicorn", "-b", f"127.0.0.1:{port}", "-w", str(workers),
                "--log-level", "warning", "examples.hello:app"]
    elif server == "gunicorn-gevent":
        argv = [sys.executable, "-m", "gunicorn", "-k", "gevent", "-b", f"127.0.0.1:{port}",
                "-w", str(workers), "--log-level", "warning", "examples.hello:app"]
    else:
        raise SystemExit(f"unknown server {server}")
    argv[-1:-1] = extra  # before the app
    proc = subprocess.Popen(argv, cwd=ROOT, start_new_session=True)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return proc
        except OSError:
            time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)
    raise SystemExit(f"{server} did not start")


def wrk(port: int, connections: int, seconds: int) -> dict[str, str]:
    out = subprocess.run(["wrk", "-t2", f"-c{connections}", f"-d{seconds}s", "--latency",
                          f"http://127.0.0.1:{port}/"], capture_output=True, text=True, check=True).stdout
    result = {"rps": re.search(r"Requests/sec:\s+([\d.]+)", out).group(1)}  # type: ignore[union-attr]
    for pct in ("50", "99"):
        match = re.search(rf"\s{pct}%\s+([\d.]+\w+)", out)
        result[f"p{pct}"] = match.group(1) if match else "?"
    errors = re.search(r"Socket errors: (.*)", out)
    result["errors"] = errors.group(1) if errors else "none"
    non2xx = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
    result["non2xx"] = non2xx.group(1) if non2xx else "0"
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--server", default="forkserve",
                        choices=["forkserve", "forkserve-thread", "forkserve-gevent", "gunicorn",
                                 "gunicorn-thread", "gunicorn-gevent"])
    parser.add_argument("-w", "--workers", type=int, default=2)
    parser.add_argument("-c", "--connections", type=int, action="append")
    parser.add_argument("-d", "--duration", type=int, default=10)
    parser.add_argument("--with", dest="extra", action="append", default=[], metavar="ARG",
                        help="one more argument for the server (repeatable), e.g. "
                             "--with=--status-bind=127.0.0.1:0 --with=--access-log=/dev/null")
    args = parser.parse_args()
    if shutil.which("wrk") is None:
        raise SystemExit("wrk is not installed (apt-get install wrk)")
    port = free_port()
    proc = start(args.server, port, args.workers, args.extra)
    try:
        wrk(port, 2, 1)  # warm-up
        for connections in args.connections or [2, 100]:
            r = wrk(port, connections, args.duration)
            print(f"{args.server:16} {' '.join(args.extra)} workers={args.workers} c={connections:<4} "
                  f"req/s={float(r['rps']):>10,.0f} p50={r['p50']:>8} p99={r['p99']:>8} "
                  f"non2xx={r['non2xx']} socket-errors: {r['errors']}", flush=True)
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(30)


if __name__ == "__main__":
    main()
