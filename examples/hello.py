"""The smallest WSGI app: ``forkserve examples.hello:app``."""


def app(environ, start_response):
    body = b"Hello, World!\n"
    start_response("200 OK", [("Content-Type", "text/plain"), ("Content-Length", str(len(body)))])
    return [body]
