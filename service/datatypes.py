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

import base64
import binascii
from typing import Any

import numpy as np
import orjson

MAX_BYTES_ELEMENTS = 65_536
"""Most elements one BYTES tensor may hold: each becomes a Python object (an encoded image or a
text a row), far costlier than a number, so TG_MAX_TENSOR_ELEMENTS is no bound for them."""

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


INTEGER_RANGES: dict[str, tuple[int, int]] = {
    name: (int(info.min), int(info.max))
    for name, info in (
        ("UINT8", np.iinfo(np.uint8)),
        ("UINT16", np.iinfo(np.uint16)),
        ("UINT32", np.iinfo(np.uint32)),
        ("UINT64", np.iinfo(np.uint64)),
        ("INT8", np.iinfo(np.int8)),
        ("INT16", np.iinfo(np.int16)),
        ("INT32", np.iinfo(np.int32)),
        ("INT64", np.iinfo(np.int64)),
    )
}
LARGEST: dict[str, float] = {
    "FP16": float(np.finfo(np.float16).max),
    "FP32": float(np.finfo(np.float32).max),
    "FP64": float(np.finfo(np.float64).max),
    "BF16": 3.3895313892515355e38,  # (2 − 2⁻⁷) × 2¹²⁷
}
"""The largest finite value of each float datatype."""
FINITE_BELOW: dict[str, float] = {
    "FP16": 65520.0,  # 65504 and half its last step, 32
    "FP32": 2.0**128 - 2.0**103,
    "BF16": 2.0**128 - 2.0**119,
}
"""Below this magnitude a number rounds to a finite value of the datatype, its largest at
most: 3.4028235e+38, the shortest decimal of FP32's largest (numpy's and orjson's way of
writing it), lies past the largest itself and was refused as past FP32's range."""


def json_strings(values: Any, root: str = "") -> np.ndarray:
    """JSON's values for a BYTES tensor (a nested list, or one value): each a string (encoded
    as UTF-8) or ``{"b64": ...}`` (its bytes, as KServe v1 sends binary values); ValueError
    naming what is neither, and at most :data:`MAX_BYTES_ELEMENTS` of them. ``root``: what
    ragged lists' paths index (:func:`unlike`)."""
    given = np.array(values, dtype=object)  # nested lists of one length: the tensor's shape
    if given.size > MAX_BYTES_ELEMENTS:
        raise ValueError(f"{given.size} BYTES elements; the limit is {MAX_BYTES_ELEMENTS}")
    flat = given.reshape(-1)
    out = np.empty(flat.shape, dtype=object)
    for index, value in enumerate(flat):
        if isinstance(value, list):  # numpy kept a list where lengths differ
            raise ValueError(unlike(values, root))
        out[index] = json_bytes(value)
    return out.reshape(given.shape)


def json_bytes(value: Any) -> bytes:
    """One JSON value of BYTES: a string (as UTF-8) or ``{"b64": ...}`` (its bytes); ValueError
    saying what else it is."""
    if isinstance(value, str):
        return value.encode()
    if isinstance(value, dict) and set(value) == {"b64"} and isinstance(value["b64"], str):
        try:
            return b64_bytes(value["b64"])
        except (binascii.Error, ValueError):
            raise ValueError("a {'b64': ...} value is not valid base64") from None
    raise ValueError(f"{json_kind(value)} is not a string (or {{'b64': ...}})")


MAX_NESTING = 32
"""How deep JSON data is looked through for where it stops being one tensor."""
MAX_LOOKED_AT = 100_000
"""How many of its elements are looked at for that, at most (then it says only that)."""


def unlike(values: Any, root: str = "") -> str:
    """Where nested JSON lists stop being one tensor's: the first element (depth first) unlike
    what the first elements make the tensor's shape (a string among lists, a list of another
    length), or nesting past :data:`MAX_NESTING` (numpy takes 64 dims at most). At most
    :data:`MAX_LOOKED_AT` elements are looked at, each once, and a path is written only for
    the one named: a bad body costs no more than numpy's own attempt. ``root``: what a path's
    first index names, ``{}`` standing for it (``instances[{}].cat``: v1's ``instances[1].cat``;
    without ``{}``, the first index is left out: the values were wrapped in a list)."""
    generic = "its nested lists are not all of one length"
    shape: list[int] = []
    first = values
    while isinstance(first, list):
        if len(shape) == MAX_NESTING:
            return f"it nests lists more than {MAX_NESTING} deep"
        shape.append(len(first))
        if not first:
            break
        first = first[0]
    if not isinstance(values, list):
        return generic
    stack = [iter(values)]
    path = [-1]  # the index of each level's element being looked at
    looked_at = 0
    while stack:
        element = next(stack[-1], _END)
        if element is _END:
            stack.pop()
            path.pop()
            continue
        path[-1] += 1
        looked_at += 1
        if looked_at > MAX_LOOKED_AT:
            return generic
        depth = len(stack)
        wanted = shape[depth] if depth < len(shape) else None
        if wanted is not None and isinstance(element, list) and len(element) == wanted:
            stack.append(iter(element))
            path.append(-1)
        elif wanted is not None or isinstance(element, list):
            where, like = _path(root, path), _path(root, [0] * len(path))
            expected = f"a list of {wanted}" if wanted is not None else _shape_word(first)
            return f"{generic}: {where} is {_shape_word(element)}, {like} {expected}"
    return generic


