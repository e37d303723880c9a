"""Loading one model version: artifact → gates → pipelines → warmup, timed by part."""

from __future__ import annotations

import asyncio
import io
import logging
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from PIL import Image

from preprocessing.image import ImagePipeline, PreprocessingError
from preprocessing.spec import TextSpec
from preprocessing.text import TextPipeline
from service.errors import ModelLoadError, ModelNotReady
from service.manifest import (
    Manifest,
    Tolerance,
    check_golden,
    check_preprocessing,
    check_versions,
    read_manifest,
)
from service.model_config import ModelConfig, TensorConfig
from service.post import CLASSIFICATION, Classifier
from service.protocol.datatypes import TO_NUMPY
from service.runtimes import (
    create_runtime,
    cuda_device_count,
    instance_devices,
    resolve_device,
    runtime_versions,
)
from service.runtimes.base import Runtime, RuntimeOptions, Signature
from service.scheduler import BatchShape, Scheduler, SchedulerConfig, batch_shape
from service.settings import Settings
from service.stats import ModelStats, RequestTiming

log = logging.getLogger("tensorgate.loader")

TEXT_INPUTS = ("input_ids", "attention_mask")
SKIPPED_WITHOUT_MANIFEST = (
    "version gate skipped: no manifest.json",
    "golden replay skipped: no manifest.json",
    "preprocessing hash check skipped: no manifest.json",
)


@dataclass(eq=False)
class LoadedModel:
    """A version that passed its gates and warmup, with what serving it needs."""

    name: str
    config: ModelConfig
    runtimes: list[Runtime]
    """One per instance on CUDA (each its own device, stream and graphs); one shared by every
    instance on the CPU, where a session or module runs concurrent calls safely."""
    signature: Signature
    devices: list[str]
    """Each instance's device."""
    pipeline: ImagePipeline | TextPipeline | None
    classifier: Classifier | None
    manifest: Manifest | None
    warnings: list[str]
    timings: dict[str, float]
    warmup_timings: dict[str, float]
    warmed: set[BatchShape]
    """The batch shapes warmup ran; a batch of any other shape counts as unwarmed."""
    stats: ModelStats = field(default_factory=ModelStats, repr=False)
    scheduler: Scheduler | None = field(default=None, repr=False)
    _loop: asyncio.AbstractEventLoop | None = field(default=None, repr=False)
    closed: bool = False
    _users: int = field(default=0, repr=False)
    _idle: threading.Condition = field(default_factory=threading.Condition, repr=False)

    @property
    def device(self) -> str:
        """The instances' devices, as one string (``cuda:0,cuda:1`` when spread)."""
        return ",".join(dict.fromkeys(self.devices))

    @property
    def verified(self) -> bool:
        """True when every manifest gate ran and passed."""
        return self.manifest is not None

    @property
    def bytes_input(self) -> str | None:
        """The BYTES input a pipeline takes: encoded images, or UTF-8 text (``text``)."""
        if isinstance(self.pipeline, TextPipeline):
            return "text"
        return f"{self.signature.inputs[0].name}_bytes" if self.pipeline is not None else None

    def public_inputs(self) -> list[TensorConfig]:
        """Inputs as clients see them: the model's, plus the encoded-image BYTES input."""
        inputs = list(self.signature.inputs)
        if self.bytes_input is not None:
            inputs.append(TensorConfig(name=self.bytes_input, datatype="BYTES", shape=()))
        return inputs

    def public_outputs(self) -> list[TensorConfig]:
        """Outputs as clients see them: the model's, plus top-k classification strings."""
        outputs = list(self.signature.outputs)
        if self.classifier is not None:
            outputs.append(
                TensorConfig(name=CLASSIFICATION, datatype="BYTES", shape=(self.classifier.top_k,))
            )
        return outputs

    async def execute(
        self,
        batch: Mapping[str, np.ndarray],
        timing: RequestTiming | None = None,
        deadline: float | None = None,
    ) -> dict[str, np.ndarray]:
        """Queue one request on this version's scheduler; its outputs once its batch ran.

        The one place requests reach the runtime. The scheduler starts on first use, in the
        event loop that serves requests.
        """
        if self.closed:
            raise ModelNotReady(f"model '{self.name}' was unloaded while the request waited")
        return await self.start().submit(dict(batch), timing, deadline)

    async def execute_alone(
        self,
        prepare: Callable[[], dict[str, np.ndarray]],
        timing: RequestTiming | None = None,
    ) -> dict[str, np.ndarray] | None:
        """Preprocess and run a lone request on an idle instance's thread, in one hand-off;
        None when none is idle (see :meth:`Scheduler.submit_alone`)."""
        if self.closed:
            raise ModelNotReady(f"model '{self.name}' was unloaded while the request waited")
        return await self.start().submit_alone(prepare, timing)

    @property
    def alone(self) -> bool:
        """Whether the calling request is the only one in flight for this version."""
        return self._users == 1

    def start(self) -> Scheduler:
        """Start this version's scheduler in the running loop (once); called when it is ready,
        so that the first request does not pay for it."""
        if self.scheduler is None:
            self._loop = asyncio.get_running_loop()
            self.scheduler = Scheduler(
                self.name, _scheduler_config(self.config),
                [self.runtimes[i % len(self.runtimes)].run for i in range(self.config.instances)],
                self.stats, warmed=self.warmed,
            )  # fmt: skip
            self.scheduler.start()
        return self.scheduler

    @contextmanager
    def in_use(self) -> Iterator[None]:
        """Held by each request from lookup to answer, so that close() waits for it."""
        with self._idle:
            self._users += 1
        try:
            yield
        finally:
            with self._idle:
                self._users -= 1
                self._idle.notify_all()

    def close(self, drain_timeout_s: float = 60.0) -> None:
        """Wait for requests in flight (up to the timeout), then release the runtime.

        Called from a worker thread, never from the event loop that runs the scheduler.
        """
        with self._idle:
            self._idle.wait_for(lambda: self._users == 0, drain_timeout_s)
            self.closed = True
        if self.scheduler is not None and self._loop is not None and not self._loop.is_closed():
            stopping = asyncio.run_coroutine_threadsafe(self.scheduler.stop(), self._loop)
            stopping.result(timeout=drain_timeout_s)
        for runtime in self.runtimes:
            runtime.close()


