"""DataPlane: the protocol-agnostic core. Health, readiness, inference, repository changes.

Every protocol front end (v1 and v2 REST in ``service/http``, gRPC in ``service/grpc``) runs
one inference request straight through, in one direction::

    with dataplane.call(protocol, model, version) as call:    # 404 / 503 before any work
        request = await call.decode(work, <decoder>, body)      # the protocol's codec
        result = await call.infer(request)                      # pipeline, batch, run
        body = await call.encode(<encoder>, result)             # the protocol's codec, timed

Nothing here knows a wire format. Where each step runs is decided here, by its work: a model's
pipeline runs in the thread pool, or on the instance's own thread for a request alone (one
thread hop in all). A request refused while the server drains is answered 503 before any
lookup; it is neither counted in a model's statistics nor logged (it never reached one).
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
import math
import threading
import time
from collections.abc import Awaitable, Callable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from types import TracebackType
from typing import Any, Protocol, TypeVar

import numpy as np

from preprocessing.pipeline import (
    Arrays,
    BadInput,
    Item,
    ItemsDiffer,
    Pipeline,
    Rows,
    overrides,
    which_item,
)
from service.artifacts.shapes import Dim, apply_crop
from service.batching.codepool import CodePool
from service.batching.scheduler import rows_of
from service.batching.stats import RequestTiming
from service.core.steps import CALLER, DEADLINE, GONE
from service.core.validation import (
    check_inputs,
    check_made,
    check_rows,
    encoded_items,
    instance_tensors,
    ragged_instance_tensors,
)
from service.datatypes import TO_NUMPY, as_values, json_answer, json_bytes, json_kind
from service.errors import (
    InvalidInput,
    ModelExecutionError,
    ModelNotReady,
    PayloadTooLarge,
    TensorgateError,
    UnsupportedMediaType,
)
from service.inference import InferenceRequest, InferenceResult, OutputTensor, RequestedOutput
from service.pipelines.classification import (
    ANSWER,
    CLASSIFICATION,
    classification_tensor,
    top_values,
)
from service.pipelines.inputs import BUILT_IN, ImageInput, Prepared, TextInput
from service.repository.loader import LoadedVersion
from service.repository.models import ModelEntry, ModelRepository, ModelState
from service.repository.serving import ServedVersion
from service.settings import Settings
from service.telemetry.counters import request_held
from service.telemetry.observation import After, Drain, Observer
from service.telemetry.tracing import RequestTrace

T = TypeVar("T")
log = logging.getLogger("tensorgate.app")

ENDED = -1
"""``held[0]`` of a request whose holds were released (:meth:`DataPlane.release`)."""


class RequestEnded(Exception):
    """A hold asked for by a request that has ended (its pool work outlived it)."""


OFFLOAD_BYTES = 32 * 1024
"""Work through this many bytes (or more) moves to the thread pool; below it the hop costs more.
Callers pass the bytes the work goes through, not the body's size (a raw image's decode into a
request goes through none)."""
BULK_BYTES = 8 << 20
"""Offloaded work through this many bytes (or more) runs one at a time. Such work is copies
that hold the GIL for their whole length (upb parsing and serializing a message, numpy's
``tobytes``): 30-60 ms each at 60 MiB. Two at once on the pool's threads took the GIL in turns,
and the event loop waited behind both at every step of every other request: under 32
concurrent 60 MiB gRPC calls a small REST request took 0.27-0.36 s (median) and up to 1.8 s;
one at a time, 0.08-0.09 s and at most 0.46 s (``python -m bench.attacks``). The copies gain
nothing from running together: they hold the same GIL."""
PREPROCESS_MAX_ROWS = 32
"""Rows one ``preprocess`` request may ask for: its answer is the model's input tensors (each
row of an ImageNet model is 600 kB, whatever the image's size)."""
LONGEST_TIMEOUT_S = 86_400.0
"""The furthest a request's deadline may be (a day, as ``X-Request-Timeout`` takes it)."""


