"""What an in-place upgrade (USR2) hands to the new image: one typed record, written by the
old image's arbiter into the environment of its ``execve`` and read back, once, by the new
image's cli (which takes it out of the environment at once: never a user's setting).

The wire form is JSON; reading tolerates an older image's record (missing fields take their
defaults, a worker entry with only pid, id and generation is booted and serving), so an
upgrade across versions keeps the old workers.

Imports only the standard library: the cli, the arbiter and the metrics store all read it.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any, MutableMapping

ENV = "FORKSERVE_UPGRADE_HANDOVER"


@dataclass(frozen=True)
class HandedListener:
    fd: int
    address: str
    owned: bool  # a unix socket this server created (and so unlinks at its stop)


@dataclass(frozen=True)
class HandedWorker:
    pid: int
    worker_id: int
    generation: int
    booted: bool = True
    stopping: bool = False
    draining: bool = False


@dataclass(frozen=True)
class Handover:
    listeners: list[HandedListener]
    counter: tuple[int, int]  # the counter pipe (read, write): old workers go on reporting
    alive: tuple[int, int]  # the alive pipe: old workers go on seeing the arbiter
    workers: list[HandedWorker]
    generation: int
    wanted: list[str] = field(default_factory=list)  # "reload", "upgrade": asked, not done
    signals: list[int] = field(default_factory=list)  # received, not dispatched before exec
    status_fd: int | None = None
    status_stand_in: int | None = None  # the pid answering on status_fd through the exec
    metrics_dir: str | None = None
    metrics_owned: bool = False

    def fds(self) -> list[int]:
        """What must survive the exec (the status listener is handled on its own)."""
        return [l.fd for l in self.listeners] + [*self.counter, *self.alive]

    def dumps(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def loads(cls, text: str) -> "Handover":
        data: dict[str, Any] = json.loads(text)
        workers = []
        for entry in data.get("workers", []):
            if isinstance(entry, dict):
                workers.append(HandedWorker(**entry))
            else:  # an older image's list: pid, id, generation[, booted, stopping, draining]
                pid, worker_id, generation, *flags = entry
                workers.append(HandedWorker(pid, worker_id, generation,
                                            *(bool(f) for f in flags[:3])))
        listeners = [HandedListener(**l) if isinstance(l, dict)
                     else HandedListener(int(l[0]), str(l[1]), bool(l[2]))
                     for l in data.get("listeners", [])]
        return cls(listeners=listeners, counter=(int(data["counter"][0]), int(data["counter"][1])),
                   alive=(int(data["alive"][0]), int(data["alive"][1])), workers=workers,
                   generation=int(data["generation"]), wanted=list(data.get("wanted", [])),
                   signals=[int(s) for s in data.get("signals", [])],
                   status_fd=data.get("status_fd"), status_stand_in=data.get("status_stand_in"),
                   metrics_dir=data.get("metrics_dir"),
                   metrics_owned=bool(data.get("metrics_owned")))

    def into(self, environ: MutableMapping[str, str]) -> None:
        environ[ENV] = self.dumps()


def take(environ: MutableMapping[str, str]) -> Handover | None:
    """The handover in ``environ``, removed from it (None when this is no upgrade)."""
    text = environ.pop(ENV, None)
    return Handover.loads(text) if text else None

