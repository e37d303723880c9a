import io
import struct
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import skimage.data
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image

from preprocessing import ImagePipeline, ImageSpec, PreprocessingError
from preprocessing.image import (
    FORMATS,
    MAX_ASPECT_RATIO,
    MAX_IMAGE_PIXELS,
    MAX_JPEG_SCANS,
    jpeg_scans,
)
from preprocessing.torch import ImageDataset, ImageTransform
from tests.conftest import encode

PLAIN = ImageSpec(resize=64, crop=64, scale=1.0)  # raw 0–255 values, easy to reason about


def png(image: Image.Image, **options: object) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG", **options)
    return buffer.getvalue()


@pytest.fixture(scope="module")
def astronaut() -> Image.Image:
    return Image.fromarray(skimage.data.astronaut())


def test_resizes_shorter_side_then_centre_crops() -> None:
    image = Image.fromarray(np.zeros((300, 400, 3), np.uint8))
    spec = ImageSpec(resize=256, crop=224)
    assert ImagePipeline(spec).from_image(image).shape == (3, 224, 224)
    assert ImagePipeline(spec).output_shape == (3, 224, 224)
    nhwc = ImageSpec(resize=256, crop=224, layout="NHWC", dtype="float16")
    out = ImagePipeline(nhwc).from_image(image)
    assert out.shape == (224, 224, 3)
    assert out.dtype == np.float16


def test_normalizes_with_mean_and_std_per_channel() -> None:
    image = Image.new("RGB", (8, 8), (255, 0, 51))
    spec = ImageSpec(mean=(0.5, 0.0, 0.2), std=(0.5, 1.0, 0.2))
    out = ImagePipeline(spec).from_image(image)
    np.testing.assert_allclose(out[:, 0, 0], [1.0, 0.0, 0.0], atol=1e-6)


@pytest.mark.parametrize("color", ["RGB", "BGR", "L"])
@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_normalizing_is_the_per_pixel_arithmetic_bit_for_bit(
    astronaut: Image.Image, color: str, layout: str, dtype: str
) -> None:
    channels = 1 if color == "L" else 3
    mean, std = (0.485, 0.456, 0.406)[:channels], (0.229, 0.224, 0.225)[:channels]
    spec = ImageSpec(
        resize=256, crop=224, color=color, layout=layout, dtype=dtype, mean=mean, std=std
    )
    got = ImagePipeline(spec)(encode(np.asarray(astronaut), "JPEG", quality=90))
    # what the pipeline computes, written out pixel by pixel in float32 (as torchvision would)
    image = Image.open(io.BytesIO(encode(np.asarray(astronaut), "JPEG", quality=90)))
    image = image.convert("L" if color == "L" else "RGB").resize(
        (256, 256), Image.Resampling.BILINEAR
    )
    pixels = np.asarray(image.crop((16, 16, 240, 240)), dtype=np.float32).reshape(224, 224, -1)
    if color == "BGR":
        pixels = pixels[:, :, ::-1]
    mean_ = np.asarray(mean, np.float32)
    inv_std = np.float32(1.0) / np.asarray(std, np.float32)
    expected = (pixels * np.float32(1 / 255) - mean_) * inv_std
    if layout == "NCHW":
        expected = expected.transpose(2, 0, 1)
    expected = np.ascontiguousarray(expected, dtype=dtype)
    assert got.dtype == expected.dtype and got.shape == expected.shape
    assert got.tobytes() == expected.tobytes()


def test_one_mean_and_std_serve_every_channel(astronaut: Image.Image) -> None:
    spec = ImageSpec(resize=64, crop=64, mean=(0.5,), std=(0.25,))
    got = ImagePipeline(spec).from_image(astronaut)
    pixels = np.asarray(astronaut.resize((64, 64), Image.Resampling.BILINEAR), np.float32)
    expected = (pixels * np.float32(1 / 255) - np.float32(0.5)) * (np.float32(1) / np.float32(0.25))
    assert got.tobytes() == np.ascontiguousarray(expected.transpose(2, 0, 1)).tobytes()


def test_bgr_is_the_rgb_tensor_with_channels_reversed(astronaut: Image.Image) -> None:
    rgb = ImagePipeline(PLAIN).from_image(astronaut)
    bgr = ImagePipeline(PLAIN.model_copy(update={"color": "BGR"})).from_image(astronaut)
    np.testing.assert_array_equal(bgr, rgb[::-1])


