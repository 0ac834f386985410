"""The settings registry: every setting declared once.

Owns: each setting's name, type, default, command-line flags, ``FORKSERVE_*`` environment
name, YAML key, validation, whether HUP reloads it, and help text. Argparse and ``--help``
are generated from it. Precedence: defaults < YAML file < environment < command line; every
value records where it came from.

Imports only the standard library and yaml (never the arbiter, workers or http).
"""

from __future__ import annotations

import argparse
import grp
import importlib.util
import ipaddress
import json
import os
import pwd
import re
import socket
import shlex
import string
import sys
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Sequence


from forkserve import gunicorn_flags
from forkserve.machine import usable_cpus

ENV_PREFIX = "FORKSERVE_"


class ConfigError(Exception):
    """A bad setting, file or option: reported as one line, exit code 2."""


# -- value parsers (each takes a str, or an already-typed YAML value) -------------------------

def _int(minimum: int) -> Callable[[Any], int]:
    def parse(value: Any) -> int:
        if isinstance(value, bool):
            raise ValueError(f"expected a whole number, got {value!r}")
        try:
            number = int(value)
        except (TypeError, ValueError):
            raise ValueError(f"expected a whole number, got {value!r}") from None
        if number < minimum:
            raise ValueError(f"must be at least {minimum}, got {number}")
        return number

    return parse


def _seconds(value: Any) -> float:
    if isinstance(value, bool):
        raise ValueError(f"expected a number of seconds, got {value!r}")
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"expected a number of seconds, got {value!r}") from None
    if not 0 <= number < float("inf"):  # also refuses nan
        raise ValueError(f"must be a finite number of seconds, zero or more; got {value!r}")
    return number


def _bool(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(f"expected true or false, got {value!r}")


def _choice(*choices: str) -> Callable[[Any], str]:
    def parse(value: Any) -> str:
        text = str(value).strip().lower()
        if text not in choices:
            raise ValueError(f"must be one of {', '.join(choices)}; got {value!r}")
        return text

    return parse


def _text(value: Any) -> str:
    if not isinstance(value, (str, int, float)) or isinstance(value, bool):
        raise ValueError(f"expected text, got {value!r}")
    return str(value)


def _optional_text(value: Any) -> str | None:
    if value is None:
        return None
    return _text(value)


def _worker_class(value: Any) -> str:
    """sync, thread or gevent, under forkserve's names or gunicorn's (-k gthread)."""
    return gunicorn_flags.worker_class(_text(value))


def _cert_reqs(value: Any) -> str:
    """none, optional or required; or gunicorn's numbers for them (ssl.CERT_NONE is 0...)."""
    text = str(value).strip().lower()
    numbers = {"0": "none", "1": "optional", "2": "required"}
    return numbers[text] if text in numbers else _choice("none", "optional", "required")(text)


def _env_pairs(value: Any) -> dict[str, str]:
    """-e KEY=VALUE (repeatable), a YAML mapping or list of KEY=VALUE, or FORKSERVE_ENV: pairs
    split as a shell would (FORKSERVE_ENV='A=1 "GREETING=hello world"')."""
    if isinstance(value, dict):
        items = [f"{k}={'' if v is None else v}" for k, v in value.items()]
    elif isinstance(value, list):
        items = [_text(item) for item in value]
    else:
        try:
            items = shlex.split(_text(value))
        except ValueError as exc:
            raise ValueError(f"cannot split {value!r}: {exc}") from None
    pairs = {}
    for item in items:
        key, sep, val = item.partition("=")
        if not sep or not key or key != key.strip() or "\0" in item:
            raise ValueError(f"expected KEY=VALUE, got {item!r}")
        pairs[key] = val
    return pairs


def _paths(value: Any) -> list[str]:
    """Directories, comma-separated (gunicorn's --pythonpath) or a YAML list."""
    items = value if isinstance(value, list) else _text(value).split(",")
    return [p for p in (_text(item).strip() for item in items) if p]


def _bind(value: Any) -> str:
    text = _text(value).strip()
    if text.startswith("unix:"):
        if len(text) == 5:
            raise ValueError("unix: needs a path, e.g. unix:/run/app.sock")
        return text
    if text.startswith("fd://"):
        _int(0)(text[5:])
        return text
    host, sep, port = text.rpartition(":")
    if not sep:
        host, port = text, "8000"
    if host.startswith("["):
        if not host.endswith("]"):
            raise ValueError(f"bad IPv6 address in {text!r}: use [::1]:PORT")
    try:
        number = int(port)
    except ValueError:
        raise ValueError(f"bad port in {text!r}") from None
    if not 0 <= number <= 65535:
        raise ValueError(f"port out of range in {text!r}")
    return f"{host or '0.0.0.0'}:{number}"


# logging.handlers.SysLogHandler.facility_names (config imports no logging).
SYSLOG_FACILITIES = ("auth", "authpriv", "cron", "daemon", "ftp", "kern", "lpr", "mail", "news",
                     "security", "syslog", "user", "uucp", *(f"local{n}" for n in range(8)))


def _syslog_to(value: Any) -> str:
    text = _text(value).strip()
    scheme, sep, rest = text.partition("://")
    if not sep or scheme not in ("unix", "udp", "tcp") or not rest:
        raise ValueError(f"expected unix://PATH, udp://HOST:PORT or tcp://HOST:PORT; got {text!r}")
    if scheme != "unix":
        host, _, port = rest.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"expected {scheme}://HOST:PORT; got {text!r}")
    return text


