"""``create_app(settings)``: the FastAPI application and its lifespan.

Start: scan the repository → load every version in the background (artifact → gates → warmup)
→ ready. The HTTP server answers from the first moment, so that ``/v2/health/live`` is 200 and
``/v2/health/ready`` is 503 while models load. Stop: unload in reverse.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import time
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING

from fastapi import FastAPI, Request, Response
from fastapi.exceptions import RequestValidationError
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from preprocessing.halves import matches_pillow
from preprocessing.image import hold_decoding_with
from service import PROCESS_STARTED, __version__
from service.artifacts.pins import check_pinned
from service.cluster.control import ControlServer, Siblings, follow_siblings
from service.cluster.supervisor import Worker
from service.cluster.view import Cluster
from service.core.dataplane import DataPlane
from service.core.steps import Steps
from service.errors import TensorgateError
from service.grpc.server import start_grpc
from service.http import routers
from service.http.answer import CLIENT_GONE, Answer, ClientGone, error_answer
from service.http.fast import InferFastPath
from service.limits.admission import BodyBudget, BytesBudget, DecodeGate, error_body
from service.limits.memory import Trimmer
from service.repository.models import ModelRepository
from service.resources import SECOND_THREAD, SecondThread
from service.settings import Settings
from service.telemetry import tracing
from service.telemetry.logs import REQUEST_ID, request_id_for
from service.telemetry.metrics import Metrics
from service.telemetry.observation import Drain, Observer

if TYPE_CHECKING:
    from opentelemetry.sdk.trace.export import SpanExporter

log = logging.getLogger("tensorgate.app")


def create_app(settings: Settings, span_exporter: SpanExporter | None = None) -> FastAPI:
    """The application for ``settings``; nothing is loaded until its lifespan starts.
    ``span_exporter``: where traces go, instead of what the ``OTEL_*`` environment names (and
    tracing on whatever it says)."""
    budget = BytesBudget(settings.max_inflight_bytes)
    """Request bodies and gRPC messages in flight, both protocols together."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        check_pinned(settings)
        _enable_second_thread(settings)
        tracing.start(settings.tracing, __version__, span_exporter)
        repository = ModelRepository(settings)
        drain = Drain()
        metrics = Metrics(repository, lambda: drain.in_flight)
        repository.steps = Steps(
            repository, asyncio.get_running_loop(), settings.request_timeout_s, metrics
        )
        repository.budget = budget  # batches of several requests hold their copy in it
        repository.scan()
        pool = ThreadPoolExecutor(settings.preprocess_threads, thread_name_prefix="preprocess")
        observer = Observer(repository, metrics, drain, settings.access_log)
        app.state.dataplane = DataPlane(repository, settings, pool, observer, drain)
        app.state.dataplane.budget = budget  # what raw items decode into is held in it too
        app.state.cluster = Cluster(app.state.dataplane)
        trimmer = Trimmer(budget)  # what the budget lets go goes back to the system
        trimmer.start()
        loading = asyncio.create_task(asyncio.to_thread(_load, repository))
        loading.add_done_callback(lambda _: start_schedulers(repository))
        polling = None
        if settings.poll_interval_s is not None:
            polling = asyncio.create_task(_poll(app.state.dataplane, settings.poll_interval_s))
        # In this event loop, beside uvicorn's: one DataPlane, one Drain, shared schedulers.
        # gRPC's messages count in the budget REST bodies are held in
        worker = Worker.from_environment()
        replacement = worker is not None and worker.replacement
        grpc_server = None
        if settings.grpc_port and not replacement:
            grpc_server = await start_grpc(app.state.cluster, budget)
        control = None
        if worker is not None:  # one of several processes: answer the others, ask them
            control = ControlServer(app.state.dataplane, worker)
            await control.start()
            app.state.cluster.siblings = siblings = Siblings(worker)
            if worker.replacement:
                # Uvicorn listens once this returns, and gRPC binds below: the kernel gives a
                # replacement no connection, on either protocol, before its models serve, and
                # it serves only what its siblings serve (a model unloaded stays unloaded).
                await asyncio.shield(loading)
                await follow_siblings(app.state.dataplane, siblings)
                if settings.grpc_port:
                    grpc_server = await start_grpc(app.state.cluster, budget)
        # Images being decoded hold at most the budget's worth together (or one image).
        decoding = DecodeGate(settings.max_inflight_bytes).holding
        hold_decoding_with(decoding)
        try:
            yield
        finally:
            hold_decoding_with(None, only=decoding)
            if control is not None:
                await control.close()
            if grpc_server is not None:
                # The drain has already waited for accepted calls; this bounds any stragglers.
                await grpc_server.stop(settings.drain_grace_s)
            if polling is not None:
                polling.cancel()
            repository.stopping.set()  # a load under way stops at its next warmup batch
            await asyncio.shield(loading)
            # close() waits on schedulers running in this loop: it must run off the loop.
            await asyncio.to_thread(repository.close)
            pool.shutdown(wait=True)
            await asyncio.to_thread(tracing.stop)  # exports what is buffered
            trimmer.stop()
            log.info("stopped")

    app = FastAPI(
        title="tensorgate",
        version=__version__,
        summary="Open Inference Protocol (KServe v2) server for TorchScript and ONNX models",
        lifespan=lifespan,
        # /v2/health/ready/ is a 404 naming the route, not a 307 to a Location built from the
        # request's Host header (another host's, for whoever sets it)
        redirect_slashes=False,
        # FastAPI's OpenTelemetry hooks look up the global providers on every request (a
        # visible share of the event loop under load, docs/performance.md); tensorgate exports
        # its own Prometheus metrics.
        telemetry={"tracing": False, "metrics": False, "logs": False},
    )
    app.state.body_budget = budget  # serving_app holds REST bodies in it
    for routes in routers(settings):
        app.include_router(routes)
    _install_error_handlers(app)
    app.add_middleware(RequestIdMiddleware)
    return app


