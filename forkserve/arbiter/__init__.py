"""The arbiter: the one loop that owns the listeners, the workers and the life-cycle state.

It never runs application code (unless ``--preload``, and then only before forking). This
module is the loop only: poll, signals dispatched to methods, one deadlines registry, and
``transition()`` (the main state table is :mod:`forkserve.lifecycle`). What it acts on is
owned, one story a module, by the mixins ``Arbiter`` is made of:

    workers.py   the worker table: WorkerHandle, spawn, reap, replace, escalate, counters
    drain.py     the stop: lameduck, drain, cancel, halt (the lifecycle table's events)
    rollout.py   generations: reload (HUP), boot, retire the old one or roll back
    upgrade.py   the in-place upgrade (USR2): check, handover, exec, adopt, stand-in
    handoff.py   -sf/-st, the listeners handed to a successor, TTOU/TTIN
    observe.py   readiness, the status snapshot and pages, live numbers, systemd
    commands.py  the control socket's commands, USR1
    acquire.py   where the listening sockets come from (bound, inherited, taken over)
    codereload.py  --reload: the watcher's changes, debounced into a HUP

# -- runs in the loop ----------------------------------------------------------------------
Everything here runs in the loop. Signals reach it as bytes on a wakeup pipe
(:mod:`forkserve.signals`); the loop blocks in ``poll`` until the earliest deadline any owner
registered (``deadlines``), then lets each owner act on what is due (``tick``).
"""

from __future__ import annotations

import gc
import os
import select
import signal
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

from forkserve import signals as sigs
from forkserve.signals import ARBITER_SIGNALS
from forkserve.config import Config
from forkserve.control import ControlError, ControlServer
from forkserve.counters import Decoder, ExitCode
from forkserve.hooks import HookLog, Hooks, ServerInfo
from forkserve.lifecycle import Event, State, next_state
from forkserve.logs import Log
from forkserve.reactor import Reactor
from forkserve.capture import OutputCapture
from forkserve.sockets import Listener
from forkserve.status import FINAL_GRACE, StatusServer
from forkserve.workers import worker_class
from forkserve.workers.base import WorkerSettings
from forkserve.arbiter.codereload import CodeReload
from forkserve.arbiter.commands import Commands
from forkserve.arbiter.drain import Drain
from forkserve.arbiter.handoff import Handoff
from forkserve.arbiter.observe import Observe
from forkserve.arbiter.rollout import Generations
from forkserve.arbiter.upgrade import Upgrade
from forkserve.arbiter.workers import WorkerHandle, WorkerTable

__all__ = ["ARBITER_SIGNALS", "Arbiter", "WorkerHandle"]

# How long a stop's transition lines wait for the workers' live numbers (a busy sync worker
# reports only between requests, so the last numbers we have may say nothing is in flight).
LIVE_LINE_WAIT = 0.5


