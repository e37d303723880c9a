"""The image pipeline: encoded bytes (or a PIL image) → the model's input tensor, as numpy.

Built once from an :class:`~preprocessing.spec.ImageSpec`; calling it is pure and thread-safe, so
the server runs it in a thread pool (Pillow releases the GIL while it decodes and resizes).

What an image may cost is bounded by what the pipeline produces, not by what a client sends: the
formats Pillow may open are an allow-list, and the decoded pixel count and the aspect ratio (which
bounds the resized image) are checked from the header before any pixel is decoded.
"""

from __future__ import annotations

import bisect
import io
import re
import warnings
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext

import numpy as np
from numpy.typing import NDArray
from PIL import ExifTags, Image, ImageOps, UnidentifiedImageError

from preprocessing.halves import MIN_PIXELS, MODES, Halves, resize_in_halves
from preprocessing.pipeline import BadInput
from preprocessing.spec import ImageSpec

# Pillow's own default guard against decompression bombs is only a warning below 2x the limit.
# Here any image above the limit is an error, whatever the factor: set explicitly, not inherited.
MAX_IMAGE_PIXELS = 64 * 1024 * 1024
Image.MAX_IMAGE_PIXELS = MAX_IMAGE_PIXELS

MAX_ASPECT_RATIO = 20
"""Longest side over shortest side for an image that is resized. Beyond it the centre crop keeps
a sliver too thin to mean anything, and a resize without a crop would produce a tensor that grows
with the ratio (a 10000x1 strip resized to 256 is 2.56 M pixels long)."""

MAX_JPEG_SCANS = 100
"""Scans a JPEG may have. A progressive decoder goes over every block of the image once a scan,
data or not: 20,000 empty scans of 14 bytes each (a 674 KB file) held a decode of an 8192² JPEG
for 46 s, and a 64 MiB body could hold one for hours. Encoders write 10 or fewer (libjpeg's
progression: 10 for colour, 6 for grey); this leaves room beyond any."""

FORMATS = ("JPEG", "PNG", "WEBP", "GIF", "BMP", "TIFF")
"""The formats Pillow may open (its format names; JPEG covers MPO). Pillow reads some forty, each
a decoder a client could reach; these are the ones photos and datasets come in."""

_RESAMPLE = {
    "nearest": Image.Resampling.NEAREST,
    "bilinear": Image.Resampling.BILINEAR,
    "bicubic": Image.Resampling.BICUBIC,
    "lanczos": Image.Resampling.LANCZOS,
}


# EXIF orientations that need the image turned or flipped (1: upright; absent: upright).
_TRANSPOSED = frozenset(range(2, 9))

# "<_io.BytesIO object at 0x7f…>" in a decoder's message says nothing to a client.
_ADDRESS = re.compile(r"<[^<>]* at 0x[0-9a-fA-F]+>|\s+at 0x[0-9a-fA-F]+")


class PreprocessingError(BadInput):
    """The image cannot be turned into a tensor: the message says why, for the client to read."""


