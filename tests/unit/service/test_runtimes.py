import contextlib
import json
import random
import re
import threading
import time
import zipfile
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch

from service.artifacts.manifest import check_pt2
from service.errors import ModelLoadError
from service.model_config import TensorConfig
from service.resources import CPU_USE
from service.runtimes import create_runtime, resolve_device
from service.runtimes.base import Runtime, RuntimeOptions, Signature
from service.runtimes.onnx import providers_for
from service.runtimes.pt2 import CPU_FLAGS_KEY, CPU_KEY, TORCH_KEY, Pt2Runtime
from service.runtimes.torchscript import TorchScriptRuntime
from tests.conftest import Exported
from tests.models import (
    AlwaysDrops,
    Attends,
    Copy,
    DropsNothing,
    GuardedDrops,
    InstanceNormed,
    InvertedGuard,
    Mlp,
    NormsWithoutStats,
    TinyText,
    TrainModeNet,
)

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


def test_a_module_traced_in_training_mode_is_refused_naming_each_op_and_its_line(
    tmp_path: Path,
) -> None:
    """eval() cannot undo a trace in train(): dropout and batch norm have train=True fixed in
    the graph, and no submodule reports training. It served with dropout on."""
    path = tmp_path / "model.pt"
    torch.jit.trace(TrainModeNet().train(), torch.zeros(2, 8)).save(str(path))
    runtime = TorchScriptRuntime(RuntimeOptions("cpu", 1))
    with pytest.raises(ModelLoadError) as refused:
        runtime.load(path, SIGNATURE, max_batch_size=8)
    message = str(refused.value)
    assert message.startswith(
        "model.pt runs in training mode whatever eval() says: its graph fixes 2 dropout or "
        "normalisation ops to training (batch_norm at "
    )
    assert "dropout at " in message and "tests/models.py(" in message  # the module's own line
    assert "call model.eval() before torch.jit.trace" in message


def test_a_scripted_dropout_that_ignores_eval_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "model.pt"
    torch.jit.script(AlwaysDrops().eval()).save(str(path))
    with pytest.raises(ModelLoadError, match=r"fixes 1 dropout or normalisation ops to training"):
        TorchScriptRuntime(RuntimeOptions("cpu", 1)).load(path, SIGNATURE, max_batch_size=8)


SEQUENCES = Signature(
    (TensorConfig(name="x", datatype="FP32", shape=(3, 8)),),
    (TensorConfig(name="y", datatype="FP32", shape=(3, 8)),),
)


@pytest.mark.parametrize(
    ("module", "example", "signature", "op"),
    [
        (Attends, torch.zeros(2, 3, 8), SEQUENCES, "scaled_dot_product_attention's dropout_p"),
        (InstanceNormed, torch.zeros(2, 8), SIGNATURE, "instance_norm"),
    ],
)
def test_a_trace_in_training_mode_of_attention_or_instance_norm_is_refused(
    tmp_path: Path,
    module: type[torch.nn.Module],
    example: torch.Tensor,
    signature: Signature,
    op: str,
) -> None:
    """nn.MultiheadAttention passes its dropout to scaled_dot_product_attention only in
    training, and an instance norm with running statistics uses them only in eval mode: a trace
    in train() fixes both, where no dropout or batch norm op shows it."""
    path = tmp_path / "model.pt"
    torch.jit.trace(module().train(), example, check_trace=False).save(str(path))
    with pytest.raises(ModelLoadError) as refused:
        TorchScriptRuntime(RuntimeOptions("cpu", 1)).load(path, signature, max_batch_size=8)
    assert f"fixes 1 dropout or normalisation ops to training ({op} at " in str(refused.value)
    assert "tests/models.py(" in str(refused.value)


def test_an_instance_norm_without_running_statistics_traced_in_training_mode_loads(
    tmp_path: Path,
) -> None:
    """It normalises each item by its own statistics in eval mode too: the trace is right."""
    path = tmp_path / "model.pt"
    module = InstanceNormed(running=False)
    torch.jit.trace(module.train(), torch.zeros(2, 8)).save(str(path))
    runtime = TorchScriptRuntime(RuntimeOptions("cpu", 1))
    runtime.load(path, SIGNATURE, max_batch_size=8)
    x = np.random.default_rng(2).standard_normal((3, 8)).astype(np.float32)
    eager = module.eval()
    with torch.no_grad():
        expected = eager(torch.from_numpy(x)).numpy()
    np.testing.assert_allclose(runtime.run({"x": x})["y"], expected, atol=1e-5)


