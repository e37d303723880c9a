"""DataPlane: live / ready / metadata / infer / predict, independent of HTTP.

The v2 and v1 routes translate HTTP into calls of these methods and their results back into
HTTP; everything that decides anything lives here.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import numpy as np
import orjson

from preprocessing.image import PreprocessingError
from service import __version__
from service.errors import InvalidInput, ModelExecutionError, UnsupportedMediaType
from service.loader import LoadedModel
from service.model_config import TensorConfig
from service.protocol import v2
from service.protocol.datatypes import TO_NUMPY
from service.repository import ModelRepository, ModelState, ModelVersion
from service.settings import Settings

T = TypeVar("T")

EXTENSIONS = ("binary_tensor_data",)
# Decoding a body this large (or larger) moves to the thread pool; below it the hop costs more.
_OFFLOAD_BYTES = 32 * 1024


class DataPlane:
    """The protocol-agnostic core every route calls."""

    def __init__(
        self, repository: ModelRepository, settings: Settings, pool: ThreadPoolExecutor
    ) -> None:
        self.repository = repository
        self.settings = settings
        self.pool = pool

    async def _offload(self, size: int, fn: Callable[..., T], *args: Any) -> T:
        if size < _OFFLOAD_BYTES:
            return fn(*args)
        return await asyncio.get_running_loop().run_in_executor(self.pool, fn, *args)

    # -- health and metadata ------------------------------------------------------------------

    def live(self) -> bool:
        return True

    def ready(self) -> tuple[bool, str]:
        """Whether the server takes traffic, and if not, why."""
        repository = self.repository
        if not repository.loading_done.is_set():
            return False, "models are loading"
        if repository.all_ready():
            return True, ""
        if not self.settings.strict_readiness and repository.any_ready():
            return True, ""
        broken = {
            name: entry.error or {v.version: v.reason for v in entry.versions.values() if v.reason}
            for name, entry in repository.models.items()
            if entry.error or any(v.state is not ModelState.READY for v in entry.versions.values())
        }
        return False, f"models not ready: {broken}" if broken else "no models to serve"

    def server_metadata(self) -> dict[str, Any]:
        return {
            "name": self.settings.server_name,
            "version": __version__,
            "extensions": list(EXTENSIONS),
        }

    def model_ready(self, name: str, version: str | None) -> bool:
        found = self.repository.version(name, version)
        return found.state is ModelState.READY

    def model_metadata(self, name: str, version: str | None) -> dict[str, Any]:
        entry = self.repository.entry(name)
        found: ModelVersion | None = (
            self.repository.version(name, version) if entry.versions else None
        )
        loaded = found.loaded if found else None
        metadata: dict[str, Any] = {
            "name": name,
            "versions": [str(v) for v in sorted(entry.versions)],
            "platform": loaded.runtime.platform if loaded else _platform(entry.config),
            "inputs": _tensors(loaded.signature.inputs, loaded) if loaded else [],
            "outputs": _tensors(loaded.signature.outputs, loaded) if loaded else [],
            "state": found.state.value if found else ModelState.UNAVAILABLE.value,
        }
        if found is not None:
            metadata["version"] = str(found.version)
        reason = found.reason if found and found.reason else entry.error
        if reason:
            metadata["reason"] = reason
        if loaded is not None:
            metadata["verified"] = loaded.verified
            metadata["device"] = loaded.device
            if loaded.warnings:
                metadata["warnings"] = loaded.warnings
            metadata["load_timings_s"] = loaded.timings
            metadata["warmup_timings_s"] = loaded.warmup_timings
        return metadata

    # -- inference ------------------------------------------------------------------------------

    async def infer(
        self, name: str, version: str | None, body: bytes, header_length: int | None
    ) -> tuple[bytes, dict[str, str]]:
        """An Open Inference Protocol request body → response body and headers."""
        found, loaded = self.repository.ready_model(name, version)
        request = await self._offload(len(body), v2.decode_request, body, header_length)
        batch = _validate(request.inputs, loaded, name)
        outputs = await self._run(loaded, batch, name)
        wanted = request.outputs or [
            v2.RequestedOutput(t.name, request.binary_output) for t in loaded.signature.outputs
        ]
        known = {t.name: t for t in loaded.signature.outputs}
        encoded = []
        for output in wanted:
            if output.name not in known:
                raise InvalidInput(
                    f"requested output '{output.name}' is not an output of model '{name}' "
                    f"(it has {sorted(known)})"
                )
            data = outputs[output.name]
            encoded.append(
                v2.OutputTensor(
                    output.name, data, known[output.name].datatype, output.binary, output.parameters
                )
            )
        return v2.encode_response(
            name, str(found.version), request.id, request.parameters or None, encoded
        )

    async def predict(self, name: str, body: bytes, content_type: str) -> dict[str, Any]:
        """v1 predict: a raw image body or ``{"instances": [...]}`` → ``{"predictions": [...]}``."""
        _, loaded = self.repository.ready_model(name)
        batch = await self._v1_batch(loaded, name, body, content_type)
        outputs = await self._run(loaded, batch, name)
        return {"predictions": _postprocess(loaded, outputs)}

    async def preprocess(self, name: str, body: bytes, content_type: str) -> dict[str, np.ndarray]:
        """What predict would feed the model for this body: the tensors, not the answer."""
        _, loaded = self.repository.ready_model(name)
        return await self._v1_batch(loaded, name, body, content_type)

    async def _v1_batch(
        self, loaded: LoadedModel, name: str, body: bytes, content_type: str
    ) -> dict[str, np.ndarray]:
        if not body:
            raise InvalidInput(
                f"request body is empty; send an image or JSON instances to '{name}'"
            )
        media = content_type.split(";")[0].strip().lower()
        if media.startswith("image/") or media == "application/octet-stream":
            return await self._preprocess(loaded, name, [body])
        if media == "application/json" or not media:
            return await self._instances(loaded, name, body)
        raise UnsupportedMediaType(
            f"Content-Type {content_type!r} is not accepted; send an image (image/jpeg, "
            'image/png, ...) or application/json with {"instances": [...]}'
        )

    async def _instances(
        self, loaded: LoadedModel, name: str, body: bytes
    ) -> dict[str, np.ndarray]:
        try:
            payload = await self._offload(len(body), orjson.loads, body)
        except orjson.JSONDecodeError as exc:
            raise InvalidInput(f"request body is not valid JSON: {exc}") from None
        instances = payload.get("instances") if isinstance(payload, dict) else None
        if not isinstance(instances, list) or not instances:
            raise InvalidInput(
                'expected a JSON object {"instances": [...]} with at least one instance'
            )
        if loaded.pipeline is not None:
            images = [_b64_image(item, i) for i, item in enumerate(instances)]
            return await self._preprocess(loaded, name, images)
        return _validate(_instance_tensors(instances, loaded), loaded, name)

    async def _preprocess(
        self, loaded: LoadedModel, name: str, images: list[bytes]
    ) -> dict[str, np.ndarray]:
        pipeline = loaded.pipeline
        if pipeline is None:
            raise UnsupportedMediaType(
                f"model '{name}' has no image preprocessing; send JSON tensors to "
                f'/v2/models/{name}/infer or {{"instances": [...]}} rows'
            )
        loop = asyncio.get_running_loop()
        try:
            rows = await asyncio.gather(
                *(loop.run_in_executor(self.pool, pipeline, image) for image in images)
            )
        except PreprocessingError as exc:
            raise InvalidInput(f"model '{name}': {exc}") from None
        first = loaded.signature.inputs[0]
        for row in rows:
            if not _shape_fits(first.shape, row.shape):
                raise InvalidInput(
                    f"model '{name}': the image preprocesses to {list(row.shape)}, input "
                    f"'{first.name}' takes {list(first.shape)}; set resize/crop in its config"
                )
        if len({row.shape for row in rows}) > 1:
            raise InvalidInput(f"model '{name}': images preprocess to different shapes; set crop")
        _check_rows(len(rows), loaded, name)
        return {first.name: np.stack(rows)}

    async def _run(
        self, loaded: LoadedModel, batch: dict[str, np.ndarray], name: str
    ) -> dict[str, np.ndarray]:
        outputs = await loaded.execute(batch)
        if loaded.config.max_batch_size > 0:
            rows = next(iter(batch.values())).shape[0]
            for output, array in outputs.items():
                if array.ndim == 0 or array.shape[0] != rows:
                    raise ModelExecutionError(
                        f"model '{name}' returned {array.shape[0] if array.ndim else 0} rows of "
                        f"output '{output}' for a batch of {rows} (batch size mismatch)"
                    )
        return outputs


def _validate(
    inputs: list[v2.InputTensor], loaded: LoadedModel, name: str
) -> dict[str, np.ndarray]:
    """Check inputs against the model's signature; return the batch to run."""
    declared = {t.name: t for t in loaded.signature.inputs}
    given = {t.name: t for t in inputs}
    if unknown := sorted(set(given) - set(declared)):
        raise InvalidInput(
            f"model '{name}' has no input {unknown}; its inputs are {sorted(declared)}"
        )
    if missing := sorted(set(declared) - set(given)):
        raise InvalidInput(f"missing input {missing}; model '{name}' takes {sorted(declared)}")
    batched = loaded.config.max_batch_size > 0
    rows: set[int] = set()
    batch = {}
    for spec in loaded.signature.inputs:
        tensor = given[spec.name]
        want = ((-1,) if batched else ()) + spec.shape
        if tensor.datatype != spec.datatype or not _shape_fits(want, tensor.shape):
            raise InvalidInput(
                f"input '{spec.name}': expected {spec.datatype} {list(want)}, "
                f"got {tensor.datatype} {list(tensor.shape)}"
            )
        if batched:
            rows.add(tensor.shape[0])
        batch[spec.name] = tensor.data
    if len(rows) > 1:
        raise InvalidInput(f"inputs have different batch sizes {sorted(rows)}")
    if rows:
        _check_rows(rows.pop(), loaded, name)
    return batch


