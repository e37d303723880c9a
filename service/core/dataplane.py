"""DataPlane: the protocol-agnostic core. Health, readiness, inference, repository changes.

Every protocol front end (v1 and v2 REST in ``service/http``, gRPC in ``service/grpc``) decodes
its request into an :class:`~service.inference.InferenceRequest`, calls :meth:`DataPlane.infer`
with its own encoder, and sends what the encoder made. Nothing here knows a wire format. A
request refused while the server drains is answered 503 by the observer before any lookup, and
is neither counted in a model's statistics nor logged (it never reached one).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import numpy as np

from service.artifacts.shapes import apply_crop
from service.batching.scheduler import rows_of
from service.core.validation import (
    check_inputs,
    check_rows,
    encoded_items,
    instance_tensors,
)
from service.errors import InvalidInput, PayloadTooLarge, UnsupportedMediaType
from service.inference import InferenceRequest, InferenceResult, OutputTensor, RequestedOutput
from service.pipelines.classification import CLASSIFICATION, classification_tensor
from service.pipelines.inputs import Prepared
from service.repository.loader import LoadedVersion
from service.repository.models import ModelRepository, ModelState
from service.settings import Settings
from service.telemetry.observation import Drain, Observer

T = TypeVar("T")

OFFLOAD_BYTES = 32 * 1024
"""Work through this many bytes (or more) moves to the thread pool; below it the hop costs more.
Callers pass the bytes the work goes through, not the body's size (a raw image's decode into a
request goes through none)."""
PREPROCESS_MAX_ROWS = 32
"""Rows one ``preprocess`` request may ask for: its answer is the model's input tensors (each
row of an ImageNet model is 600 kB, whatever the image's size)."""


class DataPlane:
    """The core every protocol calls."""

    def __init__(
        self,
        repository: ModelRepository,
        settings: Settings,
        pool: ThreadPoolExecutor,
        observer: Observer,
        drain: Drain,
    ) -> None:
        self.repository = repository
        self.settings = settings
        self.pool = pool
        self.observer = observer
        self.drain = drain

    async def offload(self, size: int, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)``, in the thread pool when ``size`` (the bytes it works on) is large."""
        if size < OFFLOAD_BYTES:
            return fn(*args)
        return await asyncio.get_running_loop().run_in_executor(self.pool, fn, *args)

    # -- health ---------------------------------------------------------------------------------

    def live(self) -> tuple[bool, str]:
        """False only when an instance has been stuck on one batch past the limit: busy is fine."""
        limit = self.settings.stuck_instance_s
        for version, served in self.repository.served_versions():
            longest = served.scheduler.longest_running() if served.scheduler else None
            if longest is not None and longest[1] > limit:
                return False, (
                    f"model '{version.name}' version {version.version} instance {longest[0]} "
                    f"has run one batch for {longest[1]:.0f} s (limit {limit:g} s)"
                )
        return True, ""

    def started(self) -> tuple[bool, str]:
        """Whether loading has finished, whatever its outcome: a model refused by a gate leaves
        a started, not-ready server (a stable NotReady pod that says why), not a restart loop."""
        if self.repository.loading_done.is_set():
            return True, ""
        return False, "models are loading"

    def ready(self) -> tuple[bool, str]:
        """Whether the server takes traffic, and if not, why."""
        repository = self.repository
        if self.drain.draining:
            return False, "draining: the server is shutting down"
        if not repository.loading_done.is_set():
            return False, "models are loading"
        if repository.all_ready():
            return True, ""
        if not self.settings.strict_readiness and repository.any_ready():
            return True, ""
        return False, f"models not ready: {repository.problems()}"

    def model_ready(self, name: str, version: str | None) -> bool:
        return self.repository.version(name, version).state is ModelState.READY

    # -- inference --------------------------------------------------------------------------------

    async def infer(
        self,
        model: str,
        version: str | None,
        protocol: str,
        decode: Callable[[], Awaitable[InferenceRequest]],
        encode: Callable[[InferenceResult], T],
    ) -> T:
        """Look ``model`` up (404 / 503 first, before any work), ``decode`` the request, run
        it, and ``encode`` the result (timed as postprocessing). Every outcome, a decoding
        error included, is counted, timed and logged once."""
        with self.observer.observe(protocol, model, version) as observation:
            found, served = self.repository.ready_model(model, version)
            observation.version, observation.served = str(found.version), served
            timing = observation.timing
            with served.use():
                request = await decode()
                loaded = served.loaded
                _check_outputs(loaded, request.outputs)
                prepared = await self._prepare(loaded, request, alone=served.in_flight == 1)
                deadline = self.deadline(request.timeout_s, request.parameters)
                if isinstance(prepared.work, dict):
                    observation.rows = rows_of(prepared.work, loaded.batched)
                    timing.compute_input_ns = time.perf_counter_ns() - timing.started_ns
                else:
                    observation.rows = 1  # made on the instance's thread, which times it
                outputs = await served.execute(prepared.work, timing, deadline)
                if prepared.crop:
                    outputs = apply_crop(outputs, prepared.crop)
                encode_started = time.perf_counter_ns()
                result = InferenceResult(
                    model, str(found.version), request.id,
                    _outputs(loaded, request.outputs, outputs),
                    outputs, {**request.parameters, **prepared.parameters}, loaded.classifier,
                    loaded.batched,
                )  # fmt: skip
                encoded = encode(result)
                timing.compute_output_ns = time.perf_counter_ns() - encode_started
                return encoded

    async def preprocess(
        self, model: str, decode: Callable[[], Awaitable[InferenceRequest]]
    ) -> dict[str, np.ndarray]:
        """What ``infer`` would feed the model for the request: the tensors, not the answer."""
        _, served = self.repository.ready_model(model)
        with served.use():
            request = await decode()
            rows = len(request.raw or request.rows or [])
            if rows > PREPROCESS_MAX_ROWS:
                raise PayloadTooLarge(
                    f"{rows} instances; :preprocess answers at most {PREPROCESS_MAX_ROWS} (its "
                    "answer is the model's input tensors, far larger than the request)"
                )
            work = (await self._prepare(served.loaded, request, alone=False)).work
            return work if isinstance(work, dict) else await self.offload(OFFLOAD_BYTES, work)

    async def _prepare(
        self, model: LoadedVersion, request: InferenceRequest, alone: bool
    ) -> Prepared:
        """The request's inputs as the model's batch: raw items through its pipeline, tensors
        (or rows) checked against its signature and padded to its buckets."""
        raw, pipeline = request.raw, model.pipeline
        if raw is None and pipeline is not None:
            named = [t for t in request.inputs if t.name == pipeline.raw_input]
            if named and len(request.inputs) != 1:
                raise InvalidInput(
                    f"input '{pipeline.raw_input}' feeds the model's preprocessing: send it "
                    f"alone, not with {[t.name for t in request.inputs if t is not named[0]]}"
                )
            raw = encoded_items(named[0], model.name) if named else None
        if raw is not None:
            if pipeline is None:
                raise UnsupportedMediaType(
                    f"model '{model.name}' has no preprocessing; send tensors to "
                    f'/v2/models/{model.name}/infer or {{"instances": [...]}} rows'
                )
            check_rows(len(raw), model.config, model.name)
            return await pipeline.prepare(raw, self.pool, alone)
        inputs = request.inputs
        if request.rows is not None:
            inputs = instance_tensors(request.rows, model.signature.inputs)
        batch = check_inputs(inputs, model.signature, model.config, model.name)
        if not model.shapes.axes:  # the common case, with no dynamic dim: nothing to fit
            return Prepared(batch)
        fitted, crop = model.shapes.fit(batch, model.name)
        return Prepared(fitted, crop=crop or None)

    def deadline(self, timeout_s: float | None, parameters: dict[str, Any] | None = None) -> float:
        """When a request must have started: its own timeout, else OIP ``parameters.timeout``
        (microseconds, as Triton reads it), else the server's default."""
        if timeout_s is None and parameters and "timeout" in parameters:
            micros = parameters["timeout"]
            if not isinstance(micros, int | float) or isinstance(micros, bool) or micros <= 0:
                raise InvalidInput("parameter 'timeout' must be a positive number of microseconds")
            timeout_s = micros / 1e6
        return time.monotonic() + (timeout_s or self.settings.request_timeout_s)

    # -- repository -------------------------------------------------------------------------------

    async def load_model(self, name: str) -> None:
        """Load (or reload) a model; its new versions serve once their gates and warmup pass."""
        entry = await asyncio.to_thread(self.repository.load_model, name)
        for version in entry.versions.values():
            if version.served is not None:
                version.served.start()

    async def unload_model(self, name: str) -> None:
        await asyncio.to_thread(self.repository.unload_model, name)


