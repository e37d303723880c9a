"""Model runtimes. Only this package imports torch or onnxruntime, and only when needed."""

from __future__ import annotations

import os
from collections.abc import Callable

from service.errors import ModelLoadError
from service.runtimes.base import Runtime, RuntimeOptions

PLATFORMS = {"onnx": "onnxruntime_onnx", "torchscript": "pytorch_libtorch", "pt2": "pytorch_aoti"}
"""Each backend's platform, as Triton names it (model metadata and configuration)."""


def create_runtime(backend: str, options: RuntimeOptions) -> Runtime:
    """The runtime for a config's ``backend``; its library is imported only now."""
    if backend == "onnx":
        from service.runtimes.onnx import OnnxRuntime

        return OnnxRuntime(options)
    if backend == "torchscript":
        from service.runtimes.torchscript import TorchScriptRuntime

        return TorchScriptRuntime(options)
    if backend == "pt2":
        from service.runtimes.pt2 import Pt2Runtime

        return Pt2Runtime(options)
    raise ValueError(f"unknown backend {backend!r}")


def resolve_device(device: str, backend: str) -> str:
    """``auto`` → ``cuda`` when the backend's library sees a GPU, else ``cpu``."""
    if device != "auto":
        return device
    if backend == "onnx":
        import onnxruntime as ort

        return "cuda" if "CUDAExecutionProvider" in ort.get_available_providers() else "cpu"
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def cuda_device_count() -> int:
    """The CUDA devices this process may use: from torch (``CUDA_VISIBLE_DEVICES`` applied),
    else from NVML (an onnxruntime-gpu image with a CPU torch), else 0."""
    import torch

    if torch.cuda.is_available():
        return torch.cuda.device_count()
    try:
        import pynvml
    except ImportError:
        return 0
    try:
        pynvml.nvmlInit()
        count = int(pynvml.nvmlDeviceGetCount())
        pynvml.nvmlShutdown()
    except pynvml.NVMLError:
        return 0
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        count = min(count, len([d for d in visible.split(",") if d.strip()]))
    return count


def instance_devices(device: str, instances: int, gpu_count: Callable[[], int]) -> list[str]:
    """Each instance's device: ``cuda`` spreads instances round-robin over the visible GPUs,
    ``cuda:N`` puts them all on GPU N, ``cpu`` on the CPU.

    ``gpu_count`` is asked only for a CUDA device; a GPU index it does not have is refused.
    """
    if not device.startswith("cuda"):
        return [device] * instances
    count = gpu_count()
    if count == 0:
        raise ModelLoadError(f"device {device!r} asked for, but no CUDA device is visible")
    index = device.partition(":")[2]
    if index:
        if int(index) >= count:
            raise ModelLoadError(
                f"device {device!r} asked for, but only {count} CUDA device(s) are visible "
                f"(cuda:0..cuda:{count - 1})"
            )
        return [device] * instances
    return [f"cuda:{i % count}" for i in range(instances)]


def runtime_versions(backend: str) -> dict[str, str]:
    """The versions of the library a backend runs on, as the manifest gate compares them."""
    if backend == "onnx":
        import onnxruntime as ort

        return {"onnxruntime": ort.__version__}
    import torch

    if backend == "pt2":  # a compiled package also needs the device type it was compiled for
        devices = "cpu,cuda" if torch.cuda.is_available() else "cpu"
        return {"torch": torch.__version__, "devices": devices}
    return {"torch": torch.__version__}


__all__ = [
    "Runtime",
    "RuntimeOptions",
    "create_runtime",
    "cuda_device_count",
    "instance_devices",
    "resolve_device",
    "runtime_versions",
]
