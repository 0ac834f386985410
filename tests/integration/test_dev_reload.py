"""--reload (development): an edit to the application's files is a graceful HUP, under load.

Each test copies a small app into its own directory (the server's current directory, which
--reload watches) and edits it there, as an editor would. The app answers ``VERSION PID``, so
every response tells which code served it. Edits change the file's size too: Python's cached
bytecode is keyed on the source's mtime (in whole seconds) and size, and two edits of the
same size within a second would otherwise be served from the stale cache.

The reload itself is the ordinary HUP (tests/integration/test_reload.py tests it at length);
what is tested here is what --reload adds: which changes count, that a batch is one reload,
that a broken edit keeps the old workers serving, and the watcher's life in the arbiter (TERM,
USR2). The edit-and-reload and broken-edit tests run on every worker class (the reload boots
a generation of that class); the filter, debounce and extra-file tests on the sync worker
only: they concern the arbiter's watcher, which is the same whatever the workers are.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from tests.harness import ROOT, Server, get, wait_for
from tests.load import Load

CLASS_ARGS = {"sync": (), "thread": ("-k", "thread", "--threads", "4"), "gevent": ("-k", "gevent")}
by_worker_class = pytest.mark.parametrize("worker_class", list(CLASS_ARGS))

APP_SOURCE = '''\
import os

VERSION = {version!r}
with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "conf", "extra.txt")) as fh:
    EXTRA = fh.read().strip()


def app(environ, start_response):
    body = f"{{VERSION}} {{os.getpid()}} {{EXTRA}}".encode()
    start_response("200 OK", [("Content-Type", "text/plain"), ("Content-Length", str(len(body)))])
    return [body]
# edit {edit}: {padding}
'''


class Project:
    """The app's directory (``proj/devapp.py``) and a config file outside it (``conf/``)."""

    def __init__(self, base: Path) -> None:
        self.dir = base / "proj"
        self.conf = base / "conf"
        self.dir.mkdir()
        self.conf.mkdir()
        self.app = self.dir / "devapp.py"
        self.extra = self.conf / "extra.txt"
        self.edits = 0
        replace(self.extra, "extra-1")
        self.write("v1")

    def write(self, version: str) -> None:
        self.edits += 1
        replace(self.app, APP_SOURCE.format(version=version, edit=self.edits,
                                            padding="x" * self.edits))

    def break_it(self) -> None:
        self.edits += 1
        replace(self.app, "VERSION = (\n" + "#" * self.edits + "\n")


def replace(path: Path, text: str) -> None:
    """As editors save: a new file renamed over the old one (the name does not match *.py)."""
    new = path.with_name(path.name + ".new")
    new.write_text(text)
    os.rename(new, path)


def start(server_factory: Any, project: Project, *args: str, workers: int = 2) -> Server:
    server = server_factory("--reload", *args, app="devapp:app", cwd=project.dir,
                            workers=workers).wait_ready()
    server.wait_log("Watching for code changes")
    return server  # type: ignore[no-any-return]


def version(body: bytes) -> str:
    return body.split()[0].decode()


def reloads(server: Server) -> list[str]:
    return [r["message"] for r in server.records() if r.get("message", "").startswith("Code changed")]


def wait_reloads(server: Server, count: int, timeout: float = 20.0) -> None:
    wait_for(lambda: server.count_log("Reload complete") >= count, timeout,
             lambda: f"reload {count} to complete\n{server.log_text()}")


def replaced(server: Server, old: set[int], count: int = 2) -> None:
    """Until the arbiter's children are ``count`` workers, none of them in ``old``."""
    wait_for(lambda: len(w := set(server.workers())) == count and not w & old, 15,
             lambda: f"the old workers {old} to be gone, have {server.workers()}")


def errors(server: Server) -> list[dict[str, Any]]:
    return [r for r in server.records() if r.get("level") == "ERROR"]


def no_failures(load: Load) -> None:
    assert load.failures == [], f"{load.summary()}: {load.failures[:20]}"


# -- an edit reloads, under load ------------------------------------------------------------------

