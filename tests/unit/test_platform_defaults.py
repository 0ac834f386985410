"""What the platform decides where the user did not (issue 12): the CPUs a cgroup quota allows
(forkserve.machine, over fake /proc/self/cgroup and cgroup trees), and $PORT, WEB_CONCURRENCY
and --threads in the configuration (forkserve.config)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from forkserve.config import ConfigError, parse_args, resolve
from forkserve.machine import cpu_quota, usable_cpus


def cgroup(tmp_path: Path, proc: str, files: dict[str, str]) -> tuple[str, str]:
    """A /proc/self/cgroup with ``proc`` and a cgroup root holding ``files``."""
    root = tmp_path / "cgroup"
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    (tmp_path / "proc").write_text(proc)
    return str(tmp_path / "proc"), str(root)


@pytest.mark.parametrize("proc, files, quota", [
    # v2 in a container (cgroup namespace: the root is ours)
    ("0::/\n", {"cpu.max": "200000 100000\n"}, (2.0, "cgroup cpu.max")),
    ("0::/\n", {"cpu.max": "max 100000\n"}, None),
    ("0::/\n", {"cpu.max": "150000 100000\n"}, (1.5, "cgroup cpu.max")),
    # v2 seen from the host: the process's own path, and a tighter parent
    ("0::/kubepods/pod1/c1\n", {"kubepods/pod1/c1/cpu.max": "400000 100000",
                                "kubepods/pod1/cpu.max": "300000 100000"}, (3.0, "cgroup cpu.max")),
    # v1
    ("4:cpu,cpuacct:/docker/abc\n2:memory:/docker/abc\n",
     {"cpu,cpuacct/docker/abc/cpu.cfs_quota_us": "50000", "cpu,cpuacct/docker/abc/cpu.cfs_period_us": "100000"},
     (0.5, "cgroup cpu.cfs_quota_us")),
    ("4:cpu,cpuacct:/\n", {"cpu,cpuacct/cpu.cfs_quota_us": "-1", "cpu,cpuacct/cpu.cfs_period_us": "100000"}, None),
    # nothing there, or garbage
    ("0::/\n", {}, None),
    ("0::/\n", {"cpu.max": "lots\n"}, None),
])
def test_the_cgroup_quota(tmp_path: Path, proc: str, files: dict[str, str],
                          quota: tuple[float, str] | None) -> None:
    assert cpu_quota(*cgroup(tmp_path, proc, files)) == quota


def test_no_proc_file_is_no_quota(tmp_path: Path) -> None:
    assert cpu_quota(str(tmp_path / "absent"), str(tmp_path)) is None


def test_the_quota_wins_over_affinity_rounded_up(tmp_path: Path) -> None:
    affinity = len(os.sched_getaffinity(0))
    paths = cgroup(tmp_path, "0::/\n", {"cpu.max": "50000 100000"})  # half a CPU
    # One CPU at least (rounded up); the quota named only where it is what limits us.
    assert usable_cpus(*paths) == ((1, "cgroup cpu.max (0.5 CPUs)") if affinity > 1
                                   else (1, "CPU affinity"))
    roomy = cgroup(tmp_path / "b", "0::/\n", {"cpu.max": f"{(affinity + 8) * 100000} 100000"})
    assert usable_cpus(*roomy) == (affinity, "CPU affinity")  # a quota above what we have


# -- the configuration ----------------------------------------------------------------------------
def config(argv: list[str], env: dict[str, str] | None = None) -> Any:
    return resolve(parse_args([*argv, "tests.apps.basic:app"], "test")[0], env or {})


def test_port_binds_every_interface_unless_bind_is_given() -> None:
    c = config([], {"PORT": "8123"})
    assert c.bind == ["0.0.0.0:8123"] and c.derived["bind"] == "from $PORT"
    assert "0.0.0.0:8123 (from $PORT)" in c.describe()
    assert config(["-b", "127.0.0.1:9"], {"PORT": "8123"}).bind == ["127.0.0.1:9"]
    assert config([], {"PORT": "8123", "FORKSERVE_BIND": "unix:/tmp/x"}).bind == ["unix:/tmp/x"]


def test_web_concurrency_is_the_default_worker_count() -> None:
    c = config([], {"WEB_CONCURRENCY": "3"})
    assert c.worker_count == 3 and c.derived["workers"] == "from WEB_CONCURRENCY"
    assert config(["-w", "5"], {"WEB_CONCURRENCY": "3"}).worker_count == 5
    assert "workers" not in config(["-w", "5"], {"WEB_CONCURRENCY": "3"}).derived


def test_threads_alone_choose_the_thread_worker() -> None:
    c = config(["--threads", "8"])
    assert c.worker_class == "thread" and c.derived["worker_class"] == "from --threads 8"
    assert config(["--threads", "1"]).worker_class == "sync"
    assert config(["-k", "gevent", "--threads", "8"]).worker_class == "gevent"
    assert config(["-k", "thread", "--threads", "8"]).derived.get("worker_class") is None


@pytest.mark.parametrize("argv, env, message", [
    ([], {"PORT": "http"}, "PORT: expected a port number, got 'http'"),
    ([], {"PORT": "70000"}, "PORT: expected a port number, got '70000'"),
    ([], {"WEB_CONCURRENCY": "0"}, "WEB_CONCURRENCY: expected a whole number of at least 1, got '0'"),
    (["-k", "sync", "--threads", "4"], {},
     "--threads 4 needs -k thread: -k sync serves one request at a time per worker"),
])
def test_bad_platform_values_are_one_line(argv: list[str], env: dict[str, str], message: str) -> None:
    with pytest.raises(ConfigError) as caught:
        config(argv, env)
    assert str(caught.value) == message