def _check_outputs(model: LoadedVersion, wanted: list[RequestedOutput] | None) -> None:
    """Before anything runs: every output asked for is one the model offers."""
    known = model.output_datatypes
    for output in wanted or []:
        if output.name not in known:
            raise InvalidInput(
                f"requested output '{output.name}' is not an output of model '{model.name}' "
                f"(it has {sorted(known)})"
            )


def _outputs(
    model: LoadedVersion, wanted: list[RequestedOutput] | None, outputs: dict[str, np.ndarray]
) -> list[OutputTensor]:
    """The outputs a request asked for (all the model offers by default), with the
    classification extension's top-k strings where asked."""
    known = model.output_datatypes
    tensors = []
    for output in wanted or [RequestedOutput(name) for name in known]:
        top_k = output.parameters.get("classification")
        if output.name == CLASSIFICATION or top_k is not None:
            data = _classify(model, outputs, output.name, top_k)
            tensors.append(OutputTensor(output.name, "BYTES", data, output.parameters))
        else:
            tensors.append(
                OutputTensor(
                    output.name, known[output.name], outputs[output.name], output.parameters
                )
            )
    return tensors


def _classify(
    model: LoadedVersion, outputs: dict[str, np.ndarray], output: str, top_k: Any
) -> np.ndarray:
    classifier = model.classifier
    if classifier is None:
        raise InvalidInput(f"model '{model.name}' has no classification postprocessing")
    if top_k is not None and (not isinstance(top_k, int) or isinstance(top_k, bool) or top_k < 1):
        raise InvalidInput(f"output '{output}': parameter 'classification' must be an integer ≥ 1")
    source = outputs[classifier.output]
    return classification_tensor(classifier, source if model.batched else source[None], top_k)
