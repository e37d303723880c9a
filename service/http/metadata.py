"""Server and model metadata, model configuration and statistics."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request, Response
from pydantic import BaseModel

from service.http.answer import cluster_of, dataplane_of, json_response
from service.limits.auth import require_api
from service.repository import metadata

router = APIRouter(tags=["metadata"])


class ServerMetadata(BaseModel):
    name: str
    version: str
    extensions: list[str]


class TensorMetadata(BaseModel):
    name: str
    datatype: str
    shape: list[int]


class ModelMetadata(BaseModel):
    name: str
    versions: list[str]
    platform: str
    inputs: list[TensorMetadata]
    outputs: list[TensorMetadata]
    state: str
    version: str | None = None
    reason: str | None = None
    verified: bool | None = None
    device: str | None = None
    warnings: list[str] | None = None
    load_timings_s: dict[str, float] | None = None
    warmup_timings_s: dict[str, float] | None = None
    queue: dict[str, int] | None = None


class ModelStatistics(BaseModel):
    model_stats: list[dict[str, Any]]


@router.get("/v2", response_model=ServerMetadata)
@router.get("/v2/", response_model=ServerMetadata, include_in_schema=False)
async def server_metadata(request: Request) -> Response:
    require_api(request)
    dataplane = dataplane_of(request)
    return json_response(metadata.server(dataplane.settings))


@router.get("/v2/models/stats", response_model=ModelStatistics)
async def all_statistics(request: Request) -> Response:
    require_api(request)
    return json_response(await cluster_of(request).statistics(None, None))


@router.get("/v2/models/{name}", response_model=ModelMetadata)
@router.get("/v2/models/{name}/versions/{version}", response_model=ModelMetadata)
async def model_metadata(request: Request, name: str, version: str | None = None) -> Response:
    require_api(request)
    dataplane = dataplane_of(request)
    return json_response(metadata.model(dataplane.repository, name, version))


@router.get("/v2/models/{name}/config")
@router.get("/v2/models/{name}/versions/{version}/config")
async def model_config(request: Request, name: str, version: str | None = None) -> Response:
    require_api(request)
    dataplane = dataplane_of(request)
    return json_response(metadata.config(dataplane.repository, name, version))


@router.get("/v2/models/{name}/stats", response_model=ModelStatistics)
@router.get("/v2/models/{name}/versions/{version}/stats", response_model=ModelStatistics)
async def model_statistics(request: Request, name: str, version: str | None = None) -> Response:
    require_api(request)
    return json_response(await cluster_of(request).statistics(name, version))
