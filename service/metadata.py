"""Metadata, configuration, statistics and repository views: what the read-only routes show."""

from __future__ import annotations

from typing import Any

from service import __version__
from service.model_config import ModelConfig, TensorConfig
from service.repository import ModelRepository, ModelState, ModelVersion
from service.settings import Settings

PLATFORMS = {"onnx": "onnxruntime_onnx", "torchscript": "pytorch_libtorch", "pt2": "pytorch_aoti"}


def extensions(settings: Settings) -> list[str]:
    """The protocol extensions this server really implements with these settings."""
    names = ["binary_tensor_data", "classification", "model_configuration", "statistics"]
    if settings.admin_token is not None:
        names.append("model_repository")
    return names


def server(settings: Settings) -> dict[str, Any]:
    return {
        "name": settings.server_name,
        "version": __version__,
        "extensions": extensions(settings),
    }


def model(repository: ModelRepository, name: str, version: str | None) -> dict[str, Any]:
    """OIP model metadata plus state, reason, gate results and timings."""
    entry = repository.entry(name)
    found: ModelVersion | None = repository.version(name, version) if entry.versions else None
    loaded = found.loaded if found else None
    backend = entry.config.backend if entry.config else ""
    metadata: dict[str, Any] = {
        "name": name,
        "versions": [str(v) for v in sorted(entry.versions)],
        "platform": PLATFORMS.get(backend, ""),
        "inputs": _tensors(loaded.public_inputs(), loaded.config) if loaded else [],
        "outputs": _tensors(loaded.public_outputs(), loaded.config) if loaded else [],
        "state": found.state.value if found else ModelState.UNAVAILABLE.value,
    }
    if found is not None:
        metadata["version"] = str(found.version)
    reason = found.reason if found and found.reason else entry.error
    if entry.last_load_error:  # a reload was refused: say what serves instead, and why
        serving = f"version {found.version} serves" if found else "nothing serves"
        reason = f"{serving}; the last reload was refused: {entry.last_load_error}"
        metadata["last_load_error"] = entry.last_load_error
    if reason:
        metadata["reason"] = reason
    if loaded is not None:
        metadata["verified"] = loaded.verified
        metadata["device"] = loaded.device
        if loaded.warnings:
            metadata["warnings"] = loaded.warnings
        metadata["load_timings_s"] = loaded.timings
        metadata["warmup_timings_s"] = loaded.warmup_timings
        scheduler = loaded.scheduler
        metadata["queue"] = {
            "pending": scheduler.pending if scheduler else 0,
            "busy_instances": sum(b is not None for b in scheduler.busy_since) if scheduler else 0,
            "instances": loaded.config.instances,
        }
    return metadata


def config(repository: ModelRepository, name: str, version: str | None) -> dict[str, Any]:
    """The config being served, with inputs and outputs resolved (model_configuration)."""
    found = repository.version(name, version)
    entry = repository.entry(name)
    assert entry.config is not None  # a version exists only under a valid config
    served: ModelConfig = entry.config
    body: dict[str, Any] = {
        "name": name,
        "version": str(found.version),
        "platform": PLATFORMS[served.backend],
        **served.model_dump(mode="json", exclude_none=True),
    }
    if found.loaded is not None:
        body["inputs"] = [t.model_dump() for t in found.loaded.signature.inputs]
        body["outputs"] = [t.model_dump() for t in found.loaded.signature.outputs]
    return body


def statistics(
    repository: ModelRepository, name: str | None, version: str | None
) -> dict[str, Any]:
    """Triton's ``model_stats`` for every loaded version, one model, or one version."""
    if name is None:
        chosen = repository.loaded_versions()
    elif version is None:
        repository.entry(name)
        chosen = [(v, loaded) for v, loaded in repository.loaded_versions() if v.name == name]
    else:
        found = repository.version(name, version)
        chosen = [(found, found.loaded)] if found.loaded is not None else []
    return {"model_stats": [loaded.stats.snapshot(v.name, str(v.version)) for v, loaded in chosen]}


def _tensors(tensors: list[TensorConfig], config: ModelConfig) -> list[dict[str, Any]]:
    batch = [-1] if config.max_batch_size > 0 else []
    return [{"name": t.name, "datatype": t.datatype, "shape": [*batch, *t.shape]} for t in tensors]