@pytest.mark.slow
@by_worker_class
def test_an_edit_reloads_the_code_without_a_failed_request(server_factory: Any, tmp_path: Path,
                                                           worker_class: str) -> None:
    project = Project(tmp_path)
    server = start(server_factory, project, *CLASS_ARGS[worker_class])
    old = set(server.workers())
    with Load(server.port, threads=3, seconds=60) as load:
        load.wait_requests(20)
        mark = time.monotonic()
        project.write("v2")
        server.wait_log("Code changed: devapp.py; reloading", changed=1)
        wait_reloads(server, 1)
        load.wait_body(lambda b: version(b) == "v2", mark, 15, "a response of the edited code")
        replaced(server, old)
        after = time.monotonic()
        load.wait_requests(20)
    no_failures(load)
    assert {version(b) for b in load.since(after)} == {"v2"}, "old code served after the reload"
    # The new workers' imports wrote __pycache__/devapp.*.pyc: excluded, so no second reload.
    assert reloads(server) == ["Code changed: devapp.py; reloading"]
    assert errors(server) == [], server.log_text()
    # TERM: the watcher thread stops with the loop, and holds nothing up: exit 0, no orphan.
    server.signal(signal.SIGTERM)
    assert server.wait_exit(10) == 0
    server.wait_log("Server stopped")


@pytest.mark.slow
@by_worker_class
def test_a_broken_edit_keeps_the_old_workers_serving_until_fixed(server_factory: Any,
                                                                 tmp_path: Path,
                                                                 worker_class: str) -> None:
    project = Project(tmp_path)
    server = start(server_factory, project, *CLASS_ARGS[worker_class])
    old = set(server.workers())
    with Load(server.port, threads=3, seconds=60) as load:
        load.wait_requests(20)
        project.break_it()
        record = server.wait_log("Reload failed, the old workers keep serving")
        assert "SyntaxError" in record["message"] and "devapp.py" in record["message"], record
        load.wait_requests(20)
        # The broken generation is stopped (QUIT); the old one was never asked to go.
        wait_for(lambda: set(server.workers()) == old, 15,
                 lambda: f"only the old workers {old}, have {server.workers()}")
        assert server.count_log("Reload complete") == 0
        mark = time.monotonic()
        project.write("v3")  # the fix: the next edit reloads
        wait_reloads(server, 1)
        load.wait_body(lambda b: version(b) == "v3", mark, 15, "a response of the fixed code")
    no_failures(load)
    assert {version(b) for _, b in load.bodies} <= {"v1", "v3"}
    assert len(reloads(server)) == 2
    assert server.count_log("Reload failed") == 1
    assert server.proc.poll() is None


# -- which changes count --------------------------------------------------------------------------

def test_an_extra_file_outside_the_project_reloads(server_factory: Any, tmp_path: Path) -> None:
    project = Project(tmp_path)
    server = start(server_factory, project, "--reload-extra-file", "../conf/extra.txt",
                   "--reload-extra-file", "../nowhere/x.yaml")
    warning = server.wait_log("--reload-extra-file: no such directory, not watched")
    assert warning["path"] == str(tmp_path / "nowhere" / "x.yaml")
    assert get(server.port, "/").body.split()[2] == b"extra-1"
    replace(project.extra, "extra-22")  # replaced, as an editor saves: still watched
    record = server.wait_log("Code changed")
    assert record["message"] == f"Code changed: {project.extra}; reloading", record
    wait_reloads(server, 1)
    wait_for(lambda: get(server.port, "/").body.split()[2] == b"extra-22", 10,
             "the new workers to read the extra file")
    replace(project.extra, "extra-333")  # and again: the watch survived the first rename
    wait_reloads(server, 2)
    assert len(reloads(server)) == 2


def test_excluded_changes_do_not_reload_included_ones_do(server_factory: Any,
                                                          tmp_path: Path) -> None:
    project = Project(tmp_path)
    (project.dir / "templates").mkdir()
    (project.dir / "ignored").mkdir()
    server = start(server_factory, project, "--reload-exclude", "ignored",
                   "--reload-exclude", "scratch_*.py", "--reload-include", "*.html")
    # Each excluded change first, then an included one: the watcher sees them in that order,
    # so once the included one's reload is logged, the excluded ones were seen and dropped.
    (project.dir / "scratch_1.py").write_text("x = 1\n")
    (project.dir / "ignored" / "module.py").write_text("x = 1\n")
    (project.dir / "notes.txt").write_text("not *.py, not included\n")
    (project.dir / ".git").mkdir()
    (project.dir / ".git" / "index.py").write_text("a default exclude\n")
    (project.dir / "devapp.py.swp").write_text("an editor's swap file\n")
    (project.dir / "templates" / "page.html").write_text("<p>included</p>\n")
    server.wait_log("Code changed")
    wait_reloads(server, 1)
    assert reloads(server) == [f"Code changed: {os.path.join('templates', 'page.html')}; reloading"]
    (project.dir / "scratch_2.py").write_text("x = 2\n")
    project.write("v2")
    wait_reloads(server, 2)
    assert reloads(server)[1:] == ["Code changed: devapp.py; reloading"]


