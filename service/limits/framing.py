"""Where each request's head, body and chunked framing lie in the bytes of one HTTP/1.1
connection, found before httptools parses them: what the connection guards
(:mod:`service.limits.connections`) bound, exactly, however the reads split the bytes.

httptools says what it parsed (a URL, a header, a piece of body), never where in a read. A head's
size could only be guessed from its parts (URL and headers, without the request line's method and
version, the whitespace and the CRLFs) or from the reads it spanned (which may also hold the end of
a previous body or the start of the next request): a head of 8,193 bytes against a limit of 8,192
was served in one write and refused sent a byte at a time, and one of 8,192 either way. A
chunk-size line (its extensions) or a trailer line that never ended was not bounded at all but by
the body timeout, while httptools joined each read of a trailer line onto the last (quadratic).

:class:`Framing` follows the bytes as llhttp, httptools' parser, frames them in its strict mode
(checked against httptools 0.9): empty lines before a request are skipped; a head ends at its first
CRLFCRLF (a bare LF is an error there); a body is ``Content-Length`` bytes or chunks, each a size
line ending at its LF (after a CR), its data and a CRLF, the last of size 0 followed by trailer
lines and an empty line. It measures, each against ``limit``:

- a head: its request line, header lines and final CRLFCRLF, from the request line's first byte
  (the empty lines before it do not count);
- a chunk-size line: its size, extensions and CRLF;
- a chunked body's trailers, together: the trailer lines and the final CRLF (none: 2 bytes).

The parser is fed the pieces :meth:`Framing.cut` marks out, each ending at a head's end, where
the parser tells :meth:`Framing.body` how the body is framed, or where a bound was passed. Bytes
llhttp would refuse are its to refuse: where the framing misreads malformed bytes, the parser
answers 400 or a bound here answers 4xx; either way the connection closes.
"""

from __future__ import annotations

import re
from typing import Literal

Part = Literal["head", "head_parsed", "body", "chunk_line", "chunk_data", "trailers", "untracked"]
Over = Literal["head", "chunk_line", "trailers"]

_END = b"\r\n\r\n"
_CRLF = (13, 10)
_NOT_EMPTY_LINE = re.compile(rb"[^\r\n]")
_HEX = re.compile(rb"[0-9A-Fa-f]*")


class Framing:
    """One connection's position in its requests' framing (see the module)."""

    __slots__ = ("digits", "in_digits", "left", "limit", "over", "part", "seen", "tail")

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.part: Part = "head"
        self.seen = 0  # bytes of the head, chunk-size line or trailers under way
        self.tail = b""  # their last 3 bytes, for a CRLFCRLF split between reads
        self.left = 0  # bytes of the body or chunk (its data and CRLF) still to come
        self.digits = bytearray()  # the chunk size, as read so far
        self.in_digits = True  # the chunk-size line has shown nothing but its size yet
        self.over: Over | None = None
        """What passed ``limit``: set by :meth:`cut`, which stops where it began."""

    def cut(self, data: bytes, start: int) -> int:
        """The end of the next piece of ``data[start:]`` for the parser: where a head ends (the
        parser's :meth:`body` must come before the next cut), where a head, chunk-size line or
        trailers that passed ``limit`` begin in ``data`` (:attr:`over` says which; nothing from
        there on is to be parsed), or the end of ``data``."""
        end, at = len(data), start
        while at < end:
            part = self.part
            if part == "body" or part == "chunk_data":
                taken = min(end - at, self.left)
                self.left -= taken
                at += taken
                if self.left:
                    return end
                self.part, self.seen = ("head", 0) if part == "body" else ("chunk_line", 0)
                self.digits, self.in_digits = bytearray(), True
            elif part == "head" or part == "trailers":
                if part == "head" and not self.seen and data[at] in _CRLF:
                    found = _NOT_EMPTY_LINE.search(data, at)
                    if found is None:
                        return end  # empty lines between requests: llhttp skips them
                    at = found.start()
                closed = self._crlfcrlf(data, at)
                if self.seen + (end if closed < 0 else closed) - at > self.limit:
                    self.over = part
                    return at
                if closed < 0:
                    self.seen += end - at
                    self.tail = (self.tail + data[max(at, end - 3) :])[-3:]
                    return end
                self.seen, self.tail = 0, b""
                if part == "head":
                    self.part = "head_parsed"
                    return closed
                self.part, at = "head", closed
            elif part == "chunk_line":
                closed = data.find(b"\n", at)
                line_end = end if closed < 0 else closed + 1
                if self.in_digits:
                    digits = _HEX.match(data, at, line_end)
                    assert digits is not None  # it matches no digits at least
                    self.digits += digits.group()
                    self.in_digits = digits.end() == line_end
                if self.seen + line_end - at > self.limit:
                    self.over = "chunk_line"
                    return at
                if closed < 0:
                    self.seen += end - at
                    return end
                size = int(self.digits, 16) if self.digits else 0  # no digits: llhttp's 400
                self.seen = 0
                if size:
                    self.part, self.left = "chunk_data", size + 2  # its data and CRLF
                else:  # the trailers' CRLFCRLF may begin with this line's CRLF
                    self.part, self.tail = "trailers", b"\r\n"
                at = line_end
            else:  # "head_parsed": the parser has not said how the body is framed; "untracked"
                return end
        return end

    def _crlfcrlf(self, data: bytes, at: int) -> int:
        """Where the first CRLFCRLF of the bytes under way and ``data[at:]`` ends, or -1."""
        if self.tail:
            found = (self.tail + data[at : at + 3]).find(_END)
            if found >= 0:
                return at + found + 4 - len(self.tail)
        found = data.find(_END, at)
        return -1 if found < 0 else found + 4

    @property
    def idle(self) -> bool:
        """Between requests: nothing of a head read yet."""
        return self.part == "head" and not self.seen

    def follow(self, data: bytes, heads: list[tuple[int, bool]]) -> bool:
        """Follow ``data``, already parsed whole from :attr:`idle` (it holds no more than
        ``limit`` bytes, so nothing in it can pass the bound), each head's end taking the next
        of ``heads`` (its body's framing, as :meth:`body` takes it): where the framing stands
        at its end. False when ``data`` holds more heads than ``heads`` (the parser and the
        framing disagree)."""
        start, taken = 0, 0
        while start < len(data):
            start = self.cut(data, start)
            if self.part == "head_parsed":
                if taken == len(heads):
                    return False
                self.body(*heads[taken])
                taken += 1
        return True

    def body(self, length: int, chunked: bool) -> None:
        """How the body after the head just parsed is framed (the parser read its headers)."""
        if chunked:
            self.part, self.seen, self.digits, self.in_digits = "chunk_line", 0, bytearray(), True
        elif length:
            self.part, self.left = "body", length
        else:
            self.part = "head"

    def untrack(self) -> None:
        """Follow the connection no further: what it sends next is not parsed as requests (after
        an answer that closes it)."""
        self.part = "untracked"
