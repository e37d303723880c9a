"""Liveness and readiness: 200 or 503, always with a JSON body (for status- and body-readers)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request, Response
from pydantic import BaseModel

from service import workers
from service.api.auth import require_api
from service.api.http import dataplane_of, json_response
from service.dataplane import DataPlane

router = APIRouter(tags=["health"])


class LiveResponse(BaseModel):
    live: bool
    reason: str | None = None


class StartedResponse(BaseModel):
    started: bool
    reason: str | None = None


class ReadyResponse(BaseModel):
    ready: bool
    reason: str | None = None


class ModelReadyResponse(BaseModel):
    name: str
    ready: bool


_NOT_READY: dict[int | str, dict[str, Any]] = {
    503: {"model": ReadyResponse, "description": "Not ready"}
}


def _checked(request: Request) -> DataPlane:
    dataplane = dataplane_of(request)
    if dataplane.settings.protect_health_and_metrics:
        require_api(request)
    return dataplane


def _probe(key: str, answer: tuple[bool, str]) -> Response:
    ok, reason = answer
    if ok:
        return json_response({key: True})
    return json_response({key: False, "reason": reason}, 503)


@router.get(
    "/v2/health/live",
    response_model=LiveResponse,
    responses={503: {"model": LiveResponse, "description": "An instance is stuck"}},
)
async def live(request: Request) -> Response:
    return _probe("live", await workers.probe(_checked(request), "live"))


@router.get(
    "/v2/health/startup",
    response_model=StartedResponse,
    responses={503: {"model": StartedResponse, "description": "Models are still loading"}},
)
async def startup(request: Request) -> Response:
    """True once every model has been loaded or refused: what a Kubernetes startupProbe asks.
    Readiness stays false for a refused model (strict readiness), without a restart."""
    return _probe("started", await workers.probe(_checked(request), "started"))


@router.get("/v2/health/ready", response_model=ReadyResponse, responses=_NOT_READY)
async def ready(request: Request) -> Response:
    return _probe("ready", await workers.probe(_checked(request), "ready"))


@router.get("/v2/models/{name}/ready", response_model=ModelReadyResponse, responses=_NOT_READY)
@router.get(
    "/v2/models/{name}/versions/{version}/ready",
    response_model=ModelReadyResponse,
    responses=_NOT_READY,
)
async def model_ready(request: Request, name: str, version: str | None = None) -> Response:
    ok = await workers.model_ready(_checked(request), name, version)
    return json_response({"name": name, "ready": ok}, 200 if ok else 503)
