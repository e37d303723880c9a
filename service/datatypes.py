"""Open Inference Protocol datatypes ↔ numpy dtypes.

numpy has no bfloat16. A BF16 tensor is held as its 2-byte bit patterns in a ``uint16`` array,
which is exactly Triton's binary layout and gRPC's raw contents, and what onnxruntime and torch
take as bfloat16 (``OrtValue`` element type 16, ``Tensor.view(torch.bfloat16)``). ``ml_dtypes``
would give numpy a bfloat16, but it is not in the runtime lock (onnx brings it, and onnx is a
build-time dependency only): a dependency for two pure functions below is not worth it. Values
enter and leave as floats only where the protocol speaks in numbers (JSON, v1 rows, casts):
:func:`from_values` and :func:`as_values` are the one place that happens.
"""

from __future__ import annotations

from typing import Any

import numpy as np

TO_NUMPY: dict[str, np.dtype[np.generic]] = {
    "BOOL": np.dtype(np.bool_),
    "UINT8": np.dtype(np.uint8),
    "UINT16": np.dtype(np.uint16),
    "UINT32": np.dtype(np.uint32),
    "UINT64": np.dtype(np.uint64),
    "INT8": np.dtype(np.int8),
    "INT16": np.dtype(np.int16),
    "INT32": np.dtype(np.int32),
    "INT64": np.dtype(np.int64),
    "FP16": np.dtype(np.float16),
    "FP32": np.dtype(np.float32),
    "FP64": np.dtype(np.float64),
    "BF16": np.dtype(np.uint16),  # bit patterns: see the module's docstring
    "BYTES": np.dtype(np.object_),
}
FROM_NUMPY: dict[np.dtype[np.generic], str] = {
    dtype: name for name, dtype in TO_NUMPY.items() if name != "BF16"
}
"""A numpy array's datatype (uint16 is UINT16: BF16 bit patterns say so themselves)."""


def bf16_bits(values: np.ndarray) -> np.ndarray:
    """Floats → the bit patterns of the nearest bfloat16 (ties to even), as ``uint16``.

    float64 is first narrowed to float32 rounding to odd, so that the second rounding (to
    bfloat16, 16 bits fewer) is correctly rounded from the original value: narrowing to nearest
    twice would round some values just past a bfloat16 tie the wrong way. NaN stays NaN (made
    quiet), infinities and signed zeros stay themselves, and values beyond bfloat16's largest
    finite one round to infinity as IEEE 754 says.
    """
    values = np.asarray(values)
    if values.dtype == np.float64:
        with np.errstate(over="ignore", invalid="ignore"):
            single = values.astype(np.float32)
            bits = single.view(np.uint32).copy()
            wide = single.astype(np.float64)
            inexact = (wide != values) & ~np.isnan(values)
            # round to nearest went away from zero: step back one float32 towards it
            bits[inexact & (np.abs(wide) > np.abs(values))] -= 1
        bits[inexact] |= 1
    else:
        bits = values.astype(np.float32).view(np.uint32)
    rounded = (bits + (0x7FFF + ((bits >> 16) & 1))) >> 16
    quiet_nan = (bits >> 16) | 0x0040
    nan = (bits & 0x7FFFFFFF) > 0x7F800000
    return np.where(nan, quiet_nan, rounded).astype(np.uint16)


def bf16_floats(bits: np.ndarray) -> np.ndarray:
    """bfloat16 bit patterns → the same values as float32 (exact: bfloat16 is float32's top
    half)."""
    return (np.asarray(bits, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)


def from_values(values: Any, datatype: str) -> np.ndarray:
    """Numbers (a nested list, a scalar, an array) → an array as tensorgate holds ``datatype``."""
    if datatype == "BF16":
        return bf16_bits(np.asarray(values, dtype=np.float64))
    return np.asarray(values, dtype=TO_NUMPY[datatype])


def as_values(array: np.ndarray, datatype: str) -> np.ndarray:
    """An array as tensorgate holds ``datatype`` → its values as numpy numbers (BF16: float32)."""
    return bf16_floats(array) if datatype == "BF16" else array


NON_FINITE_JSON = {"NaN": float("nan"), "Infinity": float("inf"), "-Infinity": float("-inf")}
"""How JSON carries the floats it has no numbers for: proto3's JSON mapping of ``float`` and
``double``. orjson would write ``null`` for each, which reads back as no value at all; these
strings read back as themselves (``float()`` and numpy parse them, so tritonclient's
``as_numpy`` does too), and inputs accept them the same way."""


def json_values(values: np.ndarray) -> np.ndarray | list[Any]:
    """Numbers as a JSON answer carries them: ``values`` itself (orjson writes it) while each is
    finite, else nested lists in which NaN, +inf and -inf are :data:`NON_FINITE_JSON`'s strings."""
    if values.dtype.kind != "f" or np.isfinite(values).all():
        return values
    held = np.empty(values.shape, dtype=object)
    held.flat[:] = list(values.flat)  # numpy scalars: orjson writes each at its own precision
    held[np.isnan(values)] = "NaN"
    held[values == np.inf] = "Infinity"
    held[values == -np.inf] = "-Infinity"
    listed: list[Any] = held.tolist()
    return listed


def cast(array: np.ndarray, given: str, wanted: str) -> np.ndarray:
    """``array`` of datatype ``given`` converted to ``wanted`` (numpy's casting rules)."""
    if "BF16" not in (given, wanted):
        return array.astype(TO_NUMPY[wanted])
    return from_values(as_values(array, given).astype(np.float64), wanted)
