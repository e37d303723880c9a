"""Loading one model version: artifact → gates → pipelines → warmup, each a named step.

The steps run in the order docs/architecture.md gives; each passes or raises ModelLoadError
naming the refusal, which leaves the version UNAVAILABLE with that reason:

1. ``_check_pins``: the manifest's library versions are ones this server can run;
2. ``_open_runtimes``: the artifact opens on each instance's device (eval mode, no autograd);
3. ``_check_artifact``: the preprocessing in config.yaml hashes to the manifest's, and the
   golden inputs replay to the exported outputs, on every device;
4. ``pipeline_for``: the pipeline fits the model's inputs; postprocessing fits its outputs;
5. ``_warm_up``: every batch size × shape bucket has run, on every device.
6. ``_check_repeatable``: two runs of one batch answer the same (no dropout left live).
"""

from __future__ import annotations

import itertools
import logging
import math
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from functools import cached_property, partial
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

from preprocessing.pipeline import Item, Models, Pipeline, answer_one, overrides
from preprocessing.spec import PythonSpec
from service.artifacts.code import (
    AnswerPair,
    CodeFacts,
    check_answers,
    check_code,
    code_facts,
    read_answer_pairs,
)
from service.artifacts.manifest import (
    Golden,
    Manifest,
    Tolerance,
    check_golden,
    check_preprocessing,
    check_versions,
    read_golden,
    read_manifest,
    unfinished_export,
)
from service.artifacts.shapes import ShapePolicy
from service.batching.codepool import CodePool
from service.batching.scheduler import BatchShape, batch_shape
from service.datatypes import LARGEST, TO_NUMPY, as_values
from service.errors import (
    LoadStopped,
    ModelLoadError,
    ModelNotReady,
    StepNotReady,
    TensorgateError,
)
from service.model_config import ModelConfig, TensorConfig
from service.pipelines.classification import ANSWER, CLASSIFICATION, Classifier
from service.pipelines.inputs import bounded_signature, check_names, pipeline_for
from service.resources import CPU_USE
from service.runtimes import (
    create_runtime,
    cuda_device_count,
    instance_devices,
    resolve_device,
    runtime_versions,
)
from service.runtimes.base import Runtime, RuntimeOptions, Signature
from service.runtimes.pt2_probe import outputs_in_child
from service.settings import Settings

log = logging.getLogger("tensorgate.loader")
T = TypeVar("T")
Runner = Callable[[dict[str, np.ndarray]], dict[str, np.ndarray]]

SKIPPED_WITHOUT_MANIFEST = (
    "version gate skipped: no manifest.json",
    "golden replay skipped: no manifest.json",
    "preprocessing hash check skipped: no manifest.json",
)


_LOADS = itertools.count(1)


@dataclass(frozen=True)
class Step:
    """A model a pipeline's code called in its load's end-to-end replay."""

    model: str
    asked: str | None
    """The version the code asked for (None: whichever serves)."""
    serial: int | None
    """:attr:`LoadedVersion.serial` of what served the call (None: not known)."""


