"""PyTorch module → the model repository's artifacts, with proof that they agree.

:func:`export_model` writes ``model.pt`` (TorchScript) and ``model.onnx`` into a version folder,
replays fixed golden inputs through eager PyTorch, the saved TorchScript and onnxruntime, and
refuses (``ExportError``, naming the max abs/rel error) when they disagree beyond tolerance.
It then writes ``golden.npz`` and ``manifest.json``, which the server's load gates check.
Imported only by ``tensorgate export`` and build scripts: the server never needs it.
"""

from __future__ import annotations

import datetime
import logging
import platform
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
import torch

from preprocessing.spec import ImageSpec, spec_hash
from service.manifest import GOLDEN, MANIFEST, Manifest, Tolerance
from service.model_config import TensorConfig
from service.protocol.datatypes import TO_NUMPY

log = logging.getLogger("tensorgate.export")
DEFAULT_OPSET = 17
FORMATS = ("onnx", "torchscript")


class ExportError(RuntimeError):
    """The module cannot be exported faithfully; the message says where it diverged."""


def export_model(
    module: torch.nn.Module,
    out_dir: Path,
    *,
    name: str,
    inputs: Sequence[TensorConfig],
    outputs: Sequence[TensorConfig],
    golden_inputs: Mapping[str, np.ndarray],
    max_batch_size: int,
    preprocessing: ImageSpec | None = None,
    opset: int = DEFAULT_OPSET,
    tolerance: Tolerance | None = None,
    metrics: Mapping[str, float] | None = None,
    formats: Sequence[str] = FORMATS,
) -> Manifest:
    """Export ``module`` into ``out_dir`` (a version folder) and return the manifest written."""
    tolerance = tolerance or Tolerance()
    out_dir.mkdir(parents=True, exist_ok=True)
    module = _prepare(module)
    golden = {t.name: np.ascontiguousarray(golden_inputs[t.name]) for t in inputs}
    example = tuple(torch.from_numpy(golden[t.name].copy()) for t in inputs)
    with torch.inference_mode():
        eager = _as_outputs(module(*example), outputs)

    artifacts: dict[str, str] = {}
    parity: dict[str, dict[str, float]] = {}
    if "torchscript" in formats:
        artifacts["torchscript"] = "model.pt"
        served = _export_torchscript(module, example, out_dir / "model.pt", outputs)
        parity["torchscript"] = _compare("TorchScript", eager, served, tolerance)
    if "onnx" in formats:
        artifacts["onnx"] = "model.onnx"
        onnx_path = out_dir / "model.onnx"
        _export_onnx(module, example, onnx_path, inputs, outputs, max_batch_size, opset)
        served = _run_onnx(onnx_path, golden)
        parity["onnx"] = _compare("onnxruntime", eager, served, tolerance)

    arrays = {f"input.{k}": v for k, v in golden.items()}
    arrays.update({f"output.{k}": v for k, v in eager.items()})
    np.savez(out_dir / GOLDEN, allow_pickle=False, **arrays)
    manifest = Manifest(
        name=name,
        max_batch_size=max_batch_size,
        inputs=tuple(inputs),
        outputs=tuple(outputs),
        dynamic_axes=_dynamic_axes([*inputs, *outputs], max_batch_size),
        opset=opset if "onnx" in formats else None,
        versions=_versions(),
        artifacts=artifacts,
        preprocessing=preprocessing.model_dump(mode="json") if preprocessing else None,
        preprocessing_hash=spec_hash(preprocessing) if preprocessing else None,
        tolerance=tolerance,
        parity=parity,
        metrics=dict(metrics or {}),
        created=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    )
    (out_dir / MANIFEST).write_text(manifest.model_dump_json(indent=2) + "\n")
    log.info("exported %s to %s: parity %s", name, out_dir, parity)
    return manifest


def _prepare(module: torch.nn.Module) -> torch.nn.Module:
    training = [n or "(root)" for n, m in module.named_modules() if m.training]
    if training:
        warnings.warn(
            f"module was in training mode ({len(training)} submodules, e.g. {training[:3]}); "
            "exporting it in eval mode",
            stacklevel=3,
        )
    module.eval()
    for parameter in module.parameters():
        parameter.requires_grad_(False)
    return module


