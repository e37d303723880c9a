"""The Open Inference Protocol end to end, driven by NVIDIA's own clients (sync and aio)."""

from __future__ import annotations

import asyncio
import base64
import json
import re
import shutil
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import tritonclient.http as triton
import tritonclient.http.aio as triton_aio
from tritonclient.utils import InferenceServerException

from service.datatypes import TO_NUMPY
from tests.identity import ONNX_TYPES, write_identity_model
from tests.server import Server, copy_model

pytestmark = pytest.mark.integration
TOKEN = "s3cret-admin-token-1"
ADMIN = {"Authorization": f"Bearer {TOKEN}"}


@pytest.fixture(scope="module")
def protocol_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    root = tmp_path_factory.mktemp("protocol") / "models"
    write_identity_model(root / "identity")
    write_identity_model(root / "identity_cast", cast_inputs="true")
    write_identity_model(
        root / "classified",
        datatypes=("FP32", "FP64"),
        postprocessing="{kind: classification, output: out_FP32, labels: labels.txt, top_k: 2}",
    )
    (root / "classified" / "labels.txt").write_text("a\nb\nc\n")
    copy_model("digits", root / "digits")
    server = Server(root, env={"TG_ADMIN_TOKEN": TOKEN}, log_path=root.parent / "server.log")
    try:
        server.wait_until()
        yield server
    finally:
        server.stop()


def sample(datatype: str, rows: int = 2) -> np.ndarray:
    if datatype == "BYTES":
        return np.array(
            [[f"r{r}c{c}-é".encode() for c in range(3)] for r in range(rows)], dtype=object
        )
    if datatype == "BOOL":
        return np.array([[True, False, True]] * rows)
    dtype = TO_NUMPY[datatype]
    values = np.arange(rows * 3).reshape(rows, 3) + 1
    return (values * (-1.5 if dtype.kind == "f" else 1)).astype(dtype)


def identity_inputs(binary: bool, module: Any = triton) -> tuple[list[Any], list[Any]]:
    inputs, outputs = [], []
    for datatype in ONNX_TYPES:
        data = sample(datatype)
        tensor = module.InferInput(f"in_{datatype}", list(data.shape), datatype)
        tensor.set_data_from_numpy(data, binary_data=binary)
        inputs.append(tensor)
        outputs.append(module.InferRequestedOutput(f"out_{datatype}", binary_data=binary))
    return inputs, outputs


def check_identity(result: Any) -> None:
    for datatype in ONNX_TYPES:
        got = result.as_numpy(f"out_{datatype}")
        want = sample(datatype)
        assert got.shape == want.shape, datatype
        if datatype == "BYTES":
            flat = [g if isinstance(g, bytes) else g.encode() for g in got.reshape(-1)]
            assert flat == list(want.reshape(-1))
        else:
            assert got.dtype == want.dtype, datatype
            np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("binary", [False, True])
def test_every_datatype_round_trips_through_the_sync_client(
    protocol_server: Server, binary: bool
) -> None:
    client = triton.InferenceServerClient(protocol_server.url.removeprefix("http://"))
    inputs, outputs = identity_inputs(binary)
    check_identity(client.infer("identity", inputs, outputs=outputs))


@pytest.mark.parametrize("binary", [False, True])
def test_every_datatype_round_trips_through_the_aio_client(
    protocol_server: Server, binary: bool
) -> None:
    async def run() -> None:
        client = triton_aio.InferenceServerClient(protocol_server.url.removeprefix("http://"))
        try:
            assert await client.is_server_live()
            assert await client.is_server_ready()
            assert await client.is_model_ready("identity")
            metadata = await client.get_model_metadata("identity")
            assert len(metadata["inputs"]) == len(ONNX_TYPES)
            assert (await client.get_server_metadata())["name"] == "tensorgate"
            inputs, outputs = identity_inputs(binary, triton_aio)
            check_identity(await client.infer("identity", inputs, outputs=outputs))
            stats = await client.get_inference_statistics("identity")
            assert stats["model_stats"][0]["name"] == "identity"
            config = await client.get_model_config("identity")
            assert config["backend"] == "onnxruntime"
        finally:
            await client.close()

    asyncio.run(run())


