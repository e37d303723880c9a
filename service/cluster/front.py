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
- **What it lets the workers hold**: grpcio takes in every message whole before a handler
  sees it, so the front counts what each connection's client sent that its worker has not
  answered (:class:`service.cluster.held.Held`). While a worker's connections hold more than
  ``max_held_bytes`` (its ``TG_MAX_INFLIGHT_BYTES`` over
  :data:`~service.cluster.held.MESSAGE_COPIES`, as a message whole in the worker counts that
  many times its size in its budget), the front stops reading each of them that holds
  :data:`LIGHT` or more, but the one with the oldest message arriving
  (:attr:`GrpcFront.finishing`), until answers let enough go: a client stalled short of its
  messages' ends holds the budget, not the memory, small calls on other connections go on,
  one large message can always arrive whole in each worker, and a client stalled on one
  worker holds back no other worker's calls (bounded over all connections together, the one
  read on was the stalled one, and every large call to the other worker waited). A client's
  calls on one connection interleave frame by frame, so the connection read on is read until
  all of them are whole, not only its oldest: that is past the bound (docs/deploy.md,
  "Limits and timeouts"). The sweep (:meth:`GrpcFront._sweep`) closes the clients that stall a
  message or take no answers past their timeouts.
- **Connections**: at most ``max_connections`` forwarded, and ``max_connections_per_client``
  from one client address (grpcio has no per-address cap, so a single process has only the
  global one; here one client's 4,096 idle channels would lock every other client out). One
  past either is closed unread.
- **What it costs**: one thread, two sockets and a copy a direction, and reading each frame
  header and message prefix (about 12 µs of Python a small call, both ways); everything else
  gRPC checks (message sizes, streams, handshake timeout) is checked by the worker's grpcio
  as before. ``python -m bench.front`` measures it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import cast

from service.cluster.held import MESSAGE_COPIES, Held

log = logging.getLogger("tensorgate.workers")

CHUNK = 64 * 1024
"""The most read from one side at a time, and the most left unsent to it before the other side
stops being read."""
LIGHT = 2 * CHUNK
"""A connection holding less unanswered bytes than this is read on when the front holds its
most: the small calls of other clients go on while large ones wait."""
SWEEP_S = 0.5
"""How often the connections not read are looked at for a client that has gone."""
TCP_ESTABLISHED = 1
"""``tcpi_state`` of a connection both ends still hold open (linux/tcp_states.h)."""
THROTTLE_LOG_S = 10.0
"""The least time between two log lines saying that the front stopped reading connections."""


class _Side(asyncio.BufferedProtocol):
    """One side of a forwarded connection (the client's or the worker's): what it reads is
    written to its peer."""

    def __init__(self, link: _Link) -> None:
        self.link = link
        self.peer: _Side | None = None
        self.transport: asyncio.Transport | None = None
        self.buffer = bytearray(CHUNK)
        self.eof = False
        self.behind = False
        """Its peer has more unsent than :data:`CHUNK`: not read until it has sent it."""
        self.full_since: float | None = None
        """Since when more than :data:`CHUNK` waits to be written to this side (monotonic)."""
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
        data = memoryview(self.buffer)[:nbytes]
        self.peer.transport.write(bytes(data))  # one copy
        self.link.passed(self, data)

    def join(self, peer: _Side) -> None:
        """Forward to ``peer`` from now on, what was read before it first."""
        self.peer = peer
        assert self.transport is not None and peer.transport is not None
        if self.early:
            peer.transport.write(self.early)
            self.link.passed(self, memoryview(self.early))
            self.early = b""
        self.read_or_not()

    def read_or_not(self) -> None:
        """Read while the peer keeps up and (the client's side) the front is not holding
        this connection back."""
        transport = self.transport
        if transport is None or transport.is_closing() or self.peer is None:
            return
        if self.behind or (self is self.link.client and self.link.throttled):
            transport.pause_reading()
        else:
            transport.resume_reading()

    def eof_received(self) -> bool:
        self.eof = True
        peer = self.peer
        if peer is None or peer.eof or peer.transport is None or not peer.transport.can_write_eof():
            self.link.lost()  # both sides have said all they will (or there is nobody to tell)
            return False
        peer.transport.write_eof()  # a half-close, forwarded; the other direction goes on
        return True

    def pause_writing(self) -> None:  # this side is behind: stop reading what feeds it
        self.full_since = time.monotonic()
        if self.peer is not None:
            self.peer.behind = True
            self.peer.read_or_not()

    def resume_writing(self) -> None:
        self.full_since = None
        if self.peer is not None:
            self.peer.behind = False
            self.peer.read_or_not()

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
        self.held = Held()
        self.throttled = False
        """Not read because the front holds its most (``front.throttled``)."""
        self.read_since = 0.0
        """When it was last let read again after being held back (monotonic)."""
        self.gone = False
        """Its client has closed: read to its end, never held back again."""

    def passed(self, side: _Side, data: memoryview) -> None:
        """``data`` went from ``side`` to its peer: counted, or let go if it is an answer (or
        the client reset a stream). The front's sum follows the count whatever happens."""
        held = self.held
        before = held.total
        try:
            if side is self.client:
                held.sent(data)
            else:
                held.answered(data)
        except Exception:  # a bug here must not cost the connection: it is counted no more
            log.error("gRPC front: reading a connection's frames failed", exc_info=True)
            held.stop()
        more = held.total - before
        if more < 0:
            self.front.letting_go(self.worker, -more)
        elif side is self.client:
            self.front.holding(self, more)

    def lost(self) -> None:
        """Either side closed (or failed): close the other, once."""
        if self.closed:
            return
        self.closed = True
        self.front._links.discard(self)
        self.front.throttled.discard(self)
        freed = self.held.stop()  # nothing is counted before a worker is linked
        if self.worker >= 0:
            if self.front.finishing[self.worker] is self:
                self.front.finishing[self.worker] = None
            self.front.letting_go(self.worker, freed)
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
        max_held_bytes: int | None = None,
        body_timeout_s: float = 60.0,
        write_timeout_s: float = 60.0,
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
        self.max_held_bytes = max_held_bytes
        """The most each worker's connections may hold before those holding much are held
        back (None: no bound)."""
        self.held = [0] * count
        """Client bytes forwarded to each worker and not yet answered."""
        self.throttled: set[_Link] = set()
        self.finishing: list[_Link | None] = [None] * count
        """Each worker's connection with the oldest message arriving, read on while others
        are held back, so that one message at least can always arrive whole and be answered."""
        self.body_timeout_s = body_timeout_s
        self.write_timeout_s = write_timeout_s
        self._logged = -THROTTLE_LOG_S
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
        self.loop.call_later(SWEEP_S, self._sweep)
        try:
            self.loop.run_forever()
        finally:
            server.close()
            for link in list(self._links):
                link.lost()
            self.loop.run_until_complete(asyncio.sleep(0))  # the closes happen
            self.loop.close()

    def holding(self, link: _Link, more: int) -> None:
        """``link``'s client sent ``more`` bytes its worker has not answered; past the
        worker's bound, ``link`` is read no more until answers let enough go, unless it holds
        little."""
        worker = link.worker
        self.held[worker] += more
        if (
            self.max_held_bytes is None
            or self.held[worker] < self.max_held_bytes
            or link.held.total < LIGHT
            or link.throttled
            or link.gone
            or link is self.finishing[worker]
        ):
            return
        link.throttled = True
        self.throttled.add(link)
        link.client.read_or_not()
        now = self.loop.time()
        if now - self._logged >= THROTTLE_LOG_S:
            self._logged = now
            log.warning(
                "gRPC front: %d MiB of messages not yet answered by worker %d (%d MiB at most: "
                "its TG_MAX_INFLIGHT_BYTES over %d): %d connection(s) holding the most are not "
                "read until their answers come",
                self.held[worker] >> 20,
                worker,
                self.max_held_bytes >> 20,
                MESSAGE_COPIES,
                len(self.throttled),
            )

    def letting_go(self, worker: int, freed: int) -> None:
        """``freed`` bytes ``worker`` was sent were answered (or their connection closed):
        under its bound again, every connection to it held back is read again."""
        if not freed:
            return
        self.held[worker] -= freed
        if not self.throttled:
            return
        if self.max_held_bytes is not None and self.held[worker] >= self.max_held_bytes:
            return
        links = [link for link in self.throttled if link.worker == worker]
        self.throttled.difference_update(links)
        now = time.monotonic()
        for link in links:
            link.throttled = False
            link.read_since = now
            link.client.read_or_not()

    def _sweep(self) -> None:
        """Every :data:`SWEEP_S`, over every connection:

        - One whose client has not taken what was written to it for ``write_timeout_s`` is
          closed (its answers wait in grpcio, and what it sent stays counted): as REST's.
        - One read while it holds :data:`LIGHT` or more with a message that has not arrived in
          full within ``body_timeout_s`` (from the message's first byte, or from when it was
          last let read again) is closed: its client stalled it. A ModelInfer's worker ends
          such a call too; a stream's message has no other limit. One held back is not
          closed for it: the front, not its client, holds it back.
        - While a worker's connections are held back: the one with the oldest message
          arriving is read on (:attr:`finishing`), and each whose client has closed (its TCP
          state is no longer established) is read to its end, so that the close is seen and
          what it held let go.
        """
        try:
            self._sweep_once()
        finally:
            self.loop.call_later(SWEEP_S, self._sweep)

    def _sweep_once(self) -> None:
        now = time.monotonic()
        oldest: dict[int, tuple[float, _Link]] = {}
        for link in list(self._links):
            full = link.client.full_since
            if full is not None and now - full > self.write_timeout_s:
                self._close(
                    link,
                    f"did not take its answers within {self.write_timeout_s:g} s "
                    "(TG_WRITE_TIMEOUT_S)",
                )
                continue
            if link.held.total < LIGHT:
                continue
            since = link.held.arriving_since()
            if since is None:
                continue
            if not link.throttled and now - max(since, link.read_since) > self.body_timeout_s:
                self._close(
                    link,
                    f"a message did not arrive in full within "
                    f"{self.body_timeout_s:g} s (TG_BODY_TIMEOUT_S)",
                )
                continue
            if link.worker >= 0 and (link.worker not in oldest or since < oldest[link.worker][0]):
                oldest[link.worker] = (since, link)
        held_back = {link.worker for link in self.throttled}
        for worker in range(self.count):
            first = oldest.get(worker)
            self.finishing[worker] = first[1] if first is not None and worker in held_back else None
        for link in list(self.throttled):
            finishing = link is self.finishing[link.worker]
            if finishing or not _established(link.client.transport):
                link.gone = not finishing
                self.throttled.discard(link)
                link.throttled = False
                link.read_since = now
                link.client.read_or_not()

    def _close(self, link: _Link, why: str) -> None:
        log.warning(
            "gRPC front: closed a connection from %s holding %d MiB: it %s",
            link.address or "?",
            link.held.total >> 20,
            why,
        )
        link.lost()

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


def _established(transport: asyncio.Transport | None) -> bool:
    if transport is None or transport.is_closing():
        return False
    try:
        info = transport.get_extra_info("socket").getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 1)
    except OSError:
        return False
    return bool(info[0] == TCP_ESTABLISHED)


def _log_failure(task: asyncio.Task[None]) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("gRPC front: forwarding a connection failed", exc_info=task.exception())


def _new_loop() -> asyncio.AbstractEventLoop:
    try:
        import uvloop
    except ImportError:  # the images have it (uvicorn[standard]); a bare install may not
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()
