"""Model runtimes. Only this package imports torch or onnxruntime, and only when needed."""

from __future__ import annotations

from service.runtimes.base import Runtime, RuntimeOptions


def create_runtime(backend: str, options: RuntimeOptions) -> Runtime:
    """The runtime for a config's ``backend``; its library is imported only now."""
    if backend == "onnx":
        from service.runtimes.onnx import OnnxRuntime

        return OnnxRuntime(options)
    if backend == "torchscript":
        from service.runtimes.torchscript import TorchScriptRuntime

        return TorchScriptRuntime(options)
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


def runtime_versions(backend: str) -> dict[str, str]:
    """The versions of the library a backend runs on, as the manifest gate compares them."""
    if backend == "onnx":
        import onnxruntime as ort

        return {"onnxruntime": ort.__version__}
    import torch

    return {"torch": torch.__version__}


__all__ = ["Runtime", "RuntimeOptions", "create_runtime", "resolve_device", "runtime_versions"]