def read_log_config(path: str) -> dict[str, Any]:
    """--log-config: a logging dictConfig in JSON (``.json``, or text starting with ``{``) or
    YAML; ValueError with one readable sentence."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as exc:
        raise ValueError(exc.strerror or str(exc)) from None
    if path.endswith((".ini", ".conf", ".cfg")) and re.search(r"^\[loggers\]", text, re.M):
        return _ini_log_config(path, text)
    as_json = path.endswith(".json") or (not path.endswith((".yaml", ".yml"))
                                         and text.lstrip().startswith("{"))
    import yaml  # (here, not at the top: a server that reads no YAML maps none of it)

    try:
        data = json.loads(text) if as_json else yaml.safe_load(text)
    except ValueError as exc:  # json.JSONDecodeError
        raise ValueError(f"not valid JSON: {exc}") from None
    except Exception as exc:  # yaml.YAMLError
        raise ValueError(f"not valid YAML: {' '.join(str(exc).split())}") from None
    if not isinstance(data, dict):  # (what dictConfig itself would say is less clear)
        raise ValueError("expected a mapping (a logging dictConfig with version: 1)")
    if data.get("version") != 1:
        raise ValueError("a logging dictConfig needs version: 1")
    return dict(data)


def _ini_log_config(path: str, text: str) -> dict[str, Any]:
    """gunicorn's --log-config file: logging.config.fileConfig's INI. Kept as the path (the
    logging set-up applies it with fileConfig) and the loggers it names (by qualname)."""
    import configparser  # (only for an INI --log-config)

    parser = configparser.ConfigParser(interpolation=None)
    try:
        parser.read_string(text, path)
        keys = [k.strip() for k in parser.get("loggers", "keys").split(",") if k.strip()]
        names: dict[str, Any] = {parser.get(f"logger_{k}", "qualname", fallback=k): {}
                                 for k in keys if k != "root"}
    except configparser.Error as exc:
        raise ValueError(f"not a valid logging INI file: {' '.join(str(exc).split())}") from None
    return {"version": 1, "ini_file": path, "loggers": names}


def _status_bind(value: Any) -> str | None:
    if value is None or value == "":
        return None
    text = _bind(value)
    if text.startswith(("unix:", "fd://")):
        raise ValueError(f"the status server takes HOST:PORT, got {text!r}")
    return text


# A header as an access-log field: {req_NAME} (request) or {resp_NAME} (response), NAME a
# header name in any case (forkserve.telemetry.accesslog has the same pattern).
ACCESS_LOG_HEADER = re.compile(r"(req|resp)_([A-Za-z0-9!#$%&'*+.^_`|~-]+)\Z")
# gunicorn's access-log atoms (its --access-logformat): %(h)s and the like, %({name}i)s a
# request header, %({name}o)s a response header, %({name}e)s an environ variable.
ACCESS_LOG_ATOMS = {
    "h": "remote address", "l": "-", "u": "user name (Basic auth)", "t": "[time] (Apache's)",
    "r": "request line", "s": "status", "m": "method", "U": "path", "q": "query string",
    "H": "protocol", "b": "body bytes, or -", "B": "body bytes", "f": "referer", "a": "user agent",
    "T": "duration (s)", "D": "duration (us)", "M": "duration (ms)", "L": "duration (s, decimal)",
    "p": "<pid>",
}
_ATOM = re.compile(r"%\(([^)]*)\)")
_NUMBER_ATOMS = frozenset("sBTDM")


def _access_log_format(value: Any) -> str:
    text = _text(value)
    lowered = text.strip().lower()
    if lowered in ("combined", "json"):
        return lowered
    if lowered.startswith("json:"):
        names = [n.strip() for n in text.strip()[5:].split(",") if n.strip()]
        bad = [n for n in names if not ACCESS_LOG_HEADER.match(n)]
        if bad or not names:
            raise ValueError(f"json:FIELDS takes header fields (req_NAME, resp_NAME), comma-"
                             f"separated; got {', '.join(bad) or '(none)'}")
        return "json:" + ",".join(names)
    if "%(" in text:
        return _gunicorn_format(text)
    if "{" not in text:
        raise ValueError(f"expected combined, json, a template with {{fields}} or gunicorn "
                         f"%(atoms)s; got {text!r}")
    try:
        names = [name for _, name, _, _ in string.Formatter().parse(text) if name is not None]
    except ValueError as exc:
        raise ValueError(f"bad access-log template {text!r}: {exc}") from None
    unknown = sorted({n for n in names if n not in ACCESS_LOG_FIELDS
                      and not ACCESS_LOG_HEADER.match(n)})
    if unknown or not names:
        raise ValueError(f"unknown field(s) {', '.join(unknown) or '(none given)'} in the "
                         f"access-log template; fields: {', '.join(ACCESS_LOG_FIELDS)}, and "
                         "req_HEADER / resp_HEADER")
    # A format spec or conversion that does not fit a field's type ({path:d}) would fail
    # on every request: try it now on values of the real types.
    sample = {name: 0 if name in ACCESS_LOG_NUMBERS else "-" for name in names}
    try:
        text.format_map(sample)
    except (ValueError, TypeError, KeyError, IndexError, AttributeError) as exc:
        raise ValueError(f"bad access-log template {text!r}: {exc}") from None
    return text


def _gunicorn_format(text: str) -> str:
    """gunicorn's atom format, checked: known atoms, and a %-format that works on them."""
    keys = _ATOM.findall(text)
    unknown = sorted({k for k in keys if k not in ACCESS_LOG_ATOMS and not (
        len(k) > 3 and k[0] == "{" and k[-2] == "}" and k[-1] in "ioe")})
    if unknown:
        raise ValueError(f"unknown atom(s) {', '.join(unknown)} in the access-log format; "
                         f"atoms: {', '.join(ACCESS_LOG_ATOMS)}, {{header}}i, {{header}}o, "
                         "{variable}e")
    sample = {k: 0 if k in _NUMBER_ATOMS else "-" for k in keys}
    try:
        text % sample
    except (ValueError, TypeError, KeyError) as exc:
        raise ValueError(f"bad access-log format {text!r}: {exc}") from None
    return text


ACCESS_LOG_NUMBERS = frozenset(("status", "bytes", "duration_us", "pid"))  # ints; the rest are text
# What an access-log template (and the json format) can name: forkserve.telemetry.accesslog
# fills exactly these.
ACCESS_LOG_FIELDS = {
    "time": "request start, as Apache's day/Mon/year:H:M:S +0000",
    "time_iso": "request start, ISO 8601 UTC with milliseconds",
    "remote_addr": "the client's address",
    "method": "request method",
    "path": "request path, as sent (still %-encoded)",
    "query": "query string, without the ?",
    "target": "the whole request target (path?query)",
    "protocol": "HTTP/1.1 or HTTP/1.0",
    "status": "response status",
    "bytes": "response body bytes sent",
    "duration_us": "microseconds from the request head to the end of the response",
    "duration": "the same in seconds",
    "referer": "Referer header, or -",
    "user_agent": "User-Agent header, or -",
    "request_id": "X-Request-ID from the request, or one generated for it",
    "pid": "the worker's process id",
}


def _binds(value: Any) -> list[str]:
    items = value if isinstance(value, list) else [value]
    if not items:
        raise ValueError("at least one address is needed")
    return [_bind(item) for item in items]


def _text_list(value: Any) -> list[str]:
    items = value if isinstance(value, list) else [value]
    return [_text(item) for item in items]


def _pids(value: Any) -> list[int]:
    items = value if isinstance(value, list) else str(value).replace(",", " ").split()
    return [_int(1)(item) for item in items]


def _allow_list(value: Any) -> list[str]:
    """Addresses, CIDR networks or ``*``, comma- or space-separated (or a YAML list); each
    checked here, so a typo is one clear line at start-up (forkserve.proxy applies them)."""
    items = value if isinstance(value, list) else str(value).replace(",", " ").split()
    out = []
    for item in (str(i).strip() for i in items):
        if not item:
            continue
        if item != "*":
            try:
                ipaddress.ip_network(item.strip("[]"), strict=False)
            except ValueError:
                raise ValueError(f"expected IP addresses or CIDR networks (or *), "
                                 f"got {item!r}") from None
        out.append(item)
    return out


def _account(lookup: Callable[[str], Any], what: str) -> Callable[[Any], str]:
    """A user or group: a name, which must exist, or a number, which need not (containers
    often run as a uid no /etc/passwd names)."""
    def parse(value: Any) -> str:
        text = _text(value).strip()
        if not text.isdigit():
            try:
                lookup(text)
            except KeyError:
                raise ValueError(f"no such {what}: {text!r}") from None
        return text
    return parse


_user = _account(pwd.getpwnam, "user")
_group = _account(grp.getgrnam, "group")


def _octal(value: Any) -> int:
    """A file mode or umask: octal text (``027``, ``0o660``), or a YAML number (``0o27``)."""
    if isinstance(value, int) and not isinstance(value, bool):
        number = value
    else:
        text = str(value).strip().lower().removeprefix("0o")
        try:
            number = int(text, 8)
        except ValueError:
            raise ValueError(f"expected an octal mode such as 027 or 660, got {value!r}") from None
    if not 0 <= number <= 0o777:
        raise ValueError(f"expected an octal mode from 0 to 777, got {value!r}")
    return number


def _app(value: Any) -> str:
    text = _text(value).strip()
    module = text.partition(":")[0]
    if _is_file_path(module):
        return text  # refused by resolve(), which knows the --chdir to spell the module from
    if not module or not all(part.isidentifier() for part in module.split(".")):
        raise ValueError(f"expected MODULE:APP (e.g. myapp:wsgi), got {text!r}")
    return text


