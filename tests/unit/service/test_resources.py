"""Thread defaults follow the CPU the process may use: affinity capped by the cgroup quota."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from service.resources import available_cpus, cgroup_cpu_quota, memory_limit_bytes

AFFINITY = len(os.sched_getaffinity(0))


def write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


@pytest.fixture
def proc(tmp_path: Path) -> Path:
    return tmp_path / "proc-self-cgroup"


def test_no_cgroup_files_means_the_affinity_mask(tmp_path: Path, proc: Path) -> None:
    assert cgroup_cpu_quota(tmp_path / "none", proc) is None
    assert available_cpus(tmp_path / "none", proc) == AFFINITY


@pytest.mark.parametrize(
    ("cpu_max", "quota"),
    [("max 100000", None), ("200000 100000", 2.0), ("150000 100000", 1.5), ("50000 100000", 0.5)],
)
def test_v2_cpu_max_at_the_namespace_root(
    tmp_path: Path, proc: Path, cpu_max: str, quota: float | None
) -> None:
    write(tmp_path / "cpu.max", cpu_max + "\n")
    write(proc, "0::/\n")
    assert cgroup_cpu_quota(tmp_path, proc) == quota


def test_a_quota_rounds_up_and_never_goes_below_one(tmp_path: Path, proc: Path) -> None:
    write(proc, "0::/\n")
    write(tmp_path / "cpu.max", "50000 100000")
    assert available_cpus(tmp_path, proc) == 1
    write(tmp_path / "cpu.max", "150000 100000")
    assert available_cpus(tmp_path, proc) == min(AFFINITY, 2)


def test_a_quota_above_the_affinity_mask_changes_nothing(tmp_path: Path, proc: Path) -> None:
    write(proc, "0::/\n")
    write(tmp_path / "cpu.max", f"{(AFFINITY + 8) * 100000} 100000")
    assert available_cpus(tmp_path, proc) == AFFINITY


def test_v2_the_tightest_of_the_process_cgroup_and_its_parents(tmp_path: Path, proc: Path) -> None:
    write(proc, "0::/kubepods/pod1/ctr\n")
    write(tmp_path / "kubepods" / "cpu.max", "max 100000")
    write(tmp_path / "kubepods" / "pod1" / "cpu.max", "400000 100000")  # the pod's limit
    write(tmp_path / "kubepods" / "pod1" / "ctr" / "cpu.max", "max 100000")
    assert cgroup_cpu_quota(tmp_path, proc) == 4.0


def test_v2_path_not_mounted_here_reads_the_mount_root(tmp_path: Path, proc: Path) -> None:
    write(proc, "0::/host/only/path\n")  # a cgroup namespace: the host's path is not visible
    write(tmp_path / "cpu.max", "300000 100000")
    assert cgroup_cpu_quota(tmp_path, proc) == 3.0


@pytest.mark.parametrize("mount", ["cpu", "cpu,cpuacct"])
def test_v1_cfs_quota_and_period(tmp_path: Path, proc: Path, mount: str) -> None:
    write(proc, "4:cpu,cpuacct:/docker/abc\n2:memory:/docker/abc\n")
    write(tmp_path / mount / "docker" / "abc" / "cpu.cfs_quota_us", "250000\n")
    write(tmp_path / mount / "docker" / "abc" / "cpu.cfs_period_us", "100000\n")
    assert cgroup_cpu_quota(tmp_path, proc) == 2.5
    assert available_cpus(tmp_path, proc) == min(AFFINITY, 3)


def test_v1_no_quota_is_minus_one(tmp_path: Path, proc: Path) -> None:
    write(proc, "4:cpu:/\n")
    write(tmp_path / "cpu" / "cpu.cfs_quota_us", "-1")
    write(tmp_path / "cpu" / "cpu.cfs_period_us", "100000")
    assert cgroup_cpu_quota(tmp_path, proc) is None


def test_garbage_in_a_cgroup_file_is_ignored(tmp_path: Path, proc: Path) -> None:
    write(proc, "not a cgroup line\n0::/\n")
    write(tmp_path / "cpu.max", "lots 100000")
    assert cgroup_cpu_quota(tmp_path, proc) is None


def test_settings_default_threads_follow_the_cpus() -> None:
    from service.settings import Settings

    settings = Settings()
    assert settings.cpus == available_cpus()
    assert settings.intra_op_threads == settings.cpus
    assert settings.preprocess_threads == max(1, settings.cpus // settings.workers)


def test_memory_limit_is_the_tightest_cgroup_limit(tmp_path: Path, proc: Path) -> None:
    physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    assert memory_limit_bytes(tmp_path / "none", proc) == physical
    write(proc, "0::/pod/ctr\n")
    write(tmp_path / "pod" / "memory.max", str(4 << 30))
    write(tmp_path / "pod" / "ctr" / "memory.max", "max")
    assert memory_limit_bytes(tmp_path, proc) == min(physical, 4 << 30)


def test_memory_limit_v1(tmp_path: Path, proc: Path) -> None:
    write(proc, "4:memory:/docker/abc\n1:cpu:/\n")
    write(tmp_path / "memory" / "docker" / "abc" / "memory.limit_in_bytes", str(2 << 30))
    assert memory_limit_bytes(tmp_path, proc) == min(
        2 << 30, os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    )


def test_batches_beside_each_other_are_contended_across_workers(tmp_path: Path) -> None:
    """Two workers share one file; each counts its own batches and sees the other's."""
    from service.resources import CpuUse, create_cpu_use_file

    path = create_cpu_use_file(tmp_path / "cpu-use", 2)
    first, second = CpuUse(), CpuUse()
    first.attach(path, 0)
    second.attach(path, 1)
    with first:
        assert not first.contended()  # alone on the machine
        with second:
            assert first.contended() and second.contended()
        assert not first.contended()
        with first:  # two batches of one worker (two instances)
            assert first.contended()
    assert not second.contended()
    alone = CpuUse()  # one process, no file: only its own batches count
    with alone:
        assert not alone.contended()


