"""bench/run.py, the side-by-side benchmark (issue 16), end to end at its smallest size.

Runs the script as a subprocess (forkserve sync and gunicorn sync; hello and json; keep-alive
and close; c=2; 1 s runs, one repetition) with the built-in Python client, and with wrk where
it is installed, and checks the JSON it writes: a row per cell, traffic served, forkserve
without a socket error or a non-2xx response, and the forkserve ÷ gunicorn ratio of each cell.
The figures themselves are not judged: the machine is shared.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SERVERS = ["fs-sync", "gu-sync"]
WORKLOADS = ["hello", "json"]
MODES = ["ka", "close"]

pytest.importorskip("gunicorn")
# Two servers started per workload (and warmed up 1 s), 4 cells × 2 servers of 1 s: ~20-30 s.
pytestmark = pytest.mark.slow


@pytest.mark.parametrize("client", ["python", "wrk"])
def test_bench_run_smallest(tmp_path: Path, client: str) -> None:
    if client == "wrk" and shutil.which("wrk") is None:
        pytest.skip("wrk is not installed")
    out = tmp_path / "out.json"
    markdown = tmp_path / "out.md"
    argv = [sys.executable, str(ROOT / "bench" / "run.py"), "--servers", ",".join(SERVERS),
            "--workloads", ",".join(WORKLOADS), "--conns", "2", "--modes", ",".join(MODES),
            "--duration", "1", "--runs", "1", "--client", client, "--json", str(out),
            "--markdown", str(markdown), "--noise", "100"]  # never repeat a run: figures aside
    proc = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads(out.read_text())

    cells = {(c["server"], c["workload"], c["mode"], c["conns"]): c for c in result["cells"]}
    expected = {(s, w, m, 2) for s in SERVERS for w in WORKLOADS for m in MODES}
    assert set(cells) == expected, proc.stdout
    for key, cell in cells.items():
        assert cell["rps"] > 0, (key, cell)
        assert cell["requests"] > 0, (key, cell)
        if key[0] == "fs-sync":
            assert cell["errors"] == 0, (key, cell["error_kinds"], proc.stdout)
            assert cell["non2xx"] == 0, (key, cell, proc.stdout)
            assert cell["rss_mib"] > 0 and cell["pss_mib"] > 0, (key, cell)
            assert cell["workers"] == 2, (key, cell)

    ratios = {(r["workload"], r["mode"], r["conns"]): r for r in result["ratios"]
              if r["forkserve"] == "fs-sync" and r["peer"] == "gu-sync"}
    assert set(ratios) == {(w, m, 2) for w in WORKLOADS for m in MODES}, result["ratios"]
    for ratio in ratios.values():
        assert ratio["ratio"] > 0, ratio
    assert "forkserve ÷ peer" in proc.stdout
    assert "| server |" in markdown.read_text()
    assert result["machine"]["versions"]["gunicorn"] != "not installed"
