"""Several server processes on one port (``TG_WORKERS``), one server to the outside.

One event loop parses, decodes and encodes every request of a process, and a small request's
cost is mostly that loop's (docs/performance.md): past one core, more requests/s need more
loops. ``tensorgate serve`` with ``TG_WORKERS=N > 1`` becomes a :class:`Supervisor` that starts
N copies of itself (workers), each a whole server with its own models, batcher and threads,
each accepting HTTP connections from one listening socket the supervisor binds and they
inherit (a worker takes a connection when its event loop gets to it, so a busy one takes fewer,
and no stranger can bind the port beside them): nothing sits between an HTTP client and the
worker that answers it. gRPC connections the supervisor accepts on its own socket and forwards
to a worker's unix socket (:class:`service.cluster.front.GrpcFront`: grpcio adopts no
inherited socket, and ``SO_REUSEPORT`` would let a stranger take the calls).
docs/architecture.md says why this design and not front processes feeding one model process.

What a client must see as one server, the worker it reaches gathers from the others over a
private control socket (:class:`ControlServer`, JSON lines on a unix socket in a folder only
this user may open): readiness and startup are true only when every worker's are; liveness is
false when any running worker's is; statistics and ``/metrics`` are the sums over workers;
a model load or unload happens in every worker before it is answered. ``--poll`` needs nothing:
each worker polls the repository itself.

The supervisor forwards SIGTERM to every worker (each drains as a single server does, so no
accepted request is lost), replaces a worker that dies (its in-flight requests fail with a
closed connection; the other workers serve on), and exits when they have. A worker exits when
its supervisor does, however the supervisor ended (``PR_SET_PDEATHSIG``): no orphans.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import orjson

from service.cluster.front import GrpcFront
from service.cluster.held import MESSAGE_COPIES
from service.limits.balance import create_balance_file, not_accepting
from service.resources import create_cpu_use_file

if TYPE_CHECKING:
    from service.settings import Settings

log = logging.getLogger("tensorgate.workers")


WORKER_ENV = "TENSORGATE_WORKER"
LISTEN_FD_ENV = "TENSORGATE_LISTEN_FD"
"""The HTTP listening socket a worker inherits from its supervisor (a descriptor number)."""
"""Set by the supervisor for each worker: ``<index>/<count>/<supervisor pid>/<replacement>/
<control folder>``. Not a ``TG_*`` setting: a user never sets it."""
KEY_FD_ENV = "TENSORGATE_CONTROL_KEY_FD"
"""The read end of a pipe that holds this server's control key (:func:`control_key`)."""
STARTUP_S = 60.0
"""A worker that exits with an error this soon after the server started, on its first start,
is a server that cannot start: the supervisor stops, rather than retry for ever."""
PING_S = 1.0
"""How often the supervisor asks each worker whether it is live (its control socket)."""
RESTART_BACKOFF_S = (1.0, 30.0)
"""A dead worker is started again after the first delay, doubled each time it dies within a
minute of starting, up to the second."""


def worker_python(env: dict[str, str]) -> list[str]:
    """The interpreter a worker runs in, importing the supervisor's own ``service``.

    ``python -m`` puts the current directory first on ``sys.path``, so workers started from a
    folder with a ``service`` package or module of its own (a user's project: a common name)
    imported that instead of tensorgate and failed, or ran whatever it held. ``-P`` (Python
    3.11) leaves the current directory out. Where the supervisor itself imported ``service``
    from there (``python -m service`` in a checkout), its folder is put on the workers'
    ``PYTHONPATH`` (in ``env``), so that they run the same code as the supervisor."""
    root = Path(__file__).resolve().parents[2]
    if Path(sys.path[0] or os.getcwd()).resolve() == root:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, (str(root), env.get("PYTHONPATH"))))
    return [sys.executable, "-P"]


