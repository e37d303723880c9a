"""BF16 as bit patterns: rounding to nearest even, checked against ml_dtypes and exact
arithmetic, and the conversions every protocol goes through."""

from __future__ import annotations

import functools
import re
from fractions import Fraction

import ml_dtypes
import numpy as np
import orjson
import pytest
from hypothesis import given
from hypothesis import strategies as st

from service.datatypes import (
    INTEGER_RANGES,
    TO_NUMPY,
    as_values,
    bf16_bits,
    bf16_floats,
    cast,
    from_values,
    json_numbers,
)

pytestmark = pytest.mark.unit

MAX_FINITE = 0x7F7F
INF = 0x7F80


def exact(bits: int) -> Fraction:
    """The value of a finite bfloat16 bit pattern, exactly; infinity as 2**128 (IEEE 754
    rounds to it as if it were the next power of two)."""
    magnitude = bits & 0x7FFF
    value = Fraction(2**128) if magnitude == INF else Fraction(float(bf16_floats(np.uint16(bits))))
    return -abs(value) if bits & 0x8000 else abs(value)


def nearest_even(x: float) -> int:
    """The correctly rounded bfloat16 of ``x`` (finite), by exact comparison of neighbours."""
    start = int(ml_dtypes.bfloat16(x).view(np.uint16))  # within one step of the answer
    sign = start & 0x8000 if x != 0 else (0x8000 if np.signbit(x) else 0)
    magnitudes = {m for m in range((start & 0x7FFF) - 2, (start & 0x7FFF) + 3) if 0 <= m <= INF}
    target = Fraction(x)
    candidates = [sign | m for m in magnitudes]
    return min(candidates, key=lambda b: (abs(exact(b) - target), b & 1))


@given(st.integers(0, 2**32 - 1))
def test_float32_rounds_as_ml_dtypes_does(pattern: int) -> None:
    value = np.array([pattern], np.uint32).view(np.float32)
    ours = bf16_bits(value)
    theirs = value.astype(ml_dtypes.bfloat16).view(np.uint16)
    if np.isnan(value[0]):
        assert np.isnan(bf16_floats(ours)[0])
    else:
        assert ours[0] == theirs[0], hex(pattern)


@given(st.floats(allow_nan=False, allow_infinity=False, width=64))
def test_float64_rounds_correctly_to_nearest_even(x: float) -> None:
    assert int(bf16_bits(np.array([x]))[0]) == nearest_even(x)


@pytest.mark.parametrize(
    ("x", "bits"),
    [
        (1 + 2**-8 + 2**-30, 0x3F81),  # float32 would round it onto the tie, then to 1.0
        (1 + 2**-8, 0x3F80),  # a tie: to even
        (1 + 3 * 2**-8, 0x3F82),  # a tie: to even, upwards
        (-0.0, 0x8000),
        (float("inf"), INF),
        (float("-inf"), 0xFF80),
        (3.4e38, INF),  # beyond bfloat16's largest finite value
        (3.39e38, MAX_FINITE),
        (1e-45, 0x0000),  # below half the smallest subnormal
        (-1e-40, 0x8001),  # a subnormal
    ],
)
def test_edge_values(x: float, bits: int) -> None:
    assert int(bf16_bits(np.array([x]))[0]) == bits
    assert int(bf16_bits(np.array([x], np.float32))[0]) == bits or x == 1 + 2**-8 + 2**-30


def test_nan_stays_nan_and_values_convert_both_ways() -> None:
    nan = bf16_bits(np.array([np.nan, -np.nan]))
    assert np.isnan(bf16_floats(nan)).all()
    array = from_values([[1.5, -2.0], [0.1, 65504]], "BF16")
    assert array.dtype == np.uint16 and array.shape == (2, 2)
    np.testing.assert_array_equal(as_values(array, "BF16"), [[1.5, -2.0], [0.10009765625, 65536]])
    np.testing.assert_array_equal(cast(array, "BF16", "FP32"), as_values(array, "BF16"))
    np.testing.assert_array_equal(cast(np.float32([0.1, -0.0]), "FP32", "BF16"), [0x3DCD, 0x8000])
    np.testing.assert_array_equal(cast(np.int32([3, 257]), "INT32", "BF16"), [0x4040, 0x4380])
    assert from_values([1, 2], "INT8").dtype == np.int8


