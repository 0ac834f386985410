"""The gevent worker: up to ``--worker-connections`` (and ``--max-connections``) connections
at once, each served in a greenlet while it has something to serve, with the request pipeline
and drain all workers share.

A kept-alive connection waits for its next request with no greenlet: an io watcher and a timer
on gevent's loop (GreenConnection.watch_idle). The clients that sent more in one turn of the
loop go into a queue, and one greenlet (a runner) serves them one after the other. Under load
that is one switch into a greenlet and back for a whole turn of ready clients, not one per
request, and no Waiter, timer or watcher made for each wait (callgrind, one worker, 20
keep-alive clients: 149k instructions a request with a greenlet waiting on each connection,
136k so). A request that blocks (the app sleeps, or waits on an upstream, or on its client)
holds its runner as a connection's greenlet would: the rest of the queue goes to a parked
runner or a new one.

Owns: monkey-patching (first thing after fork, before the application is imported: an app
that imported ``ssl`` or ``threading`` unpatched is gunicorn's classic gevent bug), the
acceptor greenlets, and the signal handling of a process whose main thread is gevent's hub.
This is the only module that imports gevent. The arbiter imports gevent's modules before its
first fork (``share_imports``: gunicorn's arbiter does too), so that the workers share them:
importing gevent in each worker cost 4 MiB of RSS more per worker. Nothing of gevent runs in
the arbiter: no hub, no patch (that is the first thing a worker does after the fork).

Differences from the sync worker, all following from many connections per process:
- keep-alive is never given up for fairness (nobody waits behind an idle connection); it ends
  only at ``--keepalive`` or at the drain;
- signals arrive through ``gevent.signal_handler`` (a greenlet per signal), so a stop, cancel
  or hard stop acts on each request's greenlet: a thrown ``RequestCancelled`` interrupts any
  cooperative wait — a sleep, a socket read, an upstream HTTP call;
- the background pool's threads are greenlets (``threading`` is patched).
"""

from __future__ import annotations

import importlib
import os
import signal
import socket
import sys
import time
import warnings
from collections import deque
from dataclasses import replace
from select import POLLOUT
from typing import Any

from forkserve.context import RequestCancelled, RequestContext, RequestTimedOut
from forkserve.sockets import Listener
from forkserve.workers.base import HardStop, WorkerEvent, WorkerState, drain_pipe
from forkserve.workers.connection import Abandoned, Connection
from forkserve.workers.pipeline import CLOSE, IDLE, LINGER, Pipeline, stop_grace_end
from forkserve.wsgi import ClientGone

RUNNING = WorkerState.RUNNING
CANCELLED = WorkerState.CANCELLED
HALTING = WorkerState.HALTING
# Runners (see the module's docstring) that wait for the next ready client, parked; one more
# ends when its queue is empty. Under load the few that are parked take every turn of the loop;
# a burst of blocking requests spawns more, and they end as it passes.
PARKED_RUNNERS = 16
IDLE_PRIORITY = 2  # libev's EV_MAXPRI: a kept-alive connection's watch (GreenConnection.watch_idle)

# What patch_all and this worker import, less the application, imported by the arbiter before
# it forks (share_imports). Each defines classes and loads libev, greenlet or OpenSSL (whose
# one-off initialisation alone touched 2.5 MiB of libcrypto in each worker); none patches
# anything or starts a hub, a thread or a watcher. importlib.metadata is for the plugins
# patch_all looks for. The ssl module before the patch draws no warning: gevent warns only
# when another module holds a name from it, and nothing here does.
SHARED_MODULES = (
    "importlib.metadata", "ssl", "gevent", "gevent.event", "gevent.events", "gevent.hub",
    "gevent.local", "gevent.monkey", "gevent.pool", "gevent.select", "gevent.selectors",
    "gevent.signal", "gevent.socket", "gevent.ssl", "gevent.subprocess", "gevent.thread",
    "gevent.threading", "gevent.time",
)


class _Wake(Exception):
    """Thrown into an acceptor to make it look at the worker's state again."""


