"""The model_repository extension: index, load and unload. Mounted only with an admin token."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request, Response

from service.http.answer import cluster_of, dataplane_of, json_response, read_body
from service.limits.auth import require_admin

router = APIRouter(tags=["repository"], dependencies=[Depends(require_admin)])


@router.post("/v2/repository/index")
async def index(request: Request) -> Response:
    dataplane = dataplane_of(request)
    return json_response(dataplane.repository.index())


@router.post("/v2/repository/models/{name}/load")
async def load(request: Request, name: str) -> Response:
    await read_body(request, 1024 * 1024)  # parameters are accepted and not needed
    await cluster_of(request).load_model(name)
    return json_response({})


@router.post("/v2/repository/models/{name}/unload")
async def unload(request: Request, name: str) -> Response:
    await read_body(request, 1024 * 1024)
    await cluster_of(request).unload_model(name)
    return json_response({})
