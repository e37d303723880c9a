"""Dynamic batching: one scheduler per model version, a bounded queue, N instance workers.

Batch formation is pure (:func:`plan`, :func:`collate`, :func:`split`), so tests can drive it
exhaustively with plain lists; :class:`Scheduler` only adds the asyncio plumbing around it.

Rules, after Triton's dynamic batcher:
- a batch holds requests whose non-batch shapes and dtypes match the oldest request's, and at
  most ``max_batch_size`` rows (the sum of the requests' batch dims);
- it runs at once when it is full, or has reached a preferred size; otherwise it waits up to
  ``max_queue_delay`` after its oldest request arrived, then runs with what it has. Adaptive
  (the default, :data:`ADAPTIVE_DELAY_S`): it waits only while requests the model has accepted
  are still on their way to the queue (being read, decoded, preprocessed), so that a request
  alone never waits and a burst is batched as one;
- a request past its deadline is answered 504 before it runs; a cancelled one is dropped;
- a request with more rows than ``max_batch_size`` is split into chunks and reassembled, the
  chunks queued one per instance at a time so that other requests interleave with them, and
  stopped (504) once their pace shows that the last could not start before the deadline;
- a batch of several requests that fails (other than out of memory) runs again one request at
  a time, so that one bad input fails only its own request (:meth:`Scheduler._isolate`).

A request may come unprepared: ``work`` is then a function that makes its inputs, and the
instance's own thread calls it before running the model. The caller does this only for a request
alone in flight for its version, which nothing could batch with: it runs at once, alone, and
crosses threads once instead of three times (loop → preprocessing pool → loop → instance).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import time
from collections import deque
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from typing import Protocol, TypeVar

import numpy as np

from service.batching.stats import BatchRun, BatchTrace, ModelStats, RequestTiming
from service.errors import (
    DeadlineExceeded,
    InvalidInput,
    ModelExecutionError,
    ModelNotReady,
    PayloadTooLarge,
    ServerBusy,
    TensorgateError,
)
from service.resources import CPU_USE

log = logging.getLogger("tensorgate.scheduler")

Batch = dict[str, np.ndarray]
Work = Batch | Callable[[], Batch]
"""A request's inputs, or a function that makes them on the instance's thread."""
ShapeKey = tuple[tuple[str, str, tuple[int, ...]], ...]
Answers = Callable[[], None]
"""What answers the requests of a batch that ran, each with its part of the outputs."""
T = TypeVar("T")
ALONE: ShapeKey = (("", "unprepared", ()),)
"""The key of an unprepared request: no other request shares it, so it is batched alone."""


BatchShape = tuple[tuple[str, tuple[int, ...]], ...]

ADAPTIVE_DELAY_S = 0.002
"""The most an adaptive batch waits for requests still on their way (docs/performance.md,
"Defaults that win": the delay that served the most at 64 connections)."""
PACE_SLACK = 0.8
"""An oversize request is stopped early only if its last chunk would start past the deadline
even at 1.25 times the pace of its chunks so far: the pace includes queueing behind others,
which may ease."""


def batch_shape(batch: Mapping[str, np.ndarray]) -> BatchShape:
    """The full shapes of a batch's inputs: what a runtime may compile for."""
    return tuple(sorted((name, tuple(array.shape)) for name, array in batch.items()))


def pad_rows(batch: Batch, rows: int, sizes: Sequence[int]) -> Batch:
    """Pad ``rows`` up to the smallest of ``sizes`` that holds them (repeating the last row)."""
    target = min((s for s in sizes if s >= rows), default=rows)
    if target == rows:
        return batch
    return {
        name: np.concatenate([array, np.repeat(array[-1:], target - rows, axis=0)])
        for name, array in batch.items()
    }


def shape_key(inputs: Mapping[str, np.ndarray], batched: bool) -> ShapeKey:
    """What must match for two requests to share a batch: names, dtypes, non-batch shapes."""
    return tuple(
        (name, array.dtype.str, array.shape[1:] if batched else array.shape)
        for name, array in sorted(inputs.items())
    )


@dataclass(eq=False)
class Pending:
    """One request (or one chunk of an oversize request) waiting in the queue."""

    work: Work
    rows: int
    key: ShapeKey
    enqueued: float
    deadline: float | None
    future: asyncio.Future[Batch]
    timing: RequestTiming | None = None

    @property
    def dropped(self) -> bool:
        return self.future.done()  # cancelled (client gone) or already answered


