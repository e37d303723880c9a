"""Guards on each HTTP connection, below the application: what a client may hold open costs
the server a bounded amount, however the client behaves.

uvicorn's httptools protocol has no limit on the number of connections (each one costs a file
descriptor: enough idle ones and every new client is reset), no timeout for a connection that
never sends a request, no limit on a request head's size and no timeout for a head or a body
that stops arriving. This subclass adds them:

- more than ``max_connections`` open, or more than ``max_connections_per_client`` from one
  address: the new one is answered 503 (``Retry-After``) and closed (#28 finding 16: 4,096
  silent connections from one client made 118 of 125 other clients' requests 503);
- a request head larger than ``max_header_bytes``, or a chunked body's trailers: 431, closed;
  a chunk-size line larger than it (a chunk extension that never ends): 413, closed. Each is
  measured in bytes as it arrives, however the reads split it (:mod:`service.limits.framing`);
- a head not complete within ``header_timeout_s`` of the connection opening or of the request
  starting (a silent or slowloris client): 408, closed;
- a body not complete within ``body_timeout_s`` of its head: 408, closed; the application's
  ``receive`` then reports a disconnect, so nothing waits on it;
- a half-close after a whole request: the request is answered, then the connection closes
  (uvicorn closed at once, and the client got nothing); a client that closed and left is told
  apart by the reset its socket answers an interim ``100 Continue`` with (:meth:`eof_received`);
- an answer its client does not take (the transport's send buffer not empty again within
  ``write_timeout_s`` of filling): the connection is aborted, its buffer let go. Until then
  the buffer's bytes count in the server's budget (:mod:`service.limits.admission`), so
  answers piling up for clients that do not read refuse new bodies instead of growing memory
  (#28 finding 5: 200 answers never read held +4.6 GiB, with no timeout).

Each refusal is written straight to the transport (the application never sees the request) and
counted in :data:`service.telemetry.counters.REFUSED`, by reason, for the metrics. On a
pipelined connection a refusal, as uvicorn's 400 for bytes its parser rejects, comes after the
answers to the requests before it, in order, and closes the connection: until then nothing more
is read from it (each of those requests has its own deadlines).
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol, runtime_checkable

import httptools
import orjson
from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

from service.limits.admission import BytesBudget
from service.limits.balance import BALANCE
from service.limits.framing import Framing
from service.telemetry.counters import REFUSED

PROBE_S = 0.05
"""How long after a half-close's probe its reset is first looked for (loopback: well past)."""
SWEEP_S = 0.25
"""How often overdue heads and bodies are looked for: a timeout fires up to this late."""


_REASONS = {
    "too_many": (503, b"Service Unavailable"),
    "too_many_from_client": (503, b"Service Unavailable"),
    "header_too_large": (431, b"Request Header Fields Too Large"),
    "chunk_line_too_large": (413, b"Content Too Large"),
    "header_timeout": (408, b"Request Timeout"),
    "body_timeout": (408, b"Request Timeout"),
}
log = logging.getLogger("tensorgate.server")


@dataclass(frozen=True)
class ConnectionLimits:
    """The bounds one server puts on its connections (from :class:`service.settings.Settings`)."""

    max_connections: int
    max_header_bytes: int
    header_timeout_s: float
    body_timeout_s: float
    write_timeout_s: float = 60.0
    max_connections_per_client: int | None = None
    """None: as many as ``max_connections``."""


@runtime_checkable
class Flushes(Protocol):
    """A transport that may hold what was written (:class:`service.http.writes.OneWrite`)."""

    def flush(self) -> None: ...


Writes = Callable[[asyncio.Transport, asyncio.AbstractEventLoop], asyncio.Transport]
"""What a connection's protocol writes through, made from its transport and loop
(:class:`service.http.writes.OneWrite`)."""


