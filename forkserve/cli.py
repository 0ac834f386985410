"""Command line: argv -> config -> arbiter. Every failure is one line and an exit code.

Exit codes (see :class:`forkserve.counters.ExitCode`): 0 after any requested stop, 2 for bad
usage or configuration, 4 when the application cannot be loaded (so a supervisor can tell a
broken deploy from a crash), 3 when workers die while booting, 1 for anything else.
"""

from __future__ import annotations

import os
import sys
from typing import Sequence

from forkserve import __version__
from forkserve.config import ConfigError, parse_args, resolve, unknown_env
from forkserve.counters import ExitCode
from forkserve.loader import AppLoadError, load_app
from forkserve.logs import Log
from forkserve.sockets import BindError, bind


def _say(message: str) -> None:
    sys.stderr.write(f"forkserve: {message}\n")
    sys.stderr.flush()


def main(argv: Sequence[str] | None = None) -> int:
    try:
        cli, check = parse_args(sys.argv[1:] if argv is None else argv, __version__)
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
    try:
        log = Log(config.error_log, config.log_level, config.log_format)
    except OSError as exc:
        _say(f"error: --error-log {config.error_log}: {exc.strerror}")
        return ExitCode.USAGE
    for name in unknown_env(os.environ):
        log.warning("Unknown setting in the environment, ignored", variable=name)

    if check:
        try:
            load_app(config.app)
        except AppLoadError as exc:
            log.error(f"Application could not be loaded: {exc}")
            return ExitCode.APP_LOAD_ERROR
        sys.stdout.write(f"forkserve: configuration OK; {config.describe()}\n")
        return ExitCode.OK

    app = None
    if config.preload:
        try:
            app = load_app(config.app)
        except AppLoadError as exc:
            log.error(f"Application could not be loaded: {exc}")
            return ExitCode.APP_LOAD_ERROR
    try:
        listeners = bind(config.bind, config.backlog)
    except BindError as exc:
        log.error(str(exc))
        return ExitCode.ERROR

    from forkserve.arbiter import Arbiter
    from forkserve.pidfile import Pidfile

    pidfile = Pidfile(config.pidfile) if config.pidfile else None
    try:
        if pidfile is not None:
            pidfile.write()
    except OSError as exc:
        log.error(f"cannot write pidfile {config.pidfile}: {exc.strerror}")
        return ExitCode.ERROR
    try:
        from setproctitle import setproctitle
        setproctitle(f"forkserve: arbiter [{config.app}]")
    except ImportError:
        pass  # titles are a convenience; setproctitle is a declared dependency anyway
    try:
        return Arbiter(config, cli, listeners, log, app).run()
    finally:
        if pidfile is not None:
            pidfile.remove()


def run() -> None:
    sys.exit(main())
