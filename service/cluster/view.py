""":class:`Cluster`: the whole server, one worker or several, as the routes and the gRPC
servicer ask it: readiness, startup and liveness over every worker, statistics and metrics
summed, repository changes made in each."""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import hashlib
import logging
import os
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, ProcessCollector, generate_latest

from service.cluster.control import PROBE_ASK_S, REPOSITORY_TIMEOUT_S, Siblings, WorkerFailed
from service.cluster.merge import merge_metrics, merge_statistics
from service.errors import ModelLoadRefused, ModelLoadStopped, TensorgateError
from service.repository import metadata

if TYPE_CHECKING:
    from service.core.dataplane import DataPlane

log = logging.getLogger("tensorgate.workers")


class Cluster:
    """The server as one, however many worker processes serve it: what the REST routes and the
    gRPC servicers ask for readiness, statistics, metrics and repository changes. Alone, it
    answers from this process's DataPlane; as one of several workers (``siblings`` set at
    start), it merges every worker's answer."""

    def __init__(self, dataplane: DataPlane, siblings: Siblings | None = None) -> None:
        self.dataplane = dataplane
        self.siblings = siblings
        self._supervisor: CollectorRegistry | None = None

    async def probe(self, kind: str) -> tuple[bool, str]:
        """``live``, ``ready`` or ``started`` for the whole server. Ready and started need every
        worker; live fails only for a worker that answers that it is not (a dead one is being
        replaced by the supervisor, which a restart of the pod would not do better)."""
        local: tuple[bool, str] = getattr(self.dataplane, kind)()
        siblings = self.siblings
        if siblings is None or not local[0]:
            return local
        answers = await siblings.ask(kind, timeout=PROBE_ASK_S)
        for index, answer in zip(siblings.worker.others, answers, strict=True):
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
        """``/metrics`` in the text format, summed over workers (see :func:`merge_metrics`);
        ``process_*`` also over the supervisor, whose front holds what gRPC clients send."""
        local = self.dataplane.observer.metrics.exposition()
        if self.siblings is None:
            return local
        answers = await self.siblings.ask("metrics")
        if self._supervisor is None:  # the supervisor's process_* added to the workers'
            self._supervisor = CollectorRegistry(auto_describe=False)
            supervisor = os.getppid()  # a worker does not outlive it (die_with_supervisor)
            ProcessCollector(pid=lambda: supervisor, registry=self._supervisor)
        supervisor_text = generate_latest(self._supervisor).decode()
        return merge_metrics([local.decode(), *_values(answers), supervisor_text])

    async def load_model(self, name: str) -> None:
        """Load ``name`` here and in every other worker; the first refusal is the answer."""
        if self.siblings is None:
            await self.dataplane.load_model(name)
            return
        async with _model_lock(self.siblings, name):
            try:
                await self.dataplane.load_model(name)
            except ModelLoadStopped:
                raise  # an unload crossed it: the others are stopped too
            except ModelLoadRefused as refused:
                # The others load it too, to the same refusal: asked only after a success, they
                # did not know of a new folder (404, UNLOADED) where this worker said why it
                # was UNAVAILABLE, and answers flipped with the worker a request reached.
                answers = await self.siblings.ask("load", name, timeout=REPOSITORY_TIMEOUT_S)
                loaded = [
                    index
                    for index, answer in zip(self.siblings.worker.others, answers, strict=True)
                    if not isinstance(answer, TensorgateError)
                ]
                if loaded:  # a refusal of this worker's own (its memory, a warmup): say so
                    refused.message += (
                        f"; worker(s) {loaded} loaded it, so the workers differ: load it "
                        "again, or unload it"
                    )
                    refused.args = (refused.message,)
                    log.error("model %s: %s", name, refused.message)
                raise
            await self._everywhere("load", name)

    async def unload_model(self, name: str) -> None:
        """Unload ``name`` here and in every other worker. A load of it under way anywhere is
        stopped first (at its next warmup batch), so the unload waits little for its turn."""
        if self.siblings is None:
            await self.dataplane.unload_model(name)
            return
        self.dataplane.repository.stop_loading(name)
        await self.siblings.ask("stop_loading", name)
        async with _model_lock(self.siblings, name):
            await self.dataplane.unload_model(name)
            try:
                await self._everywhere("unload", name)
            except WorkerFailed as exc:  # done here all the same: say so, not just "failed"
                raise WorkerFailed(
                    f"model '{name}' is unloaded in this worker, but {exc.message}; a worker "
                    "that starts again takes the unload from the others"
                ) from None

    async def _everywhere(self, op: str, name: str) -> None:
        if self.siblings is None:
            return
        for answer in await self.siblings.ask(op, name, timeout=REPOSITORY_TIMEOUT_S):
            if isinstance(answer, TensorgateError):
                raise answer


@contextlib.asynccontextmanager
async def _model_lock(siblings: Siblings, name: str) -> AsyncIterator[None]:
    """One repository change to ``name`` at a time over every worker: a lock file of the
    workers' folder, held from this worker's change to the last sibling's. A load and an
    unload sent together to two workers crossed (each worker applied them in another order)
    and left them serving different models for good, both answered 200."""
    digest = hashlib.sha256(name.encode()).hexdigest()[:16]
    fd = os.open(siblings.worker.folder / f"model-{digest}.lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        while True:  # polled, not blocked on in a thread: a cancelled wait leaves no thread
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                await asyncio.sleep(LOCK_POLL_S)
        yield
    finally:
        os.close(fd)  # and the lock with it (also when the process dies)


LOCK_POLL_S = 0.05


def _values(answers: list[Any]) -> list[Any]:
    """The answers, or the first worker's failure: a total that misses a worker is wrong."""
    for answer in answers:
        if isinstance(answer, TensorgateError):
            raise WorkerFailed(f"cannot total over every worker: {answer.message}")
    return answers
