"""Run ``python -m forkserve`` as a real process group and watch it.

One ``wait_for(predicate, timeout)``, one log reader with a monotonic deadline: no bare sleeps.
The server binds port 0 and the harness reads the real port from its "Starting forkserve" log
line. Teardown kills the whole process group and asserts that no process of it is left.
"""

from __future__ import annotations

import errno
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_TIMEOUT = 15.0


def wait_for(predicate: Callable[[], Any], timeout: float = DEFAULT_TIMEOUT,
             what: str | Callable[[], str] = "condition", interval: float = 0.02) -> Any:
    """Poll ``predicate`` until it returns something truthy; fail after ``timeout`` seconds.
    ``what`` may be a callable: it is then called at the failure (a server log as it is by
    then, not as it was when the wait began)."""
    deadline = time.monotonic() + timeout
    while True:
        result = predicate()
        if result:
            return result
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for "
                                 f"{what() if callable(what) else what}")
        time.sleep(interval)


def wait_for_threads(pid: int, count: int, timeout: float = 15.0) -> None:
    """Until process ``pid`` runs ``count`` threads or more. A thread worker starts its poll
    loop and request threads after it forks, and load does not wait for every worker: on a
    loaded machine one may still be starting them while its sibling serves every request
    (seen: 2 threads of 5). Read what a test counts of a worker's threads after this."""
    wait_for(lambda: len(os.listdir(f"/proc/{pid}/task")) >= count, timeout,
             f"{count} threads in process {pid}")


def worker_set(server: "Server", count: int, timeout: float = 10.0) -> set[int]:
    """Wait until the arbiter has exactly ``count`` children; return their pids."""
    return set(wait_for(lambda: len(server.workers()) == count and server.workers(), timeout,
                        f"{count} workers, have {server.workers()}"))


