"""Open Inference Protocol (KServe v2) REST codec, with Triton's binary tensor data extension.

Pure functions over bytes: :func:`decode_request` turns a request body into numpy arrays (binary
tensors are viewed straight out of the body, never JSON-parsed), :func:`encode_result` turns the
core's result into a body and its headers. Bulk tensor data never goes through pydantic.
"""

from __future__ import annotations

import io
import math
import struct
from collections.abc import Mapping
from typing import Any

import numpy as np
import orjson

from service.datatypes import (
    MAX_BYTES_ELEMENTS,
    TO_NUMPY,
    as_values,
    json_answer,
    json_kind,
    json_numbers,
    json_said,
    json_values,
)
from service.errors import InvalidInput, PayloadTooLarge, UnsupportedMediaType
from service.inference import InferenceRequest, InferenceResult, InputTensor, RequestedOutput

HEADER_LENGTH = "inference-header-content-length"
MAX_EXTENT = 2**40
"""Most a shape's non-zero dims may multiply to beside a zero dim: numpy refuses even an empty
array whose other dims multiply past what it can index."""
_MAX_NESTING = 64


NOT_JSON = ("image/", "audio/", "video/", "multipart/")
"""Media types a v2 request never is: answered 415 naming where such a body goes, before it is
read (parsed as JSON it was a 400 about UTF-8 surrogates)."""


def check_media_type(content_type: str, model: str) -> None:
    """415 for a body of a media type that is never a v2 request (an image, a form)."""
    media = content_type.split(";")[0].strip().lower()
    if media.startswith(NOT_JSON):
        raise UnsupportedMediaType(
            f"Content-Type {media!r} is not accepted by v2 infer, which takes a JSON request "
            "(binary tensors may follow its JSON header, Inference-Header-Content-Length); "
            f"send a raw image to POST /v1/models/{model}:predict, or as an element of a BYTES "
            "input"
        )


def parse_header_length(value: str | None, body_length: int) -> int | None:
    """Validate ``Inference-Header-Content-Length`` against the body it claims to split."""
    if value is None:
        return None
    if not (value.isascii() and value.isdigit()):  # int() takes " 1", "+1", "1_0" too
        raise InvalidInput(
            f"Inference-Header-Content-Length must be one integer, its digits alone (got {value!r})"
        )
    length = int(value)
    if not 0 < length <= body_length:
        raise InvalidInput(
            f"Inference-Header-Content-Length is {length} but the body has {body_length} bytes"
        )
    return length


def decode_work(body: bytes, header_length: int | None) -> int:
    """The bytes :func:`decode_request` works through: the JSON header. Binary tensors are
    viewed where they lie (BYTES elements are sliced out), never parsed."""
    return len(body) if header_length is None else header_length


def decode_request(
    body: bytes,
    header_length: int | None = None,
    max_elements: int | None = None,
    model: str = "",
    version: str | None = None,
    timeout_s: float | None = None,
) -> InferenceRequest:
    """A request body (JSON, or JSON header + binary tensors) for ``model`` → the core's
    request; ``timeout_s``: the HTTP request's own (``X-Request-Timeout``)."""
    if not body:
        raise InvalidInput("request body is empty; expected an inference request in JSON")
    view = memoryview(body)
    header_bytes = view[:header_length] if header_length is not None else view
    try:
        header = orjson.loads(header_bytes)
    except orjson.JSONDecodeError as exc:
        if header_length is not None:
            raise InvalidInput(
                f"the request's JSON header (its first {header_length} bytes, as "
                f"Inference-Header-Content-Length says) is not valid JSON: {exc}"
            ) from None
        raise InvalidInput(f"request body is not valid JSON: {exc}") from None
    if not isinstance(header, dict):
        raise InvalidInput(f"request must be a JSON object, got {json_kind(header)}")
    binary = view[header_length:] if header_length is not None else view[:0]
    # JSON's true and false read as 1 and 0 among numbers; only a body that has either word
    # is looked through for them (a scan of every value cost a W2 request 2.4 µs)
    text = body if header_length is None else bytes(header_bytes)
    bools = b"true" in text or b"false" in text

    request_id = header.get("id")
    if request_id is not None and not isinstance(request_id, str):
        raise InvalidInput(f"'id' must be a string, got {json_kind(request_id)}")
    parameters = _parameters(header.get("parameters"), "request")
    raw_inputs = header.get("inputs")
    if not isinstance(raw_inputs, list) or not raw_inputs:
        raise InvalidInput("'inputs' must be a non-empty list of tensors")

    inputs: list[InputTensor] = []
    offset = 0
    for index, raw in enumerate(raw_inputs):
        tensor, used = _decode_input(raw, index, binary[offset:], max_elements, bools)
        offset += used
        inputs.append(tensor)
    if offset != len(binary):
        raise InvalidInput(
            f"the binary part of the body has {len(binary)} bytes but the inputs' "
            f"binary_data_size add up to {offset}"
        )
    names = [tensor.name for tensor in inputs]
    if len(set(names)) != len(names):
        raise InvalidInput(f"an input appears more than once in 'inputs': {names}")

    binary_output = parameters.get("binary_data_output", False)
    if not isinstance(binary_output, bool):
        raise InvalidInput("parameter 'binary_data_output' must be true or false")
    outputs = _decode_outputs(header.get("outputs"), binary_output)
    return InferenceRequest(
        model,
        version,
        inputs,
        outputs=outputs,
        parameters=parameters,
        id=request_id,
        timeout_s=timeout_s,
    )


