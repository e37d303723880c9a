"""TorchScript models on libtorch, with inference hygiene enforced rather than hoped for.

Every submodule is put in eval mode, every parameter stops requiring grad, every call runs under
``torch.inference_mode()``, and a module that still reports ``training`` after that is refused,
as is one whose graph fixes dropout or batch norm to training (:func:`fixed_to_training`: a
trace in ``train()`` does, and ``eval()`` cannot undo it).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from service.errors import ModelLoadError
from service.runtimes.base import Signature
from service.runtimes.libtorch import HALF, TorchRuntime

GraphKey = tuple[tuple[str, str, tuple[int, ...]], ...]
log = logging.getLogger("tensorgate.runtime")

_DROPOUT = re.compile(r"^aten::(feature_)?(alpha_)?dropout_?$")
_TORCH_DIR = str(Path(torch.__file__).parent)
_FRAME = re.compile(
    r'^\s*(?:File "(?P<file>[^"]+)", line (?P<line>\d+)|(?P<traced>\S.*?)\((?P<at>\d+)\): '
    r"(?P<function>\S+))"
)


def fixed_to_training(module: torch.jit.ScriptModule) -> list[str]:
    """The dropouts and normalisations of ``module``'s graph fixed to training mode, whatever
    ``eval()`` says: ``torch.jit.trace`` of a module in ``train()`` writes ``train=True`` into
    each as a constant (so after ``eval()`` no submodule reports ``training``, and yet every
    call drops activations at random and normalises by the batch's own statistics, updating the
    running ones), as does ``F.dropout`` without ``training=``, traced or scripted. The same
    holds for an instance norm that keeps running statistics (its ``use_input_stats`` fixed
    True) and for the ``dropout_p`` of ``scaled_dot_product_attention`` (``nn.MultiheadAttention``
    passes it only in training). A batch or instance norm without running statistics
    (``track_running_stats=False``) normalises by the input's in eval mode too, and is not
    counted. Each as "op at file(line)" (:func:`_where`), once."""
    found: list[str] = []

    def visit(block: Any) -> None:
        for node in block.nodes():
            kind, inputs = node.kind(), list(node.inputs())
            said = None
            if (
                _DROPOUT.match(kind)
                and len(inputs) >= 3
                and _constant(inputs[2]) is True
                and _constant(inputs[1]) != 0  # p = 0 drops nothing
            ):
                said = f"{kind.removeprefix('aten::').rstrip('_')} at {_where(node)}"
            elif (
                kind == "aten::batch_norm"
                and len(inputs) >= 6
                and _constant(inputs[5]) is True
                and not _none(inputs[3])
            ):
                said = f"batch_norm at {_where(node)}"
            elif (  # use_input_stats fixed True where running statistics were kept
                kind == "aten::instance_norm"
                and len(inputs) >= 6
                and _constant(inputs[5]) is True
                and not _none(inputs[3])
            ):
                said = f"instance_norm at {_where(node)}"
            elif (  # nn.MultiheadAttention passes its dropout only in training
                kind == "aten::scaled_dot_product_attention"
                and len(inputs) >= 5
                and isinstance(p := _constant(inputs[4]), float)
                and p > 0
            ):
                said = f"scaled_dot_product_attention's dropout_p at {_where(node)}"
            if said is not None and said not in found:  # F.dropout's two branches: one op
                found.append(said)
            for inner in _live(node):
                visit(inner)

    visit(module.inlined_graph)
    return found


def training_refusal(artifact: str, module: torch.jit.ScriptModule) -> str:
    """Why ``module`` (the ``artifact`` file's) cannot serve for what :func:`fixed_to_training`
    finds in it, or "" (the server's refusal at load, and export's before it writes one)."""
    fixed = fixed_to_training(module)
    if not fixed:
        return ""
    shown = "; ".join(fixed[:5]) + (f"; and {len(fixed) - 5} more" if len(fixed) > 5 else "")
    return (
        f"{artifact} runs in training mode whatever eval() says: its graph fixes {len(fixed)} "
        f"dropout or normalisation ops to training ({shown}), so each call would drop activations "
        "at random or use the batch's statistics. A trace of a module in train() fixes them so: "
        "call model.eval() before torch.jit.trace and save it again (tensorgate export does); "
        "and pass training=self.training to F.dropout, whose default is True"
    )


def _live(node: Any) -> list[Any]:
    """The blocks of ``node`` that can run in eval mode: of an ``if`` on ``self.training`` (or
    on a constant) only the branch taken, so that ``if self.training: x = F.dropout(x, p)`` is
    not refused for a dropout that never runs."""
    blocks = list(node.blocks())
    if node.kind() != "prim::If" or len(blocks) != 2:
        return blocks
    condition = next(node.inputs())
    made = condition.node()
    if _is_training(made):
        return [blocks[1]]
    if made.kind() == "aten::__not__" and _is_training(next(made.inputs()).node()):
        return [blocks[0]]
    if made.kind() == "prim::Constant" and isinstance(taken := _constant(condition), bool):
        return [blocks[0] if taken else blocks[1]]
    return blocks


def _is_training(node: Any) -> bool:
    """Whether ``node`` reads a module's ``training`` (False once ``eval()`` ran)."""
    return bool(node.kind() == "prim::GetAttr" and node.s("name") == "training")


def _none(value: Any) -> bool:
    """Whether a graph value is the constant None (an optional tensor not given)."""
    return bool(value.node().kind() == "prim::Constant" and value.toIValue() is None)


def _constant(value: Any) -> Any:
    """A graph value's constant (None where it is not one)."""
    return value.toIValue() if value.node().kind() == "prim::Constant" else None


def _where(node: Any) -> str:
    """Where ``node`` came from: the first frame of its source range outside torch (a trace
    records the caller's stack, "path(line): function"), else torch's own line (a scripted
    module records only the op's: "File "path", line N")."""
    text: str = node.sourceRange()
    frames = [
        (found["file"] or found["traced"], found["line"] or found["at"], found["function"])
        for line in text.split("Serialized", 1)[0].splitlines()
        if (found := _FRAME.match(line)) is not None
    ]
    for path, line, function in frames:
        if not path.startswith(_TORCH_DIR):
            return f"{path}({line})" + (f": {function}" if function else "")
    if frames:
        path, line, _ = frames[0]
        return f"torch/{Path(path).relative_to(_TORCH_DIR)}({line}), in the module's code"
    return "an unknown line"


def _probe(batch: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Inputs of ``batch``'s shapes with varied values (warmup batches are zeros)."""
    rng = np.random.default_rng(0)
    return {
        name: rng.standard_normal(a.shape).astype(a.dtype) if a.dtype.kind == "f" else a.copy()
        for name, a in batch.items()
    }


def graph_key(batch: Mapping[str, np.ndarray]) -> GraphKey:
    """What a captured CUDA graph is specific to: every input's name, dtype and full shape."""
    return tuple(sorted((name, a.dtype.str, tuple(a.shape)) for name, a in batch.items()))


class _Graph:
    """One captured CUDA graph: fixed input buffers it reads, fixed outputs it writes."""

    def __init__(self, graph: Any, inputs: list[torch.Tensor], outputs: Any) -> None:
        self.graph = graph
        self.inputs = inputs
        self.outputs = outputs

    @classmethod
    def capture(cls, module: Any, inputs: list[torch.Tensor], stream: Any, pool: Any) -> _Graph:
        """Capture ``module`` on ``inputs``' shapes. Graphs of one runtime share one memory
        pool: they replay one at a time on its stream, and each replay's outputs are copied
        to the host before the next."""
        static = [t.clone() for t in inputs]
        for _ in range(2):  # let lazy initialisation happen outside the capture
            module(*static)
        stream.synchronize()
        graph = torch.cuda.CUDAGraph()
        # thread_local: other instances' threads may allocate while this one captures
        with torch.cuda.graph(graph, pool=pool, stream=stream, capture_error_mode="thread_local"):
            outputs = module(*static)
        return cls(graph, static, outputs)

    def replay(self, inputs: list[torch.Tensor]) -> Any:
        for buffer, tensor in zip(self.inputs, inputs, strict=True):
            buffer.copy_(tensor, non_blocking=True)
        self.graph.replay()
        return self.outputs


class TorchScriptRuntime(TorchRuntime):
    """Runs ``model.pt`` (a ``torch.jit`` archive) on CPU or CUDA; on CUDA with
    ``gpu.cuda_graphs``, a captured graph per warmed batch shape."""

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
        self._half = HALF.get(self.options.precision)
        if self._half is not None:
            module = module.to(self._half)
        still_training = [name or "(root)" for name, sub in module.named_modules() if sub.training]
        if still_training:
            raise ModelLoadError(
                f"submodules still in training mode after eval(): {still_training}"
            )
        if refusal := training_refusal(path.name, module):
            raise ModelLoadError(refusal)
        arguments = [arg.name for arg in module.forward.schema.arguments[1:]]
        if len(arguments) != len(declared.inputs):
            raise ModelLoadError(
                f"forward() takes {len(arguments)} inputs {arguments}, "
                f"{len(declared.inputs)} are declared"
            )
        self._graphs: dict[GraphKey, _Graph] = {}
        self._pool: Any = None
        signature = self._bind(module, torch.device(device), declared)
        self._capture = self._cuda and self.options.gpu.cuda_graphs
        return signature

    def _replay(self, batch: Mapping[str, np.ndarray]) -> Any:
        graph = self._graphs.get(graph_key(batch)) if self._graphs else None
        return None if graph is None else graph.replay(self._inputs(batch))

    def warmup(self, batch: Mapping[str, np.ndarray]) -> None:
        """Run the shape eagerly (cuDNN picks its kernels); with ``gpu.cuda_graphs``, capture it,
        and keep the graph only if its replay answers as the eager module does."""
        self.run(batch)
        if self._capture:
            self._capture_graph(batch)

    def _capture_graph(self, batch: Mapping[str, np.ndarray]) -> None:
        key = graph_key(batch)
        try:
            with torch.inference_mode(), torch.cuda.stream(self._stream):
                if self._pool is None:
                    self._pool = torch.cuda.graph_pool_handle()
                graph = _Graph.capture(self._module, self._inputs(batch), self._stream, self._pool)
        except Exception as exc:  # a data-dependent branch, .item(), a recompilation, ...
            log.warning("CUDA graph capture failed for %s; that shape runs eagerly: %s", key, exc)
            return
        probe = _probe(batch)
        eager = self.run(probe)
        self._graphs[key] = graph
        replayed = self.run(probe)
        tolerance = 1e-2 if self._half is not None else 1e-4  # half precision rounds coarser
        if not all(np.allclose(replayed[n], eager[n], rtol=1e-3, atol=tolerance) for n in eager):
            del self._graphs[key]
            log.warning(
                "CUDA graph replay for %s differs from the eager module; that shape runs eagerly",
                key,
            )

    def close(self) -> None:
        """Drop the graphs, then the module, and hand cached device memory back."""
        self.__dict__.get("_graphs", {}).clear()
        self._pool = None
        super().close()

    @property
    def captured(self) -> frozenset[GraphKey]:
        """The batch shapes that replay a CUDA graph."""
        return frozenset(self._graphs)