class ImagePipeline:
    """decode → EXIF orientation → colour → resize → crop → scale → normalize → layout → dtype."""

    def __init__(self, spec: ImageSpec, halves: Halves | None = None) -> None:
        """``halves``: a second thread for half of each resize when one is free (the server's;
        :mod:`preprocessing.halves`): the same pixels, sooner. Training code leaves it None."""
        self.spec = spec
        self._halves = halves
        channels = spec.channels
        mean = np.asarray(spec.mean, np.float32).reshape(1, -1)
        inv_std = (1.0 / np.asarray(spec.std, np.float32)).reshape(1, -1)
        levels = np.arange(256, dtype=np.float32).reshape(-1, 1)
        # (level * scale - mean) * (1 / std) for each of the 256 levels of each channel, in
        # float32 as it would be computed per pixel: looking a pixel up gives the same bits
        # as computing it, in a third of the time. Rows: channels, in the model's order.
        table = (levels * np.float32(spec.scale) - mean) * inv_std
        table = np.broadcast_to(table, (256, channels))  # one mean/std may serve every channel
        self._table = np.ascontiguousarray(table.T.astype(spec.dtype))
        self._channels = channels
        self._dtype = np.dtype(spec.dtype)

    @property
    def output_shape(self) -> tuple[int, ...] | None:
        """The tensor shape without batch dim, or ``None`` when it depends on the image size."""
        if self.spec.crop is None:
            return None
        side = self.spec.crop
        c = self._channels
        return (c, side, side) if self.spec.layout == "NCHW" else (side, side, c)

    def decode(self, data: bytes) -> Image.Image:
        """Bytes in one of :data:`FORMATS` → an upright image in the spec's colour mode.

        The size is checked from the header, before the pixels are decoded; any error Pillow
        raises while it reads, decodes or converts the image is a :class:`PreprocessingError`.
        What decoding holds at its peak is held by :func:`hold_decoding_with`'s hook, if any,
        while it runs.
        """
        image = _open(data)
        self.check_size(*image.size)
        with _held(image):
            return self._load(image, data)

    def _load(self, image: Image.Image, data: bytes) -> Image.Image:
        try:
            image.load()
            return self.normalize_mode(image)
        except (MemoryError, PreprocessingError):
            raise  # the server's trouble, not the client's; or said already
        except Exception as exc:  # every decoder raises its own kinds: all mean a bad file
            raise PreprocessingError(
                f"cannot decode image ({len(data)} bytes, {image.format}): {_reason(exc)}"
            ) from None

    def check_size(self, width: int, height: int) -> None:
        """Refuse an image this pipeline cannot make a meaningful tensor of, before decoding it."""
        spec = self.spec
        if spec.resize is not None and max(width, height) > MAX_ASPECT_RATIO * min(width, height):
            raise PreprocessingError(
                f"image is {width}x{height}, an aspect ratio of {_past(width, height)}:1; "
                "this model resizes "
                f"images and takes aspect ratios up to {MAX_ASPECT_RATIO}:1 (long side over "
                "short side)"
            )
        if spec.crop is not None:
            resized = _resized_size(width, height, spec.resize)
            if min(resized) < spec.crop:
                raise PreprocessingError(
                    f"image is {resized[0]}x{resized[1]} after resizing, smaller than the "
                    f"{spec.crop}x{spec.crop} crop"
                )

    def normalize_mode(self, image: Image.Image) -> Image.Image:
        """Apply EXIF orientation and convert any mode (P, LA, RGBA, CMYK, I;16…) to RGB or L."""
        if image.getexif().get(ExifTags.Base.Orientation, 1) in _TRANSPOSED:
            image = ImageOps.exif_transpose(image)  # a copy: only when it has to turn
        if image.mode in ("RGBA", "LA", "PA") or (
            image.mode == "P" and "transparency" in image.info
        ):
            rgba = image.convert("RGBA")
            background = Image.new("RGBA", rgba.size, (*self.spec.background, 255))
            image = Image.alpha_composite(background, rgba)
        if image.mode.startswith("I;16") or image.mode == "I":
            # 16-bit greyscale, in either byte order (a TIFF's I;16B): keep the top 8 bits
            # instead of clipping to white. "I" holds 16-bit values (older Pillow's PNGs) or a
            # 32-bit TIFF's, which have no one scale to 8 bits: refused, not wrapped.
            array = np.asarray(image)
            low, high = int(array.min()), int(array.max())
            if low < 0 or high > 65535:
                raise PreprocessingError(
                    f"image has {array.dtype.itemsize * 8}-bit integer pixels from {low} to "
                    f"{high}; this model takes images of 8 or 16 bits a channel: convert it"
                )
            image = Image.fromarray((array >> 8).astype(np.uint8), mode="L")
        elif image.mode == "F":
            raise PreprocessingError(
                "image has floating-point pixels (mode F), which have no one scale to 8 bits; "
                "this model takes images of 8 or 16 bits a channel: convert it"
            )
        target = "L" if self.spec.color == "L" else "RGB"
        return image if image.mode == target else image.convert(target)

    def from_image(self, image: Image.Image) -> NDArray[np.generic]:
        """A decoded image → the input tensor for one row (no batch dimension)."""
        self.check_size(*image.size)
        return self._tensor(self.normalize_mode(image))

    def __call__(self, data: bytes) -> NDArray[np.generic]:
        """Encoded bytes → the input tensor for one row (no batch dimension)."""
        image = _open(data)
        self.check_size(*image.size)
        with _held(image):  # until the image is resized: it is held until then
            return self._tensor(self._load(image, data))

    def _tensor(self, image: Image.Image) -> NDArray[np.generic]:
        """An upright RGB or L image → resize and crop → scale → normalize → layout → dtype."""
        spec = self.spec
        image = _resize_and_crop(
            image, spec.resize, spec.crop, _RESAMPLE[spec.interpolation], self._halves
        )
        pixels = np.asarray(image)  # uint8: RGB and L are 8 bits a channel
        if pixels.ndim == 2:
            pixels = pixels[:, :, None]
        if spec.color == "BGR":
            pixels = pixels[:, :, ::-1]
        height, width, channels = pixels.shape
        if spec.layout == "NCHW":
            tensor = np.empty((channels, height, width), self._dtype)
            for c in range(channels):
                np.take(self._table[c], pixels[:, :, c], out=tensor[c], mode="clip")
        else:
            tensor = np.empty((height, width, channels), self._dtype)
            for c in range(channels):
                tensor[:, :, c] = np.take(self._table[c], pixels[:, :, c], mode="clip")
        return tensor