def test_outputs_subset_id_and_parameters_are_honoured(protocol_server: Server) -> None:
    client = triton.InferenceServerClient(protocol_server.url.removeprefix("http://"))
    inputs, _ = identity_inputs(binary=True)
    wanted = [triton.InferRequestedOutput("out_INT8", binary_data=False)]
    result = client.infer(
        "identity", inputs, outputs=wanted, request_id="abc", parameters={"note": "kept"}
    )
    response = result.get_response()
    assert response["id"] == "abc"
    assert response["parameters"] == {"note": "kept"}
    assert [o["name"] for o in response["outputs"]] == ["out_INT8"]
    np.testing.assert_array_equal(result.as_numpy("out_INT8"), sample("INT8"))


def test_a_declared_datatype_is_enforced_unless_the_config_opts_into_casting(
    protocol_server: Server,
) -> None:
    client = triton.InferenceServerClient(protocol_server.url.removeprefix("http://"))
    inputs, _ = identity_inputs(binary=False)
    as_fp64 = sample("FP32").astype(np.float64)
    inputs[list(ONNX_TYPES).index("FP32")] = wrong = triton.InferInput("in_FP32", [2, 3], "FP64")
    wrong.set_data_from_numpy(as_fp64, binary_data=False)
    with pytest.raises(
        InferenceServerException,
        match=r"input 'in_FP32': expected FP32 \[-1, 3\], got FP64 \[2, 3\]",
    ):
        client.infer("identity", inputs)
    result = client.infer("identity_cast", inputs)
    got = result.as_numpy("out_FP32")
    assert got.dtype == np.float32
    np.testing.assert_array_equal(got, sample("FP32"))


def test_statistics_count_exactly_what_was_served(protocol_server: Server) -> None:
    client = triton.InferenceServerClient(protocol_server.url.removeprefix("http://"))
    before = client.get_inference_statistics("digits", "1")["model_stats"][0]
    body = {
        "inputs": [
            {"name": "image", "datatype": "FP32", "shape": [3, 1, 8, 8], "data": [0.0] * 192}
        ]
    }
    for _ in range(4):
        assert protocol_server.client.post("/v2/models/digits/infer", json=body).status_code == 200
    bad = {"inputs": [{"name": "image", "datatype": "FP32", "shape": [3, 1, 8, 8], "data": [0.0]}]}
    assert protocol_server.client.post("/v2/models/digits/infer", json=bad).status_code == 400
    after = client.get_inference_statistics("digits", "1")["model_stats"][0]
    assert after["inference_count"] - before["inference_count"] == 12
    assert after["execution_count"] - before["execution_count"] == 4
    stats, old = after["inference_stats"], before["inference_stats"]
    assert stats["success"]["count"] - old["success"]["count"] == 4
    assert stats["fail"]["count"] - old["fail"]["count"] == 1
    for phase in ("queue", "compute_input", "compute_infer", "compute_output"):
        assert stats[phase]["count"] - old[phase]["count"] == 4
        assert stats[phase]["ns"] > old[phase]["ns"]
    assert {b["batch_size"] for b in after["batch_stats"]} >= {3}
    everything = client.get_inference_statistics()
    served = {"classified", "digits", "identity", "identity_cast"}
    assert {s["name"] for s in everything["model_stats"]} == served


def test_model_configuration_is_the_served_config(protocol_server: Server) -> None:
    client = triton.InferenceServerClient(protocol_server.url.removeprefix("http://"))
    config = client.get_model_config("digits")
    assert config["name"] == "digits"
    assert config["platform"] == "pytorch_libtorch"
    assert config["max_batch_size"] == 64
    assert config["input"] == [
        {"name": "image", "data_type": "TYPE_FP32", "dims": [1, 8, 8]},
        {
            "name": "image_bytes",
            "data_type": "TYPE_STRING",
            "dims": [1],
            "optional": True,
            "reshape": {
                "shape": []
            },  # one value a row, as Triton writes it: [batch], not [batch, 1]
        },
    ]
    preprocessing = json.loads(config["parameters"]["tensorgate.preprocessing"]["string_value"])
    assert preprocessing["color"] == "L"


