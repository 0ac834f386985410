"""PEP 3333: the environ, ``wsgi.input``, ``start_response``, ``write`` and the iterable.

Owns: turning a parsed :class:`~forkserve.http.Request` into an environ, the start_response
and exc_info rules, and handing what the app yields to the body writer of
:mod:`forkserve.http.writers`, which frames it (Content-Length, chunked, close-delimited;
nothing for HEAD, 1xx, 204, 304); the head is built by ``forkserve.http.response``. It
talks to the connection only through a small *transport* object (``send``, ``sendfile``,
``read_body``, ``should_close``), so it imports no sockets and no workers.
"""

from __future__ import annotations

import os
import stat
from typing import Any, Callable, Iterable, NoReturn, Protocol
from urllib.parse import unquote_to_bytes

from forkserve.http import HTTPError, Request
from forkserve.http.response import (CONNECTION_CLOSE, CONNECTION_KEEP_ALIVE, HOP_BY_HOP, SERVER,
                                     DateCache, check_header, parse_status, status_and_headers)
from forkserve.http.writers import BodyWriter, ContentLengthWriter, body_writer

SERVER_FIELD = b"\r\nServer: " + SERVER + b"\r\n"  # follows the Date value in every head


class Transport(Protocol):
    continue_sent: bool

    def send(self, data: bytes) -> None: ...
    def send_last(self, data: bytes, close_next: bool = False) -> None: ...
    def sendfile(self, fileno: int, offset: int, count: int) -> int: ...
    def read_body(self) -> bytes: ...
    def should_close(self) -> bool: ...


class AppError(Exception):
    """The application broke the WSGI contract (no start_response, bad body type, ...)."""


class ClientGone(Exception):
    """The client closed or reset the connection while we were writing to it."""


# -- the client's socket, for an app that takes the connection over (WebSockets) ----------------

class Upgradable(Protocol):
    sock: Any

    def take_over(self) -> Any: ...


class UpgradeRefused(RuntimeError):
    """The app tried to take the connection over (a WebSocket upgrade) on a worker that
    cannot give it one: the sync worker serves one connection at a time."""


# What an app may look up on the socket without taking the connection over: its addresses,
# options, TLS parameters. Anything else (send, recv, fileno, close, makefile, setblocking...)
# is I/O, and hands the connection to the app.
LOOKUPS = frozenset({"family", "type", "proto", "getpeername", "getsockname", "getsockopt",
                     "gettimeout", "getblocking", "getpeercert", "cipher", "shared_ciphers",
                     "version", "selected_alpn_protocol", "compression", "server_side",
                     "server_hostname", "context", "session", "session_reused"})


class ClientSocket:
    """``environ["gunicorn.socket"]`` and ``environ["werkzeug.socket"]``, on a request that
    asks for an upgrade (``Connection: Upgrade`` and ``Upgrade``): the client's socket (an ``ssl.SSLSocket``
    over TLS), for an app that takes the connection over, as WebSocket libraries do
    (simple-websocket, flask-sock). A stand-in that hands the socket over on first use: any
    attribute but a look-up (``LOOKUPS``, or a name that begins with ``_``) makes the
    connection the app's, and is then the socket's own. From then on the server writes no
    response of its own (what the app returns or writes through start_response is dropped),
    reads no more requests on the connection, and closes it once the app returns; the socket
    is blocking (cooperatively, under gevent). A stand-in rather than the socket itself so
    that the server knows, exactly and at no cost to other requests, that the app took it.
    With ``refuse`` (the sync worker) taking it calls ``refuse``, which raises."""

    __slots__ = ("_transport", "_refuse")

    def __init__(self, transport: Upgradable,
                 refuse: Callable[[], NoReturn] | None = None) -> None:
        self._transport = transport
        self._refuse = refuse

    def __getattr__(self, name: str) -> Any:
        if name in LOOKUPS or name[:1] == "_":
            return getattr(self._transport.sock, name)
        if self._refuse is not None:
            self._refuse()
        return getattr(self._transport.take_over(), name)

    def __repr__(self) -> str:
        return f"<forkserve.ClientSocket of {self._transport.sock!r}>"


