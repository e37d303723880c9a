"""gRPC messages still arriving, bounded by what they make the heap hold.

grpcio says nothing of a message until all of it has arrived, and nothing else sees it while it
arrives in two places (#28 finding 2):

- **a stream's next message, with one worker** (no front counts what clients send,
  ``service.cluster.front``): a stream's read cannot tell an idle stream from one whose
  message is on its way, so it holds nothing of the budget (a ModelInfer call's message
  holds ``TG_MAX_BODY_BYTES`` of it while it arrives, ``InferenceServicer._receive``; the same
  rule would end idle streams). 12 streams stalled short of the end of a 12 MiB message held
  +141 MiB for as long as their clients liked.
- **behind the front, the connection it reads on**: past a worker's bound the front reads no
  more of its connections but the one with the oldest message arriving, so that one message
  can always arrive whole; a client's calls on one connection interleave frame by frame, so
  all of them arrive with it. One connection of 48 calls of 12 MiB stalled after 400 MiB held
  +178 MiB in workers of 32 MiB budgets until ``TG_BODY_TIMEOUT_S`` (128 calls of
  ``TG_MAX_BODY_BYTES`` a connection: 8 GiB by default).

What such messages hold is memory grpc core allocates with ``malloc``. :class:`Arriving` counts
every stream read and every ModelInfer read not whole at once as waiting, looks at the bytes
glibc has in use (``mallinfo2``) less what the budget holds, four times a second while any
wait, and where that grew by more than half of ``TG_MAX_INFLIGHT_BYTES`` since the oldest of
the reads that have waited :data:`WAITED_S` or more began (or since a model was loaded or
unloaded: what it holds is no message's), on two looks in a row, ends the newest of those
reads, keeping the oldest in the proportion the threshold bears to what grew (at least one:
one message can always arrive whole, as the front's rule has it). An ended ModelInfer call is
UNAVAILABLE; an ended stream answers the requests it has read, then ends UNAVAILABLE
(``reason="body_budget"``); grpc lets their messages go. An idle stream waiting then is counted
as any other read (nothing tells it from a stalled one), so it is kept only if it is among the
oldest. What the reads kept hold may not stay: once every look for ``TG_BODY_TIMEOUT_S`` has
found the heap grown past a quarter of the budget, the reads waiting all that time are ended
too (as a ModelInfer message not whole by then; a stream's next message has no limit of its
own). Without glibc (musl) nothing is looked at.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from service.limits.admission import BytesBudget
from service.limits.memory import malloc_in_use_bytes
from service.telemetry.counters import REFUSED

log = logging.getLogger("tensorgate.grpc")

Request = TypeVar("Request")

LOOK_EVERY_S = 0.25
"""How often the heap is looked at while a read waits (``mallinfo2`` walks glibc's free lists,
each arena under its lock: 6 µs with the bundled models loaded, 0.8–5 ms once tens of thousands
of chunks are free, so it runs on a thread)."""
WAITED_S = 0.5
"""How long a read must have waited to be ended: a stream's requests that follow one another
are read at once, and over loopback a 60 MiB message is whole in 115 ms."""
LOOKS = 2
"""Looks in a row that must find the heap grown: a request's memory the budget does not count
(its outputs while encoded) is gone by the next."""

MIB = 1 << 20


@dataclass(slots=True, eq=False)
class Waiting:
    """One read waiting for its message (:meth:`Arriving.counting`)."""

    read: asyncio.Future[Any]
    stream: bool
    began: float = 0.0
    since: int | None = None
    """The heap in use less the budget's, at the last look before the read began."""
    ended: str | None = None
    """Why it was ended (its read cancelled), for the client."""
    timer: asyncio.TimerHandle | None = None


