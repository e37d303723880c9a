"""ONNX models on onnxruntime: one InferenceSession, explicit providers and thread counts."""

from __future__ import annotations

import ctypes
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort

from service.errors import InvalidInput, ModelLoadError
from service.model_config import GpuConfig, TensorConfig
from service.resources import CPU_USE
from service.runtimes.base import Runtime, Signature, shape_fits

_ORT_TYPES = {
    "tensor(bool)": "BOOL",
    "tensor(uint8)": "UINT8",
    "tensor(uint16)": "UINT16",
    "tensor(uint32)": "UINT32",
    "tensor(uint64)": "UINT64",
    "tensor(int8)": "INT8",
    "tensor(int16)": "INT16",
    "tensor(int32)": "INT32",
    "tensor(int64)": "INT64",
    "tensor(float16)": "FP16",
    "tensor(float)": "FP32",
    "tensor(double)": "FP64",
    "tensor(bfloat16)": "BF16",
    "tensor(string)": "BYTES",
}
_BFLOAT16 = 16
"""ONNX's element type number for bfloat16 (``onnx.TensorProto.BFLOAT16``; onnx itself is not
a runtime dependency)."""


Provider = str | tuple[str, dict[str, Any]]


def providers_for(
    device: str, available: list[str], gpu: GpuConfig | None = None, cache_dir: Path | None = None
) -> list[Provider]:
    """The execution providers for a device, with their options, CPU always last.

    Refuses CUDA (or TensorRT) when this onnxruntime does not have it: a model meant for a GPU
    silently running on the CPU is a trap, not a fallback.
    """
    if device == "cpu":
        return ["CPUExecutionProvider"]
    gpu = gpu or GpuConfig()
    if "CUDAExecutionProvider" not in available:
        raise ModelLoadError(
            f"device {device!r} asked for, but this onnxruntime has no CUDAExecutionProvider "
            f"(available: {', '.join(available)}); install onnxruntime-gpu or set device: cpu"
        )
    device_id = int(device.partition(":")[2] or 0)
    providers: list[Provider] = []
    if gpu.tensorrt:
        if "TensorrtExecutionProvider" not in available:
            raise ModelLoadError(
                "gpu.tensorrt is set, but this onnxruntime has no TensorrtExecutionProvider "
                f"(available: {', '.join(available)})"
            )
        cache = (cache_dir or Path(".")) / gpu.tensorrt_cache
        providers.append(
            (
                "TensorrtExecutionProvider",
                {
                    "device_id": device_id,
                    "trt_engine_cache_enable": True,
                    "trt_engine_cache_path": str(cache),
                    "trt_fp16_enable": gpu.tensorrt_fp16,
                },
            )
        )
    cuda: dict[str, Any] = {
        "device_id": device_id,
        "arena_extend_strategy": gpu.arena_extend_strategy,
        "cudnn_conv_algo_search": gpu.cudnn_conv_algo_search,
    }
    if gpu.memory_limit_bytes is not None:
        cuda["gpu_mem_limit"] = gpu.memory_limit_bytes
    providers.append(("CUDAExecutionProvider", cuda))
    providers.append("CPUExecutionProvider")
    return providers


