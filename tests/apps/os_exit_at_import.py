"""An application that ends its process with ``os._exit(n)`` while being imported (n from
FORKSERVE_TEST_EXIT_CODE, default 7): no exception, no atexit, nothing written; the server
must still name what happened and exit 4."""

import os

os._exit(int(os.environ.get("FORKSERVE_TEST_EXIT_CODE", "7")))


def app(environ, start_response):  # never reached
    start_response("200 OK", [("Content-Length", "0")])
    return [b""]
