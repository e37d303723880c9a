"""Adapters so that training code feeds a model through the very pipeline the server uses.

torch is imported here only; the rest of the package is torch-free, so the server's
preprocessing never needs it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from PIL import Image

from preprocessing.image import ImagePipeline
from preprocessing.pipeline import Pipeline, as_item
from preprocessing.spec import ImageSpec


class ImageTransform:
    """A torchvision-style transform: PIL image, encoded bytes or a file path → ``torch.Tensor``.

    ``ImageTransform(spec)`` is a drop-in for a ``transforms.Compose([...])`` in a Dataset, and
    produces exactly the tensor the server builds for the same file.
    """

    def __init__(self, spec: ImageSpec | ImagePipeline) -> None:
        self.pipeline = spec if isinstance(spec, ImagePipeline) else ImagePipeline(spec)

    def __call__(self, item: Image.Image | bytes | str | Path) -> torch.Tensor:
        if isinstance(item, Image.Image):
            array = self.pipeline.from_image(item)
        elif isinstance(item, bytes):
            array = self.pipeline(item)
        else:
            array = self.pipeline(Path(item).read_bytes())
        return torch.from_numpy(array)


class ImageDataset(torch.utils.data.Dataset[tuple[torch.Tensor, int]]):
    """Images (PIL, bytes or paths) with integer labels, through the shared pipeline."""

    def __init__(
        self,
        images: Sequence[Image.Image | bytes | str | Path],
        labels: Sequence[int],
        spec: ImageSpec | ImagePipeline,
        target_transform: Callable[[int], int] | None = None,
    ) -> None:
        if len(images) != len(labels):
            raise ValueError(f"{len(images)} images but {len(labels)} labels")
        self.images = images
        self.labels = labels
        self.transform = ImageTransform(spec)
        self.target_transform = target_transform

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        label = self.labels[index]
        if self.target_transform is not None:
            label = self.target_transform(label)
        return self.transform(self.images[index]), label


class PipelineDataset(torch.utils.data.Dataset[tuple[dict[str, torch.Tensor], int]]):
    """Raw items (JSON values, or bytes) with integer labels, through a model's own
    :class:`~preprocessing.pipeline.Pipeline`: each sample is what its ``preprocess`` makes for
    the item, as the server makes it, so a ``DataLoader`` stacks the rows the server stacks."""

    def __init__(self, pipeline: Pipeline, items: Sequence[Any], labels: Sequence[int]) -> None:
        if len(items) != len(labels):
            raise ValueError(f"{len(items)} items but {len(labels)} labels")
        self.pipeline, self.items, self.labels = pipeline, items, labels

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int) -> tuple[dict[str, torch.Tensor], int]:
        rows = self.pipeline.preprocess(as_item(self.items[index]), {})
        return {name: torch.from_numpy(array) for name, array in rows.items()}, self.labels[index]