@dataclass(frozen=True, eq=False)
class LoadedVersion:
    """What loading a version made and found; it never changes once built (how it is served
    is :class:`service.repository.serving.ServedVersion`'s)."""

    name: str
    config: ModelConfig
    runtimes: tuple[Runtime, ...]
    """One per instance on CUDA (each its own device, stream and graphs); one shared by every
    instance on the CPU, where a session or module runs concurrent calls safely."""
    signature: Signature
    """As clients may fill it (value ranges included)."""
    devices: tuple[str, ...]
    """Each instance's device."""
    pipeline: Pipeline | None
    classifier: Classifier | None
    manifest: Manifest | None
    warnings: tuple[str, ...]
    timings: Mapping[str, float]
    warmup_timings: Mapping[str, float]
    warmed: frozenset[BatchShape]
    """The batch shapes warmup ran; a batch of any other shape counts as unwarmed."""
    shapes: ShapePolicy
    """How requests' dynamic dims are bounded, padded to the warmed buckets, and cropped back."""
    golden: Golden | None
    """The exported golden pairs, replayed after a request fails alone to tell whose fault it
    was (None without a manifest)."""
    tolerance: Tolerance
    steps: tuple[Step, ...] = ()
    """The other models its code called in the load's end-to-end replay: while one of them
    cannot serve, or serves other than what the replay ran through, neither can this version."""
    serial: int = field(default_factory=lambda: next(_LOADS))
    """This load's number in the process: a step's identity as a pipeline's replay met it (a
    reload of the step, even at the same version number, is another)."""
    _code_pool: list[CodePool] = field(default_factory=list, repr=False)

    def code_pool(self, threads: int) -> CodePool:
        """The threads this version's own code (its pre- and postprocessing) runs on, made at
        its first request: its own, so that code that hangs or crawls holds only its own
        model's requests. In the pool every model shares, three requests to code sleeping 15 s
        (each answered 504 at its deadline) held a plain model's preprocessing for 13 s."""
        if not self._code_pool:
            self._code_pool.append(CodePool(threads, f"{self.name}-code"))
        return self._code_pool[0]

    def replay_golden(self, runtime_run: Runner) -> str | None:
        """None when ``runtime_run`` still answers the golden inputs as exported, else why not
        (only for a version that has them: without, there is no evidence either way)."""
        assert self.golden is not None, "a version without golden pairs has nothing to replay"
        try:
            check_golden(self.golden, runtime_run, self.tolerance)
        except ModelLoadError as exc:
            return str(exc)
        except Exception as exc:  # the runtime's own failure on inputs that ran at export
            return f"golden replay failed: {type(exc).__name__}: {exc}"
        return None

    @property
    def device(self) -> str:
        """The instances' devices, as one string (``cuda:0,cuda:1`` when spread)."""
        return ",".join(dict.fromkeys(self.devices))

    @property
    def verified(self) -> bool:
        """True when every manifest gate ran and passed."""
        return self.manifest is not None

    @property
    def batched(self) -> bool:
        return self.config.max_batch_size > 0

    def public_inputs(self) -> list[TensorConfig]:
        """Inputs as clients see them: the model's, plus its pipeline's raw BYTES input."""
        inputs = list(self.signature.inputs)
        if self.pipeline is not None:
            inputs.append(TensorConfig(name=self.pipeline.raw_input, datatype="BYTES", shape=()))
        return inputs

    @cached_property
    def answers(self) -> bool:
        """Whether its own code postprocesses: answers, the ``answer`` output."""
        return self.pipeline is not None and overrides(self.pipeline, "postprocess")

    @cached_property
    def output_datatypes(self) -> dict[str, str]:
        """Each public output's name and datatype (asked of every request)."""
        return {t.name: t.datatype for t in self.public_outputs()}

    def public_outputs(self) -> list[TensorConfig]:
        """Outputs as clients see them: the model's, plus top-k classification strings, plus
        the answers of a pipeline whose code postprocesses (JSON texts)."""
        outputs = list(self.signature.outputs)
        if self.answers:
            outputs.append(TensorConfig(name=ANSWER, datatype="BYTES", shape=()))
        if self.classifier is not None:
            outputs.append(
                TensorConfig(name=CLASSIFICATION, datatype="BYTES", shape=(self.classifier.top_k,))
            )
        return outputs

    def close(self) -> None:
        for runtime in self.runtimes:
            runtime.close()
        for pool in self._code_pool:
            pool.shutdown()