@pytest.mark.parametrize(
    ("values", "datatype", "words"),
    [
        ([1.9], "INT64", "1.9 is not an integer (INT64)"),
        ([[0], [0.5]], "INT32", "0.5 is not an integer (INT32)"),
        ([5, "7"], "INT64", '"7" is not an integer (INT64)'),
        ([True, False], "INT64", "true and false are not INT64 values"),
        ([None], "INT64", "null is not an integer (INT64)"),
        ([300], "INT8", "values must lie within INT8's [-128, 127]; got values from 300 to 300"),
        ([-1], "UINT8", "values must lie within UINT8's [0, 255]"),
        ([10**20], "INT64", "values must lie within INT64's"),
        ([-1, 2**63], "INT64", "values must lie within INT64's"),  # numpy holds both as floats
        ([-1, 2**64 - 1], "UINT64", "got values from -1 to 18446744073709551615"),  # not 2**64
        ([2.0**63, 1], "INT64", "got values from 1 to 9223372036854775808"),
        ([2**64, 1.0], "UINT64", "got values from 1 to 18446744073709551616"),  # numpy: objects
        # JSON's 99999999999999999999999 is the float 1e+23: said so, not as 99999999999999991611392
        ([1, 1e23], "INT64", "got values from 1 to 1e+23"),
        ([2**63 + 1, 0.5], "UINT64", "0.5 is not an integer (UINT64)"),
        ([1e300], "FP32", "1e+300 is past FP32's range (±3.40282e+38)"),
        ([100000], "FP16", "100000 is past FP16's range (±65504)"),
        ([1, 10**300], "FP32", "1e+300 is past FP32's range"),
        ([1e300], "BF16", "1e+300 is past BF16's range"),
        (["7"], "FP32", '"7" is not a number (a string stands only for NaN, Infinity, -Infinity)'),
        # a value that is not short is said by its kind and start, not echoed whole
        ([{"b64": "A" * 4096}], "FP32", 'an object {"b64": ...} is not a number'),
        (["x" * 4096], "FP32", f'"{"x" * 32}…" (4096 characters) is not a number'),
        ([1, {"a": 1}], "INT64", "an object is not an integer"),
        ([1, None], "FP32", "null is not a number"),
        ([True], "FP32", "true and false are not FP32 values"),
        ([5, True, 7], "INT64", "true and false are not INT64 values"),  # numpy: [5, 1, 7]
        ([[0.5, 2.5], [False, 1.5]], "FP32", "true and false are not FP32 values"),
        ([2, "NaN", True], "FP64", "true is not a number"),
        ([1, 0], "BOOL", "1 is not true or false"),
        ([[1, 2], [3]], "FP32", "its nested lists are not all of one length"),
        # which element, where it only said the lists were not of one length
        ([[1, 2], [3]], "FP32", "[1] is a list of 1, [0] a list of 2"),
        ([[1, 2], "text", [3, 4]], "FP32", "[1] is a string, [0] a list of 2"),
        (
            [[[1], [2]], [[1], [2, 3]]],
            "INT64",
            "[1][1] is a list of 2, [0][0] a list of 1",
        ),
        ([[1], 2], "FP32", "[1] is a number, [0] a list of 1"),
        (
            functools.reduce(lambda inner, _: [inner], range(70), 1),  # numpy: 64 dims at most
            "FP32",
            "nests lists more than 32 deep",
        ),
    ],
)
def test_json_values_of_another_type_are_refused_not_converted(
    values: object, datatype: str, words: str
) -> None:
    """numpy alone makes 1.9 the id 1, "7" the id 7, true the value 1, 300 the INT8 44 and 1e300
    the FP32 inf, each silently: a request's values are each of the type its tensor says."""
    with pytest.raises(ValueError, match=re.escape(words)):
        json_numbers(values, datatype)


