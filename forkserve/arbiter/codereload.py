"""Development reload (``--reload``): a change to the application's files is a HUP.

The watcher (:mod:`forkserve.reloader`) runs in a thread and reports through a pipe the reactor
polls; everything here runs in the loop. A batch of changes opens a quiet window: more changes
within it join the same reload (a ``git checkout`` of fifty files is one), which happens
QUIET seconds after the last one, and never more than MOST_WAIT after the first. The reload is
the ordinary one (:meth:`forkserve.arbiter.rollout.Generations.reload`): the new workers boot,
then the old ones drain; a new generation that fails to import is rolled back while the old
one serves, and the next edit tries again. With ``--preload`` a HUP does not re-import the
application, so the configuration refuses the two together.

# -- machine: pending changes ------------------------------------------------------------------
    none ──changes──▶ pending (reload_at) ──more changes──▶ pending (reload_at later, capped)
    pending ──reload_at──▶ none: one line naming the files, then reload() (coalesced if a
    reload is in progress; dropped if the server is stopping)
"""

from __future__ import annotations

import os
import select
import sys
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Iterator

from forkserve.lifecycle import State
from forkserve.arbiter.part import Part

if TYPE_CHECKING:
    from forkserve.reloader import Watcher

QUIET = 0.3  # seconds without a new change before the reload
MOST_WAIT = 3.0  # seconds after the first change at the latest (a file written continuously)
NAMED = 5  # files named in the reload's line; the rest are counted


@dataclass(kw_only=True)
class CodeReload(Part):
    """--reload (a mixin of :class:`forkserve.arbiter.Arbiter`)."""

    watcher: Watcher | None = None
    changed: dict[str, None] = field(default_factory=dict)  # the pending paths, in order
    changes_began: float = 0.0
    reload_at: float | None = None

    def start_watching(self) -> None:
        if not self.config.reload:
            return
        # Imported here, at the start (--reload is not reloadable): no worker of a server
        # without it carries the watcher's code and its queue module.
        from forkserve.reloader import ChangeFilter, Watcher, watch_plan

        cwd = os.getcwd()  # the --chdir directory: where the application is imported from
        plan = watch_plan(self.config.app, cwd, self.config.reload_extra_file, sys.path)
        accepts = ChangeFilter(plan, self.config.reload_include, self.config.reload_exclude)
        for path in plan.missing:
            self.log.warning("--reload-extra-file: no such directory, not watched", path=path)
        if not plan.watched:
            self.log.warning("--reload: nothing to watch (the current directory is /); "
                             "use --chdir PROJECT or --reload-extra-file")
            return
        try:
            self.watcher = Watcher(plan, accepts)
        except ImportError as exc:  # (the configuration checked it is installed)
            self.log.error(f"--reload: cannot import watchfiles, not watching: {exc}")
            return
        self.reactor.add(self.watcher.read_fd, select.POLLIN, self.on_watch)
        self.watcher.start()

    def stop_watching(self) -> None:
        watcher, self.watcher = self.watcher, None
        if watcher is None:
            return
        self.reactor.remove(watcher.read_fd)
        if not watcher.stop():
            self.log.warning("--reload: the watcher thread did not stop in time; exiting anyway")

    def watch_fds(self) -> list[int]:
        return self.watcher.fds() if self.watcher is not None else []

    def on_watch(self, fd: int, events: int) -> None:
        if self.watcher is None:
            return
        now = time.monotonic()
        for report in self.watcher.take():
            if report.kind == "watching":
                self.log.info("Watching for code changes (--reload)",
                              directories=",".join(self.watcher.plan.watched))
            elif report.kind == "failed":
                self.log.error(f"--reload: watching stopped ({report.error}); code changes are "
                               "no longer seen, restart to watch again")
            else:
                if self.reload_at is None:
                    self.changes_began = now
                self.changed.update(dict.fromkeys(report.paths))
                self.reload_at = min(now + QUIET, self.changes_began + MOST_WAIT)

    def watch_deadlines(self) -> Iterator[float]:
        if self.reload_at is not None:
            yield self.reload_at

    def watch_tick(self, now: float) -> None:
        if self.reload_at is None or now < self.reload_at:
            return
        paths, self.changed, self.reload_at = list(self.changed), {}, None
        if self.state not in (State.BOOTING, State.RUNNING):
            return  # stopping: no reload to ask for (nor a line saying one is ignored)
        cwd = os.getcwd()
        shown = [os.path.relpath(p, cwd) if p.startswith(cwd + os.sep) else p
                 for p in paths[:NAMED]]
        more = f" and {len(paths) - NAMED} more" if len(paths) > NAMED else ""
        self.log.info(f"Code changed: {', '.join(shown)}{more}; reloading", changed=len(paths))
        self.reload()
