"""What an SRE checks: metrics, access logs, auth, limits, drain on SIGTERM, live updates."""

from __future__ import annotations

import io
import json
import signal
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
import yaml
from PIL import Image
from prometheus_client.parser import text_string_to_metric_families

from tests.server import Server, copy_model

pytestmark = pytest.mark.integration
API = "api-s3cret-token-123"
DIGIT = {
    "inputs": [{"name": "image", "datatype": "FP32", "shape": [2, 1, 8, 8], "data": [0.5] * 128}]
}


@pytest.fixture(scope="module")
def ops(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    root = tmp_path_factory.mktemp("ops") / "models"
    copy_model("digits", root / "digits")
    env = {"TG_API_TOKEN": API, "TG_MAX_BODY_BYTES": "200000", "TG_MAX_TENSOR_ELEMENTS": "4096"}
    server = Server(root, env=env, log_path=root.parent / "server.log")
    server.client.headers["Authorization"] = f"Bearer {API}"
    try:
        server.wait_until()
        yield server
    finally:
        server.stop()


def samples(server: Server) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = httpx.get(f"{server.url}/metrics").text  # no token: metrics stay open
    found = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            found[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return found


def metric(
    found: dict[tuple[str, tuple[tuple[str, str], ...]], float], name: str, **labels: str
) -> float:
    return found.get((name, tuple(sorted(labels.items()))), 0.0)


def test_metrics_count_exactly_what_was_served(ops: Server) -> None:
    before = samples(ops)
    # server-side failures are series from 0 before the first one: rate() counts that one too
    for protocol in ("v1", "v2", "grpc"):
        for failed in ("error", "unavailable", "timeout"):
            labels = {"model": "digits", "version": "1", "protocol": protocol, "outcome": failed}
            key = ("tensorgate_requests_total", tuple(sorted(labels.items())))
            assert key in before, labels
    for _ in range(7):
        assert ops.client.post("/v2/models/digits/infer", json=DIGIT).status_code == 200
    for _ in range(3):
        assert ops.client.post("/v2/models/digits/infer", json={"inputs": []}).status_code == 400
    png = io.BytesIO()
    Image.new("L", (8, 8), 128).save(png, format="PNG")
    assert (
        ops.client.post(
            "/v1/models/digits:predict",
            content=png.getvalue(),
            headers={"content-type": "image/png"},
        ).status_code
        == 200
    )
    after = samples(ops)
    ok = {"model": "digits", "version": "1", "protocol": "v2", "outcome": "success"}
    bad = {**ok, "outcome": "bad_request"}
    assert (
        metric(after, "tensorgate_requests_total", **ok)
        - metric(before, "tensorgate_requests_total", **ok)
        == 7
    )
    assert (
        metric(after, "tensorgate_requests_total", **bad)
        - metric(before, "tensorgate_requests_total", **bad)
        == 3
    )
    v1 = {**ok, "protocol": "v1"}
    assert (
        metric(after, "tensorgate_requests_total", **v1)
        - metric(before, "tensorgate_requests_total", **v1)
        == 1
    )
    rows = metric(after, "tensorgate_inference_rows_total", model="digits", version="1")
    assert (
        rows - metric(before, "tensorgate_inference_rows_total", model="digits", version="1") == 15
    )
    executions = metric(after, "tensorgate_executions_total", model="digits", version="1")
    assert metric(after, "tensorgate_batch_size_count", model="digits", version="1") == executions
    assert metric(after, "tensorgate_batch_size_sum", model="digits", version="1") >= rows
    v2_latency = {"model": "digits", "protocol": "v2"}
    assert (
        metric(after, "tensorgate_request_duration_seconds_count", **v2_latency)
        - metric(before, "tensorgate_request_duration_seconds_count", **v2_latency)
        == 10
    )
    for stage in ("queue", "compute", "preprocess", "postprocess"):
        assert metric(after, f"tensorgate_{stage}_duration_seconds_count", model="digits") >= 8
    assert metric(after, "tensorgate_model_state", model="digits", version="1", state="READY") == 1
    assert (
        metric(after, "tensorgate_unwarmed_shape_requests_total", model="digits", version="1") == 0
    )
    assert metric(after, "process_resident_memory_bytes") > 10_000_000  # the conventional name
    pending = ("tensorgate_pending_requests", (("model", "digits"), ("version", "1")))
    assert after[pending] == 0  # one series per version, labelled by it
    assert metric(after, "tensorgate_warmup_duration_seconds", model="digits", version="1") > 0
    # what the dashboard and alerts compare (deploy/grafana, deploy/prometheus): idle now
    version = {"model": "digits", "version": "1"}
    assert metric(after, "tensorgate_queued_requests", **version) == 0
    assert metric(after, "tensorgate_queue_capacity", **version) == 256  # max_queue_size default
    assert metric(after, "tensorgate_instances", **version) == 1
    assert metric(after, "tensorgate_instances_busy", **version) == 0
    assert metric(after, "tensorgate_longest_batch_seconds", **version) == 0
    assert metric(after, "tensorgate_memory_limit_bytes") > 100_000_000
    assert metric(after, "tensorgate_requests_in_flight") == 0


def test_label_values_are_only_names_that_exist(ops: Server) -> None:
    """A client picks the name and version in the URL: neither may become a label value, or
    every new string would add series to /metrics for good."""
    for name, version in (("nosuchmodel-x1", None), ("digits", "nosuchversion-x1")):
        path = (
            f"/v2/models/{name}/versions/{version}/infer" if version else f"/v2/models/{name}/infer"
        )
        assert ops.client.post(path, json=DIGIT).status_code == 404
    text = ops.client.get("/metrics").text
    assert "nosuchmodel-x1" not in text and "nosuchversion-x1" not in text
    assert "_created" not in text  # a timestamp series per counter that rate() never needs
    assert "tensorgate_process_" not in text
    assert 'tensorgate_queue_duration_seconds_count{model=""}' not in text  # stages: successes
    assert (
        metric(
            samples(ops),
            "tensorgate_requests_total",
            model="digits",
            version="",
            protocol="v2",
            outcome="not_found",
        )
        >= 1
    )


def test_one_json_access_line_per_request_with_its_id(ops: Server) -> None:
    ops.client.post("/v2/models/digits/infer", json=DIGIT, headers={"X-Request-ID": "trace-ops-1"})
    ops.client.post(
        "/v2/models/digits/infer", json={"inputs": []}, headers={"X-Request-ID": "trace-ops-2"}
    )
    ops.wait_for(lambda: "trace-ops-2" in ops.log())
    lines = [json.loads(line) for line in ops.log().splitlines() if line.startswith("{")]
    ok = [
        line
        for line in lines
        if line.get("request_id") == "trace-ops-1" and line["logger"] == "tensorgate.access"
    ]
    bad = [
        line
        for line in lines
        if line.get("request_id") == "trace-ops-2" and line["logger"] == "tensorgate.access"
    ]
    assert len(ok) == 1 and len(bad) == 1
    assert ok[0]["model"] == "digits" and ok[0]["version"] == "1" and ok[0]["status"] == 200
    assert {"duration_ms", "preprocess_ms", "queue_ms", "compute_ms", "postprocess_ms"} <= set(
        ok[0]
    )
    assert bad[0]["status"] == 400


@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("POST", "/v2/models/digits/infer"),
        ("POST", "/v2/models/digits/versions/1/infer"),
        ("POST", "/v1/models/digits:predict"),
        ("GET", "/v2/models/digits"),
        ("GET", "/v2"),
        ("GET", "/v2/models/digits/config"),
        ("GET", "/v2/models/digits/stats"),
    ],
)
def test_protected_routes_need_the_api_token(ops: Server, method: str, path: str) -> None:
    for headers in ({}, {"Authorization": "Bearer nope"}, {"Authorization": API}):
        response = httpx.request(method, f"{ops.url}{path}", headers=headers, json=DIGIT)
        assert response.status_code == 401, (path, headers)
        assert response.headers["www-authenticate"] == 'Bearer realm="api"'
    right = httpx.request(
        method, f"{ops.url}{path}", headers={"Authorization": f"Bearer {API}"}, json=DIGIT
    )
    assert right.status_code != 401