class DataPlane:
    """The core every protocol calls: health, inference (:meth:`call`), repository changes."""

    def __init__(
        self,
        repository: ModelRepository,
        settings: Settings,
        pool: ThreadPoolExecutor,
        observer: Observer,
        drain: Drain,
    ) -> None:
        self.repository = repository
        self.settings = settings
        self.pool = pool
        self.observer = observer
        self.drain = drain
        self._bulk = asyncio.Lock()  # see BULK_BYTES
        self._holds = threading.Lock()  # a hold taken in the pool, and the request's end
        self.budget: Budget | None = None
        """The server's budget for what clients make it hold (set by the app: the one its
        bodies and messages are held in); raw items hold what they decode into in it."""

    def code_pool(self, model: LoadedVersion) -> CodePool:
        """Where ``model``'s own code runs: a pool of its own, as many threads as the shared
        one (``TG_PREPROCESS_THREADS``), and spares for those left running past their answer."""
        return model.code_pool(self.settings.preprocess_threads)

    async def offload(
        self, size: int, fn: Callable[..., T], *args: Any, starting: Callable[[], object] = int
    ) -> T:
        """``fn(*args)``, in the thread pool when ``size`` (the bytes it works on) is large, and
        one at a time with the others of :data:`BULK_BYTES` or more; ``starting()`` is called
        on the loop just before ``fn`` starts (once its turn has come)."""
        if size < OFFLOAD_BYTES:
            starting()
            return fn(*args)
        loop = asyncio.get_running_loop()
        if size < BULK_BYTES:
            starting()
            return await loop.run_in_executor(self.pool, fn, *args)
        async with self._bulk:
            starting()
            return await loop.run_in_executor(self.pool, fn, *args)

    # -- health ---------------------------------------------------------------------------------

    def live(self) -> tuple[bool, str]:
        """False only when an instance has been stuck on one batch past the limit: busy is fine."""
        limit = self.settings.stuck_instance_s
        for version, served in self.repository.served_versions():
            longest = served.scheduler.longest_running() if served.scheduler else None
            if longest is not None and longest[1] > limit:
                return False, (
                    f"model '{version.name}' version {version.version} instance {longest[0]} "
                    f"has run one batch for {longest[1]:.0f} s (limit {limit:g} s)"
                )
        return True, ""

    def started(self) -> tuple[bool, str]:
        """Whether loading has finished, whatever its outcome: a model refused by a gate leaves
        a started, not-ready server (a stable NotReady pod that says why), not a restart loop."""
        if self.repository.loading_done.is_set():
            return True, ""
        return False, "models are loading"

    def ready(self) -> tuple[bool, str]:
        """Whether the server takes traffic, and if not, why."""
        repository = self.repository
        if self.drain.draining:
            return False, "draining: the server is shutting down"
        if not repository.loading_done.is_set():
            return False, "models are loading"
        if repository.all_ready():
            return True, ""
        if not self.settings.strict_readiness and repository.any_ready():
            return True, ""
        problems = repository.problems()
        return False, "models not ready: " + ", ".join(
            f"{name} ({why})" for name, why in sorted(problems.items())
        )

    def model_ready(self, name: str, version: str | None) -> bool:
        repository = self.repository
        return repository.state(repository.version(name, version))[0] is ModelState.READY

    # -- inference --------------------------------------------------------------------------------

    def call(
        self, protocol: str, model: str, version: str | None, after: After | None = None
    ) -> Call:
        """``with dataplane.call(protocol, model, version) as call:`` around one inference
        request: 503 while the server refuses new work, then 404 / 503 for the model before any
        work; inside, the version is in use (unloading waits for it) and whatever happens is
        counted, timed and logged once: at the block's end, or, with ``after``, by what the
        block leaves there, which the caller runs once it has sent the answer
        (:meth:`Observer.finish <service.telemetry.observation.Observer.finish>`)."""
        return Call(self, protocol, model, version, after)

    async def preprocess(self, request: InferenceRequest) -> dict[str, np.ndarray]:
        """What ``infer`` would feed the model for the request: the tensors, not the answer.
        Call it within :meth:`draining` (as the route does)."""
        _, served = self.repository.ready_model(request.model, whole=False)
        held = [0]
        try:
            return await self._preprocess(served, request, held)
        finally:
            self.release(held)

    @contextlib.contextmanager
    def draining(self) -> Iterator[None]:
        """Around a request that is not inference (``:preprocess``), from its decoding to its
        answer: drained as inference is, refused past pre-stop and waited for before the exit
        (counted from inside the model's work alone, a large body's decoding or its answer's
        encoding could run past the exit)."""
        drain = self.drain
        drain.admit()
        drain.in_flight += 1
        try:
            task: asyncio.Task[object] | None = asyncio.current_task()
        except RuntimeError:  # called outside the event loop: nothing to end
            task = None
        if task is not None:  # ended, and answered 503, when the grace period is over
            drain.tasks.add(task)
        try:
            yield
        finally:
            drain.in_flight -= 1
            if task is not None:
                drain.tasks.discard(task)

    async def _preprocess(
        self, served: ServedVersion, request: InferenceRequest, held: list[int]
    ) -> dict[str, np.ndarray]:
        with served.use():
            rows = len(request.raw or request.rows or [])
            if rows > PREPROCESS_MAX_ROWS:
                raise PayloadTooLarge(
                    f"{rows} instances; :preprocess answers at most {PREPROCESS_MAX_ROWS} (its "
                    "answer is the model's input tensors, far larger than the request)"
                )
            deadline = self.deadline(request.timeout_s, request.parameters)
            work = (await self.prepare(served.loaded, request, False, deadline, held)).work
            assert isinstance(work, dict), "not alone: prepared here, never on an instance"
            return work

    async def prepare(
        self,
        model: LoadedVersion,
        request: InferenceRequest,
        alone: bool,
        deadline: float,
        held: list[int] | None = None,
        timing: RequestTiming | None = None,
    ) -> Prepared:
        """The request's inputs as the model's batch: raw items through its pipeline, tensors
        (or rows) checked against its signature and padded to its buckets.

        Where a built-in pipeline runs: for a lone item of a request ``alone`` in flight for its
        model, on the instance's own thread (one thread hop in all); else in the pool, items in
        parallel unless the pipeline batches them itself. A model's own code always runs in the
        pool, bounded by the request's ``deadline`` (a hung step must not hold an instance), and
        what it made is checked against the model's signature and fitted to its buckets.

        Raw items first take what they will decode into (rows × the model's input row at its
        largest bucket) from the budget, adding it to ``held[0]`` for the caller to release
        once answered: a request of 1,024 one-pixel PNGs (108 KB) decodes into 616 MB."""
        items, pipeline = _items(model, request), model.pipeline
        if items is None:
            # Read, checked and padded in the pool when large: a v1 body of 30 MiB of numbers
            # is read into arrays in 1.2 s, and a tensor's ranges are checked, its cast made
            # and its padding copied over all of it, each holding the event loop until done.
            work = request.rows_bytes if request.rows is not None else _tensor_work(model, request)
            return await self.offload(work, self._tensors, model, request, held, request_held())
        assert pipeline is not None
        check_rows(len(items), model.config, model.name)
        self._hold(held, len(items) * row_bytes(model))
        contexts: list[dict[str, Any]] = [{} for _ in items]
        make = partial(_preprocess, pipeline, items, contexts, model)
        loop = asyncio.get_running_loop()
        if not isinstance(pipeline, BUILT_IN):
            runner, gone = _code_context(deadline, timing)
            batch = await self.code_pool(model).run(
                partial(runner, make), deadline, model.name, "preprocessing", gone
            )
            check_made(batch, model.signature, model.config.max_batch_size > 0, model.name)
            return _fitted(model, batch, contexts)
        # A model with dynamic dims takes a size only within its range, and at a warmed size
        # (its buckets): what the pipeline made is fitted before it may join a batch, as sent
        # tensors are, so its batch is made here, never on the instance.
        dynamic = bool(model.shapes.axes)
        if len(items) == 1 and alone and not dynamic:
            return Prepared(make, contexts)
        if len(items) == 1 or overrides(pipeline, "preprocess_batch"):
            batch = await loop.run_in_executor(self.pool, make)
        else:
            # Each row is copied into its place in the batch in the pool as soon as it is made,
            # and let go: 1,024 rows of efficientnet's input are 616 MB, which the budget
            # counts once; made first and stacked after, they were held twice (4 such requests
            # peaked at 1.15 × the budget, 1.57 × with two workers), and stacked on the event
            # loop, the copy onto fresh pages held it 2.2 s, every other request waiting
            into = Rows(len(items))
            await asyncio.gather(
                *(
                    loop.run_in_executor(
                        self.pool, _preprocess_into, pipeline, item, context, model.name, into, i
                    )
                    for i, (item, context) in enumerate(zip(items, contexts, strict=True))
                )
            )
            batch = _as_batch(model, _guarded(into.batch, model.name))
        if not dynamic:
            return Prepared(batch, contexts)
        try:
            prepared = _fitted(model, batch, contexts)
        except InvalidInput as exc:
            if isinstance(pipeline, ImageInput):  # "dim 3 is 100": of the image, which is it?
                exc.message += pipeline.dims_said(model.batched)
                exc.args = (exc.message,)
            raise
        if isinstance(pipeline, TextInput):
            _crop_to_texts(model, prepared)
        return prepared

    def _tensors(
        self,
        model: LoadedVersion,
        request: InferenceRequest,
        held: list[int] | None = None,
        already: int = 0,
    ) -> Prepared:
        """Tensors (or v1 rows) sent for the model itself, checked and fitted to its buckets.
        v1 rows of their own lengths, for a model that export measured pads without changing
        its answer, are padded to one length and each row's answer cropped back to its own.
        Callable in the pool: ``already`` is what the request held before (the budget's
        :func:`request_held`, which a pool thread does not see)."""
        inputs, sizes = request.inputs, None
        if request.rows is not None:
            try:
                inputs = instance_tensors(request.rows, model.signature.inputs, model.batched)
            except InvalidInput:
                if not (model.batched and model.shapes.pads_unchanged):
                    raise
                check_rows(len(request.rows), model.config, model.name)
                inputs, sizes = ragged_instance_tensors(
                    request.rows,
                    model.signature.inputs,
                    model.shapes.axes,
                    model.name,
                    partial(self._hold, held, already=already),
                )
                _check_multiples(model, sizes)
        raw = model.pipeline.raw_input if model.pipeline is not None else None
        checked = check_inputs(
            inputs,
            model.signature,
            model.config,
            model.name,
            raw_input=raw,
            ranges_checked=sizes is not None,
            rows_are="instances[{}]" if request.rows is not None else "",
        )
        prepared = _fitted(model, checked)
        if sizes is not None:
            assert isinstance(prepared.work, dict)
            prepared.row_crops = model.shapes.row_crops(sizes, prepared.work)
            prepared.crop = None
        return prepared

    def _hold(self, held: list[int] | None, size: int, already: int | None = None) -> None:
        """``size`` bytes more from the budget for a request holding ``held[0]`` (released
        with the rest when it is answered: :meth:`release`) beside ``already`` (by default,
        what its task holds: :func:`request_held`). From the pool too: a request that ended
        meanwhile (its client gone, its task cancelled while the pool read its rows) takes
        nothing, since nothing would release it."""
        if self.budget is None or held is None:
            return
        before = request_held() if already is None else already
        with self._holds:
            if held[0] == ENDED:
                raise RequestEnded("the request ended while its inputs were read")
            self.budget.take(size, before + held[0])
            held[0] += size

    def release(self, held: list[int]) -> None:
        """What a request took in :meth:`_hold`, back to the budget, once; later holds fail."""
        with self._holds:
            if held[0] > 0 and self.budget is not None:
                self.budget.release(held[0])
            held[0] = ENDED

    def deadline(self, timeout_s: float | None, parameters: dict[str, Any] | None = None) -> float:
        """When a request must have started: the sooner of its own timeout (a header, a gRPC
        deadline) and OIP ``parameters.timeout`` (microseconds, as Triton reads it; checked
        whenever it is sent), else the server's default; at most :data:`LONGEST_TIMEOUT_S`
        away (a timeout of 1e16 µs overflowed the wait of a pipeline's step: a 500)."""
        if parameters and "timeout" in parameters:
            micros = parameters["timeout"]
            if not isinstance(micros, int | float) or isinstance(micros, bool) or not micros > 0:
                raise InvalidInput("parameter 'timeout' must be a positive number of microseconds")
            timeout_s = micros / 1e6 if timeout_s is None else min(timeout_s, micros / 1e6)
        timeout_s = timeout_s or self.settings.request_timeout_s
        return time.monotonic() + min(timeout_s, LONGEST_TIMEOUT_S)

    # -- repository -------------------------------------------------------------------------------

    async def load_model(self, name: str, polled: bool = False) -> None:
        """Load (or reload) a model; its new versions serve once their gates and warmup pass.
        ``polled``: by ``--poll``, which leaves a model unloaded through the API meanwhile.

        Then each pipeline whose load's replay ran through a step that has been loaded again
        since is reloaded, so that its answers are replayed through what serves now
        (:meth:`ModelRepository.stale`), those calling others after them. The pipelines that
        call this model, directly or through others, serve on meanwhile
        (:attr:`ModelRepository.replaying`); one whose replay fails is UNAVAILABLE, saying why
        (``missing_step``). Its refusal is its own, never this load's: logged, and in its
        metadata. The load and the replays run to their end even if the caller is cancelled
        (a gRPC client gone): the swap, in its thread, would happen all the same."""
        done = asyncio.ensure_future(self._load(name, polled))
        done.add_done_callback(_retrieve)
        await asyncio.shield(done)

    async def _load(self, name: str, polled: bool) -> None:
        repository = self.repository
        callers = repository.depending_on(name)
        repository.replaying.update(callers)  # before the swap: they serve on meanwhile
        try:
            entry = await asyncio.to_thread(repository.load_model, name, polled)
            if repository.stopping.is_set():  # closed meanwhile: nothing is to start
                return
            _start(entry)
            await self._replay_stale({name} | callers)
        finally:
            repository.replaying.subtract(callers)
            for caller in callers:
                if repository.replaying[caller] <= 0:
                    del repository.replaying[caller]

    async def _replay_stale(self, scope: set[str]) -> None:
        """Reload each stale pipeline of ``scope`` (the model loaded and those that call it)
        once it is due, leaves first: one waits while a model it calls is stale, or calls a
        stale one through others (it would replay through what is about to be replaced). A
        refusal leaves the pipeline to say why (a later load of one of its steps tries it
        again, not any load), and the rest go on."""
        repository = self.repository
        tried: set[str] = set()
        while not repository.stopping.is_set() and (
            stale := [n for n in repository.stale() if n in scope and n not in tried]
        ):
            waiting = set(stale)
            for name in stale:
                waiting |= repository.depending_on(name)
            due = [n for n in stale if not repository.steps_of(n) & waiting] or stale
            for pipeline in due:
                tried.add(pipeline)
                if pipeline not in repository.stale():  # another load replayed it meanwhile
                    continue
                log.info(
                    "replaying %s's answers through the steps it calls as they now serve", pipeline
                )
                try:  # polled: a pipeline unloaded meanwhile stays unloaded
                    _start(await asyncio.to_thread(repository.load_model, pipeline, True))
                except TensorgateError as exc:  # its refusal: in its metadata too
                    log.error("model %s: the replay of its answers was refused: %s", pipeline, exc)
                except Exception:
                    log.exception("model %s: its reload, to replay its answers, failed", pipeline)

    async def unload_model(self, name: str, requested: bool = True) -> None:
        """``requested``: asked for (the repository API), so ``--poll`` leaves it unloaded."""
        await asyncio.to_thread(self.repository.unload_model, name, requested)


