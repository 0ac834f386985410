from __future__ import annotations

import gc
import os
import shutil
import signal
import tempfile
from pathlib import Path
from typing import Any, Iterator

import pytest

from tests.harness import Gate, Server

# Started as a background job of a non-interactive shell (`nohup ... &`, some CI runners), the
# suite inherits SIGINT ignored, and an ignored signal stays ignored across exec: every process
# the tests start would ignore the Ctrl-C they send it (`forkserve status --watch` then never
# stops). Give the children a terminal's disposition: a handler here is reset to the default
# in them.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


MAX_TEST_PROCESSES = 4


def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """``-n auto`` (pyproject's addopts): one test process per core this process may run on,
    at most MAX_TEST_PROCESSES. Each load test drives its servers with client threads or wrk
    sized for two cores; more at once than the cores would only make them wait on each
    other (the suite's loaded-machine check is two whole runs side by side on 2 cores)."""
    return max(1, min(len(os.sched_getaffinity(0)), MAX_TEST_PROCESSES))


def _open_fds() -> dict[int, str]:
    found = {}
    for name in os.listdir("/proc/self/fd"):
        try:
            found[int(name)] = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            continue  # the listdir's own descriptor, closed already
    return found


def _multiprocessing_globals() -> set[int]:
    """What multiprocessing opens once per process and keeps (the bench's load generator
    uses it): the resource tracker's pipe; its shared-memory arenas are /dev/shm/pym-*."""
    from multiprocessing import resource_tracker

    fd = getattr(getattr(resource_tracker, "_resource_tracker", None), "_fd", None)
    return {fd} if isinstance(fd, int) else set()


@pytest.fixture(autouse=True)
def no_leaked_fds() -> Iterator[None]:
    """Every descriptor a test opened (client sockets, the pipes to a server's output, a
    gate's FIFO) is closed by the end of its teardown: a leak here is a socket a server sees
    as a client that never leaves, or a descriptor count that grows over the suite."""
    before = _open_fds()
    yield

    def leaked() -> dict[int, str]:
        kept = _multiprocessing_globals()
        return {fd: target for fd, target in _open_fds().items()
                if (fd not in before or before[fd] != target) and fd not in kept
                and not target.startswith("/dev/shm/pym-")}

    if leaked():
        gc.collect()  # a cycle's socket: closed (and its ResourceWarning raised) by the collector
        assert not leaked(), f"descriptors left open by the test: {leaked()}"


# What a process started by a later test inherits from this one. The tests run spread over
# worker processes (pytest-xdist), so a unit test's leftover reaches the integration tests
# that run after it in the same process: seen, FORKSERVE_WORKERS=9 set by a unit test and
# never unset, and every later server of that process ran 9 workers whatever it was told.
_INHERITED_SIGNALS = tuple(signal.Signals(n) for n in sorted(signal.valid_signals())
                           if n not in (signal.SIGKILL, signal.SIGSTOP) and n < signal.SIGRTMIN)


def _inherited_state() -> dict[str, Any]:
    umask = os.umask(0o022)
    os.umask(umask)
    return {
        # (pytest's own variable names the running test and its phase)
        "environ": {k: v for k, v in os.environ.items() if k != "PYTEST_CURRENT_TEST"},
        "umask": umask,
        "blocked signals": signal.pthread_sigmask(signal.SIG_BLOCK, []),
        # an ignored signal stays ignored across exec; a handler is reset to the default
        "ignored signals": {s for s in _INHERITED_SIGNALS if signal.getsignal(s) is signal.SIG_IGN},
    }


@pytest.fixture(autouse=True)
def no_leaked_process_state() -> Iterator[None]:
    """A test leaves the environment, umask, signal mask and ignored signals as it found them
    (restored here either way, so that one leak fails one test, not every later one)."""
    before = _inherited_state()
    yield
    after = _inherited_state()
    changed = sorted(name for name in before if before[name] != after[name])
    if not changed:
        return
    environ = before["environ"]
    for key in set(os.environ) - set(environ) - {"PYTEST_CURRENT_TEST"}:
        del os.environ[key]
    os.environ.update(environ)
    os.umask(before["umask"])
    signal.pthread_sigmask(signal.SIG_SETMASK, before["blocked signals"])
    for s in after["ignored signals"] - before["ignored signals"]:
        signal.signal(s, signal.SIG_DFL)
    for s in before["ignored signals"] - after["ignored signals"]:
        signal.signal(s, signal.SIG_IGN)
    details = {name: (before[name], after[name]) for name in changed if name != "environ"}
    if "environ" in changed:
        details["environ"] = ({k: v for k, v in environ.items() if after["environ"].get(k) != v},
                              {k: v for k, v in after["environ"].items() if environ.get(k) != v})
    raise AssertionError(f"the test changed what later tests' processes inherit "
                         f"(before, after): {details}")


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
    """Each phase's report on its item (``item.failed_phase``), for fixtures' teardowns."""
    report = yield
    if report.failed:
        item.failed_phase = report.when  # type: ignore[attr-defined]
    return report


@pytest.fixture
def server_factory(request: pytest.FixtureRequest) -> Iterator[type[Server]]:
    """``server_factory(*args, app=..., env=...)`` starts a server; every one is killed and
    checked for orphans at teardown. When the test failed, each server's log is printed (the
    report's "Captured stdout teardown"): a failure on a loaded CI machine shows what the
    server saw."""
    started: list[Server] = []

    def start(*args: str, **kwargs: object) -> Server:
        server = Server(*args, **kwargs)  # type: ignore[arg-type]
        started.append(server)
        return server

    yield start  # type: ignore[misc]
    for server in started:
        server.close()
    if getattr(request.node, "failed_phase", None) is not None:
        for n, server in enumerate(started):
            text = server.log_text()
            print(f"--- server {n} log ({len(text)} chars; the last 30000) ---\n{text[-30000:]}")


@pytest.fixture
def server(server_factory: type[Server]) -> Server:
    """A ready two-worker server running tests.apps.basic:app."""
    return server_factory().wait_ready()  # type: ignore[call-arg]


@pytest.fixture
def gates(tmp_path: Path) -> Iterator[Any]:
    made: list[Gate] = []

    def make(name: str = "gate") -> Gate:
        gate = Gate(tmp_path / name)
        made.append(gate)
        return gate

    yield make
    for gate in made:
        gate.release()


@pytest.fixture
def ctl_dir() -> Iterator[Path]:
    """A short directory for unix sockets such as control sockets (sun_path holds 107 bytes,
    more than pytest's tmp_path leaves)."""
    path = Path(tempfile.mkdtemp(prefix="fs-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)