class OnnxRuntime(Runtime):
    """Runs ``model.onnx`` with onnxruntime."""

    artifact = "model.onnx"

    def load(self, path: Path, declared: Signature | None, max_batch_size: int) -> Signature:
        providers = providers_for(
            self.options.device,
            ort.get_available_providers(),
            self.options.gpu,
            self.options.cache_dir,
        )
        if self.options.device != "cpu" and hasattr(ort, "preload_dlls"):
            # The GPU image takes CUDA and cuDNN from pip's nvidia-* wheels, not from system
            # paths: onnxruntime finds them only once they are loaded (or torch imported).
            ort.preload_dlls()
        threads, shared = self.options.intra_op_threads, self.options.shared_threads
        two = self.options.device == "cpu" and 0 < shared < threads
        try:
            # With a share session beside it, this one runs only batches alone on the server
            # (CPU_USE): its threads spin between operators, and stop when the run ends.
            options = _session_options(threads, spin=two)
            self._session = ort.InferenceSession(str(path), options, providers=providers)
            bounded = self.options.bucketed or self.options.device != "cpu"
            if not bounded and _unbounded(self._session, declared, max_batch_size):
                options.enable_cpu_mem_arena = False
                self._session = ort.InferenceSession(str(path), options, providers=providers)
            self._shared: ort.InferenceSession | None = None
            self._alone = AloneChoice()
            if two:
                # A second session of the same graph with the process's share of the CPUs, for
                # batches that run beside another (service.resources.CpuUse): an intra-op pool
                # is fixed per session, and one wider than its share splits each operator
                # into halves that wait on each other's preempted threads.
                share = _session_options(shared, spin=False)
                share.enable_cpu_mem_arena = options.enable_cpu_mem_arena
                self._shared = ort.InferenceSession(str(path), share, providers=providers)
        except Exception as exc:  # onnxruntime raises its own unexported exception types
            raise ModelLoadError(f"onnxruntime cannot load {path.name}: {exc}") from None
        graph = Signature(
            tuple(_tensor(arg, max_batch_size) for arg in self._session.get_inputs()),
            tuple(_tensor(arg, max_batch_size) for arg in self._session.get_outputs()),
        )
        if declared is not None:
            _check_declared(declared, graph)
        self._output_names = [t.name for t in graph.outputs]
        device = self.options.device
        self._device_type = "cuda" if device.startswith("cuda") else "cpu"
        self._device_id = int(device.partition(":")[2] or 0)
        self._bf16_inputs = {t.name for t in graph.inputs if t.datatype == "BF16"}
        self._bf16_outputs = {t.name for t in graph.outputs if t.datatype == "BF16"}
        if self._bf16_outputs and any(t.datatype == "BYTES" for t in graph.inputs):
            raise ModelLoadError(
                f"outputs {sorted(self._bf16_outputs)} are BF16 and the model takes strings: "
                "onnxruntime's Python API returns bfloat16 only from OrtValue inputs, and makes "
                "no OrtValue of strings; split the model, or return FP32"
            )
        mode = self.options.gpu.io_binding
        self._io_binding = (
            (mode == "on" or (mode == "auto" and self._device_type == "cuda"))
            # string outputs live on the host: bound to a device they would fail; bfloat16
            # outputs have no numpy type to be copied back as
            and all(t.datatype not in ("BYTES", "BF16") for t in graph.outputs)
            and not self._bf16_inputs
        )
        return declared or graph

    def run(self, batch: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        shared = self._shared
        if shared is None:
            return self._run(self._session, batch)
        rows = _rows(batch)
        sides = self._alone.sides(rows)
        if sides.small(rows) or CPU_USE.contended():
            return self._run(shared, batch)
        return self._run_alone(shared, batch, sides, rows)

    def _run_alone(
        self,
        shared: ort.InferenceSession,
        batch: Mapping[str, np.ndarray],
        sides: _Sides,
        rows: int,
    ) -> dict[str, np.ndarray]:
        """A batch alone, on the session that runs lone batches of its size faster
        (:class:`AloneChoice`), timed for it when nothing else ran meanwhile."""
        wide = sides.wide()
        started = time.perf_counter()
        outputs = self._run(self._session if wide else shared, batch)
        seconds = time.perf_counter() - started
        if not CPU_USE.contended():
            sides.record(wide, seconds / max(rows, 1))
        return outputs

    def warmup(self, batch: Mapping[str, np.ndarray]) -> None:
        self._run(self._session, batch)
        shared = self._shared
        if shared is None:
            return
        self._run(shared, batch)  # either may serve the shape
        rows = _rows(batch)
        if all(self._alone.sides(rows).per_row):
            # Seeded by an earlier shape of its size bucket (another size of it, or the same
            # size at other dims): a seed is only where the first lone batches start, and
            # timing every shape ran each twice more, 4 runs instead of 2 (efficientnet's 32
            # sizes, minilm's 5 sizes × 5 lengths: half of a worker's startup).
            return
        for wide, session in ((True, self._session), (False, shared)):  # each timed once more
            started = time.perf_counter()
            self._run(session, batch)
            self._alone.seed(wide, time.perf_counter() - started, rows)

    def _run(
        self, session: ort.InferenceSession, batch: Mapping[str, np.ndarray]
    ) -> dict[str, np.ndarray]:
        if self._bf16_outputs:
            results = self._run_bf16(session, batch)
        elif any(a.dtype == object for a in batch.values()) or self._bf16_inputs:
            # String tensors live on the host whatever the device: no binding for them.
            feed = {name: self._feed(name, a) for name, a in batch.items()}
            results = session.run(self._output_names, feed)
        elif self._io_binding:
            results = self._run_bound(batch)
        else:
            results = session.run(self._output_names, dict(batch))
        return dict(zip(self._output_names, results, strict=True))

    def _feed(self, name: str, array: np.ndarray) -> Any:
        """One input as onnxruntime takes it: strings as str, BF16 bit patterns as bfloat16."""
        if array.dtype == object:
            return _text(name, array)
        if name in self._bf16_inputs:
            return ort.OrtValue.ortvalue_from_numpy_with_onnx_type(
                np.ascontiguousarray(array), _BFLOAT16
            )
        return array

    def _run_bf16(
        self, session: ort.InferenceSession, batch: Mapping[str, np.ndarray]
    ) -> list[np.ndarray]:
        """A model with bfloat16 outputs: onnxruntime cannot hand them to numpy, so the run
        takes and gives OrtValues, and those outputs are read back as their bit patterns."""
        feed = {
            name: self._feed(name, a)
            if name in self._bf16_inputs
            else ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(a))
            for name, a in batch.items()
        }
        values = session.run_with_ort_values(self._output_names, feed)
        return [
            _bf16_bits(value) if name in self._bf16_outputs else _numpy(value)
            for name, value in zip(self._output_names, values, strict=True)
        ]

    def _run_bound(self, batch: Mapping[str, np.ndarray]) -> list[np.ndarray]:
        """IO binding: each input is copied host→device once, each output is left on the device
        by the graph and copied back once, instead of onnxruntime's per-run staging."""
        binding = self._session.io_binding()
        for name, array in batch.items():
            binding.bind_cpu_input(name, np.ascontiguousarray(array))
        for name in self._output_names:
            binding.bind_output(name, self._device_type, self._device_id)
        self._session.run_with_iobinding(binding)
        results: list[np.ndarray] = binding.copy_outputs_to_cpu()
        return results

    def close(self) -> None:
        self.__dict__.pop("_session", None)  # idempotent; the session is freed with it
        self.__dict__.pop("_shared", None)


