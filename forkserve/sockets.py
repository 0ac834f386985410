"""Listening sockets: bind TCP (IPv4/IPv6) and unix addresses, or adopt inherited fds.

Owns: turning ``--bind`` values into listening sockets and describing them. Imports only the
standard library.
"""

from __future__ import annotations

import ctypes
import errno
import os
import socket
import stat
import struct
from dataclasses import dataclass


class BindError(Exception):
    """An address that cannot be listened on: one line, exit code 1."""


@dataclass
class Listener:
    sock: socket.socket
    address: str  # as configured: 127.0.0.1:8000, [::1]:8000, unix:/path, fd://3
    unix_path: str | None = None
    # Another process keeps this socket open beyond our exit (a service manager's socket, an
    # fd:// we were given, a successor we handed it to): never change its behaviour for good.
    shared: bool = False

    @property
    def fd(self) -> int:
        return self.sock.fileno()

    def name(self) -> str:
        """The real address, with the port the kernel chose for port 0."""
        if self.unix_path is not None:
            return f"unix:{self.unix_path}"
        if self.sock.family == socket.AF_UNIX:
            path = self.sock.getsockname()
            return f"unix:{path.decode() if isinstance(path, bytes) else path}"
        host, port = self.sock.getsockname()[:2]
        if self.sock.family == socket.AF_INET6:
            return f"[{host}]:{port}"
        return f"{host}:{port}"

    def server_name_port(self) -> tuple[str, str]:
        if self.unix_path is not None or self.sock.family == socket.AF_UNIX:
            return "localhost", "0"
        host, port = self.sock.getsockname()[:2]
        return host, str(port)

    def close(self, unlink: bool = False) -> None:
        self.sock.close()
        if unlink and self.unix_path:
            try:
                os.unlink(self.unix_path)
            except FileNotFoundError:
                return


