"""Memory the budget let go goes back to the system.

Python frees a request's bodies, rows and answers as soon as it is answered, but glibc keeps
what was freed in its heaps (one per thread that allocated: the event loop, the preprocessing
pool, each instance's thread) for the next allocation: the process's RSS stays at its peak.
Measured (16 concurrent binary requests of 61 MiB each, three times, to an identity model
with a dynamic dim): RSS 128 MiB before, 572 MiB a second after every round; with
``malloc_trim(0)`` once a second, 129 MiB. An attack would otherwise leave the pod near its
memory limit for good, and the next one pushes it over.

:class:`Trimmer` asks glibc to give back what it holds free, once the budget has let go of at
least :data:`TRIM_AFTER_BYTES` since the last time: never on a quiet server (trimming walks
every heap, under each heap's lock), at most once every :data:`TRIM_EVERY_S`; or once glibc
holds 32 MiB more free than the least it held since the last trim (``mallinfo2``'s
``fordblks``): memory the budget never counted, such as what grpcio buffered of gRPC messages
still arriving when their clients went (measured, `bench.stalled`: the workers' RSS stayed at
1.55–2.17 × where it started without this). Free memory already trimmed stays in that count
(its pages are given back, its chunks stay free), so a count back at its least since the last
trim has nothing more to give. The free count must have grown on two checks in a row (churn
between two checks is not memory left free), and after a trim it asked for gave back less
than 8 MiB of RSS it is looked at only every 2, 4, … 64 checks, until one gives back more
or the budget lets go of enough (what requests leave is often freed just after the budget
lets go of them: under a back-off it stayed for up to a minute).
Without glibc (musl), nothing is trimmed.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import threading
from collections.abc import Callable
from typing import Any

from service.limits.admission import BytesBudget

log = logging.getLogger("tensorgate.memory")

TRIM_EVERY_S = 1.0
MAX_BACKOFF_CHECKS = 64
TRIM_AFTER_BYTES = 32 << 20
"""What the budget must have let go of (its high-water mark since the last trim, less what it
holds now) before a trim is worth its walk over the heaps."""


ARENAS = 2
"""glibc malloc arenas a server process uses (:func:`limit_arenas`)."""
_M_ARENA_MAX = -8  # mallopt's parameter, <malloc.h>


def limit_arenas(count: int = ARENAS) -> bool:
    """At most ``count`` glibc malloc arenas for this process's threads from now on, unless
    ``MALLOC_ARENA_MAX`` already says how many; True when set. glibc gives each thread that
    allocates an arena of its own (up to 8 per CPU), and what a burst leaves in the arenas of
    threads that hold a few live chunks in each is never handed back, not even by
    ``malloc_trim``: after 30 refused gRPC calls of 60 MiB, three thread arenas kept about
    30 MiB each (RSS 1.06–1.13 × where it started); with two arenas, 1.01–1.03 ×. Call it
    before the server starts its threads."""
    return _mallopt(_M_ARENA_MAX, count, "MALLOC_ARENA_MAX")


MMAP_THRESHOLD = 4 * 1024 * 1024
"""Allocations from this size up are mapped of their own and unmapped when freed
(:func:`fix_mmap_threshold`)."""
_M_MMAP_THRESHOLD = -3  # mallopt's parameter, <malloc.h>


def fix_mmap_threshold(size: int = MMAP_THRESHOLD) -> bool:
    """Allocations of ``size`` bytes or more mapped of their own from now on, and so handed
    back to the system when freed, unless ``MALLOC_MMAP_THRESHOLD_`` already says; True when
    set. glibc starts at 128 KiB and raises the threshold to the size of each mapped chunk
    freed, up to 32 MiB: after one 30 MiB request body, the next ones came from the heap,
    where freed memory stays until trimmed, and three rounds of 8 such requests to a model
    with a dynamic dim peaked at 2.3–3.4 × a 256 MiB budget, rising round by round, against
    1.5–2.0 × with the threshold fixed (`test_batches_of_dynamic_dims_hold_their_copy_in_the_
    budget_and_memory_returns`). A fixed threshold also turns off that raising."""
    return _mallopt(_M_MMAP_THRESHOLD, size, "MALLOC_MMAP_THRESHOLD_")


TRIM_THRESHOLD = 2 * MMAP_THRESHOLD
"""Free memory a heap keeps at its top rather than hand back at once (:func:`fix_trim_threshold`):
glibc's own rule, twice the mmap threshold, which it stops applying once that is fixed."""
_M_TRIM_THRESHOLD = -1  # mallopt's parameter, <malloc.h>


def fix_trim_threshold(size: int = TRIM_THRESHOLD) -> bool:
    """A heap hands back free memory at its top only past ``size`` bytes from now on (unless
    ``MALLOC_TRIM_THRESHOLD_`` already says); True when set. With the mmap threshold fixed
    (:func:`fix_mmap_threshold`) glibc keeps its trim threshold at 128 KiB, so a thread that
    allocates and frees a few hundred KiB an image gives its pages back at every free and
    faults them in again at the next allocation: a lone image's second-half thread took 178 page
    faults an image (0.47 ms of system time, on the resize's way); with this, none. What the
    budget lets go of still goes back through :class:`Trimmer`'s ``malloc_trim``, which keeps
    nothing."""
    return _mallopt(_M_TRIM_THRESHOLD, size, "MALLOC_TRIM_THRESHOLD_")


