"""The v2 codec against hand-built and tritonclient-built bodies, exhaustively and by property."""

import contextlib
import json
import math
import struct
import tracemalloc
from typing import Any

import ml_dtypes
import numpy as np
import orjson
import pytest
import tritonclient.http as triton
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp
from tritonclient.http._utils import _get_inference_request

from service.datatypes import MAX_BYTES_ELEMENTS, TO_NUMPY, bf16_bits, json_answer
from service.errors import InvalidInput, PayloadTooLarge
from service.inference import InferenceResult, OutputTensor
from service.protocol import v1
from service.protocol.v2 import (
    binary_default,
    decode_request,
    encode_result,
    parse_header_length,
)

NUMERIC = [name for name in TO_NUMPY if name not in ("BYTES", "BF16")]
"""The datatypes numpy has; BF16 (ml_dtypes on the client's side, bit patterns on ours) below."""
shapes = hnp.array_shapes(min_dims=1, max_dims=4, min_side=0, max_side=5)


def arrays_of(datatype: str) -> st.SearchStrategy[np.ndarray]:
    dtype = TO_NUMPY[datatype]
    elements = None
    if dtype.kind == "f":
        elements = st.floats(width=dtype.itemsize * 8, allow_nan=False, allow_infinity=False)
    return hnp.arrays(dtype, shapes, elements=elements)


def triton_body(arrays: dict[str, np.ndarray], binary: bool) -> tuple[bytes, int | None]:
    """The exact bytes tritonclient.http sends for these inputs."""
    inputs = []
    for name, array in arrays.items():
        datatype = "BYTES" if array.dtype == object else triton.np_to_triton_dtype(array.dtype)
        tensor = triton.InferInput(name, list(array.shape), datatype)
        tensor.set_data_from_numpy(array, binary_data=binary)
        inputs.append(tensor)
    body, json_size = _get_inference_request(
        inputs=inputs,
        request_id="r1",
        outputs=None,
        sequence_id=0,
        sequence_start=False,
        sequence_end=False,
        priority=0,
        timeout=None,
        custom_parameters=None,
    )
    return (body if isinstance(body, bytes) else body.encode()), json_size


@settings(max_examples=60, suppress_health_check=[HealthCheck.too_slow])
@given(datatype=st.sampled_from(NUMERIC), data=st.data(), binary=st.booleans())
def test_every_numeric_datatype_round_trips_from_tritonclient(
    datatype: str, data: st.DataObject, binary: bool
) -> None:
    array = data.draw(arrays_of(datatype))
    body, header_length = triton_body({"x": array}, binary)
    request = decode_request(body, header_length)
    (decoded,) = request.inputs
    assert decoded.datatype == datatype
    assert decoded.shape == array.shape
    assert decoded.data.dtype == array.dtype
    np.testing.assert_array_equal(decoded.data, array)
    assert request.id == "r1"
    assert binary_default(request) is True  # tritonclient asks for binary outputs by default


@given(
    items=st.lists(st.binary(max_size=20), min_size=1, max_size=6),
    binary=st.booleans(),
)
def test_bytes_round_trip_from_tritonclient(items: list[bytes], binary: bool) -> None:
    if not binary:  # JSON carries BYTES as UTF-8 strings
        items = [item.decode("latin-1").encode() for item in items]
    array = np.array(items, dtype=object)
    body, header_length = triton_body({"s": array}, binary)
    (decoded,) = decode_request(body, header_length).inputs
    assert list(decoded.data) == items


@pytest.mark.parametrize("datatype", NUMERIC)
def test_nested_and_flat_json_data_decode_alike(datatype: str) -> None:
    flat = [1, 0, 1, 1, 0, 1]
    nested = [[1, 0, 1], [1, 0, 1]]
    values = [[bool(v) for v in flat], [[bool(v) for v in r] for r in nested]]
    if datatype != "BOOL":
        values = [flat, nested]
    results = []
    for data in values:
        body = orjson.dumps(
            {"inputs": [{"name": "x", "datatype": datatype, "shape": [2, 3], "data": data}]}
        )
        results.append(decode_request(body).inputs[0].data)
    np.testing.assert_array_equal(results[0], results[1])
    assert results[0].shape == (2, 3)


