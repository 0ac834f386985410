"""Replays the HTTP corpus (tests/http/corpus) through RequestParser.

Each case is a raw ``NNN.http`` file (exact bytes) and an ``NNN.json`` expectation:

* ``valid/``: ``{"requests": [...]}``, every request the parser must emit, in order: method,
  target, path, query, version, headers as [name, value] pairs, body (latin-1 text),
  keep_alive, chunked, content_length, expect_continue, upgrade.
* ``invalid/``: ``{"status": 400}``; optionally ``"complete": n``, the number of good requests
  pipelined before the bad one. The parser must raise HTTPError with that status, and the bad
  request must never be emitted as a complete request (a head followed by END), so it never
  reaches an application.

Either may carry ``"limits"``: keyword arguments for ``Limits``.

Every case is replayed whole, byte by byte, split after every CRLF, split between every CR and
LF, and in seeded random chunks, like gunicorn's ``tests/treq.py`` and h11's ``tests/test_io.py``.
A failure names the case, the split mode and the seed. To replay one: run the test id, e.g.
``pytest 'tests/unit/test_http_corpus.py::test_valid[valid/004-random-seed3]'``.
"""

from __future__ import annotations

import json
import random
import re
from pathlib import Path
from typing import Any

import pytest

from forkserve.http import END, HTTPError, Limits, Request, RequestParser
from tests.http import taken

CORPUS = Path(__file__).resolve().parent.parent / "http" / "corpus"
SEEDS = tuple(range(8))
MODES = ("whole", "bytes", "crlf", "cr-lf") + tuple(f"random-seed{seed}" for seed in SEEDS)


# -- loading ------------------------------------------------------------------------------------

def case_names(kind: str) -> list[str]:
    return sorted(path.stem for path in (CORPUS / kind).glob("*.http"))


def load(kind: str, name: str) -> tuple[bytes, dict[str, Any]]:
    data = (CORPUS / kind / f"{name}.http").read_bytes()
    spec = json.loads((CORPUS / kind / f"{name}.json").read_text(encoding="ascii"))
    return data, spec


# -- splitting ----------------------------------------------------------------------------------

def split(data: bytes, mode: str) -> list[bytes]:
    """The pieces ``data`` is fed in; joined they are always ``data`` exactly."""
    if mode == "whole":
        return [data]
    if mode == "bytes":
        return [data[i:i + 1] for i in range(len(data))]
    if mode == "crlf":
        return [piece for piece in re.split(rb"(?<=\r\n)", data) if piece]
    if mode == "cr-lf":
        return [piece for piece in re.split(rb"(?<=\r)(?=\n)", data) if piece]
    seed = int(mode.removeprefix("random-seed"))
    rng = random.Random(seed)
    if len(data) < 2:
        return [data]
    count = rng.randint(1, min(len(data) - 1, 40))
    cuts = sorted(rng.sample(range(1, len(data)), count))
    return [data[start:end] for start, end in zip([0, *cuts], [*cuts, len(data)])]


def describe(kind: str, name: str, mode: str, pieces: list[bytes]) -> str:
    seed = mode.removeprefix("random-seed") if mode.startswith("random-seed") else "-"
    return (f"corpus case {kind}/{name}, split mode {mode!r}, seed {seed}, "
            f"piece sizes {[len(p) for p in pieces][:60]}")


def replay(parser: RequestParser, pieces: list[bytes]) -> None:
    for piece in pieces:
        parser.feed(piece)


def as_requests(events: list[Any], where: str) -> list[dict[str, Any]]:
    """Group the event queue into complete requests, checking the event grammar on the way."""
    requests: list[dict[str, Any]] = []
    current: dict[str, Any] | None = None
    for event in events:
        if isinstance(event, Request):
            assert current is None, f"{where}: a new head before END of the previous request"
            current = {
                "method": event.method,
                "target": event.target.decode("latin-1"),
                "path": event.path.decode("latin-1"),
                "query": event.query.decode("latin-1"),
                "version": event.version,
                "headers": [[n.decode("latin-1"), v.decode("latin-1")] for n, v in event.headers],
                "body": "",
                "keep_alive": event.keep_alive,
                "chunked": event.chunked,
                "content_length": event.content_length,
                "expect_continue": event.expect_continue,
                "upgrade": event.upgrade,
            }
        elif event is END:
            assert current is not None, f"{where}: END without a request head"
            requests.append(current)
            current = None
        else:
            assert type(event) is bytes, f"{where}: unexpected event {event!r}"
            assert event, f"{where}: an empty body piece"
            assert current is not None, f"{where}: body bytes without a request head"
            current["body"] += event.decode("latin-1")
    assert current is None, f"{where}: the last request never ended (no END)"
    return requests