_END = object()


def _path(root: str, path: list[int]) -> str:
    """``[1][0]``, or under ``root`` (:func:`unlike`) ``instances[1].cat[0]``."""
    if not root:
        return "".join(f"[{i}]" for i in path)
    return root.format(path[0]) + "".join(f"[{i}]" for i in path[1:])


def _shape_word(value: Any) -> str:
    if isinstance(value, list):
        return f"a list of {len(value)}"
    if isinstance(value, int | float) and not isinstance(value, bool):
        return "a number"
    return json_kind(value)


def article(datatype: str) -> str:
    """The article read before ``datatype``: an INT64, an FP32; a UINT8, a BOOL, a BF16."""
    return "an" if datatype.startswith(("INT", "FP")) else "a"


def json_kind(value: Any) -> str:
    """What a JSON value is, in JSON's words, for an error naming what came."""
    return _JSON_KINDS.get(type(value), type(value).__name__)


_JSON_KINDS = {
    dict: "an object",
    list: "a list",
    str: "a string",
    bool: "a boolean",
    int: "a number",
    float: "a number",
}
_JSON_KINDS[type(None)] = "null"


def json_numbers(
    values: Any, datatype: str, bools_possible: bool = True, root: str = ""
) -> np.ndarray:
    """JSON's values for a tensor (a nested list, or one value) → an array as tensorgate holds
    ``datatype``, each value of the type it names: ValueError saying which one is not (a
    fraction, a string or true/false for an integer type, or a value past its range; a
    string other than :data:`NON_FINITE_JSON`'s, or true/false, for a float type, or a number
    past its range; anything but true/false for BOOL). numpy alone would make 1.9 the id 1,
    "7" the id 7, true the value 1 (alone, or beside numbers), 300 the INT8 44 and 1e300 the
    FP32 inf, each silently. ``bools_possible`` False: the JSON text had neither ``true`` nor
    ``false``, so the values are not looked through for them. ``root``: what ragged lists'
    paths index (:func:`unlike`).
    """
    try:
        given = np.asarray(values)
    except ValueError:  # numpy's words: "inhomogeneous shape after 1 dimensions"
        raise ValueError(unlike(values, root)) from None
    kind = given.dtype.kind
    target = TO_NUMPY[datatype]
    if given.size == 0:
        return given.astype(target)
    if datatype == "BOOL":
        if kind != "b":
            raise ValueError(f"{_first(given)} is not true or false")
        return given
    if kind == "b" or (kind in "iuf" and bools_possible and _bools_among(values, given)):
        raise ValueError(f"true and false are not {datatype} values")
    if target.kind in "iu" and datatype != "BF16":
        if kind in "US":
            raise ValueError(f"{_first_of(values, str)} is not an integer ({datatype})")
        return _integers(values, given, datatype, target)
    if kind in "USO":  # strings (only the names of the non-finite floats), null, huge ints
        try:
            given = np.asarray(list(_non_finite(values)), dtype=np.float64).reshape(given.shape)
        except OverflowError:
            raise ValueError(f"an integer is past {datatype}'s range") from None
    # narrowed, a value past the type's range would become ±inf (the test is also false when
    # any is NaN or ±inf: they are looked at then)
    if datatype != "FP64" and not np.abs(given).max() < (limit := FINITE_BELOW[datatype]):
        past = np.isfinite(given) & (np.abs(given) >= limit)
        if past.any():
            value = given[past][0].item()
            raise ValueError(f"{value!r} is past {datatype}'s range (±{LARGEST[datatype]:g})")
    if datatype == "BF16":
        return bf16_bits(given.astype(np.float64))
    return given.astype(target, copy=False)


def _bools_among(values: Any, given: np.ndarray) -> bool:
    """Whether JSON's true or false is among ``values``, which numpy read as numbers
    (``given``): only where a value is 0 or 1 is each value looked at. Even so it cost a row
    of 64 floats 2.4 µs, so v2 calls it only for a body whose text has ``true`` or ``false``."""
    if not ((given == 0) | (given == 1)).any():
        return False
    return _has_bool(values)


