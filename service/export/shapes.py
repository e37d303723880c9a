"""What ``tensorgate export`` proves about a module's inputs before the server relies on it.

- **Axes and ranges of the dynamic dims** (:func:`graph_axes`): ``torch.export`` names each
  dynamic size with a symbol; input dims that share one are an axis (they must agree), and its
  range constraint is the smallest and largest size the program takes.
- **Which output dims follow which input dim** (:func:`graph_follows`): an output dim's
  symbolic size, as a function of one input symbol, evaluated for every size up to the longest
  bucket, so the server can crop a padded output back to the caller's size exactly (a strided
  convolution's ``(h - 5) // 2 + 1`` as well as a tagger's ``n``). Without a program
  (:func:`probed_follows`), only an output dim equal to its input dim at two sizes is known.
- **Whether padding changes the answer** (:func:`padding_verdict`): the golden rows run in
  eager PyTorch unpadded and padded (with zeros, as the server pads) to each bucket, as they
  are and with their float inputs made all negative, scaled into [0, 1] and made all
  positive; the outputs over the real region must agree within the manifest's tolerance.
  Then, axis by axis, the rows cut to the largest odd multiple of 1, 2, 4 … 32 below their
  size: an axis along which only multiples of a stride agree (a padded stride-2 convolution
  reads the padding at an odd size's last window) is padded from those.
- **Value ranges** (:func:`index_ranges`): an integer input that indexes an ``nn.Embedding``
  (or ``F.embedding``, or a parameter by ``[]``), itself or through views of it (a column, a
  reshape), takes ``[0, rows - 1]`` (``[-rows, rows - 1]`` for ``[]``, which counts from the
  end as eager PyTorch does).
- **Indexes no range proves** (:func:`unproven_indexes`): an input whose values reach an index
  through anything else (``ids + 1``, a cast, a gather) has no range export can prove; a
  compiled ``model.pt2`` kernel aborts the whole process on an out-of-range index, so such an
  input needs a declared range before pt2 is exported.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import torch
from torch.export import ExportedProgram

from service.artifacts.manifest import Tolerance
from service.artifacts.shapes import Axis, Dim, Follow
from service.model_config import TensorConfig

Probe = dict[str, np.ndarray]
EagerRun = Callable[[Probe], dict[str, np.ndarray]]


def _user_nodes(program: ExportedProgram, names: Sequence[str]) -> dict[str, Any]:
    nodes = {n.name: n for n in program.graph.nodes}
    return {name: nodes[name] for name in names if name in nodes}


def _symbol(size: object) -> Any:
    """The sympy symbol of a dynamic size (None for a static one or an expression)."""
    if isinstance(size, torch.SymInt):
        expr = size.node.expr
        return expr if expr.is_Symbol else None
    return None


def graph_axes(
    program: ExportedProgram, inputs: Sequence[TensorConfig], batched: bool, longest: int
) -> tuple[dict[Any, Axis], set[Any]]:
    """Each dynamic non-batch size's axis, keyed by its symbol, and the batch symbols."""
    placeholders = _user_nodes(program, program.graph_signature.user_inputs)
    dims: dict[Any, list[Dim]] = {}
    batch_symbols: set[Any] = set()
    for tensor, name in zip(inputs, program.graph_signature.user_inputs, strict=True):
        shape = placeholders[name].meta["val"].shape
        for index, size in enumerate(shape):
            symbol = _symbol(size)
            if symbol is None:
                continue
            if batched and index == 0:
                batch_symbols.add(symbol)
            else:
                dims.setdefault(symbol, []).append((tensor.name, index))
    axes = {}
    for symbol, members in dims.items():
        bounds = program.range_constraints.get(symbol)
        low = int(bounds.lower) if bounds is not None else 1
        high = longest if bounds is None or not bounds.upper.is_finite else int(bounds.upper)
        # torch.export takes sizes 0 and 1 for constants, so every dynamic size it reports
        # starts at 2 at least: 1 is taken (the server pads it, or runs it as exported).
        axes[symbol] = Axis(dims=tuple(members), min=1 if low <= 2 else low, max=min(high, longest))
    return axes, batch_symbols


