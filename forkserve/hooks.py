"""Server hooks: functions of a Python module (``--hooks``) that forkserve calls at the moments
of its life, with gunicorn's names and signatures.

Owns: loading the module (a dotted name imported as the app is, or a ``.py`` file such as an
existing ``gunicorn.conf.py``), checking each hook's signature, the warnings about what the
module holds that is not a hook (a typo such as ``post_forks``; gunicorn settings such as
``bind`` that a hooks module does not apply), calling a hook with its failure contained and
logged, and the small objects passed to the hooks (``ServerInfo``, ``WorkerInfo``,
``RequestInfo``, ``ResponseInfo``, ``HookLog``). Where each hook is called is the arbiter's
and the worker's business; which process calls which is ``ARBITER_HOOKS``/``WORKER_HOOKS``.

Imports only the standard library and forkserve.logs (the arbiter, the workers and the cli
import this; it imports none of them).
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import os
import sys
import traceback
from types import ModuleType
from typing import TYPE_CHECKING, Any, Callable

from forkserve.logs import Log

# name -> the arguments it is called with (gunicorn's names and order).
HOOKS: dict[str, tuple[str, ...]] = {
    "on_starting": ("server",),
    "on_reload": ("server",),
    "when_ready": ("server",),
    "pre_fork": ("server", "worker"),
    "post_fork": ("server", "worker"),
    "post_worker_init": ("worker",),
    "worker_int": ("worker",),
    "worker_abort": ("worker",),
    "pre_exec": ("server",),
    "pre_request": ("worker", "req"),
    "post_request": ("worker", "req", "environ", "resp"),
    "child_exit": ("server", "worker"),
    "worker_exit": ("server", "worker"),
    "nworkers_changed": ("server", "new_value", "old_value"),
    "on_exit": ("server",),
}
ARBITER_HOOKS = frozenset({"on_starting", "on_reload", "when_ready", "pre_fork", "pre_exec",
                           "child_exit", "nworkers_changed", "on_exit"})
WORKER_HOOKS = frozenset(HOOKS) - ARBITER_HOOKS
# post_request may take 2, 3 or 4 arguments (gunicorn passes environ and resp only to a
# function that takes them).
POST_REQUEST_MIN = 2

# gunicorn's setting names (its config.py), the hooks above left out: a gunicorn.conf.py
# given as --hooks sets some of them (bind = ..., workers = ...), which are not applied here;
# its ssl_context and dirty-worker hooks have no counterpart (named in the same warning).
GUNICORN_SETTINGS = frozenset("""
    config wsgi_app bind backlog workers worker_class threads worker_connections max_requests
    max_requests_jitter timeout graceful_timeout keepalive limit_request_line
    limit_request_fields limit_request_field_size reload reload_engine reload_extra_files spew
    check_config print_config preload_app sendfile reuse_port chdir daemon raw_env pidfile
    worker_tmp_dir user group umask initgroups tmp_upload_dir secure_scheme_headers
    forwarded_allow_ips accesslog disable_redirect_access_to_syslog access_log_format errorlog
    loglevel capture_output logger_class logconfig logconfig_dict logconfig_json syslog_addr
    syslog syslog_prefix syslog_facility enable_stdio_inheritance statsd_host dogstatsd_tags
    statsd_prefix enable_backlog_metric proc_name default_proc_name pythonpath paste
    ssl_context proxy_protocol proxy_allow_ips protocol uwsgi_allow_ips keyfile certfile
    ssl_version cert_reqs ca_certs suppress_ragged_eofs do_handshake_on_connect ciphers
    http_protocols raw_paste_global_conf permit_obsolete_folding strip_header_spaces
    permit_unconventional_http_method permit_unconventional_http_version casefold_http_method
    forwarder_headers header_map root_path http2_cleartext http2_max_concurrent_streams
    http2_initial_window_size http2_max_frame_size http2_max_header_list_size asgi_loop
    asgi_lifespan asgi_disconnect_grace_period http_parser dirty_apps dirty_workers
    dirty_timeout dirty_threads dirty_graceful_timeout on_dirty_starting dirty_post_fork
    dirty_worker_init dirty_worker_exit control_socket control_socket_mode
    control_socket_disable
