"""Command line: argv -> config -> arbiter. Every failure is one line and an exit code.

Exit codes (see :class:`forkserve.counters.ExitCode`): 0 after any requested stop, 2 for bad
usage or configuration, 4 when the application cannot be loaded (so a supervisor can tell a
broken deploy from a crash), 3 when workers die while booting, 1 for anything else.
"""

from __future__ import annotations

import atexit
import json
import os
import sys
from typing import Any, Sequence

from setproctitle import setproctitle

from forkserve import __version__
from forkserve.config import (ENV_PREFIX, ConfigError, parse_args, provenance,
                              read_log_config, resolve, unknown_env)
from forkserve.counters import ExitCode
from forkserve.gunicorn_flags import GUNICORN_CONFIG, python_config_advice
from forkserve.handover import Handover, take
from forkserve.hooks import Hooks, HooksError, load_hooks
from forkserve.loader import AppLoadError, load_app, os_exit_reported
from forkserve.logs import Log, Setup, open_error, probe_append, setup_error
from forkserve.config import Config
from forkserve.control import ControlError
from forkserve.sockets import BindError
from forkserve.metrics import ENV as METRICS_ENV
from forkserve.metrics import Store, prepare_directory
from forkserve.procenv import ProcessEnv


def _say(message: str) -> None:
    sys.stderr.write(f"forkserve: {message}\n")
    sys.stderr.flush()


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["ctl"]:
        from forkserve.control import ctl_main
        return ctl_main(args[1:])
    if args[:1] == ["status"]:
        from forkserve.statusview import main as status_main
        return status_main(args[1:])
    # What an in-place upgrade handed over (our own variable: never a user's setting).
    handover = take(os.environ)
    start_cwd = os.getcwd()
    try:
        cli, check = parse_args(args, __version__)
        print_config = bool(cli.pop("print_config", False))
        config = resolve(cli, os.environ)
    except ConfigError as exc:
        _say(f"error: {exc}")
        return ExitCode.USAGE
    if config.chdir:
        try:
            os.chdir(config.chdir)
        except OSError as exc:
            _say(f"error: --chdir {config.chdir}: {exc.strerror}")
            return ExitCode.USAGE
    if config.umask is not None:
        os.umask(config.umask)  # before any file or socket is made (the workers inherit it)
    try:
        # (--print-config writes nothing but its output: its notes go to stderr)
        log = Log("-" if print_config else config.error_log, config.log_level, config.log_format)
    except OSError as exc:
        _say(f"error: --error-log {config.error_log}: {open_error(config.error_log, exc)}")
        return ExitCode.USAGE
    for level, message, fields in config.notes:  # GUNICORN_CMD_ARGS, gunicorn flags ignored
        (log.info if level == "info" else log.warning)(message, **fields)
    _warn_unread_gunicorn_config(config, start_cwd, log)
    for name in unknown_env(os.environ):
        log.warning("Unknown setting in the environment, ignored", variable=name)
    for name in (key for key in config.env if key.startswith(ENV_PREFIX)):
        log.warning(f"-e {name}: set for the application only; forkserve's own settings "
                    f"were read before -e applies", variable=name)
    if print_config:
        _print_config(config)
        return ExitCode.OK
    # Before anything of the app is loaded (a --preload app, --check's import); the workers
    # inherit both at fork.
    process_env = ProcessEnv()
    process_env.apply(config.env, config.pythonpath)
    if config.env or config.pythonpath:
        log.info("Set for the application", env=",".join(config.env),
                 pythonpath=",".join(process_env.paths))
    # After -e and --pythonpath: a --log-config handler class may live on that path.
    problem = _install_logging(config, log)
    if problem:
        _say(f"error: {problem}")
        return ExitCode.USAGE
    # The workers open these after fork (before dropping privileges, so as the user we are
    # now): one that cannot be opened is a configuration error to tell here, once, not a
    # traceback from every worker and a boot failure.
    for flag, path in (("--access-log", config.access_log), ("--span-log", config.span_log)):
        if not path or (flag == "--access-log" and path == "-"):
            continue
        try:
            probe_append(path, keep=not check)
        except OSError as exc:
            _say(f"error: {flag} {path}: {open_error(path, exc)}")
            return ExitCode.USAGE
    try:
        # Before --check returns and before anything forks: a hooks module that does not
        # import is one line and exit 4, as an app that does not (after -e and --pythonpath).
        hooks = load_hooks(config.hooks, log, start_cwd)
    except HooksError as exc:
        log.error(f"Hooks could not be loaded: {exc}")
        return ExitCode.APP_LOAD_ERROR
    tls = None
    if config.certfile:
        from forkserve.tls import TLSError, build_context  # (ssl only when TLS is on)
        try:
            tls = build_context(config.values)
        except TLSError as exc:
            _say(f"error: {exc}")
            return ExitCode.USAGE

    if check:
        try:
            with os_exit_reported(lambda text: log.error(f"Application could not be loaded: {text}")):
                load_app(config.app, config.chdir)
        except AppLoadError as exc:
            log.error(f"Application could not be loaded: {exc}")
            return ExitCode.APP_LOAD_ERROR
        budget = config.lameduck + config.drain_timeout + config.cancel_grace
        margin = 3
        sys.stdout.write(
            f"forkserve: configuration OK; {config.describe()}\n"
            f"forkserve: behind a proxy: {config.describe_proxies()}\n"
            f"forkserve: shutdown budget {budget:g}s = lameduck {config.lameduck:g}s + drain "
            f"{config.drain_timeout:g}s + cancel grace {config.cancel_grace:g}s (+ flush); "
            f"set systemd TimeoutStopSec={budget + margin:g}, Kubernetes "
            f"terminationGracePeriodSeconds: {int(budget + margin + 0.999)}, "
            f"docker stop --time {int(budget + margin + 0.999)}\n")
        return ExitCode.OK

    store = None
    if config.status_bind or os.environ.get(METRICS_ENV):
        # Before anything imports prometheus_client (a preloaded app, the workers): it decides
        # at import whether its values live in the shared directory (forkserve.metrics imports
        # it only inside its functions).
        try:
            path, owned, removed, lock = prepare_directory(handover)
            store = Store(path, owned, lock)
            identity = config.worker_identity()
            if identity is not None and owned:
                os.chown(path, identity[0], identity[1])  # --user workers write their files there
        except OSError as exc:
            log.error(f"cannot prepare the metrics directory: {exc}")
            return ExitCode.ERROR
        if removed:
            log.info("Removed metric files of an earlier run", directory=path, files=removed)
    try:
        return _serve(config, cli, args, start_cwd, handover, store, log, tls, process_env, hooks)
    finally:
        if store is not None:
            store.close()  # after an in-place upgrade's exec this never runs: the new image keeps it


