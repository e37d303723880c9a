"""Metadata, configuration, statistics and repository views: what the read-only routes show."""

from __future__ import annotations

from typing import Any

from service import __version__
from service.model_config import ModelConfig, TensorConfig
from service.repository.models import ModelRepository, ModelState, ModelVersion
from service.repository.triton_config import triton_config
from service.runtimes import PLATFORMS
from service.settings import Settings


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
    """OIP model metadata plus state, reason, whether the gates verified it (and the warnings
    of those skipped), device and load timings."""
    entry = repository.entry(name)
    found: ModelVersion | None = repository.version(name, version) if entry.versions else None
    served = found.served if found else None
    loaded = served.loaded if served else None
    backend = entry.config.backend if entry.config else ""
    metadata: dict[str, Any] = {
        "name": name,
        "versions": [str(v) for v in sorted(entry.versions)],
        "platform": PLATFORMS.get(backend, ""),
        "inputs": _tensors(loaded.public_inputs(), loaded.config) if loaded else [],
        "outputs": _tensors(loaded.public_outputs(), loaded.config) if loaded else [],
    }
    state, reason = repository.state(found) if found else (ModelState.UNAVAILABLE, "")
    metadata["state"] = state.value
    if found is not None:
        metadata["version"] = str(found.version)
    reason = reason or entry.error
    if entry.unloaded:
        metadata["state"], reason = ModelState.UNLOADED.value, "unloaded"
    if entry.last_load_error:  # a reload was refused: say what serves instead, and why
        metadata["last_load_error"] = entry.last_load_error
        if state is ModelState.READY and found is not None:  # else its own reason stands
            serving = (
                [found.version]
                if version
                else sorted(
                    number
                    for number, each in entry.versions.items()
                    if repository.state(each)[0] is ModelState.READY
                )
            )
            said = ", ".join(map(str, serving))
            reason = f"version {said} serves" if len(serving) == 1 else f"versions {said} serve"
            reason += "; the last reload was refused: " + entry.last_load_error
    if reason:
        metadata["reason"] = reason
    if loaded is not None:
        metadata["verified"] = loaded.verified
        metadata["device"] = loaded.device
        if loaded.warnings:
            metadata["warnings"] = loaded.warnings
        metadata["load_timings_s"] = loaded.timings
        metadata["warmup_timings_s"] = loaded.warmup_timings
        scheduler = served.scheduler if served else None
        metadata["queue"] = {
            "pending": scheduler.pending if scheduler else 0,
            "busy_instances": scheduler.busy_instances() if scheduler else 0,
            "instances": loaded.config.instances,
        }
    return metadata


def config(repository: ModelRepository, name: str, version: str | None) -> dict[str, Any]:
    """The config being served, in Triton's shape (model_configuration; see triton_config)."""
    found = repository.version(name, version)
    entry = repository.entry(name)
    assert entry.config is not None  # a version exists only under a valid config
    loaded = found.served.loaded if found.served is not None else None
    return triton_config(name, found.version, entry.config, loaded)


def statistics(
    repository: ModelRepository, name: str | None, version: str | None
) -> dict[str, Any]:
    """Triton's ``model_stats`` for every loaded version, one model, or one version."""
    if name is None:
        chosen = repository.served_versions()
    elif version is None:
        repository.entry(name)
        chosen = [(v, served) for v, served in repository.served_versions() if v.name == name]
    else:
        found = repository.version(name, version)
        chosen = [(found, found.served)] if found.served is not None else []
    return {"model_stats": [served.stats.snapshot(v.name, str(v.version)) for v, served in chosen]}


def _tensors(tensors: list[TensorConfig], config: ModelConfig) -> list[dict[str, Any]]:
    batch = [-1] if config.max_batch_size > 0 else []
    return [{"name": t.name, "datatype": t.datatype, "shape": [*batch, *t.shape]} for t in tensors]
