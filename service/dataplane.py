"""DataPlane: live / ready / metadata / infer / predict / repository, independent of HTTP.

The v2 and v1 routes translate HTTP into calls of these methods and their results back into
HTTP; everything that decides anything lives here.
"""

from __future__ import annotations

import asyncio
import io
import logging
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial
from typing import Any, TypeVar

import numpy as np
import orjson

from preprocessing.image import ImagePipeline, PreprocessingError
from preprocessing.text import TextPipeline
from service.errors import (
    InvalidInput,
    PayloadTooLarge,
    ServerBusy,
    TensorgateError,
    UnsupportedMediaType,
)
from service.loader import LoadedModel
from service.metrics import Metrics
from service.post import CLASSIFICATION, classification_tensor
from service.protocol import v2
from service.repository import ModelRepository, ModelState
from service.settings import Settings
from service.stats import RequestTiming
from service.validation import (
    b64_image,
    check_inputs,
    check_rows,
    encoded_items,
    instance_tensors,
    pad_to_buckets,
    shape_fits,
)

T = TypeVar("T")
access = logging.getLogger("tensorgate.access")

# Decoding a body this large (or larger) moves to the thread pool; below it the hop costs more.
_OFFLOAD_BYTES = 32 * 1024
PREPROCESS_MAX_ROWS = 32
"""Rows one ``:preprocess`` request may ask for: a debugging route whose answer is the model's
input tensors (each row of an ImageNet model is 600 kB, whatever the image's size)."""