class Arriving:
    """Reads waiting for their messages; the newest are ended when the heap grows past
    ``threshold`` (half the budget) while they wait."""

    def __init__(
        self,
        budget: BytesBudget,
        in_use: Callable[[], int],
        model_changes: Callable[[], tuple[int, bool]] = lambda: (0, False),
        threshold: int | None = None,
        timeout_s: float = 60.0,
    ) -> None:
        self.budget = budget
        self.in_use = in_use
        self.model_changes = model_changes
        """The repository's count of loads and unloads, and whether one is under way: what a
        model holds is no message's, so reads begin from the next look after one."""
        self._changes = model_changes()
        self.threshold = budget.limit // 2 if threshold is None else threshold
        self.timeout_s = timeout_s
        """TG_BODY_TIMEOUT_S: the reads kept are ended too once the heap has stayed grown past
        half the threshold this long."""
        self.streams = 0
        """Streams open: the heap is looked at while there is one, or a read waits."""
        self.reads: set[Waiting] = set()
        self.last: int | None = None
        """The latest look: the heap in use less the budget's held bytes."""
        self._looks = 0
        """Looks in a row that found the heap grown past the threshold."""
        self._grown_since: float | None = None
        """Since when every look found it grown past half the threshold."""
        self._task: asyncio.Task[None] | None = None

    @classmethod
    def where_available(
        cls,
        budget: BytesBudget | None,
        model_changes: Callable[[], tuple[int, bool]],
        timeout_s: float,
    ) -> Arriving | None:
        in_use = malloc_in_use_bytes()
        if budget is None or in_use is None:
            return None
        return cls(budget, in_use, model_changes, timeout_s=timeout_s)

    async def watch(self, requests: AsyncIterator[Request]) -> Watched[Request]:
        """``requests``, a stream's, each read counted waiting, until :meth:`Watched.close`."""
        self.streams += 1
        try:
            self._looking()
            if self.last is None:  # a look to begin from, before its message can arrive
                await self.look()
        except BaseException:  # the call was cancelled meanwhile
            self.streams -= 1
            raise
        return Watched(requests, self)

    def counting(self, read: asyncio.Future[Any], stream: bool, after_s: float = 0.0) -> Waiting:
        """``read`` (a stream's, or a ModelInfer call's) counted waiting from ``after_s`` on,
        unless it is done by then, until :meth:`done`."""
        waiting = Waiting(read, stream)
        if after_s:
            waiting.timer = asyncio.get_running_loop().call_later(after_s, self._add, waiting)
        else:
            self._add(waiting)
        return waiting

    def done(self, waiting: Waiting) -> None:
        if waiting.timer is not None:
            waiting.timer.cancel()
        self.reads.discard(waiting)

    def _add(self, waiting: Waiting) -> None:
        if waiting.read.done():
            return
        waiting.began, waiting.since = time.monotonic(), self.last
        self.reads.add(waiting)
        self._looking()

    def _looking(self) -> None:
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._look_while_waited_on())

    async def look(self) -> None:
        """Look at the heap; where it grew past the threshold since the oldest of the reads
        that have waited at least WAITED_S began, on two looks in a row, end the newest of
        them."""
        now = await asyncio.to_thread(self.in_use) - self.budget.held
        self.last = now
        clock = time.monotonic()
        changes = self.model_changes()
        changed = changes != self._changes or changes[1]  # a model loading, loaded, unloaded
        self._changes = changes
        late = []
        for waiting in self.reads:
            if waiting.since is None or changed:
                waiting.since = now
            elif clock - waiting.began >= WAITED_S and waiting.ended is None:
                late.append(waiting)
        grown = now - min((waiting.since or now for waiting in late), default=now)
        self._looks = self._looks + 1 if grown > self.threshold else 0
        if grown <= self.threshold // 2:
            self._grown_since = None
        elif self._grown_since is None:
            self._grown_since = clock
        late.sort(key=lambda waiting: waiting.began)
        if self._looks >= LOOKS:
            self._looks = 0  # what is let go takes a moment to leave the heap
            keep = max(1, len(late) * self.threshold // grown)
            why = f"past half of TG_MAX_INFLIGHT_BYTES, {self.threshold / MIB:.0f} MiB"
            self._end(late[keep:], grown, clock, why, keep)
        elif self._grown_since is not None and clock - self._grown_since >= self.timeout_s:
            # what the reads kept hold has stayed: let it go, as a ModelInfer's at its timeout
            waited = [waiting for waiting in late if waiting.began <= self._grown_since]
            why = (
                "past a quarter of TG_MAX_INFLIGHT_BYTES for TG_BODY_TIMEOUT_S, "
                f"{self.timeout_s:g} s"
            )
            self._end(waited, grown, clock, why, len(late) - len(waited))
            self._grown_since = None

    def _end(self, ended: list[Waiting], grown: int, clock: float, why: str, kept: int) -> None:
        """End the reads of ``ended``, their clients told ``why``."""
        for waiting in ended:
            what = (
                "this stream waited {waited:.1f} s for its next request"
                if waiting.stream
                else "this call's message was still arriving after {waited:.1f} s"
            ).format(waited=clock - waiting.began)
            waiting.ended = (
                f"{what} while the server's memory outside its budget grew by "
                f"{grown / MIB:.0f} MiB (messages still arriving; {why}): "
                + ("open a new stream" if waiting.stream else "retry shortly")
            )
            waiting.read.cancel()
        if ended:
            REFUSED["body_budget"] += len(ended)
            log.warning(
                "ended %d gRPC read(s) waiting for their messages (%d of them streams'), and "
                "kept %d: the heap grew by %.0f MiB outside the budget while they waited (%s)",
                len(ended),
                sum(waiting.stream for waiting in ended),
                kept,
                grown / MIB,
                why,
            )

    async def _look_while_waited_on(self) -> None:
        try:
            while self.streams or self.reads:
                await asyncio.sleep(LOOK_EVERY_S)
                await self.look()
        finally:
            self.last = None  # stale by the next read

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)


class Watched(AsyncIterator[Request]):
    """A stream's requests, each read counted waiting in its :class:`Arriving` until its
    message has arrived. A read it ends makes the iterator end (the requests read are
    answered); :attr:`ended` says why."""

    def __init__(self, requests: AsyncIterator[Request], arriving: Arriving) -> None:
        self.requests = requests
        self.arriving = arriving
        self.ended: str | None = None
        self._closed = False

    def __aiter__(self) -> Watched[Request]:
        return self

    async def __anext__(self) -> Request:
        if self.ended is not None:
            raise StopAsyncIteration
        read: asyncio.Future[Request] = asyncio.ensure_future(anext(self.requests))
        waiting = self.arriving.counting(read, stream=True)
        try:
            return await read
        except asyncio.CancelledError:
            if waiting.ended is not None and read.cancelled():
                self.ended = waiting.ended
                raise StopAsyncIteration from None
            raise
        finally:
            self.arriving.done(waiting)

    def close(self) -> None:
        """The stream is over: the heap is no longer looked at for it."""
        if not self._closed:
            self._closed = True
            self.arriving.streams -= 1
