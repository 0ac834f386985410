"""The control socket: a small line protocol on a unix socket, and its client.

Owns: the server side the arbiter polls (``ControlServer``: accept, read one line, answer one
JSON line, close) and the client side (``request``, ``take_listeners``, and ``forkserve ctl``).
Imports only the standard library.

The socket is created with mode 0600 inside a umask, so no other user can ever connect, and
every peer's uid is checked with SO_PEERCRED as well. A command is one line
``COMMAND [ARG]``; the answer is one line of JSON. ``listeners`` answers with the listening
sockets' addresses and, in the same message, their file descriptors (SCM_RIGHTS), for a new
instance taking over the port without ever closing the kernel's accept queue (HAProxy's ``-x``);
the status server's listener comes last, when there is one (``status``: its address), so the
status port changes hands the same way, with no moment where nobody listens.
"""

from __future__ import annotations

import array
import json
import os
import select
import socket
import stat
import struct
import sys
import time
from typing import Any, Callable, Sequence

from forkserve.reactor import Reactor

MAX_LINE = 4096
CLIENT_TIMEOUT = 5.0


class ControlError(Exception):
    pass


class ControlServer:
    """Non-blocking, on the loop's reactor: the listener, then each client for what it waits
    for (the request line, then the answer's room); nothing here blocks the loop, not even a
    client that sends its command and never reads the answer (it is dropped at its deadline,
    see expire)."""

    def __init__(self, path: str, handler: Callable[[str, str], tuple[dict[str, Any], list[int]]],
                 reactor: Reactor) -> None:
        self.path = os.path.abspath(path)
        self.handler = handler
        self.reactor = reactor
        self.clients: dict[int, tuple[socket.socket, bytes, float]] = {}
        self.peers: dict[int, int] = {}  # client fd -> its process id (SO_PEERCRED)
        self.peer_pid = 0  # the process whose command the handler is answering now
        self.answers: dict[int, tuple[bytes, list[int]]] = {}  # fd -> what is left to send
        try:
            self.sock = self._bind()
        except OSError as exc:
            # A missing directory, no permission, a path too long for a unix socket: the
            # operator's mistake, told in one line (the cli exits 1), never a traceback.
            raise ControlError(f"cannot bind the control socket {path}: "
                               f"{exc.strerror or exc}") from None
        self.owner_pid = os.getpid()
        reactor.add(self.sock.fileno(), select.POLLIN, self._on_listener)

    def _bind(self) -> socket.socket:
        if os.path.exists(self.path):
            if not stat.S_ISSOCK(os.stat(self.path).st_mode):
                raise ControlError(f"cannot bind the control socket {self.path}: the path "
                                   "exists and is not a socket")
            probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                probe.connect(self.path)
            except OSError:
                os.unlink(self.path)  # stale: nobody answers there
            else:
                raise ControlError(f"cannot bind the control socket {self.path}: another "
                                   "process answers on it")
            finally:
                probe.close()
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            old_umask = os.umask(0o177)  # the socket is born 0600: no window where others connect
            try:
                sock.bind(self.path)
            finally:
                os.umask(old_umask)
            os.chmod(self.path, 0o600)
            sock.listen(16)
        except OSError:
            sock.close()
            raise
        sock.setblocking(False)
        return sock

    def fileno(self) -> int:
        return self.sock.fileno()

    # -- the reactor's callbacks ---------------------------------------------------------------
    def _on_listener(self, fd: int, events: int) -> None:
        self.accept()

    def _on_client(self, fd: int, events: int) -> None:
        if fd in self.clients and not self.serve(fd):
            self.reactor.modify(fd, self.wants(fd))

    def accept(self) -> list[int]:
        """New clients (each now on the reactor); returns their fds."""
        fds: list[int] = []
        while True:
            try:
                client, _ = self.sock.accept()
            except (BlockingIOError, InterruptedError):
                return fds
            except OSError:
                return fds  # EMFILE, ECONNABORTED...: the next wake tries again
            creds = client.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
            pid, uid, _ = struct.unpack("3i", creds)
            if uid not in (os.getuid(), 0):
                client.close()  # the file mode already keeps others out; this is belt and braces
                continue
            client.setblocking(False)
            self.peers[client.fileno()] = pid
            self.clients[client.fileno()] = (client, b"", time.monotonic() + CLIENT_TIMEOUT)
            self.reactor.add(client.fileno(), select.POLLIN, self._on_client)
            fds.append(client.fileno())

    def wants(self, fd: int) -> int:
        """The poll events this client waits for now."""
        return select.POLLOUT if fd in self.answers else select.POLLIN

    def serve(self, fd: int) -> bool:
        """The client's fd is ready: read its line (and answer it once whole), or send more
        of the answer. True when the client is done (answered, gone, or refused)."""
        if fd in self.answers:
            return self._send(fd)
        client, buffer, deadline = self.clients[fd]
        try:
            data = client.recv(MAX_LINE)
        except BlockingIOError:
            return False
        except OSError:
            data = b""
        buffer += data
        if b"\n" not in buffer and data and len(buffer) < MAX_LINE:
            self.clients[fd] = (client, buffer, deadline)
            return False
        line = buffer.split(b"\n", 1)[0].decode("utf-8", "replace").strip()
        command, _, arg = line.partition(" ")
        self.peer_pid = self.peers.get(fd, 0)
        try:
            answer, fds = self.handler(command.lower(), arg.strip())
        except Exception as exc:  # a broken command must not take the arbiter down
            answer, fds = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}, []
        self.answers[fd] = ((json.dumps(answer, default=str) + "\n").encode(), fds)
        return self._send(fd)

    def _send(self, fd: int) -> bool:
        client = self.clients[fd][0]
        payload, fds = self.answers[fd]
        try:
            if fds:  # with the first byte sent, or not at all
                sent = client.sendmsg([payload], [(socket.SOL_SOCKET, socket.SCM_RIGHTS,
                                                   array.array("i", fds).tobytes())])
            else:
                sent = client.send(payload)
        except (BlockingIOError, InterruptedError):
            return False  # no room yet: poll for it
        except OSError:
            sent = len(payload)  # the client left; nothing to tell it
        if sent < len(payload):
            self.answers[fd] = (payload[sent:], [])
            return False
        self.drop(fd)
        return True

    def expire(self, now: float) -> None:
        """Each round: drop the clients past their deadline."""
        for fd in [fd for fd, (_, _, deadline) in self.clients.items() if now >= deadline]:
            self.drop(fd)

    def drop(self, fd: int) -> None:
        client, _, _ = self.clients.pop(fd)
        self.peers.pop(fd, None)
        self.answers.pop(fd, None)
        self.reactor.remove(fd)
        client.close()

    def close(self) -> None:
        for fd in list(self.clients):
            self.drop(fd)
        if self.sock.fileno() in self.reactor:
            self.reactor.remove(self.sock.fileno())
        self.sock.close()
        if os.getpid() == self.owner_pid:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                return