class DataPlane:
    """The protocol-agnostic core every route calls."""

    def __init__(
        self, repository: ModelRepository, settings: Settings, pool: ThreadPoolExecutor
    ) -> None:
        self.repository = repository
        self.settings = settings
        self.pool = pool
        self.metrics = Metrics(repository)
        self.draining = False
        """SIGTERM arrived: readiness is false, inference still served (pre-stop)."""
        self.refusing = False
        """Past pre-stop: new inference requests get 503 while the accepted ones finish."""
        self.in_flight = 0

    async def _offload(self, size: int, fn: Callable[..., T], *args: Any) -> T:
        if size < _OFFLOAD_BYTES:
            return fn(*args)
        return await asyncio.get_running_loop().run_in_executor(self.pool, fn, *args)

    # -- health ---------------------------------------------------------------------------------

    def live(self) -> tuple[bool, str]:
        """False only when an instance has been stuck on one batch past the limit: busy is fine."""
        limit = self.settings.stuck_instance_s
        now = time.monotonic()
        for version, loaded in self.repository.loaded_versions():
            scheduler = loaded.scheduler
            if scheduler is None:
                continue
            for instance, since in enumerate(scheduler.busy_since):
                if since is not None and now - since > limit:
                    return False, (
                        f"model '{version.name}' version {version.version} instance {instance} "
                        f"has run one batch for {now - since:.0f} s (limit {limit:g} s)"
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
        if self.draining:
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

    @contextmanager
    def _observed(self, protocol: str, name: str, version: str | None) -> Iterator[Observation]:
        """Count, time and log one inference request, whatever its outcome."""
        if self.refusing:
            raise ServerBusy("the server is shutting down; send this request elsewhere")
        observation = Observation(version or "")
        self.in_flight += 1
        status = 500
        try:
            yield observation
            status = 200
        except TensorgateError as exc:
            status = exc.status
            raise
        except asyncio.CancelledError:
            status = 499
            raise
        finally:
            self.in_flight -= 1
            if observation.loaded is not None:  # the model's own statistics (Triton's names)
                stats = observation.loaded.stats
                if status == 200:
                    stats.record_success(observation.rows, observation.timing)
                else:
                    stats.record_failure(observation.timing)
            self._record(protocol, name, observation, status)

    def _record(self, protocol: str, name: str, observation: Observation, status: int) -> None:
        timing = observation.timing
        elapsed = (time.perf_counter_ns() - timing.started_ns) / 1e9
        # bounded label values: a model and version that exist, else "" (a client can send any)
        found = observation.loaded is not None
        model = name if found or name in self.repository.models else ""
        self.metrics.record(
            model, observation.version if found else "", protocol, status, elapsed, timing
        )
        if self.settings.access_log:
            access.info(
                "%s %s %d", protocol, name, status,
                extra={
                    "model": name, "version": observation.version, "protocol": protocol,
                    "status": status, "duration_ms": round(elapsed * 1000, 3),
                    "preprocess_ms": round(timing.compute_input_ns / 1e6, 3),
                    "queue_ms": round(timing.queue_ns / 1e6, 3),
                    "compute_ms": round(timing.compute_infer_ns / 1e6, 3),
                    "postprocess_ms": round(timing.compute_output_ns / 1e6, 3),
                },
            )  # fmt: skip

    # -- repository -------------------------------------------------------------------------------

    async def load_model(self, name: str) -> None:
        """Load (or reload) a model; its new versions serve once their gates and warmup pass."""
        entry = await asyncio.to_thread(self.repository.load_model, name)
        for version in entry.versions.values():
            if version.loaded is not None:
                version.loaded.start()

    async def unload_model(self, name: str) -> None:
        await asyncio.to_thread(self.repository.unload_model, name)

    # -- inference --------------------------------------------------------------------------------

    async def infer(
        self,
        name: str,
        version: str | None,
        body: bytes,
        header_length: int | None,
        timeout_s: float | None = None,
    ) -> tuple[bytes, dict[str, str]]:
        """An Open Inference Protocol request body → response body and headers."""
        with self._observed("v2", name, version) as observation:
            found, loaded = self.repository.ready_model(name, version)
            observation.version, observation.loaded = str(found.version), loaded
            with loaded.in_use():
                return await self._infer(
                    found.version, loaded, name, body, header_length, timeout_s, observation
                )

    async def _infer(
        self,
        version: int,
        loaded: LoadedModel,
        name: str,
        body: bytes,
        header_length: int | None,
        timeout_s: float | None,
        observation: Observation,
    ) -> tuple[bytes, dict[str, str]]:
        timing = observation.timing
        # By the whole body: binary BYTES tensors are unpacked element by element, and a small
        # JSON header may announce millions of them.
        request = await self._offload(
            len(body), v2.decode_request, body, header_length, self.settings.max_tensor_elements
        )
        prepared = await self._request_batch(request, loaded, name)
        deadline = self.deadline(timeout_s, request.parameters)
        outputs = await self._execute(loaded, prepared, observation, deadline)
        encode_started = time.perf_counter_ns()
        tensors = _output_tensors(request, loaded, outputs, name)
        parameters = {**request.parameters, **prepared.parameters}
        response = v2.encode_response(name, str(version), request.id, parameters or None, tensors)
        timing.compute_output_ns = time.perf_counter_ns() - encode_started
        return response

    async def predict(
        self, name: str, body: bytes, content_type: str, timeout_s: float | None = None
    ) -> dict[str, Any]:
        """v1 predict: a raw image body or ``{"instances": [...]}`` → ``{"predictions": [...]}``."""
        with self._observed("v1", name, None) as observation:
            found, loaded = self.repository.ready_model(name)
            observation.version, observation.loaded = str(found.version), loaded
            with loaded.in_use():
                return await self._predict(loaded, name, body, content_type, timeout_s, observation)

    async def _predict(
        self,
        loaded: LoadedModel,
        name: str,
        body: bytes,
        content_type: str,
        timeout_s: float | None,
        observation: Observation,
    ) -> dict[str, Any]:
        timing = observation.timing
        prepared = await self._v1_batch(loaded, name, body, content_type)
        outputs = await self._execute(loaded, prepared, observation, self.deadline(timeout_s))
        encode_started = time.perf_counter_ns()
        answer: dict[str, Any] = {"predictions": _predictions(loaded, outputs)}
        if prepared.parameters:
            answer["parameters"] = prepared.parameters
        timing.compute_output_ns = time.perf_counter_ns() - encode_started
        return answer

    async def preprocess(self, name: str, body: bytes, content_type: str) -> bytes:
        """What predict would feed the model for this body, as an ``.npz`` archive (built in the
        pool); at most :data:`PREPROCESS_MAX_ROWS` rows, since the answer is far larger than the
        body (a 1×1 PNG becomes 600 kB of float32)."""
        _, loaded = self.repository.ready_model(name)
        with loaded.in_use():
            prepared = await self._v1_batch(loaded, name, body, content_type, PREPROCESS_MAX_ROWS)
            loop = asyncio.get_running_loop()
            if prepared.lone is not None:
                prepared.batch = await loop.run_in_executor(self.pool, prepared.lone)
            return await loop.run_in_executor(self.pool, _npz, prepared.batch)

    async def _execute(
        self,
        loaded: LoadedModel,
        prepared: Prepared,
        observation: Observation,
        deadline: float,
    ) -> dict[str, np.ndarray]:
        """Run a prepared request: a lone image preprocessed and run on an idle instance's
        thread when it can be, otherwise through the model's queue."""
        timing = observation.timing
        if prepared.lone is not None:
            observation.rows = 1
            outputs = await loaded.execute_alone(prepared.lone, timing)
            if outputs is not None:
                return outputs
            loop = asyncio.get_running_loop()
            prepared.batch = await loop.run_in_executor(self.pool, prepared.lone)
        observation.rows = _rows(prepared.batch, loaded)
        timing.compute_input_ns = time.perf_counter_ns() - timing.started_ns
        return await loaded.execute(prepared.batch, timing, deadline)

    async def _request_batch(
        self, request: v2.InferenceRequest, loaded: LoadedModel, name: str
    ) -> Prepared:
        encoded = loaded.bytes_input
        if encoded is not None and any(t.name == encoded for t in request.inputs):
            if len(request.inputs) != 1:
                raise InvalidInput(
                    f"input '{encoded}' feeds the model's preprocessing: send it alone, not with "
                    f"{[t.name for t in request.inputs if t.name != encoded]}"
                )
            items = encoded_items(request.inputs[0], name)
            if isinstance(loaded.pipeline, TextPipeline):
                return await self._text_batch(loaded, name, _utf8(items, encoded))
            return await self._image_batch(loaded, name, items)
        batch = check_inputs(request.inputs, loaded.signature, loaded.config, name)
        return Prepared(pad_to_buckets(batch, loaded.signature, loaded.config, name))

    async def _v1_batch(
        self,
        loaded: LoadedModel,
        name: str,
        body: bytes,
        content_type: str,
        max_rows: int | None = None,
    ) -> Prepared:
        if not body:
            raise InvalidInput(
                f"request body is empty; send an image or JSON instances to '{name}'"
            )
        media = content_type.split(";")[0].strip().lower()
        if media.startswith("image/") or media == "application/octet-stream":
            return await self._image_batch(loaded, name, [body])
        if media == "application/json" or not media:
            return await self._instances(loaded, name, body, max_rows)
        raise UnsupportedMediaType(
            f"Content-Type {content_type!r} is not accepted; send an image (image/jpeg, "
            'image/png, ...) or application/json with {"instances": [...]}'
        )

    async def _instances(
        self, loaded: LoadedModel, name: str, body: bytes, max_rows: int | None
    ) -> Prepared:
        try:
            payload = await self._offload(len(body), orjson.loads, body)
        except orjson.JSONDecodeError as exc:
            raise InvalidInput(f"request body is not valid JSON: {exc}") from None
        instances = payload.get("instances") if isinstance(payload, dict) else None
        if not isinstance(instances, list) or not instances:
            raise InvalidInput(
                'expected a JSON object {"instances": [...]} with at least one instance'
            )
        if max_rows is not None and len(instances) > max_rows:
            raise PayloadTooLarge(
                f"{len(instances)} instances; :preprocess answers at most {max_rows} (its "
                "answer is the model's input tensors, far larger than the request)"
            )
        if isinstance(loaded.pipeline, TextPipeline):
            if not all(isinstance(item, str) for item in instances):
                raise InvalidInput(f"model '{name}' takes text: instances must be strings")
            return await self._text_batch(loaded, name, instances)
        if loaded.pipeline is not None:
            images = [b64_image(item, i) for i, item in enumerate(instances)]
            return await self._image_batch(loaded, name, images)
        tensors = instance_tensors(instances, loaded.signature.inputs)
        batch = check_inputs(tensors, loaded.signature, loaded.config, name)
        return Prepared(pad_to_buckets(batch, loaded.signature, loaded.config, name))

    async def _text_batch(self, loaded: LoadedModel, name: str, texts: list[str]) -> Prepared:
        pipeline = loaded.pipeline
        assert isinstance(pipeline, TextPipeline)
        check_rows(len(texts), loaded.config, name)
        loop = asyncio.get_running_loop()
        try:
            tokens = await loop.run_in_executor(self.pool, pipeline, texts)
        except PreprocessingError as exc:
            raise InvalidInput(f"model '{name}': {exc}") from None
        batch = {"input_ids": tokens.input_ids, "attention_mask": tokens.attention_mask}
        return Prepared(batch, {"truncated": tokens.truncated} if any(tokens.truncated) else {})

    async def _image_batch(self, loaded: LoadedModel, name: str, images: list[bytes]) -> Prepared:
        pipeline = loaded.pipeline
        if not isinstance(pipeline, ImagePipeline):
            raise UnsupportedMediaType(
                f"model '{name}' has no image preprocessing; send JSON tensors to "
                f'/v2/models/{name}/infer or {{"instances": [...]}} rows'
            )
        check_rows(len(images), loaded.config, name)
        if len(images) == 1:
            one = partial(_image_rows, pipeline, loaded, name, images)
            if loaded.alone:  # nothing to overlap with: preprocess on the instance (_execute)
                return Prepared({}, lone=one)
            return Prepared(await asyncio.get_running_loop().run_in_executor(self.pool, one))
        loop = asyncio.get_running_loop()
        rows = await asyncio.gather(
            *(
                loop.run_in_executor(self.pool, _preprocess, pipeline, image, name)
                for image in images
            )
        )
        return Prepared(_stack_rows(loaded, name, rows))

    def deadline(self, timeout_s: float | None, parameters: dict[str, Any] | None = None) -> float:
        """When a request must have started: the header's timeout, else OIP ``parameters.timeout``
        (microseconds, as Triton reads it), else the server's default."""
        if timeout_s is None and parameters and "timeout" in parameters:
            micros = parameters["timeout"]
            if not isinstance(micros, int | float) or isinstance(micros, bool) or micros <= 0:
                raise InvalidInput("parameter 'timeout' must be a positive number of microseconds")
            timeout_s = micros / 1e6
        return time.monotonic() + (timeout_s or self.settings.request_timeout_s)


@dataclass(slots=True)
class Observation:
    """What the metrics and the access log learn about a request as it travels."""

    version: str
    timing: RequestTiming = field(default_factory=RequestTiming)
    loaded: LoadedModel | None = None
    rows: int = 0


@dataclass(slots=True)
class Prepared:
    """A request turned into model inputs, plus what the response should report about it."""

    batch: dict[str, np.ndarray]
    parameters: dict[str, Any] = field(default_factory=dict)
    lone: Callable[[], dict[str, np.ndarray]] | None = None
    """Set instead of ``batch`` for a request alone in flight: makes the batch, on whichever
    thread runs it (the instance's, see ``DataPlane._execute``)."""


def _npz(tensors: dict[str, np.ndarray]) -> bytes:
    buffer = io.BytesIO()
    np.savez(buffer, allow_pickle=False, **tensors)
    return buffer.getvalue()


def _preprocess(pipeline: ImagePipeline, image: bytes, name: str) -> np.ndarray:
    """One image's row; a client's error when it cannot be preprocessed. Off the loop."""
    try:
        return pipeline(image)
    except PreprocessingError as exc:
        raise InvalidInput(f"model '{name}': {exc}") from None


def _image_rows(
    pipeline: ImagePipeline, loaded: LoadedModel, name: str, images: list[bytes]
) -> dict[str, np.ndarray]:
    """Images → the model's batch, in the calling thread (off the loop)."""
    return _stack_rows(loaded, name, [_preprocess(pipeline, image, name) for image in images])


def _stack_rows(loaded: LoadedModel, name: str, rows: list[np.ndarray]) -> dict[str, np.ndarray]:
    """Preprocessed rows → the model's batch: each row must fit the model's first input."""
    first = loaded.signature.inputs[0]
    for row in rows:
        if not shape_fits(first.shape, row.shape):
            raise InvalidInput(
                f"model '{name}': the image preprocesses to {list(row.shape)}, input "
                f"'{first.name}' takes {list(first.shape)}; set resize/crop in its config"
            )
    if len({row.shape for row in rows}) > 1:
        raise InvalidInput(f"model '{name}': images preprocess to different shapes; set crop")
    stacked = rows[0][None] if len(rows) == 1 else np.stack(rows)  # one image: a view
    return {first.name: stacked if loaded.config.max_batch_size > 0 else stacked[0]}


def _utf8(items: list[bytes], name: str) -> list[str]:
    try:
        return [item.decode() for item in items]
    except UnicodeDecodeError as exc:
        raise InvalidInput(f"input '{name}': text must be UTF-8 ({exc})") from None


def _rows(batch: dict[str, np.ndarray], loaded: LoadedModel) -> int:
    if loaded.config.max_batch_size == 0:
        return 1
    return int(next(iter(batch.values())).shape[0])


def _output_tensors(
    request: v2.InferenceRequest,
    loaded: LoadedModel,
    outputs: dict[str, np.ndarray],
    name: str,
) -> list[v2.OutputTensor]:
    """The outputs a request asked for (all by default), with postprocessing where asked."""
    known = {t.name: t.datatype for t in loaded.public_outputs()}
    wanted = request.outputs or [v2.RequestedOutput(n, request.binary_output) for n in known]
    tensors = []
    for output in wanted:
        if output.name not in known:
            raise InvalidInput(
                f"requested output '{output.name}' is not an output of model '{name}' "
                f"(it has {sorted(known)})"
            )
        top_k = output.parameters.get("classification")
        if output.name == CLASSIFICATION or top_k is not None:
            data = _classify(loaded, outputs, output.name, top_k, name)
            tensors.append(
                v2.OutputTensor(output.name, data, "BYTES", output.binary, output.parameters)
            )
            continue
        tensors.append(
            v2.OutputTensor(
                output.name, outputs[output.name], known[output.name], output.binary,
                output.parameters,
            )
        )  # fmt: skip
    return tensors


def _classify(
    loaded: LoadedModel, outputs: dict[str, np.ndarray], output: str, top_k: Any, name: str
) -> np.ndarray:
    classifier = loaded.classifier
    if classifier is None:
        raise InvalidInput(f"model '{name}' has no classification postprocessing")
    if top_k is not None and (not isinstance(top_k, int) or isinstance(top_k, bool) or top_k < 1):
        raise InvalidInput(f"output '{output}': parameter 'classification' must be an integer ≥ 1")
    source = outputs[classifier.output]
    if loaded.config.max_batch_size == 0:
        source = source[None]
    return classification_tensor(classifier, source, top_k)


def _predictions(loaded: LoadedModel, outputs: dict[str, np.ndarray]) -> list[Any]:
    batched = loaded.config.max_batch_size > 0
    rows = next(iter(outputs.values())).shape[0] if batched else 1
    per_row = [{k: (v[i] if batched else v) for k, v in outputs.items()} for i in range(rows)]
    if loaded.classifier is not None:
        return [loaded.classifier(row) for row in per_row]
    if len(outputs) == 1:
        return [next(iter(row.values())).tolist() for row in per_row]
    return [{k: v.tolist() for k, v in row.items()} for row in per_row]
