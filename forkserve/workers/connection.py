"""One client connection in a worker: non-blocking socket I/O with deadlines, the parser, and
the transport that :mod:`forkserve.wsgi` writes through.

The socket is non-blocking and every read or write is tried first and polled only when the
kernel says EAGAIN: a ready socket costs one syscall, not a poll plus the call (which is what
``socket.settimeout`` does in CPython). Deadlines are absolute ``time.monotonic()`` values.
"""

from __future__ import annotations

import enum
import os
import select
import socket
import time
from typing import TYPE_CHECKING, Any, Callable

from forkserve.http import END, HTTPError, Limits, Request, RequestParser
from forkserve.http import proxy_protocol
from forkserve.http.proxy_protocol import ProxyProtocolError
from forkserve.http.response import CONTINUE
from forkserve.wsgi import ClientGone

if TYPE_CHECKING:
    from forkserve.wsgi import Exchange

RECV_SIZE = 65536
# What a connection's reads ask for until one fills it (a large head, a body streaming in):
# then RECV_SIZE, for the rest of the connection. A read allocates what it asks for and
# shrinks it to what came; 64 KiB buffers for requests of a few hundred bytes fragmented the C
# heap (a sync worker's grew by 2 MiB under load, and stayed so). gunicorn reads 8 KiB.
FIRST_READS = 8192
# A lingering close (Connection.close, Pipeline.close_later) drains what a client still sends
# for at most this long and this much: a client that keeps sending is cut then.
LINGER_TIME = 1.0
LINGER_BYTES = 4 * RECV_SIZE
MSG_PEEK_NOW = socket.MSG_PEEK | socket.MSG_DONTWAIT  # (Connection.sent_more)
MSG_MORE = getattr(socket, "MSG_MORE", 0)  # (Connection.send_last; Linux: 0x8000)
# After a response, at most this much of a body the app did not read is read and dropped to
# keep the connection; a larger rest costs less to the client as a reconnect.
DISCARD_LIMIT = 65536
# A write that waits this long for its client to take more is a slow reader's: where the worker
# parks such waits (Connection.park: the thread worker), the rest of the wait is parked.
PARK_AFTER = 0.1


class Timeout(Exception):
    """The client did not send (or take) data before the deadline."""


class Abandoned(Exception):
    """The worker is stopping and this wait is not worth finishing (a client that has not
    sent its request yet at drain start, or anything still waiting at the cancel)."""


class Phase(enum.Enum):
    """Where a connection is in its requests. Only the connection's own methods change it."""

    IDLE = "idle"  # accepted, or kept alive after a response: nobody is reading from it
    AWAITING = "awaiting a request"  # reading a head, none of it here yet: a stop may cut this short
    HEAD = "reading a request head"  # some of it here (or it was bad, late or cut off)
    REQUEST = "serving a request"  # ``exchange`` is set
    CLOSED = "closed"


IDLE, AWAITING, HEAD, REQUEST, CLOSED = Phase


