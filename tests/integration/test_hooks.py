"""Server hooks (--hooks, issue 15), on a real server: the hooks module tests.apps.hooks_record
appends one JSON line per call to $HOOKS_LOG, so each test reads which hook ran, in which
process, with which arguments, and in what order."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.harness import ROOT, get, wait_for
from tests.load import Load

CLASSES = ["sync", "thread", "gevent"]
HOOKS = "tests.apps.hooks_record"
APP_LOAD_ERROR = 4


def calls(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines()]


def named(path: Path, hook: str) -> list[dict[str, Any]]:
    return [c for c in calls(path) if c["hook"] == hook]


def hooked(server_factory: Any, tmp_path: Path, *args: str, raising: str = "",
           **kwargs: Any) -> tuple[Any, Path]:
    log = tmp_path / "hooks.jsonl"
    env = {"HOOKS_LOG": str(log), "HOOKS_RAISE": raising, **kwargs.pop("env", {})}
    server = server_factory("--hooks", HOOKS, *args, env=env, **kwargs)
    return server, log


@pytest.mark.parametrize("worker_class", CLASSES)
def test_hooks_run_in_order_with_their_arguments(server_factory: Any, tmp_path: Path,
                                                 worker_class: str) -> None:
    server, log = hooked(server_factory, tmp_path, "-k", worker_class)
    server.wait_ready()
    # ("Server ready" is logged as readiness begins; when_ready runs right after it.)
    wait_for(lambda: named(log, "when_ready"), 10, "the when_ready hook")
    arbiter = server.pid
    first = [c["hook"] for c in calls(log)]
    assert first[:2] == ["on_starting", "nworkers_changed"], first
    assert named(log, "nworkers_changed")[0] | {"pid": 0} == {
        "hook": "nworkers_changed", "pid": 0, "new": 2, "old": None}
    assert first[-1] == "when_ready"  # after every worker booted
    forks = named(log, "pre_fork")
    assert [(c["pid"], c["worker_pid"], c["worker_id"], c["age"]) for c in forks] == [
        (arbiter, None, 1, 1), (arbiter, None, 2, 2)]
    posts = sorted(named(log, "post_fork"), key=lambda c: c["age"])
    gen1 = [c["pid"] for c in posts]
    assert [(c["worker_pid"], c["server_pid"], c["worker_id"]) for c in posts] == [
        (gen1[0], arbiter, 1), (gen1[1], arbiter, 2)]
    assert arbiter not in gen1 and len(set(gen1)) == 2
    inits = named(log, "post_worker_init")
    assert sorted(c["pid"] for c in inits) == sorted(gen1) and all(c["has_app"] for c in inits)

    # Under load, one pre_request and one post_request per request served, in the worker.
    load = Load(server.port, threads=4, seconds=20).start()
    wait_for(lambda: len(load.bodies) >= 60, 15, "60 requests served")
    load.stop()
    assert load.failures == []
    # pre_request raising: a 500, the app never called, post_request still told.
    failed = get(server.port, "/pre-request-fails")
    assert failed.status == 500
    served = len(load.bodies) + 1
    wait_for(lambda: len(named(log, "post_request")) >= served, 10, "every post_request")
    pre, post = named(log, "pre_request"), named(log, "post_request")
    assert len(pre) == len(post) == served
    assert {c["pid"] for c in pre} <= set(gen1) and all(c["worker_pid"] == c["pid"] for c in pre)
    ok = [c for c in post if c["path"] == "/"]
    assert len(ok) == served - 1
    assert all(c["status"] == "200 OK" and c["sent"] == 6 and c["path_info"] == "/" for c in ok)
    assert [c["status_code"] for c in post if c["path"] == "/pre-request-fails"] == [500]
    assert "RuntimeError: pre_request failed on purpose" in \
        server.wait_log("The pre_request hook raised")["traceback"]
    assert server.count_log("The pre_request hook raised") == 1
    assert [c for c in pre if c["path"] == "/"][0]["version"] == [1, 1]

    # HUP: on_reload, a new generation forked, the old one's worker_exit (in each old worker)
    # and child_exit (in the arbiter).
    server.signal(signal.SIGHUP)
    server.wait_log("Reload complete")
    wait_for(lambda: len(named(log, "child_exit")) == 2, 15, "the old workers' child_exit")
    assert [c["pid"] for c in named(log, "on_reload")] == [arbiter]
    exits = named(log, "worker_exit")
    assert sorted(c["pid"] for c in exits) == sorted(gen1)
    assert all(c["worker_pid"] == c["pid"] and c["server_pid"] == arbiter for c in exits)
    children = named(log, "child_exit")
    assert sorted(c["worker_pid"] for c in children) == sorted(gen1)
    assert {(c["pid"], c["reason"]) for c in children} == {(arbiter, "stopped")}
    gen2 = [c["pid"] for c in named(log, "post_fork") if c["generation"] == 2]
    assert len(gen2) == 2 and not set(gen2) & set(gen1)
    assert [c["age"] for c in named(log, "pre_fork")] == [1, 2, 3, 4]

    # TERM: each worker's worker_exit and child_exit, then on_exit, last of all.
    server.signal(signal.SIGTERM)
    assert server.wait_exit(20) == 0
    assert sorted(c["pid"] for c in named(log, "worker_exit")) == sorted(gen1 + gen2)
    assert sorted(c["worker_pid"] for c in named(log, "child_exit")) == sorted(gen1 + gen2)
    assert calls(log)[-1]["hook"] == "on_exit" and calls(log)[-1]["pid"] == arbiter
    assert len(named(log, "on_exit")) == 1 and len(named(log, "when_ready")) == 1
    assert len(named(log, "worker_int")) == 0 and len(named(log, "worker_abort")) == 0


def test_usr2_calls_pre_exec_then_the_new_image_starts(server_factory: Any,
                                                       tmp_path: Path) -> None:
    server, log = hooked(server_factory, tmp_path)
    server.wait_ready()
    server.signal(signal.SIGUSR2)
    server.wait_log("Upgrade complete", timeout=30)
    hooks = [(c["hook"], c["pid"]) for c in calls(log) if c["pid"] == server.pid]
    at = hooks.index(("pre_exec", server.pid))
    # The same pid, a new image: on_starting again, and when_ready once its workers booted.
    assert [h for h, _ in hooks[at:]][:2] == ["pre_exec", "on_starting"]
    wait_for(lambda: len(named(log, "when_ready")) == 2, 10, "the new image's when_ready")
    server.signal(signal.SIGTERM)
    assert server.wait_exit(20) == 0


def test_a_raising_hook_in_the_arbiter_is_logged_and_the_server_goes_on(
        server_factory: Any, tmp_path: Path) -> None:
    raising = ["on_starting", "nworkers_changed", "pre_fork", "when_ready", "on_reload",
               "child_exit", "post_request", "worker_exit", "on_exit"]
    server, log = hooked(server_factory, tmp_path, raising=",".join(raising))
    server.wait_ready()
    assert get(server.port, "/").status == 200
    server.signal(signal.SIGHUP)
    server.wait_log("Reload complete")
    wait_for(lambda: len(named(log, "child_exit")) == 2, 15, "the old workers' child_exit")
    assert get(server.port, "/").status == 200
    server.signal(signal.SIGTERM)
    assert server.wait_exit(20) == 0
    for hook in raising:
        if hook == "post_request":
            continue
        records = [r for r in server.records() if r.get("hook") == hook]
        assert records, f"{hook}: no record\n{server.log_text()}"
        assert f"The {hook} hook raised; carrying on" == records[0]["message"]
        assert f"RuntimeError: {hook} failed on purpose" in records[0]["traceback"]
    post = [r for r in server.records() if r.get("hook") == "post_request"]
    assert len(post) == 2 and post[0]["message"] == "The post_request hook raised; serving on"
    assert server.count_log("Server stopped") == 1


@pytest.mark.parametrize("hook", ["post_fork", "post_worker_init"])
def test_a_boot_hook_that_raises_is_a_boot_failure(server_factory: Any, tmp_path: Path,
                                                   hook: str) -> None:
    server, log = hooked(server_factory, tmp_path, raising=hook)
    assert server.wait_exit(20) == APP_LOAD_ERROR
    failed = server.wait_log("Application failed to boot")
    assert f"the {hook} hook raised RuntimeError: {hook} failed on purpose " \
           "(tests/apps/hooks_record.py:" in failed["message"]
    # No fork loop: the first generation, and no more.
    assert server.count_log("Spawned worker") <= 2
    assert [c["hook"] for c in calls(log)][-1] == "on_exit"


@pytest.mark.parametrize("worker_class", ["sync", "gevent"])
def test_a_timed_out_worker_logs_every_stack_and_calls_worker_abort(
        server_factory: Any, tmp_path: Path, worker_class: str) -> None:
    # Not the thread worker: its main thread heartbeats while request threads hang, so it is
    # timed out only when something holds the GIL, and then no Python code (a hook, ours)
    # can run before the SIGKILL.
    server, log = hooked(server_factory, tmp_path, "-k", worker_class, "--timeout", "2",
                         app="tests.apps.stuck:app", workers=1)
    server.wait_ready()
    first = int(get(server.port, "/").body)
    with server.connect() as sock:
        sock.sendall(b"GET /stuck HTTP/1.1\r\nHost: x\r\n\r\n")
        record = server.wait_log(f"(pid {first}) was stuck at the arbiter's timeout kill",
                                 timeout=15)
        stacks = record["stacks"]
        assert "Thread MainThread" in stacks and "interrupted by the kill" in stacks
        # Where it was stuck, innermost last; not the handler's own frames.
        assert stacks.rstrip().endswith("_real_sleep()(seconds)"), stacks
        assert "stuck_in_the_app" in stacks and "report_abort" not in stacks
        server.wait_log(f"(pid {first}) exited with code 1 after a timeout", timeout=10)
    abort = named(log, "worker_abort")
    assert [(c["pid"], c["worker_pid"]) for c in abort] == [(first, first)]
    assert [c["reason"] for c in named(log, "child_exit")] == ["timeout"]
    assert int(get(server.port, "/").body) != first  # replaced, serving


def test_a_gunicorn_conf_py_gives_its_hooks_and_names_the_settings_it_does_not(
        server_factory: Any, tmp_path: Path) -> None:
    marker = tmp_path / "marker"
    conf = tmp_path / "gunicorn.conf.py"
    conf.write_text(
        "import multiprocessing\n"
        "bind = '0.0.0.0:8000'\n"
        "workers = multiprocessing.cpu_count() * 2 + 1\n"
        "timeout = 120\n"
        "def post_fork(server, worker):\n"
        f"    open({str(marker)!r} + '-' + str(worker.pid), 'w').close()\n"
        "def post_forks(server, worker):\n"
        "    pass\n")
    server = server_factory("--hooks", "gunicorn.conf.py", cwd=tmp_path).wait_ready()
    warning = server.wait_log("also sets gunicorn settings that --hooks does not apply")
    assert "bind, timeout, workers; move them into -c forkserve.yaml" in warning["message"]
    assert server.count_log("also sets gunicorn settings") == 1
    assert "post_forks is not a hook name (did you mean post_fork?)" in \
        server.wait_log("post_forks is not a hook name")["message"]
    assert server.wait_log("Starting forkserve")["listening"].startswith("127.0.0.1:")
    wait_for(lambda: len(list(tmp_path.glob("marker-*"))) == 2, 10, "post_fork in both workers")
    # HUP executes the file anew: a hook added meanwhile runs (on_reload).
    conf.write_text(conf.read_text() + "def on_reload(server):\n"
                    f"    open({str(marker)!r} + '-reloaded', 'w').close()\n")
    server.signal(signal.SIGHUP)
    server.wait_log("Reload complete")
    assert Path(f"{marker}-reloaded").exists()


@pytest.mark.parametrize("spec, content, expected", [
    ("tests.apps.no_such_hooks", None, "cannot import hooks module 'tests.apps.no_such_hooks'"),
    ("missing.conf.py", None, "hooks file missing.conf.py not found"),
    ("broken.py", "def post_fork(server, worker)\n    pass\n",
     "cannot import hooks broken.py: SyntaxError: expected ':' (broken.py:1)"),
    ("raising.py", "import os\nraise RuntimeError('no config')\n",
     "cannot import hooks raising.py: RuntimeError: no config (raising.py:2)"),
    ("arity.py", "def post_fork(server):\n    pass\n",
     "post_fork must take (server, worker); it takes (server)"),
])
def test_hooks_that_cannot_be_loaded_are_one_line_and_exit_4(
        tmp_path: Path, spec: str, content: str | None, expected: str) -> None:
    if content is not None:
        (tmp_path / spec).write_text(content)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-m", "forkserve", "-b", "127.0.0.1:0", "--hooks",
                           spec, "tests.apps.basic:app"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=30)
    assert done.returncode == APP_LOAD_ERROR, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "Hooks could not be loaded: " in lines[0], done.stderr
    assert expected in lines[0], lines[0]
    assert "Spawned worker" not in done.stderr
