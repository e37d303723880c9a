"""The declarative preprocessing spec and its stable hash.

A spec is data, not code: it lives in a model's ``config.yaml``, is recorded in the artifact's
``manifest.json`` at export, and the server refuses a model whose served spec does not hash to
the recorded one. The hash therefore covers every field with its default filled in, so that
writing a default explicitly does not change it.
"""

from __future__ import annotations

import hashlib
import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator


class ImageSpec(BaseModel):
    """decode → colour order → resize shorter side → centre crop → scale → normalize → layout."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: Literal["image"] = "image"
    color: Literal["RGB", "BGR", "L"] = "RGB"
    """Channel order the model was trained on; ``L`` is single-channel greyscale."""
    resize: int | None = Field(default=None, gt=0)
    """Resize so that the shorter side has this many pixels (aspect kept); ``None`` keeps size."""
    crop: int | None = Field(default=None, gt=0)
    """Centre crop to a ``crop`` × ``crop`` square after resizing; ``None`` skips it."""
    interpolation: Literal["nearest", "bilinear", "bicubic", "lanczos"] = "bilinear"
    scale: float = 1.0 / 255.0
    """Multiplies the 0–255 pixel values before normalisation."""
    mean: tuple[float, ...] = (0.0,)
    std: tuple[float, ...] = (1.0,)
    layout: Literal["NCHW", "NHWC"] = "NCHW"
    dtype: Literal["float32", "float16"] = "float32"
    background: tuple[int, int, int] = (255, 255, 255)
    """Colour that transparent pixels are composited onto before alpha is dropped."""

    @field_validator("mean", "std")
    @classmethod
    def _per_channel(cls, values: tuple[float, ...], info: ValidationInfo) -> tuple[float, ...]:
        color = info.data.get("color", "RGB")
        channels = 1 if color == "L" else 3
        if len(values) not in (1, channels):
            raise ValueError(f"has {len(values)} values; color {color} needs 1 or {channels}")
        if info.field_name == "std" and any(s == 0 for s in values):
            raise ValueError("must not contain 0")
        return values

    @property
    def channels(self) -> int:
        return 1 if self.color == "L" else 3


class TextSpec(BaseModel):
    """UTF-8 text → token ids and attention mask, padded to the smallest bucket that fits."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: Literal["text"] = "text"
    tokenizer: str = "tokenizer.json"
    """A ``tokenizers`` JSON file in the model's version folder."""
    tokenizer_sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    """The file's sha256: part of the spec, so that a changed tokenizer changes the hash."""
    max_length: int = Field(gt=1)
    """Longest sequence in tokens, special tokens included."""
    buckets: tuple[int, ...]
    """Sequence lengths batches are padded to; the largest must equal max_length."""
    truncate: bool = True
    """Cut longer texts at max_length (and report it); false: refuse them with 400."""
    pad_id: int = Field(default=0, ge=0)

    @model_validator(mode="before")
    @classmethod
    def _says_how_to_hash(cls, data: Any) -> Any:
        """The sha256 missing is a 400 saying how to make it (pydantic said "Field required")."""
        if isinstance(data, dict) and "tokenizer_sha256" not in data:
            name = data.get("tokenizer", "tokenizer.json")
            raise ValueError(
                "tokenizer_sha256 is required: the sha256 of the tokenizer file, in hex "
                f"(`sha256sum {name}`), so that a changed tokenizer changes the spec's hash"
            )
        return data

    @field_validator("buckets")
    @classmethod
    def _ascending(cls, buckets: tuple[int, ...], info: ValidationInfo) -> tuple[int, ...]:
        if not buckets or list(buckets) != sorted(set(buckets)) or buckets[0] < 1:
            raise ValueError(f"must be ascending lengths ≥ 1 (got {list(buckets)})")
        if buckets[-1] != info.data.get("max_length"):
            raise ValueError(f"the largest ({buckets[-1]}) must equal max_length")
        return buckets


class PythonSpec(BaseModel):
    """A model's own :class:`~preprocessing.pipeline.Pipeline` subclass: code, not data, so
    export records the sources' hashes and end-to-end answers beside this spec's hash."""

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)

    kind: Literal["python"] = "python"
    module: str = Field(pattern=r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")
    """Without ``package``: a file of the model's folder, beside config.yaml (``pipeline`` is
    ``pipeline.py``); with it: a module of that installed package."""
    cls: str = Field(alias="class", pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")
    """The class in ``module``: a subclass of ``preprocessing.pipeline.Pipeline``."""
    params: dict[str, Any] = Field(default_factory=dict)
    """Keyword arguments the class is built with (JSON values: the training's statistics)."""
    package: str | None = Field(default=None, pattern=r"^[A-Za-z0-9_.\-]+==[A-Za-z0-9_.+!\-]+$")
    """``name==version`` of the installed distribution ``module`` comes from."""


PreprocessingSpec = Annotated[ImageSpec | TextSpec | PythonSpec, Field(discriminator="kind")]
"""Every kind of spec the server knows, told apart by ``kind``."""


def spec_hash(spec: BaseModel) -> str:
    """A stable sha256 of the spec: canonical JSON with every default filled in, sorted keys."""
    canonical = json.dumps(spec.model_dump(mode="json"), sort_keys=True, separators=(",", ":"))
    return "sha256:" + hashlib.sha256(canonical.encode()).hexdigest()
