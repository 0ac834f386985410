"""Property tests of the request path, in this process: ``RequestParser`` over arbitrary bytes
and over structured-but-mutated requests (``tests.http.strategies``), each fed in random read
splits, and the workers' shared pipeline over a socketpair (``tests.http.served``).

What must hold, whatever the input (the oracle is ``tests.http.invariants``):

* the parser raises nothing but ``HTTPError``, with a documented refusal status, and its
  event grammar holds (a head, body data, END; a refusal only behind complete requests);
* a request that would reach the app is fully framed: a token method, a valid target (a
  lone ``*`` only for OPTIONS), HTTP/1.0 or 1.1 *as sent*, fields within the limits and free
  of control characters, a body exactly as long as its framing says;
* well-formed requests parse to exactly what was built;
* the outcome (the requests parsed, the refusal status, what of an unfinished request is
  queued) does not depend on how the bytes are split into reads;
* a connection answers exactly what the oracle expects: each request's digest in order,
  refusals as the parser refused, HEAD without a body, then a clean close; nothing is
  logged at error level.

Never hangs: inputs are small, each example has a deadline, and every socket wait a timeout.
The run is derandomized (the same examples every run, no example database);
``FORKSERVE_HYPOTHESIS_EXAMPLES`` raises the number of examples (default 200 a property).
"""

from __future__ import annotations

import os
from typing import Callable, Iterator

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from forkserve.http import Limits
from tests.apps.digest import app as digest_app
from tests.http.invariants import (check_answers, check_outcome, expected_answers, keeps_alive,
                                   parse, same_outcome)
from tests.http.served import InProcess
from tests.http.strategies import (LIMITS, SMALL_LIMITS, good_pipelines, mutated, pipelines,
                                   splits)

EXAMPLES = int(os.environ.get("FORKSERVE_HYPOTHESIS_EXAMPLES", "200"))
PROPERTIES = settings(max_examples=EXAMPLES, derandomize=True, database=None,
                      deadline=5000,  # ms an example may take on a loaded machine
                      suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@st.composite
def inputs(draw: st.DrawFn) -> tuple[bytes, list[bytes]]:
    """Bytes to feed, and the bytes of each request built (empty for arbitrary bytes)."""
    kind = draw(st.sampled_from(["raw", "structured", "mutated"]))
    if kind == "raw":
        return draw(st.binary(max_size=300)), []
    built = draw(pipelines)
    data = b"".join(b.data for b in built)
    if kind == "mutated":
        return draw(mutated(data)), []
    return data, [b.data for b in built]


def assert_same_outcome(data: bytes, pieces: list[bytes], limits: Limits) -> None:
    whole = parse([data], limits)
    check_outcome(whole, data, limits)
    split = parse(pieces, limits)
    check_outcome(split, data, limits)
    assert same_outcome(whole, split), (
        f"the outcome depends on the read split {[len(p) for p in pieces]}:\n"
        f"  whole: {whole}\n  split: {split}")


@PROPERTIES
@given(st.data(), LIMITS)
def test_arbitrary_and_mutated_bytes_are_parsed_or_refused(data: st.DataObject,
                                                           limits: Limits) -> None:
    raw, _ = data.draw(inputs())
    assert_same_outcome(raw, data.draw(splits(raw)), limits)


@PROPERTIES
@given(st.data(), good_pipelines)
def test_well_formed_requests_parse_to_what_was_built(data: st.DataObject, built: list) -> None:
    raw = b"".join(b.data for b in built)
    pieces = data.draw(splits(raw))
    outcome = parse(pieces, Limits())
    check_outcome(outcome, raw, Limits())
    # Up to the first request that ends the connection: llhttp refuses what follows it
    # ("Data after Connection: close"), which no server reads anyway.
    last = next((i for i, r in enumerate(outcome.requests) if not keeps_alive(r)), None)
    if last is None or last + 1 == len(built):
        assert outcome.refusal is None, f"a well-formed pipeline refused with {outcome.refusal}: {raw!r}"
        assert outcome.pending is None, raw
        expected = built
    else:
        expected = built[:last + 1]
    got = [(r.method, r.target, r.body) for r in outcome.requests[:len(expected)]]
    assert got == [(b.method, b.target, b.body) for b in expected], raw


@PROPERTIES
@given(st.data())
def test_at_the_small_limits(data: st.DataObject) -> None:
    """Structured requests against limits small enough to be reached often."""
    built = data.draw(pipelines)
    raw = b"".join(b.data for b in built)
    assert_same_outcome(raw, data.draw(splits(raw)), SMALL_LIMITS)


# -- the pipeline, over a socketpair ---------------------------------------------------------------

@pytest.fixture(scope="module")
def workers() -> Iterator[Callable[[Limits], InProcess]]:
    """``workers(limits)``: an in-process pipeline with these limits, built once for every
    example (hypothesis runs them all in one call of the test), before the test begins (its
    descriptors are not the test's leak)."""
    made = {limits: InProcess.start(digest_app, limits) for limits in (Limits(), SMALL_LIMITS)}
    yield made.__getitem__
    for worker in made.values():
        worker.stop()


@PROPERTIES
@given(data=st.data(), limits=LIMITS)
def test_a_connection_answers_what_was_sent(workers: Callable[[Limits], InProcess],
                                            data: st.DataObject, limits: Limits) -> None:
    raw, requests = data.draw(inputs())
    pieces = data.draw(splits(raw))
    server = workers(limits)
    answered = server.answer(pieces)
    errors, server.errors[:] = list(server.errors), []
    assert not errors, f"logged at error level: {errors}"
    check_answers(expected_answers(raw, limits, requests or None), answered)