@dataclass(frozen=True)
class Worker:
    """This process's place among the workers of one server."""

    index: int
    count: int
    supervisor_pid: int
    folder: Path
    replacement: bool = False
    """Started in place of one that died: it listens only once its models are ready, so that
    the kernel gives it no connection it would answer 503 while the others serve."""

    def socket_path(self, index: int) -> Path:
        return self.folder / f"worker-{index}.sock"

    @property
    def cpu_use_path(self) -> Path:
        """The workers' shared count of batches running (:class:`service.resources.CpuUse`)."""
        return self.folder / "cpu-use"

    @property
    def connections_path(self) -> Path:
        """The workers' shared counts of open connections (:mod:`service.limits.balance`)."""
        return self.folder / "connections"

    def grpc_socket_path(self, index: int) -> Path:
        """Where a worker's gRPC server listens, for the supervisor's :class:`GrpcFront`."""
        return self.folder / f"grpc-{index}.sock"

    @property
    def others(self) -> list[int]:
        return [i for i in range(self.count) if i != self.index]

    def encode(self) -> str:
        replacement = int(self.replacement)
        return f"{self.index}/{self.count}/{self.supervisor_pid}/{replacement}/{self.folder}"

    @classmethod
    def from_environment(cls) -> Worker | None:
        value = os.environ.get(WORKER_ENV)
        if not value:
            return None
        index, count, pid, replacement, folder = value.split("/", 4)
        return cls(int(index), int(count), int(pid), Path(folder), replacement == "1")


# -- the supervisor ---------------------------------------------------------------------------


