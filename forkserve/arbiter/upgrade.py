"""The in-place upgrade (USR2): check the new code and configuration in a child, then
re-execute ourselves with a typed :class:`forkserve.handover.Handover` in the environment;
the new image adopts the old workers, boots its own generation (see rollout) and retires
them. A status stand-in answers on the status port through the exec.

# -- machine: an upgrade -----------------------------------------------------------------------
    idle ──USR2──▶ checking ──check passed──▶ exec ──▶ (new image) adopting ──booted──▶ idle
                     │ check failed                      │ exec failed: still serving, idle
                     ▼                                   │ new workers fail to boot:
                    idle (still serving)                 ▼ the old workers keep serving, idle
    Signals are blocked from the exec until the new image has its handlers; those already
    received are handed over (``Handover.signals``) and replayed.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from forkserve import signals as sigs
from forkserve.signals import ARBITER_SIGNALS
from forkserve.control import ControlServer
from forkserve.counters import ExitCode
from forkserve.handover import HandedListener, HandedWorker, Handover
from forkserve.lifecycle import Rollout, State, Step
from forkserve.metrics import ENV as METRICS_ENV
from forkserve.procenv import ProcessEnv
from forkserve.standin import OPENMETRICS_PATH, RETRY_AFTER, run_stand_in
from forkserve.status import Answer
from forkserve.arbiter.observe import json_answer
from forkserve.arbiter.workers import WorkerHandle, describe_status
from forkserve.arbiter.part import Part

if TYPE_CHECKING:
    import subprocess



@dataclass(kw_only=True)
class Upgrade(Part):
    """USR2, both halves (a mixin of :class:`forkserve.arbiter.Arbiter`)."""

    inherited: Handover | None = None  # what the image we replaced handed over
    argv: list[str] = field(default_factory=list)  # our command line, for the upgrade
    cwd: str = ""  # where we were started, for the upgrade's check and exec
    upgrade_check: subprocess.Popen[bytes] | None = None
    upgrading_from: int | None = None  # the old image's generation, until its workers are gone
    # The status stand-in answering while an in-place upgrade execs (its pid): the old image's
    # child until the new image, once its own status server is up, stops and reaps it.
    stand_in: int | None = None
    # What -e/--env and --pythonpath changed in this process: the upgrade's check and exec get
    # the environment without it (the new image applies its own configuration's).
    process_env: ProcessEnv = field(default_factory=ProcessEnv)

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
        if self.state is State.BOOTING or self.reloading() or self.upgrade_check is not None:
            self.coalesce(Step.UPGRADE)
            return
        self.log.info("Upgrade requested: checking the new configuration and application")
        env = self.process_env.pristine()
        if self.metrics is not None:
            try:
                env[METRICS_ENV] = self.metrics.scratch()  # the check's app import must not count
            except OSError as exc:
                self.log.error(f"Upgrade aborted, still serving: the metrics directory is not "
                               f"usable: {exc}")
                self.count_reload("failed")
                return
        self.step(Step.UPGRADE)
        # Imported here, at the one USR2 that needs it: imported at start, subprocess (1 MiB)
        # was in the arbiter's memory and so, forked, in every worker's.
        import subprocess
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
        if self.rollout is not Rollout.CHECKING:
            return  # called off while it ran (paused): already logged
        if check.returncode != 0:
            reason = error.splitlines()[-1] if error else f"the check exited {check.returncode}"
            self.step(Step.CHECK_FAILED)
            self.log.error(f"Upgrade aborted, still serving: {reason}")
            self.count_reload("failed")
            return
        if self.state is not State.RUNNING:
            self.step(Step.ABANDONED)
            self.log.warning("Upgrade abandoned: the server is stopping")
            return
        self.exec_upgrade()

    def call_off_upgrade(self, why: str) -> None:
        """An upgrade's check is running and the upgrade can no longer happen (paused: a
        successor takes the ports): stop the check; its exit is reaped as usual."""
        if self.rollout is not Rollout.CHECKING:
            return
        self.step(Step.ABANDONED)
        self.log.warning(f"Upgrade abandoned: {why}")
        if self.upgrade_check is not None:
            self.upgrade_check.kill()

    def handover(self) -> Handover:
        """What the new image needs (the status listener and stand-in are added by the exec)."""
        return Handover(
            listeners=[HandedListener(l.fd, l.address, l.unix_path is not None)
                       for l in self.listeners],
            counter=(self.counter_r, self.counter_w), alive=(self.alive_r, self.alive_w),
            workers=[HandedWorker(h.pid, h.worker_id, h.generation, h.booted, h.stopping,
                                  h.draining) for h in self.workers.values()],
            generation=self.generation,
            wanted=[what for what, wanted in (("reload", self.reload_wanted),
                                              ("upgrade", self.upgrade_wanted)) if wanted])

    def exec_upgrade(self) -> None:
        # From here to the new image's SignalQueue, a handled signal must not be acted on by
        # its default action (HUP, USR1, USR2, TERM would kill the new image before it has
        # handlers: a total outage). Blocked, it stays pending across execve and reaches the
        # new image's handlers; what already reached ours is handed over below.
        mask = sigs.block(ARBITER_SIGNALS)
        self.notify("reloading")
        handover = self.handover()
        if self.status_server is not None:
            os.set_inheritable(self.status_server.fileno(), True)
            # Who answers on it until the new image's status server does, and answers the
            # status requests in progress (not waited for here: the exec goes on at once).
            self.stand_in = self.fork_stand_in()
            if self.status_server.clients:
                self.log.info("Upgrade: the status stand-in answers the requests in progress",
                              clients=len(self.status_server.clients))
            self.status_server.hand_over()
            handover = replace(handover, status_fd=self.status_server.fileno(),
                               status_stand_in=self.stand_in)
        if self.metrics is not None:
            handover = replace(handover, metrics_dir=self.metrics.path,
                               metrics_owned=self.metrics.owned)
        for fd in handover.fds():
            os.set_inheritable(fd, True)
        # Last, after the status clients were answered: the signals our handlers recorded and
        # the loop has not dispatched (the wakeup pipe does not survive the exec).
        signals = self.signals.undelivered()
        handover = replace(handover, signals=signals)
        env = self.process_env.pristine()
        handover.into(env)
        if self.control is not None:
            self.control.close()  # the new image opens it again at the same path
            self.control = None
        self.hooks.call("pre_exec", self.log, self.server_info)
        self.log.info("Upgrade: re-executing", pid=os.getpid(), generation=self.generation)
        try:
            if self.cwd:
                os.chdir(self.cwd)
            os.execve(sys.executable, [sys.executable, "-m", "forkserve", *self.argv], env)
        except OSError as exc:
            self.step(Step.EXEC_FAILED)
            self.log.error(f"Upgrade failed, still serving: cannot exec: {exc.strerror}")
            self.count_reload("failed")
            self.stop_stand_in()  # we answer again from the next poll on; the loop reaps it
            sigs.set_mask(mask)
            self.signals.replay(signals)
            if self.status_server is not None:
                os.set_inheritable(self.status_server.fileno(), False)
            for fd in handover.fds():
                os.set_inheritable(fd, False)
            if self.config.control_socket:
                self.control = ControlServer(self.config.control_socket, self.command,
                                             self.reactor)

    def adopt_old_workers(self, workers: list[HandedWorker], generation: int) -> None:
        """The new image's view of the workers the old image handed over."""
        now = time.monotonic()
        for w in workers:
            self.workers[w.pid] = WorkerHandle(w.worker_id, w.generation, pid=w.pid,
                                               spawned_at=now, last_seen=now, booted=w.booted,
                                               stopping=w.stopping, draining=w.draining)
        self.generation = generation + 1
        self.upgrading_from = generation
        # A new process: its rollout starts here, not by a step from idle.
        self.rollout = Rollout.ADOPTING

    def stand_in_answers(self) -> dict[str, Answer]:
        """What the stand-in answers, by path: the old image's view at the exec. Readiness is
        as it is now (the workers go on serving through the exec); /status is the last
        snapshot, marked "upgrading"; /metrics the last exposition, in both formats (a scrape
        during the exec gets valid, monotonic numbers a moment old, not a failed scrape); the
        rest asks to retry."""
        ready = self.ready()
        snapshot = {**self.status(), "state": "upgrading"}
        return {
            "/healthz": json_answer(200, {"status": "alive", "state": "upgrading"}),
            "/readyz": json_answer(200 if ready else 503, {"ready": ready, "state": "upgrading",
                                                     "generation": self.generation,
                                                     "reloading": True}),
            "/status": json_answer(200, snapshot),
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
            code: int = ExitCode.ERROR
            try:
                keep = sorted({*self.log.fds(), server.fileno(), self.alive_r, *server.clients}
                              - {0, 1, 2, -1})
                for low, high in zip([2, *keep], [*keep, os.sysconf("SC_OPEN_MAX")]):
                    if low + 1 < high:  # (an empty range would be read as "to the end")
                        os.closerange(low + 1, high)  # the rest: main listeners, pipes...
                wakeup = sigs.stand_in_signals(
                    ARBITER_SIGNALS, wake_on=(signal.SIGTERM,),
                    ignore=(signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2, signal.SIGTTIN,
                            signal.SIGTTOU, signal.SIGWINCH))
                code = run_stand_in(server.sock, wakeup, self.alive_r, answers, self.log,
                                    adopted=server)
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

    def reaped_upgrade_child(self, pid: int, status: int) -> bool:
        """The upgrade's check or the status stand-in exited: dealt with here."""
        if self.upgrade_check is not None and pid == self.upgrade_check.pid:
            self.upgrade_checked(status)
            return True
        if pid == self.stand_in:
            self.stand_in = None
            if status != 0:
                self.log.warning(f"Upgrade: the status stand-in {describe_status(status)}",
                                 pid=pid)
            return True
        return False
