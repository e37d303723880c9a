"""HTTP connections spread evenly over the workers, whichever took them (issue #27).

The workers accept from one listening socket, the supervisor's: a busy worker's loop gets to
it later, so it takes fewer. A burst of connections that arrives while every worker is idle
(a client pool opening, a load balancer reconnecting) goes mostly to whichever loop wakes
first: 16 connections of one W1 benchmark split 15/1, 11/5 and 8/8 in three runs. The workers
share the CPUs evenly (:class:`service.resources.CpuUse`), so each serves about as many
requests a second, and a request on the worker with 15 connections waited 15 times as long:
p50 185 ms there against 12 ms on the other, and the server's p99/p50 was the imbalance.

Each worker writes how many connections it holds into its slot of a file the supervisor
creates (one ``uint16`` per worker), or :data:`NOT_ACCEPTING` while it takes none (not
listening yet, which a replacement does only once its models are ready; done accepting; the
supervisor writes it for a worker that died), so that nobody waits for it or counts it in the
even share. Two rules read the counts.
When accepting (:class:`TakeTurns`), a worker takes one connection a wake-up and lets a new
one wait briefly for a worker holding fewer, so a burst splits evenly as it arrives. After
a response, a worker holding more than its even share of all of them answers with
``Connection: close`` (HTTP/1.1 lets a server end any keep-alive connection after a
response; every client reconnects), and the reconnection goes, by the first rule, to a
worker with fewer. At most one connection is let go per :data:`CLOSE_EVERY_S` a worker, so
a worker that takes its own reconnections back costs a client one reconnection per
interval, never one per request.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import mmap
import socket
import sys
import time
from collections.abc import Callable
from pathlib import Path

log = logging.getLogger("tensorgate.server")

CLOSE_EVERY_S = 0.01
"""At most one connection let go per this many seconds, per worker."""
SLOT = 2
"""Bytes per worker in the shared file: a ``uint16`` count (capped at 65,534)."""
NOT_ACCEPTING = 0xFFFF
"""A slot's value while its worker accepts no connection."""


