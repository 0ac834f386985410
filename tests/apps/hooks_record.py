"""A hooks module (--hooks tests.apps.hooks_record) that records every call: one JSON line
per call, appended to the file named by HOOKS_LOG (one os.write on an O_APPEND descriptor:
lines from the arbiter and every worker never interleave). HOOKS_RAISE names hooks that
raise RuntimeError after recording their call; pre_request raises for the path
/pre-request-fails."""

from __future__ import annotations

import json
import os


def _record(hook, **fields):
    line = json.dumps({"hook": hook, "pid": os.getpid(), **fields}) + "\n"
    fd = os.open(os.environ["HOOKS_LOG"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line.encode())
    finally:
        os.close(fd)
    if hook in os.environ.get("HOOKS_RAISE", "").split(","):
        raise RuntimeError(f"{hook} failed on purpose")


def _server(server):
    return {"server_pid": server.pid, "num_workers": server.num_workers, "app": server.app,
            "bind": server.cfg.bind}


def _worker(worker):
    return {"worker_pid": worker.pid, "age": worker.age, "worker_id": worker.worker_id,
            "generation": worker.generation}


def on_starting(server):
    server.log.info("on_starting hook: %s workers", server.num_workers)
    _record("on_starting", **_server(server))


def on_reload(server):
    _record("on_reload", **_server(server))


def when_ready(server):
    _record("when_ready", **_server(server))


def pre_fork(server, worker):
    _record("pre_fork", **_server(server), **_worker(worker))


def post_fork(server, worker):
    _record("post_fork", **_server(server), **_worker(worker))


def post_worker_init(worker):
    _record("post_worker_init", **_worker(worker), has_app=callable(worker.wsgi))


def worker_int(worker):
    _record("worker_int", **_worker(worker))


def worker_abort(worker):
    _record("worker_abort", **_worker(worker))


def pre_exec(server):
    _record("pre_exec", **_server(server))


def pre_request(worker, req):
    _record("pre_request", worker_pid=worker.pid, method=req.method, path=req.path,
            query=req.query, uri=req.uri, version=list(req.version),
            agent=dict(req.headers).get("USER-AGENT", ""))
    if req.path == "/pre-request-fails":
        raise RuntimeError("pre_request failed on purpose")


def post_request(worker, req, environ, resp):
    _record("post_request", worker_pid=worker.pid, path=req.path, status=resp.status,
            status_code=resp.status_code, sent=resp.sent, path_info=environ["PATH_INFO"])


def child_exit(server, worker):
    _record("child_exit", **_server(server), **_worker(worker), reason=worker.exit_reason)


def worker_exit(server, worker):
    _record("worker_exit", **_server(server), **_worker(worker))


def nworkers_changed(server, new_value, old_value):
    _record("nworkers_changed", new=new_value, old=old_value)


def on_exit(server):
    _record("on_exit", **_server(server))
