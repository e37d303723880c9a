"""Versions refused at load whatever their format, with a manifest or without: a model that
answers one batch twice differently (a dropout exported in train() mode, noise left in
forward), and a version folder an export is writing, or left half written."""

import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from service.errors import ModelLoadError
from service.export.exporter import export_model
from service.model_config import ModelConfig, TensorConfig
from service.repository.loader import _apart, _ones, load_version
from service.settings import Settings
from tests.models import Noisy


class DropsLast(nn.Module):
    """A head whose dropout is its last op: onnxruntime's optimizer removes a dropout between
    two ops, but not one whose output is the graph's."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.out = nn.Linear(8, 32)  # 32 values: never the same mask in two runs
        self.drop = nn.Dropout(0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.out(x))


def _onnx(module: nn.Module, path: Path) -> None:
    path.parent.mkdir(parents=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(
            module,
            (torch.zeros(2, 8),),
            str(path),
            input_names=["x"],
            output_names=["y"],
            dynamic_shapes={"x": {0: torch.export.Dim("batch", max=8)}},
        )


def _config(backend: str, **extra: object) -> ModelConfig:
    return ModelConfig.model_validate({"backend": backend, "max_batch_size": 8, **extra})


def test_an_onnx_model_exported_in_train_mode_is_refused_unless_it_samples_on_purpose(
    tmp_path: Path,
) -> None:
    """torch.onnx.export of a module left in train() keeps its Dropout live (training_mode
    True): onnxruntime drops at random on every call. No manifest: no golden replay."""
    _onnx(DropsLast().train(), tmp_path / "net" / "1" / "model.onnx")
    settings = Settings(model_repository=tmp_path)
    with pytest.raises(ModelLoadError) as refused:
        load_version("net", tmp_path / "net" / "1", _config("onnx"), settings)
    said = str(refused.value)
    assert "two runs of the same batch answered differently (output 'y': " in said
    assert " values apart)): " in said
    assert "most likely a dropout exported in train() mode" in said
    assert "set stochastic: true in config.yaml" in said

    loaded = load_version("net", tmp_path / "net" / "1", _config("onnx", stochastic=True), settings)
    loaded.close()


def test_the_same_model_exported_in_eval_mode_loads(tmp_path: Path) -> None:
    _onnx(DropsLast().eval(), tmp_path / "net" / "1" / "model.onnx")
    settings = Settings(model_repository=tmp_path)
    load_version("net", tmp_path / "net" / "1", _config("onnx"), settings).close()


def test_a_torchscript_model_that_adds_noise_in_eval_mode_is_refused(tmp_path: Path) -> None:
    """No dropout or normalisation op for the TorchScript check to read: Gaussian noise added
    in forward, whatever eval() says. Its answers show it."""
    version = tmp_path / "noisy" / "1"
    version.mkdir(parents=True)
    torch.jit.trace(Noisy().eval(), torch.zeros(2, 8), check_trace=False).save(
        str(version / "model.pt")
    )
    tensors = {
        "inputs": [{"name": "x", "datatype": "FP32", "shape": [8]}],
        "outputs": [{"name": "y", "datatype": "FP32", "shape": [4]}],
    }
    settings = Settings(model_repository=tmp_path)
    with pytest.raises(ModelLoadError, match="two runs of the same batch answered differently"):
        load_version("noisy", version, _config("torchscript", **tensors), settings)
    config = _config("torchscript", stochastic=True, **tensors)
    load_version("noisy", version, config, settings).close()


def test_two_runs_agree_within_what_other_threads_may_change() -> None:
    logits = np.array([[3.0, -1.0, 0.5]], dtype=np.float32)
    assert _apart(logits, logits + np.float32(1e-4)) is None  # within 1e-4 + 1e-3 × each
    assert _apart(logits, logits * 2) == "3, then 6 (3 values apart)"
    # each value by its own magnitude: a mask's -1e9 does not hide a dropped activation
    masked = np.array([-1e9, 0.8, 0.3])
    assert _apart(masked, np.array([-1e9, 0.0, 0.3])) == "0.8, then 0 (1 values apart)"
    assert _apart(np.array([np.nan, 1.0]), np.array([np.nan, 1.0])) is None
    assert _apart(np.array([np.nan, 1.0]), np.array([0.0, 1.0])) == "NaN in one run only"
    inf = np.array([-np.inf, 2.0, np.inf])
    assert _apart(inf, inf.copy()) is None  # a mask's -inf in both runs
    assert _apart(inf, np.array([-np.inf, 2.0, 5.0])) == "inf, then 5 (1 values apart)"
    assert _apart(np.array([1, 2]), np.array([1, 2])) is None
    assert _apart(np.array([1, 2]), np.array([1, 3])) == "values differ"
    assert _apart(np.zeros((1, 2)), np.zeros((2, 2))) == "shape [1, 2], then [2, 2]"


@pytest.mark.parametrize(
    ("datatype", "bounds", "value"),
    [
        ("FP32", None, 1.0),
        ("FP32", (-1.0, 1.0), 1.0),  # the middle, 0, would pass a dropout unchanged
        ("INT64", (0, 1), 1),  # an attention mask: 0.5 truncated to 0 masked everything
        ("INT64", (2, 5), 5),  # 4.25, rounded up
        ("FP32", (-3.4e38, 3.4e38), 1.0),  # a finite-only input: not 1.7e38
        ("FP32", (10.0, 20.0), 17.5),
    ],
)
def test_the_repeatability_batch_is_never_all_zeros(
    datatype: str, bounds: tuple[float, float] | None, value: float
) -> None:
    tensor = TensorConfig(name="x", datatype=datatype, shape=(2,), range=bounds)
    np.testing.assert_array_equal(_ones((1, 2), tensor), np.full((1, 2), value))


def test_a_version_whose_export_never_finished_is_refused(tmp_path: Path) -> None:
    """An export killed midway (out of memory, a signal) leaves its version folder half written
    and what it replaced set aside beside it; the server served what it found, unverified (a
    new user's walk: a crashed export's leftover padded what its export had measured it must
    not). The same holds while an export is under way."""
    _onnx(DropsLast().eval(), tmp_path / "net" / "1" / "model.onnx")
    aside = tmp_path / "net" / ".1.before-export-x1y2"
    aside.mkdir()
    settings = Settings(model_repository=tmp_path)
    with pytest.raises(ModelLoadError) as refused:
        load_version("net", tmp_path / "net" / "1", _config("onnx"), settings)
    assert str(refused.value) == (
        "version 1 is being exported, or its export never finished (it keeps the files it "
        "replaces in .1.before-export-x1y2 beside it until it ends): its folder may be half "
        "written; export it again (an export that finishes removes .1.before-export-x1y2)"
    )
    # as it says: an export of the version that finishes removes what one that did not left
    (aside / "model.onnx").write_text("the graph before the export that never finished")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        export_model(
            DropsLast().eval(),
            tmp_path / "net" / "1",
            name="net",
            inputs=[TensorConfig(name="x", datatype="FP32", shape=(8,))],
            outputs=[TensorConfig(name="y", datatype="FP32", shape=(32,))],
            golden_inputs={"x": np.ones((2, 8), np.float32)},
            max_batch_size=8,
            formats=("onnx",),
        )
    assert sorted(p.name for p in (tmp_path / "net").iterdir()) == ["1"]
    load_version("net", tmp_path / "net" / "1", _config("onnx"), settings).close()
