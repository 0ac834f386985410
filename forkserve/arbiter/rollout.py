"""Generations: boot a new one, retire the old once it has booted, or roll back — shared by
HUP (reload), TTIN (resume) and the post-exec half of USR2 (upgrade), and the first boot.

# -- machine: a rollout (its table: lifecycle.ROLLOUT) -----------------------------------------
    idle ──HUP / TTIN──▶ reloading ──BOOTED──▶ idle (the old generation retires)
    idle ──USR2──▶ checking (upgrade.py) ──▶ exec ──▶ the new image starts in adopting
    adopting ──BOOTED──▶ idle (the old image's workers retire)
    reloading / adopting ──a new worker fails to boot──▶
        old workers serve: ROLLED_BACK, idle (back to their configuration too)
        none serve (a resume's generation): retried with backoff, still reloading
    A HUP or USR2 asked for meanwhile is coalesced into one, carried out once idle.
"""

from __future__ import annotations

import signal
import time
from dataclasses import dataclass
from typing import Any

from forkserve.config import Config, ConfigError, reloadable_changes, resolve
from forkserve.hooks import Hooks, HooksError, load_hooks
from forkserve.lifecycle import Event, Rollout, State, Step, next_rollout
from forkserve.workers import worker_class
from forkserve.workers.base import WorkerSettings
from forkserve.arbiter.workers import MAX_RESPAWN_DELAY, WorkerHandle
from forkserve.arbiter.part import Part