""".split())
# Names that look like a hook: a function so named that is not one is probably a typo.
HOOK_PREFIXES = ("on_", "pre_", "post_", "when_", "worker_", "child_", "nworkers")
FILE_MODULE = "__forkserve_hooks__"  # the module name a hooks file is loaded under


class HooksError(Exception):
    """The hooks module cannot be loaded: one line, exit code 4 (as an app that cannot be)."""


class Hooks:
    """The hook functions of one module; each attribute is the function or None. Calling
    one that is not defined is a None check (``pre_request``/``post_request`` are read once
    per worker into an attribute, so a request without hooks pays nothing)."""

    __slots__ = ("source", *HOOKS)
    if TYPE_CHECKING:  # (one attribute per name of HOOKS; set in __init__)
        on_starting: Callable[..., Any] | None
        on_reload: Callable[..., Any] | None
        when_ready: Callable[..., Any] | None
        pre_fork: Callable[..., Any] | None
        post_fork: Callable[..., Any] | None
        post_worker_init: Callable[..., Any] | None
        worker_int: Callable[..., Any] | None
        worker_abort: Callable[..., Any] | None
        pre_exec: Callable[..., Any] | None
        pre_request: Callable[..., Any] | None
        post_request: Callable[..., Any] | None
        child_exit: Callable[..., Any] | None
        worker_exit: Callable[..., Any] | None
        nworkers_changed: Callable[..., Any] | None
        on_exit: Callable[..., Any] | None

    def __init__(self, functions: dict[str, Callable[..., Any]] | None = None,
                 source: str | None = None) -> None:
        self.source = source
        for name in HOOKS:
            setattr(self, name, (functions or {}).get(name))

    def __bool__(self) -> bool:
        return any(getattr(self, name) is not None for name in HOOKS)

    def defined(self) -> list[str]:
        return [name for name in HOOKS if getattr(self, name) is not None]

    def call(self, name: str, log: Log, *args: Any) -> bool:
        """Run hook ``name`` if defined; a failure is one error record with its traceback,
        never raised (the arbiter, a request, an exit go on). False when it raised."""
        function = getattr(self, name)
        if function is None:
            return True
        try:
            function(*args)
        except (Exception, SystemExit) as exc:  # a hook's sys.exit() must not end us either
            log.exception(f"The {name} hook raised; carrying on", exc, hook=name)
            return False
        return True


# -- loading ----------------------------------------------------------------------------------

def load_hooks(spec: str | None, log: Log | None = None, start_dir: str | None = None) -> Hooks:
    """The hooks of ``spec``: a dotted module name (imported from the current directory, the
    app's --chdir, and sys.path) or the path of a ``.py`` file (relative to the current
    directory or, failing that, to ``start_dir``, where the server was started). Each load
    executes the module anew (a HUP picks up its changes). Warnings go to ``log``.
    Raises HooksError (one line)."""
    if not spec:
        return Hooks()
    here = os.getcwd()
    if here not in sys.path and "" not in sys.path:
        sys.path.insert(0, here)  # as load_app does: the app's directory
    if is_hooks_file(spec):
        module = _load_file(spec, start_dir)
    else:
        module = _load_module(spec)
    functions: dict[str, Callable[..., Any]] = {}
    for name in HOOKS:
        value = getattr(module, name, None)
        if value is None:
            continue
        if not callable(value):
            raise HooksError(f"hooks {spec}: {name} must be a function, got "
                             f"{type(value).__name__}")
        functions[name] = _checked(spec, name, value)
    if log is not None:
        _warn_about_the_rest(spec, module, log)
    return Hooks(functions, spec)


def is_hooks_file(spec: str) -> bool:
    return spec.endswith(".py") or os.sep in spec


def _load_file(spec: str, start_dir: str | None) -> ModuleType:
    candidates = [spec] if os.path.isabs(spec) else [
        os.path.join(d, spec) for d in dict.fromkeys([os.getcwd(), start_dir or os.getcwd()])]
    path = next((p for p in candidates if os.path.isfile(p)), None)
    if path is None:
        raise HooksError(f"hooks file {spec} not found (looked in "
                         f"{', '.join(os.path.dirname(os.path.abspath(p)) for p in candidates)})")
    loader_spec = importlib.util.spec_from_file_location(FILE_MODULE, path)
    if loader_spec is None or loader_spec.loader is None:
        raise HooksError(f"hooks file {spec} cannot be loaded as Python")
    module = importlib.util.module_from_spec(loader_spec)
    sys.modules[FILE_MODULE] = module  # (dataclasses and pickle look a module up by name)
    _execute(spec, module, loader_spec.loader.exec_module)
    return module


def _load_module(spec: str) -> ModuleType:
    if not all(part.isidentifier() for part in spec.split(".")):
        raise HooksError(f"hooks {spec!r}: expected a module (pkg.module) or a .py file")
    try:
        found = importlib.util.find_spec(spec)
    except (ImportError, ValueError) as exc:  # its package is missing, or fails to import
        raise HooksError(f"cannot import hooks module {spec!r}: {describe_failure(exc)}") from exc
    except Exception as exc:
        raise HooksError(f"cannot import hooks module {spec!r}: {describe_failure(exc)}") from exc
    if found is None or found.loader is None:
        raise HooksError(f"cannot import hooks module {spec!r} from {os.getcwd()}: no such "
                         "module (a file? give its path, e.g. --hooks gunicorn.conf.py)")
    # A fresh module object every time (a HUP re-executes it, with its changes); importlib's
    # reload would keep a hook the new version deleted.
    module = importlib.util.module_from_spec(found)
    sys.modules[spec] = module
    _execute(spec, module, found.loader.exec_module)
    return module


def _execute(spec: str, module: ModuleType, run: Callable[[ModuleType], None]) -> None:
    try:
        run(module)
    except SystemExit as exc:
        raise HooksError(f"hooks {spec} called sys.exit({exc.code!r}) while being "
                         "imported") from exc
    except BaseException as exc:
        if isinstance(exc, KeyboardInterrupt):
            raise
        raise HooksError(f"cannot import hooks {spec}: {describe_failure(exc)}") from exc


def describe_failure(exc: BaseException) -> str:
    """``SyntaxError: invalid syntax (hooks.py:3)``: the error and the hooks module's line."""
    text = str(exc).strip().splitlines()
    if isinstance(exc, SyntaxError) and exc.filename:
        where = f" ({_shown(exc.filename)}:{exc.lineno})"
        text = [exc.msg]
    else:
        frames = [f for f in traceback.extract_tb(exc.__traceback__)
                  if not f.filename.startswith("<frozen ")]
        where = f" ({_shown(frames[-1].filename)}:{frames[-1].lineno})" if frames else ""
    return f"{type(exc).__name__}: {text[0] if text else ''}{where}"


