"""forkserve: a pre-fork WSGI server that never loses a request to a deploy.

The public API lives here; see README.md for the command line.
"""

__version__ = "0.1.0"

__all__ = ["__version__"]
