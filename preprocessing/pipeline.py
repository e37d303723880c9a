"""The one interface between raw request items and a model: subclass :class:`Pipeline`.

The server runs every model's preprocessing through it (its built-in image and text pipelines
are implementations of it), and a model may name its own (``preprocessing: {kind: python,
module: ..., class: ...}`` in ``config.yaml``). Training code imports the same class, so the
code that served a request is the code the model was trained with; ``tensorgate export``
hashes it, and the server refuses a version whose code changed since.

A pipeline is synchronous and keeps no per-request state on itself: the server calls it from
several threads at once, off the event loop, and decides where each step runs. What one item
must carry from preprocessing to postprocessing (its original size, say) goes in ``context``,
a dict the server makes per item.

Raise :class:`BadInput` (a ``ValueError``) for an item the pipeline cannot take: the client
gets a 400 naming the model and your message, and no other request is affected. Any other
exception is a bug: the client gets a 500 that names its request id, the traceback goes to the
server's log.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Protocol

import numpy as np
import orjson

Arrays = dict[str, np.ndarray]
"""Named arrays: one item's rows (no batch dim), or a batch (batch dim first)."""


class BadInput(ValueError):
    """The item cannot be served: the message says why, for the client to read."""


class Item:
    """One raw request item: bytes with their content type (an image body, one element of a
    BYTES input), or a JSON value (one of v1's ``instances``)."""

    __slots__ = ("_value", "content_type", "data")

    def __init__(
        self, data: bytes | None = None, content_type: str | None = None, value: Any = None
    ) -> None:
        self.data, self.content_type, self._value = data, content_type, value

    def bytes(self) -> bytes:
        """The item's bytes (a JSON value's UTF-8 JSON text)."""
        if self.data is None:
            return (
                self._value.encode() if isinstance(self._value, str) else orjson.dumps(self._value)
            )
        return self.data

    def text(self) -> str:
        """The item as text: a JSON string as it is, bytes as UTF-8."""
        if self.data is None and isinstance(self._value, str):
            return self._value
        try:
            return self.bytes().decode()
        except UnicodeDecodeError as exc:
            raise BadInput(f"text must be UTF-8 ({exc})") from None

    def json(self) -> Any:
        """The item as a JSON value: as sent in ``instances``, or parsed from its bytes."""
        if self.data is None:
            return self._value
        try:
            return orjson.loads(self.data)
        except orjson.JSONDecodeError as exc:
            sent = f" (sent as {self.content_type})" if self.content_type else ""
            raise BadInput(
                f"item is not valid JSON{sent}: {exc}; this model takes JSON records"
            ) from None


class Models(Protocol):
    """Other models, as pipeline code calls them: ``self.models.infer("rnet", {"input": x})``."""

    def infer(
        self, model: str, inputs: Mapping[str, np.ndarray], version: str | None = None
    ) -> dict[str, np.ndarray]:
        """``inputs`` (a batch) → ``model``'s outputs for it."""
        ...


class LocalModels:
    """Models as plain functions (batch → outputs), for pipeline code outside a server: in
    training, or at export (``export_model(models=...)``), where eager modules stand in."""

    def __init__(self, models: Mapping[str, Callable[[Arrays], Arrays]]) -> None:
        self._models = dict(models)

    def infer(
        self, model: str, inputs: Mapping[str, np.ndarray], version: str | None = None
    ) -> dict[str, np.ndarray]:
        if model not in self._models:
            raise KeyError(
                f"no model '{model}' here (LocalModels has {sorted(self._models)}): outside a "
                "server a pipeline's steps are the functions it is given, at export "
                f"export_model(..., models=LocalModels({{'{model}': a function of a batch}})) "
                "(docs/models.md; `tensorgate export` gives it none)"
            )
        return self._models[model](dict(inputs))


