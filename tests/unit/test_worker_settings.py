"""WorkerSettings is derived from the configuration: each field but the derived ones is the
setting of the same name, so a renamed setting cannot silently fall out of the workers."""

from __future__ import annotations

from dataclasses import FrozenInstanceError, fields

import pytest

from forkserve.config import BY_NAME, parse_args, resolve
from forkserve.http import Limits
from forkserve.workers.base import WorkerSettings


def test_every_field_is_a_setting_or_derived() -> None:
    names = {f.name for f in fields(WorkerSettings)}
    assert WorkerSettings.DERIVED <= names
    assert names - WorkerSettings.DERIVED <= set(BY_NAME), names - set(BY_NAME)


def test_built_from_the_configuration() -> None:
    cli, _ = parse_args(["--keepalive", "7", "--threads", "3", "--limit-request-line", "900",
                         "tests.apps.basic:app"], "test")
    config = resolve(cli, {})
    settings = WorkerSettings.of(config, "/tmp/metrics")
    for f in fields(WorkerSettings):
        if f.name not in WorkerSettings.DERIVED:
            assert getattr(settings, f.name) == getattr(config, f.name), f.name
    assert (settings.keepalive, settings.threads, settings.app) == (7.0, 3, "tests.apps.basic:app")
    assert isinstance(settings.limits, Limits) and settings.metrics_dir == "/tmp/metrics"
    with pytest.raises(FrozenInstanceError):
        settings.keepalive = 1.0  # type: ignore[misc]
