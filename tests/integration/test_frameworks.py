"""Real framework applications served by real forkserve servers (issue 14).

``examples/flask_app`` and ``examples/django_project`` are started exactly as the README says
(``--chdir examples/... app:app``, ``mysite.wsgi:application``, from the repository's root),
on each worker class, and driven with ``requests``: a JSON route, a form (for Django, its CSRF
round trip: a POST without the token is refused with 403), a file upload answered with its
SHA-256, static files through WhiteNoise, and a TERM while requests are held in flight
(``tests.apps.frameworks`` wraps the examples with a FIFO gate; nothing in them is for tests).

The servers run with ``PYTHONWARNINGS=default``, so a warning the frameworks raise in a worker
(a deprecation in how the examples use them) is written to the server's log, and every test
checks that its servers' logs hold none. Django's static files are collected once per module,
as a deployment's build step does, into a temporary ``DJANGO_STATIC_ROOT``.
"""

from __future__ import annotations

import hashlib
import os
import re
import signal
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest
import requests

from tests.harness import ROOT, Gate, Server

WORKER_CLASSES = ["sync", "thread", "gevent"]
by_worker_class = pytest.mark.parametrize("worker_class", WORKER_CLASSES)

FLASK_DIR = "examples/flask_app"
DJANGO_DIR = "examples/django_project"
STYLE = ROOT / DJANGO_DIR / "static" / "style.css"
BOOT_TIMEOUT = 60.0  # importing Django or Flask in each worker, on a loaded 2-core machine
REQUEST_TIMEOUT = 30.0
UPLOAD_SIZE = 3 * 1024 * 1024  # past Django's FILE_UPLOAD_MAX_MEMORY_SIZE: spooled to disk
WARNING_LINE = re.compile(r"\b\w*Warning: ")  # how the warnings module prints one


def django_env(static_root: Path) -> dict[str, str]:
    """The example's settings (whatever the environment running the tests may have set) and
    where its static files were collected."""
    return {"DJANGO_SETTINGS_MODULE": "mysite.settings", "DJANGO_STATIC_ROOT": str(static_root)}


