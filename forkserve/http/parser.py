"""Request parsing on httptools (llhttp): bytes in, events out.

``RequestParser.feed(data)`` queues events, in order: a :class:`Request` (the head), zero or
more ``bytes`` (body data, de-chunked), then ``END`` (the one :class:`EndOfMessage`).
Pipelined requests simply follow in the same queue; ``next_event()`` takes them off it, in
order, and gives None when it needs more input. Anything the server must refuse raises
:class:`HTTPError` with the precise status, before the request can reach an application;
``fail(error)`` queues such an error behind the requests already complete (the caller answers
those first), so the queue may also hold one ``HTTPError``, always last.

Body data stays plain ``bytes``: wrapping each piece in a small event object (a NamedTuple or a
frozen dataclass, as h11's ``Data``) cost 0.5 to 0.8 µs more per piece, queued and taken, on
the machine this was measured on, and ``bytes`` is already a type of its own in the union.

llhttp already refuses the classic smuggling vectors (Transfer-Encoding with Content-Length,
duplicate Content-Length, bare LF, obs-fold, invalid tokens); on top of it we enforce the
size limits, a single Host on HTTP/1.1 (RFC 9112 §3.2), the HTTP version (505), and that the
only transfer coding is ``chunked`` (RFC 9112 §6.1: 501 for codings we do not implement).
"""

from __future__ import annotations

import re
from collections import deque
from dataclasses import dataclass
from typing import Callable, Final, Union, final

import httptools

from forkserve.http.errors import HTTPError

_TOKEN_START = re.compile(rb"[!#$%&'*+\-.^_`|~0-9A-Za-z]+( |\Z)")



