"""What an operator asks of the running arbiter besides signals: the control socket's
commands (``forkserve ctl``), and USR1's log reopening."""

from __future__ import annotations

import signal
import time
from dataclasses import dataclass
from typing import Any

from forkserve.control import ControlServer
from forkserve.arbiter.part import Part


@dataclass(kw_only=True)
class Commands(Part):
    """The control socket (a mixin of :class:`forkserve.arbiter.Arbiter`)."""

    control: ControlServer | None = None

    # -- the control socket --------------------------------------------------------------------
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
            old = self.config.worker_count
            self.config.values["workers"] = count
            self.log.info("Scaling workers", workers=count)
            if count != old:
                self.hooks.call("nworkers_changed", self.log, self.server_info, count, old)
            self.spawn_missing(time.monotonic())
            return {"ok": True, "workers": count}, []
        if name == "listeners":
            return self.hand_listeners()
        return {"ok": False, "error": f"unknown command {name!r}"}, []

    def reopen_logs(self) -> None:
        self.log.reopen()
        self.log.info("Reopened log files")
        self.signal_workers(signal.SIGUSR1, list(self.workers.values()))
