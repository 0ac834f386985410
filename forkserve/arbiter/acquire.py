"""Where the listening sockets come from, before the arbiter's loop starts: handed over by
the image we replaced in place (USR2), passed by systemd (socket activation), received from a
running instance (``--takeover``), or bound — with HAProxy's pause fallback for ``-sf``/``-st``
when the port is taken — and the status server's listener likewise."""

from __future__ import annotations

import errno
import os
import signal
import socket
import time

from forkserve.config import Config
from forkserve.control import take_listeners
from forkserve.handover import Handover
from forkserve.logs import Log
from forkserve.sockets import AddressInUse, BindError, Listener, adopt, bind
from forkserve.systemd import activation_env_vars, listen_fds

PAUSE_WAIT = 3.0  # how long a new instance waits for paused predecessors to free the port


def open_listeners(config: Config, handover: Handover | None, log: Log
                   ) -> tuple[list[Listener], socket.socket | None]:
    """The listening sockets, in order of preference: handed over by the image we replaced
    in place (USR2), passed by systemd (socket activation), received from a running instance
    (--takeover), or bound — with the -sf/-st fallback when the port is taken. Second: the
    status listener a running instance sent with its listeners (--takeover), if any."""
    inherited: list[Listener] = []
    if handover is not None:
        inherited = [adopt(socket.socket(fileno=l.fd), l.address, owned=l.owned)
                     for l in handover.listeners]
        return _bind(config, inherited), None
    activated = listen_fds(os.environ, os.getpid())
    if activated:
        for name in activation_env_vars():
            os.environ.pop(name, None)
        listeners = []
        for fd, name in activated:
            sock = socket.socket(fileno=fd)
            listeners.append(adopt(sock, _describe(sock, name), shared=True))
        log.info("Using the sockets passed by the service manager; --bind is ignored",
                 listening=",".join(l.name() for l in listeners))
        return listeners, None
    if config.takeover:
        received, status = take_listeners(config.takeover)
        inherited = [adopt(sock, address) for sock, address in received]
        log.info("Took the listening sockets over from the running instance",
                 control_socket=config.takeover, listening=",".join(a for _, a in received))
        if status is not None:
            status.set_inheritable(False)
        try:
            return _bind(config, inherited), status
        except BindError:
            if status is not None:
                status.close()
            raise
    return _bind(config), None


def _bind(config: Config, inherited: list[Listener] | None = None) -> list[Listener]:
    identity = config.worker_identity() if config.user is not None else None
    return bind(config.bind, config.backlog, config.reuse_port, inherited, unix_mode(config),
                config.bind_gid(), identity[0] if identity else None, config.defer_accept)


def unix_mode(config: Config) -> int:
    """The mode of the unix sockets we bind: --bind-mode, else 666 (less --umask, if one is
    given). Not the inherited umask's 755: connecting needs write permission, and nginx
    running as another user would get 502 (gunicorn's sockets are 777 for the same reason).
    666 opens the socket to local users as a port on 127.0.0.1 is open to them."""
    if config.bind_mode is not None:
        return int(config.bind_mode)
    return 0o666 & ~int(config.umask or 0)


