"""Open Inference Protocol over gRPC (Triton's ``grpc_service.proto``): messages ↔ the core.

Pure functions, as :mod:`service.protocol.v2` is for REST: :func:`decode_request` turns a
``ModelInferRequest`` into the core's request (raw contents are numpy views of the message's
bytes, laid out as Triton's binary tensors; typed ``contents`` are read field by field), and
:func:`encode_result` turns the core's result into a ``ModelInferResponse``, which
:func:`serialized` writes with its raw outputs copied once.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple, TypeVar

import numpy as np
from google.protobuf.message import DecodeError, Message

from service.datatypes import TO_NUMPY, article, json_answer
from service.errors import InvalidInput
from service.inference import InferenceRequest, InferenceResult, InputTensor, RequestedOutput
from service.protocol import v2
from service.protocol.pb import grpc_service_pb2 as pb

CONTENTS_FIELD = {
    "BOOL": "bool_contents",
    "UINT8": "uint_contents",
    "UINT16": "uint_contents",
    "UINT32": "uint_contents",
    "UINT64": "uint64_contents",
    "INT8": "int_contents",
    "INT16": "int_contents",
    "INT32": "int_contents",
    "INT64": "int64_contents",
    "FP32": "fp32_contents",
    "FP64": "fp64_contents",
    "BYTES": "bytes_contents",
}
"""Where each datatype's typed ``contents`` live; FP16 and BF16 have none (raw contents only)."""
FIELD_DTYPES: dict[str, type[np.generic]] = {
    "bool_contents": np.bool_,
    "uint_contents": np.uint32,
    "uint64_contents": np.uint64,
    "int_contents": np.int32,
    "int64_contents": np.int64,
    "fp32_contents": np.float32,
    "fp64_contents": np.float64,
}
"""The type of each numeric ``contents`` field's values, as the protocol declares it."""

M = TypeVar("M", bound=Message)


class Unparsed:
    """A request message's bytes as grpc received them, for its handler to parse with
    :func:`parse`: after the token and the budget, off the event loop when large. grpc's own
    deserializer parses on the loop, before anything else, and answers a malformed message
    UNKNOWN with a Python class's name. Handlers take ``raw`` out (leaving ``b""``) so that
    they alone hold it and can let it go once parsed."""

    __slots__ = ("raw",)

    def __init__(self, raw: bytes) -> None:
        self.raw = raw


def parse(message_type: type[M], raw: bytes) -> M:
    """``raw`` as a ``message_type``; 400 (INVALID_ARGUMENT) naming the message if it is not one."""
    try:
        message: M = message_type.FromString(raw)
    except DecodeError:
        raise InvalidInput(
            f"the request is not a valid {message_type.DESCRIPTOR.full_name} message "
            f"({len(raw)} bytes that do not parse as protobuf)"
        ) from None
    return message


class InferMessage(NamedTuple):
    """A ``ModelInferRequest`` as :func:`parse_infer` reads it: the message, and its
    ``raw_input_contents`` as views of the bytes it arrived in."""

    message: pb.ModelInferRequest
    """Without its raw contents: they are ``contents``."""
    contents: Sequence[bytes | memoryview]


RAW_INPUT_TAG = 7 << 3 | 2
"""``ModelInferRequest.raw_input_contents`` (field 7, length-delimited) on the wire."""
SCAN_FROM_BYTES = 64 << 10
"""Messages this large or larger have their raw contents read as views (:func:`parse_infer`);
a smaller one upb reads whole, faster than a scan in Python, and copying its contents costs
little."""
MAX_SCANNED_FIELDS = 4096
"""Top-level fields :func:`parse_infer` reads in Python before it leaves a message to upb: a
real request has a few (names, inputs, outputs, parameters, contents); millions of tiny
``outputs`` entries upb reads far faster."""


def parse_infer(raw: bytes) -> InferMessage:
    """``raw`` as a ``ModelInferRequest``, its raw contents apart. In a large message they are
    views of ``raw``: upb would copy a 60 MiB input twice, the GIL held each time (parsing,
    27 ms, and reading the field, 25 ms), and every other request's step on the event loop
    waits for the GIL. upb parses the rest of the message, field run by field run (no joined
    copy of it), so a malformed one is refused as :func:`parse` refuses it."""
    spans = _split_raw_contents(raw) if len(raw) >= SCAN_FROM_BYTES else None
    if spans is None:  # small, many fields, or not protobuf: upb reads it (and says what's wrong)
        return _parsed_whole(raw)
    contents, rest = spans
    view = memoryview(raw)
    message = pb.ModelInferRequest()
    try:
        for start, end in rest:  # merging field runs in turn is parsing them joined
            message.MergeFromString(view[start:end])
    except DecodeError:
        return _parsed_whole(raw)  # refused as a whole message is, naming its size
    return InferMessage(message, [view[start:end] for start, end in contents])


