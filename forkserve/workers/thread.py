"""The thread worker: a pool of ``--threads`` request threads per worker process (and spares
standing in for threads parked on clients that do not read).

Owns: the poll loop (main thread) and the hand-off of ready connections to the pool. Only the
main thread changes a connection's place: it accepts, it watches idle keep-alive connections
(they wait in the poller, never in a thread), it reads what their clients send without
waiting until a request is ready (its whole head, and its body or the first --body-buffer
bytes of it; it answers 100 Continue itself), and then hands the connection to a pool
thread, which serves the requests that are there and hands it back (or closes it). A whole response (the app returned one bytes object) that the
client does not take at once is handed back too, and the poll loop writes out the rest. A
streamed response (an iterable, a file) cannot be: its app code runs as it is written. Its
thread parks on a client that takes nothing for PARK_AFTER, and a spare thread takes its
place until it comes back (see park). So N threads serve N requests at once while any number
of idle, silent or slow clients (slowloris: a header byte every few seconds; a client that
stopped reading its response) cost a poll entry and their bytes, or a parked thread, never
one of the N.

Cancellation at the drain deadline raises ``RequestCancelled`` asynchronously in each request's
thread (``PyThreadState_SetAsyncExc``). Honestly: an asynchronous exception is only seen when
the thread runs Python bytecode, so a thread blocked in a C call — ``time.sleep``, a blocking
socket or file read, a database driver's wait — is not interrupted until that call returns;
the cancel grace and the kill after it bound the exit. Use the gevent worker when requests
must be interruptible in their waits.

# -- runs in pool threads ------------------------------------------------------------------------
``_run`` and what it calls run in pool threads; they share with the main thread only the two
queues (work in, connections back) and the counters (plain int updates, which CPython performs
without a thread switch in between).
"""

from __future__ import annotations

import ctypes
import os
import queue
import select
import threading
import time
from typing import Any

from forkserve.context import RequestCancelled, RequestContext, RequestTimedOut
from forkserve.sockets import Listener
from forkserve.workers.base import WorkerEvent, WorkerState, drain_pipe
from forkserve.workers.connection import Abandoned, Connection
from forkserve.workers.pipeline import CLOSE, IDLE, LINGER, Ending, Pipeline, stop_grace_end
from forkserve.wsgi import ClientGone

EPOLLIN = select.EPOLLIN
EPOLLOUT = select.EPOLLOUT
# A connection waiting for its client: the entry disarms as it fires, while a thread has it.
EPOLLIN_ONCE = select.EPOLLIN | select.EPOLLONESHOT
RUNNING = WorkerState.RUNNING
CANCELLED = WorkerState.CANCELLED
HALTING = WorkerState.HALTING
# Spare threads at most, each standing in for a request thread parked on a client that does
# not take its streamed response (see park): beyond them, a parked request holds its thread.
SPARE_LIMIT = 64
ROUND_MOST = 64  # new clients a listener's turn takes in at most, or --threads if more
BACKLOG_PAUSE = 0.002  # seconds a backlogged worker leaves new clients to its siblings at most


