"""What is learned about each inference request as it travels, and where it goes: the model's
statistics (Triton's names), the Prometheus metrics and one access-log line. Also the drain
state the server's SIGTERM handler sets and every request reads."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from types import TracebackType

from service.batching.stats import RequestTiming
from service.errors import ServerBusy, TensorgateError
from service.repository.models import ModelRepository
from service.repository.serving import ServedVersion
from service.telemetry.counters import REFUSED
from service.telemetry.metrics import Metrics
from service.telemetry.tracing import CALLER, CURRENT, RequestTrace

access = logging.getLogger("tensorgate.access")

After = list[Callable[[], None]]
"""What a request's observation leaves to run once its answer is sent (:meth:`Observer.finish`)."""


@dataclass(slots=True)
class Drain:
    """Where the server stands on its way out (set by :mod:`service.http.server` on SIGTERM)."""

    draining: bool = False
    """SIGTERM arrived: readiness is false, inference still served (pre-stop)."""
    refusing: bool = False
    """Past pre-stop: new inference requests get 503 while the accepted ones finish."""
    in_flight: int = 0
    """Inference requests accepted and not yet answered (``:preprocess`` ones too: the exit
    waits for them)."""
    over: bool = False
    """The grace period ended with requests in flight (:meth:`expire`)."""
    tasks: set[asyncio.Task[object]] = field(default_factory=set)
    """The tasks answering inference requests now, to end at :meth:`expire`."""

    def admit(self) -> None:
        """503 once new work is refused (past pre-stop)."""
        if self.refusing:
            REFUSED["draining"] += 1  # before a model is looked up: no request metric sees it
            raise ServerBusy("the server is shutting down; send this request elsewhere")

    def expire(self) -> None:
        """On the loop, once the grace period is over: each request still in flight is cancelled,
        and answered :data:`GRACE_OVER` (503) by its route, instead of its connection closing
        with no answer at the exit (a hung model's code, a client that asked for a timeout
        longer than the grace period)."""
        self.over = True
        for task in list(self.tasks):
            task.cancel(GRACE_OVER)

    def ended(self, exc: BaseException | None) -> bool:
        """Whether ``exc`` is :meth:`expire`'s cancellation (the request is answered 503)."""
        return self.over and isinstance(exc, asyncio.CancelledError)

    def answer_for(self, exc: asyncio.CancelledError) -> ServerBusy:
        """What a route answers in place of ``exc``, caught in the task :meth:`expire`
        cancelled: :data:`GRACE_OVER`, the task uncancelled (the request answered, not
        dropped). Any other cancellation (the client left, the server stops) is re-raised."""
        if not self.ended(exc):
            raise exc
        if (current := _current_task()) is not None:
            current.uncancel()
        return ServerBusy(GRACE_OVER)


def _current_task() -> asyncio.Task[object] | None:
    """The task running this, if any (a call made outside the event loop has none)."""
    try:
        return asyncio.current_task()
    except RuntimeError:
        return None


GRACE_OVER = (
    "the server stopped before this request was answered: its drain grace period "
    "(TG_DRAIN_GRACE_S) ended; send the request again"
)


@dataclass(slots=True)
class Observation:
    """One request's facts, filled in as it travels."""

    version: str
    timing: RequestTiming = field(default_factory=RequestTiming)
    served: ServedVersion | None = None
    rows: int = 0
    trace: RequestTrace | None = None
    """The request's trace when tracing is on (its stages are marked on it)."""
    unserved: bool = False
    """``version`` is a version of the model that exists and cannot serve (a 503)."""