class ConnectionBalance:
    """This worker's count of open HTTP connections beside the other workers' counts."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.mine = 0
        self._counts: memoryview | None = None
        self._index = 0
        self._accepting = False
        self._closed_at = float("-inf")
        self.closed = 0
        """Connections let go to even the spread (the tests read it)."""

    def attach(self, path: Path, index: int) -> None:
        """Share counts through ``path`` (:func:`create_balance_file`, the supervisor's)."""
        with path.open("r+b") as file:
            self._counts = memoryview(mmap.mmap(file.fileno(), 0)).cast("H")
        self._index = index
        self.count(self.mine)  # a replacement clears what its predecessor left

    def accepting(self, accepting: bool) -> None:
        """This worker takes connections from now on (:class:`TakeTurns`), or no more."""
        self._accepting = accepting
        self.count(self.mine)

    def count(self, connections: int) -> None:
        """This worker holds ``connections`` now (called as each opens and closes)."""
        self.mine = connections
        if self._counts is not None:
            mine = min(connections, NOT_ACCEPTING - 1) if self._accepting else NOT_ACCEPTING
            self._counts[self._index] = mine

    def others(self) -> list[int]:
        """The counts of the other workers that accept connections."""
        counts = self._counts
        if counts is None:
            return []
        mine = self._index
        return [n for i, n in enumerate(counts.tolist()) if i != mine and n != NOT_ACCEPTING]

    def holds_more(self) -> bool:
        """Whether this worker holds more connections than another accepting worker does."""
        return bool(self.fewer())

    def fewer(self) -> dict[int, int]:
        """The accepting workers that hold fewer connections than this one: index → count."""
        counts = self._counts
        if counts is None:
            return {}
        mine, index = self.mine, self._index
        return {
            i: n
            for i, n in enumerate(counts.tolist())
            if i != index and n != NOT_ACCEPTING and n < mine
        }

    def now(self, workers: dict[int, int]) -> dict[int, int]:
        """What ``workers`` (indices) hold now (:data:`NOT_ACCEPTING` for one that stopped)."""
        counts = self._counts
        return {} if counts is None else {i: counts[i] for i in workers}

    def over_share(self) -> bool:
        """Whether this worker should let one connection go after its response now: it holds
        more than its even share (the total over the workers, rounded up), and it let none go
        in the last :data:`CLOSE_EVERY_S`."""
        others = self.others()
        if not others:
            return False
        total, workers = sum(others) + self.mine, len(others) + 1
        if self.mine * workers <= total + workers - 1:  # mine <= ceil(total / workers)
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
    """The file the workers share their connection counts through (the supervisor's): none
    accepts yet."""
    path.write_bytes(NOT_ACCEPTING.to_bytes(SLOT, sys.byteorder) * workers)
    return path


def not_accepting(path: Path, index: int) -> None:
    """Worker ``index`` accepts no more: it died (the supervisor's; its replacement attaches)."""
    with path.open("r+b") as file:
        file.seek(SLOT * index)
        file.write(NOT_ACCEPTING.to_bytes(SLOT, sys.byteorder))


class TakeTurns:
    """Accept from the listening socket the workers share, each worker in its turn.

    uvloop, like asyncio, accepts every connection waiting before it returns to its loop, so
    a burst (a client pool opening, wrk's 16 connections) went mostly to the first loop awake:
    12/4 in bench.defaults' W1 c=16 runs, whose crowded worker's requests then waited half as
    long again until :class:`ConnectionBalance` had let enough go, and that second was the
    run's p99 (p99/p50 1.57 against 1.16 with one worker). Here a worker accepts one
    connection a wake-up, and a worker that holds more than another does lets the connection
    wait :data:`DEFER_S` for the other (its own reader off meanwhile: no spinning), and when
    the wait ends it takes the connection, or finds another worker took it. A worker not
    listening or dead is waited for by nobody (:data:`NOT_ACCEPTING`), but one stopped
    (SIGSTOP) or whose loop is blocked still shows its count: when the workers waited for took
    none of :data:`UNHEEDED_IN_A_ROW` such connections in a row, over :data:`UNHEEDED_OVER_S`
    at least, and none of their counts moved meanwhile (a count moves only on its worker's
    loop; the others' say nothing of these), the worker lets none wait for :data:`UNHEEDED_S`,
    and once more at the first such wait after. A worker merely busy leaves one unheeded now
    and then, and a loaded machine may not run it for a few of them in a row: stopping at the
    first, the eighth, or (in CI) 16 in a row within a burst took the even split of bursts
    away.
    The accepted socket goes to the loop (``connect_accepted_socket``) with uvicorn's own
    protocol: nothing else changes.
    """

    DEFER_S = 0.002
    """How long a worker holding more connections than another lets a new one wait for it."""
    UNHEEDED_IN_A_ROW = 16
    """Connections that waited for nothing (no other worker took them), each within
    :data:`UNHEEDED_WITHIN_S` of the last, before none waits."""
    UNHEEDED_WITHIN_S = 0.1
    """Farther apart than this, waits for nothing are a busy worker's, not a missing one's."""
    UNHEEDED_OVER_S = 0.25
    """How long a run of waits for nothing lasts at least before none waits."""
    UNHEEDED_S = 1.0
    """How long none waits then."""
    RETRY_S = 0.5
    """Out of file descriptors (or memory): accepting pauses this long, as asyncio's does."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        sock: socket.socket,
        protocol: Callable[[], asyncio.Protocol],
        balance: ConnectionBalance,
    ) -> None:
        self.loop = loop
        self.sock = sock
        self.protocol = protocol
        self.balance = balance
        self.accepted = 0
        self.deferred = 0
        self._fd = sock.fileno()
        self._connecting: set[asyncio.Task[None]] = set()
        self._waited = False
        self._unheeded = 0
        self._unheeded_since = self._unheeded_at = float("-inf")
        self._unheeded_until = float("-inf")
        self._waited_for: dict[int, int] = {}
        """The workers the connection waiting now waits for, and what they held then."""
        self._run_for: dict[int, int] = {}
        """The same, when the run of waits for nothing began."""
        self._ignored: dict[int, int] = {}
        """The same, when none waited last."""
        self._stopped = False
        sock.setblocking(False)
        balance.accepting(True)
        loop.add_reader(self._fd, self._readable)

    def _readable(self) -> None:
        waited, self._waited = self._waited, False
        if (
            not waited
            and self.loop.time() >= self._unheeded_until
            and (fewer := self.balance.fewer())
        ):
            self._waited = True  # taken when the wait ends (_resume), whoever holds what
            self._waited_for = fewer
            self.deferred += 1
            self._pause(self.DEFER_S)
            return
        try:
            conn, _ = self.sock.accept()
        except (BlockingIOError, InterruptedError, ConnectionAbortedError):
            if waited and self.balance.now(self._run_for) != self._run_for:
                # taken by a worker waited for, which so accepts: a run begins anew
                self._unheeded, self._unheeded_at = 0, float("-inf")
            return
        except OSError as exc:
            if exc.errno not in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                raise
            log.warning("accepting paused for %.1f s: %s", self.RETRY_S, exc)
            self._pause(self.RETRY_S)
            return
        if waited:  # nobody else took it
            self._heeded_by_none()
        conn.setblocking(False)
        self.accepted += 1
        self.balance.count(self.balance.mine + 1)  # at once: the next wake-up compares with it
        task = self.loop.create_task(self._connect(conn))
        self._connecting.add(task)
        task.add_done_callback(self._connecting.discard)

    def _heeded_by_none(self) -> None:
        """A connection waited and no other worker took it: after enough such, none waits. A
        run of them is of waits for the same workers, none of whose counts moved (a count moves
        only on its worker's loop; the others' moving says nothing of these). Within
        :data:`UNHEEDED_S` of the end of a time none waited, a wait for the same workers, their
        counts unmoved, lets none wait again at once (a stopped worker costs one wait a period,
        not a run of them)."""
        now, waited_for = self.loop.time(), self._waited_for
        if (
            waited_for
            and waited_for == self._ignored
            and now - self._unheeded_until < self.UNHEEDED_S
        ):  # still as when none waited last, and not long after
            self._unheeded_until = now + self.UNHEEDED_S
            return
        if now - self._unheeded_at > self.UNHEEDED_WITHIN_S or (
            not self._run_for or self.balance.now(self._run_for) != self._run_for
        ):
            self._unheeded, self._unheeded_since, self._run_for = 0, now, waited_for
        self._unheeded_at = now
        self._unheeded += 1
        if (
            self._unheeded >= self.UNHEEDED_IN_A_ROW
            and now - self._unheeded_since >= self.UNHEEDED_OVER_S
        ):  # the workers waited for are not accepting
            self._unheeded, self._run_for = 0, {}
            self._ignored = waited_for
            self._unheeded_until = now + self.UNHEEDED_S

    async def _connect(self, conn: socket.socket) -> None:
        try:
            await self.loop.connect_accepted_socket(self.protocol, conn)
        except Exception as exc:  # the client went before its transport was made, say
            log.debug("an accepted connection was not served: %r", exc)
            conn.close()

    def _pause(self, seconds: float) -> None:
        self.loop.remove_reader(self._fd)
        self.loop.call_later(seconds, self._resume)

    def _resume(self) -> None:
        if not self._stopped:
            self.loop.add_reader(self._fd, self._readable)
            if self._waited:  # the connection that waited: taken now, or gone to another worker
                self._readable()

    def stop(self) -> None:
        """Accept no more (the caller closes the socket)."""
        self._stopped = True
        self.balance.accepting(False)
        self.loop.remove_reader(self._fd)
