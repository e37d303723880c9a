"""The gRPC port of several workers: the supervisor's, forwarded (issue #28, finding 12).

grpcio binds its own listening socket and takes no inherited one (nor an accepted connection),
so several workers could share the gRPC port only with ``SO_REUSEPORT``. That lets any process
of the same user bind the port too, and take the calls: grpcio's sockets are dual-stack IPv6,
and Linux prefers an IPv4 socket for IPv4 connections, so a stranger's plain IPv4 socket took
every new channel, not a share (no BPF program on the workers' group can help: the stranger is
in a group of its own). So the supervisor binds the gRPC port as it binds HTTP's, without
``SO_REUSEPORT``, and :class:`GrpcFront` forwards each connection it accepts, byte for byte, to
one worker's gRPC server on a unix socket in the supervisor's private folder.

- **Which worker**: the one with the fewest forwarded connections among those whose socket
  accepts and whose control socket answered lately (a wedged worker takes none while another
  can; a replacement listens only once its models are ready). None: the connection is closed,
  the client retries.
- **What it holds**: at most one :data:`CHUNK` a direction a connection, read only when the
  last one was sent (a client that stops reading stops its worker's answers, which HTTP/2 flow
  control then holds in grpcio, as it did without a front).
- **Connections**: at most ``max_connections`` forwarded, and ``max_connections_per_client``
  from one client address (grpcio has no per-address cap, so a single process has only the
  global one; here one client's 4,096 idle channels would lock every other client out). One
  past either is closed unread.
- **What it costs**: one thread, two sockets and a copy a direction; everything else gRPC
  checks (message sizes, streams, handshake timeout) is checked by the worker's grpcio as
  before. ``python -m bench.front`` measures it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import threading
from collections.abc import Callable
from pathlib import Path
from typing import cast

log = logging.getLogger("tensorgate.workers")

CHUNK = 64 * 1024
"""The most read from one side at a time, and the most left unsent to it before the other side
stops being read."""


class _Side(asyncio.BufferedProtocol):
    """One side of a forwarded connection (the client's or the worker's): what it reads is
    written to its peer."""

    def __init__(self, link: _Link) -> None:
        self.link = link
        self.peer: _Side | None = None
        self.transport: asyncio.Transport | None = None
        self.buffer = bytearray(CHUNK)
        self.eof = False
        self.early = b""
        """Read before the peer was there (uvloop may read once past a pause at the start)."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's: no subclass, same API
        self.transport.set_write_buffer_limits(high=CHUNK)
        self.transport.pause_reading()  # until it is linked to its peer
        if self is self.link.client:
            self.link.front._forward(self.link)

    def get_buffer(self, sizehint: int) -> bytearray:
        return self.buffer

    def buffer_updated(self, nbytes: int) -> None:
        if self.peer is None or self.peer.transport is None:
            self.early += self.buffer[:nbytes]
            if self.transport is not None:
                self.transport.pause_reading()
            return
        self.peer.transport.write(bytes(memoryview(self.buffer)[:nbytes]))  # one copy

    def join(self, peer: _Side) -> None:
        """Forward to ``peer`` from now on, what was read before it first."""
        self.peer = peer
        assert self.transport is not None and peer.transport is not None
        if self.early:
            peer.transport.write(self.early)
            self.early = b""
        self.transport.resume_reading()

    def eof_received(self) -> bool:
        self.eof = True
        peer = self.peer
        if peer is None or peer.eof or peer.transport is None or not peer.transport.can_write_eof():
            self.link.lost()  # both sides have said all they will (or there is nobody to tell)
            return False
        peer.transport.write_eof()  # a half-close, forwarded; the other direction goes on
        return True

    def pause_writing(self) -> None:  # this side is behind: stop reading what feeds it
        if self.peer is not None and self.peer.transport is not None:
            self.peer.transport.pause_reading()

    def resume_writing(self) -> None:
        if self.peer is not None and self.peer.transport is not None:
            self.peer.transport.resume_reading()

    def connection_lost(self, exc: Exception | None) -> None:
        self.link.lost()