def test_repository_index_unload_and_load_with_the_admin_token(protocol_server: Server) -> None:
    client = triton.InferenceServerClient(protocol_server.url.removeprefix("http://"))
    assert "model_repository" in client.get_server_metadata()["extensions"]
    index = client.get_model_repository_index(headers=ADMIN)
    assert {"name": "digits", "version": "1", "state": "READY", "reason": ""} in index
    client.unload_model("identity_cast", headers=ADMIN)
    assert not client.is_model_ready("identity_cast")
    assert protocol_server.client.get("/v2/health/ready").status_code == 200  # unloaded ≠ broken
    metadata = protocol_server.client.get("/v2/models/identity_cast").json()
    assert (metadata["state"], metadata["reason"]) == ("UNLOADED", "unloaded")
    assert protocol_server.client.post("/v2/repository/index").status_code == 401
    protocol_server.wait_log("without the admin token (a missing or wrong")  # and from where
    assert re.search(
        r"without the admin token .* the latest from 127\.0\.0\.1:\d+", protocol_server.log()
    )
    metrics = protocol_server.client.get("/metrics").text
    assert 'tensorgate_model_state{model="identity_cast",state="UNLOADED",version=""} 1.0' in (
        metrics
    )
    refused = re.search(r'tensorgate_refused_total\{reason="unauthorized"\} (\S+)', metrics)
    assert refused is not None and float(refused.group(1)) >= 1
    # a folder that arrived after startup is in the index before anyone loads it, as in Triton's
    write_identity_model(protocol_server.repository / "late")
    try:
        index = client.get_model_repository_index(headers=ADMIN)
        (late,) = [row for row in index if row["name"] == "late"]
        assert late["state"] == "UNLOADED" and "load it" in late["reason"]
    finally:
        shutil.rmtree(protocol_server.repository / "late")
    refused = protocol_server.client.post("/v2/models/identity_cast/infer", json={"inputs": []})
    assert refused.status_code == 503 and "unloaded" in refused.json()["error"]
    client.load_model("identity_cast", headers=ADMIN)
    assert client.is_model_ready("identity_cast")
    with pytest.raises(InferenceServerException, match="no model 'missing'"):
        client.load_model("missing", headers=ADMIN)
    with pytest.raises(InferenceServerException, match="not valid"):
        client.load_model("..", headers=ADMIN)
    refused = protocol_server.client.post("/v2/repository/models/%2e%2e/load", headers=ADMIN)
    assert refused.status_code == 400 and "'..' is not valid" in refused.json()["error"]
    long = protocol_server.client.post(f"/v2/repository/models/{'é' * 5000}/load", headers=ADMIN)
    assert long.status_code == 400 and "(5000 characters)" in long.json()["error"]
    assert len(long.content) < 500  # the name is not echoed whole
    wrong = protocol_server.client.post(
        "/v2/repository/models/identity_cast/unload",
        headers=ADMIN,
        json={"parameters": {"unload_dependents": "yes"}},
    )
    assert wrong.status_code == 400
    assert "'unload_dependents' is true or false, not a string" in wrong.json()["error"]
    assert client.is_model_ready("identity_cast")


@pytest.mark.parametrize(
    "headers", [{}, {"Authorization": "Bearer wrong"}, {"Authorization": TOKEN}]
)
def test_repository_routes_refuse_a_missing_or_wrong_token(
    protocol_server: Server, headers: dict[str, str]
) -> None:
    response = protocol_server.client.post("/v2/repository/index", headers=headers)
    assert response.status_code == 401
    assert response.headers["www-authenticate"] == 'Bearer realm="admin"'
    assert "Authorization: Bearer" in response.json()["error"]


def test_repository_routes_are_absent_without_an_admin_token(server: Server) -> None:
    assert server.client.post("/v2/repository/index").status_code == 404
    assert "model_repository" not in server.client.get("/v2").json()["extensions"]


def test_v1_instances_may_name_the_raw_input_the_metadata_lists(
    server: Server, chelsea_jpeg: bytes
) -> None:
    """TF Serving's form, ``{"input_bytes": {"b64": ...}}``: the metadata lists the input, and
    the instance was told "lacks input(s) ['input']; the model takes ['input']"."""
    encoded = base64.b64encode(chelsea_jpeg).decode()
    url = "/v1/models/efficientnet_lite0:predict"
    plain = server.client.post(url, json={"instances": [{"b64": encoded}]})
    named = server.client.post(url, json={"instances": [{"input_bytes": {"b64": encoded}}] * 2})
    assert named.status_code == 200, named.text
    assert named.json()["predictions"] == plain.json()["predictions"] * 2
    for instances, said in (
        ([{"input_bytes": {"b64": encoded}, "input": [1]}], "send it alone, not with ['input']"),
        ([{"input_bytes": {"b64": encoded}}, {"b64": encoded}], "does not name input 'input_b"),
        ([{"input_bytes": {"b64": "ab!"}}], "instances[0].input_bytes: a {'b64': ...} value is"),
        ([{"input_bytes": [1, 2]}], "instances[0].input_bytes: a list is not a string (or {'b6"),
        # the tensor input given an encoded image: said so, the image not echoed back
        ([{"input": {"b64": encoded}}], 'an object {"b64": ...} is not a number'),
    ):
        refused = server.client.post(url, json={"instances": instances})
        assert refused.status_code == 400, refused.text
        assert said in refused.json()["error"]
        assert len(refused.content) < 600
    assert server.client.get("/v2/health/ready").status_code == 200


