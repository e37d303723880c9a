"""until_disconnect (a client gone mid-request) and the coalescing transport, on real loops and
real sockets."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from service.http.answer import until_disconnect


class Messages:
    """An ASGI ``receive`` fed by the test: what the server would deliver after the body."""

    def __init__(self) -> None:
        self.queue: asyncio.Queue[dict[str, Any]] = asyncio.Queue()

    async def __call__(self) -> dict[str, Any]:
        return await self.queue.get()

    def disconnect(self) -> None:
        self.queue.put_nowait({"type": "http.disconnect"})


async def long_work(cancelled: asyncio.Event) -> int:
    """A minute of work that notes being cancelled."""
    try:
        await asyncio.sleep(60)
    except asyncio.CancelledError:
        cancelled.set()
        raise
    return 1


async def test_work_that_finishes_returns_its_result_and_leaves_no_task() -> None:
    tasks = len(asyncio.all_tasks())
    result = await until_disconnect(Messages(), asyncio.sleep(0.001, result=7))
    await asyncio.sleep(0)  # let the cancelled watcher finish
    assert (result, len(asyncio.all_tasks())) == (7, tasks)  # no task left behind


async def test_a_disconnect_cancels_the_work_and_returns_none() -> None:
    cancelled = asyncio.Event()

    receive = Messages()
    asyncio.get_running_loop().call_later(0.01, receive.disconnect)
    result = await until_disconnect(receive, long_work(cancelled))
    await asyncio.sleep(0)  # the task is usable afterwards: not left cancelling
    current = asyncio.current_task()
    assert current is not None
    result = result, cancelled.is_set(), current.cancelling()
    assert result == (None, True, 0)


@pytest.mark.parametrize("ending", ["raises", "returns"])
async def test_work_that_mishandles_the_cancellation_still_leaves_the_task_usable(
    ending: str,
) -> None:
    """Work that turns the disconnect's cancellation into an error, or swallows it."""

    async def work() -> int:
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            if ending == "raises":
                raise RuntimeError("cleanup failed") from None
        return 1

    receive = Messages()
    asyncio.get_running_loop().call_later(0.01, receive.disconnect)
    result = await until_disconnect(receive, work())
    await asyncio.sleep(0)  # would raise CancelledError if a cancellation were left pending
    current = asyncio.current_task()
    assert current is not None
    result = result, current.cancelling()
    assert result == (None, 0)


async def test_errors_of_the_work_reach_the_caller() -> None:
    async def work() -> int:
        raise ValueError("bad input")

    with pytest.raises(ValueError, match="bad input"):
        await until_disconnect(Messages(), work())


async def test_cancelling_the_request_cancels_its_work() -> None:
    cancelled = asyncio.Event()

    request = asyncio.ensure_future(until_disconnect(Messages(), long_work(cancelled)))
    await asyncio.sleep(0.01)
    request.cancel()
    with pytest.raises(asyncio.CancelledError):
        await request
    result = cancelled.is_set()
    assert result