def _check_rows(rows: int, loaded: LoadedModel, name: str) -> None:
    limit = loaded.config.max_batch_size
    if rows < 1:
        raise InvalidInput(f"model '{name}': a request needs at least 1 row (got 0)")
    if limit and rows > limit:
        raise InvalidInput(f"model '{name}': {rows} rows is above its max_batch_size {limit}")


def _shape_fits(want: tuple[int, ...], got: tuple[int, ...]) -> bool:
    return len(want) == len(got) and all(w in (-1, g) for w, g in zip(want, got, strict=True))


def _instance_tensors(instances: list[Any], loaded: LoadedModel) -> list[v2.InputTensor]:
    """v1 rows → one tensor per input: plain rows feed the only input, dicts name their inputs."""
    specs = loaded.signature.inputs
    if all(isinstance(item, dict) for item in instances):
        columns = {t.name: [item.get(t.name) for item in instances] for t in specs}
    elif len(specs) == 1:
        columns = {specs[0].name: instances}
    else:
        raise InvalidInput(
            f"the model takes {len(specs)} inputs; send each instance as an object naming them "
            f"({[t.name for t in specs]})"
        )
    tensors = []
    for spec in specs:
        try:
            array = np.asarray(columns[spec.name], dtype=TO_NUMPY[spec.datatype])
        except (ValueError, TypeError, OverflowError) as exc:
            raise InvalidInput(
                f"instances for input '{spec.name}' are not {spec.datatype} rows of shape "
                f"{list(spec.shape)}: {exc}"
            ) from None
        tensors.append(v2.InputTensor(spec.name, spec.datatype, array.shape, array))
    return tensors


