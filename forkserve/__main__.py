"""``python -m forkserve``: the same as the ``forkserve`` command."""

import sys

from forkserve.cli import main

if __name__ == "__main__":
    sys.exit(main())