@dataclass(frozen=True, slots=True)
class Plan:
    """Run the first ``take`` queued requests of the head's group now, or wait ``wait_s``."""

    take: tuple[int, ...] = ()
    wait_s: float | None = None


def plan(
    queue: Sequence[tuple[int, ShapeKey, float]],
    max_rows: int,
    preferred: Sequence[int],
    max_delay_s: float,
    now: float,
) -> Plan:
    """Decide the next batch from ``(rows, key, enqueued)`` entries, oldest first.

    Returns the indices to take (all sharing the oldest entry's key, FIFO within it), or how
    long to wait for more. ``max_rows`` 0 means the model takes no batch: one at a time.
    With preferred sizes, as in Triton, a batch grows to the largest preferred size at most
    (a larger one is slower per row, or there would be no reason to prefer it); a request
    larger than that still runs, alone.
    """
    if not queue:
        return Plan(wait_s=None)
    _, head_key, head_enqueued = queue[0]
    if max_rows == 0 or head_key == ALONE:
        return Plan(take=(0,))
    cap = min(max(preferred), max_rows) if preferred else max_rows
    if queue[0][0] > cap:
        return Plan(take=(0,))
    group: list[int] = []
    rows = 0
    for index, (count, key, _) in enumerate(queue):
        if key != head_key:
            continue
        if rows + count > cap:
            break
        group.append(index)
        rows += count
    if rows >= cap:
        return Plan(take=tuple(group))
    target = _preferred_cut(group, queue, preferred)
    if target is not None:
        return Plan(take=target)
    waited = now - head_enqueued
    if waited >= max_delay_s:
        return Plan(take=tuple(group))
    return Plan(wait_s=max_delay_s - waited)


def _preferred_cut(
    group: list[int], queue: Sequence[tuple[int, ShapeKey, float]], preferred: Sequence[int]
) -> tuple[int, ...] | None:
    """The longest prefix of ``group`` whose rows are a preferred size: Triton runs it at once."""
    if not preferred:
        return None
    rows = 0
    best: tuple[int, ...] | None = None
    for position, index in enumerate(group):
        rows += queue[index][0]
        if rows in preferred:
            best = tuple(group[: position + 1])
    return best


def collate(items: Sequence[Pending]) -> Batch:
    """Concatenate requests' inputs along the batch dim (an unprepared one, always alone, makes
    its own here: on the instance's thread)."""
    if len(items) == 1:
        work = items[0].work
        return work() if callable(work) else work
    inputs: list[Batch] = []
    for p in items:
        assert isinstance(p.work, dict), "unprepared requests are batched alone"
        inputs.append(p.work)
    return {name: np.concatenate([i[name] for i in inputs]) for name in inputs[0]}


def split(outputs: Mapping[str, np.ndarray], rows: Sequence[int], model: str) -> list[Batch]:
    """Cut a batch's outputs back into one dict per request; every output must have the rows."""
    total = sum(rows)
    for name, array in outputs.items():
        if array.ndim == 0 or array.shape[0] != total:
            got = array.shape[0] if array.ndim else 0
            raise ModelExecutionError(
                f"model '{model}' returned {got} rows of output '{name}' for a batch of {total} "
                "(batch size mismatch)"
            )
    if len(rows) == 1:
        return [dict(outputs)]
    parts = []
    offset = 0
    for count in rows:
        parts.append({name: array[offset : offset + count] for name, array in outputs.items()})
        offset += count
    return parts


@dataclass
class SchedulerConfig:
    max_batch_size: int
    preferred_batch_sizes: tuple[int, ...] = ()
    max_queue_delay_s: float = 0.0
    adaptive: bool = False
    """Wait (up to ``max_queue_delay_s``) only while ``Scheduler.arriving`` says requests are on
    their way; else run what is queued at once."""
    max_queue_size: int = 256
    instances: int = 1
    pad_to: tuple[int, ...] = ()
    """Warmed batch sizes to pad each batch's rows up to (empty: no padding)."""
    inline_run_ns: int = 0
    """A batch of tensors whose run is expected to take at most this long runs on the event
    loop's thread (:class:`RunTimes`); 0: every batch on its instance's thread."""


