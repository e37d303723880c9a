"""Dependencies and small HTTP helpers shared by the routes."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import orjson
from fastapi import Request, Response

from service.dataplane import DataPlane
from service.errors import PayloadTooLarge


def dataplane_of(request: Request) -> DataPlane:
    """The app's DataPlane.

    Read straight from app state rather than injected with ``Depends``: FastAPI's dependency
    resolution cost about 180 µs a request here, more than half of a small request's
    server time (measured with wrk on /v2/health/live: 3,100 vs 7,600 req/s).
    """
    dataplane: DataPlane = request.app.state.dataplane
    return dataplane


def json_response(
    content: Any, status_code: int = 200, headers: Mapping[str, str] | None = None
) -> Response:
    """orjson-encoded JSON; no pydantic on the way out."""
    return Response(
        orjson.dumps(content, option=orjson.OPT_SERIALIZE_NUMPY),
        status_code=status_code,
        headers=headers,
        media_type="application/json",
    )


async def read_body(request: Request, limit: int) -> bytes:
    """The request body, refused with 413 as soon as it is known to exceed ``limit`` bytes."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise PayloadTooLarge(f"request body is {declared} bytes; the limit is {limit}")
    chunks = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise PayloadTooLarge(f"request body exceeds the limit of {limit} bytes")
        chunks.append(chunk)
    return b"".join(chunks)
