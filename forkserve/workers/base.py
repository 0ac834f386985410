"""The worker process's runtime: what every worker class does after fork.

Owns: post-fork reset (signals, fds, process title), loading the app, the BOOTED record and
heartbeats on the counter pipe, noticing the arbiter's death (EOF on an inherited pipe, and the
kernel's parent-death signal for a worker busy in a request), the worker's own states, telemetry flushing and the exit path. Subclasses implement ``serve()``.

Must not import the arbiter: a worker knows the arbiter only through the counter pipe (up)
and signals (down).
"""

from __future__ import annotations

import contextlib
import enum
import gc
import os
import random
import select
import signal
import sys
import threading
import time
import traceback
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any, Callable, ClassVar

from setproctitle import setproctitle

from forkserve import signals as sigs
from forkserve.background import BackgroundPool
from forkserve.capture import flush_std_streams
from forkserve.context import RequestCancelled, RequestContext
from forkserve.counters import ExitCode, Kind, Writer, retiring_text
from forkserve.exits import Budget, run_atexit, run_exit_functions
from forkserve.hooks import Hooks, ServerInfo, WorkerInfo, describe_failure
from forkserve.http import Limits
from forkserve.loader import AppLoadError, load_app
from forkserve.logs import Log
from forkserve.metrics import Recorder
from forkserve.sockets import Listener
from forkserve.telemetry import AccessLog, SpanLog
from forkserve.telemetry.accesslog import RequestIds
from forkserve.telemetry.spans import OpenTelemetrySink, Sinks

if TYPE_CHECKING:
    import ssl  # only with TLS on: nothing may hold a name from ssl before gevent patches it

    from forkserve.tls import TLSMaterial


class WorkerState(enum.Enum):
    BOOTING = "booting"
    RUNNING = "running"
    STOPPING = "stopping"  # TERM, arbiter gone, or retiring: finish what is in flight, leave
    CANCELLED = "cancelled"  # the drain deadline passed (USR2): cancel what runs, flush, leave
    HALTING = "halting"  # QUIT, or the arbiter's timeout kill: leave now


class WorkerEvent(enum.Enum):
    BOOTED = "the app is loaded"
    STOP = "TERM or INT"  # graceful, from the arbiter
    RETIRE = "a recycling limit reached"  # graceful, on its own: max-requests, -rss, -lifetime
    ARBITER_GONE = "the arbiter is gone"
    CANCEL = "USR2: the drain deadline passed"
    HALT = "QUIT, or the arbiter's timeout kill"


WS, WE = WorkerState, WorkerEvent
# Every (state, event) pair is listed: a signal can come at any moment, and its handler must
# never raise for a pair nobody thought of; one that changes nothing says so here. Only
# Worker._enter writes a worker's state.
WORKER_TRANSITIONS: dict[tuple[WorkerState, WorkerEvent], WorkerState] = {
    **{(state, event): state for state in WS for event in WE},  # unchanged, unless below
    (WS.BOOTING, WE.BOOTED): WS.RUNNING,
    (WS.BOOTING, WE.STOP): WS.STOPPING,
    (WS.RUNNING, WE.STOP): WS.STOPPING,
    (WS.RUNNING, WE.RETIRE): WS.STOPPING,
    **{(state, WE.CANCEL): WS.CANCELLED for state in WS if state is not WS.HALTING},
    **{(state, WE.HALT): WS.HALTING for state in WS},
    **{(state, WE.ARBITER_GONE): WS.HALTING for state in WS},  # and out at once (orphaned)
}


class HardStop(BaseException):
    """Raised inside a live request when the worker must stop at once (QUIT, or the arbiter's
    timeout kill via SIGABRT). A BaseException so that ``except Exception`` in apps does not
    swallow it."""


# Sent by the kernel when the arbiter dies (see _post_fork); nobody else sends it.
ORPHAN_SIGNAL = signal.SIGPWR
# An orphaned worker's way out (arbiter_gone) ends within this even if something it does
# hangs: SIGALRM, at its default action, ends the process.
ORPHAN_EXIT_DEADLINE = 0.5
WORKER_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGQUIT, signal.SIGUSR1, signal.SIGABRT,
                  signal.SIGHUP, signal.SIGUSR2, signal.SIGTTIN, signal.SIGTTOU, signal.SIGWINCH,
                  ORPHAN_SIGNAL)


