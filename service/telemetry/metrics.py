"""Prometheus metrics, all named ``tensorgate_*``, on a registry of the app's own.

Per-request observations (durations, outcomes) are recorded as they happen; per-model counters
that :class:`~service.batching.stats.ModelStats` already keeps (executions, rows, unwarmed
shapes) and states (queue depth, model state, warmup time) are read at scrape time by a
collector, so the two views can never disagree.
"""

from __future__ import annotations

import sys
from bisect import bisect_left
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from prometheus_client import (
    CollectorRegistry,
    Counter,
    ProcessCollector,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from service.batching.scheduler import Scheduler
from service.batching.stats import RequestTiming
from service.repository.models import ModelRepository, ModelState
from service.repository.serving import ServedVersion
from service.resources import memory_limit_bytes
from service.telemetry.counters import REASONS, REFUSED, bytes_held

# Sub-millisecond to a minute: a small model over gRPC is answered in 0.6 ms and a pipeline's
# postprocessing in well under 0.5 ms (with 0.5 ms the lowest bound, every such p50 read as an
# interpolation, 0.25 ms), and TG_REQUEST_TIMEOUT_S is 60 s (with 10 s the highest, a
# saturated p99 read 10 s).
LATENCY_BUCKETS = (
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.002,
    0.005,
    0.01,
    0.02,
    0.05,
    0.1,
    0.2,
    0.5,
    1.0,
    2.0,
    5.0,
    10.0,
    30.0,
    60.0,
)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)

OUTCOMES = {
    200: "success",
    400: "bad_request",
    401: "unauthorized",
    404: "not_found",
    413: "too_large",
    415: "unsupported",
    499: "client_gone",
    503: "unavailable",
    504: "timeout",
}


PROTOCOLS = ("v1", "v2", "grpc")
"""How a request came: REST's two, or gRPC (each version's failure series primed from 0)."""
STEP = "step"
"""The protocol of a pipeline's code calling the model (:mod:`service.core.steps`): its series
appear with its first call, its failures from 0 then (most models are nobody's step), and time
only the stages a step has (queue and compute)."""
SERVER_FAILURES = ("error", "unavailable", "timeout")
"""The outcomes the error-ratio alert counts (deploy/prometheus/rules.yaml)."""


def outcome(status: int) -> str:
    return OUTCOMES.get(status, "error" if status >= 500 else "client_error")


class Metrics:
    """The server's metrics; one instance per app."""

    def __init__(
        self, repository: ModelRepository, in_flight: Callable[[], int] | None = None
    ) -> None:
        # A `_created` series per counter and histogram doubles the series count for a
        # timestamp that rate() never needs (process-wide switch: the registry is ours alone).
        disable_created_metrics()  # type: ignore[no-untyped-call]  # the library leaves it untyped
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter(
            "tensorgate_requests",
            "Requests answered, by model, version, protocol and outcome.",
            ["model", "version", "protocol", "outcome"],
            registry=r,
        )
        self.duration = DurationHistogram(
            "tensorgate_request_duration_seconds",
            "Time from request body to answer.",
            ("model", "protocol"),
            LATENCY_BUCKETS,
            r,
        )
        self.queue = self._stage("queue", "Time a request waited in its model's queue.")
        self.compute = self._stage("compute", "Time the model ran the batch a request was in.")
        self.preprocess = self._stage("preprocess", "Decoding, preprocessing and validation.")
        self.postprocess = self._stage("postprocess", "Postprocessing and response encoding.")
        self._children: dict[tuple[str, str, str, int], tuple[Any, ...]] = {}
        self._primed: set[tuple[str, str]] = set()
        self._steps_primed: set[tuple[str, str]] = set()
        self.repository = repository
        ProcessCollector(registry=r)  # process_*: the names stock dashboards and alerts use
        r.register(_RepositoryCollector(repository, in_flight))
        r.register(_GpuCollector())

    def exposition(self) -> bytes:
        """The text format, every served version's server-side failure outcomes in it from 0
        on. A series that appears with its first failure has no earlier value for ``rate()``
        and ``increase()`` to count from, so the first burst of 504s or 503s on each model and
        protocol after a start (a whole scrape interval of them) never reached the
        error-ratio alert or the 5xx panels."""
        for version, _ in self.repository.served_versions():
            key = (version.name, str(version.version))
            if key not in self._primed:
                self._primed.add(key)
                for protocol in PROTOCOLS:
                    for failed in SERVER_FAILURES:
                        self.requests.labels(*key, protocol, failed)
        return generate_latest(self.registry)

    def record(
        self,
        model: str,
        version: str,
        protocol: str,
        status: int,
        elapsed_s: float,
        timing: RequestTiming,
    ) -> None:
        """One answered inference request: its outcome, its duration and, for a success, the
        time of each stage. Label values must be bounded: names of models and versions that
        exist, or ""."""
        key = (model, version, protocol, status)
        children = self._children.get(key)
        if children is None:  # prometheus' labels() costs microseconds a call: look up once
            if protocol == STEP and (model, version) not in self._steps_primed:
                self._steps_primed.add((model, version))  # its failures from 0, for rate()
                for failed in SERVER_FAILURES:
                    self.requests.labels(model, version, STEP, failed)
            children = (
                self.requests.labels(model, version, protocol, outcome(status)),
                self.duration.labels(model, protocol),
            )
            if status == 200:  # the stages are timed for successes only
                children += (self.queue.labels(model), self.compute.labels(model))
                if protocol != STEP:  # a step has no pre- or postprocessing of its own
                    children += (self.preprocess.labels(model), self.postprocess.labels(model))
            self._children[key] = children
        children[0].inc()
        children[1].observe(elapsed_s)
        if status == 200:
            children[2].observe(timing.queue_ns / 1e9)
            children[3].observe(timing.compute_infer_ns / 1e9)
            if len(children) > 4:
                children[4].observe(timing.compute_input_ns / 1e9)
                children[5].observe(timing.compute_output_ns / 1e9)

    def _stage(self, stage: str, help_text: str) -> DurationHistogram:
        return DurationHistogram(
            f"tensorgate_{stage}_duration_seconds",
            help_text,
            ("model",),
            LATENCY_BUCKETS,
            self.registry,
        )