@pytest.mark.parametrize(
    ("module", "made"),
    [
        (GuardedDrops, "script"),
        (InvertedGuard, "script"),
        (DropsNothing, "trace"),  # traced in train(): its dropout fixed to training, p = 0
    ],
)
def test_a_dropout_that_never_drops_in_eval_mode_is_not_refused(
    tmp_path: Path, module: type[torch.nn.Module], made: str
) -> None:
    path = tmp_path / "model.pt"
    if made == "script":
        torch.jit.script(module().eval()).save(str(path))
    else:
        torch.jit.trace(module().train(), torch.zeros(2, 8)).save(str(path))
    runtime = TorchScriptRuntime(RuntimeOptions("cpu", 1))
    runtime.load(path, SIGNATURE, max_batch_size=8)
    x = np.ones((2, 8), np.float32)
    np.testing.assert_array_equal(runtime.run({"x": x})["y"], runtime.run({"x": x})["y"])


@pytest.mark.parametrize("module", [TrainModeNet, NormsWithoutStats])
def test_a_module_traced_in_eval_mode_loads_and_answers_as_eager(
    tmp_path: Path, module: type[torch.nn.Module]
) -> None:
    eager = module().eval()
    path = tmp_path / "model.pt"
    torch.jit.trace(eager, torch.zeros(2, 8)).save(str(path))
    runtime = TorchScriptRuntime(RuntimeOptions("cpu", 1))
    runtime.load(path, SIGNATURE, max_batch_size=8)
    x = np.random.default_rng(1).standard_normal((3, 8)).astype(np.float32)
    with torch.no_grad():
        expected = eager(torch.from_numpy(x)).numpy()
    np.testing.assert_allclose(runtime.run({"x": x})["y"], expected, atol=1e-5)


@pytest.mark.parametrize(("shared", "expected"), [(1, [2, 1, 2]), (0, [2, 2, 2])])
def test_a_torch_runtime_takes_every_cpu_alone_and_its_share_beside_another_batch(
    train_mode_archive: Path, shared: int, expected: list[int]
) -> None:
    """As ONNX Runtime's two sessions do: every CPU's threads for a batch alone, the worker's
    share beside another (CPU_USE); threads set by hand (no share), always those. It kept every
    CPU always: two workers warming efficientnet at once on 2 CPUs took 125 s, 41 s at 1 each."""
    runtime = TorchScriptRuntime(RuntimeOptions("cpu", 2, shared_threads=shared))
    runtime.load(train_mode_archive, SIGNATURE, max_batch_size=8)
    batch = {"x": np.ones((3, 8), np.float32)}
    seen: list[int] = []

    def batches() -> None:  # on a thread of its own, as an instance's: the count is per thread
        for beside in (False, True, False):
            with CPU_USE, CPU_USE if beside else contextlib.nullcontext():
                runtime.run(batch)
                seen.append(torch.get_num_threads())

    thread = threading.Thread(target=batches)
    thread.start()
    thread.join()
    assert seen == expected


def test_pt2_keeps_every_cpus_threads_beside_another_batch() -> None:
    """Switching them per batch, as TorchScript does, measured a p99/p50 of 4 to 6 served
    (Pt2Runtime.shares_threads says where); only the thread count is asked of it here."""
    runtime = Pt2Runtime(RuntimeOptions("cpu", 2, shared_threads=1))
    seen: list[int] = []

    def beside_another() -> None:
        with CPU_USE, CPU_USE:
            runtime._cpu_threads()
            seen.append(torch.get_num_threads())

    thread = threading.Thread(target=beside_another)
    thread.start()
    thread.join()
    assert seen == [2]


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


def linear_onnx(folder: Path) -> Path:
    """TrainModeNet (8 → 8, a dynamic batch) as ``folder/model.onnx``."""
    path = folder / "model.onnx"
    torch.onnx.export(
        TrainModeNet().eval(),
        (torch.zeros(2, 8),),
        str(path),
        input_names=["x"],
        output_names=["y"],
        dynamic_axes={"x": {0: "b"}, "y": {0: "b"}},
        dynamo=False,
    )
    return path


