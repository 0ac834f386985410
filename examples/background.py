"""Work the response need not wait for: ``forkserve.background.submit``.

``POST /signup?email=ada@example.com`` answers ``202 Accepted`` and queues the welcome email in
the worker's background pool (``--background-threads``, 2 by default). The email is "sent" by
writing it to ``OUTBOX`` after ``SEND_SECONDS`` (a stand-in for a slow mail server). At TERM the
drain waits for queued and running tasks; a task still queued when the drain timeout ends it
is never started, and the worker logs it by name (``Background task not started before
shutdown``, ``task=send_welcome_email``): never dropped silently.

    OUTBOX=/tmp/outbox forkserve examples.background:app
    curl -X POST 'http://127.0.0.1:8000/signup?email=ada@example.com'; ls /tmp/outbox
"""

import os
import time
from urllib.parse import parse_qs

import forkserve

OUTBOX = os.environ.get("OUTBOX", "outbox")
SEND_SECONDS = float(os.environ.get("SEND_SECONDS", "0.5"))


def send_welcome_email(address):
    time.sleep(SEND_SECONDS)  # the mail server takes its time
    os.makedirs(OUTBOX, exist_ok=True)
    with open(os.path.join(OUTBOX, f"{address}.eml"), "w", encoding="utf-8") as mail:
        mail.write(f"To: {address}\nSubject: Welcome!\n\nThanks for signing up.\n")


def app(environ, start_response):
    address = parse_qs(environ["QUERY_STRING"]).get("email", [""])[0]
    if "@" not in address or "/" in address:
        return respond(start_response, "400 Bad Request", b"email=ADDRESS, please\n")
    forkserve.background.submit(send_welcome_email, address)
    return respond(start_response, "202 Accepted", b"welcome email queued\n")


def respond(start_response, status, body):
    start_response(status, [("Content-Type", "text/plain"), ("Content-Length", str(len(body)))])
    return [body]
