"""Shortening a text before it is tokenized, without changing the tokens a model keeps.

A model keeps at most ``max_length`` tokens of a text, yet tokenizing costs time and memory in
proportion to the whole text: a 10 MB text would be tokenized whole to keep 256 tokens. A plain
character budget cannot fix that exactly: a text may hold any number of characters that yield no
token (whitespace, control characters, accents that the normalizer strips) or one token for any
number of characters (a word longer than WordPiece's ``max_input_chars_per_word`` is one
``[UNK]``), so a cut at a fixed number of characters would drop tokens of a text that fits.

:class:`TextCutter` makes the text short instead by rewrites that provably leave its tokens alone,
for tokenizers whose normalizer and pre-tokenizer work character by character (BERT's):

* each character is classed by the tokenizer itself, in the context ``a?a``, as a word character
  (``w``: joins its neighbours into a word), a separator (``p``: splits, yields tokens), a gap
  (``z``: splits, yields nothing: whitespace) or removed (``r``: the normalizer deletes it);
* a run of gaps and removed characters that holds a gap is one space; a run of removed
  characters is its first one (kept, so that no added token such as ``[MASK]`` can form across
  it);
* a word with more than ``max_input_chars_per_word`` + 1 word characters keeps only that many:
  it is one ``[UNK]`` either way.

Once rewritten, a text of L characters yields at least ``(L - 2) / (2 M + 4)`` tokens (M is
``max_input_chars_per_word``): each word holds at most M + 1 word characters and M + 2 removed
ones, and yields a token, as does each separator; gaps and lone removed characters sit between
them. So the rewritten text, cut before a separator or gap once it is long enough, yields more
tokens than the model keeps, and they are the first tokens of the whole text. The cost is one
pass of :meth:`str.translate` and a few regular expressions over the part of the text read, and
a tokenizer run over a bounded prefix.
"""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Callable

from tokenizers import Tokenizer
from tokenizers.models import WordPiece
from tokenizers.normalizers import BertNormalizer
from tokenizers.pre_tokenizers import BertPreTokenizer

# Classes, one ASCII letter per character so that a class mask lines up with its text. ``q`` is a
# separator that also occurs inside an added token (``]`` of ``[MASK]``): a cut before one must
# not split an occurrence. ``x`` is a character that fits no class: left alone, never cut before.
_UNKNOWN = "\0"
_GAP_OR_REMOVED_RUN = re.compile(r"[zr]{2,}")
_CUT = re.compile(r"[pqz]")
_WINDOW = (1 << 6, 1 << 16)
"""Fewest and most characters read at a time: the budget, within these bounds."""


