"""``forkserve status``: a compact table of a running arbiter and its workers.

Owns: fetching one status snapshot (from the control socket, or from the status server's
``/status``), rendering it as a table, and ``--watch`` (redraw every second until the server is
gone: handy to watch a drain happen). Like ``pumactl stats`` or ``uwsgitop``.

Imports only the standard library and :mod:`forkserve.control`'s client.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import urllib.error
import urllib.request
from typing import Any, Sequence

from forkserve.control import ControlError, request


class Unreachable(Exception):
    """The server could not be asked. ``gone``: nothing listens there (refused, no socket
    file); otherwise it may be alive but slow (a timeout, a dropped connection)."""

    def __init__(self, message: str, gone: bool) -> None:
        super().__init__(message)
        self.gone = gone


GONE = (ConnectionRefusedError, FileNotFoundError)


def fetch(control_socket: str | None, url: str | None, timeout: float = 5.0) -> dict[str, Any]:
    if control_socket:
        try:
            answer, fds = request(control_socket, "status", timeout)
        except (OSError, ControlError) as exc:
            raise Unreachable(f"cannot talk to {control_socket}: {exc}",
                              isinstance(exc, GONE)) from None
        for fd in fds:
            os.close(fd)
        return answer
    assert url is not None
    base = url.rstrip("/")
    target = base if base.endswith("/status") else base + "/status"
    try:
        with urllib.request.urlopen(target, timeout=timeout) as response:
            return dict(json.loads(response.read().decode()))
    except (OSError, ValueError) as exc:
        reason = getattr(exc, "reason", exc)
        raise Unreachable(f"cannot get {target}: {reason}", isinstance(reason, GONE)) from None


def _duration(seconds: float) -> str:
    seconds = max(int(seconds), 0)
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    if seconds < 86400:
        return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
    return f"{seconds // 86400}d{seconds % 86400 // 3600:02d}h"


def _bytes(count: int) -> str:
    size = float(count)
    for unit in ("B", "K", "M", "G"):
        if size < 1024 or unit == "G":
            return f"{size:.0f}{unit}" if unit == "B" else f"{size:.1f}{unit}"
        size /= 1024
    return f"{size:.1f}G"


GONE_AFTER = 1.0  # seconds a server must stay unreachable to count as stopped

COLUMNS = ("PID", "WORKER", "GEN", "STATE", "AGE", "REQUESTS", "IN FLIGHT", "CONNS", "BG", "RSS",
           "HEARTBEAT")


def render(snapshot: dict[str, Any]) -> str:
    """The table, as text (a header line for the arbiter, then one row per worker)."""
    ready = "ready" if snapshot.get("ready") else "not ready"
    lines = [
        f"forkserve {snapshot.get('version', '?')}  pid {snapshot.get('pid')}  "
        f"{snapshot.get('state')} ({ready})  generation {snapshot.get('generation')}  "
        f"up {_duration(snapshot.get('uptime', 0))}  {snapshot.get('worker_class', '')} workers "
        f"{len(snapshot.get('workers', []))}",
        f"in flight {snapshot.get('in_flight_requests', 0)}  connections "
        f"{snapshot.get('active_connections', 0)}  background "
        f"{snapshot.get('background_tasks', 0)}" + ("  PAUSED" if snapshot.get("paused") else ""),
        "",
    ]
    rows = [COLUMNS]
    for w in snapshot.get("workers", []):
        rows.append((str(w["pid"]), str(w["worker_id"]), str(w["generation"]),
                     w.get("state", "running" if w.get("booted") else "booting"),
                     _duration(w.get("age", 0)), str(w.get("requests_served", 0)),
                     str(w.get("in_flight_requests", 0)), str(w.get("active_connections", 0)),
                     str(w.get("background_tasks", 0)), _bytes(w.get("rss_bytes", 0)),
                     f"{w.get('seconds_since_heartbeat', 0):.1f}s"))
    widths = [max(len(row[i]) for row in rows) for i in range(len(COLUMNS))]
    for row in rows:
        lines.append("  ".join(cell.ljust(width) if i < 4 else cell.rjust(width)
                               for i, (cell, width) in enumerate(zip(row, widths))).rstrip())
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="forkserve status",
        description="Show a running forkserve's arbiter and workers.")
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--control-socket", metavar="PATH", help="the server's --control-socket")
    where.add_argument("--url", metavar="URL",
                       help="the server's status server, e.g. http://127.0.0.1:9100")
    parser.add_argument("--watch", action="store_true",
                        help="redraw every --interval seconds until the server is gone (Ctrl-C "
                             "stops watching)")
    parser.add_argument("--interval", type=float, default=1.0, metavar="SECONDS",
                        help="seconds between redraws with --watch [default: 1]")
    parser.add_argument("--json", action="store_true", help="print the raw snapshot as JSON")
    try:
        args = parser.parse_args(list(argv))
    except SystemExit as exc:
        return 2 if exc.code else 0
    if args.interval <= 0:
        sys.stderr.write("forkserve status: --interval must be more than 0\n")
        return 2
    out = sys.stdout
    clear = "\x1b[H\x1b[2J" if out.isatty() else ""
    seen = False
    gone_since: float | None = None
    try:
        while True:
            try:
                snapshot = fetch(args.control_socket, args.url)
            except Unreachable as exc:
                if not seen:
                    sys.stderr.write(f"forkserve status: {exc}\n")
                    return 1
                if exc.gone:
                    # Gone for good, or re-executing in place (USR2 re-creates the control
                    # socket): only a server absent for GONE_AFTER has stopped.
                    now = time.monotonic()
                    gone_since = now if gone_since is None else gone_since
                    if now - gone_since >= GONE_AFTER:
                        out.write("forkserve has stopped\n")
                        out.flush()
                        return 0
                    time.sleep(min(args.interval, 0.1))
                    continue
                # Alive but not answering (stopped, swamped): say so and keep watching.
                out.write(clear + time.strftime("%H:%M:%S  ") + f"no answer: {exc}\n"
                          + ("" if clear else "\n"))
                out.flush()
                time.sleep(args.interval)
                continue
            seen = True
            gone_since = None
            text = json.dumps(snapshot, indent=2) + "\n" if args.json else render(snapshot)
            if args.watch:
                text = clear + time.strftime("%H:%M:%S  ") + text + ("" if clear else "\n")
            out.write(text)
            out.flush()
            if not args.watch:
                return 0
            time.sleep(args.interval)  # the refresh period itself, not a wait for an event
    except KeyboardInterrupt:
        return 0
    except BrokenPipeError:
        # `forkserve status --watch | head`: the reader left; nothing more to say.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