def _start(entry: ModelEntry) -> None:
    """Start the schedulers of ``entry``'s versions that serve (in the running loop)."""
    for version in entry.versions.values():
        if version.served is not None:
            version.served.start()


def _retrieve(done: asyncio.Future[None]) -> None:
    """A load's outcome, read once its caller may have left (else asyncio logs it as never
    retrieved): a refusal the repository logged already, anything else here."""
    if done.cancelled():
        return
    if (exc := done.exception()) is not None and not isinstance(exc, TensorgateError):
        log.error("a model's load failed", exc_info=exc)


def _crop_to_texts(model: LoadedVersion, prepared: Prepared) -> None:
    """A text pipeline's tokens come padded to a bucket: the outputs that follow their length
    (a tagger's tags) are cut back to the request's longest text, and in v1 each text's answer
    to its own tokens (``row_crops``), as tensors sent of those lengths are. They came at the
    bucket's length, padding tokens' rows included, and a text's answer took the length of the
    longest text beside it."""
    shapes, work = model.shapes, prepared.work
    if not (shapes.pads_unchanged and shapes.follows and isinstance(work, dict)):
        return
    lengths = work["attention_mask"].sum(axis=1).tolist()  # padded on the right
    axis = next(a for a in shapes.axes if ("attention_mask", 1) in a.dims)
    crops = shapes.row_crops([dict.fromkeys(axis.dims, n) for n in [max(lengths), *lengths]], work)
    prepared.crop = crops[0] or None
    prepared.row_crops = crops[1:]