def test_health_and_metrics_stay_open_and_management_is_absent(ops: Server) -> None:
    assert httpx.get(f"{ops.url}/v2/health/live").status_code == 200
    assert httpx.get(f"{ops.url}/v2/health/ready").status_code == 200
    assert httpx.get(f"{ops.url}/metrics").status_code == 200
    assert ops.client.post("/v2/repository/index").status_code == 404  # no admin token set


def bomb() -> bytes:
    buffer = io.BytesIO()
    Image.new("1", (12_000, 12_000)).save(buffer, format="PNG")
    return buffer.getvalue()


@pytest.mark.parametrize(
    ("path", "body", "content_type", "status", "message"),
    [
        (
            "/v2/models/digits/infer",
            b"{" + b" " * 300_000 + b"}",
            "application/json",
            413,
            "300002 bytes; the limit is 200000",
        ),
        (
            "/v2/models/digits/infer",
            json.dumps(
                {
                    "inputs": [
                        {
                            "name": "image",
                            "datatype": "FP32",
                            "shape": [100, 1, 8, 8],
                            "data": [0.0] * 6400,
                        }
                    ]
                }
            ).encode(),
            "application/json",
            413,
            "6400 elements; the limit is 4096",
        ),
        ("/v1/models/digits:predict", bomb(), "image/png", 400, "image too large"),
        (
            "/v2/models/..%2F..%2Fetc%2Fpasswd/infer",
            b"{}",
            "application/json",
            400,
            "an encoded slash (%2F)",
        ),
        ("/v2/models/%2e%2e/infer", b"{}", "application/json", 404, "unknown model '..'"),
        ("/v2/models//etc/passwd/infer", b"{}", "application/json", 404, ""),
    ],
)
def test_limits_and_hostile_inputs_get_a_4xx_and_the_server_goes_on(
    ops: Server, path: str, body: bytes, content_type: str, status: int, message: str
) -> None:
    response = ops.client.post(path, content=body, headers={"content-type": content_type})
    assert response.status_code == status, response.text
    assert message in response.json()["error"]
    assert ops.client.post("/v2/models/digits/infer", json=DIGIT).status_code == 200


