"""The hooks loader (forkserve.hooks) and the exit-time registry (forkserve.exits), without a
server: what a hooks module or file gives, what it is refused for, what it is warned about."""

from __future__ import annotations

import sys
import traceback
from pathlib import Path
from typing import Any, Iterator

import pytest

from forkserve import exits, on_worker_exit
from forkserve.hooks import (HOOKS, Hooks, HooksError, RequestInfo, ResponseInfo, ServerInfo,
                             WorkerInfo, HookLog, load_hooks)
from forkserve.logs import Log


class Recorder(Log):
    """A Log that keeps its records."""

    def __init__(self) -> None:
        super().__init__("-", "debug")
        self.records: list[tuple[int, str, dict[str, Any]]] = []

    def log(self, level: int, message: str, fields: dict[str, Any],
            exc: BaseException | None = None) -> None:
        if exc is not None:  # (the traceback, in the one record, as Log's text format has it)
            message += "\n" + "".join(traceback.format_exception(exc))
        self.records.append((level, message, fields))

    def warnings(self) -> list[str]:
        return [m for level, m, _ in self.records if level == 30]


@pytest.fixture
def here(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path
    for name in [n for n in sys.modules if n.startswith("myhooks")]:
        del sys.modules[name]


def test_no_hooks_is_an_empty_set() -> None:
    hooks = load_hooks(None)
    assert not hooks and hooks.defined() == [] and hooks.pre_request is None


def test_a_dotted_module_gives_its_hook_functions(here: Path) -> None:
    (here / "myhooks.py").write_text(
        "calls = []\n"
        "def post_fork(server, worker):\n    calls.append(worker)\n"
        "def when_ready(server):\n    pass\n"
        "def helper():\n    pass\n")
    log = Recorder()
    hooks = load_hooks("myhooks", log)
    assert hooks.defined() == ["when_ready", "post_fork"]
    assert hooks.call("post_fork", log, "server", "worker")
    assert sys.modules["myhooks"].calls == ["worker"]
    assert log.warnings() == []  # helper() looks like no hook


def test_a_file_path_is_loaded_from_here_or_from_the_start_directory(here: Path,
                                                                    tmp_path_factory: Any) -> None:
    start = tmp_path_factory.mktemp("start")
    (start / "gunicorn.conf.py").write_text("def on_exit(server):\n    pass\n")
    assert load_hooks("gunicorn.conf.py", start_dir=str(start)).defined() == ["on_exit"]
    (here / "gunicorn.conf.py").write_text("def on_starting(server):\n    pass\n")
    assert load_hooks("gunicorn.conf.py", start_dir=str(start)).defined() == ["on_starting"]


def test_each_load_executes_the_module_anew(here: Path) -> None:
    (here / "myhooks_again.py").write_text("def on_reload(server):\n    pass\n")
    assert load_hooks("myhooks_again").defined() == ["on_reload"]
    (here / "myhooks_again.py").write_text("def on_exit(server):\n    pass\n")
    # A hook the new version deleted is gone (importlib.reload would keep it).
    assert load_hooks("myhooks_again").defined() == ["on_exit"]


def test_gunicorn_settings_in_the_file_are_named_in_one_warning(here: Path) -> None:
    (here / "gunicorn.conf.py").write_text(
        "import multiprocessing\nbind = '0.0.0.0:80'\nworkers = 3\ntimeout = 60\n"
        "accesslog = '-'\n_private = 1\n"
        "def post_fork(server, worker):\n    pass\n")
    log = Recorder()
    load_hooks("gunicorn.conf.py", log)
    warnings = log.warnings()
    assert warnings == ["Hooks gunicorn.conf.py also sets gunicorn settings that --hooks does not "
                        "apply: accesslog, bind, timeout, workers; move them into -c "
                        "forkserve.yaml or command-line flags"]


def test_a_misspelt_hook_is_warned_about(here: Path) -> None:
    (here / "myhooks_typo.py").write_text(
        "def post_forks(server, worker):\n    pass\n"
        "def on_startup(server):\n    pass\n"
        "def make_tracer():\n    pass\n")
    log = Recorder()
    assert load_hooks("myhooks_typo", log).defined() == []
    assert log.warnings() == [
        "Hooks myhooks_typo: post_forks is not a hook name (did you mean post_fork?); it is "
        "never called",
        "Hooks myhooks_typo: on_startup is not a hook name; it is never called"]


@pytest.mark.parametrize("source, expected", [
    ("def post_fork(server):\n    pass\n",
     "post_fork must take (server, worker); it takes (server)"),
    ("def pre_request(worker, req, extra):\n    pass\n",
     "pre_request must take (worker, req); it takes (worker, req, extra)"),
    ("post_fork = 3\n", "post_fork must be a function, got int"),
    ("def post_fork(server, worker)\n    pass\n", "SyntaxError: expected ':' (myhooks_bad.py:1)"),
    ("raise KeyError('DATABASE_URL')\n", "KeyError: 'DATABASE_URL' (myhooks_bad.py:1)"),
    ("import sys\nsys.exit('no')\n", "called sys.exit('no') while being imported"),
])
def test_what_is_refused_is_one_line(here: Path, source: str, expected: str) -> None:
    (here / "myhooks_bad.py").write_text(source)
    with pytest.raises(HooksError) as caught:
        load_hooks("myhooks_bad")
    assert expected in str(caught.value) and "\n" not in str(caught.value)


def test_a_missing_module_or_file(here: Path) -> None:
    with pytest.raises(HooksError, match="cannot import hooks module 'myhooks_none'.*no such"):
        load_hooks("myhooks_none")
    with pytest.raises(HooksError, match="hooks file conf/none.py not found"):
        load_hooks("conf/none.py")
    with pytest.raises(HooksError, match="expected a module"):
        load_hooks("my-hooks")


def test_signatures_with_defaults_and_varargs_are_taken(here: Path) -> None:
    (here / "myhooks_sig.py").write_text(
        "def post_fork(server, worker, extra=None):\n    pass\n"
        "def on_exit(*args):\n    pass\n"
        "def post_request(worker, req):\n    post_request.seen = (worker, req)\n")
    hooks = load_hooks("myhooks_sig")
    assert hooks.defined() == ["post_fork", "post_request", "on_exit"]
    # post_request as gunicorn allows it, with 2 (or 3) arguments: adapted to be given 4.
    assert hooks.post_request is not None
    hooks.post_request("w", "r", {"environ": 1}, "resp")
    assert sys.modules["myhooks_sig"].post_request.seen == ("w", "r")


def test_a_hook_that_raises_is_logged_once_with_its_traceback() -> None:
    def boom(server: Any) -> None:
        raise RuntimeError("boom")

    def leave(server: Any) -> None:
        sys.exit(3)

    log = Recorder()
    hooks = Hooks({"on_starting": boom, "on_exit": leave})
    assert hooks.call("on_starting", log, None) is False
    assert hooks.call("on_exit", log, None) is False  # a hook's sys.exit() ends nothing
    assert hooks.call("when_ready", log, None) is True  # not defined: nothing
    messages = [(m.split("\n", 1)[0], f["hook"]) for _, m, f in log.records]
    assert messages == [("The on_starting hook raised; carrying on", "on_starting"),
                        ("The on_exit hook raised; carrying on", "on_exit")]
    assert "RuntimeError: boom" in log.records[0][1]  # the traceback, in the one record


def test_every_hook_name_is_gunicorns() -> None:
    assert set(HOOKS) == {"on_starting", "on_reload", "when_ready", "pre_fork", "post_fork",
                          "post_worker_init", "worker_int", "worker_abort", "pre_exec",
                          "pre_request", "post_request", "child_exit", "worker_exit",
                          "nworkers_changed", "on_exit"}


def test_the_facades() -> None:
    config = type("C", (), {"app": "myapp:app", "worker_count": 3, "bind": ["x:1"]})()
    log = Recorder()
    server = ServerInfo(42, lambda: config, HookLog(log))
    assert (server.pid, server.app, server.num_workers, server.cfg.bind) == (42, "myapp:app", 3,
                                                                            ["x:1"])
    server.log.info("worker %s spawned", 7)
    server.log.debug("quiet %d", 1)
    assert [(lvl, m) for lvl, m, _ in log.records] == [(20, "worker 7 spawned"), (10, "quiet 1")]
    worker = WorkerInfo(5, 2, 1, 42, lambda: config, server.log)
    assert (worker.pid, worker.age, worker.worker_id, worker.number, worker.ppid) == \
        (None, 5, 2, 2, 42)
    req = RequestInfo("GET", b"/a%20b?x=1", b"/a%20b", b"x=1", "1.1",
                      [(b"user-agent", b"curl"), (b"X-Id", b"7")], "10.0.0.1")
    assert (req.uri, req.path, req.query, req.version) == ("/a%20b?x=1", "/a%20b", "x=1", (1, 1))
    assert req.headers == [("USER-AGENT", "curl"), ("X-ID", "7")]
    resp = ResponseInfo("404 Not Found", 404, [("Content-Length", "3")], 3)
    assert (resp.status, resp.status_code, resp.sent, resp.response_length) == \
        ("404 Not Found", 404, 3, 3)
    assert ResponseInfo(None, 500, [], 0).status == "500"


def test_on_worker_exit_functions_run_in_order_each_contained() -> None:
    ran: list[str] = []

    def fail() -> None:
        raise ValueError("nope")

    def add(what: str) -> None:
        ran.append(what)

    before = exits.registered()
    assert on_worker_exit(add, "first") is add  # (a decorator too)
    on_worker_exit(fail)
    on_worker_exit(add, "third")
    assert exits.registered() == before + 3
    log = Recorder()
    exits.run_exit_functions(log)
    assert ran[-2:] == ["first", "third"]
    assert [f.get("function") for _, _, f in log.records] == [fail.__qualname__]
    assert exits.registered() == 0  # run once


def test_the_setting_from_each_source(tmp_path: Path) -> None:
    from forkserve.config import parse_args, resolve

    yaml_file = tmp_path / "forkserve.yaml"
    yaml_file.write_text("hooks: serverhooks\n")
    cli, _ = parse_args(["-c", str(yaml_file), "myapp:app"], "test")
    assert (resolve(cli, {}).hooks, resolve(cli, {}).sources["hooks"]) == ("serverhooks", "file")
    env = {"FORKSERVE_HOOKS": "gunicorn.conf.py"}
    assert resolve(cli, env).hooks == "gunicorn.conf.py"
    cli, _ = parse_args(["--hooks", "pkg.hooks", "myapp:app"], "test")
    assert resolve(cli, env).hooks == "pkg.hooks"
    assert resolve(parse_args(["myapp:app"], "test")[0], {}).hooks is None
