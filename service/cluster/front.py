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
- **What it costs**: one thread, two sockets and a copy a direction; everything gRPC checks
  (message sizes, streams, handshake timeout, connection cap) is checked by the worker's grpcio
  as before. ``python -m bench.grpc`` measures it.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import selectors
import socket
import threading
from collections.abc import Callable
from pathlib import Path

log = logging.getLogger("tensorgate.workers")

CHUNK = 64 * 1024
"""The most read from one side of a connection before it has been written to the other."""


class _End:
    """One side of a forwarded connection: the client's or the worker's socket, and what was
    read from the other side and not yet written to this one."""

    __slots__ = ("eof", "owed", "peer", "registered", "sock", "worker")

    def __init__(self, sock: socket.socket, worker: int) -> None:
        self.sock = sock
        self.worker = worker
        self.peer: _End = self
        self.owed = memoryview(b"")
        self.eof = False  # this side has sent everything it will (a read returned b"")
        self.registered = 0


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
    ) -> None:
        self.listener = listener
        self.count = count
        self.socket_path = socket_path
        self.live = live
        self.max_connections = max_connections
        self.open = [0] * count
        """Forwarded connections open per worker."""
        self.selector = selectors.DefaultSelector()
        self._wake_read, self._wake_write = socket.socketpair()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="grpc-front", daemon=True)

    def start(self) -> None:
        self.listener.setblocking(False)
        self.selector.register(self.listener, selectors.EVENT_READ, None)
        self.selector.register(self._wake_read, selectors.EVENT_READ, None)
        self._thread.start()

    def stop(self) -> None:
        """Close every forwarded connection and the thread (not the listener: its owner's)."""
        self._stopping = True
        with contextlib.suppress(OSError):
            self._wake_write.send(b"x")
        self._thread.join(5)

    # -- the loop ------------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while not self._stopping:
                for key, events in self.selector.select():
                    if key.fileobj is self.listener:
                        self._accept()
                    elif isinstance(key.data, _End):
                        self._serve(key.data, events)
        finally:
            for key in list(self.selector.get_map().values()):
                if isinstance(key.data, _End):
                    self._close(key.data)
            self.selector.close()
            self._wake_read.close()
            self._wake_write.close()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # EMFILE and the like: the next connection may fit
                log.warning("gRPC front: accept failed: %s", exc)
                return
            if sum(self.open) >= self.max_connections:
                client.close()  # TG_MAX_CONNECTIONS, as grpcio closes one more
                continue
            worker = self._connect()
            if worker is None:
                client.close()  # no worker serves gRPC now: the client retries
                continue
            index, upstream = worker
            client.setblocking(False)
            client.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            near, far = _End(client, index), _End(upstream, index)
            near.peer, far.peer = far, near
            self.open[index] += 1
            self._update(near)
            self._update(far)

    def _connect(self) -> tuple[int, socket.socket] | None:
        """A connection to the least loaded live worker whose gRPC socket accepts it; to one
        whose control socket is slow to answer only when no live one accepts (a loop busy with
        a large message answers pings late, and is still better than a closed connection)."""
        for index in sorted(range(self.count), key=lambda i: (not self.live(i), self.open[i])):
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.setblocking(False)
            try:
                sock.connect(str(self.socket_path(index)))
            except OSError:  # not listening (yet, or any more), or its backlog full
                sock.close()
                continue
            return index, sock
        return None

    def _serve(self, end: _End, events: int) -> None:
        if end.sock.fileno() == -1:
            return  # closed with its peer earlier in this round of events
        try:
            if events & selectors.EVENT_WRITE and end.owed:
                sent = end.sock.send(end.owed)
                end.owed = end.owed[sent:]
                if not end.owed and end.peer.eof:
                    end.sock.shutdown(socket.SHUT_WR)
            if events & selectors.EVENT_READ and not end.peer.owed and not end.eof:
                data = end.sock.recv(CHUNK)
                if not data:
                    end.eof = True
                    if not end.peer.owed:
                        end.peer.sock.shutdown(socket.SHUT_WR)
                else:
                    try:
                        sent = end.peer.sock.send(data)
                    except BlockingIOError:
                        sent = 0
                    end.peer.owed = memoryview(data)[sent:]
        except (BlockingIOError, InterruptedError):
            pass
        except OSError as exc:
            if exc.errno not in (errno.ECONNRESET, errno.EPIPE, errno.ENOTCONN):
                log.warning("gRPC front: connection failed: %s", exc)
            self._close(end)
            return
        if end.eof and end.peer.eof and not end.owed and not end.peer.owed:
            self._close(end)  # both sides said all they had, and all of it arrived
            return
        self._update(end)
        self._update(end.peer)

    def _update(self, end: _End) -> None:
        """Wait on what this side can do next: write what it is owed; read when its peer is
        owed nothing (one chunk a direction at most) and it has not ended."""
        wanted = (selectors.EVENT_WRITE if end.owed else 0) | (
            selectors.EVENT_READ if not end.peer.owed and not end.eof else 0
        )
        if wanted == end.registered:
            return
        if not wanted:
            self.selector.unregister(end.sock)
        elif not end.registered:
            self.selector.register(end.sock, wanted, end)
        else:
            self.selector.modify(end.sock, wanted, end)
        end.registered = wanted

    def _close(self, end: _End) -> None:
        if end.worker >= 0:
            self.open[end.worker] -= 1
            end.worker = end.peer.worker = -1  # counted once
        for side in (end, end.peer):
            if side.registered:
                self.selector.unregister(side.sock)
                side.registered = 0
            if side.sock.fileno() != -1:
                side.sock.close()
