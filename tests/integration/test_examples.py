"""The runnable examples (``examples/*.py``), each served by a real ``python -m forkserve`` and
checked for the guarantee its docstring promises (issue 14).

Real sockets and ``requests``, real signals, port 0. Every wait is bounded and waits for an
event: a log line, a file, a response, a webhook call the test holds. Where an example has
to be caught in the middle of its work at the TERM, the test holds that work (the webhook of
``finish_request``, a job of many steps) rather than racing a timer.
"""

from __future__ import annotations

import json
import signal
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families

from tests.harness import Server, read_head, read_response, wait_for

WORKER_CLASSES = ["sync", "thread", "gevent"]
by_worker_class = pytest.mark.parametrize("worker_class", WORKER_CLASSES)

DRAINING = "Draining in-flight connections"
DEADLINE = "Drain timeout reached, cancelling in-flight requests"
UNSTARTED = "Background task not started before shutdown"
STILL_RUNNING = "Background task still running at exit"


def serve(server_factory: Callable[..., Server], example: str, worker_class: str, *args: str,
          env: dict[str, str] | None = None, workers: int = 1) -> Server:
    return server_factory("-k", worker_class, *args, app=f"examples.{example}:app",
                          env=env, workers=workers).wait_ready()


def closed_by_server(sock: socket.socket, timeout: float = 10.0) -> bool:
    """True once the server closed ``sock`` (EOF) with nothing more sent."""
    sock.settimeout(timeout)
    try:
        return sock.recv(65536) == b""
    except ConnectionResetError:
        return True


# -- finish_request -----------------------------------------------------------------------------

class Webhook:
    """A local HTTP endpoint that records each POST body and holds its answer until
    ``release()``: the example's post-response work stays in flight as long as the test wants."""

    def __init__(self) -> None:
        self.bodies: list[bytes] = []
        self.called = threading.Event()
        self.released = threading.Event()
        hook = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                hook.bodies.append(self.rfile.read(int(self.headers["Content-Length"])))
                hook.called.set()
                hook.released.wait(30)
                self.send_response(204)
                self.end_headers()

            def log_message(self, format: str, *args: Any) -> None:
                return None  # the test's output stays the test's

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/hook"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def wait_called(self, timeout: float = 10.0) -> None:
        assert self.called.wait(timeout), "the app never called the webhook"

    def release(self) -> None:
        self.released.set()

    def close(self) -> None:
        self.release()
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join(10)


@pytest.fixture
def webhook() -> Iterator[Webhook]:
    hook = Webhook()
    yield hook
    hook.close()


@by_worker_class
def test_finish_request_answers_first_and_the_drain_waits_for_the_audit_record(
        server_factory: Any, tmp_path: Path, webhook: Webhook, worker_class: str) -> None:
    audit = tmp_path / "audit.log"
    server = serve(server_factory, "finish_request", worker_class,
                   env={"AUDIT_LOG": str(audit), "WEBHOOK_URL": webhook.url})
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
        sock.sendall(b"POST /orders?id=42 HTTP/1.1\r\nHost: shop\r\nContent-Length: 0\r\n\r\n")
        response = read_response(sock)
        assert response.status == 202 and response.body == b"accepted\n"
        # The client asked for keep-alive; finish_request ends the connection all the same,
        # while the app is still at work (the webhook holds it).
        assert closed_by_server(sock), "finish_request did not end the connection"
    webhook.wait_called()
    assert webhook.bodies == [b"order 42"]
    server.signal(signal.SIGTERM)
    # The request is still in flight after its client left: the drain counts and waits for it.
    record = server.wait_log(DRAINING, in_flight_requests=1)
    assert record["active_connections"] == 0, record
    assert server.proc.poll() is None and not audit.exists()
    webhook.release()
    assert server.wait_exit(20) == 0
    lines = audit.read_text().splitlines()
    assert len(lines) == 1 and lines[0].endswith("order '42' accepted"), lines
    assert server.count_log(DEADLINE) == 0, server.log_text()