@settings(max_examples=40)
@given(datatype=st.sampled_from(NUMERIC), data=st.data())
def test_responses_parse_with_tritonclients_own_reader(datatype: str, data: st.DataObject) -> None:
    a = data.draw(arrays_of(datatype))
    b = np.array([b"ab", b"", "é".encode()], dtype=object)
    for binary in (False, True):
        outputs = [OutputTensor("a", datatype, a), OutputTensor("b", "BYTES", b)]
        result = InferenceResult("m", "1", "id-7", outputs, {}, {"k": 1}, None, True)
        body, headers = encode_result(result, binary)
        length = headers.get("inference-header-content-length")
        result = triton.InferResult.from_response_body(
            body, header_length=int(length) if length else None
        )
        got = result.as_numpy("a")
        if binary or datatype != "FP16":
            np.testing.assert_array_equal(got.astype(a.dtype).reshape(a.shape), a)
        strings = [item if binary else item.decode() for item in b]  # JSON carries text
        assert list(result.as_numpy("b")) == strings
        assert result.get_response()["id"] == "id-7"
        assert result.get_response()["parameters"] == {"k": 1}


BF16_VALUES = [1.0, 1 + 2**-8 + 2**-30, -0.0, 3.0e38, -2.5, 1e-40]
BF16_BITS = [0x3F80, 0x3F81, 0x8000, 0x7F62, 0xC020, 0x0001]
"""JSON floats and the bfloat16 each rounds to (nearest, ties to even)."""


def test_bf16_json_data_is_rounded_to_nearest_even_bfloat16() -> None:
    body = orjson.dumps(
        {"inputs": [{"name": "x", "datatype": "BF16", "shape": [2, 3], "data": BF16_VALUES}]}
    )
    (decoded,) = decode_request(body).inputs
    assert decoded.datatype == "BF16" and decoded.data.dtype == np.uint16
    assert decoded.data.reshape(-1).tolist() == BF16_BITS


def test_bf16_binary_data_from_tritonclient_is_two_byte_words() -> None:
    values = np.array([[1.5, -0.0, np.inf], [-np.inf, np.nan, 3.0e38]], ml_dtypes.bfloat16)
    body, header_length = triton_body({"x": values}, binary=True)
    (decoded,) = decode_request(body, header_length).inputs
    assert decoded.datatype == "BF16" and decoded.shape == (2, 3)
    np.testing.assert_array_equal(decoded.data, values.view(np.uint16))


@pytest.mark.parametrize("binary", [False, True])
def test_bf16_outputs_parse_with_tritonclients_own_reader(binary: bool) -> None:
    bits = np.array([BF16_BITS], np.uint16)
    result = InferenceResult("m", "1", None, [OutputTensor("y", "BF16", bits)], {}, {}, None, True)
    body, headers = encode_result(result, binary)
    length = headers.get("inference-header-content-length")
    if binary:
        assert body[int(length or 0) :] == bits.astype("<u2").tobytes()
    else:  # floats, written as float32 (shortest): each parses back to the same bfloat16
        data = orjson.loads(body)["outputs"][0]["data"]
        assert bf16_bits(np.array(data)).tolist() == BF16_BITS
        assert data[:3] == [1.0, 1.0078125, -0.0] and math.copysign(1, data[2]) == -1
    parsed = triton.InferResult.from_response_body(
        body, header_length=int(length) if length else None
    ).as_numpy("y")
    assert parsed.dtype == ml_dtypes.bfloat16
    np.testing.assert_array_equal(parsed.view(np.uint16), bits)


def _request(**tensor: Any) -> bytes:
    base = {"name": "x", "datatype": "FP32", "shape": [2], "data": [1.0, 2.0]}
    base.update(tensor)
    return orjson.dumps({"inputs": [{k: v for k, v in base.items() if v is not ...}]})


