"""``create_app(settings)``: the FastAPI application and its lifespan.

Start: scan the repository → load every version in the background (artifact → gates → warmup)
→ ready. The HTTP server answers from the first moment, so that ``/v2/health/live`` is 200 and
``/v2/health/ready`` is 503 while models load. Stop: unload in reverse.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request, Response
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException

from service import __version__
from service.api import router
from service.api.deps import json_response
from service.dataplane import DataPlane
from service.errors import TensorgateError
from service.repository import ModelRepository
from service.settings import Settings

log = logging.getLogger("tensorgate.app")


def create_app(settings: Settings) -> FastAPI:
    """The application for ``settings``; nothing is loaded until its lifespan starts."""
    started = time.perf_counter()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        repository = ModelRepository(settings)
        repository.scan()
        pool = ThreadPoolExecutor(settings.preprocess_threads, thread_name_prefix="preprocess")
        app.state.dataplane = DataPlane(repository, settings, pool)
        loading = asyncio.create_task(asyncio.to_thread(_load, repository, started))
        try:
            yield
        finally:
            await asyncio.shield(loading)
            pool.shutdown(wait=True)
            repository.close()
            log.info("stopped")

    app = FastAPI(
        title="tensorgate",
        version=__version__,
        summary="Open Inference Protocol (KServe v2) server for TorchScript and ONNX models",
        lifespan=lifespan,
    )
    app.include_router(router())
    _install_error_handlers(app)
    return app


def _load(repository: ModelRepository, started: float) -> None:
    repository.load_all()
    log.info(
        "startup finished in %.2fs: %s",
        time.perf_counter() - started,
        {
            name: {v.version: v.state.value for v in entry.versions.values()} or entry.error
            for name, entry in repository.models.items()
        },
    )


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(TensorgateError)
    async def tensorgate_error(request: Request, exc: TensorgateError) -> Response:
        if exc.status >= 500 and exc.status != 503:
            log.error("%s %s failed: %s", request.method, request.url.path, exc.message)
        return json_response({"error": exc.message}, exc.status, exc.headers)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> Response:
        message = exc.detail if exc.status_code != 404 else f"no route {request.url.path}"
        return json_response({"error": str(message)}, exc.status_code, exc.headers)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> Response:
        return json_response({"error": f"invalid request: {exc.errors()}"}, 400)

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception) -> Response:
        incident = uuid.uuid4().hex[:12]
        log.exception("%s %s: internal error %s", request.method, request.url.path, incident)
        return json_response(
            {"error": f"internal server error (incident {incident}); see the server log"}, 500
        )
