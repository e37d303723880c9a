"""The Runtime contract: load an artifact, warm it up, run one batch. Nothing else."""

from __future__ import annotations

import abc
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

import numpy as np

from service.model_config import GpuConfig, TensorConfig


@dataclass(frozen=True, slots=True)
class RuntimeOptions:
    """What every runtime is told at construction."""

    device: str = "cpu"
    """``cpu`` or ``cuda[:N]``; ``auto`` is resolved before a runtime sees it."""
    intra_op_threads: int = 1
    precision: str = "fp32"
    gpu: GpuConfig = field(default_factory=GpuConfig)
    cache_dir: Path | None = None
    """Where a runtime may cache compiled engines (the version folder)."""
    shared_threads: int = 0
    """Threads for a batch that runs beside another one (``service.resources.CPU_USE``): the
    process's share of the CPUs. 0, or ``intra_op_threads`` or more: always
    ``intra_op_threads``."""
    bucketed: bool = False
    """The model's config names shape buckets: its dynamic dims never pass the largest."""


def shape_fits(want: tuple[int, ...], got: tuple[int, ...]) -> bool:
    """Whether a tensor of shape ``got`` fits ``want``, whose -1 dims take any size."""
    return len(want) == len(got) and all(w in (-1, g) for w, g in zip(want, got, strict=True))


@dataclass(frozen=True, slots=True)
class Signature:
    """Inputs and outputs as the runtime will take and give them, without the batch dim."""

    inputs: tuple[TensorConfig, ...]
    outputs: tuple[TensorConfig, ...]


class Runtime(abc.ABC):
    """Loads one artifact onto one device and runs batches on it.

    ``run`` is called from one instance thread at a time; implementations hold no per-request
    state. A runtime owns inference hygiene: eval mode, no autograd, explicit threads/providers.
    """

    artifact: ClassVar[str]
    """The file name of the artifact in a version folder."""

    def __init__(self, options: RuntimeOptions) -> None:
        self.options = options

    @abc.abstractmethod
    def load(self, path: Path, declared: Signature | None, max_batch_size: int) -> Signature:
        """Load the artifact; return its signature (``declared`` fills what the file lacks)."""

    @abc.abstractmethod
    def run(self, batch: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Run one batch: input name → array, output name → array (on the host)."""

    def warmup(self, batch: Mapping[str, np.ndarray]) -> None:
        """Run one batch of the given shapes so that later requests of that shape pay nothing."""
        self.run(batch)

    def close(self) -> None:  # noqa: B027 - a no-op default that runtimes may override
        """Release what the runtime holds."""