def _is_file_path(module: str) -> bool:
    """``mysite/wsgi.py``, ``./app.py``, ``app.py``: a file given where a module is expected
    (a submodule named ``py`` is not worth the confusion)."""
    return "/" in module or module.endswith(".py")


def _module_spelling(spec: str, chdir: str | None) -> str:
    """What to write instead of a file path: ``try --chdir mysite mysite.wsgi`` for
    ``mysite/mysite/wsgi.py`` (the packages, directories with an ``__init__.py``, are part of
    the module's name; the first directory above them is the one to import from)."""
    module, colon, attr = spec.partition(":")
    start = os.getcwd()
    base = os.path.normpath(os.path.join(start, chdir)) if chdir else start
    bare = module.rstrip("/")
    bare = bare[:-3] if bare.endswith(".py") else bare
    # Loaded from the --chdir directory; a path typed from where the server was started is
    # understood too.
    roots = [base, start] if base != start else [base]
    full = next((p for p in (os.path.normpath(os.path.join(r, bare)) for r in roots)
                 if os.path.isfile(p + ".py") or os.path.isdir(p)),
                os.path.normpath(os.path.join(base, bare)))
    directory, name = os.path.split(full)
    if name == "__init__":  # mysite/__init__.py: the package itself
        directory, name = os.path.split(directory)
    parts = [name]
    while os.path.isfile(os.path.join(directory, "__init__.py")):
        directory, package = os.path.split(directory)
        parts.insert(0, package)
    dotted = ".".join(parts)
    refused = f"{spec!r} is a file path, not a module"
    if not all(part.isidentifier() for part in parts):
        return f"{refused}, and {dotted!r} cannot be imported under that name"
    where = "" if directory == base else (
        f"--chdir {directory if os.path.isabs(module) else os.path.relpath(directory, start)} ")
    return f"{refused}: try {where}{dotted}{colon}{attr}"


@dataclass(frozen=True)
class Setting:
    name: str
    parse: Callable[[Any], Any]
    default: Any
    help: str
    flags: tuple[str, ...] = ()
    metavar: str | None = None
    reloadable: bool = True  # does HUP apply a changed value?
    repeatable: bool = False  # -b a -b b
    flag: bool = False  # takes no argument on the command line
    aliases: tuple[str, ...] = ()  # extra command-line spellings (--graceful-timeout)
    several: bool = False  # takes one or more values after one flag (-sf PID PID)
    env_aliases: tuple[str, ...] = ()  # other servers' variables honoured too, below ours
    secret: bool = False  # no command-line flag (ps shows argv): the environment or the file only

    @property
    def env(self) -> str:
        return ENV_PREFIX + self.name.upper()


