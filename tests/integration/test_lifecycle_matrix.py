"""A bounded subset of the lifecycle matrix (bench/lifecycle.py, issue 10), for every worker class.

Each test runs one cell: a real forkserve (2 workers, port 0) under load from the bench's
classifying raw-socket clients, one life-cycle event, then the issue's pass criteria:

- zero failed requests for TERM, HUP ×5, USR2 ×2, ``--max-requests``, ``scale`` and TTOU/TTIN
  (refusals are expected only after the TERM, and while paused);
- SIGKILL of a worker: only requests in flight on it may fail (within 1 s of the kill, at
  most one per client), and a replacement answers within 1 s;
- TERM: exit code 0, accepting stops within 100 ms (the last connect() the kernel completed),
  later connections are refused (at once or at their SYN retransmission), the arbiter exits
  within 20 ms of the last response, no process outlives it.

The timing bounds get ``SCHEDULING_SLACK`` on top of the issue's numbers: the clients and the
server share a loaded 2-core machine, and a bound a busy scheduler misses is a flaky test, not a
finding. The longer cells are marked ``slow``.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.lifecycle import ACCEPT_STOP, EXIT_AFTER_LAST, REPLACEMENT, Cell, run_cell

CLASSES = ["sync", "thread", "gevent"]
CLIENTS = 8
# The bench (bench/lifecycle.py) judges the figures strictly: accepting stops within
# 100 ms, exit within 20 ms of the last response, a killed worker replaced within 1 s. The suite
# must pass on a loaded machine too (CI beside other work, the suite run twice at once), where a
# process can wait its turn for the CPU for hundreds of milliseconds: here those bounds get a
# second of room. They still catch what they guard against: accepting for the whole drain,
# an exit held up by a linger (1 s), a worker not replaced at all.
SCHEDULING_SLACK = 1.0




def run(tmp: Path, worker_class: str, event: str, times: int = 1, clients: str = "close",
        app: str = "hello", concurrency: int = CLIENTS) -> Cell:
    cell = run_cell(Cell("forkserve", worker_class, event, times, clients, app, concurrency), tmp)
    print(f"\n[{cell.name}] sent={cell.sent} ok={cell.ok} failures={cell.failures} lost={cell.lost} "
          f"exit={cell.exit_code} accepting_until={cell.accepting_until} refused_from={cell.accept_stop} "
          f"after_last={cell.exit_after_last_response} replacement={cell.replacement} "
          f"notes={cell.notes} verdict={cell.verdict}")
    return cell


def describe(cell: Cell) -> str:
    return (f"{cell.name}: {cell.sent} sent, {cell.ok} ok, failures {cell.failures}, "
            f"{cell.lost} lost; error={cell.error}; notes={cell.notes}; e.g. {cell.samples[:5]}")


def assert_nothing_lost(cell: Cell) -> None:
    assert cell.error is None, describe(cell)
    assert cell.ok > 0, describe(cell)
    assert cell.lost == 0, describe(cell)
    assert not [n for n in cell.notes if "gone" in n or "not running" in n or "died" in n], describe(cell)


def assert_term(cell: Cell) -> None:
    assert_nothing_lost(cell)
    assert cell.exit_code == 0, describe(cell)
    assert cell.accepting_until is not None and cell.accepting_until <= ACCEPT_STOP + SCHEDULING_SLACK, \
        f"connections were still accepted {cell.accepting_until} s after TERM: {describe(cell)}"
    # Later clients are refused, never accepted and reset (a reset is lost, above). When: at
    # once, or at the SYN retransmission 1 s later (the README's drain drops new SYNs at the
    # stop by design), so the moment is reported, not asserted.
    assert cell.accept_stop is not None, f"no connection was refused after TERM: {describe(cell)}"
    assert cell.exit_after_last_response is not None, describe(cell)
    assert cell.exit_after_last_response <= EXIT_AFTER_LAST + SCHEDULING_SLACK, \
        f"exit {cell.exit_after_last_response * 1000:.0f} ms after the last response: {describe(cell)}"
    assert not [n for n in cell.notes if "outlived" in n], describe(cell)


# -- the default run (about a minute per worker class) -------------------------------------------

@pytest.mark.parametrize("worker_class", CLASSES)
def test_term_under_load(ctl_dir: Path, worker_class: str) -> None:
    assert_term(run(ctl_dir, worker_class, "term"))


@pytest.mark.parametrize("worker_class", CLASSES)
def test_five_hups_with_keepalive_clients(ctl_dir: Path, worker_class: str) -> None:
    assert_nothing_lost(run(ctl_dir, worker_class, "hup", 5, clients="keepalive"))


@pytest.mark.parametrize("worker_class", CLASSES)
def test_two_usr2_upgrades(ctl_dir: Path, worker_class: str) -> None:
    assert_nothing_lost(run(ctl_dir, worker_class, "usr2", 2))


@pytest.mark.parametrize("worker_class", CLASSES)
def test_max_requests_recycling(ctl_dir: Path, worker_class: str) -> None:
    cell = run(ctl_dir, worker_class, "max-requests", 4, clients="mix")
    assert_nothing_lost(cell)


@pytest.mark.parametrize("worker_class", CLASSES)
def test_scale_up_and_down(ctl_dir: Path, worker_class: str) -> None:
    cell = run(ctl_dir, worker_class, "scale", clients="keepalive")
    assert_nothing_lost(cell)
    assert not [n for n in cell.notes if "not reached" in n], describe(cell)


@pytest.mark.parametrize("worker_class", CLASSES)
def test_ttou_ttin(ctl_dir: Path, worker_class: str) -> None:
    cell = run(ctl_dir, worker_class, "ttou-ttin", 1)
    assert_nothing_lost(cell)
    assert not [n for n in cell.notes if "not paused" in n or "not resumed" in n], describe(cell)


@pytest.mark.parametrize("worker_class", CLASSES)
def test_kill_worker(ctl_dir: Path, worker_class: str) -> None:
    cell = run(ctl_dir, worker_class, "kill-worker", clients="keepalive")
    assert_nothing_lost(cell)  # failures within 1 s of the kill, one per client, are expected
    assert cell.replacement and all(r is not None and r <= REPLACEMENT + SCHEDULING_SLACK
                                    for r in cell.replacement), describe(cell)


# -- longer cells ------------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("worker_class", CLASSES)
@pytest.mark.parametrize("clients,app", [("keepalive", "hello"), ("close", "sleep"), ("mix", "stream")])
def test_term_slow(ctl_dir: Path, worker_class: str, clients: str, app: str) -> None:
    assert_term(run(ctl_dir, worker_class, "term", clients=clients, app=app))


@pytest.mark.slow
@pytest.mark.parametrize("worker_class", CLASSES)
@pytest.mark.parametrize("clients", ["close", "mix"])
def test_twenty_hups(ctl_dir: Path, worker_class: str, clients: str) -> None:
    assert_nothing_lost(run(ctl_dir, worker_class, "hup", 20, clients=clients, concurrency=16))


@pytest.mark.slow
@pytest.mark.parametrize("worker_class", CLASSES)
@pytest.mark.parametrize("event", ["usr2-hup", "usr2-usr1"])
def test_signal_during_reexec(ctl_dir: Path, worker_class: str, event: str) -> None:
    assert_nothing_lost(run(ctl_dir, worker_class, event, 2))


@pytest.mark.slow
@pytest.mark.parametrize("worker_class", CLASSES)
@pytest.mark.parametrize("event", ["sf-takeover", "sf-reuseport"])
def test_soft_stop_handoff(ctl_dir: Path, worker_class: str, event: str) -> None:
    cell = run(ctl_dir, worker_class, event, 2, clients="mix")
    assert_nothing_lost(cell)
    assert not [n for n in cell.notes if "handoff" in n], describe(cell)


@pytest.mark.slow
@pytest.mark.parametrize("worker_class", CLASSES)
def test_usr2_keepalive_sleep(ctl_dir: Path, worker_class: str) -> None:
    assert_nothing_lost(run(ctl_dir, worker_class, "usr2", 2, clients="keepalive", app="sleep"))
