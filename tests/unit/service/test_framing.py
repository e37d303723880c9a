"""Where a connection's heads, chunk-size lines and trailers lie, however the reads split them."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from service.limits.framing import Framing

LIMIT = 200
BEFORE = {
    "nothing": (b"", []),
    "empty lines": (b"\r\n\r\n", []),
    "a body": (b"POST / HTTP/1.1\r\nContent-Length: 10\r\n\r\n0123\r\n\r\n89", [(10, False)]),
    "a chunked body": (
        b"POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n"
        b"3;x=y\r\n\r\n\r\r\n0\r\nT: 1\r\n\r\n",
        [(0, True)],
    ),
}
"""What comes before the part measured on the connection, and how its bodies are framed."""
NEXT = b"GET / HTTP/1.1\r\n\r\n"


def fed(stream: bytes, cuts: list[int], bodies: list[tuple[int, bool]]) -> tuple[str | None, bytes]:
    """What passed the limit, and the bytes a parser was fed before, with the stream read in
    the pieces ``cuts`` makes; after each head, the parser's say on its body from ``bodies``."""
    framing, pieces, bodies = Framing(LIMIT), [], [*bodies, *[(0, False)] * 4]
    ends = sorted({*cuts, len(stream)})
    for begin, end in zip([0, *ends], ends, strict=False):
        data, start = stream[begin:end], 0
        while start < len(data):
            stop = framing.cut(data, start)
            pieces.append(data[start:stop])
            if framing.over is not None:
                return framing.over, b"".join(pieces)
            if framing.part == "head_parsed":
                framing.body(*bodies.pop(0))
            start = stop
    return None, b"".join(pieces)


def sized_head(size: int) -> bytes:
    base = b"GET / HTTP/1.1\r\nHost: x\r\nX-Padding: \r\n\r\n"
    return base.replace(b"X-Padding: ", b"X-Padding: " + b"a" * (size - len(base)))


@given(
    st.sampled_from(sorted(BEFORE)),
    st.sampled_from([LIMIT, LIMIT + 1]),
    st.lists(st.integers(1, 400), max_size=8),
)
def test_a_head_passes_the_limit_by_its_bytes_alone_however_the_reads_split(
    before: str, size: int, cuts: list[int]
) -> None:
    prefix, bodies = BEFORE[before]
    stream = prefix + sized_head(size) + NEXT
    over, parsed = fed(stream, [cut for cut in cuts if cut < len(stream)], bodies)
    assert over == ("head" if size > LIMIT else None)
    if over:  # the parser never has a head past it whole (it may have its first reads)
        assert stream.startswith(parsed) and len(prefix) <= len(parsed) < len(prefix) + size
    else:
        assert parsed == stream


@given(st.sampled_from([LIMIT, LIMIT + 1]), st.lists(st.integers(1, 400), max_size=8))
def test_a_chunk_size_line_and_the_trailers_are_bounded_each_by_its_bytes(
    size: int, cuts: list[int]
) -> None:
    head = b"POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n"
    line = b"1;" + b"e" * (size - 4) + b"\r\n"  # its size, an extension, its CRLF
    trailers = b"T: " + b"v" * (size - 7) + b"\r\n\r\n"  # the lines and the final CRLF
    for stream, what in [
        (head + line + b"a\r\n0\r\n\r\n" + NEXT, "chunk_line"),
        (head + b"1\r\na\r\n0\r\n" + trailers + NEXT, "trailers"),
    ]:
        over, _ = fed(stream, [cut for cut in cuts if cut < len(stream)], [(0, True)])
        assert over == (what if size > LIMIT else None)


def test_trailers_of_none_are_their_final_crlf() -> None:
    stream = b"POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n" + NEXT
    assert fed(stream, [len(stream) - len(NEXT) - 1], [(0, True)]) == (None, stream)


def state(framing: Framing) -> tuple[object, ...]:
    return (
        framing.part,
        framing.seen,
        framing.left,
        framing.tail,
        bytes(framing.digits),
        framing.in_digits,
    )


@given(st.sampled_from(sorted(BEFORE)), st.integers(1, LIMIT))
def test_a_read_fed_whole_is_followed_to_where_cutting_it_up_would_leave_the_framing(
    before: str, size: int
) -> None:
    """The connection feeds a read of at most the limit, from between requests, to the parser
    whole, and the framing follows it afterwards with the bodies' framing the parser said: it
    must stand where cutting the read up as it went would have left it."""
    prefix, bodies = BEFORE[before]
    stream = (prefix + NEXT + prefix + sized_head(LIMIT))[:size]
    cut_up, followed = Framing(LIMIT), Framing(LIMIT)
    heads = [*bodies, (0, False), *bodies]
    said = list(heads)
    start = 0
    while start < len(stream):
        start = cut_up.cut(stream, start)
        if cut_up.part == "head_parsed":
            cut_up.body(*said.pop(0))
    assert followed.idle and cut_up.over is None
    assert followed.follow(stream, heads[: len(heads) - len(said)])
    assert state(followed) == state(cut_up)
    assert not Framing(LIMIT).follow(NEXT, [])  # a head the parser did not say: disagreement