class LoadBound:
    """When one version's load must end, checked before and at each warmup batch: the server
    stopping, an unload of the model asked meanwhile, or ``TG_LOAD_TIMEOUT_S`` gone by."""

    def __init__(self, stopping: threading.Event, timeout_s: float) -> None:
        self._stopping = stopping
        self._timeout_s = timeout_s
        self._deadline = time.monotonic() + timeout_s
        self._cancelled: str | None = None

    def cancel(self, why: str) -> None:
        self._cancelled = why

    def run(self, fn: Callable[[], T], what: str) -> T:
        """``fn()``, a model's own code (its ``warm()``, the end-to-end replay), on a thread of
        its own, waited for only while the load may go on. Python cannot stop a thread: one
        that hangs is left behind (a daemon, so that it holds no exit) and the load is refused
        at its time, at an unload or at SIGTERM; a ``warm()`` that slept 40 s held a load past
        a 5 s TG_LOAD_TIMEOUT_S, and the model's unload, for all of it."""
        done: Future[T] = Future()

        def work() -> None:
            try:
                done.set_result(fn())
            except BaseException as exc:  # SystemExit too: the load's, as when run in place
                done.set_exception(exc)

        threading.Thread(target=work, name=f"load-{what}", daemon=True).start()
        while True:
            try:
                return done.result(timeout=0.1)
            except FutureTimeout:
                try:
                    self.check()
                except ModelLoadError as exc:
                    raise type(exc)(f"{exc} (it stopped in {what}, which goes on)") from None

    def check(self) -> None:
        if self._stopping.is_set():
            raise LoadStopped("loading stopped: the server is shutting down")
        if self._cancelled is not None:
            raise LoadStopped(f"loading stopped: {self._cancelled}")
        if time.monotonic() > self._deadline:
            raise ModelLoadError(
                f"loading stopped: it took longer than TG_LOAD_TIMEOUT_S ({self._timeout_s:g} s);"
                " warm fewer batch sizes or shapes (warmup.batch_sizes, shape buckets), or raise"
                " TG_LOAD_TIMEOUT_S"
            )


def load_version(
    name: str,
    path: Path,
    config: ModelConfig,
    settings: Settings,
    models: Models | None = None,
    bound: LoadBound | None = None,
) -> LoadedVersion:
    """Load ``path`` (a version folder) under ``config``; ModelLoadError names any refusal.
    ``bound`` ends it early (the server stopping, the model unloaded, its time up)."""
    started = time.perf_counter()
    if (aside := unfinished_export(path)) is not None:
        raise ModelLoadError(
            f"version {path.name} is being exported, or its export never finished (it keeps the "
            f"files it replaces in {aside.name} beside it until it ends): its folder may be half "
            f"written; export it again (an export that finishes removes {aside.name})"
        )
    manifest = read_manifest(path)
    warnings = _check_pins(name, config, manifest)
    runtimes, signature, devices = _open_runtimes(name, path, config, manifest, settings, warnings)
    try:
        return _gate_and_warm(
            name,
            path,
            config,
            models,
            bound,
            manifest,
            warnings,
            runtimes,
            signature,
            devices,
            started,
        )
    except BaseException:
        for runtime in runtimes:  # now, not at the next garbage collection
            runtime.close()
        raise


def _gate_and_warm(
    name: str,
    path: Path,
    config: ModelConfig,
    models: Models | None,
    bound: LoadBound | None,
    manifest: Manifest | None,
    warnings: list[str],
    runtimes: list[Runtime],
    signature: Signature,
    devices: list[str],
    started: float,
) -> LoadedVersion:
    loaded_at = time.perf_counter()
    golden, tolerance = _check_artifact(path, config, manifest, runtimes, warnings)
    shapes = ShapePolicy.of(config, signature.inputs, manifest.shapes if manifest else None)
    warnings.extend(_unwarmed_dims(config, signature, shapes))
    if shapes.axes and shapes.buckets and not shapes.check_agreement:  # no facts: on trust
        said = (
            "dynamic dims padded up to their buckets unverified, and outputs not cropped back "
            "to the request's size: no manifest.json (export with `tensorgate export` to "
            "measure whether padding leaves the answer unchanged)"
        )
        log.warning("model %s: %s", name, said)
        warnings.append(said)
    _check_code(config, path, manifest, warnings)
    pipeline = pipeline_for(config, signature, path, name)
    check_names(pipeline, signature.inputs, signature.outputs, config.postprocessing is not None)
    if pipeline is not None and models is not None and isinstance(config.preprocessing, PythonSpec):
        pipeline.models = models  # before the replay: its steps may call other models
    called: set[Step] = set()
    if pipeline is not None:
        signature = bounded_signature(pipeline, signature)
        _bounded(bound, pipeline.warm, "the pipeline's warm()")
        if manifest is not None and manifest.answers:
            served_models = pipeline.models
            if models is not None and served_models is models:
                pipeline.models = _Recording(models, called, name)
            try:
                replay = partial(
                    _replay_answers, pipeline, path, manifest, runtimes, config, tolerance
                )
                _bounded(bound, replay, "the end-to-end replay of its code")
            finally:
                pipeline.models = served_models
    classifier = (
        Classifier(config.postprocessing, path.parent, signature.outputs)
        if config.postprocessing is not None
        else None
    )
    gated_at = time.perf_counter()
    if bound is not None:
        bound.check()
    if config.backend == "pt2" and manifest is None:
        _probe_unchecked_pt2(path, signature, config, shapes, devices[0], bound)
    warmup_timings, warmed = _warm_up(runtimes[0], signature, config, shapes, bound)
    if not config.stochastic:
        _check_repeatable(runtimes[0], signature, config, shapes)
    for runtime in runtimes[1:]:  # each device compiles (and captures) its own shapes
        _warm_up(runtime, signature, config, shapes, bound)
    done = time.perf_counter()
    timings = {
        "load_s": loaded_at - started,
        "gates_s": gated_at - loaded_at,
        "warmup_s": done - gated_at,
        "total_s": done - started,
    }
    log.info(
        "model %s loaded from %s on %s: %s",
        name,
        path,
        ",".join(dict.fromkeys(devices)),
        _fmt(timings),
    )
    return LoadedVersion(
        name,
        config,
        tuple(runtimes),
        signature,
        tuple(devices),
        pipeline,
        classifier,
        manifest,
        tuple(warnings),
        timings,
        warmup_timings,
        frozenset(warmed),
        shapes,
        golden,
        tolerance,
        tuple(sorted(called, key=lambda step: (step.model, str(step.asked)))),
    )


