"""Options that change where and how the app is loaded and where the server listens."""

from __future__ import annotations

import socket

import requests

from tests.harness import children, wait_for


def test_preload_imports_the_app_once_in_the_arbiter(server_factory, tmp_path):
    record = tmp_path / "imports"
    server = server_factory("--preload", app="tests.apps.options:app",
                            env={"TESTAPP_IMPORT_RECORD": str(record)}).wait_ready()
    importers = record.read_text().split()
    assert importers == [str(server.pid)], "with --preload only the arbiter imports the app"
    pids = {requests.get(server.url, timeout=10).text.split()[0] for _ in range(6)}
    assert pids <= {str(p) for p in server.workers()}
    assert str(server.pid) not in pids, "the arbiter never serves requests"


def test_without_preload_each_worker_imports_the_app(server_factory, tmp_path):
    record = tmp_path / "imports"
    server = server_factory(app="tests.apps.options:app",
                            env={"TESTAPP_IMPORT_RECORD": str(record)}).wait_ready()
    importers = set(record.read_text().split())
    assert str(server.pid) not in importers
    assert importers == {str(p) for p in server.workers()}


def test_chdir_loads_the_app_from_that_directory(server_factory, tmp_path):
    appdir = tmp_path / "site"
    appdir.mkdir()
    (appdir / "chdir_app.py").write_text(
        "import os\n"
        "def app(environ, start_response):\n"
        "    body = os.getcwd().encode()\n"
        "    start_response('200 OK', [('Content-Length', str(len(body)))])\n"
        "    return [body]\n")
    server = server_factory("--chdir", str(appdir), app="chdir_app:app", cwd="/").wait_ready()
    assert requests.get(server.url, timeout=10).text == str(appdir)


def test_adopts_a_listening_socket_passed_as_fd(server_factory):
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    port = listener.getsockname()[1]
    fd = listener.fileno()
    try:
        server = server_factory("-b", f"fd://{fd}", bind=None, pass_fds=(fd,)).wait_ready()
        record = server.wait_log("Starting forkserve")
        assert record["listening"] == f"127.0.0.1:{port}"
        response = requests.get(f"http://127.0.0.1:{port}/", timeout=10)
        assert response.text == "hello\n"
    finally:
        listener.close()


def test_fd_that_is_not_a_listening_socket_is_one_line_exit_1(server_factory, tmp_path):
    with open(tmp_path / "plain", "w") as fh:
        fd = fh.fileno()
        server = server_factory("-b", f"fd://{fd}", bind=None, pass_fds=(fd,), json_logs=False)
        assert server.wait_exit() == 1
    server.wait_text(f"fd://{fd}")
    errors = [line for line in server.lines if line.strip()]
    assert len(errors) == 1, errors
    assert "not a usable socket" in errors[0] or "not a" in errors[0]


def test_several_binds_all_serve(server_factory, tmp_path):
    path = tmp_path / "s.sock"
    server = server_factory("-b", f"unix:{path}").wait_ready()
    listening = server.wait_log("Starting forkserve")["listening"]
    assert f"unix:{path}" in listening
    assert requests.get(server.url, timeout=10).text == "hello\n"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as client:
        client.settimeout(10)
        client.connect(str(path))
        client.sendall(b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        data = b""
        while chunk := client.recv(65536):
            data += chunk
    assert data.startswith(b"HTTP/1.1 200 ") and data.endswith(b"hello\n")
    server.signal(15)
    assert server.wait_exit() == 0
    wait_for(lambda: not path.exists(), 5, "the unix socket file to be removed at exit")


def test_worker_count_from_the_environment(server_factory):
    server = server_factory(workers=0, env={"FORKSERVE_WORKERS": "3"}).wait_ready()
    assert len(wait_for(lambda: len(server.workers()) == 3 and server.workers(), 10,
                        "three workers")) == 3
    assert len(children(server.pid)) == 3
