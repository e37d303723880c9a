"""What TorchScript and AOTInductor models share on libtorch: tensors in and out (BF16 as bit
patterns, half precision, pinned copies on a CUDA stream of the runtime's own), one call under
``torch.inference_mode()``, and release. :class:`~service.runtimes.torchscript.TorchScriptRuntime`
and :class:`~service.runtimes.pt2.Pt2Runtime` are siblings on it: each loads its own artifact.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from service.resources import CPU_USE
from service.runtimes.base import Runtime, Signature

HALF = {"fp16": torch.float16, "bf16": torch.bfloat16}
_TORCH_DTYPES = {
    "FP16": torch.float16,
    "FP32": torch.float32,
    "FP64": torch.float64,
    "BF16": torch.bfloat16,
}


_THREADS = threading.local()
"""``count``: the intra-op threads torch was last given on this thread (by any runtime)."""


class TorchRuntime(Runtime):
    """A loaded torch module (``_bind``) run on one device."""

    _half: torch.dtype | None = None
    shares_threads = True
    """Whether a batch beside another keeps to the worker's share (:meth:`_cpu_threads`)."""

    def _bind(self, module: Any, device: torch.device, declared: Signature) -> Signature:
        """Take ``module`` (loaded on ``device``) as the one ``run`` calls."""
        self._module = module
        self._device = device
        self._cuda = self._device.type == "cuda"
        # Each runtime (instance) gets its own stream, so that copies and kernels of concurrent
        # instances overlap instead of queueing on the default stream.
        self._stream = (
            torch.cuda.Stream(device=self._device)  # type: ignore[no-untyped-call]  # untyped in torch
            if self._cuda
            else None
        )
        self._input_names = [t.name for t in declared.inputs]
        self._bf16_inputs = {t.name for t in declared.inputs if t.datatype == "BF16"}
        self._output_names = [t.name for t in declared.outputs]
        self._output_dtypes = [_TORCH_DTYPES.get(t.datatype) for t in declared.outputs]
        return declared

    def run(self, batch: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        with torch.inference_mode():
            if self._stream is None:
                self._cpu_threads()
                return self._outputs(self._module(*self._inputs(batch)))
            with torch.cuda.stream(self._stream):
                replayed = self._replay(batch)
                if replayed is not None:
                    return self._outputs(replayed)
                result = self._module(*self._inputs(batch))
                return self._outputs(result)  # .cpu() waits for this stream's work

    def _cpu_threads(self) -> None:
        """Give the calling thread the intra-op threads this batch runs with: every CPU's
        (``intra_op_threads``) for a batch alone, the worker's share beside another batch
        (:data:`service.resources.CPU_USE`), as ONNX Runtime's two sessions do, unless the
        runtime keeps every CPU's (:attr:`shares_threads`). torch's ops and AOTInductor's
        kernels parallelise with OpenMP, whose thread count is the calling thread's own, so
        each instance thread sets it, and only when it changes.

        TorchScript took every CPU always: two workers warming efficientnet at once on 2 CPUs,
        each splitting every operator over 2 threads, took 125 s where one thread each took
        41 (docs/performance.md, "torch runtimes at the defaults")."""
        options = self.options
        wanted = options.intra_op_threads
        if self.shares_threads and 0 < options.shared_threads < wanted and CPU_USE.contended():
            wanted = options.shared_threads
        if getattr(_THREADS, "count", 0) != wanted:
            torch.set_num_threads(wanted)
            _THREADS.count = wanted

    def _replay(self, batch: Mapping[str, np.ndarray]) -> Any:
        """A captured graph's outputs for ``batch``, or None to run the module (the default)."""
        return None

    def close(self) -> None:
        """Drop the module and hand cached device memory back."""
        self.__dict__.pop("_module", None)  # idempotent
        if self.__dict__.get("_cuda"):
            torch.cuda.empty_cache()

    def _inputs(self, batch: Mapping[str, np.ndarray]) -> list[torch.Tensor]:
        return [
            self._to_tensor(batch[name], name in self._bf16_inputs) for name in self._input_names
        ]

    def _to_tensor(self, array: np.ndarray, bf16: bool = False) -> torch.Tensor:
        # torch.from_numpy shares memory and needs a writable array with no negative stride;
        # views of a request body are read-only, and a model's own code may make a reversed
        # view (``img[..., ::-1]``), so those are copied once here, in C order, as a compiled
        # kernel's inputs are laid out.
        if not (array.flags.writeable and array.flags.c_contiguous):
            array = np.array(array, order="C")
        tensor = torch.from_numpy(array)
        if bf16:  # tensorgate holds BF16 as its bit patterns (service/datatypes.py)
            tensor = tensor.view(torch.bfloat16)
        if self._cuda:
            # Pinned host memory lets the copy run asynchronously on the instance's stream.
            tensor = tensor.pin_memory().to(self._device, non_blocking=True)
        if self._half is not None and tensor.is_floating_point():
            tensor = tensor.to(self._half)
        return tensor

    def _outputs(self, result: Any) -> dict[str, np.ndarray]:
        if isinstance(result, torch.Tensor):
            tensors = [result]
        elif isinstance(result, (tuple, list)):
            tensors = list(result)
        elif isinstance(result, dict):
            tensors = [result[name] for name in self._output_names]
        else:
            raise TypeError(f"forward() returned {type(result).__name__}, not tensors")
        if len(tensors) != len(self._output_names):
            raise TypeError(
                f"forward() returned {len(tensors)} outputs, {len(self._output_names)} declared"
            )
        arrays = {}
        for name, tensor, dtype in zip(
            self._output_names, tensors, self._output_dtypes, strict=True
        ):
            if dtype is not None and tensor.dtype != dtype:
                tensor = tensor.to(dtype)  # half-precision results back to the declared type
            if tensor.dtype == torch.bfloat16:  # numpy has no bfloat16: its bit patterns
                tensor = tensor.view(torch.uint16)
            arrays[name] = tensor.detach().cpu().numpy()
        return arrays
