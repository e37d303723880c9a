"""ModelStreamInfer messages still arriving, on a port of the worker's own (one worker: no
front counts what clients send, ``service.cluster.front``).

grpcio says nothing of a message until all of it has arrived, so a stream's handler waiting
for its next request cannot tell an idle stream from one whose message is on its way: 12
streams stalled short of the end of a 12 MiB message held +141 MiB for as long as their
clients liked, none of it in the budget (#28 finding 2). A ModelInfer call's message is
held to ``TG_MAX_BODY_BYTES`` of the budget while it arrives (``InferenceServicer._receive``);
a stream may wait for its next request as long as it likes, so the same rule would end idle
streams. What stalled messages hold is memory: grpc core buffers them with ``malloc``. So
:class:`ArrivingStreams` looks at the bytes glibc has in use (``mallinfo2``), less what the
budget holds, four times a second while a stream is open, and ends every stream read that has
waited :data:`WAITED_S` or more while that grew by more than half of ``TG_MAX_INFLIGHT_BYTES``
since the read began (or since a model was loaded or unloaded: what it holds is no stream's),
on two looks in a row. Such a stream answers the requests it has read,
then ends UNAVAILABLE (``reason="body_budget"``), and grpc lets its message go. An idle
stream waiting then is ended too: nothing tells it from a stalled one, and its client opens a
new one. Without glibc (musl) nothing is looked at.
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
"""How often the heap is looked at while a stream is open (``mallinfo2`` walks glibc's free
lists, each arena under its lock: 6 µs with the bundled models loaded, 0.8–5 ms once tens of
thousands of chunks are free, so it runs on a thread)."""
WAITED_S = 0.5
"""How long a read must have waited to be ended: a stream's requests that follow one another
are read at once, and over loopback a 60 MiB message is whole in 115 ms."""
LOOKS = 2
"""Looks in a row that must find the heap grown: a request's memory the budget does not count
(its outputs while encoded) is gone by the next."""

MIB = 1 << 20


@dataclass(slots=True, eq=False)
class _Waiting:
    """One stream read waiting for its message."""

    stream: Watched[Any]
    read: asyncio.Future[Any]
    began: float
    since: int | None
    """The heap in use less the budget's, at the last look before the read began."""
    looks: int = 0


class ArrivingStreams:
    """Stream reads waiting for their messages, ended when the heap grows past
    ``threshold`` (half the budget) meanwhile."""

    def __init__(
        self,
        budget: BytesBudget,
        in_use: Callable[[], int],
        model_changes: Callable[[], tuple[int, bool]] = lambda: (0, False),
        threshold: int | None = None,
    ) -> None:
        self.budget = budget
        self.in_use = in_use
        self.model_changes = model_changes
        """The repository's count of loads and unloads, and whether one is under way: what a
        model holds is no stream's, so reads begin from the next look after one."""
        self._changes = model_changes()
        self.threshold = budget.limit // 2 if threshold is None else threshold
        self.streams = 0
        """Streams open: the heap is looked at while there is one."""
        self.reads: set[_Waiting] = set()
        self.last: int | None = None
        """The latest look: the heap in use less the budget's held bytes."""
        self._task: asyncio.Task[None] | None = None

    @classmethod
    def where_available(
        cls, budget: BytesBudget | None, model_changes: Callable[[], tuple[int, bool]]
    ) -> ArrivingStreams | None:
        in_use = malloc_in_use_bytes()
        if budget is None or in_use is None:
            return None
        return cls(budget, in_use, model_changes)

    async def watch(self, requests: AsyncIterator[Request]) -> Watched[Request]:
        """``requests``, a stream's, read under watch from now until :meth:`Watched.close`."""
        self.streams += 1
        try:
            if self._task is None or self._task.done():  # the first stream: looks from now on
                self._task = asyncio.create_task(self._looking())
            if self.last is None:  # a look to begin from, before its message can arrive
                await self.look()
        except BaseException:  # the call was cancelled meanwhile
            self.streams -= 1
            raise
        return Watched(requests, self)

    async def look(self) -> None:
        """Look at the heap, and end the reads it grew by past the threshold, two looks in a
        row, while they waited at least WAITED_S."""
        now = await asyncio.to_thread(self.in_use) - self.budget.held
        self.last = now
        clock = time.monotonic()
        changes = self.model_changes()
        changed = changes != self._changes or changes[1]  # a model loading, loaded, unloaded
        self._changes = changes
        ended = []
        for waiting in list(self.reads):
            if waiting.since is None or changed:
                waiting.since, waiting.looks = now, 0
                continue
            grown = now - waiting.since
            late = clock - waiting.began >= WAITED_S
            waiting.looks = waiting.looks + 1 if late and grown > self.threshold else 0
            if waiting.looks >= LOOKS and waiting.stream.ended is None:
                waiting.stream.ended = (
                    f"this stream waited {clock - waiting.began:.1f} s for its next request "
                    f"while the server's memory outside its budget grew by {grown / MIB:.0f} "
                    f"MiB (messages still arriving; past half of TG_MAX_INFLIGHT_BYTES, "
                    f"{self.threshold / MIB:.0f} MiB): open a new stream"
                )
                waiting.read.cancel()
                ended.append(grown)
        if ended:
            REFUSED["body_budget"] += len(ended)
            log.warning(
                "ended %d gRPC stream(s) waiting for their next request: the heap grew by up "
                "to %.0f MiB outside the budget while they waited",
                len(ended),
                max(ended) / MIB,
            )

    async def _looking(self) -> None:
        try:
            while self.streams:
                await asyncio.sleep(LOOK_EVERY_S)
                await self.look()
        finally:
            self.last = None  # stale by the next stream

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)


class Watched(AsyncIterator[Request]):
    """A stream's requests, each read counted waiting in its :class:`ArrivingStreams` until its
    message has arrived. A read it ends makes the iterator end (the requests read are
    answered); :attr:`ended` says why."""

    def __init__(self, requests: AsyncIterator[Request], streams: ArrivingStreams) -> None:
        self.requests = requests
        self.streams = streams
        self.ended: str | None = None
        self._closed = False

    def __aiter__(self) -> Watched[Request]:
        return self

    async def __anext__(self) -> Request:
        if self.ended is not None:
            raise StopAsyncIteration
        streams = self.streams
        read: asyncio.Future[Request] = asyncio.ensure_future(anext(self.requests))
        waiting = _Waiting(self, read, time.monotonic(), streams.last)
        streams.reads.add(waiting)
        try:
            return await read
        except asyncio.CancelledError:
            if self.ended is not None and read.cancelled():
                raise StopAsyncIteration from None
            raise
        finally:
            streams.reads.discard(waiting)

    def close(self) -> None:
        """The stream is over: the heap is no longer looked at for it."""
        if not self._closed:
            self._closed = True
            self.streams.streams -= 1
