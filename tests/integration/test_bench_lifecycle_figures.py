"""bench/lifecycle_figures.py (issue 16) at its smallest size, and bench/unaccounted.py's patch.

The figures run as the bench runs them, in a subprocess (its servers are process groups of
their own; a TERM makes it stop them all): the sync class only, 2 HUPs, 1 USR2, one stop of
each kind, one wrk run of 1 s on each side of the accounting (callgrind's count is left out:
it takes minutes under valgrind). The values are checked for being there and sane, not for
the issue's targets (a loaded machine misses a 20 ms bound without the server being at
fault), except that forkserve must lose no request.
"""

from __future__ import annotations

import json
import math
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.harness import ROOT

RUN_TIMEOUT = 240.0
KEYS = {"figure", "server", "value", "unit", "target", "ok", "detail"}


def run_figures(tmp_path: Path, *args: str) -> tuple[int, list[dict], str]:
    out = tmp_path / "rows.json"
    proc = subprocess.Popen([sys.executable, str(ROOT / "bench" / "lifecycle_figures.py"), *args,
                             "--json", str(out)], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        output, _ = proc.communicate(timeout=RUN_TIMEOUT)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGTERM)  # it stops every server it started
        try:
            output, _ = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            output, _ = proc.communicate()
        pytest.fail(f"bench/lifecycle_figures.py ran over {RUN_TIMEOUT:.0f}s:\n{output[-3000:]}")
    assert out.exists(), output[-3000:]
    return proc.returncode, json.loads(out.read_text()), output


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("wrk") is None, reason="needs Debian's wrk")
def test_smallest_run_has_every_figure(tmp_path: Path) -> None:
    code, rows, output = run_figures(
        tmp_path, "--quick", "--lifecycle-classes", "sync", "--hups", "2", "--usr2s", "1",
        "--stop-runs", "1", "--accounting-seconds", "1", "--accounting-runs", "1",
        "--accounting-connections", "50", "--callgrind-requests", "0", "--no-lifecycle-gunicorn")
    assert code in (0, 1), output[-3000:]  # 1: a target missed (the machine may be loaded)
    for row in rows:
        assert set(row) == KEYS, row
        assert row["server"] == "fs-sync", row
        assert isinstance(row["value"], (int, float)) and math.isfinite(row["value"]), row
        assert isinstance(row["ok"], bool), row
    by_figure = {row["figure"]: row for row in rows}
    assert set(by_figure) == {
        "failed requests over 2 HUPs under load (keep-alive + close clients)",
        "failed requests over 1 USR2s under load (keep-alive + close clients)",
        "TERM → exit, idle server (median of 1)", "TERM → exit, idle server (worst of 1)",
        "last in-flight response → exit (median of 1)", "last in-flight response → exit (worst of 1)",
        "in-flight accounting cost, req/s (wrk -t2 -c50 keep-alive)",
        "in-flight accounting cost, CPU per request (wrk -t2 -c50 keep-alive)",
        "in-flight accounting cost, best CPU per request (wrk -t2 -c50 keep-alive)",
        "in-flight accounting, micro-benchmark share (wrk -t2 -c50 keep-alive)",
    }, output[-3000:]
    for event in ("2 HUPs", "1 USR2s"):
        row = by_figure[f"failed requests over {event} under load (keep-alive + close clients)"]
        assert row["value"] == 0 and row["ok"], row
        assert " 0 ok" not in row["detail"], row  # requests were served meanwhile
    for figure in ("TERM → exit, idle server", "last in-flight response → exit"):
        row = by_figure[f"{figure} (worst of 1)"]
        assert row["unit"] == "ms" and 0 < row["value"] < 2000, row
    for figure in ("req/s", "CPU per request", "best CPU per request"):
        row = by_figure[f"in-flight accounting cost, {figure} (wrk -t2 -c50 keep-alive)"]
        assert row["unit"] == "%" and -100 < row["value"] < 100, row
        assert "errors 0" in row["detail"], row
    assert "fs-sync" in output and "figure" in output  # the table was printed


def test_unaccounted_takes_the_accounting_out() -> None:
    """In a fresh interpreter (the patch changes the Pipeline class): the statements are gone
    from the recompiled functions, the rest of serve_request is still there."""
    check = """
from bench.unaccounted import patch
from forkserve.workers.pipeline import Pipeline
before = set(Pipeline.serve_request.__code__.co_names)
patch()
after = set(Pipeline.serve_request.__code__.co_names)
assert {"in_flight_requests", "set_current", "reset_current", "RequestContext",
         "run_shutdown_functions", "report"} <= before
assert not after & {"in_flight_requests", "set_current", "reset_current", "RequestContext",
         "run_shutdown_functions", "report"}, after
assert {"_run_app", "build_environ", "request_done", "_NO_CONTEXT"} <= after, after
assert "report" not in Pipeline.release.__code__.co_names
assert "active_connections" in Pipeline.release.__code__.co_names  # admission reads it: kept
print("patched")
"""
    result = subprocess.run([sys.executable, "-c", check], cwd=ROOT, capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 0 and "patched" in result.stdout, result.stderr