def _tcp(host: str, port: int, backlog: int, reuse_port: bool = False) -> socket.socket:
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    try:
        # An ASCII name as bytes: a str goes through the idna codec (encodings.idna,
        # stringprep and unicodedata: 250 KiB in every process) even for "127.0.0.1".
        name: str | bytes = host.encode("ascii") if host.isascii() else host
        infos = socket.getaddrinfo(name, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise BindError(f"cannot resolve {host!r}: {exc.strerror}") from None
    family, kind, proto, _, sockaddr = infos[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if reuse_port:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        if family == socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        # Accepted sockets inherit TCP_NODELAY on Linux: one setsockopt here instead of one
        # per connection. A response is written in one send, so Nagle only ever hurts.
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.bind(sockaddr)
        sock.listen(backlog)
    except OSError as exc:
        sock.close()
        error = AddressInUse if exc.errno == errno.EADDRINUSE else BindError
        raise error(f"cannot listen on {host}:{port}: {exc.strerror}") from None
    return sock


def _unix(path: str, backlog: int, perms: int | None = None, gid: int | None = None,
          uid: int | None = None) -> socket.socket:
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        mode = 0
    if mode and stat.S_ISSOCK(mode):
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.connect(path)
        except ConnectionRefusedError:
            os.unlink(path)  # a stale socket file left by a process that died
        except OSError as exc:
            if exc.errno not in (errno.ECONNREFUSED, errno.ENOENT):
                raise BindError(f"cannot listen on unix:{path}: {exc.strerror}") from None
        else:
            probe.close()
            raise BindError(f"cannot listen on unix:{path}: another server is listening there")
        finally:
            probe.close()
    elif mode:
        raise BindError(f"cannot listen on unix:{path}: the path exists and is not a socket")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind(path)
        # Before listen(): nobody can connect yet, so no client ever meets the old mode.
        if gid is not None or uid is not None:
            os.chown(path, -1 if uid is None else uid, -1 if gid is None else gid)
        if perms is not None:
            os.chmod(path, perms)
        sock.listen(backlog)
    except OSError as exc:
        sock.close()
        raise BindError(f"cannot listen on unix:{path}: {exc.strerror}") from None
    return sock


def _adopt(fd: int) -> socket.socket:
    try:
        sock = socket.socket(fileno=fd)
    except OSError as exc:
        raise BindError(f"fd://{fd} is not a usable socket: {exc.strerror}") from None
    if sock.type != socket.SOCK_STREAM:
        raise BindError(f"fd://{fd} is not a stream socket")
    try:
        listening = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN)
    except OSError:
        listening = 0
    if not listening:
        raise BindError(f"fd://{fd} is not a listening socket")
    os.set_inheritable(fd, False)
    return sock


# A classic BPF socket filter: drop a segment that is a pure SYN (SYN set, ACK clear), keep
# everything else. On a TCP listener the filter sees the TCP header at offset 0 (byte 13 holds
# the flags), for IPv4 and IPv6 alike; handshakes already under way (their ACK) and the
# connections already in the accept queue are untouched.
_BPF_DROP_SYN = b"".join(struct.pack("HBBI", *op) for op in (
    (0x30, 0, 0, 13),          # ldb [13]            the TCP flags
    (0x54, 0, 0, 0x12),        # and #(SYN|ACK)
    (0x15, 0, 1, 0x02),        # jeq #SYN, drop, keep
    (0x06, 0, 0, 0),           # drop: ret #0
    (0x06, 0, 0, 0xFFFFFFFF),  # keep: ret #-1
))
SO_ATTACH_FILTER = getattr(socket, "SO_ATTACH_FILTER", 26)


def refuse_new_connections(listener: Listener) -> bool:
    """Stop new clients from joining this listener's accept queue, while those already in it
    are still accepted and served: the kernel drops new SYNs from now on (Linux; TCP only).

    Closing a listener resets every connection still in its queue, and under steady load the
    queue is never empty, so a stop that waits for it to empty never stops accepting, and one
    that closes anyway resets clients. With new SYNs dropped the queue can only shrink: the
    workers drain it and close. A client that tries meanwhile retransmits its SYN (after 1 s),
    and by then the port is closed: it is refused (ECONNREFUSED), which every client and
    balancer retries safely, instead of being accepted and reset. False where not applicable."""
    sock = listener.sock
    if sock.fileno() < 0 or sock.family not in (socket.AF_INET, socket.AF_INET6):
        return False
    if listener.shared:
        if held_elsewhere(sock):
            return False
        listener.shared = False  # whoever shared it is gone (a successor that failed to boot)
    program = ctypes.create_string_buffer(_BPF_DROP_SYN)
    fprog = struct.pack("HL", len(_BPF_DROP_SYN) // 8, ctypes.addressof(program))
    try:
        sock.setsockopt(socket.SOL_SOCKET, SO_ATTACH_FILTER, fprog)
    except OSError:
        return False
    return True


def held_elsewhere(sock: socket.socket) -> bool:
    """Does a process other than this one and its children hold this socket (read from
    /proc)? Where that cannot be told for some process, it counts as held."""
    me = os.getpid()
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == me:
            continue
        try:
            with open(f"/proc/{entry}/stat", encoding="ascii", errors="replace") as fh:
                if int(fh.read().rsplit(")", 1)[1].split()[1]) == me:
                    continue  # our own worker
            os.listdir(f"/proc/{entry}/fd")
        except FileNotFoundError:
            continue  # gone meanwhile
        except OSError:
            return True  # not ours to look at: assume it may hold it
        if holds_socket(int(entry), sock):
            return True
    return False


def refusing_new_connections(listener: Listener) -> bool:
    """Did a process holding this socket (our arbiter, at a full stop) make it refuse new
    clients? A worker then knows it is among the last holders: nobody else will serve the
    clients queued there. (With SO_GET_FILTER an int-sized answer is too small for any filter.)"""
    sock = listener.sock
    if sock.fileno() < 0 or sock.family not in (socket.AF_INET, socket.AF_INET6):
        return False
    try:
        sock.getsockopt(socket.SOL_SOCKET, SO_ATTACH_FILTER)  # SO_GET_FILTER: the same number
    except OSError as exc:
        return exc.errno == errno.EINVAL
    return False


class AddressInUse(BindError):
    """The port is taken: a handoff (-sf/-st) may free it by pausing the old instance."""


def adopt(sock: socket.socket, address: str, owned: bool = False, shared: bool = False) -> Listener:
    """A listening socket handed to us (upgrade, takeover, socket activation). Only an
    ``owned`` unix socket's path is removed at exit: under socket activation the path is the
    service manager's, after a takeover it is shared with the instance we replaced. A
    ``shared`` socket stays open in another process after we exit (a service manager's)."""
    sock.setblocking(False)
    os.set_inheritable(sock.fileno(), False)
    path = address[5:] if address.startswith("unix:") and owned else None
    return Listener(sock, address, path, shared)


def bind(addresses: list[str], backlog: int, reuse_port: bool = False,
         inherited: list[Listener] | None = None, unix_mode: int | None = None,
         unix_gid: int | None = None, unix_uid: int | None = None,
         defer_accept: int = 0) -> list[Listener]:
    """Listeners for ``addresses``: inherited ones are reused when their configured address
    or real name matches; the rest are bound (a unix socket with ``unix_mode``, group
    ``unix_gid`` and owner ``unix_uid``: --bind-mode, --bind-group, --user). Inherited ones
    left over are closed. TCP listeners of ours, inherited ones too (an upgrade's), get
    ``defer_accept`` (--defer-accept; 0 clears it); a service manager's keep their own."""
    pool = list(inherited or [])
    listeners: list[Listener] = []
    try:
        for address in addresses:
            match = next((l for l in pool if address in (l.address, l.name())), None)
            if match is not None:
                pool.remove(match)
                match.address = address
                listeners.append(match)
            elif address.startswith("unix:"):
                path = os.path.abspath(address[5:])
                listeners.append(Listener(_unix(path, backlog, unix_mode, unix_gid, unix_uid),
                                          address, path))
            elif address.startswith("fd://"):
                listeners.append(Listener(_adopt(int(address[5:])), address, shared=True))
            else:
                host, _, port = address.rpartition(":")
                listeners.append(Listener(_tcp(host, int(port), backlog, reuse_port), address))
    except BindError:
        for listener in listeners:
            if listener not in (inherited or []):
                listener.close(unlink=True)
        raise
    for leftover in pool:
        leftover.close(unlink=False)  # no longer configured; whoever else holds it keeps it
    for listener in listeners:
        listener.sock.setblocking(False)
        if not listener.shared and listener.sock.family in (socket.AF_INET, socket.AF_INET6) \
                and hasattr(socket, "TCP_DEFER_ACCEPT"):
            # Connections whose first bytes have not come wait in the kernel, not in a
            # worker's accept: one wake-up per connection instead of two.
            listener.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_DEFER_ACCEPT, defer_accept)
    return listeners


# -- who else holds or serves a port ---------------------------------------------------------------

def _proc_address(hex_address: str) -> tuple[str, int]:
    """An address of /proc/net/tcp[6] (host byte order in 32-bit words) as (host, port)."""
    host, _, port = hex_address.partition(":")
    raw = bytes.fromhex(host)
    words = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
    family = socket.AF_INET if len(raw) == 4 else socket.AF_INET6
    return socket.inet_ntop(family, words), int(port, 16)


NETLINK_SOCK_DIAG, SOCK_DIAG_BY_FAMILY = 4, 20
NLM_F_REQUEST, NLM_F_DUMP, NLMSG_ERROR, NLMSG_DONE = 0x1, 0x300, 2, 3
TCP_SYN_RECV, TCP_LISTEN = 3, 10


def _tcp_sockets(family: int, state: int) -> list[tuple[str, int, int]]:
    """(local host, local port, inode) of every TCP socket of ``family`` in ``state`` (a
    TCP_* state number), from the kernel's sock_diag netlink interface, which is asked for
    that state only, where /proc/net/tcp (the fallback) lists every connection (tens of
    thousands of TIME_WAIT entries under load: reading it took the arbiter's loop 100 ms and
    more). Raises OSError when neither can be read."""
    try:
        return _sockets_by_diag(family, state)
    except OSError:
        return _sockets_by_proc(family, state)


def _sockets_by_diag(family: int, state: int) -> list[tuple[str, int, int]]:
    # struct inet_diag_req_v2: family, protocol, ext, pad, states; then a zeroed sockid (48)
    request = struct.pack("=BBBBI", family, socket.IPPROTO_TCP, 0, 0, 1 << state) + bytes(48)
    header = struct.pack("=IHHII", 16 + len(request), SOCK_DIAG_BY_FAMILY,
                         NLM_F_REQUEST | NLM_F_DUMP, 1, 0)
    found: list[tuple[str, int, int]] = []
    with socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM, NETLINK_SOCK_DIAG) as nl:
        nl.settimeout(1.0)
        nl.sendto(header + request, (0, 0))
        while True:
            data = nl.recv(1 << 16)
            offset = 0
            while offset + 16 <= len(data):
                length, kind = struct.unpack_from("=IH", data, offset)
                if kind == NLMSG_DONE:
                    return found
                if kind == NLMSG_ERROR or length < 16:
                    raise OSError("sock_diag refused the request")
                # struct inet_diag_msg: family, state, timer, retrans, sockid (sport and dport
                # big-endian, src, dst, if, cookie), expires, rqueue, wqueue, uid, inode
                body = offset + 16
                port = struct.unpack_from("!H", data, body + 4)[0]
                size = 4 if family == socket.AF_INET else 16
                host = socket.inet_ntop(family, data[body + 8:body + 8 + size])
                inode = struct.unpack_from("=I", data, body + 68)[0]
                found.append((host, port, inode))
                offset += (length + 3) & ~3


