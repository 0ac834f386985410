"""An application that refuses to start: it calls ``sys.exit(message)`` while being imported,
as a settings module does when a required variable is missing (the server must say so in one
line, exit 4, and not fork-loop)."""

import sys

sys.exit("FATAL: DATABASE_URL is not set")


def app(environ, start_response):  # never reached
    start_response("200 OK", [("Content-Length", "0")])
    return [b""]
