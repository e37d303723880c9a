"""Freed memory goes back to the system once the budget has let go of enough."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from service.limits.admission import BytesBudget
from service.limits.memory import (
    ARENAS,
    TRIM_AFTER_BYTES,
    Trimmer,
    malloc_free_bytes,
    malloc_trim,
)


def test_a_trim_follows_what_the_budget_let_go_and_never_a_quiet_server() -> None:
    trims: list[int] = []
    budget = BytesBudget(limit=1 << 30)
    trimmer = Trimmer(
        budget, trim=lambda: trims.append(budget.held), free_bytes=lambda: 0, rss=lambda: 0
    )
    assert not trimmer.check()  # nothing was ever held
    budget.take(TRIM_AFTER_BYTES)
    assert not trimmer.check()  # still held: nothing to give back
    budget.release(TRIM_AFTER_BYTES - 1)
    assert not trimmer.check()  # one byte short of the threshold
    budget.release(1)
    assert trimmer.check() and trims == [0]
    assert not trimmer.check()  # once: the high-water mark starts again from what is held
    budget.hold(2 * TRIM_AFTER_BYTES)  # answers unsent count too
    budget.hold(-2 * TRIM_AFTER_BYTES)
    assert trimmer.check() and trimmer.trims == 2


def test_memory_the_budget_never_counted_is_trimmed_once_freed() -> None:
    """What grpcio buffered of gRPC messages still arriving never enters the budget: once the
    heaps hold 32 MiB more free than the least they held since the last trim, on two checks
    in a row, it trims; free memory already trimmed (still counted free) does not trim again."""
    free, rss = [100 << 20], [900 << 20]

    def trim() -> None:
        rss[0] -= 40 << 20  # gives back

    trimmer = Trimmer(
        BytesBudget(limit=1 << 30), trim=trim, free_bytes=lambda: free[0], rss=lambda: rss[0]
    )
    assert not trimmer.check()
    free[0] -= 90 << 20  # reused: 10 MiB free
    assert not trimmer.check()
    free[0] += TRIM_AFTER_BYTES
    assert not trimmer.check()  # once: it may be churn
    assert trimmer.check()  # still free at the next check: the clients went
    assert not trimmer.check()  # the same free chunks, given back already
    free[0] -= 64 << 20  # taken again (resident again), then freed again
    assert not trimmer.check()
    free[0] += 64 << 20
    assert not trimmer.check()
    assert trimmer.check() and trimmer.trims == 2


def test_trims_that_give_little_back_look_at_the_free_count_less_often() -> None:
    free = [0]
    trimmer = Trimmer(
        BytesBudget(limit=1 << 30), trim=lambda: None, free_bytes=lambda: free[0], rss=lambda: 1
    )
    trims = []
    for _ in range(40):  # seconds
        free[0] += TRIM_AFTER_BYTES  # a heap that keeps growing free space nothing gives back
        trims.append(trimmer.check())
    assert trims.count(True) < 8  # every second check without the back-off: 20


def test_requests_ending_end_the_back_off() -> None:
    """What requests leave is often freed a moment after the budget lets go of them (after the
    trim that followed): under a back-off grown during the load, it stayed up to a minute."""
    free = [0]
    budget = BytesBudget(limit=1 << 30)
    trimmer = Trimmer(budget, trim=lambda: None, free_bytes=lambda: free[0], rss=lambda: 1)
    for _ in range(20):  # churn during a load: trims that give little back
        free[0] += TRIM_AFTER_BYTES
        trimmer.check()
    assert trimmer._backoff > 4
    budget.take(TRIM_AFTER_BYTES)
    budget.release(TRIM_AFTER_BYTES)
    assert trimmer.check()  # the requests ended
    free[0] += TRIM_AFTER_BYTES  # what they left, freed just after
    assert not trimmer.check()  # once: it may be churn
    assert trimmer.check()  # at the next check, not 2**n checks later


def test_this_c_library_trims_for_real() -> None:
    trim = malloc_trim()
    assert trim is not None  # glibc, here and in the image
    trim()
    free_bytes = malloc_free_bytes()
    assert free_bytes is not None and free_bytes() >= 0


def probe(script: str, mode: str, unset: str) -> subprocess.CompletedProcess[str]:
    """``script`` run in a fresh interpreter with ``mode`` as its argument, glibc's variable
    ``unset`` left out of its environment."""
    env = {k: v for k, v in os.environ.items() if k != unset}
    return subprocess.run(
        [sys.executable, "-c", script, mode],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )


ARENA_PROBE = """
import ctypes, os, sys, threading
from service.limits.memory import limit_arenas
if sys.argv[1] == "limited":
    assert limit_arenas()
