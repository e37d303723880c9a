"""A resize in two halves on two threads makes Pillow's pixels, bit for bit, in both pass orders."""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import skimage.data
from PIL import Image

from preprocessing import ImagePipeline, ImageSpec
from preprocessing.halves import matches_pillow, resize_in_halves, vertical_first
from preprocessing.image import _resize_and_crop
from tests.conftest import encode

FILTERS = [Image.Resampling.BILINEAR, Image.Resampling.BICUBIC, Image.Resampling.LANCZOS]


class TwoThreads:
    """Halves on two real threads, recording which thread ran each second half."""

    def __init__(self) -> None:
        self.executor = ThreadPoolExecutor(1)
        self.seconds: list[str] = []
        self.asked = 0

    def ready(self) -> bool:
        self.asked += 1
        return True

    def __call__(
        self, first: Callable[[], Image.Image], second: Callable[[], Image.Image]
    ) -> tuple[Image.Image, Image.Image]:
        def recorded() -> Image.Image:
            self.seconds.append(threading.current_thread().name)
            return second()

        other = self.executor.submit(recorded)
        return first(), other.result()


@pytest.fixture(scope="module")
def halves() -> TwoThreads:
    return TwoThreads()


def sizes() -> list[tuple[tuple[int, int], tuple[int, int], str]]:
    """Random sizes (seeded) shrunk and grown, wide and tall: both of Pillow's pass orders."""
    rng = np.random.default_rng(7)
    cases = []
    for i in range(24):
        source = (int(rng.integers(120, 900)), int(rng.integers(120, 900)))
        target = (int(rng.integers(40, 700)), int(rng.integers(40, 700)))
        cases.append((source, target, "RGB" if i % 3 else "L"))
    cases.append(((400, 1200), (256, 768), "RGB"))  # tall, shrunk: vertical pass first
    cases.append(((640, 480), (341, 256), "RGB"))  # the camera image of bench/
    return cases


@pytest.mark.parametrize(("source", "target", "mode"), sizes())
@pytest.mark.parametrize("resample", FILTERS, ids=lambda f: f.name)
def test_the_halves_make_pillows_whole_resize_and_crop(
    source: tuple[int, int],
    target: tuple[int, int],
    mode: str,
    resample: Image.Resampling,
    halves: TwoThreads,
) -> None:
    rng = np.random.default_rng(sum(source) + sum(target))
    channels = (3,) if mode == "RGB" else ()
    image = Image.fromarray(rng.integers(0, 256, (source[1], source[0], *channels), np.uint8))
    left, top = target[0] // 5, target[1] // 7
    for box in ((0, 0, *target), (left, top, target[0] - left // 2, target[1] - top // 3)):
        whole = image.resize(target, resample).crop(box)
        halved = resize_in_halves(image, target, box, resample, halves)
        assert halved.mode == whole.mode and halved.size == whole.size
        assert halved.tobytes() == whole.tobytes(), (source, target, box)


def test_the_installed_pillow_orders_its_passes_as_the_halves_do() -> None:
    """On a Pillow that orders its passes otherwise the server resizes whole (service.app): this
    test says so first, at the upgrade."""
    assert matches_pillow()
    assert vertical_first(400, 1200, 256, 768)  # 432 rows fewer > 2 × 144 columns fewer
    assert not vertical_first(640, 480, 341, 256)
    assert not vertical_first(300, 400, 600, 800)  # grown


def tall_photo() -> np.ndarray:
    """Coffee turned upright and stacked twice: 400 × 1200, three times as tall as wide."""
    upright = np.rot90(skimage.data.coffee())
    return np.ascontiguousarray(np.concatenate([upright, upright]))


@pytest.mark.parametrize(
    "photo",
    [skimage.data.chelsea, skimage.data.coffee, skimage.data.astronaut, tall_photo],
    ids=lambda f: f.__name__,
)
@pytest.mark.parametrize("interpolation", ["bilinear", "bicubic", "lanczos"])
@pytest.mark.parametrize("crop", [224, None])
def test_a_pipeline_with_halves_makes_the_training_tensor(
    photo: Callable[[], np.ndarray], interpolation: str, crop: int | None, halves: TwoThreads
) -> None:
    spec = ImageSpec(resize=256, crop=crop, interpolation=interpolation)
    data = encode(photo(), "PNG")
    before = len(halves.seconds)
    served = ImagePipeline(spec, halves)(data)
    assert served.tobytes() == ImagePipeline(spec)(data).tobytes()
    assert len(halves.seconds) > before  # it did run in halves
    assert all(name != threading.current_thread().name for name in halves.seconds)


class Refusing:
    """Halves that must not be used."""

    def ready(self) -> bool:
        return False

    def __call__(
        self, first: Callable[[], Image.Image], second: Callable[[], Image.Image]
    ) -> tuple[Image.Image, Image.Image]:
        raise AssertionError("halves used although not ready")


class ReadyButForbidden(Refusing):
    """Halves that say they are ready but must not be used."""

    def ready(self) -> bool:
        return True


def test_small_images_nearest_and_an_unready_second_thread_resize_whole(
    halves: TwoThreads,
) -> None:
    photo = encode(skimage.data.chelsea(), "PNG")  # 451 × 300: large enough to halve
    small = encode(skimage.data.chelsea()[:200, :300], "PNG")  # 60,000 pixels
    used, asked = len(halves.seconds), halves.asked
    ImagePipeline(ImageSpec(resize=256, crop=224, interpolation="nearest"), halves)(photo)
    ImagePipeline(ImageSpec(resize=128, crop=128), halves)(small)
    assert (len(halves.seconds), halves.asked) == (used, asked)
    spec = ImageSpec(resize=256, crop=224)
    assert ImagePipeline(spec, Refusing())(photo).tobytes() == ImagePipeline(spec)(photo).tobytes()


@pytest.mark.parametrize("resize", [None, 1, 256])
@pytest.mark.parametrize("crop", [None, 1, 2])
def test_a_one_pixel_band_is_resized_whole(resize: int | None, crop: int | None) -> None:
    """A crop or a resize to 1 pixel leaves one of the second pass's halves empty."""
    image = Image.fromarray(skimage.data.chelsea())
    halves = TwoThreads()
    got = _resize_and_crop(image, resize, crop, Image.Resampling.BILINEAR, halves)
    assert (
        got.tobytes() == _resize_and_crop(image, resize, crop, Image.Resampling.BILINEAR).tobytes()
    )


def test_images_with_alpha_are_not_resized_in_halves() -> None:
    """Pillow premultiplies alpha around each resize call: halves of RGBA would differ. The
    pipeline converts to RGB or L before it resizes; the resize itself refuses the rest."""
    rgba = Image.fromarray(skimage.data.chelsea()).convert("RGBA")
    got = _resize_and_crop(rgba, 256, 224, Image.Resampling.BILINEAR, ReadyButForbidden())
    assert got.tobytes() == _resize_and_crop(rgba, 256, 224, Image.Resampling.BILINEAR).tobytes()
