"""Request inflation within the body limit, and the choice of answer encoding."""

from __future__ import annotations

import gzip
import tracemalloc
import zlib

import pytest

from service.errors import InvalidInput, PayloadTooLarge, ServerBusy, UnsupportedMediaType
from service.limits import compression
from service.limits.compression import decompress

pytestmark = pytest.mark.unit
BODY = b'{"inputs": []}' * 100


def raw_deflate(data: bytes) -> bytes:
    packer = zlib.compressobj(6, zlib.DEFLATED, -15)
    return packer.compress(data) + packer.flush()


@pytest.mark.parametrize(
    ("encoding", "packed"),
    [
        ("gzip", gzip.compress(BODY)),
        ("deflate", zlib.compress(BODY)),
        ("deflate", raw_deflate(BODY)),
        ("identity", BODY),
    ],
)
def test_bodies_inflate_to_what_was_sent(encoding: str, packed: bytes) -> None:
    assert compression.decompress(packed, encoding, len(BODY)) == BODY


def test_inflating_past_the_limit_stops_at_the_limit() -> None:
    with pytest.raises(PayloadTooLarge, match="inflates past the limit of 1000 bytes"):
        compression.decompress(gzip.compress(bytes(10_000_000)), "gzip", 1000)


def test_each_inflated_chunk_is_reserved_before_it_is_kept() -> None:
    told: list[int] = []
    assert compression.decompress(gzip.compress(BODY), "gzip", len(BODY), told.append) == BODY
    assert sum(told) == len(BODY)

    def budget(size: int) -> None:  # a budget with 3 MiB left
        told.append(size)
        if sum(told) > 3 << 20:
            raise ServerBusy("over budget")

    told.clear()
    with pytest.raises(ServerBusy):
        compression.decompress(gzip.compress(bytes(10 << 20)), "gzip", 16 << 20, budget)
    assert sum(told) <= 4 << 20  # refused within a chunk (1 MiB) of the budget, not at 10 MiB


def test_broken_and_unknown_encodings_are_refused() -> None:
    with pytest.raises(InvalidInput):
        compression.decompress(gzip.compress(BODY)[:-10], "gzip", 1 << 20)
    with pytest.raises(UnsupportedMediaType, match="'br'"):
        compression.decompress(BODY, "br", 1 << 20)


@pytest.mark.parametrize(
    ("accept", "chosen"),
    [
        ("gzip", "gzip"),
        ("deflate, gzip;q=0", "deflate"),
        ("identity", None),
        ("", None),
        ("br, deflate;q=0.5, gzip", "gzip"),
    ],
)
def test_the_answer_encoding_follows_accept_encoding(accept: str, chosen: str | None) -> None:
    assert compression.choose(accept) == chosen


def test_every_member_of_a_gzip_body_is_inflated() -> None:
    """Issue #28, finding 21: `cat a.gz b.gz` is one gzip body (RFC 1952); only the first
    member was read, and the rest dropped in silence."""
    body = gzip.compress(b"first half, ") + gzip.compress(b"second half")
    assert decompress(body, "gzip", 1 << 20) == b"first half, second half"


def test_bytes_after_the_compressed_stream_are_refused() -> None:
    for body, encoding in (
        (gzip.compress(b"payload") + b"trailing garbage", "gzip"),
        (zlib.compress(b"payload") + b"trailing", "deflate"),
    ):
        with pytest.raises(InvalidInput, match=encoding):
            decompress(body, encoding, 1 << 20)


def test_a_list_of_codings_is_undone_last_first_within_the_limit() -> None:
    """Repeated Content-Encoding headers combine into a list (RFC 9110, 5.3): each applies."""
    twice = gzip.compress(zlib.compress(b"x" * 1000))
    assert decompress(twice, "deflate, gzip", 1 << 20) == b"x" * 1000
    with pytest.raises(PayloadTooLarge):
        decompress(gzip.compress(gzip.compress(b"x" * 10_000)), "gzip, gzip", 5_000)
    with pytest.raises(UnsupportedMediaType):
        decompress(twice, "br, gzip", 1 << 20)


def test_an_inflated_body_is_held_once_not_twice() -> None:
    """A list of parts and their join hold the inflated body twice at the join (#28 finding 14)."""
    size = 32 << 20
    packed = gzip.compress(bytes(size), 1)
    tracemalloc.start()
    try:
        body = decompress(packed, "gzip", size)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert body == bytes(size)
    assert peak < 1.3 * size, f"peak {peak >> 20} MiB for {size >> 20} MiB inflated"


@pytest.mark.parametrize("encoding", ["gzip", "deflate"])
def test_an_answer_is_compressed_only_where_it_shrinks(encoding: str) -> None:
    """Float32 tensors in binary shrink by 7-8 % at about 30 MB/s: a 60 MiB answer took a
    pool thread 2 s for nothing. A large answer whose middle does not shrink by a tenth goes
    as it is (None); JSON, and anything small enough to be its own sample, is compressed."""
    import numpy as np

    noise = np.random.default_rng(0).standard_normal(1 << 18).astype(np.float32).tobytes()
    assert compression.compress(noise, encoding) is None
    json_head = b'{"outputs": [{"name": "y", "datatype": "FP32"}]}'
    assert compression.compress(json_head + noise, encoding) is None  # what a binary answer is
    small = noise[: 2 * compression.SAMPLE_BYTES]
    text = b'{"data": [' + b", ".join(b"%.6f" % v for v in range(40_000)) + b"]}"
    for body in (small, text, bytes(1 << 20)):
        packed = compression.compress(body, encoding)
        assert packed is not None
        assert compression.decompress(packed, encoding, len(body)) == body
    assert len(compression.compress(text, encoding) or b"") < len(text) // 2