class Pipeline:
    """Raw items → a model's batch, and the model's outputs for each item → its answer.

    Override :meth:`preprocess` (one item → its rows) and, to answer with something other than
    the model's own outputs, :meth:`postprocess`. Override :meth:`preprocess_batch` where
    stacking rows is not enough (a tokenizer pads a batch to its longest text at once).
    """

    raw_input: str = "raw"
    """The BYTES input that carries raw items over v2 REST and gRPC (v1 takes the body)."""
    models: Models = LocalModels({})
    """The server's other models (set by the server when it loads the pipeline); pipeline code
    calls them by name, and each call joins that model's batches (:mod:`service.core.steps`)."""
    json_items: bool = True
    """Whether v1's JSON ``instances`` (records, strings, numbers) are items for
    :meth:`preprocess`, as JSON values. ``{"b64": ...}`` objects always are items, as their
    decoded bytes. The built-in pipelines set this False: their string instances are texts,
    and rows of numbers go to the model as its tensors."""

    def preprocess(self, item: Item, context: dict[str, Any]) -> Arrays:
        """One item → the model's inputs for it, without a batch dim."""
        raise NotImplementedError(f"{type(self).__name__} does not define preprocess()")

    def preprocess_batch(self, items: Sequence[Item], contexts: Sequence[dict[str, Any]]) -> Arrays:
        """Items → the model's batch. By default each item's :meth:`preprocess`, stacked: each
        row copied into its place as it is made, so that the rows are not held twice."""
        made = (
            which_item(self.preprocess, index, len(items), item, c)
            for index, (item, c) in enumerate(zip(items, contexts, strict=True))
        )
        return stack(made, len(items))

    def postprocess(self, outputs: Mapping[str, np.ndarray], context: dict[str, Any]) -> Any:
        """The model's outputs for one item (no batch dim) → its answer: JSON-serialisable
        (numpy values included). Only called where a subclass overrides it."""
        raise NotImplementedError

    def parameters(self, contexts: Sequence[dict[str, Any]]) -> dict[str, Any]:
        """What the answer's ``parameters`` report about the request's items (the text
        pipeline says which texts it truncated); by default nothing."""
        return {}

    def warm(self) -> None:
        """Called once at load, before the model is ready: pay for lazy set-up here."""


def as_item(raw: Any) -> Item:
    """A raw item as the server hands it to a pipeline: an :class:`Item` as it is, bytes as
    an item's bytes, anything else as a JSON value (one of v1's ``instances``)."""
    if isinstance(raw, Item):
        return raw
    return Item(raw) if isinstance(raw, bytes) else Item(value=raw)


def answer_one(
    pipeline: Pipeline, item: Any, run: Callable[[Arrays], Arrays], batched: bool = True
) -> Any:
    """What the server answers for one raw item (an :class:`Item`, bytes, or a JSON value, as
    :func:`as_item` takes them, and as ``PipelineDataset`` does), with ``run`` (a batch → the
    model's outputs) as the model: preprocess, run, postprocess. Training code can evaluate a
    pipeline with it exactly as it will be served; export records its answers, and the server
    replays them at load."""
    context: dict[str, Any] = {}
    batch = pipeline.preprocess_batch([as_item(item)], [context])
    if not batched:
        batch = {name: array[0] for name, array in batch.items()}
    outputs = run(batch)
    row = {name: (array[0] if batched else array) for name, array in outputs.items()}
    if overrides(pipeline, "postprocess"):
        return pipeline.postprocess(row, context)
    return {name: np.asarray(array).tolist() for name, array in row.items()}


def stack(rows: Iterable[Arrays], count: int | None = None) -> Arrays:
    """Rows (one dict per item) → a batch: each name's arrays stacked on a new first dim, their
    datatypes widened alike (as ``np.stack``); items whose rows differ in shape are a
    :class:`BadInput`, in input names an :class:`ItemsDiffer`. Given ``count``, ``rows`` may
    be a generator: each row is copied into its place as it comes (:class:`Rows`), never all
    held at once."""
    if count is None:
        rows = list(rows)
        count = len(rows)
    if count == 1:
        (first,) = rows
        _check_row(first)
        return {name: np.asarray(array)[None] for name, array in first.items()}  # a view
    into = Rows(count)
    for index, row in enumerate(rows):
        into.put(index, row)
    return into.batch()


