"""The front's count of what a gRPC client sent that its worker has not answered
(service/cluster/held.py, issue #28 finding 2), over HTTP/2 frames made here byte by byte and
fed in pieces of every size."""

from __future__ import annotations

import pytest

from service.cluster.held import DATA, END_STREAM, HEADERS, PADDED, PREFACE, RST_STREAM, Held

pytestmark = pytest.mark.unit

SETTINGS = 0x4


def frame(kind: int, flags: int, stream: int, payload: bytes = b"") -> bytes:
    return (
        len(payload).to_bytes(3, "big") + bytes([kind, flags]) + stream.to_bytes(4, "big") + payload
    )


def message(size: int) -> bytes:
    """A gRPC message of ``size`` bytes with its 5-byte prefix."""
    return b"\0" + size.to_bytes(4, "big") + bytes(size)


def fed(held: Held, data: bytes, piece: int, answers: bool = False) -> int:
    """``data`` given to ``held`` ``piece`` bytes at a time; the bytes let go."""
    let_go = 0
    for start in range(0, len(data), piece):
        view = memoryview(data[start : start + piece])
        if answers:
            let_go += held.answered(view)
        else:
            held.sent(view)
    return let_go


PIECES = [1, 2, 5, 9, 10, 4096]


@pytest.mark.parametrize("piece", PIECES)
def test_a_request_counts_until_an_answer_starts_on_its_stream(piece: int) -> None:
    held = Held()
    request = message(1000)
    sent = (
        PREFACE
        + frame(SETTINGS, 0, 0, bytes(6))
        + frame(HEADERS, 0x4, 1, b"headers")
        + frame(DATA, 0, 1, request[:300])
        + frame(DATA, END_STREAM, 1, request[300:])
    )
    fed(held, sent, piece)
    assert held.total == len(request)
    assert fed(held, frame(SETTINGS, 0, 0) + frame(HEADERS, 0x4, 1, b"h"), piece, True) == 0
    let_go = fed(held, frame(DATA, 0, 1, message(10)), piece, answers=True)
    assert (let_go, held.total) == (len(request), 0)
    assert fed(held, frame(HEADERS, END_STREAM | 0x4, 1, b"trailers"), piece, True) == 0


@pytest.mark.parametrize("piece", PIECES)
def test_padding_counts_and_goes_with_its_stream(piece: int) -> None:
    held = Held()
    request = message(100)
    padded = frame(DATA, PADDED, 1, bytes([7]) + request[:60] + bytes(7))
    sent = PREFACE + frame(HEADERS, 0x4, 1) + padded + frame(DATA, 0, 1, request[60:])
    fed(held, sent, piece)
    assert held.total == 1 + 60 + 7 + len(request) - 60  # every byte on the wire
    # the pad length byte and padding are not read as the message: an answer lets it go
    assert fed(held, frame(DATA, 0, 1, message(1)), piece, True) == len(request)
    assert held.total == 8
    assert fed(held, frame(RST_STREAM, 0, 1, bytes(4)), piece, True) == 8
    assert held.total == 0


@pytest.mark.parametrize("piece", PIECES)
def test_a_stream_of_requests_lets_one_go_for_each_answer(piece: int) -> None:
    held = Held()
    first, second, partial = message(50), message(70), message(5000)[:2000]
    sent = PREFACE + frame(HEADERS, 0x4, 3) + frame(DATA, 0, 3, first + second + partial)
    fed(held, sent, piece)
    assert held.total == len(first) + len(second) + len(partial)
    assert fed(held, frame(DATA, 0, 3, message(3)), piece, True) == len(first)
    assert fed(held, frame(DATA, 0, 3, message(3) + message(4)), piece, True) == len(second)
    # a message still arriving is held until its answer or its stream's end
    assert held.total == len(partial)
    assert fed(held, frame(HEADERS, END_STREAM | 0x4, 3), piece, True) == len(partial)
    assert held.total == 0