def _b64_image(item: Any, index: int) -> bytes:
    if not isinstance(item, dict) or not isinstance(item.get("b64"), str):
        raise InvalidInput(f'instances[{index}] must be {{"b64": "<base64 image>"}}')
    try:
        return base64.b64decode(item["b64"], validate=True)
    except (binascii.Error, ValueError) as exc:
        raise InvalidInput(f"instances[{index}].b64 is not valid base64: {exc}") from None


def _postprocess(loaded: LoadedModel, outputs: dict[str, np.ndarray]) -> list[Any]:
    rows = next(iter(outputs.values())).shape[0] if loaded.config.max_batch_size > 0 else 1
    per_row = [
        {k: (v[i] if loaded.config.max_batch_size > 0 else v) for k, v in outputs.items()}
        for i in range(rows)
    ]
    if loaded.classifier is not None:
        return [loaded.classifier(row) for row in per_row]
    if len(outputs) == 1:
        return [next(iter(row.values())).tolist() for row in per_row]
    return [{k: v.tolist() for k, v in row.items()} for row in per_row]


def _tensors(tensors: tuple[TensorConfig, ...], loaded: LoadedModel) -> list[dict[str, Any]]:
    batch = [-1] if loaded.config.max_batch_size > 0 else []
    return [{"name": t.name, "datatype": t.datatype, "shape": [*batch, *t.shape]} for t in tensors]


def _platform(config: Any) -> str:
    backend = getattr(config, "backend", None)
    return {"onnx": "onnxruntime_onnx", "torchscript": "pytorch_libtorch"}.get(backend or "", "")
