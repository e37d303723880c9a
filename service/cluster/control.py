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
"""How long a worker waits for another's answer to a health or statistics question."""
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
            "unloaded": self._unloaded,
        }
        if dataplane.settings.admin_token is not None:
            self.ops["load"] = dataplane.load_model
            self.ops["unload"] = dataplane.unload_model

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

    async def _unloaded(self) -> list[str]:
        return sorted(n for n, e in self.dataplane.repository.models.items() if e.unloaded)

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
    """A replacement worker, once loaded: unload what every sibling that answers has unloaded,
    so that a restart does not bring back a model the server was told to stop serving (the
    replacement loads the whole repository, as every worker does at start)."""
    answers = [a for a in await siblings.ask("unloaded") if isinstance(a, list)]
    if not answers:
        return
    unloaded = set.intersection(*(set(a) for a in answers))
    for name in sorted(unloaded & set(dataplane.repository.models)):
        log.info("model %s is unloaded in the other workers: unloading it here too", name)
        await dataplane.unload_model(name)


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