@pytest.mark.parametrize(
    ("body", "header", "message"),
    [
        (b"", None, "request body is empty"),
        (b"{not json", None, "not valid JSON"),
        # the header's length cut the JSON short: which bytes were read as JSON, and why
        (b'{"inputs": []}', 5, r"JSON header \(its first 5 bytes, as Inference-Header-Content-"),
        (b"[1, 2]", None, "must be a JSON object"),
        (b'{"inputs": []}', None, "non-empty list"),
        (b'{"inputs": [1]}', None, r"inputs\[0\] must be an object"),
        (b'{"id": 5, "inputs": [{}]}', None, "'id' must be a string"),
        (_request(name=...), None, "name must be a non-empty string"),
        (_request(datatype="FLOAT"), None, "datatype must be one of"),
        (_request(shape=[-1]), None, "shape dims must be integers ≥ 0; dim 0 is -1$"),
        (_request(shape=[True, 2]), None, "shape dims must be integers ≥ 0; dim 0 is true$"),
        (_request(shape=[2, 1.5]), None, "dim 1 is 1.5$"),
        (_request(shape=[2, "2"]), None, "dim 1 is a string$"),
        (_request(shape=[2, None]), None, "dim 1 is null$"),
        (_request(shape="2"), None, "'shape' must be a list"),
        (_request(shape=[3]), None, r"shape \[3\] needs 3 elements, 'data' has 2"),
        (_request(shape=[10**12, 10**12]), None, "needs 1000000000000000000000000 elements"),
        (_request(shape=[0, 2**40, 2**40], data=[]), None, "too large for any tensor"),
        (_request(data=["a", "b"]), None, "not a \\(nested\\) list of FP32"),
        (_request(data=[[1.0], [2.0, 3.0]]), None, "not a \\(nested\\) list of FP32"),
        (_request(data=...), None, "has no 'data' and no binary_data_size"),
        (_request(datatype="UINT8", data=[1, 300]), None, "not a \\(nested\\) list of UINT8"),
        (_request(datatype="BYTES", data=[1, 2]), None, "BYTES data must be strings"),
        (_request(parameters=[1]), None, "'parameters' must be an object"),
        (  # it said the input had no 'data' and no binary_data_size
            _request(data=..., parameters={"shared_memory_region": "r"}),
            None,
            r"input 'x': shared memory \(shared_memory_region\) is not supported by this server",
        ),
        (  # the region was ignored and the output answered inline
            b'{"inputs": [{"name":"x","datatype":"FP32","shape":[1],"data":[1]}],'
            b'"outputs": [{"name": "y", "parameters": {"shared_memory_region": "o"}}]}',
            None,
            "output 'y': shared memory",
        ),
        (  # echoed in the answer, whose JSON writer stops at 254 levels: a 500 after the model
            b'{"inputs": [{"name":"x","datatype":"FP32","shape":[1],"data":[1]}],'
            b'"parameters": {"note": ' + b"[" * 254 + b"]" * 254 + b"}}",
            None,
            "request: parameter 'note' nests arrays or objects more than 32 deep",
        ),
        (
            b'{"inputs": [{"name":"x","datatype":"FP32","shape":[1],"data":[1]}],'
            b'"outputs": [{"name": "y", "parameters": {"n": '
            + b"[" * 33
            + b"0"
            + b"]" * 33
            + b"}}]}",
            None,
            "output 'y': parameter 'n' nests arrays or objects more than 32 deep",
        ),
        (
            b'{"inputs": [{"name":"x","datatype":"FP32","shape":[1],"data":[1]},'
            b'{"name":"x","datatype":"FP32","shape":[1],"data":[1]}]}',
            None,
            "more than once",
        ),
        (
            b'{"inputs": [{"name":"x","datatype":"FP32","shape":[1],"data":[1]}],'
            b'"outputs": [{"nome": "y"}]}',
            None,
            "string 'name'",
        ),
        (
            b'{"inputs": [{"name":"x","datatype":"FP32","shape":[1],"data":[1]}],'
            b'"parameters": {"binary_data_output": "yes"}}',
            None,
            "must be true or false",
        ),
    ],
)
def test_malformed_requests_say_what_is_wrong(
    body: bytes, header: int | None, message: str
) -> None:
    with pytest.raises(InvalidInput, match=message):
        decode_request(body, header)


def _binary_request(
    size: int, payload: bytes, datatype: str = "FP32", shape: list[int] | None = None
) -> tuple[bytes, int]:
    header = orjson.dumps(
        {
            "inputs": [
                {
                    "name": "x",
                    "datatype": datatype,
                    "shape": shape or [2],
                    "parameters": {"binary_data_size": size},
                }
            ]
        }
    )
    return header + payload, len(header)


