"""The per-model serving config (``models/<name>/config.yaml``) and its loader.

The schema is flat and strict: an unknown key is an error, and every error names the file and
the dotted path of the field, e.g. ``models/digits/config.yaml: warmup.batch_sizes.0: ...``.
``tensorgate schema`` prints it as JSON Schema for editors.
"""

from __future__ import annotations

import difflib
import typing
from pathlib import Path
from typing import Any, Literal, Self

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    ValidationError,
    field_validator,
    model_serializer,
    model_validator,
)
from pydantic.fields import FieldInfo

from preprocessing.spec import PreprocessingSpec
from service.errors import ModelLoadError

Datatype = Literal[
    "BOOL",
    "UINT8",
    "UINT16",
    "UINT32",
    "UINT64",
    "INT8",
    "INT16",
    "INT32",
    "INT64",
    "FP16",
    "FP32",
    "FP64",
    "BF16",
    "BYTES",
]


PREPROCESSING_KINDS = ("image", "text", "python")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class TensorConfig(_Strict):
    """One input or output: its name, datatype and shape without the batch dim (-1 = dynamic)."""

    name: str = Field(min_length=1)
    datatype: Datatype
    shape: tuple[int, ...]
    range: tuple[float, float] | None = None
    """The values the model takes, inclusive (e.g. token ids within the vocabulary): a request
    outside it gets 400 before it can fail a batch it would have joined. Text models get theirs
    from the tokenizer."""

    @model_serializer(mode="wrap")
    def _without_empty_range(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        # Written only when set: manifests and configs stay readable by servers that predate it.
        data: dict[str, Any] = handler(self)
        if self.range is None:
            data.pop("range", None)
        elif self.datatype.startswith(("INT", "UINT")) and all(
            float(b).is_integer() for b in self.range
        ):
            data["range"] = [int(b) for b in self.range]  # ids as written: [0, 99], not [0.0, 99.0]
        return data

    @model_validator(mode="after")
    def _numeric_range(self) -> Self:
        if self.range is None:
            return self
        if self.datatype == "BYTES":
            raise ValueError("range: BYTES values have no range")
        if not self.range[0] <= self.range[1]:
            raise ValueError(f"range must be [low, high] with low ≤ high (got {list(self.range)})")
        return self

    @field_validator("shape")
    @classmethod
    def _dims(cls, shape: tuple[int, ...]) -> tuple[int, ...]:
        for dim in shape:
            if dim < -1 or dim == 0:
                raise ValueError(f"each dim must be -1 (dynamic) or ≥ 1 (got {dim})")
        return shape


class ClassificationConfig(_Strict):
    """Top-k labels with probabilities from a logits (or probabilities) output."""

    kind: Literal["classification"] = "classification"
    labels: str | None = None
    """A text file beside config.yaml, one label a line, in class-index order."""
    top_k: int = Field(default=5, ge=1)
    softmax: bool = True
    """Apply softmax to the output first (false when the model outputs probabilities)."""
    output: str | None = None
    """Which output to read (default: the first)."""


MAX_WARMUP_ROWS = 16384
"""Rows one load's warmup may run over all its batch sizes: ``warmup: all`` with
``max_batch_size: 100000`` ran for hours, holding every other load (#28 finding 13)."""


class WarmupConfig(_Strict):
    """Shapes run at load, before the model reports ready: every batch size × every bucket."""

    batch_sizes: tuple[int, ...] | Literal["all"] = (1,)
    """Batch sizes to run, or ``all`` for every size from 1 to max_batch_size."""
    pad_batches: bool = False
    """Pad each batch's rows up to the next warmed batch size, so no batch meets a new shape
    (for runtimes that compile per shape; costs compute on ones that do not)."""

    @field_validator("batch_sizes")
    @classmethod
    def _positive(cls, sizes: tuple[int, ...] | str) -> tuple[int, ...] | str:
        if not isinstance(sizes, str) and any(size < 1 for size in sizes):
            raise ValueError(f"batch sizes must be ≥ 1 (got {list(sizes)})")
        return sizes


class BatchingConfig(_Strict):
    """How the dynamic batcher forms batches (max_batch_size > 0)."""

    max_queue_delay_ms: float | None = Field(default=None, ge=0)
    """Wait at most this long after a batch's oldest request for more; 0 = run what is there.
    Unset: adaptive, waiting (up to 2 ms) only while requests the model accepted are still on
    their way to its queue; a request alone never waits (docs/performance.md, "Defaults")."""
    preferred_batch_sizes: tuple[int, ...] = ()
    """Run a batch at once when its rows reach one of these sizes."""
    max_queue_size: int = Field(default=256, ge=1)
    """Requests waiting beyond this get 503 with Retry-After."""


class GpuConfig(_Strict):
    """How the model runs when it runs on CUDA (ignored on the CPU)."""

    tensorrt: bool = False
    """Put onnxruntime's TensorRT provider first (refused at load when it is not installed)."""
    tensorrt_fp16: bool = False
    tensorrt_cache: str = "tensorrt_cache"
    """Engine cache, relative to the version folder (so it lives on the model volume)."""
    cudnn_conv_algo_search: Literal["EXHAUSTIVE", "HEURISTIC", "DEFAULT"] = "EXHAUSTIVE"
    arena_extend_strategy: Literal["kNextPowerOfTwo", "kSameAsRequested"] = "kNextPowerOfTwo"
    memory_limit_bytes: int | None = Field(default=None, gt=0)
    io_binding: Literal["auto", "on", "off"] = "auto"
    """onnxruntime: bind inputs and outputs so that each crosses host↔device once per batch.
    ``auto``: on CUDA only; ``on``: on every device (the CPU too, where it changes nothing)."""
    cuda_graphs: bool = False
    """TorchScript on CUDA: capture one CUDA graph per warmed batch shape at warmup and replay
    it for batches of that shape (others run eagerly). Ignored, with a warning, on the CPU."""


class VersionPolicy(_Strict):
    """Which version folders to serve: the latest N (default 1), or exactly these."""

    latest: int | None = Field(default=None, ge=1)
    specific: tuple[int, ...] | None = None
    all: bool = False

    @model_validator(mode="after")
    def _one_policy(self) -> Self:
        # all, then specific, then latest would win: a config naming two says one of them
        given = (("latest", self.latest), ("specific", self.specific))
        named = [k for k, v in given if v is not None]
        named += ["all: true"] if self.all else []
        if len(named) > 1:
            raise ValueError(
                f"name one of latest, specific and all: true (got {' and '.join(named)})"
            )
        return self


class ModelConfig(_Strict):
    """What ``models/<name>/config.yaml`` holds."""

    backend: Literal["onnx", "torchscript", "pt2"]
    max_batch_size: int = Field(default=0, ge=0)
    """Most rows in one inference; 0 = the model takes no batch dimension."""
    max_request_rows: int = Field(default=1024, ge=1)
    """Most rows one request may carry; above max_batch_size it runs as several batches."""
    inputs: tuple[TensorConfig, ...] | None = None
    """Optional for ONNX (read from the graph) and exported artifacts (from the manifest)."""
    outputs: tuple[TensorConfig, ...] | None = None
    preprocessing: PreprocessingSpec | None = None
    postprocessing: ClassificationConfig | None = None
    batching: BatchingConfig = BatchingConfig()
    buckets: tuple[int, ...] = ()
    """Lengths that every dynamic (-1) non-batch dim of an input is padded up to; a longer
    input is refused. A text pipeline's buckets apply when this is empty."""
    warmup: WarmupConfig = WarmupConfig()
    instances: int = Field(default=1, ge=1)
    device: str = Field(default="auto", pattern=r"^(auto|cpu|cuda(:\d+)?)$")
    precision: Literal["fp32", "fp16", "bf16"] = "fp32"
    """TorchScript: run in half precision (weights converted at load); needs tolerance_override,
    since the golden outputs were made in fp32."""
    gpu: GpuConfig = GpuConfig()
    version_policy: VersionPolicy = VersionPolicy(latest=1)
    cast_inputs: bool = False
    """Cast numeric inputs of another datatype to the declared one instead of refusing them."""
    tolerance_override: float | None = Field(default=None, gt=0)
    """Widen the manifest's golden tolerance explicitly (e.g. on another device)."""
    stochastic: bool = False
    """The model draws random numbers on purpose (it samples): serve it although two runs of
    one batch answer differently (refused at load otherwise, as a dropout left in train())."""

    @model_validator(mode="after")
    def _consistent(self) -> ModelConfig:
        """What the config alone decides, checked when it is read (not at load)."""
        if self.gpu.cuda_graphs and self.backend != "torchscript":
            raise ValueError(
                "gpu.cuda_graphs is for TorchScript models; for ONNX use gpu.tensorrt, which "
                "compiles the graph for the GPU"
            )
        if self.precision != "fp32" and self.backend != "torchscript":
            raise ValueError(
                f"precision {self.precision} is for TorchScript models; export the ONNX graph in "
                "half precision instead"
            )
        if (self.inputs is None) != (self.outputs is None):
            raise ValueError("name both 'inputs' and 'outputs', or neither")
        for size in self.batching.preferred_batch_sizes:
            if not 1 <= size <= max(self.max_batch_size, 1):
                raise ValueError(
                    f"batching.preferred_batch_sizes has {size}, outside 1..max_batch_size "
                    f"({self.max_batch_size})"
                )
        rows = sum(self.warmup_batch_sizes())
        if rows > MAX_WARMUP_ROWS:
            raise ValueError(
                f"warmup runs {rows} rows in all (warmup.batch_sizes "
                f"{self.warmup.batch_sizes!r}, max_batch_size {self.max_batch_size}); at most "
                f"{MAX_WARMUP_ROWS}: name the batch sizes the scheduler will form, e.g. "
                "preferred_batch_sizes and max_batch_size, with pad_batches: true"
            )
        if self.max_batch_size > 0 and any(
            size > self.max_batch_size for size in self.warmup_batch_sizes()
        ):
            raise ValueError(
                f"warmup.batch_sizes has {max(self.warmup_batch_sizes())}, above max_batch_size "
                f"{self.max_batch_size}"
            )
        return self

    def warmup_batch_sizes(self) -> tuple[int, ...]:
        sizes = self.warmup.batch_sizes
        if sizes == "all":
            return tuple(range(1, self.max_batch_size + 1)) if self.max_batch_size else (1,)
        return tuple(sizes)

    def shape_buckets(self) -> tuple[int, ...]:
        if self.buckets:
            return self.buckets
        spec = self.preprocessing
        return spec.buckets if spec is not None and spec.kind == "text" else ()


def load_model_config(path: Path) -> ModelConfig:
    """Read and validate a config.yaml, raising :class:`ModelLoadError` naming file and field."""
    try:
        raw: Any = yaml.safe_load(path.read_text())
    except OSError as exc:
        raise ModelLoadError(f"{path}: cannot read it ({exc.strerror})") from None
    except yaml.YAMLError as exc:
        raise ModelLoadError(f"{path}: cannot read YAML: {yaml_problem(exc)}") from None
    if raw is None:
        raise ModelLoadError(f"{path} is empty: a model's config names its backend at least")
    if not isinstance(raw, dict):
        raise ModelLoadError(f"{path}: expected a mapping of settings, got {type(raw).__name__}")
    try:
        return ModelConfig.model_validate(raw)
    except ValidationError as exc:
        raise ModelLoadError(f"{path}: {describe_validation_error(exc)}") from None


def describe_validation_error(exc: ValidationError, root: object = None) -> str:
    """``field.path: message (got value)`` for each error, joined with ``; ``. ``root``: what
    was validated (a model, or a union of them; ModelConfig when None), for the setting a
    misspelt key was likely meant to be."""
    parts = []
    for error in exc.errors():
        loc = [str(part) for part in error["loc"]]
        # A tagged union adds its tag to the path (preprocessing.image.mean, or image.mean in
        # a spec of its own): not a key the user wrote, so it is left out.
        loc = [
            p
            for i, p in enumerate(loc)
            if not (
                p in PREPROCESSING_KINDS
                and (loc[i - 1] == "preprocessing" if i else root is PreprocessingSpec)
            )
        ]
        where = ".".join(loc) or "(top level)"
        if error["type"] == "extra_forbidden":  # a misspelt key: pydantic's words name none
            parts.append(f"{where}: not a setting here{_closest(error['loc'], root)}")
            continue
        said = error["type"] == "missing" or "(got " in error["msg"]  # a validator's own
        got = "" if said else f" (got {error['input']!r})"
        message = error["msg"].removeprefix("Value error, ")  # pydantic's, for a ValueError
        parts.append(f"{where}: {message}{got}")
    return "; ".join(parts)


def yaml_problem(exc: yaml.YAMLError) -> str:
    """A YAML error in one line, with where (PyYAML's own takes four, and names no file)."""
    if isinstance(exc, yaml.MarkedYAMLError) and exc.problem_mark is not None:
        mark, began = exc.problem_mark, exc.context_mark
        said = f"line {mark.line + 1}, column {mark.column + 1}: {exc.problem}"
        if exc.context and began is not None:
            said += f" ({exc.context}, which began at line {began.line + 1}, column "
            said += f"{began.column + 1})"
        return said
    return " ".join(str(exc).split())


def _closest(loc: tuple[int | str, ...], root: object) -> str:
    """``; did you mean <the setting of that level spelt most like it>?``, or the settings
    there."""
    models = _models_in(ModelConfig if root is None else root)
    for part in loc[:-1]:
        fields = [f for m in models for key, f in _keys(m).items() if key == part]
        tagged = [
            m for m in models if "kind" in m.model_fields and m.model_fields["kind"].default == part
        ]
        if fields:
            models = [m for f in fields for m in _models_in(f.annotation)]
        elif tagged:  # a tagged union's tag (preprocessing.image): that member
            models = tagged
    names = sorted({key for m in models for key in _keys(m)})
    close = difflib.get_close_matches(str(loc[-1]), names, n=1)
    return f"; did you mean {close[0]}?" if close else f" (settings here: {', '.join(names)})"


def _keys(model: type[BaseModel]) -> dict[str, FieldInfo]:
    """A model's fields by the key a config writes (``class``, not the field ``cls``)."""
    return {field.alias or name: field for name, field in model.model_fields.items()}


def _models_in(annotation: object) -> list[type[BaseModel]]:
    """The pydantic models a field's annotation holds (in unions, optionals, lists)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [m for arg in typing.get_args(annotation) for m in _models_in(arg)]
