"""SignalQueue and the signal mask across an exec (issue 10): fork-free, in this process.

A signal blocked before the queue exists stays pending (what an in-place upgrade's exec
carries over) and reaches the queue once its handlers are installed; what the loop has not
taken yet can be handed over and replayed.
"""

from __future__ import annotations

import os
import signal
import threading
from typing import Iterator

import pytest

from forkserve import signals as sigs


@pytest.fixture
def restore_mask() -> Iterator[None]:
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, [])
    handler = signal.getsignal(signal.SIGUSR1)
    yield
    signal.pthread_sigmask(signal.SIG_SETMASK, mask)
    signal.signal(signal.SIGUSR1, handler)


def dispose(queue: sigs.SignalQueue) -> None:
    """What the arbiter never needs (it exits or execs with its queue): undo the wakeup fd and
    close the pipe, so the rest of the test session is not woken through it."""
    signal.set_wakeup_fd(-1)
    os.close(queue.read_fd)
    os.close(queue.write_fd)


def test_a_signal_blocked_before_the_queue_is_delivered_to_it(restore_mask: None) -> None:
    previous = sigs.block([signal.SIGUSR1])
    assert signal.SIGUSR1 not in previous
    # To this thread: the mask is per thread, and a signal sent to the process goes to any
    # thread that does not block it. A thread an earlier test left running (the suite's
    # helpers start some) took it once, with the default action: the whole test run ended.
    # The arbiter has one thread, so its exec carries a pending signal either way.
    signal.pthread_kill(threading.get_ident(), signal.SIGUSR1)
    assert signal.SIGUSR1 in signal.sigpending()
    queue = sigs.SignalQueue([signal.SIGUSR1])  # installs, then unblocks: delivered now
    try:
        assert signal.SIGUSR1 not in signal.pthread_sigmask(signal.SIG_BLOCK, [])
        assert list(queue.drain()) == [signal.SIGUSR1]
    finally:
        dispose(queue)


def test_undelivered_signals_are_taken_once_and_replay_in_order(restore_mask: None) -> None:
    queue = sigs.SignalQueue([signal.SIGUSR1])
    try:
        signal.pthread_kill(threading.get_ident(), signal.SIGUSR1)  # (see above)
        taken = queue.undelivered()
        assert taken == [signal.SIGUSR1] and queue.undelivered() == []
        queue.replay([signal.SIGHUP, signal.SIGUSR2])
        batch = queue.drain()
        assert next(batch) == signal.SIGHUP
        # Stopping in the middle of a batch (an exec) leaves the rest to be handed over.
        assert queue.undelivered() == [signal.SIGUSR2]
    finally:
        dispose(queue)
