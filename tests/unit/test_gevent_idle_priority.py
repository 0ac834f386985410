"""A gevent worker's kept-alive connection is seen before the timers of the same loop turn
(forkserve.workers.gevent.GreenConnection.watch_idle, IDLE_PRIORITY).

libev runs a turn's events last in, first out, so at one priority the timers that came due
in a turn (apps' sleeps ending) ran before the clients whose next request came in it: every
runner those timers resumed found the queue of ready clients empty and parked, and the
clients waited a whole turn behind the responses (a 10 ms sleeping app, 25 kept-alive
clients: 1.4 ms at the median from a request's send to its app, against 0.18 ms under
gunicorn's gevent worker). In a child process: gevent patches what it imports.
"""

from __future__ import annotations

import ast
import subprocess
import sys

CHILD = r"""
from gevent import monkey
monkey.patch_all()
import socket
import gevent
from forkserve.http import Limits
from forkserve.workers.gevent import GreenConnection

loop = gevent.get_hub().loop
order = []
served, client = socket.socketpair()
conn = GreenConnection(served, ("127.0.0.1", "1"), Limits(), 5.0)


def idle_ended(c, expired):  # as the worker's: the watch ends, the client is queued
    c.unwatch_idle()
    order.append(("client", expired))


conn.watch_idle(loop, 30.0, idle_ended)
for n in range(3):
    timer = loop.timer(0.0)
    timer.start(order.append, ("timer", n))
client.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")  # readable before the loop's next turn
gevent.sleep(0.05)
print(order)
"""


def test_a_kept_alive_clients_request_is_queued_before_the_timers_of_its_turn() -> None:
    done = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    order = ast.literal_eval(done.stdout.strip())  # the list of tuples the child printed
    assert order[0] == ("client", False), order
    assert sorted(order[1:]) == [("timer", 0), ("timer", 1), ("timer", 2)], order
