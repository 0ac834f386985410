"""``python -m forkserve``: the same as the ``forkserve`` command."""

from forkserve.cli import run

if __name__ == "__main__":
    run()