def test_onnx_runtime_reads_the_signature_from_the_graph(tmp_path: Path) -> None:
    path = linear_onnx(tmp_path)
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
        {
            "device_id": 1,
            "trt_engine_cache_enable": True,
            "trt_engine_cache_path": "/models/m/1/tensorrt_cache",
            "trt_fp16_enable": True,
        },
    )
    assert providers[1] == (
        "CUDAExecutionProvider",
        {
            "device_id": 1,
            "arena_extend_strategy": "kNextPowerOfTwo",
            "cudnn_conv_algo_search": "EXHAUSTIVE",
            "gpu_mem_limit": 2**30,
        },
    )
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


BF16_WORDS = np.array([[0x3F80, 0x8000, 0x7F80], [0xFF80, 0x7FC0, 0x0001]], np.uint16)
"""1, -0, inf, -inf, NaN and the smallest subnormal, as bfloat16 bit patterns."""


def test_onnx_bf16_tensors_go_in_and_come_out_as_bit_patterns(tmp_path: Path) -> None:
    from tests.identity import write_identity_model

    write_identity_model(tmp_path / "m", datatypes=("BF16", "FP32"))
    runtime = create_runtime("onnx", RuntimeOptions("cpu", 1))
    signature = runtime.load(tmp_path / "m" / "1" / "model.onnx", None, max_batch_size=8)
    assert [t.datatype for t in signature.inputs] == ["BF16", "FP32"]
    x = np.ones((2, 3), np.float32)
    out = runtime.run({"in_BF16": BF16_WORDS, "in_FP32": x})
    assert out["out_BF16"].dtype == np.uint16
    np.testing.assert_array_equal(out["out_BF16"], BF16_WORDS)
    np.testing.assert_array_equal(out["out_FP32"], x)


def test_onnx_bf16_outputs_beside_string_inputs_are_refused_at_load(tmp_path: Path) -> None:
    from tests.identity import write_identity_model

    write_identity_model(tmp_path / "m", datatypes=("BF16", "BYTES"))
    runtime = create_runtime("onnx", RuntimeOptions("cpu", 1))
    with pytest.raises(
        ModelLoadError, match=r"\['out_BF16'\] are BF16 and the model takes strings"
    ):
        runtime.load(tmp_path / "m" / "1" / "model.onnx", None, max_batch_size=8)


def test_torchscript_bf16_tensors_go_in_and_come_out_as_bit_patterns(tmp_path: Path) -> None:
    path = tmp_path / "model.pt"
    torch.jit.script(Copy()).save(str(path))
    bf16 = Signature(
        (TensorConfig(name="x", datatype="BF16", shape=(3,)),),
        (TensorConfig(name="y", datatype="BF16", shape=(3,)),),
    )
    runtime = TorchScriptRuntime(RuntimeOptions("cpu", 1))
    runtime.load(path, bf16, max_batch_size=8)
    words = BF16_WORDS.copy()
    words.flags.writeable = False  # as a view of a request body is
    out = runtime.run({"x": words})["y"]
    assert out.dtype == np.uint16
    np.testing.assert_array_equal(out, BF16_WORDS)


@pytest.mark.integration  # loads the built digits model
def test_half_precision_needs_the_golden_tolerance_widened_explicitly(tmp_path: Path) -> None:
    from service.model_config import load_model_config
    from service.repository.loader import load_version
    from service.settings import Settings
    from tests.server import copy_model

    copy_model("digits", tmp_path / "digits")
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

    path = linear_onnx(tmp_path)
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
    from pydantic import ValidationError

    from service.model_config import ModelConfig, load_model_config
    from service.repository.loader import load_version
    from service.settings import Settings
    from tests.server import copy_model

    with pytest.raises(ValidationError, match="gpu.cuda_graphs is for TorchScript models"):
        ModelConfig.model_validate({"backend": "onnx", "gpu": {"cuda_graphs": True}})
    copy_model("digits", tmp_path / "digits")
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


def _repackaged(source: Path, target: Path, **metadata: str) -> Path:
    """A copy of a pt2 package whose metadata says something else (as another torch or another
    device would have written it)."""
    with zipfile.ZipFile(source) as original, zipfile.ZipFile(target, "w") as copy:
        for item in original.infolist():
            data = original.read(item)
            if item.filename.endswith("metadata.json"):
                data = json.dumps({**json.loads(data), **metadata}).encode()
            copy.writestr(item, data)
    return target


