"""Liveness and readiness: 200 or 503, always with a JSON body (for status- and body-readers)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request, Response
from pydantic import BaseModel

from service.cluster.view import Cluster
from service.http.answer import cluster_of, dataplane_of, json_response
from service.limits.auth import require_api

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


def _checked(request: Request) -> Cluster:
    if dataplane_of(request).settings.protect_health_and_metrics:
        require_api(request)
    return cluster_of(request)


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
    return _probe("live", await _checked(request).probe("live"))


@router.get(
    "/v2/health/startup",
    response_model=StartedResponse,
    responses={503: {"model": StartedResponse, "description": "Models are still loading"}},
)
async def startup(request: Request) -> Response:
    """True once every model has been loaded or refused: what a Kubernetes startupProbe asks.
    Readiness stays false for a refused model (strict readiness), without a restart."""
    return _probe("started", await _checked(request).probe("started"))


@router.get("/v2/health/ready", response_model=ReadyResponse, responses=_NOT_READY)
async def ready(request: Request) -> Response:
    return _probe("ready", await _checked(request).probe("ready"))


@router.get("/v2/models/{name}/ready", response_model=ModelReadyResponse, responses=_NOT_READY)
@router.get(
    "/v2/models/{name}/versions/{version}/ready",
    response_model=ModelReadyResponse,
    responses=_NOT_READY,
)
async def model_ready(request: Request, name: str, version: str | None = None) -> Response:
    ok = await _checked(request).model_ready(name, version)
    return json_response({"name": name, "ready": ok}, 200 if ok else 503)