class ThreadWorker(Pipeline):
    multithread = True
    stop_pipes = True  # waits in pool threads watch the stop pipe, written once at the stop
    defers_writes = True  # the poll loop writes out what a slow reader has not taken

    def should_close(self) -> bool:
        """-- runs in a pool thread. Once the worker took the stop (its Python handler ran:
        /status says draining), every response says Connection: close. One whose head went
        out a moment before, as the signal was on its way, promised keep-alive: the poll loop
        gives its connection the close grace (see _after_response), so a request its client
        sends meanwhile is still served, and nothing is asked of the kernel per response."""
        return self.state is not RUNNING or self.settings.keepalive <= 0 or self.lameduck

    def serve(self) -> None:
        self.setup_http()
        threads = self.settings.threads
        # Idle keep-alive connections cost a poll entry, not a thread: hold up to 1000 (or
        # --max-connections); beyond that, clients wait in the listen backlog.
        self.limit = self.settings.max_connections or 1000
        self.work: queue.SimpleQueue[tuple[Connection, Listener] | None] = queue.SimpleQueue()
        self.back: queue.SimpleQueue[tuple[Connection, Listener, Ending]] = queue.SimpleQueue()
        self.back_r, self.back_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self.polling = False  # the poll loop sleeps in poll, not woken yet (see _hand_back)
        self.accept_rounds: dict[int, int] = {}  # listener fd -> new clients its next turn takes
        self.accept_grown: dict[int, float] = {}  # listener fd -> when its round last doubled
        self.was_backlogged = False  # the last turn of the loop did not listen (_backlogged)
        self.accept_waits = False  # the loop stopped accepting until a thread is free
        self.backlog_until = 0.0  # ... or until then (see _backlogged)
        self.pool_lock = threading.Lock()  # pool_threads and parked, as threads park or retire
        self.pool_threads: list[threading.Thread] = []
        self.parked = 0  # request threads waiting on a client that does not read (see park)
        for _ in range(threads):
            self._spawn()
        self.idle: dict[int, tuple[Connection, Listener, float]] = {}  # fd -> conn, deadline
        # No idle deadline is before this (a lower bound: _expire_idle scans the idle
        # connections only once it has passed, not on every turn of a busy loop).
        self.idle_due = float("inf")
        # epoll, not poll: a poll call hands the kernel every watched descriptor, and CPython
        # rebuilds that array after each register or unregister: both O(connections) on every
        # turn of a loop that changes the set per request (the loop's poll line was 60 % of its
        # samples at c=50). An epoll wait costs what is ready. A listener's descriptor is
        # unregistered before it is closed: it is shared with the arbiter, and an epoll entry
        # outlives a close while another descriptor refers to the same socket. A connection's
        # entry is one-shot (see _watch): it disarms as it fires, so a request costs one
        # epoll_ctl (re-arming it), not an unregister and a register (each a GIL hand-off),
        # and one a thread closes is disarmed: nothing is left that could fire.
        self.poller = select.epoll()
        self.in_epoll: set[int] = set()  # connections' descriptors with an entry (see _watch)
        self.listener_fds = {listener.fd: listener for listener in self.listeners}
        for fd in (self.wakeup_r, self.alive_fd, self.back_r):
            self.poller.register(fd, EPOLLIN)
        self.listening = False
        self.idle_stopped = False  # the stop's graces were applied to the idle connections
        self.main_ident = threading.get_ident()
        self.timing_lock = threading.Lock()  # the timed requests (--request-timeout)
        try:
            self._loop_threads()
        finally:
            for listener in self.listeners:
                listener.sock.close()
            with self.pool_lock:
                # The timeout kill: SIGKILL follows in moments, waiting on threads is futile.
                threads_left = [] if self.timed_out else list(self.pool_threads)
            for _ in threads_left:
                self.work.put(None)
            # One deadline for all (spares included), not a grace per thread.
            deadline = time.monotonic() + self.settings.cancel_grace
            for thread in threads_left:
                thread.join(max(deadline - time.monotonic(), 0.0))

    def open_connection(self, sock: Any, addr: Any) -> Connection:
        conn = super().open_connection(sock, addr)
        conn.park = self.park
        return conn

    # -- the main thread -------------------------------------------------------------------
    def _listen(self, on: bool) -> None:
        if on == self.listening:
            return
        self.listening = on
        for fd, listener in self.listener_fds.items():
            if listener.sock.fileno() < 0:
                continue
            if on:
                self.poller.register(fd, EPOLLIN)
            else:
                self.poller.unregister(fd)

    def _loop_threads(self) -> None:
        while True:
            state = self.state
            pause = self.accept_paused_for()  # out of descriptors: retry in a moment
            after_pause = False
            if state is RUNNING and not self.pause_requested:
                now = time.monotonic()
                backlogged = self._backlogged(now)
                # The listener was off for a while (a sibling could take new clients): see
                # _accept_round.
                after_pause = self.was_backlogged and not backlogged
                self.was_backlogged = backlogged
                if backlogged:  # (the loop's wait below ends when the pause does)
                    pause = max(min(pause or BACKLOG_PAUSE, self.backlog_until - now), 1e-4)
                self._listen(self.counters.active_connections < self.limit and not pause
                             and not backlogged)
            else:
                self._stop_listening(state)
            if state is not RUNNING:
                self.signal_stop()
            if state is not RUNNING and not self.idle and self.counters.active_connections == 0:
                return
            if state is HALTING:
                return
            self.before_waiting()
            now = time.monotonic()
            timeout = self.heartbeat_interval
            if self.idle:
                timeout = min(timeout, max(self.idle_due - now, 0))
            if self.flushing:
                timeout = min(timeout, max(min(f[3] for f in self.flushing.values()) - now, 0))
            if self.lingering:
                # (In deadline order: see end_lingering.)
                timeout = min(timeout, max(next(iter(self.lingering.values()))[1] - now, 0))
            if pause:
                timeout = min(timeout, pause)
            if self.request_timeout:
                timeout = min(timeout, max(self.next_request_deadline(now) - now, 0))
            # A thread hands a connection back with a wake-up byte only while this loop sleeps
            # in poll (see _hand_back): one handed back while it was busy is found here. Set
            # before the look, so that a hand-back after the look sees it and writes the byte.
            self.polling = True
            handed_back = not self.back.empty()
            ready = self.poller.poll(0 if handed_back else timeout + 0.001)
            self.polling = False
            for fd, _ in ready:
                if fd == self.wakeup_r:
                    self.handle_wakeups()
                elif fd == self.alive_fd:
                    self.arbiter_gone()
                elif fd == self.back_r:
                    drain_pipe(self.back_r)
                    handed_back = True
                elif fd in self.idle:
                    self._gather(fd)
                elif fd in self.flushing:
                    self._write_out(fd)
                elif fd in self.lingering:
                    self.linger_more(fd)
                elif fd in self.listener_fds:
                    self._accept_round(self.listener_fds[fd], after_pause)
            if handed_back:
                self._take_back()
            self._expire_idle(time.monotonic())
            if self.flushing:
                self.end_writes(time.monotonic())
            if self.lingering:
                self.end_lingering(time.monotonic())
            if self.request_timeout:
                self._cancel_overdue(time.monotonic())

    def _backlogged(self, now: float) -> bool:
        """Every request thread has a ready client queued for it already: accept no more
        until one of them is free (the first to be wakes this loop, see _run) or for
        BACKLOG_PAUSE, whichever is sooner, and leave new clients to a sibling worker with a
        free thread meanwhile. Without it, the worker that woke first to a burst of kept-alive
        clients could take them all (c=50: 50 against 0, one run in ten, for as long as they
        stayed: a quarter of the throughput) while the other idled. Never longer: a worker
        whose kept-alive clients keep its threads busy still takes new ones in turn."""
        if now >= self.backlog_until and self.backlog_until:
            self.backlog_until = 0.0  # paused for its time: one round now
            return False
        self.accept_waits = True  # (first: a thread taking work from now on sees it)
        if self.work.qsize() < self.settings.threads:
            self.accept_waits = False
            self.backlog_until = 0.0
            return False
        if not self.backlog_until:
            self.backlog_until = now + BACKLOG_PAUSE
        return True

    def _accept_round(self, listener: Listener, after_pause: bool) -> None:
        """A listener's turn takes in at most a round of new clients. The first round is a
        thread's worth: a worker that took a whole burst of kept-alive clients kept them, and
        their latency, while its sibling idled; in rounds (and with _backlogged's pause
        between them) the workers share a burst as they share the queue. A round after such
        a pause which took a whole round (clients may still be waiting: no sibling took them,
        every worker is busy) doubles the next, up to ROUND_MOST, once a BACKLOG_PAUSE at
        most; one that found the queue empty resets it, and any other leaves it. At a
        thread's worth a turn, the last of 500 clients that came at once to busy workers
        waited 0.5 to 1.4 s in the listen queue on one worker (0.1 s on two), while the
        kept-alive clients were served every turn."""
        threads = self.settings.threads
        fd = listener.fd
        at_most = self.accept_rounds.get(fd, threads)
        if self._accept_into_pool(listener, at_most) < at_most:
            # The queue was found empty (or the connection limit, or an accept error, ended
            # the round).
            self.accept_rounds[fd] = threads
        elif after_pause:
            # At most one doubling a BACKLOG_PAUSE: a pause that a freed thread cut short
            # after microseconds gave a sibling no real chance (4 rounds to a c=50 burst).
            now = time.monotonic()
            if now - self.accept_grown.get(fd, 0.0) >= BACKLOG_PAUSE:
                self.accept_grown[fd] = now
                self.accept_rounds[fd] = min(at_most * 2, max(ROUND_MOST, threads))

    def _accept_into_pool(self, listener: Listener, at_most: int = 1 << 30) -> int:
        """Take in up to ``at_most`` waiting clients of ``listener``: how many it took."""
        taken = 0
        while taken < at_most and self.counters.active_connections < self.limit:
            accepted = self.accept_from(listener)
            if accepted is None:
                break
            taken += 1
            conn = self.open_connection(*accepted)
            self.admit(conn)
            # A thread takes it once its request is ready (its request is often here
            # already: no poll round for it): a client that connects ahead of time (browsers,
            # Go's and other pools do) or sends slowly must not hold a thread while the
            # clients that did send wait behind it.
            ready = self.gather(conn)
            if ready:
                self.work.put((conn, listener))
                continue
            if ready is None:
                continue  # refused
            deadline = time.monotonic() + self.settings.header_timeout
            if self.state is not RUNNING:
                deadline = self.stop_deadline(conn, deadline)
            self._wait_for_client(conn, listener, self.gathered_until(conn, deadline))
        return taken

    def _wait_for_client(self, conn: Connection, listener: Listener, deadline: float) -> None:
        """The main thread watches ``conn`` until its client's request is ready (then a thread
        serves it) or ``deadline`` passes (then it is closed, or refused if it began)."""
        self._idle_until(conn, listener, deadline)
        self._watch(conn.fd, EPOLLIN_ONCE)

    def _watch(self, fd: int, events: int) -> None:
        """Watch a connection's descriptor for ``events``: its entry changed where it has one
        (disarmed since it fired, or watched for another event), else a new one."""
        if fd not in self.in_epoll:
            self.poller.register(fd, events)
            self.in_epoll.add(fd)
            return
        try:
            self.poller.modify(fd, events)
        except FileNotFoundError:
            # The entry went with a socket a thread closed since: this one is new.
            self.poller.register(fd, events)

    def _unwatch(self, fd: int) -> None:
        self.poller.unregister(fd)
        self.in_epoll.discard(fd)

    def _idle_until(self, conn: Connection, listener: Listener, deadline: float) -> None:
        """Watched until ``deadline`` (new, or a later bound for a head partly here)."""
        self.idle[conn.fd] = (conn, listener, deadline)
        if deadline < self.idle_due:
            self.idle_due = deadline

    def _gather(self, fd: int) -> None:
        """The client of a watched connection sent something: read it, and hand the
        connection to a thread once its request is ready (until then, see gathered_until)."""
        conn, listener, deadline = self.idle[fd]
        ready = self.gather(conn)
        if ready is False:
            self._idle_until(conn, listener, self.gathered_until(conn, deadline))
            self._watch(fd, EPOLLIN_ONCE)  # (it disarmed as it fired)
            return
        del self.idle[fd]  # (its entry disarmed as it fired)
        if ready:
            self.work.put((conn, listener))

    def _stop_listening(self, state: WorkerState) -> None:
        """Stopping or pausing: clients already queued are served (or, past the deadline,
        turned away with a 503), then our listeners close. Connections waiting for their
        client's next request get the stop's graces (see stop_deadline)."""
        if any(l.sock.fileno() >= 0 for l in self.listeners):
            self._listen(False)
            for listener in self.listeners:
                if listener.sock.fileno() < 0:
                    continue
                if state is CANCELLED:
                    self.turn_away_queue([listener])
                elif state is WorkerState.STOPPING and self.takes_queue(listener) or (
                        state is RUNNING and self.pause_requested):
                    self.limit = 1 << 30  # the queue is served whatever the limit
                    self.take_queue(listener, lambda: self._accept_into_pool(listener),
                                    time.sleep)
                listener.sock.close()
            self.pause_requested = False
            self.listener_fds = {}
        if state is not RUNNING and not self.idle_stopped:
            self.idle_stopped = True
            for fd, (conn, listener, deadline) in list(self.idle.items()):
                self.idle[fd] = (conn, listener, self.stop_deadline(conn, deadline))
            self.idle_due = min([entry[2] for entry in self.idle.values()], default=float("inf"))
        if state is CANCELLED:
            self.end_writes()  # responses still going out are cut at the deadline
            self.end_lingering()
            for fd in list(self.idle):
                conn = self.idle.pop(fd)[0]
                self._unwatch(fd)
                if conn.received:
                    # It began: never unanswered.
                    self.refuse(conn, 503, "Service Unavailable", wait=False)
                self._release(conn)

    def stop_deadline(self, conn: Connection, deadline: float) -> float:
        """A stopping worker's limit on waiting for a connection's next request: the close
        grace for an idle keep-alive one (a request may be on its way), a short grace for
        one just accepted and silent. A request partly here keeps its own bound: it is
        served, as one a thread were reading would be."""
        if conn.received:
            return deadline
        return min(deadline, stop_grace_end(conn, self.stop_began()))

    def _take_back(self) -> None:
        back = self.back
        # Only this thread takes from ``back``: not empty means get_nowait() returns (its
        # queue.Empty at the end of every turn was an exception raised and caught per turn).
        while not back.empty():
            conn, listener, ending = back.get_nowait()
            state = self.state
            if state is CANCELLED or state is HALTING:
                self._release(conn)
            elif conn.unsent is not None:
                self.write_later(conn, listener, ending)
            else:
                self._after_response(conn, listener, ending)

    def _after_response(self, conn: Connection, listener: Listener, ending: Ending) -> None:
        """A connection's response is all out: it ends, a pipelined request is served, or
        the loop watches it for the client's next request."""
        if ending is LINGER:
            self.end_connection(conn, linger=True)  # the loop drains it (close_later)
        elif ending is not IDLE:
            self._release(conn)
        elif conn.events:
            self.work.put((conn, listener))  # pipelined behind the response just written
        else:
            deadline = conn.idle_since + self.settings.keepalive
            if self.state is not RUNNING:
                # Its last response promised keep-alive before the stop: the close grace.
                deadline = self.stop_deadline(conn, deadline)
            self._wait_for_client(conn, listener, deadline)

    def watch_writable(self, fd: int, on: bool) -> None:  # (Pipeline.write_later)
        if on:
            self._watch(fd, EPOLLOUT)
        else:
            self._unwatch(fd)

    def watch_readable(self, fd: int, on: bool) -> None:  # (Pipeline.close_later)
        if on:
            self._watch(fd, EPOLLIN)
        else:
            self._unwatch(fd)

    def _write_out(self, fd: int) -> None:
        done = self.write_more(fd)
        if done is not None:
            self._after_response(*done)

    def _expire_idle(self, now: float) -> None:
        if now < self.idle_due:
            return
        due = float("inf")
        for fd, (conn, listener, deadline) in list(self.idle.items()):
            if now < deadline:
                due = min(due, deadline)
            else:
                del self.idle[fd]
                self._unwatch(fd)
                if conn.received:
                    # A head (or small body) that did not come in time: answered here, it
                    # never reaches the app (nor a thread).
                    self.refuse(conn, 408, "Request Timeout", wait=False)
                    self._release(conn)
                elif self.state is WorkerState.STOPPING and conn.readable_now():
                    # Its request came just as the grace ended: answer it, never reset it.
                    self.work.put((conn, listener))
                else:
                    self._release(conn)
        self.idle_due = due

    def _release(self, conn: Connection, linger: bool = False) -> None:
        if self.release(conn, linger) and threading.get_ident() != self.main_ident:
            self._wake_main()  # a stopping worker leaves when its last connection is gone

    def _hand_back(self, conn: Connection, listener: Listener, ending: Ending) -> None:
        """-- runs in a pool thread. The connection goes back to the poll loop; a wake-up byte
        only if the loop sleeps in poll (a write, and the loop's read of it, per request
        otherwise), and only one a sleep: the first thread to hand one back clears
        ``polling``, and the loop takes every connection queued when it wakes (the threads
        that hand one back meanwhile write nothing: at c=50, 0.07 writes a request instead
        of 0.7-1). Put first, then look: a loop that set ``polling`` before it looked at the
        queue either saw this connection there, or is seen polling here (or was woken by
        the thread that cleared it, after which it looks at the queue again)."""
        self.back.put((conn, listener, ending))
        if self.polling:
            self.polling = False
            self._wake_main()

    def _wake_main(self) -> None:
        try:
            os.write(self.back_w, b"\0")
        except BlockingIOError:
            return  # the pipe is full: the loop has wake-ups pending already

    # -- pool threads ------------------------------------------------------------------------
    def _spawn(self) -> None:
        """One more pool thread (at the start, or a spare: see park). Under pool_lock but at
        the start."""
        thread = threading.Thread(target=self._run, daemon=True,
                                  name=f"forkserve-request-{len(self.pool_threads)}")
        self.pool_threads.append(thread)
        thread.start()

    def park(self, on: bool) -> None:
        """-- runs in a pool thread. Its request's response waits on a client that has not
        taken more for PARK_AFTER (it reads slowly, or not at all: a streamed or file
        response, which the poll loop cannot write out without running app code). The
        thread waits on (its generator stays in its own thread: thread-bound state such as a
        database connection stays valid), bounded by --header-timeout between the client's
        reads; meanwhile a spare thread takes its place, so --threads threads still serve
        the other clients. The surplus retires when the parked request ends (_retire)."""
        with self.pool_lock:
            if on:
                self.parked += 1
                if (len(self.pool_threads) - self.parked < self.settings.threads
                        and len(self.pool_threads) < self.settings.threads + SPARE_LIMIT):
                    self._spawn()
            else:
                self.parked -= 1

    def _retire(self) -> bool:
        """-- runs in a pool thread, between connections: True when this thread is a surplus
        (a parked request it stood in for has ended) and leaves the pool."""
        if len(self.pool_threads) - self.parked <= self.settings.threads:
            return False
        with self.pool_lock:
            if len(self.pool_threads) - self.parked <= self.settings.threads:
                return False
            self.pool_threads.remove(threading.current_thread())
        return True

    def _run(self) -> None:
        while True:
            item = None
            try:
                item = self.work.get()
                if item is None:
                    return
                if self.accept_waits and self.work.qsize() < self.settings.threads:
                    self.accept_waits = False
                    self._wake_main()  # the loop accepts again (see _backlogged)
                conn, listener = item  # (not *item: a call with *args is never specialized)
                self._run_connection(conn, listener)
            except RequestCancelled:
                # The drain deadline's asynchronous exception can land at any bytecode: here
                # it hit a thread whose request had just ended. End its connection all the
                # same (the deadline passed: nothing more is served), keep the thread.
                if item is not None and not item[0].closed:
                    self._release(item[0])
            if self._retire():
                return

    def _run_connection(self, conn: Connection, listener: Listener) -> None:
        """Serve a connection whose client sent something; hand it back or end it."""
        conn.owner = threading.get_ident()
        try:
            ending = self.serve_connection(conn, self.environs[id(listener)])
        except (RequestCancelled, Abandoned, ClientGone):
            ending = CLOSE
        except Exception as exc:  # never lose a pool thread to one connection
            self.log.exception("Connection failed", exc, worker=self.worker_id)
            ending = CLOSE
        conn.owner = None
        if ending is IDLE or conn.unsent is not None or (
                ending is LINGER and conn.defer_writes):
            # Back to the main thread, which writes out what the client has not taken yet,
            # and watches it (applying a stop's grace), drains it before closing (a
            # lingering close: no thread waits on the client), or ends it.
            self._hand_back(conn, listener, ending)
        else:
            self._release(conn, linger=ending is LINGER)

    # -- cancellation ------------------------------------------------------------------------
    # --request-timeout: the poll loop watches the timed requests (its wait is never longer
    # than the time to the next one's deadline, see next_request_deadline) and sends an overdue
    # one RequestTimedOut in its thread, as the drain's cancel does. The lock makes "still in
    # the app?" and the send one step, against the request ending in its thread meanwhile.
    def time_request(self, context: RequestContext, conn: Connection) -> None:
        # -- runs in a pool thread
        with self.timing_lock:
            super().time_request(context, conn)  # (its deadline read under the lock: in order)

    def untime_request(self, context: RequestContext) -> None:
        # -- runs in a pool thread
        with self.timing_lock:
            super().untime_request(context)
            if context.timed_out:
                # Sent just as the request was ending, the exception may still be pending in
                # this thread: cleared (NULL), it cannot land in what the thread does next.
                _raise_in(threading.get_ident(), None)

    def next_request_deadline(self, now: float) -> float:
        with self.timing_lock:
            return super().next_request_deadline(now)

    def _cancel_overdue(self, now: float) -> None:
        with self.timing_lock:
            for _, conn in self.overdue_requests(now):
                if conn.owner is not None:
                    _raise_in(conn.owner, RequestTimedOut)

    def _on_cancel(self, signum: int, frame: Any) -> None:
        """USR2 (the drain deadline): RequestCancelled in every thread serving a request; a
        thread waiting on its client is woken by the stop pipe (one atomic write)."""
        self._enter(WorkerEvent.CANCEL)
        for conn in list(self.connections):
            ident = conn.owner
            # A thread waiting on its client (conn.waiting) is ended by the stop pipe; one in
            # the application gets the exception (a second one would cut its 503 short).
            if ident is not None and conn.in_request and not conn.waiting:
                _raise_in(ident, RequestCancelled)
        # The exception thrown above is pending by now, so it lands in the app, not after it.
        self._cut_taken()
        # Only now: a thread the pipe wakes from a wait (a body read) raises RequestCancelled
        # itself and is no longer `waiting`; had the pipe been written first, the loop above
        # could see it so and throw it a second one, into its shutdown functions.
        self.signal_stop(cancel=True)

    def _on_hard(self, signum: int, frame: Any) -> None:
        """QUIT (a hard stop, and what an old generation gets at its drain deadline after a
        reload): connections the app took over are shut down too, so that their threads,
        waiting on their clients in the app, end within the join below (serve) instead of
        holding the worker until the arbiter's SIGKILL."""
        self._cut_taken()
        super()._on_hard(signum, frame)

    def _cut_taken(self) -> None:
        """-- runs in a signal handler. Connections the app took over (WebSockets) are shut
        down: the app's waits on them end (a WebSocket library's receive() wakes)."""
        for conn in list(self.connections):
            if conn.taken:
                conn.cut()


def _raise_in(ident: int, exc_type: type[BaseException] | None) -> None:
    """``exc_type`` raised in thread ``ident`` when it next runs Python (None: clears one
    still pending there)."""
    ctypes.pythonapi.PyThreadState_SetAsyncExc(
        ctypes.c_ulong(ident), None if exc_type is None else ctypes.py_object(exc_type))


__all__ = ["ThreadWorker"]
