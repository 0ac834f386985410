"""A minimal Flask application served by forkserve (README: "Serving a Flask app").

From the repository's root::

    forkserve --chdir examples/flask_app app:app -w 2
    forkserve --chdir examples/flask_app 'app:create_app()'     # the factory, one app per worker

``--chdir`` changes the server's directory before the app is loaded, and the loader puts the
new current directory on ``sys.path``: ``app`` is this file, ``examples/flask_app/app.py``.

Routes: ``GET /api/hello`` (JSON), ``GET``/``POST /form`` (an HTML form and its answer),
``POST /upload`` (a multipart file upload, answered with its size and SHA-256).
Flask has no CSRF protection of its own (Flask-WTF adds it); the Django example shows one.
"""

from __future__ import annotations

import hashlib
import os

from flask import Flask, jsonify, render_template_string, request

FORM = """<!doctype html>
<title>forkserve + Flask</title>
<form method="post" action="/form">
  <input name="name"> <button>Greet</button>
</form>
<form method="post" action="/upload" enctype="multipart/form-data">
  <input type="file" name="file"> <button>Upload</button>
</form>
"""

GREETING = "<!doctype html>\n<p>Hello, {{ name }}!</p>\n"


def create_app() -> Flask:
    app = Flask(__name__)
    # Bigger bodies are refused with 413 before they are read.
    app.config["MAX_CONTENT_LENGTH"] = 16 * 1024 * 1024

    @app.get("/api/hello")
    def hello():  # type: ignore[no-untyped-def]
        return jsonify(message="Hello from Flask", pid=os.getpid())

    @app.get("/form")
    def form():  # type: ignore[no-untyped-def]
        return render_template_string(FORM)

    @app.post("/form")
    def greet():  # type: ignore[no-untyped-def]
        # request.form["name"] answers 400 Bad Request when the field is missing.
        return render_template_string(GREETING, name=request.form["name"])

    @app.post("/upload")
    def upload():  # type: ignore[no-untyped-def]
        upload = request.files["file"]
        digest = hashlib.sha256()
        size = 0
        for chunk in iter(lambda: upload.stream.read(65536), b""):
            digest.update(chunk)
            size += len(chunk)
        return jsonify(filename=upload.filename, size=size, sha256=digest.hexdigest())

    return app


app = create_app()
