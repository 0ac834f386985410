"""gunicorn's spellings that are not forkserve settings (issue 15: moving from gunicorn).

Owns: gunicorn's command-line flags forkserve has no setting for, each with what forkserve
does instead, and whether it is *ignored* (it asks for nothing forkserve would not do anyway:
a warning, and the server starts) or *refused* (it asks for something forkserve does not do:
one line, exit 2); gunicorn's worker-class names; the default config file gunicorn would have
read. Flags that mean a forkserve setting are that setting's ``aliases`` in
:mod:`forkserve.config`, not here; docs/operations.md's migration table covers them all.

Pure data and small functions: imports only the standard library (forkserve.config builds
its parser from it).
"""

from __future__ import annotations

from dataclasses import dataclass

# The file gunicorn reads when it is given no -c (it looks in the directory it was started in).
GUNICORN_CONFIG = "gunicorn.conf.py"
# Parsed like the command line, below it (see forkserve.config.resolve for the precedence).
CMD_ARGS_ENV = "GUNICORN_CMD_ARGS"


@dataclass(frozen=True)
class GunicornOnly:
    flags: tuple[str, ...]
    setting: str  # gunicorn's name for it
    takes_value: bool
    hint: str  # what forkserve does instead, said in the warning or the error
    ignored: bool = False  # True: always a warning only
    # Values that ask for what forkserve always does (--header-map drop): a warning only;
    # any other value is refused.
    same: frozenset[str] = frozenset()


_ASGI = "forkserve is a WSGI server: serve an ASGI application with uvicorn or hypercorn"
_HTTP2 = ("forkserve speaks HTTP/1.1: terminate HTTP/2 in the proxy or load balancer in front "
          "of it")
_DIRTY = ("forkserve has no dirty-worker pool: run long jobs with forkserve.background.submit "
          "(a pool in each worker) or a task queue")
_STATSD = ("forkserve has no StatsD client: its status server serves Prometheus metrics "
           "(--status-bind HOST:PORT, then /metrics)")
_STRICT = "forkserve has no switch to relax its HTTP parser: such requests are refused"
_PASTE = ("forkserve loads no PasteDeploy file: name the application as MODULE:APP (a module "
          "of yours can call paste.deploy.loadapp)")

