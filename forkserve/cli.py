"""Command line: argv -> config -> arbiter. Every failure is one line and an exit code.

Exit codes (see :class:`forkserve.counters.ExitCode`): 0 after any requested stop, 2 for bad
usage or configuration, 4 when the application cannot be loaded (so a supervisor can tell a
broken deploy from a crash), 3 when workers die while booting, 1 for anything else.
"""

from __future__ import annotations

import atexit
import errno
import json
import os
import signal
import socket
import sys
import time
from typing import Any, Sequence

from setproctitle import setproctitle

from forkserve import __version__
from forkserve.config import ConfigError, parse_args, resolve, unknown_env
from forkserve.counters import ExitCode
from forkserve.loader import AppLoadError, load_app
from forkserve.logs import Log
from forkserve.arbiter import UPGRADE_ENV
from forkserve.config import Config
from forkserve.control import ControlError, take_listeners
from forkserve.sockets import AddressInUse, BindError, Listener, adopt, bind
from forkserve.systemd import activation_env_vars, listen_fds
from forkserve.metrics import ENV as METRICS_ENV
from forkserve.metrics import Store, prepare_directory


PAUSE_WAIT = 3.0  # how long a new instance waits for paused predecessors to free the port


def _say(message: str) -> None:
    sys.stderr.write(f"forkserve: {message}\n")
    sys.stderr.flush()


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["ctl"]:
        from forkserve.control import ctl_main
        return ctl_main(args[1:])
    if args[:1] == ["status"]:
        from forkserve.statusview import main as status_main
        return status_main(args[1:])
    # What an in-place upgrade handed over (our own variable: never a user's setting).
    handover_text = os.environ.pop(UPGRADE_ENV, None)
    start_cwd = os.getcwd()
    try:
        cli, check = parse_args(args, __version__)
        config = resolve(cli, os.environ)
    except ConfigError as exc:
        _say(f"error: {exc}")
        return ExitCode.USAGE
    if config.chdir:
        try:
            os.chdir(config.chdir)
        except OSError as exc:
            _say(f"error: --chdir {config.chdir}: {exc.strerror}")
            return ExitCode.USAGE
    try:
        log = Log(config.error_log, config.log_level, config.log_format)
    except OSError as exc:
        _say(f"error: --error-log {config.error_log}: {exc.strerror}")
        return ExitCode.USAGE
    for name in unknown_env(os.environ):
        log.warning("Unknown setting in the environment, ignored", variable=name)

    if check:
        try:
            load_app(config.app)
        except AppLoadError as exc:
            log.error(f"Application could not be loaded: {exc}")
            return ExitCode.APP_LOAD_ERROR
        budget = config.lameduck + config.drain_timeout + config.cancel_grace
        margin = 3
        sys.stdout.write(
            f"forkserve: configuration OK; {config.describe()}\n"
            f"forkserve: shutdown budget {budget:g}s = lameduck {config.lameduck:g}s + drain "
            f"{config.drain_timeout:g}s + cancel grace {config.cancel_grace:g}s (+ flush); "
            f"set systemd TimeoutStopSec={budget + margin:g}, Kubernetes "
            f"terminationGracePeriodSeconds: {int(budget + margin + 0.999)}, "
            f"docker stop --time {int(budget + margin + 0.999)}\n")
        return ExitCode.OK

    handover = json.loads(handover_text) if handover_text else None
    store = None
    if config.status_bind or os.environ.get(METRICS_ENV):
        # Before anything imports prometheus_client (a preloaded app, the workers): it decides
        # at import whether its values live in the shared directory (forkserve.metrics imports
        # it only inside its functions).
        try:
            path, owned, removed, lock = prepare_directory(handover)
            store = Store(path, owned, lock)
        except OSError as exc:
            log.error(f"cannot prepare the metrics directory: {exc}")
            return ExitCode.ERROR
        if removed:
            log.info("Removed metric files of an earlier run", directory=path, files=removed)
    try:
        return _serve(config, cli, args, start_cwd, handover, store, log)
    finally:
        if store is not None:
            store.close()  # after an in-place upgrade's exec this never runs: the new image keeps it


def _serve(config: Config, cli: dict[str, Any], args: list[str], start_cwd: str,
           handover: dict[str, Any] | None, store: Any, log: Log) -> int:
    app = None
    if config.preload:
        try:
            app = load_app(config.app)
        except AppLoadError as exc:
            log.error(f"Application could not be loaded: {exc}")
            return ExitCode.APP_LOAD_ERROR
    try:
        listeners, status_sock, status_deferred = open_sockets(config, handover, log)
    except (BindError, ControlError) as exc:
        log.error(str(exc))
        return ExitCode.ERROR

    from forkserve.arbiter import Arbiter
    from forkserve.pidfile import Pidfile
    from forkserve.systemd import Notifier

    pidfile = Pidfile(config.pidfile) if config.pidfile else None
    try:
        if pidfile is not None:
            pidfile.write()
    except OSError as exc:
        log.error(f"cannot write pidfile {config.pidfile}: {exc.strerror}")
        return ExitCode.ERROR
    setproctitle(f"forkserve: arbiter [{config.app}]")
    try:
        arbiter = Arbiter(config, cli, listeners, log, app, inherited=handover, argv=args,
                          cwd=start_cwd, notifier=Notifier(os.environ), status_sock=status_sock,
                          status_deferred=status_deferred, metrics=store)
        return arbiter.run()
    finally:
        if pidfile is not None:
            pidfile.remove()


def open_listeners(config: Config, handover: dict[str, Any] | None, log: Log
                   ) -> tuple[list[Listener], socket.socket | None]:
    """The listening sockets, in order of preference: handed over by the image we replaced
    in place (USR2), passed by systemd (socket activation), received from a running instance
    (--takeover), or bound — with the -sf/-st fallback when the port is taken. Second: the
    status listener a running instance sent with its listeners (--takeover), if any."""
    inherited: list[Listener] = []
    if handover is not None:
        inherited = [adopt(socket.socket(fileno=fd), address, owned=bool(owned))
                     for fd, address, owned in handover["listeners"]]
        return bind(config.bind, config.backlog, config.reuse_port, inherited), None
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
            return bind(config.bind, config.backlog, config.reuse_port, inherited), status
        except BindError:
            if status is not None:
                status.close()
            raise
    return bind(config.bind, config.backlog, config.reuse_port), None


def open_sockets(config: Config, handover: dict[str, Any] | None, log: Log
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


def open_status(config: Config, handover: dict[str, Any] | None, log: Log,
                taken: socket.socket | None = None, successor: bool = False
                ) -> tuple[socket.socket | None, bool]:
    """The status server's listener: the one an in-place upgrade handed over, the one a
    running instance sent with its listeners (--takeover), or bound now; and whether to wait
    for our workers before answering on it (see open_sockets). After an upgrade, a status
    port that cannot be bound is logged, not fatal: the old image's workers are serving and
    must not be taken down for it."""
    inherited = handover.get("status_fd") if handover else None
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


def run() -> None:
    code = main()
    # Everything this process had to do is done and written (the logs are unbuffered os.write
    # calls; the pidfile and metrics directory are removed): exit-time callbacks run (a
    # --preload app's), the standard streams are flushed, and the interpreter's teardown of
    # every module and object, tens of milliseconds that a stop waits for, is skipped.
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            code = code or ExitCode.ERROR  # a closed or full stdout: say so in the code
    os._exit(int(code or 0))
