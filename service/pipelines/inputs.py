"""A model's own preprocessing, as the core sees it: one small interface for every kind.

A model with a pipeline takes raw items as well as tensors: encoded images, or UTF-8 texts,
in a BYTES input named :attr:`Pipeline.raw_input` (v2, gRPC) or as the body (v1).
:meth:`Pipeline.prepare` turns the items into the model's batch, off the event loop. The
pipelines themselves (decode, resize, tokenize...) live in ``preprocessing/``, which training
code imports too; this module only fits them to a model's signature and to the server's threads.
"""

from __future__ import annotations

import abc
import asyncio
import io
from concurrent.futures import Executor
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from preprocessing.image import ImagePipeline, PreprocessingError
from preprocessing.spec import TextSpec
from preprocessing.text import TextPipeline
from service.artifacts.shapes import Crop
from service.batching.scheduler import Work
from service.datatypes import TO_NUMPY
from service.errors import InvalidInput, ModelLoadError
from service.model_config import ModelConfig, TensorConfig
from service.runtimes.base import Signature, shape_fits

TEXT_INPUTS = ("input_ids", "attention_mask")
"""What a text pipeline feeds: the model must take exactly these, INT64 [-1, -1]."""


@dataclass(slots=True)
class Prepared:
    """Raw items turned into the model's batch (or a function that makes it on the instance's
    thread), and what the response should report about them."""

    work: Work
    parameters: dict[str, Any] = field(default_factory=dict)
    crop: Crop | None = None
    """The region of each output that answers the caller's own input (where dims were padded)."""


class Pipeline(abc.ABC):
    """Raw items → the model's batch."""

    raw_input: str
    """The BYTES input clients send raw items in."""

    @abc.abstractmethod
    async def prepare(self, items: list[bytes], pool: Executor, alone: bool) -> Prepared:
        """The batch for ``items``, made in ``pool``; with ``alone`` (the request is the only
        one in flight for its model), a function the instance's thread calls instead."""

    @abc.abstractmethod
    def warm(self) -> None:
        """Run once at load: the first call pays for lazy set-up that no request should."""

    def signature(self, signature: Signature) -> Signature:
        """The signature as clients may fill it (a text pipeline bounds its token ids)."""
        return signature


class ImageInput(Pipeline):
    """Encoded images → rows of the model's first input, stacked."""

    def __init__(self, pipeline: ImagePipeline, first: TensorConfig, batched: bool, model: str):
        self.pipeline, self.first, self.batched, self.model = pipeline, first, batched, model
        self.raw_input = f"{first.name}_bytes"

    async def prepare(self, items: list[bytes], pool: Executor, alone: bool) -> Prepared:
        loop = asyncio.get_running_loop()
        if len(items) == 1:
            make = partial(self.batch, items)
            return Prepared(make if alone else await loop.run_in_executor(pool, make))
        rows = await asyncio.gather(*(loop.run_in_executor(pool, self.row, i) for i in items))
        return Prepared(self._stack(rows))

    def batch(self, items: list[bytes]) -> dict[str, np.ndarray]:
        """Images → the model's batch, in the calling thread (never the loop)."""
        return self._stack([self.row(item) for item in items])

    def row(self, image: bytes) -> np.ndarray:
        try:
            return self.pipeline(image)
        except PreprocessingError as exc:
            raise InvalidInput(f"model '{self.model}': {exc}") from None

    def _stack(self, rows: list[np.ndarray]) -> dict[str, np.ndarray]:
        for row in rows:
            if not shape_fits(self.first.shape, row.shape):
                raise InvalidInput(
                    f"model '{self.model}': the image preprocesses to {list(row.shape)}, input "
                    f"'{self.first.name}' takes {list(self.first.shape)}; set resize/crop in its "
                    "config"
                )
        if len({row.shape for row in rows}) > 1:
            raise InvalidInput(
                f"model '{self.model}': images preprocess to different shapes; set crop"
            )
        stacked = rows[0][None] if len(rows) == 1 else np.stack(rows)  # one image: a view
        return {self.first.name: stacked if self.batched else stacked[0]}

    def warm(self) -> None:
        buffer = io.BytesIO()
        Image.new("RGB", (512, 384), (128, 64, 32)).save(buffer, format="JPEG")
        self.pipeline(buffer.getvalue())


