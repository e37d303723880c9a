"""HTTP connections spread evenly over the workers, whichever took them (issue #27).

The workers accept from one listening socket, the supervisor's: a busy worker's loop gets to
it later, so it takes fewer. A burst of connections that arrives while every worker is idle
(a client pool opening, a load balancer reconnecting) goes mostly to whichever loop wakes
first: 16 connections of one W1 benchmark split 15/1, 11/5 and 8/8 in three runs. The workers
share the CPUs evenly (:class:`service.resources.CpuUse`), so each serves about as many
requests a second, and a request on the worker with 15 connections waited 15 times as long:
p50 185 ms there against 12 ms on the other, and the server's p99/p50 was the imbalance.

Each worker writes how many connections it holds into its slot of a file the supervisor
creates (one ``uint16`` per worker). A worker holding more than its even share of all of them
answers its next inference response with ``Connection: close`` (HTTP/1.1 lets a server end
any keep-alive connection after a response; every client reconnects). The reconnection is
accepted by whichever worker gets to it first, most often the one with fewer. At most one
connection is let go per :data:`CLOSE_EVERY_S` a worker, so a worker that takes its own
reconnections back costs a client one reconnection per interval, never one per request.
"""

from __future__ import annotations

import mmap
import time
from collections.abc import Callable
from pathlib import Path

CLOSE_EVERY_S = 0.01
"""At most one connection let go per this many seconds, per worker."""
SLOT = 2
"""Bytes per worker in the shared file: a ``uint16`` count (capped at 65,535)."""


class ConnectionBalance:
    """This worker's count of open HTTP connections beside the other workers' counts."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.mine = 0
        self._counts: memoryview | None = None
        self._index = 0
        self._closed_at = float("-inf")
        self.closed = 0
        """Connections let go to even the spread (the tests read it)."""

    def attach(self, path: Path, index: int) -> None:
        """Share counts through ``path`` (:func:`create_balance_file`, the supervisor's)."""
        with path.open("r+b") as file:
            self._counts = memoryview(mmap.mmap(file.fileno(), 0)).cast("H")
        self._index = index
        self.count(self.mine)  # a replacement clears what its predecessor left

    def count(self, connections: int) -> None:
        """This worker holds ``connections`` now (called as each opens and closes)."""
        self.mine = connections
        if self._counts is not None:
            self._counts[self._index] = min(connections, 0xFFFF)

    def over_share(self) -> bool:
        """Whether this worker should let one connection go after its response now: it holds
        more than its even share (the total over the workers, rounded up), and it let none go
        in the last :data:`CLOSE_EVERY_S`."""
        counts = self._counts
        if counts is None:
            return False
        total = sum(counts.tolist())
        if self.mine * len(counts) <= total + len(counts) - 1:  # mine <= ceil(total / n)
            return False
        now = self.clock()
        if now - self._closed_at < CLOSE_EVERY_S:
            return False
        self._closed_at = now
        self.closed += 1
        return True


BALANCE = ConnectionBalance()
"""This worker's (the HTTP protocol counts in it; the inference routes ask it)."""


def create_balance_file(path: Path, workers: int) -> Path:
    """The file the workers share their connection counts through (the supervisor's)."""
    path.write_bytes(bytes(SLOT * workers))
    return path
