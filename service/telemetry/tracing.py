"""OpenTelemetry traces of inference requests, off unless asked for.

On when ``TG_TRACING=true`` or ``OTEL_TRACES_EXPORTER`` names an exporter (``otlp``: OTLP over
HTTP/protobuf to ``OTEL_EXPORTER_OTLP[_TRACES]_ENDPOINT``, default ``http://localhost:4318``;
``console``: JSON on stdout). Everything else is the SDK's standard ``OTEL_*`` configuration
(sampler, batch processor, resource, propagators). A configuration the SDK cannot use is a
warning and tracing stays off: a typo in a tracing variable must not keep models from serving.

Each inference request is one SERVER span named by its route template
(``POST /v2/models/{name}/infer``, ``inference.GRPCInferenceService/ModelInfer``), continuing
the client's W3C ``traceparent``. Its stages are children made when it ends, from times taken
as it travelled (``decode``, ``preprocess``, ``queue``, ``postprocess``, ``encode``): a request
costs no span calls until then. The model's run is one ``compute`` span per batch, a child of
the batch's first traced request, linked to every request's span in the batch (and each of
those to it), so a slow request shows the batch it waited for.

A step that a model's own pipeline code runs on another model (``self.models.infer``) is an
INTERNAL ``step`` span, the calling request's child, with its own ``queue`` and ``compute``
under it: a face request shows each of its detector's stages and how long each waited.

With tracing off none of this runs: :data:`TRACER` is None, and the request path reads one
global and one context variable (docs/performance.md, "Tracing").
"""

from __future__ import annotations

import contextvars
import difflib
import logging
import os
import re
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any
from urllib.parse import urlparse

from opentelemetry import propagate  # the API (a few ms to import); the SDK only when on
from opentelemetry.trace import Link, SpanKind, Status, StatusCode, set_span_in_context

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SpanExporter
    from opentelemetry.trace import Span, Tracer

    from service.batching.stats import BatchRun

log = logging.getLogger("tensorgate.tracing")

TRACER: Tracer | None = None
"""The server's tracer while tracing is on; None when off (the request path checks only this)."""
_PROVIDER: TracerProvider | None = None

CURRENT: contextvars.ContextVar[RequestTrace | None] = contextvars.ContextVar("trace", default=None)
"""The trace of the request this task answers (each request is its own task)."""

EXPORTERS = ("otlp", "console", "none")


def wanted(setting: bool | None, environ: Mapping[str, str] | None = None) -> bool:
    """Whether tracing is asked for: ``TG_TRACING`` when set, else whether
    ``OTEL_TRACES_EXPORTER`` names an exporter; never with ``OTEL_SDK_DISABLED=true``."""
    env = os.environ if environ is None else environ
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    if setting is not None:
        return setting
    return env.get("OTEL_TRACES_EXPORTER", "").strip().lower() not in ("", "none")


def start(
    setting: bool | None, version: str, exporter: SpanExporter | None = None
) -> TracerProvider | None:
    """Turn tracing on when :func:`wanted` (``exporter``: where spans go instead of what the
    environment names, e.g. a test's in-memory one). Returns the provider, or None when off,
    also when the configuration is unusable (logged as a warning)."""
    global TRACER, _PROVIDER
    stop()
    if exporter is None and not wanted(setting):
        return None
    try:
        provider = _provider(version, exporter)
    except ImportError as exc:
        log.warning("tracing is off: the OpenTelemetry SDK is not installed (%s)", exc)
        return None
    except ValueError as exc:
        log.warning("tracing is off: %s", exc)
        return None
    _PROVIDER, TRACER = provider, provider.get_tracer("tensorgate", version)
    sampler = os.environ.get("OTEL_TRACES_SAMPLER", "").strip().lower() or "parentbased_always_on"
    if sampler in RATIO_SAMPLERS:
        sampler += f" {os.environ.get('OTEL_TRACES_SAMPLER_ARG', '').strip() or '1.0'}"
    log.info("tracing is on: sampler %s", sampler)
    return provider


def stop() -> None:
    """Export what is buffered and turn tracing off (blocks up to the export timeout)."""
    global TRACER, _PROVIDER
    provider, _PROVIDER, TRACER = _PROVIDER, None, None
    if provider is not None:
        provider.shutdown()


