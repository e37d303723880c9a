"""OpenTelemetry traces: the client's ``traceparent`` is continued over REST and gRPC, each
inference request is one server span with its stages as children, a batch is one ``compute``
span linked to every request in it, access-log lines carry the ids, and health, metrics and
readiness make no span. Spans go to the SDK's in-memory exporter in these tests; a real server
process exporting OTLP over HTTP is tested at the end."""

from __future__ import annotations

import asyncio
import http.server
import json
import logging
import os
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import ClassVar

import grpc
import orjson
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

from service.protocol.pb import grpc_service_pb2 as pb
from service.protocol.pb import grpc_service_pb2_grpc as pb_grpc
from service.settings import Settings
from service.telemetry import tracing
from tests.asgi import InProcess, Reply, call
from tests.server import Server, free_port

pytestmark = pytest.mark.integration

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_ID = "00f067aa0ba902b7"
TRACEPARENT = f"00-{TRACE_ID}-{PARENT_ID}-01"
DIGIT = orjson.dumps(
    {"inputs": [{"name": "image", "datatype": "FP32", "shape": [1, 1, 8, 8], "data": [0.5] * 64}]}
)
STAGES = {"decode", "preprocess", "queue", "compute", "postprocess", "encode"}


@pytest.fixture(scope="module")
def traced(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[InProcess, InMemorySpanExporter]]:
    """digits, traced into memory; batches of 4 run at once (and wait up to 2 s for the 4th)."""
    from tests.server import copy_model

    root = tmp_path_factory.mktemp("traced") / "models"
    folder = copy_model("digits", root / "digits")
    config = folder / "config.yaml"
    config.write_text(
        config.read_text() + "batching: {max_queue_delay_ms: 2000, preferred_batch_sizes: [1, 4]}\n"
    )
    exporter = InMemorySpanExporter()
    settings = Settings(model_repository=root, grpc_port=free_port(), access_log=True)
    running = InProcess(settings, exporter)
    try:
        yield running, exporter
    finally:
        running.close()


def _flush() -> None:
    provider = tracing._PROVIDER
    assert provider is not None, "tracing is on"
    provider.force_flush()


def _spans(exporter: InMemorySpanExporter) -> list[ReadableSpan]:
    _flush()
    spans = list(exporter.get_finished_spans())
    exporter.clear()
    return spans


def _infer(running: InProcess, headers: list[tuple[str, str]]) -> Reply:
    return running.request(
        running.serving,
        "POST",
        "/v2/models/digits/infer",
        DIGIT,
        [("content-type", "application/json"), *headers],
    )


def _children(spans: list[ReadableSpan], parent: ReadableSpan) -> dict[str, ReadableSpan]:
    own = parent.context.span_id
    return {s.name: s for s in spans if s.parent is not None and s.parent.span_id == own}


def test_a_traceparent_is_continued_and_the_stages_are_children(
    traced: tuple[InProcess, InMemorySpanExporter],
) -> None:
    running, exporter = traced
    _spans(exporter)
    reply = _infer(running, [("traceparent", TRACEPARENT), ("x-request-id", "trace-me-1")])
    assert reply.status == 200, reply.body
    spans = _spans(exporter)
    [server] = [s for s in spans if s.kind is SpanKind.SERVER]
    assert server.name == "POST /v2/models/{name}/infer"
    assert f"{server.context.trace_id:032x}" == TRACE_ID
    assert server.parent is not None and f"{server.parent.span_id:016x}" == PARENT_ID
    attributes = dict(server.attributes or {})
    assert attributes["tensorgate.model"] == "digits"
    assert attributes["tensorgate.model.version"] == "1"
    assert attributes["tensorgate.request_id"] == "trace-me-1"
    assert attributes["http.response.status_code"] == 200
    assert attributes["tensorgate.rows"] == 1
    assert attributes["tensorgate.device"] == "cpu"
    children = _children(spans, server)
    assert set(children) == STAGES, sorted(children)
    assert all(s.context.trace_id == server.context.trace_id for s in spans)
    for child in children.values():  # inside the request's span, in order of the stages
        assert server.start_time <= child.start_time <= child.end_time <= server.end_time
    order = ["decode", "preprocess", "queue", "compute", "postprocess", "encode"]
    starts = [children[name].start_time for name in order]
    assert starts == sorted(starts)
    compute = dict(children["compute"].attributes or {})
    assert compute["tensorgate.batch.rows"] == 1
    assert compute["tensorgate.device"] == "cpu"