def test_a_chunked_body_without_length_is_cut_off_at_the_limit(ops: Server) -> None:
    response = httpx.post(
        f"{ops.url}/v2/models/digits/infer",
        content=iter([b"{" * 1024] * 400),
        headers={"Authorization": f"Bearer {API}", "content-type": "application/json"},
    )
    assert response.status_code == 413
    assert "exceeds the limit of 200000 bytes" in response.json()["error"]


# -- drain on SIGTERM, with the real `tensorgate serve` process and a bounded load ----------


@pytest.mark.parametrize("workers", ["1", "2"])
def test_sigterm_mid_load_drains_every_accepted_request_and_exits_0(
    tmp_path: Path, workers: str
) -> None:
    root = tmp_path / "models"
    copy_model("digits", root / "digits")
    env = {
        "TG_DRAIN_PRE_STOP_S": "2.0",  # the readiness loop sees 503 within it, on a loaded machine too
        "TG_DRAIN_GRACE_S": "20",
        "TG_ACCESS_LOG": "false",
        "TG_WORKERS": workers,
    }
    server = Server(root, env=env, log_path=tmp_path / "server.log")
    server.wait_until()
    events: list[tuple[float, str, int]] = []
    lock = threading.Lock()
    stop = threading.Event()

    def note(kind: str, code: int) -> None:
        with lock:
            events.append((time.monotonic(), kind, code))

    def client_loop() -> None:
        for _ in range(2000):  # bounded
            try:
                code = httpx.post(
                    f"{server.url}/v2/models/digits/infer", json=DIGIT, timeout=30
                ).status_code
            except httpx.ConnectError:
                note("refused", 0)
                return
            note("infer", code)
            if code != 200:
                return

    def readiness_loop() -> None:
        while not stop.is_set():
            try:
                code = httpx.get(f"{server.url}/v2/health/ready", timeout=5).status_code
            except httpx.TransportError:
                return
            note("ready", code)

    with ThreadPoolExecutor(5) as pool:
        clients = [pool.submit(client_loop) for _ in range(4)]
        pool.submit(readiness_loop)
        server.wait_for(lambda: sum(1 for e in events if e[1] == "infer") > 50)
        server.process.send_signal(signal.SIGTERM)
        for client in clients:
            client.result(timeout=60)
        stop.set()
    assert server.process.wait(timeout=60) == 0
    infers = [e for e in events if e[1] == "infer"]
    refusals = [e for e in events if e[1] == "refused" or (e[1] == "infer" and e[2] == 503)]
    first_not_ready = min(t for t, kind, code in events if kind == "ready" and code == 503)
    assert refusals, "the load never met a refusal"
    assert first_not_ready < min(t for t, _, _ in refusals)
    assert {code for _, _, code in infers} <= {200, 503}
    assert len([e for e in infers if e[2] == 200]) > 50
    assert server.log().count("drained: every accepted request was answered") == int(workers)
    server.stop()


