from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch

from service.errors import ModelLoadError
from service.model_config import TensorConfig
from service.runtimes import create_runtime, resolve_device
from service.runtimes.base import RuntimeOptions, Signature
from service.runtimes.onnx import providers_for
from service.runtimes.torchscript import TorchScriptRuntime
from tests.models import TrainModeNet

SIGNATURE = Signature(
    (TensorConfig(name="x", datatype="FP32", shape=(8,)),),
    (TensorConfig(name="y", datatype="FP32", shape=(4,)),),
)


@pytest.fixture
def train_mode_archive(tmp_path: Path) -> Path:
    model = TrainModeNet().train()
    path = tmp_path / "model.pt"
    torch.jit.script(model).save(str(path))
    return path


def test_torchscript_runtime_enforces_eval_no_grad_and_inference_mode(
    train_mode_archive: Path,
) -> None:
    runtime = TorchScriptRuntime(RuntimeOptions("cpu", 1))
    runtime.load(train_mode_archive, SIGNATURE, max_batch_size=8)
    module = runtime._module
    assert not any(sub.training for sub in module.modules())
    assert not any(p.requires_grad for p in module.parameters())
    x = np.random.default_rng(0).standard_normal((5, 8)).astype(np.float32)
    first, second = runtime.run({"x": x})["y"], runtime.run({"x": x})["y"]
    np.testing.assert_array_equal(first, second)
    eager = TrainModeNet().eval()
    with torch.no_grad():
        np.testing.assert_allclose(first, eager(torch.from_numpy(x)).numpy(), atol=1e-5)
    with torch.inference_mode():
        raw = module(torch.from_numpy(x))
    assert raw.is_inference() and not raw.requires_grad and raw.grad_fn is None


def test_torchscript_without_declared_signature_is_refused(train_mode_archive: Path) -> None:
    runtime = TorchScriptRuntime(RuntimeOptions("cpu", 1))
    with pytest.raises(ModelLoadError, match="carries no tensor datatypes"):
        runtime.load(train_mode_archive, None, max_batch_size=8)


def test_torchscript_on_absent_cuda_is_refused_clearly(train_mode_archive: Path) -> None:
    if torch.cuda.is_available():
        pytest.skip("this check is for machines without CUDA; a GPU is present")
    runtime = TorchScriptRuntime(RuntimeOptions("cuda", 1))
    with pytest.raises(ModelLoadError, match="torch sees no CUDA device"):
        runtime.load(train_mode_archive, SIGNATURE, max_batch_size=8)


def test_onnx_providers_are_explicit_and_cuda_absent_is_refused() -> None:
    assert providers_for("cpu", ["CPUExecutionProvider"]) == ["CPUExecutionProvider"]
    cuda = providers_for("cuda:1", ["CUDAExecutionProvider", "CPUExecutionProvider"])
    assert [p if isinstance(p, str) else p[0] for p in cuda] == [
        "CUDAExecutionProvider",
        "CPUExecutionProvider",
    ]
    assert cuda[0][1]["device_id"] == 1
    with pytest.raises(ModelLoadError, match="no CUDAExecutionProvider.*install onnxruntime-gpu"):
        providers_for("cuda", ["CPUExecutionProvider"])


def test_auto_device_falls_back_to_cpu_without_a_gpu() -> None:
    if torch.cuda.is_available():
        pytest.skip("this check is for machines without CUDA; a GPU is present")
    assert resolve_device("auto", "onnx") == "cpu"
    assert resolve_device("auto", "torchscript") == "cpu"
    assert resolve_device("cuda:0", "onnx") == "cuda:0"


def test_onnx_runtime_reads_the_signature_from_the_graph(tmp_path: Path) -> None:
    path = tmp_path / "model.onnx"
    torch.onnx.export(
        TrainModeNet().eval(), (torch.zeros(2, 8),), str(path), input_names=["x"],
        output_names=["y"], dynamic_axes={"x": {0: "b"}, "y": {0: "b"}}, dynamo=False,
    )  # fmt: skip
    runtime = create_runtime("onnx", RuntimeOptions("cpu", 1))
    signature = runtime.load(path, None, max_batch_size=8)
    assert signature == SIGNATURE
    wrong = Signature((TensorConfig(name="x", datatype="FP64", shape=(8,)),), SIGNATURE.outputs)
    with pytest.raises(ModelLoadError, match="declared FP64 \\[8\\], the graph has FP32 \\[8\\]"):
        create_runtime("onnx", RuntimeOptions("cpu", 1)).load(path, wrong, max_batch_size=8)
    (tmp_path / "broken.onnx").write_bytes(b"not onnx")
    with pytest.raises(ModelLoadError, match="onnxruntime cannot load broken.onnx"):
        create_runtime("onnx", RuntimeOptions("cpu", 1)).load(tmp_path / "broken.onnx", None, 8)