class RunTimes:
    """How long a model's batches ran lately, by their shape (the inputs' non-batch dims and
    dtypes, and the rows to a power of two), for the batches
    :attr:`SchedulerConfig.inline_run_ns` keeps on the event loop.

    Handing a batch to its instance's thread and its outputs back wakes that thread and then
    the loop: on the 2-CPU machine that cost a lone request of the W2 MLP more CPU (about
    130 µs) than its whole model run (12 µs), and a third of its throughput at one connection
    (docs/performance.md, "Small batches on the loop"). Kept only for what is measured to run
    briefly, so that the loop is never held long: a shape not run yet goes to the instance's
    thread; the estimate is the median of the shape's last :data:`KEPT` runs, so one run
    slowed by the machine (a preemption) does not move it and a shape whose runs grew slow goes
    back within three; a shape that once ran :data:`FAR` times past the bound on its thread's CPU
    (its cost follows its values, not its shape) stays on the instance's thread for good."""

    KEPT = 5
    FAR = 10

    __slots__ = ("_never", "_runs")

    def __init__(self) -> None:
        self._runs: dict[Hashable, deque[int]] = {}
        self._never: set[Hashable] = set()

    def expected_ns(self, key: Hashable) -> int | None:
        """The estimate for a batch of shape ``key``; None before one of it has run, or once
        one ran far past the bound."""
        runs = self._runs.get(key)
        return None if runs is None else sorted(runs)[len(runs) // 2]

    def record(self, key: Hashable, ns: int, thread_ns: int, bound_ns: int) -> None:
        """A run of a batch of shape ``key`` took ``ns``, ``thread_ns`` of them on the CPU of
        the thread that ran it (a run preempted for a few ms of the machine's other work is
        slow, not costly: it is not barred); ``bound_ns``: the loop's bound."""
        if key in self._never:
            return
        if min(ns, thread_ns) > self.FAR * bound_ns:
            self._never.add(key)
            self._runs.pop(key, None)
        elif (runs := self._runs.get(key)) is not None:
            runs.append(ns)
        else:
            self._runs[key] = deque([ns], maxlen=self.KEPT)


class Instance:
    """One model instance: its own thread, its runtime's ``run``, and since when it has been
    running a batch (liveness and the metrics ask, through :meth:`busy_for`)."""

    def __init__(self, model: str, index: int, run: Callable[[Batch], dict[str, np.ndarray]]):
        self.index = index
        self.run = run
        self.executor = ThreadPoolExecutor(1, thread_name_prefix=f"{model}-instance-{index}")
        self._busy_since: float | None = None

    def busy_for(self, now: float) -> float | None:
        """Seconds the current batch has run, or None when idle."""
        since = self._busy_since
        return None if since is None else now - since

    def infer(self, batch: Batch) -> tuple[dict[str, np.ndarray], float, int]:
        """Run one batch on the calling thread (the instance's): outputs, when it started
        (monotonic) and how long it took (ns)."""
        started = time.monotonic()
        self._busy_since = started
        clock = time.perf_counter_ns()
        try:
            with CPU_USE:  # the runtimes ask it whether this batch runs beside another
                outputs = self.run(batch)
            return outputs, started, time.perf_counter_ns() - clock
        finally:
            self._busy_since = None


class BatchBudget(Protocol):
    """Where a batch's concatenated inputs and its outputs are held
    (:class:`service.limits.admission.BytesBudget`)."""

    def try_take(self, size: int) -> bool: ...

    def release(self, size: int) -> None: ...

    def hold_while_alive(self, arrays: Iterable[np.ndarray]) -> None: ...


@dataclass(eq=False)
class Scheduler:
    """The queue and instance workers of one model version."""

    model: str
    config: SchedulerConfig
    runs: Sequence[Callable[[Batch], dict[str, np.ndarray]]]
    """One callable per instance (its runtime's ``run``: its own device and stream on CUDA)."""
    stats: ModelStats
    warmed: set[BatchShape] | None = None
    """Shapes run at warmup; a batch of another shape is counted in stats.unwarmed."""
    replay: Callable[[Callable[[Batch], dict[str, np.ndarray]]], str | None] | None = None
    """Replays the golden pairs through an instance's run: None when it still answers them as
    exported, else why not. The evidence that tells, after a request fails alone, the
    client's fault (400) from the model's (500); None without golden pairs (always 500)."""
    on_broken: Callable[[str], None] | None = None
    """Called with the reason when the replay shows the model itself broken."""
    devices: Sequence[str] = ()
    """Each instance's device (traces name it)."""
    arriving: Callable[[], int] | None = None
    """Requests accepted for the model that have not reached this queue yet (the adaptive
    delay waits for them)."""
    budget: BatchBudget | None = None
    """The server's budget: a batch of several requests holds its concatenation there while
    it runs; when that does not fit, its requests run one at a time, uncopied (#28 finding
    15: 7 same-shape requests of 61 MiB to a model with dynamic dims made a 427 MiB batch
    beside their bodies, counted nowhere). A batch's outputs are held there for as long as
    they live."""
    queue: deque[Pending] = field(default_factory=deque)
    instances: list[Instance] = field(default_factory=list)
    _arrived: asyncio.Event = field(default_factory=asyncio.Event)
    _workers: list[asyncio.Task[None]] = field(default_factory=list)
    _warned: set[BatchShape] = field(default_factory=set)
    _broken: str | None = None
    """Why the model failed its golden replay: from then on no batch runs on it."""
    _run_times: RunTimes = field(default_factory=RunTimes)

    def start(self) -> None:
        for index in range(self.config.instances):
            instance = Instance(self.model, index, self.runs[index])
            self.instances.append(instance)
            self._workers.append(asyncio.create_task(self._worker(instance)))

    @property
    def pending(self) -> int:
        """Requests queued, not yet running."""
        return len(self.queue)

    def busy_instances(self) -> int:
        """Instances running a batch now."""
        now = time.monotonic()
        return sum(i.busy_for(now) is not None for i in self.instances)

    def longest_running(self) -> tuple[int, float] | None:
        """The instance whose current batch has run longest, and for how many seconds."""
        now = time.monotonic()
        running = [(i.index, t) for i in self.instances if (t := i.busy_for(now)) is not None]
        return max(running, key=lambda pair: pair[1], default=None)

    async def submit(
        self, work: Work, timing: RequestTiming | None, deadline: float | None
    ) -> dict[str, np.ndarray]:
        """Queue one request (its inputs, or a function that makes one row of them); its
        outputs once the batch it joined has run. A request of more rows than max_batch_size
        runs as chunks, queued in turn (see :meth:`_in_turn`)."""
        batched = self.config.max_batch_size > 0
        if callable(work):
            chunks: list[Work] = [work]
            rows, key = 1, ALONE
        else:
            rows, key = rows_of(work, batched), shape_key(work, batched)
            limit = self.config.max_batch_size
            chunks = [work] if not batched or rows <= limit else [*_chunks(work, rows, limit)]
        window = min(len(chunks), max(1, len(self.instances)))
        if len(self.queue) + window > self.config.max_queue_size:
            raise ServerBusy(
                f"model '{self.model}' has {len(self.queue)} requests queued (limit "
                f"{self.config.max_queue_size}); retry shortly"
            )
        if len(chunks) > 1:
            return await self._in_turn(chunks, key, window, deadline, timing)
        pending = self._enqueue(work, rows, key, deadline, timing)
        try:
            return await pending.future
        except asyncio.CancelledError:
            pending.future.cancel()  # the client went away: drop it if it has not run
            raise

    def _enqueue(
        self,
        work: Work,
        rows: int,
        key: ShapeKey,
        deadline: float | None,
        timing: RequestTiming | None,
    ) -> Pending:
        loop = asyncio.get_running_loop()
        pending = Pending(work, rows, key, time.monotonic(), deadline, loop.create_future(), timing)
        self.queue.append(pending)
        self._arrived.set()
        return pending

    async def _in_turn(
        self,
        chunks: list[Work],
        key: ShapeKey,
        window: int,
        deadline: float | None,
        timing: RequestTiming | None,
    ) -> dict[str, np.ndarray]:
        """An oversize request's chunks, at most ``window`` (one per instance) queued or
        running at once: the next joins the queue behind whatever arrived meanwhile, so other
        requests interleave with a large one instead of waiting for all of it (#28 finding 7:
        1,024 texts held minilm for 64 s). Once a chunk fails (504 past the deadline, or any
        error), or the pace of those answered shows that the last could not start before the
        deadline (:meth:`_in_time`), the chunks not yet run are dropped: no work for an answer
        that cannot be given."""
        batched = self.config.max_batch_size > 0
        results: list[dict[str, np.ndarray]] = []
        queued: deque[Pending] = deque()
        started = time.monotonic()
        try:
            for index, chunk in enumerate(chunks):
                if len(queued) >= window:
                    results.append(await queued.popleft().future)
                    if deadline is not None:
                        self._in_time(len(chunks), index, len(results), started, deadline)
                rows = rows_of(chunk, batched)  # type: ignore[arg-type]  # chunks are batches
                queued.append(self._enqueue(chunk, rows, key, deadline, timing))
            while queued:
                results.append(await queued.popleft().future)
        except BaseException:
            for p in queued:
                p.future.cancel()  # not run yet: dropped
            raise
        return {name: np.concatenate([r[name] for r in results]) for name in results[0]}

    def _in_time(self, total: int, next_: int, done: int, started: float, deadline: float) -> None:
        """504 for an oversize request whose last chunk would start past ``deadline`` at the
        pace its ``done`` answered chunks kept since ``started`` (queueing behind other requests
        included), even :data:`PACE_SLACK` times faster; ``next_``: the index of the chunk about
        to be queued."""
        now = time.monotonic()
        pace = (now - started) / done
        last_start = now + (total - 1 - next_) * pace * PACE_SLACK
        if last_start > deadline:
            raise DeadlineExceeded(
                f"model '{self.model}': the request runs as {total} chunks of at most "
                f"{self.config.max_batch_size} rows, {done} answered at {pace * 1000:.0f} ms "
                f"each; its last would start about {last_start - deadline:.1f} s past its "
                "deadline, so the rest were not run (send fewer rows a request, or a longer "
                "timeout)"
            )

    async def _worker(self, instance: Instance) -> None:
        while True:
            await self._execute(instance, await self._next_batch())

    async def _next_batch(self) -> list[Pending]:
        while True:
            self._expire(time.monotonic())
            entries = [(p.rows, p.key, p.enqueued) for p in self.queue]
            config = self.config
            delay = config.max_queue_delay_s
            if config.adaptive and (self.arriving is None or self.arriving() == 0):
                delay = 0.0  # nobody else is coming: run what is here
            decision = plan(
                entries,
                config.max_batch_size,
                config.preferred_batch_sizes,
                delay,
                time.monotonic(),
            )
            if decision.take:
                chosen = [self.queue[i] for i in decision.take]
                for index in sorted(decision.take, reverse=True):
                    del self.queue[index]
                return chosen
            self._arrived.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._arrived.wait(), decision.wait_s)

    def _expire(self, now: float) -> None:
        """Drop cancelled requests; answer 504 to those past their deadline."""
        if not any(p.dropped or (p.deadline is not None and now > p.deadline) for p in self.queue):
            return
        kept: deque[Pending] = deque()
        for p in self.queue:
            if p.dropped:
                continue
            if p.deadline is not None and now > p.deadline:
                waited = now - p.enqueued
                p.future.set_exception(
                    DeadlineExceeded(
                        f"model '{self.model}': the request waited {waited * 1000:.0f} ms in the "
                        "queue, past its deadline, and was not run"
                    )
                )
                continue
            kept.append(p)
        self.queue = kept

    async def _execute(
        self,
        instance: Instance,
        items: list[Pending],
        failures: list[tuple[Pending, Exception]] | None = None,
    ) -> None:
        """Run ``items`` as one batch on ``instance`` and answer each. With ``failures``, a
        model error is recorded there instead of answered."""
        if self._broken is not None:  # queued before the verdict, or after: none runs on it
            _fail(items, ModelNotReady(f"model '{self.model}' is broken: {self._broken}"))
            return
        budget, held = self.budget, 0
        if len(items) > 1 and budget is not None:
            held = sum(a.nbytes for p in items if isinstance(p.work, dict) for a in p.work.values())
            if not budget.try_take(held):
                for p in items:
                    if not p.future.done():
                        await self._execute(instance, [p], failures)
                return
        try:
            await self._run_batch(instance, items, failures)
        finally:
            if held and budget is not None:
                budget.release(held)

    async def _run_batch(
        self,
        instance: Instance,
        items: list[Pending],
        failures: list[tuple[Pending, Exception]] | None,
    ) -> None:
        rows = sum(p.rows for p in items)
        padded = bool(self.config.pad_to) and self.config.max_batch_size > 0

        def work() -> tuple[dict[str, np.ndarray], float, int, int, float, int]:
            begun = time.monotonic()
            try:
                batch = collate(items)
            except TensorgateError:
                raise
            except Exception as exc:  # an unprepared request's own failure, never the model's
                raise _PreparationFailed(exc) from exc
            prepared_ns = time.perf_counter_ns()
            if padded:
                batch = pad_rows(batch, rows, self.config.pad_to)
            self._check_warmed(batch, items)
            thread_ns = time.thread_time_ns()  # this thread's CPU: a preemption is not the run's
            outputs, started, infer_ns = instance.infer(batch)
            return outputs, started, infer_ns, prepared_ns, begun, time.thread_time_ns() - thread_ns

        # On the loop only with one instance (several are asked for to run batches side by
        # side), for tensors none of which are strings (their cost is not their shape's). A
        # batch is tensors throughout or one unprepared request (its key is ALONE).
        shape: Hashable | None = None
        inline = False
        config = self.config
        first = items[0].work
        if (
            config.inline_run_ns
            and config.instances == 1
            and isinstance(first, dict)
            and not any(array.dtype == object for array in first.values())
        ):
            shape = (items[0].key, rows.bit_length())
            expected = self._run_times.expected_ns(shape)
            inline = expected is not None and expected <= config.inline_run_ns

        def settle(ran: tuple[dict[str, np.ndarray], float, int, int, float, int]) -> Answers:
            """The batch's outputs cut into each request's (raising a model's error), and what
            answers them."""
            outputs, started, infer_ns, prepared_ns, begun, thread_ns = ran
            if self.budget is not None:
                self.budget.hold_while_alive(outputs.values())
            if shape is not None:
                self._run_times.record(shape, infer_ns, thread_ns, config.inline_run_ns)
            if padded:
                outputs = {name: array[:rows] for name, array in outputs.items()}
            if config.max_batch_size == 0:  # no batch dimension: one request, whole
                parts = [dict(outputs)]
            else:
                parts = split(outputs, [p.rows for p in items], self.model)
            index = instance.index
            device = self.devices[index] if index < len(self.devices) else ""
            run = BatchRun(
                self.model, index, device, rows, len(items), begun, prepared_ns, started, infer_ns
            )
            return partial(self._answer, items, parts, run)

        def orphaned(exc: BaseException) -> None:
            """The batch failed after its worker was cancelled (``stop``): nobody is left to
            judge or retry it, so its requests get the error at once."""
            _fail(items, self._orphan_error(exc))

        try:
            if inline:
                settle(work())()
            else:
                await self._on_thread(instance, work, settle, orphaned)
        except _PreparationFailed as failed:
            _fail(items, failed.error)
        except TensorgateError as exc:
            _fail(items, exc)
        except Exception as exc:
            try:
                if is_out_of_memory(exc):
                    await self._after_oom(instance, items)
                elif failures is not None:
                    failures.extend((p, exc) for p in items)
                elif len(items) > 1:
                    await self._isolate(instance, items, exc)
                else:
                    _fail(items, await self._judge(instance, exc))
            except asyncio.CancelledError:  # stop() meanwhile: what was not answered never will
                _fail(items, ServerBusy(f"model '{self.model}' is shutting down"))
                raise

    async def _on_thread(
        self,
        instance: Instance,
        work: Callable[[], T],
        settle: Callable[[T], Answers],
        orphaned: Callable[[BaseException], None],
    ) -> None:
        """``work()`` on the instance's thread, its result settled on the loop in the very
        callback that wakes the loop: the requests' tasks are ready one turn of the loop sooner
        than through an awaited future (``run_in_executor``), where this worker resumed first and
        answered them in its own turn. With nothing queued they also run before this worker
        looks for the next batch (a lone request waited for that: 30 µs, docs/performance.md);
        with requests queued this worker goes first, handing the instance its next batch before
        any answer is written. An error, of ``work`` or of ``settle``, is raised here; once
        this worker was cancelled, it goes to ``orphaned``."""
        loop = asyncio.get_running_loop()
        done: asyncio.Future[None] = loop.create_future()

        def finished(outcome: tuple[T] | BaseException) -> None:
            """On the loop: ``(result,)`` of the work, or what it raised."""
            if isinstance(outcome, BaseException):
                error: BaseException | None = outcome
            else:
                try:
                    answers = settle(outcome[0])
                    error = None
                except BaseException as exc:
                    error = exc
            if error is not None:
                if done.done():  # the worker was cancelled (stop): its requests still wait
                    orphaned(error)
                else:
                    done.set_exception(error)
                return
            queued = bool(self.queue)
            try:
                if not queued:
                    answers()
            finally:  # the worker goes on even if answering failed (the loop logs that)
                if not done.done():  # else the worker was cancelled (stop): answered all the same
                    done.set_result(None)
            if queued:
                answers()

        def on_thread() -> None:
            outcome: tuple[T] | BaseException
            try:
                outcome = (work(),)
            except BaseException as exc:  # every error goes to the worker, as an executor's would
                outcome = exc
            with contextlib.suppress(RuntimeError):  # the loop closed meanwhile: nobody waits
                loop.call_soon_threadsafe(finished, outcome)

        instance.executor.submit(on_thread)
        await done

    def _answer(self, items: list[Pending], parts: list[Batch], run: BatchRun) -> None:
        """Answer each request of a batch that ran (``run``) with its part of the outputs."""
        self.stats.record_execution(run.rows, run.infer_ns)
        traced: list[tuple[BatchTrace, float, bool]] = []
        for p, part in zip(items, parts, strict=True):
            if p.future.done():
                continue
            timing = p.timing
            if timing is not None:
                if callable(p.work):  # made on the instance: no queue, no hand-off
                    timing.compute_input_ns = run.prepared_ns - timing.started_ns
                else:  # the request's wait: until its last chunk started (chunks overlap)
                    timing.queue_ns = max(timing.queue_ns, int((run.started - p.enqueued) * 1e9))
                timing.compute_infer_ns += run.infer_ns
                if timing.trace is not None:
                    traced.append((timing.trace, p.enqueued, callable(p.work)))
            p.future.set_result(part)  # its task resumes after this returns: traced by then
        if traced:
            traced[0][0].batch_ran(run, traced)

    def _check_warmed(self, batch: Batch, items: list[Pending]) -> None:
        """Count the requests of a batch whose shape warmup did not run (on the instance),
        and mark each for its access-log line."""
        if self.warmed is None:
            return
        shape = batch_shape(batch)
        if shape in self.warmed:
            return
        self.stats.record_unwarmed(len(items))
        for p in items:
            if p.timing is not None:
                p.timing.unwarmed = True
        # once per shape (a log line per batch is a cost), for the first 1,000 shapes
        if shape not in self._warned and len(self._warned) < 1000:
            self._warned.add(shape)
            log.warning(
                "model %s met an unwarmed shape %s (logged once per shape; "
                "tensorgate_unwarmed_shape_requests counts every request, and each one's "
                "access-log line says unwarmed_shape)",
                self.model,
                shape,
            )

    async def _isolate(self, instance: Instance, items: list[Pending], error: Exception) -> None:
        """One bad input must not fail the other requests of its batch: run each request
        alone. One that still fails while another of the batch ran gets 400 (its own input is the
        cause); when every one fails, the golden replay decides (:meth:`_judge`)."""
        self.stats.record_isolated()
        log.warning(
            "model %s failed on a batch of %d requests (%s); running each alone",
            self.model,
            len(items),
            error,
        )
        failures: list[tuple[Pending, Exception]] = []
        for p in items:
            if not p.future.done():  # a client that left while its batch ran
                await self._execute(instance, [p], failures=failures)
        ran = any(
            p.future.done() and not p.future.cancelled() and p.future.exception() is None
            for p in items
        )
        if failures and not ran:  # every one failed alone: the model, or every input?
            verdict = await self._judge(instance, failures[0][1])
            if isinstance(verdict, ModelExecutionError):
                _fail([p for p, _ in failures], verdict)
                return
            evidence = "it still answers its golden inputs as exported"
        else:
            evidence = "the other requests of its batch ran"
        for p, exc in failures:
            _fail([p], self._bad_input(exc, evidence))

    async def _judge(self, instance: Instance, exc: Exception) -> TensorgateError:
        """A request failed alone: the client's fault (400) if the instance still answers the
        golden inputs as exported, the model's (500, and the version reported broken) if not
        or if there is no evidence either way."""
        reason: str | None = "no golden pairs to tell the input's fault from the model's"
        if self.replay is not None:
            replay = self.replay
            loop = asyncio.get_running_loop()
            reason = await loop.run_in_executor(instance.executor, replay, instance.run)
            if reason is None:
                return self._bad_input(exc, "it still answers its golden inputs as exported")
            log.error(
                "model %s is broken: it failed on a request alone and then on its "
                "golden inputs (%s)",
                self.model,
                reason,
                exc_info=exc,
            )
            self._broken = f"failed its golden replay after a request failed: {reason}"
            if self.on_broken is not None:
                self.on_broken(self._broken)
        else:
            log.error("model %s failed on a request alone (%s)", self.model, reason, exc_info=exc)
        return ModelExecutionError(f"model '{self.model}' failed: {runtime_message(exc)}")

    def _orphan_error(self, exc: BaseException) -> BaseException:
        """What the requests of a batch that failed while its version stopped are answered: a
        request's own error as it is, else 503 (the version is going; another may serve)."""
        if isinstance(exc, _PreparationFailed):
            return exc.error
        if isinstance(exc, TensorgateError):
            return exc
        log.error("model %s: a batch failed while the version stopped", self.model, exc_info=exc)
        return ServerBusy(
            f"model '{self.model}' is shutting down; its batch failed: {runtime_message(exc)}"
        )

    def _bad_input(self, exc: Exception, evidence: str) -> InvalidInput:
        log.info("model %s failed on one request's input (%s): %s", self.model, evidence, exc)
        return InvalidInput(
            f"model '{self.model}' failed on this request's input ({runtime_message(exc)}); "
            f"{evidence}, so the input is at fault"
        )

    async def _after_oom(self, instance: Instance, items: list[Pending]) -> None:
        """Out of device memory is a per-request error, never a dead server: run the batch again
        in halves, down to single requests; a request that fails alone gets 503 (413 when it
        failed with the device otherwise idle: it can never fit)."""
        self.stats.record_out_of_memory()
        if len(items) > 1:
            half = len(items) // 2
            log.warning(
                "model %s: out of memory on %d requests; retrying in halves", self.model, len(items)
            )
            await self._execute(instance, items[:half])
            await self._execute(instance, items[half:])
            return
        now = time.monotonic()
        others_busy = any(i.busy_for(now) is not None for i in self.instances if i is not instance)
        if others_busy:
            _fail(
                items,
                ServerBusy(
                    f"model '{self.model}': out of device memory for this request while other "
                    "batches ran; retry",
                    retry_after_s=1,
                ),
            )
        else:
            _fail(
                items,
                PayloadTooLarge(
                    f"model '{self.model}': this request ({items[0].rows} rows) does not fit in "
                    "device memory even alone; send fewer rows or smaller inputs"
                ),
            )

    async def stop(self) -> None:
        """Answer what is still queued with 503, stop the workers, release the threads."""
        for p in self.queue:
            if not p.future.done():
                p.future.set_exception(ServerBusy(f"model '{self.model}' is shutting down"))
        self.queue.clear()
        for task in self._workers:
            task.cancel()
        await asyncio.gather(*self._workers, return_exceptions=True)
        for instance in self.instances:
            instance.executor.shutdown(wait=True)


