"""The Open Inference Protocol over gRPC, driven by NVIDIA's own client (sync and aio) and by
KServe's InferenceGRPCClient, against a real server: the same core, scheduler and errors as REST."""

from __future__ import annotations

import asyncio
import queue
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import AsyncIterator, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import httpx
import numpy as np
import pytest
import tritonclient.grpc as tgrpc
import tritonclient.grpc.aio as tgrpc_aio
import tritonclient.grpc.service_pb2 as service_pb2
import tritonclient.grpc.service_pb2_grpc as service_grpc
from tritonclient.utils import InferenceServerException

from service.datatypes import INTEGER_RANGES
from service.protocol.grpc import CONTENTS_FIELD
from tests.identity import ONNX_TYPES, write_identity_model
from tests.integration.test_batching import _slow_busy, _slow_model, slow_body
from tests.integration.test_hostile_requests import DIGIT
from tests.integration.test_protocol import sample
from tests.server import REPO_ROOT, Server, copy_model

pytestmark = pytest.mark.integration
ADMIN_TOKEN = "s3cret-admin-token-1"
API_TOKEN = "s3cret-api-token-22"
TYPED = tuple(t for t in ONNX_TYPES if t != "FP16")  # FP16 has no typed field in the protocol


@pytest.fixture(scope="module")
def grpc_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    root = tmp_path_factory.mktemp("grpc") / "models"
    write_identity_model(root / "identity")
    write_identity_model(root / "identity_typed", datatypes=TYPED)
    copy_model("digits", root / "digits")
    config = root / "digits" / "config.yaml"
    config.write_text(
        config.read_text() + "batching: {max_queue_delay_ms: 20, preferred_batch_sizes: [16]}\n"
    )
    _slow_model(root, "slow", 150_000, batching={"max_queue_size": 4})
    env = {"TG_ADMIN_TOKEN": ADMIN_TOKEN, "TG_MAX_BODY_BYTES": str(4 << 20)}
    server = Server(root, env=env, log_path=root.parent / "server.log")
    try:
        server.wait_until(timeout=180)
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def client(grpc_server: Server) -> tgrpc.InferenceServerClient:
    return tgrpc.InferenceServerClient(grpc_server.grpc_url)


def identity_inputs() -> tuple[list[tgrpc.InferInput], list[tgrpc.InferRequestedOutput]]:
    inputs, outputs = [], []
    for datatype in ONNX_TYPES:
        data = sample(datatype)
        tensor = tgrpc.InferInput(f"in_{datatype}", list(data.shape), datatype)
        tensor.set_data_from_numpy(data)
        inputs.append(tensor)
        outputs.append(tgrpc.InferRequestedOutput(f"out_{datatype}"))
    return inputs, outputs


def check_identity(result: Any, datatypes: Any = ONNX_TYPES) -> None:
    for datatype in datatypes:
        got, want = result.as_numpy(f"out_{datatype}"), sample(datatype)
        assert got.shape == want.shape, datatype
        if datatype == "BYTES":
            assert list(got.reshape(-1)) == list(want.reshape(-1))
        else:
            assert got.dtype == want.dtype, datatype
            np.testing.assert_array_equal(got, want)


