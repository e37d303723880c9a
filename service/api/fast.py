"""The inference hot paths on plain ASGI: ``POST /v2/models/{name}[/versions/{v}]/infer`` and
``POST /v1/models/{name}:predict``.

FastAPI would route the request through Starlette's middleware and router, build a Request,
validate the path parameters with pydantic and wrap the endpoint: per request, more than the
server spends on a small model's whole protocol work (bench/protocol.py measures both paths in
one run). This middleware sits outside all of that and answers those routes itself, with the
same behaviour as the FastAPI routes in ``service/api/infer.py``: API token, request id, body
limit, ``Inference-Header-Content-Length``, ``X-Request-Timeout``, 499 for a client that left,
``{"error", "request_id"}`` bodies. Those routes stay: they make the OpenAPI document and
answer when ``TG_FAST_PATH=false``.
"""

from __future__ import annotations

import logging
import re

import orjson
from fastapi import FastAPI
from starlette.types import Receive, Scope, Send

from service.api.auth import check_authorization
from service.api.deps import ClientGone, error_body, parse_timeout, receive_body, until_disconnect
from service.dataplane import DataPlane
from service.errors import TensorgateError
from service.logs import REQUEST_ID, request_id_for
from service.protocol.v2 import HEADER_LENGTH, parse_header_length

log = logging.getLogger("tensorgate.app")

_INFER = re.compile(r"^/v2/models/([^/]+)/(?:versions/([^/]+)/)?infer$")
_PREDICT = re.compile(r"^/v1/models/([^/]+):predict$")
_WANTED = {
    b"authorization",
    b"content-length",
    b"content-type",
    b"x-request-id",
    b"x-request-timeout",
    HEADER_LENGTH.encode(),
}


class InferFastPath:
    """Wraps the FastAPI app: the inference routes are answered here, everything else (and the
    lifespan) goes to the app. Outermost, so that none of Starlette's or FastAPI's own
    middleware (server errors, telemetry, body limit) runs for the hot routes."""

    def __init__(self, app: FastAPI) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST":
            path = scope["path"]
            infer = _INFER.match(path)
            predict = _PREDICT.match(path) if infer is None else None
            if infer is not None or predict is not None:
                # None only before the lifespan has started
                dataplane: DataPlane | None = getattr(self.app.state, "dataplane", None)
                if dataplane is not None:
                    await _answer(dataplane, scope, receive, send, infer, predict)
                    return
        await self.app(scope, receive, send)


async def _answer(
    dataplane: DataPlane,
    scope: Scope,
    receive: Receive,
    send: Send,
    infer: re.Match[str] | None,
    predict: re.Match[str] | None,
) -> None:
    headers: dict[str, str] = {}
    for key, value in scope["headers"]:
        if key in _WANTED:  # the first of repeated headers wins, as in Starlette
            headers.setdefault(key.decode(), value.decode("latin-1"))
    request_id = request_id_for(headers.get("x-request-id", ""))
    REQUEST_ID.set(request_id)  # each request is its own task: the value is its own
    extra: dict[str, str] = {"content-type": "application/json"}
    status = 200
    try:
        settings = dataplane.settings
        check_authorization(headers.get("authorization", ""), settings.api_token, "api")
        body = await receive_body(receive, headers.get("content-length"), settings.max_body_bytes)
        if infer is not None:
            header_length = parse_header_length(headers.get(HEADER_LENGTH), len(body))
            timeout_s = parse_timeout(headers.get("x-request-timeout"))
            work = dataplane.infer(infer[1], infer[2], body, header_length, timeout_s)
        else:
            assert predict is not None
            timeout_s = parse_timeout(headers.get("x-request-timeout"))
            work = _predict(dataplane, predict[1], body, headers.get("content-type", ""), timeout_s)
        answer = await until_disconnect(receive, work)
        if answer is None:
            status, content, extra = 499, b"", {}
        else:
            content, extra = answer
    except ClientGone:
        status, content, extra = 499, b"", {}
    except TensorgateError as exc:
        if exc.status == 500:
            log.error("POST %s failed: %s", scope["path"], exc.message, exc_info=exc.__cause__)
        status, content = exc.status, error_body(exc.message)
        extra = {**extra, **(exc.headers or {})}
    except Exception:
        log.exception("POST %s: internal error", scope["path"])
        status = 500
        content = error_body(f"internal server error (request {request_id}); see the server log")
    raw = [(k.lower().encode(), v.encode("latin-1")) for k, v in extra.items()]
    raw.append((b"content-length", str(len(content)).encode()))
    raw.append((b"x-request-id", request_id.encode()))
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": content})


async def _predict(
    dataplane: DataPlane, name: str, body: bytes, content_type: str, timeout_s: float | None
) -> tuple[bytes, dict[str, str]]:
    answer = await dataplane.predict(name, body, content_type, timeout_s)
    content = orjson.dumps(answer, option=orjson.OPT_SERIALIZE_NUMPY)
    return content, {"content-type": "application/json"}
