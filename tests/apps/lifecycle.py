"""Apps for the life-cycle tests: failures at import time, controlled from the test.

- ``LIFECYCLE_EXIT_ON_IMPORT=N``: the import calls ``os._exit(N)`` (a worker that dies while
  booting without reporting an import error).
- ``LIFECYCLE_BREAK_IF_EXISTS=PATH``: the import raises while PATH exists, so a test can break
  the "deploy" between a start and a HUP.
- ``failing_factory``: for ``MODULE:failing_factory()``, a factory that raises.

``app`` is ``tests.apps.basic.app`` (same routes: /pid, /block?fifo=..., /exit...).
"""

from __future__ import annotations

import os

from tests.apps.basic import app, factory  # noqa: F401  (re-exported for MODULE:APP specs)

if os.environ.get("LIFECYCLE_EXIT_ON_IMPORT"):
    os._exit(int(os.environ["LIFECYCLE_EXIT_ON_IMPORT"]))

_flag = os.environ.get("LIFECYCLE_BREAK_IF_EXISTS")
if _flag and os.path.exists(_flag):
    raise RuntimeError("broken deploy on purpose")


def failing_factory():
    raise ValueError("the factory refused on purpose")
