"""The dynamic dims a model takes: their ranges and buckets, padding, and cropping back.

``tensorgate export`` measures what a model's dynamic (-1) dims allow and records it in the
manifest (:class:`ShapeFacts`): which input dims are one *axis* (a text model's ids and mask
share their length), the sizes each axis was exported for, whether padding an input up to a
bucket leaves the answer of the real (unpadded) region unchanged, and which output dims follow
which input dim, with the output's size for each input size. :class:`ShapePolicy` applies that
to each request, before it is queued: a size outside the range is a 400 naming the input, the
dim and the range; a size inside is padded up to its bucket where padding is safe (and the
outputs cropped back to the caller's size afterwards), or else must be one of the buckets
exactly, since those are the shapes warmup ran. A version folder without these facts (one
exported before them, or a bring-your-own artifact) pads every dynamic dim and crops nothing.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    model_serializer,
)

from service.errors import InvalidInput, ModelLoadError
from service.model_config import ModelConfig, TensorConfig

Dim = tuple[str, int]
"""An input's name and the index of a dim in its full shape (the batch dim, if any, is 0)."""
Crop = dict[str, tuple[slice, ...]]
"""Per output, the region that belongs to the caller's own (unpadded) input."""


class _Frozen(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Axis(_Frozen):
    """One dynamic size: the input dims that must agree on it, and the sizes the model takes."""

    dims: tuple[Dim, ...] = Field(min_length=1)
    min: int = Field(ge=1)
    max: int = Field(ge=1)
    multiple: int = Field(default=1, ge=1)
    """Padding along it leaves the answer unchanged from sizes that are multiples of this only
    (a stride-2 net reads the padding at an odd size's last window): other sizes are taken at
    a bucket exactly. Written only when above 1, so that a server from before it, which could
    not keep to it, refuses the manifest rather than pad every size."""

    @model_serializer(mode="wrap")
    def _without_one(self, write: SerializerFunctionWrapHandler) -> dict[str, Any]:
        written: dict[str, Any] = write(self)
        if written.get("multiple") == 1:
            del written["multiple"]
        return written


class Follow(_Frozen):
    """An output dim whose size follows an input dim's."""

    input: str
    dim: int
    sizes: tuple[int, ...] | None = None
    """The output's size when the input dim is ``n``, at ``sizes[n - 1]``; None: the same size."""

    def size(self, n: int) -> int:
        return n if self.sizes is None else self.sizes[n - 1]


class ShapeFacts(_Frozen):
    """What export measured about the dynamic dims (``manifest.json`` ``shapes``)."""

    axes: tuple[Axis, ...]
    buckets: tuple[int, ...]
    """The buckets export checked the artifact at."""
    pad: bool
    """Padding up to a bucket leaves the answer over the real region unchanged (measured)."""
    reason: str = ""
    """Why not, when ``pad`` is false or an axis's ``multiple`` is above 1."""
    follows: dict[str, dict[int, Follow]] = {}
    """Output name → its dims (full-shape index) that follow an input dim."""


def guess_axes(inputs: Sequence[TensorConfig], batched: bool) -> tuple[Axis, ...]:
    """Axes when nothing better is known: the k-th dynamic dim of every input is axis k (a
    text model's ids and mask share their length), of any size."""
    offset = 1 if batched else 0
    per_input = [[(t.name, i + offset) for i, d in enumerate(t.shape) if d == -1] for t in inputs]
    axes = []
    for k in range(max((len(dims) for dims in per_input), default=0)):
        dims = tuple(dims[k] for dims in per_input if len(dims) > k)
        axes.append(Axis(dims=dims, min=1, max=2**31 - 1))
    return tuple(axes)


@dataclass(frozen=True)
class ShapePolicy:
    """How one served version fits requests' dynamic dims to the shapes it warmed."""

    axes: tuple[Axis, ...]
    buckets: tuple[int, ...]
    pad: bool
    reason: str
    follows: Mapping[str, Mapping[int, Follow]]
    check_agreement: bool
    """Refuse inputs that disagree on an axis (only where export found the axis, not guessed)."""

    @classmethod
    def of(
        cls, config: ModelConfig, inputs: Sequence[TensorConfig], facts: ShapeFacts | None
    ) -> ShapePolicy:
        buckets = config.shape_buckets()
        if facts is None:
            axes = guess_axes(inputs, config.max_batch_size > 0)
            if buckets:
                axes = tuple(a.model_copy(update={"max": max(buckets)}) for a in axes)
            return cls(axes, buckets, True, "", {}, check_agreement=False)
        axes = facts.axes
        for axis in axes:
            outside = [b for b in buckets if not axis.min <= b <= axis.max]
            if outside:
                name, index = axis.dims[0]
                raise ModelLoadError(
                    f"buckets {outside} lie outside the sizes input '{name}' dim {index} was "
                    f"exported for ({axis.min} to {axis.max}); export again with these buckets"
                )
        if buckets:
            axes = tuple(a.model_copy(update={"max": min(a.max, max(buckets))}) for a in axes)
        return cls(axes, buckets, facts.pad, facts.reason, facts.follows, check_agreement=True)

    @property
    def pads_unchanged(self) -> bool:
        """Whether export measured that padding to a bucket leaves the answer over the real
        region unchanged (a version without those facts pads on trust, uncropped)."""
        return self.check_agreement and self.pad and bool(self.buckets)

    def warm_sizes(self) -> list[dict[Dim, int]]:
        """Every combination of the axes' buckets: the shapes a request can be fitted to."""
        if not self.axes or not self.buckets:
            return [{}]
        choices = [[b for b in self.buckets if axis.min <= b <= axis.max] for axis in self.axes]
        combos = []
        for sizes in itertools.product(*choices):
            combos.append(
                {
                    dim: size
                    for axis, size in zip(self.axes, sizes, strict=True)
                    for dim in axis.dims
                }
            )
        return combos

    def fit(self, batch: dict[str, np.ndarray], model: str) -> tuple[dict[str, np.ndarray], Crop]:
        """The batch with each dynamic dim at a warmed size, and the crop that gives the
        caller outputs of the size its own input implies. InvalidInput for a size the model
        does not take."""
        if not self.axes:
            return batch, {}
        targets: dict[Dim, tuple[int, int]] = {}
        for axis in self.axes:
            for dim in axis.dims:
                n = batch[dim[0]].shape[dim[1]]
                targets[dim] = (n, self._target(axis, dim, n, model))
            if self.check_agreement:
                sizes = {targets[d][0] for d in axis.dims}
                if len(sizes) > 1:
                    names = ", ".join(f"'{name}' dim {i}" for name, i in axis.dims)
                    raise InvalidInput(
                        f"inputs {names} must have the same size for model '{model}'; got "
                        f"{[targets[d][0] for d in axis.dims]}"
                    )
        padded = dict(batch)
        for name, array in batch.items():
            widths = [(0, 0)] * array.ndim
            for index in range(array.ndim):
                if (name, index) in targets:
                    n, target = targets[name, index]
                    widths[index] = (0, target - n)
            if any(after for _, after in widths):  # BYTES with empty elements, not int 0
                padded[name] = np.pad(
                    array, widths, constant_values=b"" if array.dtype.kind == "O" else 0
                )
        return padded, self._crop(targets)

    def _target(self, axis: Axis, dim: Dim, n: int, model: str) -> int:
        name, index = dim
        if not axis.min <= n <= axis.max:
            where = f"input '{name}': dim {index} is {n}"
            if self.buckets and n > axis.max == max(self.buckets):
                where += f", above the largest bucket ({axis.max}) of model '{model}'"
            if self.buckets and not self.pad:  # exact buckets: no size between them is taken
                takes = f"only {list(self.buckets)}"
            else:
                takes = f"{axis.min} to {axis.max}"
            raise InvalidInput(f"{where}; model '{model}' takes {takes} there")
        if not self.buckets:
            return n
        if not self.pad:
            if n not in self.buckets:
                raise InvalidInput(
                    f"input '{name}': dim {index} is {n}; model '{model}' takes only "
                    f"{list(self.buckets)} there, since padding changes its answer ({self.reason})"
                )
            return n
        if n % axis.multiple and n not in self.buckets:
            raise InvalidInput(
                f"input '{name}': dim {index} is {n}; model '{model}' takes multiples of "
                f"{axis.multiple} from {axis.min} to {axis.max} there, or exactly "
                f"{list(self.buckets)}, since padding changes its answer at other sizes "
                f"({self.reason})"
            )
        return next(b for b in self.buckets if b >= n)

    def axis_of(self, dim: Dim) -> Axis:
        """The axis ``dim`` belongs to."""
        return next(axis for axis in self.axes if dim in axis.dims)

    def row_crops(
        self, sizes: Sequence[Mapping[Dim, int]], fitted: Mapping[str, np.ndarray]
    ) -> list[Crop]:
        """For rows of their own sizes padded into one batch (v1's ragged instances), each
        row's crop: the region of each output that answers that row's own input, the batch
        dim's slice first (applied to the row, it is left off)."""
        return [
            self._crop({dim: (n, fitted[dim[0]].shape[dim[1]]) for dim, n in own.items()})
            for own in sizes
        ]

    def _crop(self, targets: Mapping[Dim, tuple[int, int]]) -> Crop:
        crop: Crop = {}
        for output, dims in self.follows.items():
            region: list[slice] = []
            for index, follow in sorted(dims.items()):
                n, target = targets.get((follow.input, follow.dim), (0, 0))
                if n == target:
                    continue
                region.extend([slice(None)] * (index - len(region)))
                region.append(slice(0, follow.size(n)))
            if region:
                crop[output] = tuple(region)
        return crop


def apply_crop(outputs: dict[str, np.ndarray], crop: Crop) -> dict[str, np.ndarray]:
    """Outputs cut to the caller's region (those without a crop unchanged)."""
    if not crop:
        return outputs
    return {name: array[crop[name]] if name in crop else array for name, array in outputs.items()}
