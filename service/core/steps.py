"""Other models of the same server, as a model's own pipeline code calls them.

``self.models.infer("rnet", {"input": crops})`` in a pipeline's ``preprocess`` or
``postprocess`` (which run in the thread pool) joins that model's own scheduler on the event
loop, so the step batches with every other request for it, as Triton's BLS does: one
request's crops and another client's requests share a batch. What carries through:

- the request's deadline (a step that has not started by then is a 504, and the calling thread
  stops waiting for it then), and its cancellation (once the client has left, or the request
  was answered 504, a step the code calls next is refused instead of run);
- the step model's in-use count (unloading it, or the server's drain, waits for the step),
  and its statistics (a step counts as a request of its own);
- failures: a step that fails fails the request with the step named (``pipeline step
  'rnet': ...``), with the step's own status where the request may be at fault or the step
  may recover (503 for a model not ready, 400 for a shape or value it does not take, 504 past
  the deadline), and 500 where the code is (a model or version that is not there, an input
  name or dtype the model does not take, inputs that are not a mapping, more rows than the
  model takes in one request: the code's own mistakes, whatever the client sent,
  counted as errors where a 4xx would have counted them as the client's).

A step sends tensors to the step model itself (its own pipeline, if any, is not run), so a
pipeline never waits on the pool it runs in.
"""

from __future__ import annotations

import asyncio
import contextvars
import threading
import time
from collections.abc import Mapping
from concurrent.futures import TimeoutError as FutureTimeout

import numpy as np

from service.artifacts.shapes import Crop, apply_crop
from service.batching.scheduler import Batch, rows_of
from service.batching.stats import RequestTiming
from service.core.validation import castable, check_inputs
from service.datatypes import FROM_NUMPY, TO_NUMPY
from service.errors import (
    DeadlineExceeded,
    InvalidInput,
    ModelExecutionError,
    ModelNotFound,
    ModelNotReady,
    PayloadTooLarge,
    StepCancelled,
    TensorgateError,
)
from service.inference import InputTensor
from service.repository.loader import LoadedVersion
from service.repository.models import ModelRepository
from service.repository.serving import ServedVersion
from service.telemetry import tracing
from service.telemetry.metrics import STEP, Metrics
from service.telemetry.observation import status_of

DEADLINE: contextvars.ContextVar[float | None] = contextvars.ContextVar(
    "tensorgate_step_deadline", default=None
)
"""The deadline of the request whose code is running (set by the core around each call)."""
GONE: contextvars.ContextVar[threading.Event | None] = contextvars.ContextVar(
    "tensorgate_step_gone", default=None
)
"""Set once the request whose code is running was answered (past its deadline) or cancelled
(its client left, the server stopped): a step it calls after that is refused, not run."""
CALLER: contextvars.ContextVar[RequestTiming | None] = contextvars.ContextVar(
    "tensorgate_step_caller", default=None
)
"""The timing of the request whose code is running: a step that met an unwarmed shape marks
it, so that its access-log line says so (the faces pyramid's steps)."""


class Steps:
    """The server's models, for pipeline code: :meth:`infer` from any thread but the loop's."""

    def __init__(
        self,
        repository: ModelRepository,
        loop: asyncio.AbstractEventLoop,
        default_s: float,
        metrics: Metrics | None = None,
    ) -> None:
        """``metrics``: where each step is counted and timed as a request of protocol
        ``step`` (the step model's series: its requests, duration and stages)."""
        self.repository, self.loop, self.default_s = repository, loop, default_s
        self.metrics = metrics

    def _left_out(self, model: str) -> str:
        """Why a model the code calls is unknown, where the server chose not to load it."""
        repository = self.repository
        chosen = repository.settings.models
        if chosen and model not in chosen and model in repository.on_disk():
            return " (it is in the repository, but TG_MODELS leaves it out)"
        return ""

    def serial_of(self, model: str, version: str | None) -> int | None:
        """Which load of ``model`` serves a call now (:attr:`LoadedVersion.serial`), if one
        does: what a pipeline's replay records of each step it ran through."""
        try:
            return self.repository.ready_model(model, version, whole=False)[1].loaded.serial
        except TensorgateError:
            return None

    def infer(
        self, model: str, inputs: Mapping[str, np.ndarray], version: str | None = None
    ) -> dict[str, np.ndarray]:
        """Run ``inputs`` (a batch, batch dim first for a batching model) on ``model``."""
        if _on_loop(self.loop):
            raise RuntimeError("models.infer() blocks: call it from pipeline code, not the loop")
        if version is not None:  # the code's own: an int is taken as the number it is
            version = str(version)
        deadline = DEADLINE.get() or time.monotonic() + self.default_s
        gone = GONE.get()
        if gone is not None and gone.is_set():
            raise StepCancelled(
                f"pipeline step '{model}': not run, its request was cancelled or answered"
            )
        try:
            if not isinstance(inputs, Mapping) or not all(isinstance(k, str) for k in inputs):
                raise ModelExecutionError(
                    "models.infer() takes a mapping of input name to array, e.g. "
                    f"{{'image': batch}}; the code sent a {type(inputs).__name__}"
                )
            for _ in range(3):  # a version retired meanwhile (a reload): its successor runs it
                try:
                    found, served = self.repository.ready_model(model, version, whole=False)
                except ModelNotFound as exc:  # the code named it: not the client's 404
                    raise ModelExecutionError(exc.message + self._left_out(model)) from None
                loaded = served.loaded
                _check_names_and_dtypes(inputs, loaded)
                tensors = [_tensor(name, array) for name, array in inputs.items()]
                try:
                    batch = check_inputs(
                        tensors, loaded.signature, loaded.config, model, empty=True
                    )
                except PayloadTooLarge as exc:  # the code's request, however small the client's
                    raise ModelExecutionError(
                        f"{exc.message}: the code sent more than the model takes in one "
                        "request; send it in parts, or raise the limit in its config.yaml"
                    ) from None
                if loaded.batched and not rows_of(batch, True):
                    return _no_rows(loaded)
                batch, crop = _warmed(loaded, batch)
                ran = asyncio.run_coroutine_threadsafe(
                    _run(served, batch, deadline, CALLER.get(), self.metrics, str(found.version)),
                    self.loop,
                )
                try:
                    outputs = ran.result(timeout=max(0.0, deadline - time.monotonic()) + 0.05)
                except FutureTimeout:
                    ran.cancel()
                    raise DeadlineExceeded("did not finish within the request's deadline") from None
                if outputs is not None:
                    return apply_crop(outputs, crop)
            raise ModelNotReady(f"model '{model}' was reloaded again and again meanwhile")
        except TensorgateError as exc:
            raise _named(exc, model) from None


