"""Server and model metadata."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Response
from pydantic import BaseModel

from service.api.deps import DataPlaneDep, json_response

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
    reason: str | None = None
    verified: bool | None = None
    extra: dict[str, Any] | None = None


@router.get("/v2", response_model=ServerMetadata)
async def server_metadata(dataplane: DataPlaneDep) -> Response:
    return json_response(dataplane.server_metadata())


@router.get("/v2/models/{name}", response_model=ModelMetadata)
@router.get("/v2/models/{name}/versions/{version}", response_model=ModelMetadata)
async def model_metadata(
    dataplane: DataPlaneDep, name: str, version: str | None = None
) -> Response:
    return json_response(dataplane.model_metadata(name, version))
