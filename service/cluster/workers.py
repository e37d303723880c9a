"""Several server processes on one port (``TG_WORKERS``), one server to the outside.

One event loop parses, decodes and encodes every request of a process, and a small request's
cost is mostly that loop's (docs/performance.md): past one core, more requests/s need more
loops. ``tensorgate serve`` with ``TG_WORKERS=N > 1`` becomes a :class:`Supervisor` that starts
N copies of itself (workers), each a whole server with its own models, batcher and threads
(``TG_CPUS / N`` of them), each listening on the same HTTP and gRPC ports with
``SO_REUSEPORT``: the kernel spreads connections over the workers, and nothing sits between a
client and the worker that answers it. docs/architecture.md says why this design and not front
processes feeding one model process.

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

import asyncio
import ctypes
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import orjson
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

from service.errors import TensorgateError
from service.repository import metadata

if TYPE_CHECKING:
    from service.core.dataplane import DataPlane
    from service.settings import Settings

log = logging.getLogger("tensorgate.workers")

WORKER_ENV = "TENSORGATE_WORKER"
"""Set by the supervisor for each worker: ``<index>/<count>/<supervisor pid>/<replacement>/
<control folder>``. Not a ``TG_*`` setting: a user never sets it."""
ASK_TIMEOUT_S = 5.0
"""How long a worker waits for another's answer to a health or statistics question."""
REPOSITORY_TIMEOUT_S = 3600.0
"""How long it waits for another worker to load a model (gates and warmup included)."""
STARTUP_S = 60.0
"""A worker that exits with an error this soon after the server started, on its first start,
is a server that cannot start: the supervisor stops, rather than retry for ever."""
RESTART_BACKOFF_S = (1.0, 30.0)
"""A dead worker is started again after the first delay, doubled each time it dies within a
minute of starting, up to the second."""


class WorkerFailed(TensorgateError):
    """Another worker could not do its part (it is restarting, or refused)."""

    status = 503


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

    def run(self) -> int:
        # Reserve the port (and learn it, for port 0) without listening: a socket that does
        # not listen takes no connections, and SO_REUSEPORT lets the workers bind beside it.
        reserved = reserve_port(self.settings.host, self.settings.port)
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
        try:
            for index in range(self.count):
                self._start(index, port)
            status = self._watch(port)
        finally:
            reserved.close()
            for process in self.processes.values():
                if process.poll() is None:
                    process.kill()
                    process.wait()
            shutil.rmtree(self.folder, ignore_errors=True)
        return status

    def _start(self, index: int, port: int, replacement: bool = False) -> None:
        worker = Worker(index, self.count, os.getpid(), self.folder, replacement)
        env = {**os.environ, WORKER_ENV: worker.encode(), "TG_PORT": str(port)}
        # A session of its own: a signal to the supervisor's process group (Ctrl-C, `kill` of a
        # `make run`) reaches the workers once, forwarded, instead of twice ("stop now").
        self.processes[index] = subprocess.Popen(
            [sys.executable, "-m", "service", *self.argv], env=env, start_new_session=True
        )
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
            for index, when in list(self.due.items()):
                if self.stopping:
                    del self.due[index]
                elif now >= when:
                    del self.due[index]
                    self._start(index, port, replacement=True)
            if self.stopping and not self.processes:
                return 1 if failed else 0
            time.sleep(0.1)  # a poll interval: children are few and rarely change

    def _forward(self, sig: int, frame: object) -> None:
        """First SIGTERM: every worker drains. A second: every worker stops now."""
        self.stopping = True
        for process in self.processes.values():
            if process.poll() is None:
                process.send_signal(signal.SIGTERM if sig == signal.SIGTERM else sig)


def reserve_port(host: str, port: int) -> socket.socket:
    """A bound, not listening, SO_REUSEPORT socket on ``host:port``."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    return sock


def listening_socket(host: str, port: int) -> socket.socket:
    """This worker's own listening socket on the shared port."""
    sock = reserve_port(host, port)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def die_with_supervisor(worker: Worker) -> None:
    """Ask the kernel for SIGTERM when the supervisor ends, however it ends (Linux)."""
    libc = ctypes.CDLL(None, use_errno=True)
    pr_set_pdeathsig = 1
    libc.prctl(pr_set_pdeathsig, signal.SIGTERM)
    if os.getppid() != worker.supervisor_pid:  # it ended before the request was made
        os.kill(os.getpid(), signal.SIGTERM)


# -- the control socket -----------------------------------------------------------------------