# -- a new version swapped in under load ------------------------------------------------------


class Times(torch.nn.Module):
    def __init__(self, factor: float) -> None:
        super().__init__()
        self.factor = factor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.factor


def _version(folder: Path, number: int, factor: float) -> None:
    (folder / str(number)).mkdir(parents=True)
    torch.jit.script(Times(factor)).save(str(folder / str(number) / "model.pt"))


@pytest.mark.parametrize("trigger", ["api", "poll"])
def test_a_new_version_swaps_in_under_load_without_a_failed_request(
    tmp_path: Path, trigger: str
) -> None:
    folder = tmp_path / "models" / "times"
    _version(folder, 1, 1.0)
    (folder / "config.yaml").write_text(
        yaml.safe_dump(
            {
                "backend": "torchscript",
                "max_batch_size": 8,
                "inputs": [{"name": "x", "datatype": "FP32", "shape": [4]}],
                "outputs": [{"name": "y", "datatype": "FP32", "shape": [4]}],
            }
        )
    )
    env = {"TG_ADMIN_TOKEN": "admin-token-of-16+", "TG_ACCESS_LOG": "false"}
    if trigger == "poll":
        env["TG_POLL_INTERVAL_S"] = "0.2"
    server = Server(folder.parent, env=env, log_path=tmp_path / "server.log")
    answers: list[tuple[int, float]] = []
    done = threading.Event()

    def load() -> None:
        with httpx.Client(base_url=server.url, timeout=30) as client:
            for _ in range(3000):  # bounded
                body = {
                    "inputs": [
                        {"name": "x", "datatype": "FP32", "shape": [1, 4], "data": [1.0] * 4}
                    ]
                }
                response = client.post("/v2/models/times/infer", json=body)
                answers.append(
                    (
                        response.status_code,
                        response.json()["outputs"][0]["data"][0]
                        if response.status_code == 200
                        else -1,
                    )
                )
                if done.is_set():
                    return

    try:
        server.wait_until()
        with ThreadPoolExecutor(2) as pool:
            running = [pool.submit(load) for _ in range(2)]
            server.wait_for(lambda: len(answers) > 100)
            _version(folder, 2, 2.0)
            if trigger == "api":
                loaded = httpx.post(
                    f"{server.url}/v2/repository/models/times/load",
                    headers={"Authorization": "Bearer admin-token-of-16+"},
                    timeout=60,
                )
                assert loaded.status_code == 200, loaded.text
            server.wait_for(
                lambda: server.client.get("/v2/models/times").json().get("version") == "2"
            )
            count = len(answers)
            server.wait_for(lambda: len(answers) > count + 100)
            done.set()
            for future in running:
                future.result(timeout=60)
        assert {code for code, _ in answers} == {200}
        values = [value for _, value in answers]
        switch = values.index(2.0)
        assert set(values[:switch]) == {1.0}
        # Two clients: the last v1 answers may land just after the first v2 one, never later.
        assert values[switch:].count(1.0) <= 1
        assert server.client.get("/v2/models/times").json()["versions"] == ["2"]
    finally:
        done.set()
        server.stop()