def load_version(name: str, path: Path, config: ModelConfig, settings: Settings) -> LoadedModel:
    """Load ``path`` (a version folder) under ``config``; ModelLoadError names any refusal."""
    started = time.perf_counter()
    manifest = read_manifest(path)
    warnings: list[str] = []
    if manifest is None:
        warnings.extend(SKIPPED_WITHOUT_MANIFEST)
        for warning in warnings:
            log.warning("model %s: %s (export with `tensorgate export` to verify)", name, warning)
    else:
        check_versions(manifest, config.backend, runtime_versions(config.backend))

    device = resolve_device(config.device, config.backend)
    devices = instance_devices(device, config.instances, cuda_device_count)
    if config.gpu.cuda_graphs and not device.startswith("cuda"):
        warnings.append("gpu.cuda_graphs ignored: the model runs on the CPU")
    if config.precision != "fp32" and config.backend != "torchscript":
        raise ModelLoadError(
            f"precision {config.precision} is for TorchScript models; export the ONNX graph in "
            "half precision instead"
        )
    if config.precision != "fp32" and manifest is not None and config.tolerance_override is None:
        raise ModelLoadError(
            f"precision {config.precision} changes the outputs the golden file holds (made in "
            "fp32): set tolerance_override (e.g. 0.05) to widen the golden tolerance explicitly"
        )
    runtimes = [
        create_runtime(
            config.backend,
            RuntimeOptions(
                instance_device, settings.intra_op_threads, config.precision, config.gpu, path
            ),
        )
        for instance_device in (devices if device.startswith("cuda") else devices[:1])
    ]
    artifact = path / runtimes[0].artifact
    if not artifact.is_file():
        raise ModelLoadError(f"{artifact} is missing; run `make models` or export the model")
    declared = _declared(config, manifest)
    signature = runtimes[0].load(artifact, declared, config.max_batch_size)
    for runtime in runtimes[1:]:
        runtime.load(artifact, declared, config.max_batch_size)
    loaded_at = time.perf_counter()

    if manifest is not None:
        check_preprocessing(config, manifest)
        tolerance = manifest.tolerance
        if config.tolerance_override is not None:
            tolerance = Tolerance(atol=config.tolerance_override, rtol=tolerance.rtol)
            warnings.append(f"golden tolerance widened by config to atol={tolerance.atol:g}")
        for runtime in runtimes:  # every device answers as the exporter's did
            check_golden(path, runtime.run, tolerance)
    pipeline = _pipeline(config, signature, path)
    if isinstance(pipeline, TextPipeline):
        signature = _text_ranges(signature, pipeline.vocab_size)
    _warm_pipeline(pipeline)
    classifier = (
        Classifier(config.postprocessing, path.parent, signature.outputs)
        if config.postprocessing is not None
        else None
    )
    gated_at = time.perf_counter()

    warmup_timings, warmed = _warm_up(runtimes[0], signature, config)
    for runtime in runtimes[1:]:  # each device compiles (and captures) its own shapes
        _warm_up(runtime, signature, config)
    done = time.perf_counter()
    timings = {
        "load_s": loaded_at - started,
        "gates_s": gated_at - loaded_at,
        "warmup_s": done - gated_at,
        "total_s": done - started,
    }
    log.info("model %s loaded from %s on %s: %s", name, path, ",".join(dict.fromkeys(devices)),
             _fmt(timings))  # fmt: skip
    return LoadedModel(
        name, config, runtimes, signature, devices, pipeline, classifier, manifest, warnings,
        timings, warmup_timings, warmed,
    )  # fmt: skip