class ControlServer:
    """What a worker answers the others: questions about itself alone, one JSON line each."""

    def __init__(self, dataplane: DataPlane, worker: Worker) -> None:
        self.dataplane = dataplane
        self.worker = worker
        self.server: asyncio.AbstractServer | None = None
        self.ops: dict[str, Callable[..., Awaitable[Any]]] = {
            "live": self._probe("live"),
            "ready": self._probe("ready"),
            "started": self._probe("started"),
            "model_ready": self._model_ready,
            "statistics": self._statistics,
            "metrics": self._metrics,
            "load": dataplane.load_model,
            "unload": dataplane.unload_model,
        }

    async def start(self) -> None:
        path = self.worker.socket_path(self.worker.index)
        path.unlink(missing_ok=True)  # a dead predecessor's
        self.server = await asyncio.start_unix_server(self._serve, path=str(path))

    async def close(self) -> None:
        if self.server is not None:
            self.server.close()
            await self.server.wait_closed()

    def _probe(self, kind: str) -> Callable[[], Awaitable[tuple[bool, str]]]:
        async def probe() -> tuple[bool, str]:
            answer: tuple[bool, str] = getattr(self.dataplane, kind)()
            return answer

        return probe

    async def _model_ready(self, name: str, version: str | None) -> bool:
        return self.dataplane.model_ready(name, version)

    async def _statistics(self, name: str | None, version: str | None) -> dict[str, Any]:
        return metadata.statistics(self.dataplane.repository, name, version)

    async def _metrics(self) -> str:
        return generate_latest(self.dataplane.observer.metrics.registry).decode()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            line = await reader.readline()
            question = orjson.loads(line)
            try:
                answer = {"value": await self.ops[question["op"]](*question["args"])}
            except TensorgateError as exc:
                answer = {"error": exc.message, "status": exc.status}
            writer.write(orjson.dumps(answer) + b"\n")
            await writer.drain()
        except Exception:  # a peer that went away mid-answer; it will say so itself
            log.debug("control connection ended early", exc_info=True)
        finally:
            writer.close()


class Siblings:
    """The other workers of this server, as this worker asks them."""

    def __init__(self, worker: Worker) -> None:
        self.worker = worker

    async def ask(self, op: str, *args: Any, timeout: float = ASK_TIMEOUT_S) -> list[Any]:
        """Every other worker's answer to ``op``, in worker order: its value, or the
        :class:`TensorgateError` it answered or that stands for no answer."""
        return await asyncio.gather(*(self._ask(i, op, args, timeout) for i in self.worker.others))

    async def _ask(self, index: int, op: str, args: tuple[Any, ...], timeout: float) -> Any:
        path = self.worker.socket_path(index)
        try:
            async with asyncio.timeout(timeout):
                reader, writer = await asyncio.open_unix_connection(str(path))
                try:
                    writer.write(orjson.dumps({"op": op, "args": args}) + b"\n")
                    answer = orjson.loads(await reader.readline())
                finally:
                    writer.close()
        except (OSError, TimeoutError, orjson.JSONDecodeError) as exc:
            return WorkerFailed(
                f"worker {index} is not answering ({type(exc).__name__}); "
                "it may be starting or restarting"
            )
        if "error" in answer:
            error = TensorgateError(f"worker {index}: {answer['error']}")
            error.status = answer["status"]
            return error
        return answer["value"]


# -- one server to the outside ------------------------------------------------------------------


class Cluster:
    """The server as one, however many worker processes serve it: what the REST routes and the
    gRPC servicers ask for readiness, statistics, metrics and repository changes. Alone, it
    answers from this process's DataPlane; as one of several workers (``siblings`` set at
    start), it merges every worker's answer."""

    def __init__(self, dataplane: DataPlane, siblings: Siblings | None = None) -> None:
        self.dataplane = dataplane
        self.siblings = siblings

    async def probe(self, kind: str) -> tuple[bool, str]:
        """``live``, ``ready`` or ``started`` for the whole server. Ready and started need every
        worker; live fails only for a worker that answers that it is not (a dead one is being
        replaced by the supervisor, which a restart of the pod would not do better)."""
        local: tuple[bool, str] = getattr(self.dataplane, kind)()
        siblings = self.siblings
        if siblings is None or not local[0]:
            return local
        for index, answer in zip(siblings.worker.others, await siblings.ask(kind), strict=True):
            if isinstance(answer, TensorgateError):
                if kind != "live":
                    return False, answer.message
            elif not answer[0]:
                return False, f"worker {index}: {answer[1]}"  # which one, as for no answer
        return local

    async def model_ready(self, name: str, version: str | None) -> bool:
        """A model is ready when it is in every worker."""
        if not self.dataplane.model_ready(name, version):
            return False
        if self.siblings is None:
            return True
        answers = await self.siblings.ask("model_ready", name, version)
        return all(answer is True for answer in answers)

    async def statistics(self, name: str | None, version: str | None) -> dict[str, Any]:
        """The statistics extension's answer, summed over workers."""
        local = metadata.statistics(self.dataplane.repository, name, version)
        if self.siblings is None:
            return local
        answers = await self.siblings.ask("statistics", name, version)
        return merge_statistics([local, *_values(answers)])

    async def metrics(self) -> bytes:
        """``/metrics`` in the text format, summed over workers (see :func:`merge_metrics`)."""
        local = generate_latest(self.dataplane.observer.metrics.registry)
        if self.siblings is None:
            return local
        answers = await self.siblings.ask("metrics")
        return merge_metrics([local.decode(), *_values(answers)])

    async def load_model(self, name: str) -> None:
        """Load ``name`` here and in every other worker; the first refusal is the answer."""
        await self.dataplane.load_model(name)
        await self._everywhere("load", name)

    async def unload_model(self, name: str) -> None:
        await self.dataplane.unload_model(name)
        await self._everywhere("unload", name)

    async def _everywhere(self, op: str, name: str) -> None:
        if self.siblings is None:
            return
        for answer in await self.siblings.ask(op, name, timeout=REPOSITORY_TIMEOUT_S):
            if isinstance(answer, TensorgateError):
                raise answer


