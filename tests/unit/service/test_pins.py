"""Which CUDA torch was built for, from installed metadata only (no torch import)."""

from __future__ import annotations

import importlib.metadata

import pytest

from service.artifacts import pins


@pytest.mark.parametrize(
    ("torch", "runtime", "cuda"),
    [
        ("2.13.0+cu128", None, "12.8"),  # the PyTorch index's build names its CUDA
        ("2.13.0+cpu", "13.0.96", None),
        ("2.13.0", "13.0.96", "13.0"),  # PyPI's build: its nvidia-cuda-runtime wheel says
        ("2.13.0", None, None),  # a plain CPU build (e.g. macOS, or this machine's wheel)
    ],
)
def test_the_cuda_build_is_read_from_metadata(
    monkeypatch: pytest.MonkeyPatch, torch: str, runtime: str | None, cuda: str | None
) -> None:
    def version(package: str) -> str:
        if package == "nvidia-cuda-runtime" and runtime is not None:
            return runtime
        raise importlib.metadata.PackageNotFoundError(package)

    monkeypatch.setattr(pins.importlib.metadata, "version", version)
    assert pins._cuda_build(torch) == cuda