# -- client side --------------------------------------------------------------------------------

def request(path: str, command: str, timeout: float = 30.0) -> tuple[dict[str, Any], list[int]]:
    """Send one command; returns the JSON answer and any file descriptors that came with it."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(timeout)
        sock.connect(path)
        sock.sendall(command.encode() + b"\n")
        data = b""
        fds: list[int] = []
        while not data.endswith(b"\n"):
            chunk, ancdata, _, _ = sock.recvmsg(65536, socket.CMSG_SPACE(64 * 4))
            for level, kind, payload in ancdata:
                if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                    fds.extend(array.array("i", payload[: len(payload) - len(payload) % 4]))
            if not chunk:
                break
            data += chunk
    try:
        return json.loads(data.decode()), fds
    except ValueError:
        raise ControlError(f"no answer from {path}") from None


def take_listeners(path: str) -> tuple[list[tuple[socket.socket, str]], socket.socket | None]:
    """The old instance's listening sockets, received as fds: (socket, address) pairs, and its
    status server's listener when it has one (its address is the answer's ``status``; an older
    instance sends none)."""
    answer, fds = request(path, "listeners")
    if not answer.get("ok"):
        for fd in fds:
            os.close(fd)
        raise ControlError(f"{path}: {answer.get('error', 'listeners refused')}")
    addresses = answer.get("listeners", [])
    expected = len(addresses) + (1 if answer.get("status") else 0)
    if expected != len(fds):
        for fd in fds:
            os.close(fd)
        raise ControlError(f"{path} sent {len(fds)} descriptors for {len(addresses)} listeners"
                           f"{' and a status listener' if answer.get('status') else ''}")
    listeners = [(socket.socket(fileno=fd), address) for fd, address in zip(fds, addresses)]
    status = socket.socket(fileno=fds[-1]) if answer.get("status") else None
    return listeners, status


def ctl_main(argv: Sequence[str]) -> int:
    """``forkserve ctl SOCKET COMMAND [ARG]``: print the answer; exit 0 when it says ok."""
    if len(argv) < 2:
        sys.stderr.write("forkserve: usage: forkserve ctl SOCKET COMMAND [ARG]  (commands: status, "
                         "reload, upgrade, stop, scale N, pause, resume, listeners)\n")
        return 2
    path, command = argv[0], " ".join(argv[1:])
    try:
        answer, fds = request(path, command)
    except (OSError, ControlError) as exc:
        sys.stderr.write(f"forkserve: cannot talk to {path}: {exc}\n")
        return 1
    for fd in fds:
        os.close(fd)  # `ctl listeners` only shows the addresses
    sys.stdout.write(json.dumps(answer, indent=2, default=str) + "\n")
    return 0 if answer.get("ok") else 1