def _values(answers: list[Any]) -> list[Any]:
    """The answers, or the first worker's failure: a total that misses a worker is wrong."""
    for answer in answers:
        if isinstance(answer, TensorgateError):
            raise WorkerFailed(f"cannot total over every worker: {answer.message}")
    return answers


def merge_statistics(answers: list[dict[str, Any]]) -> dict[str, Any]:
    """Triton's statistics of several workers as one: counts and durations add up, batch
    statistics add up by batch size, ``last_inference`` is the latest."""
    merged: dict[tuple[str, str], dict[str, Any]] = {}
    for answer in answers:
        for model in answer["model_stats"]:
            key = (model["name"], model["version"])
            if key in merged:
                _add(merged[key], model)
            else:
                merged[key] = orjson.loads(orjson.dumps(model))  # a copy to add into
    return {"model_stats": list(merged.values())}


def _add(into: dict[str, Any], other: dict[str, Any]) -> None:
    for key, value in other.items():
        if key == "last_inference":
            into[key] = max(into.get(key) or 0, value or 0)
        elif key == "batch_stats":
            sizes = {entry["batch_size"]: entry for entry in into.setdefault(key, [])}
            for entry in value:
                if entry["batch_size"] in sizes:
                    _add(sizes[entry["batch_size"]], entry)
                else:
                    into[key].append(orjson.loads(orjson.dumps(entry)))
            into[key].sort(key=lambda entry: entry["batch_size"])
        elif key == "batch_size":
            continue
        elif isinstance(value, dict):
            _add(into.setdefault(key, {}), value)
        elif isinstance(value, int | float) and not isinstance(value, bool):
            into[key] = into.get(key, 0) + value


LOWEST = {"process_start_time_seconds"}
"""Gauges that are the least over workers (when the server started)."""
SUMMED_GAUGES = {
    "process_virtual_memory_bytes",
    "process_resident_memory_bytes",
    "process_open_fds",
    "tensorgate_pending_requests",
    "tensorgate_request_body_bytes_in_flight",
}
"""Gauges of what each worker holds, so the server holds their sum. Every other gauge (a
model's state, warmup time, a GPU's memory) describes one thing each worker sees alike, and is
the greatest over workers."""


def merge_metrics(texts: list[str]) -> bytes:
    """Several workers' exposition texts as one: counters and histograms add up; gauges add
    up, take the least or the greatest, as :data:`SUMMED_GAUGES` and :data:`LOWEST` say."""
    families: dict[str, Metric] = {}
    values: dict[str, dict[tuple[str, tuple[tuple[str, str], ...]], float]] = {}
    for text in texts:
        for family in text_string_to_metric_families(text):
            if family.name not in families:
                families[family.name] = Metric(family.name, family.documentation, family.type)
                values[family.name] = {}
            samples = values[family.name]
            for sample in family.samples:
                key = (sample.name, tuple(sorted(sample.labels.items())))
                if key not in samples:
                    samples[key] = sample.value
                elif family.type != "gauge" or family.name in SUMMED_GAUGES:
                    samples[key] += sample.value
                elif family.name in LOWEST:
                    samples[key] = min(samples[key], sample.value)
                else:
                    samples[key] = max(samples[key], sample.value)
    for name, family in families.items():
        for (sample_name, labels), value in values[name].items():
            family.add_sample(sample_name, dict(labels), value)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Fixed(list(families.values())))
    return generate_latest(registry)


class _Fixed:
    """A collector of metric families computed elsewhere."""

    def __init__(self, families: list[Metric]) -> None:
        self.families = families

    def collect(self) -> list[Metric]:
        return self.families