PT2_COMPILED = pytest.mark.integration
"""Tests of compiled pt2 packages: the session's `exported` fixture compiles them (half a minute
on two cores), so they run with the integration tier, and `pytest -m unit` stays quick."""


def _pt2(spec: Exported) -> Pt2Runtime:
    runtime = Pt2Runtime(RuntimeOptions("cpu", 1))
    runtime.load(spec.version / "model.pt2", Signature(spec.inputs, spec.outputs), 8)
    return runtime


@PT2_COMPILED
def test_pt2_answers_every_batch_size_and_length_as_eager_does(
    exported: dict[str, Exported],
) -> None:
    mlp, text = _pt2(exported["mlp"]), _pt2(exported["tiny_text"])
    rng = np.random.default_rng(4)
    for rows in range(1, exported["mlp"].max_batch_size + 1):
        x = rng.standard_normal((rows, 64)).astype(np.float32)
        with torch.inference_mode():
            want = Mlp().eval()(torch.from_numpy(x)).numpy()
        np.testing.assert_allclose(mlp.run({"x": x})["y"], want, atol=1e-5)
    for rows in range(1, exported["tiny_text"].max_batch_size + 1):
        for length in exported["tiny_text"].buckets:
            ids = rng.integers(1, 100, (rows, length))
            mask = np.ones_like(ids)
            with torch.inference_mode():
                want = TinyText().eval()(torch.from_numpy(ids), torch.from_numpy(mask)).numpy()
            got = text.run({"input_ids": ids, "attention_mask": mask})["embedding"]
            np.testing.assert_allclose(got, want, atol=1e-5)


@PT2_COMPILED
def test_pt2_takes_reversed_and_strided_views_as_the_arrays_they_show(
    exported: dict[str, Exported],
) -> None:
    """A model's own code may hand over ``x[..., ::-1]``: torch.from_numpy refused its negative
    stride (a 400 blaming the client, for a lone item only: a batch of two was stacked)."""
    mlp = _pt2(exported["mlp"])
    x = np.random.default_rng(5).standard_normal((3, 128)).astype(np.float32)
    for view in (x[:, ::-1][:, :64], x[:, ::2], x[::-1, :64]):
        with torch.inference_mode():
            want = Mlp().eval()(torch.from_numpy(np.ascontiguousarray(view))).numpy()
        np.testing.assert_allclose(mlp.run({"x": view})["y"], want, atol=1e-5)


@PT2_COMPILED
def test_pt2_from_another_torch_or_for_another_device_is_refused_naming_both(
    exported: dict[str, Exported], tmp_path: Path
) -> None:
    source, spec = exported["mlp"].version / "model.pt2", exported["mlp"]
    signature = Signature(spec.inputs, spec.outputs)
    older = _repackaged(source, tmp_path / "older.pt2", **{TORCH_KEY: "2.12.1+cpu"})
    with pytest.raises(
        ModelLoadError,
        match=r"compiled by torch 2\.12\.1\+cpu, this server runs "
        rf"torch {re.escape(torch.__version__)}",
    ):
        Pt2Runtime(RuntimeOptions("cpu", 1)).load(older, signature, 8)
    gpu = _repackaged(source, tmp_path / "gpu.pt2", AOTI_DEVICE_KEY="cuda")
    with pytest.raises(ModelLoadError, match="compiled for cuda, this server runs it on cpu"):
        Pt2Runtime(RuntimeOptions("cpu", 1)).load(gpu, signature, 8)


@PT2_COMPILED
def test_pt2_without_a_declared_signature_is_refused(exported: dict[str, Exported]) -> None:
    with pytest.raises(ModelLoadError, match="carries no tensor names or datatypes"):
        Pt2Runtime(RuntimeOptions("cpu", 1)).load(exported["mlp"].version / "model.pt2", None, 8)