def _parsed_whole(raw: bytes) -> InferMessage:
    """``raw`` parsed by upb, its raw contents read out once (each read of the field copies)."""
    message = parse(pb.ModelInferRequest, raw)
    contents = list(message.raw_input_contents)
    message.ClearField("raw_input_contents")
    return InferMessage(message, contents)


Span = tuple[int, int]


def _split_raw_contents(raw: bytes) -> tuple[list[Span], list[Span]] | None:
    """The spans of ``raw`` that are raw contents' payloads, and the spans of every other
    field (whole, consecutive ones merged), in wire order; None for a message of more than
    :data:`MAX_SCANNED_FIELDS` top-level fields, or one this does not read as upb does (not
    protobuf wire format, a tag over 5 bytes or past a field number's range, a group)."""
    contents: list[Span] = []
    rest: list[Span] = []
    run = position = 0  # run: where the current stretch of other fields began
    end = len(raw)
    for _ in range(MAX_SCANNED_FIELDS):
        if position == end:
            break
        start = position
        tag, position = _read_varint(raw, position, 5)
        if position < 0 or tag >> 32 or tag >> 3 == 0:
            return None
        kind = tag & 7
        if kind == 2:
            length, position = _read_varint(raw, position, 10)
            payload = position
            position = -1 if position < 0 else position + length
        elif kind == 0:
            _, position = _read_varint(raw, position, 10)
        elif kind in (1, 5):
            position += 8 if kind == 1 else 4
        else:  # groups, or not a wire type: upb's to judge
            return None
        if not 0 <= position <= end:
            return None
        if tag == RAW_INPUT_TAG:
            if start > run:
                rest.append((run, start))
            contents.append((payload, position))
            run = position
    else:
        if position != end:
            return None
    if end > run:
        rest.append((run, end))
    return contents, rest


def _read_varint(data: bytes, position: int, most: int) -> tuple[int, int]:
    """The base-128 varint of at most ``most`` bytes at ``position`` and the position after it;
    ``(0, -1)`` when it is cut off or longer."""
    value = shift = 0
    for index in range(position, min(position + most, len(data))):
        byte = data[index]
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, index + 1
        shift += 7
    return 0, -1


def decode_work(message: pb.ModelInferRequest) -> int:
    """About the bytes :func:`decode_request` works through: 8 for each element of typed
    ``contents`` (each is read into a numpy array one by one) and 64 for each output asked for
    and each parameter (each becomes a Python object). Raw contents are not counted here (their
    size cannot be read without the copy upb makes of each): the caller adds the message's."""
    entries = len(message.outputs) + len(message.parameters) + len(message.inputs)
    return 8 * typed_elements(message) + 64 * entries


TYPED_HELD_PER_ELEMENT = 48
"""What one element of typed ``contents`` holds at the peak of its decoding (a Python number
each, then numpy's copies): 96 MB for 2 M INT64 values that took 6 MB on the wire (measured
with tracemalloc), against 8 bytes in raw contents."""


def typed_elements(message: pb.ModelInferRequest) -> int:
    """How many values the message's inputs carry in typed ``contents``."""
    return sum(
        len(getattr(t.contents, CONTENTS_FIELD.get(t.datatype, "fp32_contents")))
        for t in message.inputs
        if t.HasField("contents")
    )


