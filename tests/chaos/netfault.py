"""A faulty network between a client and the server: a TCP proxy on 127.0.0.1.

The kernel here has no netem, and a network namespace needs privileges a CI runner may lack;
a proxy in the test process gives every fault a test needs, on loopback only: slow links
(bytes per second, each way), latency per chunk, connections reset after a given number of
bytes in either direction (the client cut mid-request, or mid-answer), and half-closes passed
on as they come. Every connection's threads end with it; :meth:`FaultyProxy.close` ends them
all.
"""

from __future__ import annotations

import contextlib
import socket
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

CHUNK = 4096


@dataclass
class Faults:
    """What the proxy does to one connection."""

    rate: float | None = None
    """Bytes per second each way (None: as fast as loopback)."""
    latency_s: float = 0.0
    """Added before each chunk is passed on."""
    cut_up_after: int | None = None
    """Reset both sides once this many client bytes have passed (a client cut mid-request)."""
    cut_down_after: int | None = None
    """Reset both sides once this many server bytes have passed (cut mid-answer)."""
    stall_up_after: int | None = None
    """Pass no more client bytes once this many have passed, the connection left open (a
    client stalled mid-message)."""
    stall_down_once_up: int | None = None
    """Pass no more server bytes once this many client bytes have passed, the connection left
    open: a client that sent its requests and stopped taking its answers (stalled before, it
    would take no more flow-control window either, and send nothing more)."""


def _reset(sock: socket.socket) -> None:
    """Close with an RST, as a client that crashed or a link that died."""
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    with contextlib.suppress(OSError):
        sock.close()


class FaultyProxy:
    """Listens on 127.0.0.1 (``.port``) and forwards each connection to ``target`` with the
    faults ``policy(index)`` gives its ``index``-th connection."""

    def __init__(self, target: int, policy: Callable[[int], Faults]) -> None:
        self.target = target
        self.policy = policy
        self.connections = 0
        self.cuts = 0
        self.passed_up = 0
        """Client bytes passed on to the server, over every connection."""
        self.stopped_down = 0
        """Connections that stopped passing server bytes (``stall_down_once_up``)."""
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.settimeout(0.2)
        self.port = self._listener.getsockname()[1]
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._open: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._accepting = threading.Thread(target=self._accept, daemon=True)
        self._accepting.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def close(self) -> None:
        self._stop.set()
        self._accepting.join(5)
        self._listener.close()
        with self._lock:
            for sock in list(self._open):
                with contextlib.suppress(OSError):
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                    sock.shutdown(socket.SHUT_RDWR)  # wakes a pump blocked in recv or sendall
                _reset(sock)
        for thread in self._threads:
            thread.join(5)

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                client, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            faults = self.policy(self.connections)
            self.connections += 1
            try:
                server = socket.create_connection(("127.0.0.1", self.target), timeout=10)
            except OSError:
                _reset(client)
                continue
            for sock in (client, server):
                sock.settimeout(None)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with self._lock:
                self._open.update((client, server))
            pair = _Pair(self, client, server)
            for args in (
                (client, server, faults.cut_up_after, faults.stall_up_after),
                (server, client, faults.cut_down_after, None),
            ):
                thread = threading.Thread(target=pair.pump, args=(*args, faults), daemon=True)
                thread.start()
                self._threads.append(thread)


class _Pair:
    """One proxied connection: two pumps, one each way. A cut wakes both (a thread blocked in
    ``recv`` keeps a closed socket open: no RST would go out), and the last pump to end
    closes both sockets, with an RST after a cut."""

    def __init__(self, proxy: FaultyProxy, client: socket.socket, server: socket.socket) -> None:
        self.proxy, self.client, self.server = proxy, client, server
        self.cut = False
        self.up = 0
        """Client bytes passed on, on this connection."""
        self._done = 0
        self._lock = threading.Lock()

    def pump(
        self,
        source: socket.socket,
        sink: socket.socket,
        cut_after: int | None,
        stall_after: int | None,
        faults: Faults,
    ) -> None:
        passed = 0
        try:
            while not self.proxy._stop.is_set() and not self.cut:
                data = source.recv(CHUNK)
                if self.cut:
                    break
                if not data:  # a half-close: pass it on, the other way goes on
                    sink.shutdown(socket.SHUT_WR)
                    break
                if cut_after is not None and passed + len(data) >= cut_after:
                    sink.sendall(data[: max(0, cut_after - passed)])
                    self.proxy.cuts += 1
                    self._cut()
                    break
                if stall_after is not None and passed + len(data) >= stall_after:
                    self._pass(sink, data[: max(0, stall_after - passed)], source)
                    while not self.cut and not self.proxy._stop.wait(0.05):
                        pass  # held open, passing nothing, until closed or cut
                    break
                stop_at = faults.stall_down_once_up if source is self.server else None
                if stop_at is not None and self.up >= stop_at:
                    with self.proxy._lock:
                        self.proxy.stopped_down += 1
                    while not self.cut and not self.proxy._stop.wait(0.05):
                        pass  # held open, passing nothing more, until closed or cut
                    break
                if faults.latency_s:
                    time.sleep(faults.latency_s)
                if faults.rate:
                    time.sleep(len(data) / faults.rate)
                self._pass(sink, data, source)
                passed += len(data)
        except OSError:
            self._cut()
        self._end()

    def _pass(self, sink: socket.socket, data: bytes, source: socket.socket) -> None:
        sink.sendall(data)
        if source is self.client:
            self.up += len(data)
            with self.proxy._lock:
                self.proxy.passed_up += len(data)

    def _cut(self) -> None:
        self.cut = True
        for sock in (self.client, self.server):
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RD)  # wakes the other pump's recv

    def _end(self) -> None:
        with self._lock:
            self._done += 1
            both = self._done == 2
        if both:
            with self.proxy._lock:
                for sock in (self.client, self.server):
                    self.proxy._open.discard(sock)
                    with contextlib.suppress(OSError):
                        sock.close()  # an RST after a cut (SO_LINGER 0), else a FIN
