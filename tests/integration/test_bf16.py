"""BF16 end to end: JSON floats rounded to nearest even, binary and gRPC raw contents as 2-byte
words, through an ONNX and a TorchScript model that take and return bfloat16, driven by NVIDIA's
clients (which hold BF16 as ml_dtypes.bfloat16)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import grpc
import ml_dtypes
import numpy as np
import pytest
import torch
import tritonclient.grpc as tgrpc
import tritonclient.grpc.service_pb2 as service_pb2
import tritonclient.grpc.service_pb2_grpc as service_grpc
import tritonclient.http as thttp
import yaml
from tritonclient.utils import InferenceServerException

from tests.identity import write_identity_model
from tests.models import Copy
from tests.server import Server

pytestmark = pytest.mark.integration
MODELS = ("identity_bf16", "copy_bf16")  # ONNX, TorchScript
SPECIAL = np.array(
    [[1.5, -0.0, np.inf], [-np.inf, np.nan, 1e-40], [3.0e38, -2.0, 0.0]], ml_dtypes.bfloat16
)
"""Values a bfloat16 round trip must keep bit for bit (NaN, infinities, -0, a subnormal)."""
FINITE = np.array([[1.5, -0.0, 1e-40], [3.0e38, -2.0, 0.0]], ml_dtypes.bfloat16)
"""The same for JSON, which has no infinity or NaN (they are written as null, as for FP32)."""


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    root = tmp_path_factory.mktemp("bf16") / "models"
    write_identity_model(root / "identity_bf16", datatypes=("BF16", "FP32"))
    folder = root / "copy_bf16"
    (folder / "1").mkdir(parents=True)
    torch.jit.script(Copy()).save(str(folder / "1" / "model.pt"))
    config = {
        "backend": "torchscript",
        "max_batch_size": 8,
        "inputs": [{"name": "in_BF16", "datatype": "BF16", "shape": [3]}],
        "outputs": [{"name": "out_BF16", "datatype": "BF16", "shape": [3]}],
    }
    (folder / "config.yaml").write_text(yaml.safe_dump(config))
    running = Server(root, log_path=root.parent / "server.log")
    try:
        running.wait_until(timeout=180)
        yield running
    finally:
        running.stop()


def bits(array: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(array).view(np.uint16)


def _inputs(module: Any, model: str, x: np.ndarray, binary: bool = True) -> list[Any]:
    tensor = module.InferInput("in_BF16", list(x.shape), "BF16")
    if module is thttp:
        tensor.set_data_from_numpy(x, binary_data=binary)
    else:
        tensor.set_data_from_numpy(x)
    inputs = [tensor]
    if model == "identity_bf16":
        other = module.InferInput("in_FP32", list(x.shape), "FP32")
        other.set_data_from_numpy(np.zeros(x.shape, np.float32))
        inputs.append(other)
    return inputs


@pytest.mark.parametrize("model", MODELS)
def test_metadata_and_config_say_bf16(server: Server, model: str) -> None:
    metadata = server.client.get(f"/v2/models/{model}").json()
    assert {t["name"]: t["datatype"] for t in metadata["inputs"]}["in_BF16"] == "BF16"
    http = thttp.InferenceServerClient(server.url.removeprefix("http://"))
    config = http.get_model_config(model)
    assert {t["name"]: t["data_type"] for t in config["output"]}["out_BF16"] == "TYPE_BF16"
    over_grpc = tgrpc.InferenceServerClient(server.grpc_url).get_model_config(model, as_json=True)
    assert over_grpc["config"]["input"][0]["data_type"] == "TYPE_BF16"


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("binary_output", [True, False])
def test_tritonclient_http_round_trips_bf16(
    server: Server, model: str, binary_output: bool
) -> None:
    """tritonclient sends BF16 inputs binary only; outputs come binary or as JSON floats."""
    client = thttp.InferenceServerClient(server.url.removeprefix("http://"))
    x = SPECIAL if binary_output else FINITE
    wanted = [thttp.InferRequestedOutput("out_BF16", binary_data=binary_output)]
    result = client.infer(model, _inputs(thttp, model, x), outputs=wanted)
    got = result.as_numpy("out_BF16")
    assert got.dtype == ml_dtypes.bfloat16
    np.testing.assert_array_equal(bits(got), bits(x))


@pytest.mark.parametrize("model", MODELS)
def test_json_floats_are_rounded_to_nearest_even_and_answered_as_floats(
    server: Server, model: str
) -> None:
    values = [[1 + 2**-8, 1 + 3 * 2**-8, 1 + 2**-8 + 2**-30], [0.1, -0.0, 3.0e38]]
    inputs = [{"name": "in_BF16", "datatype": "BF16", "shape": [2, 3], "data": values}]
    if model == "identity_bf16":
        inputs.append({"name": "in_FP32", "datatype": "FP32", "shape": [2, 3], "data": [0.0] * 6})
    answer = server.client.post(f"/v2/models/{model}/infer", json={"inputs": inputs})
    assert answer.status_code == 200, answer.text
    (out,) = [o for o in answer.json()["outputs"] if o["name"] == "out_BF16"]
    assert out["datatype"] == "BF16" and out["shape"] == [2, 3]
    # ties to even (down, then up); just past a tie: up; -0 keeps its sign
    got = bits(np.array(out["data"], ml_dtypes.bfloat16)).tolist()
    assert got == [0x3F80, 0x3F82, 0x3F81, 0x3DCD, 0x8000, 0x7F62]
    assert out["data"][:3] == [1.0, 1.015625, 1.0078125] and str(out["data"][4]) == "-0.0"


@pytest.mark.parametrize("model", MODELS)
def test_tritonclient_grpc_round_trips_bf16_in_raw_contents(server: Server, model: str) -> None:
    client = tgrpc.InferenceServerClient(server.grpc_url)
    result = client.infer(model, _inputs(tgrpc, model, SPECIAL))
    got = result.as_numpy("out_BF16")
    assert got.dtype == ml_dtypes.bfloat16
    np.testing.assert_array_equal(bits(got), bits(SPECIAL))
    raw = result.get_response()
    assert raw.outputs[0].datatype == "BF16" and len(raw.raw_output_contents[0]) == 2 * 9


def test_typed_contents_for_bf16_are_invalid_argument_naming_raw_contents(server: Server) -> None:
    request = service_pb2.ModelInferRequest(model_name="copy_bf16")
    tensor = request.inputs.add(name="in_BF16", datatype="BF16", shape=[1, 3])
    tensor.contents.fp32_contents.extend([1.0, 2.0, 3.0])
    with grpc.insecure_channel(server.grpc_url) as channel:
        stub = service_grpc.GRPCInferenceServiceStub(channel)
        with pytest.raises(grpc.RpcError) as error:
            stub.ModelInfer(request)
    assert error.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert "raw_input_contents" in (error.value.details() or "")
    http = thttp.InferenceServerClient(server.url.removeprefix("http://"))
    with pytest.raises(InferenceServerException, match="binary data"):  # refused by the client
        http.infer("copy_bf16", _inputs(thttp, "copy_bf16", SPECIAL, binary=False))


@pytest.mark.parametrize("model", MODELS)
def test_a_bf16_output_is_classified_by_its_values(server: Server, model: str) -> None:
    """Triton's classification parameter on a BF16 output ranked and wrote the 2-byte words as
    integers: [-1.0, 0.5, 2.0] answered 49024 (-1.0's bits) first."""
    inputs = [{"name": "in_BF16", "datatype": "BF16", "shape": [1, 3], "data": [-1.0, 0.5, 2.0]}]
    if model == "identity_bf16":
        inputs.append({"name": "in_FP32", "datatype": "FP32", "shape": [1, 3], "data": [0.0] * 3})
    asked = [{"name": "out_BF16", "parameters": {"classification": 2}}]
    answer = server.client.post(
        f"/v2/models/{model}/infer", json={"inputs": inputs, "outputs": asked}
    )
    assert answer.status_code == 200, answer.text
    assert answer.json()["outputs"][0]["data"] == ["2.000000:2", "0.500000:1"]
