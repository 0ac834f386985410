"""The thread worker: N request threads, idle keep-alive connections in the poller."""

from __future__ import annotations

import socket
import time

from tests.harness import get, read_response, send_get


def test_eight_slow_requests_and_a_fast_one(server_factory, gates):
    """Issue 5: 8 slow requests are served at once (all inside the app together) while a fast
    request on another connection is answered within 100 ms. One worker with 9 threads: 8
    for the slow ones, one left for the fast one (a pool of exactly 8 would make it wait)."""
    server = server_factory("-k", "thread", "--threads", "9", workers=1).wait_ready()
    held = [gates(f"g{i}") for i in range(8)]
    socks = [send_get(server.port, gate.route) for gate in held]
    try:
        for gate in held:
            gate.wait_entered()  # all eight are inside the app at the same time
        started = time.monotonic()
        fast = get(server.port, "/")
        assert fast.status == 200 and fast.body == b"hello\n"
        assert time.monotonic() - started < 0.1
    finally:
        for gate in held:
            gate.release()
    for sock in socks:
        with sock:
            assert read_response(sock).body == b"released"


def test_idle_keepalive_connections_do_not_hold_threads(server_factory):
    """100 idle keep-alive connections on a worker with 2 threads: another client is still
    served at once (they wait in the poller, not in threads)."""
    server = server_factory("-k", "thread", "--threads", "2", "--keepalive", "30",
                            workers=1).wait_ready()
    idle = []
    try:
        for _ in range(100):
            sock = send_get(server.port, "/", close=False)
            assert read_response(sock).status == 200
            idle.append(sock)
        started = time.monotonic()
        assert get(server.port, "/").status == 200
        assert time.monotonic() - started < 0.5
        for sock in idle[:10]:  # and the idle ones are still alive
            sock.sendall(b"GET / HTTP/1.1\r\nHost: t\r\n\r\n")
            assert read_response(sock).status == 200
    finally:
        for sock in idle:
            sock.close()


def test_wsgi_multithread_is_true(server_factory):
    import json

    server = server_factory("-k", "thread", workers=1).wait_ready()
    response = get(server.port, "/environ")
    assert json.loads(response.body)["wsgi.multithread"] is True
    with socket.create_connection(("127.0.0.1", server.port), timeout=5):
        pass


def test_kept_alive_connections_are_watched_again_at_once(server_factory):
    """A request thread hands a kept-alive connection back to the poll loop, with one wake-up
    a sleep of the loop however many threads hand one back during it (_hand_back). Were a
    hand-back's wake-up lost, its connection would wait for the loop's next heartbeat (1 s)
    before its client's next request was seen. 8 clients on 4 threads, each 100 requests in
    turn on its own connection (many hand-backs during one sleep), then a lone client, 50
    requests (no other client's request wakes the loop for it). Every response comes, in
    order, on its connection."""
    import json
    from concurrent.futures import ThreadPoolExecutor

    server = server_factory("-k", "thread", "--threads", "4", "--keepalive", "30",
                            workers=1).wait_ready()

    def client(index: int, rounds: int = 100) -> float:
        started = time.monotonic()
        with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
            for n in range(rounds):
                sock.sendall(f"GET /environ?c={index}&n={n} HTTP/1.1\r\nHost: t\r\n\r\n"
                             .encode())
                response = read_response(sock)
                assert response.status == 200, response
                assert json.loads(response.body)["QUERY_STRING"] == f"c={index}&n={n}"
        return time.monotonic() - started

    with ThreadPoolExecutor(max_workers=8) as pool:
        took = list(pool.map(client, range(8)))
    alone = client(8, rounds=50)
    # Generous for a loaded machine (each client needs well under a second here); a lost
    # wake-up costs about a second a request (the lone client's 50: 45 s or more).
    assert max(took) < 30, f"clients took {sorted(took)} s"
    assert alone < 20, f"a lone client's 50 requests took {alone:.1f} s"


def test_a_kept_alive_clients_slow_next_head_holds_no_thread(server_factory):
    """Clients whose first request was served send their next one's head in pieces, and
    stall: the poll loop reads what came and keeps watching the connection until the head
    is all there (_gather), so 30 of them on 2 threads hold none, and another client is
    served at once. Then each sends the rest of its head and gets its answer on its
    connection; one that never does gets a 408 at --header-timeout."""
    server = server_factory("-k", "thread", "--threads", "2", "--keepalive", "30",
                            "--header-timeout", "5", workers=1).wait_ready()
    slow = []
    try:
        for n in range(30):
            sock = send_get(server.port, f"/environ?first={n}", close=False)
            assert read_response(sock).status == 200
            sock.sendall(f"GET /environ?second={n} HTTP/1.1\r\nHost: t\r\nX-Slow: ".encode())
            slow.append(sock)
        stalled = send_get(server.port, "/", close=False)
        slow.append(stalled)  # (closed with them)
        assert read_response(stalled).status == 200
        stalled.sendall(b"GET / HTTP/1.1\r\nHo")
        for _ in range(5):
            started = time.monotonic()
            assert get(server.port, "/").status == 200
            assert time.monotonic() - started < 1.0
        import json

        for n, sock in enumerate(slow[:30]):
            sock.sendall(b"1\r\n\r\n")
            response = read_response(sock)
            assert response.status == 200
            assert json.loads(response.body)["QUERY_STRING"] == f"second={n}"
        response = read_response(stalled, timeout=15.0)
        assert response.status == 408, response
    finally:
        for sock in slow:
            sock.close()
