"""What must hold of the request path for any input: the oracle the property tests
(``tests/unit/test_http_properties.py``, ``tests/integration/test_request_properties.py``) and
the fuzz targets (``fuzz/``) share, so that a case one of them finds means the same thing in
the others.

* :func:`parse` feeds bytes to ``RequestParser`` in given pieces, as a connection does (a
  refusal stops the reading; ``fail`` keeps the complete requests before it), checks the
  event grammar, and gives the :class:`Outcome`: the complete requests, the refusal status,
  what of an unfinished request is queued.
* :func:`check_request` holds one request that would reach the application to its framing,
  from the bytes that were sent, independently of the parser: a valid method, target and
  version, the request line really in the input, fields within the limits and free of
  control characters, a body exactly as long as its framing says.
* :func:`expected_answers` and :func:`check_answers` do the same for a whole connection:
  from the bytes a client sent, which requests the server must answer (in order, up to one
  it must close after), whether a refusal follows, and whether what came back is exactly that:
  well-formed responses, each request's digest (``tests.apps.digest``), no body for HEAD,
  then the close.

Imports only forkserve.http (and this package's helpers): no hypothesis, no atheris.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass, field
from typing import Sequence

from forkserve.http import END, HTTPError, Limits, Request, RequestParser

# The statuses RequestParser refuses with (forkserve/http/parser.py, the README's limits table):
# bad request, body too large, request line too long, fields too large, not implemented
# (method, transfer coding), version not supported.
REFUSALS = frozenset({400, 413, 414, 431, 501, 505})
TOKEN = re.compile(rb"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
# A field value as RFC 9110 §5.5 allows it: VCHAR, obs-text, SP and HTAB inside; no other
# control character (known bug 4: llhttp lets some through).
FIELD_VALUE = re.compile(rb"(?:[\x21-\x7e\x80-\xff](?:[\x20\x09\x21-\x7e\x80-\xff]*[\x21-\x7e\x80-\xff])?)?")
ABSOLUTE_FORM = re.compile(rb"[A-Za-z][A-Za-z0-9+\-.]*://[\x21-\x7e]*")


@dataclass(frozen=True)
class Parsed:
    """One request as the parser gave it, head and (de-chunked) body."""

    method: str
    target: bytes
    version: str
    headers: tuple[tuple[bytes, bytes], ...]
    body: bytes
    keep_alive: bool
    chunked: bool
    content_length: int | None
    expect_continue: bool
    upgrade: bool

    @classmethod
    def of(cls, request: Request, body: bytes) -> "Parsed":
        return cls(request.method, request.target, request.version, tuple(request.headers),
                   body, request.keep_alive, request.chunked, request.content_length,
                   request.expect_continue, request.upgrade)


@dataclass(frozen=True)
class Outcome:
    """What a parser made of some bytes: the complete requests, the refusal (a status, or
    None), and, when nothing was refused, the request under way (its head and body so far,
    or None)."""

    requests: tuple[Parsed, ...]
    refusal: int | None
    pending: Parsed | None
    # llhttp refused a method whose bytes, so far, are a token: 400 or 501 is decided by
    # the next read (RequestParser.method_undecided); a refusal, still to come.
    undecided: bool = False
    reason: str = field(default="", compare=False)  # the refusal's reason


# Refusals whose status may depend on where the reads split, both refusing the same request
# (see the parser's docstring: llhttp gives no error position). A line or target over its
# limit is measured after each read (or each span of the target), llhttp's byte errors inside
# the read: the first seen wins (400, 414 or 431). A method llhttp refuses is told apart (501 for a token, 400) by the request's
# first bytes, which for one pipelined behind another in the same read are not known.
# (Mixed, too: a line over its limit in one split, an unknown method, 501, in another.)
SPLIT_DEPENDENT = (frozenset({400, 414, 431, 501}),)


CHUNK_LINE = "Chunk size line too long"


def same_outcome(whole: Outcome, split: Outcome) -> bool:
    """``split`` is ``whole`` read in other pieces: the same requests, and the same refusal
    or one of the same request whose status depends on the split (SPLIT_DEPENDENT)."""
    if whole == split:
        return True
    for cut, other in ((whole, split), (split, whole)):
        if cut.reason == CHUNK_LINE and other.reason != CHUNK_LINE:
            # A chunk-size line is measured only where a read ends inside it (httptools has
            # no chunk-extension callback, and body data can hold any byte): whole in one
            # read it is bounded by the read (64 KiB), not by the line limit (the parser's
            # docstring). Where it was measured, the request is refused there: what came
            # before it is the same.
            return cut.requests == other.requests[:len(cut.requests)]
    if whole.requests != split.requests:
        return False
    if whole.pending != split.pending:
        return False
    pair = {whole.refusal, split.refusal}
    if None in pair:  # one refused, the other is waiting to tell 400 from 501
        refused = whole.refusal if split.refusal is None else split.refusal
        return (whole.undecided or split.undecided) and refused in (400, 501)
    return any(pair <= statuses for statuses in SPLIT_DEPENDENT)


def parse(pieces: Sequence[bytes], limits: Limits) -> Outcome:
    """Feed ``pieces`` one by one, as reads; stop at a refusal, as a connection does. Raises
    AssertionError on a broken event grammar; any exception but HTTPError from the parser
    goes up as it is (that is a bug)."""
    parser = RequestParser(limits)
    refusal: HTTPError | None = None
    for piece in pieces:
        try:
            parser.feed(piece)
        except HTTPError as exc:
            assert exc.status in REFUSALS, f"refused with {exc.status} {exc.reason!r}"
            refusal = exc
            break
    if refusal is not None:
        try:
            parser.fail(refusal)  # queues it behind the complete requests, if any
        except HTTPError as again:  # nothing complete: fail() raises it again, as documented
            assert again is refusal, f"fail() raised another error: {again!r}"
    events = []
    event = parser.next_event()
    while event is not None:
        events.append(event)
        event = parser.next_event()
    if refusal is not None and events and isinstance(events[-1], HTTPError):
        assert events[-1] is refusal, f"another error queued: {events[-1]!r}"
        events.pop()
    requests: list[Parsed] = []
    head: Request | None = None
    body: list[bytes] = []
    for event in events:
        if isinstance(event, Request):
            assert head is None, f"a head before the END of the previous request: {events!r}"
            head, body = event, []
        elif event is END:
            assert head is not None, f"END without a head: {events!r}"
            requests.append(Parsed.of(head, b"".join(body)))
            head = None
        else:
            assert type(event) is bytes and event, f"not body data: {event!r}"
            assert head is not None, f"body data without a head: {events!r}"
            body.append(event)
    if refusal is not None:
        # fail() dropped what followed the last complete request; with nothing complete it
        # raised, and a head may still be queued: it never reaches an app (read_head raises).
        assert head is None or not requests, f"a refused request's head kept: {events!r}"
        return Outcome(tuple(requests), refusal.status, None, reason=refusal.reason)
    pending = Parsed.of(head, b"".join(body)) if head is not None else None
    return Outcome(tuple(requests), None, pending, parser.method_undecided)


def tokens(headers: Sequence[tuple[bytes, bytes]], name: bytes) -> list[bytes]:
    """The comma-separated tokens of every field ``name``, lower-cased."""
    return [token.strip().lower() for n, v in headers if n.lower() == name
            for token in v.split(b",") if token.strip()]


def keeps_alive(request: Parsed) -> bool:
    """RFC 9112 §9.3, independently of llhttp: HTTP/1.1 persists unless a Connection field
    says close; HTTP/1.0 only when one says keep-alive and none says close (known bug 5);
    a request we do not upgrade ends the connection."""
    connection = tokens(request.headers, b"connection")
    if b"close" in connection or request.upgrade:
        return False
    return request.version == "1.1" or b"keep-alive" in connection


def check_request(request: Parsed, data: bytes, limits: Limits) -> None:
    """Everything a request that reaches the application must be, given the bytes sent."""
    where = f"{request!r}"
    method = request.method.encode("ascii")
    assert TOKEN.fullmatch(method), f"method is not a token: {where}"
    target = request.target
    assert re.fullmatch(rb"[\x21-\x7e]+", target), f"target with SP, CTL or non-ASCII: {where}"
    if target[:1] == b"*":
        # asterisk-form is a lone "*", for OPTIONS only (RFC 9112 §3.2.4; known bug 1).
        assert target == b"*" and request.method == "OPTIONS", f"bad asterisk-form: {where}"
    else:
        assert target[:1] == b"/" or ABSOLUTE_FORM.fullmatch(target), f"bad target form: {where}"
    assert request.version in ("1.0", "1.1"), where
    # The request line as it was sent (llhttp takes runs of SP between its parts): the
    # protocol name too, not only the version digits. (Anything may come before it: the
    # body of the request before.)
    # RTSP/: llhttp takes it for HTTP/ and says nothing (see the parser's docstring).
    line = (re.escape(method) + rb" +" + re.escape(target) + rb" +(?:HTTP|RTSP)/"
            + re.escape(request.version.encode()) + rb"\r\n")
    assert re.search(line, data), f"no such request line in the input (HTTP-name?): {where}"
    assert len(method) + len(target) + 10 <= limits.request_line, f"request line over the limit: {where}"
    assert len(request.headers) <= limits.fields, where
    hosts = [v for n, v in request.headers if n.lower() == b"host"]
    assert len(hosts) == 1 or (request.version == "1.0" and not hosts), f"Host fields {hosts}: {where}"
    for name, value in request.headers:
        assert TOKEN.fullmatch(name), f"field name {name!r}: {where}"
        assert FIELD_VALUE.fullmatch(value), f"field value {value!r} (CTL or OWS): {where}"
        assert len(name) + len(value) <= limits.field_size, where
    lengths = [v for n, v in request.headers if n.lower() == b"content-length"]
    codings = tokens(request.headers, b"transfer-encoding")
    if request.chunked:
        assert codings == [b"chunked"] and not lengths and request.content_length is None, where
        assert request.version == "1.1", f"chunked on HTTP/1.0: {where}"
    else:
        assert not codings, f"a transfer coding, not chunked: {where}"
        if request.content_length is None:
            assert not lengths and request.body == b"", f"a body with no framing: {where}"
        else:
            # 1*DIGIT (RFC 9110 §8.6): leading zeros are allowed, the value is the same.
            assert len(lengths) == 1 and re.fullmatch(rb"[0-9]+", lengths[0]), where
            assert int(lengths[0]) == request.content_length, where
            assert len(request.body) == request.content_length, (
                f"body of {len(request.body)} bytes, Content-Length {request.content_length}: {where}")
    if limits.body:
        assert len(request.body) <= limits.body, where
    if request.expect_continue:
        assert request.version == "1.1", where
    if request.upgrade:
        assert not request.keep_alive, where


def check_outcome(outcome: Outcome, data: bytes, limits: Limits) -> None:
    for request in outcome.requests:
        check_request(request, data, limits)
    if outcome.refusal is not None:
        assert outcome.refusal in REFUSALS and outcome.pending is None


# -- a whole connection: what a server must answer -----------------------------------------------

def digest(method: str, target: bytes, body: bytes) -> str:
    """What ``tests.apps.digest`` answers in ``X-Digest``: what reached the app."""
    return hashlib.sha256(method.encode("ascii") + b"\0" + target + b"\0" + body).hexdigest()[:32]


@dataclass(frozen=True)
class Expected:
    """What a server must answer to some bytes, sent whole by a client that then half-closed:
    these requests in order, the server free to close (with ``Connection: close``) after any
    of them; then, if every one kept the connection, the refusal (or, with None, the close).
    ``head_refused``: the refused request is a HEAD (its refusal carries no body); None
    when that cannot be told from the bytes (arbitrary or mutated input)."""

    served: tuple[Parsed, ...]
    refusal: int | None
    head_refused: bool | None = None
    # The input ends in a token character (where a request may begin): read apart from what came
    # before, llhttp's refused method may be a method still arriving (RequestParser.
    # method_undecided), and the server closes at the client's end without a 400 or 501.
    may_wait: bool = False
    # Read whole, the input ends inside a head llhttp has not judged yet (a field is judged
    # when the next begins): read in pieces, a line over its limit is refused at once.
    may_refuse: bool = False


def expected_answers(data: bytes, limits: Limits,
                     requests: Sequence[bytes] | None = None) -> Expected:
    """From the parser (whole: the split does not matter, test_http_properties holds it to
    that), cut at the first request that must close the connection (by RFC 9112 §9.3, not by
    the parser's word). ``requests``: the bytes of each request sent, when known, to tell
    whether the refused one is a HEAD."""
    outcome = parse([data], limits)
    served: list[Parsed] = []
    for request in outcome.requests:
        served.append(request)
        if not keeps_alive(request):
            return Expected(tuple(served), None)
    head_refused = None
    if outcome.refusal is not None and requests is not None:
        index = len(served)
        if index < len(requests):
            before = parse([b"".join(requests[:index])], limits)
            # The refused request begins exactly where request ``index`` was sent only when
            # the ones before it parse to exactly ``index`` requests with nothing left over.
            if (len(before.requests) == index and before.refusal is None
                    and before.pending is None):
                head_refused = requests[index].lstrip(b"\r\n").startswith(b"HEAD ")
    may_wait = outcome.refusal in (400, 501) and bool(_BARE_TOKEN_AT_END.search(data))
    may_refuse = outcome.refusal is None and outcome.pending is None and not data.endswith(
        b"\r\n\r\n")
    return Expected(tuple(served), outcome.refusal, head_refused, may_wait, may_refuse)


_BARE_TOKEN_AT_END = re.compile(rb"[!#$%&'*+\-.^_`|~0-9A-Za-z]\Z")  # (after a body, anything)


@dataclass
class Answer:
    status: int
    headers: list[tuple[str, str]]
    body: bytes
    raw: bytes

    def header(self, name: str) -> str | None:
        values = [v for n, v in self.headers if n.lower() == name]
        return ", ".join(values) if values else None

    def closes(self) -> bool:
        return "close" in [t.strip().lower() for t in (self.header("connection") or "").split(",")]


STATUS_LINE = re.compile(rb"HTTP/1\.1 ([1-5][0-9][0-9]) [\x20\x09\x21-\x7e]*")


class Answers:
    """A strict reader of the responses in ``data`` (everything a server sent until it
    closed): each must be well-formed, framed by Content-Length or chunked."""

    def __init__(self, data: bytes) -> None:
        self.data = data
        self.at = 0

    def at_end(self) -> bool:
        return self.at == len(self.data)

    def _line(self) -> bytes:
        end = self.data.find(b"\r\n", self.at)
        assert end >= 0, f"a response line cut off: {self.data[self.at:self.at + 200]!r}"
        line = self.data[self.at:end]
        assert b"\n" not in line and b"\r" not in line, f"bare CR or LF in {line!r}"
        self.at = end + 2
        return line

    def _take(self, size: int) -> bytes:
        assert self.at + size <= len(self.data), (
            f"a response body cut off: {size} bytes announced, {len(self.data) - self.at} came")
        piece = self.data[self.at:self.at + size]
        self.at += size
        return piece

    def next(self, method: str) -> Answer:
        """The next final response to a request of ``method``; 1xx before it are skipped."""
        while True:
            start = self.at
            status_line = self._line()
            match = STATUS_LINE.fullmatch(status_line)
            assert match, f"not a status line: {status_line!r}"
            status = int(match.group(1))
            headers = []
            while True:
                line = self._line()
                if not line:
                    break
                name, sep, value = line.partition(b":")
                assert sep and TOKEN.fullmatch(name), f"bad response field line {line!r}"
                assert FIELD_VALUE.fullmatch(value.strip(b" \t")), f"bad field value {line!r}"
                headers.append((name.decode("ascii"), value.strip(b" \t").decode("latin-1")))
            answer = Answer(status, headers, b"", b"")
            if status < 200:
                assert answer.header("content-length") is None, f"a 1xx with a length: {headers}"
                continue
            lengths = [v for n, v in headers if n.lower() == "content-length"]
            coding = answer.header("transfer-encoding")
            assert len(lengths) <= 1 and not (lengths and coding), f"ambiguous framing: {headers}"
            if method == "HEAD" or status in (204, 304):
                body = b""
            elif coding is not None:
                assert coding.lower() == "chunked", f"coding {coding!r}"
                pieces = []
                while True:
                    size_line = self._line()
                    assert re.fullmatch(rb"[0-9a-fA-F]+", size_line), f"chunk size {size_line!r}"
                    size = int(size_line, 16)
                    if size == 0:
                        while self._line():
                            pass
                        break
                    pieces.append(self._take(size))
                    assert self._take(2) == b"\r\n", "chunk data not followed by CRLF"
                body = b"".join(pieces)
            else:
                assert lengths, f"a response with neither Content-Length nor chunked: {headers}"
                assert re.fullmatch(r"[0-9]+", lengths[0]), f"Content-Length {lengths[0]!r}"
                body = self._take(int(lengths[0]))
            answer.body, answer.raw = body, self.data[start:self.at]
            return answer


CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"


def check_answers(expected: Expected, data: bytes) -> list[Answer]:
    """``data``, all a server sent until it closed, is exactly what ``expected`` allows:
    each request's response (status 200, its digest), possibly cut short after one that
    announced the close, then the refusal with ``Connection: close``, then nothing."""
    answers = Answers(data)
    got: list[Answer] = []
    for index, request in enumerate(expected.served):
        if answers.at_end():
            assert got and got[-1].closes(), (
                f"the server closed after {len(got)} of {len(expected.served)} responses "
                f"without announcing it; requests {expected.served[len(got):]!r}")
            return got
        answer = answers.next(request.method)
        got.append(answer)
        assert answer.status == 200, f"request {index} {request!r} got {answer.raw[:300]!r}"
        want = digest(request.method, request.target, request.body)
        assert answer.header("x-digest") == want, (
            f"request {index} reached the app otherwise than it was sent: {request!r}, "
            f"answer {answer.raw[:400]!r}")
        if request.method == "HEAD":
            assert answer.body == b"", "a HEAD answered with a body"
        if answer.closes() and index + 1 < len(expected.served):
            assert answers.at_end(), f"bytes after a response that announced the close: {data[answers.at:][:200]!r}"
            return got
    if expected.refusal is not None and not answers.at_end():
        if got and got[-1].closes():
            assert answers.at_end(), f"bytes after Connection: close: {data[answers.at:][:200]!r}"
            return got
        if expected.head_refused is None:
            # Not known whether the refused request is a HEAD: a body as announced, or none
            # at all (as to a HEAD), and nothing after either.
            start = answers.at
            refusal = answers.next("HEAD")
            if not answers.at_end():
                answers.at = start
                refusal = answers.next("GET")
        else:
            refusal = answers.next("HEAD" if expected.head_refused else "GET")
        got.append(refusal)
        assert refusal.status == expected.refusal or any(
            {refusal.status, expected.refusal} <= statuses for statuses in SPLIT_DEPENDENT), (
            f"refused with {refusal.status}, expected {expected.refusal}: {refusal.raw[:300]!r}")
        assert refusal.closes(), f"a refusal that does not announce the close: {refusal.raw!r}"
    elif expected.refusal is not None and not expected.may_wait:
        assert got and got[-1].closes(), (
            f"closed without the {expected.refusal} refusal: {data[-300:]!r}")
    if expected.may_refuse and not answers.at_end() and len(got) == len(expected.served):
        late = answers.next("GET")  # a limit the pieces showed before the whole did
        assert late.status in SPLIT_DEPENDENT[0] and late.closes(), late.raw[:300]
    if data.endswith(CONTINUE, answers.at) and answers.at + len(CONTINUE) == len(data):
        # The poller answered 100 Continue to a request whose body never came whole: the
        # client's end closes it, with no final response (nothing reached the app).
        answers.at = len(data)
    assert answers.at_end(), (
        f"unexpected bytes after the last response (a body for HEAD?): {data[answers.at:][:300]!r}")
    return got
