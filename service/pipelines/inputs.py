"""The built-in pipelines, on the public interface (:class:`preprocessing.pipeline.Pipeline`),
and the check that a model's pipeline can feed it.

A model with a pipeline takes raw items as well as tensors: encoded images, or UTF-8 texts,
in a BYTES input named after the pipeline's ``raw_input`` (v2, gRPC) or as the body (v1).
What runs where (the thread pool, or the instance's own thread for a request alone) is the
core's decision (:mod:`service.core.dataplane`); a pipeline only turns items into rows.
"""

from __future__ import annotations

import io
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from preprocessing.image import ImagePipeline, PreprocessingError
from preprocessing.pipeline import Arrays, Item, Pipeline, overrides
from preprocessing.spec import PythonSpec, TextSpec
from preprocessing.text import TextPipeline
from service.artifacts.shapes import Crop
from service.batching.scheduler import Work
from service.datatypes import TO_NUMPY
from service.errors import ModelLoadError
from service.model_config import ModelConfig, TensorConfig
from service.pipelines.classification import ANSWER, CLASSIFICATION
from service.pipelines.code import load_pipeline
from service.resources import SECOND_THREAD
from service.runtimes.base import Signature, shape_fits

TEXT_INPUTS = ("input_ids", "attention_mask")
"""What a text pipeline feeds: the model must take exactly these, INT64 [-1, -1]."""


@dataclass(slots=True)
class Prepared:
    """A request's inputs as the model's batch (or a function that makes it on the instance's
    thread), with what its items carry to postprocessing."""

    work: Work
    contexts: list[dict[str, Any]] | None = None
    """One per raw item, filled by the pipeline (None: the request sent tensors)."""
    crop: Crop | None = None
    """The region of each output that answers the caller's own input (where dims were padded)."""
    row_crops: list[Crop] | None = None
    """Each row's own region, where rows of their own sizes were padded to one (v1's ragged
    instances, a text pipeline's texts): v1 answers each row cut to it, after ``crop``."""


class ImageInput(Pipeline):
    """Encoded images → rows of the model's first input."""

    json_items = False

    def __init__(self, pipeline: ImagePipeline, first: TensorConfig) -> None:
        self.pipeline, self.first = pipeline, first
        self.raw_input = f"{first.name}_bytes"

    def preprocess(self, item: Item, context: dict[str, Any]) -> Arrays:
        row = self.pipeline(item.bytes())
        if not shape_fits(self.first.shape, row.shape):
            raise PreprocessingError(
                f"the image preprocesses to {list(row.shape)}, input '{self.first.name}' takes "
                f"{list(self.first.shape)}; set resize/crop in its config"
            )
        return {self.first.name: row}

    def warm(self) -> None:
        buffer = io.BytesIO()
        Image.new("RGB", (512, 384), (128, 64, 32)).save(buffer, format="JPEG")
        self.pipeline(buffer.getvalue())

    def dims_said(self, batched: bool) -> str:
        """Which of the input's dims are the image's height and width, for a 400 that names a
        dim by its number (a client sent a picture, not a tensor)."""
        offset = 1 if batched else 0
        height = offset + (1 if self.pipeline.spec.layout == "NCHW" else 0)
        return (
            f" (dim {height} is the image's height and dim {height + 1} its width, in pixels "
            "after its preprocessing's resize and crop)"
        )


class TextInput(Pipeline):
    """UTF-8 texts → token ids and attention mask, padded to a bucket (a batch at once: the
    tokenizer pads to the longest text, which stacking rows cannot)."""

    raw_input = "text"
    json_items = False

    def __init__(self, pipeline: TextPipeline) -> None:
        self.pipeline = pipeline

    def preprocess(self, item: Item, context: dict[str, Any]) -> Arrays:
        batch = self.preprocess_batch([item], [context])
        return {name: array[0] for name, array in batch.items()}

    def preprocess_batch(self, items: Sequence[Item], contexts: Sequence[dict[str, Any]]) -> Arrays:
        tokens = self.pipeline([item.text() for item in items])
        for context, truncated in zip(contexts, tokens.truncated, strict=True):
            context["truncated"] = truncated
        return {"input_ids": tokens.input_ids, "attention_mask": tokens.attention_mask}

    def parameters(self, contexts: Sequence[dict[str, Any]]) -> dict[str, Any]:
        truncated = [bool(c.get("truncated")) for c in contexts]
        return {"truncated": truncated} if any(truncated) else {}

    def warm(self) -> None:
        self.pipeline(["warm up the tokenizer"])


BUILT_IN = (ImageInput, TextInput)
"""The pipelines tensorgate ships: the core may run them on an instance's own thread."""


def check_names(
    pipeline: Pipeline | None,
    inputs: Sequence[TensorConfig],
    outputs: Sequence[TensorConfig],
    classifies: bool,
) -> None:
    """The names the server adds to a model's own (its pipeline's raw input, its code's
    ``answer``, the ``classification`` strings) must not be the model's: a request could not
    say which it meant (an output called ``answer`` came back empty, one called
    ``classification`` was a 400 on every request)."""
    said = "rename the model's tensor at export (or the pipeline's raw_input)"
    if pipeline is not None and pipeline.raw_input in {t.name for t in inputs}:
        raise ModelLoadError(
            f"the pipeline's raw input '{pipeline.raw_input}' is also an input of the model: {said}"
        )
    own = {t.name for t in outputs}
    if pipeline is not None and overrides(pipeline, "postprocess") and ANSWER in own:
        raise ModelLoadError(
            f"the model has an output named '{ANSWER}', the name its code's answers take: {said}"
        )
    if classifies and CLASSIFICATION in own:
        raise ModelLoadError(
            f"the model has an output named '{CLASSIFICATION}', the name its classification "
            f"postprocessing's top-k strings take: {said}"
        )


def bounded_signature(pipeline: Pipeline, signature: Signature) -> Signature:
    """The signature as clients may fill it. A text pipeline bounds token ids to its
    vocabulary and masks to 0 or 1, so a request that sends its own ids is checked before it
    can fail the batch it would join (the model's embedding lookup fails the whole batch on one
    id out of range)."""
    if not isinstance(pipeline, TextInput):
        return signature
    bounds = {
        "input_ids": (0.0, float(pipeline.pipeline.vocab_size - 1)),
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
    it); None for a model without preprocessing. ``folder`` is the version's (a text spec's
    tokenizer is in it; a model's own code is in the model's folder, above it)."""
    spec = config.preprocessing
    if spec is None:
        return None
    if isinstance(spec, TextSpec):
        return TextInput(_text_pipeline(spec, signature, folder))
    if isinstance(spec, PythonSpec):
        return load_pipeline(spec, folder.parent, model)
    pipeline = ImagePipeline(spec, SECOND_THREAD)
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
    return ImageInput(pipeline, first)


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