@pytest.mark.parametrize(
    ("size", "payload", "datatype", "message"),
    [
        (8, b"\0" * 4, "FP32", "binary_data_size is 8 but only 4 bytes"),
        (4, b"\0" * 4, "FP32", "2 FP32 elements need 8 bytes"),
        (8, b"\0" * 12, "FP32", "binary part of the body has 12 bytes"),
        (-1, b"", "FP32", "binary_data_size must be an integer"),
        (6, struct.pack("<I", 9) + b"ab", "BYTES", "claims 9 bytes"),
        (2, b"\1\0", "BYTES", "length is cut off"),
        (5, struct.pack("<I", 1) + b"a", "BYTES", "needs 2 BYTES elements, binary data holds 1"),
        (
            12,
            struct.pack("<I", 0) * 3,
            "BYTES",
            "holds more than the 2 BYTES elements its shape needs",
        ),
        (2, b"\x01\xff", "BOOL", "a BOOL element is one byte, 0 or 1; one is 255"),
        (2, b"\x02\x00", "BOOL", "a BOOL element is one byte, 0 or 1; one is 2"),
    ],
)
def test_malformed_binary_data_is_refused(
    size: int, payload: bytes, datatype: str, message: str
) -> None:
    body, length = _binary_request(size, payload, datatype)
    with pytest.raises(InvalidInput, match=message):
        decode_request(body, length)


def test_millions_of_empty_bytes_elements_are_refused_before_unpacking() -> None:
    """8 M empty BYTES elements are 32 MB behind a tiny JSON header: refused by their count,
    before a single one becomes an object."""
    count = 8_000_000
    body, length = _binary_request(4 * count, b"\0" * (4 * count), "BYTES", [count])
    with pytest.raises(
        PayloadTooLarge, match=f"has {count} BYTES elements; the limit is {MAX_BYTES_ELEMENTS}"
    ):
        decode_request(body, length)


def test_an_output_requested_twice_is_refused() -> None:
    """Each copy would be encoded again: 100,000 copies turned 2 MB into 710 MB."""
    body = orjson.dumps(
        {
            "inputs": [{"name": "x", "datatype": "FP32", "shape": [1], "data": [1]}],
            "outputs": [{"name": "y"}, {"name": "z"}, {"name": "y"}],
        }
    )
    with pytest.raises(InvalidInput, match="output 'y' is requested more than once"):
        decode_request(body)


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("abc", "must be one integer"),
        ("0", "but the body has"),
        ("999", "but the body has"),
        # int() read each of these as a length (a 200)
        (" 14 ", "must be one integer, its digits alone"),
        ("+14", "must be one integer"),
        ("1_4", "must be one integer"),
        ("١٤", "must be one integer"),  # Arabic-Indic digits
        ("14, 5", "must be one integer"),  # the header twice (InferFastPath joins repeats)
    ],
)
def test_lying_header_length_is_refused(value: str, message: str) -> None:
    with pytest.raises(InvalidInput, match=message):
        parse_header_length(value, 100)


def test_header_length_that_cuts_json_short_is_refused() -> None:
    body, length = _binary_request(8, b"\0" * 8)
    with pytest.raises(InvalidInput, match="not valid JSON"):
        decode_request(body, length - 3)


@settings(max_examples=300)
@given(body=st.binary(max_size=300), header=st.one_of(st.none(), st.integers(1, 300)))
def test_arbitrary_bytes_never_raise_anything_but_invalid_input(
    body: bytes, header: int | None
) -> None:
    with contextlib.suppress(InvalidInput):
        length = parse_header_length(None if header is None else str(header), len(body))
        decode_request(body, length)


@settings(max_examples=200)
@given(
    tensor=st.fixed_dictionaries(
        {},
        optional={
            "name": st.one_of(st.text(max_size=3), st.integers(), st.none()),
            "datatype": st.sampled_from([*TO_NUMPY, "X", 3]),
            "shape": st.one_of(st.lists(st.integers(-2, 2**40), max_size=4), st.text(max_size=2)),
            "data": st.recursive(
                st.one_of(
                    st.integers(-(2**70), 2**70),
                    st.floats(),
                    st.text(max_size=3),
                    st.booleans(),
                    st.none(),
                ),
                lambda children: st.lists(children, max_size=4),
                max_leaves=12,
            ),
            "parameters": st.one_of(
                st.dictionaries(st.just("binary_data_size"), st.integers(-5, 50)), st.integers()
            ),
        },
    )
)
def test_random_json_tensors_never_raise_anything_but_invalid_input(tensor: dict[str, Any]) -> None:
    body = json.dumps({"inputs": [tensor]}).encode()
    # a client's error either way: 400, or 413 for more BYTES elements than the server holds
    with contextlib.suppress(InvalidInput, PayloadTooLarge):
        decode_request(body)