def _has_bool(values: Any) -> bool:
    if type(values) is not list:
        return type(values) is bool
    if values and type(values[0]) is list:
        return any(_has_bool(row) for row in values)
    return bool in set(map(type, values))


def _integers(
    values: Any, given: np.ndarray, datatype: str, target: np.dtype[np.generic]
) -> np.ndarray:
    """Integers (or floats of integral value: 1.0 is the id 1, 1.5 is no id) of ``datatype``'s
    range as its array: ``values`` as sent, ``given`` as numpy read them."""
    kind = given.dtype.kind
    if kind == "O":  # integers past uint64, or values of no number type (null)
        for value in given.flat:
            if isinstance(value, float) and value.is_integer():
                continue
            if not isinstance(value, int) or isinstance(value, bool):
                raise ValueError(f"{_json(value)} is not an integer ({datatype})")
        return _exact_integers(given, datatype, target)
    if kind == "f":
        fractions = given[np.floor(given) != given]  # NaN and ±inf among them
        if fractions.size:
            raise ValueError(f"{fractions[0].item()!r} is not an integer ({datatype})")
        if not np.abs(given).max() < _EXACT_FLOATS:
            return _exact_integers(np.array(values, dtype=object), datatype, target)
    low, high = given.min(), given.max()
    _check_range(datatype, int(low), int(high))
    return given.astype(target, copy=False)


_EXACT_FLOATS = 2.0**53
"""Every integer of smaller magnitude is a float64, so the floats numpy read below it are the
values sent. Past it, an integer numpy read as a float may have been rounded: one beside a float
(INT64's [9007199254740993, 1.0] became [9007199254740992, 1]), or one past int64's largest
beside a small one (UINT64's [9223372036854775809, 0, 1] became [9223372036854775808, 0, 1];
18446744073709551615 beside 0 became 2⁶⁴, and was refused)."""


def _exact_integers(sent: np.ndarray, datatype: str, target: np.dtype[np.generic]) -> np.ndarray:
    """``sent``: the values as sent (Python ints, and floats of integral value), an object array
    → ``datatype``'s array, each value exact: Python compares ints and floats exactly, and numpy
    converts each Python int as itself. Taken only for the few requests whose values numpy may
    have rounded (:data:`_EXACT_FLOATS`); it still loops in C, at two to three times the cost
    of numpy's own reading."""
    low = sent.min()
    if low <= _INT64_LOW and any(type(v) is float and v <= _INT64_LOW for v in sent.flat):
        # JSON's reader gives an integer below int64's range as a float, which rounds to the
        # lowest int64 from up to 1,024 below it: taken as sent, -9223372036854775809 was
        # served as -9223372036854775808
        low_end, high_end = INTEGER_RANGES[datatype]
        raise ValueError(
            f"a value is below {datatype}'s range [{low_end}, {high_end}] (or is {_INT64_LOW:.0f}"
            " written as a float, which reads the same as one below it: write it as an integer)"
        )
    _check_range(datatype, int(low), int(sent.max()))
    return sent.astype(target)


_INT64_LOW = -(2.0**63)


def _check_range(datatype: str, low: int, high: int) -> None:
    """ValueError unless ``low`` and ``high`` lie within ``datatype``'s range."""
    low_end, high_end = INTEGER_RANGES[datatype]
    if low < low_end or high > high_end:
        raise ValueError(
            f"values must lie within {datatype}'s [{low_end}, {high_end}]; got values from "
            f"{_said(low)} to {_said(high)}"
        )


def b64_bytes(text: str) -> bytes:
    """A ``{"b64": ...}`` value's bytes: strict base64, or base64 wrapped in lines (``base64``
    wraps at 76 columns, MIME encoders with CRLF), whose line breaks are not the data's.
    binascii.Error (or ValueError) for anything else."""
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        unwrapped = "".join(text.split())
        if len(unwrapped) == len(text):
            raise
        return base64.b64decode(unwrapped, validate=True)


def json_said(value: Any) -> str:
    """A JSON value as the client sent it where it is short (``true``, ``2.5``, ``-1``,
    ``1e+23``), else what it is (:func:`json_kind`): ``[true, 2]`` told ``true``, not ``True``."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return _said(value)
    if isinstance(value, float):
        return f"{value:g}" if abs(value) > 2**64 else repr(value)
    return json_kind(value)


def _said(value: int) -> str:
    """An integer as the client sent it: past 64 bits it came as a float (JSON's readers
    take no larger integer), 1e+23, not the float's exact 99999999999999991611392."""
    return f"{float(value):g}" if abs(value) > 2**64 else str(value)