GUNICORN_ONLY: tuple[GunicornOnly, ...] = (
    # Worker Processes
    GunicornOnly(("--asgi-loop",), "asgi_loop", True, _ASGI),
    GunicornOnly(("--asgi-lifespan",), "asgi_lifespan", True, _ASGI),
    GunicornOnly(("--asgi-disconnect-grace-period",), "asgi_disconnect_grace_period", True, _ASGI),
    GunicornOnly(("--websocket-max-message-size",), "websocket_max_message_size", True, _ASGI),
    GunicornOnly(("--http-parser",), "http_parser", True,
                 "forkserve always parses HTTP with httptools", ignored=True),
    # Debugging
    GunicornOnly(("--reload-engine",), "reload_engine", True,
                 "forkserve's --reload always uses watchfiles (inotify; WATCHFILES_FORCE_POLLING=1 "
                 "polls instead)", ignored=True),
    GunicornOnly(("--spew",), "spew", False,
                 "forkserve has no line tracer: run it under python -m trace or a debugger"),
    # Server Mechanics
    GunicornOnly(("--no-sendfile",), "sendfile", False,
                 "forkserve has no switch to turn sendfile off (it sends wsgi.file_wrapper "
                 "files with it over plain HTTP)"),
    GunicornOnly(("-D", "--daemon"), "daemon", False,
                 "forkserve stays in the foreground: run it under systemd, a container or a "
                 "process supervisor"),
    GunicornOnly(("--worker-tmp-dir",), "worker_tmp_dir", True,
                 "forkserve's workers send their heartbeats through a pipe: there is no "
                 "temporary file", ignored=True),
    GunicornOnly(("--paste", "--paster"), "paste", True, _PASTE),
    GunicornOnly(("--paste-global",), "raw_paste_global_conf", True, _PASTE),
    GunicornOnly(("--proxy-allow-from",), "proxy_allow_ips", True,
                 "forkserve takes the PROXY header from the peers --forwarded-allow-ips trusts "
                 "(one list for both): give them there"),
    GunicornOnly(("--protocol",), "protocol", True,
                 "forkserve speaks HTTP only (no uwsgi protocol): point nginx at it with "
                 "proxy_pass", same=frozenset({"http"})),
    GunicornOnly(("--uwsgi-allow-from",), "uwsgi_allow_ips", True,
                 "forkserve speaks HTTP only (no uwsgi protocol): point nginx at it with "
                 "proxy_pass"),
    GunicornOnly(("--permit-obsolete-folding",), "permit_obsolete_folding", False, _STRICT),
    GunicornOnly(("--strip-header-spaces",), "strip_header_spaces", False, _STRICT),
    GunicornOnly(("--permit-unconventional-http-method",), "permit_unconventional_http_method",
                 False, _STRICT),
    GunicornOnly(("--permit-unconventional-http-version",), "permit_unconventional_http_version",
                 False, _STRICT),
    GunicornOnly(("--casefold-http-method",), "casefold_http_method", False, _STRICT),
    GunicornOnly(("--forwarder-headers",), "forwarder_headers", True,
                 "forkserve takes no SCRIPT_NAME, PATH_INFO or REMOTE_USER from request headers"),
    GunicornOnly(("--header-map",), "header_map", True,
                 "forkserve always drops header names with an underscore (gunicorn's drop)",
                 same=frozenset({"drop"})),
    GunicornOnly(("--root-path",), "root_path", True, _ASGI),
    # Logging (the rest of gunicorn's logging flags are forkserve settings or aliases)
    GunicornOnly(("--logger-class",), "logger_class", True,
                 "forkserve has no logger class: configure its loggers (forkserve.error and "
                 "forkserve.access) with --log-config FILE"),
    GunicornOnly(("-R", "--enable-stdio-inheritance"), "enable_stdio_inheritance", False,
                 "forkserve never daemonizes: its workers always inherit stdout and stderr",
                 ignored=True),
    GunicornOnly(("--statsd-host",), "statsd_host", True, _STATSD),
    GunicornOnly(("--dogstatsd-tags",), "dogstatsd_tags", True, _STATSD),
    GunicornOnly(("--statsd-prefix",), "statsd_prefix", True, _STATSD),
    GunicornOnly(("--enable-backlog-metric",), "enable_backlog_metric", False, _STATSD),
    # SSL
    GunicornOnly(("--ssl-version",), "ssl_version", True,
                 "forkserve negotiates TLS 1.2 or newer (gunicorn ignores this setting too, "
                 "since 21.0)", ignored=True),
    GunicornOnly(("--suppress-ragged-eofs",), "suppress_ragged_eofs", False,
                 "forkserve handles TLS end-of-file itself", ignored=True),
    GunicornOnly(("--do-handshake-on-connect",), "do_handshake_on_connect", False,
                 "forkserve runs the TLS handshake in the worker, under --header-timeout",
                 ignored=True),
    # HTTP/2
    GunicornOnly(("--http-protocols",), "http_protocols", True, _HTTP2, same=frozenset({"h1"})),
    GunicornOnly(("--http2-cleartext",), "http2_cleartext", True, _HTTP2,
                 same=frozenset({"off"})),
    GunicornOnly(("--http2-max-concurrent-streams",), "http2_max_concurrent_streams", True, _HTTP2),
    GunicornOnly(("--http2-initial-window-size",), "http2_initial_window_size", True, _HTTP2),
    GunicornOnly(("--http2-max-frame-size",), "http2_max_frame_size", True, _HTTP2),
    GunicornOnly(("--http2-max-header-list-size",), "http2_max_header_list_size", True, _HTTP2),
    # Dirty Arbiters
    GunicornOnly(("--dirty-app",), "dirty_apps", True, _DIRTY),
    GunicornOnly(("--dirty-workers",), "dirty_workers", True, _DIRTY),
    GunicornOnly(("--dirty-timeout",), "dirty_timeout", True, _DIRTY),
    GunicornOnly(("--dirty-threads",), "dirty_threads", True, _DIRTY),
    GunicornOnly(("--dirty-graceful-timeout",), "dirty_graceful_timeout", True, _DIRTY),
    # Control
    GunicornOnly(("--control-socket-mode",), "control_socket_mode", True,
                 "forkserve's control socket is always mode 0600",
                 same=frozenset({"600", "0600", "0o600", "384"})),
    GunicornOnly(("--no-control-socket",), "control_socket_disable", False,
                 "forkserve opens a control socket only when given --control-socket PATH",
                 ignored=True),
)


