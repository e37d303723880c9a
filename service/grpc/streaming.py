"""Requests of one stream answered concurrently, each answer sent as soon as it is ready.

Protocol-free, so that a test can drive it with a plain async generator: gRPC's
``ModelStreamInfer`` (:mod:`service.grpc.servicer`) gives it the call's request iterator and a
function that answers one request.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

Request = TypeVar("Request")
Answer = TypeVar("Answer")


@dataclass(frozen=True, slots=True)
class _Failed:
    error: BaseException


class _Ended:
    """The reader is done: every request it read has been answered."""


async def completion_order(
    requests: AsyncIterator[Request],
    answer: Callable[[Request], Awaitable[Answer]],
    limit: int,
    stop: asyncio.Event | None = None,
) -> AsyncIterator[Answer]:
    """Each of ``requests``' answers, in the order they complete (Triton's order for a stream:
    clients match answers to requests by id), with at most ``limit`` being answered at once.

    While ``limit`` are in flight the next request is not read, so a client that sends faster
    than the server answers is held back by the transport's flow control instead of piling up
    here. An answer is in flight until it has been taken (the caller came back for the next
    one, which gRPC does once it has sent the last): a client that stops reading its answers
    holds at most ``limit`` of them (#28 finding 8: answers done but unsent piled up, +0.5 MB/s
    for as long as the client kept sending). When ``stop`` is set, reading stops and the
    requests already read are answered. If ``answer`` raises (it should turn errors into
    answers), that error ends the stream. Closing the iterator early (the client cancelled)
    cancels every request still being answered, and waits for them to let go.
    """
    ready: asyncio.Queue[Answer | _Failed | _Ended] = asyncio.Queue()
    slots = asyncio.Semaphore(limit)
    running: set[asyncio.Task[None]] = set()

    async def one(request: Request) -> None:
        try:
            ready.put_nowait(await answer(request))  # its slot is given back once taken
        except Exception as exc:
            ready.put_nowait(_Failed(exc))

    async def read() -> None:
        try:
            while True:
                await slots.acquire()  # before reading: no request is read that cannot start
                try:
                    request = await anext(requests)
                except StopAsyncIteration:
                    return
                task = asyncio.create_task(one(request))
                running.add(task)
                task.add_done_callback(running.discard)
        except Exception as exc:
            ready.put_nowait(_Failed(exc))

    async def finish() -> None:
        """Once reading is over (the client's half-close, an error, or ``stop``), wait for the
        requests in flight, then end."""
        if stop is None:
            await reading
        else:
            stopping = asyncio.create_task(stop.wait())
            await asyncio.wait({reading, stopping}, return_when=asyncio.FIRST_COMPLETED)
            for task in (stopping, reading):
                task.cancel()
        while running:
            await asyncio.wait(set(running))
        ready.put_nowait(_Ended())

    reading = asyncio.create_task(read())
    finishing = asyncio.create_task(finish())
    try:
        while not isinstance(item := await ready.get(), _Ended):
            if isinstance(item, _Failed):
                raise item.error
            yield item
            slots.release()  # taken: the next request may be read
    finally:
        left = [reading, finishing, *running]
        for task in left:
            task.cancel()
        await asyncio.gather(*left, return_exceptions=True)