def test_without_a_traceparent_a_new_trace_starts(
    traced: tuple[InProcess, InMemorySpanExporter],
) -> None:
    running, exporter = traced
    _spans(exporter)
    assert _infer(running, []).status == 200
    [server] = [s for s in _spans(exporter) if s.kind is SpanKind.SERVER]
    assert server.parent is None
    assert f"{server.context.trace_id:032x}" != TRACE_ID


def test_a_batch_is_one_compute_span_linked_to_each_request(
    traced: tuple[InProcess, InMemorySpanExporter],
) -> None:
    running, exporter = traced
    _spans(exporter)

    async def four() -> list[Reply]:
        return await asyncio.gather(
            *(
                call(
                    running.serving,
                    "POST",
                    "/v2/models/digits/infer",
                    DIGIT,
                    [("content-type", "application/json"), ("x-request-id", f"batch-{i}")],
                    False,
                )
                for i in range(4)
            )
        )

    replies = running.run(four())
    assert [r.status for r in replies] == [200] * 4
    spans = _spans(exporter)
    servers = [s for s in spans if s.kind is SpanKind.SERVER]
    assert len(servers) == 4
    [compute] = [s for s in spans if s.name == "compute"]
    assert dict(compute.attributes or {})["tensorgate.batch.requests"] == 4
    assert dict(compute.attributes or {})["tensorgate.batch.rows"] == 4
    linked = {link.context.span_id for link in compute.links}
    assert linked == {s.context.span_id for s in servers}
    # each request has its own queue stage; those not leading the batch link to its compute
    for server in servers:
        children = _children(spans, server)
        assert "queue" in children
        if "compute" not in children:
            assert compute.context.span_id in {link.context.span_id for link in server.links}
    leaders = [s for s in servers if "compute" in _children(spans, s)]
    assert len(leaders) == 1


def test_errors_are_traced_with_their_status(
    traced: tuple[InProcess, InMemorySpanExporter],
) -> None:
    running, exporter = traced
    _spans(exporter)
    bad = running.request(
        running.serving,
        "POST",
        "/v2/models/digits/infer",
        b'{"inputs": [{"name": "image", "datatype": "FP32", "shape": [1, 1, 8, 8], "data": [1]}]}',
        [("traceparent", TRACEPARENT)],
    )
    assert bad.status == 400
    missing = running.request(running.serving, "POST", "/v2/models/nope/infer", DIGIT, [])
    assert missing.status == 404
    servers = {
        dict(s.attributes or {})["http.response.status_code"]: s
        for s in _spans(exporter)
        if s.kind is SpanKind.SERVER
    }
    assert set(servers) == {400, 404}
    assert f"{servers[400].context.trace_id:032x}" == TRACE_ID
    assert dict(servers[404].attributes or {}).get("tensorgate.model") == "nope"


def test_health_metrics_and_readiness_make_no_span(
    traced: tuple[InProcess, InMemorySpanExporter],
) -> None:
    running, exporter = traced
    _spans(exporter)
    for path in ("/v2/health/live", "/v2/health/ready", "/v2/models/digits/ready", "/metrics"):
        reply = running.request(running.serving, "GET", path, b"", [("traceparent", TRACEPARENT)])
        assert reply.status == 200, path
    assert _spans(exporter) == []