def _check_multiples(model: LoadedVersion, sizes: list[dict[Dim, int]]) -> None:
    """Rows of their own sizes are each padded to the longest: along an axis padded only from
    multiples of a stride (:class:`~service.artifacts.shapes.Axis`), each row's size must be one
    of them, or the longest row's when that is a bucket (not padded)."""
    shapes = model.shapes
    longest = {dim: max(row[dim] for row in sizes) for dim in sizes[0]} if sizes else {}
    multiples = {dim: shapes.axis_of(dim).multiple for dim in longest}
    if all(multiple == 1 for multiple in multiples.values()):
        return
    for index, own in enumerate(sizes):
        for dim, n in own.items():
            multiple = multiples[dim]
            if n % multiple and not (n == longest[dim] and n in shapes.buckets):
                raise InvalidInput(
                    f"instances[{index}]: input '{dim[0]}' dim {dim[1]} is {n}; model "
                    f"'{model.name}' takes rows of their own sizes at multiples of {multiple} "
                    f"only there, since padding changes its answer at other sizes "
                    f"({shapes.reason})"
                )


TENSOR_OFFLOAD_BYTES = 1 << 20
"""Tensors of this many bytes (or more) are checked and fitted in the pool: numpy's range
checks and padding go through 20-40 GB/s here (51 µs for the range of 2 MiB of ids, 74 µs to
pad 1 MiB), so below it the hop costs more than the work."""