class _Series:
    """One labelled series of a :class:`DurationHistogram`: a count per bucket and the sum."""

    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # the last: above every bound (+Inf)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1  # the first bound >= value: its le
        self.sum += value


class DurationHistogram(Collector):
    """A Prometheus histogram of per-request durations, exposed as prometheus_client's own
    (same names, ``le`` labels and series), recorded more cheaply: one bisect and two
    additions per observation, on the event loop that answers the requests, where
    prometheus_client's ``Histogram.observe`` takes a lock and walks the buckets. A request
    observes five of these (docs/performance.md, "Per-request bookkeeping")."""

    def __init__(
        self,
        name: str,
        documentation: str,
        labels: tuple[str, ...],
        buckets: Sequence[float],
        registry: CollectorRegistry,
    ) -> None:
        self.name, self.documentation, self.label_names = name, documentation, labels
        self.bounds = tuple(float(b) for b in buckets)
        self._series: dict[tuple[str, ...], _Series] = {}
        registry.register(self)

    def labels(self, *values: str) -> _Series:
        series = self._series.get(values)
        if series is None:
            series = self._series[values] = _Series(self.bounds)
        return series

    def collect(self) -> Iterator[Metric]:
        family = HistogramMetricFamily(self.name, self.documentation, labels=self.label_names)
        for values, series in list(self._series.items()):
            counts = list(series.counts)  # a copy: the loop may observe while this runs
            buckets = []
            total = 0
            for bound, count in zip((*self.bounds, float("inf")), counts, strict=True):
                total += count
                le = floatToGoString(bound)  # type: ignore[no-untyped-call]  # the library leaves it untyped
                buckets.append((le, float(total)))
            family.add_metric(list(values), buckets, series.sum)
        yield family


def _pending(served: ServedVersion) -> float | None:
    scheduler = served.scheduler
    return None if scheduler is None else scheduler.pending + scheduler.busy_instances()


def _scheduler_value(read: Callable[[Scheduler], float]) -> Callable[[ServedVersion], float | None]:
    def value(served: ServedVersion) -> float | None:
        scheduler = served.scheduler
        return None if scheduler is None else read(scheduler)

    return value


def _longest(scheduler: Scheduler) -> float:
    longest = scheduler.longest_running()
    return 0.0 if longest is None else longest[1]