def open_sockets(config: Config, handover: Handover | None, log: Log
                 ) -> tuple[list[Listener], socket.socket | None, bool]:
    """The listeners, the status server's socket, and whether answering on it waits until our
    workers are booted. When a port is taken and we replace running instances (-sf/-st),
    HAProxy's fallback: ask them to stop listening (TTOU, which frees their status port too),
    retry for a moment, and if a port is still taken ask them to listen again (TTIN) and
    give up.

    Waiting: a successor that shares the status port with the instances it replaces (their
    very listener, received with --takeover; or SO_REUSEPORT) answers on it only once it is
    ready: until then they answer 200 while their workers serve, where ours would answer 503
    (booting) to the same balancer checks."""
    predecessors = [] if handover is not None else config.soft_stop + config.hard_stop
    listeners: list[Listener] | None = None
    taken: socket.socket | None = None
    status: socket.socket | None = None
    deadline: float | None = None
    while True:
        try:
            if listeners is None:
                listeners, taken = open_listeners(config, handover, log)
            status, deferred = open_status(config, handover, log, taken,
                                           successor=bool(predecessors))
            return listeners, status, deferred
        except AddressInUse as exc:
            if predecessors and deadline is None:
                log.warning("Address in use; asking the old instance(s) to pause listening",
                            pids=",".join(map(str, predecessors)), error=str(exc))
                _signal_all(predecessors, signal.SIGTTOU)
                deadline = time.monotonic() + PAUSE_WAIT
            elif not predecessors or time.monotonic() >= deadline:  # type: ignore[operator]
                for listener in listeners or []:
                    listener.close(unlink=True)
                if not predecessors:
                    raise
                _signal_all(predecessors, signal.SIGTTIN)
                raise BindError(f"{exc}; the old instance(s) were asked to resume listening") from None
            time.sleep(0.05)  # a bounded retry against another process, not a test wait


def open_status(config: Config, handover: Handover | None, log: Log,
                taken: socket.socket | None = None, successor: bool = False
                ) -> tuple[socket.socket | None, bool]:
    """The status server's listener: the one an in-place upgrade handed over, the one a
    running instance sent with its listeners (--takeover), or bound now; and whether to wait
    for our workers before answering on it (see open_sockets). After an upgrade, a status
    port that cannot be bound is logged, not fatal: the old image's workers are serving and
    must not be taken down for it."""
    inherited = handover.status_fd if handover else None
    for sock in ([socket.socket(fileno=inherited)] if inherited is not None else []) + \
            ([taken] if taken is not None and taken.fileno() >= 0 else []):
        sock.set_inheritable(False)
        host, _, port = config.status_bind.rpartition(":") if config.status_bind else ("", "", "")
        got_host, _, got_port = _describe(sock, "").rpartition(":")
        if config.status_bind and _same_host(host, got_host) and port in (got_port, "0"):
            if sock is taken:
                log.info("Took the status listener over from the running instance; answering "
                         "on it once the workers are booted", status_bind=_describe(sock, ""))
            return sock, sock is taken
        sock.close()  # --status-bind changed (or went away) with the upgrade / the successor
    if not config.status_bind:
        return None, False
    from forkserve.status import bind_status, is_loopback

    defer = successor and config.reuse_port
    try:
        sock = bind_status(config.status_bind, config.reuse_port, listen=not defer)
    except OSError as exc:
        message = f"cannot bind the status server to {config.status_bind}: {exc.strerror}"
        if handover is not None:
            log.error(f"{message}; serving without it")
            return None, False
        raise (AddressInUse if exc.errno == errno.EADDRINUSE else BindError)(message) from None
    host = config.status_bind.rpartition(":")[0]
    if not is_loopback(host):
        log.warning("The status server listens beyond this host: /status and /metrics show "
                    "internals; bind it to 127.0.0.1 or firewall it", status_bind=config.status_bind)
    if defer:
        log.info("Status server bound; it joins the port once the workers are booted",
                 status_bind=_describe(sock, config.status_bind))
    else:
        log.info("Status server listening", status_bind=_describe(sock, config.status_bind))
    return sock, defer


def _same_host(configured: str, bound: str) -> bool:
    """Is the configured host (a name, such as localhost, or an address) the bound address?"""
    configured, bound = configured.strip("[]"), bound.strip("[]")
    if configured == bound:
        return True
    try:
        return bound in {info[4][0] for info in socket.getaddrinfo(configured, None)}
    except OSError:
        return False


def _signal_all(pids: list[int], signum: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, signum)
        except ProcessLookupError:
            continue


def _describe(sock: socket.socket, name: str) -> str:
    try:
        address = sock.getsockname()
    except OSError:
        return name or "fd"
    if isinstance(address, str) or isinstance(address, bytes):
        return f"unix:{address if isinstance(address, str) else address.decode()}"
    if sock.family == socket.AF_INET6:
        return f"[{address[0]}]:{address[1]}"
    return f"{address[0]}:{address[1]}"