_HOLD: Callable[[int], AbstractContextManager[object]] | None = None


def hold_decoding_with(
    hold: Callable[[int], AbstractContextManager[object]] | None,
    only: Callable[[int], AbstractContextManager[object]] | None = None,
) -> None:
    """Have every decode in this process hold ``hold(bytes)`` while it runs, the bytes
    :func:`working_bytes` gives (the server: a gate that has decodes take turns). Training
    code sets none. ``only``: change it only if ``only`` is the one set (a server stopping
    takes its own away, not another's)."""
    global _HOLD
    if only is None or only == _HOLD:
        _HOLD = hold


def working_bytes(image: Image.Image) -> int:
    """What decoding ``image`` (a header read, its pixels not yet) and converting it to RGB or
    L holds at its peak, resize included. Measured with 8192×8192 images: RGBA PNG 20 bytes a
    pixel (its copy, the background, their composite, then RGB), a palette with transparency
    17, 16-bit greyscale 9, greyscale TIFF 5, RGB JPEG 4.3."""
    mode = image.mode
    if mode in ("RGBA", "RGBa", "LA", "La", "PA") or (mode == "P" and "transparency" in image.info):
        per_pixel = 20
    elif mode.startswith("I") or mode == "F":
        per_pixel = 10
    else:
        per_pixel = 5  # a 12-megapixel photo: 60 MB
    return image.width * image.height * per_pixel


def _held(image: Image.Image) -> AbstractContextManager[object]:
    return nullcontext() if _HOLD is None else _HOLD(working_bytes(image))


def _open(data: bytes) -> Image.Image:
    """Read the header of an image in one of :data:`FORMATS`, refusing more than the pixel limit."""
    if not data:
        raise PreprocessingError("image is empty (0 bytes)")
    try:
        with warnings.catch_warnings():
            # Pillow warns between the limit and twice it; checked below with a clearer message.
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(data), formats=FORMATS)
    except Image.DecompressionBombError:
        raise PreprocessingError(
            f"image too large: more than {2 * MAX_IMAGE_PIXELS} pixels; this server decodes "
            f"images of at most {MAX_IMAGE_PIXELS} pixels ({MAX_IMAGE_PIXELS // 2**20} Mi)"
        ) from None
    except UnidentifiedImageError:
        raise PreprocessingError(
            f"cannot decode image ({len(data)} bytes): not in a format this server reads "
            f"({', '.join(FORMATS)})"
        ) from None
    except MemoryError:
        raise
    except Exception as exc:  # a header a plugin recognised and then could not parse
        raise PreprocessingError(
            f"cannot decode image ({len(data)} bytes): {_reason(exc)}"
        ) from None
    width, height = image.size
    if width * height > MAX_IMAGE_PIXELS:
        raise PreprocessingError(
            f"image too large: {width}x{height} is {width * height} pixels; this server decodes "
            f"images of at most {MAX_IMAGE_PIXELS} pixels ({MAX_IMAGE_PIXELS // 2**20} Mi)"
        )
    if image.format in ("JPEG", "MPO") and jpeg_scans(data) > MAX_JPEG_SCANS:
        raise PreprocessingError(
            f"JPEG has more than {MAX_JPEG_SCANS} scans; this server decodes JPEGs of at most "
            f"{MAX_JPEG_SCANS} (each scan is a pass over the whole image; encoders write 10 or "
            "fewer)"
        )
    return image


