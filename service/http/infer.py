"""Inference: Open Inference Protocol ``infer`` and the v1 ``predict`` convenience routes.

The server answers ``infer`` and ``predict`` on plain ASGI (:mod:`service.http.fast`) before
FastAPI sees them; these routes document them in the OpenAPI schema and answer them when the
app is used without that wrapper (in-process). All three call the one implementation,
:func:`service.http.answer.answer_inference`.
"""

from __future__ import annotations

from fastapi import APIRouter, Request, Response

from service.http.answer import LISTED, Route, answer_inference, dataplane_of
from service.limits.admission import reserve_of

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
_V1_BODY = {
    "requestBody": {
        "required": True,
        "content": {
            "application/json": {"schema": {"type": "object"}},
            "image/*": {"schema": {"type": "string", "format": "binary"}},
        },
    }
}


async def _answer(request: Request, route: Route) -> Response:
    headers = {key: request.headers[key] for key in request.headers}  # first of repeated ones
    for name in LISTED:  # every coding applies (RFC 9110, 5.3); two header lengths: a 400
        if name in headers:
            headers[name] = ", ".join(request.headers.getlist(name))
    answer = await answer_inference(
        dataplane_of(request),
        route,
        headers,
        request.receive,
        reserve_of(request.scope),
        request.scope.get("client"),
    )
    return Response(answer.body, answer.status, answer.headers)


# Two functions rather than one with ``version: str | None = None``: on the unversioned path
# FastAPI would treat the default as a query parameter.
@router.post("/v2/models/{name}/infer", openapi_extra=_INFER_BODY)
async def infer(request: Request, name: str) -> Response:
    return await _answer(request, Route("infer", name))


@router.post("/v2/models/{name}/versions/{version}/infer", openapi_extra=_INFER_BODY)
async def infer_version(request: Request, name: str, version: str) -> Response:
    return await _answer(request, Route("infer", name, version))


@router.post("/v1/models/{name}:predict", openapi_extra=_V1_BODY)
async def predict(request: Request, name: str) -> Response:
    return await _answer(request, Route("predict", name))


@router.post(
    "/v1/models/{name}:preprocess",
    openapi_extra=_V1_BODY,
    responses={200: {"content": {"application/x-npz": {}}, "description": "tensors as .npz"}},
)
async def preprocess(request: Request, name: str) -> Response:
    """The tensors predict would feed the model, as an .npz archive: to debug preprocessing."""
    return await _answer(request, Route("preprocess", name))
