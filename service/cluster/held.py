"""What a gRPC client has sent that its worker has not answered yet, read from the HTTP/2
frames as they pass the supervisor's front (issue #28, finding 2).

grpcio takes in a whole message before any handler can see it (its flow control opens the
window for all of a message once its length is known), so the workers' budget, which counts a
message from the moment grpcio hands it over, cannot bound what is still arriving: 32 streams
stalled 1 KiB short of 60 MiB held +1.9 GiB. The front sees every byte first. :class:`Held`
counts, per connection, the DATA bytes of each stream from the client, and lets them go as the
worker answers: a request message when an answer message starts on its stream (grpcio handed
the request over, so the worker's budget counts it from then on), all of a stream when the
worker ends it (trailers, ``RST_STREAM``) or the client resets it. The front stops reading the
connections that hold the most while all of them together hold more than the budget
(:class:`service.cluster.front.GrpcFront`).

Only the frames' 9-byte headers and gRPC's 5-byte message prefixes are read; nothing is
decoded (no HPACK) or changed. A client whose first bytes are not HTTP/2's preface is not
counted (it is grpcio's to refuse).
"""

from __future__ import annotations

import struct
import time
from collections import deque

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
DATA, HEADERS, RST_STREAM = 0x0, 0x1, 0x3
END_STREAM, PADDED = 0x1, 0x8
_HEAD = 9
"""Bytes of an HTTP/2 frame header: length (3), type, flags, stream id (4)."""
_HEADER = struct.Struct(">BHBBI")
"""A frame header: the length's high byte and low two bytes, type, flags, stream id."""


MESSAGE_COPIES = 2
"""How many times an inference message's size a worker holds for it at most, and takes from
its budget (:mod:`service.grpc.servicer`); the front lets a worker be sent at most its budget
over this. Its bytes, once, where its raw contents are read as views of them
(:func:`service.protocol.grpc.parse_infer`); twice where upb reads them (a message under
``SCAN_FROM_BYTES`` or of more than ``MAX_SCANNED_FIELDS`` fields): its bytes and the parsed
message while it is parsed, then the parsed message and the raw contents read out of it."""


def _split(fields: tuple[int, ...]) -> tuple[int, int, int, int]:
    """The header fields as :meth:`_Frames._header` takes them."""
    high, low, kind, flags, stream = fields
    return high << 16 | low, kind, flags, stream


class _Messages:
    """gRPC's length-prefixed messages (a flag byte, a 4-byte length, the message) in the
    DATA of one direction of one stream: where they start and end."""

    __slots__ = ("fresh", "head", "left", "size")

    def __init__(self) -> None:
        self.head = bytearray()
        self.left = 0
        self.size = 0
        self.fresh = False
        """The message arriving (if one is) began in the last piece fed."""

    @property
    def within(self) -> bool:
        """Between a message's first byte and its last."""
        return bool(self.left or self.head)

    def feed(self, data: memoryview) -> tuple[int, list[int]]:
        """The messages that start in ``data``, and the sizes (prefix included) of those
        that end in it."""
        end = len(data)
        if end >= 5 and not self.left and not self.head:  # most often: one whole message
            size = 5 + int.from_bytes(data[1:5], "big")
            if size == end:
                self.fresh = False
                return 1, [size]
        started, ended = 0, []
        at = 0
        self.fresh = False
        while at < end:
            if self.left:
                taken = min(self.left, end - at)
                self.left -= taken
                at += taken
                if not self.left:
                    ended.append(self.size)
                    self.fresh = False
                continue
            if not self.head:
                self.fresh = True  # a message's first byte
            taken = min(5 - len(self.head), end - at)
            self.head += data[at : at + taken]
            at += taken
            if len(self.head) == 5:
                self.left = int.from_bytes(self.head[1:], "big")
                self.size = 5 + self.left
                self.head.clear()
                started += 1
                if not self.left:
                    ended.append(self.size)
                    self.fresh = False
        return started, ended


class _Stream:
    """One stream's count: its DATA bytes held, and its whole requests not yet answered."""

    __slots__ = ("answers", "held", "requests", "since", "unanswered")

    def __init__(self) -> None:
        self.held = 0
        self.since: float | None = None
        """When the request message still arriving began to (monotonic), if one is."""
        self.requests = _Messages()
        self.unanswered: deque[int] = deque()
        self.answers = _Messages()


