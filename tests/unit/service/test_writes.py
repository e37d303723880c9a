"""One write an answer (service.http.writes): a response head waits for the body written after
it in the same turn of the loop, over a real socket pair and the loop's own transport."""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from service.http.writes import OneWrite
from service.limits.connections import Flushes

HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 11\r\n\r\n"
BODY = b'{"ok":true}'


@asynccontextmanager
async def pair() -> AsyncIterator[tuple[OneWrite, socket.socket]]:
    """A connected socket pair: ours behind the loop's transport and a OneWrite, theirs raw."""
    loop = asyncio.get_running_loop()
    ours, theirs = socket.socketpair()
    transport, _ = await loop.connect_accepted_socket(asyncio.Protocol, ours)
    theirs.setblocking(False)
    try:
        yield OneWrite(transport, loop), theirs
    finally:
        transport.abort()
        theirs.close()


async def arriving(peer: socket.socket) -> bytes:
    """The next bytes (b"" at the end of the stream) once they arrive, within 5 s."""
    return await asyncio.wait_for(asyncio.get_running_loop().sock_recv(peer, 65536), 5)


def received(peer: socket.socket) -> bytes:
    try:
        return peer.recv(65536)
    except BlockingIOError:
        return b""


async def test_a_head_waits_for_its_body_and_both_leave_in_one_write() -> None:
    async with pair() as (transport, peer):
        transport.write(HEAD)
        assert received(peer) == b""  # held: nothing sent yet
        assert transport.get_write_buffer_size() == len(HEAD)  # counted while held
        transport.write(BODY)
        assert received(peer) == HEAD + BODY  # one send: one read takes both
        assert transport.get_write_buffer_size() == 0


async def test_a_head_no_body_follows_leaves_at_the_end_of_the_turn() -> None:
    """A streamed answer's head, or an interim 100 Continue: sent as soon as the loop turns."""
    async with pair() as (transport, peer):
        transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        await asyncio.sleep(0)
        assert received(peer) == b"HTTP/1.1 100 Continue\r\n\r\n"
        transport.write(b"chunk")  # not a head: at once
        assert received(peer) == b"chunk"


async def test_close_sends_a_held_head_first() -> None:
    async with pair() as (transport, peer):
        transport.write(HEAD)
        transport.close()
        assert await arriving(peer) == HEAD
        assert await arriving(peer) == b""  # then the end of the stream


async def test_an_aborted_connection_sends_nothing_it_held() -> None:
    loop = asyncio.get_running_loop()
    ours, theirs = socket.socketpair()
    transport, _ = await loop.connect_accepted_socket(asyncio.Protocol, ours)
    writes = OneWrite(transport, loop)
    writes.write(HEAD)
    writes.abort()
    theirs.setblocking(False)
    assert await arriving(theirs) == b""
    theirs.close()


async def test_head_and_body_are_one_call_on_the_transport() -> None:
    """One read taking both could also be two sends read late: the transport under OneWrite
    is asked once, with both."""
    loop = asyncio.get_running_loop()
    ours, theirs = socket.socketpair()
    transport, _ = await loop.connect_accepted_socket(asyncio.Protocol, ours)
    calls: list[tuple[str, list[bytes]]] = []
    write, writelines = transport.write, transport.writelines

    def noted_write(data: bytes) -> None:
        calls.append(("write", [bytes(data)]))
        write(data)

    def noted_writelines(data: list[bytes]) -> None:
        calls.append(("writelines", [bytes(d) for d in data]))
        writelines(data)

    transport.write = noted_write  # type: ignore[method-assign]  # the real one, noted
    transport.writelines = noted_writelines  # type: ignore[method-assign]  # the real one, noted
    writes = OneWrite(transport, loop)
    writes.write(HEAD)
    writes.write(BODY)
    # asyncio's own writelines joins and calls write: that one write is its, not a second send
    assert calls[0] == ("writelines", [HEAD, BODY]) and calls[1:] in (
        [],
        [("write", [HEAD + BODY])],
    )
    transport.abort()
    theirs.close()


class ClosesAtEof(asyncio.Protocol):
    """As GuardedHttpProtocol at a FIN after a complete answer: flush, then let the loop close."""

    writes: OneWrite | None = None

    def eof_received(self) -> bool | None:
        if isinstance(self.writes, Flushes):
            self.writes.flush()
        return None


async def test_a_held_head_is_flushed_before_the_loop_closes_at_the_client_s_fin() -> None:
    """A HEAD answer's head has no body after it; if the client's FIN is read in the same
    turn, the loop closes the transport before the end-of-turn flush, which found it closing
    and dropped the head (a review's reproduction). The protocol flushes first."""
    loop = asyncio.get_running_loop()
    ours, theirs = socket.socketpair()
    transport, protocol = await loop.connect_accepted_socket(ClosesAtEof, ours)
    writes = protocol.writes = OneWrite(transport, loop)
    theirs.shutdown(socket.SHUT_WR)  # the FIN, read in the turn below

    def step() -> None:  # the answer's last step, busy while the FIN arrives
        time.sleep(0.02)  # blocks the loop on purpose: the FIN is read in this same turn
        writes.write(b"HTTP/1.1 200 OK\r\ncontent-length: 11\r\n\r\n")

    loop.call_soon(step)
    theirs.setblocking(False)
    assert await arriving(theirs) == b"HTTP/1.1 200 OK\r\ncontent-length: 11\r\n\r\n"
    theirs.close()


def test_an_answer_written_after_its_connection_closed_is_dropped() -> None:
    """A refusal closes a pipelined connection under an earlier request still running: its
    answer, written then, raised in uvloop's transport (an ERROR traceback in the log, one per
    connection, at a client's will)."""
    import uvloop

    async def main() -> bytes:
        async with pair() as (transport, peer):
            transport.close()
            ended = await arriving(peer)
            await asyncio.sleep(0.05)  # closed, not only closing
            transport.write(HEAD)
            transport.write(BODY)
            transport.writelines([HEAD, BODY])
            return ended

    loop = uvloop.new_event_loop()
    try:
        assert loop.run_until_complete(main()) == b""  # the end of the stream, nothing raised
    finally:
        loop.close()


def test_a_connection_the_server_stopped_reading_is_given_more_time_not_refused() -> None:
    """A request queued behind a running one on its connection: uvicorn stops reading it,
    and its head's or body's deadline went by meanwhile (408, both answers lost)."""
    from types import SimpleNamespace

    from service.limits.connections import GuardedHttpProtocol

    said: list[tuple[str, ...]] = []
    for paused in (True, False):
        connection = SimpleNamespace(
            flow=SimpleNamespace(read_paused=paused),
            _waiting_for=("body_timeout", 3.0),
            _deadline=1.0,
            cycle=None,
            _in_head=False,
            _expect=lambda reason, seconds: said.append(("wait", reason)),
            _refuse=lambda reason, message: said.append(("refuse", reason)),
        )
        GuardedHttpProtocol._expire(connection)  # type: ignore[arg-type]  # a stand-in connection
    assert said == [("wait", "body_timeout"), ("refuse", "body_timeout")]