def graph_follows(
    program: ExportedProgram,
    outputs: Sequence[TensorConfig],
    axes: Mapping[Any, Axis],
    batch_symbols: set[Any],
    batched: bool,
) -> tuple[dict[str, dict[int, Follow]], str]:
    """Output dims whose size follows one input dim, and why padding cannot be cropped back
    ("" when every output dim can)."""
    import sympy  # type: ignore[import-untyped]  # torch's dependency, untyped

    nodes = _user_nodes(program, program.graph_signature.user_outputs)
    follows: dict[str, dict[int, Follow]] = {}
    for tensor, name in zip(outputs, program.graph_signature.user_outputs, strict=True):
        value = nodes[name].meta.get("val") if name in nodes else None
        if value is None:
            return {}, f"torch.export gives no shape for output '{tensor.name}'"
        for index, size in enumerate(value.shape):
            if not isinstance(size, torch.SymInt) or (batched and index == 0):
                continue
            expr = size.node.expr
            free = expr.free_symbols - batch_symbols
            if expr.free_symbols & batch_symbols or len(free) != 1 or next(iter(free)) not in axes:
                return {}, (
                    f"output '{tensor.name}' dim {index} has size {expr}, which depends on "
                    "the batch or on several padded dims, so it cannot be cropped back"
                )
            symbol = next(iter(free))
            axis = axes[symbol]
            source, dim = axis.dims[0]
            sizes = None
            if expr != symbol:
                sizes = tuple(
                    max(int(expr.xreplace({symbol: sympy.Integer(n)})), 0)
                    for n in range(1, axis.max + 1)
                )
            follows.setdefault(tensor.name, {})[index] = Follow(input=source, dim=dim, sizes=sizes)
    return follows, ""


def probed_follows(
    outputs: Sequence[TensorConfig],
    axes: Sequence[Axis],
    small: tuple[int, Mapping[str, np.ndarray]],
    large: tuple[int, Mapping[str, np.ndarray]],
    batched: bool,
) -> tuple[dict[str, dict[int, Follow]], str]:
    """Without a program: the eager outputs with every axis at ``small[0]`` and at
    ``large[0]``. An output dim equal to the axes' size both times follows the output's k-th
    dynamic axis; one that changes otherwise cannot be cropped back without torch.export."""
    offset = 1 if batched else 0
    follows: dict[str, dict[int, Follow]] = {}
    for tensor in outputs:
        dynamic = [i + offset for i, d in enumerate(tensor.shape) if d == -1]
        for k, index in enumerate(dynamic):
            a, b = small[1][tensor.name].shape[index], large[1][tensor.name].shape[index]
            if a == b:
                continue
            if (a, b) == (small[0], large[0]) and axes:
                source, dim = axes[min(k, len(axes) - 1)].dims[0]
                follows.setdefault(tensor.name, {})[index] = Follow(input=source, dim=dim)
                continue
            return {}, (
                f"output '{tensor.name}' dim {index} changes with the input's size ({a} at "
                f"{small[0]}, {b} at {large[0]}), and without torch.export's symbolic shapes "
                "export cannot tell how, to crop it back"
            )
    return follows, ""


def crop_to(
    outputs: Mapping[str, np.ndarray],
    follows: Mapping[str, Mapping[int, Follow]],
    real: Mapping[Dim, int],
) -> dict[str, np.ndarray]:
    """Outputs of a padded run cut to the region the inputs' ``real`` sizes give."""
    cut = {}
    for name, array in outputs.items():
        region = [slice(None)] * array.ndim
        for index, follow in follows.get(name, {}).items():
            region[index] = slice(0, follow.size(real[follow.input, follow.dim]))
        cut[name] = array[tuple(region)]
    return cut