# -- wsgi.input ---------------------------------------------------------------------------------

class Input:
    """``wsgi.input``: the request body, streamed from the connection as the app reads it.

    Reading past the end returns ``b""`` (``wsgi.input_terminated`` is true).
    """

    __slots__ = ("_transport", "_buffer", "_done")

    def __init__(self, transport: Transport | None) -> None:
        self._transport = transport
        self._buffer = b""
        self._done = transport is None

    def _piece(self) -> bytes:
        """The body's next piece from the connection; b"" at its end."""
        if self._done:
            return b""
        data = self._transport.read_body()  # type: ignore[union-attr]
        if not data:
            self._done = True
        return data

    def _fill(self) -> bool:
        data = self._piece()
        self._buffer += data
        return bool(data)

    def read(self, size: int | None = -1) -> bytes:
        # Pieces joined once: growing one bytes object piece by piece copies it each time
        # (quadratic: a 100 MiB body read whole is 1,600 pieces of 64 KiB).
        if size is None or size < 0:
            parts = [self._buffer]
            while data := self._piece():
                parts.append(data)
            self._buffer = b""
            return b"".join(parts)
        buffered = len(self._buffer)
        if buffered < size:
            parts = [self._buffer]
            while buffered < size and (data := self._piece()):
                parts.append(data)
                buffered += len(data)
            self._buffer = b"".join(parts)
        data, self._buffer = self._buffer[:size], self._buffer[size:]
        return data

    def readline(self, size: int | None = -1) -> bytes:
        limit = -1 if size is None else size
        start = 0
        while True:
            index = self._buffer.find(b"\n", start)
            if index >= 0:
                end = index + 1
                break
            if 0 <= limit <= len(self._buffer):
                end = limit
                break
            start = len(self._buffer)
            if not self._fill():
                end = len(self._buffer)
                break
        if 0 <= limit < end:
            end = limit
        line, self._buffer = self._buffer[:end], self._buffer[end:]
        return line

    def readlines(self, hint: int = -1) -> list[bytes]:
        lines: list[bytes] = []
        total = 0
        while True:
            line = self.readline()
            if not line:
                return lines
            lines.append(line)
            total += len(line)
            if 0 < hint <= total:
                return lines

    def __iter__(self) -> "Input":
        return self

    def __next__(self) -> bytes:
        line = self.readline()
        if not line:
            raise StopIteration
        return line

    @property
    def finished(self) -> bool:
        return self._done


# wsgi.input of every request without a body: reading it changes nothing (it is at its end,
# its buffer stays empty), so one serves all, in every thread, and none is built per request.
NO_BODY = Input(None)


class ErrorStream:
    """``wsgi.errors``: text the app writes goes to the error log's descriptor."""

    def __init__(self, fileno: Callable[[], int]) -> None:
        self._fileno = fileno

    def write(self, text: str) -> int:
        data = text.encode("utf-8", "backslashreplace")
        try:
            os.write(self._fileno(), data)
        except OSError:
            return 0  # a full disk or closed stderr must not fail the request
        return len(text)

    def writelines(self, lines: Iterable[str]) -> None:
        for line in lines:
            self.write(line)

    def flush(self) -> None:
        return None


class FileWrapper:
    """``wsgi.file_wrapper``: served with ``os.sendfile`` when the file has a descriptor."""

    def __init__(self, filelike: Any, blksize: int = 65536) -> None:
        self.filelike = filelike
        self.blksize = blksize
        closer = getattr(filelike, "close", None)
        if closer is not None:
            self.close = closer

    def __iter__(self) -> "FileWrapper":
        return self

    def __next__(self) -> bytes:
        data: bytes = self.filelike.read(self.blksize)
        if data:
            return data
        raise StopIteration

    def sendfile_span(self) -> tuple[int, int, int] | None:
        """(fd, offset, size) when the file is a regular file we can sendfile from."""
        try:
            fd = self.filelike.fileno()
            info = os.fstat(fd)
            offset = self.filelike.tell()
        except (AttributeError, OSError, ValueError):
            return None
        if not stat.S_ISREG(info.st_mode):
            return None
        return fd, offset, max(info.st_size - offset, 0)