def decode_request(
    message: pb.ModelInferRequest | InferMessage,
    timeout_s: float | None,
    max_elements: int | None = None,
) -> InferenceRequest:
    """A ``ModelInferRequest`` (or one read by :func:`parse_infer`) → the core's request;
    ``timeout_s``: the call's deadline."""
    if isinstance(message, InferMessage):
        message, raw = message
    else:
        raw = message.raw_input_contents
    if raw and len(raw) != len(message.inputs):
        raise InvalidInput(
            f"raw_input_contents has {len(raw)} entries for {len(message.inputs)} inputs; "
            "when used it holds one per input, in order"
        )
    if not message.inputs:
        raise InvalidInput("'inputs' must hold at least one tensor")
    inputs = []
    for index, tensor in enumerate(message.inputs):
        content = raw[index] if raw else None
        inputs.append(_decode_input(tensor, content, max_elements))
    _once([t.name for t in inputs], "input", "appears more than once in 'inputs'")
    outputs = None
    if message.outputs:
        outputs = [RequestedOutput(o.name, parameters(o.parameters)) for o in message.outputs]
        for output in outputs:
            v2.refuse_shared_memory(output.parameters, f"output '{output.name}'")
        _once([o.name for o in outputs], "output", "is requested more than once")
    return InferenceRequest(
        message.model_name,
        message.model_version or None,
        inputs,
        outputs=outputs,
        parameters=parameters(message.parameters),
        id=message.id or None,
        timeout_s=timeout_s,
    )


def _once(names: list[str], kind: str, what: str) -> None:
    """400 naming the first name that repeats (only it: a message may hold millions)."""
    seen: set[str] = set()
    for name in names:
        if name in seen:
            raise InvalidInput(f"{kind} {name[:200]!r} {what}")
        seen.add(name)


def _decode_input(
    tensor: pb.ModelInferRequest.InferInputTensor,
    raw: bytes | memoryview | None,
    max_elements: int | None,
) -> InputTensor:
    name, datatype = tensor.name, tensor.datatype
    if not name:
        raise InvalidInput("every input needs a name")
    v2.check_datatype(datatype, name)
    v2.refuse_shared_memory(tensor.parameters, f"input '{name}'")
    shape = tuple(tensor.shape)
    for i, dim in enumerate(shape):
        if dim < 0:
            raise InvalidInput(f"input '{name}': shape dims must be integers ≥ 0; dim {i} is {dim}")
    count = v2.element_count(shape, datatype, name, max_elements)
    if raw is not None:
        if tensor.HasField("contents"):
            raise InvalidInput(f"input '{name}' has both 'contents' and raw_input_contents")
        data = v2.from_binary(
            memoryview(raw), datatype, count, name, source="its raw_input_contents entry's size"
        )
    else:
        data = _from_contents(tensor, count)
    return InputTensor(name, datatype, shape, data.reshape(shape), parameters(tensor.parameters))


def _from_contents(tensor: pb.ModelInferRequest.InferInputTensor, count: int) -> np.ndarray:
    name, datatype = tensor.name, tensor.datatype
    field = CONTENTS_FIELD.get(datatype)
    if field is None:
        raise InvalidInput(
            f"input '{name}': {datatype} has no typed 'contents' in the protocol; send it in "
            "raw_input_contents (2-byte little-endian words)"
        )
    given = [f.name for f, _ in tensor.contents.ListFields()]
    unused = [f for f in given if f != field]
    if unused:  # values the model would never see: the client's mistake, not noise to skip
        others = "contents." + ", contents.".join(unused)
        said = f"{others} is set too" if field in given else f"not in {others}"
        raise InvalidInput(
            f"input '{name}': {article(datatype)} {datatype} tensor's values go in "
            f"contents.{field}; {said}"
        )
    values = getattr(tensor.contents, field)
    if len(values) != count:
        raise InvalidInput(
            f"input '{name}': shape {list(tensor.shape)} needs {count} elements, "
            f"contents.{field} has {len(values)}"
        )
    if datatype == "BYTES":
        array = np.empty(count, dtype=object)
        array[:] = list(values)
        return array
    dtype = TO_NUMPY[datatype]
    try:
        # Narrow types travel in wider fields (INT8 in int_contents): a value out of range is
        # the client's error, not a silent wrap-around. Read as the field's own type: numpy's
        # guess made uint64_contents [2⁶³ + 1, 0, 1] floats, rounded to 2⁶³.
        wide = np.asarray(values, dtype=FIELD_DTYPES[field])
        array = wide.astype(dtype)
        if datatype not in ("FP32", "FP64", "BOOL") and not np.array_equal(array, wide):
            raise ValueError("a value is out of range")
    except (ValueError, OverflowError) as exc:
        raise InvalidInput(f"input '{name}': contents.{field} is not {datatype}: {exc}") from None
    return array


class Encoded(NamedTuple):
    """A ``ModelInferResponse`` in two parts, joined by :func:`serialized`: the message without
    its raw outputs, and the raw outputs' bytes (numpy's own buffers, not copied). upb would
    copy a 60 MiB output three times, holding the GIL each time (``tobytes``, ``append``,
    ``SerializeToString``: 110 ms); joined, it is copied once."""

    message: pb.ModelInferResponse
    raw: list[memoryview]


