"""A served model's configuration in Triton's shape (``model_config.proto``), for the
model_configuration extension: ``GET /v2/models/{name}/config`` and gRPC ``ModelConfig``.

Triton tooling (perf_analyzer, model analyzer, scripts) reads ``input[]`` / ``output[]`` with
``data_type`` (``TYPE_FP32``) and ``dims`` without the batch dimension, ``max_batch_size``,
``dynamic_batching`` and ``instance_group``. What tensorgate has beyond Triton (preprocessing,
buckets, warmup, the gates' outcome) is under ``parameters``, Triton's map of strings: one key
``tensorgate.<setting>`` a setting, its value JSON. The dict is the proto's JSON form, so gRPC
parses it into ``inference.ModelConfig`` unchanged.
"""

from __future__ import annotations

from typing import Any

import orjson

from service.batching.scheduler import ADAPTIVE_DELAY_S
from service.model_config import ModelConfig, TensorConfig, VersionPolicy
from service.repository.loader import LoadedVersion
from service.runtimes import PLATFORMS

BACKENDS = {"onnx": "onnxruntime", "torchscript": "pytorch", "pt2": "pytorch"}
"""Each backend's name as Triton's backends are named (an AOTInductor package is PyTorch's)."""
FILENAMES = {"onnx": "model.onnx", "torchscript": "model.pt", "pt2": "model.pt2"}
OWN_SETTINGS = (
    "preprocessing",
    "postprocessing",
    "buckets",
    "warmup",
    "max_request_rows",
    "cast_inputs",
    "precision",
    "device",
    "gpu",
    "tolerance_override",
    "stochastic",
)
"""tensorgate's own config keys, given under ``parameters`` as ``tensorgate.<key>``."""


def data_type(datatype: str) -> str:
    """An OIP datatype as Triton's config names it (``FP32`` → ``TYPE_FP32``; BYTES is STRING)."""
    return "TYPE_STRING" if datatype == "BYTES" else f"TYPE_{datatype}"


def triton_config(
    name: str, version: int, config: ModelConfig, loaded: LoadedVersion | None
) -> dict[str, Any]:
    """The config of ``name`` (``loaded``: its version being served, when there is one)."""
    body: dict[str, Any] = {
        "name": name,
        "platform": PLATFORMS[config.backend],
        "backend": BACKENDS[config.backend],
        "version_policy": _version_policy(config.version_policy),
        "max_batch_size": config.max_batch_size,
        "default_model_filename": FILENAMES[config.backend],
    }
    if loaded is not None:
        raw = loaded.pipeline.raw_input if loaded.pipeline is not None else None
        # The raw-bytes input and the tensors it is made into exclude each other: the tensors
        # are what a client that fills every required input sends; the raw input is optional.
        body["input"] = [_tensor(t, optional=t.name == raw) for t in loaded.public_inputs()]
        body["output"] = [_tensor(t) for t in loaded.public_outputs()]
    if config.max_batch_size > 0:
        batching = config.batching
        body["dynamic_batching"] = {
            "preferred_batch_size": list(batching.preferred_batch_sizes),
            # adaptive (unset): at most ADAPTIVE_DELAY_S, which is what a client can wait
            "max_queue_delay_microseconds": round(
                ADAPTIVE_DELAY_S * 1e6
                if batching.max_queue_delay_ms is None
                else batching.max_queue_delay_ms * 1000
            ),
            "default_queue_policy": {"max_queue_size": batching.max_queue_size},
        }
    device = loaded.device if loaded is not None else config.device
    group: dict[str, Any] = {"name": name, "count": config.instances, "kind": "KIND_CPU"}
    if device.startswith("cuda"):
        group["kind"] = "KIND_GPU"
        group["gpus"] = [int(device.partition(":")[2] or 0)]
    body["instance_group"] = [group]
    settings = config.model_dump(mode="json", exclude_none=True)
    own = {key: settings[key] for key in OWN_SETTINGS if key in settings}
    own["version"] = str(version)
    if loaded is not None:
        own["verified"] = loaded.verified
        # what a request is held to, as served: the values each input takes (declared, proven
        # at export, or a tokenizer's vocabulary), and how its dynamic dims are fitted
        ranges = {
            t.name: t.model_dump(mode="json")["range"]
            for t in loaded.signature.inputs
            if t.range is not None
        }
        if ranges:
            own["input_ranges"] = ranges
        shapes = loaded.shapes
        if shapes.axes:
            own["dynamic_dims"] = {
                "dims": [[f"{name}:{index}" for name, index in a.dims] for a in shapes.axes],
                "buckets": list(shapes.buckets),
                "sizes": (
                    ("padded to a bucket" if shapes.pad else "exactly a bucket")
                    if shapes.buckets
                    else "any (no buckets: not warmed)"
                ),
                "largest": [a.max for a in shapes.axes],
            }
    body["parameters"] = {
        f"tensorgate.{key}": {"string_value": orjson.dumps(value).decode()}
        for key, value in own.items()
    }
    return body


def _tensor(tensor: TensorConfig, optional: bool = False) -> dict[str, Any]:
    entry: dict[str, Any] = {
        "name": tensor.name,
        "data_type": data_type(tensor.datatype),
        "dims": list(tensor.shape) or [1],  # a scalar per row is dims [1], as Triton writes it
    }
    if not tensor.shape:  # and reshaped to none, as Triton says it: the tensor is [batch]
        entry["reshape"] = {"shape": []}
    if optional:
        entry["optional"] = True
    return entry


def _version_policy(policy: VersionPolicy) -> dict[str, Any]:
    if policy.all:
        return {"all": {}}
    if policy.specific is not None:
        return {"specific": {"versions": list(policy.specific)}}
    return {"latest": {"num_versions": policy.latest or 1}}
