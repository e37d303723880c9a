"""An artifact that answers a NaN or an infinity unlike eager PyTorch never answers one.

torch 2.13's AOTInductor compiles ``torch.relu`` into a kernel that turns NaN into 0: a
click-through model's package answered a NaN feature with the score 0.528 where eager PyTorch,
onnxruntime and TorchScript answered NaN (a new user's walk). Export now runs each artifact on
a NaN and an infinity in each float input without a range, records the ones that answer
otherwise than eager PyTorch, and the server refuses non-finite values for the inputs of a
version served from one (a 400); the others answer them as eager PyTorch does."""

from __future__ import annotations

import shutil
import warnings
from collections.abc import Iterator

import numpy as np
import pytest
import torch
import yaml

from service.export.exporter import export_model
from service.model_config import TensorConfig
from tests.models import Scores
from tests.server import Server

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    root = tmp_path_factory.mktemp("non_finite") / "models"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        manifest = export_model(
            Scores(),
            root / "scores_pt2" / "1",
            name="scores",
            inputs=[TensorConfig(name="x", datatype="FP32", shape=(8,))],
            outputs=[TensorConfig(name="y", datatype="FP32", shape=(1,))],
            golden_inputs={"x": np.random.default_rng(0).standard_normal((4, 8)).astype("f4")},
            max_batch_size=8,
            formats=("onnx", "pt2"),
        )
    assert set(manifest.non_finite) == {"pt2"}, manifest.non_finite
    assert manifest.non_finite["pt2"] == (
        "nan in input 'x' makes 1 of output 'y''s values NaN or infinite in eager PyTorch, "
        "0 in AOTInductor"
    )
    shutil.copytree(root / "scores_pt2", root / "scores_onnx")
    for backend in ("pt2", "onnx"):
        config = {"backend": backend, "max_batch_size": 8}
        (root / f"scores_{backend}" / "config.yaml").write_text(yaml.safe_dump(config))
    server = Server(root)
    try:
        server.wait_until()
        yield server
    finally:
        server.stop()


def _infer(server: Server, model: str, row: list[object]) -> tuple[int, dict[str, object]]:
    body = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 8], "data": row}]}
    response = server.client.post(f"/v2/models/{model}/infer", json=body)
    return response.status_code, response.json()


@pytest.mark.parametrize("value", ["NaN", "Infinity"])
def test_a_package_that_drops_nan_refuses_non_finite_inputs(served: Server, value: str) -> None:
    status, answer = _infer(served, "scores_pt2", [value] + [0.1] * 7)
    assert status == 400, answer
    assert "input 'x': values must lie within [-3.40282e+38, 3.40282e+38]" in str(answer["error"])
    warnings_ = served.client.get("/v2/models/scores_pt2").json()["warnings"]
    assert any("answers non-finite inputs unlike eager PyTorch" in w for w in warnings_)


def test_finite_inputs_are_answered_as_eager_and_onnx_answers_nan_as_eager(served: Server) -> None:
    row = [0.1 * i for i in range(8)]
    with torch.inference_mode():
        want = Scores().eval()(torch.tensor([row])).numpy()
    for model in ("scores_pt2", "scores_onnx"):
        status, answer = _infer(served, model, row)
        assert status == 200, answer
        np.testing.assert_allclose(answer["outputs"][0]["data"], want.ravel(), atol=1e-6)
    status, answer = _infer(served, "scores_onnx", ["NaN"] + [0.1] * 7)
    assert status == 200 and answer["outputs"][0]["data"] == ["NaN"], answer