class AloneChoice:
    """Whether a batch alone runs on every CPU's threads (the wide session) or on the share:
    the one that has run lone batches of its size faster, as measured while serving (warmup
    seeds it). A model whose operators gain from more threads (a CNN: 1.7 × on 2 CPUs) takes
    them; a tiny one (the W2 MLP), which only pays for waking them, keeps to its share, and a
    batch its share runs within :data:`SMALL_RUN_S` is not chosen for at all
    (:meth:`_Sides.small`).

    Each batch size (rounded down to a power of two) is judged apart: per row, a batch of 32
    costs a third of a lone image, and with one estimate per row for every size each side's
    came from whatever size it had run fastest per row, not from the size at hand (at the
    defaults a worker's first 150 lone images after its warmup took 13 ms, then 8).

    For each size, each side's estimate is the least time per row seen, aged by
    :data:`AGING` of itself for every lone batch of that size since (either side's): a sample
    slowed by another process is never too fast, so one good sample tells, and both sides age
    alike however often each runs. (Aged per sample of its own side instead, the chosen side
    climbed to its typical time while the other kept its best. Aged by wall time, a size whose
    batches came a second or more apart found the side last run freshest, and flipped.) The side
    not chosen runs one batch in :data:`EXPLORE` of its size, so that the choice follows the
    machine; warmup's timings only seed the estimates, and the first two lone batches of a size
    try both sides.

    Read and written without a lock from the instance threads: a lost update costs an estimate
    one sample, and two instances of a model may both take the same turn to explore."""

    __slots__ = ("sizes",)

    def __init__(self) -> None:
        self.sizes: dict[int, _Sides] = {}
        """Per size bucket (``rows.bit_length()``: at most 64 of them)."""

    def sides(self, rows: int) -> _Sides:
        key = rows.bit_length()
        sides = self.sizes.get(key)
        if sides is None:
            sides = self.sizes[key] = _Sides()
        return sides

    def seed(self, wide: bool, seconds: float, rows: int) -> None:
        """A warmup batch's time: an estimate until the size's first lone batches try both."""
        self.sides(rows).record(wide, seconds / max(rows, 1), tried=False)


