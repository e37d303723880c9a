"""Prometheus metrics in the text exposition format."""

from __future__ import annotations

from fastapi import APIRouter, Request, Response
from prometheus_client import CONTENT_TYPE_LATEST

from service.http.answer import cluster_of, dataplane_of
from service.limits.auth import check_bearer

router = APIRouter(tags=["metrics"])


@router.get("/metrics", response_class=Response)
async def metrics(request: Request) -> Response:
    dataplane = dataplane_of(request)
    settings = dataplane.settings
    if settings.protect_health_and_metrics:
        check_bearer(request, settings.api_token, "api")
    return Response(await cluster_of(request).metrics(), media_type=CONTENT_TYPE_LATEST)
