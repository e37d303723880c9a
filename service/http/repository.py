"""The model_repository extension: index, load and unload. Mounted only with an admin token."""

from __future__ import annotations

from typing import Any

import orjson
from fastapi import APIRouter, Depends, Request, Response

from service.errors import InvalidInput
from service.http.answer import cluster_of, dataplane_of, json_response, read_body
from service.limits.auth import require_admin
from service.repository.models import check_load_parameters, check_unload_parameters

router = APIRouter(tags=["repository"], dependencies=[Depends(require_admin)])

MAX_BODY = 1024 * 1024


async def _request(request: Request, what: str) -> dict[str, Any]:
    """The request's JSON object (none sent: an empty one); 400 for anything else."""
    body = await read_body(request, MAX_BODY)
    if not body.strip():
        return {}
    try:
        parsed = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise InvalidInput(f"the {what} request is not valid JSON: {exc}") from None
    if not isinstance(parsed, dict):
        raise InvalidInput(f"the {what} request must be a JSON object")
    return parsed


def _parameters(request: dict[str, Any], what: str) -> dict[str, Any]:
    parameters = request.get("parameters", {})
    if not isinstance(parameters, dict):
        raise InvalidInput(f"the {what} request's 'parameters' must be an object")
    return parameters


@router.post("/v2/repository/index")
async def index(request: Request) -> Response:
    asked = await _request(request, "index")
    ready = asked.get("ready", False)
    if not isinstance(ready, bool):
        raise InvalidInput("the index request's 'ready' must be true or false")
    rows = dataplane_of(request).repository.index()
    if ready:  # only the models that can take requests now
        rows = [row for row in rows if row["state"] == "READY"]
    return json_response(rows)


@router.post("/v2/repository/models/{name}/load")
async def load(request: Request, name: str) -> Response:
    check_load_parameters(_parameters(await _request(request, "load"), "load"))
    await cluster_of(request).load_model(name)
    return json_response({})


@router.post("/v2/repository/models/{name}/unload")
async def unload(request: Request, name: str) -> Response:
    check_unload_parameters(_parameters(await _request(request, "unload"), "unload"))
    await cluster_of(request).unload_model(name)
    return json_response({})