class _Sides:
    """One size bucket's estimates in :class:`AloneChoice`: index 0 wide, 1 the share. Its
    clock is its count of lone batches."""

    __slots__ = ("count", "per_row", "seen", "tried")

    def __init__(self) -> None:
        self.count = 0
        self.per_row = [0.0, 0.0]
        """The least seconds per row seen; 0: not measured yet."""
        self.seen = [0, 0]
        """At which count each was seen."""
        self.tried = [-EXPLORE, -EXPLORE]
        """At which count each side last ran a lone batch."""

    def small(self, rows: int) -> bool:
        """Whether ``rows`` run on the share within :data:`SMALL_RUN_S`: such a batch keeps to
        the share with nothing timed or explored."""
        return 0.0 < self.per_row[1] * rows < SMALL_RUN_S

    def estimate(self, side: int) -> float:
        return self.per_row[side] * (1.0 + AGING * (self.count - self.seen[side]))

    def wide(self) -> bool:
        """Whether the next lone batch runs on every CPU's threads."""
        self.count += 1
        count, tried = self.count, self.tried
        if not self.per_row[0] or not self.per_row[1]:
            # Unmeasured (a size warmup did not run): each side once, then the measured one.
            for side in (0, 1):
                if not self.per_row[side] and count - tried[side] >= EXPLORE:
                    tried[side] = count
                    return side == 0
            return bool(self.per_row[0])
        best = self.estimate(0) < self.estimate(1) * WIDE_GAIN
        other = 1 if best else 0
        if count - tried[other] >= EXPLORE:
            tried[other] = count
            return not best
        return best

    def record(self, wide: bool, per_row: float, tried: bool = True) -> None:
        side = 0 if wide else 1
        if tried and self.count > self.tried[side]:
            self.tried[side] = self.count
        if not self.per_row[side] or per_row <= self.estimate(side):
            self.per_row[side], self.seen[side] = per_row, self.count


SMALL_RUN_S = 100e-6
"""A batch that its share runs within this long is not worth every CPU's threads: waking
them costs about what they could save, the other CPU is often another worker's, and choosing
(timing, exploring the wide side one batch in :data:`EXPLORE`) cost the W2 MLP's one-row
requests more than their 12 µs run (docs/performance.md, "Defaults that win")."""
WIDE_GAIN = 0.9
"""A batch alone takes every CPU's threads only when they run it at least 10 % faster."""
EXPLORE = 64
"""One lone batch of a size in this many runs on the side not chosen."""
AGING = 0.005
"""How fast a best time is forgotten, per lone batch of its size: after 100, a better one
within 1.5 × replaces it."""


def _rows(batch: Mapping[str, np.ndarray]) -> int:
    first = next(iter(batch.values()), None)
    return int(first.shape[0]) if first is not None and first.ndim else 1


def _bf16_bits(value: ort.OrtValue) -> np.ndarray:
    """A bfloat16 OrtValue (on the host) → its bit patterns as a ``uint16`` array."""
    if value.device_name().lower() != "cpu":
        raise RuntimeError(f"a bfloat16 output came back on {value.device_name()}, not the host")
    size = value.tensor_size_in_bytes()
    raw = ctypes.string_at(value.data_ptr(), size) if size else b""
    return np.frombuffer(raw, dtype="<u2").reshape(value.shape())


def _numpy(value: ort.OrtValue) -> np.ndarray:
    array: np.ndarray = value.numpy()
    # strings come back as numpy str here, as Python objects from session.run()
    return array.astype(object) if array.dtype.kind == "U" else array