def _provider(version: str, exporter: SpanExporter | None) -> TracerProvider:
    """A provider of the SDK's own configuration (sampler, limits, OTEL_BSP_*), with the
    exporters ``OTEL_TRACES_EXPORTER`` names, or ``exporter``. ValueError: unusable."""
    from opentelemetry.sdk.resources import OTELResourceDetector, Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    _check_sampler(os.environ)
    exporters = [exporter] if exporter is not None else _exporters(os.environ)
    resource = Resource.create({"service.name": "tensorgate", "service.version": version})
    provider = TracerProvider(resource=resource.merge(OTELResourceDetector().detect()))
    for chosen in exporters:
        provider.add_span_processor(BatchSpanProcessor(chosen))
    return provider


RATIO_SAMPLERS = ("traceidratio", "parentbased_traceidratio")
SAMPLERS = (
    "always_on",
    "always_off",
    "parentbased_always_on",
    "parentbased_always_off",
    *RATIO_SAMPLERS,
)
"""The samplers the SDK's tracer provider reads from ``OTEL_TRACES_SAMPLER``."""


def _check_sampler(environ: Mapping[str, str]) -> None:
    """ValueError for a sampler, or a ratio sampler's argument, the SDK cannot read: it warned
    and sampled every request (``OTEL_TRACES_SAMPLER_ARG=1%``, or the sampler
    ``parentbased_traceid_ratio``: all 20 of 20 traced, where full tracing cuts a small model's
    throughput to 0.30 ×)."""
    sampler = environ.get("OTEL_TRACES_SAMPLER", "").lower()  # as the SDK reads it: unstripped
    argument = environ.get("OTEL_TRACES_SAMPLER_ARG", "").strip()
    if sampler and sampler not in SAMPLERS:
        close = difflib.get_close_matches(sampler, SAMPLERS, n=1)
        hint = f"did you mean {close[0]}? " if close else ""
        raise ValueError(
            f"OTEL_TRACES_SAMPLER={sampler!r} is no sampler the SDK knows ({hint}"
            f"it knows {', '.join(SAMPLERS)})"
        )
    if sampler not in RATIO_SAMPLERS or not argument:
        return
    try:
        ratio = float(argument)
    except ValueError:
        ratio = -1.0
    if not 0.0 <= ratio <= 1.0:
        raise ValueError(
            f"OTEL_TRACES_SAMPLER_ARG={argument!r} is no ratio from 0 to 1 for {sampler} "
            "(0.01 samples 1 % of traces)"
        )


def _exporters(environ: Mapping[str, str]) -> list[SpanExporter]:
    names = [n.strip().lower() for n in environ.get("OTEL_TRACES_EXPORTER", "otlp").split(",")] or [
        "otlp"
    ]
    unknown = [n for n in names if n not in EXPORTERS]
    if unknown:
        raise ValueError(
            f"OTEL_TRACES_EXPORTER names {', '.join(unknown)}; tensorgate ships "
            f"{', '.join(EXPORTERS)} (otlp is OTLP over HTTP/protobuf)"
        )
    exporters: list[SpanExporter] = []
    if "otlp" in names:
        protocol = environ.get(
            "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", environ.get("OTEL_EXPORTER_OTLP_PROTOCOL", "")
        ).strip()
        if protocol not in ("", "http/protobuf"):
            raise ValueError(
                f"OTLP protocol {protocol!r} is not shipped: tensorgate exports OTLP over "
                "http/protobuf (a collector's port 4318); set OTEL_EXPORTER_OTLP_PROTOCOL="
                "http/protobuf"
            )
        for variable in ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT"):
            endpoint = environ.get(variable, "").strip()
            url = urlparse(endpoint)
            if endpoint and (url.scheme not in ("http", "https") or not url.netloc):
                raise ValueError(
                    f"{variable}={endpoint!r} is not an http(s) URL (e.g. http://collector:4318)"
                )
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        exporters.append(OTLPSpanExporter())
    if "console" in names:
        from opentelemetry.sdk.trace.export import ConsoleSpanExporter

        exporters.append(ConsoleSpanExporter())
    return exporters


CALLER: contextvars.ContextVar[str | None] = contextvars.ContextVar("caller_trace", default=None)
"""The trace id of the request's ``traceparent``, whether or not this server records the
request: the access log names it, so that a log line joins the caller's trace also when
tracing is off or the sampler left the request out (99 % of them at a ratio of 0.01)."""
_TRACEPARENT = re.compile(r"[0-9a-f]{2}-([0-9a-f]{32})-[0-9a-f]{16}-[0-9a-f]{2}")


def note_caller(carrier: Mapping[str, str]) -> None:
    """Keep the trace id of ``carrier``'s ``traceparent`` (W3C) as :data:`CALLER`."""
    given = carrier.get("traceparent")
    if given is None:
        return
    found = _TRACEPARENT.fullmatch(given.strip())
    if found is not None and found.group(1) != "0" * 32:
        CALLER.set(found.group(1))


