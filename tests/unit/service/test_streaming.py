"""A stream's requests answered concurrently, in completion order, driven by plain generators."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

import pytest

from service.grpc.streaming import completion_order

pytestmark = pytest.mark.unit


class Gate:
    """Answers request ``n`` once ``open(n)`` is called; remembers what was read and dropped."""

    def __init__(self) -> None:
        self.events: dict[int, asyncio.Event] = {}
        self.read: list[int] = []
        self.cancelled: list[int] = []
        self.started = asyncio.Condition()

    def event(self, n: int) -> asyncio.Event:
        return self.events.setdefault(n, asyncio.Event())

    async def requests(
        self, items: list[int], then: asyncio.Event | None = None
    ) -> AsyncIterator[int]:
        for n in items:
            self.read.append(n)
            yield n
        if then is not None:  # a client that keeps its stream open
            await then.wait()

    async def answer(self, n: int) -> str:
        async with self.started:
            self.started.notify_all()
        try:
            await self.event(n).wait()
        except asyncio.CancelledError:
            self.cancelled.append(n)
            raise
        if n < 0:
            raise ValueError(f"bad request {n}")
        return f"answer {n}"

    async def until(self, condition: Callable[[], bool]) -> None:
        async with self.started:
            await self.started.wait_for(condition)


def test_answers_come_in_completion_order() -> None:
    async def run() -> list[str]:
        gate = Gate()
        stream = completion_order(gate.requests([1, 2, 3]), gate.answer, limit=8)
        got = []
        for n in (2, 3, 1):
            gate.event(n).set()
            got.append(await anext(stream))
        with pytest.raises(StopAsyncIteration):
            await anext(stream)
        return got

    assert asyncio.run(run()) == ["answer 2", "answer 3", "answer 1"]


def test_no_more_than_the_limit_is_read_while_answers_are_pending() -> None:
    async def run() -> None:
        gate = Gate()
        stream = completion_order(gate.requests([1, 2, 3, 4]), gate.answer, limit=2)
        first = asyncio.ensure_future(anext(stream))
        await gate.until(lambda: len(gate.read) == 2)
        await asyncio.sleep(0)  # give the reader every chance to take a third
        assert gate.read == [1, 2]
        gate.event(1).set()
        assert await first == "answer 1"
        gate.event(2).set()
        assert await anext(stream) == "answer 2"  # answer 1 taken: a third is read
        await gate.until(lambda: len(gate.read) >= 3)
        for n in (3, 4):
            gate.event(n).set()
        assert sorted([x async for x in stream]) == ["answer 3", "answer 4"]

    asyncio.run(run())


def test_a_client_that_stops_taking_answers_holds_at_most_the_limit() -> None:
    """#28 finding 8: answers done but not taken freed their slot, so a client that sent and
    never read made answers pile up without bound."""

    async def run() -> None:
        gate = Gate()
        for n in range(100):
            gate.event(n).set()  # every answer is ready at once
        stream = completion_order(gate.requests(list(range(100))), gate.answer, limit=4)
        assert await anext(stream) == "answer 0"  # then nobody takes another
        for _ in range(50):
            await asyncio.sleep(0)
        assert len(gate.read) <= 5  # the limit, and the one taken
        rest = {x async for x in stream}
        assert rest == {f"answer {n}" for n in range(1, 100)}

    asyncio.run(run())


def test_an_answer_that_raises_ends_the_stream_with_its_error() -> None:
    async def run() -> None:
        gate = Gate()
        stream = completion_order(gate.requests([-1]), gate.answer, limit=2)
        gate.event(-1).set()
        with pytest.raises(ValueError, match="bad request -1"):
            await anext(stream)

    asyncio.run(run())


def test_closing_the_stream_cancels_what_is_still_being_answered() -> None:
    async def run() -> Gate:
        gate = Gate()
        stream = completion_order(gate.requests([1, 2, 3]), gate.answer, limit=8)
        gate.event(2).set()
        assert await anext(stream) == "answer 2"
        await stream.aclose()  # as when the client cancels the call
        assert len(asyncio.all_tasks()) == 1  # only this test's own
        return gate

    assert sorted(asyncio.run(run()).cancelled) == [1, 3]


def test_stop_ends_reading_and_answers_what_was_read() -> None:
    async def run() -> list[str]:
        gate, stop, never = Gate(), asyncio.Event(), asyncio.Event()
        stream = completion_order(gate.requests([1, 2], then=never), gate.answer, 8, stop)

        async def collect() -> list[str]:
            return [x async for x in stream]

        answers = asyncio.ensure_future(collect())
        await gate.until(lambda: len(gate.read) == 2)
        stop.set()
        gate.event(1).set()
        gate.event(2).set()
        return await answers

    assert sorted(asyncio.run(run())) == ["answer 1", "answer 2"]