def encode_result(result: InferenceResult, raw: bool) -> Encoded:
    """The core's result → a ``ModelInferResponse`` (:class:`Encoded`): outputs in
    ``raw_output_contents`` when ``raw`` (as the request sent its inputs) or when an output's
    datatype has no typed field (raw contents are all or nothing), else in typed ``contents``."""
    response = pb.ModelInferResponse(
        model_name=result.model, model_version=result.version, id=result.id or ""
    )
    set_parameters(response.parameters, result.parameters)
    raw = raw or any(o.datatype not in CONTENTS_FIELD for o in result.outputs)
    contents: list[memoryview] = []
    for output in result.outputs:
        tensor = response.outputs.add(
            name=output.name, datatype=output.datatype, shape=output.data.shape
        )
        set_parameters(tensor.parameters, output.parameters)
        if raw:
            contents.append(_binary(output.data, output.datatype))
        else:
            flat = output.data.reshape(-1)
            values = (
                flat.tolist()
                if output.datatype != "BYTES"
                else [v if isinstance(v, bytes) else str(v).encode() for v in flat]
            )
            getattr(tensor.contents, CONTENTS_FIELD[output.datatype]).extend(values)
    return Encoded(response, contents)


def _binary(data: np.ndarray, datatype: str) -> memoryview:
    """A tensor in Triton's binary layout (:func:`service.protocol.v2.to_binary`): a view of the
    tensor's own bytes where they are already little-endian and contiguous."""
    if datatype == "BYTES":
        return memoryview(v2.to_binary(data, datatype))
    little = np.ascontiguousarray(data, dtype=data.dtype.newbyteorder("<"))
    return little.reshape(-1).view(np.uint8).data


RAW_OUTPUT_TAG = b"\x32"
"""``ModelInferResponse.raw_output_contents`` (field 6, length-delimited) on the wire: the
message's last field, so a serializer writes these entries last, as :func:`serialized` does."""
INFER_RESPONSE_TAG = b"\x12"
"""``ModelStreamInferResponse.infer_response`` (field 2, length-delimited) on the wire."""


def serialized(encoded: Encoded, stream: bool = False) -> bytes:
    """The wire bytes of an encoded ``ModelInferResponse`` (or, ``stream``, of the
    ``ModelStreamInferResponse`` that holds it), the same bytes upb writes for the whole
    message, made with one copy of the raw outputs."""
    parts: list[bytes | memoryview] = [encoded.message.SerializeToString()]
    for data in encoded.raw:
        parts += [RAW_OUTPUT_TAG, _varint(len(data)), data]
    if stream:
        parts[:0] = [INFER_RESPONSE_TAG, _varint(sum(len(part) for part in parts))]
    return b"".join(parts)


def _varint(value: int) -> bytes:
    """``value`` as a protobuf base-128 varint."""
    out = bytearray()
    while value > 0x7F:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def parameters(message: Mapping[str, pb.InferParameter]) -> dict[str, Any]:
    """A protobuf parameter map → plain values."""
    values: dict[str, Any] = {}
    for key, parameter in message.items():
        choice = parameter.WhichOneof("parameter_choice")
        values[key] = getattr(parameter, choice) if choice is not None else None
    return values


def set_parameters(target: Any, values: Mapping[str, Any]) -> None:
    """Plain values → a protobuf parameter map; values with no protobuf type go as JSON text,
    as REST writes them (numpy arrays as lists, NaN as "NaN": ``repr`` had made "[1 2]");
    None (a parameter with no value, as :func:`parameters` reads it) as one with none."""
    for key, value in values.items():
        parameter = target[key]
        if value is None:  # a parameter sent with no value: echoed as it came, not as "null"
            continue
        if isinstance(value, np.generic) and value.ndim == 0 and value.dtype.kind in "biuf":
            value = value.item()
        if isinstance(value, bool):
            parameter.bool_param = value
        elif isinstance(value, int) and -(2**63) <= value < 2**63:
            parameter.int64_param = value
        elif isinstance(value, int) and 0 <= value < 2**64:
            parameter.uint64_param = value
        elif isinstance(value, float):
            parameter.double_param = value
        elif isinstance(value, str):
            parameter.string_param = value
        else:
            parameter.string_param = json_answer(value).decode()
