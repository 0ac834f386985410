"""An app that records which process imported it (for --preload tests)."""

import os

_record = os.environ.get("TESTAPP_IMPORT_RECORD")
if _record:
    with open(_record, "a", encoding="ascii") as fh:
        fh.write(f"{os.getpid()}\n")


def app(environ, start_response):
    body = f"{os.getpid()} {os.getcwd()}".encode()
    start_response("200 OK", [("Content-Type", "text/plain"), ("Content-Length", str(len(body)))])
    return [body]
