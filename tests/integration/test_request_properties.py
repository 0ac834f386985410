"""Property tests of the request path through a real server process, one per worker class (2
workers, 127.0.0.1), running ``tests.apps.digest`` (it answers with a digest of what reached
it, and records each call).

Each example is one connection: a client sends structured-but-mutated requests, pipelined,
or arbitrary bytes (``tests.http.strategies``), in random sends, then half-closes and reads
until the server closes. What must hold (the oracle is ``tests.http.invariants``, fed the
same bytes through ``RequestParser``):

* every answer is a well-formed HTTP/1.1 response, then a clean close (FIN, never a
  stall: every read has a timeout). A reset is allowed only after a whole response that
  announced ``Connection: close``, when the client's later sends (pipelined behind it, in a
  later segment) reach a socket the server has closed: a race no lingering close at the
  server's side fully removes (the response is read whole; the in-process tests, where the
  split is exact, hold the connection to no reset at all);
* each request that was answered matches what was sent (its digest), in order; the server
  may close early only after announcing it; a request the parser refuses gets its status;
* malformed input never reaches the app: the app's record of calls holds exactly the
  answered requests' digests;
* HEAD answers carry no body (refusals of a HEAD too);
* afterwards the server's log has no traceback and no error, and no worker was respawned.

Bounded and deterministic: derandomized, no example database, ``FORKSERVE_SERVER_EXAMPLES``
examples per worker class (default 60: a few seconds per class on a loaded 2-core machine).
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from forkserve.http import Limits
from tests.harness import Server, worker_set
from tests.http.invariants import check_answers, expected_answers
from tests.http.strategies import mutated, pipelines, splits

WORKER_CLASSES = ["sync", "thread", "gevent"]
EXAMPLES = int(os.environ.get("FORKSERVE_SERVER_EXAMPLES", "60"))
READ_TIMEOUT = 10.0  # seconds a client waits for the server's next bytes (a loaded machine)
PROPERTIES = settings(max_examples=EXAMPLES, derandomize=True, database=None,
                      deadline=30000,  # ms: a connection on a loaded machine, well within
                      suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@dataclass
class Served:
    server: Server
    record: Path
    workers: set[int]

    def calls(self) -> list[str]:
        return self.record.read_text().splitlines() if self.record.exists() else []


@pytest.fixture(scope="module", params=WORKER_CLASSES)
def served(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    """One server per worker class for all its examples (a server per example would spend
    the time budget on booting)."""
    record = tmp_path_factory.mktemp(f"digest-{request.param}") / "calls"
    server = Server("-k", request.param, app="tests.apps.digest:app",
                    env={"DIGEST_RECORD": str(record)})
    try:
        server.wait_ready()
        yield Served(server, record, worker_set(server, 2))
    finally:
        server.close()


def converse(port: int, pieces: list[bytes]) -> tuple[bytes, bool]:
    """Send ``pieces`` (one send each), half-close, and read until the server closes: what
    it sent, and whether the end was a reset."""
    with socket.create_connection(("127.0.0.1", port), timeout=READ_TIMEOUT) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            for piece in pieces:
                sock.sendall(piece)
            sock.shutdown(socket.SHUT_WR)
        except OSError:  # (EPIPE, ECONNRESET, ENOTCONN)
            pass  # the server refused or closed early: what it answered is still to read
        chunks = []
        while True:
            try:
                data = sock.recv(65536)
            except ConnectionResetError:
                return b"".join(chunks), True
            except socket.timeout:
                raise AssertionError(f"the server neither answered nor closed within "
                                     f"{READ_TIMEOUT}s; so far {b''.join(chunks)[-300:]!r}") from None
            if not data:
                return b"".join(chunks), False
            chunks.append(data)


@st.composite
def conversations(draw: st.DrawFn) -> tuple[bytes, list[bytes] | None]:
    kind = draw(st.sampled_from(["structured", "structured", "mutated", "raw"]))
    if kind == "raw":
        return draw(st.binary(min_size=1, max_size=200)), None
    built = draw(pipelines)
    data = b"".join(b.data for b in built)
    if kind == "mutated":
        return draw(mutated(data)), None
    return data, [b.data for b in built]


@PROPERTIES
@given(data=st.data())
def test_every_answer_is_what_was_sent_or_a_refusal(served: Served, data: st.DataObject) -> None:
    raw, requests = data.draw(conversations())
    pieces = data.draw(splits(raw))
    before = len(served.calls())
    answered, reset = converse(served.server.port, pieces)
    got = check_answers(expected_answers(raw, Limits(), requests), answered)
    assert not reset or (got and got[-1].closes() and len(pieces) > 1), (
        f"reset, not after a whole response that announced the close: {raw!r}\n{answered[-300:]!r}")
    digests = [a.header("x-digest") for a in got if a.status == 200]
    assert served.calls()[before:] == digests, (
        f"the app saw other requests than those answered: {raw!r}\n{answered[:600]!r}")


def test_the_server_log_is_clean(served: Served) -> None:
    """Runs after the properties of the same worker class (pytest orders the tests of a
    module-scoped parameter together)."""
    log = served.server.log_text()
    assert "Traceback" not in log, log
    errors = [r for r in served.server.records() if r.get("level") in ("error", "critical")]
    assert not errors, errors
    assert set(served.server.workers()) == served.workers, (
        f"workers were respawned: {served.workers} then {served.server.workers()}\n{log}")
