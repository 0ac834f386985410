"""atheris fuzz target: RequestParser over arbitrary bytes, fed in random read splits.

Checks what the property tests check (``tests.http.invariants``): only ``HTTPError`` with a
documented status is raised; the event grammar holds; every request that would reach an app
is fully framed (method, target, version as sent, fields, body length); and the outcome is
the same whole as in the split (and byte by byte for short inputs).

Run it by hand from the repository's root (a run ends at the first crash, or at the limit)::

    .venv/bin/python fuzz/fuzz_parser.py -max_total_time=300     # five minutes
    .venv/bin/python fuzz/fuzz_parser.py -atheris_runs=100000    # a number of inputs
    .venv/bin/python fuzz/fuzz_parser.py fuzz/artifacts/crash-…   # replay one input

The corpus is ``fuzz/corpus/parser/`` (new inputs that reach new code are added to it; it is
not committed), seeded at each start from ``tests/http/corpus``; crashes are written to
``fuzz/artifacts/`` (not committed either). Any libFuzzer option may follow (``-jobs=2``,
``-max_len=…``; the default maximum length here is 4096 bytes). The first two input bytes
choose the limits and the read split; the rest are the request bytes.

To go on past a finding already reported (a fuzzing run stops at its first crash), name it:
``FORKSERVE_FUZZ_TOLERATE="HTTP-name;split changed"`` makes a failed check whose message
holds one of these ``;``-separated texts pass; how many were passed is printed at the end.
Note that atheris sees coverage of the Python code only: llhttp is C, not instrumented.
"""

from __future__ import annotations

import atexit
import os
import sys
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # this checkout's forkserve and tests, not an installed copy

import atheris  # noqa: E402

with atheris.instrument_imports():
    from forkserve.http import Limits  # noqa: E402
    import forkserve.http.parser  # noqa: E402,F401

from tests.http.invariants import check_outcome, parse, same_outcome  # noqa: E402

LIMITS = (Limits(), Limits(request_line=96, fields=8, field_size=80, body=256))
TOLERATED = [t for t in os.environ.get("FORKSERVE_FUZZ_TOLERATE", "").split(";") if t]
PASSED: dict[str, int] = {text: 0 for text in TOLERATED}  # (a run's tally, printed at exit)


def checked(check: Callable[[bytes], None]) -> Callable[[bytes], None]:
    """``check``, with the failures FORKSERVE_FUZZ_TOLERATE names passed (and counted)."""
    if not TOLERATED:
        return check

    def tolerant(raw: bytes) -> None:
        try:
            check(raw)
        except AssertionError as exc:
            text = next((t for t in TOLERATED if t in str(exc)), None)
            if text is None:
                raise
            PASSED[text] += 1
    atexit.register(lambda: print(f"tolerated findings: {PASSED}", file=sys.stderr))
    return tolerant


def pieces_of(data: bytes, seed: int) -> list[bytes]:
    """``data`` cut where the seed says: every ``seed % 7 + 1`` bytes, shifted by the rest."""
    step = seed % 7 + 1
    first = (seed >> 3) % (len(data) + 1)
    cuts = [0, *range(first, len(data), step), len(data)]
    return [data[a:b] for a, b in zip(cuts, cuts[1:]) if b > a]


def test_one_input(raw: bytes) -> None:
    if len(raw) < 2:
        return
    limits = LIMITS[raw[0] & 1]
    data = raw[2:]
    whole = parse([data], limits)
    check_outcome(whole, data, limits)
    split = parse(pieces_of(data, raw[1]), limits)
    assert same_outcome(whole, split), f"the split changed the outcome:\n  whole {whole}\n  split {split}"
    if len(data) <= 256:
        single = parse([data[i:i + 1] for i in range(len(data))], limits)
        assert same_outcome(whole, single), f"byte by byte changed the outcome:\n  whole {whole}\n  bytes {single}"


def seed_corpus(corpus: Path) -> None:
    """The HTTP corpus's cases as starting inputs (two leading bytes: the limits, the split)."""
    corpus.mkdir(parents=True, exist_ok=True)
    for case in sorted((ROOT / "tests" / "http" / "corpus").glob("*/*.http")):
        target = corpus / f"seed-{case.parent.name}-{case.stem}"
        if not target.exists():
            target.write_bytes(b"\x00\x00" + case.read_bytes())


def main(argv: list[str], target: str = "parser",
         one_input: Callable[[bytes], None] = test_one_input) -> None:
    """Fuzz ``one_input`` (or replay the files given) with the corpus of ``target``."""
    args = argv[1:]
    inputs = [a for a in args if not a.startswith("-")]
    if not inputs:  # a fuzzing run, not a replay of given files
        corpus = ROOT / "fuzz" / "corpus" / target
        seed_corpus(corpus)
        artifacts = ROOT / "fuzz" / "artifacts"
        artifacts.mkdir(exist_ok=True)
        args = [f"-artifact_prefix={artifacts}{os.sep}", "-max_len=4096", *args, str(corpus)]
    atheris.Setup([argv[0], *args], checked(one_input))
    atheris.Fuzz()


if __name__ == "__main__":
    main(sys.argv)
