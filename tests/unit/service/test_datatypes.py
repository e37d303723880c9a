"""BF16 as bit patterns: rounding to nearest even, checked against ml_dtypes and exact
arithmetic, and the conversions every protocol goes through."""

from __future__ import annotations

from fractions import Fraction

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from service.datatypes import as_values, bf16_bits, bf16_floats, cast, from_values

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
