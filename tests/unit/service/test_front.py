"""The supervisor's gRPC front (service/cluster/front.py, issue #28 finding 12) on real
sockets: a TCP listener on 127.0.0.1, and unix-socket servers standing for the workers' grpcio
servers (an echo that answers what it reads)."""

from __future__ import annotations

import contextlib
import hashlib
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from service.cluster.front import GrpcFront
from service.cluster.held import DATA, HEADERS, PREFACE

pytestmark = pytest.mark.unit


class Echo:
    """A worker: a unix socket whose every connection gets back what it sends, and a FIN once
    it has sent one."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX)
        self.sock.bind(str(path))
        self.sock.listen(64)
        self.connections: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.connections.append(conn)
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            try:
                while data := conn.recv(1 << 16):
                    conn.sendall(data)
                conn.shutdown(socket.SHUT_WR)
            except OSError:
                pass

    def close(self) -> None:
        """As a killed process's sockets close: the listener (its file stays, refusing) and
        every connection (a reset)."""
        for sock in (self.sock, *self.connections):
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)  # wakes the thread blocked on it
            sock.close()


class Sink(Echo):
    """A worker that takes in everything and answers nothing: what reached it is counted."""

    def __init__(self, path: Path) -> None:
        self.received = 0
        self._grew = threading.Condition()
        super().__init__(path)

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            try:
                while data := conn.recv(1 << 16):
                    with self._grew:
                        self.received += len(data)
                        self._grew.notify_all()
            except OSError:
                pass

    def reached(self, count: int, timeout: float = 10) -> bool:
        """Whether ``count`` bytes reached this worker within ``timeout`` seconds."""
        with self._grew:
            return self._grew.wait_for(lambda: self.received >= count, timeout)


Front = tuple[GrpcFront, list[Echo], set[int]]
"""The front, its two workers, and the indexes it must take for down."""


@contextlib.contextmanager
def serving(tmp_path: Path, kind: type[Echo] = Echo, **caps: int) -> Iterator[Front]:
    workers = [kind(tmp_path / f"grpc-{i}.sock") for i in range(2)]
    down: set[int] = set()
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(64)
    served = GrpcFront(
        listener, 2, lambda i: tmp_path / f"grpc-{i}.sock", lambda i: i not in down, **caps
    )
    served.start()
    try:
        yield served, workers, down
    finally:
        served.stop()
        listener.close()
        for worker in workers:
            worker.close()


@pytest.fixture
def front(tmp_path: Path) -> Iterator[Front]:
    with serving(tmp_path, max_connections=6) as served:
        yield served


def frame(kind: int, payload: bytes, stream: int = 1, flags: int = 0) -> bytes:
    """An HTTP/2 frame (RFC 9113 4.1)."""
    return (
        len(payload).to_bytes(3, "big") + bytes((kind, flags)) + stream.to_bytes(4, "big") + payload
    )


def message_start(size: int, sent: int) -> bytes:
    """A gRPC client's first bytes: the preface, a stream's HEADERS (the front reads no HPACK),
    and the first ``sent`` bytes of a ``size`` byte message in DATA frames of 16 KiB."""
    body = b"\0" + size.to_bytes(4, "big") + bytes(sent)
    data = b"".join(frame(DATA, body[i : i + (16 << 10)]) for i in range(0, len(body), 16 << 10))
    return PREFACE + frame(HEADERS, b"\x82", flags=0x4) + data


def connect(front: GrpcFront, source: str = "127.0.0.1") -> socket.socket:
    """A client connection from ``source`` (any 127.x.y.z is this host's loopback)."""
    return socket.create_connection(front.listener.getsockname(), 10, (source, 0))


def received(sock: socket.socket) -> bytes:
    """Everything ``sock`` reads until the other side's FIN."""
    chunks = []
    while data := sock.recv(1 << 16):
        chunks.append(data)
    return b"".join(chunks)


def test_bytes_go_to_a_worker_and_back_whole_and_the_fin_follows(front: Front) -> None:
    served, _, _ = front
    payload = bytes(range(256)) * (40 * 1024)  # 10 MiB: many chunks, both ways at once
    with connect(served) as client:
        sender = threading.Thread(
            target=lambda: (client.sendall(payload), client.shutdown(socket.SHUT_WR))
        )
        sender.start()
        echoed = received(client)  # ends at the worker's FIN, forwarded
        sender.join()
    assert hashlib.sha256(echoed).digest() == hashlib.sha256(payload).digest()


def test_connections_go_to_the_worker_with_fewest_and_to_one_down_only_when_all_are(
    front: Front,
) -> None:
    served, workers, down = front
    clients = [connect(served) for _ in range(4)]
    for client in clients:
        client.sendall(b"ping")
        assert client.recv(4) == b"ping"
    assert [len(w.connections) for w in workers] == [2, 2]
    down.add(0)  # a wedged worker: its control socket has not answered
    more = [connect(served) for _ in range(2)]
    for client in more:
        client.sendall(b"ping")
        assert client.recv(4) == b"ping"
    assert [len(w.connections) for w in workers] == [2, 4]
    more.pop().close()  # under the cap of 6 again, once the front has seen it
    deadline = time.monotonic() + 10
    while sum(served.open) > 5 and time.monotonic() < deadline:
        time.sleep(0.01)
    down.add(1)  # both slow to answer their pings: the least loaded still takes it
    with connect(served) as last:
        last.sendall(b"ping")
        assert last.recv(4) == b"ping"
    assert [len(w.connections) for w in workers] == [3, 4]
    for client in clients + more:
        client.close()


def test_a_worker_that_dies_closes_its_clients_and_the_next_go_to_the_other(front: Front) -> None:
    served, workers, _ = front
    first, second = connect(served), connect(served)
    for client in (first, second):
        client.sendall(b"ping")
        assert client.recv(4) == b"ping"
    dead = next(i for i, w in enumerate(workers) if w.connections)
    workers[dead].close()  # its socket and connections: a killed process
    closed = 0
    for client in (first, second):
        try:
            client.sendall(b"x")
            closed += client.recv(1) == b""
        except OSError:
            closed += 1
    assert closed == 1  # the one the dead worker had; the other still echoes
    with connect(served) as client:
        client.sendall(b"ping")
        assert client.recv(4) == b"ping"
    assert served.open[dead] == 0
    first.close()
    second.close()


def test_past_the_connection_cap_a_connection_is_closed_unread(front: Front) -> None:
    served, _, _ = front
    clients = [connect(served) for _ in range(6)]
    for client in clients:
        client.sendall(b"ping")
        assert client.recv(4) == b"ping"
    with connect(served) as extra:
        assert extra.recv(4) == b""  # closed by the front, no worker connected
    for client in clients:
        client.close()


def test_with_no_worker_listening_a_connection_is_closed(front: Front) -> None:
    served, workers, _ = front
    for worker in workers:
        worker.close()
    with connect(served) as client:
        assert client.recv(1) == b""


def test_one_client_address_gets_at_most_its_share_of_the_connections(tmp_path: Path) -> None:
    with serving(tmp_path, max_connections=6, max_connections_per_client=2) as (served, _, _):
        mine = [connect(served) for _ in range(2)]
        for client in mine:
            client.sendall(b"ping")
            assert client.recv(4) == b"ping"
        with connect(served) as third:
            assert third.recv(4) == b""  # closed unread: this address has its 2
        with connect(served, "127.0.0.2") as other:  # another client is served meanwhile
            other.sendall(b"ping")
            assert other.recv(4) == b"ping"
        mine.pop().close()
        deadline = time.monotonic() + 10
        while served.per_client.get("127.0.0.1") != 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        with connect(served) as again:  # one closed: one more may open
            again.sendall(b"ping")
            assert again.recv(4) == b"ping"
        mine.pop().close()


def test_a_client_that_takes_nothing_written_to_it_is_closed_after_the_write_timeout(
    tmp_path: Path,
) -> None:
    """A client that sends and never reads what comes back: its answers would wait in the
    worker (and what it sent stay counted) for good. Past the write timeout it is closed."""
    with serving(tmp_path, max_connections=6, write_timeout_s=1.0) as (served, _, _):
        failed = threading.Event()

        def send() -> None:
            try:
                client.sendall(bytes(64 << 20))  # echoed back, never read
            except OSError:
                failed.set()

        with connect(served) as client:
            sender = threading.Thread(target=send, daemon=True)
            sender.start()
            assert failed.wait(30)  # closed: not blocked for good
        deadline = time.monotonic() + 10
        while sum(served.open) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert sum(served.open) == 0


def test_a_workers_bound_holds_back_its_own_clients_not_anothers(tmp_path: Path) -> None:
    """What the front lets the workers hold is bounded worker by worker. Bounded over all
    connections together, a client stalled half-way through a large message to one worker held
    back every large call to the other (the oldest message arriving, the only one read on, was
    the stalled one)."""
    mib = 1 << 20
    with serving(tmp_path, Sink, max_connections=6, max_held_bytes=mib) as (served, sinks, _):
        first, second = sinks
        assert isinstance(first, Sink) and isinstance(second, Sink)
        stalled = connect(served)  # worker 0: 2 MiB of a 4 MiB message, then nothing
        start = message_start(4 * mib, 2 * mib)
        stalled.sendall(start)
        assert first.reached(len(start))  # its worker's oldest message arriving: read on
        assert served.held[0] >= mib  # past worker 0's bound, and held there
        whole = message_start(3 * mib, 3 * mib)
        with connect(served) as other:  # worker 1: a whole message of 3 MiB
            other.sendall(whole)
            assert second.reached(len(whole))
            assert second.received == len(whole)
        stalled.close()
