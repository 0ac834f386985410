"""What this machine (or container) gives us: how many CPUs we may use, and why.

Owns: the CPU count the default worker count follows: the CPUs this process may run on
(affinity: ``taskset``, a cpuset) and the cgroup's CPU quota (v2 ``cpu.max``, v1
``cpu.cfs_quota_us`` / ``cpu.cfs_period_us``), the smaller of the two. A pod limited to 2
CPUs on a 64-core node sees 64 CPUs by affinity; forking 64 workers there gets it throttled
or OOM-killed, so the quota wins.

The quota is read for this process's own cgroup and each of its parents (a parent's limit
binds the children too), wherever ``/proc/self/cgroup`` says that is; in a container with a
cgroup namespace that is the root of ``/sys/fs/cgroup``.

Imports only the standard library (config.py reads it).
"""

from __future__ import annotations

import math
import os
from pathlib import Path

CGROUP_ROOT = "/sys/fs/cgroup"
PROC_CGROUP = "/proc/self/cgroup"


def usable_cpus(proc_cgroup: str = PROC_CGROUP, root: str = CGROUP_ROOT) -> tuple[int, str]:
    """(CPUs, where that number came from), at least 1."""
    try:
        count, why = len(os.sched_getaffinity(0)), "CPU affinity"
    except (AttributeError, OSError):
        count, why = os.cpu_count() or 1, "CPU count"
    quota = cpu_quota(proc_cgroup, root)
    if quota is not None:
        limit, where = quota
        cpus = max(1, math.ceil(limit))
        if cpus < count:
            count, why = cpus, f"{where} ({limit:g} CPUs)"
    return max(1, count), why


def cpu_quota(proc_cgroup: str = PROC_CGROUP, root: str = CGROUP_ROOT) -> tuple[float, str] | None:
    """The tightest CPU quota on this process's cgroup path, in CPUs, and the file it is in;
    None where there is none (unlimited, no cgroup, unreadable)."""
    try:
        lines = Path(proc_cgroup).read_text().splitlines()
    except OSError:
        return None
    found: list[tuple[float, str]] = []
    for line in lines:
        _, controllers, path = (line.split(":", 2) + ["", ""])[:3]
        if controllers == "":  # cgroup v2: "0::/path"
            for directory in _upwards(Path(root), path):
                quota = _v2(directory / "cpu.max")
                if quota is not None:
                    found.append((quota, "cgroup cpu.max"))
        elif "cpu" in controllers.split(","):  # cgroup v1: "4:cpu,cpuacct:/path"
            for mount in (Path(root) / controllers, Path(root) / "cpu,cpuacct", Path(root) / "cpu"):
                for directory in _upwards(mount, path):
                    quota = _v1(directory)
                    if quota is not None:
                        found.append((quota, "cgroup cpu.cfs_quota_us"))
    return min(found) if found else None


def _upwards(mount: Path, path: str) -> list[Path]:
    """``mount/a/b``, ``mount/a``, ``mount``: a path as seen from outside a cgroup
    namespace, its parents, and the mount's root (where a container sees its own)."""
    parts = [p for p in path.strip().split("/") if p and p != ".."]
    return [mount.joinpath(*parts[:n]) for n in range(len(parts), -1, -1)]


def _v2(path: Path) -> float | None:
    try:
        quota, _, period = path.read_text().strip().partition(" ")
    except OSError:
        return None
    if quota == "max" or not quota.isdigit() or not period.isdigit() or int(period) == 0:
        return None
    return int(quota) / int(period)


def _v1(directory: Path) -> float | None:
    try:
        quota = int((directory / "cpu.cfs_quota_us").read_text().strip())
        period = int((directory / "cpu.cfs_period_us").read_text().strip())
    except (OSError, ValueError):
        return None
    if quota <= 0 or period <= 0:
        return None  # -1: no quota
    return quota / period