def test_idle_means_no_batch_in_this_worker_or_another(tmp_path: Path) -> None:
    from service.resources import CpuUse, create_cpu_use_file

    path = create_cpu_use_file(tmp_path / "cpu-use", 2)
    first, second = CpuUse(), CpuUse()
    first.attach(path, 0)
    second.attach(path, 1)
    assert first.idle() and second.idle()
    with second:
        assert not first.idle() and not second.idle()
    with first:
        assert not first.idle()
    assert first.idle() and CpuUse().idle()


def test_a_replacement_worker_clears_the_count_its_predecessor_left(tmp_path: Path) -> None:
    from service.resources import CpuUse, create_cpu_use_file

    path = create_cpu_use_file(tmp_path / "cpu-use", 2)
    path.write_bytes(bytes([0, 3]))  # worker 1 died during batches
    watcher = CpuUse()
    watcher.attach(path, 0)
    with watcher:
        assert watcher.contended()
        CpuUse().attach(path, 1)  # its replacement
        assert not watcher.contended()


def test_the_second_thread_takes_half_of_a_lone_resize_only() -> None:
    """Ready while no batch runs and no other image has it; the second half runs on its own
    thread; taken, both halves run on the caller's thread; a failing first half still waits
    for the second."""
    import threading

    from service.resources import CPU_USE, SecondThread

    second = SecondThread()
    assert not second.ready()  # off until enabled
    assert second(lambda: "a", lambda: "b") == ("a", "b")
    second.set(True)
    assert second.ready()
    here = threading.current_thread().name
    names = second(lambda: threading.current_thread().name, lambda: threading.current_thread().name)
    assert names[0] == here and names[1].startswith("second-half")
    with CPU_USE:  # a batch runs: every CPU has work
        assert not second.ready()
    assert second.ready()

    inside = threading.Event()
    release = threading.Event()

    def held() -> str:
        inside.set()
        release.wait(5)
        return threading.current_thread().name

    other = threading.Thread(target=lambda: second(held, lambda: "b"))
    other.start()
    assert inside.wait(5)
    assert not second.ready()  # another image has it
    assert second(lambda: "a", lambda: threading.current_thread().name) == ("a", here)
    release.set()
    other.join(5)
    assert second.ready()

    finished = threading.Event()

    def slow() -> str:
        threading.Event().wait(0.05)
        finished.set()
        return "b"

    def failing() -> str:
        raise ValueError("first half")

    with pytest.raises(ValueError, match="first half"):
        second(failing, slow)
    assert finished.is_set() and second.ready()