def binary_default(request: InferenceRequest) -> bool:
    """Whether outputs that do not say go in binary (``binary_data_output``, checked a bool at
    decode): what :func:`encode_result` is given for the request's answer."""
    return request.parameters.get("binary_data_output", False) is True


def _decode_input(
    raw: Any, index: int, binary: memoryview, max_elements: int | None, bools: bool = True
) -> tuple[InputTensor, int]:
    if not isinstance(raw, dict):
        raise InvalidInput(f"inputs[{index}] must be an object, got {json_kind(raw)}")
    name = raw.get("name")
    if not isinstance(name, str) or not name:
        raise InvalidInput(f"inputs[{index}].name must be a non-empty string")
    datatype = check_datatype(raw.get("datatype"), name)
    shape = _shape(raw.get("shape"), f"input '{name}'")
    parameters = _parameters(raw.get("parameters"), f"input '{name}'")
    count = element_count(shape, datatype, name, max_elements)
    size = parameters.get("binary_data_size")
    if size is not None:
        if "data" in raw:
            raise InvalidInput(f"input '{name}' has both 'data' and binary_data_size")
        if not isinstance(size, int) or isinstance(size, bool) or size < 0:
            raise InvalidInput(f"input '{name}': binary_data_size must be an integer ≥ 0")
        if size > len(binary):
            raise InvalidInput(
                f"input '{name}': binary_data_size is {size} but only {len(binary)} bytes "
                "of binary data are left in the body"
            )
        data = from_binary(binary[:size], datatype, count, name)
        return InputTensor(name, datatype, shape, data.reshape(shape), parameters), size
    if "data" not in raw:
        raise InvalidInput(f"input '{name}' has no 'data' and no binary_data_size")
    data = _from_json(raw["data"], datatype, name, bools)
    if data.size != count:
        raise InvalidInput(
            f"input '{name}': shape {list(shape)} needs {count} elements, 'data' has {data.size}"
        )
    return InputTensor(name, datatype, shape, data.reshape(shape), parameters), 0


def _shape(raw: Any, what: str) -> tuple[int, ...]:
    if not isinstance(raw, list):
        raise InvalidInput(f"{what}: 'shape' must be a list of integers, got {json_kind(raw)}")
    for i, dim in enumerate(raw):
        if not isinstance(dim, int) or isinstance(dim, bool) or dim < 0:
            raise InvalidInput(
                f"{what}: shape dims must be integers ≥ 0; dim {i} is {json_said(dim)}"
            )
    return tuple(raw)


def check_datatype(datatype: object, name: str) -> str:
    """``datatype``, input ``name``'s, if the protocol names it; else 400."""
    if not isinstance(datatype, str) or datatype not in TO_NUMPY:
        raise InvalidInput(
            f"input '{name}': datatype must be one of {', '.join(TO_NUMPY)} (got {datatype!r})"
        )
    return datatype


def element_count(
    shape: tuple[int, ...], datatype: str, name: str, max_elements: int | None
) -> int:
    """Elements input ``name`` of ``shape`` holds, within the bounds on what one tensor may
    make the server hold: 413 past ``max_elements``, or for BYTES past
    :data:`MAX_BYTES_ELEMENTS`; 400 for an empty shape no array can have (a zero dim beside
    others too large for numpy: a non-empty one can never match its data)."""
    count = math.prod(shape)
    if count == 0 and (extent := math.prod(dim for dim in shape if dim)) > MAX_EXTENT:
        raise InvalidInput(
            f"input '{name}': shape {list(shape)} is too large for any tensor, even an empty "
            f"one (its non-zero dims multiply to {extent}; the most is {MAX_EXTENT})"
        )
    if max_elements is not None and count > max_elements:
        raise PayloadTooLarge(
            f"input '{name}': shape {list(shape)} has {count} elements; the limit is {max_elements}"
        )
    if datatype == "BYTES" and count > MAX_BYTES_ELEMENTS:
        raise PayloadTooLarge(
            f"input '{name}': shape {list(shape)} has {count} BYTES elements; the limit is "
            f"{MAX_BYTES_ELEMENTS} (each element is an object of its own)"
        )
    return count


