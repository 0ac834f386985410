"""Worker classes, loaded lazily by name so that an unused one's imports never happen
(``gevent`` must only ever be imported by the gevent worker)."""

from __future__ import annotations

import importlib

WORKER_CLASSES = {
    "sync": ("forkserve.workers.sync", "SyncWorker"),
    "gevent": ("forkserve.workers.gevent", "GeventWorker"),
    "thread": ("forkserve.workers.thread", "ThreadWorker"),
}


def worker_class(name: str) -> type:
    module_name, class_name = WORKER_CLASSES[name]
    return getattr(importlib.import_module(module_name), class_name)  # type: ignore[no-any-return]