@pytest.mark.parametrize(
    ("values", "datatype", "want"),
    [
        ([1.0, 2], "INT64", [1, 2]),  # an integral float is that integer
        ([[0, 1], [1, 0]], "INT64", [[0, 1], [1, 0]]),  # 0 and 1 are looked at, and are ids
        ([-128.0, 255], "INT16", [-128, 255]),
        ([2**63], "UINT64", [2**63]),
        ([2**63 + 1, 0, 1], "UINT64", [2**63 + 1, 0, 1]),  # numpy: floats, the first 2**63
        ([2**64 - 1, 0, 1], "UINT64", [2**64 - 1, 0, 1]),  # numpy: 2**64, refused
        ([[2**53 + 1], [1.0]], "INT64", [[2**53 + 1], [1]]),  # numpy: 2**53 beside a float
        ([-(2**63), 2**63 - 1, 0.0], "INT64", [-(2**63), 2**63 - 1, 0]),
        ([1, "NaN", "Infinity", "-Infinity"], "FP32", [1.0, np.nan, np.inf, -np.inf]),
        ([[True], [False]], "BOOL", [[True], [False]]),
        ([1.5, 2], "FP16", [1.5, 2.0]),
        ([], "INT8", []),
        (7, "INT32", 7),
    ],
)
def test_json_values_of_the_tensors_type_convert_exactly(
    values: object, datatype: str, want: object
) -> None:
    got = json_numbers(values, datatype)
    assert got.dtype == TO_NUMPY[datatype]
    np.testing.assert_array_equal(got, np.asarray(want, dtype=TO_NUMPY[datatype]))


@st.composite
def integers_of_a_datatype(draw: st.DrawFn) -> tuple[str, list[int | float]]:
    """An integer datatype and values of its range, some (those a float holds exactly) as
    floats; but int64's lowest, which as a float reads the same as JSON integers below it
    (refused: the test after)."""
    datatype = draw(st.sampled_from(sorted(INTEGER_RANGES)))
    low, high = INTEGER_RANGES[datatype]
    drawn = draw(st.lists(st.tuples(st.integers(low, high), st.booleans()), min_size=1, max_size=8))
    return datatype, [
        float(v) if as_float and float(v) == v and v != -(2**63) else v for v, as_float in drawn
    ]


@given(integers_of_a_datatype())
def test_every_integer_of_a_datatypes_range_is_taken_exactly_whatever_shares_its_list(
    drawn: tuple[str, list[int | float]],
) -> None:
    """numpy reads a list as one type: UINT64's 2**63 + 1 beside 0 became the float 2**63,
    2**64 - 1 the float 2**64 (refused), and INT64's 2**53 + 1 beside 1.0 the float 2**53."""
    datatype, values = drawn
    got = json_numbers(values, datatype)
    assert got.dtype == TO_NUMPY[datatype]
    assert got.tolist() == [int(v) for v in values]


@pytest.mark.parametrize("text", [b"[-9223372036854775809, 1]", b"[1, -9223372036854775900]"])
def test_an_integer_below_int64_is_refused_not_rounded_to_its_lowest(text: bytes) -> None:
    """orjson reads an integer below int64's range as a float, which rounds to -2**63 from up
    to 1,024 below it: INT64's -9223372036854775809 was served as -9223372036854775808."""
    with pytest.raises(ValueError, match="below INT64's range"):
        json_numbers(orjson.loads(text), "INT64")
    assert json_numbers(orjson.loads(b"[-9223372036854775808, 1]"), "INT64").tolist() == [
        -(2**63),
        1,
    ]