def _text(name: str, array: np.ndarray) -> np.ndarray:
    """onnxruntime string tensors take str: it would turn bytes into their repr ``"b'...'"``."""
    text = np.empty(array.shape, dtype=object)
    try:
        for index, item in np.ndenumerate(array):
            text[index] = item.decode() if isinstance(item, bytes) else item
    except UnicodeDecodeError:
        raise InvalidInput(
            f"input '{name}': onnxruntime string tensors hold UTF-8 text, and an element is not"
        ) from None
    return text


def _session_options(threads: int, spin: bool) -> ort.SessionOptions:
    """Options of one session of ``threads`` intra-op threads. Idle intra-op threads spin by
    default, burning the cores that the event loop and preprocessing need between batches
    (bench/protocol.py): they sleep, unless ``spin``, where they spin while a run lasts (a
    thread that sleeps between operators is woken for each: 1.0 ms of a lone
    efficientnet_lite0 image's 5.0 on 2 CPUs) and stop when it ends (force_spinning_stop)."""
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.add_session_config_entry("session.intra_op.allow_spinning", "1" if spin else "0")
    if spin:
        options.add_session_config_entry("session.force_spinning_stop", "1")
    return options


def _unbounded(
    session: ort.InferenceSession, declared: Signature | None, max_batch_size: int
) -> bool:
    """Whether a request can make a batch of any size: an input dim, other than the batch's,
    that neither the graph nor the config fixes. onnxruntime's CPU arena grows to the largest
    batch a session ran and never gives it back (its shrinkage option frees nothing of it):
    for such a model one large request would keep its memory for good (16 × 61 MiB requests
    left +440 MiB after they were answered), so it runs without the arena. A model whose
    shapes are bounded keeps it: its arena reached its largest at warmup, and what it saves
    is within noise here (a lone efficientnet_lite0 image without it: 0.96–1.15 × the median
    time in four runs, the minimums within 1 %; docs/performance.md, "Memory after an
    attack"), so nothing is given up where it costs no memory."""
    inputs = declared.inputs if declared is not None else None
    if inputs is None:
        inputs = tuple(_tensor(arg, max_batch_size) for arg in session.get_inputs())
    return any(-1 in tensor.shape for tensor in inputs)


def _tensor(arg: ort.NodeArg, max_batch_size: int) -> TensorConfig:
    datatype = _ORT_TYPES.get(arg.type)
    if datatype is None:
        raise ModelLoadError(
            f"tensor '{arg.name}' has type {arg.type}, which tensorgate cannot serve"
        )
    dims = [d if isinstance(d, int) and d > 0 else -1 for d in arg.shape]
    if max_batch_size > 0:
        if not dims:
            raise ModelLoadError(
                f"tensor '{arg.name}' is a scalar, but max_batch_size > 0 needs a batch dimension"
            )
        dims = dims[1:]
    return TensorConfig.model_validate({"name": arg.name, "datatype": datatype, "shape": dims})


def _check_declared(declared: Signature, graph: Signature) -> None:
    for kind, mine, theirs in (
        ("input", declared.inputs, graph.inputs),
        ("output", declared.outputs, graph.outputs),
    ):
        graph_by_name = {t.name: t for t in theirs}
        for tensor in mine:
            actual = graph_by_name.get(tensor.name)
            if actual is None:
                raise ModelLoadError(
                    f"{kind} '{tensor.name}' is declared but the graph has only "
                    f"{sorted(graph_by_name)}"
                )
            if actual.datatype != tensor.datatype or not shape_fits(actual.shape, tensor.shape):
                raise ModelLoadError(
                    f"{kind} '{tensor.name}': declared {tensor.datatype} {list(tensor.shape)}, "
                    f"the graph has {actual.datatype} {list(actual.shape)}"
                )
        if kind == "input" and {t.name for t in mine} != set(graph_by_name):
            raise ModelLoadError(
                f"declared inputs {sorted(t.name for t in mine)} differ from the graph's "
                f"{sorted(graph_by_name)}"
            )