class Observer:
    """Counts, times and logs every inference request, whatever its outcome."""

    def __init__(
        self, repository: ModelRepository, metrics: Metrics, drain: Drain, access_log: bool
    ):
        self.repository, self.metrics, self.drain = repository, metrics, drain
        self.access_log = access_log

    def observe(
        self, protocol: str, name: str, version: str | None, after: After | None = None
    ) -> _Observing:
        """``with observer.observe(...) as observation:`` around one request: 503 while the
        server refuses new work; whatever happens inside is counted, timed and logged once:
        at the block's end, or with ``after``, once the caller has sent the answer and runs
        what the block left there (see :meth:`finish`)."""
        self.drain.admit()
        observation = Observation(version or "")
        trace = CURRENT.get()
        if trace is not None:
            observation.trace = observation.timing.trace = trace
        return _Observing(self, protocol, name, observation, after)

    def finish(
        self,
        protocol: str,
        name: str,
        observation: Observation,
        status: int,
        after: After | None = None,
    ) -> None:
        """A request is answered with ``status``: its trace's attributes now (its span ends
        with the answer), then its model's statistics, metrics and log line, and its leaving
        the drain's count: now, or appended to ``after`` for the caller to run once the answer
        is sent. Before the answer, the access-log line cost a lone image 90–150 µs of its way
        out, its record made and queued and the writer thread woken while the answer waited
        (docs/performance.md, "A lone image stage by stage"); after, the client has its answer,
        and the duration logged is the server's whole (the answer's encoding and write
        included)."""
        trace = observation.trace
        if trace is not None:
            trace.span.set_attributes(
                {
                    "tensorgate.model": name,
                    "tensorgate.model.version": observation.version,
                    "tensorgate.rows": observation.rows,
                    "tensorgate.protocol": protocol,
                }
            )
            if observation.served is not None:
                trace.device = observation.served.loaded.device
        if after is None:
            self._count(protocol, name, observation, status)
        else:
            after.append(partial(self._count, protocol, name, observation, status))

    def _count(self, protocol: str, name: str, observation: Observation, status: int) -> None:
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
        found = observation.served is not None or observation.unserved
        model = name if found or name in self.repository.models else ""
        self.metrics.record(
            model, observation.version if found else "", protocol, status, elapsed, timing
        )
        if self.access_log:
            extra = {
                "model": name,
                "version": observation.version,
                "protocol": protocol,
                "status": status,
                "duration_ms": round(elapsed * 1000, 3),
                "preprocess_ms": round(timing.compute_input_ns / 1e6, 3),
                "queue_ms": round(timing.queue_ns / 1e6, 3),
                "compute_ms": round(timing.compute_infer_ns / 1e6, 3),
                "postprocess_ms": round(timing.compute_output_ns / 1e6, 3),
            }
            if timing.unwarmed:
                extra["unwarmed_shape"] = True
            if observation.trace is not None:
                extra["trace_id"], extra["span_id"] = observation.trace.ids
            elif (caller := CALLER.get()) is not None:  # not recorded here: the caller's trace
                extra["trace_id"] = caller
            access.info("%s %s %d", protocol, name, status, extra=extra)


class _Observing:
    """The context of :meth:`Observer.observe`: a class rather than ``@contextmanager``, whose
    generator costs every request a few more calls (docs/performance.md, "Per-request
    bookkeeping")."""

    __slots__ = ("after", "name", "observation", "observer", "protocol")

    def __init__(
        self,
        observer: Observer,
        protocol: str,
        name: str,
        observation: Observation,
        after: After | None,
    ) -> None:
        self.observer, self.protocol, self.name = observer, protocol, name
        self.observation, self.after = observation, after

    def __enter__(self) -> Observation:
        drain = self.observer.drain
        drain.in_flight += 1
        if (task := _current_task()) is not None:
            drain.tasks.add(task)
        return self.observation

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        drain = self.observer.drain
        if (task := _current_task()) is not None:
            drain.tasks.discard(task)
        status = 200 if kind is None else 503 if drain.ended(exc) else status_of(exc)
        self.observer.finish(self.protocol, self.name, self.observation, status, self.after)


def status_of(exc: BaseException | None) -> int:
    """The status a request that ended in ``exc`` is counted with: its own, 499 when it was
    cancelled (its client left), 500 for anything else."""
    if isinstance(exc, TensorgateError):
        return exc.status
    return 499 if isinstance(exc, asyncio.CancelledError) else 500