def _bounded(bound: LoadBound | None, fn: Callable[[], T], what: str) -> T:
    return fn() if bound is None else bound.run(fn, what)


class _Recording:
    """``models`` that notes which model (and version) each call asks for: the steps a
    pipeline's replay reaches."""

    def __init__(self, models: Models, called: set[Step], own: str) -> None:
        self.models, self.called, self.own = models, called, own

    def infer(
        self, model: str, inputs: Mapping[str, np.ndarray], version: str | None = None
    ) -> dict[str, np.ndarray]:
        if model == self.own:  # it could never load: "unknown model" said nothing of why
            raise ModelLoadError(
                f"its pipeline calls its own model '{model}' as a step: a model's code runs "
                "around its own network; a network it calls is a model of its own (export it "
                "apart and call it by that name)"
            )
        # as the step will be looked up: an int was kept as it came, and the version lookups of
        # readiness, metadata, the index and /metrics took it for a string (500s)
        asked = None if version is None else str(version)
        serial_of = getattr(self.models, "serial_of", None)  # the server's steps say
        self.called.add(Step(model, asked, serial_of(model, asked) if serial_of else None))
        return self.models.infer(model, inputs, version)


def _check_pins(name: str, config: ModelConfig, manifest: Manifest | None) -> list[str]:
    """Step 1: a manifest's torch / onnx / onnxruntime versions are ones this server runs.
    Without a manifest the gates that need one are skipped, each named in a warning."""
    if manifest is None:
        for warning in SKIPPED_WITHOUT_MANIFEST:
            log.warning("model %s: %s (export with `tensorgate export` to verify)", name, warning)
        return list(SKIPPED_WITHOUT_MANIFEST)
    check_versions(manifest, config.backend, runtime_versions(config.backend))
    return []


def _open_runtimes(
    name: str,
    path: Path,
    config: ModelConfig,
    manifest: Manifest | None,
    settings: Settings,
    warnings: list[str],
) -> tuple[list[Runtime], Signature, list[str]]:
    """Step 2: one runtime per device the instances use, each with the artifact open."""
    device = resolve_device(config.device, config.backend)
    devices = instance_devices(device, config.instances, cuda_device_count)
    if config.gpu.cuda_graphs and not device.startswith("cuda"):
        warnings.append("gpu.cuda_graphs ignored: the model runs on the CPU")
    if config.precision != "fp32" and manifest is not None and config.tolerance_override is None:
        raise ModelLoadError(
            f"precision {config.precision} changes the outputs the golden file holds (made in "
            "fp32): set tolerance_override (e.g. 0.05) to widen the golden tolerance explicitly"
        )
    runtimes = [
        create_runtime(
            config.backend,
            RuntimeOptions(
                instance_device,
                settings.intra_op_threads,
                config.precision,
                config.gpu,
                path,
                settings.shared_threads,
                bool(config.shape_buckets()),
            ),
        )
        for instance_device in (devices if device.startswith("cuda") else devices[:1])
    ]
    artifact = path / runtimes[0].artifact
    if not artifact.is_file():
        raise ModelLoadError(f"{artifact} is missing; run `make models` or export the model")
    declared = _declared(config, manifest, warnings)
    signature = runtimes[0].load(artifact, declared, config.max_batch_size)
    for runtime in runtimes[1:]:
        runtime.load(artifact, declared, config.max_batch_size)
    return runtimes, signature, devices