SETTINGS: tuple[Setting, ...] = (
    Setting("app", _app, None, "the WSGI application, MODULE:NAME or MODULE:factory(...)",
            metavar="MODULE:APP"),
    Setting("config", _optional_text, None, "YAML file of settings (keys as in --help, with _)",
            flags=("-c", "--config"), metavar="FILE.yaml", reloadable=False),
    # -- hooks (issue 15)
    Setting("hooks", _optional_text, None,
            "server hooks: a Python module (pkg.module, imported as the app is) or a .py file "
            "(an existing gunicorn.conf.py works: its hook functions are used, its settings "
            "are not) defining on_starting, when_ready, pre_fork, post_fork, post_worker_init, "
            "pre_request, post_request, worker_exit, child_exit, on_reload, on_exit... with "
            "gunicorn's names and arguments; HUP imports it anew",
            flags=("--hooks",), metavar="MODULE_OR_FILE"),
    Setting("bind", _binds, ["127.0.0.1:8000"],
            "address to listen on: HOST:PORT, [::1]:PORT, unix:PATH or fd://N (repeatable)",
            flags=("-b", "--bind"), metavar="ADDRESS", repeatable=True, reloadable=False),
    Setting("workers", _int(1), None,
            "number of worker processes (default: $WEB_CONCURRENCY, else the CPUs this process "
            "may use: its affinity and its cgroup's CPU quota, the smaller)",
            flags=("-w", "--workers"), metavar="N"),
    Setting("worker_class", _worker_class, "sync",
            "worker type: sync (one connection at a time), thread (a pool of --threads request "
            "threads) or gevent (greenlets, many connections each; pip install 'forkserve[gevent]'); "
            "--threads N > 1 alone chooses thread, as gunicorn does; gunicorn's gthread and "
            "worker class paths are understood",
            flags=("-k", "--worker-class"), metavar="CLASS"),
    Setting("threads", _int(1), 4,
            "thread worker: request threads per worker (idle keep-alive connections wait in its "
            "poller, not in a thread)",
            flags=("--threads",), metavar="N"),
    Setting("cpu_affinity", _bool, False,
            "pin each worker process to one CPU of those the server may run on (worker 1 to "
            "the first, worker 2 to the next, round the set again when there are more "
            "workers): a thread worker's threads, which take turns at Python's GIL, then "
            "hand it over on one CPU instead of across two (measured: about a third more requests a "
            "second at keep-alive c=50 on 2 cores); a process then never uses a second CPU, "
            "even for work that releases the GIL; Linux only",
            flags=("--cpu-affinity",), flag=True),
    Setting("sched_batch", _bool, False,
            "run each worker under Linux's SCHED_BATCH scheduling policy, in which a thread "
            "that wakes does not preempt the one running: a thread worker's threads then stop "
            "handing Python's GIL to each other at every short system call (measured with "
            "--cpu-affinity, keep-alive c=50 on 2 cores: 72-90k req/s against 43-68k); a "
            "worker woken while another process runs on its CPU waits for the end of that "
            "one's time slice (a few ms); Linux only",
            flags=("--sched-batch",), flag=True),
    Setting("worker_connections", _int(1), 1000,
            "gevent worker: most connections served at once per worker",
            flags=("--worker-connections",), metavar="N"),
    Setting("backlog", _int(1), 2048, "listen queue length", flags=("--backlog",), metavar="N",
            reloadable=False),
    Setting("defer_accept", _int(0), 0,
            "TCP listeners: the kernel hands a new connection to a worker only once its first "
            "bytes have come (Linux's TCP_DEFER_ACCEPT, nginx's 'deferred'), so a worker is "
            "woken once per connection, not at the handshake and again at the request "
            "(measured, sync worker, Connection: close c=50: about 5 percent more requests a second, "
            "p99 a quarter lower); a client that connects and sends nothing reaches a worker only "
            "after about this many seconds (then --header-timeout applies); 0 (the default) "
            "turns it off; Linux only",
            flags=("--defer-accept",), metavar="SECONDS", reloadable=False),
    Setting("timeout", _seconds, 30.0,
            "a worker silent (no heartbeat) this long is killed and replaced; 0 disables",
            flags=("-t", "--timeout"), metavar="SECONDS"),
    Setting("keepalive", _seconds, 5.0, "seconds an idle keep-alive connection is kept; 0 disables",
            flags=("--keepalive",), aliases=("--keep-alive",), metavar="SECONDS"),
    Setting("header_timeout", _seconds, 10.0,
            "seconds a client has to send a whole request head from its first byte, and the "
            "longest pause in a body and in reading a response (a client that stops reading)",
            flags=("--header-timeout",), metavar="SECONDS"),
    Setting("body_buffer", _int(0), 65536,
            "sync and thread workers: bytes of a request body read before the app is called "
            "(the rest streams), so a slow upload waits in the poller, not in the worker or a "
            "thread; 0 calls the app once the head is complete (an app that answers a body "
            "while it is still arriving; a slow uploader then holds the worker or thread)",
            flags=("--body-buffer",), metavar="BYTES"),
    Setting("drain_timeout", _seconds, 25.0,
            "on TERM/INT, seconds to let in-flight requests finish before they are stopped",
            flags=("--drain-timeout",), aliases=("--graceful-timeout",), metavar="SECONDS"),
    Setting("lameduck", _seconds, 0.0,
            "on TERM/INT, seconds to keep serving and accepting (readiness already failing) so "
            "load balancers stop sending before accepting stops",
            flags=("--lameduck",), metavar="SECONDS"),
    Setting("cancel_grace", _seconds, 2.0,
            "after the drain timeout, seconds cancelled requests get for their shutdown "
            "functions before a stuck worker is killed",
            flags=("--cancel-grace",), metavar="SECONDS"),
    Setting("max_connections", _int(1), None,
            "most connections a worker holds at once; beyond it they wait in the listen backlog "
            "(default: the worker class's own: a sync worker holds one, plus one parked "
            "keep-alive connection; gevent --worker-connections)",
            flags=("--max-connections",), metavar="N"),
    Setting("background_threads", _int(1), 2,
            "threads of each worker's background pool (forkserve.background.submit)",
            flags=("--background-threads",), metavar="N"),
    Setting("span_log", _optional_text, None,
            "write spans recorded with forkserve.telemetry.span to this file, one JSON object "
            "per line (off by default)",
            flags=("--span-log",), metavar="PATH"),
    Setting("control_socket", _optional_text, None,
            "unix socket (mode 0600) for `forkserve ctl`: status, reload, upgrade, stop, scale N, "
            "pause, resume, and handing the listeners to a successor",
            flags=("--control-socket",), metavar="PATH", reloadable=False),
    Setting("reuse_port", _bool, False,
            "bind with SO_REUSEPORT, so a successor started with it too can bind the same port",
            flags=("--reuse-port",), flag=True, reloadable=False),
    Setting("takeover", _optional_text, None,
            "take the listening sockets from a running forkserve's control socket "
            "(the accept queue is never closed; HAProxy's -x)",
            flags=("--takeover",), metavar="PATH", reloadable=False),
    Setting("soft_stop", _pids, [],
            "once serving, stop these PIDs gracefully (TERM), as HAProxy's -sf",
            flags=("-sf", "--soft-stop"), metavar="PID", several=True, reloadable=False),
    Setting("hard_stop", _pids, [],
            "once serving, stop these PIDs at once (QUIT), as HAProxy's -st",
            flags=("-st", "--hard-stop"), metavar="PID", several=True, reloadable=False),
    Setting("max_requests", _int(0), 0, "restart a worker after this many requests; 0 disables",
            flags=("--max-requests",), metavar="N"),
    Setting("max_requests_jitter", _int(0), 0, "add up to this many requests at random per worker",
            flags=("--max-requests-jitter",), metavar="N"),
    # -- worker recycling and request limits (issue 15)
    Setting("max_worker_rss", _int(0), 0,
            "recycle a worker (gracefully: its replacement is spawned, it finishes what is in "
            "flight) once its resident memory passes this many MiB, checked with each "
            "heartbeat (at most once a second); 0 disables",
            flags=("--max-worker-rss",), metavar="MiB"),
    Setting("max_worker_rss_jitter", _int(0), 0,
            "add up to this many MiB at random to each worker's --max-worker-rss, so that "
            "workers growing alike are not all recycled at once",
            flags=("--max-worker-rss-jitter",), metavar="MiB"),
    Setting("max_worker_lifetime", _seconds, 0.0,
            "recycle a worker (gracefully) this many seconds after it booted; 0 disables",
            flags=("--max-worker-lifetime",), metavar="SECONDS"),
    Setting("max_worker_lifetime_jitter", _seconds, 0.0,
            "add up to this many seconds at random to each worker's --max-worker-lifetime",
            flags=("--max-worker-lifetime-jitter",), metavar="SECONDS"),
    Setting("request_timeout", _seconds, 0.0,
            "thread, gevent and sync workers: a request still running this many seconds after "
            "its head arrived is cancelled (RequestCancelled in the app, its shutdown functions "
            "run, 504 if no response began, else the connection is closed), its stack is "
            "logged, and the worker serves on; 0 disables",
            flags=("--request-timeout",), metavar="SECONDS"),
    Setting("limit_request_line", _int(16), 8190, "longest request line (method, target and version) in bytes (else 414)",
            flags=("--limit-request-line",), metavar="BYTES"),
    Setting("limit_request_fields", _int(1), 100, "most header and trailer fields in a request (else 431)",
            flags=("--limit-request-fields",), metavar="N"),
    Setting("limit_request_field_size", _int(16), 8190,
            "longest header or trailer field (name and value) in bytes (else 431)",
            flags=("--limit-request-field-size",), aliases=("--limit-request-field_size",),
            metavar="BYTES"),
    Setting("limit_request_body", _int(0), 0, "largest request body in bytes (else 413); 0: no limit",
            flags=("--limit-request-body",), metavar="BYTES"),
    Setting("preload", _bool, False, "import the application in the arbiter, before forking",
            flags=("--preload",), flag=True, reloadable=False),
    # -- development reload (issue 15)
    Setting("gc_freeze", _bool, True,
            "each worker runs gc.freeze() as it starts, and with --preload the arbiter runs "
            "gc.collect() and gc.freeze() after the import, before forking, so that the "
            "workers' garbage collector never writes to what they inherited (the "
            "application's objects with --preload, the server's own otherwise) and those "
            "memory pages stay shared (copy-on-write); --no-gc-freeze (gc_freeze: false) "
            "turns both off",
            flags=("--no-gc-freeze",), flag=True, reloadable=False),
    Setting("reload", _bool, False,
            "development: watch the application's files and reload as HUP does (new workers "
            "boot, then the old ones drain) when one changes; watches the --chdir directory "
            "and the application's package, *.py and --reload-include files; needs watchfiles "
            "(pip install 'forkserve[reload]'); not with --preload",
            flags=("--reload",), flag=True, reloadable=False),
    Setting("reload_extra_file", _text_list, [],
            "with --reload, also reload when this file changes, or any file in this directory "
            "(repeatable; relative to --chdir)",
            flags=("--reload-extra-file",), metavar="PATH", repeatable=True, reloadable=False),
    Setting("reload_include", _text_list, [],
            "with --reload, files matching this glob count too, besides *.py (repeatable; "
            "matched against the name and the path below the watched directory, e.g. "
            "'*.html' or 'templates/*')",
            flags=("--reload-include",), metavar="GLOB", repeatable=True, reloadable=False),
    Setting("reload_exclude", _text_list, [],
            "with --reload, changes to paths with a part matching this glob do not count "
            "(repeatable), besides .git, __pycache__, .venv, venv, node_modules, *.pyc, "
            "editors' swap and backup files and the like",
            flags=("--reload-exclude",), metavar="GLOB", repeatable=True, reloadable=False),
    Setting("chdir", _optional_text, None, "change to this directory before loading the app",
            flags=("--chdir",), metavar="DIR", reloadable=False),
    # -- gunicorn spellings and process settings (issue 15)
    Setting("proc_name", _optional_text, None,
            "process title prefix shown by ps and top: forkserve: arbiter [NAME], forkserve: "
            "worker N [NAME] (default: the app)",
            flags=("-n", "--name"), metavar="NAME", reloadable=False),
    Setting("env", _env_pairs, {},
            "set KEY=VALUE in the environment of the arbiter and the workers before the app "
            "is loaded (repeatable; it configures the app, not forkserve: FORKSERVE_* given "
            "this way are not read)",
            flags=("-e", "--env"), metavar="KEY=VALUE", repeatable=True, reloadable=False),
    Setting("pythonpath", _paths, [],
            "directories, comma-separated, put first on sys.path (in this order) before the "
            "app is loaded; relative ones are relative to --chdir",
            flags=("--pythonpath",), metavar="DIRS", reloadable=False),
    Setting("pidfile", _optional_text, None, "write the arbiter's PID to this file",
            flags=("--pidfile",), aliases=("-p", "--pid"), metavar="FILE", reloadable=False),
    Setting("log_level", _choice("debug", "info", "warning", "error", "critical"), "info",
            "error-log level", flags=("--log-level",), metavar="LEVEL"),
    Setting("log_format", _choice("text", "json"), "text", "error-log format: text or json",
            flags=("--log-format",), metavar="FORMAT"),
    Setting("access_log", _optional_text, None, "access-log file, or - for stdout (off by default)",
            flags=("--access-log",), aliases=("--access-logfile",), metavar="PATH"),
    Setting("access_log_format", _access_log_format, "combined",
            "access-log line: combined (Apache's, plus the duration), json, or a template of "
            "named fields such as '{remote_addr} {method} {path} {status} {duration_us}us "
            "{request_id}' (the README lists the fields; {req_NAME} and {resp_NAME} are any "
            "request or response header), json (json:req_NAME,resp_NAME adds headers), or "
            "gunicorn's atom format (h l u t r s b f a ...)",
            flags=("--access-log-format",), aliases=("--access-logformat",), metavar="FORMAT"),
    Setting("status_bind", _status_bind, None,
            "HOST:PORT of the status server (/healthz /readyz /metrics /status), served by the "
            "arbiter; off by default; anything but loopback is public, so a warning is logged",
            flags=("--status-bind",), metavar="HOST:PORT", reloadable=False),
    Setting("error_log", _text, "-", "error-log file, or - for stderr",
            flags=("--error-log",), aliases=("--error-logfile", "--log-file"), metavar="PATH",
            reloadable=False),
    Setting("forwarded_allow_ips", _allow_list, ["127.0.0.1", "::1"],
            "proxies trusted to say the request's scheme (X-Forwarded-Proto, X-Forwarded-Ssl, "
            "Forwarded proto=) and, with --forwarded-for, the client's address: addresses or "
            "CIDR networks, comma-separated, or * for any; unix-socket peers are always "
            "trusted; from anyone else these headers change nothing",
            flags=("--forwarded-allow-ips",), metavar="IPS",
            env_aliases=("FORWARDED_ALLOW_IPS",)),
    Setting("forwarded_for", _bool, False,
            "from a trusted proxy, REMOTE_ADDR is the client's address from Forwarded for= or "
            "X-Forwarded-For (the right-most hop that is not a trusted proxy), in the access "
            "log too; the proxy's own address stays in environ['forkserve.peer_addr']",
            flags=("--forwarded-for",), flag=True),
    Setting("proxy_protocol", _bool, False,
            "accept the PROXY protocol (v1 and v2, detected per connection) from the peers "
            "--forwarded-allow-ips trusts, as an AWS NLB or HAProxy send-proxy sends it: "
            "REMOTE_ADDR is the client it names; from anyone else it is refused",
            flags=("--proxy-protocol",), flag=True),
    Setting("certfile", _optional_text, None,
            "serve HTTPS: the certificate chain (PEM); re-read on HUP, and a new one that does "
            "not load keeps the old",
            flags=("--certfile",), metavar="FILE"),
    Setting("keyfile", _optional_text, None, "its private key (PEM; default: in the --certfile)",
            flags=("--keyfile",), metavar="FILE"),
    Setting("keyfile_password_file", _optional_text, None,
            "a file holding the key's password (never the password itself on the command "
            "line, where ps shows it)",
            flags=("--keyfile-password-file",), metavar="FILE"),
    Setting("keyfile_password", _optional_text, None,
            "the key's password itself: environment or config file only (no flag: ps would "
            "show it); --keyfile-password-file wins",
            secret=True),
    Setting("ca_certs", _optional_text, None,
            "CA certificates (PEM) that client certificates must be signed by (--cert-reqs)",
            flags=("--ca-certs",), metavar="FILE"),
    Setting("cert_reqs", _cert_reqs, "none",
            "client certificates: none, optional or required (or gunicorn's 0, 1, 2); a "
            "verified one is in environ['forkserve.peer_cert']",
            flags=("--cert-reqs",), metavar="WHEN"),
    Setting("ciphers", _optional_text, None,
            "OpenSSL cipher list for TLS 1.2 (TLS 1.3's are OpenSSL's own; TLS 1.2 at least "
            "always)",
            flags=("--ciphers",), metavar="LIST"),
    Setting("user", _user, None,
            "run the workers as this user (name or uid): the arbiter stays root, so it can bind "
            "privileged ports again and read keys at a reload or upgrade; needs root",
            flags=("-u", "--user"), metavar="USER", reloadable=False),
    Setting("group", _group, None,
            "run the workers with this group (name or gid; default: the user's own group)",
            flags=("-g", "--group"), metavar="GROUP", reloadable=False),
    Setting("initgroups", _bool, False,
            "give the workers the user's supplementary groups too (else none)",
            flags=("--initgroups",), flag=True, reloadable=False),
    Setting("umask", _octal, None,
            "umask of the arbiter and workers, octal (e.g. 027): the mode of files and unix "
            "sockets they create (default: inherited)",
            flags=("-m", "--umask"), metavar="MASK", reloadable=False),
    Setting("bind_mode", _octal, None,
            "mode of the unix sockets forkserve binds, octal (e.g. 660, so that a proxy in "
            "--bind-group can connect; default: 666, so that a proxy running as another user "
            "can connect, as it could to a port on 127.0.0.1; less --umask if one is given)",
            flags=("--bind-mode",), metavar="MODE", reloadable=False),
    Setting("bind_group", _group, None,
            "group of the unix sockets forkserve binds (default: --group, else unchanged)",
            flags=("--bind-group",), metavar="GROUP", reloadable=False),
    # -- logging integration (issue 15)
    Setting("log_config", _optional_text, None,
            "a logging dictConfig file (YAML, or JSON: .json or text starting with {; or "
            "gunicorn's INI fileConfig: .ini/.conf/.cfg with [loggers]): applied "
            "in the arbiter and in each worker after fork; a logger it names (forkserve.error, "
            "forkserve.access or gunicorn's names) gets only its handlers, instead of "
            "--error-log / --access-log",
            flags=("--log-config",), metavar="FILE", reloadable=False,
            aliases=("--log-config-json",)),
    Setting("log_syslog", _bool, False,
            "also send the error log (and the access log, when on) to syslog",
            flags=("--log-syslog",), flag=True, reloadable=False),
    Setting("log_syslog_to", _syslog_to, "unix:///dev/log",
            "where syslog is: unix://PATH, udp://HOST:PORT or tcp://HOST:PORT",
            flags=("--log-syslog-to",), metavar="ADDRESS", reloadable=False),
    Setting("log_syslog_prefix", _text, "forkserve",
            "syslog tag (the program name before [pid]:)",
            flags=("--log-syslog-prefix",), metavar="NAME", reloadable=False),
    Setting("log_syslog_facility", _choice(*SYSLOG_FACILITIES), "user",
            "syslog facility (user, daemon, local0...local7, ...)",
            flags=("--log-syslog-facility",), metavar="FACILITY", reloadable=False),
    Setting("capture_output", _bool, False,
            "send what workers write to their stdout and stderr (print(), C libraries) to the "
            "error log, a record per line with the worker's pid",
            flags=("--capture-output",), flag=True, reloadable=False),
)