@dataclass(frozen=True)
class WorkerSettings:
    """What a worker needs of the configuration, read once at spawn: each field but the
    derived ones (``DERIVED``) is the setting of the same name (a test holds them to it)."""

    app: str
    chdir: str | None  # named in a load error, and what a suggested --chdir is relative to
    proc_name: str | None  # the process title's [NAME] (-n), else the app's
    keepalive: float
    header_timeout: float
    body_buffer: int
    timeout: float
    max_requests: int
    max_requests_jitter: int
    max_worker_rss: int  # MiB
    max_worker_rss_jitter: int
    max_worker_lifetime: float
    max_worker_lifetime_jitter: float
    request_timeout: float
    access_log: str | None
    access_log_format: str
    span_log: str | None
    background_threads: int
    cancel_grace: float
    max_connections: int | None
    worker_connections: int
    threads: int
    cpu_affinity: bool
    sched_batch: bool
    defer_accept: int  # (a stop waits for connections the kernel holds back: Pipeline)
    forwarded_allow_ips: list[str]
    forwarded_for: bool
    proxy_protocol: bool
    gc_freeze: bool
    limits: Limits  # limit_request_line, _fields, _field_size, _body
    metrics_dir: str | None = None  # the arbiter's metrics store's directory, when metrics are on
    # (uid, gid, groups) to drop to after fork (--user, --group, --initgroups), resolved in the
    # arbiter: no user-database lookup in a child.
    identity: tuple[int, int, tuple[int, ...]] | None = None
    # The TLS context the arbiter built (it read the keys; a HUP builds a new one): the
    # workers of a generation serve HTTPS with it, and what it was built from (a gevent
    # worker builds its own from that once it patched ssl). None: plain HTTP.
    tls: ssl.SSLContext | None = None
    tls_material: TLSMaterial | None = None

    DERIVED: ClassVar[frozenset[str]] = frozenset({"limits", "metrics_dir", "identity", "tls",
                                                   "tls_material"})

    @classmethod
    def of(cls, config: Any, metrics_dir: str | None = None,
           tls: tuple[ssl.SSLContext, TLSMaterial] | None = None) -> "WorkerSettings":
        taken = {f.name: getattr(config, f.name) for f in fields(cls) if f.name not in cls.DERIVED}
        limits = Limits(config.limit_request_line, config.limit_request_fields,
                        config.limit_request_field_size, config.limit_request_body)
        return cls(**taken, limits=limits, metrics_dir=metrics_dir,
                   identity=config.worker_identity(), tls=tls[0] if tls else None,
                   tls_material=tls[1] if tls else None)