def _scheduler_config(config: ModelConfig) -> SchedulerConfig:
    return SchedulerConfig(
        max_batch_size=config.max_batch_size,
        pad_to=config.warmup_batch_sizes() if config.warmup.pad_batches else (),
        preferred_batch_sizes=config.batching.preferred_batch_sizes,
        max_queue_delay_s=config.batching.max_queue_delay_ms / 1000,
        max_queue_size=config.batching.max_queue_size,
        instances=config.instances,
    )


def _declared(config: ModelConfig, manifest: Manifest | None) -> Signature | None:
    if config.inputs is not None and config.outputs is not None:
        return Signature(config.inputs, config.outputs)
    if config.inputs is not None or config.outputs is not None:
        raise ModelLoadError("config.yaml names only one of 'inputs' and 'outputs'; name both")
    if manifest is not None:
        return Signature(manifest.inputs, manifest.outputs)
    return None


def _pipeline(
    config: ModelConfig, signature: Signature, folder: Path
) -> ImagePipeline | TextPipeline | None:
    spec = config.preprocessing
    if spec is None:
        return None
    if isinstance(spec, TextSpec):
        return _text_pipeline(spec, signature, folder)
    pipeline = ImagePipeline(spec)
    first = signature.inputs[0]
    produced = pipeline.output_shape
    if produced is not None and not (
        len(produced) == len(first.shape)
        and all(want in (-1, got) for want, got in zip(first.shape, produced, strict=True))
    ):
        raise ModelLoadError(
            f"preprocessing produces {list(produced)} per image, but input '{first.name}' is "
            f"{list(first.shape)}"
        )
    if np.dtype(spec.dtype) != TO_NUMPY[first.datatype]:
        raise ModelLoadError(
            f"preprocessing produces {spec.dtype}, input '{first.name}' is {first.datatype}"
        )
    return pipeline


