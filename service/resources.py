"""What this process may use: CPUs (the affinity mask, capped by the cgroup's CPU quota) and
memory (the cgroup's limit, else the machine's), for the defaults that are sized by them.

``os.sched_getaffinity`` alone is wrong in most containers: on a Kubernetes node without the
static CPU manager it lists every core of the node, while the pod's ``limits.cpu`` is enforced as
a CFS quota. Sizing thread pools by the node then runs 64 threads on a 4-CPU budget, and the
pod spends its time throttled.
"""

from __future__ import annotations

import math
import mmap
import os
import resource
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")

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


ARTIFACTS = ("model.onnx", "model.pt", "model.pt2")
WORKER_BASE_BYTES = 512 << 20
"""A worker's memory before its models: the interpreter, torch, onnxruntime, the server."""
MODEL_BYTES = 256 << 20
"""Each model's memory beyond its artifact's: its runtime's arenas grown by warmup to the
largest batch, its sessions, tokenizer and pipeline (docs/performance.md, "Defaults that win":
the bundled repository, 8 models and 111 MiB of artifacts, is 2.7 GiB RSS a worker)."""
MODEL_COPY_FACTOR = 3
"""A loaded model's memory over its artifact's size: the weights, in each of its sessions."""
SUPERVISOR_BYTES = 128 << 20
"""The supervisor of several workers (about 85 MiB RSS measured)."""


def cuda_visible(environ: dict[str, str] | None = None, dev: Path = Path("/dev")) -> bool:
    """Whether an NVIDIA GPU is visible to this process, without loading a CUDA library: a
    device node, and ``CUDA_VISIBLE_DEVICES`` not hiding every device."""
    env = os.environ if environ is None else environ
    visible = env.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and visible.strip().lower() in ("", "-1", "none", "void"):
        return False
    return any(dev.glob("nvidia[0-9]*"))


def repository_model_bytes(repository: Path, models: list[str] | None = None) -> int:
    """What one worker's models take, estimated from ``repository`` (only ``models`` when
    named): per model, :data:`MODEL_BYTES` + :data:`MODEL_COPY_FACTOR` × its newest version's
    largest artifact. A model folder given as the repository itself (``config.yaml`` at its
    root) counts as one model. 0 when unreadable: the estimate must never stop a server that
    would start."""
    try:
        folders = (
            [repository]
            if (repository / "config.yaml").is_file()
            else [p for p in repository.iterdir() if (p / "config.yaml").is_file()]
        )
        total = 0
        for folder in folders:
            if models is not None and folder.name not in models and folder != repository:
                continue
            versions = [p for p in folder.iterdir() if p.name.isdigit() and p.is_dir()]
            if not versions:
                continue
            newest = max(versions, key=lambda p: int(p.name))
            sizes = [
                (newest / name).stat().st_size for name in ARTIFACTS if (newest / name).is_file()
            ]
            total += MODEL_BYTES + MODEL_COPY_FACTOR * max(sizes, default=0)
        return total
    except OSError:
        return 0


def workers_that_fit(wanted: int, model_bytes: int, limit_bytes: int) -> int:
    """The most workers, up to ``wanted`` and at least one, whose estimated memory (each:
    :data:`WORKER_BASE_BYTES` + ``model_bytes``, plus the supervisor's when there are several)
    stays within 90 % of ``limit_bytes``."""
    per_worker = WORKER_BASE_BYTES + model_bytes
    budget = limit_bytes * 0.9
    count = wanted
    while count > 1 and count * per_worker + SUPERVISOR_BYTES > budget:
        count -= 1
    return count


class CpuUse:
    """Model batches running now on the CPUs this server shares: this process's, and with
    several workers the others' too (one byte per worker in a file the supervisor creates,
    each worker writing its own). A runtime that can run a batch on every CPU or on a share of
    them asks :meth:`contended` before each batch: alone it takes every CPU (a lone request as
    fast as one process can serve it); beside another batch it keeps to its share, so that the
    batches do not split each other's threads (docs/performance.md, "Defaults that win").
    A heuristic read without locks: a stale byte costs one batch its best thread count."""

    def __init__(self) -> None:
        self.local = 0
        self._lock = threading.Lock()
        self._shared: mmap.mmap | None = None
        self._index = 0

    def attach(self, path: Path, index: int) -> None:
        """Share counts through ``path`` (one byte per worker, created by the supervisor)."""
        with path.open("r+b") as file:
            self._shared = mmap.mmap(file.fileno(), 0)
        self._index = index
        self._shared[index] = min(self.local, 255)  # a replacement clears what its predecessor left

    def __enter__(self) -> None:
        with self._lock:
            self.local += 1
            if self._shared is not None:
                self._shared[self._index] = min(self.local, 255)

    def __exit__(self, *exc: object) -> None:
        with self._lock:
            self.local -= 1
            if self._shared is not None:
                self._shared[self._index] = min(self.local, 255)

    def contended(self) -> bool:
        """Whether another batch runs now (asked by a batch already counted in)."""
        if self.local > 1:
            return True
        shared = self._shared
        if shared is None:
            return False
        counts = shared[:]  # bytes: iterating an mmap gives 1-byte strings, these ints
        return any(counts[: self._index]) or any(counts[self._index + 1 :])

    def idle(self) -> bool:
        """Whether no batch runs now, in this process or another worker."""
        shared = self._shared
        return self.local == 0 and (shared is None or not any(shared[:]))


CPU_USE = CpuUse()
"""This process's count (:class:`CpuUse`): the instance threads enter it around each batch."""


class SecondThread:
    """A thread for the second half of a lone image's resize (:mod:`preprocessing.halves`),
    while the CPUs have nothing else to do: no batch runs in any worker (:data:`CPU_USE`) and no
    other image of this worker has it. Under load every CPU already has work, and the halves
    would only add the cost of cutting and pasting; alone, a 640×480 photo's resize and crop
    takes 1.4 ms instead of 2.2 (docs/performance.md, "A lone image's resize in halves").

    Two workers' lone images at the same moment may each take one: four threads on two CPUs for
    a millisecond, as their runtimes each take every CPU for a batch alone (``CpuUse``).

    Off until :meth:`set` turns it on (a server with two CPUs or more, on a Pillow whose resize
    the halves match: ``service.app``)."""

    def __init__(self) -> None:
        self._taken = threading.Lock()
        self._executor: ThreadPoolExecutor | None = None
        self.on = False

    def set(self, on: bool) -> None:
        self.on = on
        if on and self._executor is None:
            self._executor = ThreadPoolExecutor(1, thread_name_prefix="second-half")

    def ready(self) -> bool:
        return self.on and not self._taken.locked() and CPU_USE.idle()

    def __call__(self, first: Callable[[], T], second: Callable[[], T]) -> tuple[T, T]:
        """Both results, ``second`` on the thread; both here if another image has it (or the
        interpreter is shutting down)."""
        executor = self._executor
        if executor is None or not self._taken.acquire(blocking=False):
            return first(), second()
        try:
            try:
                other = executor.submit(second)
            except RuntimeError:  # shutting down: no new futures
                return first(), second()
            try:
                mine = first()
            finally:
                theirs = other.result()  # the half is waited for even when this one raised
            return mine, theirs
        finally:
            self._taken.release()


SECOND_THREAD = SecondThread()
"""This process's :class:`SecondThread` (every image pipeline is given it)."""


def create_cpu_use_file(path: Path, workers: int) -> Path:
    """The file the workers share their :class:`CpuUse` counts through (the supervisor's)."""
    path.write_bytes(bytes(workers))
    return path
