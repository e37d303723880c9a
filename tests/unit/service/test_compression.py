"""Request inflation within the body limit, and the choice of answer encoding."""

from __future__ import annotations

import gzip
import zlib

import pytest

from service.errors import InvalidInput, PayloadTooLarge, ServerBusy, UnsupportedMediaType
from service.limits import compression

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