def process_group(pgid: int) -> list[int]:
    """Live (non-zombie) processes of a process group, read from /proc."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", encoding="ascii", errors="replace") as fh:
                stat = fh.read()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        state, group = fields[0], int(fields[2])
        if group == pgid and state != "Z":
            pids.append(int(entry))
    return pids


def children(pid: int) -> list[int]:
    result: list[int] = []
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/children", encoding="ascii") as fh:
                result.extend(int(p) for p in fh.read().split())
    except OSError:
        return []
    return result


def open_fds(pid: int) -> list[str]:
    try:
        return sorted(os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return []


class Server:
    """A forkserve process group. Lines of its error log are parsed as JSON records."""

    def __init__(self, *args: str, app: str = "tests.apps.basic:app",
                 env: dict[str, str] | None = None, cwd: Path | str = ROOT, json_logs: bool = True,
                 bind: str | None = "127.0.0.1:0", workers: int = 2,
                 pass_fds: tuple[int, ...] = ()) -> None:
        argv = [sys.executable, "-m", "forkserve"]
        if bind is not None:
            argv += ["-b", bind]
        if workers:
            argv += ["-w", str(workers)]
        if json_logs:
            argv += ["--log-format", "json"]
        argv += list(args)
        if app:
            argv.append(app)
        self._launch(argv, dict(os.environ), env, cwd, pass_fds)

    def _launch(self, argv: list[str], base_env: dict[str, str], env: dict[str, str] | None,
                cwd: Path | str, pass_fds: tuple[int, ...]) -> None:
        """Start ``argv`` in a new session with the tests on PYTHONPATH, and read its output."""
        self.argv = argv
        full_env = dict(base_env)
        # The platform's defaults (a CI runner or a PaaS shell may set them) only when a test
        # asks for them: else they would change every test server's bind and worker count.
        for name in ("PORT", "WEB_CONCURRENCY", "FORWARDED_ALLOW_IPS"):
            full_env.pop(name, None)
        full_env["PYTHONPATH"] = str(ROOT) + os.pathsep + full_env.get("PYTHONPATH", "")
        full_env.update(env or {})
        self.proc = subprocess.Popen(argv, cwd=str(cwd), env=full_env, stdin=subprocess.DEVNULL,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     start_new_session=True, pass_fds=pass_fds)
        self.pid = self.proc.pid
        self.lines: list[str] = []
        self.stdout_lines: list[str] = []
        # The error log's JSON records, each parsed once as its line comes: a wait_log polls
        # every 20 ms, and parsing the whole log at each poll cost a long test (twenty HUPs,
        # thousands of lines) more CPU than the server it watched.
        self._records: list[dict[str, Any]] = []
        self._lock = threading.Lock()
        self._readers = [
            threading.Thread(target=self._read, args=(self.proc.stderr, self.lines, self._records),
                             daemon=True),
            threading.Thread(target=self._read, args=(self.proc.stdout, self.stdout_lines, None),
                             daemon=True),
        ]
        for reader in self._readers:
            reader.start()
        self._port: int | None = None

    def _read(self, stream: Any, sink: list[str], records: list[dict[str, Any]] | None) -> None:
        for raw in iter(stream.readline, b""):
            line = raw.decode("utf-8", "replace").rstrip("\n")
            parsed = json_records([line]) if records is not None else []
            with self._lock:
                sink.append(line)
                if records is not None and parsed:
                    records.append(parsed[0])

    # -- logs ----------------------------------------------------------------------------
    def records(self) -> list[dict[str, Any]]:
        with self._lock:
            return list(self._records)

    def log_text(self) -> str:
        with self._lock:
            return "\n".join(self.lines)

    def wait_log(self, message: str, timeout: float = DEFAULT_TIMEOUT, **fields: Any) -> dict[str, Any]:
        """The first JSON record whose message contains ``message`` and has ``fields``. Fails
        at once (not at the timeout) when the server exited without logging it."""
        def find() -> dict[str, Any] | None:
            for record in self.records():
                if message in record.get("message", "") and all(
                        record.get(k) == v for k, v in fields.items()):
                    return record
            return None

        def found_or_exited() -> dict[str, Any] | bool | None:
            record = find()
            if record is not None:
                return record
            if self.proc.poll() is None:
                return None
            for reader in self._readers:
                reader.join(5)  # whatever the process wrote is in the buffers after this
            return find() or True

        result = wait_for(found_or_exited, timeout,
                          lambda: f"log line {message!r} {fields or ''}\n{self.log_text()}")
        if result is True:
            raise AssertionError(f"the server exited (code {self.proc.returncode}) without "
                                 f"logging {message!r} {fields or ''}\n{self.log_text()}")
        return result  # type: ignore[no-any-return]

    def count_log(self, message: str) -> int:
        return sum(1 for r in self.records() if message in r.get("message", ""))

    def wait_text(self, text: str, timeout: float = DEFAULT_TIMEOUT) -> str:
        return wait_for(lambda: text in self.log_text() and self.log_text(), timeout,  # type: ignore[no-any-return]
                        lambda: f"{text!r} in the log\n{self.log_text()}")

    # -- addresses -------------------------------------------------------------------------
    @property
    def port(self) -> int:
        if self._port is None:
            record = self.wait_log("Starting forkserve")
            first = str(record["listening"]).split(",")[0]
            self._port = int(first.rsplit(":", 1)[1])
        return self._port

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def status_port(self) -> int:
        """The --status-bind port (start the server with ``--status-bind 127.0.0.1:0``)."""
        record = self.wait_log("Status server listening")
        return int(str(record["status_bind"]).rsplit(":", 1)[1])

    @property
    def status_url(self) -> str:
        return f"http://127.0.0.1:{self.status_port}"

    def wait_ready(self, timeout: float = DEFAULT_TIMEOUT) -> "Server":
        self.wait_log("Server ready", timeout)
        return self

    def connect(self, timeout: float = 10.0) -> socket.socket:
        return socket.create_connection(("127.0.0.1", self.port), timeout=timeout)

    # -- processes ---------------------------------------------------------------------------
    def workers(self) -> list[int]:
        return children(self.pid)

    def signal(self, signum: int) -> None:
        os.kill(self.pid, signum)

    def wait_exit(self, timeout: float = DEFAULT_TIMEOUT) -> int:
        """The exit code, once the process exited and its output is read to the end: a
        loaded machine can run the test before the reader threads took the last lines."""
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"server did not exit within {timeout}s\n{self.log_text()}") from None
        for reader in self._readers:
            reader.join(5)  # EOF once the server and its workers are gone
        return code

    def close(self) -> None:
        """Kill the process group. A server that exited by itself must have left no worker."""
        exited = self.proc.poll() is not None
        orphans: list[int] = []
        if exited:
            try:
                wait_for(lambda: not process_group(self.pid), 3, "the workers to exit")
            except AssertionError:
                orphans = process_group(self.pid)
        try:
            os.killpg(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(10)
        for reader in self._readers:
            reader.join(5)
        for stream in (self.proc.stdout, self.proc.stderr):
            if stream is not None:
                stream.close()
        wait_for(lambda: not process_group(self.pid), 5, "the process group to be gone")
        assert not orphans, f"processes outlived the server: {orphans}\n{self.log_text()}"

    def __enter__(self) -> "Server":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def json_records(lines: list[str]) -> list[dict[str, Any]]:
    """The lines that are JSON objects, parsed (a log may also hold a traceback, text)."""
    out = []
    for line in lines:
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict):
            out.append(record)
    return out


def read_json_file(path: Path) -> list[dict[str, Any]]:
    """The JSON-object lines of a file written by a server (none while it does not exist)."""
    return json_records(path.read_text().splitlines()) if path.exists() else []


def wait_file_record(path: Path, message: str, timeout: float = 10.0) -> dict[str, Any]:
    """The first record of a JSON log file whose message contains ``message``."""
    def find() -> dict[str, Any] | None:
        return next((r for r in read_json_file(path) if message in r.get("message", "")), None)
    return wait_for(find, timeout, f"{message!r} in {path}")  # type: ignore[no-any-return]


def raw_request(port: int, data: bytes, timeout: float = 10.0, read_until_close: bool = True) -> bytes:
    """Send raw bytes, return everything the server sends until it closes (or times out)."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        sock.sendall(data)
        chunks = []
        while True:
            try:
                chunk = sock.recv(65536)
            except socket.timeout:
                break
            if not chunk:
                break
            chunks.append(chunk)
            if not read_until_close:
                break
        return b"".join(chunks)


