"""Development reload (``--reload``): which files to watch, which changes count, and the thread
that watches them for the arbiter.

Owns: the watch plan (directories and files, found without importing the application), the
filter (``*.py`` and the ``--reload-include`` globs, less the excludes), and the watcher thread,
which hands batches of changed paths to the arbiter's loop through a pipe the loop polls. The
arbiter decides what a change does (a HUP, debounced). Imports only the standard library;
watchfiles (the optional ``reload`` extra) only when a watcher starts.

Why the arbiter watches directories, not each worker its ``sys.modules`` (gunicorn's reloader
is a thread in every worker that watches the files of the modules it imported):

- A worker whose import failed (the syntax error just typed) has no modules to report and no
  thread left: nothing would see the edit that fixes it (gunicorn special-cases the
  SyntaxError's file). The arbiter's watcher does not depend on the application importing.
- A change is then a HUP, which the arbiter owns: the new workers boot before the old ones
  drain, so no request is lost, and a new generation that fails to boot is rolled back while
  the old one serves. A worker that notices a change can only exit (gunicorn's do), and the
  requests queued meanwhile wait for its replacement to import the application.
- One watcher (one inotify instance, one thread) instead of one per worker, and no thread of
  ours inside the application's processes (gevent's patching, fork-unsafe libraries).

The cost: a module imported from outside the watched directories (a library installed
elsewhere in editable mode) is not seen unless named with ``--reload-extra-file``; and
a big directory tree is watched in full (excluded directories too: the filter drops their
events, inotify still watches them).

# -- runs in the watcher thread ---------------------------------------------------------------
Only :meth:`Watcher._watch` (and the filter it calls): watchfiles' loop, with every signal
blocked in this thread and so in the Rust thread it starts, so that signals keep reaching the
loop thread's handlers (and an upgrade's block of the arbiter's signals across ``execve`` cannot
be bypassed through another thread). It puts reports in a queue and writes one byte on a pipe;
no logging, no state of the arbiter's.
"""

from __future__ import annotations

import importlib.machinery
import os
import queue
import signal
import threading
from dataclasses import dataclass
from fnmatch import fnmatchcase
from typing import Any, Iterable, Sequence

# What counts by default: Python source. --reload-include adds to it (templates, *.yaml...).
DEFAULT_INCLUDES = ("*.py",)
# Matched against every part of a path below a watched directory: version control, bytecode
# (the workers write it as they import: never a reason to reload), virtualenvs and caches,
# other languages' dependency trees, and editors' swap, backup and lock files.
DEFAULT_EXCLUDES = (".git", ".hg", ".svn", "__pycache__", ".venv", "venv", ".tox", ".nox",
                    ".mypy_cache", ".pytest_cache", ".hypothesis", "node_modules",
                    "site-packages", "*.pyc", "*.pyo", "*.swp", "*.swo", "*.swx", "*~", ".#*",
                    "#*#")
# watchfiles' loop: it groups events until none arrived for STEP_MS (the arbiter debounces
# again, longer: see forkserve.arbiter.codereload), and returns every TIMEOUT_MS without
# changes; its first return tells that the watches are in place.
STEP_MS = 50
TIMEOUT_MS = 500
STOP_WAIT = 2.0  # seconds a stop waits for the thread (it sees the stop within STEP_MS)


@dataclass(frozen=True)
class WatchPlan:
    roots: tuple[str, ...]  # directories whose files count when the globs say so
    extra: tuple[str, ...]  # --reload-extra-file: files (or directories) that always count
    watched: tuple[str, ...]  # what watchfiles watches (recursively)
    missing: tuple[str, ...] = ()  # extra files whose directory does not exist: not watched


def watch_plan(app: str, cwd: str, extra_files: Iterable[str],
               search_path: Sequence[str]) -> WatchPlan:
    """What to watch for ``app`` (MODULE:NAME) served from ``cwd`` (the --chdir directory):
    ``cwd`` itself (unless it is ``/``), where the application's top-level package lives if
    that is elsewhere (found as an import would find it, from ``cwd`` first, but without
    importing anything), and the extra files. A file outside those is watched through its
    directory: editors save by writing a new file and renaming it over the old one, which ends
    a watch on the file itself."""
    roots: list[str] = [] if cwd == os.sep else [cwd]
    top = app.partition(":")[0].partition(".")[0]
    try:
        spec = importlib.machinery.PathFinder.find_spec(top, [cwd, *search_path])
    except (ImportError, ValueError, OSError):
        spec = None  # not found from here: the workers will say why; cwd is still watched
    if spec is not None:
        if spec.submodule_search_locations:  # a package (a namespace package: each part)
            roots.extend(os.path.abspath(p) for p in spec.submodule_search_locations)
        elif spec.origin and os.path.isfile(spec.origin):
            roots.append(os.path.dirname(os.path.abspath(spec.origin)))
    roots = _outermost(roots)
    extra = tuple(dict.fromkeys(os.path.abspath(os.path.join(cwd, f)) for f in extra_files))
    watched, missing = list(roots), []
    for path in extra:
        if _below_any(path, roots):
            continue
        where = path if os.path.isdir(path) else os.path.dirname(path)
        if os.path.isdir(where):
            watched.append(where)  # (a file not there yet is seen when it is created)
        else:
            missing.append(path)
    return WatchPlan(tuple(roots), extra, tuple(_outermost(watched)), tuple(missing))