def _sockets_by_proc(family: int, state: int) -> list[tuple[str, int, int]]:
    table = "/proc/net/tcp6" if family == socket.AF_INET6 else "/proc/net/tcp"
    with open(table, encoding="ascii") as fh:
        rows = [line.split() for line in fh.readlines()[1:]]
    code = f"{state:02X}"
    return [(*_proc_address(row[1]), int(row[9])) for row in rows
            if len(row) > 9 and row[3] == code]


def deferred_connections(listener: Listener) -> int:
    """--defer-accept: how many connections to this TCP listener have their handshake done
    (or under way) and wait in the kernel, outside the accept queue, for their client's first
    bytes (SYN-RECV). A listener closed now would reset them as those bytes come."""
    sock = listener.sock
    if sock.family not in (socket.AF_INET, socket.AF_INET6) or sock.fileno() < 0:
        return 0
    try:
        address = sock.getsockname()[:2]
        found = _tcp_sockets(sock.family, TCP_SYN_RECV)
    except OSError:
        return 0
    return sum(1 for host, port, _ in found if (host, port) == address)


def other_listeners(sock: socket.socket) -> int:
    """How many other listening sockets share this one's address and port (SO_REUSEPORT: a
    successor's, or a predecessor's); 0 where it cannot be told."""
    try:
        host, port = sock.getsockname()[:2]
        inode = os.fstat(sock.fileno()).st_ino
    except OSError:
        return 0
    try:
        listeners = _tcp_sockets(sock.family, TCP_LISTEN)
    except OSError:
        return 0
    return sum(1 for h, p, i in listeners if (h, p) == (host, port) and i != inode)


