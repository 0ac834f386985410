"""The upgrade's handover: what the old image writes into its exec's environment is what the
new image reads back, and a record from an older image (lists, fewer fields) still reads."""

from __future__ import annotations

import json

from forkserve.handover import ENV, HandedListener, HandedWorker, Handover, take


def full() -> Handover:
    return Handover(
        listeners=[HandedListener(5, "127.0.0.1:8000", False), HandedListener(6, "unix:/s", True)],
        counter=(7, 8), alive=(9, 10),
        workers=[HandedWorker(101, 1, 3, booted=True, stopping=False, draining=False),
                 HandedWorker(102, 2, 2, booted=False, stopping=True, draining=True)],
        generation=3, wanted=["reload"], signals=[1, 12], status_fd=11, status_stand_in=4242,
        metrics_dir="/tmp/forkserve-metrics-1-x", metrics_owned=True)


def test_the_handover_round_trips_through_the_environment() -> None:
    handover = full()
    environ: dict[str, str] = {"PATH": "/bin"}
    handover.into(environ)
    assert json.loads(environ[ENV])["generation"] == 3  # plain JSON, one variable
    assert take(environ) == handover
    assert ENV not in environ, "read once: the new image takes it out of its environment"
    assert environ == {"PATH": "/bin"}


def test_no_handover_is_none() -> None:
    assert take({}) is None
    assert take({ENV: ""}) is None


def test_what_survives_the_exec() -> None:
    assert full().fds() == [5, 6, 7, 8, 9, 10]


def test_an_older_images_record_still_reads() -> None:
    """Before the typed record: listeners and workers as lists, workers with only pid, id and
    generation (booted and serving, then), no signals, no status, no metrics."""
    old = json.dumps({"listeners": [[5, "127.0.0.1:8000", False]], "counter": [7, 8],
                      "alive": [9, 10], "workers": [[101, 1, 3], [102, 2, 3, 1, 1, 0]],
                      "generation": 3})
    handover = take({ENV: old})
    assert handover is not None
    assert handover.listeners == [HandedListener(5, "127.0.0.1:8000", False)]
    assert handover.counter == (7, 8) and handover.alive == (9, 10)
    assert handover.workers == [HandedWorker(101, 1, 3, True, False, False),
                                HandedWorker(102, 2, 3, True, True, False)]
    assert (handover.wanted, handover.signals, handover.status_fd, handover.metrics_dir) == \
        ([], [], None, None)