def begin(name: str, carrier: Mapping[str, str], request_id: str) -> RequestTrace | None:
    """The trace of one inference request, continuing the ``traceparent`` (and ``tracestate``)
    in ``carrier`` (lower-case header or metadata names); None when tracing is off or the
    sampler drops it. Set as :data:`CURRENT` for the request's task."""
    tracer = TRACER
    if tracer is None:
        return None
    parent = propagate.extract(carrier)
    span = tracer.start_span(name, parent, SpanKind.SERVER, {"tensorgate.request_id": request_id})
    if not span.is_recording():
        return None
    trace = RequestTrace(tracer, span)
    CURRENT.set(trace)
    return trace


def step(caller: object, model: str, version: str) -> RequestTrace | None:
    """The span of a pipeline step on ``model`` that the traced request ``caller`` (its
    ``RequestTiming.trace``) called: its child, which the step's batch reports to as a request
    of its own; None when ``caller`` is not a trace (tracing off, or the request not sampled)."""
    if not isinstance(caller, RequestTrace):
        return None
    span = caller.tracer.start_span(
        "step",
        set_span_in_context(caller.span),
        SpanKind.INTERNAL,
        {"tensorgate.model": model, "tensorgate.model.version": version},
    )
    return RequestTrace(caller.tracer, span)


class RequestTrace:
    """One request's server span and the stage times it collects on its way (monotonic ns),
    made into child spans when it ends. Implements the scheduler's ``BatchTrace``."""

    __slots__ = ("_offset", "device", "span", "stages", "tracer")

    def __init__(self, tracer: Tracer, span: Span) -> None:
        self.tracer, self.span = tracer, span
        self._offset = time.time_ns() - time.monotonic_ns()
        """Epoch ns − monotonic ns, taken once: a request's spans share one clock."""
        self.stages: list[tuple[str, int, int]] = []
        self.device = ""

    @property
    def ids(self) -> tuple[str, str]:
        """The span's trace id and span id, as W3C ``traceparent`` writes them."""
        context = self.span.get_span_context()
        return f"{context.trace_id:032x}", f"{context.span_id:016x}"

    def stage(self, name: str, started_ns: int, ended_ns: int) -> None:
        """A stage of the request, from ``started_ns`` to ``ended_ns`` (time.monotonic_ns)."""
        self.stages.append((name, started_ns, ended_ns))

    def batch_ran(self, run: BatchRun, members: Sequence[tuple[Any, float, bool]]) -> None:
        """The batch this request led ran: one ``compute`` span, this request's child, linked to
        each member's span; each member's ``queue`` (or, for an item made on the instance,
        ``preprocess``) stage. ``members``: (trace, enqueued monotonic s, made on the
        instance), this request's own first."""
        to_ns = 1_000_000_000
        compute = self.tracer.start_span(
            "compute",
            set_span_in_context(self.span),
            attributes={
                "tensorgate.model": run.model,
                "tensorgate.instance": run.instance,
                "tensorgate.device": run.device,
                "tensorgate.batch.rows": run.rows,
                "tensorgate.batch.requests": run.requests,
            },
            links=[Link(trace.span.get_span_context()) for trace, _, _ in members],
            start_time=self._offset + int(run.started * to_ns),
        )
        compute.end(self._offset + int(run.started * to_ns) + run.infer_ns)
        link = compute.get_span_context()
        begun_ns = int(run.begun * to_ns)
        for trace, enqueued, made_here in members:
            if made_here:  # made on the instance's thread: no queue, its preprocessing here
                trace.stage("preprocess", begun_ns, run.prepared_ns)
            else:
                trace.stage("queue", int(enqueued * to_ns), begun_ns)
            if trace is not self:
                trace.span.add_link(link, {"tensorgate.link": "batch"})

    def end(self, error: bool, attributes: Mapping[str, Any]) -> None:
        """The request is answered (``error``: as a server error; ``attributes``: the
        protocol's status): its stages become child spans and its span ends."""
        span, offset = self.span, self._offset
        span.set_attributes(attributes)
        if self.device:
            span.set_attribute("tensorgate.device", self.device)
        if error:
            span.set_status(Status(StatusCode.ERROR))
        context = set_span_in_context(span)
        for name, started, ended in self.stages:
            child = self.tracer.start_span(name, context, start_time=offset + started)
            child.end(offset + ended)
        span.end()