def test_greyscale_becomes_three_equal_channels_for_an_rgb_model(astronaut: Image.Image) -> None:
    out = ImagePipeline(PLAIN)(png(astronaut.convert("L")))
    assert out.shape == (3, 64, 64)
    np.testing.assert_array_equal(out[0], out[1])
    np.testing.assert_array_equal(out[1], out[2])


def test_transparent_pixels_are_composited_onto_the_background() -> None:
    image = Image.new("RGBA", (64, 64), (10, 20, 30, 0))
    out = ImagePipeline(PLAIN)(png(image))
    assert np.all(out == 255.0)
    black = ImagePipeline(PLAIN.model_copy(update={"background": (0, 0, 0)}))(png(image))
    assert np.all(black == 0.0)


def test_palette_with_transparency_and_16_bit_greyscale_decode() -> None:
    palette = Image.new("P", (64, 64), 0)
    palette.info["transparency"] = 0
    assert ImagePipeline(PLAIN)(png(palette, transparency=0)).shape == (3, 64, 64)
    deep = Image.fromarray(np.full((64, 64), 65535, np.uint16))
    out = ImagePipeline(PLAIN)(png(deep))
    assert np.all(out == 255.0)


def test_16_bit_greyscale_in_either_byte_order_gives_the_same_tensor() -> None:
    """A big-endian 16-bit TIFF (Pillow's I;16B) was converted as if it were 8 bits: every
    pixel clipped to white, a confident wrong answer with a 200."""
    values = (np.arange(64 * 64, dtype=np.uint32).reshape(64, 64) * 16).astype(np.uint16)
    little = ImagePipeline(PLAIN)(png(Image.fromarray(values)))
    big = Image.frombytes("I;16B", (64, 64), values.astype(">u2").tobytes())
    stored = io.BytesIO()
    big.save(stored, format="TIFF")
    assert Image.open(io.BytesIO(stored.getvalue())).mode == "I;16B"
    np.testing.assert_array_equal(ImagePipeline(PLAIN)(stored.getvalue()), little)
    assert len(np.unique(little)) > 200  # the gradient kept, not clipped


@pytest.mark.parametrize(
    ("mode", "values", "message"),
    [
        ("I", np.arange(64 * 64, dtype=np.int32) * 100, "32-bit integer pixels from 0 to 409500"),
        ("F", np.linspace(0, 1, 64 * 64, dtype=np.float32), r"floating-point pixels \(mode F\)"),
    ],
)
def test_pixels_with_no_one_scale_to_8_bits_are_refused(
    mode: str, values: np.ndarray, message: str
) -> None:
    """A 32-bit integer TIFF was shifted by 8 bits and wrapped (a 200 for "manhole cover");
    a float one clipped to black."""
    stored = io.BytesIO()
    Image.frombytes(mode, (64, 64), values.tobytes()).save(stored, format="TIFF")
    with pytest.raises(PreprocessingError, match=message):
        ImagePipeline(PLAIN)(stored.getvalue())


@pytest.mark.parametrize(
    ("orientation", "stored"),
    [
        (3, Image.Transpose.ROTATE_180),
        (6, Image.Transpose.ROTATE_90),
        (8, Image.Transpose.ROTATE_270),
    ],
)
def test_exif_orientation_is_applied(
    astronaut: Image.Image, orientation: int, stored: Image.Transpose
) -> None:
    exif = Image.Exif()
    exif[0x0112] = orientation
    rotated = png(astronaut.transpose(stored), exif=exif.tobytes())
    np.testing.assert_array_equal(
        ImagePipeline(PLAIN)(rotated), ImagePipeline(PLAIN).from_image(astronaut)
    )


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (b"", "image is empty"),
        (b"not an image at all", "cannot decode image"),
        (png(Image.fromarray(skimage.data.astronaut()))[:5000], "cannot decode image"),
    ],
)
def test_undecodable_bytes_raise_a_preprocessing_error(data: bytes, message: str) -> None:
    with pytest.raises(PreprocessingError, match=message):
        ImagePipeline(PLAIN)(data)


def test_decompression_bomb_is_refused_before_it_is_decoded() -> None:
    bomb = png(Image.new("1", (10_000, 10_000)))  # 100 Mpx in a few kB
    assert len(bomb) < 100_000
    with pytest.raises(PreprocessingError, match="image too large"):
        ImagePipeline(PLAIN)(bomb)