class Supervisor:
    """Starts ``settings.workers`` workers running ``argv`` (this command line), keeps them
    running, forwards SIGTERM/SIGINT, and returns the exit status once they have all exited."""

    def __init__(self, settings: Settings, argv: Sequence[str]) -> None:
        self.settings = settings
        self.argv = list(argv)
        self.count = settings.workers
        self.processes: dict[int, subprocess.Popen[bytes]] = {}
        self.started_at: dict[int, float] = {}
        self.backoff: dict[int, float] = {}
        self.due: dict[int, float] = {}
        self.stopping = False
        self.folder = Path(tempfile.mkdtemp(prefix="tensorgate-workers-"))  # mode 0700
        self.key = secrets.token_hex(32)
        """What every question on the control socket must carry (:func:`control_key`)."""
        self.answered: dict[int, float] = {}
        """When each worker's control socket last answered (monotonic), since it started."""

    def run(self) -> int:
        # HTTP: one listening socket, the supervisor's, inherited by every worker. One accept
        # queue: a worker takes a connection when its loop gets to it, so a busy worker takes
        # fewer (SO_REUSEPORT hashed each connection to a worker whatever its load: 16
        # connections split 11/5 made the tail), and no other process can bind beside it.
        reserved = self._listen("HTTP", self.settings.port)
        if reserved is None:
            return 1
        self.listener = reserved
        # gRPC: grpcio takes no inherited socket, and SO_REUSEPORT would let a stranger take
        # the calls: the supervisor listens, and forwards each connection to a worker's unix
        # socket (service/cluster/front.py).
        front = None
        if self.settings.grpc_port:
            grpc_listener = self._listen("gRPC", self.settings.grpc_port)
            if grpc_listener is None:
                reserved.close()
                return 1
            grpc_listener.set_inheritable(False)
            front = GrpcFront(
                grpc_listener,
                self.count,
                Worker(0, self.count, os.getpid(), self.folder).grpc_socket_path,
                self._takes_calls,
                self.settings.max_connections,
                self.settings.max_connections_per_client,
                self.settings.max_inflight_bytes // MESSAGE_COPIES,  # each worker's
                self.settings.body_timeout_s,
                self.settings.write_timeout_s,
            )
        create_cpu_use_file(self.folder / "cpu-use", self.count)  # Worker.cpu_use_path
        create_balance_file(self.folder / "connections", self.count)  # Worker.connections_path
        port = reserved.getsockname()[1]
        signal.signal(signal.SIGTERM, self._forward)
        signal.signal(signal.SIGINT, self._forward)
        log.info(
            "serving on %s:%d with %d workers of %d threads each (TG_WORKERS, TG_CPUS %d)",
            self.settings.host,
            port,
            self.count,
            self.settings.intra_op_threads,
            self.settings.cpus,
        )
        pinging = threading.Thread(target=self._ping, name="ping-workers", daemon=True)
        try:
            for index in range(self.count):
                self._start(index, port)
            pinging.start()
            if front is not None:
                front.start()
            status = self._watch(port)
        finally:
            if front is not None:
                front.stop()
                front.listener.close()
            reserved.close()
            for process in self.processes.values():
                if process.poll() is None:
                    process.kill()
                    process.wait()
            shutil.rmtree(self.folder, ignore_errors=True)
        return status

    def _start(self, index: int, port: int, replacement: bool = False) -> None:
        worker = Worker(index, self.count, os.getpid(), self.folder, replacement)
        fd = self.listener.fileno()
        key, writing = os.pipe()  # the key in a pipe: never in the environment or on disk
        os.write(writing, self.key.encode())
        os.close(writing)
        env = {
            **os.environ,
            WORKER_ENV: worker.encode(),
            "TG_PORT": str(port),
            LISTEN_FD_ENV: str(fd),
            KEY_FD_ENV: str(key),
        }
        # A session of its own: a signal to the supervisor's process group (Ctrl-C, `kill` of a
        # `make run`) reaches the workers once, forwarded, instead of twice ("stop now").
        try:
            self.processes[index] = subprocess.Popen(
                [*worker_python(env), "-m", "service", *self.argv],
                env=env,
                start_new_session=True,
                pass_fds=(fd, key),
            )
        finally:
            os.close(key)
        self.answered.pop(index, None)  # judged only once it has answered
        self.started_at[index] = time.monotonic()
        log.info("worker %d started (pid %d)", index, self.processes[index].pid)

    def _watch(self, port: int) -> int:
        failed = False
        began = time.monotonic()
        while True:
            now = time.monotonic()
            for index, process in list(self.processes.items()):
                code = process.poll()
                if code is None:
                    continue
                not_accepting(self.folder / "connections", index)  # nobody waits for it
                if self.stopping:
                    failed |= code != 0
                    del self.processes[index]
                    continue
                del self.processes[index]
                if code > 0 and now - began < STARTUP_S and index not in self.backoff:
                    # A worker that cannot start (a port in use, a bad setting) will not start
                    # on a retry either: stop as one server would, with its status.
                    log.error("worker %d could not start (status %d): stopping", index, code)
                    self._forward(signal.SIGTERM, None)
                    failed = True
                    continue
                quick = now - self.started_at[index] < 60
                delay = min(self.backoff.get(index, 0) * 2, RESTART_BACKOFF_S[1]) if quick else 0
                self.backoff[index] = max(delay, RESTART_BACKOFF_S[0])
                self.due[index] = now + self.backoff[index]
                log.error(
                    "worker %d (pid %d) exited with status %s; starting it again in %.0f s",
                    index,
                    process.pid,
                    code,
                    self.backoff[index],
                )
            self._replace_wedged(now)
            for index, when in list(self.due.items()):
                if self.stopping:
                    del self.due[index]
                elif now >= when:
                    del self.due[index]
                    self._start(index, port, replacement=True)
            if self.stopping and not self.processes:
                return 1 if failed else 0
            time.sleep(0.1)  # a poll interval: children are few and rarely change

    def _ping(self) -> None:
        """Ask each worker ``live`` over its control socket, every :data:`PING_S`, and note
        when it answers (a thread: a wedged worker's silence must not hold the watch loop)."""
        question = orjson.dumps({"op": "live", "args": [], "key": self.key}) + b"\n"
        while not self.stopping:
            for index in list(self.processes):
                path = str(self.folder / f"worker-{index}.sock")
                try:
                    with socket.socket(socket.AF_UNIX) as sock:
                        sock.settimeout(PING_S)
                        sock.connect(path)
                        sock.sendall(question)
                        if sock.makefile("rb").readline():
                            self.answered[index] = time.monotonic()
                except OSError:
                    pass  # not listening yet, or not answering: its silence is measured
            time.sleep(PING_S)

    def _takes_calls(self, index: int) -> bool:
        """Whether a worker may be given a new gRPC connection: it runs, and its control socket
        answered within the last few pings (or never yet: a new worker's gRPC server listens
        before its control socket does)."""
        process = self.processes.get(index)
        answered = self.answered.get(index)
        return (
            process is not None
            and process.poll() is None
            and (answered is None or time.monotonic() - answered < 3 * PING_S + 1)
        )

    def _replace_wedged(self, now: float) -> None:
        """A worker that answered once and then not for ``TG_STUCK_INSTANCE_S`` (stopped, or
        its event loop blocked) is killed, and so replaced as a dead one is (#28 finding 11:
        a SIGSTOPped worker held the connections it took, and nobody noticed)."""
        limit = self.settings.stuck_instance_s
        if self.stopping:
            return
        for index, process in self.processes.items():
            answered = self.answered.get(index)
            if answered is None or now - answered < limit or process.poll() is not None:
                continue
            log.error(
                "worker %d (pid %d) has not answered for %.0f s (TG_STUCK_INSTANCE_S): killing "
                "it to start another",
                index,
                process.pid,
                now - answered,
            )
            self.answered.pop(index)
            process.kill()

    def _listen(self, kind: str, port: int) -> socket.socket | None:
        return listen(kind, self.settings.host, port)

    def _forward(self, sig: int, frame: object) -> None:
        """First SIGTERM: every worker drains. A second: every worker stops now."""
        self.stopping = True
        for process in self.processes.values():
            if process.poll() is None:
                process.send_signal(signal.SIGTERM if sig == signal.SIGTERM else sig)


