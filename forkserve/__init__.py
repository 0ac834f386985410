"""forkserve: a pre-fork WSGI server that never loses a request to a deploy.

The application API:

- ``forkserve.finish_request()``: the response is complete for the client now; the app goes
  on running (also ``environ["forkserve.finish_request"]``).
- ``forkserve.register_shutdown_function(fn, *args, **kwargs)``: run when the request ends,
  however it ends (normally, with an exception, or cancelled at the drain deadline).
- ``forkserve.RequestCancelled``: raised inside a request cancelled at the drain deadline, or
  (as its subclass ``forkserve.RequestTimedOut``) past --request-timeout.
- ``forkserve.on_worker_exit(fn, *args, **kwargs)``: run when this worker exits gracefully
  (after its drain, a HUP replacement, a max-requests recycle), before its atexit handlers.
- ``forkserve.background.submit(fn, *args, **kwargs)``: the worker's background pool.
- ``forkserve.telemetry.span(name, **attributes)``: record a span (``--span-log``).
"""

__version__ = "0.1.0"

from forkserve import background, telemetry  # noqa: E402  (public submodules)
from forkserve.context import (RequestCancelled, RequestTimedOut, finish_request,  # noqa: E402
                               register_shutdown_function)
from forkserve.exits import on_worker_exit  # noqa: E402

__all__ = ["RequestCancelled", "RequestTimedOut", "__version__", "background", "finish_request",
           "on_worker_exit", "register_shutdown_function", "telemetry"]