def _shown(path: str) -> str:
    relative = os.path.relpath(path)
    return path if relative.startswith(os.pardir) else relative


def _checked(spec: str, name: str, function: Callable[..., Any]) -> Callable[..., Any]:
    """The function, if it can take the hook's arguments (post_request: 2 to 4, as gunicorn
    allows, adapted to always take 4); else HooksError naming what it should take."""
    wanted = HOOKS[name]
    try:
        signature = inspect.signature(function)
    except (TypeError, ValueError):
        return function  # a builtin or such: it is called, and fails then if it must
    params = list(signature.parameters.values())
    variadic = any(p.kind is p.VAR_POSITIONAL for p in params)
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    required = [p for p in positional if p.default is p.empty]
    lowest = POST_REQUEST_MIN if name == "post_request" else len(wanted)
    takes = len(wanted) if variadic else min(len(positional), len(wanted))
    if len(required) > len(wanted) or takes < lowest:
        raise HooksError(f"hooks {spec}: {name} must take ({', '.join(wanted)}); "
                         f"it takes ({', '.join(p.name for p in params)})")
    if takes < len(wanted):  # post_request(worker, req) or (worker, req, environ)
        def adapted(*args: Any) -> Any:
            return function(*args[:takes])
        return adapted
    return function


def _warn_about_the_rest(spec: str, module: ModuleType, log: Log) -> None:
    """One warning naming the gunicorn settings the module sets (not applied), and one for
    each function that looks like a misspelt hook."""
    names = {k: v for k, v in vars(module).items() if not k.startswith("_")}
    settings = sorted(k for k in names if k in GUNICORN_SETTINGS
                      and not isinstance(names[k], ModuleType))
    if settings:
        log.warning(f"Hooks {spec} also sets gunicorn settings that --hooks does not apply: "
                    f"{', '.join(settings)}; move them into -c forkserve.yaml or command-line "
                    "flags", settings=",".join(settings))
    for key, value in names.items():
        if key in HOOKS or key in GUNICORN_SETTINGS or not inspect.isfunction(value) \
                or getattr(value, "__module__", None) != module.__name__:
            continue
        import difflib  # (only for a misspelt name)

        close = difflib.get_close_matches(key, HOOKS, n=1, cutoff=0.8)
        if close or key.startswith(HOOK_PREFIXES):
            hint = f" (did you mean {close[0]}?)" if close else ""
            log.warning(f"Hooks {spec}: {key} is not a hook name{hint}; it is never called",
                        function=key)


# -- what the hooks are given -------------------------------------------------------------------

_LEVELS = {"debug": 10, "info": 20, "warning": 30, "error": 40, "critical": 50}


