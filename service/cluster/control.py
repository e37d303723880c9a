"""The workers' private control socket: each worker answers the others' questions
(:class:`ControlServer`) and asks them (:class:`Siblings`), JSON lines on a unix socket in a
folder only this user may open (service/cluster/supervisor.py says how the workers start)."""

from __future__ import annotations

import asyncio
import hmac
import logging
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import orjson

from service.cluster.supervisor import Worker, control_key
from service.errors import TensorgateError
from service.repository import metadata

if TYPE_CHECKING:
    from service.core.dataplane import DataPlane

log = logging.getLogger("tensorgate.workers")


ASK_TIMEOUT_S = 5.0
"""How long a worker waits for another's answer to a statistics or metrics question."""
PROBE_ASK_S = 1.5
"""How long for a health probe's: within the CLI probe's 2 s and the kubelet's and compose's
3 s. With 5 s, one stuck worker (SIGSTOP) made every probe time out, and the kubelet would
have restarted the pod, the healthy worker with it, before the supervisor replaced the stuck
one (TG_STUCK_INSTANCE_S)."""
REPOSITORY_TIMEOUT_S = 3600.0
"""How long it waits for another worker to load a model (gates and warmup included)."""


class WorkerFailed(TensorgateError):
    """Another worker could not do its part (it is restarting, or refused)."""

    status = 503


class ControlServer:
    """What a worker answers the others: questions about itself alone, one JSON line each,
    each carrying the server's control key (:func:`~service.cluster.supervisor.control_key`);
    a question without it is answered 401 and logged. Loads and unloads are answered only
    when the server has an admin token: without one no route asks for them."""

    def __init__(self, dataplane: DataPlane, worker: Worker) -> None:
        self.dataplane = dataplane
        self.worker = worker
        self.key = control_key().encode()
        self.server: asyncio.AbstractServer | None = None
        self.ops: dict[str, Callable[..., Awaitable[Any]]] = {
            "live": self._probe("live"),
            "ready": self._probe("ready"),
            "started": self._probe("started"),
            "model_ready": self._model_ready,
            "statistics": self._statistics,
            "metrics": self._metrics,
            "models": self._models,
        }
        if dataplane.settings.admin_token is not None:
            self.ops["load"] = dataplane.load_model
            self.ops["unload"] = dataplane.unload_model
            self.ops["stop_loading"] = self._stop_loading

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

    async def _stop_loading(self, name: str) -> bool:
        return self.dataplane.repository.stop_loading(name)

    async def _models(self) -> dict[str, list[str]]:
        """The models this worker was told to stop serving, and the others it holds, among
        them those whose load, asked for while it ran, was refused."""
        models = self.dataplane.repository.models
        return {
            "unloaded": sorted(n for n, e in models.items() if e.unloaded),
            "held": sorted(n for n, e in models.items() if not e.unloaded),
            "refused": sorted(n for n, e in models.items() if e.refused),
        }

    async def _metrics(self) -> str:
        return self.dataplane.observer.metrics.exposition().decode()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            line = await reader.readline()
            question = orjson.loads(line)
            key = question.get("key") if isinstance(question, dict) else None
            op = question.get("op") if isinstance(question, dict) else None
            if not isinstance(key, str) or not hmac.compare_digest(key.encode(), self.key):
                log.warning("control socket: a question without this server's key, refused")
                answer: dict[str, Any] = {
                    "error": "this server's control key is needed",
                    "status": 401,
                }
            elif op not in self.ops:
                answer = {"error": f"no operation {str(op)[:100]!r}", "status": 400}
            else:
                try:
                    answer = {"value": await self.ops[op](*question["args"])}
                except TensorgateError as exc:
                    answer = {"error": exc.message, "status": exc.status}
            writer.write(orjson.dumps(answer) + b"\n")
            await writer.drain()
        except Exception:  # a peer that went away mid-answer; it will say so itself
            log.debug("control connection ended early", exc_info=True)
        finally:
            writer.close()


async def follow_siblings(dataplane: DataPlane, siblings: Siblings) -> None:
    """A replacement worker, once loaded, takes the model set the other workers hold: the
    replacement loads the repository's folders, as every worker does at start, but since then
    the server may have been told to stop serving a model (unload), to serve one it did not
    start with (a load of a model outside ``TG_MODELS``), or may have left a folder that
    appeared since unloaded. Without this the workers served different models behind one
    port (a third of the requests 404, the index and metadata alternating)."""
    answers = [a for a in await siblings.ask("models") if isinstance(a, dict)]
    if not answers:
        return
    unloaded = set.intersection(*(set(a["unloaded"]) for a in answers))
    held = set.intersection(*(set(a["held"]) for a in answers))
    refused = set.intersection(*(set(a.get("refused", ())) for a in answers))
    anywhere = set.union(*(set(a["unloaded"]) | set(a["held"]) for a in answers))
    here = set(dataplane.repository.models)
    for name in sorted(refused & here):
        # A load the others were asked for while they ran, refused: theirs leaves them ready.
        # This worker's own start loaded the folder and met the same refusal, which counted
        # against its readiness: the server stayed unready for good after a worker's restart.
        if dataplane.repository.refuse_unserved(name):
            log.info("model %s was refused in the other workers, and here: shown refused", name)
    for name in sorted(unloaded & here):
        log.info("model %s is unloaded in the other workers: unloading it here too", name)
        await dataplane.unload_model(name)
    for name in sorted(here - anywhere):
        log.info("model %s was never loaded by the other workers: unloading it here too", name)
        await dataplane.unload_model(name, requested=False)  # as theirs: a folder not loaded
    for name in sorted(held - here):
        log.info("model %s was loaded in the other workers: loading it here too", name)
        try:
            await dataplane.load_model(name)
        except TensorgateError as exc:
            log.error("model %s, held by the other workers, did not load here: %s", name, exc)


class Siblings:
    """The other workers of this server, as this worker asks them."""

    def __init__(self, worker: Worker) -> None:
        self.worker = worker
        self.key = control_key()

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
                    question = {"op": op, "args": args, "key": self.key}
                    writer.write(orjson.dumps(question) + b"\n")
                    # to its end, not a line: asyncio's lines stop at 64 KiB, and a worker's
                    # metrics text passed that after a few hundred requests to 9 models (every
                    # /metrics then answered 500)
                    answer = orjson.loads(await reader.read())
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
