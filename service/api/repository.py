"""The model_repository extension: index, load and unload. Mounted only with an admin token."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request, Response

from service import workers
from service.api.auth import require_admin
from service.api.http import dataplane_of, json_response, read_body

router = APIRouter(tags=["repository"], dependencies=[Depends(require_admin)])


@router.post("/v2/repository/index")
async def index(request: Request) -> Response:
    dataplane = dataplane_of(request)
    return json_response(dataplane.repository.index())


@router.post("/v2/repository/models/{name}/load")
async def load(request: Request, name: str) -> Response:
    dataplane = dataplane_of(request)
    await read_body(request, 1024 * 1024)  # parameters are accepted and not needed
    await workers.load_model(dataplane, name)
    return json_response({})


@router.post("/v2/repository/models/{name}/unload")
async def unload(request: Request, name: str) -> Response:
    dataplane = dataplane_of(request)
    await read_body(request, 1024 * 1024)
    await workers.unload_model(dataplane, name)
    return json_response({})