CANNOT_LISTEN = "cannot listen on the %s port %s:%d (%s): stopping"
"""A port taken (or not ours to take): one line, where it was a traceback."""


def listen(kind: str, host: str, port: int, inheritable: bool = True) -> socket.socket | None:
    """:func:`listening_socket`, or None once why it cannot be is logged in one line."""
    try:
        return listening_socket(host, port, inheritable)
    except OSError as exc:
        log.error(CANNOT_LISTEN, kind, host, port, exc.strerror)
        return None


def listening_socket(host: str, port: int, inheritable: bool = True) -> socket.socket:
    """A listening socket on ``host:port``: the supervisor's, for its workers to inherit, or a
    lone worker's. Bound without ``SO_REUSEPORT`` (no other process takes a share of the
    connections), and for ``::`` dual-stack, IPv4 too, as grpcio's are (asyncio, and so
    uvicorn, would bind it IPv6 only)."""
    address: tuple[object, ...]
    if host in ("", "0.0.0.0"):  # every IPv4 address (getaddrinfo knows no "")
        family, kind, proto, address = socket.AF_INET, socket.SOCK_STREAM, 0, ("", port)
    else:  # a scoped IPv6 address keeps its scope; a name, its IPv4 address before its IPv6
        found = socket.getaddrinfo(
            host, port, socket.AF_UNSPEC, socket.SOCK_STREAM, 0, socket.AI_PASSIVE
        )
        found.sort(key=lambda info: info[0] != socket.AF_INET)
        family, kind, proto, _, address = found[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6 and host == "::":
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        sock.bind(address)
        sock.listen(2048)
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(inheritable)
    return sock


@functools.cache
def control_key() -> str:
    """This worker's server's control key, which every question on the control socket carries:
    read once from the pipe its supervisor handed it. The socket's folder is this user's alone,
    but any process of this user could connect and load or unload one worker; the environment
    and the disk are readable by them too (``/proc/<pid>/environ``), a drained pipe is not."""
    fd = os.environ.pop(KEY_FD_ENV, None)
    if fd is None:
        raise RuntimeError(f"{KEY_FD_ENV} is not set: a worker is started by its supervisor")
    with os.fdopen(int(fd), "rb") as pipe:
        return pipe.read().decode()


def inherited_listener() -> socket.socket:
    """The listening socket this worker inherited from its supervisor."""
    return socket.socket(fileno=int(os.environ[LISTEN_FD_ENV]))


def die_with_supervisor(worker: Worker) -> None:
    """Ask the kernel for SIGTERM when the supervisor ends, however it ends (Linux)."""
    libc = ctypes.CDLL(None, use_errno=True)
    pr_set_pdeathsig = 1
    libc.prctl(pr_set_pdeathsig, signal.SIGTERM)
    if os.getppid() != worker.supervisor_pid:  # it ended before the request was made
        os.kill(os.getpid(), signal.SIGTERM)


# -- the control socket -----------------------------------------------------------------------
