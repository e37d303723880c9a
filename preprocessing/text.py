"""The text pipeline: UTF-8 strings → token ids and attention mask, bucketed.

Built once per model from a :class:`~preprocessing.spec.TextSpec` and the tokenizer file it
names (checked against its sha256). Padding and truncation are set here explicitly, whatever
the tokenizer file says: a batch is padded to the smallest configured bucket that holds its
longest text, so the model only ever sees the lengths it was warmed up on.

A long text is shortened before it is tokenized (:mod:`preprocessing.text_cut`), so that its
cost follows the ``max_length`` tokens kept rather than its length, with the very tokens the
whole text would give.
"""

from __future__ import annotations

import bisect
import hashlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from numpy.typing import NDArray
from tokenizers import Tokenizer

from preprocessing.image import PreprocessingError
from preprocessing.spec import TextSpec
from preprocessing.text_cut import TextCutter

CHARS_PER_TOKEN = 8
"""A long text is first cut after this many characters per token kept, plenty for prose; a text
whose tokens are sparser (long words, runs of whitespace) is cut again at the cutter's proven
bound."""


@dataclass(frozen=True, slots=True)
class TokenBatch:
    """Model inputs for a batch of texts, and which texts were cut at max_length."""

    input_ids: NDArray[np.int64]
    attention_mask: NDArray[np.int64]
    truncated: list[bool]


class TextPipeline:
    """Tokenize with the model's own tokenizer; pad to a bucket; truncate per the spec."""

    def __init__(self, spec: TextSpec, folder: Path) -> None:
        path = folder / spec.tokenizer
        try:
            data = path.read_bytes()
        except OSError as exc:
            raise PreprocessingError(f"cannot read tokenizer {path}: {exc}") from None
        digest = hashlib.sha256(data).hexdigest()
        if digest != spec.tokenizer_sha256:
            raise PreprocessingError(
                f"tokenizer {path} has sha256 {digest}, the spec names {spec.tokenizer_sha256}"
            )
        self.spec = spec
        self._tokenizer = Tokenizer.from_str(data.decode())
        self._tokenizer.no_padding()
        self._tokenizer.enable_truncation(max_length=spec.max_length)
        self._cutter = TextCutter.for_tokenizer(self._tokenizer)
        self._budgets: tuple[int, ...] = ()
        if self._cutter is not None:
            proven = self._cutter.budget(spec.max_length)
            self._budgets = (min(CHARS_PER_TOKEN * spec.max_length, proven), proven)

    @property
    def vocab_size(self) -> int:
        """Token ids this tokenizer makes lie in ``[0, vocab_size)``."""
        return int(self._tokenizer.get_vocab_size(with_added_tokens=True))

    def bucket(self, length: int) -> int:
        """The smallest bucket that holds ``length`` tokens (the largest when none does)."""
        buckets = self.spec.buckets
        return buckets[min(bisect.bisect_left(buckets, length), len(buckets) - 1)]

    def __call__(self, texts: list[str]) -> TokenBatch:
        if not texts:
            raise PreprocessingError("no texts to tokenize")
        encodings = self._tokenizer.encode_batch([self.head(text) for text in texts])
        truncated = [bool(e.overflowing) for e in encodings]
        if not self.spec.truncate and any(truncated):
            first = truncated.index(True)
            raise PreprocessingError(
                f"text {first} is longer than {self.spec.max_length} tokens and this model "
                "refuses over-long texts (truncate: false)"
            )
        width = self.bucket(max(len(e.ids) for e in encodings))
        ids = np.full((len(texts), width), self.spec.pad_id, dtype=np.int64)
        mask = np.zeros((len(texts), width), dtype=np.int64)
        for row, encoding in enumerate(encodings):
            n = len(encoding.ids)
            ids[row, :n] = encoding.ids
            mask[row, :n] = 1
        return TokenBatch(ids, mask, truncated)

    def head(self, text: str) -> str:
        """What of ``text`` the tokenizer needs to read: a text whose first ``max_length``
        tokens are those of ``text``, and which is over-long exactly when ``text`` is. ``text``
        itself when it is short, or when the tokenizer is not one that
        :class:`~preprocessing.text_cut.TextCutter` has reasoned about."""
        if self._cutter is None or len(text) <= self._budgets[0]:
            return text
        for budget in self._budgets:
            head, whole = self._cutter.cut(text, budget)
            if whole or self._tokenizer.encode(head).overflowing:
                return head
        # Not reached when the cutter's bound holds (characters it cannot class may break it):
        # the whole text rewritten gives every token the text gives.
        return self._cutter.cut(text, len(text) + 1)[0]
