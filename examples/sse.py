"""Server-sent events that end cleanly when the server stops.

``GET /clock`` is a ``text/event-stream`` of one event per ``interval`` seconds (default 1),
which never ends by itself. When the worker stops (TERM, a reload, an upgrade) forkserve ends
the stream after the event it just sent: the chunked body is terminated, so the client sees a
clean end after a whole event and reconnects (with ``Last-Event-ID``) to whoever serves next,
and the generator is closed (``GeneratorExit`` at its ``yield``). No drain timeout is spent.

    forkserve examples.sse:app -k gevent     # a greenlet per stream; sync and thread work too
    curl -N 'http://127.0.0.1:8000/clock?interval=0.5'
"""

import time
from urllib.parse import parse_qs


def app(environ, start_response):
    interval = float(parse_qs(environ["QUERY_STRING"]).get("interval", ["1"])[0])
    start_response("200 OK", [("Content-Type", "text/event-stream"),
                              ("Cache-Control", "no-cache")])
    last = environ.get("HTTP_LAST_EVENT_ID", "")  # a reconnecting client resumes after it
    return clock(interval, int(last) + 1 if last.isdigit() else 0)


def clock(interval, first_id):
    n = first_id
    while True:
        yield f"id: {n}\nevent: tick\ndata: {time.time():.3f}\n\n".encode()
        n += 1
        time.sleep(interval)
