from pathlib import Path

import numpy as np
import pytest
import yaml

from preprocessing.spec import ImageSpec, PythonSpec, spec_hash
from service.artifacts.manifest import (
    Manifest,
    Tolerance,
    check_golden,
    check_preprocessing,
    check_versions,
    max_opset,
    read_golden,
)
from service.errors import ModelLoadError
from service.model_config import ModelConfig, TensorConfig

SPEC = ImageSpec(resize=8, crop=8)


def manifest(**changes: object) -> Manifest:
    base = Manifest(
        name="m",
        max_batch_size=4,
        inputs=(TensorConfig(name="x", datatype="FP32", shape=(3,)),),
        outputs=(TensorConfig(name="y", datatype="FP32", shape=(2,)),),
        opset=17,
        versions={"torch": "2.13.0+cpu", "onnxruntime": "1.32.0"},
        artifacts={"onnx": "model.onnx", "torchscript": "model.pt"},
        preprocessing=SPEC.model_dump(mode="json"),
        preprocessing_hash=spec_hash(SPEC),
    )
    return base.model_copy(update=changes)


RUNNING = {"onnxruntime": "1.32.0", "torch": "2.13.0+cpu"}


def test_opset_table_grows_with_onnxruntime() -> None:
    assert max_opset("1.14.1") == 18
    assert max_opset("1.17.0") == 20
    assert max_opset("1.32.0") >= 23


def test_a_current_artifact_passes_every_version_check() -> None:
    check_versions(manifest(), "onnx", RUNNING)
    check_versions(manifest(), "torchscript", RUNNING)


@pytest.mark.parametrize(
    ("changes", "backend", "message"),
    [
        ({"opset": 99}, "onnx", "ONNX opset 99 cannot run on onnxruntime 1.32.0"),
        ({"opset": 3}, "onnx", "ONNX opset 3 cannot run"),
        ({"versions": {"torch": "3.0.0"}}, "torchscript", "a different major version"),
        ({"versions": {"torch": "2.99.0"}}, "torchscript", "older torch 2.13.0"),
        ({"versions": {"torch": "banana"}}, "torchscript", "not a version"),
        ({"format": 2}, "onnx", "manifest format 2 is newer"),
        ({"artifacts": {"onnx": "model.onnx"}}, "torchscript", "lists only ['onnx']"),
    ],
)
def test_versions_the_server_cannot_run_are_refused(
    changes: dict[str, object], backend: str, message: str
) -> None:
    with pytest.raises(ModelLoadError, match=message.replace("[", r"\[").replace("]", r"\]")):
        check_versions(manifest(**changes), backend, RUNNING)


def test_an_edited_preprocessing_spec_is_refused() -> None:
    config = ModelConfig(backend="onnx", preprocessing=SPEC)
    check_preprocessing(config, manifest())
    edited = ModelConfig(backend="onnx", preprocessing=SPEC.model_copy(update={"color": "BGR"}))
    with pytest.raises(ModelLoadError, match="preprocessing in config.yaml differs"):
        check_preprocessing(edited, manifest())
    with pytest.raises(ModelLoadError, match="served None"):
        check_preprocessing(ModelConfig(backend="onnx"), manifest())


def test_the_spec_to_restore_is_said_as_config_yaml_takes_it() -> None:
    """It was the recorded dict's repr: ``'cls'`` and ``'package': None``, which config.yaml
    refuses when pasted back."""
    code = PythonSpec.model_validate({"kind": "python", "module": "rec", "class": "Records"})
    recorded = manifest(preprocessing=code.model_dump(mode="json"), preprocessing_hash="x")
    with pytest.raises(ModelLoadError) as refused:
        check_preprocessing(ModelConfig(backend="onnx", preprocessing=code), recorded)
    said = refused.value.args[0].split("(preprocessing: ", 1)[1].removesuffix(")")
    assert PythonSpec.model_validate(yaml.safe_load(said)) == code
    assert "None" not in said and '"class": "Records"' in said


def test_golden_replay_within_and_beyond_tolerance(tmp_path: Path) -> None:
    x = np.ones((2, 3), np.float32)
    y = np.array([[1.0, 2.0], [3.0, 4.0]], np.float32)
    np.savez(tmp_path / "golden.npz", **{"input.x": x, "output.y": y})
    worst = check_golden(read_golden(tmp_path), lambda batch: {"y": y + 1e-5}, Tolerance())
    assert worst["y"] == pytest.approx(1e-5, rel=1e-2)
    with pytest.raises(ModelLoadError, match="output 'y' differs .* by up to 0.5"):
        check_golden(read_golden(tmp_path), lambda batch: {"y": y + 0.5}, Tolerance())
    with pytest.raises(ModelLoadError, match="has shape \\[2\\], golden \\[2, 2\\]"):
        check_golden(read_golden(tmp_path), lambda batch: {"y": y[0]}, Tolerance())
    with pytest.raises(ModelLoadError, match="golden.npz is missing"):
        check_golden(read_golden(tmp_path / "nowhere"), lambda batch: {}, Tolerance())


def test_a_manifest_without_dynamic_dims_or_skipped_formats_writes_neither_key() -> None:
    """Servers that predate ``skipped`` and ``shapes`` refuse unknown keys: a manifest that has
    nothing to say in them leaves them out."""
    from service.artifacts.manifest import Manifest
    from service.model_config import TensorConfig

    x = TensorConfig(name="x", datatype="FP32", shape=(4,))
    written = Manifest(
        name="m",
        max_batch_size=1,
        inputs=(x,),
        outputs=(x,),
        versions={},
        artifacts={"onnx": "model.onnx"},
    ).model_dump_json()
    assert '"skipped"' not in written and '"shapes"' not in written
    assert Manifest.model_validate_json(written).shapes is None