def test_image_smaller_than_the_crop_is_refused() -> None:
    spec = ImageSpec(crop=32)
    with pytest.raises(PreprocessingError, match="smaller than the 32x32 crop"):
        ImagePipeline(spec)(png(Image.new("RGB", (16, 40))))


def test_torch_adapter_gives_the_servers_tensor_byte_for_byte(
    astronaut: Image.Image, tmp_path: Path
) -> None:
    spec = ImageSpec(resize=256, crop=224, mean=(0.485, 0.456, 0.406), std=(0.229, 0.224, 0.225))
    data = encode(np.asarray(astronaut), "JPEG", quality=90)
    path = tmp_path / "astronaut.jpg"
    path.write_bytes(data)
    served = ImagePipeline(spec)(data)
    transform = ImageTransform(spec)
    for item in (data, path, str(path), Image.open(io.BytesIO(data))):
        assert transform(item).numpy().tobytes() == served.tobytes()
    dataset = ImageDataset([data], [7], spec)
    tensor, label = dataset[0]
    assert label == 7
    assert tensor.numpy().tobytes() == served.tobytes()


IMAGENET = ImageSpec(resize=256, crop=224, mean=(0.485, 0.456, 0.406), std=(0.229, 0.224, 0.225))


@pytest.mark.parametrize("size", [(10_000, 1), (1, 10_000)])
def test_a_strip_is_refused_before_decoding_naming_the_aspect_ratio_limit(
    size: tuple[int, int],
) -> None:
    """A 10000×1 PNG is about a hundred bytes; resized whole it would be 2.56 M × 256 pixels."""
    strip = png(Image.new("L", size))
    assert len(strip) < 200
    width, height = size
    with pytest.raises(
        PreprocessingError,
        match=rf"image is {width}x{height}, an aspect ratio of 10000:1; .* up to 20:1",
    ):
        ImagePipeline(IMAGENET)(strip)
    with pytest.raises(PreprocessingError, match="up to 20:1"):
        ImagePipeline(IMAGENET).from_image(Image.new("L", size))


def test_the_aspect_ratio_limit_itself_is_served() -> None:
    assert MAX_ASPECT_RATIO == 20
    at_limit = png(Image.new("RGB", (20 * 13, 13)))
    assert ImagePipeline(IMAGENET)(at_limit).shape == (3, 224, 224)
    with pytest.raises(PreprocessingError, match="21:1"):
        ImagePipeline(IMAGENET)(png(Image.new("RGB", (21 * 13, 13))))
    # Without a resize the crop reads what the image has: no aspect ratio to refuse.
    assert ImagePipeline(ImageSpec(crop=8))(png(Image.new("L", (10_000, 8)))).shape == (3, 8, 8)


@pytest.mark.parametrize(("size", "said"), [((224, 11), "20.37"), ((501, 25), "20.04")])
def test_a_ratio_just_past_the_limit_is_told_past_it(size: tuple[int, int], said: str) -> None:
    """224×11 is 20.36:1; rounded, it was told as "20:1" beside a limit of "up to 20:1"."""
    with pytest.raises(PreprocessingError, match=rf"an aspect ratio of {said}:1; .* up to 20:1"):
        ImagePipeline(IMAGENET)(png(Image.new("RGB", size)))


def with_empty_scans(jpeg: bytes, count: int) -> bytes:
    """A progressive JPEG with ``count`` more scans of no data before its first (14 bytes each:
    a copy of the first scan's header)."""
    first = jpeg.index(b"\xff\xda")
    length = int.from_bytes(jpeg[first + 2 : first + 4], "big")
    return jpeg[:first] + jpeg[first : first + 2 + length] * count + jpeg[first:]


