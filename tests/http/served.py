"""The workers' request pipeline, in this process: bytes in over a socketpair, the bytes the
server answered out. For the connection property tests and ``fuzz/fuzz_connection.py``,
which must see the server's own code (coverage for the fuzzer, a traceback as it happens),
not a process on the other side of a socket.

``InProcess`` is a ``Pipeline`` (the code every worker class shares: reading heads through
``Connection``, refusals, the app's run, lingering closes) with no listener, no arbiter and
no loop of its own: :meth:`InProcess.answer` writes what a client sent into one end of a
socketpair, half-closes it, and runs ``serve_connection`` on the other end until the
connection ends, as a sync worker's ``keep_serving`` does. Its socket hands the connection
the bytes in exactly the reads planned (:class:`PlannedReads`), so a split is a split, not
whatever the kernel coalesced. A reader thread takes the answers as they come (a pipeline of
many requests answers more than a socket buffer holds).

Anything the pipeline logs at error level (a traceback of the app or of forkserve) is kept
in ``InProcess.errors``; the callers fail on it.
"""

from __future__ import annotations

import os
import socket
import threading
import warnings
from dataclasses import replace
from typing import Any, Callable, Sequence
from wsgiref.validate import WSGIWarning

from forkserve.config import parse_args, resolve
from forkserve.http import Limits
from forkserve.logs import Log
from forkserve.workers.base import WorkerEvent, WorkerSettings
from forkserve.workers.connection import Connection
from forkserve.workers.pipeline import Ending, Pipeline
from forkserve.wsgi import ClientGone, ErrorStream, base_environ

ANSWER_TIMEOUT = 30.0  # a loaded machine: the reader thread's bound, never reached when well


class PlannedReads(socket.socket):
    """A socket whose reads return at most the next planned size, then what is there: the
    client wrote everything before the first read, so each read is exactly one piece."""

    def __init__(self, sizes: Sequence[int], fileno: int) -> None:
        super().__init__(fileno=fileno)
        self.sizes = list(reversed(sizes))

    def recv(self, bufsize: int, flags: int = 0) -> bytes:
        if self.sizes:
            bufsize = min(bufsize, self.sizes.pop())
        return super().recv(bufsize, flags)


class RecordingLog(Log):
    """The error log, kept in memory: what an error line would say, and its traceback."""

    def __init__(self) -> None:
        super().__init__(os.devnull, "warning")
        self.errors: list[str] = []

    def log(self, level: int, message: str, fields: dict[str, Any]) -> None:
        if level >= 40:
            self.errors.append(f"{message} {fields}")


class InProcess(Pipeline):
    """The shared pipeline, serving one connection at a time in the calling thread."""

    def should_close(self) -> bool:
        return False  # nobody else waits for this worker: keep-alive as long as the client wants

    def wait_idle(self, conn: Connection) -> bool:
        return True  # (never asked: answer() reads on until the client's half-close)

    @classmethod
    def start(cls, app: Callable[..., Any], limits: Limits) -> "InProcess":
        cli, _ = parse_args(["tests.apps.digest:app"], "test")
        settings = replace(WorkerSettings.of(resolve(cli, {})), limits=limits, header_timeout=5.0)
        counters = os.open(os.devnull, os.O_WRONLY)
        worker = cls(1, 1, settings, [], counters, -1, RecordingLog(), app, [])
        worker._enter(WorkerEvent.BOOTED)
        worker.setup_http()
        worker.base = base_environ("127.0.0.1", "8000", ErrorStream(lambda: counters))
        return worker

    def stop(self) -> None:
        """Close what start() opened."""
        os.close(self.counters.fd)
        os.close(self.log.fd)

    @property
    def errors(self) -> list[str]:
        return self.log.errors  # type: ignore[attr-defined, no-any-return]

    def answer(self, pieces: Sequence[bytes]) -> bytes:
        """Everything the server answered to ``pieces`` (each one read), sent by a client that
        then half-closed, until the server closed."""
        ours, client = socket.socketpair()
        answers: list[bytes] = []
        reader = threading.Thread(target=_read_all, args=(client, answers), daemon=True)
        try:
            client.sendall(b"".join(pieces))
            client.shutdown(socket.SHUT_WR)
            reader.start()
            sock = PlannedReads([len(p) for p in pieces if p], ours.detach())
            conn = Connection(sock, ("127.0.0.1", "40000"), self.settings.limits, 5.0,
                              self.should_close)
            self.admit(conn)
            ending = Ending.IDLE
            with warnings.catch_warnings():
                # wsgiref's validator warns of methods it does not know (PROPFIND, CONNECT):
                # PEP 3333 allows any; in a server process that is a line on stderr, here
                # (pytest turns warnings into errors) it would be a 500.
                warnings.filterwarnings("ignore", "Unknown REQUEST_METHOD", WSGIWarning)
                try:
                    while ending is Ending.IDLE:
                        ending = self.serve_connection(conn, self.base)
                except ClientGone:
                    ending = Ending.CLOSE
            self.release(conn, ending is Ending.LINGER)
            reader.join(ANSWER_TIMEOUT)
            assert not reader.is_alive(), "the answers never ended: the server did not close"
        finally:
            ours.close()
            client.close()
        return b"".join(answers)


def _read_all(sock: socket.socket, into: list[bytes]) -> None:
    sock.settimeout(ANSWER_TIMEOUT)
    while True:
        try:
            data = sock.recv(65536)
        except ConnectionResetError:
            into.append(b"<RESET>")  # (never valid HTTP: check_answers fails on it)
            return
        if not data:
            return
        into.append(data)
