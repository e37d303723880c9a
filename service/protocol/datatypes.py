"""Open Inference Protocol datatypes ↔ numpy dtypes."""

from __future__ import annotations

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
    "BYTES": np.dtype(np.object_),
}
FROM_NUMPY: dict[np.dtype[np.generic], str] = {
    dtype: name for name, dtype in TO_NUMPY.items() if name != "BYTES"
}


def datatype_of(array: np.ndarray) -> str:
    """The protocol datatype of an array; object and bytes arrays are BYTES."""
    if array.dtype.kind in ("O", "S", "U"):
        return "BYTES"
    try:
        return FROM_NUMPY[array.dtype]
    except KeyError:
        raise TypeError(f"no Open Inference Protocol datatype for numpy {array.dtype}") from None
