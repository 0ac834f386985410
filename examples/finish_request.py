"""Answer the client first, then finish the work: ``forkserve.finish_request()``.

``POST /orders?id=42`` answers ``202 Accepted`` at once. After ``finish_request()`` the client
has its whole response and the connection is closed; the app goes on: it notifies a webhook
(when ``WEBHOOK_URL`` is set: the slow part nobody should wait for) and then appends an audit
record to ``AUDIT_LOG``. Until the app returns the request still counts as in flight, so a
TERM meanwhile waits for the audit record before the server exits 0.

    AUDIT_LOG=/tmp/audit.log forkserve examples.finish_request:app
    curl -X POST 'http://127.0.0.1:8000/orders?id=42'; cat /tmp/audit.log
"""

import os
import time
import urllib.request
from urllib.parse import parse_qs

import forkserve

AUDIT_LOG = os.environ.get("AUDIT_LOG", "audit.log")
WEBHOOK_URL = os.environ.get("WEBHOOK_URL")


def app(environ, start_response):
    order = parse_qs(environ["QUERY_STRING"]).get("id", ["?"])[0]
    body = b"accepted\n"
    start_response("202 Accepted", [("Content-Type", "text/plain"),
                                    ("Content-Length", str(len(body)))])
    yield body
    forkserve.finish_request()  # the client has its answer; what follows is ours alone

    if WEBHOOK_URL:
        with urllib.request.urlopen(WEBHOOK_URL, data=f"order {order}".encode(), timeout=10):
            pass
    # One write of one short line with O_APPEND: lines from several workers never interleave.
    with open(AUDIT_LOG, "a", encoding="utf-8") as audit:
        audit.write(f"{time.time():.3f} {os.getpid()} order {order!r} accepted\n")
