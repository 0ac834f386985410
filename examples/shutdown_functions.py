"""Clean up however a request ends: ``forkserve.register_shutdown_function``.

``GET /jobs?key=nightly`` takes a lock (a file in ``LOCK_DIR``) and runs a job of ``steps``
short steps (0.1 s each). The lock's release is registered as a shutdown function, so it runs
when the request ends, however it ends: normally, with an exception (``fail=1``: a 500), or
cancelled at the drain deadline (``forkserve.RequestCancelled``). A second job with the same
key while the lock is held gets 409.

    LOCK_DIR=/tmp/locks forkserve examples.shutdown_functions:app
    curl 'http://127.0.0.1:8000/jobs?key=nightly&fail=1'   # 500, and the lock is released
    curl 'http://127.0.0.1:8000/jobs?key=nightly'          # 200
"""

import os
import tempfile
import time
from urllib.parse import parse_qs

import forkserve

LOCK_DIR = os.environ.get("LOCK_DIR", os.path.join(tempfile.gettempdir(), "forkserve-locks"))


def app(environ, start_response):
    query = {k: v[0] for k, v in parse_qs(environ["QUERY_STRING"]).items()}
    key = query.get("key", "default")
    if not key.isalnum():  # it names a file: no "../"
        return respond(start_response, "400 Bad Request", b"key: letters and digits only\n")
    os.makedirs(LOCK_DIR, exist_ok=True)
    lock = os.path.join(LOCK_DIR, f"{key}.lock")
    try:
        os.close(os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return respond(start_response, "409 Conflict", b"that job is running\n")
    forkserve.register_shutdown_function(os.remove, lock)  # from here on, released whatever happens

    for _ in range(int(query.get("steps", "5"))):
        time.sleep(0.1)  # one step of the job
    if query.get("fail"):
        raise RuntimeError(f"job {key} failed")  # a 500; the lock is released all the same
    return respond(start_response, "200 OK", b"done\n")


def respond(start_response, status, body):
    start_response(status, [("Content-Type", "text/plain"), ("Content-Length", str(len(body)))])
    return [body]