# -- the environ --------------------------------------------------------------------------------

def base_environ(server_name: str, server_port: str, errors: ErrorStream,
                 multithread: bool = False) -> dict[str, Any]:
    """Keys that are the same for every request on one listener of one worker."""
    return {
        "SERVER_NAME": server_name,
        "SERVER_PORT": server_port,
        "SCRIPT_NAME": os.environ.get("SCRIPT_NAME", ""),
        "SERVER_SOFTWARE": "forkserve",
        "wsgi.version": (1, 0),
        "wsgi.url_scheme": "http",
        "wsgi.errors": errors,
        "wsgi.multithread": multithread,
        "wsgi.multiprocess": True,
        "wsgi.run_once": False,
        "wsgi.input_terminated": True,
        "wsgi.file_wrapper": FileWrapper,
    }


class HeaderKeys(dict):  # type: ignore[type-arg]
    """Per-worker cache of header name -> environ key (``User-Agent`` -> ``HTTP_USER_AGENT``).

    Names with ``_`` map to None and are dropped: ``X-Forwarded_For`` must not be able to
    pose as ``X-Forwarded-For`` (the same rule as nginx and gunicorn).
    """

    def __missing__(self, name: bytes) -> str | None:
        if len(self) > 1000:
            self.clear()  # bounded: a client sending random names cannot grow it forever
        text = name.decode("latin-1")
        if "_" in text:
            key = None
        else:
            key = text.upper().replace("-", "_")
            if key not in ("CONTENT_TYPE", "CONTENT_LENGTH"):
                key = "HTTP_" + key
        self[name] = key
        return key


# What start_response found of one status and headers list: the status code, the headers
# kept (the hop-by-hop ones are the server's), the app's Content-Length, the head's start
# (status_and_headers), whether the body is an event stream, and whether the app said close.
Checked = tuple[int, tuple[tuple[str, str], ...], "int | None", bytes, bool, bool]


class CheckedHeads(dict):  # type: ignore[type-arg]
    """Per-worker: the status and headers lists start_response has checked, by value
    (``(status, *headers)``), and what it found (:data:`Checked`). Checking one (two regular
    expressions a header, the status's two, the head's encoding) cost more than the rest of
    start_response; an app sends the same few lists again and again. Bounded like
    :class:`HeaderKeys`: an app whose headers differ every time (an ETag, a cookie) only
    refills it."""

    LIMIT = 256

    def check(self, status: str, headers: list[tuple[str, str]]) -> Checked:
        """PEP 3333's rules for a status and headers (ValueError, TypeError or AppError for
        anything an app must not send, the status first); the result is kept."""
        code = parse_status(status)
        if code < 200:
            # An interim status as the whole response would desync the connection: the client
            # takes it as interim and the next response as this one's.
            raise AppError(f"a WSGI app cannot send the interim status {status!r}")
        if type(headers) is not list:
            raise TypeError(f"headers must be a list, got {type(headers).__name__}")
        content_length = None
        event_stream = close = False
        kept = []
        for item in headers:
            if type(item) is not tuple or len(item) != 2:
                raise TypeError(f"each header must be a (name, value) tuple, got {item!r}")
            name, value = item
            check_header(name, value)
            lname = name.lower()
            if lname == "content-length":
                if not value.strip().isdigit():
                    raise ValueError(f"invalid Content-Length {value!r}")
                content_length = int(value)
                continue
            if lname == "content-type" and value.startswith("text/event-stream"):
                event_stream = True
            if lname in HOP_BY_HOP:
                if lname == "connection" and "close" in value.lower():
                    close = True
                continue  # the server frames the message and manages the connection
            kept.append(item)
        checked = (code, tuple(kept), content_length, status_and_headers(status, kept),
                   event_stream, close)
        if len(self) >= self.LIMIT:
            self.clear()
        key = (status, *headers)
        self[key] = checked
        return checked