def _below_any(path: str, directories: Iterable[str]) -> bool:
    return any(path == d or path.startswith(d.rstrip(os.sep) + os.sep) for d in directories)


def _outermost(paths: Iterable[str]) -> list[str]:
    """Each path once, less those inside another one (watched recursively already)."""
    unique = list(dict.fromkeys(paths))
    return [p for p in unique if not _below_any(p, [q for q in unique if q != p])]


class ChangeFilter:
    """Does a change of ``path`` count? An extra file: always; a path in an extra directory
    or below a root: unless a part of it matches an exclude; below a root it must also match
    an include (its name, or its path relative to the root). The user's excludes add to the
    defaults; a default exclude the user includes by name (``--reload-include '*.pyc'``) is
    dropped."""

    def __init__(self, plan: WatchPlan, includes: Iterable[str] = (),
                 excludes: Iterable[str] = ()) -> None:
        self.roots = [r.rstrip(os.sep) + os.sep for r in plan.roots]
        self.extra = plan.extra
        self.includes = tuple(dict.fromkeys((*DEFAULT_INCLUDES, *includes)))
        self.excludes = tuple(dict.fromkeys(
            (*(e for e in DEFAULT_EXCLUDES if e not in self.includes), *excludes)))

    def __call__(self, change: Any, path: str) -> bool:  # watchfiles' watch_filter
        return self.counts(path)

    def counts(self, path: str) -> bool:
        for extra in self.extra:
            if path == extra:
                return True
            if path.startswith(extra + os.sep):
                return not self.excluded(path[len(extra) + 1:])
        for root in self.roots:
            if path.startswith(root):
                relative = path[len(root):]
                if self.excluded(relative):
                    return False
                name = os.path.basename(relative)
                return any(fnmatchcase(name, g) or fnmatchcase(relative, g) for g in self.includes)
        return False

    def excluded(self, relative: str) -> bool:
        parts = relative.split(os.sep)
        return any(fnmatchcase(part, g) for g in self.excludes for part in parts) or \
            any(fnmatchcase(relative, g) for g in self.excludes)


@dataclass(frozen=True)
class Report:
    """What the watcher tells the loop: ``watching`` (the watches are in place), ``changed``
    (``paths``, a batch), or ``failed`` (``error``: the watcher stopped)."""

    kind: str
    paths: tuple[str, ...] = ()
    error: str = ""


class Watcher:
    """watchfiles in a daemon thread; the loop polls :attr:`read_fd` and calls :meth:`take`."""

    def __init__(self, plan: WatchPlan, accepts: ChangeFilter) -> None:
        # Imported here, in the loop thread, with what the watcher thread would otherwise
        # import itself (watchfiles' WSL check imports platform): a fork while another thread
        # imports leaves that module's import lock held in the child for ever, and a worker
        # that imports it then hangs at boot (a gevent worker did, patching the standard
        # library). The filter's patterns are compiled here too.
        import platform
        import watchfiles

        self._watchfiles = watchfiles
        self._platform = platform  # (kept: imported for the thread, see above)
        accepts.counts(os.path.join(plan.roots[0] if plan.roots else os.sep, "x.py"))
        self.plan = plan
        self.accepts = accepts
        self.read_fd, self._write_fd = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._reports: queue.SimpleQueue[Report] = queue.SimpleQueue()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="forkserve-reload", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def fds(self) -> list[int]:
        """Its pipe (a worker closes them; the watches themselves are close-on-exec)."""
        return [self.read_fd, self._write_fd]

    def take(self) -> list[Report]:
        """Everything reported so far (the loop thread only)."""
        while True:
            try:
                if not os.read(self.read_fd, 512):
                    break
            except BlockingIOError:
                break
        reports = []
        while True:
            try:
                reports.append(self._reports.get_nowait())
            except queue.Empty:
                return reports

    def stop(self) -> bool:
        """Stop the thread; its pipe is closed once it is gone (True), never under it."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(STOP_WAIT)
        if self._thread.is_alive():
            return False  # a daemon thread: it does not hold up the exit
        for fd in self.fds():
            os.close(fd)
        return True

    # -- runs in the watcher thread -----------------------------------------------------------
    def _watch(self) -> None:
        signal.pthread_sigmask(signal.SIG_BLOCK, signal.valid_signals())
        try:
            first = True
            for changes in self._watchfiles.watch(
                    *self.plan.watched, watch_filter=self.accepts, step=STEP_MS,
                    rust_timeout=TIMEOUT_MS, yield_on_timeout=True, stop_event=self._stop,
                    raise_interrupt=False, ignore_permission_denied=True):
                if first:
                    first = False
                    self._post(Report("watching"))
                if changes:
                    self._post(Report("changed", tuple(sorted({path for _, path in changes}))))
        except Exception as exc:  # a watched directory gone, inotify's limits: told, not raised
            self._post(Report("failed", error=f"{type(exc).__name__}: {exc}"))

    def _post(self, report: Report) -> None:
        self._reports.put(report)
        try:
            os.write(self._write_fd, b"!")
        except BlockingIOError:
            return  # the pipe is full of wake-ups already: the loop will take the queue


__all__ = ["ChangeFilter", "DEFAULT_EXCLUDES", "DEFAULT_INCLUDES", "Report", "WatchPlan",
           "Watcher", "watch_plan"]