def still_listening(inodes: list[int]) -> bool:
    """Is one of these TCP sockets still listening in the kernel, whoever holds it? A
    process's close of its last descriptor leaves /proc a moment before the kernel closes the
    socket (on a loaded machine, that moment can be a scheduling slice): meanwhile no process
    holds it, and its port is still taken."""
    wanted = set(inodes)
    for family in (socket.AF_INET, socket.AF_INET6):
        try:
            listeners = _tcp_sockets(family, TCP_LISTEN)
        except OSError:
            continue
        if any(inode in wanted for _, _, inode in listeners):
            return True
    return False


SO_ATTACH_REUSEPORT_CBPF = getattr(socket, "SO_ATTACH_REUSEPORT_CBPF", 51)


def steer_new_connections_here(sock: socket.socket) -> bool:
    """A successor that just joined a SO_REUSEPORT port (listen() put it last in the kernel's
    group, at index N-1): a reuseport program ``ret #N-1`` sends every new connection to it, so
    the instances it replaces get none from now on and can close their listeners with an
    empty queue at their stop (nothing reset, no SYN dropped). When one of them closes, the
    kernel moves the last socket into its slot and the index falls out of range: selection
    falls back to the hash, among what is left. False where it does not apply or fails."""
    try:
        if not sock.getsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT):
            return False
    except OSError:
        return False
    index = other_listeners(sock)
    if index == 0:
        return False  # alone on the port: nothing to steer
    program = ctypes.create_string_buffer(struct.pack("HBBI", 0x06, 0, 0, index))  # ret #index
    fprog = struct.pack("HL", 1, ctypes.addressof(program))
    try:
        sock.setsockopt(socket.SOL_SOCKET, SO_ATTACH_REUSEPORT_CBPF, fprog)
    except OSError:
        return False
    return True


def socket_inode(sock: socket.socket) -> int:
    """The socket's inode: who holds it can still be asked after we closed our copy."""
    return os.fstat(sock.fileno()).st_ino


def holds_socket(pid: int, sock: socket.socket) -> bool:
    """Does process ``pid`` still hold this very socket (one we passed it)?"""
    try:
        inode = socket_inode(sock)
    except OSError:
        return False
    return holds_inode(pid, inode)


def holds_inode(pid: int, inode: int) -> bool:
    """Does process ``pid`` hold the socket with this inode?"""
    wanted = f"socket:[{inode}]"
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return False
    for fd in fds:
        try:
            if os.readlink(f"/proc/{pid}/fd/{fd}") == wanted:
                return True
        except OSError:
            continue  # closed while we looked
    return False


def accept_queue_length(listener: Listener) -> int | None:
    """For a TCP listener, TCP_INFO's ``tcpi_unacked`` is the accept queue's length (Linux);
    None where it is unknown (a unix socket, a closed one)."""
    if listener.sock.family not in (socket.AF_INET, socket.AF_INET6) or listener.sock.fileno() < 0:
        return None
    try:
        info = listener.sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 104)
    except OSError:
        return None
    return int(struct.unpack_from("I", info, 24)[0])


def queued_clients(listeners: list[Listener]) -> int:
    """How many clients wait in these listeners' accept queues now: what a stopping worker
    may still take. Where a queue's length is unknown (a unix socket), its backlog bound."""
    total = 0
    for listener in listeners:
        length = accept_queue_length(listener)
        if length is None:
            length = 0 if listener.sock.fileno() < 0 else socket.SOMAXCONN
        total += length
    return total
