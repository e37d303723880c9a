import json
from pathlib import Path

import numpy as np
import pytest
import torch

from preprocessing.spec import ImageSpec, spec_hash
from service.export import ExportError, export_model
from service.manifest import Tolerance
from service.model_config import TensorConfig
from tests.models import Mlp, TrainModeNet

X = TensorConfig(name="x", datatype="FP32", shape=(64,))
Y = TensorConfig(name="y", datatype="FP32", shape=(10,))


def golden() -> dict[str, np.ndarray]:
    return {"x": np.random.default_rng(0).standard_normal((3, 64)).astype(np.float32)}


def test_export_writes_both_artifacts_golden_and_manifest(tmp_path: Path) -> None:
    spec = ImageSpec(resize=8, crop=8)
    manifest = export_model(
        Mlp().eval(), tmp_path, name="mlp", inputs=[X], outputs=[Y], golden_inputs=golden(),
        max_batch_size=16, preprocessing=spec, metrics={"accuracy": 0.5},
    )  # fmt: skip
    assert {p.name for p in tmp_path.iterdir()} == {
        "model.onnx", "model.pt", "golden.npz", "manifest.json"
    }  # fmt: skip
    written = json.loads((tmp_path / "manifest.json").read_text())
    assert written["preprocessing_hash"] == spec_hash(spec) == manifest.preprocessing_hash
    assert written["dynamic_axes"] == {"x": {"0": "batch"}, "y": {"0": "batch"}}
    assert written["versions"]["torch"] == torch.__version__
    assert written["opset"] == 17
    assert written["metrics"] == {"accuracy": 0.5}
    assert manifest.parity["onnx"]["max_abs"] < 1e-4
    with np.load(tmp_path / "golden.npz") as files:
        expected = Mlp().eval()(torch.from_numpy(golden()["x"])).detach().numpy()
        np.testing.assert_array_equal(files["output.y"], expected)


def test_export_of_a_module_left_in_train_mode_warns_and_exports_eval(tmp_path: Path) -> None:
    x = TensorConfig(name="x", datatype="FP32", shape=(8,))
    y = TensorConfig(name="y", datatype="FP32", shape=(4,))
    rows = {"x": np.ones((4, 8), np.float32)}
    with pytest.warns(UserWarning, match="was in training mode"):
        export_model(TrainModeNet().train(), tmp_path, name="t", inputs=[x], outputs=[y],
                     golden_inputs=rows, max_batch_size=4)  # fmt: skip
    loaded = torch.jit.load(str(tmp_path / "model.pt"))
    assert not loaded.training


def test_disagreement_beyond_tolerance_fails_with_the_error_size(tmp_path: Path) -> None:
    with pytest.raises(ExportError, match="max abs error .* max rel error"):
        export_model(
            Mlp().eval(), tmp_path, name="mlp", inputs=[X], outputs=[Y], golden_inputs=golden(),
            max_batch_size=16, tolerance=Tolerance(atol=1e-30, rtol=0.0), formats=("onnx",),
        )  # fmt: skip


def test_declared_output_datatype_must_match(tmp_path: Path) -> None:
    wrong = TensorConfig(name="y", datatype="FP64", shape=(10,))
    with pytest.raises(ExportError, match="declared FP64, the module returns float32"):
        export_model(Mlp().eval(), tmp_path, name="mlp", inputs=[X], outputs=[wrong],
                     golden_inputs=golden(), max_batch_size=16)  # fmt: skip
