"""Dynamic batching: one scheduler per model version, a bounded queue, N instance workers.

Batch formation is pure (:func:`plan`, :func:`collate`, :func:`split`), so tests can drive it
exhaustively with plain lists; :class:`Scheduler` only adds the asyncio plumbing around it.

Rules, after Triton's dynamic batcher:
- a batch holds requests whose non-batch shapes and dtypes match the oldest request's, and at
  most ``max_batch_size`` rows (the sum of the requests' batch dims);
- it runs at once when it is full, or has reached a preferred size; otherwise it waits up to
  ``max_queue_delay`` after its oldest request arrived, then runs with what it has;
- a request past its deadline is answered 504 before it runs; a cancelled one is dropped;
- a request with more rows than ``max_batch_size`` is split into chunks and reassembled;
- a batch of several requests that fails (other than out of memory) runs again one request at
  a time, so that one bad input fails only its own request (:meth:`Scheduler._isolate`).

And one shortcut of its own: a request alone in flight, with nothing queued and an instance
idle, may hand that instance its preprocessing too (:meth:`Scheduler.submit_alone`), so that at
concurrency 1 it crosses threads once instead of three times.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np

from service.errors import (
    DeadlineExceeded,
    InvalidInput,
    ModelExecutionError,
    PayloadTooLarge,
    ServerBusy,
    TensorgateError,
)
from service.stats import ModelStats, RequestTiming

log = logging.getLogger("tensorgate.scheduler")

Batch = dict[str, np.ndarray]
ShapeKey = tuple[tuple[str, str, tuple[int, ...]], ...]


BatchShape = tuple[tuple[str, tuple[int, ...]], ...]


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

    inputs: Batch
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
    if max_rows == 0:
        return Plan(take=(0,))
    _, head_key, head_enqueued = queue[0]
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
    """Concatenate requests' inputs along the batch dim."""
    if len(items) == 1:
        return items[0].inputs
    return {name: np.concatenate([p.inputs[name] for p in items]) for name in items[0].inputs}


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
    max_queue_size: int = 256
    instances: int = 1
    pad_to: tuple[int, ...] = ()
    """Warmed batch sizes to pad each batch's rows up to (empty: no padding)."""


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
    queue: deque[Pending] = field(default_factory=deque)
    _arrived: asyncio.Event = field(default_factory=asyncio.Event)
    _workers: list[asyncio.Task[None]] = field(default_factory=list)
    _executors: list[ThreadPoolExecutor] = field(default_factory=list)
    _warned: set[BatchShape] = field(default_factory=set)
    busy_since: list[float | None] = field(default_factory=list)
    """Per instance: when its current batch started (None when idle); liveness reads it."""
    _committed: list[bool] = field(default_factory=list)
    """Per instance, on the loop: a batch or a lone request has been given to it."""

    def start(self) -> None:
        for instance in range(self.config.instances):
            executor = ThreadPoolExecutor(1, thread_name_prefix=f"{self.model}-instance-{instance}")
            self._executors.append(executor)
            self.busy_since.append(None)
            self._committed.append(False)
            self._workers.append(asyncio.create_task(self._worker(instance, executor)))

    async def submit(
        self, inputs: Batch, timing: RequestTiming | None, deadline: float | None
    ) -> dict[str, np.ndarray]:
        """Queue one request; its outputs once the batch it joined has run."""
        batched = self.config.max_batch_size > 0
        rows = _rows(inputs, batched)
        limit = self.config.max_batch_size
        chunks = [inputs] if not batched or rows <= limit else _chunks(inputs, rows, limit)
        if len(self.queue) + len(chunks) > self.config.max_queue_size:
            raise ServerBusy(
                f"model '{self.model}' has {len(self.queue)} requests queued (limit "
                f"{self.config.max_queue_size}); retry shortly"
            )
        loop = asyncio.get_running_loop()
        now = time.monotonic()
        key = shape_key(inputs, batched)
        pending = [
            Pending(chunk, _rows(chunk, batched), key, now, deadline, loop.create_future(), timing)
            for chunk in chunks
        ]
        self.queue.extend(pending)
        self._arrived.set()
        try:
            results = [await p.future for p in pending]
        except asyncio.CancelledError:
            for p in pending:
                p.future.cancel()  # the client went away: drop what has not run
            raise
        if len(results) == 1:
            return results[0]
        return {name: np.concatenate([r[name] for r in results]) for name in results[0]}

    async def submit_alone(
        self, prepare: Callable[[], Batch], timing: RequestTiming | None
    ) -> dict[str, np.ndarray] | None:
        """Run ``prepare`` (a request's preprocessing, one row) and then the model on an idle
        instance's own thread: one hand-off instead of three (loop → preprocessing pool →
        loop → instance → loop), for a request that has nothing to wait for or to batch with.

        Returns None, having done nothing, when a request is queued or no instance is idle:
        the caller then preprocesses in its pool and submits as usual. No deadline: the request
        starts at once or not at all.
        """
        if self.queue:
            return None
        instance = next((i for i, taken in enumerate(self._committed) if not taken), None)
        if instance is None:
            return None
        loop = asyncio.get_running_loop()
        executor = self._executors[instance]
        pending = Pending({}, 1, (), time.monotonic(), None, loop.create_future(), timing)
        self._committed[instance] = True
        try:
            await self._execute(instance, executor, [pending], prepare)
        except asyncio.CancelledError:
            # The client went away, but the instance's thread may still be on this request:
            # the instance is free once a no-op queued behind it has run.
            try:
                behind = loop.run_in_executor(executor, int)
            except RuntimeError:  # shut down: nothing runs on it any more
                self._release(instance)
            else:
                behind.add_done_callback(lambda _: self._release(instance))
            raise
        self._release(instance)
        return pending.future.result()  # the outputs, or the request's error

    def _release(self, instance: int) -> None:
        """A lone request is done with ``instance``: what queued meanwhile may run on it."""
        self._committed[instance] = False
        self._arrived.set()

    async def _worker(self, instance: int, executor: ThreadPoolExecutor) -> None:
        while True:
            batch = await self._next_batch(instance)
            self._committed[instance] = True
            try:
                await self._execute(instance, executor, batch)
            finally:
                self._committed[instance] = False

    async def _next_batch(self, instance: int) -> list[Pending]:
        while True:
            if self._committed[instance]:  # a lone request runs on it: wait until it is done
                decision = Plan(wait_s=None)
            else:
                self._expire(time.monotonic())
                entries = [(p.rows, p.key, p.enqueued) for p in self.queue]
                decision = plan(
                    entries, self.config.max_batch_size, self.config.preferred_batch_sizes,
                    self.config.max_queue_delay_s, time.monotonic(),
                )  # fmt: skip
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
        instance: int,
        executor: ThreadPoolExecutor,
        items: list[Pending],
        prepare: Callable[[], Batch] | None = None,
        failures: list[tuple[Pending, Exception]] | None = None,
    ) -> None:
        """Run ``items`` as one batch on ``instance`` (or, with ``prepare``, the one lone
        request whose inputs ``prepare`` makes, on the instance's thread) and answer each.
        With ``failures``, a model error is recorded there instead of answered."""
        rows = sum(p.rows for p in items)
        padded = bool(self.config.pad_to) and self.config.max_batch_size > 0

        def work() -> tuple[dict[str, np.ndarray], float, int, int]:
            if prepare is None:
                batch = collate(items)
            else:
                try:
                    batch = prepare()
                except Exception as exc:
                    raise _Unprepared(exc) from exc
            prepared_ns = time.perf_counter_ns()
            if padded:
                batch = pad_rows(batch, rows, self.config.pad_to)
            self._check_warmed(batch, len(items))
            started = time.monotonic()
            self.busy_since[instance] = started
            clock = time.perf_counter_ns()
            try:
                outputs = self.runs[instance](batch)
                return outputs, started, time.perf_counter_ns() - clock, prepared_ns
            finally:
                self.busy_since[instance] = None

        loop = asyncio.get_running_loop()
        try:
            outputs, started, infer_ns, prepared_ns = await loop.run_in_executor(executor, work)
            if padded:
                outputs = {name: array[:rows] for name, array in outputs.items()}
            if self.config.max_batch_size == 0:  # no batch dimension: one request, whole
                parts = [dict(outputs)]
            else:
                parts = split(outputs, [p.rows for p in items], self.model)
        except _Unprepared as failed:  # the request's own error, as its preprocessing raised it
            _fail(items, failed.error)
            return
        except TensorgateError as exc:
            _fail(items, exc)
            return
        except Exception as exc:
            if is_out_of_memory(exc):
                await self._after_oom(instance, executor, items)
                return
            if failures is not None:
                failures.extend((p, exc) for p in items)
                return
            if len(items) > 1:
                await self._isolate(instance, executor, items, exc)
                return
            log.exception("model %s failed on a batch of %d rows", self.model, len(items))
            _fail(items, ModelExecutionError(f"model '{self.model}' failed: {exc}"))
            return
        self.stats.record_execution(sum(p.rows for p in items), infer_ns)
        for p, part in zip(items, parts, strict=True):
            if p.future.done():
                continue
            if p.timing is not None:
                if prepare is not None:  # preprocessed on the instance: no queue, no hand-off
                    p.timing.compute_input_ns = prepared_ns - p.timing.started_ns
                else:
                    p.timing.queue_ns += int((started - p.enqueued) * 1e9)
                p.timing.compute_infer_ns += infer_ns
            p.future.set_result(part)

    def _check_warmed(self, batch: Batch, requests: int) -> None:
        """Count the requests of a batch whose shape warmup did not run (on the instance)."""
        if self.warmed is None:
            return
        shape = batch_shape(batch)
        if shape in self.warmed:
            return
        self.stats.record_unwarmed(requests)
        # once per shape (a log line per batch is a cost), for the first 1,000 shapes
        if shape not in self._warned and len(self._warned) < 1000:
            self._warned.add(shape)
            log.warning("model %s met an unwarmed shape %s (logged once per shape; "
                        "tensorgate_unwarmed_shape_requests counts every request)",
                        self.model, shape)  # fmt: skip

    async def _isolate(
        self, instance: int, executor: ThreadPoolExecutor, items: list[Pending], error: Exception
    ) -> None:
        """One bad input must not fail the other requests of its batch: run each request
        alone. One that still fails while another of the batch ran gets 400 with the model's
        error (its own input is the cause); when every one fails, the model is: 500 for all."""
        self.stats.record_isolated()
        log.warning("model %s failed on a batch of %d requests (%s); running each alone",
                    self.model, len(items), error)  # fmt: skip
        failures: list[tuple[Pending, Exception]] = []
        for p in items:
            if not p.future.done():  # a client that left while its batch ran
                await self._execute(instance, executor, [p], failures=failures)
        ran = any(
            p.future.done() and not p.future.cancelled() and p.future.exception() is None
            for p in items
        )
        for p, exc in failures:
            if ran:
                _fail([p], InvalidInput(
                    f"model '{self.model}' failed on this request's input, while the other "
                    f"requests of its batch ran: {exc}"
                ))  # fmt: skip
            else:
                log.error("model %s failed on every request of a batch, each alone: %s",
                          self.model, exc, exc_info=exc)  # fmt: skip
                _fail([p], ModelExecutionError(f"model '{self.model}' failed: {exc}"))

    async def _after_oom(
        self, instance: int, executor: ThreadPoolExecutor, items: list[Pending]
    ) -> None:
        """Out of device memory is a per-request error, never a dead server: run the batch again
        in halves, down to single requests; a request that fails alone gets 503 (413 when it
        failed with the device otherwise idle: it can never fit)."""
        self.stats.record_out_of_memory()
        if len(items) > 1:
            half = len(items) // 2
            log.warning("model %s: out of memory on %d requests; retrying in halves",
                        self.model, len(items))  # fmt: skip
            await self._execute(instance, executor, items[:half])
            await self._execute(instance, executor, items[half:])
            return
        others_busy = any(b is not None for i, b in enumerate(self.busy_since) if i != instance)
        if others_busy:
            _fail(items, ServerBusy(
                f"model '{self.model}': out of device memory for this request while other "
                "batches ran; retry", retry_after_s=1,
            ))  # fmt: skip
        else:
            _fail(items, PayloadTooLarge(
                f"model '{self.model}': this request ({items[0].rows} rows) does not fit in "
                "device memory even alone; send fewer rows or smaller inputs"
            ))  # fmt: skip

    async def stop(self) -> None:
        """Answer what is still queued with 503, stop the workers, release the threads."""
        for p in self.queue:
            if not p.future.done():
                p.future.set_exception(ServerBusy(f"model '{self.model}' is shutting down"))
        self.queue.clear()
        for task in self._workers:
            task.cancel()
        await asyncio.gather(*self._workers, return_exceptions=True)
        for executor in self._executors:
            executor.shutdown(wait=True)

    @property
    def pending(self) -> int:
        return len(self.queue)


class _Unprepared(Exception):
    """A lone request's preprocessing failed: its error goes to it as it is (a 400 for a bad
    image, the generic 500 for a bug), never taken for the model's (or for out of memory)."""

    def __init__(self, error: Exception) -> None:
        super().__init__(str(error))
        self.error = error


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


def _rows(inputs: Batch, batched: bool) -> int:
    return int(next(iter(inputs.values())).shape[0]) if batched else 1


def _chunks(inputs: Batch, rows: int, limit: int) -> list[Batch]:
    return [
        {name: array[start : start + limit] for name, array in inputs.items()}
        for start in range(0, rows, limit)
    ]