class Connection:
    __slots__ = ("sock", "fd", "remote", "parser", "io_timeout", "exchange", "phase",
                 "continue_sent", "_continued", "_poll", "should_close", "released",
                 "interrupt_fd", "interrupted", "served", "cutoff", "owner", "waiting",
                 "idle_since",
                 "output_ended", "trusted", "peer", "_proxy", "_ssl", "_handshaking",
                 "_blocked_read", "_blocked_write", "_broken", "head_began", "_refusal",
                 "defer_writes", "unsent", "park", "taken", "read_size", "io")

    def __init__(self, sock: socket.socket, remote: tuple[str, str], limits: Limits,
                 io_timeout: float, should_close: Callable[[], bool] | None = None,
                 interrupt_fd: int = -1,
                 interrupted: Callable[[Connection], bool] | None = None,
                 trusted: bool = False, proxy_protocol: bool = False, tls: bool = False,
                 defer_writes: bool = False) -> None:
        sock.setblocking(False)
        self.sock = sock
        # What the hot path's recv and send call: the socket itself here; a gevent
        # connection's plain socket underneath gevent's (see GreenConnection).
        self.io: Any = sock
        self.fd = sock.fileno()
        self.remote = remote
        self.parser = RequestParser(limits)
        self.read_size = FIRST_READS  # (RECV_SIZE once a read fills it)
        self.io_timeout = io_timeout
        self.phase = IDLE
        self.exchange: Exchange | None = None  # the request being served (phase REQUEST)
        self.continue_sent = False
        self._continued = False  # gather() sent 100 Continue for the request it gathers
        self._poll: select.poll | None = None
        # Asked as a response head is written (wsgi.Exchange): close after this response?
        self.should_close = should_close or _never
        self.released = False  # finish_request() ended the response early (see release)
        # Waits also watch interrupt_fd (the worker's signal wakeup pipe, or its stop pipe);
        # when it fires, interrupted(self) says whether to abandon the wait.
        self.interrupt_fd = interrupt_fd
        self.interrupted = interrupted
        self.served = 0  # requests answered on this connection
        self.owner: Any = None  # the worker's: the greenlet or thread serving it
        self.waiting = False  # inside _wait: the thread worker's stop pipe reaches it there
        self.cutoff: float | None = None  # a stopping worker's limit on this wait (Abandoned)
        self.idle_since = 0.0  # monotonic time the last response ended (keep-alive idle)
        self.output_ended = False  # end_output() was called: nothing more can be sent
        self.head_began = 0.0  # monotonic time the current head's first byte came (0: none yet)
        self._refusal: HTTPError | None = None  # what gather() found bad, for read_head to raise
        # The worker writes out what a slow reader has not taken of a whole response (see
        # send_last): plain sockets only (a TLS write must be retried by the same caller).
        self.defer_writes = defer_writes and not tls
        self.unsent: memoryview | None = None
        # Called with True before, False after, a wait of a response's writer on a client
        # that has not taken more for PARK_AFTER (the thread worker: a spare thread serves
        # meanwhile; see ThreadWorker.park).
        self.park: Callable[[bool], None] | None = None
        # The app took the connection over (wsgi.ClientSocket: a WebSocket upgrade): it is the
        # app's until the app returns, then closed; nothing of ours is read or written on it.
        self.taken = False
        self.trusted = trusted  # the peer is a trusted proxy (see forkserve.proxy)
        self.peer: tuple[str, str] | None = None  # the balancer's address, once a PROXY header named the client
        # --proxy-protocol: what arrived so far while the first bytes may be a PROXY header
        # (None once it is known whether they are).
        self._proxy: bytes | None = b"" if proxy_protocol else None
        # TLS (the socket is an ssl.SSLSocket, its handshake not done yet): what "would block"
        # and "broken" mean then. Looked up here, not imported by this module: nothing may hold
        # a name from ssl before gevent patches it (and a sync worker need not load it).
        self._ssl: Any = None
        self._handshaking = False
        self._blocked_read: tuple[type[BaseException], ...] = (BlockingIOError,)
        self._blocked_write: tuple[type[BaseException], ...] = (BlockingIOError,)
        self._broken: tuple[type[BaseException], ...] = ()
        if tls:
            import ssl
            self._ssl, self._handshaking = ssl, True
            self._blocked_read = (BlockingIOError, ssl.SSLWantReadError)
            self._blocked_write = (BlockingIOError, ssl.SSLWantWriteError)
            self._broken = (ssl.SSLError,)

    @property
    def events(self) -> int:
        """How many parser events wait: non-zero when a pipelined request is already here."""
        return self.parser.pending()

    @property
    def received(self) -> bool:
        """Some of the current request head is here (its wait ended: it was bad, or late)."""
        return self.phase is HEAD

    @property
    def awaiting_request(self) -> bool:
        """Waiting for a request's first byte, with no stop cutoff yet."""
        return self.phase is AWAITING and self.cutoff is None

    @property
    def in_request(self) -> bool:
        return self.phase is REQUEST

    @property
    def closed(self) -> bool:
        return self.phase is CLOSED

    # -- the phases --------------------------------------------------------------------
    def cut_off(self, at: float) -> None:
        """A stopping worker waits for this request's first byte until ``at`` (Abandoned)."""
        self.cutoff = at

    def begin(self, exchange: Exchange) -> None:
        self.phase = REQUEST
        self.exchange = exchange

    def end_request(self) -> None:
        """The request is answered: the connection idles (kept alive) until its next one."""
        self.exchange = None
        if self.taken and self.park is not None:
            self.park(False)  # (see take_over)
        self.served += 1
        self.idle_since = time.monotonic()
        if self.phase is REQUEST:
            self.phase = IDLE

    def release(self) -> None:
        """finish_request(): the client sees the end of its response now; the app runs on,
        and the connection serves nothing more."""
        self.end_output()
        self.released = True

    def take_over(self) -> socket.socket:
        """-- may run in any of the app's threads. The app takes the connection (the first
        use of its wsgi.ClientSocket, in a WebSocket library's handshake): no output of the
        response in progress goes out any more (the app writes its own, the 101 first), and
        the socket, blocking now, is the app's until it returns (see close). Where a request
        thread waits on a slow client (``park``: the thread worker), a spare thread takes
        this one's place for as long as the app holds the connection."""
        if not self.taken:
            self.taken = True
            exchange = self.exchange
            if exchange is not None:
                exchange.finished = exchange.close = True
            self.sock.setblocking(True)
            if self.park is not None:
                self.park(True)
        return self.sock

    def cut(self) -> None:
        """-- may run in a signal handler. A taken connection at the drain deadline: shut down
        both ways, so that the app's waits on it end (a recv() blocked in one of its threads
        returns EOF; a WebSocket library's receive() raises ConnectionClosed) and the client
        sees the connection end. Not a close: the fd stays the app's until it returns."""
        try:
            if self.sock.fileno() >= 0:  # (-1: the app closed it itself)
                self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            return  # the client is gone already

    # -- waiting -------------------------------------------------------------------------
    def _wait(self, flag: int, deadline: float) -> None:
        poller = self._poll
        if poller is None:
            poller = self._poll = select.poll()
            poller.register(self.fd, select.POLLIN)
            if self.interrupt_fd >= 0:
                poller.register(self.interrupt_fd, select.POLLIN)
        poller.modify(self.fd, flag)
        self.waiting = True
        try:
            self._wait_loop(poller, deadline)
        finally:
            self.waiting = False

    def wait_left(self, deadline: float) -> float:
        """Seconds a wait may still last; Abandoned past a stop's cutoff, Timeout past
        ``deadline``. A stop's cutoff bounds only the wait for a request's first byte: a
        request that arrived within the grace is served to its end (its body, a slow
        reader)."""
        now = time.monotonic()
        cutoff = self.cutoff if self.phase is AWAITING else None
        if cutoff is not None and now >= cutoff:
            raise Abandoned()
        remaining = min(deadline, cutoff or deadline) - now
        if remaining <= 0:
            raise Timeout()
        return remaining

    def _wait_loop(self, poller: select.poll, deadline: float) -> None:
        while True:
            ready = poller.poll(self.wait_left(deadline) * 1000.0 + 1)
            for fd, _ in ready:
                if fd == self.fd:
                    return
                if self.interrupted is not None and self.interrupted(self):
                    raise Abandoned()

    def interrupt_on(self, fd: int) -> None:
        """Watch ``fd`` instead of the current interrupt fd (which stays readable once it
        fired: a wait must not spin on it); -1 to watch none."""
        if fd == self.interrupt_fd:
            return
        if self._poll is not None:
            if self.interrupt_fd >= 0:
                self._poll.unregister(self.interrupt_fd)
            if fd >= 0:
                self._poll.register(fd, select.POLLIN)
        self.interrupt_fd = fd

    def readable_now(self) -> bool:
        """Has the client sent something we have not read (a zero-timeout poll)?"""
        poller = select.poll()
        poller.register(self.fd, select.POLLIN)
        return bool(poller.poll(0))

    # -- reading -------------------------------------------------------------------------
    def recv(self, deadline: float) -> bool:
        """Read once and feed the parser. False at EOF. Raises Timeout, HTTPError."""
        if self._handshaking and not self.handshake(deadline):
            return False
        while True:
            try:
                data = self.io.recv(self.read_size)
            except self._blocked_read:
                self._wait(select.POLLIN, deadline)
                continue
            except self._blocked_write:  # (TLS: a renegotiation wants to write)
                self._wait(select.POLLOUT, deadline)
                continue
            except (ConnectionResetError, ConnectionAbortedError):
                return False
            except self._broken:  # a TLS record that does not decrypt, or no close_notify
                return False
            if not data:
                return False
            if len(data) == self.read_size:
                self.read_size = RECV_SIZE
            if self._take(data):
                return True

    def _take(self, data: bytes) -> bool:
        """Received bytes into the parser; False when they were only a PROXY header."""
        if self._proxy is not None:
            data = self._take_proxy_header(data)
            if not data:
                return False  # (a PROXY header alone is not yet a request: no byte "received")
        if self.phase is AWAITING:
            self.phase = HEAD
            self.head_began = time.monotonic()
        try:
            self.parser.feed(data)
        except HTTPError as exc:
            self.parser.fail(exc)  # raised again unless complete requests come first
        return True

    def gather(self, enough: int) -> bool:
        """Read what the client has sent so far, without waiting (the thread worker's poll loop,
        so that no request thread waits on a slow client). True once a thread should take
        over: the request is ready (RequestParser.request_ready: its head, and its body or
        ``enough`` of it), the client closed or broke off, or what came cannot be served
        (the thread answers that). Raises ProxyProtocolError (a refused PROXY header)."""
        parser = self.parser
        while True:
            if self._handshaking:
                ssl = self._ssl
                try:
                    self.sock.do_handshake()  # type: ignore[attr-defined]  # an SSLSocket
                except ssl.SSLWantReadError:
                    return False
                except (ssl.SSLError, OSError):
                    return True  # (or it wants to write): the thread's own wait sorts it out
                self._handshaking = False
            try:
                data = self.sock.recv(self.read_size)
            except self._blocked_read:
                return parser.request_ready(enough, self._continued)
            except OSError:  # reset, or (ssl.SSLError) a TLS record that does not decrypt
                return True  # the thread sees it again and closes
            if not data:
                return True  # closed: the thread sees the end and closes (or answers what came)
            if len(data) == self.read_size:
                self.read_size = RECV_SIZE
            if self.phase is IDLE:
                self.phase = AWAITING  # (as read_head would: the next request is coming)
            try:
                if not self._take(data):
                    continue
            except HTTPError as exc:
                self._refusal = exc  # the thread's read_head raises it: a 4xx, as always
                return True
            if enough and not self._continued:
                head = parser.peek_event()
                if type(head) is Request and head.expect_continue and head.has_body:
                    # The client waits for 100 Continue before it sends the body: sent here
                    # (25 bytes into an empty send buffer), so its body is gathered like any
                    # other, and a slow one holds no worker or thread either.
                    try:
                        self.sock.send(CONTINUE)
                    except OSError:
                        return True  # the thread sees it again and closes
                    self._continued = True
            if parser.request_ready(enough, self._continued):
                return True

    def handshake(self, deadline: float) -> bool:
        """TLS: the handshake, here in the worker, non-blocking, within the same deadline as
        the request head (and a stop's cutoff): a silent or slow client cannot hold a sync
        worker longer. False when it fails (plain HTTP to an HTTPS port, a client that does
        not trust us): the connection ends unanswered."""
        ssl = self._ssl
        while self._handshaking:
            try:
                self.sock.do_handshake()  # type: ignore[attr-defined]  # an SSLSocket
            except ssl.SSLWantReadError:
                self._wait(select.POLLIN, deadline)
                continue
            except ssl.SSLWantWriteError:
                self._wait(select.POLLOUT, deadline)
                continue
            except (ssl.SSLError, OSError):
                return False
            self._handshaking = False
        return True

    def peer_certificate(self) -> dict[str, Any] | None:
        """TLS with --cert-reqs: the client's verified certificate (ssl's dict form)."""
        if self._ssl is None or self._handshaking:
            return None
        return self.sock.getpeercert() or None  # type: ignore[attr-defined]

    def _take_proxy_header(self, data: bytes) -> bytes:
        """The connection's first bytes with --proxy-protocol: a PROXY header (v1 or v2) is
        taken off and names the client; anything else is the request itself. Waiting for a
        whole header is bounded as the request head is (read_head's deadline). Raises
        ProxyProtocolError for a broken header, or one from a peer we do not trust."""
        assert self._proxy is not None
        buffered = self._proxy + data
        result = proxy_protocol.parse(buffered)
        if result is None:
            self._proxy = buffered
            return b""
        self._proxy = None
        if result == proxy_protocol.NOT_PROXY:
            return buffered
        assert isinstance(result, tuple)
        if not self.trusted:
            raise ProxyProtocolError(f"a PROXY header from {self.remote[0]}, not a trusted proxy")
        consumed, source = result
        if source is not None:
            self.peer, self.remote = self.remote, source
        return buffered[consumed:]

    def read_head(self, deadline: float) -> Request | None:
        """The next request's head, or None when the client closed before sending one."""
        parser = self.parser
        pending = parser.pending
        # Left as it ends (HEAD or AWAITING) when the wait fails: its handler asks `received`.
        if self.phase is not HEAD:  # (HEAD: gather() has some of it)
            self.phase = HEAD if pending() else AWAITING
        if self._refusal is not None:
            refusal, self._refusal = self._refusal, None
            raise refusal
        while not pending():
            if not self.recv(deadline):
                return None
        head = parser.next_event()
        self.cutoff = None  # a request is here: the next wait for one gets its own grace
        self.head_began = 0.0
        if type(head) is not Request:
            raise head  # type: ignore[misc]  # an HTTPError queued by RequestParser.fail
        self.continue_sent, self._continued = self._continued, False
        return head

    def read_body(self) -> bytes:
        """Transport for wsgi.input: the next piece of the body, b"" at its end."""
        parser = self.parser
        while True:
            event = parser.peek_event()
            if event is END:
                return b""  # left in place: discard_body() sees the request ended
            if event is not None:
                parser.next_event()
                return event  # type: ignore[return-value]  # inside a body: data only
            if not self.continue_sent:
                exchange = self.exchange
                if exchange is not None and exchange.request.expect_continue and not exchange.headers_sent:
                    self.send(CONTINUE)
                self.continue_sent = True
            if not self.recv(time.monotonic() + self.io_timeout):
                raise ClientGone("the client closed the connection during the request body")

    def has_unread(self) -> bool:
        """True when closing now could discard bytes the client sent (so linger first): what
        the parser holds beyond this request's end, or what the kernel holds that we have not
        read (a request pipelined behind one that asked to close: closing on it would reset
        the connection, and the client could lose the response it is reading)."""
        parser = self.parser
        return parser.pending() != 1 or parser.peek_event() is not END or self.sent_more()

    def sent_more(self) -> bool:
        """Are there bytes from the client the kernel holds that we have not read? Unlike
        ``readable_now``, the client's end of stream alone is no: a client that read its
        response and closed (a ``Connection: close`` client, at once on loopback) has sent
        nothing a close could reset, and lingering on it cost a shutdown, a poll and a loop
        trip per connection. One peek, no wait (TLS: a poll; a peek would read a record), on
        the plain socket (``io``: under gevent's, the peek needs none of its wrapper's Python).
        (Where nothing waits, the usual case, the peek raises BlockingIOError. FIONREAD asks
        the same without an exception, 200 ns less a connection, but its number comes from
        termios, whose import costs every worker 50 kB of RSS; a poll is gevent's under
        gevent, a trip through its hub: bench/RESULTS.md.)"""
        if self._ssl is not None:
            return self.readable_now()
        try:
            return bool(self.io.recv(1, MSG_PEEK_NOW))
        except OSError:  # nothing yet (BlockingIOError), or reset: nothing to keep from loss
            return False

    def discard_body(self, request: Request) -> bool:
        """Drop what is left of the body; False when the connection cannot be reused."""
        parser = self.parser
        if not request.has_body:
            parser.take_end()
            return True
        if request.expect_continue and not self.continue_sent:
            return False  # we never asked for the body: the client may or may not send it
        dropped = 0
        deadline = time.monotonic() + min(self.io_timeout, 1.0)
        while True:
            event = parser.next_event()
            while event is not None:
                if event is END:
                    return True
                dropped += len(event)  # type: ignore[arg-type]  # inside a body: data only
                event = parser.next_event()
            if dropped > DISCARD_LIMIT:
                return False
            try:
                if not self.recv(deadline):
                    return False
            except (Timeout, HTTPError):
                return False

    # -- writing -------------------------------------------------------------------------
    def send(self, data: bytes) -> None:
        try:
            sent = self.io.send(data)
        except self._blocked_write:
            sent = 0
        except (BrokenPipeError, ConnectionResetError, ConnectionAbortedError) as exc:
            raise ClientGone(str(exc)) from None
        except self._broken as exc:  # (TLS: SSLWantReadError too: a renegotiation, refused)
            raise ClientGone(str(exc)) from None
        if sent == len(data):
            return
        view = memoryview(data)[sent:]
        deadline = time.monotonic() + self.io_timeout
        while view:
            try:
                sent = self.io.send(view)
            except self._blocked_write:
                self._wait_writable(deadline)
                deadline = time.monotonic() + self.io_timeout
                continue
            except (BrokenPipeError, ConnectionResetError, ConnectionAbortedError) as exc:
                raise ClientGone(str(exc)) from None
            except self._broken as exc:
                raise ClientGone(str(exc)) from None
            view = view[sent:]

    def _wait_writable(self, deadline: float) -> None:
        """A response's writer waits for its client to take more, until ``deadline``
        (ClientGone). Past PARK_AFTER the wait is a slow reader's: ``park`` is told."""
        try:
            park = self.park
            if park is None:
                self._wait(select.POLLOUT, deadline)
                return
            soon = time.monotonic() + PARK_AFTER
            if soon < deadline:
                try:
                    self._wait(select.POLLOUT, soon)
                    return
                except Timeout:
                    pass
            park(True)
            try:
                self._wait(select.POLLOUT, deadline)
            finally:
                park(False)
        except Timeout:
            raise ClientGone("the client stopped reading the response") from None

    def send_last(self, data: bytes, close_next: bool = False) -> None:
        """A whole response, nothing to follow it. Where the worker writes out the rest
        itself (``defer_writes``: the thread worker's poll loop), what the client does not
        take at once is left in ``unsent``: a client that reads slowly, or not at all, holds
        a poll entry instead of a request thread.

        ``close_next``: the caller closes (or half-closes) the connection right after this,
        with no application code in between. The response then goes with MSG_MORE: the
        kernel holds its last segment until the close, which sends it with the FIN in one
        segment (tcp_send_fin tacks the FIN onto unsent data) instead of a data segment and
        then a FIN segment: one packet, and one wake-up of the client, fewer per connection.
        (Plain sockets only, as defer_writes: an SSLSocket takes no flags.)"""
        if not self.defer_writes:
            self.send(data)
            return
        try:
            sent = self.sock.send(data, MSG_MORE if close_next else 0)
        except BlockingIOError:
            sent = 0
        except (BrokenPipeError, ConnectionResetError, ConnectionAbortedError) as exc:
            raise ClientGone(str(exc)) from None
        if sent < len(data):
            self.unsent = memoryview(data)[sent:]

    def send_once(self, data: bytes) -> None:
        """One send without waiting (a small answer from a poll loop); what does not fit in
        the socket's buffer is dropped. Raises ClientGone."""
        try:
            self.sock.send(data)
        except self._blocked_write:
            return
        except OSError as exc:
            raise ClientGone(str(exc)) from None

    def write_unsent(self) -> bool:
        """Send what the client takes of ``unsent`` without waiting; True once all is sent.
        Raises ClientGone."""
        view = self.unsent
        while view:
            try:
                sent = self.sock.send(view)
            except BlockingIOError:
                self.unsent = view
                return False
            except OSError as exc:  # reset, broken pipe, or an error the socket had pending
                self.unsent = None
                raise ClientGone(str(exc)) from None
            view = view[sent:]
        self.unsent = None
        return True

    def sendfile(self, fileno: int, offset: int, count: int) -> int:
        if self._ssl is not None:
            return self._send_file_through_tls(fileno, offset, count)
        total = 0
        deadline = time.monotonic() + self.io_timeout
        while total < count:
            try:
                sent = os.sendfile(self.fd, fileno, offset + total, count - total)
            except BlockingIOError:
                self._wait_writable(deadline)
                deadline = time.monotonic() + self.io_timeout
                continue
            except (BrokenPipeError, ConnectionResetError, ConnectionAbortedError) as exc:
                raise ClientGone(str(exc)) from None
            if sent == 0:
                break  # the file is shorter than it was: stop, the length check closes
            total += sent
        return total

    def _send_file_through_tls(self, fileno: int, offset: int, count: int) -> int:
        """os.sendfile would put the file's plaintext on the wire: read and send it instead
        (kernel TLS offload is not used)."""
        total = 0
        while total < count:
            chunk = os.pread(fileno, min(RECV_SIZE, count - total), offset + total)
            if not chunk:
                break  # the file is shorter than it was: stop, the length check closes
            self.send(chunk)
            total += len(chunk)
        return total

    def end_output(self) -> None:
        """Half-close: the client sees the end of the response now (finish_request)."""
        self.output_ended = True
        try:
            self.sock.shutdown(socket.SHUT_WR)
        except OSError:
            return  # already gone; nothing more to tell the client

    def close(self, linger: bool = False) -> None:
        """Close; with ``linger``, first half-close and drain what the client still sends.

        Closing a socket with unread input makes the kernel send RST, and a client that gets
        RST may drop the response it had not yet read (the 400 or 413 it needs to see). So on
        error paths we shut our side down, read and drop for a moment, then close, as Apache's
        lingering close does.
        """
        if self.phase is CLOSED:
            return
        self.phase = CLOSED
        self.exchange = None
        self.parser.dispose()  # (a reference cycle otherwise: freed now, not by a collection)
        if self.taken:
            # The app has returned: it sent its own close (a WebSocket Close frame) or just
            # stopped. The server closes TCP first (RFC 6455 §7.1.1); shut down first, so a
            # reader thread the app left in recv() wakes (a close alone would not wake it).
            self.cut()
            linger = False
        try:
            if linger:
                self._linger()
            self.sock.close()
        except OSError:
            return

    def _linger(self) -> None:
        if not self.released:
            self.sock.shutdown(socket.SHUT_WR)
        deadline = time.monotonic() + LINGER_TIME
        dropped = 0
        while dropped < LINGER_BYTES:
            try:
                data = self.sock.recv(RECV_SIZE)
            except BlockingIOError:
                try:
                    self._wait(select.POLLIN, deadline)
                except (Timeout, Abandoned):
                    return
                continue
            if not data:
                return
            dropped += len(data)


def linger_together(conns: list[Connection], deadline: float) -> None:
    """Close connections whose output already ended (half-closed): first read and drop what
    their clients still send until each closes its side or ``deadline`` passes, all in one
    poll, so that many lingering closes take no longer than one."""
    poller = select.poll()
    waiting = {}
    for conn in conns:
        if not conn.closed:
            poller.register(conn.fd, select.POLLIN)
            waiting[conn.fd] = conn
    while waiting:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            break
        for fd, _ in poller.poll(remaining * 1000.0 + 1):
            conn = waiting[fd]
            try:
                data = conn.sock.recv(RECV_SIZE)
            except BlockingIOError:
                continue
            except OSError:
                data = b""
            if not data:
                poller.unregister(fd)
                del waiting[fd]
                conn.close()
    for conn in waiting.values():
        conn.close()


def _never() -> bool:
    return False
