"""The gRPC codec: ModelInferRequest ↔ the core's request and result, as pure functions."""

from __future__ import annotations

import json

import numpy as np
import pytest

from service.core.dataplane import OFFLOAD_BYTES
from service.datatypes import INTEGER_RANGES, TO_NUMPY
from service.errors import InvalidInput, PayloadTooLarge
from service.inference import InferenceResult, OutputTensor
from service.protocol import grpc as codec
from service.protocol import v2
from service.protocol.pb import grpc_service_pb2 as pb

pytestmark = pytest.mark.unit


def request_with(datatype: str, shape: list[int], **contents: list[object]) -> pb.ModelInferRequest:
    message = pb.ModelInferRequest(model_name="m", model_version="2", id="q")
    tensor = message.inputs.add(name="x", datatype=datatype, shape=shape)
    for field, values in contents.items():
        getattr(tensor.contents, field).extend(values)
    return message


def test_typed_and_raw_contents_decode_to_the_same_tensor() -> None:
    typed = codec.decode_request(request_with("INT16", [1, 3], int_contents=[1, -2, 3]), 1.5)
    raw = request_with("INT16", [1, 3])
    raw.raw_input_contents.append(np.array([1, -2, 3], "<i2").tobytes())
    decoded = codec.decode_request(raw, None)
    np.testing.assert_array_equal(typed.inputs[0].data, decoded.inputs[0].data)
    assert typed.inputs[0].data.dtype == np.int16
    assert (typed.model, typed.version, typed.id, typed.timeout_s) == ("m", "2", "q", 1.5)


@pytest.mark.parametrize(
    ("message", "error", "text"),
    [
        (request_with("INT8", [1], int_contents=[300]), InvalidInput, "not INT8"),
        (request_with("FP32", [2], fp32_contents=[1.0]), InvalidInput, "needs 2 elements"),
        (request_with("FP16", [1]), InvalidInput, "raw_input_contents"),
        (request_with("BF16", [1], fp32_contents=[1.0]), InvalidInput, "BF16.*raw_input_contents"),
        (request_with("FP64", [1 << 20, 1 << 10]), PayloadTooLarge, "limit"),
        (request_with("NOPE", [1]), InvalidInput, "datatype must be one of"),
        (request_with("FP32", [2, -1]), InvalidInput, "integers ≥ 0; dim 1 is -1$"),
        (request_with("FP32", [0, 1 << 40, 1 << 40]), InvalidInput, "too large for any tensor"),
    ],
)
def test_bad_requests_name_the_input(
    message: pb.ModelInferRequest, error: type[Exception], text: str
) -> None:
    with pytest.raises(error, match=text):
        codec.decode_request(message, None, max_elements=1 << 24)