@pytest.mark.parametrize("datatype", ["FP16", "FP32", "FP64", "BF16"])
def test_nan_and_infinities_travel_in_json_as_proto3_strings(datatype: str) -> None:
    values = np.array([[1.5, np.nan, np.inf], [-np.inf, -0.0, 2.0]])
    data = bf16_bits(values) if datatype == "BF16" else values.astype(TO_NUMPY[datatype])
    result = InferenceResult(
        "m", "1", None, [OutputTensor("y", datatype, data)], {}, {}, None, True
    )
    body, headers = encode_result(result, False)
    assert headers["content-type"] == "application/json"
    sent = orjson.loads(body)["outputs"][0]["data"]
    assert sent == [1.5, "NaN", "Infinity", "-Infinity", -0.0, 2.0]  # not null: a value
    if datatype != "BF16":  # ml_dtypes' bfloat16 takes no strings: binary carries BF16 exactly
        parsed = triton.InferResult.from_response_body(body).as_numpy("y")
        np.testing.assert_array_equal(parsed, values.astype(TO_NUMPY[datatype]))
    # what an answer says, a request may say back
    request = orjson.dumps(
        {"inputs": [{"name": "x", "datatype": datatype, "shape": [2, 3], "data": sent}]}
    )
    np.testing.assert_array_equal(decode_request(request).inputs[0].data.reshape(2, 3), data)


def test_finite_json_outputs_keep_numpys_own_encoding() -> None:
    data = np.array([0.1, 2.5], np.float32)
    result = InferenceResult("m", "1", None, [OutputTensor("y", "FP32", data)], {}, {}, None, True)
    body, _ = encode_result(result, False)
    assert b'"data":[0.1,2.5]' in body


def test_v1_predictions_carry_nan_and_infinities_as_strings() -> None:
    rows = np.array([[np.nan, 1.0], [np.inf, -np.inf]], np.float32)
    one = InferenceResult("m", "1", None, [], {"y": rows}, {}, None, True)
    assert orjson.loads(v1.encode_predictions(one))["predictions"] == [
        ["NaN", 1.0],
        ["Infinity", "-Infinity"],
    ]
    two = InferenceResult("m", "1", None, [], {"y": rows, "z": rows[:, :1]}, {}, None, True)
    assert orjson.loads(v1.encode_predictions(two))["predictions"][1] == {
        "y": ["Infinity", "-Infinity"],
        "z": ["Infinity"],
    }


def test_v1_predictions_of_one_value_a_row_are_numbers_of_any_numpy_type() -> None:
    """onnxruntime's INT64 outputs are numpy ``longlong``, which orjson refuses: a model
    answering one class id a row was a 500 on v1 (v2 and gRPC carry whole arrays)."""
    ids = np.array([3, 7], np.longlong)
    flags = np.array([True, False])
    scores = np.array([np.nan, 0.5], np.float32)
    one = InferenceResult("m", "1", None, [], {"cls": ids}, {}, None, True)
    assert orjson.loads(v1.encode_predictions(one))["predictions"] == [3, 7]
    three = InferenceResult(
        "m", "1", None, [], {"cls": ids, "pos": flags, "s": scores}, {}, None, True
    )
    assert orjson.loads(v1.encode_predictions(three))["predictions"] == [
        {"cls": 3, "pos": True, "s": "NaN"},
        {"cls": 7, "pos": False, "s": 0.5},
    ]