class _Frames:
    """The HTTP/2 frames of one direction, as its bytes pass in pieces of any size: calls
    ``frame(type, flags, stream)`` at each frame's header, and ``data(stream, piece,
    wire)`` for each piece of a DATA frame's data (padding taken off; ``wire``: the bytes of
    the frame the piece stands for, padding included)."""

    def __init__(self, skip: int, owner: Held, answers: bool) -> None:
        self.skip = skip
        self.owner = owner
        self.answers = answers
        self.head = bytearray()
        self.left = 0
        """Payload bytes of the current frame still to come."""
        self.kind = self.stream = 0
        self.pad_byte = False
        """A PADDED DATA frame whose pad length (its first payload byte) is still to come."""
        self.padding = 0

    def feed(self, data: memoryview) -> None:
        at, end = 0, len(data)
        if self.skip:
            at = min(self.skip, end)
            self.skip -= at
        while at < end:
            if not self.left:
                if self.head or end - at < _HEAD:  # a header cut by the pieces' edge
                    taken = min(_HEAD - len(self.head), end - at)
                    self.head += data[at : at + taken]
                    at += taken
                    if len(self.head) == _HEAD:
                        self._header(*_split(_HEADER.unpack(self.head)))
                        self.head.clear()
                    continue
                high, low, kind, flags, stream = _HEADER.unpack_from(data, at)
                at += _HEAD
                self._header(high << 16 | low, kind, flags, stream)
                if not self.left:
                    continue
            taken = min(self.left, end - at)  # the payload, or as much of it as is here
            if self.kind == DATA and taken:
                self._data(data[at : at + taken])
            self.left -= taken
            at += taken

    def _header(self, length: int, kind: int, flags: int, stream: int) -> None:
        self.left = length
        self.kind = kind
        self.stream = stream & 0x7FFFFFFF
        if kind == DATA:
            self.pad_byte = bool(flags & PADDED)
            self.padding = 0
        elif kind == RST_STREAM or (
            kind == HEADERS and (flags & END_STREAM if self.answers else True)
        ):
            self.owner.frame(self.answers, kind, flags, self.stream)

    def _data(self, piece: memoryview) -> None:
        wire = len(piece)
        if not self.pad_byte and not self.padding:  # most often: no padding
            self.owner.data(self.answers, self.stream, piece, wire)
            return
        if self.pad_byte:
            self.padding = piece[0]
            self.pad_byte = False
            piece = piece[1:]
        # the last ``padding`` bytes of the frame are padding: ``left`` counts down to them
        data_left = max(0, self.left - (wire - len(piece)) - self.padding)
        self.owner.data(self.answers, self.stream, piece[:data_left], wire)


class Held:
    """The client bytes of one forwarded connection that its worker has not answered:
    ``sent`` with what goes to the worker, ``answered`` with what comes back; ``total`` is
    the count."""

    def __init__(self) -> None:
        self.total = 0
        self.counting = True
        """False once the client's first bytes were not HTTP/2's preface."""
        self._preface = bytearray()
        self._streams: dict[int, _Stream] = {}
        self._highest = 0
        self._sent = _Frames(len(PREFACE), self, answers=False)
        self._answered = _Frames(0, self, answers=True)

    def sent(self, data: memoryview) -> None:
        """``data`` goes from the client to the worker."""
        if not self.counting:
            return
        if len(self._preface) < len(PREFACE):
            taken = data[: len(PREFACE) - len(self._preface)]
            self._preface += taken
            if not PREFACE.startswith(self._preface):
                self.stop()
                return
        self._sent.feed(data)

    def answered(self, data: memoryview) -> int:
        """``data`` goes from the worker to the client; the bytes it lets go."""
        if not self.counting or len(self._preface) < len(PREFACE):
            return 0
        before = self.total
        self._answered.feed(data)
        return before - self.total

    def arriving_since(self) -> float | None:
        """When the oldest request message still arriving began to (monotonic), if one is."""
        return min((s.since for s in self._streams.values() if s.since is not None), default=None)

    def stop(self) -> int:
        """Count no more (the connection closed, or is not HTTP/2); what was held."""
        held, self.total = self.total, 0
        self.counting = False
        self._streams.clear()
        return held

    def frame(self, answers: bool, kind: int, flags: int, stream: int) -> None:
        if kind == RST_STREAM or (answers and kind == HEADERS and flags & END_STREAM):
            self._end(stream)
        elif not answers and kind == HEADERS and stream > self._highest:
            self._highest = stream  # a new stream (ids only grow; a closed one stays closed)
            self._streams[stream] = _Stream()

    def data(self, answers: bool, stream: int, piece: memoryview, wire: int) -> None:
        state = self._streams.get(stream)
        if state is None:  # ended, or never opened: grpcio drops it
            return
        if not answers:
            state.held += wire
            self.total += wire
            requests = state.requests
            ended = requests.feed(piece)[1]
            if ended:
                state.unanswered.extend(ended)
            if not requests.within:
                state.since = None
            elif requests.fresh or state.since is None:  # the one arriving began here
                state.since = time.monotonic()
            return
        started, _ = state.answers.feed(piece)
        for _ in range(started):
            if not state.unanswered:
                break
            self._release(state, state.unanswered.popleft())

    def _end(self, stream: int) -> None:
        state = self._streams.pop(stream, None)
        if state is not None:
            self._release(state, state.held)

    def _release(self, state: _Stream, size: int) -> None:
        freed = min(size, state.held)  # padding is counted, and let go with its stream
        state.held -= freed
        self.total -= freed
