"""Per-version inference statistics, in the shape of Triton's statistics extension.

Durations are cumulative nanoseconds with counts, so that a client computes averages over any
interval by subtracting two snapshots, as Triton's clients do.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

PHASES = ("success", "fail", "queue", "compute_input", "compute_infer", "compute_output")


@dataclass(frozen=True, slots=True)
class BatchRun:
    """One batch run, as the scheduler tells a traced request. Times are ``time.monotonic()``
    seconds and ``time.perf_counter_ns()`` (one clock on Linux: CLOCK_MONOTONIC)."""

    model: str
    instance: int
    device: str
    rows: int
    requests: int
    begun: float
    """The instance took the batch (monotonic s): the end of each request's wait."""
    prepared_ns: int
    """The batch was collated, its items made (perf_counter ns)."""
    started: float
    """The model started (monotonic s)."""
    infer_ns: int
    """How long the model ran."""


class BatchTrace(Protocol):
    """A traced request, as the scheduler sees it (:class:`service.telemetry.tracing.RequestTrace`
    implements it): told once per batch, by the batch's first traced request."""

    def batch_ran(self, run: BatchRun, members: Sequence[tuple[Any, float, bool]]) -> None: ...


@dataclass(slots=True)
class RequestTiming:
    """Nanoseconds one request spent in each phase; filled in as it travels."""

    started_ns: int = field(default_factory=time.perf_counter_ns)
    compute_input_ns: int = 0
    queue_ns: int = 0
    compute_infer_ns: int = 0
    compute_output_ns: int = 0
    trace: BatchTrace | None = None
    """Its trace, when tracing is on (the scheduler reports each batch it ran in to it)."""
    unwarmed: bool = False
    """It ran in a batch of a shape warmup did not run (its access-log line says so)."""


class ModelStats:
    """Counters for one model version; safe to update from any thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.inference_count = 0
        self.execution_count = 0
        self.last_inference_ms = 0
        self.unwarmed_count = 0
        self.out_of_memory_count = 0
        self.isolated_count = 0
        self._phases = {phase: [0, 0] for phase in PHASES}
        self._batches: dict[int, dict[str, list[int]]] = {}

    def record_execution(self, batch_size: int, infer_ns: int) -> None:
        """One run of the model on a batch of ``batch_size`` rows."""
        with self._lock:
            self.execution_count += 1
            batch = self._batches.setdefault(batch_size, {"compute_infer": [0, 0]})
            batch["compute_infer"][0] += 1
            batch["compute_infer"][1] += infer_ns

    def record_unwarmed(self, requests: int) -> None:
        """Requests whose batch had a shape that warmup did not run (should stay 0)."""
        with self._lock:
            self.unwarmed_count += requests

    def record_out_of_memory(self) -> None:
        """A batch that ran out of device memory (it is retried in halves)."""
        with self._lock:
            self.out_of_memory_count += 1

    def record_isolated(self) -> None:
        """A batch of several requests that failed and was run again one request at a time."""
        with self._lock:
            self.isolated_count += 1

    def record_success(self, rows: int, timing: RequestTiming) -> None:
        total = time.perf_counter_ns() - timing.started_ns
        now_ms = time.time_ns() // 1_000_000
        phases = self._phases
        with self._lock:  # written out, not looped: this runs for every request
            self.inference_count += rows
            self.last_inference_ms = now_ms
            success, queue = phases["success"], phases["queue"]
            compute_input, compute_infer = phases["compute_input"], phases["compute_infer"]
            compute_output = phases["compute_output"]
            success[0] += 1
            success[1] += total
            queue[0] += 1
            queue[1] += timing.queue_ns
            compute_input[0] += 1
            compute_input[1] += timing.compute_input_ns
            compute_infer[0] += 1
            compute_infer[1] += timing.compute_infer_ns
            compute_output[0] += 1
            compute_output[1] += timing.compute_output_ns

    def record_failure(self, timing: RequestTiming) -> None:
        with self._lock:
            self._phases["fail"][0] += 1
            self._phases["fail"][1] += time.perf_counter_ns() - timing.started_ns

    def snapshot(self, name: str, version: str) -> dict[str, Any]:
        """This version's entry of ``model_stats``, with Triton's field names."""
        with self._lock:
            return {
                "name": name,
                "version": version,
                "last_inference": self.last_inference_ms,
                "inference_count": self.inference_count,
                "execution_count": self.execution_count,
                "unwarmed_shape_count": self.unwarmed_count,
                "out_of_memory_count": self.out_of_memory_count,
                "isolated_batch_count": self.isolated_count,
                "inference_stats": {
                    phase: {"count": count, "ns": ns} for phase, (count, ns) in self._phases.items()
                },
                "batch_stats": [
                    {
                        "batch_size": size,
                        **{k: {"count": c, "ns": ns} for k, (c, ns) in phases.items()},
                    }
                    for size, phases in sorted(self._batches.items())
                ],
            }