def _check_artifact(
    path: Path,
    config: ModelConfig,
    manifest: Manifest | None,
    runtimes: list[Runtime],
    warnings: list[str],
) -> tuple[Golden | None, Tolerance]:
    """Step 3: the served preprocessing is the exported one, and every device answers the
    golden inputs as the exporter's eager PyTorch did."""
    if manifest is None:
        return None, Tolerance()
    check_preprocessing(config, manifest)
    tolerance = manifest.tolerance
    if config.tolerance_override is not None:
        tolerance = Tolerance(atol=config.tolerance_override, rtol=tolerance.rtol)
        warnings.append(f"golden tolerance widened by config to atol={tolerance.atol:g}")
    golden = read_golden(path)
    for runtime in runtimes:
        check_golden(golden, runtime.run, tolerance)
    return golden, tolerance


def _check_code(
    config: ModelConfig, path: Path, manifest: Manifest | None, warnings: list[str]
) -> None:
    """Step 3b, before any of a model's own code runs: its sources and the versions of the
    distributions they import are the exported ones."""
    spec = config.preprocessing
    if not isinstance(spec, PythonSpec):
        return
    if manifest is None:
        warnings.append("preprocessing code hash check skipped: no manifest.json")
        return
    if manifest.code is None:
        raise ModelLoadError(
            "preprocessing is code (kind: python) but manifest.json records no hash of it: "
            "export the model with `tensorgate export` (or export_model) and this spec"
        )
    check_code(CodeFacts.from_json(manifest.code), code_facts(spec, path.parent))


def _replay_answers(
    pipeline: Pipeline,
    path: Path,
    manifest: Manifest,
    runtimes: list[Runtime],
    config: ModelConfig,
    tolerance: Tolerance,
) -> None:
    """Step 4b: the exported raw items answer, through the served pipeline and every
    device's runtime, as the eager pipeline answered them at export."""
    pairs = read_answer_pairs(manifest.answers)
    items: dict[str, Item] = {}
    for pair in pairs:
        try:
            items[pair.file] = Item((path / pair.file).read_bytes(), pair.content_type)
        except OSError as exc:
            raise ModelLoadError(
                f"end-to-end golden replay: {pair.file}, an item its export answered (listed in "
                f"manifest.json), cannot be read ({exc.strerror}): export the version again"
            ) from None
    for runtime in runtimes:

        def answer(pair: AnswerPair, run: Runner = runtime.run) -> Any:
            return answer_one(pipeline, items[pair.file], run, config.max_batch_size > 0)

        try:
            check_answers(pairs, answer, tolerance.rtol, tolerance.atol)
        except ModelNotReady as exc:  # a step model not loaded yet: the repository retries
            raise StepNotReady(f"end-to-end golden replay: {exc.message}") from None
        except TensorgateError as exc:
            raise ModelLoadError(f"end-to-end golden replay: {exc.message}") from None


def _declared(
    config: ModelConfig, manifest: Manifest | None, warnings: list[str]
) -> Signature | None:
    declared: Signature | None = None
    if config.inputs is not None and config.outputs is not None:
        inputs = config.inputs
        if manifest is not None:
            inputs = _within_exported_ranges(inputs, manifest.inputs, warnings)
        declared = Signature(inputs, config.outputs)
    elif manifest is not None:
        declared = Signature(manifest.inputs, manifest.outputs)
    why = manifest.non_finite.get(config.backend) if manifest is not None else None
    if declared is not None and why:
        declared = Signature(_finite_only(declared.inputs, why, warnings), declared.outputs)
    return declared