BY_NAME = {s.name: s for s in SETTINGS}


@dataclass
class Config:
    """Resolved settings with the source of each value (default, file, env or cli)."""

    values: dict[str, Any]
    sources: dict[str, str] = field(default_factory=dict)
    # Defaults the platform decided, and why: bind from $PORT, workers from WEB_CONCURRENCY or
    # the CPU quota, the worker class from --threads (logged at start, shown by --check).
    derived: dict[str, str] = field(default_factory=dict)
    # Where exactly a value came from, beyond its source: the variable (FORKSERVE_WORKERS,
    # FORWARDED_ALLOW_IPS), the file's path (--print-config shows them).
    origins: dict[str, str] = field(default_factory=dict)
    # Lines for the error log once it is open, (level, message, fields): what GUNICORN_CMD_ARGS
    # set, the gunicorn flags that were ignored.
    notes: list[tuple[str, str, dict[str, str]]] = field(default_factory=list)

    def __getattr__(self, name: str) -> Any:
        try:
            return self.values[name]
        except KeyError:
            raise AttributeError(name) from None

    @property
    def worker_count(self) -> int:
        return int(self.values["workers"])

    def describe(self) -> str:
        status = f"; status server on {self.status_bind}" if self.status_bind else ""
        why = {name: f" ({reason})" for name, reason in self.derived.items()}
        scheme = f"; HTTPS with {self.certfile}" if self.certfile else ""
        return (f"app {self.app}: {self.worker_count}{why.get('workers', '')} "
                f"{self.worker_class}{why.get('worker_class', '')} worker(s) on "
                f"{', '.join(self.bind)}{why.get('bind', '')}{scheme}{status}")

    def worker_identity(self) -> tuple[int, int, tuple[int, ...]] | None:
        """(uid, gid, supplementary groups) the workers drop to; None: they stay as we are."""
        user, group = self.values["user"], self.values["group"]
        if user is None and group is None:
            return None
        uid, gid, name = os.getuid(), os.getgid(), None
        if user is not None:
            entry = _passwd(user)
            uid = int(user) if entry is None else entry.pw_uid
            if entry is not None:
                gid, name = entry.pw_gid, entry.pw_name
        if group is not None:
            gid = _gid(group)
        groups = (tuple(os.getgrouplist(name, gid)) if self.values["initgroups"] and name
                  else (gid,))
        return uid, gid, groups

    def bind_gid(self) -> int | None:
        group = self.values["bind_group"] or self.values["group"]
        return None if group is None else _gid(group)

    def describe_proxies(self) -> str:
        """What --check says of the proxy headers: whose are believed, and for what."""
        allow = self.forwarded_allow_ips
        who = ("any peer" if "*" in allow else
               f"{', '.join(allow)} and unix-socket peers" if allow else "unix-socket peers only")
        address = ("the client's, from Forwarded for= / X-Forwarded-For" if self.forwarded_for
                   else "the peer's (--forwarded-for takes the client's from X-Forwarded-For)")
        return (f"the scheme (Forwarded proto=, X-Forwarded-Proto, X-Forwarded-Ssl) is believed "
                f"from {who}; REMOTE_ADDR is {address}")


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        if message.startswith("unrecognized arguments"):
            message += ("; forkserve --help lists the options (docs/operations.md, "
                        "Migrating from gunicorn, maps gunicorn's)")
        raise ConfigError(message)