def _tensor_work(model: LoadedVersion, request: InferenceRequest) -> int:
    """What checking and fitting a request's tensors goes through: their bytes (a BYTES
    tensor's elements counted as pointers) where a range is checked, a cast may be made or a
    dynamic dim padded, from :data:`TENSOR_OFFLOAD_BYTES`; none where their shapes and types
    are only looked at, or they are smaller."""
    size = sum(tensor.data.nbytes for tensor in request.inputs)
    if size < TENSOR_OFFLOAD_BYTES:
        return 0
    specs = {spec.name: spec for spec in model.signature.inputs}
    padded = bool(model.shapes.axes and model.shapes.buckets)
    ranged = any(spec.range is not None for spec in specs.values())
    cast = model.config.cast_inputs and any(
        tensor.name in specs and tensor.datatype != specs[tensor.name].datatype
        for tensor in request.inputs
    )
    return size if padded or ranged or cast else 0


def _check_outputs(model: LoadedVersion, wanted: list[RequestedOutput] | None) -> None:
    """Before anything runs: every output asked for is one the model offers, and one asked
    classified (Triton's ``classification`` parameter) holds numbers."""
    known = model.output_datatypes
    for output in wanted or []:
        if output.name not in known:
            raise InvalidInput(
                f"requested output '{output.name}' is not an output of model '{model.name}' "
                f"(it has {sorted(known)})"
            )
        top_k = output.parameters.get("classification")
        if top_k is None:
            continue
        if not isinstance(top_k, int) or isinstance(top_k, bool) or top_k < 1:
            raise InvalidInput(
                f"output '{output.name}': parameter 'classification' must be an integer ≥ 1"
            )
        if known[output.name] == "BYTES" and output.name != CLASSIFICATION:
            raise InvalidInput(
                f"output '{output.name}' of model '{model.name}' holds BYTES: only an output of "
                "numbers can be classified"
            )


def _outputs(
    model: LoadedVersion,
    wanted: list[RequestedOutput] | None,
    outputs: dict[str, np.ndarray],
    answers: list[Any] | None,
) -> list[OutputTensor]:
    """The outputs a request asked for: by default the pipeline's answers where its code
    postprocesses, else every output the model offers; the classification extension's top-k
    strings where asked."""
    known = model.output_datatypes
    if wanted is None:
        if answers is not None:
            names = [ANSWER]
        else:
            names = [n for n in known if n != ANSWER or not model.answers]
        wanted = [RequestedOutput(name) for name in names]
    tensors = []
    for output in wanted:
        top_k = output.parameters.get("classification")
        if output.name == ANSWER and model.answers:
            answer = _answer_tensor(model, answers)
            tensors.append(OutputTensor(ANSWER, "BYTES", answer, output.parameters))
        elif (output.name == CLASSIFICATION and model.classifier is not None) or (
            top_k is not None
        ):
            data = _classify(model, outputs, output.name, top_k)
            tensors.append(OutputTensor(output.name, "BYTES", data, output.parameters))
        else:
            tensors.append(
                OutputTensor(
                    output.name, known[output.name], outputs[output.name], output.parameters
                )
            )
    return tensors


def _answer_tensor(model: LoadedVersion, answers: list[Any] | None) -> np.ndarray:
    """The pipeline's answers as a BYTES tensor: one JSON text per item."""
    if answers is None:
        raise InvalidInput(
            f"output '{ANSWER}' is what model '{model.name}''s pipeline answers for raw items; "
            "this request sent tensors"
        )
    array = np.empty(len(answers), dtype=object)
    try:
        array[:] = [json_answer(a) for a in answers]
    except (TypeError, OverflowError) as exc:  # orjson's JSONEncodeError is a TypeError
        kinds = sorted({type(a).__name__ for a in answers})
        raise ModelExecutionError(
            f"model '{model.name}': its pipeline's postprocess() answered what JSON cannot "
            f"hold ({', '.join(kinds)}: {exc})"
        ) from exc
    return array


def _classify(
    model: LoadedVersion, outputs: dict[str, np.ndarray], output: str, top_k: int | None
) -> np.ndarray:
    """The classification extension's strings for ``output``: the virtual ``classification``
    output and the output the config's postprocessing names, by its classifier (labels,
    softmax); any other output by its own values, best first, ``"value:index"`` as Triton
    writes an output without labels (it read the postprocessing's output instead, whichever
    output was asked)."""
    classifier = model.classifier
    if classifier is not None and output in (CLASSIFICATION, classifier.output):
        source = outputs[classifier.output]
        return classification_tensor(classifier, source if model.batched else source[None], top_k)
    values = as_values(outputs[output], model.output_datatypes[output])  # BF16: its floats
    return top_values(values if model.batched else values[None], top_k or 1)


class Budget(Protocol):
    """What the core takes from the server's budget
    (:class:`service.limits.admission.BytesBudget`)."""

    def take(self, size: int, already: int = 0) -> None: ...

    def hold_for_request(self, size: int) -> int: ...

    def release(self, size: int) -> None: ...