PADDING_VARIANTS: dict[str, Callable[[np.ndarray], np.ndarray]] = {
    "": lambda x: x,
    ", made all negative,": lambda x: x - (x.max() + 1),
    ", scaled into [0, 1],": lambda x: np.abs(x) / max(float(np.abs(x).max()), 1e-12),
    ", made all positive,": lambda x: x - (x.min() - 1),
}
"""The golden rows' float inputs (masks aside) as the padding check also runs them (a
variant the module does not take unpadded is left out). Zeros padded among
normal values leave a maximum over the dim where it was (a real value is above 0); among
negative ones, or under a convolution of pixels in [0, 1] whose channels' maxima fall below
what the bias alone gives, they are the maximum: served with padding, such a model answered
unlike eager PyTorch (by 1.07 and 0.061) where the check had passed."""


STRIDES = 6
"""Sizes checked below the golden rows' own, per axis: the largest odd multiple of 1, 2, 4, 8,
16 and 32 under it. A convolution of stride 2 (or a pooling window of 2 with ``ceil_mode``)
padded reads the padding at an odd size's last window only; a net of five such, at sizes not a
multiple of 32."""


def padding_verdict(
    run: EagerRun,
    golden: Probe,
    axes: Sequence[Axis],
    buckets: Sequence[int],
    follows: Mapping[str, Mapping[int, Follow]],
    tolerance: Tolerance,
) -> tuple[str, tuple[int, ...]]:
    """Whether padding the golden rows to each bucket above their sizes leaves their outputs
    over the real region unchanged (in eager PyTorch), also with their float inputs made all
    negative, scaled into [0, 1] and made all positive (:data:`PADDING_VARIANTS`): if not, what
    changed and ``()`` (no padding). Then, for each axis alone, the rows cut along it to the
    largest odd multiple of 1, 2, 4, … 32 below their size (:data:`STRIDES`), each padded to the
    next bucket: each axis's multiple is the least power of two whose every size checked
    agreed (1: any size), with what changed at a size it leaves out. ("", (1, 1)) for a module
    padding leaves unchanged everywhere; a multiple past 32 is no padding."""
    real = {dim: golden[dim[0]].shape[dim[1]] for axis in axes for dim in axis.dims}
    why = _padding_changes(run, golden, "the golden rows", real, buckets, follows, tolerance)
    if why:
        return why, ()
    multiples: list[int] = []
    said = ""
    for axis in axes:
        size = real[axis.dims[0]]
        multiple = 1
        for power in range(STRIDES):
            stride = 1 << power
            cut = size - 1 - (size - 1 - stride) % (2 * stride)  # the odd multiple of stride
            if cut >= size or cut < max(axis.min, 1):
                continue
            sizes = {**real, **dict.fromkeys(axis.dims, cut)}
            rows = dict(golden)
            for name, index in axis.dims:
                rows[name] = np.take(rows[name], np.arange(cut), axis=index)
            above = [b for b in buckets if b > cut][:1]
            try:
                changed = _padding_changes(
                    run, rows, "the golden rows cut shorter", sizes, above, follows, tolerance
                )
            except Exception:  # the module takes no such size unpadded: not a padding fact
                continue
            if changed:
                multiple, said = 2 * stride, said or changed
        if multiple > 1 << (STRIDES - 1):
            return said, ()
        multiples.append(multiple)
    return said, tuple(multiples)


def _padding_changes(
    run: EagerRun,
    golden: Probe,
    said_golden: str,
    real: Mapping[Dim, int],
    buckets: Sequence[int],
    follows: Mapping[str, Mapping[int, Follow]],
    tolerance: Tolerance,
) -> str:
    """What padding ``golden`` (its dynamic dims ``real`` long) to each of ``buckets`` above
    them changes over the real region, as it is and in each of :data:`PADDING_VARIANTS`; ""
    for nothing."""
    for said, variant in PADDING_VARIANTS.items():
        rows = {name: variant(x).astype(x.dtype) if _varied(x) else x for name, x in golden.items()}
        if said and all(rows[name] is golden[name] for name in golden):
            break  # no float input to vary: the variants are the golden rows again
        try:
            reference = run(rows)
        except Exception:  # the module takes no such values (float ids): not a padding fact
            if not said:
                raise
            continue
        for bucket in (b for b in buckets if b > max(real.values())):
            said_rows = f"{said_golden}{said}"
            why = _padded_differs(run, rows, said_rows, reference, real, bucket, follows, tolerance)
            if why:
                return why
    return ""