# What the command line noted for the log (gunicorn flags ignored): the parser's namespace
# carries it under this name, and resolve() moves it into Config.notes.
NOTES = "gunicorn_notes"


class _GunicornOnly(argparse.Action):
    """A gunicorn flag forkserve has no setting for: noted (ignored) or refused, with what
    forkserve does instead (forkserve.gunicorn_flags)."""

    def __init__(self, option_strings: Sequence[str], dest: str,
                 entry: gunicorn_flags.GunicornOnly, **kwargs: Any) -> None:
        self.entry = entry
        super().__init__(option_strings, dest, nargs=None if entry.takes_value else 0,
                         help=argparse.SUPPRESS, **kwargs)

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: Any, option_string: str | None = None) -> None:
        value = values if isinstance(values, str) else None
        ignored, line = gunicorn_flags.judge(self.entry, option_string or self.dest, value)
        if not ignored:
            raise ConfigError(line)
        notes = list(getattr(namespace, NOTES, []))
        notes.append(line)
        setattr(namespace, NOTES, notes)


def build_argparser(version: str) -> argparse.ArgumentParser:
    parser = _Parser(
        prog="forkserve",
        description="A pre-fork WSGI server. Every option may also be set as FORKSERVE_NAME in "
                    "the environment or as name: in the YAML file given with -c "
                    "(precedence: defaults < file < environment < command line).",
        argument_default=argparse.SUPPRESS,
        # No abbreviations: `--keyfile-password SECRET` must be an error, not taken as
        # --keyfile-password-file (and the secret then printed in "cannot read SECRET").
        allow_abbrev=False,
    )
    parser.add_argument("--version", action="version", version=f"forkserve {version}")
    parser.add_argument("--check", "--check-config", action="store_true", default=False,
                        help="validate the configuration and import the app, then exit "
                             "(no binding, no forking)")
    parser.add_argument("--print-config", action="store_true",
                        help="print every setting's value and where it came from, then exit "
                             "(no binding, no forking; JSON with --log-format json)")
    for entry in gunicorn_flags.GUNICORN_ONLY:
        parser.add_argument(*entry.flags, action=_GunicornOnly, entry=entry,
                            dest=f"gunicorn_{entry.setting}")
    for s in SETTINGS:
        if s.name == "app":
            parser.add_argument("app", nargs="?", metavar=s.metavar, help=s.help)
            continue
        if s.secret:
            continue
        default_text = ("" if s.default is None or s.default is False or s.default in ([], {})
                        or s.flag else f" [default: {_show(s.default)}]")
        kwargs: dict[str, Any] = {"dest": s.name, "help": s.help + default_text}
        if s.flag:
            kwargs["action"] = "store_const"
            # A flag turns its setting on; one on by default, off (--no-gc-freeze).
            kwargs["const"] = s.default is not True
        else:
            kwargs["metavar"] = s.metavar
            if s.repeatable:
                kwargs["action"] = "append"
            elif s.several:
                kwargs["nargs"] = "+"
        parser.add_argument(*s.flags, *s.aliases, **kwargs)
    return parser


def _show(value: Any) -> str:
    return ", ".join(value) if isinstance(value, list) else str(value)


def _apply(values: dict[str, Any], sources: dict[str, str], name: str, raw: Any, source: str,
           env_name: str | None = None) -> None:
    setting = BY_NAME[name]
    try:
        values[name] = setting.parse(raw)
    except ValueError as exc:
        flag = (setting.flags or (name,))[-1]
        where = {"file": f"in the config file, {name}", "env": env_name or setting.env,
                 "cli": flag, GUNICORN: f"{gunicorn_flags.CMD_ARGS_ENV}, {flag}"}[source]
        raise ConfigError(f"{where}: {exc}") from None
    sources[name] = source