@dataclass(kw_only=True)
class Generations(Part):
    """Reloads and generations (a mixin of :class:`forkserve.arbiter.Arbiter`)."""

    generation: int = 1  # the newest: the one spawned, booting or serving
    rollout: Rollout = Rollout.IDLE
    # A reload or upgrade asked for while another was in progress: carried out once it is
    # over (any number of requests coalesce into one), dropped only if the server stops.
    reload_wanted: bool = False
    upgrade_wanted: bool = False
    previous: tuple[Config, WorkerSettings, type] | None = None  # what a failed reload restores
    previous_hooks: Hooks | None = None  # and the hooks it had
    tls: Any = None  # (ssl.SSLContext, TLSMaterial) the workers serve HTTPS with; None: HTTP

    def reloading(self) -> bool:
        """A reload or an upgrade is in progress: a new generation booting, an upgrade's check
        running, or the new image booting while the old image's workers serve."""
        return self.rollout is not Rollout.IDLE

    def step(self, step: Step) -> None:
        self.rollout = next_rollout(self.rollout, step)

    def coalesce(self, step: Step) -> None:
        """A reload or upgrade asked for while another is in progress (or the first generation
        boots): remembered, not dropped (a second `systemctl reload` during a deploy), and
        carried out when that one is over; any number of them coalesce into one."""
        if self.reloading():
            self.step(step)  # the table's word: it stays as it is
        what = "Reload" if step is Step.RELOAD else "Upgrade"
        if step is Step.RELOAD:
            self.reload_wanted = True
        else:
            self.upgrade_wanted = True
        self.log.info(f"{what} requested during another reload or upgrade; coalesced, it "
                      "follows once that one completes", state=self.state.value)

    def reload(self) -> None:
        if self.state not in (State.BOOTING, State.RUNNING):
            self.log.warning("Reload ignored: the server is stopping", state=self.state.value)
            return
        if self.state is State.BOOTING or self.reloading():
            self.coalesce(Step.RELOAD)
            return
        try:
            # (as at the start: without what -e set for the app)
            new = resolve(self.cli_args, self.process_env.pristine())
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
        try:
            # Executed anew: a HUP picks up a changed hooks module (its on_reload runs).
            hooks = load_hooks(new.hooks, self.log, self.cwd)
        except HooksError as exc:
            self.log.error("Reload failed, keeping the current configuration", error=str(exc))
            self.count_reload("failed")
            return
        if self.app is not None:
            self.log.warning("With --preload, HUP restarts workers but not the application code")
        self.previous = (self.config, self.settings, self.worker_cls)
        self.previous_hooks = self.hooks
        old_count = self.config.worker_count
        self.config = new
        self.hooks = hooks
        self.log.configure(new.log_level, new.log_format)
        self.reload_tls(new)
        self.settings = WorkerSettings.of(new, self.metrics_dir(), self.tls)
        self.worker_cls = worker_class(new.worker_class)
        self.worker_cls.share_imports()
        self.notify("reloading")
        self.step(Step.RELOAD)
        self.hooks.call("on_reload", self.log, self.server_info)
        if new.worker_count != old_count:
            self.hooks.call("nworkers_changed", self.log, self.server_info, new.worker_count,
                            old_count)
        self.start_generation("Reloading")

    def reload_tls(self, new: Config) -> None:
        """HUP re-reads the certificate and key (rotation without a restart); one that does
        not load keeps the context the workers have, with an error line."""
        if not new.certfile:
            self.tls = None  # (and no ssl context: one is built only for TLS)
            return
        from forkserve.tls import TLSError, build_context

        try:
            self.tls = build_context(new.values)
        except TLSError as exc:
            self.log.error("Reload: the new TLS certificate or key does not load; the workers "
                           "keep the one they have", error=str(exc))
            return
        self.log.info("Reload: TLS certificate read", certfile=new.certfile)

    def carry_out_wanted(self) -> None:
        """A coalesced reload or upgrade, once nothing else is in progress. An upgrade also
        re-reads the configuration and starts a new generation: it answers a reload asked for
        before it started as well."""
        if self.state is not State.RUNNING or self.reloading() or self.paused \
                or self.upgrade_check is not None:  # (an abandoned check still running)
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
        self.log.info(f"{why}: starting a new generation of workers", generation=self.generation,
                      workers=self.config.worker_count)
        self.spawn_missing(time.monotonic())

    def check_booted(self) -> None:
        generation = self.current()
        if len(generation) < self.config.worker_count or not all(h.booted for h in generation):
            return
        if self.state is State.BOOTING:
            self.transition(Event.BOOTED, "Server ready", generation=self.generation)
            self.notify("ready")
            self.hooks.call("when_ready", self.log, self.server_info)
            if self.status_server is not None and not self.status_server.accepting:
                # A successor: we can answer ready now; the instances we replace answered
                # meanwhile (they leave the port at the stop we send them next).
                self.status_server.start_accepting()
                address = self.status_server.sock.getsockname()
                self.log.info("Status server listening",
                              status_bind=f"{address[0]}:{address[1]}")
            if self.rollout is Rollout.ADOPTING:
                assert self.upgrading_from is not None
                self.step(Step.BOOTED)
                old = [h for h in self.workers.values() if h.generation <= self.upgrading_from]
                self.log.info("Upgrade complete: stopping the old workers", old_workers=len(old),
                              generation=self.generation)
                self.count_reload("succeeded")
                self.upgrading_from = None
                self.retire(old)
            self.stop_predecessors()
        elif self.rollout is Rollout.RELOADING:
            self.step(Step.BOOTED)
            old = [h for h in self.workers.values() if h.generation < self.generation]
            self.log.info("Reload complete: new workers booted, stopping the old ones",
                          generation=self.generation, old_workers=len(old))
            self.count_reload("succeeded")
            self.retire(old)
            self.notify("ready")

    def on_boot_failure(self, handle: WorkerHandle, status: int) -> None:
        """A worker gone before it booted: roll back (an upgrade's or a reload's new
        generation, while older workers serve), give up (the first boot), or retry."""
        reason, code = handle.boot_failure(status)
        if handle.stopping or self.state not in (State.BOOTING, State.RUNNING):
            return  # stopped on purpose before it was ready
        if self.state is State.BOOTING and self.rollout is Rollout.ADOPTING:
            # The new image passed its check but its workers do not boot: the old workers,
            # handed over, still serve. Keep them; do not take the service down.
            assert self.upgrading_from is not None
            self.step(Step.ROLLED_BACK)
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
        if self.rollout is Rollout.RELOADING and handle.generation == self.generation and old_serve:
            self.step(Step.ROLLED_BACK)
            failed = [h for h in self.workers.values() if h.generation == handle.generation]
            self.signal_workers(signal.SIGQUIT, failed)
            self.generation = max((h.generation for h in self.workers.values()
                                   if h.generation < handle.generation), default=self.generation)
            # Back to the configuration the old workers run, so that replacing one of them
            # does not start the broken app.
            if self.previous is not None:
                self.config, self.settings, self.worker_cls = self.previous
            if self.previous_hooks is not None:
                self.hooks = self.previous_hooks
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