def _varied(x: np.ndarray) -> bool:
    """Whether an input's golden values are varied for the padding check: floats, and not a
    mask (values 0 and 1 only: an additive mask made negative turns real keys into padding)."""
    return x.dtype.kind == "f" and x.size > 0 and not np.isin(x, (0.0, 1.0)).all()


def _padded_differs(
    run: EagerRun,
    rows: Probe,
    said: str,
    reference: Mapping[str, np.ndarray],
    real: Mapping[Dim, int],
    bucket: int,
    follows: Mapping[str, Mapping[int, Follow]],
    tolerance: Tolerance,
) -> str:
    """What padding ``rows`` (``said``: which) to ``bucket`` changes over the real region; ""
    for nothing."""
    padded = dict(rows)
    for (name, index), size in real.items():
        widths = [(0, 0)] * padded[name].ndim
        widths[index] = (0, bucket - size)
        padded[name] = np.pad(padded[name], widths)
    try:
        got = crop_to(run(padded), follows, real)
    except Exception as exc:  # the module itself refusing the padded input
        return f"the module fails on {said} padded to {bucket}: {exc}"
    for name, want in reference.items():
        have = got[name]
        if have.shape != want.shape:
            return (
                f"output '{name}' is {list(have.shape)} when padded to {bucket} and cut "
                f"back, {list(want.shape)} unpadded"
            )
        want64, have64 = want.astype(np.float64), have.astype(np.float64)
        error = np.abs(have64 - want64)
        limit = tolerance.atol + tolerance.rtol * np.abs(want64)
        agree = (error <= limit) | (np.isnan(want64) & np.isnan(have64))
        if not np.all(agree):
            sizes = sorted(set(real.values()))
            worst = float(np.nanmax(np.where(agree, 0.0, np.nan_to_num(error, nan=np.inf))))
            return (
                f"padding {said} from {'/'.join(map(str, sizes))} to {bucket} "
                f"changes output '{name}' over the real region by up to {worst:.3g}"
            )
    return ""


def _views() -> set[Any]:
    """Ops whose values are their input's own, only fewer or rearranged."""
    ops = torch.ops.aten
    return {
        ops.select.int,
        ops.slice.Tensor,
        ops.squeeze.dim,
        ops.squeeze.dims,
        ops.squeeze.default,
        ops.unsqueeze.default,
        ops.view.default,
        ops.reshape.default,
        ops.flatten.using_ints,
        ops.alias.default,
        ops.clone.default,
        ops.permute.default,
        ops.t.default,
        ops.expand.default,
        ops.contiguous.default,
    }


def _through_views(node: Any) -> Any:
    """The tensor a chain of views (select, slice, reshape...) reads its values from: the
    values are the input's own, only fewer or rearranged."""
    views = _views()
    while getattr(node, "op", None) == "call_function" and node.target in views:
        node = node.args[0]
    return node


def _direct_index(node: Any, names: Mapping[str, str]) -> tuple[str, int, bool] | None:
    """``(input, table rows, counts from the end)`` when ``node`` indexes a weight by an input
    itself or a view of it (an ``nn.Embedding``, or a parameter by ``[]``), else None."""
    ops = torch.ops.aten
    if node.target is ops.embedding.default:
        weight, index = node.args[0], node.args[1]
        negative = False
    elif node.target is ops.index.Tensor and len(node.args[1]) >= 1:
        weight, index = node.args[0], node.args[1][0]
        negative = True
    else:
        return None
    index = _through_views(index)
    if getattr(index, "op", None) != "placeholder" or index.name not in names:
        return None
    if getattr(weight, "op", None) != "placeholder" or weight.name in names:
        return None  # indexes another input, whose size the request decides
    return names[index.name], int(weight.meta["val"].shape[0]), negative