VERSION_SERIES: tuple[
    tuple[
        type[GaugeMetricFamily | CounterMetricFamily],
        str,
        str,
        Callable[[ServedVersion], float | None],
    ],
    ...,
] = (
    (
        GaugeMetricFamily,
        "tensorgate_pending_requests",
        "Requests waiting in the queue plus batches running, per model version.",
        _pending,
    ),
    (
        GaugeMetricFamily,
        "tensorgate_queued_requests",
        "Requests waiting in the queue, not yet running, per model version.",
        _scheduler_value(lambda scheduler: scheduler.pending),
    ),
    (
        GaugeMetricFamily,
        "tensorgate_queue_capacity",
        "Requests the queue holds at most; one past it is refused 503 (max_queue_size).",
        _scheduler_value(lambda scheduler: scheduler.config.max_queue_size),
    ),
    (
        GaugeMetricFamily,
        "tensorgate_instances",
        "Model instances (each runs one batch at a time).",
        _scheduler_value(lambda scheduler: len(scheduler.instances)),
    ),
    (
        GaugeMetricFamily,
        "tensorgate_instances_busy",
        "Model instances running a batch now.",
        _scheduler_value(lambda scheduler: scheduler.busy_instances()),
    ),
    (
        GaugeMetricFamily,
        "tensorgate_longest_batch_seconds",
        "How long the longest-running current batch has run (0 when idle); liveness fails past "
        "TG_STUCK_INSTANCE_S.",
        _scheduler_value(_longest),
    ),
    (
        GaugeMetricFamily,
        "tensorgate_warmup_duration_seconds",
        "Time warmup took at load.",
        lambda served: served.loaded.timings["warmup_s"],
    ),
    (
        CounterMetricFamily,
        "tensorgate_executions",
        "Batches run by the model.",
        lambda served: served.stats.execution_count,
    ),
    (
        CounterMetricFamily,
        "tensorgate_inference_rows",
        "Rows inferred (over executions: the batch ratio).",
        lambda served: served.stats.inference_count,
    ),
    (
        CounterMetricFamily,
        "tensorgate_unwarmed_shape_requests",
        "Requests whose batch had a shape warmup did not run (should stay 0).",
        lambda served: served.stats.unwarmed_count,
    ),
    (
        CounterMetricFamily,
        "tensorgate_out_of_memory",
        "Batches that ran out of device memory (retried in halves, down to one request).",
        lambda served: served.stats.out_of_memory_count,
    ),
    (
        CounterMetricFamily,
        "tensorgate_isolated_batches",
        "Batches of several requests that failed (not out of memory) and ran again one request at "
        "a time, so that only the request at fault failed.",
        lambda served: served.stats.isolated_count,
    ),
)
"""The series each served model version has: kind, name, help, and how to read its value
(None: nothing to report, e.g. before the scheduler starts)."""


class _RepositoryCollector(Collector):
    """Model state, queue depth, warmup time and the counters ModelStats keeps, at scrape time."""

    def __init__(
        self, repository: ModelRepository, in_flight: Callable[[], int] | None = None
    ) -> None:
        self.repository = repository
        self.memory_limit = memory_limit_bytes()  # read once: a cgroup's limit is fixed at start
        self.in_flight = in_flight

    def collect(self) -> Iterator[Metric]:
        state = GaugeMetricFamily(
            "tensorgate_model_state",
            "1 for the state each model version is in.",
            labels=["model", "version", "state"],
        )
        families = [
            (kind(name, text, labels=["model", "version"]), value)
            for kind, name, text, value in VERSION_SERIES
        ]
        for name, entry in list(self.repository.models.items()):
            if entry.unloaded:  # on purpose: said, so that its series do not just vanish
                state.add_metric([name, "", ModelState.UNLOADED.value], 1.0)
            for number, version in entry.versions.items():
                labels = [name, str(number)]
                now = self.repository.state(version)[0]
                for candidate in ModelState:
                    state.add_metric([*labels, candidate.value], float(now is candidate))
                if version.served is None:
                    continue
                for family, value in families:
                    if (measured := value(version.served)) is not None:
                        family.add_metric(labels, measured)
        yield state
        yield from (family for family, _ in families)
        yield self._batch_sizes()
        refused = CounterMetricFamily(
            "tensorgate_refused",
            "Connections or requests refused by a server-wide bound before the application "
            "read them: too_many (connections), too_many_from_client (connections from one "
            "address), header_too_large, chunk_line_too_large (a chunked body's size line past "
            "TG_MAX_HEADER_BYTES), header_timeout, "
            "body_timeout, write_timeout (an answer the client did not take), body_budget "
            "(TG_MAX_INFLIGHT_BYTES); and requests refused before a model was looked up: "
            "unauthorized, too_large (a REST body past TG_MAX_BODY_BYTES), draining, "
            "bad_request (a REST 400 or 415 for a header or the body's encoding).",
            labels=["reason"],
        )
        for reason in REASONS:
            refused.add_metric([reason], REFUSED[reason])
        yield refused
        if self.in_flight is not None:
            yield GaugeMetricFamily(
                "tensorgate_requests_in_flight",
                "Inference requests accepted and not yet answered, over every model (reading, "
                "decoding, queued, running, encoding).",
                value=self.in_flight(),
            )
        yield GaugeMetricFamily(
            "tensorgate_memory_limit_bytes",
            "Memory the server may use: its cgroup's limit, else the machine's (alert on "
            "process_resident_memory_bytes against it).",
            value=self.memory_limit,
        )
        yield GaugeMetricFamily(
            "tensorgate_request_body_bytes_in_flight",
            "Request body bytes (and gRPC inference messages, REST answers written and not "
            "yet taken by their clients, and what was made for requests: batches' outputs, "
            "REST answers not yet sent) held now over all connections "
            "(TG_MAX_INFLIGHT_BYTES bounds it).",
            value=bytes_held(),
        )

    def _batch_sizes(self) -> Metric:
        """Rows per execution, as a histogram built from the exact per-size counts."""
        family = HistogramMetricFamily(
            "tensorgate_batch_size", "Rows per model execution.", labels=["model", "version"]
        )
        for version, served in self.repository.served_versions():
            sizes = {
                b["batch_size"]: b["compute_infer"]["count"]
                for b in served.stats.snapshot(version.name, "")["batch_stats"]
            }
            buckets = [
                (str(bound), float(sum(n for size, n in sizes.items() if size <= bound)))
                for bound in BATCH_BUCKETS
            ]
            total = float(sum(sizes.values()))
            buckets.append(("+Inf", total))
            rows = float(sum(size * n for size, n in sizes.items()))
            family.add_metric([version.name, str(version.version)], buckets, rows)
        return family


