"""``-e/--env`` and ``--pythonpath`` applied to this process, and the environment as it was
without them.

The arbiter applies both once, before anything of the application is loaded (a --preload
app, hooks, the check of --check); the workers inherit them at fork. What this process
starts again from its command line, an in-place upgrade's check and its exec, is given the
environment *without* them (:meth:`ProcessEnv.pristine`): the new image applies its own
``--env`` from its own configuration, so a value is neither carried twice nor kept after the
configuration dropped it, and a ``FORKSERVE_*`` variable set with ``-e`` (for the app) never
becomes a setting of the next image. A HUP resolves its configuration from the same
environment.

Imports only the standard library.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from typing import Mapping, Sequence


@dataclass
class ProcessEnv:
    # Each variable -e set, and its value before (None: it was not set).
    before: dict[str, str | None] = field(default_factory=dict)
    paths: list[str] = field(default_factory=list)  # what --pythonpath put first on sys.path

    def apply(self, env: Mapping[str, str], pythonpath: Sequence[str]) -> None:
        """Set ``env`` in ``os.environ`` and put ``pythonpath`` first on ``sys.path``, in the
        order given; relative directories are taken from the current directory (the server
        changed to --chdir before), as gunicorn does."""
        for key, value in env.items():
            self.before.setdefault(key, os.environ.get(key))
            os.environ[key] = value
        paths = list(dict.fromkeys(os.path.abspath(p) for p in pythonpath))
        if paths:
            # First, even where a directory was on the path already (from PYTHONPATH): what
            # the operator asked for is found before anything else, the current directory
            # (which forkserve.loader otherwise puts first, as python -m does) included, as
            # gunicorn has it.
            rest = [p for p in sys.path if p not in paths]
            here = os.getcwd()
            if here not in rest and "" not in rest:
                rest.insert(0, here)
            sys.path[:] = paths + rest
        self.paths = paths

    def pristine(self) -> dict[str, str]:
        """``os.environ`` as it was before :meth:`apply`, for a process started anew."""
        env = dict(os.environ)
        for key, value in self.before.items():
            if value is None:
                env.pop(key, None)
            else:
                env[key] = value
        return env