def row_bytes(model: LoadedVersion) -> int:
    """The bytes one row of the model's inputs holds: each input's shape with dynamic dims at
    the largest bucket (1 without buckets), times its item size (8 for BYTES: a reference)."""
    longest = max(model.config.shape_buckets(), default=1)
    total = 0
    for tensor in model.signature.inputs:
        dims = [dim if dim > 0 else longest for dim in tensor.shape]
        itemsize = 8 if tensor.datatype == "BYTES" else TO_NUMPY[tensor.datatype].itemsize
        total += math.prod(dims) * itemsize
    return total


class Call:
    """One inference request inside the core (:meth:`DataPlane.call`). A protocol adapter runs
    its own steps in order inside it: decode, :meth:`infer`, :meth:`encode`.

    A class rather than ``@contextmanager``: the generator would cost every request a few more
    calls (docs/performance.md, "Per-request bookkeeping")."""

    __slots__ = (
        "_arriving",
        "_held",
        "_in_use",
        "_observing",
        "asked",
        "dataplane",
        "model",
        "observation",
        "served",
        "version",
    )

    def __init__(
        self,
        dataplane: DataPlane,
        protocol: str,
        model: str,
        version: str | None,
        after: After | None = None,
    ):
        self._observing = dataplane.observer.observe(protocol, model, version, after)
        self.dataplane, self.model, self.asked = dataplane, model, version
        self._held = [0]  # bytes raw items took from the budget (DataPlane.prepare)

    def __enter__(self) -> Call:
        observation = self._observing.__enter__()
        try:
            found, served = self.dataplane.repository.ready_model(self.model, self.asked)
        except BaseException as exc:
            if isinstance(exc, ModelNotReady) and exc.version is not None:
                observation.version, observation.unserved = str(exc.version), True
            self._observing.__exit__(type(exc), exc, exc.__traceback__)
            raise
        observation.version, observation.served = str(found.version), served
        self.observation, self.served, self.version = observation, served, str(found.version)
        self._in_use = served.use()
        self._in_use.__enter__()
        served.arriving += 1  # on its way to the queue: the adaptive batcher waits for it
        self._arriving = True
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._arriving:  # failed (or was answered) before it reached the queue
            self.served.arriving -= 1
        self.dataplane.release(self._held)
        self._in_use.__exit__(kind, exc, tb)
        self._observing.__exit__(kind, exc, tb)

    async def infer(self, request: InferenceRequest) -> InferenceResult:
        """Run ``request`` on the version found: prepare, batch, run, crop, postprocess."""
        served, observation = self.served, self.observation
        loaded, timing = served.loaded, observation.timing
        _check_outputs(loaded, request.outputs)
        deadline = self.dataplane.deadline(request.timeout_s, request.parameters)
        alone = served.in_flight == 1
        trace = observation.trace
        preparing = 0 if trace is None else time.perf_counter_ns()
        try:
            prepared = await self.dataplane.prepare(
                loaded, request, alone, deadline, self._held, timing
            )
        except BaseException:  # a failed (or timed out) preprocessing: its time still shows
            timing.compute_input_ns = time.perf_counter_ns() - timing.started_ns
            raise
        if isinstance(prepared.work, dict):
            observation.rows = rows_of(prepared.work, loaded.batched)
            now = time.perf_counter_ns()
            timing.compute_input_ns = now - timing.started_ns
            if trace is not None:
                trace.stage("preprocess", preparing, now)
        else:
            observation.rows = 1  # made on the instance's thread, which times it
        served.arriving -= 1  # reaches the queue now (the decrement and the submit: no await)
        self._arriving = False
        outputs = await served.execute(prepared.work, timing, deadline)
        postprocessing = 0 if trace is None else time.perf_counter_ns()
        if prepared.crop:
            outputs = apply_crop(outputs, prepared.crop)
        parameters = dict(request.parameters)
        answers = None
        if prepared.contexts is not None:
            pipeline = loaded.pipeline
            assert pipeline is not None
            own = not isinstance(pipeline, BUILT_IN)  # a model's own code: in its pool, timed
            if not own:
                parameters.update(_guarded(pipeline.parameters, loaded.name, prepared.contexts))
            if own and (loaded.answers or overrides(pipeline, "parameters")):
                # within the request's deadline, as preprocess was: a deadline from here gave
                # postprocess and its steps a whole timeout more (1.4 s for a timeout of 1 s)
                started = time.perf_counter_ns()
                done = partial(_answer, pipeline, outputs, prepared.contexts, loaded)
                runner, gone = _code_context(deadline, timing)
                try:
                    said, answers = await self.dataplane.code_pool(loaded).run(
                        partial(runner, done), deadline, loaded.name, "postprocessing", gone
                    )
                finally:  # a failed (or timed out) postprocessing: its time still shows
                    timing.compute_output_ns += time.perf_counter_ns() - started
                parameters.update(said)
        tensors = _outputs(loaded, request.outputs, outputs, answers)
        if trace is not None:
            trace.stage("postprocess", postprocessing, time.perf_counter_ns())
        return InferenceResult(
            self.model,
            self.version,
            request.id,
            tensors,
            outputs,
            parameters,
            loaded.classifier,
            loaded.batched,
            answers,
            row_crops=prepared.row_crops,
        )

    def decode(self, work: int, decode: Callable[..., T], *args: Any) -> Awaitable[T]:
        """``decode(*args)``, the protocol's decoding of the request, offloaded by its ``work``
        (:meth:`DataPlane.offload`); a stage of the request's trace. Untraced, the offload
        itself is awaited: no coroutine of its own in between."""
        if self.observation.trace is None:
            return self.dataplane.offload(work, decode, *args)
        return self._decode_traced(self.observation.trace, work, decode, *args)

    async def _decode_traced(
        self, trace: RequestTrace, work: int, decode: Callable[..., T], *args: Any
    ) -> T:
        started = time.perf_counter_ns()
        decoded = await self.dataplane.offload(work, decode, *args)
        trace.stage("decode", started, time.perf_counter_ns())
        return decoded

    async def encode(
        self, encode: Callable[..., T], result: InferenceResult, *args: Any, pooled: bool = False
    ) -> T:
        """``encode(result, *args)``, timed as the request's postprocessing. ``pooled``: in the
        thread pool when the outputs are large (gRPC: building and serializing a 60 MiB answer
        on the event loop held every other request for tens of milliseconds each; REST's JSON:
        20 M values held them for 0.64 s). A REST binary answer stays on the loop: it is one
        copy of its outputs, and pooled, the round-three dynamic-dims test's RSS stayed more
        than 10 % up after 30 MiB answers (likely glibc's per-thread arenas; not proven)."""
        started = time.perf_counter_ns()
        try:
            size = answer_bytes(result)
            budget = self.dataplane.budget
            # A REST answer is counted from when it starts being made (large ones wait their
            # turn uncounted): made first and counted after, each answer of 61 MiB was held
            # beside its outputs and body uncounted; the answer made is counted in its place
            estimate = JSON_ANSWER_PER_BYTE * size if pooled else size
            starting = int if budget is None else partial(budget.hold_for_request, estimate)
            return await self.dataplane.offload(
                size if pooled else 0, encode, result, *args, starting=starting
            )
        finally:
            ended = time.perf_counter_ns()
            self.observation.timing.compute_output_ns += ended - started
            if (trace := self.observation.trace) is not None:
                trace.stage("encode", started, ended)