def test_a_jpeg_sent_as_a_bytes_tensor_gets_postprocessed_outputs(
    server: Server, chelsea_jpeg: bytes
) -> None:
    client = triton.InferenceServerClient(server.url.removeprefix("http://"))
    metadata = client.get_model_metadata("efficientnet_lite0")
    assert {"name": "input_bytes", "datatype": "BYTES", "shape": [-1]} in metadata["inputs"]
    assert {"name": "classification", "datatype": "BYTES", "shape": [-1, 5]} in metadata["outputs"]
    for binary in (True, False):
        image = triton.InferInput("input_bytes", [1], "BYTES")
        image.set_data_from_numpy(np.array([chelsea_jpeg], dtype=object), binary_data=True)
        wanted = [
            triton.InferRequestedOutput("classification", binary_data=binary),
            triton.InferRequestedOutput("logits", binary_data=binary, class_count=3),
        ]
        result = client.infer("efficientnet_lite0", [image], outputs=wanted)
        top5 = result.as_numpy("classification")
        assert top5.shape == (1, 5)
        best = top5[0][0]
        text = best.decode() if isinstance(best, bytes) else best  # JSON outputs come as str
        probability, index, label = text.split(":")
        assert int(index) in (285, 281) and label in ("Egyptian cat", "tabby")
        assert 0 < float(probability) <= 1
        assert result.as_numpy("logits").shape == (1, 3)  # Triton's classification extension


def test_the_classification_parameter_classifies_the_output_it_is_asked_of(
    protocol_server: Server,
) -> None:
    """Triton's classification extension: the output the parameter is on, by its own values.
    Every output was answered with the top-k of the output the config's postprocessing names
    (out_FP32's labels for out_FP64's values [30, 20, 10]), silently."""
    inputs = [
        {"name": "in_FP32", "datatype": "FP32", "shape": [1, 3], "data": [1, 2, 3]},
        {"name": "in_FP64", "datatype": "FP64", "shape": [1, 3], "data": [30, 20, 10]},
    ]

    def classified(outputs: list[dict[str, Any]]) -> dict[str, list[str]]:
        answer = protocol_server.client.post(
            "/v2/models/classified/infer", json={"inputs": inputs, "outputs": outputs}
        )
        assert answer.status_code == 200, answer.text
        return {o["name"]: o["data"] for o in answer.json()["outputs"]}

    asked = [
        {"name": "out_FP64", "parameters": {"classification": 2}},
        {"name": "out_FP32", "parameters": {"classification": 1}},
        {"name": "classification"},
    ]
    assert classified(asked) == {
        "out_FP64": ["30.000000:0", "20.000000:1"],  # its values, no labels (as Triton's)
        "out_FP32": ["0.665241:2:c"],  # the postprocessing's output: its labels and softmax
        "classification": ["0.665241:2:c", "0.244728:1:b"],
    }
    refused = protocol_server.client.post(
        "/v2/models/classified/infer",
        json={
            "inputs": inputs,
            "outputs": [{"name": "out_FP64", "parameters": {"classification": 0}}],
        },
    )
    assert refused.status_code == 400
    assert "parameter 'classification' must be an integer ≥ 1" in refused.json()["error"]


def test_request_ids_are_taken_returned_and_put_in_error_bodies(server: Server) -> None:
    response = server.client.get("/v2/models/nope", headers={"X-Request-ID": "trace-42"})
    assert response.headers["x-request-id"] == "trace-42"
    assert response.json()["request_id"] == "trace-42"
    generated = server.client.get("/v2/health/live").headers["x-request-id"]
    assert len(generated) == 32 and generated != server.client.get("/v2").headers["x-request-id"]
    odd = server.client.get("/v2", headers={"X-Request-ID": "bad id\twith spaces"})
    assert odd.headers["x-request-id"] != "bad id\twith spaces"