def test_grpc_continues_the_traceparent_of_its_metadata(
    traced: tuple[InProcess, InMemorySpanExporter],
) -> None:
    running, exporter = traced
    _spans(exporter)
    request = pb.ModelInferRequest(model_name="digits")
    tensor = request.inputs.add(name="image", datatype="FP32", shape=[1, 1, 8, 8])
    tensor.contents.fp32_contents.extend([0.5] * 64)
    port = running.app.state.dataplane.settings.grpc_port
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        metadata = [("traceparent", TRACEPARENT), ("x-request-id", "grpc-trace")]
        stub.ModelInfer(request, metadata=metadata, timeout=30)
        stub.ServerLive(pb.ServerLiveRequest(), metadata=[("traceparent", TRACEPARENT)])
    spans = _spans(exporter)
    [server] = [s for s in spans if s.kind is SpanKind.SERVER]
    assert server.name == "inference.GRPCInferenceService/ModelInfer"
    assert f"{server.context.trace_id:032x}" == TRACE_ID
    attributes = dict(server.attributes or {})
    assert attributes["rpc.system"] == "grpc"
    assert attributes["rpc.grpc.status_code"] == 0
    assert attributes["tensorgate.request_id"] == "grpc-trace"
    assert set(_children(spans, server)) == STAGES


def test_each_request_of_a_stream_is_its_own_span_in_the_stream_s_trace(
    traced: tuple[InProcess, InMemorySpanExporter],
) -> None:
    running, exporter = traced
    _spans(exporter)
    requests = []
    for i in range(2):
        request = pb.ModelInferRequest(model_name="digits", id=f"stream-{i}")
        tensor = request.inputs.add(name="image", datatype="FP32", shape=[1, 1, 8, 8])
        tensor.contents.fp32_contents.extend([0.5] * 64)
        requests.append(request)
    port = running.app.state.dataplane.settings.grpc_port
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        answers = list(
            stub.ModelStreamInfer(iter(requests), metadata=[("traceparent", TRACEPARENT)])
        )
    assert [a.error_message for a in answers] == ["", ""]
    servers = [s for s in _spans(exporter) if s.kind is SpanKind.SERVER]
    assert {s.name for s in servers} == {"inference.GRPCInferenceService/ModelStreamInfer"}
    assert {dict(s.attributes or {})["tensorgate.request_id"] for s in servers} == {
        "stream-0",
        "stream-1",
    }
    assert {f"{s.context.trace_id:032x}" for s in servers} == {TRACE_ID}


def test_access_log_lines_carry_the_trace_and_span_ids(
    traced: tuple[InProcess, InMemorySpanExporter], caplog: pytest.LogCaptureFixture
) -> None:
    running, exporter = traced
    _spans(exporter)
    with caplog.at_level(logging.INFO, logger="tensorgate.access"):
        assert _infer(running, [("traceparent", TRACEPARENT)]).status == 200
    [server] = [s for s in _spans(exporter) if s.kind is SpanKind.SERVER]
    [line] = [r for r in caplog.records if r.name == "tensorgate.access"]
    assert line.__dict__["trace_id"] == TRACE_ID
    assert line.__dict__["span_id"] == f"{server.context.span_id:016x}"


@pytest.mark.unit
def test_an_unusable_configuration_is_a_warning_and_tracing_stays_off(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    ratio = "OTEL_TRACES_SAMPLER=parentbased_traceidratio"
    for setting, says in (
        ("OTEL_TRACES_EXPORTER=zipkin", "tensorgate ships otlp, console, none"),
        ("OTEL_EXPORTER_OTLP_PROTOCOL=grpc", "http/protobuf"),
        ("OTEL_EXPORTER_OTLP_ENDPOINT=collector:4318", "not an http(s) URL"),
        # the SDK warned and sampled every request
        (f"{ratio} OTEL_TRACES_SAMPLER_ARG=1%", "'1%' is no ratio from 0 to 1"),
        (f"{ratio} OTEL_TRACES_SAMPLER_ARG=2", "'2' is no ratio from 0 to 1"),
        # so it did for a sampler it did not know (20 of 20 traced at "0.01")
        (
            "OTEL_TRACES_SAMPLER=parentbased_traceid_ratio OTEL_TRACES_SAMPLER_ARG=0.01",
            "OTEL_TRACES_SAMPLER='parentbased_traceid_ratio' is no sampler the SDK knows (did "
            "you mean parentbased_traceidratio?",
        ),
        ("OTEL_TRACES_SAMPLER=bogus", "'bogus' is no sampler the SDK knows (it knows always_on"),
    ):
        with monkeypatch.context() as patched:
            patched.setenv("OTEL_TRACES_EXPORTER", "otlp")
            for variable, value in (pair.split("=", 1) for pair in setting.split()):
                patched.setenv(variable, value)
            caplog.clear()
            with caplog.at_level(logging.WARNING, logger="tensorgate.tracing"):
                assert tracing.start(None, "test") is None
            assert tracing.TRACER is None
            assert says in caplog.text, caplog.text


@pytest.mark.unit
def test_tracing_is_off_unless_asked_for() -> None:
    assert not tracing.wanted(None, {})
    assert not tracing.wanted(None, {"OTEL_TRACES_EXPORTER": "none"})
    assert tracing.wanted(None, {"OTEL_TRACES_EXPORTER": "otlp"})
    assert tracing.wanted(True, {})
    assert not tracing.wanted(False, {"OTEL_TRACES_EXPORTER": "otlp"})
    assert not tracing.wanted(True, {"OTEL_SDK_DISABLED": "true"})


class _Collector(http.server.BaseHTTPRequestHandler):
    """An OTLP/HTTP trace receiver: each POST /v1/traces body, decoded."""

    received: ClassVar[list[trace_service_pb2.ExportTraceServiceRequest]] = []

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers["content-length"]))
        message = trace_service_pb2.ExportTraceServiceRequest()
        message.ParseFromString(body)
        _Collector.received.append(message)
        self.send_response(200)
        self.send_header("content-type", "application/x-protobuf")
        self.send_header("content-length", "0")
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


