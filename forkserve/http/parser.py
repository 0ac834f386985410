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
size limits (see :class:`Limits`), a single and well-formed Host (RFC 9112 §3.2, RFC 9110
§7.2), the HTTP version (505), that the only transfer coding is ``chunked`` (RFC 9112 §6.1:
501 for codings we do not implement) and never on HTTP/1.0 (RFC 9112 §6.1: faulty framing,
400), that asterisk-form is only for OPTIONS (RFC 9112 §3.2.4), no duplicate Content-Type,
and that no trailer field is one a trailer must not carry (RFC 9110 §6.5.1).

What llhttp does not do for us, and where it matters:

* It hands each field to httptools in spans, one per ``feed_data`` call, and httptools joins
  the spans of one field with ``bytes +=`` before calling ``on_header``: a field sent in many
  small reads costs quadratic time until it ends. A field that never ends (a 64 MiB trailer)
  once cost 30 s of CPU and 100 MiB. We cannot change httptools' join, so we make sure it
  never runs long: ``feed`` measures the unfinished line after every read and refuses it
  once it passes :attr:`Limits.line`, so no span chain outgrows one line plus one read.
* It keeps no count of chunk-size lines, chunk extensions or trailer fields: the same line
  measure bounds the first two (RFC 9112 §7.1.1: "a server ought to limit the total length
  of chunk extensions"), and ``on_header`` counts trailer fields against the request's field
  limits as it counts the head's. (A chunk-size line is measured only where a read ends
  inside it: one that arrives whole, in one read, is bounded by the read, 64 KiB.)
* It accepts runs of spaces between the parts of the request line, and has no option to
  refuse them; ``on_url`` limits the canonical line (one SP each side) exactly, the line
  measure limits any other.
* It takes ``RTSP/1.x`` for ``HTTP/1.x`` in a request line (RFC 9112 §2.3 says HTTP-name is
  "HTTP") and tells no one: httptools has no protocol callback, and finding the line in
  what was read, whatever the read split, would mean keeping every read of a head. The
  framing is HTTP/1.x's either way (llhttp parses both alike), so it opens no disagreement
  on where a request ends; the app sees SERVER_PROTOCOL HTTP/1.x.
* It gives no position for an error. A request whose method llhttp refuses is answered
  501 if its first bytes are a token and a space (a method we do not implement), else 400;
  for one pipelined behind another in the same read, its first bytes cannot be told apart
  from the read's, and the answer is 400 or 501 by where the reads split. Likewise a line
  or target over its limit is measured after each read, llhttp's byte errors inside one:
  a request with both is refused 414 or 431 in one split, 400 in another. Each refuses it,
  and the connection closes.