def read_yaml(path: str) -> dict[str, Any]:
    import yaml  # (here, not at the top: a server that reads no YAML maps none of it)

    try:
        with open(path, encoding="utf-8") as fh:
            data = yaml.safe_load(fh)
    except OSError as exc:
        raise ConfigError(f"cannot read config file {path}: {exc.strerror}") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" (line {mark.line + 1})" if mark is not None else ""
        raise ConfigError(f"config file {path} is not valid YAML{where}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} must be a mapping of setting: value")
    unknown = sorted(str(k) for k in data if str(k).replace("-", "_") not in BY_NAME or k == "config")
    if unknown:
        raise ConfigError(f"config file {path}: unknown setting(s): {', '.join(unknown)}")
    return {str(k).replace("-", "_"): v for k, v in data.items()}


# The source of what GUNICORN_CMD_ARGS set (the others: default, file, env, cli).
GUNICORN = "gunicorn_cmd_args"


def resolve(cli: dict[str, Any], environ: dict[str, str] | os._Environ[str]) -> Config:
    """Merge defaults < YAML < GUNICORN_CMD_ARGS < environment < command line into a Config.

    GUNICORN_CMD_ARGS sits where gunicorn puts it, above the config file and below the
    command line; forkserve's own FORKSERVE_* variables are above it (they are this server's
    configuration, GUNICORN_CMD_ARGS is what a deployment moving over brought along), and
    gunicorn's FORWARDED_ALLOW_IPS below it, as in gunicorn (there it is only a default)."""
    values = {s.name: s.default for s in SETTINGS}
    sources = {s.name: "default" for s in SETTINGS}
    origins: dict[str, str] = {}
    notes: list[tuple[str, str, dict[str, str]]] = [("warning", line, {})
                                                    for line in cli.get(NOTES, [])]
    from_gunicorn = _gunicorn_cmd_args(environ, notes)
    config_env = BY_NAME["config"].env
    config_path, config_source = next(
        ((path, source) for path, source in ((cli.get("config"), "cli"),
                                             (environ.get(config_env), "env"),
                                             (from_gunicorn.get("config"), GUNICORN)) if path),
        (None, "default"))
    if config_path:
        hooks = gunicorn_flags.python_config(config_path)
        if hooks is not None:
            where = {"cli": "-c ", "env": f"{config_env}=",
                     GUNICORN: f"{gunicorn_flags.CMD_ARGS_ENV}, -c "}[config_source]
            raise ConfigError(f"{where}{config_path}: {gunicorn_flags.python_config_advice(hooks)}")
        for name, raw in read_yaml(config_path).items():
            _apply(values, sources, name, raw, "file")
            origins[name] = config_path
        values["config"], sources["config"] = config_path, config_source
        if config_source != "cli":
            origins["config"] = config_env if config_source == "env" else gunicorn_flags.CMD_ARGS_ENV
    for name, raw in from_gunicorn.items():
        if name in BY_NAME and name != "config" and raw is not None:
            _apply(values, sources, name, raw, GUNICORN)
            origins[name] = gunicorn_flags.CMD_ARGS_ENV
    for s in SETTINGS:
        # Ours first; else another server's name for it (gunicorn's FORWARDED_ALLOW_IPS), so
        # a deployment moving over keeps its behaviour.
        env_name = next((n for n in (s.env, *s.env_aliases) if n in environ), None)
        if env_name is None or s.name == "config":
            continue
        if env_name != s.env and sources[s.name] == GUNICORN:
            continue  # GUNICORN_CMD_ARGS beats gunicorn's own variables, as in gunicorn
        raw_env: Any = environ[env_name]
        if (s.repeatable or s.several) and s.name != "env":  # (env: split as a shell would)
            raw_env = [part for part in raw_env.replace(",", " ").split() if part]
        _apply(values, sources, s.name, raw_env, "env", env_name)
        origins[s.name] = env_name
    for name, raw in cli.items():
        if name in BY_NAME and name != "config" and raw is not None:
            _apply(values, sources, name, raw, "cli")
            origins.pop(name, None)
    if values["app"] is None:
        raise ConfigError("no application given: forkserve [options] MODULE:APP (see --help)")
    if _is_file_path(values["app"].partition(":")[0]):
        where = {"file": "in the config file, app", "env": BY_NAME["app"].env,
                 "cli": "app"}[sources["app"]]
        raise ConfigError(f"{where}: {_module_spelling(values['app'], values['chdir'])}")
    derived = _platform_defaults(values, sources, environ)
    if values["worker_class"] == "gevent" and importlib.util.find_spec("gevent") is None:
        raise ConfigError("-k gevent needs gevent: pip install 'forkserve[gevent]'")
    if values["preload"] and values["worker_class"] == "gevent":
        # The app would be imported in the arbiter before gevent patches the standard
        # library in each worker: gunicorn's classic gevent bug. Refuse it outright.
        raise ConfigError("--preload cannot be used with -k gevent: the application would be "
                          "imported before gevent patches the standard library")
    if values["reload"] and values["preload"]:
        # A HUP with --preload forks new workers from the arbiter's copy of the application,
        # imported once at start: the edited code would never be loaded.
        raise ConfigError("--reload cannot be used with --preload: the application is imported "
                          "once, in the arbiter, and a reload would fork the workers from that "
                          "same code; drop --preload while developing")
    if values["cpu_affinity"] and not hasattr(os, "sched_setaffinity"):
        raise ConfigError("--cpu-affinity needs Linux (os.sched_setaffinity)")
    if values["sched_batch"] and not hasattr(os, "SCHED_BATCH"):
        raise ConfigError("--sched-batch needs Linux (os.SCHED_BATCH)")
    if values["defer_accept"] and not hasattr(socket, "TCP_DEFER_ACCEPT"):
        raise ConfigError("--defer-accept needs Linux (TCP_DEFER_ACCEPT)")
    if values["reload"] and importlib.util.find_spec("watchfiles") is None:
        raise ConfigError("--reload needs watchfiles: pip install 'forkserve[reload]'")
    if values["proxy_protocol"] and values["certfile"]:
        # The PROXY header comes before the TLS handshake on the wire; the workers look for it
        # in the decrypted stream, so the two together would fail every handshake. Refused
        # rather than broken until the header is read from the raw socket.
        raise ConfigError("--proxy-protocol cannot be used with --certfile yet: terminate TLS "
                          "in the balancer, or drop one of them")
    config = Config(values, sources, derived, origins, notes)
    _check_privileges(config)
    return config


def _gunicorn_cmd_args(environ: dict[str, str] | os._Environ[str],
                       notes: list[tuple[str, str, dict[str, str]]]) -> dict[str, Any]:
    """GUNICORN_CMD_ARGS, parsed as the command line is (an unknown flag in it is one line
    naming it); {} when it is not set."""
    name = gunicorn_flags.CMD_ARGS_ENV
    text = environ.get(name, "").strip()
    if not text:
        return {}
    try:
        tokens = shlex.split(text)
    except ValueError as exc:
        raise ConfigError(f"{name}: cannot split {text!r}: {exc}") from None
    for token in tokens:
        flag = token.partition("=")[0]
        if flag in ("-h", "--help", "--version", "--check", "--check-config", "--print-config"):
            # (--help and --version would exit from inside the parser: in a HUP, the arbiter)
            raise ConfigError(f"{name}: {flag} is a command, not a setting: give it on the "
                              f"command line")
    try:
        values, _ = parse_args(tokens, "")
    except ConfigError as exc:
        raise ConfigError(f"{name}: {exc}") from None
    notes.append(("info", f"read {name}: {text}",
                  {"precedence": "above the config file, below FORKSERVE_* variables and "
                                 "the command line"}))
    notes.extend(("warning", line, {}) for line in values.pop(NOTES, []))
    return values


