"""NVIDIA's own client, unchanged, against a real tensorgate server."""

from __future__ import annotations

import numpy as np
import pytest
import tritonclient.http as triton
from tritonclient.utils import InferenceServerException

from tests.server import Server

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def client(server: Server) -> triton.InferenceServerClient:
    return triton.InferenceServerClient(server.url.removeprefix("http://"))


def test_health_and_metadata(client: triton.InferenceServerClient) -> None:
    assert client.is_server_live()
    assert client.is_server_ready()
    metadata = client.get_server_metadata()
    assert metadata["name"] == "tensorgate"
    assert "binary_tensor_data" in metadata["extensions"]
    assert client.is_model_ready("efficientnet_lite0")
    assert client.is_model_ready("digits", "1")
    model = client.get_model_metadata("efficientnet_lite0")
    assert model["platform"] == "onnxruntime_onnx"
    assert model["versions"] == ["1"]
    assert model["inputs"][0] == {"name": "input", "datatype": "FP32", "shape": [-1, 3, 224, 224]}
    assert model["outputs"][0] == {"name": "logits", "datatype": "FP32", "shape": [-1, 1000]}
    assert client.get_model_metadata("digits", "1")["platform"] == "pytorch_libtorch"


@pytest.mark.parametrize("rows", [1, 4])
@pytest.mark.parametrize("binary", [False, True])
def test_infer_with_fp32_tensors(
    client: triton.InferenceServerClient, rows: int, binary: bool
) -> None:
    x = np.random.default_rng(rows).standard_normal((rows, 3, 224, 224)).astype(np.float32)
    tensor = triton.InferInput("input", list(x.shape), "FP32")
    tensor.set_data_from_numpy(x, binary_data=binary)
    wanted = [triton.InferRequestedOutput("logits", binary_data=binary)]
    result = client.infer("efficientnet_lite0", [tensor], outputs=wanted, request_id="req-1")
    logits = result.as_numpy("logits")
    assert logits.shape == (rows, 1000)
    assert logits.dtype == np.float32
    assert result.get_response()["id"] == "req-1"
    assert result.get_response()["model_version"] == "1"
    # Each row is answered on its own: row 0 of a batch equals row 0 sent alone.
    alone = triton.InferInput("input", [1, 3, 224, 224], "FP32")
    alone.set_data_from_numpy(x[:1], binary_data=binary)
    single = client.infer("efficientnet_lite0", [alone]).as_numpy("logits")
    np.testing.assert_allclose(single[0], logits[0], atol=1e-4)


def test_errors_reach_the_client_with_their_message(client: triton.InferenceServerClient) -> None:
    x = np.zeros((1, 3, 224, 224), np.float64)
    tensor = triton.InferInput("input", list(x.shape), "FP64")
    tensor.set_data_from_numpy(x)
    with pytest.raises(InferenceServerException, match="expected FP32 .* got FP64"):
        client.infer("efficientnet_lite0", [tensor])
    with pytest.raises(InferenceServerException, match="unknown model 'nope'"):
        client.get_model_metadata("nope")