def _finite_only(
    inputs: tuple[TensorConfig, ...], why: str, warnings: list[str]
) -> tuple[TensorConfig, ...]:
    """Each float input without a range given its type's finite range: the artifact served
    answers a NaN or an infinity unlike eager PyTorch (``why``, measured at export: a compiled
    ReLU of a model.pt2 turned NaN into a plausible score), so a request with one is a 400
    rather than an answer eager PyTorch would not give."""
    kept, limited = [], []
    for t in inputs:
        if t.range is None and t.datatype in LARGEST:
            t = t.model_copy(update={"range": (-LARGEST[t.datatype], LARGEST[t.datatype])})
            limited.append(t.name)
        kept.append(t)
    if limited:
        warnings.append(
            f"the artifact answers non-finite inputs unlike eager PyTorch ({why}): inputs "
            f"{limited} take finite values only (a NaN or an infinity is a 400)"
        )
    return tuple(kept)


def _within_exported_ranges(
    inputs: tuple[TensorConfig, ...], exported: tuple[TensorConfig, ...], warnings: list[str]
) -> tuple[TensorConfig, ...]:
    """``config.yaml``'s inputs, each kept within the range its export recorded (the ids an
    embedding has rows for, or what the exporter was told and checked): a config may narrow a
    range, never drop or widen it, for outside it the model answers wrongly or fails (ONNX
    Runtime takes id -1 for an embedding's last row). Each input served with a range other
    than the config's is a warning; one with no value left in both is refused."""
    recorded = {t.name: t.range for t in exported if t.range is not None}
    kept = []
    for t in inputs:
        proven = recorded.get(t.name)
        given = t.range
        if proven is None or (given is not None and proven[0] <= given[0] <= given[1] <= proven[1]):
            kept.append(t)
            continue
        served = proven if given is None else (max(given[0], proven[0]), min(given[1], proven[1]))
        if served[0] > served[1]:
            raise ModelLoadError(
                f"input '{t.name}': config.yaml's range {_listed(given)} has no value within "
                f"{_listed(proven)}, the range its export recorded (the values the model answers)"
            )
        said = "drops" if given is None else f"widens to {_listed(given)}"
        warnings.append(
            f"input '{t.name}': config.yaml {said} the range its export recorded, "
            f"{_listed(proven)}; served with {_listed(served)} (outside it the model answers "
            "wrongly or fails): a request outside it is a 400"
        )
        kept.append(t.model_copy(update={"range": served}))
    return tuple(kept)


def _listed(bounds: tuple[float, float] | None) -> str:
    return "none" if bounds is None else f"[{bounds[0]:g}, {bounds[1]:g}]"


def _unwarmed_dims(config: ModelConfig, signature: Signature, shapes: ShapePolicy) -> list[str]:
    """What a version with dynamic dims and no buckets will run cold: its warmup cannot know
    the sizes requests bring (a bring-your-own ONNX model's dynamic leading dim, served with
    ``max_batch_size`` 0, is such a dim, not a batch)."""
    if not shapes.axes or shapes.buckets:
        return []
    dynamic = sorted({f"'{name}' dim {index}" for axis in shapes.axes for name, index in axis.dims})
    said = (
        f"dynamic dims without buckets ({', '.join(dynamic)}): requests run at sizes warmup "
        "never ran (counted in tensorgate_unwarmed_shape_requests_total) and unbounded; set "
        "buckets in config.yaml"
    )
    leading = [t.name for t in signature.inputs if t.shape and t.shape[0] == -1]
    if config.max_batch_size == 0 and leading:
        said += (
            f", or max_batch_size if the first dim of {leading} is a batch (it is served as "
            "one request's dim, never batched)"
        )
    return [said]


