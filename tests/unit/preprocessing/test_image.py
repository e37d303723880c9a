import io
from pathlib import Path

import numpy as np
import pytest
import skimage.data
from PIL import Image

from preprocessing import ImagePipeline, ImageSpec, PreprocessingError
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
    spec = ImageSpec(resize=256, crop=224, color=color, layout=layout, dtype=dtype,
                     mean=mean, std=std)  # fmt: skip
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


@pytest.mark.parametrize(("orientation", "stored"), [(3, Image.Transpose.ROTATE_180),
                                                     (6, Image.Transpose.ROTATE_90),
                                                     (8, Image.Transpose.ROTATE_270)])  # fmt: skip
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