JSON_ANSWER_PER_BYTE = 4
"""What a JSON answer is taken to hold while it is made, per byte of its outputs: a float32
value is up to 16 bytes of text (``-1.2345679e-05,``)."""


def answer_bytes(result: InferenceResult) -> int:
    """What a result's outputs hold: the bytes an encoder goes through, at least (a loop, not
    a generator: asked of every JSON answer). A BYTES output counts its elements' lengths: its
    ``nbytes`` is 8 an element (the pointers), whatever the strings hold."""
    if result.size is not None:  # a BYTES output's is a walk of its strings: asked once
        return result.size
    total = 0
    for output in result.outputs:
        data = output.data
        total += data.nbytes if data.dtype != object else _object_bytes(data)
    result.size = total
    return total


def _object_bytes(data: np.ndarray) -> int:
    """An object array's bytes: its pointers, and the length of each bytes or str element."""
    try:
        return data.nbytes + sum(map(len, data.flat))  # 1M strings: 0.03 s, not 0.15
    except TypeError:  # an element without a length (BYTES outputs are bytes or str)
        return data.nbytes + sum(len(x) for x in data.flat if isinstance(x, bytes | str))


def _fitted(
    model: LoadedVersion, batch: dict[str, np.ndarray], contexts: list[dict[str, Any]] | None = None
) -> Prepared:
    """A checked batch fitted to the model's buckets (padded, with the crop that undoes it)."""
    if not model.shapes.axes:  # the common case, with no dynamic dim: nothing to fit
        return Prepared(batch, contexts)
    fitted, crop = model.shapes.fit(batch, model.name)
    return Prepared(fitted, contexts, crop or None)


def _items(model: LoadedVersion, request: InferenceRequest) -> list[Item] | None:
    """The request's raw items for the model's pipeline, or None when it sent tensors (or
    rows) for the model itself."""
    pipeline = model.pipeline
    if pipeline is None:
        # JSON texts come as rows too: read against the model's inputs, a 400 names them
        if request.raw_in_json:  # all b64 (raw), or some (rows)
            raise InvalidInput(
                f"model '{model.name}' has no preprocessing to decode b64 instances; send "
                f'its inputs as {{"instances": [...]}} rows of numbers, or tensors to '
                f"/v2/models/{model.name}/infer"
            )
        if request.raw is not None and request.rows is None:
            raise UnsupportedMediaType(
                f"model '{model.name}' has no preprocessing; send tensors to "
                f'/v2/models/{model.name}/infer or {{"instances": [...]}} rows'
            )
        return None
    if request.rows is not None and pipeline.json_items:  # a {"b64": ...} one: its bytes
        return [Item(row) if isinstance(row, bytes) else Item(value=row) for row in request.rows]
    if request.raw is not None:
        return [Item(item, request.raw_type) for item in request.raw]
    if request.rows is not None and (named_raw := _named_raw(request.rows, pipeline.raw_input)):
        return named_raw
    if request.rows is not None and isinstance(pipeline, TextInput):
        # texts are strings; objects are rows of the model's own inputs (token ids)
        odd = next((i for i, r in enumerate(request.rows) if not isinstance(r, str | dict)), None)
        if odd is not None:
            row = request.rows[odd]  # a {"b64": ...} object is decoded to bytes by then
            what = 'a {"b64": ...} object' if isinstance(row, bytes) else json_kind(row)
            raise InvalidInput(
                f"model '{model.name}' takes texts: send each instance as a string "
                f"(instances[{odd}] is {what})"
            )
    if request.rows is not None and request.raw_in_json:
        raise InvalidInput(
            f"model '{model.name}' takes encoded items: send every instance as {{\"b64\": ...}}"
        )
    named = [t for t in request.inputs if t.name == pipeline.raw_input]
    if not named:
        return None
    if len(request.inputs) != 1:
        raise InvalidInput(
            f"input '{pipeline.raw_input}' feeds the model's preprocessing: send it "
            f"alone, not with {[t.name for t in request.inputs if t is not named[0]]}"
        )
    return [Item(item) for item in encoded_items(named[0], model.name)]