def _warm_up(
    runtime: Runtime,
    signature: Signature,
    config: ModelConfig,
    shapes: ShapePolicy,
    bound: LoadBound | None = None,
) -> tuple[dict[str, float], set[BatchShape]]:
    """Step 5: run every batch size × combination of the axes' buckets; return the timings
    and the shapes now warm. Once ``bound`` says stop (the server stopping, the model
    unloaded, the load's time up), the load ends at the next batch, refused, instead of
    holding the process for the rest of its warmup."""
    timings: dict[str, float] = {}
    warmed: set[BatchShape] = set()
    for size, lengths, batch in _warm_batches(signature, config, shapes):
        if bound is not None:
            bound.check()
        started = time.perf_counter()
        try:
            with CPU_USE:  # as a batch: two workers warming at once keep to their shares
                runtime.warmup(batch)
        except Exception as exc:
            where = f"batch size {size}" + (f", dims {lengths}" if lengths else "")
            raise ModelLoadError(f"warmup at {where} failed: {exc}") from exc
        label = f"batch_{size}" + "".join(f"_len_{n}" for n in lengths)
        timings[label] = time.perf_counter() - started
        warmed.add(batch_shape(batch))
        log.debug("warmed %s in %.1f ms", label, timings[label] * 1000)
    return timings, warmed


def _warm_batches(
    signature: Signature, config: ModelConfig, shapes: ShapePolicy
) -> Iterator[tuple[int, list[int], dict[str, np.ndarray]]]:
    """Each warmup batch (of zeros): its batch size, its dynamic dims' sizes, its inputs."""
    batched = config.max_batch_size > 0
    offset = 1 if batched else 0
    for size in config.warmup_batch_sizes() if batched else (0,):
        for dims in shapes.warm_sizes():
            batch = {
                t.name: _zeros(_warm_shape(t, size, dims, offset), t) for t in signature.inputs
            }
            yield size, [dims[a.dims[0]] for a in shapes.axes if a.dims[0] in dims], batch


def _probe_unchecked_pt2(
    path: Path,
    signature: Signature,
    config: ModelConfig,
    shapes: ShapePolicy,
    device: str,
    bound: LoadBound | None = None,
) -> None:
    """Run a ``model.pt2`` no export checked (no manifest) at each warmup batch and at the
    repeatability check's, in a child process first: a compiled package can abort the process
    that runs it (:mod:`service.runtimes.pt2_probe`), which here would be every model's. One
    that `tensorgate export` made needs its integer inputs' ranges declared (its manifest held
    them)."""
    from service.runtimes.pt2 import refuse_unranged_copy

    refuse_unranged_copy(path / "model.pt2", signature)
    batches = [batch for _, _, batch in _warm_batches(signature, config, shapes)]
    batches.append(_repeatable_batch(signature, config, shapes, _ones))
    check = bound.check if bound is not None else None  # the child ends with the load
    outputs_in_child(path / "model.pt2", batches, signature, device, check=check)


def _check_repeatable(
    runtime: Runtime, signature: Signature, config: ModelConfig, shapes: ShapePolicy
) -> None:
    """Refuse a model that answers one batch twice differently: it draws random numbers as it
    runs, which a served model does only when it was exported in ``train()`` mode (the ONNX
    exporter of torch 2.13 keeps a ``Dropout`` live in a module left in ``train()``, and a
    ``torch.jit.trace`` fixes ``scaled_dot_product_attention``'s dropout in its graph). The
    golden replay catches that too, but only with a manifest: a bring-your-own artifact has
    none. The batch is the first warmed shape, of ones (:func:`_ones`: so that no dropout meets
    only zeros), run :data:`AGAIN` more times; a model that samples on purpose sets
    ``stochastic``."""
    with CPU_USE:
        try:
            batch = _repeatable_batch(signature, config, shapes, _ones)
            first = runtime.run(batch)
        except Exception:  # ones are no input of it (an index into one row): warmup's zeros
            batch = _repeatable_batch(signature, config, shapes, _zeros)
            first = runtime.run(batch)
        again = [runtime.run(batch) for _ in range(AGAIN)]
    bf16 = {t.name for t in signature.outputs if t.datatype == "BF16"}  # held as uint16 words
    for name, answer in first.items():
        values = partial(as_values, datatype="BF16") if name in bf16 else np.asarray
        apart = next(
            filter(None, (_apart(values(answer), values(other[name])) for other in again)), None
        )
        if apart is None:
            continue
        raise ModelLoadError(
            f"two runs of the same batch answered differently (output '{name}': {apart}): the "
            "model draws random numbers as it runs, most likely a dropout exported in train() "
            "mode (torch.onnx.export and torch.export keep a module's dropouts live unless "
            "model.eval() was called first, as `tensorgate export` does). Export it again after "
            "model.eval(); a model that samples on purpose: set stochastic: true in config.yaml"
        )