def _install_logging(config: Config, log: Log) -> str | None:
    """forkserve.error/forkserve.access (and gunicorn's names) wired, --log-config applied and
    --log-syslog connected, before anything is forked (--check included: a file that does not
    apply is found there): what fails, as one line, or None."""
    log_config = None
    if config.log_config:
        try:
            log_config = read_log_config(config.log_config)
        except ValueError as exc:
            return f"--log-config {config.log_config}: {exc}"
    setup = Setup(log_config, config.log_syslog_to if config.log_syslog else None,
                  config.log_syslog_prefix, config.log_syslog_facility)
    try:
        log.install(setup)
    except Exception as exc:  # dictConfig: ValueError, TypeError, ImportError, OSError...
        if setup.syslog_to is not None and isinstance(exc, OSError):
            return f"--log-syslog-to {setup.syslog_to}: {setup_error(exc)}"
        return f"--log-config {config.log_config}: {setup_error(exc)}"
    return None


def _serve(config: Config, cli: dict[str, Any], args: list[str], start_cwd: str,
           handover: Handover | None, store: Any, log: Log, tls: Any,
           process_env: ProcessEnv, hooks: Hooks) -> int:
    app = None
    if config.preload:
        try:
            with os_exit_reported(lambda text: log.error(f"Application could not be loaded: {text}")):
                app = load_app(config.app, config.chdir)
        except AppLoadError as exc:
            log.error(f"Application could not be loaded: {exc}")
            return ExitCode.APP_LOAD_ERROR
    from forkserve.arbiter import Arbiter
    from forkserve.arbiter.acquire import open_sockets
    from forkserve.pidfile import Pidfile
    from forkserve.systemd import Notifier

    for name, why in config.derived.items():
        # What the platform decided where the user did not ($PORT, the CPU quota...).
        value = config.values[name]
        shown = ", ".join(value) if isinstance(value, list) else str(value)
        log.info(f"Using {name} {shown} ({why})", setting=name, value=shown)
    try:
        listeners, status_sock, status_deferred = open_sockets(config, handover, log)
    except (BindError, ControlError) as exc:
        log.error(str(exc))
        return ExitCode.ERROR

    pidfile = Pidfile(config.pidfile) if config.pidfile else None
    try:
        if pidfile is not None:
            pidfile.write()
    except OSError as exc:
        log.error(f"cannot write pidfile {config.pidfile}: {exc.strerror}")
        return ExitCode.ERROR
    setproctitle(f"forkserve: arbiter [{config.proc_name or config.app}]")
    try:
        arbiter = Arbiter(config, cli, listeners, log, app, inherited=handover, argv=args,
                          cwd=start_cwd, notifier=Notifier(os.environ), status_sock=status_sock,
                          status_deferred=status_deferred, metrics=store, tls=tls,
                          process_env=process_env, hooks=hooks)
        return arbiter.run()
    finally:
        if pidfile is not None:
            pidfile.remove()