def test_a_server_process_exports_otlp_over_http_as_the_environment_says(
    repository: Path, tmp_path: Path
) -> None:
    """``python -m service serve`` with only the standard OTEL_* variables set: its spans
    arrive at a collector on 127.0.0.1, under the service name given, continuing the
    traceparent; the access log names the same trace."""
    collector = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Collector)
    threading.Thread(target=collector.serve_forever, daemon=True).start()
    _Collector.received = []
    env = {
        "OTEL_TRACES_EXPORTER": "otlp",
        "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{collector.server_address[1]}",
        "OTEL_SERVICE_NAME": "tensorgate-under-test",
        "OTEL_BSP_SCHEDULE_DELAY": "100",
        "TG_ACCESS_LOG": "true",
        "TG_DRAIN_PRE_STOP_S": "0",
    }
    log = tmp_path / "server.log"
    server = Server(repository, env=env, log_path=log)
    try:
        server.wait_until()
        reply = server.client.post(
            "/v2/models/digits/infer",
            content=DIGIT,
            headers={"content-type": "application/json", "traceparent": TRACEPARENT},
        )
        assert reply.status_code == 200, reply.text
    finally:
        assert server.stop() == 0  # SIGTERM: what is buffered is exported on the way out
        collector.shutdown()
    spans = [
        (resource_spans.resource, span)
        for message in _Collector.received
        for resource_spans in message.resource_spans
        for scope in resource_spans.scope_spans
        for span in scope.spans
    ]
    names = {span.name for _, span in spans}
    assert "POST /v2/models/{name}/infer" in names and names >= STAGES, names
    services = {
        a.value.string_value
        for resource, _ in spans
        for a in resource.attributes
        if a.key == "service.name"
    }
    assert services == {"tensorgate-under-test"}
    assert {span.trace_id.hex() for _, span in spans} == {TRACE_ID}
    lines = [json.loads(line) for line in log.read_text().splitlines() if line.startswith("{")]
    access = [line for line in lines if line.get("logger") == "tensorgate.access"]
    assert access and access[-1]["trace_id"] == TRACE_ID
    assert os.environ.get("OTEL_TRACES_EXPORTER") is None  # the test's process is untouched


@pytest.mark.unit
def test_a_sampler_is_read_as_the_sdk_reads_it_unstripped() -> None:
    """The SDK lowercases OTEL_TRACES_SAMPLER but does not strip it: "traceidratio " is no
    sampler to it (it traced every request), and so it is none here either."""
    with pytest.raises(ValueError, match="did you mean traceidratio"):
        tracing._check_sampler({"OTEL_TRACES_SAMPLER": "traceidratio "})
    tracing._check_sampler(
        {"OTEL_TRACES_SAMPLER": "TraceIdRatio", "OTEL_TRACES_SAMPLER_ARG": "0.5"}
    )