def index_ranges(
    program: ExportedProgram, inputs: Sequence[TensorConfig]
) -> dict[str, tuple[int, int]]:
    """Integer inputs that index a weight directly, and the values that index it."""
    names = dict(zip(program.graph_signature.user_inputs, (t.name for t in inputs), strict=True))
    ranges: dict[str, tuple[int, int]] = {}
    for node in program.graph.nodes:
        if node.op != "call_function" or (direct := _direct_index(node, names)) is None:
            continue
        name, rows, negative = direct
        bounds = (-rows if negative else 0, rows - 1)
        old = ranges.get(name, bounds)
        ranges[name] = (max(old[0], bounds[0]), min(old[1], bounds[1]))
    return ranges


def _indexing() -> dict[Any, tuple[int, ...]]:
    """Each indexing op and the positions of its index arguments (a list of them for
    ``index``)."""
    ops = torch.ops.aten
    return {
        ops.embedding.default: (1,),
        ops.index.Tensor: (1,),
        ops.index_select.default: (2,),
        ops.gather.default: (2,),
        ops.take.default: (1,),
        ops.scatter.src: (2,),
        ops.scatter.value: (2,),
        ops.scatter_add.default: (2,),
        ops.index_put.default: (1,),
        ops.index_add.default: (2,),
        ops.embedding_bag.default: (1,),
    }


def _bounded_by_shape() -> set[Any]:
    """Ops whose integer results a tensor's shape bounds, whatever the values that made them
    (positions of a maximum, of a sort, comparisons), or that take only its shape (``zeros_like``,
    BERT's token types): an index made by them cannot run out."""
    ops = torch.ops.aten
    return {
        ops.zeros_like.default,
        ops.ones_like.default,
        ops.empty_like.default,
        ops.full_like.default,
        ops.new_zeros.default,
        ops.new_ones.default,
        ops.new_full.default,
        ops.new_empty.default,
        ops.arange.default,
        ops.arange.start,
        ops.arange.start_step,
        ops.argmax.default,
        ops.argmin.default,
        ops.sort.default,
        ops.sort.stable,
        ops.topk.default,
        ops.nonzero.default,
        ops.eq.Tensor,
        ops.eq.Scalar,
        ops.ne.Tensor,
        ops.ne.Scalar,
        ops.lt.Tensor,
        ops.lt.Scalar,
        ops.le.Tensor,
        ops.le.Scalar,
        ops.gt.Tensor,
        ops.gt.Scalar,
        ops.ge.Tensor,
        ops.ge.Scalar,
        ops.sym_size.int,
    }


def _flat(args: Any) -> list[Any]:
    if isinstance(args, (list, tuple)):
        return [a for item in args for a in _flat(item)]
    return [args]


def unproven_indexes(program: ExportedProgram, inputs: Sequence[TensorConfig]) -> dict[str, str]:
    """Inputs whose values reach an index other than directly (see :func:`index_ranges`), each
    with the first op that indexes by them (``aten.embedding after aten.add.Tensor``)."""
    names = dict(zip(program.graph_signature.user_inputs, (t.name for t in inputs), strict=True))
    indexing = _indexing()
    bounded = _bounded_by_shape()
    views = _views()
    # node → the inputs its values derive from, and the ops they passed through on the way
    reach: dict[Any, dict[str, str]] = {}
    found: dict[str, str] = {}
    for node in program.graph.nodes:
        if node.op == "placeholder" and node.name in names:
            reach[node] = {names[node.name]: ""}
            continue
        if node.op != "call_function" or node.target in bounded:
            continue
        if node.target in indexing:
            # a direct index is the first at its position (embedding's ids, ``[]``'s first)
            skip = 0 if _direct_index(node, names) is None else 1
            for position in indexing[node.target]:
                if position >= len(node.args):
                    continue
                for index in _flat(node.args[position])[skip:]:
                    for name, path in reach.get(index, {}).items():
                        found.setdefault(name, f"{_op_name(node.target)}{path}")
        came: dict[str, str] = {}
        for arg in _flat([*node.args, *node.kwargs.values()]):
            for name, path in reach.get(arg, {}).items():
                changed = not path and node.target not in views
                came.setdefault(name, f" after {_op_name(node.target)}" if changed else path)
        if came:
            reach[node] = came
    return found


def _op_name(target: Any) -> str:
    name = getattr(target, "__name__", str(target))
    return f"aten.{name}" if not name.startswith("aten") else name
