"""Each atheris fuzz target in fuzz/ runs for a short bounded run (a few seconds, in its own
process, with a timeout) and must end clean: no crash, no traceback in its output.

The long runs are by hand (each target's docstring says how). A run here uses a corpus and
an artifact directory of its own under tmp_path: it must not grow the checkout's. Skipped,
saying why, only where atheris is not installed (``pip install -e '.[test]'`` installs it).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent.parent
# Inputs per target (-runs, with -seed=1): a count, not a time, so that every machine runs
# the same inputs, a slow one included (a few seconds here); the long runs are by hand.
RUNS = 1500
TIMEOUT = 60  # the process's bound, start-up and a loaded machine included


@pytest.mark.parametrize("target", ["fuzz_parser", "fuzz_connection"])
def test_a_short_fuzzing_run_is_clean(target: str, tmp_path: Path) -> None:
    pytest.importorskip("atheris", reason="atheris is not installed (the test extra has it)")
    corpus, artifacts = tmp_path / "corpus", tmp_path / "artifacts"
    corpus.mkdir()
    artifacts.mkdir()
    # Start from the seeds the target itself would use, in a corpus of this run's own.
    seeds = sorted((ROOT / "tests" / "http" / "corpus").glob("*/*.http"))
    for case in seeds:
        (corpus / f"seed-{case.parent.name}-{case.stem}").write_bytes(b"\0\0" + case.read_bytes())
    env = {k: v for k, v in os.environ.items() if k != "FORKSERVE_FUZZ_TOLERATE"}
    argv = [sys.executable, str(ROOT / "fuzz" / f"{target}.py"), f"-runs={RUNS}",
            "-seed=1", "-max_len=4096", f"-artifact_prefix={artifacts}{os.sep}", str(corpus)]
    try:
        run = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, timeout=TIMEOUT,
                             stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"{target} did not end within {TIMEOUT}s: {(exc.stderr or b'')[-3000:]!r}")
    output = (run.stdout + run.stderr).decode("utf-8", "replace")
    assert run.returncode == 0, f"{target} exited {run.returncode}:\n{output[-6000:]}"
    assert "Traceback" not in output, output[-6000:]
    assert "Done " in output, f"{target} never finished a run:\n{output[-3000:]}"
    assert not list(artifacts.iterdir()), f"{target} left crash artifacts: {list(artifacts.iterdir())}"
