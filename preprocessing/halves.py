"""A resize in two halves on two threads, pixel for pixel the same as Pillow's whole resize.

Pillow resizes in two passes, one per axis, rounding to 8 bits between them: a horizontal pass
works on each row alone, a vertical pass on each column alone. Cut into bands across the pass,
each band resized on its own thread (Pillow releases the GIL while it resamples), the bands put
back together are what the whole pass would have made, bit for bit, and the crop can be taken
between the passes, so the second pass resamples only the columns (or rows) it keeps. Cutting
the image the other way (``resize(box=...)``) is not exact: Pillow takes the box as float32.

Which pass comes first is Pillow's choice, and it changes the result by a level here and there:
Pillow 13 runs the vertical pass first when the height shrinks by more than twice as many pixels
as the width (``ImagingResampleInner``); earlier versions ran the horizontal pass first. The
rule is :func:`vertical_first`, and :func:`matches_pillow` checks it against the Pillow
installed, at its boundary: a server finding it differs resizes whole.

Training code never needs this: it resizes whole (``halves=None``), and so does the server
whenever it has no idle CPU to give the second half.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import numpy as np
from PIL import Image

MODES = ("RGB", "L")
"""The modes resized in halves: those the image pipeline resizes (``normalize_mode``)."""

MIN_PIXELS = 1 << 17
"""Source images smaller than this (362×362) resize whole: handing half of it to another thread
costs more than the half (about 0.1 ms to hand over and paste back)."""


class Halves(Protocol):
    """Runs the two halves of a pass, on two threads when it can (the server's is
    ``service.resources.SecondThread``)."""

    def ready(self) -> bool:
        """Whether a second thread (and a CPU for it) is free now: asked once per image."""
        ...

    def __call__(
        self, first: Callable[[], Image.Image], second: Callable[[], Image.Image]
    ) -> tuple[Image.Image, Image.Image]:
        """Both results; ``second`` on the other thread, or after ``first`` if it was taken."""
        ...


def vertical_first(width: int, height: int, new_width: int, new_height: int) -> bool:
    """Whether Pillow resizes this size to that one vertical pass first (Pillow 13's rule)."""
    shrunk = height - new_height
    return shrunk > 0 and shrunk > 2 * (width - new_width)


def resize_in_halves(
    image: Image.Image,
    size: tuple[int, int],
    box: tuple[int, int, int, int],
    resample: Image.Resampling,
    halves: Halves,
) -> Image.Image:
    """``image.resize(size, resample).crop(box)``, each pass in two bands run by ``halves``.

    ``resample`` is one of Pillow's convolution filters (not NEAREST, which is not two passes)
    and ``image`` is RGB or L (Pillow premultiplies alpha around each resize: RGBA and LA
    resized in halves differ)."""
    width, height = image.size
    new_width, new_height = size
    left, top, right, bottom = box
    if vertical_first(width, height, new_width, new_height):
        image = _pass_in_halves(image, (width, new_height), resample, halves)
        image = image.crop((0, top, width, bottom))
        if new_width != width:
            image = _pass_in_halves(image, (new_width, bottom - top), resample, halves)
        return image.crop((left, 0, right, bottom - top))
    if new_width != width:
        image = _pass_in_halves(image, (new_width, height), resample, halves)
    image = image.crop((left, 0, right, height))
    if new_height != height:
        image = _pass_in_halves(image, (right - left, new_height), resample, halves)
    return image.crop((0, top, right - left, bottom))


def _pass_in_halves(
    image: Image.Image, new_size: tuple[int, int], resample: Image.Resampling, halves: Halves
) -> Image.Image:
    """One of Pillow's passes (``new_size`` differs from the image's along one axis), in two
    halves cut across it: the top and bottom rows for the horizontal pass, the left and right
    columns for the vertical one."""
    width, height = image.size
    if min(width, height) < 2:  # a band 1 pixel across has no two halves
        return image.resize(new_size, resample)
    if new_size[1] == height:
        cut = height // 2
        boxes = (0, 0, width, cut), (0, cut, width, height)
        sizes = (new_size[0], cut), (new_size[0], height - cut)
        second_at = (0, cut)
    else:
        cut = width // 2
        boxes = (0, 0, cut, height), (cut, 0, width, height)
        sizes = (cut, new_size[1]), (width - cut, new_size[1])
        second_at = (cut, 0)
    first, second = halves(
        lambda: image.crop(boxes[0]).resize(sizes[0], resample),
        lambda: image.crop(boxes[1]).resize(sizes[1], resample),
    )
    out = Image.new(image.mode, new_size)
    out.paste(first, (0, 0))
    out.paste(second, second_at)
    return out


class OneThread:
    """:class:`Halves` that runs both halves on the calling thread (for checks and tests)."""

    def ready(self) -> bool:
        return True

    def __call__(
        self, first: Callable[[], Image.Image], second: Callable[[], Image.Image]
    ) -> tuple[Image.Image, Image.Image]:
        return first(), second()


def matches_pillow() -> bool:
    """Whether :func:`resize_in_halves` makes the installed Pillow's pixels: sizes on both sides
    of :func:`vertical_first`'s boundary, where the two orders differ, in RGB and L, with every
    filter the pipeline offers (about 20 ms)."""
    rng = np.random.default_rng(0)
    # 100→79 shrinks the height by 21 > 2 × 10: vertical first; 100→80 by 20: horizontal first.
    cases = [
        ((40, 100), (30, 79)),
        ((40, 100), (30, 80)),
        ((100, 40), (79, 30)),
        ((64, 48), (42, 32)),
    ]
    filters = (Image.Resampling.BILINEAR, Image.Resampling.BICUBIC, Image.Resampling.LANCZOS)
    for channels in ((3,), ()):  # RGB, L
        for (width, height), size in cases:
            image = Image.fromarray(rng.integers(0, 256, (height, width, *channels), np.uint8))
            box = (size[0] // 4, size[1] // 4, size[0] - size[0] // 5, size[1] - size[1] // 5)
            for resample in filters:
                whole = image.resize(size, resample).crop(box)
                halved = resize_in_halves(image, size, box, resample, OneThread())
                if whole.tobytes() != halved.tobytes():
                    return False
    return True