def test_a_request_still_in_flight_when_the_grace_period_ends_is_answered_503(
    tmp_path: Path,
) -> None:
    """It was dropped: the exit closed its connection with no answer (a hung model's request,
    a timeout longer than the grace period). Now it is answered 503 saying why, over REST and
    in a gRPC call and a gRPC stream (their requests queued behind the hung one)."""
    import grpc

    from service.protocol.pb import grpc_service_pb2 as pb
    from service.protocol.pb import grpc_service_pb2_grpc as pb_grpc
    from tests.models import Dawdle

    root = tmp_path / "models"
    copy_model("digits", root / "digits")
    (root / "dawdle" / "1").mkdir(parents=True)
    torch.jit.script(Dawdle(2000)).save(str(root / "dawdle" / "1" / "model.pt"))
    config = {
        "backend": "torchscript",
        "max_batch_size": 1,
        "inputs": [{"name": "x", "datatype": "FP32", "shape": [16]}],
        "outputs": [{"name": "y", "datatype": "FP32", "shape": [16]}],
    }
    (root / "dawdle" / "config.yaml").write_text(yaml.safe_dump(config))
    env = {"TG_DRAIN_PRE_STOP_S": "0.2", "TG_DRAIN_GRACE_S": "1", "TG_STUCK_INSTANCE_S": "600"}
    server = Server(root, env=env, log_path=tmp_path / "server.log")
    answers: list[httpx.Response] = []
    try:
        server.wait_until()
        hung = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 16], "data": [1e9] * 16}]}

        def send() -> None:
            answers.append(
                httpx.post(
                    f"{server.url}/v2/models/dawdle/infer",
                    json=hung,
                    headers={"X-Request-Timeout": "120"},
                    timeout=60,
                )
            )

        def held(id_: str) -> Any:
            """A gRPC request queued behind the hung one."""
            tensor = pb.ModelInferRequest.InferInputTensor(name="x", datatype="FP32", shape=[1, 16])
            tensor.contents.fp32_contents.extend([1e9] * 16)
            return pb.ModelInferRequest(model_name="dawdle", id=id_, inputs=[tensor])

        streamed: list[Any] = []
        unary: list[Any] = []

        def stream() -> None:
            with grpc.insecure_channel(server.grpc_url) as channel:
                calls = pb_grpc.GRPCInferenceServiceStub(channel).ModelStreamInfer
                streamed.extend(calls(iter([held("streamed")]), timeout=60))

        def call() -> None:
            with grpc.insecure_channel(server.grpc_url) as channel:
                try:
                    pb_grpc.GRPCInferenceServiceStub(channel).ModelInfer(held("unary"), timeout=60)
                except grpc.RpcError as exc:
                    unary.append(exc)

        senders = [threading.Thread(target=f) for f in (send, stream, call)]
        for sender in senders:
            sender.start()
        server.wait_for(lambda: _in_flight(server) >= 3)
        server.process.send_signal(signal.SIGTERM)
        for sender in senders:
            sender.join(timeout=30)
        assert answers, "no answer within 30 s"
        assert answers[0].status_code == 503
        assert "its drain grace period (TG_DRAIN_GRACE_S) ended" in answers[0].json()["error"]
        assert [a.infer_response.id for a in streamed] == ["streamed"]
        assert "its drain grace period (TG_DRAIN_GRACE_S) ended" in streamed[0].error_message
        assert [e.code() for e in unary] == [grpc.StatusCode.UNAVAILABLE]
        assert "its drain grace period (TG_DRAIN_GRACE_S) ended" in unary[0].details()
        assert "grace period over with 3 requests in flight: answering them 503" in server.log()
    finally:
        server.stop()


def _in_flight(server: Server) -> float:
    """Inference requests in flight, from /metrics."""
    for line in server.client.get("/metrics").text.splitlines():
        if line.startswith("tensorgate_requests_in_flight "):
            return float(line.split()[1])
    return 0.0