class _GpuCollector(Collector):
    """GPU memory and utilisation per device, from NVML (nvidia-ml-py) when it and a GPU are
    there, plus what torch's allocator holds when torch is already imported. Nothing otherwise."""

    def __init__(self) -> None:
        try:
            import pynvml  # optional: nvidia-ml-py

            pynvml.nvmlInit()
            self._nvml: Any = pynvml
        except Exception:  # no library, no driver or no GPU: there is nothing to report
            self._nvml = None

    def collect(self) -> Iterator[Metric]:
        if self._nvml is not None:
            yield from self._from_nvml(self._nvml)
        torch = sys.modules.get("torch")  # never imported just for this
        # torch may be in sys.modules half imported (a model loading as the scrape comes):
        # torch.cuda then does not exist yet, and the scrape was a 500
        cuda = getattr(torch, "cuda", None) if torch is not None else None
        if cuda is not None and getattr(cuda, "is_available", lambda: False)():
            allocated = GaugeMetricFamily(
                "tensorgate_gpu_torch_allocated_bytes",
                "Bytes torch's allocator has handed out.",
                labels=["device"],
            )
            reserved = GaugeMetricFamily(
                "tensorgate_gpu_torch_reserved_bytes",
                "Bytes torch's allocator holds.",
                labels=["device"],
            )
            for index in range(cuda.device_count()):
                allocated.add_metric([str(index)], cuda.memory_allocated(index))
                reserved.add_metric([str(index)], cuda.memory_reserved(index))
            yield allocated
            yield reserved

    @staticmethod
    def _from_nvml(nvml: Any) -> Iterator[Metric]:
        used = GaugeMetricFamily(
            "tensorgate_gpu_memory_used_bytes", "GPU memory in use.", labels=["device"]
        )
        total = GaugeMetricFamily(
            "tensorgate_gpu_memory_total_bytes", "GPU memory.", labels=["device"]
        )
        busy = GaugeMetricFamily(
            "tensorgate_gpu_utilization_ratio",
            "Share of the last sample period the GPU ran kernels.",
            labels=["device"],
        )
        for index in range(nvml.nvmlDeviceGetCount()):
            handle = nvml.nvmlDeviceGetHandleByIndex(index)
            memory = nvml.nvmlDeviceGetMemoryInfo(handle)
            used.add_metric([str(index)], memory.used)
            total.add_metric([str(index)], memory.total)
            busy.add_metric([str(index)], nvml.nvmlDeviceGetUtilizationRates(handle).gpu / 100)
        yield from (used, total, busy)
