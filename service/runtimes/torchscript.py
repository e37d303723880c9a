"""TorchScript models on libtorch, with inference hygiene enforced rather than hoped for.

Every submodule is put in eval mode, every parameter stops requiring grad, every call runs under
``torch.inference_mode()``, and a module that still reports ``training`` after that is refused.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from service.errors import ModelLoadError
from service.runtimes.base import Runtime, Signature


class TorchScriptRuntime(Runtime):
    """Runs ``model.pt`` (a ``torch.jit`` archive) on CPU or CUDA."""

    platform = "pytorch_libtorch"
    artifact = "model.pt"

    def load(self, path: Path, declared: Signature | None, max_batch_size: int) -> Signature:
        if declared is None:
            raise ModelLoadError(
                "a TorchScript artifact carries no tensor datatypes: name 'inputs' and 'outputs' "
                "in config.yaml, or export it with `tensorgate export` to get a manifest"
            )
        device = self.options.device
        if device.startswith("cuda") and not torch.cuda.is_available():
            raise ModelLoadError(f"device {device!r} asked for, but torch sees no CUDA device")
        torch.set_num_threads(self.options.intra_op_threads)
        try:
            module = torch.jit.load(str(path), map_location=device)  # type: ignore[no-untyped-call]  # untyped in torch
        except (RuntimeError, ValueError) as exc:
            raise ModelLoadError(f"torch.jit.load cannot load {path.name}: {exc}") from None
        module.eval()
        for parameter in module.parameters():
            parameter.requires_grad_(False)
        still_training = [name or "(root)" for name, sub in module.named_modules() if sub.training]
        if still_training:
            raise ModelLoadError(
                f"submodules still in training mode after eval(): {still_training}"
            )
        arguments = [arg.name for arg in module.forward.schema.arguments[1:]]
        if len(arguments) != len(declared.inputs):
            raise ModelLoadError(
                f"forward() takes {len(arguments)} inputs {arguments}, "
                f"{len(declared.inputs)} are declared"
            )
        self._module = module
        self._device = torch.device(device)
        self._input_names = [t.name for t in declared.inputs]
        self._output_names = [t.name for t in declared.outputs]
        return declared

    def run(self, batch: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        with torch.inference_mode():
            args = [self._to_tensor(batch[name]) for name in self._input_names]
            result = self._module(*args)
            return self._outputs(result)

    def _to_tensor(self, array: np.ndarray) -> torch.Tensor:
        # torch.from_numpy shares memory and needs a writable array; views of a request body
        # are read-only, so those are copied once here.
        if not array.flags.writeable:
            array = array.copy()
        return torch.from_numpy(array).to(self._device)

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
        return {
            name: tensor.detach().cpu().numpy()
            for name, tensor in zip(self._output_names, tensors, strict=True)
        }
