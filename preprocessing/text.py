"""The text pipeline: UTF-8 strings → token ids and attention mask, bucketed.

Built once per model from a :class:`~preprocessing.spec.TextSpec` and the tokenizer file it
names (checked against its sha256). Padding and truncation are set here explicitly, whatever
the tokenizer file says: a batch is padded to the smallest configured bucket that holds its
longest text, so the model only ever sees the lengths it was warmed up on.
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
        encodings = self._tokenizer.encode_batch(texts)
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