@pytest.fixture(scope="module")
def static_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``manage.py collectstatic`` into a temporary STATIC_ROOT, with warnings as errors."""
    root = tmp_path_factory.mktemp("django-static")
    done = subprocess.run([sys.executable, "-W", "error", "manage.py", "collectstatic", "--noinput"],
                          cwd=ROOT / DJANGO_DIR, env={**os.environ, **django_env(root)},
                          stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert (root / "staticfiles.json").exists(), done.stdout
    return root


@pytest.fixture
def served(server_factory: Callable[..., Server]) -> Iterator[Callable[..., Server]]:
    """``served(directory, app, worker_class, env=...)``: a ready server of the example in
    ``directory`` (``--chdir``, relative to the repository's root, where the harness starts
    it); at the end, its log must hold no warning."""
    started: list[Server] = []

    def start(directory: str, app: str, worker_class: str, *args: str,
              env: dict[str, str] | None = None) -> Server:
        server = server_factory("-k", worker_class, "--chdir", directory, *args, app=app,
                                env={"PYTHONWARNINGS": "default", **(env or {})})
        started.append(server)
        return server.wait_ready(BOOT_TIMEOUT)

    yield start
    for server in started:
        warnings = [line for line in server.log_text().splitlines() if WARNING_LINE.search(line)]
        assert not warnings, "\n".join(warnings)


def upload_body(size: int = UPLOAD_SIZE) -> bytes:
    return os.urandom(size)


def check_upload(response: requests.Response, data: bytes, filename: str) -> None:
    assert response.status_code == 200, response.text[:2000]
    assert response.json() == {"filename": filename, "size": len(data),
                               "sha256": hashlib.sha256(data).hexdigest()}


# -- Flask ------------------------------------------------------------------------------------

@by_worker_class
def test_flask_json_form_and_upload(served: Callable[..., Server], worker_class: str) -> None:
    server = served(FLASK_DIR, "app:app", worker_class)
    with requests.Session() as client:
        hello = client.get(f"{server.url}/api/hello", timeout=REQUEST_TIMEOUT)
        assert hello.status_code == 200
        assert hello.headers["Content-Type"] == "application/json"
        assert hello.json()["message"] == "Hello from Flask"
        assert hello.json()["pid"] in server.workers()

        page = client.get(f"{server.url}/form", timeout=REQUEST_TIMEOUT)
        assert page.status_code == 200 and 'name="name"' in page.text
        greeting = client.post(f"{server.url}/form", data={"name": "<forkserve>"},
                               timeout=REQUEST_TIMEOUT)
        assert greeting.status_code == 200
        assert "Hello, &lt;forkserve&gt;!" in greeting.text  # Jinja escaped the field
        assert client.post(f"{server.url}/form", data={}, timeout=REQUEST_TIMEOUT).status_code == 400

        data = upload_body()
        check_upload(client.post(f"{server.url}/upload", files={"file": ("blob.bin", data)},
                                 timeout=REQUEST_TIMEOUT), data, "blob.bin")
        assert client.post(f"{server.url}/upload", data={"x": "no file"},
                           timeout=REQUEST_TIMEOUT).status_code == 400


# -- Django -----------------------------------------------------------------------------------

def csrf_form(client: requests.Session, url: str) -> tuple[str, dict[str, str], str]:
    """GET the form: its csrfmiddlewaretoken, the csrftoken cookie Django set (also kept in
    ``client``), and the page."""
    page = client.get(f"{url}/form", timeout=REQUEST_TIMEOUT)
    assert page.status_code == 200, page.text[:2000]
    cookie = page.cookies.get("csrftoken")
    assert cookie, page.headers
    match = re.search(r'name="csrfmiddlewaretoken" value="([^"]+)"', page.text)
    assert match, page.text
    return match.group(1), {"csrftoken": cookie}, page.text


@by_worker_class
def test_django_json_csrf_form_and_upload(served: Callable[..., Server], static_root: Path,
                                          worker_class: str) -> None:
    server = served(DJANGO_DIR, "mysite.wsgi:application", worker_class,
                    env=django_env(static_root))
    url = server.url
    with requests.Session() as client:
        hello = client.get(f"{url}/api/hello", timeout=REQUEST_TIMEOUT)
        assert hello.status_code == 200
        assert hello.headers["Content-Type"] == "application/json"
        assert hello.json()["message"] == "Hello from Django"
        assert hello.json()["pid"] in server.workers()

        token, cookie, _ = csrf_form(client, url)
        greeting = client.post(f"{url}/form", data={"name": "<forkserve>",
                                                    "csrfmiddlewaretoken": token},
                               timeout=REQUEST_TIMEOUT)
        assert greeting.status_code == 200, greeting.text[:2000]
        assert "Hello, &lt;forkserve&gt;!" in greeting.text

        data = upload_body()
        check_upload(client.post(f"{url}/upload", files={"file": ("blob.bin", data)},
                                 data={"csrfmiddlewaretoken": token}, timeout=REQUEST_TIMEOUT),
                     data, "blob.bin")

    # Without the token, with the cookie but no token, or with a wrong token: 403, from
    # CsrfViewMiddleware before the view runs.
    refusals = [
        requests.post(f"{url}/form", data={"name": "x"}, timeout=REQUEST_TIMEOUT),
        requests.post(f"{url}/form", data={"name": "x"}, cookies=cookie, timeout=REQUEST_TIMEOUT),
        requests.post(f"{url}/form", data={"name": "x", "csrfmiddlewaretoken": "x" * 64},
                      cookies=cookie, timeout=REQUEST_TIMEOUT),
        requests.post(f"{url}/upload", files={"file": ("blob.bin", b"data")}, cookies=cookie,
                      timeout=REQUEST_TIMEOUT),
    ]
    assert [r.status_code for r in refusals] == [403] * 4
    assert server.wait_text("Forbidden (CSRF"), "Django logs its refusals to stderr"

    # DEBUG is off: a 404 is the plain page, and a Host outside ALLOWED_HOSTS is a 400.
    missing = requests.get(f"{url}/no-such-page", timeout=REQUEST_TIMEOUT)
    assert missing.status_code == 404 and "DEBUG = True" not in missing.text
    foreign = requests.get(f"{url}/api/hello", headers={"Host": "evil.example"},
                           timeout=REQUEST_TIMEOUT)
    assert foreign.status_code == 400


@by_worker_class
def test_django_static_files_through_whitenoise(served: Callable[..., Server], static_root: Path,
                                                worker_class: str) -> None:
    server = served(DJANGO_DIR, "mysite.wsgi:application", worker_class,
                    env=django_env(static_root))
    with requests.Session() as client:
        _, _, page = csrf_form(client, server.url)
        match = re.search(r'href="(/static/style\.[0-9a-f]{12}\.css)"', page)
        assert match, f"{{% static %}} gave no content-hashed name: {page}"
        hashed = client.get(server.url + match.group(1), headers={"Accept-Encoding": "gzip"},
                            timeout=REQUEST_TIMEOUT)
        plain = client.get(f"{server.url}/static/style.css", headers={"Accept-Encoding": "identity"},
                           timeout=REQUEST_TIMEOUT)
        missing = client.get(f"{server.url}/static/nothing.css", timeout=REQUEST_TIMEOUT)
    expected = STYLE.read_bytes()
    assert hashed.status_code == 200
    # WhiteNoise's headers: a hashed name never changes, so it is cached for ten years...
    assert hashed.headers["Cache-Control"] == "max-age=315360000, public, immutable"
    # ...and sent as the gzip file collectstatic made, chosen by Accept-Encoding.
    assert hashed.headers["Content-Encoding"] == "gzip"
    assert hashed.headers["Vary"] == "Accept-Encoding"
    assert hashed.headers["Content-Type"].startswith("text/css")
    assert "ETag" in hashed.headers and "Last-Modified" in hashed.headers
    assert hashed.content == expected  # (requests decoded the gzip)
    assert plain.status_code == 200 and plain.content == expected
    assert "Content-Encoding" not in plain.headers
    assert plain.headers["Cache-Control"] == "max-age=60, public"  # unhashed: WhiteNoise's short default
    assert missing.status_code == 404


# -- a graceful stop with framework requests in flight ----------------------------------------

def held_requests(worker_class: str) -> int:
    """Requests held at once: one per sync worker (of the two), more for the others."""
    return 2 if worker_class == "sync" else 4


def drain_with_requests_held(server: Server, gates: Callable[[str], Gate],
                             send: Callable[[int, Gate], requests.Response],
                             count: int) -> list[requests.Response]:
    """Hold ``count`` requests (``send(n, gate)``) in the app, TERM the server once all are
    in, release them once it has stopped accepting: their responses, and exit code 0."""
    held = [gates(f"held-{n}") for n in range(count)]
    with ThreadPoolExecutor(count) as pool:
        futures = []
        for n, gate in enumerate(held):
            # One at a time: sent together, two clients may reach one sync worker's poller,
            # which takes one to the app while the other waits behind it (the sync design,
            # see the README), and a second worker never sees it.
            futures.append(pool.submit(send, n, gate))
            gate.wait_entered(REQUEST_TIMEOUT)
        server.signal(signal.SIGTERM)
        server.wait_log("Stopped accepting")
        assert server.proc.poll() is None, "the server must wait for the held requests"
        for gate in held:
            gate.release()
        responses = [future.result(timeout=REQUEST_TIMEOUT) for future in futures]
    assert server.wait_exit(REQUEST_TIMEOUT) == 0, server.log_text()
    assert server.count_log("Drain timeout reached") == 0
    return responses


def term_answers_mixed_requests(server: Server, gates: Callable[[str], Gate], worker_class: str,
                                greeting: str, **upload: Any) -> None:
    """JSON GETs and 3 MiB uploads (``upload``: more for requests.post, e.g. a CSRF token)
    held in the app across a TERM: each answered in full, then exit 0."""
    data = upload_body()

    def send(n: int, gate: Gate) -> requests.Response:
        headers = {"X-Test-Gate": str(gate.path)}
        if n % 2:
            return requests.get(f"{server.url}/api/hello", headers=headers, timeout=REQUEST_TIMEOUT)
        return requests.post(f"{server.url}/upload", files={"file": (f"{n}.bin", data)},
                             headers=headers, timeout=REQUEST_TIMEOUT, **upload)

    responses = drain_with_requests_held(server, gates, send, held_requests(worker_class))
    for n, response in enumerate(responses):
        if n % 2:
            assert response.status_code == 200 and response.json()["message"] == greeting
        else:
            check_upload(response, data, f"{n}.bin")


@by_worker_class
def test_flask_term_answers_every_request_in_flight(served: Callable[..., Server],
                                                    gates: Callable[[str], Gate],
                                                    worker_class: str) -> None:
    server = served(FLASK_DIR, "tests.apps.frameworks:flask()", worker_class)
    term_answers_mixed_requests(server, gates, worker_class, "Hello from Flask")


@by_worker_class
def test_django_term_answers_every_request_in_flight(served: Callable[..., Server],
                                                     gates: Callable[[str], Gate],
                                                     static_root: Path, worker_class: str) -> None:
    server = served(DJANGO_DIR, "tests.apps.frameworks:django()", worker_class,
                    env=django_env(static_root))
    with requests.Session() as client:
        token, cookie, _ = csrf_form(client, server.url)
    term_answers_mixed_requests(server, gates, worker_class, "Hello from Django",
                                data={"csrfmiddlewaretoken": token}, cookies=cookie)
