"""Sans-IO HTTP/1.1 for forkserve: bytes in, events out; responses framed to bytes.

Owns: request parsing (on httptools/llhttp, never by hand), request limits, and response
framing. Must not import sockets, WSGI, workers or config: only its own modules.
"""

from forkserve.http.errors import HTTPError
from forkserve.http.parser import END, EndOfMessage, Event, Limits, Request, RequestParser

__all__ = ["END", "EndOfMessage", "Event", "HTTPError", "Limits", "Request", "RequestParser"]
