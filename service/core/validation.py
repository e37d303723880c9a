"""Requests against a model's signature: pure checks that run before anything is queued.

A request that fails here never reaches a model, so it can never fail a batch it would have
joined. Every error names the input and says what was expected and what came.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from service.artifacts.shapes import Axis, Dim
from service.datatypes import (
    TO_NUMPY,
    article,
    as_values,
    cast,
    json_numbers,
    json_strings,
)
from service.errors import InvalidInput, ModelExecutionError, PayloadTooLarge
from service.inference import InputTensor
from service.model_config import ModelConfig, TensorConfig
from service.runtimes.base import Signature, shape_fits


def check_inputs(
    inputs: list[InputTensor],
    signature: Signature,
    config: ModelConfig,
    name: str,
    empty: bool = False,
    raw_input: str | None = None,
    ranges_checked: bool = False,
    rows_are: str = "",
) -> dict[str, np.ndarray]:
    """Inputs that fit the signature → the batch to run (cast only where the config opts in);
    with ``empty``, a batch of 0 rows is one (a pipeline's step with nothing to run).
    ``raw_input``: the model's pipeline's input, which its errors name too.
    ``ranges_checked``: the values were held to their ranges already (v1 rows of their own
    lengths, each before it was padded: the padding's zeros are not the client's).
    ``rows_are``: what the client calls a row, ``{}`` its index (v1's ``instances[{}]``), for
    an error to name the row a value is in."""
    declared = {t.name: t for t in signature.inputs}
    given = {t.name: t for t in inputs}
    raw = f", or its raw input '{raw_input}' (BYTES) alone" if raw_input else ""
    if unknown := sorted(set(given) - set(declared)):
        raise InvalidInput(
            f"model '{name}' has no input {unknown}; its inputs are {sorted(declared)}{raw}"
        )
    if missing := sorted(set(declared) - set(given)):
        raise InvalidInput(f"missing input {missing}; model '{name}' takes {sorted(declared)}{raw}")
    batched = config.max_batch_size > 0
    rows: dict[str, int] = {}
    batch = {}
    for spec in signature.inputs:
        tensor = given[spec.name]
        want = ((-1,) if batched else ()) + spec.shape
        data = tensor.data
        if tensor.datatype != spec.datatype and castable(config, tensor.datatype, spec.datatype):
            try:
                data = cast(data, tensor.datatype, spec.datatype)
            except ValueError as exc:
                raise InvalidInput(
                    f"input '{spec.name}': {exc}, so it is not cast from {tensor.datatype} to "
                    f"{spec.datatype} (cast_inputs casts only values the model's type holds)"
                ) from None
        elif tensor.datatype != spec.datatype or not shape_fits(want, tensor.shape):
            raise InvalidInput(
                f"input '{spec.name}': expected {spec.datatype} {list(want)}, "
                f"got {tensor.datatype} {list(tensor.shape)}"
                f"{_short(batched, spec, tensor) if tensor.datatype == spec.datatype else ''}"
            )
        if not shape_fits(want, tensor.shape):
            raise InvalidInput(
                f"input '{spec.name}': expected shape {list(want)}, "
                f"got {list(tensor.shape)}{_short(batched, spec, tensor)}"
            )
        if spec.range is not None and not ranges_checked:
            values = as_values(data, spec.datatype)
            check_range(spec.name, values, spec.range, rows_are=rows_are if batched else "")
        if batched:
            rows[spec.name] = tensor.shape[0]
        batch[spec.name] = data
    if len(set(rows.values())) > 1:
        said = ", ".join(f"'{n}' {r} row{'s' * (r != 1)}" for n, r in sorted(rows.items()))
        raise InvalidInput(f"inputs have different batch sizes (the first dim): {said}")
    if rows and not (empty and 0 in rows.values()):
        check_rows(next(iter(rows.values())), config, name)
    return batch


def _short(batched: bool, spec: TensorConfig, tensor: InputTensor) -> str:
    """What to add where a batched input came one dim short, the likeliest slip: a row's
    lone value sent bare (``{"item_id": 3}`` for rows of shape [1])."""
    if not batched or len(tensor.shape) != len(spec.shape):
        return ""
    lone = " (a row's lone value is sent as [v], not v)" if spec.shape == (1,) else ""
    return f": one dim short; the first dim counts rows, each of shape {list(spec.shape)}{lone}"


def check_range(
    name: str, data: np.ndarray, bounds: tuple[float, float], where: str = "", rows_are: str = ""
) -> None:
    """Every value within ``bounds`` (inclusive): an out-of-range id would fail the batch.
    ``where`` comes before the message (whose values they are); ``rows_are``, what the first
    dim's rows are to the client (``instances[{}]``), names the row of the value said."""
    if data.size == 0:
        return
    low, high = data.min(), data.max()
    if low < bounds[0] or high > bounds[1] or np.isnan(low) or np.isnan(high):
        outside = ~((data >= bounds[0]) & (data <= bounds[1]))  # NaN too
        first = tuple(int(i) for i in np.argwhere(outside)[0])
        count = int(outside.sum())
        shown = _exact(data[first].item())
        at = f"at {list(first)}"
        if rows_are and first:  # "in instances[1] at [0]"
            inside = f" at {list(first[1:])}" if first[1:] else ""
            at = f"in {rows_are.format(first[0])}{inside}"
        raise InvalidInput(
            f"{where}input '{name}': values must lie within [{_exact(bounds[0])}, "
            f"{_exact(bounds[1])}]; got {shown} {at} ({count} value"
            f"{'s' * (count > 1)} outside it)"
        )


def _exact(value: float) -> str:
    """An integer (or an integral float below 2⁵³) as its digits, 2⁶³−1 not 9.22337e+18; any
    other number as ``:g`` writes it."""
    if isinstance(value, int) or (float(value).is_integer() and abs(value) < 2.0**53):
        return str(int(value))
    return f"{value:g}"


def castable(config: ModelConfig, given: str, wanted: str) -> bool:
    """Whether a tensor of datatype ``given`` is cast to the ``wanted`` one the model takes:
    with its ``cast_inputs`` on, numbers only (never to or from BYTES or BOOL: true is no id)."""
    return config.cast_inputs and not {"BYTES", "BOOL"} & {given, wanted}


def check_rows(rows: int, config: ModelConfig, name: str) -> None:
    """At least one row, and no more than one request may carry (the scheduler splits a
    request above max_batch_size across batches; this bounds the work one request asks for)."""
    if rows < 1:
        raise InvalidInput(f"model '{name}': a request needs at least 1 row (got 0)")
    if rows > config.max_request_rows:
        raise PayloadTooLarge(
            f"model '{name}': {rows} rows is above the {config.max_request_rows} one request may "
            "carry (max_request_rows)"
        )


def instance_tensors(
    instances: list[Any], specs: tuple[TensorConfig, ...], batched: bool = True
) -> list[InputTensor]:
    """v1 rows → one tensor per input: plain rows feed the only input, objects name their
    inputs. A model without a batch dim takes one instance as its inputs whole (or, for one
    input, the instances themselves as its tensor)."""
    if not batched and len(instances) == 1:
        (only,) = instances
        if isinstance(only, dict):  # one object naming the inputs, each value whole
            whole = {name: column[0] for name, column in _columns(instances, specs)[0].items()}
            return _tensors_of(whole, True, specs, whole=True)
        if len(specs) == 1 and _depth(only) == len(specs[0].shape):
            return _tensors_of({specs[0].name: only}, False, specs, whole=True)
    return _tensors_of(*_columns(instances, specs), specs)


def ragged_instance_tensors(
    instances: list[Any],
    specs: tuple[TensorConfig, ...],
    axes: Sequence[Axis],
    model: str,
    take: Callable[[int], None],
) -> tuple[list[InputTensor], list[dict[Dim, int]]]:
    """v1 rows whose dynamic dims differ in size from row to row (texts of their own lengths),
    each padded to the largest row's sizes as a training collate pads a batch (zeros, empty
    strings for BYTES), with each row's own sizes to crop its answer back to. Only for a
    model whose padding export measured to leave the answer unchanged. Each row's size is
    checked against the model's range, its values against their inputs' ranges, and the dims of
    one axis (ids and mask) must agree, before anything is padded: InvalidInput naming the
    instance. ``take`` is given the padded
    rows' bytes before they are made (the budget's: a row of 512 tokens among a thousand of
    one pads them all to 512)."""
    columns, named = _columns(instances, specs)
    sizes: list[dict[Dim, int]] = [{} for _ in instances]
    rows_of: dict[str, list[np.ndarray]] = {}
    for spec in specs:
        rows = []
        for index, value in enumerate(columns[spec.name]):
            try:
                root = _root(spec.name, named, index)  # the wrapping list's [0] left out
                row = (
                    json_strings([value], root)
                    if spec.datatype == "BYTES"
                    else json_numbers([value], spec.datatype, root=root)
                )[0]
            except (ValueError, TypeError, OverflowError) as exc:
                raise InvalidInput(
                    f"instances[{index}] for input '{spec.name}' is not {article(spec.datatype)} "
                    f"{spec.datatype} row "
                    f"of shape {list(spec.shape)}: {exc}"
                ) from None
            if not shape_fits(spec.shape, row.shape):
                raise InvalidInput(
                    f"instances[{index}] for input '{spec.name}' has shape {list(row.shape)}, "
                    f"the model takes {list(spec.shape)}"
                )
            if spec.range is not None:
                values = as_values(row, spec.datatype)
                check_range(spec.name, values, spec.range, f"instances[{index}]: ")
            for dim, n in enumerate(row.shape):
                if spec.shape[dim] == -1:
                    sizes[index][spec.name, dim + 1] = n
            rows.append(row)
        rows_of[spec.name] = rows
    for index, own in enumerate(sizes):
        for axis in axes:
            got = [own[dim] for dim in axis.dims if dim in own]
            if len(set(got)) > 1:
                names = ", ".join(f"'{name}' dim {i}" for name, i in axis.dims)
                raise InvalidInput(
                    f"instances[{index}]: inputs {names} must have the same size for model "
                    f"'{model}'; got {got}"
                )
            if got and not axis.min <= got[0] <= axis.max:
                name, dim = axis.dims[0]
                raise InvalidInput(
                    f"instances[{index}]: input '{name}' dim {dim} is {got[0]}; model "
                    f"'{model}' takes {axis.min} to {axis.max} there"
                )
    shapes = {
        name: (len(rows), *(max(n) for n in zip(*(r.shape for r in rows), strict=True)))
        for name, rows in rows_of.items()
    }
    take(sum(int(np.prod(shape)) * rows_of[name][0].itemsize for name, shape in shapes.items()))
    tensors = []
    for spec in specs:
        rows = rows_of[spec.name]
        empty = b"" if spec.datatype == "BYTES" else 0
        array = np.full(shapes[spec.name], empty, rows[0].dtype)
        for index, row in enumerate(rows):
            region: tuple[int | slice, ...] = (index, *(slice(0, n) for n in row.shape))
            array[region] = row
        tensors.append(InputTensor(spec.name, spec.datatype, array.shape, array))
    return tensors, sizes


def _depth(value: Any) -> int:
    """How deep ``value``'s first elements nest in lists."""
    depth = 0
    while isinstance(value, list) and value:
        value, depth = value[0], depth + 1
    return depth


def _columns(instances: list[Any], specs: tuple[TensorConfig, ...]) -> tuple[dict[str, Any], bool]:
    """Each input's values, one a row, and whether the rows were objects naming the inputs."""
    if all(isinstance(item, dict) for item in instances):
        for index, item in enumerate(instances):
            missing = [t.name for t in specs if t.name not in item]
            unknown = sorted(set(item) - {t.name for t in specs})
            if missing or unknown:
                raise InvalidInput(
                    f"instances[{index}] "
                    + (f"lacks input(s) {missing}" if missing else f"names no input {unknown}")
                    + f"; the model takes {[t.name for t in specs]}"
                )
        return {t.name: [item[t.name] for item in instances] for t in specs}, True
    if len(specs) == 1:
        return {specs[0].name: instances}, False
    raise InvalidInput(
        f"the model takes {len(specs)} inputs; send each instance as an object naming them "
        f"({[t.name for t in specs]})"
    )


def _root(name: str, named: bool, index: int | str = "{}") -> str:
    """Where an instance's value for input ``name`` is, for :func:`unlike`'s paths:
    ``instances[{}].cat`` (``{}`` the instance's index), or ``instances[{}]``."""
    escaped = name.replace("{", "{{").replace("}", "}}")
    return f"instances[{index}]" + (f".{escaped}" if named else "")


def _tensors_of(
    columns: dict[str, Any], named: bool, specs: tuple[TensorConfig, ...], whole: bool = False
) -> list[InputTensor]:
    """Each input's values as its tensor. ``named``: the instances were objects naming the
    inputs; ``whole``: one instance is the inputs whole (a model without a batch dim), so a
    path into its values starts at ``instances[0]``."""
    tensors = []
    for spec in specs:
        try:
            values = columns[spec.name]
            root = _root(spec.name, named, 0) + "[{}]" if whole else _root(spec.name, named)
            if spec.datatype == "BYTES":
                array = json_strings(values, root)
            else:
                array = json_numbers(values, spec.datatype, root=root)
        except (ValueError, TypeError, OverflowError) as exc:
            raise InvalidInput(
                f"instances for input '{spec.name}' are not {spec.datatype} rows of shape "
                f"{list(spec.shape)}: {exc}"
            ) from None
        tensors.append(InputTensor(spec.name, spec.datatype, array.shape, array))
    return tensors


def encoded_items(tensor: InputTensor, name: str) -> list[bytes]:
    """The encoded images of a BYTES input: one element per row ([N] or [N, 1])."""
    if (
        tensor.datatype != "BYTES"
        or len(tensor.shape) not in (1, 2)
        or (len(tensor.shape) == 2 and tensor.shape[1] != 1)
    ):
        raise InvalidInput(
            f"input '{tensor.name}': expected BYTES [-1] or [-1, 1] (one raw item a row: an "
            "encoded image, a text, a JSON record), "
            f"got {tensor.datatype} {list(tensor.shape)}"
        )
    return [bytes(item) for item in tensor.data.reshape(-1)]


def _cast_hint(datatype: str, made: np.dtype[Any]) -> str:
    """How a pipeline's code gives ``datatype`` (numpy's types; BF16 and BYTES have none)."""
    if datatype in ("BF16", "BYTES"):
        return ""
    hint = f": return it .astype(np.{TO_NUMPY[datatype].name}) from the pipeline's code"
    if made == np.float64:
        hint += " (numpy computes in float64 where a float64 array, a list's too, takes part)"
    return hint


def check_made(
    batch: dict[str, np.ndarray], signature: Signature, batched: bool, name: str
) -> None:
    """A batch a model's own pipeline code made fits the model. Names and dtypes are the
    code's (a 500: ModelExecutionError, logged); a shape that does not fit, or a value out of
    an input's range, depends on the item (an image too large for the model's range, an id
    the model has no row for: a 400, where ONNX Runtime counted -1 from the end and an
    AOTInductor kernel reads out of bounds)."""
    made = sorted(batch)
    wanted = sorted(t.name for t in signature.inputs)
    if made != wanted:
        raise ModelExecutionError(
            f"model '{name}': its pipeline made inputs {made}, the model takes {wanted}"
        )
    for spec in signature.inputs:
        data = batch[spec.name]
        if data.dtype != TO_NUMPY[spec.datatype]:
            raise ModelExecutionError(
                f"model '{name}': its pipeline made '{spec.name}' {data.dtype}, the model takes "
                f"{spec.datatype}{_cast_hint(spec.datatype, data.dtype)}"
            )
        want = ((-1,) if batched else ()) + spec.shape
        if not shape_fits(want, data.shape):
            raise InvalidInput(
                f"model '{name}': the item preprocesses to '{spec.name}' "
                f"{list(data.shape[1:] if batched else data.shape)}, the model takes "
                f"{list(spec.shape)}"
            )
        if spec.range is not None:  # an id the item made, out of range: as one sent (a 400)
            made_by = f"model '{name}': the items preprocess to "
            values = as_values(data, spec.datatype)
            check_range(spec.name, values, spec.range, made_by, "item {}" if batched else "")