def _warm_pipeline(pipeline: ImagePipeline | TextPipeline | None) -> None:
    """Run the preprocessing once: its first call pays for lazy set-up (tokenizer threads,
    codec tables) that no request should."""
    if isinstance(pipeline, TextPipeline):
        pipeline(["warm up the tokenizer"])
    elif isinstance(pipeline, ImagePipeline):
        buffer = io.BytesIO()
        Image.new("RGB", (512, 384), (128, 64, 32)).save(buffer, format="JPEG")
        pipeline(buffer.getvalue())


def _text_pipeline(spec: TextSpec, signature: Signature, folder: Path) -> TextPipeline:
    names = {t.name: t for t in signature.inputs}
    for name in TEXT_INPUTS:
        tensor = names.get(name)
        if tensor is None or tensor.datatype != "INT64" or tensor.shape != (-1,):
            raise ModelLoadError(
                f"text preprocessing feeds INT64 [-1, -1] inputs {list(TEXT_INPUTS)}; the model "
                f"takes {[f'{t.name} {t.datatype} {list(t.shape)}' for t in signature.inputs]}"
            )
    if set(names) != set(TEXT_INPUTS):
        raise ModelLoadError(f"text models take exactly {list(TEXT_INPUTS)}, not {sorted(names)}")
    try:
        return TextPipeline(spec, folder)
    except PreprocessingError as exc:
        raise ModelLoadError(str(exc)) from None


def _text_ranges(signature: Signature, vocab_size: int) -> Signature:
    """Token ids within the tokenizer's vocabulary, masks 0 or 1: a request that sends its own
    ids is checked before it can fail the batch it would join (the model's embedding lookup
    fails the whole batch on one id out of range)."""
    bounds = {"input_ids": (0.0, float(vocab_size - 1)), "attention_mask": (0.0, 1.0)}
    inputs = tuple(
        t.model_copy(update={"range": bounds[t.name]}) if t.range is None else t
        for t in signature.inputs
    )
    return Signature(inputs, signature.outputs)


def _warm_up(
    runtime: Runtime, signature: Signature, config: ModelConfig
) -> tuple[dict[str, float], set[BatchShape]]:
    """Run every batch size × bucket; return the timings and the shapes now warm."""
    batched = config.max_batch_size > 0
    sizes = config.warmup_batch_sizes() if batched else (0,)
    dynamic = any(-1 in t.shape for t in signature.inputs)
    buckets: tuple[int | None, ...] = config.shape_buckets() if dynamic else ()
    timings: dict[str, float] = {}
    warmed: set[BatchShape] = set()
    for size in sizes:
        if size > config.max_batch_size > 0:
            raise ModelLoadError(
                f"warmup.batch_sizes has {size}, above max_batch_size {config.max_batch_size}"
            )
        for bucket in buckets or (None,):
            batch = {
                t.name: _zeros(
                    ((size,) if size else ())
                    + tuple(bucket or 1 if d == -1 else d for d in t.shape),
                    t,
                )
                for t in signature.inputs
            }
            started = time.perf_counter()
            try:
                runtime.warmup(batch)
            except Exception as exc:
                where = f"batch size {size}" + (f", length {bucket}" if bucket else "")
                raise ModelLoadError(f"warmup at {where} failed: {exc}") from exc
            label = f"batch_{size}" + (f"_len_{bucket}" if bucket else "")
            timings[label] = time.perf_counter() - started
            warmed.add(batch_shape(batch))
            log.debug("warmed %s in %.1f ms", label, timings[label] * 1000)
    return timings, warmed


def _zeros(shape: tuple[int, ...], tensor: TensorConfig) -> np.ndarray:
    if tensor.datatype == "BYTES":
        return np.full(shape, b"", dtype=object)
    return np.zeros(shape, dtype=TO_NUMPY[tensor.datatype])


def _fmt(timings: Mapping[str, float]) -> str:
    return ", ".join(f"{k}={v * 1000:.0f}ms" for k, v in timings.items())