def serving_app(app: FastAPI, settings: Settings) -> ASGIApp:
    """What uvicorn runs: the app, its inference routes answered on plain ASGI, under the
    server-wide budget for request bodies."""
    budget: BytesBudget = app.state.body_budget
    return BodyBudget(InferFastPath(app), budget)


class RequestIdMiddleware:
    """Takes ``X-Request-ID`` (or makes one), returns it, and puts it in every log line.

    Plain ASGI rather than BaseHTTPMiddleware, which would buffer every body through a task.
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request_id = request_id_for(Headers(scope=scope).get("x-request-id", ""))
        header = (b"x-request-id", request_id.encode())

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []), header]
            await send(message)

        # Each request runs in its own task, so this value is the request's own; it is not
        # reset so that Starlette's outermost error handler can still read it.
        REQUEST_ID.set(request_id)
        await self.app(scope, receive, send_with_id)


async def _poll(dataplane: DataPlane, interval_s: float) -> None:
    """``--poll``: load models whose folder changed (new versions swap in once ready)."""
    repository = dataplane.repository
    while True:
        await asyncio.sleep(interval_s)
        if not repository.loading_done.is_set():
            continue
        try:
            await _poll_once(dataplane)
        except Exception:  # one bad folder must not end polling for good: log, try next time
            log.exception(
                "poll: the repository could not be read; trying again in %g s", interval_s
            )


async def _poll_once(dataplane: DataPlane) -> None:
    repository = dataplane.repository
    changed, gone = await asyncio.to_thread(repository.changes)
    for name in changed:
        try:
            await dataplane.load_model(name, polled=True)
            log.info("poll: model %s reloaded", name)
        except TensorgateError as exc:
            log.error("poll: model %s did not load: %s", name, exc.message)
    for name in gone:
        await dataplane.unload_model(name, requested=False)
        log.info("poll: model %s unloaded (its folder is gone)", name)


def _settle_heap() -> None:
    """Move everything loading made (modules, models, tokenizers) out of the garbage
    collector's sight, and collect young objects less often.

    Under load, objects that live across a few collections (bodies, futures, arrays of requests
    in flight) are promoted to the oldest generation, and each full collection then walked every
    object the process holds, and those pauses were the p99 (docs/performance.md). Frozen
    objects are never walked; they are never freed either, which is what objects loaded for the
    life of the process want.
    """
    gc.collect()
    gc.freeze()
    gc.set_threshold(*_GC_THRESHOLDS)


_GC_THRESHOLDS = (10_000, 20, 20)


def start_schedulers(repository: ModelRepository) -> None:
    """Start the scheduler of every ready version (in the event loop, where they run)."""
    for _, served in repository.served_versions():
        served.start()


def _load(repository: ModelRepository) -> None:
    repository.load_all()
    _settle_heap()
    parts = {"load_s": 0.0, "gates_s": 0.0, "warmup_s": 0.0}
    for _, served in repository.served_versions():
        for part in parts:
            parts[part] += served.loaded.timings[part]
    total = time.perf_counter() - PROCESS_STARTED
    states = {
        name: {v.version: v.state.value for v in entry.versions.values()} or entry.error
        for name, entry in list(repository.models.items())
    }
    # One line a Kubernetes operator can size a startupProbe from: total and its parts.
    log.info(
        "startup finished: %.2f s from process start to models loaded (load %.2f s, gates "
        "%.2f s, warmup %.2f s, the rest imports and server start): %s",
        total,
        parts["load_s"],
        parts["gates_s"],
        parts["warmup_s"],
        states,
        extra={"startup_s": round(total, 3), **{k: round(v, 3) for k, v in parts.items()}},
    )


def _install_error_handlers(app: FastAPI) -> None:
    """The routes' errors, mapped as the inference routes map theirs (one mapping)."""

    @app.exception_handler(TensorgateError)
    async def tensorgate_error(request: Request, exc: TensorgateError) -> Response:
        return _response(error_answer(exc, f"{request.method} {request.url.path}"))

    @app.exception_handler(ClientGone)
    async def client_left(request: Request, exc: ClientGone) -> Response:
        return Response(status_code=CLIENT_GONE)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> Response:
        message = exc.detail if exc.status_code != 404 else f"no route {request.url.path}"
        return _response(Answer(exc.status_code, error_body(str(message)), dict(exc.headers or {})))

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> Response:
        return _response(Answer(400, error_body(f"invalid request: {exc.errors()}")))

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception) -> Response:
        answer = error_answer(exc, f"{request.method} {request.url.path}")
        # Starlette answers this one from its outermost middleware, outside RequestIdMiddleware:
        # the header is set here, as every other response gets it.
        answer.headers["x-request-id"] = REQUEST_ID.get() or ""
        return _response(answer)


def _response(answer: Answer) -> Response:
    return Response(answer.body, answer.status, answer.headers, media_type="application/json")


def _enable_second_thread(settings: Settings, second: SecondThread = SECOND_THREAD) -> None:
    """Give a lone image's resize a second thread (:class:`service.resources.SecondThread`)
    when the server may use two CPUs or more and the installed Pillow resizes as the halves
    assume (``preprocessing.halves.matches_pillow``); else take it away."""
    if not settings.resize_halves or settings.cpus < 2:
        second.set(False)
        return
    if not matches_pillow():
        log.warning(
            "this Pillow resizes in an order preprocessing.halves does not know: images are "
            "resized on one thread (the same pixels, slower for a request alone)"
        )
        second.set(False)
        return
    second.set(True)