def _check_row(row: Arrays) -> None:
    if not isinstance(row, Mapping):
        raise TypeError(
            f"preprocess() returned {type(row).__name__}, not a dict of numpy arrays by input name"
        )


def which_item(
    preprocess: Callable[[Item, dict[str, Any]], Arrays],
    index: int,
    count: int,
    item: Item,
    context: dict[str, Any],
) -> Arrays:
    """``preprocess(item, context)``, its :class:`BadInput` saying which of ``count`` items
    it was (the client's instance or element ``index``, from 0) when there are several."""
    try:
        return preprocess(item, context)
    except BadInput as exc:
        if count == 1:
            raise
        said = f"item at index {index} (of {count}): {exc}"
        try:  # its own type, where it is made from a message (the code's may be reused)
            named = type(exc)(said)
        except Exception:  # a subclass made otherwise: named as the base class instead
            named = BadInput(said)
        raise named from exc


class ItemsDiffer(ValueError):
    """The rows a pipeline made for a request's items name different inputs: its own mistake
    (the server answers it 500, not the client's 400)."""


class Rows:
    """A batch of ``count`` items filled a row at a time: each item's row is copied into its
    place as soon as it is made (from any thread), so that it can be let go at once. What
    :func:`stack` makes (datatypes promoted alike), without holding every row and their stack
    together: 1,024 one-pixel PNGs make 616 MB of efficientnet rows, held twice while they were
    stacked."""

    def __init__(self, count: int) -> None:
        self.count = count
        self._lock = threading.Lock()
        self._batch: Arrays | None = None
        self._filled: list[int] = []
        self._odd: dict[str, set[str]] = {}
        """Input name → the shapes of the rows that did not fit the first row's."""
        self._names: list[tuple[int, list[str]]] = []
        """The first row's index and input names, then the first row's that made others."""

    def put(self, index: int, row: Arrays) -> None:
        """Item ``index``'s row (a dict of arrays by input name, no batch dim) into its place.
        The copy is made under the lock (a row's copy is short beside making it); a row whose
        datatype is wider than the batch's so far widens it, as stacking would."""
        _check_row(row)
        row = {name: np.asarray(value) for name, value in row.items()}  # lists too
        with self._lock:
            if self._batch is None:  # the first row made sets every row's shape
                self._batch = {
                    name: np.empty((self.count, *array.shape), array.dtype)
                    for name, array in row.items()
                }
            batch = self._batch
            names = sorted(row)
            if not self._names or (len(self._names) == 1 and names != self._names[0][1]):
                self._names.append((index, names))
            for name in row.keys() & batch.keys():
                array, target = row[name], batch[name]
                if array.shape != target.shape[1:]:
                    self._odd.setdefault(name, set()).add(str(list(array.shape)))
                    continue
                if array.dtype != target.dtype:
                    wider = np.result_type(target.dtype, array.dtype)
                    if wider != target.dtype:
                        grown = np.empty(target.shape, wider)
                        grown[self._filled] = target[self._filled]
                        batch[name] = target = grown
                target[index] = array
            self._filled.append(index)

    def batch(self) -> Arrays:
        """The batch, once every row is in: items whose rows differ in shape are a
        :class:`BadInput` (an image of another size: the client's), in input names an
        :class:`ItemsDiffer` (the code's own mistake, whatever the items)."""
        assert self._batch is not None, "no row was put"
        if len(self._names) > 1:
            (first, made), (other, differ) = sorted(self._names)
            raise ItemsDiffer(
                f"items make different inputs: item {first} makes {made}, item {other} {differ}"
            )
        for name, odd in sorted(self._odd.items()):
            shapes = sorted(odd | {str(list(self._batch[name].shape[1:]))})
            raise BadInput(f"items make '{name}' of different shapes ({', '.join(shapes)})")
        return self._batch


def overrides(pipeline: Pipeline, method: str) -> bool:
    """Whether ``pipeline``'s class defines ``method`` itself rather than inheriting the base's."""
    return getattr(type(pipeline), method) is not getattr(Pipeline, method)
