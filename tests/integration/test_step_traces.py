"""A pipeline's steps in its request's trace: each call of ``self.models.infer`` in a model's
own code is a ``step`` span, the request's child, with the step's own ``queue`` and ``compute``
under it. The bundled face detector (its code over three served models) on a real photo,
traced into the SDK's in-memory exporter."""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator

import pytest
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from service.settings import Settings
from service.telemetry import tracing
from tests.asgi import InProcess
from tests.server import MODELS, copy_model

pytestmark = pytest.mark.integration

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
TRACEPARENT = f"00-{TRACE_ID}-00f067aa0ba902b7-01"
STEPS = ("faces_pnet", "faces_rnet", "faces_onet")


@pytest.fixture(scope="module")
def faces(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[InProcess, InMemorySpanExporter]]:
    root = tmp_path_factory.mktemp("steps") / "models"
    for name in ("faces", *STEPS):
        copy_model(name, root / name)
    exporter = InMemorySpanExporter()
    running = InProcess(Settings(model_repository=root), exporter)
    try:
        yield running, exporter
    finally:
        running.close()


def _astronaut() -> bytes:
    spec = importlib.util.spec_from_file_location("faces_build", MODELS / "faces" / "build.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    photo: bytes = module.photo("astronaut")
    return photo


def _detect(running: InProcess, traceparent: str) -> None:
    """The astronaut, sent to the face detector with ``traceparent``; it answers 200."""
    reply = running.request(
        running.serving,
        "POST",
        "/v1/models/faces:predict",
        _astronaut(),
        [("content-type", "image/jpeg"), ("traceparent", traceparent)],
    )
    assert reply.status == 200, reply.body


def _spans(exporter: InMemorySpanExporter) -> list[ReadableSpan]:
    provider = tracing._PROVIDER
    assert provider is not None, "tracing is on"
    provider.force_flush()
    spans = list(exporter.get_finished_spans())
    exporter.clear()
    return spans


def _children(spans: list[ReadableSpan], parent: ReadableSpan) -> list[ReadableSpan]:
    own = parent.context.span_id
    return [s for s in spans if s.parent is not None and s.parent.span_id == own]


def test_each_step_is_a_span_of_its_request_with_its_own_queue_and_compute(
    faces: tuple[InProcess, InMemorySpanExporter],
) -> None:
    running, exporter = faces
    _spans(exporter)
    _detect(running, TRACEPARENT)
    spans = _spans(exporter)
    [server] = [s for s in spans if s.kind is SpanKind.SERVER]
    assert dict(server.attributes or {})["tensorgate.model"] == "faces"
    steps = [s for s in _children(spans, server) if s.name == "step"]
    called = [dict(s.attributes or {})["tensorgate.model"] for s in steps]
    # the pyramid's scales each run the proposal net, then the refine and output nets
    assert set(called) == set(STEPS), called
    assert called.count("faces_pnet") > 1
    assert called.index("faces_onet") > called.index("faces_rnet") > called.index("faces_pnet")
    for step in steps:
        attributes = dict(step.attributes or {})
        assert step.kind is SpanKind.INTERNAL
        assert attributes["tensorgate.model.version"] == "1"
        assert attributes["tensorgate.status"] == 200
        assert step.status.status_code is StatusCode.UNSET
        assert f"{step.context.trace_id:032x}" == TRACE_ID
        assert server.start_time <= step.start_time <= step.end_time <= server.end_time
        own = {s.name: s for s in _children(spans, step)}
        assert "queue" in own, sorted(own)  # each step waits in its model's queue
        runs = [s for s in spans if s.name == "compute"]  # and runs in a batch of that model
        assert any(
            dict(r.attributes or {})["tensorgate.model"] == attributes["tensorgate.model"]
            and step.context.span_id in {link.context.span_id for link in r.links}
            for r in runs
        )


def test_an_untraced_request_makes_no_step_spans(
    faces: tuple[InProcess, InMemorySpanExporter],
) -> None:
    """Sampled out (a traceparent whose flags say not sampled): neither it nor its steps."""
    running, exporter = faces
    _spans(exporter)
    _detect(running, f"00-{TRACE_ID}-00f067aa0ba902b7-00")
    assert _spans(exporter) == []