class TextCutter:
    """Rewrites and cuts texts for one tokenizer so that the tokens a model keeps are unchanged.

    Build it with :meth:`for_tokenizer`, which declines (``None``) tokenizers whose normalizer,
    pre-tokenizer or model this module has not reasoned about. Thread-safe: the class table only
    ever gains entries, each a single byte.
    """

    def __init__(self, tokenizer: Tokenizer, max_word: int) -> None:
        self._normalizer = tokenizer.normalizer
        self._pre_tokenizer = tokenizer.pre_tokenizer
        self.max_word = max_word
        self._classes = bytearray(0x110000)  # code point → class letter; 0: not yet asked
        # After gaps and removed runs are collapsed, a word is w's with lone r's between.
        self._long_run = re.compile(rf"[wr]{{{max_word + 2},}}")
        self._kept_part = re.compile(rf"(?:r?w){{{max_word + 1}}}")
        self._added = [t.content for t in tokenizer.get_added_tokens_decoder().values()]
        for content in self._added:
            for char in content[1:]:
                if self.char_class(char) == "p":
                    self._classes[ord(char)] = ord("q")

    @classmethod
    def for_tokenizer(cls, tokenizer: Tokenizer) -> TextCutter | None:
        """A cutter for BERT-style tokenizers (per-character normalizer and pre-tokenizer,
        WordPiece), whose added tokens cannot form or break across a rewrite; else ``None``."""
        model = tokenizer.model
        if not (
            isinstance(tokenizer.normalizer, BertNormalizer)
            and isinstance(tokenizer.pre_tokenizer, BertPreTokenizer)
            and isinstance(model, WordPiece)
        ):
            return None
        cutter = cls(tokenizer, model.max_input_chars_per_word)
        if cutter.char_class(" ") != "z":
            return None
        for token in tokenizer.get_added_tokens_decoder().values():
            content = token.content
            # Rewrites happen strictly inside runs of w, r and z: an added token that starts and
            # ends with a separator, holds no r, z or x and is no longer than a word's kept part
            # can neither straddle a rewrite nor be formed by one.
            if (
                token.single_word
                or not content
                or len(content) > cutter.max_word
                or cutter.char_class(content[0]) not in "pq"
                or cutter.char_class(content[-1]) not in "pq"
                or any(cutter.char_class(c) in "rzx" for c in content)
            ):
                return None
        return cutter

    def budget(self, max_length: int) -> int:
        """Rewritten characters that are sure to yield more than ``max_length`` tokens."""
        return (max_length + 1) * (2 * self.max_word + 4) + 2

    def char_class(self, char: str) -> str:
        """The class of one character, as the tokenizer treats it between two word characters."""
        known = self._classes[ord(char)]
        if known:
            return chr(known)
        normalized = self._normalizer.normalize_str(f"a{char}a")
        words = [word for word, _ in self._pre_tokenizer.pre_tokenize_str(normalized)]
        if words == ["aa"]:
            found = "r"
        elif words == ["a", "a"]:
            found = "z"
        elif len(words) == 1 and len(words[0]) >= 3:
            found = "w"
        elif len(words) >= 3 and words[0] == "a" and words[-1] == "a":
            # A combining mark may be reordered with the marks before it: never cut before one.
            found = "x" if unicodedata.combining(char) else "p"
        else:
            found = "x"
        self._classes[ord(char)] = ord(found)
        return found

    def cut(self, text: str, budget: int) -> tuple[str, bool]:
        """``text`` rewritten, and cut before a separator or gap once ``budget`` characters of it
        are written: the tokens of the result are the first tokens of ``text``. The flag says
        whether the result stands for the whole text (it was not cut)."""
        window = min(max(budget, _WINDOW[0]), _WINDOW[1])
        written: list[str] = []
        size = 0
        carry = ""  # the unfinished word (and the gap before it) at the end of the last window
        for start in range(0, len(text), window):
            chunk = carry + text[start : start + window]
            mask = self._mask(chunk)
            if size >= budget and (end := self._cut_point(written, chunk, mask)) is not None:
                written.append(self._rewrite(chunk[:end], mask[:end]))
                return "".join(written), False
            # Hold back what the next window may continue, so that no run spans two writes.
            last = max(mask.rfind("p"), mask.rfind("q"), mask.rfind("x"), mask.rfind("z"))
            if last < 0:
                end = 0
            elif mask[last] == "z":
                end = len(mask[: last + 1].rstrip("zr"))
            else:
                end = last + 1
            head = self._rewrite(chunk[:end], mask[:end])
            written.append(head)
            size += len(head)
            carry = self._rewrite(chunk[end:], mask[end:])
        written.append(carry)
        return "".join(written), True

    def _cut_point(self, written: list[str], chunk: str, mask: str) -> int | None:
        """The first place in ``chunk`` to cut at: before a separator or gap, and not inside an
        occurrence of an added token (``written`` holds the text before ``chunk``, rewritten)."""
        longest = max(map(len, self._added), default=1)
        for found in _CUT.finditer(mask):
            at = found.start()
            if found[0] != "q":
                return at
            if at + longest > len(chunk):
                continue  # the rest of an occurrence may lie in the next window: look further
            before = "".join(written)[-longest:] if at < longest else ""
            if not _inside_one(self._added, before + chunk[: at + longest], len(before) + at):
                return at
        return None

    def _mask(self, text: str) -> str:
        """One class letter per character of ``text``."""
        mask = text.translate(self._classes)
        if _UNKNOWN in mask:
            for char in set(text):
                self.char_class(char)
            mask = text.translate(self._classes)
        return mask

    def _rewrite(self, text: str, mask: str) -> str:
        """Collapse gaps and removed runs, then shorten over-long words (see the module doc)."""
        text, mask = _replace(text, mask, _GAP_OR_REMOVED_RUN, _collapse)
        text, _ = _replace(text, mask, self._long_run, self._shorten_word)
        return text

    def _shorten_word(self, found: re.Match[str], text: str) -> tuple[str, str]:
        """A word of more than ``max_word`` + 1 word characters → its first that many (and the
        removed characters between them): one ``[UNK]`` either way."""
        if found[0].count("w") <= self.max_word + 1:
            return text, found[0]
        kept = self._kept_part.match(found[0])
        assert kept is not None  # a run of w's and lone r's with enough w's
        return text[: kept.end()], kept[0]


def _collapse(found: re.Match[str], text: str) -> tuple[str, str]:
    """A run of gaps and removed characters holding a gap → one space; of removed ones → one."""
    return (" ", "z") if "z" in found[0] else (text[0], "r")


def _inside_one(contents: list[str], text: str, at: int) -> bool:
    """Whether an occurrence of one of ``contents`` in ``text`` holds ``text[at - 1 : at + 1]``."""
    return any(
        text.find(content, max(0, at - len(content) + 1), at + len(content) - 1) != -1
        for content in contents
    )


def _replace(
    text: str,
    mask: str,
    pattern: re.Pattern[str],
    rewrite: Callable[[re.Match[str], str], tuple[str, str]],
) -> tuple[str, str]:
    """Rewrite the spans of ``text`` where ``pattern`` matches its mask; the mask follows."""
    texts: list[str] = []
    masks: list[str] = []
    done = 0
    for found in pattern.finditer(mask):
        start, end = found.span()
        new_text, new_mask = rewrite(found, text[start:end])
        texts += (text[done:start], new_text)
        masks += (mask[done:start], new_mask)
        done = end
    if not done:
        return text, mask
    texts.append(text[done:])
    masks.append(mask[done:])
    return "".join(texts), "".join(masks)