def test_a_jpeg_of_more_scans_than_any_encoder_writes_is_refused_before_decoding() -> None:
    """Each scan is a pass of the decoder over every block, data or not: 20,000 empty scans
    (674 KB) held one decode of an 8192² JPEG for 46 s, the instance's thread with it. A JPEG
    of more than MAX_JPEG_SCANS is refused from its bytes; photos and an EXIF thumbnail's
    own scans are served."""
    buffer = io.BytesIO()
    Image.fromarray(skimage.data.chelsea()).save(buffer, "JPEG", progressive=True)
    photo = buffer.getvalue()
    assert jpeg_scans(photo) == 10  # libjpeg's progression for colour
    assert ImagePipeline(IMAGENET)(with_empty_scans(photo, MAX_JPEG_SCANS - 10)).shape
    crafted = with_empty_scans(photo, 20_000)
    assert jpeg_scans(crafted) == MAX_JPEG_SCANS + 1  # counting stops there
    with pytest.raises(
        PreprocessingError, match=rf"JPEG has more than {MAX_JPEG_SCANS} scans; .* at most"
    ):
        ImagePipeline(IMAGENET)(crafted)
    # a junk byte before a marker, which libjpeg skips (and decodes on): still counted
    frame = crafted.index(b"\xff\xc2")
    junk = crafted[:frame] + b"\x00" + crafted[frame:]
    assert Image.open(io.BytesIO(junk)).size == (451, 300)
    assert jpeg_scans(junk) == MAX_JPEG_SCANS + 1
    # a motion photo's video after the picture's EOI is not the picture's: not counted
    noise = np.random.default_rng(0).integers(0, 256, 8 << 20, dtype=np.uint8).tobytes()
    assert jpeg_scans(photo + noise) == 10
    thumbnail = io.BytesIO()
    Image.new("RGB", (160, 120), (1, 2, 3)).save(thumbnail, "JPEG", progressive=True)
    exif = Image.Exif()
    exif[0x0201] = 0  # the thumbnail's offset and length: the EXIF block holds its bytes
    with_thumbnail = io.BytesIO()
    Image.fromarray(skimage.data.chelsea()).save(
        with_thumbnail, "JPEG", exif=exif.tobytes() + thumbnail.getvalue()
    )
    assert jpeg_scans(with_thumbnail.getvalue()) == 1  # the thumbnail's 10 skipped with its APP1


def test_pixels_beyond_the_limit_are_refused_naming_the_limit_and_the_image() -> None:
    assert MAX_IMAGE_PIXELS == 64 * 2**20
    big = png(Image.new("1", (9000, 8000)))  # 72 M pixels: above the limit, below Pillow's 2x
    with pytest.raises(
        PreprocessingError,
        match=r"image too large: 9000x8000 is 72000000 pixels; this server decodes images of "
        r"at most 67108864 pixels \(64 Mi\)",
    ):
        ImagePipeline(PLAIN)(big)


def dds_with_an_unknown_pixel_format() -> bytes:
    """A DDS header whose FourCC Pillow's DDS reader raises NotImplementedError for."""
    header = struct.pack("<4s7I", b"DDS ", 124, 0x1007, 4, 4, 0, 0, 0) + bytes(44)
    pixel_format = struct.pack("<2I4s5I", 32, 0x4, b"ABCD", 0, 0, 0, 0, 0)
    return header + pixel_format + struct.pack("<5I", 0x1000, 0, 0, 0, 0) + bytes(64)


def pillow_encoded(fmt: str) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (32, 32), (10, 20, 30)).save(buffer, format=fmt)
    return buffer.getvalue()


@pytest.mark.parametrize(
    "data",
    [
        dds_with_an_unknown_pixel_format(),
        *(pillow_encoded(f) for f in ("ICO", "TGA", "PCX", "PPM", "SGI", "QOI", "DDS")),
    ],
    ids=["dds-unknown-pixel-format", "ico", "tga", "pcx", "ppm", "sgi", "qoi", "dds"],
)
def test_a_format_outside_the_allow_list_is_refused_by_name(data: bytes) -> None:
    with pytest.raises(
        PreprocessingError,
        match=r"not in a format this server reads \(JPEG, PNG, WEBP, GIF, BMP, TIFF\)",
    ):
        ImagePipeline(PLAIN)(data)


@pytest.mark.parametrize("fmt", FORMATS)
def test_every_format_on_the_allow_list_decodes(astronaut: Image.Image, fmt: str) -> None:
    buffer = io.BytesIO()
    astronaut.save(buffer, format=fmt)
    assert ImagePipeline(PLAIN)(buffer.getvalue()).shape == (3, 64, 64)


def test_a_camera_jpeg_holding_several_pictures_decodes_its_first() -> None:
    first, second = Image.new("RGB", (40, 30), (200, 10, 10)), Image.new("RGB", (40, 30), 0)
    buffer = io.BytesIO()
    first.save(buffer, format="MPO", save_all=True, append_images=[second])
    assert Image.open(io.BytesIO(buffer.getvalue())).format == "MPO"  # a JPEG to Image.open
    out = ImagePipeline(ImageSpec(resize=16, crop=16, scale=1.0))(buffer.getvalue())
    assert out[0].mean() > 150


