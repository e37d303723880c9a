"""What this process may use: CPUs (the affinity mask, capped by the cgroup's CPU quota) and
memory (the cgroup's limit, else the machine's), for the defaults that are sized by them.

``os.sched_getaffinity`` alone is wrong in most containers: on a Kubernetes node without the
static CPU manager it lists every core of the node, while the pod's ``limits.cpu`` is enforced as
a CFS quota. Sizing thread pools by the node then runs 64 threads on a 4-CPU budget, and the
pod spends its time throttled.
"""

from __future__ import annotations

import math
import os
import resource
from collections.abc import Iterator
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")
PROC_CGROUP = Path("/proc/self/cgroup")
V1_MOUNTS = {"cpu": ("cpu", "cpu,cpuacct", "cpuacct,cpu"), "memory": ("memory",)}
"""Where a v1 hierarchy mounts each controller."""


def available_cpus(root: Path = CGROUP_ROOT, proc_cgroup: Path = PROC_CGROUP) -> int:
    """The smallest of the affinity mask and the cgroup quota, rounded up, at least 1."""
    cpus = len(os.sched_getaffinity(0))
    quota = cgroup_cpu_quota(root, proc_cgroup)
    if quota is not None:
        cpus = min(cpus, math.ceil(quota))
    return max(1, cpus)


def cgroup_cpu_quota(root: Path = CGROUP_ROOT, proc_cgroup: Path = PROC_CGROUP) -> float | None:
    """CPUs the cgroup quota allows (quota / period), or None when there is no quota.

    Every cgroup from this process's own up to the mount's root is read (a parent's limit
    binds its children), for v2 (``cpu.max``) and v1 (``cpu.cfs_quota_us`` / ``cpu.cfs_period_us``);
    the tightest wins. Inside a container with its own cgroup namespace the process's cgroup is
    the mount's root, and that is read too.
    """
    limits = [
        limit
        for folder in _cgroup_folders(root, proc_cgroup)
        if (limit := _v2_limit(folder)) is not None or (limit := _v1_limit(folder)) is not None
    ]
    return min(limits, default=None)


def _cgroup_folders(root: Path, proc_cgroup: Path, controller: str = "cpu") -> Iterator[Path]:
    """The cgroup folders that can limit ``controller`` for this process, its own first."""
    v2_path = v1_path = ""
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        lines = []
    for line in lines:  # "0::/path" (v2) or "4:cpu,cpuacct:/path" (v1)
        controllers, _, path = line.partition(":")[2].partition(":")
        if controllers == "":
            v2_path = path
        elif controller in controllers.split(","):
            v1_path = path
    yield from _up_to(root, root / v2_path.strip("/"))
    for mount in V1_MOUNTS[controller]:
        yield from _up_to(root / mount, root / mount / v1_path.strip("/"))


def _up_to(mount: Path, folder: Path) -> Iterator[Path]:
    """``folder`` and its parents up to ``mount``; only ``mount`` when the host's path is not
    mounted inside this namespace."""
    if not folder.is_dir():
        folder = mount
    while folder != mount and mount in folder.parents:
        yield folder
        folder = folder.parent
    yield mount


def _v2_limit(folder: Path) -> float | None:
    try:
        quota, _, period = (folder / "cpu.max").read_text().strip().partition(" ")
    except OSError:
        return None
    if quota == "max" or not period:
        return None
    return _ratio(quota, period)


def _v1_limit(folder: Path) -> float | None:
    try:
        quota = (folder / "cpu.cfs_quota_us").read_text().strip()
        period = (folder / "cpu.cfs_period_us").read_text().strip()
    except OSError:
        return None
    return _ratio(quota, period)


def _ratio(quota: str, period: str) -> float | None:
    try:
        q, p = int(quota), int(period)
    except ValueError:
        return None
    return q / p if q > 0 and p > 0 else None


def memory_limit_bytes(root: Path = CGROUP_ROOT, proc_cgroup: Path = PROC_CGROUP) -> int:
    """The tightest cgroup memory limit over this process's cgroup and its parents (v2
    ``memory.max``, v1 ``memory.limit_in_bytes``), else the machine's physical memory."""
    physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    limits = [physical]
    for folder in _cgroup_folders(root, proc_cgroup, "memory"):
        for name in ("memory.max", "memory.limit_in_bytes"):
            try:
                text = (folder / name).read_text().strip()
            except OSError:
                continue
            if text.isdigit():  # "max" (v2) means none; v1 says "none" with a huge number
                limits.append(int(text))
    return min(limits)


def raise_open_file_limit() -> int:
    """Lift the soft open-file limit to the hard one (each connection holds a descriptor);
    returns the soft limit now in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError):  # a hard limit of "unlimited" is refused on some kernels
            pass
    return soft