def _non_finite(values: Any) -> Any:
    """Each of ``values`` (nested lists), a number, or NON_FINITE_JSON's float for its name."""
    for value in values if isinstance(values, list) else [values]:
        if isinstance(value, list):
            yield from _non_finite(value)
        elif isinstance(value, str):
            if value not in NON_FINITE_JSON:
                raise ValueError(
                    f"{_json(value)} is not a number (a string stands only for "
                    f"{', '.join(NON_FINITE_JSON)})"
                )
            yield NON_FINITE_JSON[value]
        elif isinstance(value, bool) or not isinstance(value, int | float):
            raise ValueError(f"{_json(value)} is not a number")
        else:
            yield value


def _first_of(values: Any, kind: type) -> str:
    """The first value of type ``kind`` among ``values`` (nested lists), as JSON writes it; ""
    when there is none."""
    for value in values if isinstance(values, list) else [values]:
        if isinstance(value, list):
            if found := _first_of(value, kind):
                return found
        elif isinstance(value, kind):
            return _json(value)
    return ""


def _first(given: np.ndarray) -> str:
    """The first value of ``given`` as JSON would write it."""
    return _json(given.flat[0])


def _json(value: Any) -> str:
    """One value (Python's or numpy's) as JSON would write it, where it is short: a string's
    first :data:`SAID_CHARACTERS` characters, an object or a list named by its kind (a
    ``{"b64": ...}`` sent for a number was echoed whole: 4 KB of base64 in the message)."""
    if isinstance(value, np.generic):
        value = value.item()
    if isinstance(value, str):
        if len(value) > SAID_CHARACTERS:
            return f'"{value[:SAID_CHARACTERS]}…" ({len(value)} characters)'
        return f'"{value}"'
    if isinstance(value, dict) and "b64" in value:
        return 'an object {"b64": ...}'
    return json_said(value)


SAID_CHARACTERS = 32
"""How much of a string sent where a number belongs an error repeats."""


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


def json_answer(answer: Any) -> bytes:
    """An answer made by code (a pipeline's, or v1's predictions) as JSON: numpy values of any
    type as numbers (orjson alone refuses some, such as the ``longlong`` integers onnxruntime
    returns: a 500 for a v1 class id), NaN and ±inf as :data:`NON_FINITE_JSON`'s strings, as
    in tensors (orjson writes ``null``, which reads back as no value). Answers are looked
    through for those only when the first writing has a ``null``."""
    written = orjson.dumps(answer, default=_json_default, option=orjson.OPT_SERIALIZE_NUMPY)
    if b"null" not in written:
        return written
    return orjson.dumps(_finite(answer), default=_json_default, option=orjson.OPT_SERIALIZE_NUMPY)


def _json_default(value: Any) -> Any:
    if isinstance(value, np.generic | np.ndarray):
        return value.tolist()
    raise TypeError(f"{type(value).__name__} is not JSON")


def _finite(value: Any) -> Any:
    """``value`` with each NaN and ±inf as its NON_FINITE_JSON string (containers rebuilt)."""
    if isinstance(value, float | np.floating):
        if np.isfinite(value):
            return value
        return "NaN" if np.isnan(value) else ("Infinity" if value > 0 else "-Infinity")
    if isinstance(value, np.ndarray):
        if value.dtype.kind == "f":
            return json_values(value)
        return _finite(value.tolist()) if value.dtype == object else value
    if isinstance(value, dict):
        return {key: _finite(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(item) for item in value]
    return value


def cast(array: np.ndarray, given: str, wanted: str) -> np.ndarray:
    """``array`` of datatype ``given`` converted to ``wanted``, where each value is one of
    ``wanted``'s: ValueError saying which is not (a fraction, NaN or an infinity for an integer
    type, an integer past its range, a finite number past a float type's). numpy alone made the
    FP64 5.7 the id 5 and -0.5 the id 0, the UINT64 2⁶⁴−1 the INT64 −1, and the FP64 1e300 the
    FP32 inf, each silently (a new user's walk, with ``cast_inputs`` on)."""
    values = as_values(array, given)
    target = TO_NUMPY[wanted]
    if values.size and target.kind in "iu" and wanted != "BF16":
        if values.dtype.kind == "f":
            fractions = values[~np.isfinite(values) | (np.floor(values) != values)]
            if fractions.size:
                raise ValueError(f"{fractions[0].item()!r} is not an integer ({wanted})")
        _check_range(wanted, int(values.min()), int(values.max()))
    elif values.size and (limit := FINITE_BELOW.get(wanted)) is not None:
        floats = values.astype(np.float64)
        past = np.isfinite(floats) & (np.abs(floats) >= limit)
        if past.any():
            value = floats[past][0].item()
            raise ValueError(f"{value!r} is past {wanted}'s range (±{LARGEST[wanted]:g})")
    if "BF16" not in (given, wanted):
        return values.astype(target)
    return from_values(values.astype(np.float64), wanted)