# -- raw HTTP helpers and in-flight gates ---------------------------------------------------

class Response:
    def __init__(self, status: int, headers: dict[str, str], body: bytes) -> None:
        self.status = status
        self.headers = headers
        self.body = body


def read_head(sock: socket.socket, timeout: float = 10.0) -> tuple[int, dict[str, str], bytes]:
    """One response head: status, lower-cased headers, and the bytes read past the head."""
    sock.settimeout(timeout)
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            raise ConnectionError(f"connection closed before a full response head: {data!r}")
        data += chunk
    return parse_head(data)


def parse_head(data: bytes) -> tuple[int, dict[str, str], bytes]:
    """Status, headers (names lower-cased) and what follows the head, of bytes that hold a
    whole response head."""
    head, _, rest = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {}
    for line in lines[1:]:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    return int(lines[0].split()[1]), headers, rest


def read_response(sock: socket.socket, timeout: float = 10.0) -> Response:
    """Read one response framed by Content-Length (the test apps always send one)."""
    status, headers, body = read_head(sock, timeout)
    length = int(headers.get("content-length", "0"))
    while len(body) < length:
        chunk = sock.recv(65536)
        if not chunk:
            raise ConnectionError(f"body truncated: {len(body)} of {length} bytes")
        body += chunk
    return Response(status, headers, body[:length])


def send_get(port: int, path: str, close: bool = True, timeout: float = 10.0) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=timeout)
    extra = "Connection: close\r\n" if close else ""
    sock.sendall(f"GET {path} HTTP/1.1\r\nHost: test\r\n{extra}\r\n".encode())
    return sock


def get(port: int, path: str, timeout: float = 10.0) -> Response:
    with send_get(port, path, timeout=timeout) as sock:
        return read_response(sock, timeout)


def closed_without_response(sock: socket.socket, timeout: float = 10.0) -> bool:
    sock.settimeout(timeout)
    try:
        return sock.recv(65536) == b""
    except ConnectionResetError:
        return True


def signal_pending(pid: int, signum: int) -> bool:
    """Is ``signum`` pending (sent, blocked or the process stopped, not yet delivered) for the
    process? (Linux: /proc's ShdPnd, where bit N-1 is signal N)"""
    try:
        with open(f"/proc/{pid}/status", encoding="ascii") as fh:
            fields = dict(line.split(":", 1) for line in fh if ":" in line)
    except OSError:
        return False
    return bool(int(fields["ShdPnd"].strip(), 16) >> (signum - 1) & 1)


def refused(port: int) -> bool:
    """Is a new connection to this port refused? A stopping server drops new SYNs until its
    port closes: a connect that times out is not refused yet (False: ask again)."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1.0):
            return False
    except ConnectionRefusedError:
        return True
    except TimeoutError:
        return False


class Gate:
    """A FIFO that ``/block?fifo=PATH`` waits on: the request stays in the app until released."""

    def __init__(self, path: Path) -> None:
        self.path = path
        os.mkfifo(path)
        self.fd: int | None = None

    @property
    def route(self) -> str:
        return f"/block?fifo={self.path}"

    def wait_entered(self, timeout: float = 10.0) -> None:
        """Until the app has opened the FIFO: the request is in flight, inside the app."""
        def try_open() -> bool:
            try:
                self.fd = os.open(self.path, os.O_WRONLY | os.O_NONBLOCK)
            except OSError as exc:
                if exc.errno == errno.ENXIO:  # no reader yet
                    return False
                raise
            return True
        wait_for(try_open, timeout, f"a request to block on {self.path}")

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def usr2_with_its_check_held(server_factory: Any, gates: Any, tmp_path: Path,
                             *args: str) -> tuple["Server", Gate, Path]:
    """A ready server on ``tests.apps.status:app`` that got a USR2 whose check (its import of
    the app) now waits on a gate: (the server, the gate, the gate's path). Release the gate
    and unlink the path to let the upgrade go on; the new image's workers then boot at once."""
    boot = tmp_path / "boot"  # absent: the first generation boots at once
    server = server_factory(*args, app="tests.apps.status:app",
                            env={"STATUS_BOOT_GATE": str(boot)}).wait_ready()
    gate = gates("boot")  # the upgrade's check imports the app: it waits here
    server.signal(signal.SIGUSR2)
    server.wait_log("Upgrade requested")
    gate.wait_entered(20)
    return server, gate, boot