"""

from __future__ import annotations

import ipaddress
import re
from collections import deque
from dataclasses import dataclass
from functools import cached_property
from types import MappingProxyType
from typing import Callable, Final, Union, final

import httptools

from forkserve.http.errors import HTTPError

_TOKEN = re.compile(rb"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
_PROBE = 64  # bytes of a request's start kept to tell a method token from garbage

# Host = uri-host [ ":" port ] (RFC 9110 §7.2), uri-host being RFC 3986 §3.2.2's host:
# IP-literal ("[" IPv6address or IPvFuture "]"), IPv4address or reg-name. An IPv4address is
# also a reg-name, so the reg-name branch covers both; an empty Host is allowed (RFC 9112
# §3.2: a target with no authority). The IPv6 literal's form is checked by ipaddress.
# The reg-name branch is written as runs of plain characters between percent-encodings, not
# as an alternation per character: this is on every request's path (0.5 µs a Host, not 1.4).
_HOST = re.compile(rb"""
    (?: [A-Za-z0-9\-._~!$&'()*+,;=]* (?: %[0-9A-Fa-f]{2} [A-Za-z0-9\-._~!$&'()*+,;=]* )*
      | \[ (?P<ipv6> [0-9A-Fa-f:.]+ ) \]
      | \[ v[0-9A-Fa-f]+ \. [A-Za-z0-9\-._~!$&'()*+,;=:]+ \]
    ) (?: : [0-9]* )?""", re.VERBOSE)
# Host values found valid, shared by every parser of the process: a server answers to a few
# names, and a new connection (every request, under Connection: close) then skips the match
# above, which cost 3 % of a sync worker's instructions a request. Bounded in count and
# length, so a client sending made-up hosts fills it once and then only pays the match.
_VALID_HOSTS: set[bytes] = set()
HOSTS_KEPT = 64
HOST_KEPT_BYTES = 255

# Fields a trailer section must not carry (RFC 9110 §6.5.1, as RFC 7230 §4.1.2 listed them):
# message framing, routing, request modifiers (controls and conditionals), authentication,
# content format, and the connection's own fields. A trailer arrives after the app has
# begun; a proxy that merges trailers into the head would give these a meaning they cannot
# have here, so the request is refused rather than the field dropped.
_FORBIDDEN_TRAILERS: Final = frozenset({
    b"transfer-encoding", b"content-length", b"host", b"trailer", b"te", b"connection",
    b"keep-alive", b"upgrade", b"expect", b"max-forwards", b"cache-control", b"pragma",
    b"range", b"if-match", b"if-none-match", b"if-modified-since", b"if-unmodified-since",
    b"if-range", b"authorization", b"proxy-authorization", b"content-encoding",
    b"content-type", b"content-range",
})



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
    """What one request may hold. Every part of a request a client can make grow is bounded
    by one of these, as it grows:

    * ``request_line``: the request line, method SP target SP version, without its CRLF
      (414), the way gunicorn measures ``limit_request_line``;
    * ``fields``: the header fields and trailer fields of one request together (431);
    * ``field_size``: one field's name and value (431), in the head or in the trailers;
    * ``body``: the body, de-chunked (413); 0: no limit;
    * :attr:`line`: any unfinished line (431; 400 for a chunk-size line);
    * :attr:`head`: the whole head (431).
    """

    request_line: int = 8190
    fields: int = 100
    field_size: int = 8190
    body: int = 0  # 0: no limit

    # Derived once per Limits, not on every read they bound (functools.cached_property
    # stores into the instance's own dict, which a frozen dataclass still has).
    @cached_property
    def line(self) -> int:
        # Any line as it arrives (the request line, a field line, a chunk-size line with its
        # extensions, a trailer line), counted raw: its CR, and the ": " of a field, are room
        # in the 4. Lines are held to the exact limits above once complete; this is the
        # bound while they grow, so a line that never ends is cut after at most one read.
        return max(self.request_line, self.field_size) + 4

    @cached_property
    def head(self) -> int:
        # The most a complete head may take: the request line with its CRLF and some room
        # (llhttp accepts runs of spaces in it), each field with ": " and CRLF, the final
        # CRLF. With the defaults: 827,624 bytes.
        return self.request_line + 32 + self.fields * (self.field_size + 4) + 2


class Request:
    """The head of one request. Bytes stay bytes: the WSGI layer decides their encoding."""

    __slots__ = ("method", "target", "path", "query", "version", "headers", "keep_alive",
                 "content_length", "chunked", "expect_continue", "upgrade", "has_body")

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
        self.has_body = chunked or bool(content_length)  # (read a few times a request)
        if target[:1] == b"/":
            path, _, query = target.partition(b"?")
        elif target == b"*":
            # asterisk-form (RFC 9112 §3.2.4), OPTIONS only: the server as a whole, no path.
            # PEP 3333 allows an empty PATH_INFO, not "*" (wsgiref's validator refuses it);
            # the application tells it from a request for its root by RAW_URI "*".
            path, query = b"", b""
        else:
            # absolute-form (RFC 9112 §3.2.2): take path and query, the authority is Host's.
            try:
                url = httptools.parse_url(target)
            except httptools.HttpParserInvalidURLError:
                raise HTTPError(400, "Bad request target") from None
            path, query = url.path or b"/", url.query or b""
        self.path = path.partition(b"#")[0]
        self.query = query.partition(b"#")[0]

    def __repr__(self) -> str:
        return f"<Request {self.method} {self.target!r} HTTP/{self.version}>"


# What the queue holds: a head, body data, the end of a request, or (last, from fail()) the
# error that refuses the request after the complete ones.
Event = Union[Request, bytes, EndOfMessage, HTTPError]


# The methods most requests use, as the str a Request holds: one lookup, not a decode.
_METHOD_NAMES: Final = MappingProxyType({name.encode("ascii"): name for name in (
    "GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS")})

# The fields on_header looks at (the rest it only counts and keeps).
_FRAMING_FIELDS = frozenset({b"content-length", b"transfer-encoding", b"host", b"content-type",
                             b"expect", b"connection"})


class RequestParser:
    """Feeds llhttp and turns its callbacks into a queue of events."""

    # Slots: with 30 attributes, one past what CPython 3.11 keeps in values shared with the
    # class, every parser got a dict of its own, and each of a few dozen attribute loads and
    # stores a request went through it: 2 % of the gevent worker's instructions a request,
    # 3.7 % of a sync worker's Connection: close request (bench/RESULTS.md, 2026-12-07 15:09).
    __slots__ = ("__weakref__", "limits", "_events", "pending", "_parser", "_in_head",
                 "_head_bytes", "_url_parts", "_url_len", "_url_room", "_headers",
                 "_field_bytes", "_trailers", "_content_length", "_te", "_hosts", "_host",
                 "_content_types", "_expect", "_close", "_body_bytes",
                 "_upgraded", "_upgrade_remaining", "_in_body", "_began_here", "_probe",
                 "_bad_method", "_line", "_body_last", "_after_chunk_size")

    def __init__(self, limits: Limits) -> None:
        self.limits = limits
        self._events: deque[Event] = deque()
        # pending(): how many events are queued. The deque's own __len__, so asking costs a C
        # call, not a Python frame: the workers ask once or twice a request.
        self.pending: Callable[[], int] = self._events.__len__
        self._parser = httptools.HttpRequestParser(self)
        # RFC 9112 §7.1.1: chunk-ext = *( BWS ";" BWS chunk-ext-name [ BWS "=" BWS ... ] ).
        # llhttp refuses the BWS before ";" unless told otherwise (it then also takes spaces
        # before the CRLF, "1 \r\n", as Squid, nginx and httpd do). Every reading of such a
        # line gives the same size, so this opens no framing disagreement; fasthttp#2193
        # chose to refuse "3 ;ext" instead. llhttp has no option for the BWS after ";" or
        # around "=": those stay 400. No other leniency is safe: lenient_transfer_encoding,
        # say, takes "chunked " (trailing OWS) as not chunked and reads the body to EOF.
        self._parser.set_dangerous_leniencies(lenient_spaces_after_chunk_size=True)
        self._in_head = False
        self._head_bytes = 0
        # The target, as llhttp hands it over in spans (one per read it spans): joined once,
        # at the end of the head, so a target sent a byte at a time costs linear time.
        self._url_parts: list[bytes] = []
        self._url_len = 0
        self._url_room = 0  # how long the target may be, given the method (see on_url)
        self._headers: list[tuple[bytes, bytes]] = []
        self._field_bytes = 0
        self._trailers = 0
        self._content_length: int | None = None
        self._te: bytes | None = None
        self._hosts = 0
        self._host = b""
        self._content_types = 0
        self._expect = False
        self._close = False
        self._body_bytes = 0
        self._upgraded = False
        self._upgrade_remaining = 0
        self._in_body = False
        self._began_here = False
        self._probe = b""
        self._bad_method = False  # llhttp refused the method; 400 or 501 is still to tell
        # The unfinished line (see feed): its length in bytes so far, whether the last thing
        # llhttp reported in this read was body data (then where lines start in the read is
        # not known), and whether a chunk-size line was the last line (trailers follow it).
        self._line = 0
        self._body_last = False
        self._after_chunk_size = False

    def dispose(self) -> None:
        """The connection is closed: let go of llhttp's parser. It holds our bound methods
        (its callbacks), so the two are a reference cycle that only the cyclic collector
        frees: 17 objects a connection, and on a connection that lived long enough to be
        promoted, not for a long time (1,270 parsers, about 2.5 MiB, waited in one thread
        worker after a c=500 Connection: close run). Nothing is parsed after this."""
        del self._parser

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

    def request_ready(self, enough: int, continued: bool = False) -> bool:
        """Is the request at the head of the queue ready to serve without waiting on its
        client: its head with its whole body or at least ``enough`` bytes of it, or a head
        that waits for ``100 Continue`` (unless ``continued``: the poller sent it, and gathers
        the body), or an error to answer? (The sync and thread workers' poll loops ask, so
        that a slow client never holds the worker or a request thread.)"""
        events = self._events
        if not events:
            return False
        head = events[0]
        if (type(head) is not Request or not head.has_body or not enough
                or (head.expect_continue and not continued)):
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

    @property
    def method_undecided(self) -> bool:
        """llhttp refused the method, and whether it is a token (501) or not (400) shows
        only in the next read (see _refuse_method)."""
        return self._bad_method

    def refusing_head(self, refused: bool = False) -> bool:
        """Is the request being read a HEAD (its answer has no body)? ``refused``: llhttp or
        a limit refused it (an HTTPError), which it does only once the method has matched
        unless the method itself was refused; else (a timeout) the method is known once the
        target began. Before that, llhttp's method is the previous request's."""
        if not (self._in_head or self._in_body):
            return False
        known = not self._bad_method if refused else bool(self._url_parts)
        return known and self._parser.get_method() == b"HEAD"

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
        if self._bad_method:
            self._probe += data[:_PROBE]  # llhttp refused the method: is it a token?
            self._refuse_method()
            return
        idle = not self._in_head and not self._in_body
        if idle:
            self._probe = data  # the start of the next request: kept to tell 400 from 501
            self._began_here = False
        elif self._in_head and not self._url_len and len(self._probe) < 2 * _PROBE:
            self._probe += data[:_PROBE]
        self._body_last = False
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
            self._bad_method = True
            self._refuse_method()
            return
        except httptools.HttpParserInvalidURLError:
            raise HTTPError(400, "Bad request target") from None
        except httptools.HttpParserError as exc:
            raise HTTPError(400, _reason(exc)) from None
        if self._in_head or self._in_body or data[-1:] != b"\n":
            self._measure_line(data)
        else:
            self._line = 0  # the read ended with a request's last LF (the usual case): as measured
        if self._in_head:
            if self._began_here:
                # The head began inside this feed: count what it holds so far, not the bytes
                # of an earlier pipelined request. The unfinished field is counted from the
                # next feed on, so an endless field is cut at most one read past the limit.
                self._began_here = False
                self._head_bytes = self._url_len + self._field_bytes
            else:
                self._head_bytes += len(data)
            if self._head_bytes > self.limits.head:
                # A long target is caught in on_url (414); what overflows here are fields.
                raise HTTPError(431, "Request header fields too large")

    def _refuse_method(self) -> None:
        """llhttp refused the method: 501 for a well-formed method we do not implement (RFC
        9110 §9.1), 400 for bytes that are no method at all (a TLS hello, garbage). Which it
        is shows only once the token ends (a space: 501; any other byte, or no end within
        ``_PROBE`` bytes: 400): until then this waits for more, so that the answer does not
        depend on where the client's reads split the line."""
        probe = self._probe.lstrip(b"\r\n")[:_PROBE]
        match = _TOKEN.match(probe)
        end = match.end() if match else 0
        if end and end < len(probe) and probe[end] == 0x20:
            raise HTTPError(501, "Method not implemented")
        if end == len(probe) < _PROBE:
            return  # the token may go on: decided by the next read (or the head's timeout)
        raise HTTPError(400, "Bad request line")

    def _measure_line(self, data: bytes) -> None:
        """Bound the line llhttp is in the middle of, after each read, without parsing.

        In a head, a chunk-size line or a trailer section, every LF ends a line (llhttp
        refuses a bare LF, and obs-fold), so what follows the read's last LF is the start of
        the unfinished line; with no LF, the read continues the line of the read before.
        Body data can hold any byte, so when body data was the last thing in the read, the
        line measure starts over: the next line begins in a later read (after the data, or
        after the next request's first read, which the head limit counts). The measure is
        an upper bound: llhttp keeps nothing of an OWS run it skips, but it counts."""
        if self._body_last:
            self._line = 0
            return
        end = data.rfind(b"\n")
        line = self._line + len(data) if end < 0 else len(data) - end - 1
        self._line = line
        if line > self.limits.line:
            self._line = 0
            if self._in_head or not self._in_body:
                raise HTTPError(431, "Request header line too long")
            if self._after_chunk_size:
                raise HTTPError(431, "Request trailer line too long")
            raise HTTPError(400, "Chunk size line too long")

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
        self._url_parts = []
        self._url_len = 0
        self._url_room = 0
        self._headers = []
        self._field_bytes = 0
        self._trailers = 0
        self._content_length = None
        self._te = None
        self._hosts = 0
        self._host = b""
        self._content_types = 0
        self._expect = False
        self._close = False
        self._body_bytes = 0
        self._after_chunk_size = False

    def on_url(self, url: bytes) -> None:
        if not self._url_parts:
            # limit_request_line limits the whole line: method SP target SP HTTP/x.y (the
            # version is always 8 bytes: llhttp takes no other form). The method is known
            # once the target begins.
            self._url_room = self.limits.request_line - len(self._parser.get_method()) - 10
        self._url_parts.append(url)
        self._url_len += len(url)
        if self._url_len > self._url_room:
            raise HTTPError(414, "Request line too long")

    def on_header(self, name: bytes, value: bytes) -> None:
        self._body_last = False
        value = value.rstrip(b" \t")  # llhttp strips leading OWS only (RFC 9110 §5.5)
        limits = self.limits
        size = len(name) + len(value)
        if size > limits.field_size:
            raise HTTPError(431, "Request header field too large")
        if not self._in_head:
            # A chunked trailer field: not passed on to WSGI, but counted as the head's
            # fields are (it costs the same to receive), and refused if it is one a trailer
            # must not carry.
            self._trailers += 1
            if len(self._headers) + self._trailers > limits.fields:
                raise HTTPError(431, "Too many request header and trailer fields")
            if name.lower() in _FORBIDDEN_TRAILERS:
                raise HTTPError(400, "A field that is not allowed in a trailer section")
            return
        headers = self._headers
        if len(headers) >= limits.fields:
            raise HTTPError(431, "Too many request header fields")
        headers.append((name, value))
        self._field_bytes += size + 4
        lname = name.lower()
        if lname not in _FRAMING_FIELDS:
            return  # (most fields: one set lookup, not six comparisons)
        if lname == b"content-length":
            self._content_length = int(value)
        elif lname == b"transfer-encoding":
            self._te = value if self._te is None else self._te + b"," + value
        elif lname == b"host":
            self._hosts += 1
            self._host = value
        elif lname == b"content-type":
            self._content_types += 1
        elif lname == b"expect":
            self._expect = value.strip().lower() == b"100-continue"
        elif lname == b"connection" and not self._close:
            # llhttp reads only some shapes ("keep-alive, close" on HTTP/1.0 keeps the
            # connection alive, as does a second Connection field): a close token anywhere,
            # in any Connection field, closes (RFC 9112 §9.6).
            value = value.lower()
            self._close = value == b"close" or b"close" in value and b"close" in [
                token.strip() for token in value.split(b",")]

    def on_headers_complete(self) -> None:
        self._in_head = False
        self._in_body = True
        self._body_last = False
        parser = self._parser
        version = parser.get_http_version()
        if version not in ("1.1", "1.0"):
            raise HTTPError(505, "HTTP version not supported")
        if self._hosts > 1 or (self._hosts == 0 and version == "1.1"):
            raise HTTPError(400, "A request needs exactly one Host header")
        if self._hosts and self._host not in _VALID_HOSTS:
            if not _valid_host(self._host):
                raise HTTPError(400, "Invalid Host header")  # RFC 9110 §7.2, RFC 9112 §3.2
            if len(_VALID_HOSTS) < HOSTS_KEPT and len(self._host) <= HOST_KEPT_BYTES:
                _VALID_HOSTS.add(self._host)
        if self._content_types > 1:
            # A singleton field (RFC 9110 §8.3): joined with a comma (RFC 9110 §5.3) it would
            # be a media type no one sent, and which one counts would be the reader's guess.
            raise HTTPError(400, "More than one Content-Type header")
        chunked = False
        if self._te is not None:
            if version == "1.0":
                # RFC 9112 §6.1: an HTTP/1.0 recipient of Transfer-Encoding "MUST treat the
                # message as if the framing is faulty": a 1.0 intermediary may have passed on
                # a coding it did not decode, so neither framing can be trusted.
                raise HTTPError(400, "Transfer-Encoding in an HTTP/1.0 request")
            codings = [c.strip().lower() for c in self._te.split(b",") if c.strip()]
            if codings != [b"chunked"]:
                raise HTTPError(501, "Transfer coding not implemented")
            chunked = True
        limit = self.limits.body
        if limit and self._content_length is not None and self._content_length > limit:
            raise HTTPError(413, "Request body too large")
        parts = self._url_parts
        target = parts[0] if len(parts) == 1 else b"".join(parts)
        method_bytes = parser.get_method()
        method = _METHOD_NAMES.get(method_bytes) or method_bytes.decode("ascii")
        if method == "CONNECT":
            # A tunnel, for proxies (RFC 9110 §9.3.6), in authority-form only (RFC 9112
            # §3.2.3): an application server serves none ("CONNECT /" reached the app).
            raise HTTPError(400, "CONNECT is for proxies")
        if target[:1] == b"*" and (target != b"*" or method != "OPTIONS"):
            # RFC 9112 §3.2.4: asterisk-form is a lone "*", and only for OPTIONS; "*/x" or
            # "*.x" is no form at all (it would reach the app as PATH_INFO "*/x").
            raise HTTPError(400, "Asterisk-form is a lone * and only for OPTIONS")
        self._events.append(Request(
            method, target, version, self._headers,
            parser.should_keep_alive() and not self._close,
            self._content_length, chunked, self._expect and version == "1.1"))

    def on_body(self, body: bytes) -> None:
        self._body_last = True
        self._after_chunk_size = False
        limit = self.limits.body
        if limit:
            self._body_bytes += len(body)
            if self._body_bytes > limit:
                raise HTTPError(413, "Request body too large")
        self._events.append(body)

    def on_chunk_header(self) -> None:
        # A chunk-size line ended. If the chunk has data, on_body follows; if it was the last
        # chunk, the trailer section does.
        self._body_last = False
        self._after_chunk_size = True

    def on_chunk_complete(self) -> None:
        self._body_last = False
        self._after_chunk_size = False

    def on_message_complete(self) -> None:
        # _body_last is left as it is: a Content-Length body ends on its data, not on an LF.
        self._in_body = False
        self._events.append(END)


def _valid_host(value: bytes) -> bool:
    match = _HOST.fullmatch(value)
    if match is None:
        return False
    literal = match.group("ipv6")
    if literal is None:
        return True
    try:
        ipaddress.IPv6Address(literal.decode("ascii"))
    except ValueError:
        return False
    return True


def _reason(exc: Exception) -> str:
    text = str(exc).strip() or "Bad request"
    return text[:1].upper() + text[1:]