def _samples() -> list[bytes]:
    base = Image.fromarray(skimage.data.astronaut()).resize((24, 20))
    samples = []
    for fmt, mode, options in [
        ("JPEG", "RGB", {}),
        ("JPEG", "CMYK", {}),
        ("PNG", "RGBA", {}),
        ("PNG", "P", {}),
        ("PNG", "I;16", {}),
        ("WEBP", "RGB", {}),
        ("WEBP", "RGBA", {"lossless": True}),
        ("GIF", "P", {}),
        ("BMP", "RGB", {}),
        ("BMP", "P", {}),
        ("TIFF", "RGB", {}),
        ("TIFF", "RGB", {"compression": "tiff_lzw"}),
        ("TIFF", "I;16", {}),
    ]:
        buffer = io.BytesIO()
        base.convert(mode).save(buffer, format=fmt, **options)
        samples.append(buffer.getvalue())
    return samples


SAMPLES = _samples()


@settings(max_examples=300, deadline=None)
@given(
    sample=st.sampled_from(SAMPLES),
    edits=st.lists(
        st.tuples(st.floats(0, 1, exclude_max=True), st.integers(0, 255)), min_size=1, max_size=4
    ),
    keep=st.floats(0.05, 1),
)
def test_a_damaged_image_is_a_tensor_or_a_preprocessing_error(
    sample: bytes, edits: list[tuple[float, int]], keep: float
) -> None:
    """Whatever a decoder raises on a damaged file in an allowed format reaches the client as a
    PreprocessingError (a 400), without the addresses of Python objects."""
    data = bytearray(sample[: max(1, int(len(sample) * keep))])
    for where, byte in edits:
        data[int(where * len(data))] = byte
    try:
        tensor = ImagePipeline(PLAIN)(bytes(data))
    except PreprocessingError as exc:
        assert " at 0x" not in str(exc)
    else:
        assert tensor.shape == (3, 64, 64)


@pytest.mark.parametrize("name", ["chelsea", "coffee", "astronaut"])
@pytest.mark.parametrize("interpolation", ["bilinear", "bicubic", "lanczos", "nearest"])
def test_a_photo_gets_pillows_resize_of_the_whole_image_then_the_crop(
    name: str, interpolation: str
) -> None:
    """The exact pixels training code that resizes then crops gets: cropping first (Pillow's
    resize(box=...)) moved pixels by a level and the bundled classifier's logits by 30x its
    golden tolerance, so the pipeline does not."""
    photo = Image.fromarray(getattr(skimage.data, name)())
    spec = ImageSpec(resize=256, crop=224, scale=1.0, interpolation=interpolation)
    width, height = photo.size
    size = (
        (256, round(height * 256 / width))
        if width <= height
        else (round(width * 256 / height), 256)
    )
    resized = photo.resize(size, getattr(Image.Resampling, interpolation.upper()))
    left, top = (size[0] - 224) // 2, (size[1] - 224) // 2
    expected = np.asarray(resized.crop((left, top, left + 224, top + 224)), np.float32)
    got = ImagePipeline(spec)(png(photo))
    assert got.tobytes() == np.ascontiguousarray(expected.transpose(2, 0, 1)).tobytes()


def test_a_decode_holds_its_working_bytes_through_the_hook_while_it_runs() -> None:
    """The server's budget takes what decoding an image holds at its peak (its pixels as
    decoded and each conversion, from the header) before the pixels are decoded, and lets it
    go once the image is a tensor; training code sets no hook and nothing is held."""
    from contextlib import contextmanager

    from preprocessing.image import hold_decoding_with, working_bytes

    held: list[int] = []
    during: list[list[int]] = []

    @contextmanager
    def hold(size: int) -> Iterator[None]:
        held.append(size)
        yield
        during.append(list(held))
        held.remove(size)

    transparent = png(Image.new("RGBA", (100, 80), (1, 2, 3, 4)))
    hold_decoding_with(hold)
    try:
        ImagePipeline(PLAIN)(transparent)
        ImagePipeline(PLAIN)(png(Image.new("RGB", (100, 80))))
    finally:
        hold_decoding_with(None)
    assert during == [[100 * 80 * 20], [100 * 80 * 5]] and held == []
    assert working_bytes(Image.open(io.BytesIO(transparent))) == 100 * 80 * 20
    ImagePipeline(PLAIN)(transparent)  # no hook: nothing asked
    assert len(during) == 2