def _mallopt(parameter: int, value: int, variable: str) -> bool:
    """glibc's ``mallopt(parameter, value)``, unless the environment ``variable`` (glibc's own
    for it) already says; True when set."""
    mallopt = _glibc("mallopt")
    if variable in os.environ or mallopt is None:
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(parameter, value))


def _glibc(name: str) -> Any | None:
    """The C library's function ``name``, or None where it has none (not glibc)."""
    try:
        return getattr(ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6"), name)
    except (OSError, AttributeError):
        return None


def malloc_trim() -> Callable[[], object] | None:
    """glibc's ``malloc_trim(0)``, or None where the C library has none."""
    trim = _glibc("malloc_trim")
    if trim is None:
        return None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return lambda: trim(0)


class Mallinfo2(ctypes.Structure):
    """glibc's ``struct mallinfo2`` (<malloc.h>)."""

    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        )
    ]


def rss_bytes() -> int:
    """This process's resident set size."""
    with open("/proc/self/statm", "rb") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def malloc_free_bytes() -> Callable[[], int] | None:
    """glibc's count of the bytes its heaps hold free (``mallinfo2().fordblks``, glibc 2.33
    on), or None where the C library has none."""
    info = _mallinfo2()
    return None if info is None else lambda: int(info().fordblks)


def malloc_in_use_bytes() -> Callable[[], int] | None:
    """glibc's count of the bytes allocated and not freed, in its heaps and mapped each of its
    own (``mallinfo2()``'s ``uordblks + hblkhd``), or None where the C library has none. It
    walks the free lists (6 µs with the bundled models loaded, 0.8–5 ms once tens of thousands
    of chunks are free): call it off the event loop (ctypes lets go of the GIL meanwhile)."""
    info = _mallinfo2()
    if info is None:
        return None
    return lambda: int((got := info()).uordblks + got.hblkhd)


def _mallinfo2() -> Callable[[], Mallinfo2] | None:
    """glibc's ``mallinfo2`` (2.33 on), or None."""
    info = _glibc("mallinfo2")
    if info is not None:
        info.argtypes, info.restype = [], Mallinfo2
    return info


class Trimmer:
    """A thread that hands freed heap memory back once ``budget`` has let go of enough."""

    def __init__(
        self,
        budget: BytesBudget,
        trim: Callable[[], object] | None = None,
        free_bytes: Callable[[], int] | None = None,
        rss: Callable[[], int] | None = None,
    ) -> None:
        self.budget = budget
        self.trim = trim or malloc_trim()
        self.free_bytes = free_bytes or malloc_free_bytes()
        self.rss = rss if rss is not None else rss_bytes
        self.least_free: int | None = None
        """The least the heaps held free since the last trim."""
        self.trims = 0
        self._freed_checks = 0
        """Checks in a row that found the heaps holding enough more free."""
        self._skip = 0
        self._backoff = 1
        """Checks the free count is not looked at after a trim it asked for gave little back
        (doubling each time, up to :data:`MAX_BACKOFF_CHECKS`)."""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="malloc-trim", daemon=True)

    def start(self) -> None:
        if self.trim is None:
            log.info("no malloc_trim in this C library: freed memory stays with the allocator")
            return
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(TRIM_EVERY_S):
            self.check()

    def check(self) -> bool:
        """Trim if the budget let go of enough since the last time, or the heaps hold that
        much more free than the least they held since; True when it did."""
        budget = self.budget
        if self.trim is None:
            return False
        free = None
        if self._skip:
            self._skip -= 1
        elif self.free_bytes is not None:
            free = self.free_bytes()
            self.least_free = free if self.least_free is None else min(self.least_free, free)
        grown = free is not None and free - (self.least_free or 0) >= TRIM_AFTER_BYTES
        self._freed_checks = self._freed_checks + 1 if grown else 0
        let_go = budget.high - budget.held >= TRIM_AFTER_BYTES
        if not let_go and self._freed_checks < 2:  # churn between two checks is not free memory
            return False
        before = self.rss()
        budget.high = budget.held
        self.trim()
        self.trims += 1
        # What it trimmed stays counted free: the count now is the least to grow from (read
        # again when this check skipped it).
        self.least_free = free if free is not None or self.free_bytes is None else self.free_bytes()
        self._freed_checks = 0
        if let_go or before - self.rss() >= TRIM_AFTER_BYTES // 4:
            # Requests just ended (what they leave is often freed a moment after the budget
            # lets go of them), or this one gave back: look at every check again.
            self._skip, self._backoff = 0, 1
        else:  # little came back: look less often
            self._skip = self._backoff
            self._backoff = min(2 * self._backoff, MAX_BACKOFF_CHECKS)
        return True