def _export_torchscript(
    module: torch.nn.Module,
    example: tuple[torch.Tensor, ...],
    path: Path,
    outputs: Sequence[TensorConfig],
) -> dict[str, np.ndarray]:
    try:
        scripted = torch.jit.script(module)
    except Exception as exc:  # torch.jit raises many unrelated types for unscriptable code
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        warnings.warn(
            f"torch.jit.script failed ({reason}); falling back to torch.jit.trace, which records "
            "one path through data-dependent control flow",
            stacklevel=3,
        )
        with torch.no_grad():
            scripted = torch.jit.trace(module, example)  # type: ignore[no-untyped-call]  # torch.jit is untyped
    scripted.save(str(path))  # type: ignore[no-untyped-call]  # torch.jit is untyped
    loaded = torch.jit.load(str(path)).eval()  # type: ignore[no-untyped-call]  # torch.jit is untyped
    with torch.inference_mode():
        return _as_outputs(loaded(*example), outputs)


def _export_onnx(
    module: torch.nn.Module,
    example: tuple[torch.Tensor, ...],
    path: Path,
    inputs: Sequence[TensorConfig],
    outputs: Sequence[TensorConfig],
    max_batch_size: int,
    opset: int,
) -> None:
    axes = _dynamic_axes([*inputs, *outputs], max_batch_size)
    with warnings.catch_warnings(), torch.no_grad():
        # The TorchScript-based exporter is deprecated in favour of torch.export, which cannot
        # yet express every dynamic axis these models use; its warnings say nothing actionable.
        warnings.simplefilter("ignore")
        torch.onnx.export(
            module,
            example,
            str(path),
            input_names=[t.name for t in inputs],
            output_names=[t.name for t in outputs],
            dynamic_axes={k: dict(v) for k, v in axes.items()},
            opset_version=opset,
            dynamo=False,
        )


def _run_onnx(path: Path, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    import onnxruntime as ort

    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    names = [o.name for o in session.get_outputs()]
    return dict(zip(names, session.run(names, dict(inputs)), strict=True))


def _as_outputs(result: object, outputs: Sequence[TensorConfig]) -> dict[str, np.ndarray]:
    if isinstance(result, torch.Tensor):
        result = (result,)
    if isinstance(result, dict):
        result = tuple(result[t.name] for t in outputs)
    if not isinstance(result, (tuple, list)) or len(result) != len(outputs):
        raise ExportError(f"forward() must return {len(outputs)} tensor(s), got {type(result)}")
    arrays = {}
    for spec, tensor in zip(outputs, result, strict=True):
        array = tensor.detach().cpu().numpy()
        if array.dtype != TO_NUMPY[spec.datatype]:
            raise ExportError(
                f"output '{spec.name}' is declared {spec.datatype}, "
                f"the module returns {array.dtype}"
            )
        arrays[spec.name] = array
    return arrays


def _compare(
    what: str,
    eager: Mapping[str, np.ndarray],
    served: Mapping[str, np.ndarray],
    tolerance: Tolerance,
) -> dict[str, float]:
    worst_abs = worst_rel = 0.0
    for name, want in eager.items():
        got = served[name]
        if got.shape != want.shape:
            raise ExportError(f"{what}: output '{name}' has shape {got.shape}, eager {want.shape}")
        error = np.abs(got.astype(np.float64) - want.astype(np.float64))
        scale = np.abs(want.astype(np.float64))
        max_abs = float(error.max(initial=0.0))
        max_rel = float((error / np.maximum(scale, 1e-12)).max(initial=0.0))
        worst_abs, worst_rel = max(worst_abs, max_abs), max(worst_rel, max_rel)
        if not np.all(error <= tolerance.atol + tolerance.rtol * scale):
            raise ExportError(
                f"{what} disagrees with eager PyTorch on output '{name}': max abs error "
                f"{max_abs:.3g}, max rel error {max_rel:.3g} (tolerance atol={tolerance.atol:g}, "
                f"rtol={tolerance.rtol:g})"
            )
    return {"max_abs": worst_abs, "max_rel": worst_rel}


def _dynamic_axes(
    tensors: Sequence[TensorConfig], max_batch_size: int
) -> dict[str, dict[int, str]]:
    axes: dict[str, dict[int, str]] = {}
    offset = 1 if max_batch_size > 0 else 0
    for tensor in tensors:
        dims = {0: "batch"} if offset else {}
        for i, dim in enumerate(tensor.shape):
            if dim == -1:
                dims[i + offset] = f"{tensor.name}_{i + offset}"
        if dims:
            axes[tensor.name] = dims
    return axes


def _versions() -> dict[str, str | None]:
    versions: dict[str, str | None] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
    }
    for package in ("onnx", "onnxruntime"):
        try:
            versions[package] = __import__(package).__version__
        except ImportError:
            versions[package] = None
    return versions