def _passwd(user: str) -> pwd.struct_passwd | None:
    try:
        return pwd.getpwuid(int(user)) if user.isdigit() else pwd.getpwnam(user)
    except KeyError:
        return None  # a bare uid: no entry, no primary group


def _gid(group: str) -> int:
    return int(group) if group.isdigit() else grp.getgrnam(group).gr_gid


def _check_privileges(config: Config) -> None:
    """--user and --group need root (dropping to ourselves is allowed, and a no-op)."""
    identity = config.worker_identity()
    if identity is None or os.geteuid() == 0:
        return
    uid, gid, _ = identity
    if uid != os.geteuid() or gid != os.getegid():
        raise ConfigError(f"--user/--group need root: forkserve runs as uid {os.geteuid()}")


def _platform_defaults(values: dict[str, Any], sources: dict[str, str],
                       environ: dict[str, str] | os._Environ[str]) -> dict[str, str]:
    """Where the user set nothing, what PaaS and container platforms say (as gunicorn reads
    them): $PORT (Heroku, Render, Cloud Run, Fly), WEB_CONCURRENCY, the CPU quota; and
    --threads alone meaning the thread worker. Returns why each was chosen."""
    derived: dict[str, str] = {}
    port = environ.get("PORT")
    if sources["bind"] == "default" and port:
        if not port.isdigit() or int(port) > 65535:
            raise ConfigError(f"PORT: expected a port number, got {port!r}")
        values["bind"] = [f"0.0.0.0:{int(port)}"]
        derived["bind"] = "from $PORT"
    if values["workers"] is None:
        concurrency = environ.get("WEB_CONCURRENCY")
        if concurrency:
            if not concurrency.isdigit() or int(concurrency) < 1:
                raise ConfigError(f"WEB_CONCURRENCY: expected a whole number of at least 1, "
                                  f"got {concurrency!r}")
            values["workers"], derived["workers"] = int(concurrency), "from WEB_CONCURRENCY"
        else:
            values["workers"], why = usable_cpus()
            derived["workers"] = f"from {why}"
    if values["threads"] > 1 and sources["threads"] != "default" and values["worker_class"] == "sync":
        if sources["worker_class"] != "default":
            raise ConfigError(f"--threads {values['threads']} needs -k thread: -k sync serves "
                              f"one request at a time per worker")
        values["worker_class"] = "thread"
        derived["worker_class"] = f"from --threads {values['threads']}"
    return derived


def unknown_env(environ: dict[str, str] | os._Environ[str]) -> list[str]:
    known = {s.env for s in SETTINGS}
    return sorted(k for k in environ if k.startswith(ENV_PREFIX) and k not in known)


def parse_args(argv: Sequence[str], version: str) -> tuple[dict[str, Any], bool]:
    """Returns (cli values, check flag). Raises ConfigError on bad usage."""
    argv, notes = _proxy_protocol_modes(list(argv))
    ns = build_argparser(version).parse_args(argv)
    cli = vars(ns)
    if notes:
        cli[NOTES] = notes + list(cli.get(NOTES, []))
    for name in ("soft_stop", "hard_stop"):
        # `forkserve -sf 123 myapp:wsgi`: nargs="+" also took the app; give it back.
        values = cli.get(name)
        if values and not str(values[-1]).isdigit() and cli.get("app") is None:
            cli["app"] = values.pop()
    check = bool(cli.pop("check", False))
    return cli, check


_PROXY_MODES = ("off", "v1", "v2", "auto")


def _proxy_protocol_modes(argv: list[str]) -> tuple[list[str], list[str]]:
    """gunicorn's ``--proxy-protocol [MODE]`` (off, v1, v2, auto) as forkserve's switch, which
    accepts v1 and v2 alike (detected per connection): the mode is taken only when it is one
    of these words, so ``--proxy-protocol myapp:app`` still leaves the app alone."""
    out: list[str] = []
    notes: list[str] = []
    tokens = iter(argv)
    for token in tokens:
        flag, eq, mode = token.partition("=")
        if flag != "--proxy-protocol":
            out.append(token)
            continue
        if not eq:
            following = next(tokens, None)
            if following is not None and following.lower() in _PROXY_MODES:
                mode = following
            elif following is not None:
                out.extend((token, following))
                continue
        if not mode:
            out.append(token)
        elif mode.lower() not in _PROXY_MODES:
            raise ConfigError(f"--proxy-protocol: expected no value, or gunicorn's "
                              f"{', '.join(_PROXY_MODES)}; got {mode!r}")
        elif mode.lower() != "off":
            out.append(flag)
            if mode.lower() != "auto":
                notes.append(f"--proxy-protocol {mode}: forkserve accepts v1 and v2 alike, "
                             f"detected per connection")
    return out, notes


def provenance(config: Config) -> list[dict[str, Any]]:
    """Every setting's value and where it came from (``--print-config``): secrets and the
    values of --env masked. Each row: setting, value (as JSON would have it), source
    (default, file, env, cli, gunicorn_cmd_args or derived), and where that was: the file,
    the variable, or the reason a value was derived."""
    rows = []
    for s in SETTINGS:
        value = config.values[s.name]
        if s.secret and value is not None:
            value = "********"
        elif s.name == "env":
            value = {key: "***" for key in value}  # (secrets, often: DATABASE_URL)
        elif s.parse is _octal and value is not None:
            value = f"{value:03o}"  # a mode, as it is written
        row: dict[str, Any] = {"setting": s.name, "value": value,
                               "source": config.sources[s.name]}
        if s.name in config.derived:
            row["source"], row["reason"] = "derived", config.derived[s.name]
        elif s.name in config.origins:
            row["from"] = config.origins[s.name]
        rows.append(row)
    return rows


def reloadable_changes(old: Config, new: Config) -> Iterable[str]:
    """Settings that differ between two configs but that a HUP cannot apply."""
    return [s.name for s in SETTINGS
            if not s.reloadable and old.values.get(s.name) != new.values.get(s.name)]


def settings_table() -> str:
    """The README's settings table, generated from the registry (a test keeps them equal)."""
    rows = ["| setting (YAML key) | command line | environment | default | HUP reloads | meaning |",
            "|---|---|---|---|---|---|"]
    for s in SETTINGS:
        flags = ("positional `MODULE:APP`" if s.name == "app"
                 else "— (never: `ps` would show it)" if s.secret
                 else ", ".join(f"`{f}`" for f in s.flags + s.aliases))
        if s.name == "workers":
            default = "`WEB_CONCURRENCY`, else usable CPUs"
        elif s.default is None or s.default in ([], {}):
            default = "—"
        elif isinstance(s.default, bool):
            default = str(s.default).lower()
        else:
            default = _show(s.default)
        env = ", ".join(f"`{name}`" for name in (s.env, *s.env_aliases))
        rows.append(f"| `{s.name}` | {flags} | {env} | {default} | "
                    f"{'yes' if s.reloadable else 'no (restart)'} | {s.help} |")
    return "\n".join(rows) + "\n"


__all__ = ["Config", "ConfigError", "SETTINGS", "Setting", "build_argparser", "parse_args",
           "provenance", "resolve", "read_yaml", "unknown_env", "reloadable_changes"]

if __name__ == "__main__":  # `python -m forkserve.config` prints the README's settings table
    sys.stdout.write(settings_table())
