"""The gevent worker (issue 5) against real ``python -m forkserve -k gevent`` process groups.

Requests are held on FIFO gates (``tests/apps/drain.py``'s ``/held``, waited on cooperatively)
or in a patched ``time.sleep``; every wait is a bounded ``wait_for``, a socket timeout or a
selector loop with a monotonic deadline. The only waits for time itself are where time is the
point: "no response within 0.5 s", a drain deadline.
"""

from __future__ import annotations

import contextlib
import json
import resource
import select
import selectors
import signal
import socket
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterator
from urllib.parse import urlencode

import pytest

from tests.harness import (Server, get, open_fds, parse_head, read_response, send_get,
                           wait_for)

GEVENT = ("-k", "gevent")
DEADLINE = "Drain timeout reached, cancelling in-flight requests"


# -- helpers ------------------------------------------------------------------------------------

def target(path: str, **params: Any) -> str:
    return f"{path}?{urlencode(params)}" if params else path


def raise_fd_limit(needed: int) -> None:
    """The test process needs ``needed`` fds, and so does the server (it inherits this limit)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft >= needed:
        return
    if hard != resource.RLIM_INFINITY and hard < needed:
        pytest.skip(f"RLIMIT_NOFILE hard limit {hard} < {needed}")
    resource.setrlimit(resource.RLIMIT_NOFILE, (needed, hard))


def fd_limit_of(pid: int) -> int:
    with open(f"/proc/{pid}/limits", encoding="ascii") as fh:
        for line in fh:
            if line.startswith("Max open files"):
                return int(line.split()[3])
    raise AssertionError(f"no open-files limit for {pid}")


def socket_fds(pid: int) -> int:
    return sum(1 for target_ in open_fds(pid) if target_.startswith("socket:"))


def gevent_server(factory: Callable[..., Server], *args: str, app: str = "tests.apps.gevent:app",
                  **kwargs: Any) -> Server:
    return factory(*GEVENT, *args, app=app, workers=1, **kwargs).wait_ready()


def request_bytes(path: str, close: bool = False) -> bytes:
    extra = "Connection: close\r\n" if close else ""
    return f"GET {path} HTTP/1.1\r\nHost: test\r\n{extra}\r\n".encode()


def read_all_responses(socks: list[socket.socket], timeout: float) -> dict[socket.socket, Any]:
    """One Content-Length response from each socket, read concurrently with a deadline.
    Returns {sock: (status, headers, body)} for those that answered in time."""
    buffers = {sock: b"" for sock in socks}
    done: dict[socket.socket, Any] = {}
    sel = selectors.DefaultSelector()
    for sock in socks:
        sock.setblocking(False)
        sel.register(sock, selectors.EVENT_READ)
    deadline = time.monotonic() + timeout
    try:
        while len(done) < len(socks):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            for key, _ in sel.select(remaining):
                sock = key.fileobj
                try:
                    data = sock.recv(65536)  # type: ignore[union-attr]
                except BlockingIOError:
                    continue
                if not data:
                    sel.unregister(sock)
                    done[sock] = ("closed", {}, buffers[sock])  # type: ignore[index]
                    continue
                buffers[sock] += data  # type: ignore[index]
                parsed = _parse_response(buffers[sock])  # type: ignore[index]
                if parsed is not None:
                    sel.unregister(sock)
                    done[sock] = parsed  # type: ignore[index]
    finally:
        sel.close()
        for sock in socks:
            sock.settimeout(10)
    return done


def _parse_response(data: bytes) -> tuple[int, dict[str, str], bytes] | None:
    if b"\r\n\r\n" not in data:
        return None
    status, headers, body = parse_head(data)
    length = int(headers.get("content-length", "0"))
    if len(body) < length:
        return None
    return status, headers, body[:length]


@pytest.fixture
def sockets() -> Iterator[list[socket.socket]]:
    """Client sockets a test opens; all closed at teardown."""
    made: list[socket.socket] = []
    yield made
    for sock in made:
        sock.close()


# -- 1. monkey-patching before the app import -------------------------------------------------

def test_app_importing_ssl_threading_requests_sees_them_patched(server_factory: Any, gates: Any,
                                                                 sockets: list[socket.socket]) -> None:
    """tests/apps/patched.py imports ssl, threading and requests (and binds objects from them)
    at module level: every one it captured must already be gevent's, threading must be
    greenlet-backed, and gevent must not have warned about patching too late."""
    s = gevent_server(server_factory, app="tests.apps.patched:app")
    response = get(s.port, "/patched")
    assert response.status == 200, response.body
    report = json.loads(response.body)
    assert report["modules"] == {name: True for name in ("socket", "ssl", "threading", "time",
                                                          "select")}, report
    # Captured at the app's import: an unpatched original here is the classic bug.
    assert not any(report["captured_original"].values()), report["captured_original"]
    assert all(report["captured_is_current"].values()), report["captured_is_current"]
    assert report["ssl_context_module"].startswith("gevent"), report
    assert report["thread_class"].startswith("gevent.") and "Dummy" in report["thread_class"], report
    assert report["ident_is_greenlet"] is True, report

    # threading.get_ident() is per greenlet: three requests held at once, three idents.
    held = [gates(f"ident-{i}") for i in range(3)]
    for gate in held:
        sockets.append(send_get(s.port, target("/ident", fifo=gate.path)))
    for gate in held:
        gate.wait_entered()  # all three in the app at once, on one worker
    for gate in held:
        gate.release()
    idents = [json.loads(read_response(sock).body) for sock in sockets]
    assert len({r["ident"] for r in idents}) == 3, idents
    assert all(r["ident"] == r["greenlet"] for r in idents), idents

    # requests is cooperative: a single worker can call itself.
    response = get(s.port, target("/self", port=s.port), timeout=10)
    assert response.status == 200, response.body
    assert json.loads(response.body)["status"] == 200

    assert "MonkeyPatchWarning" not in s.log_text(), s.log_text()
    s.signal(signal.SIGTERM)
    assert s.wait_exit(10) == 0
    assert "MonkeyPatchWarning" not in s.log_text(), s.log_text()


def test_ssl_imported_by_the_arbiter_is_patched_in_every_worker_before_and_after_a_reload(
        server_factory: Any) -> None:
    """The arbiter imports ssl (and gevent's modules) before forking, unpatched, so that the
    workers share those pages (workers.gevent.SHARED_MODULES); each worker's patch_all then
    patches that same module before the app is imported. Nothing in the arbiter may hold a
    name from ssl (gevent would warn, and that name would stay stdlib's): the app's captured
    objects are gevent's, on the first workers and on those a HUP forks."""
    s = server_factory(*GEVENT, app="tests.apps.patched:app", workers=1).wait_ready()
    assert "_ssl" in Path(f"/proc/{s.pid}/maps").read_text()  # loaded in the arbiter

    def check() -> None:
        report = json.loads(get(s.port, "/patched").body)
        assert report["modules"]["ssl"] is True, report
        assert not any(report["captured_original"].values()), report["captured_original"]
        assert report["ssl_context_module"].startswith("gevent"), report
    check()
    first = s.workers()
    s.signal(signal.SIGHUP)
    s.wait_log("Reload complete")
    wait_for(lambda: s.workers() and not set(s.workers()) & set(first), 15, "the new worker")
    check()
    assert "MonkeyPatchWarning" not in s.log_text(), s.log_text()


def test_preload_never_serves_an_app_imported_before_patching(server_factory: Any) -> None:
    """With --preload the arbiter imports the app before forking, so before the worker's
    patch_all(): the same class of bug. Either the server refuses the combination (exits with
    an error that says so) or the app it serves sees patched modules — never an app holding
    unpatched ssl/threading objects behind a MonkeyPatchWarning."""
    s = server_factory(*GEVENT, "--preload", app="tests.apps.patched:app", workers=1)
    wait_for(lambda: s.proc.poll() is not None or s.count_log("Server ready"), 15,
             "the server to start or refuse --preload with gevent")
    if s.proc.poll() is not None:
        assert s.wait_exit(5) != 0  # and its output is read to the end
        assert "preload" in s.log_text().lower(), s.log_text()
        return
    report = json.loads(get(s.port, "/patched").body)
    unpatched = [name for name, original in report["captured_original"].items() if original]
    assert not unpatched, f"the preloaded app holds unpatched objects: {unpatched}"
    assert "MonkeyPatchWarning" not in s.log_text(), s.log_text()


# -- 2. cooperative concurrency -----------------------------------------------------------------

def _timed_fast_request(port: int) -> float:
    started = time.monotonic()
    with send_get(port, "/fast", timeout=5) as sock:
        response = read_response(sock, 5)
    elapsed = time.monotonic() - started
    assert response.status == 200
    return elapsed


def test_twenty_gated_requests_in_one_worker_while_a_fast_one_is_answered(
        server_factory: Any, gates: Any, sockets: list[socket.socket]) -> None:
    s = gevent_server(server_factory)
    held = [gates(f"g{i}") for i in range(20)]
    for gate in held:
        sockets.append(send_get(s.port, target("/held", fifo=gate.path, size=3)))
    for gate in held:
        gate.wait_entered()  # 20 requests inside the app of one worker, at once
    fast = _timed_fast_request(s.port)
    assert fast < 0.1, f"a fast request took {fast * 1000:.0f} ms while 20 were held"
    for gate in held:
        gate.release()
    answers = read_all_responses(sockets, 10)
    assert sorted(a[0] for a in answers.values()) == [200] * 20, answers


def test_twenty_kept_alive_clients_that_block_at_once_are_served_at_once(
        server_factory: Any, gates: Any, sockets: list[socket.socket]) -> None:
    """Kept-alive connections wait between requests with no greenlet; the clients that send in
    one turn of the loop are served by one greenlet, one after the other. Twenty of them now
    send a request that blocks, in the same moment: each must get a greenlet of its own at
    once (not wait behind the first that blocked), a fast request on a 21st kept-alive
    connection is answered meanwhile, and every connection serves on afterwards."""
    s = gevent_server(server_factory)
    held = [gates(f"g{i}") for i in range(20)]
    for _ in range(21):
        sock = socket.create_connection(("127.0.0.1", s.port), timeout=10)
        sockets.append(sock)
        sock.sendall(request_bytes("/fast"))
    first = read_all_responses(sockets, 10)
    assert sorted(a[0] for a in first.values()) == [200] * 21, first
    for sock, gate in zip(sockets, held):
        sock.sendall(request_bytes(target("/held", fifo=gate.path, size=3)))
    for gate in held:
        gate.wait_entered()  # twenty requests inside the app at once, all from kept-alive clients
    started = time.monotonic()
    sockets[20].sendall(request_bytes("/fast"))
    fast = read_all_responses(sockets[20:], 5)
    elapsed = time.monotonic() - started
    assert [a[0] for a in fast.values()] == [200], fast
    assert elapsed < 0.5, f"a fast request took {elapsed * 1000:.0f} ms while 20 were held"
    for gate in held:
        gate.release()
    released = read_all_responses(sockets[:20], 10)
    assert sorted(a[0] for a in released.values()) == [200] * 20, released
    for sock in sockets:
        sock.sendall(request_bytes("/fast"))
    again = read_all_responses(sockets, 10)
    assert sorted(a[0] for a in again.values()) == [200] * 21, again


def test_twenty_sleeping_requests_complete_concurrently(server_factory: Any,
                                                        sockets: list[socket.socket]) -> None:
    s = gevent_server(server_factory)
    started = time.monotonic()
    for _ in range(20):
        sock = socket.create_connection(("127.0.0.1", s.port), timeout=10)
        sockets.append(sock)
        sock.sendall(request_bytes("/sleep?s=0.5", close=True))
    fast = _timed_fast_request(s.port)
    answers = read_all_responses(sockets, 10)
    total = time.monotonic() - started
    assert sorted(a[0] for a in answers.values()) == [200] * 20, answers
    assert len({json.loads(a[2])["ident"] for a in answers.values()}) == 20
    assert fast < 0.1, f"a fast request took {fast * 1000:.0f} ms while 20 slept"
    # Serially this would be 10 s; concurrently a little over 0.5 s.
    assert 0.5 <= total < 2.5, f"20 x 0.5 s sleeps took {total:.2f} s"


# -- 3. 2,000 keep-alive connections on one worker ----------------------------------------------

N_KEEPALIVE = 2000


@pytest.mark.slow
@pytest.mark.parametrize("extra", [(), ("--max-connections", "3000")],
                         ids=["worker-connections-only", "with-max-connections"])
def test_two_thousand_keepalive_connections_on_one_worker(
        server_factory: Any, sockets: list[socket.socket], extra: tuple[str, ...]) -> None:
    raise_fd_limit(N_KEEPALIVE * 2 + 512)
    s = gevent_server(server_factory, "--worker-connections", "3000", "--keepalive", "60",
                      "--backlog", "4096", *extra)
    (worker,) = s.workers()
    assert fd_limit_of(worker) >= N_KEEPALIVE + 64, "the worker cannot hold 2,000 sockets"
    started = time.monotonic()
    for i in range(N_KEEPALIVE):
        sock = socket.create_connection(("127.0.0.1", s.port), timeout=10)
        sockets.append(sock)
        sock.sendall(request_bytes(f"/fast?c={i}"))
    answers = read_all_responses(sockets, 10)
    statuses = [answers[sock][0] if sock in answers else None for sock in sockets]
    ok = statuses.count(200)
    assert ok == N_KEEPALIVE, (
        f"{ok} of {N_KEEPALIVE} keep-alive connections answered 200 "
        f"(first unanswered: #{statuses.index(None) if None in statuses else '-'}; "
        f"other outcomes: {sorted({str(x) for x in statuses if x != 200})})")
    assert not any(a[1].get("connection") == "close" for a in answers.values())
    # All 2,000 still open: the worker holds them (none readable here: no EOF, no reset) ...
    poller = select.poll()
    for sock in sockets:
        poller.register(sock, select.POLLIN)
    assert poller.poll(0) == [], "the server closed some keep-alive connections"
    assert socket_fds(worker) >= N_KEEPALIVE, socket_fds(worker)
    # ... and they serve a second request each (a sample spread over all of them).
    sample = sockets[::20]
    for sock in sample:
        sock.sendall(request_bytes("/fast?second"))
    second = read_all_responses(sample, 10)
    assert [second.get(sock, (None,))[0] for sock in sample] == [200] * len(sample)
    assert time.monotonic() - started < 30


# -- 4. 500 server-sent-event streams and the drain ---------------------------------------------

class ChunkedStream:
    """Incremental reader of one chunked response (an SSE stream)."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buffer = b""
        self.head: bytes | None = None
        self.events: list[bytes] = []
        self.terminated = False  # the final 0-length chunk arrived
        self.eof = False
        self.reset = False
        self.ended_at: float | None = None

    def feed(self, data: bytes) -> None:
        self.buffer += data
        if self.head is None:
            if b"\r\n\r\n" not in self.buffer:
                return
            self.head, _, self.buffer = self.buffer.partition(b"\r\n\r\n")
        while not self.terminated and b"\r\n" in self.buffer:
            size_line, _, rest = self.buffer.partition(b"\r\n")
            size = int(size_line.split(b";")[0], 16)
            if len(rest) < size + 2:
                return
            if size == 0:
                self.terminated = True
            else:
                assert rest[size:size + 2] == b"\r\n", rest[:size + 2]
                self.events.append(rest[:size])
            self.buffer = rest[size + 2:]

    @property
    def complete_events(self) -> bool:
        return all(e.startswith(b"id: ") and e.endswith(b"\n\n") for e in self.events)


def pump(streams: dict[socket.socket, ChunkedStream], until: Callable[[], bool],
         timeout: float) -> None:
    sel = selectors.DefaultSelector()
    for sock, stream in streams.items():
        if not (stream.eof or stream.reset):
            sock.setblocking(False)
            sel.register(sock, selectors.EVENT_READ)
    deadline = time.monotonic() + timeout
    try:
        while not until():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return
            for key, _ in sel.select(min(remaining, 0.5)):
                sock = key.fileobj
                stream = streams[sock]  # type: ignore[index]
                try:
                    data = sock.recv(65536)  # type: ignore[union-attr]
                except BlockingIOError:
                    continue
                except ConnectionResetError:
                    data, stream.reset = b"", True
                if not data:
                    stream.eof = True
                    stream.ended_at = time.monotonic()
                    sel.unregister(sock)
                    continue
                stream.feed(data)
    finally:
        sel.close()


N_STREAMS = 500


@pytest.mark.slow
def test_five_hundred_sse_streams_stay_open_and_end_at_the_drain(
        server_factory: Any, tmp_path: Path, sockets: list[socket.socket]) -> None:
    """Issue 5: at the signal, a text/event-stream response finishes its current event and
    ends: the chunked stream is terminated (final 0-length chunk), the app's generator sees
    GeneratorExit, its shutdown function runs, well within the drain deadline; the server
    exits 0 without cancelling or killing anything."""
    raise_fd_limit(N_STREAMS * 2 + 512)
    drain, grace = 2.0, 2.0
    out = tmp_path / "sse.out"
    s = gevent_server(server_factory, "--drain-timeout", str(drain), "--cancel-grace", str(grace))
    streams: dict[socket.socket, ChunkedStream] = {}
    for i in range(N_STREAMS):
        sock = socket.create_connection(("127.0.0.1", s.port), timeout=10)
        sockets.append(sock)
        sock.sendall(request_bytes(target("/sse", out=out, id=i, interval=0.2)))
        streams[sock] = ChunkedStream(sock)
    all_streams = list(streams.values())
    pump(streams, lambda: all(len(st.events) >= 2 for st in all_streams), 20)
    waiting = [i for i, st in enumerate(all_streams) if len(st.events) < 2]
    assert not waiting, f"{len(waiting)} streams got fewer than 2 events: {waiting[:10]}"
    assert all(st.head is not None and b" 200 " in st.head.split(b"\r\n")[0]
               and b"transfer-encoding: chunked" in st.head.lower() for st in all_streams)
    assert not any(st.eof or st.reset for st in all_streams), "a stream ended before TERM"

    t0 = time.monotonic()
    term_wall = time.time()
    s.signal(signal.SIGTERM)
    pump(streams, lambda: all(st.eof or st.reset for st in all_streams), drain + grace + 2)
    open_still = [i for i, st in enumerate(all_streams) if not (st.eof or st.reset)]
    assert not open_still, f"{len(open_still)} streams still open {drain + grace + 2}s after TERM"
    code = s.wait_exit(max(0.1, t0 + drain + grace + 2 - time.monotonic()))
    assert code == 0, s.log_text()
    assert not [r for r in s.records() if "killed" in r.get("message", "")], s.log_text()

    # Every stream ended cleanly: no reset, nothing half-sent, whole events only.
    assert not [i for i, st in enumerate(all_streams) if st.reset], "streams were reset"
    partial = [(i, st.buffer[:40]) for i, st in enumerate(all_streams) if st.buffer]
    assert not partial, f"streams cut inside a chunk: {partial[:5]}"
    assert all(st.complete_events for st in all_streams)
    # Each finished the event it was on (at most one more after TERM) and then ended, long
    # before the drain deadline. Counted by when the server sent them, not when this test
    # read them: on a loaded machine events sent before the TERM are still being read after.
    def sent_after_term(st: ChunkedStream) -> int:
        return sum(1 for e in st.events if float(e.split()[-1]) > term_wall + 0.05)
    late = [i for i, st in enumerate(all_streams) if sent_after_term(st) > 1]
    assert not late, f"{len(late)} streams sent more than one event after TERM: {late[:10]}"
    latest = max(st.ended_at for st in all_streams if st.ended_at is not None) - t0
    assert latest < drain, f"the last stream ended {latest:.2f}s after TERM"

    lines = out.read_text().splitlines() if out.exists() else []
    ended = {line.split()[1] for line in lines if line.startswith("ended ")}
    assert ended == {str(i) for i in range(N_STREAMS)}, \
        f"{N_STREAMS - len(ended)} shutdown functions did not run"
    # The generators were closed (GeneratorExit), not cancelled.
    seen = {line.split()[1] for line in lines
            if line.startswith("exc ") and line.split()[2] == "GeneratorExit"}
    assert seen == {str(i) for i in range(N_STREAMS)}, [l for l in lines if l.startswith("exc ")][:5]
    terminated = sum(st.terminated for st in all_streams)
    assert terminated == N_STREAMS, f"only {terminated} streams got their final chunk"
    assert s.count_log(DEADLINE) == 0, "the drain needed its deadline"


# -- 5. --worker-connections is enforced --------------------------------------------------------

def test_worker_connections_limit_leaves_the_next_client_in_the_backlog(
        server_factory: Any, gates: Any, sockets: list[socket.socket]) -> None:
    s = gevent_server(server_factory, "--worker-connections", "5")
    held = [gates(f"w{i}") for i in range(5)]
    for gate in held:
        sockets.append(send_get(s.port, target("/held", fifo=gate.path, size=2)))
    for gate in held:
        gate.wait_entered()
    (worker,) = s.workers()
    holding = socket_fds(worker)
    sixth = socket.create_connection(("127.0.0.1", s.port), timeout=5)  # the backlog takes it
    sockets.append(sixth)
    sixth.sendall(request_bytes("/fast", close=True))
    sixth.settimeout(0.5)
    with pytest.raises(TimeoutError):
        data = sixth.recv(65536)
        pytest.fail(f"the 6th connection was served past --worker-connections 5: {data!r}")
    assert socket_fds(worker) == holding, "the worker accepted a 6th connection"

    held[0].release()
    assert read_response(sockets[0], 5).status == 200
    response = read_response(sixth, 5)
    assert response.status == 200 and json.loads(response.body) == {"fast": True}
    for gate in held[1:]:
        gate.release()
    assert [read_response(sock, 5).status for sock in sockets[1:5]] == [200] * 4


# -- 6. cancelling a call to a slow upstream ----------------------------------------------------

class SilentUpstream:
    """An HTTP "server" that accepts, reads the request, and never answers."""

    def __init__(self) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.listener.settimeout(0.1)
        self.port = self.listener.getsockname()[1]
        self.got_request = threading.Event()
        self.stop = threading.Event()
        self.held: list[socket.socket] = []
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stop.is_set():
            try:
                conn, _ = self.listener.accept()
            except TimeoutError:
                continue
            conn.settimeout(5)
            self.held.append(conn)
            data = b""
            with contextlib.suppress(OSError):
                while b"\r\n\r\n" not in data:
                    chunk = conn.recv(65536)
                    if not chunk:
                        break
                    data += chunk
            if b"\r\n\r\n" in data:
                self.got_request.set()

    def close(self) -> None:
        self.stop.set()
        self.thread.join(5)
        self.listener.close()
        for conn in self.held:
            conn.close()


@pytest.fixture
def upstream() -> Iterator[SilentUpstream]:
    up = SilentUpstream()
    yield up
    up.close()


def test_requests_call_to_a_silent_upstream_is_cancelled_at_the_deadline(
        server_factory: Any, tmp_path: Path, upstream: SilentUpstream) -> None:
    drain, grace = 1.0, 2.0
    out = tmp_path / "upstream.out"
    s = gevent_server(server_factory, "--drain-timeout", str(drain), "--cancel-grace", str(grace))
    url = f"http://127.0.0.1:{upstream.port}/slow"
    with send_get(s.port, target("/upstream", url=url, out=out)) as sock:
        assert upstream.got_request.wait(10), "the app never called the upstream"
        t0 = time.monotonic()
        s.signal(signal.SIGTERM)
        response = read_response(sock, drain + grace + 3)
        answered = time.monotonic() - t0
    assert response.status == 503, (response.status, response.body)
    assert answered >= drain - 0.1, f"cancelled {answered:.2f}s after TERM, before the deadline"
    assert answered < drain + grace, f"cancelled {answered:.2f}s after TERM"
    code = s.wait_exit(max(0.1, t0 + drain + grace + 1 - time.monotonic()))
    assert code == 0, s.log_text()
    assert out.read_text().splitlines() == ["entered", "cancelled", "shutdown"], s.log_text()
    s.wait_log(DEADLINE, timeout=1)
    assert not [r for r in s.records() if "killed" in r.get("message", "")], s.log_text()
