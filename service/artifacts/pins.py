"""Library pins: the torch / onnxruntime / CUDA versions the server runs with, checked against
the ones its image pinned.

The image sets ``TG_EXPECT_TORCH``, ``TG_EXPECT_ONNXRUNTIME`` and ``TG_EXPECT_CUDA``; at start the
server logs what it really runs and refuses to start when any differs: a drifted runtime is the
trap where a model exported and verified with one build is served by another.
"""

from __future__ import annotations

import importlib.metadata
import logging

from service.settings import Settings

log = logging.getLogger("tensorgate.pins")


class VersionDrift(RuntimeError):
    """The running versions are not the ones the image pinned."""


def running_versions() -> dict[str, str | None]:
    """torch / onnxruntime (from installed metadata: no heavy import) and torch's CUDA build."""
    versions: dict[str, str | None] = {}
    for package in ("torch", "onnxruntime", "onnxruntime-gpu"):
        try:
            versions[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            versions[package] = None
    versions["cuda"] = _cuda_build(versions["torch"] or "")
    return versions


def _cuda_build(torch_version: str) -> str | None:
    """The CUDA (major.minor) torch was built for: its local version (``2.13.0+cu128``, the
    PyTorch index's builds), else the CUDA runtime wheel PyPI's builds depend on
    (``nvidia-cuda-runtime`` 13.0.96 → 13.0); None for a CPU build."""
    local = torch_version.partition("+")[2]
    if local.startswith("cu") and len(local) > 3:
        return f"{local[2:-1]}.{local[-1]}"
    if local:  # +cpu, +rocm…
        return None
    for package in ("nvidia-cuda-runtime", "nvidia-cuda-runtime-cu13", "nvidia-cuda-runtime-cu12"):
        try:
            major, minor, *_ = importlib.metadata.version(package).split(".")
        except (importlib.metadata.PackageNotFoundError, ValueError):
            continue
        return f"{major}.{minor}"
    return None


def check_pinned(settings: Settings) -> dict[str, str | None]:
    """Log the running versions; raise VersionDrift naming each that differs from its pin."""
    running = running_versions()
    onnxruntime = running["onnxruntime"] or running["onnxruntime-gpu"]
    expected = {
        "torch": (settings.expect_torch, running["torch"]),
        "onnxruntime": (settings.expect_onnxruntime, onnxruntime),
        "cuda": (settings.expect_cuda, running["cuda"]),
    }
    log.info(
        "running torch %s, onnxruntime %s, CUDA build %s",
        running["torch"],
        onnxruntime,
        running["cuda"] or "none",
        extra={"versions": running},
    )
    drift = [
        f"{name} {have or 'missing'} (image pinned {want})"
        for name, (want, have) in expected.items()
        if want is not None and want != have
    ]
    if drift:
        raise VersionDrift("runtime versions drifted from the image's pins: " + "; ".join(drift))
    return running