def test_a_stream_ended_or_reset_counts_no_more_of_what_still_comes() -> None:
    held = Held()
    fed(held, PREFACE + frame(HEADERS, 0x4, 1) + frame(DATA, 0, 1, message(10_000)[:4000]), 4096)
    assert held.answered(memoryview(frame(HEADERS, END_STREAM | 0x4, 1))) == 4000  # refused
    fed(held, frame(DATA, 0, 1, bytes(3000)), 4096)  # the rest, in flight: grpcio drops it
    assert held.total == 0
    fed(held, frame(HEADERS, 0x4, 5) + frame(DATA, 0, 5, bytes(100)), 4096)
    fed(held, frame(RST_STREAM, 0, 5, bytes(4)), 4096)  # the client cancels
    assert held.total == 0
    fed(held, frame(HEADERS, 0x4, 1) + frame(DATA, 0, 1, bytes(100)), 4096)  # a closed id
    assert held.total == 0


def test_streams_are_counted_apart() -> None:
    held = Held()
    one, three = message(100), message(200)
    sent = (
        PREFACE
        + frame(HEADERS, 0x4, 1)
        + frame(HEADERS, 0x4, 3)
        + frame(DATA, 0, 3, three[:50])
        + frame(DATA, 0, 1, one)
        + frame(DATA, 0, 3, three[50:])
    )
    fed(held, sent, 7)
    assert held.answered(memoryview(frame(DATA, 0, 3, message(1)))) == len(three)
    assert held.total == len(one)


def test_a_client_that_is_not_http2_is_not_counted() -> None:
    held = Held()
    held.sent(memoryview(b"GET / HTTP/1.1\r\n\r\n" + bytes(100_000)))
    assert (held.total, held.counting) == (0, False)
    assert held.answered(memoryview(b"HTTP/1.1 400\r\n\r\n")) == 0


def test_stop_gives_back_what_was_held() -> None:
    held = Held()
    fed(held, PREFACE + frame(HEADERS, 0x4, 1) + frame(DATA, 0, 1, message(500)[:300]), 64)
    assert held.stop() == 300
    assert held.total == 0
    fed(held, frame(DATA, 0, 1, bytes(100)), 64)
    assert held.total == 0


def test_a_data_frame_header_at_a_pieces_end_is_read_with_its_padding_later() -> None:
    """A PADDED DATA frame whose header ends a piece: its pad length is the next piece's
    first byte (the empty rest of the piece was read as the frame's data, and failed)."""
    held = Held()
    padded = frame(DATA, PADDED, 1, bytes([4]) + message(10) + bytes(4))
    fed(held, PREFACE + frame(HEADERS, 0x4, 1) + padded[:9], 4096)
    fed(held, padded[9:], 4096)
    assert held.total == len(padded) - 9
    assert held.answered(memoryview(frame(DATA, 0, 1, message(1)))) == 15
    assert held.answered(memoryview(frame(RST_STREAM, 0, 1, bytes(4)))) == 5


def test_a_message_arriving_is_timed_from_its_own_first_byte(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A stream whose DATA frames cross its messages' edges: each message arriving is timed
    from its own first byte, not the first message's."""
    clock = [100.0]
    monkeypatch.setattr("service.cluster.held.time.monotonic", lambda: clock[0])
    held = Held()
    first, second = message(100), message(100)
    fed(held, PREFACE + frame(HEADERS, 0x4, 1) + frame(DATA, 0, 1, first[:50]), 4096)
    assert held.arriving_since() == 100.0
    clock[0] = 160.0
    fed(held, frame(DATA, 0, 1, first[50:] + second[:30]), 4096)  # the first whole, the next begun
    assert held.arriving_since() == 160.0
    clock[0] = 170.0
    fed(held, frame(DATA, 0, 1, second[30:60]), 4096)  # the same message, still arriving
    assert held.arriving_since() == 160.0
    fed(held, frame(DATA, 0, 1, second[60:]), 4096)
    assert held.arriving_since() is None
