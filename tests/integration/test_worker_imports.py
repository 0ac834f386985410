"""What a worker carries in memory (issue 16's worker RSS target, measured by bench/run.py;
here only which modules are there, which does not depend on the machine).

- No worker imports what only an optional feature uses: the email package (the Date header is
  formatted by forkserve), logging.config and logging.handlers (--log-config, --log-syslog),
  tempfile (--pid, metrics), configparser (an INI --log-config), the idna codec (a str host
  name given to getaddrinfo), sysconfig (wording an import error), subprocess (the USR2
  upgrade's check), forkserve.reloader and its queue module (--reload). Each was 0.1 to
  2 MiB of every worker's RSS.
- A gevent server's arbiter has imported gevent's modules and ssl before forking, unpatched,
  so that every worker shares those pages instead of building its own (4 MiB a worker).
- Every server's arbiter has imported hashlib and ssl, so OpenSSL's libcrypto and libssl are
  initialised once, there, and not in each worker that imports them (2.1 and 1.4 MiB a Flask
  worker).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from forkserve.workers.gevent import SHARED_MODULES
from tests.harness import get, wait_for

CLASS_ARGS = {"sync": (), "thread": ("-k", "thread", "--threads", "4"), "gevent": ("-k", "gevent")}
OPTIONAL = ("email", "email.utils", "logging.config", "logging.handlers", "tempfile",
            "configparser", "encodings.idna", "sysconfig", "socketserver", "subprocess",
            "forkserve.reloader")
# gevent's patch_all looks for plugins with importlib.metadata, which imports email (as
# gunicorn's gevent worker does too), and patches subprocess: everything else holds for gevent
# as well.
PULLED_BY_GEVENT = {"email", "email.utils", "tempfile", "subprocess"}
SHARED_BY_GEVENT = SHARED_MODULES


@pytest.mark.parametrize("worker_class", list(CLASS_ARGS))
def test_workers_import_no_optional_feature(server_factory: Any, tmp_path: Path,
                                            worker_class: str) -> None:
    modules_file = tmp_path / "arbiter.json"
    server = server_factory("--hooks", "tests.apps.modules_hooks", *CLASS_ARGS[worker_class],
                            app="tests.apps.modules:app",
                            env={"MODULES_FILE": str(modules_file)}).wait_ready()
    wait_for(modules_file.exists, 10, "the when_ready hook's file")
    arbiter = json.loads(modules_file.read_text())
    seen: dict[int, set[str]] = {}

    def every_worker() -> bool:
        response = get(server.port, "/")
        assert response.status == 200
        seen[len(seen)] = set(json.loads(response.body))
        return len(seen) >= 6

    wait_for(every_worker, 15, "six answers")
    allowed = PULLED_BY_GEVENT if worker_class == "gevent" else set()
    for modules in seen.values():
        assert "forkserve.workers.pipeline" in modules  # the walk sees a worker's modules
        unexpected = {name for name in OPTIONAL if name in modules} - allowed
        assert not unexpected, f"a {worker_class} worker imported {sorted(unexpected)}"
    unexpected_arbiter = {name for name in OPTIONAL if name in arbiter["modules"]} - allowed
    assert not unexpected_arbiter, f"the arbiter imported {sorted(unexpected_arbiter)}"
    assert "_hashlib" in arbiter["modules"], "the arbiter did not share hashlib"
    assert "_ssl" in arbiter["modules"], "the arbiter did not share ssl"
    if worker_class == "gevent":
        missing = [name for name in SHARED_BY_GEVENT if name not in arbiter["modules"]]
        assert not missing, f"the arbiter did not share {missing}"
        assert arbiter["socket_patched"] is False  # imported, never patched, in the arbiter
    else:
        assert not [name for name in arbiter["modules"] if name.startswith("gevent")]