@final
class EndOfMessage:
    """The end of one request (its body, if any, all delivered). There is one: ``END``,
    compared with ``is``."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "END"


END: Final = EndOfMessage()


@dataclass(frozen=True)
class Limits:
    request_line: int = 8190
    fields: int = 100
    field_size: int = 8190
    body: int = 0  # 0: no limit

    @property
    def head(self) -> int:
        # The most a complete head may take: the target plus room for the method and
        # version, the fields with ": " and CRLFs, the final CRLF.
        return self.request_line + 32 + self.fields * (self.field_size + 4) + 2


class Request:
    """The head of one request. Bytes stay bytes: the WSGI layer decides their encoding."""

    __slots__ = ("method", "target", "path", "query", "version", "headers", "keep_alive",
                 "content_length", "chunked", "expect_continue", "upgrade")

    def __init__(self, method: str, target: bytes, version: str, headers: list[tuple[bytes, bytes]],
                 keep_alive: bool, content_length: int | None, chunked: bool,
                 expect_continue: bool) -> None:
        self.method = method
        self.target = target
        self.version = version
        self.headers = headers
        self.keep_alive = keep_alive
        self.content_length = content_length
        self.chunked = chunked
        self.expect_continue = expect_continue
        self.upgrade = False
        if target[:1] == b"/":
            path, _, query = target.partition(b"?")
        elif target == b"*":
            path, query = b"*", b""
        else:
            # absolute-form (RFC 9112 §3.2.2): take path and query, the authority is Host's.
            try:
                url = httptools.parse_url(target)
            except httptools.HttpParserInvalidURLError:
                raise HTTPError(400, "Bad request target") from None
            path, query = url.path or b"/", url.query or b""
        self.path = path.partition(b"#")[0]
        self.query = query.partition(b"#")[0]

    @property
    def has_body(self) -> bool:
        return self.chunked or bool(self.content_length)

    def __repr__(self) -> str:
        return f"<Request {self.method} {self.target!r} HTTP/{self.version}>"


# What the queue holds: a head, body data, the end of a request, or (last, from fail()) the
# error that refuses the request after the complete ones.
Event = Union[Request, bytes, EndOfMessage, HTTPError]


class RequestParser:
    """Feeds llhttp and turns its callbacks into a queue of events."""

    def __init__(self, limits: Limits) -> None:
        self.limits = limits
        self._events: deque[Event] = deque()
        # pending(): how many events are queued. The deque's own __len__, so asking costs a C
        # call, not a Python frame: the workers ask once or twice a request.
        self.pending: Callable[[], int] = self._events.__len__
        self._parser = httptools.HttpRequestParser(self)
        self._in_head = False
        self._head_bytes = 0
        self._url = b""
        self._headers: list[tuple[bytes, bytes]] = []
        self._field_bytes = 0
        self._content_length: int | None = None
        self._te: bytes | None = None
        self._hosts = 0
        self._expect = False
        self._body_bytes = 0
        self._upgraded = False
        self._upgrade_remaining = 0
        self._in_body = False
        self._began_here = False
        self._probe = b""

    # -- output ------------------------------------------------------------------------
    def next_event(self) -> Event | None:
        """Take the next event off the queue; None when it is empty (feed more input)."""
        events = self._events
        return events.popleft() if events else None

    def peek_event(self) -> Event | None:
        """The next event, left on the queue; None when it is empty."""
        events = self._events
        return events[0] if events else None

    def take_end(self) -> bool:
        """Take ``END`` off the queue if it is next (a request without a body, once its head
        was taken); True when it was."""
        events = self._events
        if events and events[0] is END:
            events.popleft()
            return True
        return False

    def request_ready(self, enough: int) -> bool:
        """Is the request at the head of the queue ready to serve without waiting on its
        client: its head with its whole body or at least ``enough`` bytes of it, or a head
        that waits for ``100 Continue``, or an error to answer? (The thread worker's poll loop
        asks, so that a slow client never holds a request thread.)"""
        events = self._events
        if not events:
            return False
        head = events[0]
        if type(head) is not Request or not head.has_body or head.expect_continue:
            return True
        got = 0
        queued = iter(events)
        next(queued)
        for event in queued:
            if type(event) is not bytes:
                return True  # END, or an error behind the body
            got += len(event)
            if got >= enough:
                return True
        return False

    def fail(self, error: HTTPError) -> None:
        """Refuse the request being read with ``error`` (raised by ``feed``), after those
        already complete.

        A parse error behind complete pipelined requests belongs to the request that caused
        it: those before it are answered first (RFC 9112 §9.6), then it is refused. What
        follows the last complete request is dropped, so no part of a refused request (an
        over-limit body, say) ever reaches the app. With nothing complete queued, the error
        belongs to the request being read: it is raised again now."""
        events = self._events
        if END not in events:
            raise error
        while events[-1] is not END:
            events.pop()
        events.append(error)

    # -- input -------------------------------------------------------------------------
    def feed(self, data: bytes) -> None:
        if self._upgraded:
            self._upgrade_body(data)
            return
        idle = not self._in_head and not self._in_body
        if idle:
            self._probe = data  # the start of the next request: kept to tell 400 from 501
            self._began_here = False
        elif self._in_head and not self._url:
            self._probe += data
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserCallbackError as exc:
            # Our callbacks raise HTTPError for limits; llhttp wraps it, we unwrap it.
            cause = exc.__context__
            if isinstance(cause, HTTPError):
                raise cause from None
            raise
        except httptools.HttpParserUpgrade as exc:
            self._on_upgrade(data, exc.args[0] if exc.args else len(data))
            return
        except httptools.HttpParserInvalidMethodError:
            # 501 is for a well-formed method we do not implement (RFC 9110 §9.1); bytes
            # that are no method at all (a TLS hello, garbage) are a bad request line (400).
            if _TOKEN_START.match(self._probe.lstrip(b"\r\n")):
                raise HTTPError(501, "Method not implemented") from None
            raise HTTPError(400, "Bad request line") from None
        except httptools.HttpParserInvalidURLError:
            raise HTTPError(400, "Bad request target") from None
        except httptools.HttpParserError as exc:
            raise HTTPError(400, _reason(exc)) from None
        if self._in_head:
            if self._began_here:
                # The head began inside this feed: count what it holds so far, not the bytes
                # of an earlier pipelined request. The unfinished field is counted from the
                # next feed on, so an endless field is cut at most one read past the limit.
                self._began_here = False
                self._head_bytes = len(self._url) + self._field_bytes
            else:
                self._head_bytes += len(data)
            if self._head_bytes > self.limits.head:
                # A long target is caught in on_url (414); what overflows here are fields.
                raise HTTPError(431, "Request header fields too large")

    def _on_upgrade(self, data: bytes, offset: int) -> None:
        """llhttp stops at an Upgrade (or CONNECT) head and skips its body. We do not switch
        protocols: the request is served as a plain one and the connection then closes. A
        Content-Length body is still delivered to the app; a chunked one is refused."""
        self._upgraded = True
        heads = [event for event in self._events if isinstance(event, Request)]
        if not heads:
            return
        head = heads[-1]
        head.upgrade = True
        head.keep_alive = False
        if head.chunked:
            raise HTTPError(501, "A chunked body with Upgrade is not implemented")
        remaining = head.content_length or 0
        if remaining:
            if self._events and self._events[-1] is END:
                self._events.pop()  # llhttp ended the message before its body: reopen it
            self._upgrade_remaining = remaining
            self._upgrade_body(data[offset:])

    def _upgrade_body(self, data: bytes) -> None:
        remaining = self._upgrade_remaining
        if remaining <= 0:
            return  # past the request: bytes of a protocol we do not speak, dropped
        piece = data[:remaining]
        if piece:
            self.on_body(piece)
        self._upgrade_remaining = remaining - len(piece)
        if self._upgrade_remaining == 0:
            self._events.append(END)

    # -- llhttp callbacks (called from inside feed_data) -----------------------------------
    def on_message_begin(self) -> None:
        self._in_head = True
        self._began_here = True
        self._head_bytes = 0
        self._url = b""
        self._headers = []
        self._field_bytes = 0
        self._content_length = None
        self._te = None
        self._hosts = 0
        self._expect = False
        self._body_bytes = 0

    def on_url(self, url: bytes) -> None:
        self._url += url
        if len(self._url) > self.limits.request_line:
            raise HTTPError(414, "Request line too long")

    def on_header(self, name: bytes, value: bytes) -> None:
        if not self._in_head:
            return  # a chunked trailer field: not passed on to WSGI
        headers = self._headers
        value = value.rstrip(b" \t")  # llhttp strips leading OWS only (RFC 9110 §5.5)
        if len(headers) >= self.limits.fields:
            raise HTTPError(431, "Too many request header fields")
        if len(name) + len(value) > self.limits.field_size:
            raise HTTPError(431, "Request header field too large")
        headers.append((name, value))
        self._field_bytes += len(name) + len(value) + 4
        lname = name.lower()
        if lname == b"content-length":
            self._content_length = int(value)
        elif lname == b"transfer-encoding":
            self._te = value if self._te is None else self._te + b"," + value
        elif lname == b"host":
            self._hosts += 1
        elif lname == b"expect":
            self._expect = value.strip().lower() == b"100-continue"

    def on_headers_complete(self) -> None:
        self._in_head = False
        self._in_body = True
        parser = self._parser
        version = parser.get_http_version()
        if version not in ("1.1", "1.0"):
            raise HTTPError(505, "HTTP version not supported")
        if self._hosts > 1 or (self._hosts == 0 and version == "1.1"):
            raise HTTPError(400, "A request needs exactly one Host header")
        chunked = False
        if self._te is not None:
            codings = [c.strip().lower() for c in self._te.split(b",") if c.strip()]
            if codings != [b"chunked"]:
                raise HTTPError(501, "Transfer coding not implemented")
            chunked = True
        limit = self.limits.body
        if limit and self._content_length is not None and self._content_length > limit:
            raise HTTPError(413, "Request body too large")
        # RFC 9112 §6.1: an HTTP/1.0 message with Transfer-Encoding must close afterwards.
        keep_alive = parser.should_keep_alive() and not (chunked and version == "1.0")
        self._events.append(Request(
            parser.get_method().decode("ascii"), self._url, version, self._headers,
            keep_alive, self._content_length, chunked, self._expect and version == "1.1"))

    def on_body(self, body: bytes) -> None:
        limit = self.limits.body
        if limit:
            self._body_bytes += len(body)
            if self._body_bytes > limit:
                raise HTTPError(413, "Request body too large")
        self._events.append(body)

    def on_message_complete(self) -> None:
        self._in_body = False
        self._events.append(END)


def _reason(exc: Exception) -> str:
    text = str(exc).strip() or "Bad request"
    return text[:1].upper() + text[1:]
