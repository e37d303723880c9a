"""What is learned about each inference request as it travels, and where it goes: the model's
statistics (Triton's names), the Prometheus metrics and one access-log line. Also the drain
state the server's SIGTERM handler sets and every request reads."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from service.errors import ServerBusy, TensorgateError
from service.metrics import Metrics
from service.repository import ModelRepository
from service.serving import ServedVersion
from service.stats import RequestTiming

access = logging.getLogger("tensorgate.access")


@dataclass(slots=True)
class Drain:
    """Where the server stands on its way out (set by :mod:`service.server` on SIGTERM)."""

    draining: bool = False
    """SIGTERM arrived: readiness is false, inference still served (pre-stop)."""
    refusing: bool = False
    """Past pre-stop: new inference requests get 503 while the accepted ones finish."""
    in_flight: int = 0
    """Inference requests accepted and not yet answered."""


@dataclass(slots=True)
class Observation:
    """One request's facts, filled in as it travels."""

    version: str
    timing: RequestTiming = field(default_factory=RequestTiming)
    served: ServedVersion | None = None
    rows: int = 0


class Observer:
    """Counts, times and logs every inference request, whatever its outcome."""

    def __init__(
        self, repository: ModelRepository, metrics: Metrics, drain: Drain, access_log: bool
    ):
        self.repository, self.metrics, self.drain = repository, metrics, drain
        self.access_log = access_log

    @contextmanager
    def observe(self, protocol: str, name: str, version: str | None) -> Iterator[Observation]:
        if self.drain.refusing:
            raise ServerBusy("the server is shutting down; send this request elsewhere")
        observation = Observation(version or "")
        self.drain.in_flight += 1
        status = 500
        try:
            yield observation
            status = 200
        except TensorgateError as exc:
            status = exc.status
            raise
        except asyncio.CancelledError:
            status = 499
            raise
        finally:
            self.drain.in_flight -= 1
            if observation.served is not None:  # the model's own statistics (Triton's names)
                stats = observation.served.stats
                if status == 200:
                    stats.record_success(observation.rows, observation.timing)
                else:
                    stats.record_failure(observation.timing)
            self._record(protocol, name, observation, status)

    def _record(self, protocol: str, name: str, observation: Observation, status: int) -> None:
        timing = observation.timing
        elapsed = (time.perf_counter_ns() - timing.started_ns) / 1e9
        # bounded label values: a model and version that exist, else "" (a client can send any)
        found = observation.served is not None
        model = name if found or name in self.repository.models else ""
        self.metrics.record(
            model, observation.version if found else "", protocol, status, elapsed, timing
        )
        if self.access_log:
            access.info(
                "%s %s %d", protocol, name, status,
                extra={
                    "model": name, "version": observation.version, "protocol": protocol,
                    "status": status, "duration_ms": round(elapsed * 1000, 3),
                    "preprocess_ms": round(timing.compute_input_ns / 1e6, 3),
                    "queue_ms": round(timing.queue_ns / 1e6, 3),
                    "compute_ms": round(timing.compute_infer_ns / 1e6, 3),
                    "postprocess_ms": round(timing.compute_output_ns / 1e6, 3),
                },
            )  # fmt: skip