# -- register_shutdown_function -----------------------------------------------------------------

@by_worker_class
def test_shutdown_function_releases_the_lock_after_a_failure_and_a_success(
        server_factory: Any, tmp_path: Path, worker_class: str) -> None:
    locks = tmp_path / "locks"
    lock = locks / "nightly.lock"
    server = serve(server_factory, "shutdown_functions", worker_class, env={"LOCK_DIR": str(locks)})
    failed = requests.get(f"{server.url}/jobs?key=nightly&steps=1&fail=1", timeout=10)
    assert failed.status_code == 500
    server.wait_text("job nightly failed")  # the exception, logged with its traceback
    # The shutdown function runs as the request ends, just after the 500 went out.
    wait_for(lambda: locks.is_dir() and not lock.exists(), 10, "the lock to be released")
    done = requests.get(f"{server.url}/jobs?key=nightly&steps=1", timeout=10)
    assert done.status_code == 200 and done.text == "done\n"
    wait_for(lambda: not lock.exists(), 10, "the lock to be released again")
    server.signal(signal.SIGTERM)
    assert server.wait_exit(15) == 0


@pytest.mark.slow
@by_worker_class
def test_shutdown_function_runs_when_the_drain_deadline_cancels_the_job(
        server_factory: Any, tmp_path: Path, worker_class: str) -> None:
    locks = tmp_path / "locks"
    lock = locks / "nightly.lock"
    # Two workers, so that a sync server can answer the second job while the first runs.
    server = serve(server_factory, "shutdown_functions", worker_class,
                   "--drain-timeout", "1", "--cancel-grace", "3",
                   env={"LOCK_DIR": str(locks)}, workers=2)
    with socket.create_connection(("127.0.0.1", server.port), timeout=15) as sock:
        # 600 steps of 0.1 s: a job far longer than the drain timeout.
        sock.sendall(b"GET /jobs?key=nightly&steps=600 HTTP/1.1\r\nHost: shop\r\n\r\n")
        wait_for(lock.exists, 10, "the job to take its lock")
        busy = requests.get(f"{server.url}/jobs?key=nightly&steps=1", timeout=10)
        assert busy.status_code == 409
        server.signal(signal.SIGTERM)
        response = read_response(sock, 15)
        assert response.status == 503, (response.status, response.body)
    server.wait_log("Request cancelled")
    assert server.wait_exit(15) == 0
    assert locks.is_dir() and not lock.exists(), "the cancelled job kept its lock"
    assert server.count_log("killed") == 0, server.log_text()


# -- server-sent events -------------------------------------------------------------------------

