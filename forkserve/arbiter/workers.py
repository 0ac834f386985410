"""The worker table: one ``WorkerHandle`` per worker process, spawning, reaping and replacing
them, reading the counter pipe, liveness and escalation.

# -- machine: a worker, as the arbiter sees it ----------------------------------------------
    booting ──BOOTED──▶ running ──TERM/QUIT sent, or RETIRING──▶ stopping ──DRAINING──▶ draining
    any state ──exit (reaped)──▶ gone: classified by ``WorkerHandle.exit_reason``
A worker told to go that does not is escalated: ``escalate_at`` / ``escalate_signal`` (QUIT
after the drain timeout, then KILL after KILL_GRACE); the loop's tick sends them when due.
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass, field
from typing import Iterator

from forkserve import signals as sigs
from forkserve.capture import OutputCapture, flush_std_streams
from forkserve.counters import ExitCode, Kind, Record, retiring_reason
from forkserve.hooks import WorkerInfo
from forkserve.lifecycle import State
from forkserve.arbiter.part import Part

KILL_GRACE = 2.0  # seconds between SIGABRT/SIGQUIT and SIGKILL for a worker that will not go
MAX_RESPAWN_DELAY = 10.0


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
    retiring: str = ""  # why the worker leaves on its own: its RETIRING text (retiring_reason)
    boot_error: str = ""
    imports_app: bool = True  # it loads the application itself (not --preload)
    kill_reason: str = ""
    escalate_at: float | None = None  # when to send escalate_signal (a worker not leaving)
    escalate_signal: int = signal.SIGKILL
    active_connections: int = 0
    in_flight_requests: int = 0
    background_tasks: int = 0
    requests_served: int = 0
    info: WorkerInfo | None = None  # what the server hooks are given for this worker

    def describe(self) -> str:
        return f"Worker {self.worker_id} (pid {self.pid})"

    def state(self) -> str:
        """booting, running, stopping (asked to stop, or retiring), draining (it took the
        stop: its numbers are live from then on)."""
        if not self.booted:
            return "booting"
        if self.draining:
            return "draining"
        return "stopping" if self.stopping else "running"

    def serves(self) -> bool:
        """Booted, not asked to go, and listening: it takes new clients."""
        return self.booted and not self.stopping and not self.deaf

    def escalate(self, when: float, signum: int) -> None:
        """Send ``signum`` at ``when`` unless the worker is gone by then (never later than an
        escalation already planned)."""
        if self.escalate_at is None or when < self.escalate_at:
            self.escalate_at = when
            self.escalate_signal = signum

    def due(self, now: float) -> int | None:
        """The escalation signal to send now, if one is due (then the next step is planned:
        after QUIT or ABRT comes KILL, KILL_GRACE later)."""
        if self.escalate_at is None or now < self.escalate_at:
            return None
        signum = self.escalate_signal
        self.escalate_at = None
        if signum == signal.SIGKILL:
            self.kill_reason = self.kill_reason or "a SIGKILL (it did not stop in time)"
        else:
            self.escalate(now + KILL_GRACE, signal.SIGKILL)
        return signum

    def timed_out(self, now: float, timeout: float) -> bool:
        """No heartbeat (or no boot) for ``timeout``: hung. Not asked of a stopping worker."""
        return bool(timeout) and self.escalate_at is None and not self.stopping \
            and now - self.last_seen >= timeout

    def take(self, record: Record, now: float) -> None:
        """A record from the counter pipe: its numbers, and what its kind says."""
        self.last_seen = now
        self.active_connections = record.active_connections
        self.in_flight_requests = record.in_flight_requests
        self.background_tasks = record.background_tasks
        self.requests_served = record.requests_served
        if record.kind is Kind.BOOTED:
            self.booted = True
        elif record.kind is Kind.BOOT_ERROR:
            self.boot_error = record.text
        elif record.kind is Kind.DRAINING:
            self.draining = True
        elif record.kind is Kind.RETIRING:
            self.retiring = record.text
            self.stopping = True

    def exit_reason(self) -> str:
        """Why a booted worker is gone, as the restart metric's reason: "timeout", "killed"
        (escalated), "max_requests", "max_rss", "max_lifetime" (it retired on its own: the
        limit it reached), "stopped" (asked to) or "crashed" (replace it)."""
        if self.kill_reason:
            return "timeout" if self.kill_reason.startswith("a timeout") else "killed"
        if self.retiring:
            return retiring_reason(self.retiring)[0].replace("-", "_")
        return "stopped" if self.stopping else "crashed"

    def boot_failure(self, status: int) -> tuple[str, int]:
        """A worker gone before it booted: the reason to log, and the exit code the server
        takes if this was the first generation (an app that cannot load is told apart)."""
        exited = os.WIFEXITED(status) and not self.kill_reason
        if self.boot_error:
            return self.boot_error, ExitCode.APP_LOAD_ERROR
        if exited and os.WEXITSTATUS(status) == ExitCode.APP_LOAD_ERROR:
            return "the application could not be loaded", ExitCode.APP_LOAD_ERROR
        if exited and os.WEXITSTATUS(status) == ExitCode.WORKER_BOOT_ERROR:
            # The worker's own code for a crash of its set-up while booting (it logged the
            # traceback): not the application's doing.
            return "a worker crashed while booting (its traceback is logged above)", \
                ExitCode.WORKER_BOOT_ERROR
        if exited and self.imports_app:
            # Gone with an exit code and no BOOT_ERROR record: a failed import sends one
            # (sys.exit() at import included, see forkserve.loader), so something ended the
            # process outright while it imported the app: os._exit(n), most likely. (A crash
            # of the worker's own set-up before the import logs its traceback itself.)
            return (f"a worker exited with code {os.WEXITSTATUS(status)} while importing the "
                    "application (os._exit?)"), ExitCode.APP_LOAD_ERROR
        reason = self.kill_reason or f"a worker {describe_status(status)} while booting"
        return reason, ExitCode.WORKER_BOOT_ERROR


@dataclass(kw_only=True)
class WorkerTable(Part):
    """The arbiter's workers (a mixin of :class:`forkserve.arbiter.Arbiter`)."""

    workers: dict[int, WorkerHandle] = field(default_factory=dict)
    capture: OutputCapture | None = None  # --capture-output: the workers' stdout/stderr pipes
    respawn_after: float = 0.0  # no spawn before (boots failing: a backoff, never a fork loop)
    boot_failures: int = 0
    spawned_count: int = 0  # workers spawned so far: a worker's age, for the hooks

    # -- workers ---------------------------------------------------------------------------
    def spawn(self, worker_id: int, now: float) -> None:
        self.spawned_count += 1
        server = self.server_info
        info = WorkerInfo(self.spawned_count, worker_id, self.generation, os.getpid(),
                          server.cfg_getter(), server.log)
        handle = WorkerHandle(worker_id, self.generation, spawned_at=now, last_seen=now,
                              deaf=self.paused,  # spawned while paused: it has no listener
                              imports_app=self.app is None, info=info)
        self.hooks.call("pre_fork", self.log, server, info)
        capture = self.capture
        output = capture.pipe() if capture is not None else None
        # What a preloaded app printed and Python still buffers is written once, here: a
        # child's copy would be written again when the worker flushes at its exit.
        flush_std_streams()
        pid = sigs.fork_with_signals_blocked()
        if pid == 0:  # the child: never returns into the arbiter's loop
            try:
                worker = self.worker_cls(
                    worker_id, self.generation, self.settings, self.listeners, self.counter_w,
                    self.alive_r, self.log, self.app,
                    close_fds=[self.counter_r, self.alive_w, self.signals.read_fd,
                               self.signals.write_fd, *self.control_fds(), *self.watch_fds(),
                               *(self.status_server.fds() if self.status_server else ()),
                               *(capture.read_fds() if capture is not None else ()),
                               output[0] if output is not None else -1],
                    hooks=self.hooks, server_info=server, info=info)
                if output is not None:
                    worker.output_fd = output[1]
                worker.run_child()
            finally:
                os._exit(ExitCode.ERROR)
        if output is not None and capture is not None:
            os.close(output[1])  # the worker's alone: its exit is the pipe's end of file
            capture.watch(output[0], pid)
        info.pid = handle.pid = pid
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

    def retire(self, handles: list[WorkerHandle]) -> None:
        """Stop workers gracefully, bounded: TERM now, QUIT after the drain timeout, then KILL."""
        when = time.monotonic() + self.config.drain_timeout
        self.signal_workers(signal.SIGTERM, handles)
        for handle in handles:
            handle.escalate(when, signal.SIGQUIT)

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

    def totals(self) -> dict[str, int]:
        live = self.workers.values()
        return {
            "active_connections": sum(h.active_connections for h in live),
            "in_flight_requests": sum(h.in_flight_requests for h in live),
            "background_tasks": sum(h.background_tasks for h in live),
            "workers": len(self.workers),
        }

    def control_fds(self) -> list[int]:
        """The control socket and its clients: a worker must not hold them (a client would
        then never see its answer's end of file)."""
        if self.control is None:
            return []
        return [self.control.fileno(), *self.control.clients]

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
        handle.take(record, now)
        if record.kind is Kind.BOOTED:
            self.boot_failures = 0
            self.check_booted()
        elif record.kind is Kind.RETIRING:
            handle.escalate(now + self.config.drain_timeout, signal.SIGQUIT)
            self.spawn_missing(now)  # its replacement boots while it finishes
        self.check_drained()

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
            if self.reaped_upgrade_child(pid, status):
                continue
            handle = self.workers.pop(pid, None)
            if self.capture is not None:
                self.capture.gone(pid)  # what it printed last, before the line of its exit
            if handle is not None:
                self.on_exit(handle, status)

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
        reason = handle.exit_reason() if handle.booted else "boot_failed"
        if not handle.booted:
            self.on_boot_failure(handle, status)
        elif handle.kill_reason:
            self.log.error(f"{handle.describe()} {how} after {handle.kill_reason}",
                           reason=handle.kill_reason, **fields)
            if reason == "timeout":
                self.count_restart("timeout")
        elif handle.retiring:
            # One line per recycle, with the limit and the figure that reached it.
            why, description = retiring_reason(handle.retiring)
            self.log.info(f"{handle.describe()} retired: {description} ({why})", reason=why,
                          **fields)
            self.count_restart(reason)
        elif reason == "stopped":
            self.log.info(f"{handle.describe()} {how}", reason="stopped", **fields)
        else:
            self.log.error(f"{handle.describe()} {how} unexpectedly; replacing it",
                           reason="crashed", **fields)
            self.count_restart("crashed")
        if self.hooks.child_exit is not None:
            info = handle.info
            if info is None:  # a worker the old image forked (adopted after an upgrade)
                info = WorkerInfo(0, handle.worker_id, handle.generation, os.getpid(),
                                  self.server_info.cfg_getter(), self.server_info.log)
                info.pid = handle.pid
            info.exit_reason, info.exit_status = reason, how
            self.hooks.call("child_exit", self.log, self.server_info, info)
        self.check_gone()
        self.check_booted()

    def worker_deadlines(self, now: float) -> Iterator[float]:
        timeout = self.config.timeout
        for handle in self.workers.values():
            if handle.escalate_at is not None:
                yield handle.escalate_at
            elif timeout and not handle.stopping:
                yield handle.last_seen + timeout
        if self.respawn_after > now:
            yield self.respawn_after

    def worker_tick(self, now: float) -> None:
        """Escalations due, and hung workers (no heartbeat for --timeout)."""
        timeout = self.config.timeout
        for handle in list(self.workers.values()):
            signum = handle.due(now)
            if signum == signal.SIGKILL:
                self.log.error(f"{handle.describe()} did not stop in time; killed with SIGKILL",
                               state=self.state.value)
            elif signum is not None:
                self.log.warning(f"{handle.describe()} still busy after the drain timeout; "
                                 f"sending {sigs.name(signum)}")
            elif handle.timed_out(now, timeout):
                what = "boot" if not handle.booted else "heartbeat"
                self.log.error(f"{handle.describe()} timed out (no {what} for {timeout:g}s); "
                               "killing it")
                handle.kill_reason = f"a timeout ({timeout:g}s without a {what})"
                signum = signal.SIGABRT
                handle.escalate(now + KILL_GRACE, signal.SIGKILL)
            if signum is not None:
                self.send(handle, signum)


def describe_status(status: int) -> str:
    if os.WIFSIGNALED(status):
        signum = os.WTERMSIG(status)
        return f"was killed by signal {signum} ({sigs.name(signum)})"
    code = os.waitstatus_to_exitcode(status)
    return f"exited with code {code}"