go = threading.Barrier(8)
def allocate():
    go.wait()  # all at once: each thread that finds the arenas busy takes a new one
    kept = [bytearray(4096) for _ in range(2000)]
    go.wait()
threads = [threading.Thread(target=allocate) for _ in range(8)]
for thread in threads:
    thread.start()
for thread in threads:
    thread.join()
ctypes.CDLL("libc.so.6").malloc_stats()  # one "Arena N:" block per arena, on stderr
"""


@pytest.mark.skipif(
    malloc_trim() is None,
    reason="needs glibc (mallopt, malloc_stats): this C library has no malloc_trim",
)
@pytest.mark.parametrize("mode", ["limited", "as glibc likes"])
def test_the_server_keeps_to_two_malloc_arenas(mode: str) -> None:
    """glibc gives threads allocating at once arenas of their own, up to 8 per CPU, and what a
    burst leaves in them is never given back; a server process keeps to ARENAS."""
    done = probe(ARENA_PROBE, mode, unset="MALLOC_ARENA_MAX")
    arenas = done.stderr.count("Arena ")
    if mode == "limited":
        assert 1 <= arenas <= ARENAS, done.stderr
    else:
        assert arenas > ARENAS, done.stderr  # the probe does make arenas: the test can fail


MMAP_PROBE = """
import ctypes, sys
from service.limits.memory import Mallinfo2, fix_mmap_threshold
if sys.argv[1] == "fixed":
    assert fix_mmap_threshold()
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
libc.mallinfo2.restype = Mallinfo2
size = 30 << 20
libc.free(libc.malloc(size))  # mapped and unmapped: glibc's own threshold rises past its size
second = libc.malloc(size)
print("mapped" if libc.mallinfo2().hblkhd >= size else "heap")
libc.free(second)
"""


@pytest.mark.skipif(
    malloc_trim() is None,
    reason="needs glibc 2.33+ (mallopt, mallinfo2): this C library has no malloc_trim",
)
@pytest.mark.parametrize(("mode", "where"), [("fixed", "mapped"), ("as glibc likes", "heap")])
def test_large_buffers_stay_mapped_after_one_is_freed(mode: str, where: str) -> None:
    """glibc raises its mmap threshold to each mapped chunk freed (up to 32 MiB): after one
    30 MiB body, the next came from the heap, where freed memory stays until trimmed, and
    rounds of such requests peaked higher each round. A server process fixes the threshold."""
    done = probe(MMAP_PROBE, mode, unset="MALLOC_MMAP_THRESHOLD_")
    assert done.stdout.strip() == where, done.stderr  # glibc's own way shows: the test can fail


TRIM_PROBE = """
import ctypes, resource, sys, threading
from service.limits.memory import fix_mmap_threshold, fix_trim_threshold, limit_arenas
limit_arenas()
fix_mmap_threshold()  # as the server does: glibc then keeps its trim threshold at 128 KiB
if sys.argv[1] == "fixed":
    assert fix_trim_threshold()
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
faults = []
def churn():  # what a lone image's second-half thread does: a resized band, made and freed
    size = 1 << 20
    for _ in range(2):  # the second round counted: the first made the heap
        before = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
        for _ in range(50):
            block = libc.malloc(size)
            ctypes.memset(block, 1, size)
            libc.free(block)
    faults.append(resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - before)
thread = threading.Thread(target=churn)
thread.start()
thread.join()
print(faults[0])
"""


@pytest.mark.skipif(
    malloc_trim() is None,
    reason="needs glibc (mallopt): this C library has no malloc_trim",
)
@pytest.mark.parametrize("mode", ["fixed", "as glibc likes"])
def test_a_thread_that_frees_what_it_made_does_not_fault_its_pages_in_again(mode: str) -> None:
    """With the mmap threshold fixed glibc trims a heap past 128 KiB free at its top: each
    megabyte a thread made and freed was handed back and faulted in again (178 faults a lone
    image on its second-half thread)."""
    done = probe(TRIM_PROBE, mode, unset="MALLOC_TRIM_THRESHOLD_")
    faults = int(done.stdout)
    if mode == "fixed":
        assert faults < 50, done.stdout
    else:
        assert faults > 50 * 200, done.stdout  # glibc's own way shows: the test can fail