class Worker:
    """The child's runtime. ``WorkerHandle`` in the arbiter is the parent's view of it."""

    multithread = False  # True when request threads share this worker's state
    # Every attribute a Worker or a Pipeline sets is a slot (tests/unit/test_worker_slots.py
    # holds them to it); the instance's __dict__ holds what a subclass adds, and whatever a
    # test sets. CPython 3.11 keeps an instance's attributes in values shared with its class
    # up to 29 names; past that it builds the instance a dict of its own. A worker has 65 to
    # 84, and in its dict no ``self.method()`` call got specialized: a dozen a request, each
    # a lookup in the type and one in the dict (``w.should_close()`` run 2,000 times in a
    # worker stayed LOAD_METHOD_ADAPTIVE; with the slots it is LOAD_METHOD_WITH_VALUES).
    # bench/RESULTS.md, 2026-12-07 15:09.
    __slots__ = ("__dict__", "__weakref__", "abort_reported", "access_log", "alive_fd", "app",
                 "arbiter_pid", "cancellable", "cancelled_at", "close_fds", "counters",
                 "drain_reported", "generation", "heartbeat_interval", "hooks", "in_request",
                 "info", "lameduck", "lifetime", "listeners", "log", "max_requests", "metrics",
                 "next_heartbeat", "orphaned", "output_fd", "pause_requested", "pool",
                 "recycles", "request_ids", "retire_at", "retire_reason", "rss_limit",
                 "server_info", "settings", "span_log", "spans", "state", "statm", "timed_out",
                 "wakeup_r", "wakeup_w", "worker_id")

    @classmethod
    def share_imports(cls) -> None:
        """Run by the arbiter before its first fork: import what every worker of this class
        would import after the fork, so that the workers share those pages (copy-on-write)
        instead of each building its own. Nothing may run here that a fork cannot inherit (a
        thread, a hub, a monkey-patch).

        Every class shares hashlib and ssl: nearly every application imports them (Flask and
        Werkzeug, Django, hmac and secrets, requests and urllib3, http.client), and their
        imports initialise OpenSSL's libcrypto and libssl, which done after the fork cost
        each Flask worker 2.1 MiB (hashlib) and 1.4 MiB (ssl) of RSS. A hello worker, which
        imports neither, pays 1.4 and 0.6 MiB for them and stays at or under gunicorn's,
        whose arbiter imports ssl too (bench/RESULTS.md: "Worker memory with Flask" and
        "Worker memory: ssl shared as hashlib is")."""
        import hashlib  # noqa: F401
        import ssl  # noqa: F401

    def __init__(self, worker_id: int, generation: int, settings: WorkerSettings,
                 listeners: list[Listener], counter_fd: int, alive_fd: int, log: Log,
                 app: Callable[..., Any] | None, close_fds: list[int], hooks: Hooks | None = None,
                 server_info: ServerInfo | None = None, info: WorkerInfo | None = None) -> None:
        self.worker_id = worker_id
        self.generation = generation
        self.settings = settings
        self.listeners = listeners
        self.alive_fd = alive_fd
        self.log = log
        self.app = app
        self.close_fds = close_fds
        self.counters = Writer(counter_fd, worker_id)
        self.state = WorkerState.BOOTING
        self.access_log: AccessLog | None = None
        self.request_ids: RequestIds | None = None
        self.metrics: Recorder | None = None  # when metrics are on
        self.spans: Sinks | None = None
        self.span_log: SpanLog | None = None  # opened before the privilege drop
        self.pool: BackgroundPool | None = None
        self.in_request = False
        self.cancellable: RequestContext | None = None  # the request a cancel would hit
        self.drain_reported = True  # the arbiter has our DRAINING record (see _on_graceful)
        self.pause_requested = False  # TTOU: the loop serves the queue, then stops listening
        self.lameduck = False  # TTIN: the lameduck began; every response ends its connection
        self.timed_out = False
        self.abort_reported = False  # the timeout kill's stacks are logged (once)
        self.orphaned = False  # arbiter_gone began: a second call (the other way in) returns
        self.cancelled_at: float | None = None  # when the drain deadline's cancel came
        self.retire_reason = ""
        # Server hooks (forkserve.hooks), and what they are given: the arbiter as it was at
        # the fork, and this worker.
        self.hooks = hooks if hooks is not None else Hooks()
        self.server_info = server_info
        self.info = info
        # Heartbeats: often enough that the arbiter's timeout has several to see.
        self.heartbeat_interval = min(1.0, settings.timeout / 4) if settings.timeout else 1.0
        self.next_heartbeat = 0.0
        limit = settings.max_requests
        if limit and settings.max_requests_jitter:
            limit += random.randint(0, settings.max_requests_jitter)
        self.max_requests = limit
        # Recycling by memory and by age (see check_recycle): each worker draws its own
        # jitter, so that workers that grow alike, or booted together, do not all leave at
        # once. The age counts from the boot (set in _boot).
        rss = settings.max_worker_rss
        if rss and settings.max_worker_rss_jitter:
            rss += random.randint(0, settings.max_worker_rss_jitter)
        self.rss_limit = rss * MIB
        self.lifetime = settings.max_worker_lifetime
        if self.lifetime and settings.max_worker_lifetime_jitter:
            self.lifetime += random.uniform(0.0, settings.max_worker_lifetime_jitter)
        self.retire_at = 0.0  # monotonic; 0: no lifetime limit
        self.statm = -1  # /proc/self/statm, opened at boot when rss_limit is set
        self.recycles = bool(self.rss_limit or self.lifetime)  # checked with each heartbeat
        self.wakeup_r = self.wakeup_w = -1
        self.arbiter_pid = os.getppid()  # (built in the child, right after the fork)
        self.output_fd = -1  # --capture-output: the write end of the arbiter's pipe for us

    # -- the child's life ----------------------------------------------------------------
    def _enter(self, event: WorkerEvent) -> bool:
        """The one writer of ``state`` (signal handlers call it too: a dict lookup, no I/O).
        True when the state changed."""
        new = WORKER_TRANSITIONS[(self.state, event)]
        changed = new is not self.state
        if changed and new is WorkerState.CANCELLED:
            self.cancelled_at = time.monotonic()  # the cancel grace runs from here
        self.state = new
        return changed

    def run_child(self) -> None:
        """Entered right after fork in the child; never returns."""
        code: int = ExitCode.OK
        if self.settings.gc_freeze:
            # What this process inherited (the arbiter's objects: forkserve's code, its
            # config; with --preload frozen there already) moves to the permanent generation,
            # which the collector never visits: a full collection here would otherwise write
            # to each one's gc header and so copy every page they lie on (about 2 MiB a gevent
            # worker, whose arbiter imported gevent; more once the worker has lived long
            # enough for a full collection). One merge of the generation lists: no object is
            # touched. What the app builds after the fork stays collectable.
            gc.freeze()
        # First: the threads this process starts inherit both.
        if self.settings.cpu_affinity:
            self._pin_to_cpu()
        if self.settings.sched_batch:
            self._schedule_as_batch()
        try:
            self._close_inherited()
            self._post_fork()
            if not self._boot():
                code = ExitCode.APP_LOAD_ERROR
            else:
                self._enter(WorkerEvent.BOOTED)  # (a TERM while booting: still stopping)
                self.serve()
                self.wind_down()
                if self.timed_out:  # (gevent: the kill ended the stuck greenlet, not serve())
                    code = ExitCode.ERROR
        except HardStop:
            # The timeout kill's stacks (every thread's, where the worker was stuck) were
            # logged as it came (report_abort).
            code = ExitCode.ERROR if self.timed_out else ExitCode.OK
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else ExitCode.ERROR
        except BaseException as exc:  # the last line of defence: log it, never a silent death
            self.log.exception(f"Worker {self.worker_id} crashed", exc)
            # While booting, the code says so: the arbiter tells this crash (logged above)
            # from an application that ended the process while it was being imported.
            code = (ExitCode.WORKER_BOOT_ERROR if self.state is WorkerState.BOOTING
                    else ExitCode.ERROR)
        finally:
            self._close_pool()
            self._flush_telemetry()  # forkserve's own first: nothing below can hold it back
            self._exit_cleanup(code)
            flush_std_streams()  # a last partial print() line (atexit's too), for --capture-output
        os._exit(code)

    def _exit_cleanup(self, code: int) -> None:
        """What runs at the exit (forkserve.exits has the order): on a graceful one the
        on_worker_exit functions, the worker_exit hook and the atexit handlers; on a hard
        stop by QUIT the worker_int and worker_exit hooks only. Within --cancel-grace (what
        is left of it after a cancel)."""
        graceful = self.state in (WorkerState.STOPPING, WorkerState.CANCELLED)
        quit_ = self.state is WorkerState.HALTING and not self.timed_out
        hooks = self.hooks
        if not graceful and hooks.worker_exit is None and not (quit_ and hooks.worker_int):
            return
        grace = self.settings.cancel_grace
        seconds = grace if self.cancelled_at is None else \
            self.cancelled_at + grace * 0.9 - time.monotonic()
        with Budget(seconds, self.log, self.worker_id, code) as budget:
            if quit_:
                budget.step = "worker_int hook"
                hooks.call("worker_int", self.log, self.info)
            if graceful:
                budget.step = "on_worker_exit functions"
                run_exit_functions(self.log)
            budget.step = "worker_exit hook"
            hooks.call("worker_exit", self.log, self.server_info, self.info)
            if graceful:
                budget.step = "atexit handlers"
                run_atexit()

    def _close_inherited(self) -> None:
        """First thing in the child, before any class's own set-up (gevent's monkey-patching
        takes a while): the arbiter's own descriptors (the status listener and its clients,
        the control socket, the pipes' other ends). Held here any longer, a TTOU meanwhile
        would not free the status port for a successor, or for our own TTIN."""
        for fd in self.close_fds:
            if fd < 0:
                continue
            try:
                os.close(fd)
            except OSError:
                continue

    def _pin_to_cpu(self) -> None:
        """--cpu-affinity: this process runs on one CPU of those the arbiter may run on
        (a taskset, a systemd CPUAffinity= or a container's cpuset narrow them), chosen by
        worker number, so that a worker replaced, or its successor at a reload, runs where
        it did."""
        cpus = sorted(os.sched_getaffinity(0))
        cpu = cpus[(self.worker_id - 1) % len(cpus)]
        try:
            os.sched_setaffinity(0, {cpu})
        except OSError as exc:  # (a CPU gone offline since the arbiter looked)
            self.log.warning("Worker could not be pinned to a CPU; it runs on any",
                             worker=self.worker_id, cpu=cpu, error=str(exc))

    def _schedule_as_batch(self) -> None:
        """--sched-batch: a thread of this process that wakes (a request thread given work,
        one whose GIL is free) does not preempt the one running. With preemption, a thread
        that lets the GIL go around a short system call (a send, an epoll_ctl) is switched
        out for the thread it woke, and waits to have the GIL back: two switches for a call
        of a microsecond, the thread worker's main cost at keep-alive c=50."""
        try:
            os.sched_setscheduler(0, os.SCHED_BATCH, os.sched_param(0))
        except OSError as exc:
            self.log.warning("Worker could not take the SCHED_BATCH policy; it runs under the "
                             "arbiter's", worker=self.worker_id, error=str(exc))

    def _post_fork(self) -> None:
        sigs.reset_in_child(WORKER_SIGNALS + (signal.SIGCHLD,))
        self.wakeup_r, self.wakeup_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        signal.set_wakeup_fd(self.wakeup_w, warn_on_full_buffer=False)
        handlers = {
            signal.SIGTERM: self._on_graceful,
            signal.SIGQUIT: self._on_hard,
            signal.SIGABRT: self._on_abort,
            signal.SIGUSR1: self._on_record,
        }
        handlers[signal.SIGUSR2] = self._on_cancel
        handlers[signal.SIGTTOU] = self._on_pause
        handlers[signal.SIGTTIN] = self._on_lameduck
        handlers[signal.SIGWINCH] = self._on_report
        for signum, handler in handlers.items():
            signal.signal(signum, handler)
        # The arbiter's signals, not ours. SIGINT too: Ctrl-C in a terminal reaches the whole
        # process group, and the arbiter turns it into a graceful stop (TERM to us); a
        # worker acting on it directly would cut its in-flight request short.
        for signum in (signal.SIGINT, signal.SIGHUP):
            signal.signal(signum, signal.SIG_IGN)
        sigs.unblock()
        self.counters.pid = os.getpid()
        name = self.settings.proc_name or self.settings.app
        _set_title(f"forkserve: worker {self.worker_id} [{name}]")
        stdout_fd = None
        if self.output_fd >= 0:
            stdout_fd = self._capture_output()
        # The logging set-up again, in this process: --log-config's handlers (their files,
        # sockets, threads) and the syslog connection are this worker's own.
        self.log.install()
        if self.settings.access_log or self.log.access_configured():
            # Its write failures (a full disk) are told in the error log, rate-limited.
            self.access_log = AccessLog(self.settings.access_log, self.settings.access_log_format,
                                        errors=self.log, stdout_fd=stdout_fd)
            self.access_log.logger = self.log.attach_access(self.access_log.handler)
            self.request_ids = RequestIds()
        if self.settings.metrics_dir:
            try:
                self.metrics = Recorder(self.settings.metrics_dir, os.getpid(), self.multithread)
            except OSError as exc:
                # Metrics are an extra: a worker that cannot record them still serves.
                self.log.error("Worker cannot record metrics; serving without them",
                               worker=self.worker_id, error=str(exc))
        self.pool = BackgroundPool(self.settings.background_threads, self.counters, self.log,
                                   self._pool_changed, self.spans)
        # Files are opened before the drop (the access log above): a path only root may write
        # (/var/log/...) still works; its sinks are put together once the app is loaded.
        self.span_log = (SpanLog(self.settings.span_log, errors=self.log)
                         if self.settings.span_log else None)
        self._drop_privileges()
        # After the drop (a change of credentials clears it); the arbiter may already be gone.
        signal.signal(ORPHAN_SIGNAL, self._on_orphaned)
        if sigs.on_parent_death(ORPHAN_SIGNAL) and os.getppid() != self.arbiter_pid:
            self.arbiter_gone()

    def _capture_output(self) -> int:
        """--capture-output: fd 1 and 2 become the pipe the arbiter reads (every write to them,
        print() or a C library's, reaches the error log a line at a time). The error log, when
        it is stderr, and an access log on stdout keep the real ones (a copy of each), or each
        of their lines would come back as captured output. Returns that copy of stdout."""
        stdout_copy = os.dup(1)  # (not inheritable)
        if self.log.fd in (1, 2):
            self.log.fd = os.dup(self.log.fd)
        os.dup2(self.output_fd, 1)
        os.dup2(self.output_fd, 2)
        os.close(self.output_fd)
        self.output_fd = -1
        for stream in (sys.stdout, sys.stderr):
            reconfigure = getattr(stream, "reconfigure", None)
            if reconfigure is not None:
                reconfigure(line_buffering=True)  # each print()'s line goes at once
        return stdout_copy

    def _drop_privileges(self) -> None:
        """--user/--group: after what needs root (the logs are open) and before the app is
        imported, so that no application code ever runs as root. Groups first, the uid last
        (after it, nothing else may change)."""
        identity = self.settings.identity
        if identity is None:
            return
        uid, gid, groups = identity
        os.setgroups(list(groups))
        os.setgid(gid)
        os.setuid(uid)

    def reopen_logs(self) -> None:
        """USR1. A file the worker may no longer open (logrotate made it root's, and we run as
        --user) keeps being written: one error line, never a crash (a crash per USR1 would
        replace every worker)."""
        logs: tuple[tuple[str, Log | AccessLog | SpanLog | None], ...] = (
            ("error log", self.log), ("access log", self.access_log), ("span log", self.span_log))
        for name, log in logs:
            if log is None:
                continue
            try:
                log.reopen()
            except OSError as exc:
                self.log.error(f"Worker cannot reopen its {name}; writing on to the old file",
                               worker=self.worker_id, error=exc.strerror)

    def _boot(self) -> bool:
        if self.info is not None:
            self.info.pid = os.getpid()
        if not self._boot_hook("post_fork", self.server_info, self.info):
            return False
        if self.app is None:
            try:
                self.app = load_app(self.settings.app, self.settings.chdir)
            except AppLoadError as exc:
                self.counters.send(Kind.BOOT_ERROR, str(exc))
                if self.log.enabled(10) and exc.__cause__ is not None:
                    self.log.exception("Application load failed", exc.__cause__)
                return False
        if self.info is not None:
            self.info.wsgi = self.app
        if not self._boot_hook("post_worker_init", self.info):
            return False
        if self.info is not None:
            self.info.booted = True
        self._open_span_sinks()
        self._arm_recycling()
        self.counters.send(Kind.BOOTED)
        self.next_heartbeat = time.monotonic() + self.heartbeat_interval
        return True

    def _arm_recycling(self) -> None:
        """--max-worker-lifetime counts from now (the app is loaded); --max-worker-rss reads
        /proc/self/statm, kept open (a pread per check). A worker whose RSS is already past
        its limit once loaded would be recycled at once, and so would each replacement: a
        fork loop. So it keeps serving without the limit, and says so."""
        if self.lifetime:
            self.retire_at = time.monotonic() + self.lifetime
        if not self.rss_limit:
            return
        try:
            self.statm = os.open("/proc/self/statm", os.O_RDONLY | os.O_CLOEXEC)
        except OSError as exc:
            self.log.warning("Cannot read this worker's memory: --max-worker-rss is off",
                             worker=self.worker_id, error=exc.strerror)
            self.rss_limit = 0
        else:
            rss = self.rss()
            if rss >= self.rss_limit:
                self.log.warning(
                    "This worker's memory is past --max-worker-rss already once loaded; "
                    "it is not recycled for its memory (raise the limit)",
                    worker=self.worker_id, rss_mib=rss // MIB, limit_mib=self.rss_limit // MIB)
                self.rss_limit = 0
        self.recycles = bool(self.rss_limit or self.lifetime)

    def rss(self) -> int:
        """This worker's resident set size in bytes (one pread of /proc/self/statm: ~1 µs)."""
        try:
            return int(os.pread(self.statm, 64, 0).split()[1]) * PAGE_SIZE
        except (OSError, IndexError, ValueError):
            return 0

    def _boot_hook(self, name: str, *args: Any) -> bool:
        """A hook that runs while the worker boots (post_fork, post_worker_init): one that
        raises is a boot failure, as an app that cannot be imported (the arbiter's boot
        rules apply: the first generation exits 4, a reload rolls back, never a fork loop)."""
        function = getattr(self.hooks, name)
        if function is None:
            return True
        try:
            function(*args)
        except (Exception, SystemExit) as exc:
            self.log.exception(f"Worker {self.worker_id}: the {name} hook raised", exc,
                               worker=self.worker_id, hook=name)
            self.counters.send(Kind.BOOT_ERROR, f"the {name} hook raised {describe_failure(exc)}")
            return False
        return True

    def _open_span_sinks(self) -> None:
        """After the app is loaded: it may have set up OpenTelemetry, whose buffered spans
        must then be flushed before this worker exits."""
        sinks: list[Any] = []
        if self.span_log is not None:
            sinks.append(self.span_log)
        if OpenTelemetrySink.wanted():
            sinks.append(OpenTelemetrySink())
        if sinks:
            self.spans = Sinks(sinks)
            if self.pool is not None:
                self.pool.spans = self.spans

    def serve(self) -> None:
        raise NotImplementedError

    # -- signal handlers ------------------------------------------------------------------
    # -- runs in a signal handler: record and wake the loop (the wakeup fd does that). The
    # documented exceptions, each needed because a busy worker's loop cannot act until its
    # request ends:
    #  - SIGWINCH (the arbiter's status asks) writes one atomic record of our counters;
    #  - TERM writes one atomic record (the arbiter learns this worker's live counters at
    #    once); the sync worker also releases its listeners and parked connections there
    #    (see SyncWorker._on_graceful), and ALRM goes on doing so while it stays busy;
    #  - USR2 (the drain deadline) raises RequestCancelled inside the live request;
    #  - the sync worker's SIGALRM (--request-timeout) raises RequestTimedOut inside the live
    #    request it times (see SyncWorker._on_alarm);
    #  - QUIT and the arbiter's timeout kill raise HardStop inside the live request.
    def _on_graceful(self, signum: int, frame: Any) -> None:
        self._enter(WorkerEvent.STOP)
        self.drain_reported = self.counters.draining()

    def _on_report(self, signum: int, frame: Any) -> None:
        """SIGWINCH: the arbiter wants live numbers (status); one atomic record, as on TERM."""
        self.counters.snapshot()

    def _on_lameduck(self, signum: int, frame: Any) -> None:
        """TTIN: the server's lameduck began (readiness fails, accepting goes on): every
        response from now on ends its connection (see the arbiter's drain.begin_stop)."""
        self.lameduck = True

    def _on_pause(self, signum: int, frame: Any) -> None:
        """TTOU: stop listening (serve what is queued first), keep serving connections."""
        self.pause_requested = True

    def _on_cancel(self, signum: int, frame: Any) -> None:
        self._enter(WorkerEvent.CANCEL)
        context = self.cancellable
        if context is not None and not context.cancelled:
            context.cancelled = True
            raise RequestCancelled("cancelled: the drain timeout passed")

    def _on_hard(self, signum: int, frame: Any) -> None:
        self._enter(WorkerEvent.HALT)
        if self.in_request:
            raise HardStop("hard stop requested")

    def _on_abort(self, signum: int, frame: Any) -> None:
        """The arbiter's timeout kill (SIGKILL follows shortly): where every thread was
        stuck is logged and worker_abort runs here, since the loop is what is stuck."""
        self._enter(WorkerEvent.HALT)
        self.timed_out = True
        self.report_abort(frame)
        raise HardStop("killed by the arbiter: no heartbeat within --timeout")

    def report_abort(self, frame: Any) -> None:
        """-- runs in the SIGABRT handler (documented exception: log writes and a hook; the
        worker is being killed). One record with the stack of every thread, then the
        worker_abort hook, contained."""
        if self.abort_reported:
            return
        self.abort_reported = True
        names = {t.ident: t.name for t in threading.enumerate()}
        frames = sys._current_frames()
        # This thread (the main one: handlers run there) by its running frame, this one:
        # gevent patches threading.get_ident to tell greenlets apart.
        me = sys._getframe()
        here = next((ident for ident, top in frames.items() if top is me), None)
        parts = []
        for ident, top in frames.items():
            mine = ident == here
            where = frame if mine and frame is not None else top
            name = names.get(ident) or ("MainThread" if mine else "?")
            parts.append(f"Thread {name} ({ident}){' interrupted by the kill' if mine else ''}:\n"
                         + "".join(traceback.format_stack(where)).rstrip())
        stacks = "\n".join(parts)
        message = (f"Worker {self.worker_id} (pid {os.getpid()}) was stuck at the arbiter's "
                   "timeout kill; the stack of every thread")
        # (A stuck thread may hold a logging lock: stuck in a handler's write, say.)
        if self.log.json:
            self.log.from_handler(40, message, {"worker": self.worker_id, "stacks": stacks})
        else:
            self.log.from_handler(40, message + "\n" + stacks, {"worker": self.worker_id})
        self.hooks.call("worker_abort", self.log, self.info)

    def _on_record(self, signum: int, frame: Any) -> None:
        return None  # USR1: the loop reads it from the wakeup fd and reopens the logs

    def _on_orphaned(self, signum: int, frame: Any) -> None:
        """The kernel's parent-death signal: the arbiter died (kill -9, the OOM killer). Acted
        on here, not in the loop: a worker inside a request polls nothing until it ends."""
        self.arbiter_gone()

    # -- the loop's helpers ---------------------------------------------------------------
    def handle_wakeups(self) -> None:
        """Read the signal numbers from the wakeup pipe and act on those the loop handles."""
        while True:
            try:
                data = os.read(self.wakeup_r, 64)
            except BlockingIOError:
                return
            if signal.SIGUSR1 in data:
                self.reopen_logs()
                self.log.debug("Worker reopened its log files", worker=self.worker_id)

    def arbiter_gone(self) -> None:
        """The arbiter is gone: nobody supervises this worker any more (no --timeout, no
        drain, no successor to hand clients to) and it holds the port a new instance needs.
        So it leaves now, from wherever it is (the loop, or a signal handler inside a
        request): listeners closed first, requests in flight cut, the access and span logs
        written out (whole lines), no wait for background tasks.

        Both ways in (the loop seeing the alive pipe end, the parent-death signal's handler)
        come within microseconds of each other, so one may interrupt the other: the second
        returns and the first goes on. A handler may also find the thread or greenlet it
        interrupted inside one of logging's locks (gevent's are greenlet-owned Python locks,
        half-taken until their owner is set): the line is written without waiting for any,
        and a kernel timer ends the process if anything here still hangs."""
        if self.orphaned:
            return
        self.orphaned = True
        try:
            with contextlib.suppress(ValueError):  # (not the main thread: the app's handler)
                signal.signal(signal.SIGALRM, signal.SIG_DFL)
            signal.setitimer(signal.ITIMER_REAL, ORPHAN_EXIT_DEADLINE)
            self._enter(WorkerEvent.ARBITER_GONE)
            for listener in self.listeners:
                listener.sock.close()
            self.log.from_handler(30, "Arbiter is gone; worker exiting now",
                                  {"worker": self.worker_id,
                                   "in_flight": self.counters.in_flight_requests,
                                   "connections": self.counters.active_connections})
            if self.access_log is not None:
                self.access_log.flush_from_handler()
            if self.span_log is not None:
                self.span_log.flush()
        finally:
            os._exit(ExitCode.ERROR)

    def report(self) -> None:
        """After a counter changed: while draining, the arbiter hears of every change (its
        drain decision is event-driven); while running, heartbeats carry the numbers."""
        if self.state is not WorkerState.RUNNING:
            if self.drain_reported:
                self.counters.snapshot()
            else:
                # The DRAINING record was lost to a full pipe: the arbiter does not trust our
                # numbers until it has one, so send that (it carries the numbers too).
                self.drain_reported = self.counters.draining()

    def _pool_changed(self) -> None:
        # -- runs in a pool thread: a task was queued or finished.
        self.report()
        try:
            os.write(self.wakeup_w, b"\0")  # wakes a worker waiting for its pool to empty
        except BlockingIOError:
            return  # the pipe is full, so the loop is awake anyway

    def wind_down(self) -> None:
        """The loop has stopped taking work: wait for background tasks (unless cancelled),
        reporting and heart-beating meanwhile; then the pool is closed in run_child."""
        pool = self.pool
        if pool is None:
            return
        poller = select.poll()
        poller.register(self.wakeup_r, select.POLLIN)
        poller.register(self.alive_fd, select.POLLIN)
        self.report()
        while self.state is WorkerState.STOPPING and not pool.idle:
            now = time.monotonic()
            if now >= self.next_heartbeat:
                self.heartbeat(now)
            for fd, _ in poller.poll(self.heartbeat_interval * 1000.0):
                if fd == self.wakeup_r:
                    self.handle_wakeups()
                else:
                    self.arbiter_gone()

    def _close_pool(self) -> None:
        """Report tasks that never started; give running ones until the cancel grace."""
        pool = self.pool
        if pool is None:
            return
        pool.close()
        deadline = time.monotonic() + self.settings.cancel_grace * 0.75
        while not pool.idle and time.monotonic() < deadline:
            try:
                select.select([self.wakeup_r], [], [], max(deadline - time.monotonic(), 0))
                os.read(self.wakeup_r, 4096)
            except (BlockingIOError, InterruptedError):
                continue
            except HardStop:
                break
        for name in pool.running():
            self.log.warning("Background task still running at exit", task=name)

    def heartbeat(self, now: float) -> None:
        self.next_heartbeat = now + self.heartbeat_interval
        if self.recycles and self.state is WorkerState.RUNNING:
            self.check_recycle(now)
            if self.retire_at and self.retire_at < self.next_heartbeat:
                # The next check at the deadline itself, not up to an interval later: under
                # load (the loops ask with every request) each worker leaves at its own time.
                self.next_heartbeat = self.retire_at
        if self.drain_reported:
            self.counters.snapshot()
        else:
            self.drain_reported = self.counters.draining()

    def request_done(self) -> None:
        counters = self.counters
        counters.requests_served += 1
        if self.max_requests and counters.requests_served >= self.max_requests:
            self.retire("max-requests", f"served {counters.requests_served} requests")

    def check_recycle(self, now: float) -> None:
        """With each heartbeat (at most once per heartbeat interval, never per request): past
        --max-worker-lifetime, or --max-worker-rss? Then retire, as at --max-requests."""
        if self.retire_at and now >= self.retire_at:
            jitter = self.lifetime - self.settings.max_worker_lifetime
            self.retire("max-lifetime", f"up {now - self.retire_at + self.lifetime:.1f}s, past "
                        f"--max-worker-lifetime {self.settings.max_worker_lifetime:g}s"
                        f" (+{jitter:.1f}s jitter)")
        elif self.rss_limit:
            rss = self.rss()
            if rss >= self.rss_limit:
                jitter = self.rss_limit // MIB - self.settings.max_worker_rss
                self.retire("max-rss", f"RSS {rss / MIB:.0f} MiB, past --max-worker-rss "
                            f"{self.settings.max_worker_rss} MiB (+{jitter} MiB jitter)")

    def retire(self, reason: str, description: str) -> None:
        """Leave on my own, gracefully (``reason``: one of counters.RETIRE_REASONS): stop
        taking clients (the kernel's queue stays with the others), finish what is in flight,
        exit; the arbiter spawns the replacement as soon as it reads the RETIRING record, and
        logs one line with ``description``."""
        if self.state is not WorkerState.RUNNING:
            return
        self.retire_reason = reason
        if self._enter(WorkerEvent.RETIRE):
            self.counters.send(Kind.RETIRING, retiring_text(reason, description))

    def _flush_telemetry(self) -> None:
        if self.access_log is not None:
            self.access_log.close()
            self.access_log = None
        if self.spans is not None:
            self.spans.close()
            self.spans = None


MIB = 1 << 20
PAGE_SIZE = os.sysconf("SC_PAGE_SIZE")


def drain_pipe(fd: int) -> None:
    """Read a non-blocking wake-up pipe empty. A read that returns less than it asked for
    emptied it, so no further read is made only to fail with BlockingIOError (an exception
    costs more than the read, and the thread worker drains its hand-back pipe every other
    request). A byte written after the read leaves the pipe readable: the next poll drains it."""
    try:
        while len(os.read(fd, 4096)) == 4096:
            continue
    except BlockingIOError:
        return


def _set_title(title: str) -> None:
    setproctitle(title)  # a declared dependency
