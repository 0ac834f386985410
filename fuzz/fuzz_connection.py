"""atheris fuzz target: a connection through the workers' request pipeline, over a socketpair.

Each input is what one client sends on one connection, in planned reads, before it
half-closes. It is served by ``tests.http.served.InProcess``: the ``Pipeline`` every worker
class shares (``Connection`` reading heads and bodies, refusals, the app's run, keep-alive
and lingering closes), in this process so that the fuzzer sees its coverage and a
traceback as it happens, running ``tests.apps.digest`` behind wsgiref's validator. What it
answered is held to ``tests.http.invariants``: well-formed responses, each request's digest
in order, the parser's refusal status, no body for HEAD, then the close; and nothing may be
logged at error level (an exception in forkserve or the app is a crash here).

The worker classes differ only in how they wait (a poll loop, threads, greenlets); what they
do with the bytes is this pipeline. ``tests/integration/test_request_properties.py`` sends
the same kind of input to real servers of each class.

Run it by hand from the repository's root::

    .venv/bin/python fuzz/fuzz_connection.py -max_total_time=300
    .venv/bin/python fuzz/fuzz_connection.py -atheris_runs=20000
    .venv/bin/python fuzz/fuzz_connection.py fuzz/artifacts/crash-…   # replay one input

Corpus: ``fuzz/corpus/connection/``, seeded at each start from ``tests/http/corpus``;
crashes: ``fuzz/artifacts/`` (neither is committed). The first two input bytes choose the
limits and the read split (as in ``fuzz_parser.py``); ``FORKSERVE_FUZZ_TOLERATE`` works
as it does there.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # this checkout's forkserve and tests, not an installed copy

import atheris  # noqa: E402

with atheris.instrument_imports():
    import forkserve.http.parser  # noqa: E402,F401
    import forkserve.http.response  # noqa: E402,F401
    import forkserve.workers.connection  # noqa: E402,F401
    import forkserve.workers.pipeline  # noqa: E402,F401
    import forkserve.wsgi  # noqa: E402,F401

import fuzz_parser  # noqa: E402
from fuzz_parser import LIMITS, pieces_of  # noqa: E402
from tests.apps.digest import app  # noqa: E402
from tests.http.invariants import check_answers, expected_answers  # noqa: E402
from tests.http.served import InProcess  # noqa: E402

WORKERS = [InProcess.start(app, limits) for limits in LIMITS]


def test_one_input(raw: bytes) -> None:
    if len(raw) < 2:
        return
    index = raw[0] & 1
    data = raw[2:]
    worker = WORKERS[index]
    answered = worker.answer(pieces_of(data, raw[1]))
    errors, worker.errors[:] = list(worker.errors), []
    assert not errors, f"logged at error level: {errors}"
    check_answers(expected_answers(data, LIMITS[index]), answered)


if __name__ == "__main__":
    fuzz_parser.main(sys.argv, "connection", test_one_input)