@dataclass
class Arbiter(WorkerTable, Drain, Generations, Upgrade, Handoff, Observe, Commands, CodeReload):
    config: Config
    cli_args: dict[str, Any]
    listeners: list[Listener]
    log: Log
    app: Callable[..., Any] | None = None  # set only with --preload
    state: State = State.BOOTING
    exit_code: int = ExitCode.OK
    # Transition lines waiting (at most LIVE_LINE_WAIT, until held_until) for live numbers:
    # (level, message, state, fields). The transitions themselves happened already.
    held_lines: list[tuple[str, str, str, dict[str, Any]]] = field(default_factory=list)
    held_until: float | None = None
    hooks: Hooks = field(default_factory=Hooks)  # --hooks: re-imported at each HUP

    def __post_init__(self) -> None:
        # What the server hooks see of us (live: its config is the current one).
        self.server_info = ServerInfo(os.getpid(), lambda: self.config, HookLog(self.log))

    # -- set-up ----------------------------------------------------------------------------
    def run(self) -> int:
        self.signals = sigs.SignalQueue(ARBITER_SIGNALS)
        inherited = self.inherited
        if inherited is not None:
            # After an in-place upgrade: the same pipes, so the old workers (still our
            # children) go on reporting, and go on seeing the arbiter alive.
            self.counter_r, self.counter_w = inherited.counter
            self.alive_r, self.alive_w = inherited.alive
            for fd in (self.counter_r, self.counter_w, self.alive_r, self.alive_w):
                os.set_inheritable(fd, False)
        else:
            self.counter_r, self.counter_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
            # Workers poll the read end; when the arbiter dies (even by SIGKILL) the last
            # write end closes and every worker sees EOF at once (Puma's check pipe).
            self.alive_r, self.alive_w = os.pipe2(os.O_CLOEXEC)
        self.decoder = Decoder()
        self.worker_cls = worker_class(self.config.worker_class)
        self.worker_cls.share_imports()
        self.settings = WorkerSettings.of(self.config, self.metrics_dir(), self.tls)
        self.dispatch: dict[int, Callable[[], None]] = {
            signal.SIGTERM: self.stop,
            signal.SIGINT: self.interrupt,
            signal.SIGQUIT: self.halt,
            signal.SIGHUP: self.reload,
            signal.SIGUSR1: self.reopen_logs,
            signal.SIGUSR2: self.upgrade,
            signal.SIGTTIN: self.resume,
            signal.SIGTTOU: self.pause,
            signal.SIGCHLD: self.reap,
        }
        self.reactor = reactor = Reactor()
        if self.config.capture_output:
            self.capture = OutputCapture(reactor, self.log)
        # The signal and counter pipes wake the loop; each round reads them itself, first.
        reactor.add(self.signals.fileno(), select.POLLIN, read_each_round)
        reactor.add(self.counter_r, select.POLLIN, read_each_round)
        if self.config.control_socket:
            try:
                self.control = ControlServer(self.config.control_socket, self.command, reactor)
            except ControlError as exc:
                if inherited is None:
                    # Nothing forked yet: one line, exit 1, and the listeners closed (a unix
                    # one's file removed) as at any exit.
                    self.log.error(str(exc))
                    for listener in self.listeners:
                        listener.close(unlink=True)
                    if self.status_sock is not None:
                        self.status_sock.close()
                    return ExitCode.ERROR
                # After an in-place upgrade the old image's workers serve: keep them serving.
                self.log.error(f"{exc}; serving without it")
        if self.status_sock is not None:
            self.status_server = StatusServer(self.status_sock, reactor, self.answer_status,
                                              self.log, accepting=not self.status_deferred)
        self.log.info("Starting forkserve", listening=",".join(l.name() for l in self.listeners),
                      workers=self.config.worker_count, worker_class=self.config.worker_class,
                      app=self.config.app)
        if inherited is not None:
            self.adopt_old_workers(inherited.workers, inherited.generation)
            # What the old image had been asked and had not acted on yet (see exec_upgrade).
            self.reload_wanted = "reload" in inherited.wanted
            self.upgrade_wanted = "upgrade" in inherited.wanted
            self.signals.replay(inherited.signals)
        if self.notifier is not None and self.notifier.enabled and self.notifier.watchdog_interval:
            self.next_watchdog = time.monotonic()
        self.hooks.call("on_starting", self.log, self.server_info)
        self.hooks.call("nworkers_changed", self.log, self.server_info,
                        self.config.worker_count, None)
        if self.app is not None and self.config.gc_freeze:
            freeze_shared(self.log)
        self.start_watching()  # (--reload) before the first fork: an edit during the boot counts
        self.spawn_missing(time.monotonic())
        if inherited is not None and inherited.status_stand_in:
            # Our status server answers from the next poll on (or we have none: the setting
            # changed): the stand-in that answered through the exec can go.
            self.stand_in = inherited.status_stand_in
            self.stop_stand_in()
        while self.state is not State.STOPPED:
            ready = reactor.wait(self.next_timeout(time.monotonic()))
            for signum in self.signals.drain():
                self.dispatch.get(signum, self.reap)()
            self.read_counters()
            self.reap()
            reactor.dispatch(ready)  # the control socket's and the status server's clients
            now = time.monotonic()
            self.settle_refresh(now)
            if self.control is not None:
                self.control.expire(now)
            if self.status_server is not None:
                self.status_server.expire(now)
            self.tick(now)
        self.shutdown()
        return self.exit_code

    def shutdown(self) -> None:
        self.stop_watching()
        for listener in self.listeners:
            listener.close(unlink=True)
        if self.control is not None:
            self.control.close()
        if self.capture is not None:
            self.capture.close()  # what the last workers wrote, before the closing line
        self.hooks.call("on_exit", self.log, self.server_info)
        self.log.info("Server stopped", exit_code=int(self.exit_code))
        # Last: the status server answered through the whole drain, and answers the probes
        # it accepted before it closed. (The cli then removes the metrics directory.)
        if self.status_server is not None:
            self.status_server.close(grace=FINAL_GRACE)

    # -- state -----------------------------------------------------------------------------
    # -- state -----------------------------------------------------------------------------
    def transition(self, event: Event, message: str, level: str = "info",
                   live_numbers: bool = False, **fields: Any) -> None:
        """Change state and write its one line. ``live_numbers``: the line's counters must be
        the workers' live ones, not their last heartbeats; it is held (never the transition)
        until they are in, at most LIVE_LINE_WAIT. Lines keep their order: a later
        transition writes the held ones first."""
        self.state = next_state(self.state, event)
        line = (level, message, self.state.value, fields)
        if live_numbers:
            self.held_lines.append(line)
            if self.held_until is None:
                self.held_until = time.monotonic() + LIVE_LINE_WAIT
            self.write_held_lines(time.monotonic())
            return
        self.write_held_lines(None)
        self.write_line(line)

    def write_line(self, line: tuple[str, str, str, dict[str, Any]]) -> None:
        level, message, state, fields = line
        getattr(self.log, level)(message, state=state, **self.totals(), **fields)

    def write_held_lines(self, now: float | None) -> None:
        """The held transition lines, once the numbers are live (``now`` None: at once)."""
        if not self.held_lines:
            return
        if now is not None and not self.numbers_live(now):
            return
        lines, self.held_lines, self.held_until = self.held_lines, [], None
        for line in lines:
            self.write_line(line)

    def numbers_live(self, now: float) -> bool:
        """Every worker has told its live numbers since the stop (or the wait is over): the
        ones asked (SIGWINCH) answered, and in a drain every one took the stop (a DRAINING
        record carries live counters, and from then on each change)."""
        if self.held_until is not None and now >= self.held_until:
            return True
        if self.fresh is not None:
            return False
        if self.state in (State.DRAINING, State.CANCELLING):
            return all(h.draining for h in self.workers.values())
        return True

    # -- deadlines -------------------------------------------------------------------------
    def deadlines(self, now: float) -> Iterator[float]:
        """The registry: every owner's next moment to act (the loop sleeps until the first)."""
        if self.held_until is not None:
            yield self.held_until
        yield from self.drain_deadlines()
        yield from self.worker_deadlines(now)
        yield from self.observe_deadlines()
        yield from self.handoff_deadlines()
        yield from self.watch_deadlines()

    def next_timeout(self, now: float) -> float | None:
        first = min(self.deadlines(now), default=None)
        return None if first is None else max(first - now, 0.0)

    def tick(self, now: float) -> None:
        """Each owner acts on what is due, in this order."""
        self.write_held_lines(now)  # first: before any later line (progress, escalations)
        self.worker_tick(now)
        self.observe_tick(now)
        self.drain_tick(now)
        self.handoff_tick(now)
        self.watch_tick(now)
        if self.state in (State.BOOTING, State.RUNNING):
            self.spawn_missing(now)
        self.carry_out_wanted()


def freeze_shared(log: Log) -> None:
    """With --preload, before the first fork: every object there is (the application's, and
    ours, the worker code included) moved to the permanent generation. They are shared with
    the workers copy-on-write, and a full collection in a worker would otherwise write to each
    one's header (its gc bookkeeping), so copy every page the heap lies on, in every worker.
    Frozen, they are never visited, by the workers (who inherit the permanent generation;
    they must not unfreeze) nor by us. The import's garbage is collected first, so as not to
    keep it forever. Once is enough: from here the arbiter runs no application code, and what
    it allocates itself is small (freezing again before later forks would keep its own
    garbage for good). See the gc.freeze documentation."""
    gc.collect()
    gc.freeze()
    log.debug("Preloaded application frozen for copy-on-write (gc.freeze)",
              frozen_objects=gc.get_freeze_count())


def read_each_round(fd: int, events: int) -> None:
    """The signal and counter pipes' callback: nothing (they only wake the loop; each round
    reads them first, before any client is answered, so an answer sees the new state)."""