def test_cuda_providers_carry_their_options_and_tensorrt_comes_first() -> None:
    from service.model_config import GpuConfig

    available = ["TensorrtExecutionProvider", "CUDAExecutionProvider", "CPUExecutionProvider"]
    gpu = GpuConfig(tensorrt=True, tensorrt_fp16=True, memory_limit_bytes=2**30)
    providers = providers_for("cuda:1", available, gpu, Path("/models/m/1"))
    assert providers[0] == (
        "TensorrtExecutionProvider",
        {"device_id": 1, "trt_engine_cache_enable": True,
         "trt_engine_cache_path": "/models/m/1/tensorrt_cache", "trt_fp16_enable": True},
    )  # fmt: skip
    assert providers[1] == (
        "CUDAExecutionProvider",
        {"device_id": 1, "arena_extend_strategy": "kNextPowerOfTwo",
         "cudnn_conv_algo_search": "EXHAUSTIVE", "gpu_mem_limit": 2**30},
    )  # fmt: skip
    assert providers[-1] == "CPUExecutionProvider"
    with pytest.raises(ModelLoadError, match="gpu.tensorrt is set, but this onnxruntime has no"):
        providers_for("cuda", available[1:], gpu)


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_half_precision_is_converted_at_load_and_answers_in_the_declared_dtype(
    train_mode_archive: Path, precision: str
) -> None:
    runtime = TorchScriptRuntime(RuntimeOptions("cpu", 1, precision))
    runtime.load(train_mode_archive, SIGNATURE, max_batch_size=8)
    assert all(p.dtype != torch.float32 for p in runtime._module.parameters())
    x = np.random.default_rng(1).standard_normal((3, 8)).astype(np.float32)
    y = runtime.run({"x": x})["y"]
    assert y.dtype == np.float32
    with torch.no_grad():
        exact = TrainModeNet().eval()(torch.from_numpy(x)).numpy()
    np.testing.assert_allclose(y, exact, atol=0.1)
    assert np.abs(y - exact).max() > 0  # it really ran in half precision


@pytest.mark.integration  # loads the built digits model
def test_half_precision_needs_the_golden_tolerance_widened_explicitly(tmp_path: Path) -> None:
    import shutil

    from service.loader import load_version
    from service.model_config import load_model_config
    from service.settings import Settings
    from tests.server import MODELS

    shutil.copytree(MODELS / "digits", tmp_path / "digits")
    config_path = tmp_path / "digits" / "config.yaml"
    config_path.write_text(config_path.read_text() + "precision: bf16\n")
    settings = Settings(model_repository=tmp_path)
    with pytest.raises(ModelLoadError, match="set tolerance_override .* explicitly"):
        load_version("digits", tmp_path / "digits" / "1", load_model_config(config_path), settings)
    config_path.write_text(config_path.read_text() + "tolerance_override: 0.1\n")
    loaded = load_version(
        "digits", tmp_path / "digits" / "1", load_model_config(config_path), settings
    )
    assert "golden tolerance widened by config to atol=0.1" in loaded.warnings
    loaded.close()


def test_instances_spread_round_robin_over_the_visible_gpus() -> None:
    from service.runtimes import instance_devices

    def gpus(count: int) -> Callable[[], int]:
        return lambda: count

    assert instance_devices("cpu", 3, gpus(0)) == ["cpu", "cpu", "cpu"]
    assert instance_devices("cuda", 3, gpus(2)) == ["cuda:0", "cuda:1", "cuda:0"]
    assert instance_devices("cuda:1", 2, gpus(2)) == ["cuda:1", "cuda:1"]
    with pytest.raises(ModelLoadError, match="only 2 CUDA device\\(s\\) are visible"):
        instance_devices("cuda:2", 1, gpus(2))
    with pytest.raises(ModelLoadError, match="no CUDA device is visible"):
        instance_devices("cuda", 1, gpus(0))