def test_a_foreign_cpu_package_needs_the_instruction_sets_its_metadata_names() -> None:
    needs = {"torch": "2.13.0+cpu", "device": "cpu", "cpu_isa": "AVX512 AVX512_VNNI"}
    check_pt2(needs, "2.13.0", {"cpu"}, cpu_flags={"avx2", "avx512f", "avx512_vnni"})
    with pytest.raises(ModelLoadError, match="with AVX512 AVX512_VNNI, this CPU lacks AVX512_VNNI"):
        check_pt2(needs, "2.13.0", {"cpu"}, cpu_flags={"avx2", "avx512f"})
    check_pt2({**needs, "device": "cuda"}, "2.13.0", {"cpu", "cuda"}, cpu_flags={"avx2"})


def test_a_package_needs_every_cpu_flag_its_target_recorded_cuda_host_code_too() -> None:
    needs = {
        "torch": "2.13.0+cpu",
        "device": "cpu",
        "cpu": "x86-64-v3",
        "cpu_flags": "avx avx2 bmi2 fma",
        "cpu_isa": "AVX2",
    }
    check_pt2(needs, "2.13.0", {"cpu"}, cpu_flags={"avx", "avx2", "bmi2", "fma", "sse2"})
    for device in ("cpu", "cuda"):
        with pytest.raises(
            ModelLoadError,
            match=r"compiled for x86-64-v3 CPUs, this CPU lacks "
            r"avx2 bmi2: export it again with --pt2-cpu native",
        ):
            check_pt2({**needs, "device": device}, "2.13.0", {device}, cpu_flags={"avx", "fma"})


@PT2_COMPILED
def test_a_package_for_a_cpu_this_one_is_not_is_refused_before_it_loads(
    exported: dict[str, Exported], tmp_path: Path
) -> None:
    spec = exported["mlp"]
    future = _repackaged(
        spec.version / "model.pt2",
        tmp_path / "future.pt2",
        **{CPU_KEY: "x86-64-v9", CPU_FLAGS_KEY: "avx2 avx10_9"},
    )
    with pytest.raises(ModelLoadError, match="compiled for x86-64-v9 CPUs, this CPU lacks avx10_9"):
        Pt2Runtime(RuntimeOptions("cpu", 1)).load(future, Signature(spec.inputs, spec.outputs), 8)


def two_sessions(path: Path) -> tuple[Runtime, object, object, list[object]]:
    """An ONNX runtime of ``path`` with two sessions (every CPU's threads and the share), the
    two, and the list each run appends its session to."""
    runtime = create_runtime("onnx", RuntimeOptions("cpu", 2, shared_threads=1))
    runtime.load(path, None, 8)
    # the ONNX runtime's own sessions, not on the Runtime type:
    wide, shared = runtime._session, runtime._shared  # type: ignore[attr-defined]  # see above
    assert shared is not None and shared is not wide
    used: list[object] = []
    for session in (wide, shared):
        original = session.run
        session.run = lambda names, feed, _s=session, _o=original: (
            used.append(_s),
            _o(names, feed),
        )[1]
    return runtime, wide, shared, used