class HookLog:
    """``server.log`` and ``worker.log``: logging.Logger's methods (``info(msg, *args)``,
    ``exception``...) writing to forkserve's error log, in its format."""

    __slots__ = ("_log",)

    def __init__(self, log: Log) -> None:
        self._log = log

    def log(self, level: int, msg: Any, *args: Any, **kwargs: Any) -> None:
        if not self._log.enabled(level):
            return
        text = str(msg) % args if args else str(msg)
        exc = sys.exc_info()[1] if kwargs.get("exc_info") else None
        if exc is not None:
            self._log.exception(text, exc)
        else:
            self._log.log(level, text, {})

    def debug(self, msg: Any, *args: Any, **kwargs: Any) -> None:
        self.log(10, msg, *args, **kwargs)

    def info(self, msg: Any, *args: Any, **kwargs: Any) -> None:
        self.log(20, msg, *args, **kwargs)

    def warning(self, msg: Any, *args: Any, **kwargs: Any) -> None:
        self.log(30, msg, *args, **kwargs)

    warn = warning

    def error(self, msg: Any, *args: Any, **kwargs: Any) -> None:
        self.log(40, msg, *args, **kwargs)

    def critical(self, msg: Any, *args: Any, **kwargs: Any) -> None:
        self.log(50, msg, *args, **kwargs)

    def exception(self, msg: Any, *args: Any, **kwargs: Any) -> None:
        self.log(40, msg, *args, exc_info=True)


class ServerInfo:
    """The ``server`` argument: the arbiter, as a hook may see it. In a worker (post_fork,
    worker_exit) it is the arbiter as it was when the worker was forked."""

    __slots__ = ("pid", "_config", "log")

    def __init__(self, pid: int, config: Callable[[], Any], log: HookLog) -> None:
        self.pid = pid
        self._config = config
        self.log = log

    @property
    def cfg(self) -> Any:
        """The resolved settings (``server.cfg.bind``, ``server.cfg.workers``...)."""
        return self._config()

    def cfg_getter(self) -> Callable[[], Any]:
        return self._config

    config = cfg

    @property
    def app(self) -> str:
        """The application spec (MODULE:APP); gunicorn passes its Application object."""
        return str(self._config().app)

    @property
    def num_workers(self) -> int:
        return int(self._config().worker_count)

    def __repr__(self) -> str:
        return f"<forkserve server pid={self.pid} app={self.app}>"


class WorkerInfo:
    """The ``worker`` argument. ``pid`` is None in pre_fork (not forked yet); ``age`` counts
    the workers this arbiter spawned (gunicorn's); ``worker_id`` is its slot (1..workers);
    ``wsgi`` the application once loaded (in the worker); ``exit_reason`` is set for
    child_exit (stopped, max_requests, timeout, killed, crashed, boot_failed)."""

    __slots__ = ("pid", "ppid", "age", "worker_id", "generation", "log", "_config", "wsgi",
                 "booted", "exit_reason", "exit_status")

    def __init__(self, age: int, worker_id: int, generation: int, ppid: int,
                 config: Callable[[], Any], log: HookLog) -> None:
        self.pid: int | None = None
        self.ppid = ppid
        self.age = age
        self.worker_id = worker_id
        self.generation = generation
        self._config = config
        self.log = log
        self.wsgi: Any = None
        self.booted = False
        self.exit_reason = ""
        self.exit_status = ""  # child_exit: "exited with code 0", "was killed by signal 9..."

    @property
    def cfg(self) -> Any:
        return self._config()

    config = cfg

    @property
    def number(self) -> int:
        return self.worker_id

    def __repr__(self) -> str:
        return f"<forkserve worker {self.worker_id} pid={self.pid} age={self.age}>"


class RequestInfo:
    """The ``req`` argument of pre_request and post_request (as gunicorn's Request: names
    in ``headers`` upper-case, ``version`` a tuple)."""

    __slots__ = ("method", "uri", "path", "query", "version", "headers", "remote_addr")

    def __init__(self, method: str, target: bytes, path: bytes, query: bytes, version: str,
                 headers: list[tuple[bytes, bytes]], remote_addr: str) -> None:
        self.method = method
        self.uri = target.decode("latin-1")
        self.path = path.decode("latin-1")
        self.query = query.decode("latin-1")
        major, _, minor = version.partition(".")
        self.version = (int(major or 1), int(minor or 0))
        self.headers = [(k.decode("latin-1").upper(), v.decode("latin-1")) for k, v in headers]
        self.remote_addr = remote_addr

    def __repr__(self) -> str:
        return f"<forkserve request {self.method} {self.uri}>"


class ResponseInfo:
    """The ``resp`` argument of post_request: what was answered (status 0 and no headers
    when nothing was: the client went away first)."""

    __slots__ = ("status", "status_code", "headers", "sent")

    def __init__(self, status: str | None, status_code: int, headers: list[tuple[str, str]],
                 sent: int) -> None:
        self.status = status or (str(status_code) if status_code else "")
        self.status_code = status_code
        self.headers = headers
        self.sent = sent  # body bytes sent

    @property
    def response_length(self) -> int:
        return self.sent

    def __repr__(self) -> str:
        return f"<forkserve response {self.status} {self.sent} bytes>"


__all__ = ["ARBITER_HOOKS", "HOOKS", "HookLog", "Hooks", "HooksError", "RequestInfo",
           "ResponseInfo", "ServerInfo", "WORKER_HOOKS", "WorkerInfo", "describe_failure", "load_hooks"]