class GreenConnection(Connection):
    """A gevent worker's connection: its waits (for the client, and the interrupt fd: the stop
    pipes) are io watchers and a timer on gevent's loop, made once per connection and wait,
    not the patched ``select.poll``, which builds watchers, a Timeout and a result list on
    every call (a sixth of a keep-alive request's CPU time). The same contract as
    Connection._wait_loop: the cutoff, Timeout, Abandoned, ``interrupted``."""

    __slots__ = ("_watchers", "_hub", "_waiter_class", "_idle_io", "_idle_timer",
                 "_cutoff_timer", "listener")
    _watchers: dict[tuple[int, int], Any]  # (fd, events) -> io watcher, made at first use
    _hub: Any  # gevent's hub and Waiter, looked up at the first wait (see _green_wait)
    _waiter_class: Any

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # watch_idle's: the client's next request and the keep-alive timeout (made at the
        # first idle, then restarted: nothing is allocated for a wait between requests), and
        # a stop's shorter limit on it.
        self._idle_io: Any = None
        self._idle_timer: Any = None
        self._cutoff_timer: Any = None
        self.listener: Listener | None = None  # the one it came from (its environ's base)
        if self._ssl is None:
            # The hot path's recv and send on the plain socket under gevent's: gevent's
            # wrapper (a Python frame that re-raises EAGAIN, its own wait on a blocking
            # socket) does nothing for a non-blocking socket whose waits are ours (_wait).
            self.io = self.sock._sock  # type: ignore[attr-defined]

    def watch_idle(self, loop: Any, keepalive: float, callback: Any) -> None:
        """Kept alive between requests, with no greenlet waiting: ``callback(self, False)``
        runs in the hub when the client sends, ``callback(self, True)`` after ``keepalive``
        seconds (or sooner: cut_idle). Either ends the watch (see unwatch_idle)."""
        io = self._idle_io
        if io is None:
            # libev's READ, at its highest priority (IDLE_PRIORITY): in a turn that finds
            # both a kept-alive client's next request and timers due (an app's sleeps ending),
            # the client is queued first, so each runner a timer resumes takes a ready client
            # as soon as its response is out. At the default priority libev ran the timers
            # first (it runs a turn's events last in, first out), every runner parked with
            # the queue still empty, and the clients waited for the loop's next turn behind
            # all the responses of this one (see bench/RESULTS.md, 2026-12-07 21:13).
            io = self._idle_io = loop.io(self.fd, 1, priority=IDLE_PRIORITY)
            # Repeating every keepalive seconds: again() (re)starts it that far from now,
            # with no new timer. (From the loop's time: this turn's start, a few ms at most.)
            self._idle_timer = loop.timer(keepalive, keepalive)
        io.start(callback, self, False)
        self._idle_timer.again(callback, self, True, update=False)

    @property
    def idle_watched(self) -> bool:
        return self._idle_io is not None and self._idle_io.active

    def cut_idle(self, loop: Any, until: float) -> None:
        """A stop: the idle watch ends by ``until`` (monotonic time), if it is on."""
        if not self.idle_watched:
            return
        if self._cutoff_timer is not None:
            self._cutoff_timer.close()
        self._cutoff_timer = loop.timer(max(until - time.monotonic(), 0.0))
        self._cutoff_timer.start(self._idle_io.callback, self, True)

    def unwatch_idle(self) -> None:
        """The idle watch ends (the client sent, its time is up, or the worker closes it)."""
        self._idle_io.stop()
        self._idle_timer.stop()
        if self._cutoff_timer is not None:
            self._cutoff_timer.close()
            self._cutoff_timer = None

    def _wait(self, flag: int, deadline: float) -> None:
        self.waiting = True
        try:
            self._green_wait(2 if flag == POLLOUT else 1, deadline)  # libev's WRITE, READ
        finally:
            self.waiting = False

    def _watcher(self, loop: Any, fd: int, events: int) -> Any:
        watchers = self._watchers
        watcher = watchers.get((fd, events))
        if watcher is None:
            watcher = watchers[fd, events] = loop.io(fd, events)
        elif watcher.active:
            # Another greenlet waits the same way on this connection (a WebSocket app's
            # reader beside its writer): a watcher of its own, or one callback replaces the
            # other and that greenlet never wakes.
            return loop.io(fd, events)
        return watcher

    def _green_wait(self, events: int, deadline: float) -> None:
        try:
            hub, waiter_class, watchers = self._hub, self._waiter_class, self._watchers
        except AttributeError:  # the first wait: looked up once, not at every request
            from gevent.hub import Waiter, get_hub
            hub = self._hub = get_hub()
            waiter_class = self._waiter_class = Waiter
            watchers = self._watchers = {}
        loop = hub.loop
        # (_watcher's work, inline where the watcher is there and free: every wait but the first)
        client = watchers.get((self.fd, events))
        if client is None or client.active:
            client = self._watcher(loop, self.fd, events)
        while True:
            remaining = self.wait_left(deadline)
            interrupt_fd = self.interrupt_fd
            interrupt = None
            if interrupt_fd >= 0:
                interrupt = watchers.get((interrupt_fd, 1))
                if interrupt is None or interrupt.active:
                    interrupt = self._watcher(loop, interrupt_fd, 1)
            waiter = waiter_class(hub)
            timer = loop.timer(remaining + 0.001)
            client.start(waiter.switch, _CLIENT)
            if interrupt is not None:
                interrupt.start(waiter.switch, _INTERRUPT)
            timer.start(waiter.switch, _TIMER)
            try:
                which = waiter.get()
            finally:
                client.stop()
                if interrupt is not None:
                    interrupt.stop()
                timer.close()
            if which is _CLIENT:
                return
            if which is _INTERRUPT and self.interrupted is not None and self.interrupted(self):
                raise Abandoned()