def digit(rows: int = 1, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((rows, 1, 8, 8)).astype(np.float32)


def digit_input(x: np.ndarray) -> tgrpc.InferInput:
    tensor = tgrpc.InferInput("image", list(x.shape), "FP32")
    tensor.set_data_from_numpy(x)
    return tensor


def test_health_metadata_statistics_and_repository_rpcs(
    client: tgrpc.InferenceServerClient, grpc_server: Server
) -> None:
    assert client.is_server_live() and client.is_server_ready()
    assert client.is_model_ready("digits") and client.is_model_ready("digits", "1")
    # as Triton answers: False for a model or version it does not have, not an error
    assert not client.is_model_ready("nope") and not client.is_model_ready("digits", "7")
    assert "binary_tensor_data" in client.get_server_metadata(as_json=True)["extensions"]
    ours = client.get_model_metadata("digits", as_json=True)
    rest = grpc_server.client.get("/v2/models/digits").json()
    assert ours["name"] == "digits" and ours["versions"] == ["1"]
    assert ours["platform"] == rest["platform"]
    for got, want in zip(ours["inputs"], rest["inputs"], strict=True):
        assert (got["name"], got["datatype"]) == (want["name"], want["datatype"])
        assert [int(d) for d in got["shape"]] == want["shape"]
    before = client.get_inference_statistics("digits", as_json=True)["model_stats"][0]
    client.infer("digits", [digit_input(digit())])
    after = client.get_inference_statistics("digits", as_json=True)["model_stats"][0]
    assert int(after["inference_count"]) == int(before.get("inference_count", 0)) + 1
    admin = {"authorization": f"Bearer {ADMIN_TOKEN}"}
    index = client.get_model_repository_index(headers=admin, as_json=True)["models"]
    assert {m["name"] for m in index} == {"identity", "identity_typed", "digits", "slow"}
    with pytest.raises(InferenceServerException, match="admin token") as refused:
        client.get_model_repository_index()
    assert refused.value.status() == "StatusCode.UNAUTHENTICATED"
    with grpc.insecure_channel(grpc_server.grpc_url) as channel:  # as REST: 400, nothing done
        stub = service_grpc.GRPCInferenceServiceStub(channel)
        unload = service_pb2.RepositoryModelUnloadRequest(model_name="identity")
        unload.parameters["force"].bool_param = True
        with pytest.raises(grpc.RpcError) as refused_unload:
            stub.RepositoryModelUnload(unload, metadata=list(admin.items()))
    assert refused_unload.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert "takes only the parameter 'unload_dependents'" in str(refused_unload.value.details())
    assert client.is_model_ready("identity")
    client.unload_model("identity", headers=admin, unload_dependents=True)
    assert not client.is_model_ready("identity")
    client.load_model("identity", headers=admin)
    assert client.is_model_ready("identity")


def test_a_call_is_answered_with_the_request_id_its_log_line_has(grpc_server: Server) -> None:
    """The OIP request's id was ignored by ModelInfer (a stream's requests used theirs), and
    no id reached a gRPC client, where REST answers X-Request-ID."""
    request = service_pb2.ModelInferRequest(model_name="digits", id="grpc-own-id")
    tensor = request.inputs.add(name="image", datatype="FP32", shape=[1, 1, 8, 8])
    tensor.contents.fp32_contents.extend(digit().ravel().tolist())
    with grpc.insecure_channel(grpc_server.grpc_url) as channel:
        stub = service_grpc.GRPCInferenceServiceStub(channel)
        response, call = stub.ModelInfer.with_call(request)
        assert response.id == "grpc-own-id"
        assert ("x-request-id", "grpc-own-id") in call.trailing_metadata()
        _, call = stub.ModelInfer.with_call(request, metadata=[("x-request-id", "from-header")])
        assert ("x-request-id", "from-header") in call.trailing_metadata()  # the header wins
        with pytest.raises(grpc.RpcError) as failed:
            stub.ModelInfer(service_pb2.ModelInferRequest(model_name="nope", id="lost-one"))
        assert ("x-request-id", "lost-one") in failed.value.trailing_metadata()
    grpc_server.wait_for(lambda: '"request_id":"grpc-own-id"' in grpc_server.log(), timeout=10)
    # tracing is off here: the log line still names the caller's trace, to join it by
    caller = "4bf92f3577b34da6a3ce929d0e0e4736"
    parent = [("traceparent", f"00-{caller}-00f067aa0ba902b7-00")]
    with grpc.insecure_channel(grpc_server.grpc_url) as channel:
        stub = service_grpc.GRPCInferenceServiceStub(channel)
        stub.ModelInfer(request, metadata=[*parent, ("x-request-id", "traced-grpc")])
    answer = grpc_server.client.post(
        "/v2/models/digits/infer",
        json=DIGIT,
        headers={**dict(parent), "X-Request-ID": "traced-rest"},
    )
    assert answer.status_code == 200
    for request_id in ("traced-grpc", "traced-rest"):
        grpc_server.wait_for(
            lambda request_id=request_id: any(
                f'"request_id":"{request_id}"' in line and f'"trace_id":"{caller}"' in line
                for line in grpc_server.log().splitlines()
            ),
            timeout=10,
        )


def test_every_datatype_round_trips_in_raw_contents(client: tgrpc.InferenceServerClient) -> None:
    inputs, outputs = identity_inputs()
    result = client.infer("identity", inputs, outputs=outputs, request_id="r-1", model_version="1")
    check_identity(result)
    response = result.get_response()
    assert (response.id, response.model_version) == ("r-1", "1")


def test_typed_contents_round_trip_and_come_back_typed(grpc_server: Server) -> None:
    """KServe's clients send typed ``contents``; the answer then uses typed contents too."""
    request = service_pb2.ModelInferRequest(model_name="identity_typed", id="typed")
    field = {
        "BOOL": "bool_contents",
        "UINT8": "uint_contents",
        "UINT16": "uint_contents",
        "UINT32": "uint_contents",
        "UINT64": "uint64_contents",
        "INT8": "int_contents",
        "INT16": "int_contents",
        "INT32": "int_contents",
        "INT64": "int64_contents",
        "FP32": "fp32_contents",
        "FP64": "fp64_contents",
        "BYTES": "bytes_contents",
    }
    for datatype in TYPED:
        data = sample(datatype)
        tensor = request.inputs.add(name=f"in_{datatype}", datatype=datatype, shape=data.shape)
        getattr(tensor.contents, field[datatype]).extend(data.reshape(-1).tolist())
        request.outputs.add(name=f"out_{datatype}")
    with grpc.insecure_channel(grpc_server.grpc_url) as channel:
        response = service_grpc.GRPCInferenceServiceStub(channel).ModelInfer(request)
    assert response.id == "typed" and not response.raw_output_contents
    for output in response.outputs:
        datatype = output.datatype
        want = sample(datatype).reshape(-1).tolist()
        assert list(getattr(output.contents, field[datatype])) == pytest.approx(want), datatype


def edge_rows(datatype: str) -> list[list[int]]:
    """Each end of an integer datatype's range beside small values: for UINT64, 2⁶⁴ − 1 and
    2⁶³ + 1 beside 0 and 1, which numpy reads as floats (rounded to 2⁶⁴ and 2⁶³)."""
    low, high = INTEGER_RANGES[datatype]
    return [[low, 0, high], [high // 2 + 2, 1, 0]]


def test_integers_at_each_end_of_their_range_come_back_unchanged_over_v2_v1_and_grpc(
    grpc_server: Server,
) -> None:
    """UINT64 [9223372036854775809, 0, 1] came back [9223372036854775808, 0, 1] with a 200 on
    every protocol, and [18446744073709551615, 0, 1] was refused as out of range (v2: 'got
    values from 0 to 18446744073709551616'); INT64's largest beside a JSON 0.0 was refused."""
    integers = [t for t in TYPED if t in INTEGER_RANGES]
    rows: dict[str, list[list[Any]]] = {t: edge_rows(t) for t in integers}
    rows |= {t: sample(t).tolist() for t in TYPED if t not in INTEGER_RANGES}
    rows["BYTES"] = [[item.decode() for item in row] for row in rows["BYTES"]]
    flat = {t: [v for row in values for v in row] for t, values in rows.items()}
    sent = {t: flat[t] for t in integers}

    # v2 JSON, each integer tensor's 0 as 0.0: a float of integral value, as a client that
    # holds its values as floats writes it
    zeros = {t: [0.0 if v == 0 else v for v in flat[t]] for t in integers}
    inputs = [
        {"name": f"in_{t}", "datatype": t, "shape": [2, 3], "data": zeros.get(t, flat[t])}
        for t in TYPED
    ]
    answer = grpc_server.client.post("/v2/models/identity_typed/infer", json={"inputs": inputs})
    assert answer.status_code == 200, answer.text
    outputs = answer.json()["outputs"]
    assert {o["datatype"]: o["data"] for o in outputs if o["datatype"] in sent} == sent

    instances = [{f"in_{t}": values[row] for t, values in rows.items()} for row in range(2)]
    answer = grpc_server.client.post(
        "/v1/models/identity_typed:predict", json={"instances": instances}
    )
    assert answer.status_code == 200, answer.text
    predictions = answer.json()["predictions"]
    assert {t: [v for p in predictions for v in p[f"out_{t}"]] for t in integers} == sent

    request = service_pb2.ModelInferRequest(model_name="identity_typed")
    for datatype in TYPED:
        tensor = request.inputs.add(name=f"in_{datatype}", datatype=datatype, shape=[2, 3])
        values = [v.encode() if isinstance(v, str) else v for v in flat[datatype]]
        getattr(tensor.contents, CONTENTS_FIELD[datatype]).extend(values)
    with grpc.insecure_channel(grpc_server.grpc_url) as channel:
        response = service_grpc.GRPCInferenceServiceStub(channel).ModelInfer(request)
    typed = {
        o.datatype: list(getattr(o.contents, CONTENTS_FIELD[o.datatype])) for o in response.outputs
    }
    assert {t: typed[t] for t in integers} == sent


def test_aio_client_infers_and_errors_carry_grpc_codes(grpc_server: Server) -> None:
    async def run() -> None:
        client = tgrpc_aio.InferenceServerClient(grpc_server.grpc_url)
        try:
            x = digit(3)
            result = await client.infer("digits", [digit_input(x)], request_id="aio")
            assert result.as_numpy("logits").shape == (3, 10)
            assert result.get_response().id == "aio"
            with pytest.raises(InferenceServerException) as unknown:
                await client.infer("nope", [digit_input(x)])
            assert unknown.value.status() == "StatusCode.NOT_FOUND"
        finally:
            await client.close()

    asyncio.run(run())


@pytest.mark.parametrize(
    ("model", "version", "tensor", "code", "message"),
    [
        ("digits", "", ("image", [1, 1, 8, 8], "FP64"), "INVALID_ARGUMENT", "input 'image'.*FP64"),
        ("digits", "", ("pixels", [1, 1, 8, 8], "FP32"), "INVALID_ARGUMENT", "pixels"),
        ("nope", "", ("image", [1, 1, 8, 8], "FP32"), "NOT_FOUND", "unknown model 'nope'"),
        ("digits", "7", ("image", [1, 1, 8, 8], "FP32"), "NOT_FOUND", "no version '7'"),
        ("digits", "", ("image", [20_000, 1, 8, 8], "FP32"), "RESOURCE_EXHAUSTED", "larger than"),
    ],
)
def test_errors_name_the_problem_with_tritons_status_code(
    client: tgrpc.InferenceServerClient,
    model: str,
    version: str,
    tensor: tuple[str, list[int], str],
    code: str,
    message: str,
) -> None:
    name, shape, datatype = tensor
    data = np.zeros(shape, np.float64 if datatype == "FP64" else np.float32)
    item = tgrpc.InferInput(name, shape, datatype)
    item.set_data_from_numpy(data)
    with pytest.raises(InferenceServerException, match=message) as error:
        client.infer(model, [item], model_version=version)
    assert error.value.status() == f"StatusCode.{code}"


def test_shared_memory_rpcs_say_they_are_unimplemented(client: tgrpc.InferenceServerClient) -> None:
    with pytest.raises(InferenceServerException, match="shared memory is not supported") as error:
        client.get_system_shared_memory_status()
    assert error.value.status() == "StatusCode.UNIMPLEMENTED"


def test_trace_settings_say_where_tracing_is_set(client: tgrpc.InferenceServerClient) -> None:
    """It said "tracing is not supported", and tracing is there (OpenTelemetry's)."""
    with pytest.raises(InferenceServerException, match="OTEL_TRACES_SAMPLER") as error:
        client.get_trace_settings()
    assert error.value.status() == "StatusCode.UNIMPLEMENTED"


def test_a_deadline_that_expires_in_the_queue_is_deadline_exceeded(
    client: tgrpc.InferenceServerClient, grpc_server: Server
) -> None:
    x = np.ones((1, 16), np.float32)
    slow = tgrpc.InferInput("x", [1, 16], "FP32")
    slow.set_data_from_numpy(x)
    with ThreadPoolExecutor(1) as pool:
        busy = pool.submit(client.infer, "slow", [slow])
        grpc_server.wait_for(lambda: _slow_busy(grpc_server))
        with pytest.raises(InferenceServerException) as late:
            client.infer("slow", [slow], client_timeout=0.1)
        assert late.value.status() == "StatusCode.DEADLINE_EXCEEDED"
        assert busy.result().as_numpy("y").shape == (1, 16)
    grpc_server.wait_for(lambda: _slow_idle(grpc_server))


def test_a_cancelled_call_leaves_no_work_behind(grpc_server: Server) -> None:
    stats = "/v2/models/slow/stats"
    before = grpc_server.client.get(stats).json()["model_stats"][0]["execution_count"]
    with ThreadPoolExecutor(1) as pool:
        busy = pool.submit(grpc_server.client.post, "/v2/models/slow/infer", json=slow_body(1.0))
        grpc_server.wait_for(lambda: _slow_busy(grpc_server))
        with grpc.insecure_channel(grpc_server.grpc_url) as channel:
            request = service_pb2.ModelInferRequest(model_name="slow")
            request.inputs.add(name="x", datatype="FP32", shape=[1, 16])
            request.raw_input_contents.append(np.ones((1, 16), np.float32).tobytes())
            call = service_grpc.GRPCInferenceServiceStub(channel).ModelInfer.future(request)
            grpc_server.wait_for(lambda: _slow_pending(grpc_server) == 1)
            call.cancel()
        assert busy.result().status_code == 200
    grpc_server.wait_for(lambda: _slow_idle(grpc_server))
    after = grpc_server.client.get(stats).json()["model_stats"][0]["execution_count"]
    assert after - before == 1  # only the REST request ran


def slow_input() -> tgrpc.InferInput:
    tensor = tgrpc.InferInput("x", [1, 16], "FP32")
    tensor.set_data_from_numpy(np.ones((1, 16), np.float32))
    return tensor


def test_a_stream_answers_in_completion_order_by_id_and_outlives_a_bad_request(
    client: tgrpc.InferenceServerClient, grpc_server: Server
) -> None:
    alone = {i: client.infer("digits", [digit_input(digit(1, seed=i))]) for i in range(6)}
    answers: queue.Queue[tuple[Any, Any]] = queue.Queue()
    streaming = tgrpc.InferenceServerClient(grpc_server.grpc_url)
    streaming.start_stream(callback=lambda result, error: answers.put((result, error)))
    try:
        streaming.async_stream_infer("slow", [slow_input()], request_id="slow")  # sent first
        for i in range(6):
            if i == 3:
                bad = tgrpc.InferInput("pixels", [1, 1, 8, 8], "FP32")
                bad.set_data_from_numpy(digit())
                streaming.async_stream_infer("digits", [bad], request_id="bad")
            streaming.async_stream_infer(
                "digits", [digit_input(digit(1, seed=i))], request_id=f"d{i}"
            )
        got = [answers.get(timeout=60) for _ in range(8)]
    finally:
        streaming.stop_stream()
    errors = [error for _, error in got if error is not None]
    assert len(errors) == 1 and "pixels" in str(errors[0])  # and the stream went on
    results = {r.get_response().id: r for r, _ in got if r is not None}
    assert set(results) == {"slow", *(f"d{i}" for i in range(6))}
    assert [r.get_response().id for r, _ in got if r is not None][-1] == "slow"  # overtaken
    for i, want in alone.items():  # each answer is its own request's (batched: to rounding)
        got_logits = results[f"d{i}"].as_numpy("logits")
        np.testing.assert_allclose(got_logits, want.as_numpy("logits"), rtol=1e-4, atol=1e-4)
    grpc_server.wait_for(lambda: _slow_idle(grpc_server))


def test_the_aio_client_streams_and_errors_come_in_the_stream(grpc_server: Server) -> None:
    async def run() -> list[tuple[Any, Any]]:
        client = tgrpc_aio.InferenceServerClient(grpc_server.grpc_url)

        async def requests() -> AsyncIterator[dict[str, Any]]:
            for i in range(4):
                yield {
                    "model_name": "digits",
                    "inputs": [digit_input(digit(1, seed=i))],
                    "request_id": f"a{i}",
                }
            yield {"model_name": "nope", "inputs": [digit_input(digit())], "request_id": "x"}

        try:
            return [answer async for answer in client.stream_infer(requests())]
        finally:
            await client.close()

    got = asyncio.run(run())
    assert sorted(r.get_response().id for r, _ in got if r is not None) == ["a0", "a1", "a2", "a3"]
    assert [str(e) for _, e in got if e is not None] == ["unknown model 'nope'"]


def test_a_cancelled_stream_leaves_no_work_behind(grpc_server: Server) -> None:
    stats = "/v2/models/slow/stats"
    before = grpc_server.client.get(stats).json()["model_stats"][0]["execution_count"]
    with ThreadPoolExecutor(1) as pool:
        busy = pool.submit(grpc_server.client.post, "/v2/models/slow/infer", json=slow_body(1.0))
        grpc_server.wait_for(lambda: _slow_busy(grpc_server))
        streaming = tgrpc.InferenceServerClient(grpc_server.grpc_url)
        streaming.start_stream(callback=lambda result, error: None)
        for i in range(2):
            streaming.async_stream_infer("slow", [slow_input()], request_id=f"s{i}")
        grpc_server.wait_for(lambda: _slow_pending(grpc_server) == 2)
        streaming.stop_stream(cancel_requests=True)
        assert busy.result().status_code == 200
    grpc_server.wait_for(lambda: _slow_idle(grpc_server))
    after = grpc_server.client.get(stats).json()["model_stats"][0]["execution_count"]
    assert after - before == 1  # only the REST request ran


def test_grpc_health_check_as_a_kubelet_probe_does(grpc_server: Server) -> None:
    """The kubelet calls /grpc.health.v1.Health/Check with service "" and reads the status."""
    request = b""  # HealthCheckRequest{service: ""} is the empty message
    with grpc.insecure_channel(grpc_server.grpc_url) as channel:
        check = channel.unary_unary("/grpc.health.v1.Health/Check")
        answer = check(request, timeout=5)
        unknown = channel.unary_unary("/grpc.health.v1.Health/Check")
        with pytest.raises(grpc.RpcError) as error:
            unknown(b"\n\x04nope", timeout=5)  # service: "nope"
    assert answer == b"\x08\x01"  # status: SERVING
    assert error.value.code() is grpc.StatusCode.NOT_FOUND


def test_kserve_grpc_client_infers_and_reads_metadata(grpc_server: Server) -> None:
    """KServe's SDK and tritonclient register the same protobuf names: its own process."""
    script = textwrap.dedent(f"""
        import asyncio, numpy as np
        from kserve import InferenceGRPCClient, InferInput, InferRequest
        async def main():
            client = InferenceGRPCClient({grpc_server.grpc_url!r})
            assert await client.is_server_ready()
            x = np.random.default_rng(0).standard_normal((2, 1, 8, 8)).astype(np.float32)
            tensor = InferInput("image", list(x.shape), "FP32")
            tensor.set_data_from_numpy(x, binary_data=False)
            answer = await client.infer(InferRequest("digits", [tensor], request_id="ks"))
            assert answer.id == "ks", answer.id
            logits = answer.outputs[0].as_numpy()
            assert logits.shape == (2, 10), logits.shape
            await client.close()
            print("ok")
        asyncio.run(main())
    """)
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0 and "ok" in done.stdout, done.stderr[-3000:]


def test_rest_and_grpc_requests_batch_together(grpc_server: Server) -> None:
    before = grpc_server.client.get("/v2/models/digits/stats").json()["model_stats"][0]
    x = digit(1, seed=3)
    body = {
        "inputs": [
            {"name": "image", "datatype": "FP32", "shape": [1, 1, 8, 8], "data": x.ravel().tolist()}
        ]
    }

    def rest(_: int) -> None:
        with httpx.Client(base_url=grpc_server.url, timeout=60) as http:
            for _ in range(12):
                assert http.post("/v2/models/digits/infer", json=body).status_code == 200

    def over_grpc(_: int) -> None:
        client = tgrpc.InferenceServerClient(grpc_server.grpc_url)
        for _ in range(12):
            assert client.infer("digits", [digit_input(x)]).as_numpy("logits").shape == (1, 10)
        client.close()

    with ThreadPoolExecutor(16) as pool:
        list(pool.map(lambda i: (rest if i % 2 else over_grpc)(i), range(16)))
    after = grpc_server.client.get("/v2/models/digits/stats").json()["model_stats"][0]
    rows = after["inference_count"] - before["inference_count"]
    executions = after["execution_count"] - before["execution_count"]
    assert rows == 16 * 12
    assert rows / executions > 1.0  # mean batch size
    metrics = grpc_server.client.get("/metrics").text
    assert 'protocol="grpc"' in metrics


def test_the_api_token_is_asked_for_in_metadata(tmp_path: Path) -> None:
    root = tmp_path / "models"
    copy_model("digits", root / "digits")
    server = Server(root, env={"TG_API_TOKEN": API_TOKEN}, log_path=tmp_path / "server.log")
    try:
        server.wait_until()
        client = tgrpc.InferenceServerClient(server.grpc_url)
        with pytest.raises(InferenceServerException, match="Bearer") as refused:
            client.infer("digits", [digit_input(digit())])
        assert refused.value.status() == "StatusCode.UNAUTHENTICATED"
        headers = {"authorization": f"Bearer {API_TOKEN}"}
        result = client.infer("digits", [digit_input(digit())], headers=headers)
        assert result.as_numpy("logits").shape == (1, 10)
        # a stream's token is in the stream's metadata: without it, it ends at once
        answers: queue.Queue[tuple[Any, Any]] = queue.Queue()
        client.start_stream(lambda result, error: answers.put((result, error)))
        _, error = answers.get(timeout=30)
        assert error.status() == "StatusCode.UNAUTHENTICATED" and "Bearer" in str(error)
        client.stop_stream()
        client.start_stream(lambda result, error: answers.put((result, error)), headers=headers)
        client.async_stream_infer("digits", [digit_input(digit())])
        answer, error = answers.get(timeout=30)
        client.stop_stream()
        assert error is None and answer.as_numpy("logits").shape == (1, 10)
    finally:
        server.stop()


def test_sigterm_drains_mixed_grpc_and_rest_load_losing_nothing(tmp_path: Path) -> None:
    root = tmp_path / "models"
    copy_model("digits", root / "digits")
    env = {"TG_DRAIN_PRE_STOP_S": "1.0", "TG_DRAIN_GRACE_S": "60", "TG_ACCESS_LOG": "false"}
    server = Server(root, env=env, log_path=tmp_path / "server.log")
    server.wait_until()
    outcomes: list[tuple[str, str]] = []
    lock = threading.Lock()
    x = digit()
    body = {
        "inputs": [
            {"name": "image", "datatype": "FP32", "shape": [1, 1, 8, 8], "data": x.ravel().tolist()}
        ]
    }

    def note(kind: str, outcome: str) -> bool:
        with lock:
            outcomes.append((kind, outcome))
        return outcome == "ok"

    def grpc_loop() -> None:
        client = tgrpc.InferenceServerClient(server.grpc_url)
        for _ in range(2000):  # bounded
            try:
                client.infer("digits", [digit_input(x)], client_timeout=30)
            except InferenceServerException as exc:
                note("grpc", str(exc.status()))
                return
            note("grpc", "ok")

    def rest_loop() -> None:
        for _ in range(2000):
            try:
                code = httpx.post(f"{server.url}/v2/models/digits/infer", json=body, timeout=30)
            except httpx.ConnectError:
                note("rest", "refused")
                return
            if not note("rest", "ok" if code.status_code == 200 else str(code.status_code)):
                return

    # An open stream, idle at SIGTERM, must not hold the server for the whole grace (60 s).
    streamed: queue.Queue[tuple[Any, Any]] = queue.Queue()
    streaming = tgrpc.InferenceServerClient(server.grpc_url)
    streaming.start_stream(lambda result, error: streamed.put((result, error)))
    streaming.async_stream_infer("digits", [digit_input(x)])
    assert streamed.get(timeout=30)[1] is None
    with ThreadPoolExecutor(4) as pool:
        loops = [pool.submit(grpc_loop if i % 2 else rest_loop) for i in range(4)]
        server.wait_for(lambda: min(_oks(outcomes, "grpc"), _oks(outcomes, "rest")) > 20)
        ready = tgrpc.InferenceServerClient(server.grpc_url)
        assert ready.is_server_ready()  # its channel connected: the next answer comes at once
        server.process.send_signal(signal.SIGTERM)
        signalled = time.monotonic()
        server.wait_for(lambda: not ready.is_server_ready(), timeout=10)
        for loop in loops:
            loop.result(timeout=60)
    assert server.process.wait(timeout=60) == 0
    assert time.monotonic() - signalled < 30
    _, ended = streamed.get(timeout=5)
    assert ended.status() == "StatusCode.UNAVAILABLE" and "shutting down" in str(ended)
    streaming.stop_stream()
    failures = {o for _, o in outcomes if o != "ok"}
    # every accepted call was answered; refusals are UNAVAILABLE / 503 / a closed port only
    assert failures <= {"StatusCode.UNAVAILABLE", "503", "refused"}, failures
    assert "drained: every accepted request was answered" in server.log()
    server.stop()


def _oks(outcomes: list[tuple[str, str]], kind: str) -> int:
    return sum(1 for k, o in list(outcomes) if k == kind and o == "ok")


def _slow_pending(server: Server) -> int:
    return int(server.client.get("/v2/models/slow").json()["queue"]["pending"])


def _slow_idle(server: Server) -> bool:
    queue = server.client.get("/v2/models/slow").json()["queue"]
    return bool(queue["pending"] == 0 and queue["busy_instances"] == 0)