def build_environ(request: Request, base: dict[str, Any], keys: HeaderKeys,
                  remote: tuple[str, str], wsgi_input: Input) -> dict[str, Any]:
    environ = base.copy()
    path = request.path
    if path.find(b"%") >= 0:  # (not `b"%" in path`: on bytes, that raises and clears a TypeError)
        path = unquote_to_bytes(path)
    environ["REQUEST_METHOD"] = request.method
    environ["PATH_INFO"] = path.decode("latin-1")
    environ["QUERY_STRING"] = request.query.decode("latin-1")
    environ["RAW_URI"] = request.target.decode("latin-1")
    environ["SERVER_PROTOCOL"] = "HTTP/1.1" if request.version == "1.1" else "HTTP/1.0"
    environ["REMOTE_ADDR"], environ["REMOTE_PORT"] = remote
    environ["wsgi.input"] = wsgi_input
    for name, value in request.headers:
        key = keys[name]
        if key is None:
            continue
        text = value.decode("latin-1")
        if key in environ:
            # Repeated fields combine with a comma (RFC 9110 §5.3); cookies with "; ".
            text = environ[key] + ("; " if key == "HTTP_COOKIE" else ", ") + text
        environ[key] = text
    return environ


# -- running the application --------------------------------------------------------------------

class Exchange:
    """One request and its response: start_response, write(), and handing the body to the
    writer :func:`~forkserve.http.writers.body_writer` chose for it."""

    __slots__ = ("transport", "request", "dates", "heads", "status", "status_code", "headers",
                 "head_start", "headers_sent", "content_length", "writer", "close", "framing_broken",
                 "finished", "event_stream")

    def __init__(self, transport: Transport, request: Request, dates: DateCache,
                 heads: CheckedHeads) -> None:
        self.transport = transport
        self.request = request
        self.dates = dates
        self.heads = heads
        self.status: str | None = None
        self.status_code = 0
        self.headers: tuple[tuple[str, str], ...] = ()  # the app's, less the hop-by-hop ones
        self.head_start = b""  # the status line and those headers (status_and_headers)
        self.headers_sent = False
        self.content_length: int | None = None  # the application's Content-Length, if any
        self.writer: BodyWriter | None = None  # chosen when the head goes
        self.close = not request.keep_alive
        self.framing_broken = False  # the app wrote more or less than its Content-Length
        self.finished = False  # the response is complete (the end, or finish_request)
        self.event_stream = False  # text/event-stream: ends at an event boundary on a drain

    @property
    def sent(self) -> int:
        """Body bytes of this response written so far."""
        writer = self.writer
        return 0 if writer is None else writer.sent

    # PEP 3333 start_response -----------------------------------------------------------
    def start_response(self, status: str, headers: list[tuple[str, str]],
                       exc_info: Any = None) -> Callable[[bytes], None]:
        if exc_info:
            try:
                if self.headers_sent:
                    raise exc_info[1].with_traceback(exc_info[2])
            finally:
                exc_info = None  # no reference cycle through the traceback
        elif self.status is not None:
            raise AppError("start_response called a second time without exc_info")
        # The same status and headers as an earlier response of this worker's (an app sends
        # the same few again and again): checked then, so one lookup now. Only values that
        # passed the check are ever stored, and a key equals only values equal to them.
        checked = None
        if type(headers) is list:
            try:
                checked = self.heads.get((status, *headers))
            except TypeError:  # an unhashable item (a list, not a tuple): check() says so
                checked = None
        if checked is None:
            checked = self.heads.check(status, headers)
        code, self.headers, self.content_length, self.head_start, event_stream, close = checked
        self.status = status
        self.status_code = code
        if event_stream:
            self.event_stream = True
        if close:
            self.close = True
        return self.write

    # body -------------------------------------------------------------------------------
    def _respond(self, known: int | None, body: bytes = b"", whole: bool = False,
                 exact: bool = False) -> bytes:
        """Decide the framing and whether the connection closes; return the head with
        ``body`` framed after it (the whole body when ``whole``, else its first piece).

        ``known`` is the body's length when it is known; ``exact`` says it is also what a
        GET would send (a file), so a HEAD may announce it too.
        """
        status = self.status
        if status is None:
            raise AppError("the application did not call start_response")
        request = self.request
        if not self.close:
            if request.expect_continue and request.has_body and not self.transport.continue_sent:
                # Answering without asking for the body: the connection will close, so say
                # so (RFC 9110 §10.1.1).
                self.close = True
            elif self.transport.should_close():
                self.close = True
        writer = self.writer = body_writer(self.status_code, request.method, request.version,
                                           self.content_length, known, exact)
        if writer.closes:
            self.close = True
        self.headers_sent = True
        if body:
            body = writer.whole(body) if whole else writer.frame(body)
        elif whole:
            body = writer.end()
        if self.close:
            connection = CONNECTION_CLOSE
        else:  # an HTTP/1.0 client is told the connection stays (RFC 9112 §9.3)
            connection = CONNECTION_KEEP_ALIVE if request.version == "1.0" else b""
        # (response_head's join, with the head's start already serialised)
        head = b"".join((self.head_start, writer.header, connection, b"Date: ", self.dates.get(),
                         SERVER_FIELD, b"\r\n", body))
        if writer.broken:
            # The head went before the body broke its framing, so it does not say close.
            self.close = self.framing_broken = True
        return head

    def write(self, data: bytes) -> None:
        """The write() callable, and each item of the app's iterable."""
        if self.finished:
            return  # after finish_request() output is dropped, as in PHP-FPM
        if type(data) is not bytes:
            if not isinstance(data, (bytearray, memoryview)):
                raise AppError(f"the application yielded {type(data).__name__}, not bytes")
            data = bytes(data)
        writer = self.writer
        if writer is None:
            if data:  # PEP 3333: headers wait for the first non-empty body chunk
                self.transport.send(self._respond(None, data))
            return
        if data:
            framed = writer.frame(data)
            if writer.broken:
                # More than its Content-Length: what was promised goes, then the connection
                # closes, so nothing past it can be taken as the next response.
                self.close = self.framing_broken = True
            if framed:
                self.transport.send(framed)

    def send_whole(self, body: bytes, close_next: bool = False) -> None:
        """The whole body known at once (a list or tuple): one send, with a Content-Length.
        ``close_next``: the caller closes the connection right after, with nothing in
        between, if this response ends it (see Connection.send_last)."""
        if self.finished:
            return
        if self.writer is not None:
            self.write(body)
            self.finish()
            return
        self.finished = True
        head = self._respond(len(body), body, whole=True)
        # The whole response: a slow reader's rest may be left to the worker (send_last).
        self.transport.send_last(head, close_next and self.close)

    def send_file(self, wrapper: FileWrapper) -> bool:
        """Serve a FileWrapper with sendfile; False when it must be iterated instead."""
        if self.finished:
            return True  # (the app took the connection over: nothing of ours goes out)
        span = wrapper.sendfile_span()
        if span is None or self.writer is not None:
            return False
        fd, offset, size = span
        if self.content_length is not None:
            size = min(size, self.content_length)
        self.transport.send(self._respond(size, exact=True))
        writer = self.writer
        if not isinstance(writer, ContentLengthWriter) or size == 0:
            return True  # no body (HEAD): a known length always gives a Content-Length
        sent = self.transport.sendfile(fd, offset, size)
        writer.sent += sent
        try:
            wrapper.filelike.seek(offset + sent)
        except (AttributeError, OSError, ValueError):
            self.close = True  # position unknown; nothing else depends on it
        return True

    def finish(self) -> None:
        """The iterable is exhausted: send headers if none went yet, and the body's end."""
        if self.finished:
            return
        self.finished = True
        writer = self.writer
        if writer is None:
            self.transport.send(self._respond(0, whole=True))
            return
        tail = writer.end()
        if writer.broken:
            # Fewer bytes than its Content-Length: the client sees a truncated body; close so
            # it does not wait for the rest on a kept-alive connection.
            self.close = self.framing_broken = True
        if tail:
            self.transport.send(tail)


__all__ = ["AppError", "CheckedHeads", "ClientGone", "ClientSocket", "ErrorStream", "Exchange", "FileWrapper",
           "HeaderKeys", "Input", "Transport", "Upgradable", "UpgradeRefused", "base_environ",
           "build_environ", "HTTPError"]