def _past(width: int, height: int) -> str:
    """Long side over short side, rounded up to 2 decimals (20.04, never "20" past 20)."""
    hundredths = -(-100 * max(width, height) // max(1, min(width, height)))
    return f"{hundredths / 100:.2f}".rstrip("0").rstrip(".")


def jpeg_scans(data: bytes) -> int:
    """How many scans (SOS markers) libjpeg would read of a JPEG, counted as it reads them:
    segments skipped by their lengths (APPn, an EXIF thumbnail's scans among them), a scan's
    entropy-coded data to the next marker (where 0xFF is stuffed, FF 00, or a restart), bytes
    between segments skipped as libjpeg skips them, and nothing after the first image's EOI (a
    motion photo's video, an MPO's other pictures). Counting stops past :data:`MAX_JPEG_SCANS`."""
    array = np.frombuffer(data, np.uint8)
    at_ff = np.flatnonzero(array[:-1] == 0xFF)
    following = array[at_ff + 1]
    # markers: 0xFF then neither a stuffed zero, a fill byte nor a restart (RST0-7)
    marks = at_ff[
        (following != 0) & (following != 0xFF) & ((following < 0xD0) | (following > 0xD7))
    ]
    markers = marks.tolist()
    scans, pos, end = 0, 2, len(data)
    while scans <= MAX_JPEG_SCANS:
        index = bisect.bisect_left(markers, pos)
        if index == len(markers):
            break
        at = markers[index]
        marker = data[at + 1]
        if marker == 0xD9:  # EOI: the image ends
            break
        if marker == 0x01 or 0xD0 <= marker <= 0xD8:  # no segment follows
            pos = at + 2
            continue
        if at + 4 > end:
            break
        pos = at + 2 + int.from_bytes(data[at + 2 : at + 4], "big")
        scans += marker == 0xDA
    return scans


def _reason(exc: Exception) -> str:
    """A decoder's error as a client may read it: its message without object addresses."""
    message = _ADDRESS.sub("", str(exc)).strip()
    return message or type(exc).__name__


def _resized_size(width: int, height: int, size: int | None) -> tuple[int, int]:
    """The image's size once its shorter side is ``size`` (aspect kept); unchanged for None."""
    if size is None or min(width, height) == size:
        return width, height
    if width <= height:
        return size, max(1, round(height * size / width))
    return max(1, round(width * size / height)), size


def _resize_and_crop(
    image: Image.Image,
    size: int | None,
    crop: int | None,
    resample: Image.Resampling,
    halves: Halves | None = None,
) -> Image.Image:
    """Resize the shorter side to ``size``, then centre crop ``crop`` × ``crop``; with
    ``halves`` ready, each of the resize's passes in two halves on two threads (the same pixels:
    :mod:`preprocessing.halves`).

    The whole image is resized, then cropped: resampling only the source box under the crop
    (``resize(box=...)``) passes the box to Pillow as float32 and moves pixels by a level, which
    moves the logits of the bundled classifier beyond its golden tolerance. The resize stays
    bounded without it: :data:`MAX_ASPECT_RATIO` keeps it under ``size² × MAX_ASPECT_RATIO``
    pixels, whatever the image.
    """
    width, height = image.size
    new_size = _resized_size(width, height, size)
    if crop is None:
        box = (0, 0, *new_size)
    else:
        left, top = (new_size[0] - crop) // 2, (new_size[1] - crop) // 2
        box = (left, top, left + crop, top + crop)
    if new_size == (width, height):
        return image if crop is None else image.crop(box)
    if (
        halves is not None
        and resample != Image.Resampling.NEAREST
        and image.mode in MODES
        and width * height >= MIN_PIXELS
        and halves.ready()
    ):
        return resize_in_halves(image, new_size, box, resample, halves)
    image = image.resize(new_size, resample)
    return image if crop is None else image.crop(box)