def _check_names_and_dtypes(inputs: Mapping[str, np.ndarray], loaded: LoadedVersion) -> None:
    """The code's inputs for a step have the model's names and dtypes (numeric dtypes it casts,
    where the step model's ``cast_inputs`` is on): a mismatch is the code's 500, whatever the
    request sent (shapes and values, which may follow from what it sent, are checked as a
    request's own, a 400)."""
    sent = sorted(inputs)
    takes = sorted(spec.name for spec in loaded.signature.inputs)
    if sent != takes:
        raise ModelExecutionError(
            f"the code sent inputs {sent}; model '{loaded.name}' takes {takes}"
        )
    for spec in loaded.signature.inputs:
        dtype = np.asarray(inputs[spec.name]).dtype
        given = FROM_NUMPY.get(dtype)
        if given is not None and castable(loaded.config, given, spec.datatype):
            continue  # cast to the declared datatype, as a request's tensors are (check_inputs)
        if dtype != TO_NUMPY[spec.datatype]:
            raise ModelExecutionError(
                f"the code sent input '{spec.name}' as {dtype}; model '{loaded.name}' takes "
                f"{spec.datatype} ({TO_NUMPY[spec.datatype]})"
            )


def _no_rows(loaded: LoadedVersion) -> dict[str, np.ndarray]:
    """What a step of 0 rows answers, without running the model: each output with 0 rows, of
    its datatype, its dynamic dims 0 (a detector that found nothing hands its classifier no
    crops; ``infer`` refused that with a 400, so the code had to guard each call)."""
    return {
        spec.name: np.empty((0, *(max(dim, 0) for dim in spec.shape)), TO_NUMPY[spec.datatype])
        for spec in loaded.signature.outputs
    }


def _warmed(loaded: LoadedVersion, batch: Batch) -> tuple[Batch, Crop]:
    """A step's batch at a warmed size where export measured that padding leaves the answer
    unchanged (its outputs cropped back): the code made whatever sizes it needed (a face
    pipeline's pyramid met 58 unwarmed shapes before the first client's request), each a cold
    shape. Elsewhere, or past the buckets, the step runs as the code asked, as before (and is
    counted as an unwarmed shape): pipeline code is the model's author's, not a client's."""
    shapes = loaded.shapes
    if not shapes.pads_unchanged:
        return batch, {}
    try:
        return shapes.fit(batch, loaded.name)
    except InvalidInput:
        return batch, {}


async def _run(
    served: ServedVersion,
    batch: dict[str, np.ndarray],
    deadline: float,
    caller: RequestTiming | None = None,
    metrics: Metrics | None = None,
    version: str = "",
) -> dict[str, np.ndarray] | None:
    """The step on the loop, counted in the step model's statistics and ``metrics`` as a
    request of its own, and traced as a ``step`` span of its caller's when that is traced; None
    if ``served`` was retired since the code's thread looked it up (a reload swapped another
    version in, and this one no longer waits for requests: it would fail the step)."""
    loaded = served.loaded
    with served.use():
        if served.closing:  # read after the use is counted: a close() not seen yet waits for it
            return None
        trace = tracing.step(caller.trace if caller is not None else None, loaded.name, version)
        timing = RequestTiming(trace=trace)
        try:
            outputs = await served.execute(batch, timing, deadline)
        except BaseException as exc:
            status = status_of(exc)
            served.stats.record_failure(timing)
            if metrics is not None:
                elapsed = (time.perf_counter_ns() - timing.started_ns) / 1e9
                metrics.record(loaded.name, version, STEP, status, elapsed, timing)
            if trace is not None:
                trace.end(status >= 500, {"tensorgate.status": status})
            raise
    served.stats.record_success(rows_of(batch, loaded.batched), timing)
    if metrics is not None:
        elapsed = (time.perf_counter_ns() - timing.started_ns) / 1e9
        metrics.record(loaded.name, version, STEP, 200, elapsed, timing)
    if trace is not None:
        trace.end(False, {"tensorgate.status": 200})
    if caller is not None and timing.unwarmed:
        caller.unwarmed = True
    return outputs


def _tensor(name: str, array: np.ndarray) -> InputTensor:
    array = np.asarray(array)
    datatype = FROM_NUMPY.get(array.dtype)
    if datatype is None:
        raise InvalidInput(f"input '{name}': numpy {array.dtype} has no tensor datatype")
    return InputTensor(name, datatype, array.shape, array)


def _named(exc: TensorgateError, model: str) -> TensorgateError:
    """``exc`` with the step named first: the request fails with it."""
    exc.message = f"pipeline step '{model}': {exc.message}"
    exc.args = (exc.message,)
    return exc


def _on_loop(loop: asyncio.AbstractEventLoop) -> bool:
    try:
        return asyncio.get_running_loop() is loop
    except RuntimeError:
        return False