AGAIN = 3
"""Runs compared with the first: a dropout over a small output can draw the same mask twice
(1 in 16 for 4 values at p = 0.5), not four times (1 in 4,096)."""


def _repeatable_batch(
    signature: Signature,
    config: ModelConfig,
    shapes: ShapePolicy,
    fill: Callable[[tuple[int, ...], TensorConfig], np.ndarray],
) -> dict[str, np.ndarray]:
    """The repeatability check's batch: the first warmed shape, each input made by ``fill``."""
    batched = config.max_batch_size > 0
    size = config.warmup_batch_sizes()[0] if batched else 0
    dims = shapes.warm_sizes()[0]
    return {
        t.name: fill(_warm_shape(t, size, dims, 1 if batched else 0), t) for t in signature.inputs
    }


def _apart(first: np.ndarray, second: np.ndarray) -> str | None:
    """How two runs' values of one output differ, or None when they agree (floating point:
    each value within 1e-4 + 1e-3 × its own magnitude, what two runs of one graph on other
    threads may differ by, NaN and infinities where both have them; anything else: exactly)."""
    if first.shape != second.shape:
        return f"shape {list(first.shape)}, then {list(second.shape)}"
    if first.dtype.kind != "f":
        return None if np.array_equal(first, second) else "values differ"
    a, b = first.astype(np.float64), second.astype(np.float64)
    nan_a, nan_b = np.isnan(a), np.isnan(b)
    if not np.array_equal(nan_a, nan_b):
        return "NaN in one run only"
    differ = (a != b) & ~nan_a  # an infinity equals itself; one against a number is apart
    if not differ.any():
        return None
    gaps = np.abs(a[differ] - b[differ])
    # each value by its own magnitude (a mask's -1e9 beside it does not widen what the others
    # may differ by); an infinity against a number is apart however large
    past = (gaps > 1e-4 + 1e-3 * np.abs(a[differ])) | np.isinf(gaps)
    if not past.any():
        return None
    worst = int(np.argmax(np.where(past, gaps, -1.0)))
    return f"{a[differ][worst]:.6g}, then {b[differ][worst]:.6g} ({int(past.sum())} values apart)"


def _ones(shape: tuple[int, ...], tensor: TensorConfig) -> np.ndarray:
    """Ones, or where an input's range has no 1, a value three quarters into it (rounded up for
    an integer type): never all zeros, which a dropout passes unchanged, where it can help it
    (the middle of a symmetric range is 0, and of [0, 1] for an integer mask, 0 too)."""
    if tensor.datatype == "BYTES":
        return np.full(shape, b"", dtype=object)
    dtype = TO_NUMPY[tensor.datatype]
    value = 1.0
    if tensor.range is not None and not tensor.range[0] <= 1.0 <= tensor.range[1]:
        low, high = tensor.range
        value = low + 0.75 * (high - low)
        if dtype.kind in "iu":
            value = min(float(math.ceil(value)), high)
    return np.full(shape, value).astype(dtype)


def _warm_shape(
    tensor: TensorConfig, size: int, dims: Mapping[tuple[str, int], int], offset: int
) -> tuple[int, ...]:
    """The full shape of one warmup input: ``size`` rows (none when 0), each dynamic dim at
    its axis's size (1 for a dim no bucket bounds)."""
    inner = (
        dims.get((tensor.name, i + offset), 1) if d == -1 else d for i, d in enumerate(tensor.shape)
    )
    return ((size,) if size else ()) + tuple(inner)


def _zeros(shape: tuple[int, ...], tensor: TensorConfig) -> np.ndarray:
    if tensor.datatype == "BYTES":
        return np.full(shape, b"", dtype=object)
    return np.zeros(shape, dtype=TO_NUMPY[tensor.datatype])


def _fmt(timings: Mapping[str, float]) -> str:
    return ", ".join(f"{k}={v * 1000:.0f}ms" for k, v in timings.items())