class _PreparationFailed(Exception):
    """An unprepared request's inputs could not be made: its error goes to it as it is (the
    generic 500 for a bug), never taken for the model's (or for out of memory)."""

    def __init__(self, error: Exception) -> None:
        super().__init__(str(error))
        self.error = error


_ORT_NODE = re.compile(r"^.*Status Message:\s*", re.S)  # onnxruntime: the failed node, named
_ORT_STATUS = re.compile(r"\[ONNXRuntimeError\]\s*:\s*\d+\s*:\s*\w+\s*:\s*")
_BACKTRACE = re.compile(  # c10::Error's C++ frames, and the line standing for Python's
    r"^(?:frame #\d+:|Exception raised from |\(<omitting python frames>\)$)"
)
_AOTI_RUN = re.compile(r"\brun_func_\(.*API call failed")
_PATH = re.compile(r"(?:/[\w.+-]+)+/?")  # absolute paths of the runtime's or the model's files


def runtime_message(exc: BaseException) -> str:
    """What a runtime's error says about the input, without its internals: onnxruntime's node
    names and status codes, TorchScript's source excerpts, C++ backtraces (an AOTInductor
    kernel's said only which frame was last), file paths. One line, bounded."""
    text = str(exc)
    text = _ORT_STATUS.sub("", _ORT_NODE.sub("", text))
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    lines = [line for line in lines if not _BACKTRACE.match(line)]
    text = lines[-1] if lines else type(exc).__name__
    if _AOTI_RUN.search(text):  # its own words name only a C++ call and a source line
        text = "the compiled model.pt2 kernel failed on it (its error is in the server log)"
    text = _PATH.sub("…", text)
    return text if len(text) <= 240 else text[:239] + "…"


def is_out_of_memory(exc: BaseException) -> bool:
    """CUDA out of memory from torch (``OutOfMemoryError``) or onnxruntime (its message)."""
    if type(exc).__name__ == "OutOfMemoryError":
        return True
    text = str(exc).lower()
    return "out of memory" in text or "failed to allocate memory" in text


def _fail(items: Sequence[Pending], exc: BaseException) -> None:
    for p in items:
        if not p.future.done():
            p.future.set_exception(exc)


def rows_of(inputs: Batch, batched: bool) -> int:
    """Rows of a batch (1 for a model without a batch dimension)."""
    return int(next(iter(inputs.values())).shape[0]) if batched else 1


def _chunks(inputs: Batch, rows: int, limit: int) -> list[Batch]:
    return [
        {name: array[start : start + limit] for name, array in inputs.items()}
        for start in range(0, rows, limit)
    ]