def test_onnx_runs_a_batch_beside_another_on_its_share_of_the_threads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two sessions of one graph: every CPU's threads for a batch alone, the share beside
    another batch (service.resources.CPU_USE); both answer alike and both are warmed."""
    from service.resources import CPU_USE
    from service.runtimes import onnx

    monkeypatch.setattr(onnx, "SMALL_RUN_S", 0.0)  # the estimates below, not small batches

    path = linear_onnx(tmp_path)
    runtime, wide, shared, used = two_sessions(path)
    x = {"x": np.ones((2, 8), np.float32)}
    runtime.warmup(x)  # both warmed, then each timed once: the lone choice's seeds
    assert used == [wide, shared, wide, shared]
    assert all(runtime._alone.sides(2).per_row)  # type: ignore[attr-defined]  # not on Runtime
    used.clear()
    runtime.warmup({"x": np.ones((3, 8), np.float32)})  # the same size bucket (2-3 rows)
    assert used == [wide, shared]  # both warmed, neither timed again: half a worker's startup
    from service.runtimes.onnx import AloneChoice

    # The estimates this test sets, not the machine's timings: times per row no real run is as
    # fast as (none replaces them), both sides just tried (no exploring yet).
    choice = runtime._alone = AloneChoice()  # type: ignore[attr-defined]  # not on Runtime
    sides = choice.sides(2)
    sides.per_row = [1e-12, 2e-12]  # every CPU's threads twice as fast (a CNN)
    sides.tried = [0, 0]
    used.clear()
    with CPU_USE:
        alone = runtime.run(x)
        with CPU_USE:  # another batch runs meanwhile: the share, whatever the choice
            beside = runtime.run(x)
    assert used == [wide, shared]
    np.testing.assert_allclose(alone["y"], beside["y"], rtol=1e-6)
    sides.per_row = [2e-12, 1e-12]  # the share as fast (a tiny model): alone on it too
    used.clear()
    for _ in range(128):
        with CPU_USE:
            runtime.run(x)
    assert used.count(shared) == 126 and used.count(wide) == 2  # one in 64 explores
    real = AloneChoice()
    real.sides(2).per_row = [2.0, 1.0]
    real.sides(2).record(True, 0.25)  # one fast sample of the wide side tells at once
    assert real.sides(2).per_row == [0.25, 1.0]
    real.sides(2).count += 100  # a hundred lone batches of its size later
    real.sides(2).record(True, 0.45)  # a slow one (another process ran) does not replace it
    assert real.sides(2).per_row[0] == 0.25
    assert real.sides(2).estimate(0) == pytest.approx(0.375)  # it ages by those batches instead
    single = create_runtime("onnx", RuntimeOptions("cpu", 1, shared_threads=1))
    single.load(path, None, 8)
    assert single._shared is None  # type: ignore[attr-defined]  # not on Runtime


def test_a_batch_alone_spins_its_threads_only_while_it_runs(tmp_path: Path) -> None:
    """The session of every CPU's threads runs only batches alone on the server: its threads
    spin between operators instead of being woken for each (1.0 ms of a lone
    efficientnet_lite0 image's 5.0 on 2 CPUs, bench/defaults.py), and stop when the run ends
    (``session.force_spinning_stop``): without it onnxruntime's threads burned 48 ms of CPU in
    the 200 ms after each run, what the loop and preprocessing need between batches. The
    share session, which runs beside other batches, never spins."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    weights = numpy_helper.from_array(rng.standard_normal((512, 512)).astype(np.float32), "w")
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"])],
        "wide",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", 512])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["b", 512])],
        [weights],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    path = tmp_path / "model.onnx"
    onnx.save(model, str(path))
    runtime, wide, shared, used = two_sessions(path)
    spins = [
        # two_sessions types the sessions as object (their run is patched): onnxruntime's here
        session.get_session_options().get_session_config_entry(  # type: ignore[attr-defined]
            "session.intra_op.allow_spinning"
        )
        for session in (wide, shared)
    ]
    assert spins == ["1", "0"]
    from service.resources import CPU_USE
    from service.runtimes.onnx import SMALL_RUN_S, AloneChoice

    choice = runtime._alone = AloneChoice()  # type: ignore[attr-defined]  # not on Runtime
    sides = choice.sides(256)
    sides.per_row, sides.tried = [SMALL_RUN_S, 2 * SMALL_RUN_S], [0, 0]  # wide: twice as fast
    x = {"x": np.ones((256, 512), np.float32)}  # a GEMM onnxruntime splits among its threads
    for _ in range(5):
        with CPU_USE:
            runtime.run(x)
    assert used == [wide] * 5
    # CPU time, not wall-clock: what this process's threads burn in an idle window after the
    # runs (48 ms of 200 with the threads left spinning). The sleep is that window; nothing is
    # waited for.
    started = time.process_time()
    time.sleep(0.2)
    assert time.process_time() - started < 0.010  # every thread of this process, asleep


def test_a_batch_its_share_runs_in_microseconds_keeps_to_it_untimed(tmp_path: Path) -> None:
    """A batch the share runs within SMALL_RUN_S (the W2 MLP's) is neither timed nor explored
    on every CPU's threads: choosing cost more than its run. A larger batch of the same model,
    and any size not measured yet, is chosen for as before."""
    from service.resources import CPU_USE
    from service.runtimes.onnx import EXPLORE, SMALL_RUN_S, AloneChoice

    runtime, wide, shared, used = two_sessions(linear_onnx(tmp_path))
    choice = runtime._alone = AloneChoice()  # type: ignore[attr-defined]  # not on Runtime
    small, large = choice.sides(2), choice.sides(8)
    small.per_row = [SMALL_RUN_S / 8, SMALL_RUN_S / 4]  # 2 rows: half the bound on the share
    large.per_row = [SMALL_RUN_S / 8, SMALL_RUN_S / 4]  # 8 rows: twice it
    large.tried = [0, 0]
    for _ in range(2 * EXPLORE):
        with CPU_USE:
            runtime.run({"x": np.ones((2, 8), np.float32)})
    assert used == [shared] * 2 * EXPLORE  # never the wide session, not even to explore
    assert small.count == 0 and small.per_row == [SMALL_RUN_S / 8, SMALL_RUN_S / 4]  # untimed
    used.clear()
    with CPU_USE:
        runtime.run({"x": np.ones((8, 8), np.float32)})
    assert used == [wide] and large.count == 1  # the wide side is twice as fast here: chosen


def test_the_lone_choice_holds_while_the_machine_slows_in_phases() -> None:
    """A CNN whose lone batch takes 4.4–4.8 ms on every CPU and 5.6–6.0 ms on its share,
    seeded by a warmup that ran beside another worker's (the share looked faster), on a
    machine that another process slows by 15 % every other 30 batches. Aged per sample of its
    own side, the chosen side's estimate climbed to its slow phase while the other side kept
    its best, and lone batches flipped to the share (0.952 of them wide); aged by the size's
    batches, both sides alike, all but the explored one in 64 stay wide."""
    from service.runtimes.onnx import EXPLORE, AloneChoice

    rng = random.Random(3)
    choice = AloneChoice()
    choice.seed(True, 0.0116, 1)
    choice.seed(False, 0.0101, 1)
    wide = 0
    for batch in range(6400):
        slowed = 1.15 if (batch // 30) % 2 else 1.0
        chosen = choice.sides(1).wide()
        wide += chosen
        seconds = (rng.uniform(4.4, 4.8) if chosen else rng.uniform(5.6, 6.0)) * slowed / 1000
        choice.sides(1).record(chosen, seconds)
    assert wide / 6400 >= 0.97
    assert wide / 6400 <= 1 - 1 / EXPLORE + 0.001  # it still explores the share


def test_each_batch_size_is_judged_apart_and_both_sides_are_tried_first() -> None:
    """efficientnet on 2 CPUs: a lone image takes 8 ms wide and 13 ms on the share, a batch of
    32 0.09 s and 0.1 s (per row a third of a lone image's, and the share as fast), and a
    warmup beside another worker's made the wide side look slower. With one estimate per row
    for every size the batch of 32 stood for the lone images too; per size, the first two lone
    images try both sides and the rest run wide, but for one in 64 on the share."""
    from service.runtimes.onnx import EXPLORE, AloneChoice

    choice = AloneChoice()
    for rows, wide_s, share_s in ((1, 0.0135, 0.013), (32, 0.09, 0.1)):  # warmup, contended
        choice.seed(True, wide_s, rows)
        choice.seed(False, share_s, rows)
    chosen = []
    for _ in range(100):
        wide = choice.sides(1).wide()
        chosen.append(wide)
        choice.sides(1).record(wide, 0.008 if wide else 0.013)
    assert chosen[:2] == [True, False]  # the side the seeds did not choose, then the other
    assert all(chosen[2 : 2 + EXPLORE - 1])  # once both are measured: wide
    assert chosen[2:].count(False) == 1  # but for one try of the share in 64
    # the batch of 32 keeps its own estimates (the share as fast: it stays there)
    assert choice.sides(32).per_row == pytest.approx([0.09 / 32, 0.1 / 32])


def test_lone_batches_far_apart_keep_to_the_faster_side() -> None:
    """The same model with lone images a second or more apart: the choice reads no clock, so
    nothing ages while no batch of the size runs. (Aged by wall time, the side run last looked
    freshest after each gap, and a third to a half of such images ran on the share.)"""
    from service.runtimes.onnx import EXPLORE, AloneChoice

    choice = AloneChoice()
    choice.seed(True, 0.0135, 1)
    choice.seed(False, 0.013, 1)
    rng = random.Random(5)
    chosen = []
    for _ in range(200):
        wide = choice.sides(1).wide()
        chosen.append(wide)
        seconds = rng.uniform(0.0075, 0.0085) if wide else rng.uniform(0.0125, 0.0135)
        choice.sides(1).record(wide, seconds)
    assert sum(chosen) / 200 >= 1 - 3 / EXPLORE