def test_code_answers_carry_numpy_values_nan_and_infinities_as_tensors_do() -> None:
    """A pipeline's answer with NaN was written null, which reads back as no value."""
    answer = {
        "x": float("nan"),
        "y": np.float32("inf"),
        "id": np.array([5], np.longlong)[0],
        "rows": [(1.0, -np.inf)],
        "kept": None,
        "v": np.array([np.nan, 2.0]),
        "o": np.array([np.nan, "a"], dtype=object),
    }
    assert orjson.loads(json_answer(answer)) == {
        "x": "NaN",
        "y": "Infinity",
        "id": 5,
        "rows": [[1.0, "-Infinity"]],
        "kept": None,
        "v": ["NaN", 2.0],
        "o": ["NaN", "a"],
    }
    assert json_answer({"label": "cat", "p": np.float32(0.5)}) == b'{"label":"cat","p":0.5}'


def test_a_binary_answer_is_held_once_beside_its_outputs() -> None:
    """A copy of each output and then their join would hold the answer twice (#28 finding 14)."""
    data = np.arange(8 << 20, dtype=np.float32).reshape(2, -1)  # 32 MiB, made before counting
    result = InferenceResult("m", "1", None, [OutputTensor("a", "FP32", data)], {}, {}, None, True)
    tracemalloc.start()
    try:
        body, headers = encode_result(result, True)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    header = int(headers["inference-header-content-length"])
    assert np.array_equal(np.frombuffer(body, "<f4", offset=header), data.reshape(-1))
    assert peak < 1.3 * data.nbytes, f"peak {peak >> 20} MiB for {data.nbytes >> 20} MiB"


def test_true_among_a_tensors_numbers_is_refused_in_a_body_that_has_it() -> None:
    """The body's text is looked at once for true/false, and only then every value: a W2
    request paid 2.4 µs for the scan in each body."""

    def body(data: list[object], name: str = "x") -> bytes:
        return orjson.dumps(
            {"inputs": [{"name": name, "datatype": "INT64", "shape": [len(data)], "data": data}]}
        )

    with pytest.raises(InvalidInput, match="true and false are not INT64 values"):
        decode_request(body([5, True, 7]))
    assert decode_request(body([5, 1, 7])).inputs[0].data.tolist() == [5, 1, 7]
    # the word elsewhere (a name) only costs the scan, and the numbers are numbers
    assert decode_request(body([0, 1], name="is_true")).inputs[0].data.tolist() == [0, 1]


def test_v1_base64_wrapped_in_lines_is_read_as_its_data() -> None:
    """`base64` wraps at 76 columns and MIME encoders at 76 with CRLF: such an instance was
    refused "Only base64 data is allowed", not saying the line breaks were the matter."""
    import base64

    data = bytes(range(256)) * 3
    flat = base64.b64encode(data).decode()
    lines = [flat[i : i + 76] for i in range(0, len(flat), 76)]
    for wrapped in ("\n".join(lines) + "\n", "\r\n".join(lines)):
        body = orjson.dumps({"instances": [{"b64": wrapped}]})
        assert v1.decode_predict("m", body, "application/json").raw == [data]
    with pytest.raises(InvalidInput, match=r"instances\[0\]\.b64 is not valid base64"):
        v1.decode_predict("m", orjson.dumps({"instances": [{"b64": "ab\ncd!"}]}), "")


def test_v1_instances_beside_inputs_are_refused_not_half_read() -> None:
    """v1's columnar ``inputs`` beside ``instances`` was ignored, the request answered 200."""
    body = orjson.dumps({"instances": [[1.0]], "inputs": [1]})
    with pytest.raises(InvalidInput, match="send 'instances' or 'inputs', not both"):
        v1.decode_predict("m", body, "application/json")


def test_v1_columnar_inputs_alone_are_said_to_be_not_taken() -> None:
    body = orjson.dumps({"inputs": {"x": [[1.0]]}})
    with pytest.raises(InvalidInput, match=r"v1's columnar form .* is not taken; send"):
        v1.decode_predict("m", body, "application/json")


def test_an_encoded_item_with_other_keys_is_refused_not_half_read() -> None:
    """``{"b64": ..., "x": 1}`` was answered 200, its ``x`` dropped without a word."""
    for instances in ([{"b64": "eyJhIjoxfQ==", "x": 1}], [[1.0], {"b64": "AA==", "y": 2}]):
        with pytest.raises(InvalidInput, match=r"""has keys \['[xy]'\] beside "b64"; an enc"""):
            v1.decode_predict("m", orjson.dumps({"instances": instances}), "application/json")
