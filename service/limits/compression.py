"""HTTP body compression, as Triton does it: ``Content-Encoding: gzip | deflate`` requests are
inflated within the body limit, and answers are compressed when ``Accept-Encoding`` asks and the
body is large enough to gain. Pure functions over bytes."""

from __future__ import annotations

import io
import zlib
from collections.abc import Callable

from service.errors import InvalidInput, PayloadTooLarge, UnsupportedMediaType
from service.telemetry.counters import REFUSED

MIN_COMPRESS_BYTES = 1024
"""Smaller answers go as they are: their headers and framing outweigh what compression saves."""
_CHUNK = 1 << 20
_GZIP, _ZLIB, _RAW = 16 + zlib.MAX_WBITS, zlib.MAX_WBITS, -zlib.MAX_WBITS


def decompress(
    body: bytes, encoding: str, limit: int, reserve: Callable[[int], None] | None = None
) -> bytes:
    """The body under ``encoding`` (``identity``, ``gzip`` or ``deflate``, or a list of them in
    the order they were applied, as repeated headers combine: ``gzip, gzip``), inflated a chunk
    at a time: past ``limit`` decompressed bytes it is a 413 at once, so a compression bomb
    costs at most ``limit`` bytes of memory. ``reserve(size)`` is told of each chunk before it
    is kept, and may refuse it by raising (the server's budget for bodies in flight). A gzip
    body may hold several members (RFC 1952), each inflated in turn; bytes after the last one,
    or after a deflate stream, are a 400: they would be dropped unread."""
    codings = [c.strip().lower() for c in encoding.split(",")]
    if len(codings) > 1:
        for coding in reversed(codings):  # the last applied is undone first
            body = decompress(body, coding, limit, reserve)
        return body
    encoding = codings[0]
    if encoding in ("", "identity"):
        return body
    if encoding in ("gzip", "x-gzip"):
        wbits = _GZIP
    elif encoding == "deflate":
        # HTTP's deflate is the zlib format; some clients send raw deflate: take both.
        wbits = (
            _ZLIB
            if body[:1] and (body[0] & 0x0F) == 8 and int.from_bytes(body[:2]) % 31 == 0
            else _RAW
        )
    else:
        raise UnsupportedMediaType(
            f"Content-Encoding {encoding!r} is not supported; use gzip, deflate or none"
        )
    # Parts go into one buffer as they are inflated; getvalue() hands it over uncopied, so the
    # inflated body is held once (a list of parts and their join would hold it twice).
    parts = io.BytesIO()
    size = 0
    pending = body
    try:
        while True:
            inflater = zlib.decompressobj(wbits)
            while pending:
                part = inflater.decompress(pending, _CHUNK)
                size += len(part)
                if size > limit:
                    REFUSED["too_large"] += 1
                    raise PayloadTooLarge(
                        f"the {encoding} request body inflates past the limit of {limit} bytes"
                    )
                if reserve is not None and part:
                    reserve(len(part))
                parts.write(part)
                del part
                pending = inflater.unconsumed_tail
                if inflater.eof:
                    break
            if not inflater.eof:
                raise InvalidInput(f"the {encoding} request body is cut off")
            pending = inflater.unused_data
            if not pending:
                break
            if wbits != _GZIP:
                raise InvalidInput(
                    f"the request body has {len(pending)} bytes after its {encoding} stream"
                )
            # another gzip member: it must be one (its header is checked as it inflates)
    except zlib.error as exc:
        raise InvalidInput(f"the request body is not valid {encoding}: {exc}") from None
    return parts.getvalue()


def choose(accept: str) -> str | None:
    """The encoding to answer with for an ``Accept-Encoding`` value (gzip first), or None."""
    if not accept:
        return None
    offered = {}
    for item in accept.lower().split(","):
        name, _, params = item.strip().partition(";")
        quality = params.strip().removeprefix("q=") if params.strip().startswith("q=") else "1"
        try:
            offered[name.strip()] = float(quality)
        except ValueError:
            continue
    for name in ("gzip", "deflate"):
        if offered.get(name, 0) > 0:
            return name
    return None


SAMPLE_BYTES = 16 << 10
"""A larger answer is compressed only if this much from its middle shrinks by a tenth or more."""
MOST_KEPT = 0.9


def shrinks(data: bytes | memoryview, sample_bytes: int) -> bool:
    """Whether ``sample_bytes`` from the middle of ``data`` keep at most :data:`MOST_KEPT` of
    their size compressed at level 1: whether ``data`` is worth compressing."""
    start = max(0, len(data) // 2 - sample_bytes // 2)
    with memoryview(data) as view:
        sample = view[start : start + sample_bytes]
        probe = zlib.compressobj(1, zlib.DEFLATED, _RAW)
        kept = len(probe.compress(sample)) + len(probe.flush())
        return kept <= MOST_KEPT * len(sample)


def compress(body: bytes, encoding: str) -> bytes | None:
    """``body`` under ``encoding`` (gzip or deflate), at a fast level: an answer is made once
    and sent once. None, for an answer over twice :data:`SAMPLE_BYTES`, when a sample from its
    middle keeps more than :data:`MOST_KEPT` of its size: float32 tensors in binary shrink by
    7-8 % at about 30 MB/s (docs/performance.md, "gRPC answers and compression"): at that rate a
    60 MiB answer holds a pool thread (the one images are preprocessed on) about 2 s to gain
    next to nothing."""
    if len(body) > 2 * SAMPLE_BYTES and not shrinks(body, SAMPLE_BYTES):
        return None
    compressor = zlib.compressobj(1, zlib.DEFLATED, _GZIP if encoding == "gzip" else _ZLIB)
    return compressor.compress(body) + compressor.flush()
