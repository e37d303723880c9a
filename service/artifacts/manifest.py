"""The artifact manifest (``manifest.json``) and the load gates that read it.

``tensorgate export`` writes the manifest; at load the server checks, in this order, that it can
run the versions the artifact was made with, that the served preprocessing is the one the model
was exported with, and that replaying ``golden.npz`` reproduces the eager PyTorch outputs.
Each refusal is a :class:`~service.errors.ModelLoadError` whose message names the cause.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    ValidationError,
    model_serializer,
)

from preprocessing.spec import spec_hash
from service.artifacts import cpu_targets
from service.artifacts.shapes import ShapeFacts
from service.errors import ModelLoadError
from service.model_config import ModelConfig, TensorConfig, describe_validation_error

MANIFEST_FORMAT = 1
MANIFEST = "manifest.json"
GOLDEN = "golden.npz"

# Highest ai.onnx opset each onnxruntime release runs (from onnxruntime's compatibility table).
# A release newer than the last entry runs at least that opset.
_ORT_MAX_OPSET = (
    (1, 14, 18),
    (1, 15, 19),
    (1, 17, 20),
    (1, 18, 21),
    (1, 20, 21),
    (1, 21, 22),
    (1, 23, 23),
)
MIN_OPSET = 7


class Tolerance(BaseModel):
    """Outputs match when ``|served - golden| <= atol + rtol * |golden|`` element-wise."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    atol: float = Field(default=1e-4, gt=0)
    rtol: float = Field(default=1e-3, ge=0)