def _named_raw(rows: list[Any], raw: str) -> list[Item] | None:
    """v1 rows that name the pipeline's raw input (TF Serving's form, the input in the model's
    metadata: ``{"input_bytes": {"b64": ...}}``, ``{"text": "..."}``) → its items; None when no
    row names it. Its metadata lists the input, which the rows were told the model lacked."""
    if not any(isinstance(row, dict) and raw in row for row in rows):
        return None
    items = []
    for index, row in enumerate(rows):
        if not isinstance(row, dict) or raw not in row:
            raise InvalidInput(
                f"instances[{index}] does not name input '{raw}' as the other instances do"
            )
        if len(row) > 1:
            others = sorted(key for key in row if key != raw)
            raise InvalidInput(
                f"instances[{index}]: input '{raw}' feeds the model's preprocessing: send it "
                f"alone, not with {others}"
            )
        try:
            items.append(Item(json_bytes(row[raw])))
        except ValueError as exc:
            raise InvalidInput(f"instances[{index}].{raw}: {exc}") from None
    return items


def _code_context(
    deadline: float, timing: RequestTiming | None = None
) -> tuple[Callable[[Callable[[], T]], T], threading.Event]:
    """A runner of a model's own code in a context that knows the request's deadline, whether
    it is gone and its timing, so that the steps the code calls (:mod:`service.core.steps`)
    carry all three; and the event that says it is gone."""
    gone = threading.Event()
    context = contextvars.copy_context()
    context.run(DEADLINE.set, deadline)
    context.run(GONE.set, gone)
    context.run(CALLER.set, timing)
    return context.run, gone


def _guarded(fn: Callable[..., T], model: str, *args: Any) -> T:
    """``fn(*args)`` with the pipeline's :class:`BadInput` as the client's 400, naming the model;
    anything else it raises is a bug of the pipeline's, answered 500 and logged. That includes
    ``SystemExit`` and ``KeyboardInterrupt`` (a helper's ``sys.exit()``): raised through a
    future into the event loop they stopped the server, every model with it."""
    try:
        return fn(*args)
    except BadInput as exc:
        raise InvalidInput(f"model '{model}': {exc}") from None
    except ItemsDiffer as exc:
        raise ModelExecutionError(f"model '{model}': its pipeline's {exc}") from None
    except (SystemExit, KeyboardInterrupt) as exc:
        raise RuntimeError(f"model '{model}': its code raised {type(exc).__name__}") from exc


def _made(made: Any, model: str, method: str) -> Arrays:
    """What the pipeline's ``method`` returned, if it is what it must be: input name → array."""
    if not isinstance(made, Mapping) or not all(isinstance(a, np.ndarray) for a in made.values()):
        what = type(made).__name__
        if isinstance(made, Mapping):
            what = "a dict of " + ", ".join(sorted({type(a).__name__ for a in made.values()}))
        raise ModelExecutionError(
            f"model '{model}': its pipeline's {method}() returned {what}, not a dict of numpy "
            "arrays by input name"
        )
    return made if type(made) is dict else dict(made)


def _preprocess_into(
    pipeline: Pipeline, item: Item, context: dict[str, Any], model: str, into: Rows, index: int
) -> None:
    made = _guarded(which_item, model, pipeline.preprocess, index, into.count, item, context)
    into.put(index, _made(made, model, "preprocess"))


def _preprocess(
    pipeline: Pipeline, items: list[Item], contexts: list[dict[str, Any]], model: LoadedVersion
) -> dict[str, np.ndarray]:
    """Items → the model's batch, in the calling thread (the pool's or the instance's)."""
    made = _made(
        _guarded(pipeline.preprocess_batch, model.name, items, contexts),
        model.name,
        "preprocess_batch",
    )
    # a row an item: each item's answer is its row of the outputs
    rows = {name: array.shape[0] if array.ndim else 0 for name, array in made.items()}
    if any(count != len(items) for count in rows.values()):
        raise ModelExecutionError(
            f"model '{model.name}': its pipeline's preprocess_batch() made {rows} rows for "
            f"{len(items)} items; it must make one row an item"
        )
    return _as_batch(model, made)


def _as_batch(model: LoadedVersion, batch: Arrays) -> dict[str, np.ndarray]:
    """A pipeline's batch as the model takes it: without the batch dim for a model that has
    none (one item, as ``check_rows`` made sure)."""
    return batch if model.batched else {name: array[0] for name, array in batch.items()}


def _answer(
    pipeline: Pipeline,
    outputs: dict[str, np.ndarray],
    contexts: list[dict[str, Any]],
    model: LoadedVersion,
) -> tuple[dict[str, Any], list[Any] | None]:
    """A model's own code on the outputs (in its pool: it may be slow): the parameters its
    pipeline answers with (on the loop, a ``parameters()`` that slept held every model's
    requests), then each item's answer where it postprocesses."""
    said = _guarded(pipeline.parameters, model.name, contexts)
    return said, _postprocess(pipeline, outputs, contexts, model) if model.answers else None


def _postprocess(
    pipeline: Pipeline,
    outputs: dict[str, np.ndarray],
    contexts: list[dict[str, Any]],
    model: LoadedVersion,
) -> list[Any]:
    """Each item's answer from its row of the outputs (in the pool: the code may be slow)."""
    if not model.batched:
        return [_guarded(pipeline.postprocess, model.name, outputs, contexts[0])]
    return [
        _guarded(pipeline.postprocess, model.name, {k: v[i] for k, v in outputs.items()}, context)
        for i, context in enumerate(contexts)
    ]