def judge(entry: GunicornOnly, flag: str, value: str | None) -> tuple[bool, str]:
    """(ignored, the one line to say) for ``flag`` (``value`` given with it, if it takes one)."""
    shown = flag if value is None else f"{flag} {value}"
    if entry.ignored or (value is not None and value.strip().lower() in entry.same):
        return True, f"gunicorn's {shown} is ignored: {entry.hint}"
    return False, f"{shown}: gunicorn's {entry.setting} setting has no equivalent here: {entry.hint}"


# -- worker classes ------------------------------------------------------------------------------
# gunicorn's names (-k gthread, the class paths, the egg: form) for the workers forkserve has.
WORKER_CLASSES = {
    "sync": "sync", "thread": "thread", "gevent": "gevent",
    "gthread": "thread",
    "gevent_wsgi": "gevent", "gevent_pywsgi": "gevent",  # gevent's own pywsgi: still gevent
    "gunicorn.workers.sync.syncworker": "sync",
    "gunicorn.workers.gthread.threadworker": "thread",
    "gunicorn.workers.ggevent.geventworker": "gevent",
    "gunicorn.workers.ggevent.geventpywsgiworker": "gevent",
}
_OFFERED = "forkserve's workers are sync, thread (gunicorn's gthread) and gevent"


def worker_class(value: str) -> str:
    """forkserve's worker class for a -k value; ValueError, saying what to use instead, for
    one forkserve does not have."""
    text = value.strip().lower()
    name = text.removeprefix("egg:gunicorn#")
    if name in WORKER_CLASSES:
        return WORKER_CLASSES[name]
    if "eventlet" in name:
        raise ValueError(f"forkserve has no eventlet worker: use -k gevent (greenlets, "
                         f"many connections each) or -k thread; {_OFFERED}")
    if "tornado" in name:
        raise ValueError(f"forkserve has no tornado worker: it serves WSGI applications (a "
                         f"Tornado application runs on Tornado's own server); {_OFFERED}")
    if "uvicorn" in name or "asgi" in name:
        raise ValueError(f"{value.strip()} runs ASGI applications: {_ASGI}; {_OFFERED}")
    raise ValueError(f"must be sync, thread or gevent (gunicorn's gthread is thread); got {value!r}")


# -- configuration files -------------------------------------------------------------------------

def python_config(path: str) -> str | None:
    """What --hooks would take for a gunicorn Python config given where forkserve expects
    its YAML file (``gunicorn.conf.py``, ``python:mod.conf``, ``file:conf.py``); None when
    ``path`` is not one."""
    if path.startswith("python:"):
        return path[len("python:"):]
    if path.startswith("file:"):
        return path[len("file:"):]
    if path.endswith(".py"):
        return path
    return None


def python_config_advice(hooks: str) -> str:
    return (f"forkserve reads no Python configuration: put its settings in a YAML file "
            f"(-c forkserve.yaml) or in flags, and use its server hooks with --hooks {hooks}")