class TextInput(Pipeline):
    """UTF-8 texts → token ids and attention mask, padded to a bucket."""

    raw_input = "text"

    def __init__(self, pipeline: TextPipeline, model: str) -> None:
        self.pipeline, self.model = pipeline, model

    async def prepare(self, items: list[bytes], pool: Executor, alone: bool) -> Prepared:
        try:
            texts = [item.decode() for item in items]
        except UnicodeDecodeError as exc:
            raise InvalidInput(f"input '{self.raw_input}': text must be UTF-8 ({exc})") from None
        try:
            tokens = await asyncio.get_running_loop().run_in_executor(pool, self.pipeline, texts)
        except PreprocessingError as exc:
            raise InvalidInput(f"model '{self.model}': {exc}") from None
        batch = {"input_ids": tokens.input_ids, "attention_mask": tokens.attention_mask}
        return Prepared(batch, {"truncated": tokens.truncated} if any(tokens.truncated) else {})

    def warm(self) -> None:
        self.pipeline(["warm up the tokenizer"])

    def signature(self, signature: Signature) -> Signature:
        """Token ids within the tokenizer's vocabulary, masks 0 or 1: a request that sends its
        own ids is checked before it can fail the batch it would join (the model's embedding
        lookup fails the whole batch on one id out of range)."""
        bounds = {
            "input_ids": (0.0, float(self.pipeline.vocab_size - 1)),
            "attention_mask": (0.0, 1.0),
        }
        inputs = tuple(
            t.model_copy(update={"range": bounds[t.name]}) if t.range is None else t
            for t in signature.inputs
        )
        return Signature(inputs, signature.outputs)


def pipeline_for(
    config: ModelConfig, signature: Signature, folder: Path, model: str
) -> Pipeline | None:
    """The model's pipeline, checked against its signature (ModelLoadError when it cannot feed
    it); None for a model without preprocessing."""
    spec = config.preprocessing
    if spec is None:
        return None
    if isinstance(spec, TextSpec):
        return TextInput(_text_pipeline(spec, signature, folder), model)
    pipeline = ImagePipeline(spec)
    first = signature.inputs[0]
    produced = pipeline.output_shape
    if produced is not None and not shape_fits(first.shape, produced):
        raise ModelLoadError(
            f"preprocessing produces {list(produced)} per image, but input '{first.name}' is "
            f"{list(first.shape)}"
        )
    if np.dtype(spec.dtype) != TO_NUMPY[first.datatype]:
        raise ModelLoadError(
            f"preprocessing produces {spec.dtype}, input '{first.name}' is {first.datatype}"
        )
    return ImageInput(pipeline, first, config.max_batch_size > 0, model)


def _text_pipeline(spec: TextSpec, signature: Signature, folder: Path) -> TextPipeline:
    names = {t.name: t for t in signature.inputs}
    for name in TEXT_INPUTS:
        tensor = names.get(name)
        if tensor is None or tensor.datatype != "INT64" or tensor.shape != (-1,):
            raise ModelLoadError(
                f"text preprocessing feeds INT64 [-1, -1] inputs {list(TEXT_INPUTS)}; the model "
                f"takes {[f'{t.name} {t.datatype} {list(t.shape)}' for t in signature.inputs]}"
            )
    if set(names) != set(TEXT_INPUTS):
        raise ModelLoadError(f"text models take exactly {list(TEXT_INPUTS)}, not {sorted(names)}")
    try:
        return TextPipeline(spec, folder)
    except PreprocessingError as exc:
        raise ModelLoadError(str(exc)) from None