MAX_PARAMETER_DEPTH = 32
"""How deep a parameter's value may nest arrays and objects. The OIP's are strings, numbers and
booleans; deeper values are kept for models' own code, but not past this: the request's
parameters are echoed in the answer, whose JSON writer stops at 254 levels, and a value of 254
(the reader takes 1,024) was a 500 after the model had run."""


SHARED_MEMORY = ("shared_memory_region", "shared_memory_byte_size", "shared_memory_offset")
"""The OIP's shared-memory parameters: a tensor to read from, or write to, a region."""


def refuse_shared_memory(parameters: Mapping[str, Any], what: str) -> None:
    """InvalidInput for a tensor that names a shared-memory region: regions cannot be
    registered here, and a region ignored answered inline (an output) or said the input had
    no data."""
    named = [key for key in SHARED_MEMORY if key in parameters]
    if named:
        raise InvalidInput(
            f"{what}: shared memory ({', '.join(named)}) is not supported by this server; "
            "send the tensor's data in the request and take outputs from the answer"
        )


def _parameters(raw: Any, what: str) -> dict[str, Any]:
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise InvalidInput(f"{what}: 'parameters' must be an object, got {json_kind(raw)}")
    refuse_shared_memory(raw, what)
    for key, value in raw.items():
        level, depth = [value], 0
        while level := [
            inner
            for held in level
            if isinstance(held, list | dict)
            for inner in (held.values() if isinstance(held, dict) else held)
        ]:
            depth += 1
            if depth > MAX_PARAMETER_DEPTH:
                raise InvalidInput(
                    f"{what}: parameter '{key}' nests arrays or objects more than "
                    f"{MAX_PARAMETER_DEPTH} deep"
                )
    return raw


def from_binary(
    chunk: memoryview, datatype: str, count: int, name: str, source: str = "binary_data_size"
) -> np.ndarray:
    """``count`` elements of ``datatype`` from Triton's binary layout (also gRPC's raw contents:
    ``source`` names where the chunk's size came from, in the client's protocol's words)."""
    if datatype == "BYTES":
        return unpack_bytes(chunk, count, name)
    dtype = TO_NUMPY[datatype]
    expected = count * dtype.itemsize
    if len(chunk) != expected:
        raise InvalidInput(
            f"input '{name}': {count} {datatype} elements need {expected} bytes, "
            f"{source} is {len(chunk)}"
        )
    array = np.frombuffer(chunk, dtype=dtype.newbyteorder("<"))
    if datatype == "BOOL" and (highest := int(array.view(np.uint8).max(initial=0))) > 1:
        # numpy reads any byte as a bool; runtimes do not agree on what 2 or 255 is (ONNX
        # Runtime and a pt2 kernel answered the same bytes differently)
        raise InvalidInput(f"input '{name}': a BOOL element is one byte, 0 or 1; one is {highest}")
    return array


def unpack_bytes(chunk: memoryview, count: int, name: str) -> np.ndarray:
    items: list[bytes] = []
    offset = 0
    end = len(chunk)
    while offset < end:
        if len(items) == count:  # never unpack more than the shape holds
            raise InvalidInput(
                f"input '{name}': binary data holds more than the {count} BYTES elements its "
                f"shape needs ({end - offset} bytes left over)"
            )
        if offset + 4 > end:
            raise InvalidInput(f"input '{name}': BYTES element length is cut off at byte {offset}")
        (length,) = struct.unpack_from("<I", chunk, offset)
        offset += 4
        if offset + length > end:
            raise InvalidInput(
                f"input '{name}': BYTES element {len(items)} claims {length} bytes, "
                f"{end - offset} are left"
            )
        items.append(bytes(chunk[offset : offset + length]))
        offset += length
    if len(items) != count:
        raise InvalidInput(
            f"input '{name}': shape needs {count} BYTES elements, binary data holds {len(items)}"
        )
    array = np.empty(count, dtype=object)
    array[:] = items
    return array


def _from_json(data: Any, datatype: str, name: str, bools: bool = True) -> np.ndarray:
    if not isinstance(data, list):
        data = [data]
    if datatype == "BYTES":
        flat = _flatten(data, name)
        array = np.empty(len(flat), dtype=object)
        for i, item in enumerate(flat):
            if not isinstance(item, str):
                raise InvalidInput(
                    f"input '{name}': BYTES data must be strings, got {json_kind(item)}"
                )
            array[i] = item.encode()
        return array
    try:
        array = json_numbers(data, datatype, bools)
    except (ValueError, TypeError, OverflowError) as exc:
        raise InvalidInput(
            f"input '{name}': 'data' is not a (nested) list of {datatype} values: {exc}"
        ) from None
    return array.reshape(-1)