@pytest.mark.parametrize("datatype", sorted(INTEGER_RANGES))
def test_typed_contents_take_each_end_of_the_datatypes_range_exactly(datatype: str) -> None:
    """uint64_contents [2**63 + 1, 0, 1] decoded as [2**63, 0, 1] (numpy read the list as
    floats), and [2**64 - 1, 0, 1] was refused: 'a value is out of range'."""
    low, high = INTEGER_RANGES[datatype]
    values = [low, 0, high, high // 2 + 2, 1, 0]
    field = {codec.CONTENTS_FIELD[datatype]: values}
    decoded = codec.decode_request(request_with(datatype, [2, 3], **field), None)
    assert decoded.inputs[0].data.dtype == TO_NUMPY[datatype]
    assert decoded.inputs[0].data.reshape(-1).tolist() == values


def test_shared_memory_is_refused_naming_the_tensor() -> None:
    """An input naming a region was told it had no contents; an output naming one was answered
    inline, the region ignored."""
    message = request_with("FP32", [1], fp32_contents=[1.0])
    message.inputs[0].parameters["shared_memory_region"].string_param = "input0"
    message.inputs[0].parameters["shared_memory_byte_size"].int64_param = 4
    with pytest.raises(InvalidInput) as refused:
        codec.decode_request(message, None, max_elements=1 << 24)
    assert str(refused.value).startswith(
        "input 'x': shared memory (shared_memory_region, shared_memory_byte_size) is not "
        "supported by this server; send the tensor's data in the request"
    )
    message = request_with("FP32", [1], fp32_contents=[1.0])
    output = message.outputs.add(name="y")
    output.parameters["shared_memory_region"].string_param = "output0"
    with pytest.raises(InvalidInput, match="output 'y': shared memory .shared_memory_region."):
        codec.decode_request(message, None, max_elements=1 << 24)


def test_raw_contents_must_cover_every_input() -> None:
    message = request_with("FP32", [1])
    message.inputs.add(name="y", datatype="FP32", shape=[1])
    message.raw_input_contents.append(b"\0\0\0\0")
    with pytest.raises(InvalidInput, match="one per input"):
        codec.decode_request(message, None)


def test_a_short_raw_entry_is_named_in_grpc_words() -> None:
    message = request_with("FP32", [2])
    message.raw_input_contents.append(b"\0\0\0\0")
    with pytest.raises(InvalidInput) as short:
        codec.decode_request(message, None)
    assert "input 'x': 2 FP32 elements need 8 bytes" in short.value.message
    assert "raw_input_contents entry's size is 4" in short.value.message
    assert "binary_data_size" not in short.value.message  # REST's word, not sent over gRPC


def answer(result: InferenceResult, raw: bool) -> pb.ModelInferResponse:
    """The ``ModelInferResponse`` a client reads for ``result``."""
    return pb.ModelInferResponse.FromString(codec.serialized(codec.encode_result(result, raw)))


def test_answers_are_the_bytes_upb_writes_for_the_whole_message() -> None:
    """An answer's raw outputs are joined to the rest of its message instead of going through
    upb (three copies of each, the GIL held); a client must read the same bytes upb writes,
    for a ModelInfer answer and for the ModelStreamInferResponse that holds a stream's."""
    outputs = [
        OutputTensor("a", "FP32", np.arange(6, dtype=np.float32).reshape(2, 3), {"p": 1}),
        OutputTensor("b", "BYTES", np.array([[b"x"], ["y\u00e9"]], dtype=object)),
        OutputTensor("c", "INT64", np.arange(300, dtype=">i8").reshape(2, 150)[:, ::3]),
        OutputTensor("d", "BOOL", np.array([[True], [False]])),
        OutputTensor("e", "FP16", np.zeros((2, 0), np.float16)),
        OutputTensor("f", "UINT8", np.full((2, 20_000), 7, np.uint8)),  # a 3-byte length
    ]
    result = InferenceResult("m", "2", "q", outputs, {}, {"t": "x"}, None, True)
    encoded = codec.encode_result(result, raw=True)
    whole = pb.ModelInferResponse()
    whole.CopyFrom(encoded.message)
    for output in outputs:
        whole.raw_output_contents.append(v2.to_binary(output.data, output.datatype))
    assert codec.serialized(encoded) == whole.SerializeToString()
    stream = pb.ModelStreamInferResponse(infer_response=whole)
    assert codec.serialized(encoded, stream=True) == stream.SerializeToString()
    read = pb.ModelInferResponse.FromString(codec.serialized(encoded))
    np.testing.assert_array_equal(
        np.frombuffer(read.raw_output_contents[2], "<i8").reshape(2, 50), outputs[2].data
    )


def _raw_content(payload: bytes, tag: bytes = b"\x3a") -> bytes:
    """A ``raw_input_contents`` entry on the wire (field 7; ``tag`` may spell it longer)."""
    return tag + codec._varint(len(payload)) + payload


def _expected(wire: bytes) -> tuple[pb.ModelInferRequest, list[bytes]]:
    """What upb reads of ``wire``: the message without its raw contents, and them."""
    whole = pb.ModelInferRequest.FromString(wire)
    contents = list(whole.raw_input_contents)
    whole.ClearField("raw_input_contents")
    return whole, contents


WIDE = codec.SCAN_FROM_BYTES // 4  # float32 values: a message large enough to be scanned


def test_raw_contents_are_read_as_views_of_the_bytes_the_message_came_in() -> None:
    """upb copies a raw content twice as it is parsed and read, the GIL held each time (52 ms
    for 60 MiB); in a large message they are views, none is copied, and upb parses the rest,
    wherever the entries sit among the other fields, with unknown fields of every wire type
    kept. A small message upb reads whole (a scan in Python is the slower there)."""
    message = request_with("FP32", [1, WIDE])
    message.inputs.add(name="y", datatype="UINT8", shape=[3])
    codec.set_parameters(message.parameters, {"p": 5})
    head = message.SerializeToString()
    values = np.arange(WIDE, dtype=np.float32)
    first, second = values.tobytes(), b"\x01\x02\x03"
    unknown = b"\xf8\x07\x96\x01" + b"\x81\x08" + bytes(8) + b"\x8d\x08" + bytes(4)  # 127-129
    unknown += b"\x92\x08\x02hi"  # field 130, length-delimited
    for wire in (
        head + _raw_content(first) + _raw_content(second),
        _raw_content(first) + head + unknown + _raw_content(second, b"\xba\x00"),
        head + _raw_content(b"x" * WIDE * 4, b"\xba\x80\x80\x80\x00"),  # a 5-byte tag
    ):
        parsed = codec.parse_infer(wire)
        message_read, contents = _expected(wire)
        assert parsed.message == message_read
        assert parsed.message.SerializeToString() == message_read.SerializeToString()
        assert [bytes(c) for c in parsed.contents] == contents
        assert all(isinstance(c, memoryview) and c.obj is wire for c in parsed.contents)
    wire = _raw_content(first) + head + unknown + _raw_content(second)
    x, y = codec.decode_request(codec.parse_infer(wire), None).inputs
    assert (x.data == values).all() and y.data.tolist() == [1, 2, 3]
    small = request_with("FP32", [1, 2]).SerializeToString() + _raw_content(bytes(8))
    parsed = codec.parse_infer(small)
    assert parsed.contents == [bytes(8)] and not parsed.message.raw_input_contents


def test_a_message_that_is_not_protobuf_or_has_many_fields_is_read_by_upb() -> None:
    """Cut-off or malformed bytes are refused as upb refuses them, naming the bytes sent (a tag
    cut off at the end was read from position -1 on, and the message taken, with overlapping
    contents; a tag of 6 bytes was taken); a message of more fields than the scan reads
    (millions of tiny ``outputs``: upb is faster) is parsed by upb, with the same result."""
    wire = request_with("FP32", [1, WIDE]).SerializeToString() + _raw_content(bytes(4 * WIDE))
    broken = [wire[:-1], wire + b"\x3a\x05ab", wire + b"\x0b", b"\xff" * 11 + wire]
    broken += [b"\x3a\x3a\x3a" + b"A" * 57 + wire + b"\x80"]  # a tag cut off at the end
    broken += [wire + b"\xba\x80\x80\x80\x80\x00\x03abc"]  # field 7 in a 6-byte tag
    broken += [wire + b"\x02\x00"]  # field 0
    for bad in broken:
        with pytest.raises(
            InvalidInput, match=f"inference.ModelInferRequest message \\({len(bad)} bytes"
        ):
            codec.parse_infer(bad)
    many = pb.ModelInferRequest.FromString(wire)
    for i in range(codec.MAX_SCANNED_FIELDS):
        many.outputs.add(name=f"o{i}")
    crowded = many.SerializeToString()
    parsed = codec.parse_infer(crowded)
    assert parsed.message.outputs[-1].name == f"o{codec.MAX_SCANNED_FIELDS - 1}"
    assert parsed.contents == [bytes(4 * WIDE)] and not parsed.message.raw_input_contents


def test_a_models_parameters_are_written_over_grpc_as_rest_writes_them() -> None:
    """numpy values were written by repr ("[1 2]", a float32 as the text "1.5"), and NaN in a
    list as null over REST."""
    said = {
        "arr": np.array([1, 2]),
        "f": np.float32(1.5),
        "i": np.int64(3),
        "ok": np.bool_(True),
        "nan": [float("nan"), 1.0],
    }
    message = request_with("FP32", [1], fp32_contents=[1.0])
    codec.set_parameters(message.parameters, said)
    assert codec.parameters(message.parameters) == {
        "arr": "[1,2]",
        "f": 1.5,
        "i": 3,
        "ok": True,
        "nan": '["NaN",1.0]',
    }
    result = InferenceResult("m", "1", None, [], {}, said, None, True)
    body, _ = v2.encode_result(result, binary_default=False)
    assert json.loads(body)["parameters"] == {
        "arr": [1, 2],
        "f": 1.5,
        "i": 3,
        "ok": True,
        "nan": ["NaN", 1.0],
    }


def test_parameters_round_trip_and_fp16_outputs_go_raw() -> None:
    message = request_with("FP32", [1], fp32_contents=[1.0])
    sent = {"a": True, "b": 3, "c": 0.5, "d": "s", "e": [1], "f": None}
    codec.set_parameters(message.parameters, sent)
    assert codec.parameters(message.parameters) == {
        "a": True,
        "b": 3,
        "c": 0.5,
        "d": "s",
        "e": "[1]",
        "f": None,  # sent with no value: echoed with none, not as the string "null"
    }
    outputs = [
        OutputTensor("y", "FP16", np.array([[1.5]], np.float16)),
        OutputTensor("z", "INT32", np.array([[7]], np.int32)),
    ]
    result = InferenceResult("m", "1", "q", outputs, {}, {}, None, True)
    response = answer(result, raw=False)
    assert len(response.raw_output_contents) == 2  # all or nothing
    assert np.frombuffer(response.raw_output_contents[0], "<f2")[0] == 1.5
    typed = answer(InferenceResult("m", "1", None, outputs[1:], {}, {}, None, True), False)
    assert list(typed.outputs[0].contents.int_contents) == [7] and not typed.raw_output_contents


def test_bf16_travels_as_two_byte_words_both_ways() -> None:
    message = request_with("BF16", [1, 3])
    words = np.array([0x3F80, 0x8000, 0x7FC0], "<u2")
    message.raw_input_contents.append(words.tobytes())
    (tensor,) = codec.decode_request(message, None).inputs
    assert tensor.datatype == "BF16" and tensor.data.dtype == np.uint16
    np.testing.assert_array_equal(tensor.data, [words])
    outputs = [OutputTensor("y", "BF16", tensor.data), OutputTensor("z", "INT32", np.int32([[7]]))]
    response = answer(InferenceResult("m", "1", None, outputs, {}, {}, None, True), False)
    assert response.raw_output_contents[0] == words.tobytes()  # and so every output goes raw
    assert response.outputs[0].datatype == "BF16" and list(response.outputs[0].shape) == [1, 3]


def test_a_message_of_many_outputs_or_parameters_is_decoded_off_the_event_loop() -> None:
    """#28 finding 9: 2 M ``outputs`` entries were decoded on the loop (4.4 s of stall): each
    entry counts, so such a message is decoded on the pool."""
    many = pb.ModelInferRequest(model_name="m")
    for i in range(OFFLOAD_BYTES // 64):
        many.outputs.add(name=f"o{i}")
    assert codec.decode_work(many) >= OFFLOAD_BYTES
    params = pb.ModelInferRequest(model_name="m")
    for i in range(OFFLOAD_BYTES // 64):
        params.parameters[f"p{i}"].int64_param = i
    assert codec.decode_work(params) >= OFFLOAD_BYTES
    assert codec.decode_work(pb.ModelInferRequest(model_name="m")) < OFFLOAD_BYTES


def test_a_repeated_name_is_named_alone() -> None:
    """The error names the repeated output, not every name the message holds."""
    message = pb.ModelInferRequest(model_name="m")
    tensor = message.inputs.add(name="x", datatype="FP32", shape=[1])
    tensor.contents.fp32_contents.append(1.0)
    for name in ["a", "b", *(f"o{i}" for i in range(1000)), "b"]:
        message.outputs.add(name=name)
    with pytest.raises(InvalidInput) as error:
        codec.decode_request(message, None)
    assert error.value.message == "output 'b' is requested more than once"