class _Link:
    """A client's connection and the worker connection it is forwarded to."""

    def __init__(self, front: GrpcFront) -> None:
        self.front = front
        self.client = _Side(self)
        self.worker = -1
        self.upstream: _Side | None = None
        self.address: str | None = None
        """The client's, while it counts in ``front.per_client``."""
        self.closed = False

    def lost(self) -> None:
        """Either side closed (or failed): close the other, once."""
        if self.closed:
            return
        self.closed = True
        self.front._links.discard(self)
        if self.worker >= 0:
            self.front.open[self.worker] -= 1
        if self.address is not None:
            counts = self.front.per_client
            counts[self.address] -= 1
            if not counts[self.address]:
                del counts[self.address]
        for side in (self.client, self.upstream):
            if side is not None and side.transport is not None:
                side.transport.close()


class GrpcFront:
    """Accepts on ``listener`` and forwards each connection to a worker's unix socket
    (``socket_path(index)`` for ``index`` in ``range(count)``), in one thread."""

    def __init__(
        self,
        listener: socket.socket,
        count: int,
        socket_path: Callable[[int], Path],
        live: Callable[[int], bool],
        max_connections: int,
        max_connections_per_client: int | None = None,
    ) -> None:
        self.listener = listener
        self.count = count
        self.socket_path = socket_path
        self.live = live
        self.max_connections = max_connections
        self.max_connections_per_client = max_connections_per_client
        self.open = [0] * count
        """Forwarded connections open per worker."""
        self.per_client: dict[str, int] = {}
        """Connections open per client address."""
        self.loop = _new_loop()
        self._links: set[_Link] = set()
        self._thread = threading.Thread(target=self._run, name="grpc-front", daemon=True)
        self._started = threading.Event()

    def start(self) -> None:
        self._thread.start()
        self._started.wait(10)

    def stop(self) -> None:
        """Close every forwarded connection and the thread (not the listener: its owner's)."""
        if self._thread.is_alive():
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(5)

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        server = self.loop.run_until_complete(
            self.loop.create_server(self._accepted, sock=self.listener, backlog=2048)
        )
        self._started.set()
        try:
            self.loop.run_forever()
        finally:
            server.close()
            for link in list(self._links):
                link.lost()
            self.loop.run_until_complete(asyncio.sleep(0))  # the closes happen
            self.loop.close()

    def _accepted(self) -> _Side:
        link = _Link(self)
        self._links.add(link)
        return link.client  # whose connection_made calls _forward

    def _forward(self, link: _Link) -> None:
        client = link.client.transport
        if client is None or link.closed:
            return
        if sum(self.open) >= self.max_connections:
            link.lost()  # TG_MAX_CONNECTIONS, as grpcio closes one more
            return
        peer = client.get_extra_info("peername")
        if self.max_connections_per_client is not None and isinstance(peer, tuple) and peer:
            address = str(peer[0])
            if self.per_client.get(address, 0) >= self.max_connections_per_client:
                link.lost()  # TG_MAX_CONNECTIONS_PER_CLIENT
                return
            self.per_client[address] = self.per_client.get(address, 0) + 1
            link.address = address
        with contextlib.suppress(OSError):
            client.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.loop.create_task(self._connect(link)).add_done_callback(_log_failure)

    async def _connect(self, link: _Link) -> None:
        """Link the client to the least loaded live worker whose gRPC socket accepts it; to
        one whose control socket is slow to answer only when no live one accepts (a loop busy
        with a large message answers pings late, and is still better than a closed
        connection). None: the client is closed, and retries."""
        order = sorted(range(self.count), key=lambda i: (not self.live(i), self.open[i]))
        for index in order:
            upstream = _Side(link)
            link.worker = index
            self.open[index] += 1  # counted already: the next connection's choice sees it
            try:
                await self.loop.create_unix_connection(
                    lambda side=upstream: side,  # type: ignore[misc]  # the one made above
                    str(self.socket_path(index)),
                )
            except OSError:  # not listening (yet, or any more)
                self.open[index] -= 1
                link.worker = -1
                if link.closed:
                    return
                continue
            if link.closed:  # the client went meanwhile (lost() uncounted it)
                assert upstream.transport is not None
                upstream.transport.close()
                return
            link.upstream = upstream
            upstream.join(link.client)
            link.client.join(upstream)
            return
        link.lost()


def _log_failure(task: asyncio.Task[None]) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("gRPC front: forwarding a connection failed", exc_info=task.exception())


def _new_loop() -> asyncio.AbstractEventLoop:
    try:
        import uvloop
    except ImportError:  # the images have it (uvicorn[standard]); a bare install may not
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()
