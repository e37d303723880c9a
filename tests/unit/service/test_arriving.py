"""Reads of gRPC messages still arriving, the newest ended when the heap grows outside the
budget while they wait (:mod:`service.grpc.arriving`), driven look by look with a heap count the
test sets."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from service.grpc import arriving
from service.grpc.arriving import Arriving, Waiting
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


@pytest.fixture(autouse=True)
def no_wait(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(arriving, "WAITED_S", 0.0)
    monkeypatch.setattr(arriving, "LOOK_EVERY_S", 3600.0)  # looks only where a test asks


async def calls(watch: Arriving, count: int) -> list[tuple[asyncio.Future[None], Waiting]]:
    """``count`` ModelInfer reads waiting, oldest first, each begun after a look."""
    waiting = []
    for _ in range(count):
        await watch.look()
        read: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        waiting.append((read, watch.counting(read, stream=False)))
    return waiting


async def looks(watch: Arriving, count: int) -> None:
    for _ in range(count):
        await watch.look()


def test_the_newest_reads_are_ended_in_proportion_to_what_the_heap_grew_by() -> None:
    """Ten calls waiting while 64 MiB arrive outside a 32 MiB budget (half of it: 16 MiB): the
    eight newest are ended after two looks (one look: perhaps a request's outputs being
    encoded), the two oldest kept."""

    async def run() -> None:
        heap = Heap()
        watch = Arriving(BytesBudget(32 * MIB), heap)
        reads = await calls(watch, 10)
        heap.in_use += 64 * MIB
        await watch.look()
        assert not any(read.cancelled() for read, _ in reads)
        await watch.look()
        assert [read.cancelled() for read, _ in reads] == [False] * 2 + [True] * 8
        for _, waiting in reads[2:]:
            assert waiting.ended is not None
            assert "64 MiB" in waiting.ended and "retry shortly" in waiting.ended
        for _, waiting in reads:
            watch.done(waiting)
        await watch.stop()

    asyncio.run(run())


@pytest.mark.parametrize(
    ("grown_mib", "held_mib", "looks_grown"),
    [(15, 0, 3), (40, 40, 3), (40, 0, 1)],
    ids=["below half the budget", "held in the budget", "one look only"],
)
def test_no_read_is_ended_where_the_heap_outside_the_budget_did_not_stay_grown(
    grown_mib: int, held_mib: int, looks_grown: int
) -> None:
    async def run() -> None:
        heap, budget = Heap(), BytesBudget(64 * MIB)
        watch = Arriving(budget, heap, threshold=16 * MIB)
        reads = await calls(watch, 4)
        heap.in_use += grown_mib * MIB
        budget.take(held_mib * MIB)
        await looks(watch, looks_grown)
        heap.in_use -= grown_mib * MIB
        await looks(watch, 2)
        assert not any(read.cancelled() for read, _ in reads)
        await watch.stop()

    asyncio.run(run())


def test_one_read_is_always_kept() -> None:
    """However far the heap grew, the oldest read is kept: one message can always arrive."""

    async def run() -> None:
        heap = Heap()
        watch = Arriving(BytesBudget(32 * MIB), heap)
        [(read, _)] = await calls(watch, 1)
        heap.in_use += 1000 * MIB
        await looks(watch, 4)
        assert not read.cancelled()
        await watch.stop()

    asyncio.run(run())


def test_the_reads_kept_are_ended_once_the_heap_stays_grown_for_the_body_timeout() -> None:
    """The oldest read is kept however far the heap grew, but what it holds may not stay: once
    every look for TG_BODY_TIMEOUT_S found the heap outside the budget grown past a quarter
    of the budget, the reads waiting all that time are ended; one begun since is not."""

    async def run() -> None:
        heap = Heap()
        watch = Arriving(BytesBudget(32 * MIB), heap, timeout_s=0.05)
        [(kept, waiting)] = await calls(watch, 1)
        heap.in_use += 12 * MIB  # under half the budget, over a quarter
        await looks(watch, 2)
        [(newer, _)] = await calls(watch, 1)
        await asyncio.sleep(0.06)
        await watch.look()
        assert kept.cancelled() and not newer.cancelled()
        assert waiting.ended is not None and "TG_BODY_TIMEOUT_S, 0.05 s" in waiting.ended
        await watch.stop()

    asyncio.run(run())


def test_a_read_that_has_not_waited_long_is_not_ended(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(arriving, "WAITED_S", 3600.0)

    async def run() -> None:
        heap = Heap()
        watch = Arriving(BytesBudget(32 * MIB), heap)
        reads = await calls(watch, 4)
        heap.in_use += 100 * MIB
        await looks(watch, 3)
        assert not any(read.cancelled() for read, _ in reads)
        await watch.stop()

    asyncio.run(run())


def test_a_call_whose_message_is_whole_at_once_is_never_counted() -> None:
    async def run() -> None:
        watch = Arriving(BytesBudget(32 * MIB), Heap())
        loop = asyncio.get_running_loop()
        whole, arriving_ = loop.create_future(), loop.create_future()
        counted = [watch.counting(read, stream=False, after_s=0.01) for read in (whole, arriving_)]
        whole.set_result(None)
        await asyncio.sleep(0.05)
        assert watch.reads == {counted[1]}
        for waiting in counted:
            watch.done(waiting)
        assert not watch.reads
        await watch.stop()

    asyncio.run(run())


def test_what_a_model_load_holds_is_no_messages() -> None:
    """A model loaded (or loading) while reads wait grows the heap by the model: they begin
    again from the look after it, and what grows after that still ends the newest."""

    async def run() -> None:
        heap, state = Heap(), [0, False]
        watch = Arriving(BytesBudget(32 * MIB), heap, lambda: (state[0], state[1]))
        reads = await calls(watch, 2)
        state[:] = [1, True]  # a load begins
        heap.in_use += 200 * MIB
        await looks(watch, 3)
        state[:] = [2, False]  # and ends
        await looks(watch, 3)
        assert not any(read.cancelled() for read, _ in reads)
        heap.in_use += 40 * MIB  # then messages stall
        await looks(watch, 2)
        assert [read.cancelled() for read, _ in reads] == [False, True]
        await watch.stop()

    asyncio.run(run())


async def one_then_wait(forever: asyncio.Event) -> AsyncIterator[int]:
    """A client that sends one request, then nothing (idle, or its next message stalled)."""
    yield 1
    await forever.wait()


async def answer(n: int) -> str:
    return f"answer {n}"


def test_an_ended_stream_answers_what_it_read_then_ends_saying_why() -> None:
    async def run() -> None:
        heap = Heap()
        watch = Arriving(BytesBudget(32 * MIB), heap)
        [(older, _)] = await calls(watch, 1)  # kept: the oldest
        forever = asyncio.Event()
        watched = await watch.watch(one_then_wait(forever))
        answers = completion_order(watched, answer, limit=4)
        assert await anext(answers) == "answer 1"
        while len(watch.reads) < 2:  # its next read has begun
            await asyncio.sleep(0)
        heap.in_use += 40 * MIB
        await looks(watch, 2)
        assert not older.cancelled()
        with pytest.raises(StopAsyncIteration):
            await anext(answers)
        assert watched.ended is not None and "open a new stream" in watched.ended
        watched.close()
        assert watch.streams == 0
        await watch.stop()

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