def test_onnx_io_binding_answers_exactly_as_a_plain_run(tmp_path: Path) -> None:
    """IO binding is the CUDA path's transfer discipline; forced on here, on the CPU, it must
    give the same bytes as onnxruntime's plain run (read-only request views included)."""
    from service.model_config import GpuConfig

    path = tmp_path / "model.onnx"
    torch.onnx.export(
        TrainModeNet().eval(), (torch.zeros(2, 8),), str(path), input_names=["x"],
        output_names=["y"], dynamic_axes={"x": {0: "b"}, "y": {0: "b"}}, dynamo=False,
    )  # fmt: skip
    plain = create_runtime("onnx", RuntimeOptions("cpu", 1, gpu=GpuConfig(io_binding="off")))
    bound = create_runtime("onnx", RuntimeOptions("cpu", 1, gpu=GpuConfig(io_binding="on")))
    for runtime in (plain, bound):
        runtime.load(path, None, max_batch_size=8)
    assert not plain._io_binding and bound._io_binding
    x = np.random.default_rng(2).standard_normal((5, 8)).astype(np.float32)
    view = np.frombuffer(x.tobytes(), dtype=np.float32).reshape(5, 8)  # read-only, like a body
    for batch in ({"x": x}, {"x": view}, {"x": x[::2]}):  # a strided slice too
        np.testing.assert_array_equal(bound.run(batch)["y"], plain.run(batch)["y"])
    auto = create_runtime("onnx", RuntimeOptions("cpu", 1))
    auto.load(path, None, max_batch_size=8)
    assert not auto._io_binding  # auto binds on CUDA only
    for runtime in (plain, bound, auto):
        runtime.close()
        runtime.close()  # twice is fine
        assert not hasattr(runtime, "_session")


def test_io_binding_is_off_for_models_with_string_outputs(tmp_path: Path) -> None:
    from service.model_config import GpuConfig
    from tests.identity import write_identity_model

    write_identity_model(tmp_path / "identity")
    runtime = create_runtime("onnx", RuntimeOptions("cpu", 1, gpu=GpuConfig(io_binding="on")))
    runtime.load(tmp_path / "identity" / "1" / "model.onnx", None, max_batch_size=8)
    assert not runtime._io_binding  # out_BYTES lives on the host


@pytest.mark.integration  # loads the built digits model
def test_cuda_graphs_are_for_torchscript_and_ignored_with_a_warning_on_the_cpu(
    tmp_path: Path,
) -> None:
    import shutil

    from pydantic import ValidationError

    from service.loader import load_version
    from service.model_config import ModelConfig, load_model_config
    from service.settings import Settings
    from tests.server import MODELS

    with pytest.raises(ValidationError, match="gpu.cuda_graphs is for TorchScript models"):
        ModelConfig.model_validate({"backend": "onnx", "gpu": {"cuda_graphs": True}})
    shutil.copytree(MODELS / "digits", tmp_path / "digits")
    config_path = tmp_path / "digits" / "config.yaml"
    config_path.write_text(config_path.read_text() + "device: cpu\ngpu: {cuda_graphs: true}\n")
    settings = Settings(model_repository=tmp_path)
    loaded = load_version(
        "digits", tmp_path / "digits" / "1", load_model_config(config_path), settings
    )
    assert "gpu.cuda_graphs ignored: the model runs on the CPU" in loaded.warnings
    runtime = loaded.runtimes[0]
    assert isinstance(runtime, TorchScriptRuntime) and runtime.captured == frozenset()
    loaded.close()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_graphs_replay_captured_shapes_and_match_eager(train_mode_archive: Path) -> None:
    from service.model_config import GpuConfig

    eager = TorchScriptRuntime(RuntimeOptions("cuda", 1))
    graphs = TorchScriptRuntime(RuntimeOptions("cuda", 1, gpu=GpuConfig(cuda_graphs=True)))
    for runtime in (eager, graphs):
        runtime.load(train_mode_archive, SIGNATURE, max_batch_size=8)
    zeros = {"x": np.zeros((4, 8), np.float32)}
    graphs.warmup(zeros)
    assert graphs.captured == {(("x", "<f4", (4, 8)),)}
    rng = np.random.default_rng(3)
    for rows in (4, 4, 3):  # two replays with different data, then an uncaptured shape
        x = {"x": rng.standard_normal((rows, 8)).astype(np.float32)}
        np.testing.assert_allclose(graphs.run(x)["y"], eager.run(x)["y"], atol=1e-6)
