"""Inference: Open Inference Protocol ``infer`` and the v1 ``predict`` convenience route."""

from __future__ import annotations

from fastapi import APIRouter, Request, Response

from service.api.auth import require_api
from service.api.deps import (
    client_gone,
    dataplane_of,
    json_response,
    read_body,
    request_timeout,
    until_disconnect,
)
from service.protocol.v2 import HEADER_LENGTH, parse_header_length

router = APIRouter(tags=["inference"])

_INFER_BODY = {
    "requestBody": {
        "required": True,
        "content": {
            "application/json": {"schema": {"type": "object"}},
            "application/octet-stream": {"schema": {"type": "string", "format": "binary"}},
        },
    }
}


# Two functions rather than one with ``version: str | None = None``: on the unversioned path
# FastAPI would treat the default as a query parameter and parse the query string every request.
@router.post("/v2/models/{name}/infer", openapi_extra=_INFER_BODY)
async def infer(request: Request, name: str) -> Response:
    return await _infer(request, name, None)


@router.post("/v2/models/{name}/versions/{version}/infer", openapi_extra=_INFER_BODY)
async def infer_version(request: Request, name: str, version: str) -> Response:
    return await _infer(request, name, version)


async def _infer(request: Request, name: str, version: str | None) -> Response:
    require_api(request)
    dataplane = dataplane_of(request)
    body = await read_body(request, dataplane.settings.max_body_bytes)
    header_length = parse_header_length(request.headers.get(HEADER_LENGTH), len(body))
    answer = await until_disconnect(
        request.receive,
        dataplane.infer(name, version, body, header_length, request_timeout(request)),
    )
    if answer is None:
        return client_gone()
    content, headers = answer
    return Response(content, headers=headers)


_V1_BODY = {
    "requestBody": {
        "required": True,
        "content": {
            "application/json": {"schema": {"type": "object"}},
            "image/*": {"schema": {"type": "string", "format": "binary"}},
        },
    }
}


@router.post("/v1/models/{name}:predict", openapi_extra=_V1_BODY)
async def predict(request: Request, name: str) -> Response:
    require_api(request)
    dataplane = dataplane_of(request)
    body = await read_body(request, dataplane.settings.max_body_bytes)
    content_type = request.headers.get("content-type", "")
    answer = await until_disconnect(
        request.receive, dataplane.predict(name, body, content_type, request_timeout(request))
    )
    return client_gone() if answer is None else json_response(answer)


@router.post(
    "/v1/models/{name}:preprocess",
    openapi_extra=_V1_BODY,
    responses={200: {"content": {"application/x-npz": {}}, "description": "tensors as .npz"}},
)
async def preprocess(request: Request, name: str) -> Response:
    """The tensors predict would feed the model, as an .npz archive: to debug preprocessing."""
    require_api(request)
    dataplane = dataplane_of(request)
    body = await read_body(request, dataplane.settings.max_body_bytes)
    content_type = request.headers.get("content-type", "")
    archive = await dataplane.preprocess(name, body, content_type)
    return Response(archive, media_type="application/x-npz")
