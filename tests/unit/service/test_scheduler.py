"""Batch formation as pure functions, and the Scheduler driven with a real (tiny) model."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from service.batching.scheduler import (
    Plan,
    Scheduler,
    SchedulerConfig,
    collate,
    plan,
    shape_key,
    split,
)
from service.batching.stats import ModelStats, RequestTiming
from service.errors import (
    DeadlineExceeded,
    InvalidInput,
    ModelExecutionError,
    ModelNotReady,
    PayloadTooLarge,
    ServerBusy,
)
from service.limits.admission import BytesBudget
from service.telemetry.counters import REFUSED

A = (("x", "<f4", (3,)),)
B = (("x", "<f4", (5,)),)


def q(*entries: tuple[int, tuple[object, ...], float]) -> list[tuple[int, object, float]]:
    return list(entries)


def test_an_empty_queue_waits_for_an_arrival() -> None:
    assert plan([], 8, (), 0.01, now=1.0) == Plan(wait_s=None)


def test_rows_not_requests_count_toward_max_batch_size() -> None:
    queue = [(3, A, 0.0), (3, A, 0.0), (3, A, 0.0)]
    assert plan(queue, 8, (), 1.0, now=0.0).take == ()  # 6 rows fit, the 9th would not: wait
    assert plan(queue, 6, (), 1.0, now=0.0).take == (0, 1)  # full at 6 rows: run now


def test_delay_zero_takes_what_is_there() -> None:
    assert plan([(1, A, 5.0), (2, A, 5.0)], 32, (), 0.0, now=5.0).take == (0, 1)


def test_the_oldest_request_waits_at_most_the_delay() -> None:
    queue = [(1, A, 10.0), (1, A, 10.002)]
    assert plan(queue, 8, (), 0.005, now=10.003) == Plan(wait_s=pytest.approx(0.002))
    assert plan(queue, 8, (), 0.005, now=10.005).take == (0, 1)


def test_a_preferred_size_runs_at_once_and_the_largest_reachable_wins() -> None:
    queue = [(2, A, 0.0), (2, A, 0.0), (4, A, 0.0), (1, A, 0.0)]
    assert plan(queue, 32, (4, 8), 1.0, now=0.0).take == (0, 1, 2)  # 8 rows
    assert plan(queue[:2], 32, (4, 8), 1.0, now=0.0).take == (0, 1)  # 4 rows
    assert plan(queue[:1], 32, (4, 8), 1.0, now=0.0).wait_s == pytest.approx(1.0)


def test_preferred_sizes_cap_the_batch_as_in_triton() -> None:
    """With preferred sizes a batch grows to the largest of them at most, even when more rows
    wait and max_batch_size would take them; a request larger than that runs alone."""
    queue = [(2, A, 0.0)] * 6
    assert plan(queue, 32, (4,), 1.0, now=0.0).take == (0, 1)
    assert plan(queue, 32, (4, 8), 1.0, now=0.0).take == (0, 1, 2, 3)
    assert plan([(6, A, 0.0), (1, A, 0.0)], 32, (4,), 1.0, now=0.0).take == (0,)
    assert plan([(3, A, 0.0), (3, A, 0.0)], 32, (4,), 1.0, now=2.0).take == (0,)  # 3 then 3


def test_requests_of_other_shapes_are_never_concatenated() -> None:
    queue = [(1, A, 0.0), (1, B, 0.0), (1, A, 0.0), (1, B, 0.0)]
    assert plan(queue, 8, (), 0.0, now=0.0).take == (0, 2)
    assert plan(queue[1:2] + queue[3:], 8, (), 0.0, now=0.0).take == (0, 1)


def test_a_model_without_batching_runs_one_request_at_a_time() -> None:
    assert plan([(1, A, 0.0), (1, A, 0.0)], 0, (), 1.0, now=0.0).take == (0,)


@given(
    st.lists(st.tuples(st.integers(1, 8), st.sampled_from([A, B]), st.floats(0, 0.5)), max_size=20),
    st.integers(1, 16),
    st.lists(st.integers(1, 16), max_size=3),
    st.floats(0, 0.01),
)
def test_every_plan_respects_the_rules(
    queue: list[tuple[int, object, float]], max_rows: int, preferred: list[int], delay: float
) -> None:
    queue = [(min(rows, max_rows), key, t) for rows, key, t in queue]
    decision = plan(queue, max_rows, preferred, delay, now=0.5)
    if not queue:
        assert decision == Plan(wait_s=None)
        return
    if decision.take:
        taken = [queue[i] for i in decision.take]
        assert decision.take[0] == 0  # FIFO: the oldest always goes first
        assert {key for _, key, _ in taken} == {queue[0][1]}
        assert sum(rows for rows, _, _ in taken) <= max_rows
        if preferred and len(taken) > 1:
            assert sum(rows for rows, _, _ in taken) <= max(preferred)
        assert list(decision.take) == sorted(decision.take)
    else:
        assert decision.wait_s is not None and 0 < decision.wait_s <= delay


def test_collate_and_split_round_trip_per_request() -> None:
    class P:
        def __init__(self, x: np.ndarray) -> None:
            self.work = {"x": x}

    parts = [np.full((n, 2), n, np.float32) for n in (1, 3, 2)]
    batch = collate([P(x) for x in parts])
    assert batch["x"].shape == (6, 2)
    back = split({"y": batch["x"] * 2}, [1, 3, 2], "m")
    for original, answer in zip(parts, back, strict=True):
        np.testing.assert_array_equal(answer["y"], original * 2)


def test_split_refuses_a_batch_size_mismatch_naming_the_model() -> None:
    with pytest.raises(
        ModelExecutionError, match="model 'm' returned 5 rows of output 'y' for a batch of 6"
    ):
        split({"y": np.zeros((5, 1))}, [3, 3], "m")


def test_shape_key_ignores_the_batch_dim_only() -> None:
    a = shape_key({"x": np.zeros((2, 3), np.float32)}, batched=True)
    assert a == shape_key({"x": np.zeros((7, 3), np.float32)}, batched=True)
    assert a != shape_key({"x": np.zeros((2, 4), np.float32)}, batched=True)
    assert a != shape_key({"x": np.zeros((2, 3), np.float64)}, batched=True)


# -- the Scheduler, driven in an event loop with a real function as the model ---------------


def scheduler(
    run: Callable[[dict[str, np.ndarray]], dict[str, np.ndarray]], **config: object
) -> Scheduler:
    settings = SchedulerConfig(**{"max_batch_size": 8, **config})
    return Scheduler("m", settings, [run] * settings.instances, ModelStats())


def doubling(batches: list[int]) -> Callable[[dict[str, np.ndarray]], dict[str, np.ndarray]]:
    def run(batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        batches.append(batch["x"].shape[0])
        return {"y": batch["x"] * 2}

    return run


def slow_doubling(
    batches: list[int], seconds: float
) -> Callable[[dict[str, np.ndarray]], dict[str, np.ndarray]]:
    """:func:`doubling` whose every batch computes for ``seconds`` (a sleep stands for it)."""
    double = doubling(batches)

    def run(batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        time.sleep(seconds)
        return double(batch)

    return run


async def test_concurrent_requests_each_get_their_own_rows_back() -> None:
    sizes: list[int] = []
    s = scheduler(doubling(sizes), max_queue_delay_s=0.05)
    s.start()
    inputs = [np.full((n, 2), i, np.float32) for i, n in enumerate([1, 2, 3, 1, 1])]
    answers = await asyncio.gather(*(s.submit({"x": x}, None, None) for x in inputs))
    for x, answer in zip(inputs, answers, strict=True):
        np.testing.assert_array_equal(answer["y"], x * 2)
    await s.stop()
    result = sizes
    sizes = result
    assert sum(sizes) == 8
    assert max(sizes) > 1  # they were batched together


async def test_an_oversize_request_is_split_into_chunks_and_reassembled() -> None:
    sizes: list[int] = []
    s = scheduler(doubling(sizes), max_batch_size=4)
    s.start()
    x = np.arange(22, dtype=np.float32).reshape(11, 2)
    answer = await s.submit({"x": x}, None, None)
    np.testing.assert_array_equal(answer["y"], x * 2)
    await s.stop()
    result = sizes
    assert result == [4, 4, 3]


async def test_a_batch_holds_its_copy_in_the_budget_or_runs_its_requests_one_at_a_time() -> None:
    """#28 finding 15: a batch's concatenated inputs were held beside the requests' bodies,
    counted nowhere."""
    budget = BytesBudget(limit=1000)
    sizes: list[int] = []
    s = scheduler(doubling(sizes), max_queue_delay_s=0.05)
    s.budget = budget
    s.start()
    inputs = [np.full((1, 25), i, np.float32) for i in range(4)]  # 100 bytes each
    answers = await asyncio.gather(*(s.submit({"x": x}, None, None) for x in inputs))
    assert sizes == [4] and budget.held == 0 and budget.high == 400  # held while it ran
    budget.take(700)  # the bodies, say: 400 more bytes would not fit
    refused = REFUSED["body_budget"]
    sizes.clear()
    answers = await asyncio.gather(*(s.submit({"x": x}, None, None) for x in inputs))
    for x, answer in zip(inputs, answers, strict=True):
        np.testing.assert_array_equal(answer["y"], x * 2)
    assert sizes == [1, 1, 1, 1] and budget.held == 700
    assert REFUSED["body_budget"] == refused  # nothing was refused: the batch ran another way
    await s.stop()


async def test_a_batchs_outputs_are_held_until_its_answers_are_let_go() -> None:
    budget = BytesBudget(limit=1 << 30)
    s = scheduler(doubling([]), max_queue_delay_s=0.05)
    s.budget = budget
    s.start()
    inputs = [np.full((1, 64 << 10), i, np.float32) for i in range(2)]  # 256 KiB each
    tasks = [asyncio.ensure_future(s.submit({"x": x}, None, None)) for x in inputs]
    await asyncio.wait(tasks)
    answers = [task.result() for task in tasks]
    del tasks  # a task keeps its result (as gather's would, until its future goes)
    assert budget.held == 2 * (256 << 10)  # the batch's outputs, split between the two
    del answers[0]
    assert budget.held == 2 * (256 << 10)  # one batch's memory: held until both are let go
    answers.clear()
    # the instance thread lets go of its run's result (the executor's work item) just after
    # handing it over, and on a busy machine that can come after the answers are let go here
    for _ in range(200):
        if budget.held == 0:
            break
        await asyncio.sleep(0.005)
    assert budget.held == 0
    await s.stop()


def _blocking() -> tuple[threading.Event, Callable[[dict[str, np.ndarray]], dict[str, np.ndarray]]]:
    release = threading.Event()

    def run(batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        release.wait(10)
        return {"y": batch["x"]}

    return release, run


async def busy(s: Scheduler) -> None:
    """Until the (only) instance has started a batch: polled, bounded."""
    for _ in range(1000):
        if s.busy_instances():
            return
        await asyncio.sleep(0.005)
    raise TimeoutError("the instance never started a batch")


async def test_a_full_queue_answers_503_with_retry_after() -> None:
    release, run = _blocking()
    s = scheduler(run, max_queue_size=2, max_batch_size=1)
    s.start()
    first = asyncio.ensure_future(s.submit({"x": np.zeros((1, 1))}, None, None))
    await busy(s)
    queued = [
        asyncio.ensure_future(s.submit({"x": np.zeros((1, 1))}, None, None)) for _ in range(2)
    ]
    await asyncio.sleep(0)
    with pytest.raises(ServerBusy) as refused:
        await s.submit({"x": np.zeros((1, 1))}, None, None)
    assert refused.value.headers["Retry-After"] == "1"
    release.set()
    await asyncio.gather(first, *queued)
    await s.stop()


async def test_a_request_past_its_deadline_gets_504_and_never_runs() -> None:
    release, run = _blocking()
    seen: list[int] = []

    def tracking(batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        seen.append(int(batch["x"][0, 0]))
        return run(batch)

    s = scheduler(tracking, max_batch_size=1)
    s.start()
    first = asyncio.ensure_future(s.submit({"x": np.zeros((1, 1))}, None, None))
    await busy(s)
    late = asyncio.ensure_future(
        s.submit({"x": np.ones((1, 1))}, None, deadline=time.monotonic() + 0.01)
    )
    await asyncio.sleep(0.05)  # time passes beyond the late request's deadline
    release.set()
    await first
    with pytest.raises(DeadlineExceeded, match="past its deadline"):
        await late
    await s.stop()
    result = seen
    assert result == [0]


async def test_a_cancelled_request_is_dropped_before_it_runs() -> None:
    release, run = _blocking()
    seen: list[int] = []

    def tracking(batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        seen.extend(int(v) for v in batch["x"][:, 0])
        return run(batch)

    s = scheduler(tracking, max_batch_size=1)
    s.start()
    first = asyncio.ensure_future(s.submit({"x": np.zeros((1, 1))}, None, None))
    await busy(s)
    gone = asyncio.ensure_future(s.submit({"x": np.ones((1, 1))}, None, None))
    kept = asyncio.ensure_future(s.submit({"x": np.full((1, 1), 2.0)}, None, None))
    await asyncio.sleep(0)
    gone.cancel()
    release.set()
    await asyncio.gather(first, kept)
    await s.stop()
    result = seen
    assert result == [0, 2]


async def test_a_failing_model_fails_only_its_batch_and_the_scheduler_goes_on() -> None:
    calls = 0

    def flaky(batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise RuntimeError("boom")
        return {"y": batch["x"]}

    s = scheduler(flaky, max_batch_size=1)
    s.start()
    with pytest.raises(ModelExecutionError, match="model 'm' failed: boom"):
        await s.submit({"x": np.zeros((1, 1))}, None, None)
    answer = await s.submit({"x": np.ones((1, 1))}, None, None)
    assert answer["y"][0, 0] == 1
    await s.stop()


async def test_one_poisoned_request_fails_alone_and_its_batch_mates_are_answered() -> None:
    """A batch that fails runs again one request at a time: only the request whose input the
    model cannot take fails, with 400 naming the model's error; the others get their answers."""

    sizes: list[int] = []

    def run(batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        sizes.append(batch["x"].shape[0])
        if (batch["x"] < 0).any():
            raise RuntimeError("indices element out of data bounds, idx=-7")
        return {"y": batch["x"] * 2}

    s = scheduler(run, max_queue_delay_s=0.05)
    s.start()
    inputs = [np.full((1, 2), i, np.float32) for i in (1, 2, -7, 3)]
    answers = await asyncio.gather(
        *(s.submit({"x": x}, None, None) for x in inputs), return_exceptions=True
    )
    for x, answer in zip(inputs, answers, strict=True):
        if x[0, 0] < 0:
            assert isinstance(answer, InvalidInput)
            assert "model 'm' failed on this request's input" in answer.message
            assert "out of data bounds" in answer.message
        else:
            assert isinstance(answer, dict)
            np.testing.assert_array_equal(answer["y"], x * 2)
    await s.stop()
    result = sizes, s.stats
    sizes, stats = result
    assert sizes == [4, 1, 1, 1, 1]  # the batch, then each request alone
    assert stats.isolated_count == 1


async def test_when_every_request_fails_alone_the_model_is_at_fault() -> None:
    def run(batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        raise RuntimeError("the model is broken")

    s = scheduler(run, max_queue_delay_s=0.05)
    s.start()
    answers = await asyncio.gather(
        *(s.submit({"x": np.zeros((1, 2))}, None, None) for _ in range(3)),
        return_exceptions=True,
    )
    await s.stop()
    result = answers
    for answer in result:
        assert isinstance(answer, ModelExecutionError)
        assert answer.message == "model 'm' failed: the model is broken"


async def test_a_lone_failure_is_the_inputs_fault_while_the_golden_replay_still_matches() -> None:
    def run(batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        if batch["x"].max() > 100:
            raise RuntimeError(
                "[ONNXRuntimeError] : 2 : INVALID_ARGUMENT : Non-zero status code "
                "returned while running Gather node. Name:'node_7' Status "
                "Message: idx=1000 is out of bounds"
            )
        return {"y": batch["x"] * 2}

    s = scheduler(run)
    s.replay = lambda instance_run: None  # the golden pairs still answer as exported
    s.start()
    with pytest.raises(InvalidInput) as caught:
        await s.submit({"x": np.full((1, 2), 1000.0)}, None, None)
    await s.stop()
    assert caught.value.message == (
        "model 'm' failed on this request's input (idx=1000 is out of bounds); it still answers "
        "its golden inputs as exported, so the input is at fault"
    )


async def test_a_failed_golden_replay_leaves_no_later_batch_to_the_broken_model() -> None:
    broken: list[str] = []

    def run(batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        raise RuntimeError("poisoned")

    s = scheduler(run)
    s.replay = lambda instance_run: "golden replay: output 'y' differs by up to nan"
    s.on_broken = broken.append
    s.start()
    first = asyncio.ensure_future(s.submit({"x": np.zeros((1, 2))}, None, None))
    with pytest.raises(ModelExecutionError, match="model 'm' failed: poisoned"):
        await first
    with pytest.raises(ModelNotReady, match="model 'm' is broken: failed its golden replay"):
        await s.submit({"x": np.zeros((1, 2))}, None, None)
    await s.stop()
    assert broken == [
        "failed its golden replay after a request failed: golden replay: output "
        "'y' differs by up to nan"
    ]


class OutOfMemoryError(RuntimeError):
    """Named like torch.cuda.OutOfMemoryError: what a GPU runtime raises."""


async def test_out_of_memory_splits_the_batch_until_requests_fit() -> None:
    sizes: list[int] = []

    def run(batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        rows = batch["x"].shape[0]
        sizes.append(rows)
        if rows > 2:
            raise OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return {"y": batch["x"] * 2}

    s = scheduler(run, max_queue_delay_s=0.05)
    s.start()
    inputs = [np.full((1, 2), i, np.float32) for i in range(6)]
    answers = await asyncio.gather(*(s.submit({"x": x}, None, None) for x in inputs))
    for x, answer in zip(inputs, answers, strict=True):
        np.testing.assert_array_equal(answer["y"], x * 2)
    with pytest.raises(PayloadTooLarge, match="does not fit in device memory even alone"):
        await s.submit({"x": np.zeros((4, 2), np.float32)}, None, None)
    still = await s.submit({"x": np.ones((1, 2), np.float32)}, None, None)
    np.testing.assert_array_equal(still["y"], np.full((1, 2), 2.0))
    await s.stop()
    result = sizes, s.stats
    sizes, stats = result
    assert sizes[0] == 6  # the whole batch first, then halves down to what fits
    assert sum(size for size in sizes if size <= 2) == 6 + 1  # every row ran once, + the last
    assert sizes.count(4) == 1  # the request too large alone ran once, then got its 413
    assert stats.out_of_memory_count >= 2


def test_only_out_of_memory_errors_are_retried() -> None:
    from service.batching.scheduler import is_out_of_memory

    assert is_out_of_memory(OutOfMemoryError("x"))
    assert is_out_of_memory(
        RuntimeError("[ONNXRuntimeError] : 6 : Failed to allocate memory for requested buffer")
    )
    assert not is_out_of_memory(RuntimeError("shape mismatch"))


async def test_each_instance_runs_batches_on_its_own_runtime() -> None:
    """Instances on different GPUs hold different runtimes: a batch runs on exactly one of them,
    and while one instance is busy the next batch goes to the other."""
    release = threading.Event()
    used: list[int] = []

    def instance(number: int) -> Callable[[dict[str, np.ndarray]], dict[str, np.ndarray]]:
        def run(batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
            used.append(number)
            if number == 0:
                release.wait(5)  # hold instance 0 so that the second batch must go elsewhere
            return {"y": batch["x"] + number * 100}

        return run

    config = SchedulerConfig(max_batch_size=8, instances=2)
    s = Scheduler("m", config, [instance(0), instance(1)], ModelStats())
    s.start()
    first = asyncio.ensure_future(s.submit({"x": np.zeros((1, 1), np.float32)}, None, None))
    for _ in range(5000):  # until instance 0 holds the first batch (bounded)
        if used:
            break
        await asyncio.sleep(0.001)
    second = await s.submit({"x": np.ones((1, 1), np.float32)}, None, None)
    release.set()
    answers = [await first, second]
    await s.stop()
    result = [a["y"] for a in answers]
    first, second = result
    assert used == [0, 1]
    assert first.tolist() == [[0.0]] and second.tolist() == [[101.0]]


def test_unwarmed_shapes_are_counted_every_time_and_logged_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    timings = [RequestTiming() for _ in range(5)]

    async def main() -> ModelStats:
        stats = ModelStats()
        warmed = {(("x", (1, 2)),)}
        s = Scheduler("m", SchedulerConfig(max_batch_size=8), [doubling([])], stats, warmed=warmed)
        s.start()
        for rows, timing in zip((1, 3, 3, 3, 2), timings, strict=True):
            await s.submit({"x": np.ones((rows, 2), np.float32)}, timing, None)
        await s.stop()
        return stats

    with caplog.at_level("WARNING", logger="tensorgate.scheduler"):
        stats = asyncio.run(main())
    assert stats.unwarmed_count == 4
    assert [t.unwarmed for t in timings] == [False, True, True, True, True]  # for its log line
    warned = [r.getMessage() for r in caplog.records if "unwarmed shape" in r.getMessage()]
    assert len(warned) == 2 and "(3, 2)" in warned[0] and "(2, 2)" in warned[1]


async def test_a_model_without_a_batch_dimension_gets_its_outputs_whole() -> None:
    """max_batch_size 0 (the default): one request a run, inputs and outputs of any shape."""

    def run(batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return {"y": batch["x"][:10] * 2, "total": batch["x"].sum(keepdims=True)}

    s = Scheduler("m", SchedulerConfig(max_batch_size=0), [run], ModelStats())
    s.start()
    answer = await s.submit({"x": np.ones(64, np.float32)}, None, None)
    await s.stop()
    result = answer
    answer = result
    np.testing.assert_array_equal(answer["y"], np.full(10, 2.0))
    np.testing.assert_array_equal(answer["total"], [64.0])


async def test_an_unprepared_request_is_prepared_and_run_on_the_instance_thread() -> None:
    """A request alone in flight crosses threads once: its instance makes its inputs."""

    threads: list[str] = []

    def prepare() -> dict[str, np.ndarray]:
        threads.append(threading.current_thread().name)
        return {"x": np.full((1, 2), 3.0, np.float32)}

    def run(batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        threads.append(threading.current_thread().name)
        return {"y": batch["x"] * 2}

    s = scheduler(run, max_queue_delay_s=5.0)  # it must not wait for company
    s.start()
    answer = await s.submit(prepare, None, None)
    np.testing.assert_array_equal(answer["y"], np.full((1, 2), 6.0))
    assert threads == ["m-instance-0_0", "m-instance-0_0"]  # one hand-off, not three
    assert s.stats.execution_count == 1
    await s.stop()


def _planning(monkeypatch: pytest.MonkeyPatch, events: list[str]) -> None:
    """Each time a worker looks for its next batch, ``"plan"`` in ``events``."""
    import service.batching.scheduler as module

    def recorded(*args: Any, **kwargs: Any) -> Plan:
        events.append("plan")
        return plan(*args, **kwargs)

    monkeypatch.setattr(module, "plan", recorded)


async def test_a_lone_request_is_answered_before_its_worker_looks_for_the_next_batch(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The batch's end wakes the loop with its answers settled: the request's task runs first
    (through an awaited future, the worker resumed first and looked for its next batch, 30 µs of
    a lone image's way back, before answering it; docs/performance.md)."""
    events: list[str] = []
    _planning(monkeypatch, events)
    s = scheduler(doubling([]))
    s.start()
    await asyncio.sleep(0)  # the worker looks once and waits for an arrival
    events.clear()
    answer = await s.submit(lambda: {"x": np.ones((1, 2), np.float32)}, None, None)
    events.append("answered")
    for _ in range(3):
        await asyncio.sleep(0)
    np.testing.assert_array_equal(answer["y"], np.full((1, 2), 2.0))
    assert events == ["plan", "answered", "plan"]
    await s.stop()


async def test_with_requests_queued_the_next_batch_starts_before_the_answers_are_written(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Under load the instance is not kept waiting while a batch's requests write answers: the
    worker takes the next batch first."""
    release, run = _blocking()
    events: list[str] = []
    _planning(monkeypatch, events)
    s = scheduler(run, max_batch_size=1)
    s.start()

    async def request(name: str) -> None:
        await s.submit({"x": np.zeros((1, 1))}, None, None)
        events.append(name)

    first = asyncio.ensure_future(request("first answered"))
    await busy(s)
    second = asyncio.ensure_future(request("second answered"))
    await asyncio.sleep(0)
    events.clear()
    release.set()
    await asyncio.gather(first, second)
    assert events[:2] == ["plan", "first answered"]  # the second's batch was taken first
    await s.stop()


@pytest.mark.parametrize(
    ("outputs", "answered"),
    [
        (lambda x: {"y": np.concatenate([x, x])}, ModelExecutionError),  # split fails
        (None, ServerBusy),  # the model raises
    ],
    ids=["its outputs do not split", "its model raises"],
)
async def test_a_batch_that_fails_while_its_version_stops_still_answers_its_requests(
    outputs: Callable[[np.ndarray], dict[str, np.ndarray]] | None, answered: type[Exception]
) -> None:
    """``stop`` cancels the worker awaiting a running batch; the batch's failure then has no
    worker to go to, and its requests are answered with it (they waited until shutdown)."""
    release = threading.Event()

    def run(batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        release.wait(10)
        if outputs is None:
            raise RuntimeError("boom")
        return outputs(batch["x"])

    s = scheduler(run, max_batch_size=1)
    s.start()
    request = asyncio.ensure_future(s.submit({"x": np.zeros((1, 1))}, None, None))
    await busy(s)
    timer = threading.Timer(0.05, release.set)  # stop() waits for the thread, holding the loop
    timer.start()
    await s.stop()
    with pytest.raises(answered, match="model 'm'"):
        await asyncio.wait_for(request, 5)
    timer.join()


async def test_a_batch_being_isolated_when_its_version_stops_answers_every_request() -> None:
    """A failed batch re-run a request at a time (to find the poisoned one): ``stop`` then
    cancelled the worker between runs, and the requests not run yet were never answered."""
    release = threading.Event()
    sizes: list[int] = []

    def run(batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        sizes.append(batch["x"].shape[0])
        if batch["x"].shape[0] > 1:
            raise RuntimeError("boom")
        release.wait(10)
        return {"y": batch["x"]}

    s = scheduler(run, max_batch_size=2, max_queue_delay_s=0.2)
    s.start()
    requests = [
        asyncio.ensure_future(s.submit({"x": np.zeros((1, 1))}, None, None)) for _ in range(2)
    ]
    for _ in range(1000):  # until the first request's lone re-run holds the instance
        if sizes == [2, 1]:
            break
        await asyncio.sleep(0.005)
    assert sizes == [2, 1]
    timer = threading.Timer(0.05, release.set)  # stop() waits for the thread, holding the loop
    timer.start()
    await s.stop()
    answers = await asyncio.wait_for(asyncio.gather(*requests, return_exceptions=True), 5)
    timer.join()
    assert [type(a) for a in answers] == [ServerBusy, ServerBusy], answers
    assert "model 'm' is shutting down" in str(answers[1])


async def test_an_unprepared_request_is_batched_alone_and_others_batch_on() -> None:
    release, run = _blocking()
    sizes: list[int] = []

    def tracking(batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        sizes.append(batch["x"].shape[0])
        return run(batch)

    s = scheduler(tracking, max_queue_delay_s=0.05)
    s.start()
    first = asyncio.ensure_future(s.submit({"x": np.zeros((1, 1))}, None, None))
    await busy(s)
    lone = asyncio.ensure_future(s.submit(lambda: {"x": np.ones((1, 1))}, None, None))
    others = [
        asyncio.ensure_future(s.submit({"x": np.full((1, 1), 2.0)}, None, None)) for _ in range(3)
    ]
    await asyncio.sleep(0)
    release.set()
    await asyncio.gather(first, lone, *others)
    await s.stop()
    result = sizes
    assert result == [1, 1, 3]


async def test_an_unprepared_request_that_cannot_be_prepared_gets_its_own_error() -> None:
    def bad_image() -> dict[str, np.ndarray]:
        raise InvalidInput("cannot decode image (3 bytes)")

    def bug() -> dict[str, np.ndarray]:
        raise ValueError("image.convert ran out of memory")  # a bug, not the device's OOM

    s = scheduler(lambda batch: {"y": batch["x"]})
    s.start()
    with pytest.raises(InvalidInput, match="cannot decode image"):
        await s.submit(bad_image, None, None)
    with pytest.raises(ValueError, match="image.convert"):
        await s.submit(bug, None, None)
    ok = await s.submit(lambda: {"x": np.ones((1, 1), np.float32)}, None, None)
    np.testing.assert_array_equal(ok["y"], [[1.0]])
    await s.stop()
    result = s.stats
    stats = result
    assert stats.execution_count == 1  # the failed preparations ran no model
    assert stats.out_of_memory_count == 0


async def test_adaptive_a_request_alone_runs_at_once() -> None:
    """Nothing else on its way: no wait, even with a long adaptive bound."""
    sizes: list[int] = []
    s = scheduler(doubling(sizes), adaptive=True, max_queue_delay_s=30.0)
    s.arriving = lambda: 0
    s.start()
    x = np.ones((1, 2), np.float32)
    answer = await asyncio.wait_for(s.submit({"x": x}, None, None), 10)  # not the 30 s bound
    np.testing.assert_array_equal(answer["y"], x * 2)
    await s.stop()
    assert sizes == [1]


async def test_adaptive_a_batch_waits_for_the_requests_on_their_way() -> None:
    """Two more requests accepted but not queued yet: the first waits for them and the three
    run as one batch, at once when the last arrives (not after the 30 s bound)."""
    sizes: list[int] = []
    coming = [2]
    s = scheduler(doubling(sizes), adaptive=True, max_queue_delay_s=30.0)
    s.arriving = lambda: coming[0]
    s.start()
    x = np.ones((1, 2), np.float32)
    first = asyncio.ensure_future(s.submit({"x": x}, None, None))
    for _ in range(5):  # the instance is free and has looked at the queue meanwhile
        await asyncio.sleep(0)
    assert sizes == [] and not first.done()
    coming[0] = 0  # both queue in the next turn of the loop, before the instance looks again
    second = asyncio.ensure_future(s.submit({"x": x}, None, None))
    third = asyncio.ensure_future(s.submit({"x": x}, None, None))
    await asyncio.wait_for(asyncio.gather(first, second, third), 10)
    await s.stop()
    assert sizes == [3]


async def test_adaptive_waits_at_most_its_bound_for_a_request_that_never_comes() -> None:
    """An accepted request that fails before the queue (a 400) is not waited for forever."""
    sizes: list[int] = []
    s = scheduler(doubling(sizes), adaptive=True, max_queue_delay_s=0.05)
    s.arriving = lambda: 1
    s.start()
    x = np.ones((1, 2), np.float32)
    await asyncio.wait_for(s.submit({"x": x}, None, None), 10)
    await s.stop()
    assert sizes == [1]


async def test_an_oversize_request_s_queue_time_is_its_wait_not_the_sum_of_its_chunks() -> None:
    """Issue #28, finding 24: the chunks of one request wait at once; the access log's
    queue_ms summed their waits (959 s for a request of 17 s)."""
    from service.batching.stats import RequestTiming

    def slow(batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        time.sleep(0.05)  # each chunk waits for the ones before it
        return {"y": batch["x"]}

    s = scheduler(slow, max_batch_size=2)
    s.start()
    timing = RequestTiming()
    began = time.perf_counter_ns()
    await s.submit({"x": np.zeros((8, 2), np.float32)}, timing, None)
    elapsed = time.perf_counter_ns() - began
    await s.stop()
    assert 0 < timing.queue_ns <= elapsed
    assert timing.compute_infer_ns <= elapsed


async def test_a_request_arriving_during_a_large_one_runs_before_the_large_one_ends() -> None:
    """#28 finding 7: every chunk of a large request was queued at once, so a request behind
    it waited for all of them (1,024 texts held minilm for 64 s). Chunks now queue in turn."""
    order: list[int] = []
    s = scheduler(slow_doubling(order, 0.05), max_batch_size=2, max_queue_delay_s=0.0)
    s.start()
    x = np.arange(16, dtype=np.float32).reshape(8, 2)
    large = asyncio.ensure_future(s.submit({"x": x}, None, None))
    await busy(s)
    small = asyncio.ensure_future(s.submit({"x": np.ones((1, 2), np.float32)}, None, None))
    done, _ = await asyncio.wait({large, small}, return_when=asyncio.FIRST_COMPLETED)
    assert small in done and not large.done()
    np.testing.assert_array_equal((await large)["y"], x * 2)  # whole, in order
    await s.stop()
    assert sum(order) == 9


async def test_the_chunks_of_a_failed_large_request_are_not_run() -> None:
    runs: list[int] = []

    def failing(batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        runs.append(batch["x"].shape[0])
        time.sleep(0.01)
        raise RuntimeError("the model broke")

    s = scheduler(failing, max_batch_size=2)
    s.start()
    with pytest.raises((InvalidInput, ModelExecutionError)):
        await s.submit({"x": np.zeros((8, 2), np.float32)}, None, None)
    await asyncio.sleep(0.1)
    await s.stop()
    assert runs.count(2) <= 2  # the first chunk (and its run alone), never the other three


async def test_a_large_request_that_cannot_start_its_last_chunk_in_time_stops_early() -> None:
    """#28 finding 7: each chunk had to start before the request's deadline, so a request
    whose chunks could never all start in time ran until the deadline passed, then failed 504:
    the model's time spent on an answer nobody would get. Once the pace of its chunks shows
    that its last one would start past the deadline, the rest are not run."""
    runs: list[int] = []
    s = scheduler(slow_doubling(runs, 0.1), max_batch_size=2, max_queue_delay_s=0.0)
    s.start()
    deadline = time.monotonic() + 0.45  # 4 or 5 chunks of 10 could start in time
    with pytest.raises(DeadlineExceeded) as stopped:
        await s.submit({"x": np.zeros((20, 2), np.float32)}, None, deadline)
    assert "past its deadline" in stopped.value.message
    assert "10 chunks" in stopped.value.message
    await s.stop()
    assert len(runs) <= 2, runs  # the old code ran 5, then answered 504 all the same


def threads_of(
    names: list[str], seconds: list[float]
) -> Callable[[dict[str, np.ndarray]], dict[str, np.ndarray]]:
    """A model that notes the thread each batch runs on, and computes for ``seconds[0]`` (a
    busy loop), or waits for ``-seconds[0]`` (a sleep: a run preempted, slow but not costly);
    the test changes it between batches."""

    def run(batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        names.append(threading.current_thread().name)
        if seconds[0] < 0:
            time.sleep(-seconds[0])
        end = time.thread_time() + seconds[0]  # this thread's CPU: as much on a busy machine
        while time.thread_time() < end:
            pass
        return {"y": batch["x"] * 2}

    return run


async def test_a_batch_measured_brief_runs_on_the_event_loop_and_a_new_shape_on_its_instance() -> (
    None
):
    """Handing a batch to its instance's thread and back cost a lone request of a small model
    more than its run: a batch whose shape ran briefly before runs on the loop's own thread.
    A shape never run yet (a thousand rows, or rows of another width) and a request its
    instance prepares go to the instance's thread; so does every batch with the bound at 0."""
    names: list[str] = []
    loop_thread, instance = threading.current_thread().name, "m-instance-0_0"
    s = scheduler(threads_of(names, [0.0]), max_batch_size=1024, inline_run_ns=10**9)
    s.start()
    for rows, width in ((1, 2), (1, 2), (1, 2), (1000, 2), (1000, 2), (1, 7), (1, 7)):
        x = np.ones((rows, width), np.float32)
        np.testing.assert_array_equal((await s.submit({"x": x}, None, None))["y"], x * 2)

    def prepare() -> dict[str, np.ndarray]:
        return {"x": np.ones((1, 2), np.float32)}

    await s.submit(prepare, None, None)
    await s.stop()
    assert names == [instance, loop_thread, loop_thread] + [instance, loop_thread] * 2 + [instance]

    names.clear()
    s = scheduler(threads_of(names, [0.0]), inline_run_ns=0)
    s.start()
    for _ in range(3):
        await s.submit({"x": np.ones((1, 2), np.float32)}, None, None)
    await s.stop()
    assert names == [instance] * 3


async def test_strings_and_several_instances_never_run_on_the_loop() -> None:
    """A string input's cost is its strings', not its shape's; several instances are asked for
    to run batches side by side: neither is run on the loop, however brief."""
    names: list[str] = []
    s = scheduler(threads_of(names, [0.0]), inline_run_ns=10**9)
    s.start()
    for _ in range(3):
        await s.submit({"x": np.array([[b"a", b"b"]], dtype=object)}, None, None)
    await s.stop()
    assert set(names) == {"m-instance-0_0"}

    names.clear()
    s = scheduler(threads_of(names, [0.0]), inline_run_ns=10**9, instances=2)
    s.start()
    for _ in range(3):
        await s.submit({"x": np.ones((1, 2), np.float32)}, None, None)
    await s.stop()
    assert all(name.startswith("m-instance-") for name in names) and len(names) == 3


async def test_a_shape_whose_runs_grow_slow_goes_back_to_its_instance_thread() -> None:
    """The loop is never held long: one slow run (a preemption) does not move a shape's
    estimate, three of the last five do, and the next batches of that shape go to the
    instance's thread until their runs are brief again; a shape that once runs ten times past
    the bound on its thread's CPU (its cost follows its values) stays on the instance's thread
    for good, while a run as long but asleep (preempted by the machine's other work) does
    not bar it."""
    names: list[str] = []
    seconds = [0.0]
    loop_thread, instance = threading.current_thread().name, "m-instance-0_0"
    s = scheduler(threads_of(names, seconds), inline_run_ns=20_000_000)  # 20 ms
    s.start()
    x = {"x": np.ones((1, 2), np.float32)}
    for slow in (0.0, 0.0, 0.05, 0.0, 0.05, 0.05, 0.0, 0.0, 0.0, 0.0):
        seconds[0] = slow
        await s.submit(x, None, None)
    assert names == [instance] + [loop_thread] * 5 + [instance, instance, loop_thread, loop_thread]
    names.clear()
    for slow in (-0.25, 0.0, 0.25, 0.0, 0.0, 0.0):  # 250 ms: ten times the bound, asleep, then busy
        seconds[0] = slow
        await s.submit(x, None, None)
    await s.stop()
    assert names == [loop_thread] * 3 + [instance] * 3
