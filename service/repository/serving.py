"""A loaded version being served: its scheduler, its statistics, the requests in flight, and
its orderly close when a newer version replaces it or the server stops."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from types import TracebackType

import numpy as np

from service.batching.scheduler import (
    ADAPTIVE_DELAY_S,
    BatchBudget,
    Scheduler,
    SchedulerConfig,
    Work,
)
from service.batching.stats import ModelStats, RequestTiming
from service.errors import ModelNotReady
from service.model_config import ModelConfig
from service.repository.loader import LoadedVersion


class ServedVersion:
    """How one :class:`LoadedVersion` is served. The scheduler starts in the event loop that
    serves requests (:meth:`start`, once it is ready); :meth:`close` is called from a worker
    thread and waits for the requests in flight."""

    def __init__(
        self,
        loaded: LoadedVersion,
        on_broken: Callable[[str], None] | None = None,
        budget: BatchBudget | None = None,
        inline_batch_us: int = 0,
    ) -> None:
        self.loaded = loaded
        self.inline_batch_us = inline_batch_us
        """Batches expected to run within this many microseconds run on the event loop."""
        self.budget = budget
        """The server's budget, for the batches its scheduler concatenates."""
        self.on_broken = on_broken
        """Told why, when a golden replay after a lone failure shows the model broken."""
        self.stats = ModelStats()
        self.scheduler: Scheduler | None = None
        self.closed = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._in_flight = 0
        self.arriving = 0
        """Requests accepted (in use) that have not reached the queue yet: the adaptive
        batcher waits for them. Counted by the core (:class:`service.core.dataplane.Call`)."""
        self._idle = threading.Condition()
        self._closing = False
        self._use = _InUse(self)

    @property
    def in_flight(self) -> int:
        """Requests between lookup and answer (the one asking included)."""
        return self._in_flight

    def start(self) -> Scheduler:
        """Start the scheduler in the running loop (once): done when the version turns ready,
        so that the first request does not pay for it."""
        if self.scheduler is None:
            self._loop = asyncio.get_running_loop()
            config = self.loaded.config
            runtimes = self.loaded.runtimes
            self.scheduler = Scheduler(
                self.loaded.name,
                scheduler_config(config, self.inline_batch_us),
                [runtimes[i % len(runtimes)].run for i in range(config.instances)],
                self.stats,
                warmed=set(self.loaded.warmed),
                replay=self.loaded.replay_golden if self.loaded.golden else None,
                on_broken=self.on_broken,
                devices=self.loaded.devices,
                arriving=lambda: self.arriving,
                budget=self.budget,
            )
            self.scheduler.start()
        return self.scheduler

    async def execute(
        self, work: Work, timing: RequestTiming | None, deadline: float | None
    ) -> dict[str, np.ndarray]:
        """The one place requests reach the model: queue ``work``, answer its outputs."""
        if self.closed:
            raise ModelNotReady(f"model '{self.loaded.name}' was unloaded while the request waited")
        return await self.start().submit(work, timing, deadline)

    @property
    def closing(self) -> bool:
        """Retired: it answers the requests it holds and takes no more."""
        return self._closing

    def use(self) -> _InUse:
        """Held by each request from lookup to answer, so that close() waits for it."""
        return self._use

    def close(self, drain_timeout_s: float = 60.0) -> None:
        """Wait for requests in flight (up to the timeout), then stop and release everything."""
        with self._idle:
            self._closing = True
            self._idle.wait_for(lambda: self._in_flight == 0, drain_timeout_s)
            self.closed = True
        if self.scheduler is not None and self._loop is not None and not self._loop.is_closed():
            stopping = asyncio.run_coroutine_threadsafe(self.scheduler.stop(), self._loop)
            stopping.result(timeout=drain_timeout_s)
        self.loaded.close()


class _InUse:
    """``with served.use():`` around a request. Only the event loop counts requests in and
    out, without a lock; close(), on another thread, reads the count, and once it waits it is
    woken at each exit. So a request takes no lock unless its version is closing
    (docs/performance.md, "Per-request bookkeeping")."""

    __slots__ = ("served",)

    def __init__(self, served: ServedVersion) -> None:
        self.served = served

    def __enter__(self) -> None:
        self.served._in_flight += 1

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        served = self.served
        served._in_flight -= 1
        if served._closing:  # set before close() reads the count: it cannot miss this one
            with served._idle:
                served._idle.notify_all()


def scheduler_config(config: ModelConfig, inline_batch_us: int = 0) -> SchedulerConfig:
    delay_ms = config.batching.max_queue_delay_ms
    return SchedulerConfig(
        max_batch_size=config.max_batch_size,
        pad_to=config.warmup_batch_sizes() if config.warmup.pad_batches else (),
        preferred_batch_sizes=config.batching.preferred_batch_sizes,
        max_queue_delay_s=(
            ADAPTIVE_DELAY_S if delay_ms is None else delay_ms / 1000  # None: adaptive
        ),
        adaptive=delay_ms is None,
        max_queue_size=config.batching.max_queue_size,
        instances=config.instances,
        inline_run_ns=inline_batch_us * 1000,
    )
