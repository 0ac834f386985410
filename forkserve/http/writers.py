"""Response body framing: one writer per way a body can be delimited (RFC 9112 §6.3).

Owns: choosing the framing of a response (``body_writer``) and framing its body piece by piece.
Each writer knows the field it puts in the head (``header``), how to frame a piece
(``frame``), how to end (``end``), how many body bytes it framed (``sent``), and whether the
body broke its framing (``broken``: more or less than its Content-Length). The shape is
h11's ``_writers.py``; unlike h11, a body that breaks its framing does not raise: what was
promised is sent, the rest dropped, and the caller closes the connection, so nothing can be
taken as the next response.

Pure code over bytes: no sockets, WSGI or workers; it imports only forkserve.http.
"""

from __future__ import annotations

from forkserve.http.response import LAST_CHUNK, NO_BODY_STATUS, chunk

TRANSFER_ENCODING_CHUNKED = b"Transfer-Encoding: chunked\r\n"


class BodyWriter:
    """Frames one response body. The base passes pieces through as they are."""

    __slots__ = ("sent", "broken")

    header = b""  # the framing field for the head, serialised
    closes = False  # True: only the close of the connection tells where the body ends

    def __init__(self) -> None:
        self.sent = 0  # body bytes framed so far (sendfile adds what it sent)
        self.broken = False  # more or fewer body bytes than the head announced

    def frame(self, data: bytes) -> bytes:
        """``data`` as it goes on the wire."""
        self.sent += len(data)
        return data

    def end(self) -> bytes:
        """What ends the body on the wire (the last chunk, else nothing)."""
        return b""

    def whole(self, data: bytes) -> bytes:
        """The whole body at once: ``frame(data)`` then ``end()``."""
        return self.frame(data) + self.end()


class CloseDelimitedWriter(BodyWriter):
    """HTTP/1.0 with no length known: the body runs to the close (RFC 9112 §6.3 item 8)."""

    __slots__ = ()

    closes = True


class ChunkedWriter(BodyWriter):
    """HTTP/1.1 with no length known: chunked (RFC 9112 §7.1)."""

    __slots__ = ()

    header = TRANSFER_ENCODING_CHUNKED

    def frame(self, data: bytes) -> bytes:
        if not data:
            return b""  # an empty chunk is the last chunk: only end() may send it
        self.sent += len(data)
        return chunk(data)

    def end(self) -> bytes:
        return LAST_CHUNK


class ContentLengthWriter(BodyWriter):
    """A body of a length announced in the head."""

    __slots__ = ("length", "header")

    def __init__(self, length: int) -> None:
        self.sent = 0
        self.broken = False
        self.length = length
        self.header = b"Content-Length: %d\r\n" % length

    def frame(self, data: bytes) -> bytes:
        room = self.length - self.sent
        if len(data) > room:
            # More than promised: what was promised goes out, the rest is dropped, and the
            # connection closes, so nothing past the length can be taken as the next response.
            data = data[:room]
            self.broken = True
        self.sent += len(data)
        return data

    def end(self) -> bytes:
        if self.sent < self.length:
            # Fewer bytes than promised: the client sees a truncated body; the connection
            # closes so it does not wait for the rest on a kept-alive connection.
            self.broken = True
        return b""

    def whole(self, data: bytes) -> bytes:
        # The hello-world path: one call, not frame() and end().
        room = self.length - self.sent
        if len(data) != room:
            if len(data) > room:
                data = data[:room]
            self.broken = True
        self.sent += len(data)
        return data


class NoBodyWriter(BodyWriter):
    """A response with no body: to HEAD (RFC 9110 §9.3.2), or a 1xx, 204 or 304 status
    (§6.4.1). Whatever the app yields is dropped; the head may still announce a length."""

    __slots__ = ("header",)

    def __init__(self, length: int | None) -> None:
        self.sent = 0
        self.broken = False
        self.header = b"" if length is None else b"Content-Length: %d\r\n" % length

    def frame(self, data: bytes) -> bytes:
        return b""

    def whole(self, data: bytes) -> bytes:
        return b""


def body_writer(status: int, method: str, version: str, declared: int | None,
                known: int | None = None, exact: bool = False) -> BodyWriter:
    """The writer for a response's body.

    ``declared`` is the Content-Length the application gave; ``known`` the body's length when
    the server knows it before the head goes (a whole body, a file); ``exact`` says ``known``
    is also what a GET would send (a file), so a HEAD may announce it too.
    """
    if status < 200 or status in NO_BODY_STATUS or method == "HEAD":
        if status in NO_BODY_STATUS:
            return NoBodyWriter(None)  # RFC 9110 §8.6: no Content-Length on 204 (or a 304's)
        return NoBodyWriter(known if declared is None and exact else declared)
    length = known if declared is None else declared
    if length is not None:
        return ContentLengthWriter(length)
    if version == "1.1":
        return ChunkedWriter()
    return CloseDelimitedWriter()
