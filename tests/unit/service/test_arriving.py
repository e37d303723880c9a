"""Stream reads ended when the heap grows outside the budget while they wait
(:mod:`service.grpc.arriving`), driven look by look with a heap count the test sets."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from service.grpc import arriving
from service.grpc.arriving import ArrivingStreams
from service.grpc.streaming import completion_order
from service.limits.admission import BytesBudget
from service.limits.memory import malloc_in_use_bytes

pytestmark = pytest.mark.unit

MIB = 1 << 20


class Heap:
    """What the fake ``mallinfo2`` says is in use."""

    def __init__(self) -> None:
        self.in_use = 100 * MIB

    def __call__(self) -> int:
        return self.in_use


async def one_then_wait(forever: asyncio.Event) -> AsyncIterator[int]:
    """A client that sends one request, then nothing (idle, or its next message stalled)."""
    yield 1
    await forever.wait()


async def answer(n: int) -> str:
    return f"answer {n}"


def streams_of(heap: Heap, budget: BytesBudget) -> ArrivingStreams:
    return ArrivingStreams(budget, heap)  # threshold: half the budget, 16 MiB


@pytest.fixture(autouse=True)
def no_wait(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(arriving, "WAITED_S", 0.0)
    monkeypatch.setattr(arriving, "LOOK_EVERY_S", 3600.0)  # looks only where a test asks


async def waiting_stream(
    streams: ArrivingStreams, forever: asyncio.Event
) -> tuple[arriving.Watched[int], AsyncIterator[str], str]:
    watched = await streams.watch(one_then_wait(forever))
    answers = completion_order(watched, answer, limit=4)
    first = await anext(answers)
    while not streams.reads:  # its next read has begun
        await asyncio.sleep(0)
    return watched, answers, first


def test_a_read_the_heap_grew_past_half_the_budget_for_is_ended_after_its_answers() -> None:
    async def run() -> None:
        heap, budget = Heap(), BytesBudget(32 * MIB)
        streams, forever = streams_of(heap, budget), asyncio.Event()
        watched, answers, first = await waiting_stream(streams, forever)
        assert first == "answer 1"
        heap.in_use += 17 * MIB  # a stalled message, outside the budget
        await streams.look()
        assert watched.ended is None  # one look: perhaps a request's outputs being encoded
        await streams.look()
        assert watched.ended is not None and "open a new stream" in watched.ended
        assert "17 MiB" in watched.ended
        with pytest.raises(StopAsyncIteration):
            await anext(answers)  # the requests read are answered, then the stream ends
        assert not streams.reads
        watched.close()
        assert streams.streams == 0
        await streams.stop()

    asyncio.run(run())


@pytest.mark.parametrize(
    ("grown_mib", "held_mib", "looks"),
    [(15, 0, 3), (17, 17, 3), (40, 0, 1)],
    ids=["below half the budget", "held in the budget", "one look only"],
)
def test_a_read_is_not_ended_where_the_heap_outside_the_budget_did_not_stay_grown(
    grown_mib: int, held_mib: int, looks: int
) -> None:
    async def run() -> None:
        heap, budget = Heap(), BytesBudget(32 * MIB)
        streams, forever = streams_of(heap, budget), asyncio.Event()
        watched, answers, _ = await waiting_stream(streams, forever)
        heap.in_use += grown_mib * MIB
        budget.take(held_mib * MIB)
        for _ in range(looks):
            await streams.look()
        heap.in_use -= grown_mib * MIB
        await streams.look()
        assert watched.ended is None
        assert streams.reads  # still waiting
        forever.set()  # the client half-closes: the stream ends as streams end
        with pytest.raises(StopAsyncIteration):
            await anext(answers)
        watched.close()
        await streams.stop()

    asyncio.run(run())


def test_what_a_model_load_holds_is_no_streams() -> None:
    """A model loaded (or loading) while a stream waits grows the heap by the model: the read
    begins again from the look after it, and what grows after that still ends it."""

    async def run() -> None:
        heap, budget = Heap(), BytesBudget(32 * MIB)
        state = [0, False]
        streams = ArrivingStreams(budget, heap, lambda: (state[0], state[1]))
        forever = asyncio.Event()
        watched, answers, _ = await waiting_stream(streams, forever)
        state[:] = [1, True]  # a load begins
        heap.in_use += 200 * MIB
        for _ in range(3):
            await streams.look()
        state[:] = [2, False]  # and ends
        for _ in range(3):
            await streams.look()
        assert watched.ended is None
        heap.in_use += 17 * MIB  # then a message stalls
        for _ in range(2):
            await streams.look()
        assert watched.ended is not None
        with pytest.raises(StopAsyncIteration):
            await anext(answers)
        watched.close()
        await streams.stop()

    asyncio.run(run())


def test_a_read_that_has_not_waited_long_is_not_ended(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(arriving, "WAITED_S", 3600.0)

    async def run() -> None:
        heap, budget = Heap(), BytesBudget(32 * MIB)
        streams, forever = streams_of(heap, budget), asyncio.Event()
        watched, answers, _ = await waiting_stream(streams, forever)
        heap.in_use += 100 * MIB
        for _ in range(3):
            await streams.look()
        assert watched.ended is None
        forever.set()
        with pytest.raises(StopAsyncIteration):
            await anext(answers)
        watched.close()
        await streams.stop()

    asyncio.run(run())


@pytest.mark.skipif(malloc_in_use_bytes() is None, reason="needs glibc 2.33+ (mallinfo2)")
def test_the_heap_count_sees_what_is_allocated_and_freed() -> None:
    in_use = malloc_in_use_bytes()
    assert in_use is not None
    before = in_use()
    block = bytearray(64 * MIB)
    assert in_use() - before >= 64 * MIB
    del block
    assert in_use() - before < 8 * MIB