@given(st.lists(st.floats(width=32, allow_nan=False, allow_infinity=False), max_size=8))
def test_json_floats_convert_as_numpy_converts_them(values: list[float]) -> None:
    """The checks change no value that fits: the same float32s as numpy's own conversion."""
    np.testing.assert_array_equal(
        json_numbers(values, "FP32"), np.asarray(values, dtype=np.float32)
    )


@pytest.mark.parametrize(
    ("values", "datatype", "want"),
    [
        ([3.4028235e38], "FP32", [np.finfo(np.float32).max]),  # its shortest decimal: numpy's
        ([-3.4028235e38], "FP32", [-np.finfo(np.float32).max]),
        ([65519.0], "FP16", [65504.0]),  # rounds to its largest
    ],
)
def test_a_number_that_rounds_to_the_largest_finite_value_is_taken(
    values: list[float], datatype: str, want: list[float]
) -> None:
    """numpy and orjson write FP32's largest as 3.4028235e+38, just past it: it was refused."""
    np.testing.assert_array_equal(
        json_numbers(values, datatype), np.array(want, TO_NUMPY[datatype])
    )
    with pytest.raises(ValueError, match="past"):
        json_numbers([3.4028236e38 if datatype == "FP32" else 65520.0], datatype)


@pytest.mark.parametrize(
    ("array", "given", "wanted", "words"),
    [  # what numpy's astype did silently: 5, 0, 999, -1, inf
        (np.array([5.7]), "FP64", "INT64", "5.7 is not an integer (INT64)"),
        (np.array([-0.5]), "FP64", "INT64", "-0.5 is not an integer (INT64)"),
        (np.array([1.0, np.nan]), "FP64", "INT64", "nan is not an integer (INT64)"),
        (np.array([np.inf]), "FP32", "INT32", "inf is not an integer (INT32)"),
        (np.array([1e20]), "FP64", "INT64", "values must lie within INT64's"),
        (
            np.array([2**64 - 1], np.uint64),
            "UINT64",
            "INT64",
            "got values from 18446744073709551615",
        ),
        (np.array([300], np.int32), "INT32", "UINT8", "values must lie within UINT8's [0, 255]"),
        (np.array([1e300]), "FP64", "FP32", "1e+300 is past FP32's range (±3.40282e+38)"),
        (np.array([1e5]), "FP32", "FP16", "100000.0 is past FP16's range (±65504)"),
    ],
)
def test_a_cast_refuses_a_value_the_wanted_type_does_not_hold(
    array: np.ndarray, given: str, wanted: str, words: str
) -> None:
    with pytest.raises(ValueError, match=re.escape(words)):
        cast(array, given, wanted)


def test_a_cast_keeps_each_value_the_wanted_type_holds() -> None:
    np.testing.assert_array_equal(cast(np.array([5.0, -2.0]), "FP64", "INT64"), [5, -2])
    floats = cast(np.array([np.inf, -np.inf, np.nan, 3.4028235e38]), "FP64", "FP32")
    assert floats.dtype == np.float32
    np.testing.assert_array_equal(floats, [np.inf, -np.inf, np.nan, np.finfo(np.float32).max])
    np.testing.assert_array_equal(cast(np.array([7], np.int64), "INT64", "FP32"), [7.0])


def test_saying_where_json_data_is_ragged_costs_no_more_than_numpys_attempt() -> None:
    """Siblings alike and cousins not ([[[1]], ..., [[1, 1]]]): the first walk looked at every
    element, writing each one's path, and then said nothing more (a 5.7 MiB body: 4.7 s and
    301 MiB, against 1.2 s before it). Now each element is looked at once, at most 100,000 of
    them, and only the path named is written."""
    import tracemalloc

    from service.datatypes import unlike

    ragged = [[[1]]] * 300_000 + [[[1, 1]]]
    tracemalloc.start()
    said = unlike(ragged)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert said == "its nested lists are not all of one length"  # past what is looked at
    assert peak < 2**20
    assert unlike([[[1]]] * 3 + [[[1, 1]]]).endswith("[3][0] is a list of 2, [0][0] a list of 1")