class EventStream:
    """The client side of one chunked text/event-stream response, read from a raw socket."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        status, self.headers, self.rest = read_head(sock)
        assert status == 200 and self.headers.get("transfer-encoding") == "chunked", self.headers
        assert self.headers.get("content-type") == "text/event-stream", self.headers
        self.text = ""  # the decoded body so far
        self.terminated = False  # the final 0-length chunk came

    def _more(self) -> None:
        data = self.sock.recv(65536)
        if not data:
            raise ConnectionError(f"stream cut short after {self.text!r}")
        self.rest += data

    def read_chunk(self) -> None:
        while b"\r\n" not in self.rest:
            self._more()
        size_line, _, self.rest = self.rest.partition(b"\r\n")
        size = int(size_line.split(b";")[0], 16)
        while len(self.rest) < size + 2:
            self._more()
        assert self.rest[size:size + 2] == b"\r\n", self.rest[:size + 2]
        if size == 0:
            self.terminated = True
        self.text += self.rest[:size].decode()
        self.rest = self.rest[size + 2:]

    def events(self) -> list[str]:
        return [event for event in self.text.split("\n\n") if event]


@by_worker_class
def test_event_stream_ends_cleanly_after_a_whole_event_at_the_drain(
        server_factory: Any, worker_class: str) -> None:
    server = serve(server_factory, "sse", worker_class, "--drain-timeout", "20")
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
        sock.sendall(b"GET /clock?interval=0.2 HTTP/1.1\r\nHost: shop\r\nLast-Event-ID: 41\r\n\r\n")
        stream = EventStream(sock)
        while len(stream.events()) < 2:
            stream.read_chunk()
        server.signal(signal.SIGTERM)
        while not stream.terminated:
            stream.read_chunk()
        assert stream.rest == b"" and closed_by_server(sock), "bytes or a connection left over"
        # The client is still connected (this socket is open): the server exits all the same,
        # without waiting for the deadline.
        assert server.wait_exit(15) == 0
    assert stream.text.endswith("\n\n"), f"the stream ended inside an event: {stream.text!r}"
    events = stream.events()
    for n, event in enumerate(events):
        lines = event.split("\n")
        assert lines[:2] == [f"id: {42 + n}", "event: tick"], event
        assert len(lines) == 3 and lines[2].startswith("data: "), event
    assert server.count_log(DEADLINE) == 0, server.log_text()


# -- background.submit --------------------------------------------------------------------------

def signups(server: Server, addresses: list[str]) -> None:
    for address in addresses:
        response = requests.post(f"{server.url}/signup?email={address}", timeout=10)
        assert response.status_code == 202 and response.text == "welcome email queued\n"


@by_worker_class
def test_background_tasks_queued_at_term_are_finished_before_the_exit(
        server_factory: Any, tmp_path: Path, worker_class: str) -> None:
    outbox = tmp_path / "outbox"
    addresses = [f"user{n}@example.com" for n in range(3)]
    # One thread: the second and third emails are still queued when the TERM comes.
    server = serve(server_factory, "background", worker_class, "--background-threads", "1",
                   env={"OUTBOX": str(outbox), "SEND_SECONDS": "0.3"})
    signups(server, addresses)
    server.signal(signal.SIGTERM)
    assert server.wait_exit(20) == 0
    assert sorted(p.name for p in outbox.iterdir()) == [f"{a}.eml" for a in addresses]
    assert server.count_log(UNSTARTED) == 0, server.log_text()


@pytest.mark.slow
@by_worker_class
def test_background_tasks_never_started_are_reported_by_name(
        server_factory: Any, tmp_path: Path, worker_class: str) -> None:
    outbox = tmp_path / "outbox"
    # Emails that take a minute against a drain of one second, one background thread: at the
    # deadline one email is being sent (or none yet, on a slow machine) and the rest are queued.
    server = serve(server_factory, "background", worker_class, "--background-threads", "1",
                   "--drain-timeout", "1", "--cancel-grace", "2",
                   env={"OUTBOX": str(outbox), "SEND_SECONDS": "60"})
    signups(server, [f"user{n}@example.com" for n in range(3)])
    server.signal(signal.SIGTERM)
    assert server.wait_log(DRAINING)["background_tasks"] == 3
    assert server.wait_exit(20) == 0
    unstarted = [r for r in server.records() if r.get("message") == UNSTARTED]
    # The running one is logged too, unless the arbiter's kill at the end of the cancel grace
    # came first (the worker gives a running task three quarters of it): not counted on.
    running = [r for r in server.records() if r.get("message") == STILL_RUNNING]
    assert len(unstarted) >= 2 and len(unstarted) + len(running) <= 3, server.log_text()
    for record in unstarted + running:
        assert record["level"] == "WARNING" and record["task"] == "send_welcome_email", record
    assert not outbox.exists(), "an email was sent after the shutdown"


# -- Prometheus metrics -------------------------------------------------------------------------

def scrape(server: Server) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """/metrics as {(sample name, sorted labels): value}."""
    response = requests.get(f"{server.status_url}/metrics", timeout=10)
    assert response.status_code == 200
    return {(sample.name, tuple(sorted(sample.labels.items()))): sample.value
            for family in text_string_to_metric_families(response.text)
            for sample in family.samples}


@by_worker_class
def test_app_metrics_appear_in_forkserves_metrics_summed_across_workers(
        server_factory: Any, worker_class: str) -> None:
    # An empty PROMETHEUS_MULTIPROC_DIR is unset to forkserve: one set where the tests run
    # must not leak in. forkserve then makes its own.
    server = serve(server_factory, "metrics", worker_class, "--status-bind", "127.0.0.1:0",
                   env={"PROMETHEUS_MULTIPROC_DIR": ""}, workers=2)
    orders = [("card", 20), ("card", 80), ("cash", 7), ("invoice", 300)]
    for payment, value in orders:
        response = requests.get(f"{server.url}/orders?payment={payment}&value={value}", timeout=10)
        assert response.status_code == 201
    assert requests.get(f"{server.url}/orders?payment=bitcoin", timeout=10).status_code == 400

    def counted() -> dict[Any, float] | None:
        # forkserve records its own request metrics just after each response went out.
        metrics = scrape(server)
        done = metrics.get(("forkserve_requests_total", (("method", "GET"), ("status", "201"))))
        return metrics if done == len(orders) else None

    metrics = wait_for(counted, 10, "forkserve to count the requests")
    assert metrics[("shop_orders_total", (("payment", "card"),))] == 2
    assert metrics[("shop_orders_total", (("payment", "cash"),))] == 1
    assert metrics[("shop_orders_total", (("payment", "invoice"),))] == 1
    assert metrics[("shop_order_value_euros_count", ())] == len(orders)
    assert metrics[("shop_order_value_euros_sum", ())] == sum(v for _, v in orders)
    assert metrics[("shop_order_value_euros_bucket", (("le", "10.0"),))] == 1
    assert metrics[("shop_orders_in_progress", ())] == 0
    server.signal(signal.SIGTERM)
    assert server.wait_exit(15) == 0


# -- OpenTelemetry ------------------------------------------------------------------------------

def printed_spans(server: Server) -> list[dict[str, Any]]:
    spans = []
    for line in list(server.stdout_lines):
        try:
            spans.append(json.loads(line))
        except ValueError:
            continue
    return spans


@by_worker_class
def test_otel_spans_buffered_by_the_sdk_reach_the_exporter_before_the_exit(
        server_factory: Any, worker_class: str) -> None:
    # The SDK's batch processor would export every 5 s: a minute here, so that only the
    # flush forkserve does at the exit can deliver the spans.
    server = serve(server_factory, "otel", worker_class, env={"OTEL_BSP_SCHEDULE_DELAY": "60000"},
                   workers=2)
    carts = [str(n) for n in range(5)]
    for cart in carts:
        response = requests.get(f"{server.url}/checkout?cart={cart}", timeout=10)
        assert response.status_code == 200 and response.text == f"cart {cart} checked out\n"
    assert printed_spans(server) == [], "the batch processor should still hold the spans"
    server.signal(signal.SIGTERM)
    assert server.wait_exit(15) == 0
    spans = printed_spans(server)
    by_name: dict[str, list[dict[str, Any]]] = {}
    for span in spans:
        by_name.setdefault(span["name"], []).append(span)
    assert sorted(by_name) == ["checkout", "price-cart"], spans
    for name in ("checkout", "price-cart"):
        assert sorted(s["attributes"]["cart"] for s in by_name[name]) == carts, by_name[name]
    assert {s["resource"]["attributes"]["service.name"] for s in spans} == {"shop"}
    # forkserve's span is recorded inside the app's, so it is the app span's child.
    parents = {s["context"]["span_id"]: s for s in by_name["checkout"]}
    for child in by_name["price-cart"]:
        parent = parents[child["parent_id"]]
        assert parent["attributes"]["cart"] == child["attributes"]["cart"], (parent, child)
