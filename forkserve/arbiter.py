"""The arbiter: the one loop that owns the listeners, the workers and the life-cycle state.

Owns: spawning, reaping and replacing workers (the ``WorkerHandle`` table), reading the counter
pipe, worker liveness, reload generations, and applying what :mod:`forkserve.lifecycle`
decides. It never runs application code (unless ``--preload``, and then only before forking).

# -- runs in the loop ----------------------------------------------------------------------
Everything here runs in the loop. Signals reach it as bytes on a wakeup pipe
(:mod:`forkserve.signals`); the loop blocks in ``poll`` until the next deadline.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from forkserve import __version__
from forkserve import signals as sigs
from forkserve.config import Config, ConfigError, reloadable_changes, resolve
from forkserve.control import ControlServer
from forkserve.counters import Decoder, ExitCode, Kind, Record
from forkserve.lifecycle import Event, State, accepts, next_state
from forkserve.logs import Log
from forkserve.metrics import ENV as METRICS_ENV
from forkserve.metrics import RELOADS_HELP, RESTARTS_HELP
from forkserve.sockets import (BindError, Listener, bind, holds_inode, holds_socket,
                               other_listeners, refuse_new_connections, socket_inode,
                               steer_new_connections_here)
from forkserve.status import (OPENMETRICS_PATH, RETRY_AFTER, ArbiterCollector, Answer,
                              StatusServer, bind_status, rss_bytes, run_stand_in)
from forkserve.systemd import status_line
from forkserve.workers import worker_class
from forkserve.workers.base import WorkerSettings

ARBITER_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGQUIT, signal.SIGHUP, signal.SIGUSR1,
                   signal.SIGUSR2, signal.SIGCHLD, signal.SIGTTIN, signal.SIGTTOU)

KILL_GRACE = 2.0  # seconds between SIGABRT/SIGQUIT and SIGKILL for a worker that will not go
MAX_RESPAWN_DELAY = 10.0
# Seconds a replacement's boot keeps the instance ready while no other worker serves (all of
# them recycled at once by --max-requests): clients wait in the queue that long at most.
READY_THROUGH_BOOT = 5.0
RESUME_RETRY = 0.02  # seconds between binds while a TTIN waits for our paused workers' port
MAX_POLL_MS = 3_600_000.0
STATUS_FINISH = 1.0  # seconds status requests in progress get before an upgrade's exec
REFRESH_WAIT = 0.1  # seconds a status answer waits for the workers' live numbers
FRESH_FOR = 0.05  # numbers this recent answer without asking again (a burst of scrapes)
# How long a stop's transition lines wait for the workers' live numbers (a busy sync worker
# reports only between requests, so the last numbers we have may say nothing is in flight).
LIVE_LINE_WAIT = 0.5
# What an in-place upgrade hands to the new image (read and removed by cli.main).
UPGRADE_ENV = "FORKSERVE_UPGRADE_HANDOVER"


@dataclass
class WorkerHandle:
    """The arbiter's record of one worker process (the child's own runtime is ``Worker``)."""

    worker_id: int
    generation: int
    pid: int = 0
    spawned_at: float = 0.0
    last_seen: float = 0.0
    booted: bool = False
    stopping: bool = False  # TERM or QUIT sent, or retiring on its own
    draining: bool = False  # it took the stop: its records now follow every change
    deaf: bool = False  # paused (TTOU): it closed its listeners for good; it serves no newcomer
    retiring: str = ""  # why the worker leaves on its own (max-requests)
    boot_error: str = ""
    kill_reason: str = ""
    escalate_at: float | None = None  # when to send escalate_signal (a worker not leaving)
    escalate_signal: int = signal.SIGKILL
    active_connections: int = 0
    in_flight_requests: int = 0
    background_tasks: int = 0
    requests_served: int = 0

    def describe(self) -> str:
        return f"Worker {self.worker_id} (pid {self.pid})"


@dataclass
class Arbiter:
    config: Config
    cli_args: dict[str, Any]
    listeners: list[Listener]
    log: Log
    app: Callable[..., Any] | None = None  # set only with --preload
    state: State = State.BOOTING
    generation: int = 1
    workers: dict[int, WorkerHandle] = field(default_factory=dict)
    exit_code: int = ExitCode.OK
    reload_generation: int | None = None  # a HUP's generation still booting
    # A reload or upgrade asked for while another was in progress: carried out once it is
    # over (any number of requests coalesce into one), dropped only if the server stops.
    reload_wanted: bool = False
    upgrade_wanted: bool = False
    # Transition lines waiting (at most LIVE_LINE_WAIT, until held_until) for live numbers:
    # (level, message, state, fields). The transitions themselves happened already.
    held_lines: list[tuple[str, str, str, dict[str, Any]]] = field(default_factory=list)
    held_until: float | None = None
    deadline: float | None = None  # the drain deadline
    lameduck_until: float | None = None
    next_progress: float = 0.0  # next "Draining in-flight connections" line
    respawn_after: float = 0.0
    boot_failures: int = 0
    int_count: int = 0
    previous: tuple[Config, WorkerSettings, type] | None = None  # what a failed reload restores
    inherited: dict[str, Any] | None = None  # what an in-place upgrade handed over
    argv: list[str] = field(default_factory=list)  # our command line, for the upgrade
    cwd: str = ""  # where we were started, for the upgrade's check and exec
    control: ControlServer | None = None
    upgrade_check: subprocess.Popen[bytes] | None = None
    upgrading_from: int | None = None  # the old image's generation, until its workers are gone
    paused: bool = False
    paused_addresses: list[str] = field(default_factory=list)
    paused_status: str = ""  # the status server's address while paused (TTOU)
    paused_inodes: list[int] = field(default_factory=list)  # the listeners we closed at TTOU
    # A TTIN whose bind found the port still held by our own paused workers (serving what was
    # queued at the pause): tried again at resume_retry_at, until resume_until.
    resume_retry_at: float | None = None
    resume_until: float = 0.0
    notifier: Any = None  # forkserve.systemd.Notifier, when systemd is listening
    next_watchdog: float | None = None  # next WATCHDOG=1, when systemd asks for them
    fresh: set[int] | None = None  # workers heard from since numbers_fresh() asked
    refresh_asked: set[int] = field(default_factory=set)
    refresh_until: float = 0.0
    refreshed_at: float = -1.0
    status_sock: Any = None  # the --status-bind listener (socket.socket), bound by the cli
    status_server: StatusServer | None = None
    # The status stand-in answering while an in-place upgrade execs (its pid): the old image's
    # child until the new image, once its own status server is up, stops and reaps it.
    stand_in: int | None = None
    # A successor's status listener (-sf with --takeover or --reuse-port): held, not answered
    # on, until our workers are booted; the instance we replace answers ready meanwhile.
    status_deferred: bool = False
    # Instances we handed our status listener to (the `listeners` command), by pid.
    status_successors: set[int] = field(default_factory=set)
    status_left: bool = False  # we left the status port to a successor serving it (at our stop)
    metrics: Any = None  # forkserve.metrics.Store, when metrics are on
    started_at: float = field(default_factory=time.time)

    # -- set-up ----------------------------------------------------------------------------
    def run(self) -> int:
        self.signals = sigs.SignalQueue(ARBITER_SIGNALS)
        if self.inherited is not None:
            # After an in-place upgrade: the same pipes, so the old workers (still our
            # children) go on reporting, and go on seeing the arbiter alive.
            self.counter_r, self.counter_w = self.inherited["counter"]
            self.alive_r, self.alive_w = self.inherited["alive"]
            for fd in (self.counter_r, self.counter_w, self.alive_r, self.alive_w):
                os.set_inheritable(fd, False)
        else:
            self.counter_r, self.counter_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
            # Workers poll the read end; when the arbiter dies (even by SIGKILL) the last
            # write end closes and every worker sees EOF at once (Puma's check pipe).
            self.alive_r, self.alive_w = os.pipe2(os.O_CLOEXEC)
        self.decoder = Decoder()
        self.worker_cls = worker_class(self.config.worker_class)
        self.settings = WorkerSettings(self.config)
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
        self.poller = poller = select.poll()
        poller.register(self.signals.fileno(), select.POLLIN)
        poller.register(self.counter_r, select.POLLIN)
        if self.config.control_socket:
            self.control = ControlServer(self.config.control_socket, self.command)
            poller.register(self.control.fileno(), select.POLLIN)
        if self.status_sock is not None:
            self.status_server = StatusServer(self.status_sock, poller, self.answer_status,
                                              self.log, accepting=not self.status_deferred)
        self.log.info("Starting forkserve", listening=",".join(l.name() for l in self.listeners),
                      workers=self.config.worker_count, worker_class=self.config.worker_class,
                      app=self.config.app)
        if self.inherited is not None:
            self.adopt_old_workers(self.inherited["workers"], self.inherited["generation"])
            # What the old image had been asked and had not acted on yet (see exec_upgrade).
            wanted = self.inherited.get("wanted", [])
            self.reload_wanted, self.upgrade_wanted = "reload" in wanted, "upgrade" in wanted
            self.signals.replay(self.inherited.get("signals", []))
        if self.notifier is not None and self.notifier.enabled and self.notifier.watchdog_interval:
            self.next_watchdog = time.monotonic()
        self.spawn_missing(time.monotonic())
        if self.inherited is not None and self.inherited.get("status_stand_in"):
            # Our status server answers from the next poll on (or we have none: the setting
            # changed): the stand-in that answered through the exec can go.
            self.stand_in = int(self.inherited["status_stand_in"])
            self.stop_stand_in()
        while self.state is not State.STOPPED:
            timeout = self.next_timeout(time.monotonic())
            # Capped: poll() overflows past ~24 days (a --drain-timeout of 1e7 is legal).
            ready = poller.poll(MAX_POLL_MS if timeout is None
                                else min(timeout * 1000.0 + 1, MAX_POLL_MS))
            for signum in self.signals.drain():
                self.dispatch.get(signum, self.reap)()
            self.read_counters()
            if self.fresh is not None and self.refresh_done(time.monotonic()) \
                    and self.status_server is not None:
                self.status_server.resume()
            self.reap()
            if self.control is not None:
                self.serve_control(ready)
            if self.status_server is not None:
                self.status_server.serve(ready, time.monotonic())
            self.tick(time.monotonic())
        self.shutdown()
        return self.exit_code

    def shutdown(self) -> None:
        for listener in self.listeners:
            listener.close(unlink=True)
        if self.control is not None:
            self.control.close()
        self.log.info("Server stopped", exit_code=int(self.exit_code))
        # Last: the status server answered through the whole drain. (The cli then removes
        # the metrics directory.)
        if self.status_server is not None:
            self.status_server.close()

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

    def totals(self) -> dict[str, int]:
        live = self.workers.values()
        return {
            "active_connections": sum(h.active_connections for h in live),
            "in_flight_requests": sum(h.in_flight_requests for h in live),
            "background_tasks": sum(h.background_tasks for h in live),
            "workers": len(self.workers),
        }

    # -- signals (dispatched from the loop) ---------------------------------------------------
    def stop(self) -> None:
        if not accepts(self.state, Event.STOP):
            return  # already stopping: a second TERM changes nothing
        self.leave_status_port()
        self.read_counters()
        self.numbers_fresh()  # asks busy workers for their numbers: the line waits for them
        if self.reload_wanted or self.upgrade_wanted:
            self.log.info("A coalesced reload or upgrade is dropped: the server is stopping")
            self.reload_wanted = self.upgrade_wanted = False
        self.transition(Event.STOP, "Received shutdown signal, draining connections",
                        live_numbers=True, lameduck=self.config.lameduck)
        if self.state is State.LAMEDUCK:
            # Still serving and accepting; readiness already fails, so load balancers can take
            # this instance out before it stops accepting.
            self.lameduck_until = time.monotonic() + self.config.lameduck
            if self.config.lameduck > 0:
                return
            self.lameduck_until = None
        self.begin_drain()

    def begin_drain(self) -> None:
        """Stop accepting (workers serve what is queued, then close), drain what is in flight."""
        if self.state is State.LAMEDUCK:
            self.lameduck_until = None
            self.transition(Event.LAMEDUCK_OVER, "Stopped accepting; draining in-flight work",
                            live_numbers=True)
        for listener in self.listeners:
            # New clients are refused from now on (their SYNs dropped until the port closes);
            # the queue can only shrink, and the workers drain it, then close.
            refuse_new_connections(listener)
            listener.sock.close()  # the workers hold the accept queue until they drained it
        now = time.monotonic()
        self.deadline = now + self.config.drain_timeout
        self.next_progress = now + 1.0
        self.notify("stopping")
        self.signal_workers(signal.SIGTERM, list(self.workers.values()))
        self.check_drained()

    def cancel(self) -> None:
        """The drain deadline: cancel what still runs, give it the cancel grace, then kill."""
        totals = self.totals()
        self.transition(Event.DEADLINE, "Drain timeout reached, cancelling in-flight requests",
                        level="warning", remaining_connections=totals["active_connections"])
        when = time.monotonic() + self.config.cancel_grace
        for handle in self.workers.values():
            self.send(handle, signal.SIGUSR2)
            self.escalate(handle, when, signal.SIGKILL)
        self.check_drained()

    def check_drained(self) -> None:
        """Event-driven from the counters: nothing in flight in any worker that took the stop."""
        if not accepts(self.state, Event.DRAINED):
            return
        if self.workers:
            if not all(h.draining for h in self.workers.values()):
                return  # a worker's numbers are not live yet
            totals = self.totals()
            if totals["active_connections"] or totals["in_flight_requests"] or totals["background_tasks"]:
                return
        self.transition(Event.DRAINED, "All connections drained")
        self.check_gone()

    def interrupt(self) -> None:
        self.int_count += 1
        if self.int_count > 1 and self.state in (State.LAMEDUCK, State.DRAINING, State.CANCELLING,
                                                 State.FLUSHING):
            self.halt()
        else:
            self.stop()

    def halt(self) -> None:
        if not accepts(self.state, Event.HARD_STOP):
            return
        self.leave_status_port()
        self.transition(Event.HARD_STOP, "Hard stop: stopping workers now")
        self.halt_workers()

    def halt_workers(self) -> None:
        for listener in self.listeners:
            listener.sock.close()
        now = time.monotonic()
        for handle in self.workers.values():
            handle.stopping = True
            self.send(handle, signal.SIGQUIT)
            self.escalate(handle, now + KILL_GRACE, signal.SIGKILL)
        self.check_gone()

    def leave_status_port(self) -> None:
        """At our stop, when a successor serves our status port (the -sf handoff, with
        --takeover: one we handed this very listener to still holds it; with --reuse-port:
        another listener on the same address): leave it at once. Answering 503 there would
        tell the balancer that the port is going away while the successor serves it."""
        server = self.status_server
        if server is None or server.sock.fileno() < 0 or self.status_left:
            return
        shared = any(holds_socket(pid, server.sock) for pid in self.status_successors)
        if not shared and not (self.config.reuse_port and other_listeners(server.sock)):
            return
        address = server.sock.getsockname()
        server.leave(own_queue=not shared)
        self.status_left = True
        self.log.info("Left the status port to the successor serving it",
                      status_bind=f"{address[0]}:{address[1]}",
                      how="shared listener" if shared else "SO_REUSEPORT")

    def reopen_logs(self) -> None:
        self.log.reopen()
        self.log.info("Reopened log files")
        self.signal_workers(signal.SIGUSR1, list(self.workers.values()))

    def reloading(self) -> bool:
        """A reload or an upgrade is in progress: a new generation booting, an upgrade's check
        running, or the new image booting while the old image's workers serve."""
        return (self.reload_generation is not None or self.upgrade_check is not None
                or self.upgrading_from is not None)

    def reload(self) -> None:
        if self.state not in (State.BOOTING, State.RUNNING):
            self.log.warning("Reload ignored: the server is stopping", state=self.state.value)
            return
        if self.state is State.BOOTING or self.reloading():
            # Remembered, not dropped (a second `systemctl reload` during a deploy): carried
            # out when this one is over; any number of them coalesce into one.
            self.reload_wanted = True
            self.log.info("Reload requested during another reload or upgrade; coalesced, it "
                          "follows once that one completes", state=self.state.value)
            return
        try:
            new = resolve(self.cli_args, os.environ)
        except ConfigError as exc:
            self.log.error("Reload failed, keeping the current configuration", error=str(exc))
            self.count_reload("failed")
            return
        fixed = list(reloadable_changes(self.config, new))
        if fixed:
            self.log.warning("These settings need a restart to change; kept as they were",
                             settings=",".join(fixed))
            for name in fixed:
                new.values[name] = self.config.values[name]
        if self.app is not None:
            self.log.warning("With --preload, HUP restarts workers but not the application code")
        self.previous = (self.config, self.settings, self.worker_cls)
        self.config = new
        self.log.configure(new.log_level, new.log_format)
        self.settings = WorkerSettings(new)
        self.worker_cls = worker_class(new.worker_class)
        self.notify("reloading")
        self.start_generation("Reloading")

    def carry_out_wanted(self) -> None:
        """A coalesced reload or upgrade, once nothing else is in progress. An upgrade also
        re-reads the configuration and starts a new generation: it answers a reload asked for
        before it started as well."""
        if self.state is not State.RUNNING or self.reloading() or self.paused:
            return
        if self.upgrade_wanted:
            self.upgrade_wanted = self.reload_wanted = False
            self.upgrade()
        elif self.reload_wanted:
            self.reload_wanted = False
            self.reload()

    def start_generation(self, why: str) -> None:
        """Boot a new generation of workers; the old one is retired once it has booted."""
        self.generation += 1
        self.reload_generation = self.generation
        self.log.info(f"{why}: starting a new generation of workers", generation=self.generation,
                      workers=self.config.worker_count)
        self.spawn_missing(time.monotonic())

    # -- in-place upgrade (USR2) ----------------------------------------------------------
    def upgrade(self) -> None:
        """Check the new code and config in a child first; exec ourselves only if it passes."""
        if self.state not in (State.BOOTING, State.RUNNING):
            self.log.warning("Upgrade ignored: the server is stopping", state=self.state.value)
            return
        if self.paused:
            # Paused means a successor is taking over our ports (TTOU): nothing to upgrade.
            self.log.warning("Upgrade ignored: the server is paused", state=self.state.value)
            return
        if self.state is State.BOOTING or self.reloading():
            self.upgrade_wanted = True
            self.log.info("Upgrade requested during another reload or upgrade; coalesced, it "
                          "follows once that one completes", state=self.state.value)
            return
        self.log.info("Upgrade requested: checking the new configuration and application")
        env = dict(os.environ)
        if self.metrics is not None:
            try:
                env[METRICS_ENV] = self.metrics.scratch()  # the check's app import must not count
            except OSError as exc:
                self.log.error(f"Upgrade aborted, still serving: the metrics directory is not "
                               f"usable: {exc}")
                self.count_reload("failed")
                return
        self.upgrade_check = subprocess.Popen(
            [sys.executable, "-m", "forkserve", "--check", *self.argv], cwd=self.cwd or None,
            env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)

    def upgrade_checked(self, status: int) -> None:
        check, self.upgrade_check = self.upgrade_check, None
        assert check is not None
        check.returncode = os.waitstatus_to_exitcode(status)  # reaped by our loop, not by Popen
        if self.metrics is not None:
            self.metrics.drop_scratch()
        error = check.stderr.read().decode("utf-8", "replace").strip() if check.stderr else ""
        if check.stderr is not None:
            check.stderr.close()
        if check.returncode != 0:
            reason = error.splitlines()[-1] if error else f"the check exited {check.returncode}"
            self.log.error(f"Upgrade aborted, still serving: {reason}")
            self.count_reload("failed")
            return
        if self.state is not State.RUNNING:
            self.log.warning("Upgrade abandoned: the server is stopping")
            return
        self.exec_upgrade()

    def exec_upgrade(self) -> None:
        # From here to the new image's SignalQueue, a handled signal must not be acted on by
        # its default action (HUP, USR1, USR2, TERM would kill the new image before it has
        # handlers: a total outage). Blocked, it stays pending across execve and reaches the
        # new image's handlers; what already reached ours is handed over below.
        mask = sigs.block(ARBITER_SIGNALS)
        self.notify("reloading")
        handover: dict[str, Any] = {
            "listeners": [[l.fd, l.address, l.unix_path is not None] for l in self.listeners],
            "counter": [self.counter_r, self.counter_w],
            "alive": [self.alive_r, self.alive_w],
            "workers": [[h.pid, h.worker_id, h.generation, h.booted, h.stopping, h.draining]
                        for h in self.workers.values()],
            "generation": self.generation,
            "wanted": [what for what, wanted in (("reload", self.reload_wanted),
                                                 ("upgrade", self.upgrade_wanted)) if wanted],
        }
        if self.status_server is not None:
            if self.status_server.clients:
                self.log.info("Upgrade: answering the status requests in progress first",
                              clients=len(self.status_server.clients))
            self.status_server.finish(time.monotonic() + STATUS_FINISH)
            handover["status_fd"] = self.status_server.fileno()
            os.set_inheritable(self.status_server.fileno(), True)
            # Who answers on it until the new image's status server does.
            handover["status_stand_in"] = self.stand_in = self.fork_stand_in()
        if self.metrics is not None:
            handover["metrics_dir"] = self.metrics.path
            handover["metrics_owned"] = self.metrics.owned
        for fd in [l.fd for l in self.listeners] + [self.counter_r, self.counter_w,
                                                     self.alive_r, self.alive_w]:
            os.set_inheritable(fd, True)
        # Last, after the status clients were answered: the signals our handlers recorded and
        # the loop has not dispatched (the wakeup pipe does not survive the exec).
        signals = self.signals.undelivered()
        handover["signals"] = signals
        env = dict(os.environ)
        env[UPGRADE_ENV] = json.dumps(handover)
        if self.control is not None:
            self.poller.unregister(self.control.fileno())
            self.control.close()  # the new image opens it again at the same path
            self.control = None
        self.log.info("Upgrade: re-executing", pid=os.getpid(), generation=self.generation)
        try:
            if self.cwd:
                os.chdir(self.cwd)
            os.execve(sys.executable, [sys.executable, "-m", "forkserve", *self.argv], env)
        except OSError as exc:
            self.log.error(f"Upgrade failed, still serving: cannot exec: {exc.strerror}")
            self.count_reload("failed")
            self.stop_stand_in()  # we answer again from the next poll on; the loop reaps it
            sigs.set_mask(mask)
            self.signals.replay(signals)
            if self.status_server is not None:
                os.set_inheritable(self.status_server.fileno(), False)
            for fd in [l.fd for l in self.listeners] + [self.counter_r, self.counter_w,
                                                         self.alive_r, self.alive_w]:
                os.set_inheritable(fd, False)
            if self.config.control_socket:
                self.control = ControlServer(self.config.control_socket, self.command)
                self.poller.register(self.control.fileno(), select.POLLIN)

    def stand_in_answers(self) -> dict[str, Answer]:
        """What the stand-in answers, by path: the old image's view at the exec. Readiness is
        as it is now (the workers go on serving through the exec); /status is the last
        snapshot, marked "upgrading"; /metrics the last exposition, in both formats (a scrape
        during the exec gets valid, monotonic numbers a moment old, not a failed scrape); the
        rest asks to retry."""
        ready = self.ready()
        snapshot = {**self.status(), "state": "upgrading"}
        return {
            "/healthz": _json(200, {"status": "alive", "state": "upgrading"}),
            "/readyz": _json(200 if ready else 503, {"ready": ready, "state": "upgrading",
                                                     "generation": self.generation,
                                                     "reloading": True}),
            "/status": _json(200, snapshot),
            "/metrics": self.last_metrics(b""),
            OPENMETRICS_PATH: self.last_metrics(b"application/openmetrics-text"),
        }

    def last_metrics(self, accept: bytes) -> Answer:
        """/metrics as it is now (the numbers the workers last reported), for the stand-in."""
        try:
            return self.status_page("/metrics", {b"accept": accept})
        except Exception as exc:  # the stand-in asks scrapers to retry instead
            self.log.exception("The stand-in's metrics could not be rendered", exc)
            return (503, "text/plain; charset=utf-8",
                    b"upgrading; the metrics are back in a moment\n", RETRY_AFTER)

    def fork_stand_in(self) -> int:
        """The status stand-in (see forkserve.status.run_stand_in): a child holding only the
        status listener, the alive pipe's read end (it exits when the arbiter is gone, so never
        an orphan) and the log. Forked, not started: it answers from the first instant, and it
        imports nothing (neither the app nor anything else)."""
        server = self.status_server
        assert server is not None
        answers = self.stand_in_answers()
        pid = sigs.fork_with_signals_blocked()
        if pid == 0:  # the child: never returns into the arbiter's loop
            code = ExitCode.ERROR
            try:
                keep = sorted({self.log.fd, server.fileno(), self.alive_r} - {0, 1, 2, -1})
                for low, high in zip([2, *keep], [*keep, os.sysconf("SC_OPEN_MAX")]):
                    if low + 1 < high:  # (an empty range would be read as "to the end")
                        os.closerange(low + 1, high)  # the rest: main listeners, pipes...
                wakeup = sigs.stand_in_signals(
                    ARBITER_SIGNALS, wake_on=(signal.SIGTERM,),
                    ignore=(signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2, signal.SIGTTIN,
                            signal.SIGTTOU, signal.SIGWINCH))
                code = run_stand_in(server.sock, wakeup, self.alive_r, answers, self.log)
            except BaseException as exc:  # noqa: BLE001 - reported, then the child exits
                self.log.exception("Upgrade: the status stand-in failed", exc)
            finally:
                os._exit(code)
        self.log.info("Upgrade: a status stand-in answers until the new image does", pid=pid)
        return pid

    def stop_stand_in(self) -> None:
        if self.stand_in is None:
            return
        try:
            os.kill(self.stand_in, signal.SIGTERM)
        except ProcessLookupError:
            self.stand_in = None  # gone (a child we have not reaped cannot be: its pid is ours)

    def adopt_old_workers(self, workers: list[list[Any]], generation: int) -> None:
        """The new image's view of the workers the old image handed over (an older image
        hands over only pid, id and generation: booted, then, and serving)."""
        now = time.monotonic()
        for pid, worker_id, worker_generation, *flags in workers:
            booted, stopping, draining = (list(flags) + [True, False, False][len(flags):])[:3]
            self.workers[pid] = WorkerHandle(worker_id, worker_generation, pid=pid, spawned_at=now,
                                             last_seen=now, booted=bool(booted),
                                             stopping=bool(stopping), draining=bool(draining))
        self.generation = generation + 1
        self.upgrading_from = generation

    # -- pause and resume (TTOU / TTIN): HAProxy's handoff protocol ------------------------------
    def pause(self) -> None:
        if self.paused and self.resume_retry_at is not None:
            self.resume_retry_at = None  # the last word is TTOU's: stay paused
            self.log.info("Paused: the resume that was waiting for the port is called off")
            return
        if self.state is not State.RUNNING or self.paused:
            return
        self.paused = True
        self.paused_addresses = [l.name() for l in self.listeners]
        self.paused_inodes = [socket_inode(l.sock) for l in self.listeners if l.sock.fileno() >= 0]
        for listener in self.listeners:
            # As at a stop: the queue only shrinks (new clients wait for the port's next
            # owner), so the workers can drain it and free the port while clients keep coming.
            refuse_new_connections(listener)
            listener.close(unlink=False)
        self.listeners = []
        if self.status_server is not None and self.status_server.sock.fileno() >= 0:
            self.paused_status = self.status_server.stop_listening()
        # Workers serve what is queued, then close their copies: the port is then free.
        for handle in self.workers.values():
            handle.deaf = True
        self.signal_workers(signal.SIGTTOU, list(self.workers.values()))
        self.log.info("Paused: not listening", addresses=",".join(self.paused_addresses))

    def resume(self) -> None:
        if not self.paused or self.state is not State.RUNNING:
            self.resume_retry_at = None
            return
        try:
            self.listeners = bind(self.paused_addresses, self.config.backlog, self.config.reuse_port)
        except BindError as exc:
            if not self.resume_waits(time.monotonic()):
                self.log.error(f"Resume failed, still paused: {exc}")
            return
        self.resume_retry_at = None
        self.paused = False
        if self.status_server is not None and self.paused_status:
            try:
                self.status_server.listen(bind_status(self.paused_status, self.config.reuse_port))
            except OSError as exc:
                self.log.error("Resume: cannot bind the status server again; serving without it",
                               status_bind=self.paused_status, error=exc.strerror)
            self.paused_status = ""
        self.log.info("Resumed: listening again", listening=",".join(l.name() for l in self.listeners))
        # The workers closed their listeners; a new generation gets the new ones.
        self.start_generation("Resume")

    def resume_waits(self, now: float) -> bool:
        """The bind failed: is the port still held by our own paused workers, serving what was
        queued at the pause before they close their copies (a TTIN soon after a TTOU, a sync
        worker in a long request)? Then try again shortly, bounded by the drain timeout; a port
        held by anyone else fails the resume at once."""
        held = any(holds_inode(pid, inode) for pid in self.workers for inode in self.paused_inodes)
        if self.resume_retry_at is None:
            if not held:
                return False
            self.resume_until = now + self.config.drain_timeout
            self.log.info("Resume: the paused workers still hold the port while they serve what "
                          "was queued; listening again once they have let it go")
        elif not held or now >= self.resume_until:
            self.resume_retry_at = None
            return False
        self.resume_retry_at = now + RESUME_RETRY
        return True

    # -- the control socket --------------------------------------------------------------------
    def serve_control(self, ready: list[tuple[int, int]]) -> None:
        control = self.control
        assert control is not None
        for fd, _ in ready:
            if fd == control.fileno():
                for client in control.accept():
                    self.poller.register(client, select.POLLIN)
            elif fd in control.clients and control.readable(fd):
                self.poller.unregister(fd)
        for fd in control.expired(time.monotonic()):
            self.poller.unregister(fd)
            control.drop(fd)

    def command(self, name: str, arg: str) -> tuple[dict[str, Any], list[int]]:
        """One control-socket command; the answer and any fds to send with it."""
        simple = {"reload": self.reload, "upgrade": self.upgrade, "stop": self.stop,
                  "pause": self.pause, "resume": self.resume}
        if name in simple:
            simple[name]()
            return {"ok": True, "state": self.state.value}, []
        if name == "status":
            self.refresh_counters()
            return self.status(), []
        if name == "scale":
            try:
                count = int(arg)
            except ValueError:
                return {"ok": False, "error": "scale needs a whole number of workers"}, []
            if count < 1:
                return {"ok": False, "error": "scale needs at least 1 worker"}, []
            self.config.values["workers"] = count
            self.log.info("Scaling workers", workers=count)
            self.spawn_missing(time.monotonic())
            return {"ok": True, "workers": count}, []
        if name == "listeners":
            if not self.listeners:
                return {"ok": False, "error": "not listening (paused or stopping)"}, []
            for listener in self.listeners:
                listener.unix_path = None  # shared with the successor now: never unlink it
                listener.shared = True  # nor make it refuse clients when we stop
            answer: dict[str, Any] = {"ok": True, "listeners": [l.name() for l in self.listeners]}
            fds = [l.fd for l in self.listeners]
            server = self.status_server
            if server is not None and server.sock.fileno() >= 0 and not self.status_left:
                # The status listener goes with them (last): the successor answers on this very
                # socket once it is ready, and we leave it at our stop (leave_status_port).
                host, port = server.sock.getsockname()[:2]
                answer["status"] = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
                fds.append(server.sock.fileno())
                if self.control is not None and self.control.peer_pid:
                    self.status_successors.add(self.control.peer_pid)
            return answer, fds
        return {"ok": False, "error": f"unknown command {name!r}"}, []

    def control_fds(self) -> list[int]:
        """The control socket and its clients: a worker must not hold them (a client would
        then never see its answer's end of file)."""
        if self.control is None:
            return []
        return [self.control.fileno(), *self.control.clients]

    # -- live numbers on demand ------------------------------------------------------------
    # A busy sync worker sends heartbeats only between requests, so a status answer asks the
    # workers for their numbers first (SIGWINCH: the handler writes one record). The loop never
    # waits for them: a status request waits (StatusServer), the answers come in as records.
    def numbers_fresh(self) -> bool:
        """True when the workers' numbers are fresh enough to answer with; otherwise asks for
        them (once for any number of waiting requests) and says False for now."""
        now = time.monotonic()
        if self.fresh is None:
            if now - self.refreshed_at < FRESH_FOR:
                return True
            # Not a worker still loading its app (it cannot answer yet), nor one that took
            # the stop (it reports every change by itself).
            self.refresh_asked = {pid for pid, h in self.workers.items()
                                  if h.booted and not h.draining}
            if not self.refresh_asked:
                self.refreshed_at = now
                return True
            self.fresh = set()
            self.refresh_until = now + REFRESH_WAIT
            for pid in self.refresh_asked:
                self.send(self.workers[pid], signal.SIGWINCH)
            return False
        self.read_counters()
        return self.refresh_done(now)

    def refresh_done(self, now: float) -> bool:
        if self.fresh is None:
            return True
        if (self.refresh_asked & set(self.workers)) <= self.fresh or now >= self.refresh_until:
            self.fresh = None
            self.refreshed_at = now
            return True
        return False

    def refresh_counters(self) -> None:
        """The control socket's status: the same, waiting here (bounded by REFRESH_WAIT)."""
        while not self.numbers_fresh():
            select.select([self.counter_r], [], [], max(self.refresh_until - time.monotonic(), 0))

    def ready(self) -> bool:
        """Readiness means "send me traffic": running (or, after an in-place upgrade, booting
        with the old image's workers serving), not paused, and at least one booted worker of
        any generation that is not stopping, or replacements booting for recycled workers.
        A reload or upgrade in progress does not make the instance unready (its old workers
        serve until the new ones have booted); going away (lameduck, drain, halt), or having
        no worker that serves and none about to (boots failing, or slower than
        READY_THROUGH_BOOT), does."""
        serving = self.state is State.RUNNING or (self.state is State.BOOTING
                                                   and self.upgrading_from is not None)
        if not serving or self.paused:
            return False
        if any(h.booted and not h.stopping and not h.deaf for h in self.workers.values()):
            return True
        # Every worker is retiring (max-requests) or gone (a crash) at once, and their
        # replacements are booting: the listeners stay open and the queue is served in a
        # moment, so the instance is not going away. Unless boots are failing, or one is slow.
        now = time.monotonic()
        return self.state is State.RUNNING and self.boot_failures == 0 and any(
            not h.booted and not h.stopping and not h.deaf and now - h.spawned_at < READY_THROUGH_BOOT
            for h in self.workers.values())

    def status(self) -> dict[str, Any]:
        """One snapshot of everything: the control socket's and /status's answer, and what
        /metrics's live gauges are made of (callers refresh the numbers first)."""
        now = time.monotonic()
        return {
            "ok": True, "state": self.state.value, "ready": self.ready(),
            "generation": self.generation, "pid": os.getpid(), "version": __version__,
            "worker_class": self.config.worker_class, "started": self.started_at,
            "uptime": round(time.time() - self.started_at, 3), "paused": self.paused,
            **self.totals(),
            "workers": [{
                "pid": h.pid, "worker_id": h.worker_id, "generation": h.generation,
                "state": worker_state(h),
                "age": round(now - h.spawned_at, 3), "requests_served": h.requests_served,
                "active_connections": h.active_connections,
                "in_flight_requests": h.in_flight_requests,
                "background_tasks": h.background_tasks, "booted": h.booted,
                "rss_bytes": rss_bytes(h.pid),
                "seconds_since_heartbeat": round(now - h.last_seen, 3),
            } for h in sorted(self.workers.values(), key=lambda h: (h.generation, h.worker_id))],
        }

    # -- the status server (/healthz /readyz /status /metrics) -------------------------------------
    def answer_status(self, method: str, path: str, headers: dict[bytes, bytes]) -> Answer | None:
        if path in ("/status", "/metrics") and not self.numbers_fresh():
            return None  # asked the workers; answered when their numbers are in
        try:
            return self.status_page(path, headers)
        except Exception as exc:  # a status page must never take the arbiter down
            self.log.exception(f"Status request {path} failed", exc)
            return _json(500, {"error": f"{type(exc).__name__}: {exc}"})

    def status_page(self, path: str, headers: dict[bytes, bytes]) -> Answer:
        if path == "/healthz":
            return _json(200, {"status": "alive", "state": self.state.value})
        if path == "/readyz" and self.status_left:
            # A request we had accepted before we left the port: the successor serves it.
            return _json(200, {"ready": True, "state": self.state.value,
                               "generation": self.generation, "reloading": False,
                               "successor": True})
        if path == "/readyz":
            ready = self.ready()
            return _json(200 if ready else 503, {
                "ready": ready, "state": "paused" if self.paused else self.state.value,
                "generation": self.generation,
                "reloading": self.reloading()})
        if path == "/status":
            return _json(200, self.status())
        if path == "/metrics":
            if self.metrics is None:
                return _json(404, {"error": "metrics are off"})
            snapshot = self.status()
            collector = ArbiterCollector(snapshot, [s.value for s in State])
            accept = headers.get(b"accept", b"").decode("latin-1")
            body, content_type = self.metrics.exposition(accept, collector)
            return 200, content_type, body
        return _json(404, {"error": f"no such page {path}; try /healthz /readyz /status /metrics"})

    def count_restart(self, reason: str) -> None:
        if self.metrics is not None:
            self.metrics.add("forkserve_worker_restarts", {"reason": reason}, RESTARTS_HELP)

    def count_reload(self, outcome: str) -> None:
        if self.metrics is not None:
            self.metrics.add("forkserve_reloads", {"outcome": outcome}, RELOADS_HELP)

    # -- workers ---------------------------------------------------------------------------
    def spawn(self, worker_id: int, now: float) -> None:
        handle = WorkerHandle(worker_id, self.generation, spawned_at=now, last_seen=now,
                              deaf=self.paused)  # spawned while paused: it has no listener
        pid = sigs.fork_with_signals_blocked()
        if pid == 0:  # the child: never returns into the arbiter's loop
            try:
                worker = self.worker_cls(
                    worker_id, self.generation, self.settings, self.listeners, self.counter_w,
                    self.alive_r, self.log, self.app,
                    close_fds=[self.counter_r, self.alive_w, self.signals.read_fd,
                               self.signals.write_fd, *self.control_fds(),
                               *(self.status_server.fds() if self.status_server else ())])
                worker.run_child()
            finally:
                os._exit(ExitCode.ERROR)
        handle.pid = pid
        self.workers[pid] = handle
        self.log.info("Spawned worker", worker=worker_id, pid=pid, generation=self.generation)

    def current(self) -> list[WorkerHandle]:
        return [h for h in self.workers.values() if h.generation == self.generation and not h.stopping]

    def spawn_missing(self, now: float) -> None:
        if self.state not in (State.BOOTING, State.RUNNING) or now < self.respawn_after:
            return
        taken = {h.worker_id for h in self.current()}
        for worker_id in range(1, self.config.worker_count + 1):
            if worker_id not in taken:
                self.spawn(worker_id, now)
        # A smaller count after a reload: retire the extra workers of this generation.
        extra = [h for h in self.current() if h.worker_id > self.config.worker_count]
        self.retire(extra)

    def escalate(self, handle: WorkerHandle, when: float, signum: int) -> None:
        """Send ``signum`` at ``when`` unless the worker is gone by then (never later than an
        escalation already planned)."""
        if handle.escalate_at is None or when < handle.escalate_at:
            handle.escalate_at = when
            handle.escalate_signal = signum

    def retire(self, handles: list[WorkerHandle]) -> None:
        """Stop workers gracefully, bounded: TERM now, QUIT after the drain timeout, then KILL."""
        when = time.monotonic() + self.config.drain_timeout
        self.signal_workers(signal.SIGTERM, handles)
        for handle in handles:
            self.escalate(handle, when, signal.SIGQUIT)

    def send(self, handle: WorkerHandle, signum: int) -> None:
        try:
            os.kill(handle.pid, signum)
        except ProcessLookupError:
            return  # already gone; reaping will tell

    def signal_workers(self, signum: int, handles: list[WorkerHandle]) -> None:
        for handle in handles:
            if signum in (signal.SIGTERM, signal.SIGQUIT):
                handle.stopping = True
            self.send(handle, signum)

    def read_counters(self) -> None:
        now = time.monotonic()
        while True:
            try:
                data = os.read(self.counter_r, 65536)
            except BlockingIOError:
                return
            for record in self.decoder.feed(data):
                handle = self.workers.get(record.pid)
                if handle is not None:
                    self.on_record(handle, record, now)

    def on_record(self, handle: WorkerHandle, record: Record, now: float) -> None:
        if self.fresh is not None:
            self.fresh.add(handle.pid)
        handle.last_seen = now
        handle.active_connections = record.active_connections
        handle.in_flight_requests = record.in_flight_requests
        handle.background_tasks = record.background_tasks
        handle.requests_served = record.requests_served
        if record.kind is Kind.BOOTED:
            handle.booted = True
            self.boot_failures = 0
            self.check_booted()
        elif record.kind is Kind.BOOT_ERROR:
            handle.boot_error = record.text
        elif record.kind is Kind.DRAINING:
            handle.draining = True
        elif record.kind is Kind.RETIRING:
            handle.retiring = record.text
            handle.stopping = True
            self.escalate(handle, now + self.config.drain_timeout, signal.SIGQUIT)
            self.spawn_missing(now)  # its replacement boots while it finishes
        self.check_drained()

    def stop_predecessors(self) -> None:
        """-sf / -st: we serve now, so the instances we replace can go."""
        if self.inherited is not None:
            return  # an upgraded image: those PIDs were dealt with long ago (and may be reused)
        if self.config.soft_stop or self.config.hard_stop:
            for listener in self.listeners:
                # --reuse-port: from now on the kernel gives every new connection to us, none
                # to the instances we replace: they drain a queue that only shrinks and close
                # it, and no client's SYN is dropped or reset meanwhile.
                if steer_new_connections_here(listener.sock):
                    self.log.info("Handoff: new connections now come to this instance",
                                  listening=listener.name())
        for pids, signum in ((self.config.soft_stop, signal.SIGTERM),
                             (self.config.hard_stop, signal.SIGQUIT)):
            for pid in pids:
                try:
                    os.kill(pid, signum)
                except ProcessLookupError:
                    self.log.warning("Handoff: the old instance is already gone", pid=pid)
                    continue
                self.log.info(f"Handoff: sent {sigs.name(signum)} to the old instance", pid=pid)

    def notify(self, what: str) -> None:
        """Tell systemd (when it listens) what we are doing; a no-op otherwise."""
        notifier = self.notifier
        if notifier is None or not notifier.enabled:
            return
        if what == "ready":
            notifier.ready(f"serving: {len(self.current())} workers")
        elif what == "reloading":
            notifier.reloading()
        elif what == "stopping":
            notifier.stopping("draining")
        else:
            notifier.status(status_line(self.state.value, self.totals()))

    def check_booted(self) -> None:
        generation = self.current()
        if len(generation) < self.config.worker_count or not all(h.booted for h in generation):
            return
        if self.state is State.BOOTING:
            self.transition(Event.BOOTED, "Server ready", generation=self.generation)
            self.notify("ready")
            if self.status_server is not None and not self.status_server.accepting:
                # A successor: we can answer ready now; the instances we replace answered
                # meanwhile (they leave the port at the stop we send them next).
                self.status_server.start_accepting()
                address = self.status_server.sock.getsockname()
                self.log.info("Status server listening",
                              status_bind=f"{address[0]}:{address[1]}")
            if self.upgrading_from is not None:
                old = [h for h in self.workers.values() if h.generation <= self.upgrading_from]
                self.log.info("Upgrade complete: stopping the old workers", old_workers=len(old),
                              generation=self.generation)
                self.count_reload("succeeded")
                self.upgrading_from = None
                self.retire(old)
            self.stop_predecessors()
        elif self.reload_generation == self.generation:
            self.reload_generation = None
            old = [h for h in self.workers.values() if h.generation < self.generation]
            self.log.info("Reload complete: new workers booted, stopping the old ones",
                          generation=self.generation, old_workers=len(old))
            self.count_reload("succeeded")
            self.retire(old)
            self.notify("ready")

    def reap(self) -> None:
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            # A worker writes its last record (BOOT_ERROR, RETIRING) and then exits: read the
            # pipe before judging the exit, or the record would come after its explanation.
            self.read_counters()
            if self.upgrade_check is not None and pid == self.upgrade_check.pid:
                self.upgrade_checked(status)
                continue
            if pid == self.stand_in:
                self.stand_in = None
                if status != 0:
                    self.log.warning(f"Upgrade: the status stand-in {describe_status(status)}",
                                     pid=pid)
                continue
            handle = self.workers.pop(pid, None)
            if handle is not None:
                self.on_exit(handle, status)
        # Unknown children (we may be PID 1 in a container) are reaped and forgotten.

    def on_exit(self, handle: WorkerHandle, status: int) -> None:
        how = describe_status(status)
        fields = {"worker": handle.worker_id, "pid": handle.pid, "generation": handle.generation,
                  "exit": how}
        if self.metrics is not None:
            try:
                self.metrics.process_gone(handle.pid)
            except Exception as exc:  # bookkeeping must never take the arbiter down
                self.log.exception("Could not archive a worker's metric files", exc,
                                   pid=handle.pid)
        if not handle.booted:
            self.on_boot_failure(handle, how, status)
        elif handle.kill_reason:
            self.log.error(f"{handle.describe()} {how} after {handle.kill_reason}",
                           reason=handle.kill_reason, **fields)
            if handle.kill_reason.startswith("a timeout"):
                self.count_restart("timeout")
        elif handle.retiring:
            self.log.info(f"{handle.describe()} retired: {handle.retiring}", reason="max-requests",
                          **fields)
            self.count_restart("max_requests")
        elif handle.stopping:
            self.log.info(f"{handle.describe()} {how}", reason="stopped", **fields)
        else:
            self.log.error(f"{handle.describe()} {how} unexpectedly; replacing it",
                           reason="crashed", **fields)
            self.count_restart("crashed")
        self.check_gone()
        self.check_booted()

    def on_boot_failure(self, handle: WorkerHandle, how: str, status: int) -> None:
        load_error = bool(handle.boot_error) or (
            os.WIFEXITED(status) and os.WEXITSTATUS(status) == ExitCode.APP_LOAD_ERROR)
        reason = (handle.boot_error or handle.kill_reason
                  or ("the application could not be loaded" if load_error
                      else f"a worker {how} while booting"))
        code = ExitCode.APP_LOAD_ERROR if load_error else ExitCode.WORKER_BOOT_ERROR
        if handle.stopping or self.state not in (State.BOOTING, State.RUNNING):
            return  # stopped on purpose before it was ready
        if self.state is State.BOOTING and self.upgrading_from is not None:
            # The new image passed its check but its workers do not boot: the old workers,
            # handed over, still serve. Keep them; do not take the service down.
            failed = [h for h in self.workers.values() if h.generation == self.generation]
            self.signal_workers(signal.SIGQUIT, failed)
            self.generation = self.upgrading_from
            self.upgrading_from = None
            self.log.error(f"Upgrade failed after exec, the old workers keep serving: {reason}")
            self.count_reload("failed")
            self.transition(Event.BOOTED, "Server ready", generation=self.generation)
            return
        if self.state is State.BOOTING:
            # Never a fork loop: the first generation cannot boot, so nothing can serve.
            self.exit_code = code
            self.transition(Event.BOOT_FAILED, f"Application failed to boot: {reason}", level="error")
            self.halt_workers()
            return
        old_serve = any(h.generation < handle.generation and not h.stopping and not h.deaf
                        for h in self.workers.values())
        if self.reload_generation == handle.generation and old_serve:
            self.reload_generation = None
            failed = [h for h in self.workers.values() if h.generation == handle.generation]
            self.signal_workers(signal.SIGQUIT, failed)
            self.generation = max((h.generation for h in self.workers.values()
                                   if h.generation < handle.generation), default=self.generation)
            # Back to the configuration the old workers run, so that replacing one of them
            # does not start the broken app.
            if self.previous is not None:
                self.config, self.settings, self.worker_cls = self.previous
            self.log.configure(self.config.log_level, self.config.log_format)
            self.log.error(f"Reload failed, the old workers keep serving: {reason}")
            self.count_reload("failed")
            return
        # A replacement failed while the rest serve, or a resume's generation failed while the
        # paused workers it replaces can serve nobody new: retry, slower and slower (no fork
        # loop); the paused workers are retired once a new generation has booted.
        self.boot_failures += 1
        delay = min(0.5 * 2 ** (self.boot_failures - 1), MAX_RESPAWN_DELAY)
        self.respawn_after = time.monotonic() + delay
        self.count_restart("boot_failed")
        self.log.error(f"{handle.describe()} failed to boot: {reason}; retrying in {delay:g}s",
                       worker=handle.worker_id, pid=handle.pid, reason=reason)

    def escalate_now(self, handle: WorkerHandle, now: float) -> None:
        signum = handle.escalate_signal
        handle.escalate_at = None
        if signum == signal.SIGKILL:
            self.log.error(f"{handle.describe()} did not stop in time; killed with SIGKILL",
                           state=self.state.value)
            handle.kill_reason = handle.kill_reason or "a SIGKILL (it did not stop in time)"
        else:
            self.log.warning(f"{handle.describe()} still busy after the drain timeout; "
                             f"sending {sigs.name(signum)}")
            self.escalate(handle, now + KILL_GRACE, signal.SIGKILL)
        self.send(handle, signum)

    def check_gone(self) -> None:
        if self.workers:
            return
        if accepts(self.state, Event.DRAINED):
            self.check_drained()  # logs "All connections drained", then comes back here
        elif accepts(self.state, Event.WORKERS_GONE):
            self.transition(Event.WORKERS_GONE, "All workers stopped")

    # -- deadlines -------------------------------------------------------------------------
    def next_timeout(self, now: float) -> float | None:
        deadlines = []
        if self.deadline is not None:
            deadlines.append(self.deadline)
        if self.lameduck_until is not None:
            deadlines.append(self.lameduck_until)
        if self.state in (State.DRAINING, State.CANCELLING):
            deadlines.append(self.next_progress)
        timeout = self.config.timeout
        for handle in self.workers.values():
            if handle.escalate_at is not None:
                deadlines.append(handle.escalate_at)
            elif timeout and not handle.stopping:
                deadlines.append(handle.last_seen + timeout)
        if self.respawn_after > now:
            deadlines.append(self.respawn_after)
        if self.next_watchdog is not None:
            deadlines.append(self.next_watchdog)
        if self.fresh is not None:
            deadlines.append(self.refresh_until)
        if self.held_until is not None:
            deadlines.append(self.held_until)
        if self.resume_retry_at is not None:
            deadlines.append(self.resume_retry_at)
        if self.status_server is not None:
            client_deadline = self.status_server.next_deadline()
            if client_deadline is not None:
                deadlines.append(client_deadline)
        if not deadlines:
            return None
        return max(min(deadlines) - now, 0.0)

    def tick(self, now: float) -> None:
        self.write_held_lines(now)  # first: before any later line (progress, escalations)
        timeout = self.config.timeout
        for handle in list(self.workers.values()):
            if handle.escalate_at is not None:
                if now >= handle.escalate_at:
                    self.escalate_now(handle, now)
            elif timeout and not handle.stopping and now - handle.last_seen >= timeout:
                what = "boot" if not handle.booted else "heartbeat"
                self.log.error(f"{handle.describe()} timed out (no {what} for {timeout:g}s); "
                               "killing it")
                handle.kill_reason = f"a timeout ({timeout:g}s without a {what})"
                self.send(handle, signal.SIGABRT)
                self.escalate(handle, now + KILL_GRACE, signal.SIGKILL)
        if self.next_watchdog is not None and now >= self.next_watchdog:
            # The loop is alive enough to get here: that is what the watchdog asks.
            self.notifier.watchdog()
            self.next_watchdog = now + self.notifier.watchdog_interval
        if self.lameduck_until is not None and now >= self.lameduck_until:
            self.begin_drain()
        if self.state in (State.DRAINING, State.CANCELLING) and now >= self.next_progress:
            self.next_progress = now + 1.0
            self.log.info("Draining in-flight connections", state=self.state.value,
                          **self.totals())
            self.notify("status")
        if self.deadline is not None and now >= self.deadline:
            self.deadline = None
            if accepts(self.state, Event.DEADLINE):
                self.cancel()
        if self.resume_retry_at is not None and now >= self.resume_retry_at:
            self.resume()
        if self.state in (State.BOOTING, State.RUNNING):
            self.spawn_missing(now)
        self.carry_out_wanted()


def worker_state(handle: WorkerHandle) -> str:
    """booting, running, stopping (asked to stop, or retiring), draining (it took the stop:
    its numbers are live from then on)."""
    if not handle.booted:
        return "booting"
    if handle.draining:
        return "draining"
    return "stopping" if handle.stopping else "running"


def _json(status: int, body: dict[str, Any]) -> Answer:
    return status, "application/json", json.dumps(body, default=str).encode() + b"\n"


def describe_status(status: int) -> str:
    if os.WIFSIGNALED(status):
        signum = os.WTERMSIG(status)
        return f"was killed by signal {signum} ({sigs.name(signum)})"
    code = os.waitstatus_to_exitcode(status)
    return f"exited with code {code}"