def test_a_checkout_of_fifty_files_is_one_reload(server_factory: Any, tmp_path: Path) -> None:
    project = Project(tmp_path)
    package = project.dir / "pkg"
    package.mkdir()
    server = start(server_factory, project)
    for n in range(50):  # as `git checkout` writes a branch's files, one after the other
        (package / f"module_{n:02}.py").write_text(f"N = {n}\n")
    record = server.wait_log("Code changed")
    assert record["changed"] == 50, record
    assert record["message"].endswith("and 45 more; reloading"), record
    wait_reloads(server, 1)
    project.write("v2")  # a later edit is a reload of its own: so the first one was the only one
    wait_reloads(server, 2)
    assert [r["changed"] for r in server.records() if r.get("message", "").startswith("Code changed")] \
        == [50, 1]
    assert server.count_log("Reloading: starting a new generation") == 2


# -- refusals -------------------------------------------------------------------------------------

def test_reload_with_preload_is_refused(server_factory: Any, tmp_path: Path) -> None:
    project = Project(tmp_path)
    server = server_factory("--reload", "--preload", app="devapp:app", cwd=project.dir)
    assert server.wait_exit() == 2
    assert server.log_text() == (
        "forkserve: error: --reload cannot be used with --preload: the application is imported "
        "once, in the arbiter, and a reload would fork the workers from that same code; drop "
        "--preload while developing")


def test_reload_without_watchfiles_says_what_to_install(tmp_path: Path) -> None:
    """watchfiles not importable (as when the extra is not installed): one line, exit 2."""
    project = Project(tmp_path)
    shadow = tmp_path / "shadow"
    shadow.mkdir()
    # A None entry in sys.modules is how Python marks a module that cannot be imported.
    (shadow / "sitecustomize.py").write_text("import sys\nsys.modules['watchfiles'] = None\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(shadow), str(ROOT)])}
    done = subprocess.run([sys.executable, "-m", "forkserve", "--reload", "devapp:app"],
                          cwd=project.dir, env=env, capture_output=True, timeout=30)
    assert done.returncode == 2, done
    assert done.stderr.decode() == (
        "forkserve: error: --reload needs watchfiles: pip install 'forkserve[reload]'\n")


# -- the watcher in the arbiter: USR2 -------------------------------------------------------------

def threads(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/task"))


@pytest.mark.slow
def test_usr2_leaves_one_watcher(server_factory: Any, tmp_path: Path) -> None:
    """The watcher is a thread: an in-place upgrade's exec ends it, and the new image starts
    its own. One watcher after each upgrade (the arbiter's thread count is what it was), and an
    edit then is one reload."""
    project = Project(tmp_path)
    server = start(server_factory, project)
    before = threads(server.pid)
    assert before >= 2, "no watcher thread in the arbiter"
    for n in (1, 2):
        server.signal(signal.SIGUSR2)
        wait_for(lambda: server.count_log("Upgrade complete") >= n, 30,
                 lambda: f"upgrade {n}\n{server.log_text()}")
        wait_for(lambda: server.count_log("Watching for code changes") >= n + 1, 15,
                 "the new image's watcher")
        wait_for(lambda: threads(server.pid) == before, 10,
                 lambda: f"{before} threads in the arbiter, have {threads(server.pid)}")
    project.write("v2")
    wait_reloads(server, 1)
    wait_for(lambda: version(get(server.port, "/").body) == "v2", 10, "the edited code")
    assert reloads(server) == ["Code changed: devapp.py; reloading"]
    assert errors(server) == [], server.log_text()