def _warn_unread_gunicorn_config(config: Config, start_cwd: str, log: Log) -> None:
    """gunicorn reads ./gunicorn.conf.py by itself; forkserve does not: say so, naming the
    file, where one is in the directory the server was started in or in --chdir."""
    found = dict.fromkeys(os.path.abspath(os.path.join(where, GUNICORN_CONFIG))
                          for where in (start_cwd, os.getcwd()))
    for path in (p for p in found if os.path.isfile(p)):
        shown = os.path.relpath(path, start_cwd)
        shown = shown if not shown.startswith(os.pardir) else path
        if config.values.get("hooks"):  # (helper A's --hooks, issue 15)
            advice = ("forkserve reads no Python configuration: put its settings in a YAML "
                      "file (-c forkserve.yaml) or in flags (--hooks is given: its hooks are "
                      "those)")
        else:
            # (a path that means the same from --chdir as from where the server started)
            advice = python_config_advice(path if config.chdir else GUNICORN_CONFIG)
        log.warning(f"{shown} is not read: {advice}", file=path)


def _print_config(config: Config) -> None:
    """--print-config: every setting, its value and where it came from; JSON (one object)
    with --log-format json, for tools."""
    rows = provenance(config)
    if config.log_format == "json":
        sys.stdout.write(json.dumps({"settings": rows}) + "\n")
        return
    def shown(value: Any) -> str:
        if isinstance(value, dict):
            return ", ".join(f"{k}={v}" for k, v in value.items()) or "(none)"
        if isinstance(value, list):
            return ", ".join(str(v) for v in value) or "(none)"
        if isinstance(value, bool):
            return str(value).lower()
        return "(none)" if value is None else str(value)

    width = max(len(row["setting"]) for row in rows)
    values = [shown(row["value"]) for row in rows]
    value_width = min(max(len(v) for v in values), 40)
    lines = []
    for row, value in zip(rows, values):
        where = row["source"]
        detail = row.get("reason") or row.get("from")
        if where == "gunicorn_cmd_args":
            where, detail = "GUNICORN_CMD_ARGS", None
        if detail:
            where += f" ({detail})"
        lines.append(f"{row['setting']:<{width}}  {value:<{value_width}}  {where}")
    sys.stdout.write("\n".join(lines) + "\n")


def run() -> None:
    code = main()
    # Everything this process had to do is done and written (the logs are unbuffered os.write
    # calls; the pidfile and metrics directory are removed): exit-time callbacks run (a
    # --preload app's), the standard streams are flushed, and the interpreter's teardown of
    # every module and object, tens of milliseconds that a stop waits for, is skipped.
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            code = code or ExitCode.ERROR  # a closed or full stdout: say so in the code
    os._exit(int(code or 0))