def limits_of(spec: dict[str, Any]) -> Limits:
    return Limits(**spec.get("limits", {}))


def params(kind: str) -> list[Any]:
    return [pytest.param(name, mode, id=f"{kind}/{name}-{mode}")
            for name in case_names(kind) for mode in MODES]


# -- the corpus itself --------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["valid", "invalid"])
def test_corpus_is_complete(kind: str) -> None:
    folder = CORPUS / kind
    raws = {p.stem for p in folder.glob("*.http")}
    specs = {p.stem for p in folder.glob("*.json")}
    assert raws == specs, f"{kind}: .http without .json or the reverse: {raws ^ specs}"
    assert len(raws) >= 25, f"{kind}: only {len(raws)} cases"
    for name in raws:
        assert re.fullmatch(r"\d{3}", name), f"{kind}/{name}: cases are named NNN"
        data, spec = load(kind, name)
        assert data, f"{kind}/{name}.http is empty"
        assert spec.get("description"), f"{kind}/{name}.json has no description"
        if kind == "valid":
            assert spec["requests"], f"{kind}/{name}.json expects no request"
        else:
            assert spec["status"] in (400, 413, 414, 431, 501, 505), f"{kind}/{name}: bad status"


@pytest.mark.parametrize("mode", MODES)
def test_split_modes_keep_the_bytes(mode: str) -> None:
    data = b"POST / HTTP/1.1\r\nHost: a\r\nContent-Length: 4\r\n\r\n\r\n\r\n"
    pieces = split(data, mode)
    assert b"".join(pieces) == data
    assert all(pieces)
    if mode != "whole":
        assert len(pieces) > 1
    if mode == "crlf":
        assert all(piece.endswith(b"\r\n") for piece in pieces)
    if mode == "cr-lf":
        assert all(piece.startswith(b"\n") for piece in pieces[1:])
        assert all(piece.endswith(b"\r") for piece in pieces[:-1])


def test_random_split_is_seeded() -> None:
    data = bytes(range(200))
    assert split(data, "random-seed3") == split(data, "random-seed3")
    assert split(data, "random-seed3") != split(data, "random-seed4")


# -- replay -------------------------------------------------------------------------------------

@pytest.mark.parametrize(("name", "mode"), params("valid"))
def test_valid(name: str, mode: str) -> None:
    data, spec = load("valid", name)
    pieces = split(data, mode)
    where = describe("valid", name, mode, pieces)
    parser = RequestParser(limits_of(spec))
    try:
        replay(parser, pieces)
    except HTTPError as exc:
        pytest.fail(f"{where}: refused a valid request with {exc.status} {exc.reason}")
    got = as_requests(taken(parser), where)
    assert len(got) == len(spec["requests"]), f"{where}: {len(got)} requests, expected {len(spec['requests'])}"
    for index, (actual, expected) in enumerate(zip(got, spec["requests"])):
        assert actual == expected, f"{where}: request {index} differs"


@pytest.mark.parametrize(("name", "mode"), params("invalid"))
def test_invalid(name: str, mode: str) -> None:
    data, spec = load("invalid", name)
    pieces = split(data, mode)
    where = describe("invalid", name, mode, pieces)
    parser = RequestParser(limits_of(spec))
    try:
        replay(parser, pieces)
    except HTTPError as exc:
        error = exc
    else:
        pytest.fail(f"{where}: accepted; expected HTTPError {spec['status']}; "
                    f"events {taken(parser)!r}")
    assert error.status == spec["status"], (
        f"{where}: HTTPError {error.status} {error.reason!r}, expected {spec['status']}")
    events = taken(parser)
    complete = sum(1 for event in events if event is END)
    assert complete == spec.get("complete", 0), (
        f"{where}: {complete} complete requests emitted, expected {spec.get('complete', 0)}: {events!r}")
    # Whatever follows the last complete request (a head, some body) is the bad request: it
    # must not be complete, so it can never be handed to an application.
    if complete:
        last_end = max(i for i, event in enumerate(events) if event is END)
        assert END not in events[last_end + 1:]