def _flatten(data: list[Any], name: str, depth: int = 0) -> list[Any]:
    if depth > _MAX_NESTING:
        raise InvalidInput(f"input '{name}': 'data' is nested more than {_MAX_NESTING} deep")
    if not any(isinstance(item, list) for item in data):
        return data
    flat: list[Any] = []
    for item in data:
        flat.extend(_flatten(item, name, depth + 1) if isinstance(item, list) else [item])
    return flat


def _decode_outputs(raw: Any, binary_default: bool) -> list[RequestedOutput] | None:
    if raw is None:
        return None
    if not isinstance(raw, list):
        raise InvalidInput(f"'outputs' must be a list, got {json_kind(raw)}")
    outputs = []
    names: set[str] = set()
    for index, item in enumerate(raw):
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            raise InvalidInput(f"outputs[{index}] must be an object with a string 'name'")
        if item["name"] in names:  # each copy would be encoded again: a cheap amplifier
            raise InvalidInput(f"output '{item['name']}' is requested more than once")
        names.add(item["name"])
        parameters = _parameters(item.get("parameters"), f"output '{item['name']}'")
        binary = parameters.get("binary_data", binary_default)
        if not isinstance(binary, bool):
            raise InvalidInput(f"output '{item['name']}': binary_data must be true or false")
        outputs.append(RequestedOutput(item["name"], parameters))
    return outputs


def encode_result(result: InferenceResult, binary_default: bool) -> tuple[bytes, dict[str, str]]:
    """The core's result → ``(body, headers)``; binary outputs follow the JSON header, in order.
    An output is binary when its ``binary_data`` parameter says so, else per ``binary_default``."""
    chunks: list[bytes | memoryview] = []
    encoded = []
    for output in result.outputs:
        entry: dict[str, Any] = {
            "name": output.name,
            "datatype": output.datatype,
            "shape": list(output.data.shape),
        }
        params = {k: v for k, v in output.parameters.items() if k != "binary_data"}
        if output.parameters.get("binary_data", binary_default):
            blob = _binary_view(output.data, output.datatype)
            chunks.append(blob)
            params["binary_data_size"] = blob.nbytes if isinstance(blob, memoryview) else len(blob)
        else:
            entry["data"] = _to_json(output.data, output.datatype)
        if params:
            entry["parameters"] = params
        encoded.append(entry)
    response: dict[str, Any] = {"model_name": result.model, "model_version": result.version}
    if result.id is not None:
        response["id"] = result.id
    if result.parameters:  # a model's code may say NaN or numpy values: as in its answers
        response["parameters"] = orjson.Fragment(json_answer(result.parameters))
    response["outputs"] = encoded
    header = orjson.dumps(response, option=orjson.OPT_SERIALIZE_NUMPY)
    if not chunks:
        return header, {"content-type": "application/json"}
    headers = {
        "content-type": "application/octet-stream",
        HEADER_LENGTH: str(len(header)),
    }
    # Written into one buffer straight from each output's memory, handed over uncopied: the
    # answer is held once beside its outputs, not as a copy of each and then their join.
    body = io.BytesIO()
    body.write(header)
    for chunk in chunks:
        body.write(chunk)
    return body.getvalue(), headers


def _to_json(data: np.ndarray, datatype: str) -> Any:
    flat = data.reshape(-1)
    if datatype == "BYTES":
        return [
            item.decode("utf-8", "replace") if isinstance(item, bytes) else str(item)
            for item in flat
        ]
    return json_values(np.ascontiguousarray(as_values(flat, datatype)))


def _binary_view(data: np.ndarray, datatype: str) -> bytes | memoryview:
    """:func:`to_binary`, as a view of the tensor's own bytes where no conversion is needed."""
    if datatype == "BYTES":
        return to_binary(data, datatype)
    flat = np.ascontiguousarray(data, dtype=data.dtype.newbyteorder("<")).reshape(-1)
    return flat.view(np.uint8).data


def to_binary(data: np.ndarray, datatype: str) -> bytes:
    """A tensor in Triton's binary layout: little-endian elements, BYTES length-prefixed."""
    if datatype == "BYTES":
        parts = []
        for item in data.reshape(-1):
            raw = item if isinstance(item, bytes) else str(item).encode()
            parts.append(struct.pack("<I", len(raw)))
            parts.append(raw)
        return b"".join(parts)
    return np.ascontiguousarray(data, dtype=data.dtype.newbyteorder("<")).tobytes()
