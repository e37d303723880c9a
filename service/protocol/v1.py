"""The v1 ``predict`` convenience protocol: a raw image body or ``{"instances": [...]}`` in,
``{"predictions": [...]}`` (postprocessed: top-k labels for a classifier) out.

Instances may be strings (texts for the model's pipeline), ``{"b64": ...}`` objects (encoded
images for it), or rows of numbers (read against the model's inputs by the core).
"""

from __future__ import annotations

import binascii
from typing import Any

import numpy as np
import orjson

from service.datatypes import b64_bytes, json_answer, json_values
from service.errors import InvalidInput, UnsupportedMediaType
from service.inference import InferenceRequest, InferenceResult


def decode_work(body: bytes, content_type: str) -> int:
    """The bytes :func:`decode_predict` works through: none for a raw image (its bytes are taken
    as they are; the pipeline decodes them later), the whole body for JSON."""
    media = content_type.split(";")[0].strip().lower()
    return 0 if media.startswith("image/") or media == "application/octet-stream" else len(body)


def decode_predict(
    model: str, body: bytes, content_type: str, timeout_s: float | None = None
) -> InferenceRequest:
    """A predict body → the core's request (call it in the pool for a large body)."""
    if not body:
        raise InvalidInput(f"request body is empty; send an image or JSON instances to '{model}'")
    media = content_type.split(";")[0].strip().lower()
    if media.startswith("image/") or media == "application/octet-stream":
        return _request(model, timeout_s, raw=[body], raw_type=media)
    if media not in ("application/json", ""):
        raise UnsupportedMediaType(
            f"Content-Type {content_type!r} is not accepted by '{model}:predict'; send "
            'application/json with {"instances": [...]} (texts, JSON values, or {"b64": ...} '
            "items), or one image's raw bytes (image/jpeg, image/png, ...)"
        )
    try:
        payload = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise InvalidInput(f"request body is not valid JSON: {exc}") from None
    instances = payload.get("instances") if isinstance(payload, dict) else None
    if instances is None and isinstance(payload, dict) and "inputs" in payload:
        raise InvalidInput(
            'v1\'s columnar form ({"inputs": ...}) is not taken; send '
            '{"instances": [...]}, one entry a row'
        )
    if not isinstance(instances, list) or not instances:
        raise InvalidInput('expected a JSON object {"instances": [...]} with at least one instance')
    if "inputs" in payload:  # v1's columnar form: beside instances, which would it mean?
        raise InvalidInput(
            "send 'instances' or 'inputs', not both; this server takes 'instances' (one entry "
            "a row)"
        )
    if all(isinstance(item, str) for item in instances):  # texts: raw items, and JSON values
        raw = [i.encode() for i in instances]
        return _request(model, timeout_s, raw=raw, rows=instances, rows_bytes=len(body))
    encoded = [isinstance(item, dict) and "b64" in item for item in instances]
    if all(encoded):
        raw = [_b64(item, index) for index, item in enumerate(instances)]
        return _request(model, timeout_s, raw=raw, raw_in_json=True)
    if any(encoded):  # JSON values and {"b64": ...} beside them: each as it is, decoded
        rows = [_b64(item, n) if encoded[n] else item for n, item in enumerate(instances)]
        return _request(model, timeout_s, rows=rows, rows_bytes=len(body), raw_in_json=True)
    return _request(model, timeout_s, rows=instances, rows_bytes=len(body))


def _request(model: str, timeout_s: float | None, **items: Any) -> InferenceRequest:
    """The core's request for ``items`` (``raw`` and/or ``rows``). It asks for no output
    tensors: :func:`encode_predictions` answers from the model's own outputs, so the tensors
    other protocols are answered with (a classifier's top-k strings, a pipeline's answers as
    JSON texts) would be made for nothing: 60 µs of the event loop a W1 image."""
    return InferenceRequest(model, outputs=[], timeout_s=timeout_s, **items)


def encode_predictions(result: InferenceResult) -> bytes:
    """``{"predictions": [...]}``: one entry per row: the model's own code's answer where it
    postprocesses, top-k labels for a classifier, the single output's row for a one-output
    model, else an object of outputs."""
    if result.answers is not None:
        return _dumps(result.answers, result.parameters)
    outputs = result.raw
    rows = next(iter(outputs.values())).shape[0] if result.batched else 1
    per_row = [
        {name: (array[i] if result.batched else array) for name, array in outputs.items()}
        for i in range(rows)
    ]
    if result.row_crops is not None:  # rows of their own lengths: each answer its own
        for row, crop in zip(per_row, result.row_crops, strict=True):
            for name, region in crop.items():
                row[name] = row[name][region[1:]]
    predictions: list[Any]
    if result.classifier is not None:
        predictions = [result.classifier(row) for row in per_row]
    elif len(outputs) == 1:
        predictions = [_listed(next(iter(row.values()))) for row in per_row]
    else:
        predictions = [{k: _listed(v) for k, v in row.items()} for row in per_row]
    return _dumps(predictions, result.parameters)


def _listed(values: np.ndarray) -> Any:
    """One row's values as JSON lists (NaN and ±inf as :data:`~service.datatypes.json_values`
    writes them)."""
    held = json_values(values)
    return held.tolist() if isinstance(held, np.ndarray) else held


def _dumps(predictions: list[Any], parameters: dict[str, Any]) -> bytes:
    answer: dict[str, Any] = {"predictions": predictions}
    if parameters:  # what preprocessing reports, e.g. which texts were truncated
        answer["parameters"] = parameters
    return json_answer(answer)


def _b64(item: dict[str, Any], index: int) -> bytes:
    if not isinstance(item.get("b64"), str):
        raise InvalidInput(f'instances[{index}] must be {{"b64": "<base64 image>"}}')
    if len(item) > 1:  # what else it says would be dropped without a word
        others = sorted(key for key in item if key != "b64")
        raise InvalidInput(
            f'instances[{index}] has keys {others} beside "b64"; an encoded item is '
            '{"b64": "<base64>"} alone'
        )
    try:
        return b64_bytes(item["b64"])
    except (binascii.Error, ValueError) as exc:
        raise InvalidInput(f"instances[{index}].b64 is not valid base64: {exc}") from None