_CLIENT, _INTERRUPT, _TIMER = object(), object(), object()  # (what woke a GreenConnection)


def _throw(greenlet: Any, exc: BaseException | type[BaseException]) -> None:
    """-- runs in the hub: ``exc`` raised in ``greenlet`` where it waits, as gevent's own kill
    does it; what escapes the greenlet, the hub reports."""
    try:
        greenlet.throw(exc)
    except BaseException:  # noqa: BLE001 - as gevent's own kill: the hub reports it
        greenlet.parent.handle_error(greenlet, *sys.exc_info())


class GeventWorker(Pipeline):
    multithread = False  # greenlets: wsgi.multithread stays False, as gunicorn's gevent worker
    # Waits on a client watch the stop pipe, written once when the worker stops: the wait
    # itself applies the stop's graces (no kill racing a request that just arrived). A
    # request in the application is cancelled by its greenlet's kill (_g_cancel).
    stop_pipes = True
    kills_requests = True
    connection_class = GreenConnection

    @classmethod
    def share_imports(cls) -> None:
        super().share_imports()
        for name in SHARED_MODULES:
            importlib.import_module(name)

    def _post_fork(self) -> None:
        from gevent import monkey

        # Before anything else in the child, and long before the app is imported.
        with warnings.catch_warnings():
            if self.settings.tls is not None:
                # The arbiter imported ssl to build (and check) the TLS context; this worker
                # builds its own below, with gevent's ssl, and the app imports ssl after this.
                # The warning would be about the arbiter's context, never used here.
                warnings.filterwarnings("ignore", message="Monkey-patching ssl after ssl")
            monkey.patch_all()
        material = self.settings.tls_material
        if material is not None:
            # The arbiter's context is stdlib ssl's, which cannot wrap a socket once gevent
            # patched it: the same certificate, key and options, as gevent's (still root).
            from forkserve.tls import context_of
            self.settings = replace(self.settings, tls=context_of(material))
        super()._post_fork()
        import gevent
        from gevent.event import Event

        self._gevent = gevent
        self.told_to_stop = Event()  # TERM, QUIT, the deadline or the arbiter gone
        # TERM through Python's own handler: it runs at the next bytecode of whichever
        # greenlet runs (or at the hub's next iteration), so a request woken in the same
        # moment as the stop already sees the state (and answers with Connection: close).
        signal.signal(signal.SIGTERM, self._on_term)
        for signum, handler in ((signal.SIGQUIT, self._g_quit),
                                (signal.SIGUSR2, self._g_cancel),
                                (signal.SIGUSR1, self._g_reopen), (signal.SIGTTOU, self._g_pause),
                                (signal.SIGTTIN, self._g_lameduck),
                                (signal.SIGWINCH, self.counters.snapshot)):
            gevent.signal_handler(signum, handler)
        # The timeout kill through Python's own handler, not gevent's: a worker that timed out
        # is one whose hub is blocked (a greenlet stuck in a call that never yields), so a
        # gevent handler would never run; Python's runs in that very greenlet (the call is
        # interrupted), which is where the stack to log is.
        signal.signal(signal.SIGABRT, self._on_abort)

    # -- serving -----------------------------------------------------------------------------
    def should_close(self) -> bool:
        return self.state is not RUNNING or self.settings.keepalive <= 0 or self.lameduck

    def serve(self) -> None:
        gevent = self._gevent
        from gevent.event import Event

        self.setup_http()
        self.hub = gevent.get_hub()
        self.green_loop = self.hub.loop
        # Connections open (accepted, not yet released) against the limit; slot_freed is set
        # at each release, for an acceptor waiting for a free slot and for the end of serve().
        self.limit = min(self.worker_connections, self.max_connections or self.worker_connections)
        self.open_slots = 0
        self.slot_freed = Event()
        # Kept-alive clients that sent more (or whose idle watch is up: True), in order.
        self.ready: deque[tuple[GreenConnection, bool]] = deque()
        self.parked: list[Any] = []  # runners waiting for ready clients
        self.wake_pending = False  # _wake_runner is scheduled for the loop's next turn
        self.wakeable: set[Any] = set()  # the acceptors inside their loops (_throw_wake)
        self.acceptors = [gevent.spawn(self._acceptor, listener) for listener in self.listeners]
        ticker = gevent.spawn(self._ticker)
        watcher = gevent.spawn(self._watch_arbiter)
        timer = gevent.spawn(self._request_timer) if self.request_timeout else None
        try:
            gevent.joinall(self.acceptors)
            if self.state is RUNNING:
                # Paused (TTOU), or spawned while paused: no listener left, but the worker
                # stays (serving its open connections) until it is told to stop; the arbiter
                # retires it once a resumed generation serves. Returning would be an exit
                # the arbiter did not ask for: a "crash", replaced, over and over.
                self.told_to_stop.wait()
            while self.open_slots:  # every connection served to its end
                self.slot_freed.clear()
                self.slot_freed.wait()
        finally:
            ticker.kill(block=False)
            watcher.kill(block=False)
            if timer is not None:
                timer.kill(block=False)
            for listener in self.listeners:
                listener.sock.close()

    @property
    def worker_connections(self) -> int:
        return self.settings.worker_connections

    @property
    def max_connections(self) -> int | None:
        return self.settings.max_connections

    def _acceptor(self, listener: Listener) -> None:
        from gevent.socket import wait_read

        me = self._gevent.getcurrent()
        self.wakeable.add(me)  # (see _throw_wake: every wait of this loop catches _Wake)
        try:
            while self.state is RUNNING and not self.pause_requested:
                try:
                    self._wait_for_slot()
                    if self.state is not RUNNING:
                        break
                    wait_read(listener.fd)
                    self._accept_ready(listener)
                    pause = self.accept_paused_for()
                    if pause:
                        self._gevent.sleep(pause)  # out of descriptors: the listener stays readable
                except _Wake:
                    continue
        finally:
            self.wakeable.discard(me)
        # Stopping: serve the clients already queued (none is reset), then stop listening;
        # past the deadline they get a 503 instead. Retiring (max-requests) takes no more.
        if self.state is WorkerState.STOPPING and self.takes_queue(listener) or (
                self.state is RUNNING and self.pause_requested):
            self.take_queue(listener, lambda: self._accept_ready(listener), self._gevent.sleep)
        elif self.state is WorkerState.CANCELLED:
            self.turn_away_queue([listener])
        listener.sock.close()

    def _accept_ready(self, listener: Listener) -> None:
        sleep = self._gevent.sleep
        while True:
            accepted = self.accept_from(listener)
            if accepted is None:
                return
            # (Stopping, the queue is taken one free slot at a time.)
            self._wait_for_slot()
            self.open_slots += 1
            self._gevent.spawn(self._serve_connection, *accepted, listener)
            if self.open_slots >= self.limit and self.state is RUNNING:
                return  # --worker-connections reached: the rest wait in the backlog
            # One client at a time, its first request served before the next accept: taking
            # the whole queue at once, the first worker to wake took most of a burst of
            # kept-alive clients (c=500: 400 against 100, for as long as they stay), and the
            # other worker idled while this one's latency grew tenfold. (Running only: the
            # stop's drain of the queue runs outside the acceptor's catch of _Wake, and must
            # not yield to the kill that throws it.)
            if self.state is RUNNING:
                sleep(0)

    def _serve_connection(self, sock: socket.socket, addr: Any, listener: Listener) -> None:
        """A new client, in a greenlet of its own: its first requests, then (as a runner)
        whatever other clients are ready."""
        try:
            conn: GreenConnection = self.open_connection(sock, addr)  # type: ignore[assignment]
        except BaseException:
            sock.close()
            self._free_slot()
            raise
        conn.listener = listener
        self.admit(conn)
        self._serve_turn(conn, self._gevent.getcurrent())
        self._run_ready()

    def _serve_turn(self, conn: GreenConnection, owner: Any) -> None:
        """Serve what the client sent (pipelined requests too) in this greenlet; then keep
        the connection alive with no greenlet (_keep_idle), or end it."""
        conn.owner = owner
        kept = linger = False
        try:
            ending = self.serve_connection(conn, self.environs[id(conn.listener)])
            linger = ending is LINGER
            kept = ending is IDLE and self._keep_idle(conn)
        except (ClientGone, HardStop, Abandoned, RequestCancelled):
            # The client left, or a stop, a drain or a cancel was thrown in: it ends here.
            linger = False
        finally:
            if not kept:
                self.end_connection(conn, linger)

    def _keep_idle(self, conn: GreenConnection) -> bool:
        """Between requests: watch for the client's next request until the keep-alive timeout
        (a stopping worker: until the close grace, see stop_grace_end, so that a request that
        is on its way is still answered). False: close it now."""
        keepalive = self.settings.keepalive
        state = self.state
        if keepalive <= 0 or state is CANCELLED or state is HALTING:
            return False
        conn.owner = None
        conn.watch_idle(self.green_loop, keepalive, self._idle_ended)
        if state is not RUNNING:
            conn.cut_idle(self.green_loop, stop_grace_end(conn, self.stop_began()))
        return True

    def _idle_ended(self, conn: GreenConnection, expired: bool) -> None:
        # -- runs in the hub: the client sent more (or its idle time is up). Queued for the
        # runners, woken once the loop has run every callback of this turn.
        conn.unwatch_idle()
        self.ready.append((conn, expired))
        if not self.wake_pending:
            self.wake_pending = True
            self.green_loop.run_callback(self._wake_runner)

    def _wake_runner(self) -> None:
        # -- runs in the hub
        self.wake_pending = False
        if not self.ready:
            return  # a runner that was not waiting took them
        if self.parked:
            self.parked.pop().switch()
        else:
            self._gevent.spawn(self._run_ready)

    def _run_ready(self) -> None:
        """A runner: serve the ready clients, in order, then wait for more (parked), or end
        when enough runners are parked already."""
        me = self._gevent.getcurrent()
        ready, parked, hub = self.ready, self.parked, self.hub
        while True:
            while ready:
                conn, expired = ready.popleft()
                if ready and not self.wake_pending:
                    # Should this one block (its app waits), the loop's next turn gives the
                    # rest to another runner (_wake_runner; if none blocks, the queue is
                    # empty by then and it does nothing).
                    self.wake_pending = True
                    self.green_loop.run_callback(self._wake_runner)
                if (expired or self.state is HALTING) and not self._came_in_time(conn):
                    continue
                self._serve_turn(conn, me)
            if len(parked) >= PARKED_RUNNERS:
                return
            parked.append(me)
            try:
                hub.switch()
            except (HardStop, RequestCancelled, RequestTimedOut, Abandoned):
                # Thrown in for a request this runner finished before it landed.
                if me in parked:
                    parked.remove(me)

    def _came_in_time(self, conn: GreenConnection) -> bool:
        """A kept-alive connection's wait is up, or the worker halts: True when its next
        request is here all the same (served, with Connection: close if stopping); else it
        is closed, or watched again if its time is not up after all."""
        state = self.state
        if state is not HALTING and state is not CANCELLED:
            if conn.readable_now():
                return True
            keepalive = self.settings.keepalive
            until = conn.idle_since + keepalive
            if state is RUNNING and time.monotonic() < until:
                # The timer ran from the loop's time, which was behind: a request that held
                # the loop (computing, not waiting) made this turn long. Not up yet.
                conn.watch_idle(self.green_loop, keepalive, self._idle_ended)
                conn.cut_idle(self.green_loop, until)
                return False
        self.end_connection(conn, False)
        return False

    def _kept_alive(self) -> list[GreenConnection]:
        """The connections waiting for their next request (watch_idle)."""
        return [conn for conn in self.connections
                if isinstance(conn, GreenConnection) and conn.idle_watched]

    def _close_idle(self) -> None:
        """The cancel or a hard stop: the kept-alive connections close now."""
        for conn in self._kept_alive():
            conn.unwatch_idle()
            self.end_connection(conn, False)

    def release(self, conn: Connection, linger: bool = False) -> bool:
        released = super().release(conn, linger)
        if released:
            self._free_slot()
        return released

    def _wait_for_slot(self) -> None:
        """Until fewer than the limit of connections are open."""
        while self.open_slots >= self.limit:
            self.slot_freed.clear()
            self.slot_freed.wait()

    def _free_slot(self) -> None:
        self.open_slots -= 1
        self.slot_freed.set()

    def _ticker(self) -> None:
        """Heartbeats and telemetry writes, once per heartbeat interval."""
        while True:
            self._gevent.sleep(self.heartbeat_interval)
            self.write_telemetry()
            self.heartbeat(time.monotonic())

    def _request_timer(self) -> None:
        """--request-timeout: sleeps until the next timed request's deadline (never longer
        than the timeout itself: a request that begins meanwhile ends no sooner), and throws
        RequestTimedOut into each overdue request's greenlet. Like any greenlet, it runs only
        when the others yield: a request computing without a pause holds the whole worker
        (and its heartbeat: --timeout ends that), and is cancelled at its next wait."""
        gevent = self._gevent
        hub = gevent.get_hub()
        while True:
            now = time.monotonic()
            for context, conn in self.overdue_requests(now):
                # Thrown from the hub's next turn (as Greenlet.kill does), and only if the
                # request is still the same by then: it may have ended in this very turn.
                hub.loop.run_callback(self._throw_timeout, context, conn.owner)
            gevent.sleep(max(self.next_request_deadline(now) - now, 0.0) + 0.001)

    def _throw_timeout(self, context: RequestContext, owner: Any) -> None:
        # -- runs in the hub
        if context not in self.fired or owner.dead:
            return
        _throw(owner, RequestTimedOut())

    def _watch_arbiter(self) -> None:
        from gevent.socket import wait_read

        wait_read(self.alive_fd)  # EOF: the arbiter is gone
        self.arbiter_gone()

    # -- signals (each handler runs in a greenlet of its own) --------------------------------
    def _wake_acceptors(self) -> None:
        acceptors = getattr(self, "acceptors", ())
        if acceptors:
            loop = self._gevent.get_hub().loop
            for acceptor in acceptors:
                loop.run_callback(self._throw_wake, acceptor)
        # gevent's signal watchers replace the C handler that would have written the signal
        # to the wakeup pipe; the wind-down wait (background tasks) watches that pipe.
        try:
            os.write(self.wakeup_w, b"\0")
        except BlockingIOError:
            return  # full: the waiter is awake anyway

    def _throw_wake(self, acceptor: Any) -> None:
        # -- runs in the hub, a turn after _wake_acceptors (as Greenlet.kill's throw would),
        # and only into an acceptor still in its loop: every wait there catches _Wake. By then
        # an acceptor may have left its loop by itself (woken by a client as the stop came):
        # its drain of the queue catches nothing, and a _Wake there escaped the greenlet
        # ("failed with _Wake" on stderr) and cut the drain short.
        if acceptor not in self.wakeable:
            return
        _throw(acceptor, _Wake)

    def _stop_gracefully(self) -> None:
        self._enter(WorkerEvent.STOP)
        self.drain_reported = self.counters.draining()
        self._wake_acceptors()
        # Every wait on a client wakes and applies the stop's graces itself (Pipeline.interrupted);
        # a kept-alive connection waits no longer than its close grace.
        self.signal_stop()
        began = self.stop_began()
        for conn in self._kept_alive():
            conn.cut_idle(self.green_loop, stop_grace_end(conn, began))
        self.told_to_stop.set()

    def retire(self, reason: str, description: str) -> None:
        super().retire(reason, description)
        self._wake_acceptors()  # (from the ticker's heartbeat too: the acceptors must notice)

    def request_done(self) -> None:
        super().request_done()
        if self.state is not RUNNING:
            self._wake_acceptors()  # retiring (max-requests): the acceptors must notice
        if self.counters.in_flight_requests == 0:
            # Nothing else in flight: the worker is about to go idle, so write telemetry now
            # (as the sync worker does before it waits); under load the ticker batches it.
            self.write_telemetry()

    def _on_term(self, signum: int, frame: Any) -> None:
        # -- runs in a signal handler: record the state, let a greenlet do the rest.
        self._enter(WorkerEvent.STOP)
        self._gevent.spawn(self._stop_gracefully)

    def _g_cancel(self) -> None:
        self._enter(WorkerEvent.CANCEL)
        self._wake_acceptors()
        self.signal_stop(cancel=True)  # waits for a request head end (Pipeline.interrupted)
        self.told_to_stop.set()
        self._close_idle()
        loop = self.green_loop
        for conn in list(self.connections):
            if conn.in_request or conn.released:
                if conn.taken:
                    conn.cut()  # a WebSocket: the app's reader greenlet and the client see it end
                loop.run_callback(self._throw_cancel, conn, conn.owner)

    def _throw_cancel(self, conn: Connection, owner: Any) -> None:
        # -- runs in the hub, a turn after the cancel (as Greenlet.kill's throw would), and
        # only into a runner still serving that request: by then it may serve another.
        if owner is None or owner.dead or conn.owner is not owner or not (
                conn.in_request or conn.released):
            return
        _throw(owner, RequestCancelled("cancelled: the drain timeout passed"))

    def _g_quit(self) -> None:
        self._enter(WorkerEvent.HALT)
        self._wake_acceptors()
        self.told_to_stop.set()
        self._close_idle()
        while self.ready:  # (no runner serves them now)
            self.end_connection(self.ready.popleft()[0], False)
        # Each greenlet serving a connection once (a runner serves one at a time; a second
        # throw would land in whatever it does next).
        for owner in {conn.owner for conn in self.connections if conn.owner is not None}:
            owner.kill(HardStop("hard stop requested"), block=False)

    def _on_abort(self, signum: int, frame: Any) -> None:
        # -- runs in a signal handler, in whichever greenlet ran (see _post_fork).
        self._enter(WorkerEvent.HALT)
        self.timed_out = True
        self.report_abort(frame)
        hub = self._gevent.get_hub()
        hub.loop.run_callback(self._g_quit)  # the other greenlets, once the hub runs again
        if self._gevent.getcurrent() is not hub:
            # End the greenlet that was stuck (a connection's: it catches HardStop).
            raise HardStop("killed by the arbiter: no heartbeat within --timeout")

    def _g_reopen(self) -> None:
        self.reopen_logs()

    def _g_lameduck(self) -> None:
        self.lameduck = True

    def _g_pause(self) -> None:
        self.pause_requested = True
        self._wake_acceptors()

    def handle_wakeups(self) -> None:
        """The wakeup pipe also carries the background pool's wake-ups; the signals themselves
        are gevent's to handle, so here the pipe is only drained."""
        drain_pipe(self.wakeup_r)


__all__ = ["GeventWorker"]