def guarded_protocol(
    limits: ConnectionLimits, budget: BytesBudget | None = None, writes: Writes | None = None
) -> type[GuardedHttpProtocol]:
    """The protocol class uvicorn instantiates per connection, bound to ``limits`` (one class a
    server: its sweep and its set of connections are its own); answers not yet taken by their
    clients count in ``budget``; each connection writes through ``writes`` when given."""
    return type(
        "GuardedHttpProtocol",
        (GuardedHttpProtocol,),
        {
            "limits": limits,
            "budget": budget,
            "writes": None if writes is None else staticmethod(writes),
            "_sweep": None,
            "_open": set(),
            "_per_client": {},
        },
    )


def _framed(headers: Iterable[tuple[bytes, bytes]]) -> tuple[int, bool]:
    """How the body after a head is framed, from its headers (its length, whether chunked):
    llhttp checked both (digits; not both)."""
    length, chunked = 0, False
    for name, value in headers:
        if name == b"content-length":
            length = int(value)
        elif name == b"transfer-encoding":
            chunked = True
    return length, chunked


class _Trailers:
    """Where uvicorn's ``on_header`` appends once a head is complete: a chunked body's
    trailers, not kept (their size is bounded as they arrive, by the framing). Read, it is the
    head's headers (uvicorn looks through them again for an upgrade as the body and its end are
    parsed)."""

    __slots__ = ("head",)

    def __init__(self) -> None:
        self.head: list[tuple[bytes, bytes]] = []

    def __iter__(self) -> Iterator[tuple[bytes, bytes]]:
        return iter(self.head)

    def append(self, header: tuple[bytes, bytes]) -> None:
        pass


class GuardedHttpProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with the guards of this module."""

    limits: ClassVar[ConnectionLimits]
    budget: ClassVar[BytesBudget | None] = None
    writes: ClassVar[Writes | None] = None
    _sweep: ClassVar[asyncio.TimerHandle | None] = None
    _open: ClassVar[set[Any]] = set()
    _per_client: ClassVar[dict[str, int]] = {}
    """Open connections by client address (the limit per client)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # When the head or body now under way must have arrived (loop time), and what to say
        # then. Checked by one sweep a server (below), not by a timer per request: arming and
        # cancelling two timers a request was a cost on every request.
        self._deadline: float | None = None
        self._waiting_for = ("", 0.0)
        self._in_head = False  # a request has begun and its head is not complete yet
        self._in_body = False  # the application has the head of the request being parsed
        self._framing = Framing(self.limits.max_header_bytes)
        self._heads: list[list[tuple[bytes, bytes]]] | None = None
        """Each head's headers, parsed in a read fed whole (:meth:`data_received`)."""
        self._in_message = False  # a request has begun and is not complete
        self._upgrade = (0, False)  # how the body of a request that asked for an upgrade is framed
        self._resuming = False  # the parser is being set on such a body (_resume)
        self._last: bytes | None = None  # a refusal written once the answers before it are
        self._trailers = _Trailers()
        self._unsent = 0  # bytes in the transport's send buffer, as the budget counts them
        self._filled_at: float | None = None  # when that buffer last stopped being empty
        self._half_closed = False  # the client's FIN came with a request waiting: probed
        self._address: str | None = None  # counted in _per_client while open

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]  # narrower than BaseTransport, as uvicorn's own
        writes = type(self).writes
        super().connection_made(transport if writes is None else writes(transport, self.loop))
        BALANCE.count(len(self.connections))
        if len(self.connections) > self.limits.max_connections:
            self._refuse(
                "too_many",
                f"the server has {self.limits.max_connections} connections open, its limit; "
                "retry shortly",
            )
            return
        per_client = self.limits.max_connections_per_client
        peer = transport.get_extra_info("peername")
        if per_client is not None and isinstance(peer, tuple) and peer:
            counts = type(self)._per_client
            address = str(peer[0])
            if counts.get(address, 0) >= per_client:
                self._refuse(
                    "too_many_from_client",
                    f"this client has {per_client} connections open, the limit for one "
                    "address (TG_MAX_CONNECTIONS_PER_CLIENT); reuse them, or retry shortly",
                )
                return
            counts[address] = counts.get(address, 0) + 1
            self._address = address
        type(self)._open = self.connections  # uvicorn's set of this server's connections
        self._expect("header_timeout", self.limits.header_timeout_s)
        self._schedule_sweep()

    def connection_lost(self, exc: Exception | None) -> None:
        self._deadline = None
        if self._address is not None:
            counts = type(self)._per_client
            left = counts.pop(self._address) - 1
            if left:
                counts[self._address] = left
            self._address = None
        if self.budget is not None and self._unsent:
            self.budget.hold(-self._unsent)
        self._unsent = 0
        super().connection_lost(exc)
        BALANCE.count(len(self.connections))

    def eof_received(self) -> bool | None:  # type: ignore[override]  # asyncio's own signature: uvicorn's says None
        """The client sent its FIN. That is a half-close (``shutdown(SHUT_WR)``, as ``nc -N``
        does) or a client that closed and left (a timeout): TCP shows no difference until the
        server writes, when a closed socket answers with a reset. So while a request sent whole
        waits for its answer, the connection stays open for writing and, on HTTP/1.1, is sent
        an interim ``100 Continue`` (a 1xx every HTTP/1.1 client must accept before its
        answer): a client that left resets the connection, and its work is cancelled as for any
        disconnect; one that half-closed gets its answer, and the connection closes after it.
        A request cut off in its head or body can never be whole: it is dropped, after the
        answers owed to the requests before it on the connection (uvicorn closed at once, and
        a pipelined client that half-closed lost them); with none owed, or none under way, the
        connection closes now as uvicorn does (returning None closes the transport)."""
        if self._last is not None:  # a refusal waits for the answers before it
            return True
        cycle = self.cycle
        if self._in_head or (cycle is not None and cycle.more_body):
            self._answer_last(b"")  # nothing to say to the request cut off: it is dropped
            if self._last is not None:
                return True  # the connection closes once the answers before it are written
            self._flush()
            return None
        if cycle is None or cycle.response_complete:
            self._flush()
            return None
        cycle.keep_alive = False  # its answer says ``connection: close`` and closes after
        if not cycle.response_started and cycle.scope.get("http_version") == "1.1":
            self.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")
            # asyncio stops reading once EOF is kept open, so the reset is looked for here
            # (soon, and by each sweep until the answer is written)
            self._half_closed = True
            self.loop.call_later(PROBE_S, self._check_gone)
        return True

    def _flush(self) -> None:
        """Write what the transport holds, before the loop closes it under it."""
        if isinstance(self.transport, Flushes):  # the loop closes the transport under it
            self.transport.flush()

    def pause_writing(self) -> None:
        """The transport's buffer passed its high-water mark: count what it holds now, not at
        the next sweep. An answer is let go from the request's count once written to the
        transport, and the bytes the client has not taken were counted nowhere until the sweep
        (up to 0.25 s), while new bodies were let in."""
        try:
            self._count_unsent()
        finally:
            super().pause_writing()

    def resume_writing(self) -> None:
        try:
            self._count_unsent()  # drained below its low-water mark
        finally:
            super().resume_writing()

    def _check_gone(self) -> None:
        """After a probe: a reset, if the client left, is the socket's pending error."""
        if not self._half_closed or self.transport.is_closing():
            return
        sock = self.transport.get_extra_info("socket")
        if sock is not None and sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR):
            self._half_closed = False
            self.transport.abort()  # connection_lost: the app's receive() reports a disconnect

    def data_received(self, data: bytes) -> None:
        # uvicorn's own data_received, but the parser is fed the pieces the framing marks out:
        # it stops at each head's end (the parser, at that head's end, says how the body is
        # framed) and before a head, chunk-size line or trailers past the limit, which the
        # parser never sees.
        if self._last is not None:  # a refusal waits for earlier answers: nothing is read
            self.flow.pause_reading()  # (again: an earlier request's receive() resumes it)
            return
        if data[0] in b"\r\n" and not self._in_message and not data.strip(b"\r\n"):
            # Empty lines between requests, which llhttp skips: they cancel no timer (one
            # every few seconds cancelled uvicorn's keep-alive, started no head's, and held
            # an idle connection open for good).
            return
        self._unset_keepalive_if_required()
        framing = self._framing
        if framing.idle and len(data) <= framing.limit:
            # Nothing in a read of at most the limit, from between requests, can pass it: fed
            # whole (one request in one read, the usual case, cost 11 % more instructions cut
            # up: docs/performance.md); the framing follows it only where the read ends within
            # a request.
            heads: list[list[tuple[bytes, bytes]]] = []
            self._heads = heads
            try:
                fed = self._feed(data)
            finally:
                self._heads = None
            if fed and self._in_message and not framing.follow(data, list(map(_framed, heads))):
                self._invalid()  # the parser and the framing disagree on where a head ends
            return
        view, start = memoryview(data), 0
        while start < len(data):
            end = framing.cut(data, start)
            if end > start and not self._feed(view[start:end]):
                return
            if framing.over is not None:
                self._refuse_framing(framing.over)
                return
            start = end

    def _feed(self, data: bytes | memoryview) -> bool:
        """Parse ``data``; False when the connection is answered (a 400) or upgraded, and the
        rest of the read is not parsed, as in uvicorn's own."""
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._invalid(str(exc))
            return False
        except httptools.HttpParserUpgrade as upgrade:
            return self._resume(data[upgrade.args[0] :])
        return True

    def _resume(self, rest: bytes | memoryview) -> bool:
        """After a request asking for an upgrade (``Upgrade: h2c``, as ``curl --http2`` asks on
        an http:// URL; a websocket; ``CONNECT``), which llhttp hands over at its head's end:
        the server takes none (it serves no websockets, and HTTP/2 on its gRPC port), so the
        upgrade is ignored, as RFC 9110 allows, and the request is served as HTTP/1.1 with its
        body. A new parser reads the body and what follows: after a head with the same framing,
        whose callbacks are skipped. (llhttp parses nothing after an upgrade's head: a POST's
        body was lost, its request answered as if empty, and every later request on the
        connection went unparsed and unanswered.)"""
        length, chunked = self._upgrade
        self._upgrade = (0, False)
        keep_alive = self.parser.should_keep_alive()
        if not (length or chunked or keep_alive):
            return True  # its answer closes the connection: nothing after it is parsed
        self.parser = httptools.HttpRequestParser(self)
        if length or chunked:
            self._resuming = True
            self.parser.feed_data(
                b"POST / HTTP/1.1\r\n%s%s\r\n"
                % (
                    b"Transfer-Encoding: chunked\r\n"
                    if chunked
                    else b"Content-Length: %d\r\n" % length,
                    b"" if keep_alive else b"Connection: close\r\n",
                )
            )
        return self._feed(rest) if len(rest) else True

    def _invalid(self, why: str = "") -> None:
        """uvicorn's 400 for bytes its parser rejects, saying what llhttp found wrong
        (``Invalid header value char``, ``Transfer-Encoding can't be present with
        Content-Length``): uvicorn's own said only that the request was invalid."""
        REFUSED["invalid_http"] += 1
        said = "Invalid HTTP request received" + (f": {why}" if why else ".")
        said = said.encode("ascii", "replace").decode()  # llhttp's words, ASCII as the answer
        self.logger.warning(said)
        self.send_400_response(said)

    def _refuse_framing(self, over: str) -> None:
        limit = f"{self.limits.max_header_bytes} bytes, the limit (TG_MAX_HEADER_BYTES)"
        if over == "chunk_line":
            self._refuse(
                "chunk_line_too_large",
                f"a chunk-size line of the request body (its extensions included) exceeds {limit}",
            )
        elif over == "trailers":
            self._refuse("header_too_large", f"the request body's trailers exceed {limit}")
        else:
            self._refuse("header_too_large", f"the request head exceeds {limit}")

    def send_400_response(self, msg: str) -> None:
        """uvicorn's answer to bytes its parser rejects, after the answers before it: JSON, as
        every other error the server answers (``{"error": ...}``), not uvicorn's plain text."""
        body = orjson.dumps({"error": msg})
        content = [STATUS_LINE[400]]
        for name, value in self.server_state.default_headers:
            content.extend([name, b": ", value, b"\r\n"])
        content += [
            b"content-type: application/json\r\n",
            b"content-length: %d\r\n" % len(body),
            b"connection: close\r\n\r\n",
            body,
        ]
        self._answer_last(b"".join(content))

    def on_message_begin(self) -> None:
        super().on_message_begin()
        if self._resuming:  # the head that sets the parser after an upgrade on the body
            return
        self._in_head = self._in_message = True
        if self._deadline is None:  # after a keep-alive pause: the head must now arrive in time
            self._expect("header_timeout", self.limits.header_timeout_s)

    def on_headers_complete(self) -> None:
        if self._resuming:  # the same: the request is the upgrade's, already with its cycle
            self._resuming = False
            return
        self._in_head = False
        if self._heads is not None:  # a read fed whole: looked at only if the framing follows
            self._heads.append(self.headers)
        else:  # an upgrade's body too: the upgrade is ignored, its body read (_resume)
            self._framing.body(*_framed(self.headers))
        self._expect("body_timeout", self.limits.body_timeout_s)
        cycle = self.cycle
        super().on_headers_complete()
        self._in_body = self.cycle is not cycle

    def on_chunk_header(self) -> None:
        """A chunked body's chunk begins (httptools calls this only for those): what uvicorn
        adds to its headers from here on are the body's trailers, dropped (ASGI gives a request
        no trailers; they were appended to the scope's headers, 32 MB of them against a limit
        of 8 KiB)."""
        if self.headers is not self._trailers:  # type: ignore[comparison-overlap]  # once swapped
            self._trailers.head = self.headers
            self.headers = self._trailers  # type: ignore[assignment]  # appended to, iterated

    def on_message_complete(self) -> None:
        if self.parser.should_upgrade():  # llhttp stops after an upgrade's head, body unread
            self._upgrade = _framed(self.headers)
            if self._upgrade != (0, False):
                return  # complete once its body is read (_resume)
        self._deadline, self._in_body, self._in_message = None, False, False
        if not self.parser.should_keep_alive():  # llhttp parses nothing after it
            self._framing.untrack()
        super().on_message_complete()

    def on_response_complete(self) -> None:
        """An answer is written: the next request of a pipeline runs, or the refusal that waited
        for the answers before it is written and the connection closed."""
        last = self._last
        if last is None or self.pipeline:
            super().on_response_complete()
            if last is not None:
                self.flow.pause_reading()  # resumed for the next request; nothing more is read
            return
        self.server_state.total_requests += 1
        if not self.transport.is_closing():  # not an answer that closed the connection itself
            self.transport.write(last)
            self.transport.close()

    def _expect(self, reason: str, seconds: float) -> None:
        self._deadline = self.loop.time() + seconds
        self._waiting_for = (reason, seconds)

    def _schedule_sweep(self) -> None:
        cls = type(self)
        if cls._sweep is None:
            limits = self.limits
            interval = min(
                SWEEP_S, limits.header_timeout_s, limits.body_timeout_s, limits.write_timeout_s
            )
            cls._sweep = self.loop.call_later(interval, cls._sweep_once, self.loop, interval)

    @classmethod
    def _sweep_once(cls, loop: asyncio.AbstractEventLoop, interval: float) -> None:
        """Every ``interval``: refuse each connection whose head or body is overdue, count
        what each has not sent yet, and abort those whose client has stopped taking it."""
        cls._sweep = None
        now = loop.time()
        for connection in list(cls._open):
            deadline = getattr(connection, "_deadline", None)
            if deadline is not None and now >= deadline:
                connection._expire()
            if hasattr(connection, "_filled_at"):
                connection._check_unsent(now)
                connection._check_gone()
        if cls._open:
            cls._sweep = loop.call_later(interval, cls._sweep_once, loop, interval)

    def _count_unsent(self) -> int:
        """Count what the transport has not sent in the budget, in place of the last count (a
        transport's own callbacks call this: it never closes the transport)."""
        unsent = self.transport.get_write_buffer_size()  # also while closing: it flushes first
        if self.budget is not None and unsent != self._unsent:
            self.budget.hold(unsent - self._unsent)
        self._unsent = unsent
        return unsent

    def _check_unsent(self, now: float) -> None:
        transport = self.transport
        unsent = self._count_unsent()
        if not unsent:
            self._filled_at = None
        elif self._filled_at is None:
            self._filled_at = now
        elif now - self._filled_at >= self.limits.write_timeout_s:
            REFUSED["write_timeout"] += 1
            log.warning(
                "a client left %d bytes of answer untaken for %g s (TG_WRITE_TIMEOUT_S): "
                "connection aborted",
                unsent,
                self.limits.write_timeout_s,
            )
            self._filled_at = None
            transport.abort()  # the buffer is dropped; connection_lost gives the budget back

    def _expire(self) -> None:
        self._deadline = None
        reason, seconds = self._waiting_for
        if self.flow.read_paused:
            # The server stopped reading (a request queued behind a running one, or a body
            # buffered faster than the application takes it): the time is not the client's.
            self._expect(reason, seconds)
            return
        if reason == "header_timeout" and self.cycle is not None and not self._in_head:
            # Between requests (a response still being written, or keep-alive): uvicorn's
            # own keep-alive timeout closes an idle connection.
            return
        part = "head" if reason == "header_timeout" else "body"
        self._refuse(reason, f"the request {part} did not arrive within {seconds:g} s")

    def _refuse(self, reason: str, message: str) -> None:
        """Answer with ``reason``'s status (after the answers before it), then close."""
        REFUSED[reason] += 1
        status, phrase = _REASONS[reason]
        body = orjson.dumps({"error": message})
        head = [
            b"HTTP/1.1 %d %s\r\n" % (status, phrase),
            b"content-type: application/json\r\n",
            b"content-length: %d\r\n" % len(body),
            b"connection: close\r\n",
        ]
        if status == 503:
            head.append(b"retry-after: 1\r\n")
        self._answer_last(b"".join([*head, b"\r\n", body]))

    def _answer_last(self, answer: bytes) -> None:
        """Write ``answer`` to the request being parsed and close, once the requests before it
        on this connection are answered: HTTP/1.1 answers in order, and closing at once lost
        their answers (a 431 for a second request sent before the first was answered was all
        its client got). Until then nothing more is read (:meth:`data_received`); the request
        refused, if the application has its head, reads a disconnect and is never started if
        it waited in the pipeline."""
        self._deadline = None
        refused = self.cycle if self._in_body else None
        owed = False
        if refused is not None and not refused.response_complete:
            refused.disconnected = True
            refused.message_event.set()
            queued = next((entry for entry in self.pipeline if entry[0] is refused), None)
            if queued is not None:
                self.pipeline.remove(queued)
                owed = True  # behind a request still running
            elif refused.response_started:
                self.transport.close()  # its answer is under way: it cannot be followed
                return
        elif refused is None and self.cycle is not None:
            owed = not self.cycle.response_complete  # the last request the application has
        if owed or self.pipeline:
            self._last = answer
            self.flow.pause_reading()
            return
        self.transport.write(answer)
        self.transport.close()
