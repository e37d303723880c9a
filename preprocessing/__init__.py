"""Preprocessing shared by training code and the tensorgate server.

The server builds one pipeline per model from the spec in its ``config.yaml``; training code
builds the very same pipeline from the same spec (see :mod:`preprocessing.torch`), so what a
model saw in training is what it sees in production, byte for byte.
"""

from preprocessing.image import ImagePipeline, PreprocessingError
from preprocessing.pipeline import BadInput, Item, Pipeline
from preprocessing.spec import ImageSpec, PreprocessingSpec, PythonSpec, TextSpec, spec_hash
from preprocessing.text import TextPipeline, TokenBatch

__all__ = [
    "BadInput",
    "ImagePipeline",
    "ImageSpec",
    "Item",
    "Pipeline",
    "PreprocessingError",
    "PreprocessingSpec",
    "PythonSpec",
    "TextPipeline",
    "TextSpec",
    "TokenBatch",
    "spec_hash",
]