class Manifest(BaseModel):
    """What an exported artifact says about itself."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    format: int = MANIFEST_FORMAT
    name: str
    max_batch_size: int = Field(ge=0)
    inputs: tuple[TensorConfig, ...]
    outputs: tuple[TensorConfig, ...]
    dynamic_axes: dict[str, dict[int, str]] = {}
    opset: int | None = None
    versions: dict[str, str | None]
    """torch, onnx, onnxruntime, python and cuda versions used at export; ``onnx_exporter``
    (``dynamo``, or ``torchscript`` with ``onnx_exporter_fallback`` saying why); and what
    ``model.pt2`` needs to load: ``pt2_device`` (``cpu``/``cuda``), ``pt2_cpu`` (the CPU target
    it was compiled for), ``pt2_cpu_flags`` (what that target needs of the CPU), ``pt2_cpu_isa``,
    ``pt2_compute_capability`` (kept in this mapping so that servers which predate them still
    read the manifest)."""
    artifacts: dict[str, str]
    """backend → file name in the version folder (``onnx``/``torchscript``/``pt2``)."""
    skipped: dict[str, str] = {}
    """Formats export tried and left out, each with why (e.g. what ``torch.export`` said)."""
    shapes: ShapeFacts | None = None
    """The dynamic dims' axes, ranges and buckets, and whether padding is safe (measured at
    export; :mod:`service.artifacts.shapes`)."""
    preprocessing: dict[str, Any] | None = None
    preprocessing_hash: str | None = None
    code: dict[str, Any] | None = None
    """A ``kind: python`` pipeline's sources and the distributions they import, with versions
    (:class:`service.artifacts.code.CodeFacts`)."""
    answers: list[dict[str, Any]] = []
    """End-to-end golden pairs of a ``kind: python`` pipeline: raw item files (in the version
    folder) and the answers the eager pipeline gave (:class:`service.artifacts.code.AnswerPair`)."""
    tolerance: Tolerance = Tolerance()
    parity: dict[str, dict[str, float]] = {}
    """Max abs/rel error of each artifact vs eager PyTorch, measured at export."""
    non_finite: dict[str, str] = {}
    """Each artifact (by format) that answers a NaN or an infinity in a float input unlike eager
    PyTorch, with how (measured at export): served from it, those inputs take finite values
    only."""
    metrics: dict[str, float] = {}
    """Anything measured at build time, e.g. held-out accuracy."""
    created: str | None = None

    @model_serializer(mode="wrap")
    def _without_empty_additions(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        # ``skipped``, ``shapes``, ``code``, ``answers`` and ``non_finite`` are written only when
        # they say something, so that a manifest of a model without them stays readable by
        # servers that predate them.
        data: dict[str, Any] = handler(self)
        if not self.skipped:
            data.pop("skipped", None)
        for key in ("shapes", "code"):
            if data.get(key) is None:
                data.pop(key, None)
        if not self.answers:
            data.pop("answers", None)
        if not self.non_finite:
            data.pop("non_finite", None)
        return data


def aside_prefix(version_dir: Path) -> str:
    """The name prefix of the folder beside ``version_dir`` where an export under way keeps the
    files it replaces (``.1.before-export-…``): one left there means the export never finished
    (its process killed: out of memory, a signal), and the version folder is half written."""
    return f".{version_dir.name}.before-export-"


def unfinished_export(version_dir: Path) -> Path | None:
    """The folder an export of ``version_dir`` under way (or one that never finished) keeps
    what it replaces in, if there is one."""
    prefix = aside_prefix(version_dir)
    parent = version_dir.parent
    if not parent.is_dir():
        return None
    return next((p for p in sorted(parent.iterdir()) if p.name.startswith(prefix)), None)


def read_manifest(version_dir: Path) -> Manifest | None:
    """The manifest of a version folder, or None for a bring-your-own artifact."""
    path = version_dir / MANIFEST
    if not path.exists():
        return None
    try:
        return Manifest.model_validate_json(path.read_bytes())
    except ValidationError as exc:
        raise ModelLoadError(f"{path}: {describe_validation_error(exc, Manifest)}") from None


def max_opset(ort_version: str) -> int:
    """The highest opset the given onnxruntime version runs."""
    major, minor = (int(part) for part in ort_version.split(".")[:2])
    best = _ORT_MAX_OPSET[0][2]
    for ort_major, ort_minor, opset in _ORT_MAX_OPSET:
        if (major, minor) >= (ort_major, ort_minor):
            best = opset
    return best


def check_versions(manifest: Manifest, backend: str, runtime_versions: Mapping[str, str]) -> None:
    """Gate 1: refuse an artifact made with versions this server cannot run."""
    if manifest.format > MANIFEST_FORMAT:
        raise ModelLoadError(
            f"manifest format {manifest.format} is newer than this server reads ({MANIFEST_FORMAT})"
        )
    if backend not in manifest.artifacts:
        raise ModelLoadError(
            f"config backend is {backend!r}, the manifest lists only {sorted(manifest.artifacts)}"
        )
    if backend == "onnx":
        ort_version = runtime_versions["onnxruntime"]
        highest = max_opset(ort_version)
        if manifest.opset is None or not MIN_OPSET <= manifest.opset <= highest:
            raise ModelLoadError(
                f"ONNX opset {manifest.opset} cannot run on onnxruntime {ort_version} "
                f"(it runs opsets {MIN_OPSET}–{highest}); re-export with a supported opset"
            )
    if backend == "pt2":
        versions = manifest.versions
        needs = {k: versions.get(f"pt2_{k}") for k in ("device", "cpu", "cpu_flags", "cpu_isa")}
        check_pt2(
            {**needs, "torch": versions.get("torch")},
            runtime_versions["torch"],
            runtime_versions["devices"].split(","),
        )
    if backend == "torchscript":
        exported = manifest.versions.get("torch") or "unknown"
        running = runtime_versions["torch"]
        theirs, mine = _major_minor(exported), _major_minor(running)
        if theirs is None or mine is None:
            raise ModelLoadError(f"manifest names torch {exported!r}, which is not a version")
        if theirs[0] != mine[0]:
            raise ModelLoadError(
                f"exported with torch {exported}, this server runs torch {running}: "
                "a different major version; re-export with the server's torch"
            )
        if theirs > mine:
            raise ModelLoadError(
                f"exported with torch {exported}, this server runs the older torch {running}: "
                "TorchScript archives do not load on an older torch"
            )


def check_pt2(
    needs: Mapping[str, str | None],
    running_torch: str,
    devices: Collection[str],
    cpu_flags: Collection[str] | None = None,
) -> None:
    """Refuse an AOTInductor package this process cannot run: it is machine code for the torch
    release, the device type and the CPU that compiled it.

    ``needs`` has ``torch``, ``device``, and the CPU it was compiled for: ``cpu`` (its name) and
    ``cpu_flags`` (the /proc/cpuinfo flags it needs), which ``tensorgate export`` records, or
    else ``cpu_isa`` (as the package's metadata names the kernels' instruction sets); ``devices``
    are the device types the model may run on; ``cpu_flags`` default to this CPU's.
    """
    built = needs.get("torch")
    if built is not None and built.split("+")[0] != running_torch.split("+")[0]:
        raise ModelLoadError(
            f"model.pt2 was compiled by torch {built}, this server runs torch {running_torch}: "
            "an AOTInductor package runs only on the torch release that compiled it; export it "
            "again with the server's torch"
        )
    device = needs.get("device")
    if device not in devices:
        raise ModelLoadError(
            f"model.pt2 was compiled for {device}, this server runs it on "
            f"{' or '.join(sorted(devices))}: export it again on a {' or '.join(sorted(devices))} "
            "machine, or serve the ONNX artifact"
        )
    flags = cpu_targets.cpu_flags() if cpu_flags is None else frozenset(cpu_flags)
    if not flags:
        return
    needed = needs.get("cpu_flags")
    if needed is not None:  # host code of a CUDA package too: it is compiled for that CPU
        missing = sorted(set(needed.split()) - flags)
        if missing:
            raise ModelLoadError(
                f"model.pt2 was compiled for {needs.get('cpu') or 'another'} CPUs, this CPU lacks "
                f"{' '.join(missing)}: export it again with --pt2-cpu native on this machine, or "
                "serve the ONNX artifact"
            )
        return
    isa = (needs.get("cpu_isa") or "").split() if device == "cpu" else []
    missing = [name for name in isa if _ISA_FLAGS.get(name, name.lower()) not in flags]
    if missing:
        raise ModelLoadError(
            f"model.pt2 was compiled for a CPU with {' '.join(isa)}, this CPU lacks "
            f"{' '.join(missing)}: export it again on this kind of CPU, or serve the ONNX artifact"
        )


# AOTInductor's names for instruction sets, where /proc/cpuinfo's differ from their lower case.
_ISA_FLAGS = {"AVX512": "avx512f"}


def _major_minor(version: str) -> tuple[int, int] | None:
    parts = version.split("+")[0].split(".")
    try:
        return int(parts[0]), int(parts[1])
    except (IndexError, ValueError):
        return None


def check_preprocessing(config: ModelConfig, manifest: Manifest) -> None:
    """Gate 2: the served preprocessing must hash to the one the model was exported with."""
    served = spec_hash(config.preprocessing) if config.preprocessing is not None else None
    if served != manifest.preprocessing_hash:
        raise ModelLoadError(
            "preprocessing in config.yaml differs from the one this artifact was exported with "
            f"(served {served}, manifest {manifest.preprocessing_hash}); the model would see "
            "inputs unlike its training data. Export again, or restore the spec "
            f"(preprocessing: {_as_written(manifest.preprocessing)})"
        )


def _as_written(spec: Mapping[str, Any] | None) -> str:
    """A recorded spec as config.yaml takes it (JSON is YAML): ``class``, not the field name
    ``cls``, and no null values (``package: None`` pasted back was refused)."""
    if spec is None:
        return "none"
    shown = {("class" if key == "cls" else key): v for key, v in spec.items() if v is not None}
    return json.dumps(shown)


@dataclass(frozen=True)
class Golden:
    """``golden.npz``: fixed inputs and the eager PyTorch outputs for them."""

    inputs: dict[str, np.ndarray]
    outputs: dict[str, np.ndarray]


def read_golden(version_dir: Path) -> Golden:
    path = version_dir / GOLDEN
    if not path.exists():
        raise ModelLoadError(f"{GOLDEN} is missing beside the manifest; export again")
    with np.load(path, allow_pickle=False) as golden:
        inputs = {
            k.removeprefix("input."): golden[k] for k in golden.files if k.startswith("input.")
        }
        expected = {
            k.removeprefix("output."): golden[k] for k in golden.files if k.startswith("output.")
        }
    return Golden(inputs, expected)


def check_golden(
    golden: Golden,
    run: Callable[[dict[str, np.ndarray]], dict[str, np.ndarray]],
    tolerance: Tolerance,
) -> dict[str, float]:
    """Gate 3: replay the golden inputs through ``run``; the worst abs error per output, or
    ModelLoadError when one is beyond the tolerance."""
    served = run(golden.inputs)
    expected = golden.outputs
    worst: dict[str, float] = {}
    for name, want in expected.items():
        got = served.get(name)
        if got is None or got.shape != want.shape:
            shape = None if got is None else list(got.shape)
            raise ModelLoadError(
                f"golden replay: output '{name}' has shape {shape}, golden {list(want.shape)}"
            )
        error = np.abs(got.astype(np.float64) - want.astype(np.float64))
        limit = tolerance.atol + tolerance.rtol * np.abs(want.astype(np.float64))
        worst[name] = float(error.max(initial=0.0))
        if not np.all(error <= limit):
            raise ModelLoadError(
                f"golden replay: output '{name}' differs from the exported model's by up to "
                f"{worst[name]:.3g} (tolerance atol={tolerance.atol:g}, rtol={tolerance.rtol:g})"
            )
    return worst
