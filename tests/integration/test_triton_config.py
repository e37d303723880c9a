"""Triton's model configuration (``/config`` and gRPC ``ModelConfig``), read as Triton's own
tooling reads it: a request built from ``input[].dims`` and ``data_type`` alone is valid."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as tgrpc
import tritonclient.http as thttp
from tritonclient.utils import triton_to_np_dtype

from tests.conftest import BUNDLED
from tests.server import Server

pytestmark = pytest.mark.integration
DYNAMIC = 8
"""What a dynamic dim (-1) is filled with, as perf_analyzer needs a --shape for it."""


def request_from_config(config: dict[str, Any]) -> list[tgrpc.InferInput]:
    """What a script that knows nothing but the config sends: every required input, ones."""
    inputs = []
    for spec in config["input"]:
        if spec.get("optional", False):
            continue
        dims = [DYNAMIC if int(d) == -1 else int(d) for d in spec["dims"]]
        shape = [1, *dims] if int(config["max_batch_size"]) > 0 else dims
        datatype = spec["data_type"].removeprefix("TYPE_")
        tensor = tgrpc.InferInput(spec["name"], shape, datatype)
        tensor.set_data_from_numpy(np.ones(shape, triton_to_np_dtype(datatype)))
        inputs.append(tensor)
    return inputs


@pytest.mark.parametrize("model", BUNDLED)
def test_config_has_tritons_shape_and_builds_valid_requests(server: Server, model: str) -> None:
    over_http = thttp.InferenceServerClient(server.url.removeprefix("http://"))
    over_grpc = tgrpc.InferenceServerClient(server.grpc_url)
    config = over_http.get_model_config(model)
    grpc_config = over_grpc.get_model_config(model, as_json=True)["config"]
    assert config["name"] == grpc_config["name"] == model
    assert config["platform"] in ("onnxruntime_onnx", "pytorch_libtorch")
    assert config["backend"] in ("onnxruntime", "pytorch")
    assert config["max_batch_size"] == int(grpc_config["max_batch_size"]) > 0
    assert config["dynamic_batching"]["max_queue_delay_microseconds"] >= 0
    assert config["instance_group"][0]["kind"] == grpc_config["instance_group"][0]["kind"]
    assert config["version_policy"] == {"latest": {"num_versions": 1}}
    for ours, theirs in zip(config["input"], grpc_config["input"], strict=True):
        assert ours["name"] == theirs["name"] and ours["data_type"] == theirs["data_type"]
        assert [int(d) for d in theirs["dims"]] == ours["dims"]
        assert ours.get("optional", False) == theirs.get("optional", False)
        assert ("reshape" in ours) == ("reshape" in theirs)  # gRPC JSON writes [] as {}
    optional = [i["name"] for i in config["input"] if i.get("optional")]
    # the pipeline's raw input: the image's (`<input>_bytes`), the text's, or the code's own
    raw = {"minilm": "text", "wine": "record", "faces": "image_bytes"}
    assert optional == [raw.get(model, f"{config['input'][0]['name']}_bytes")]
    assert "tensorgate.preprocessing" in config["parameters"]
    result = over_grpc.infer(model, request_from_config(grpc_config))
    for output in config["output"]:
        if output["name"] == "answer":  # a pipeline code's answer to raw items: none sent here
            continue
        assert result.as_numpy(output["name"]) is not None, output["name"]
