"""The inference routes on plain ASGI: ``POST /v2/models/{name}[/versions/{v}]/infer`` and
``POST /v1/models/{name}:predict``.

FastAPI would route the request through Starlette's middleware and router, build a Request,
validate the path parameters with pydantic and wrap the endpoint: per request, more than the
server spends on a small model's whole protocol work (bench/protocol.py measures both in one
run). This wrapper sits outside all of that: it matches the two hot paths itself and answers
them with :func:`service.http.answer.answer_inference`, the function the FastAPI routes in
:mod:`service.http.infer` call too (those stay, for the OpenAPI document and in-process use).
"""

from __future__ import annotations

import logging
import re

from fastapi import FastAPI
from starlette.types import Receive, Scope, Send

from service.core.dataplane import DataPlane
from service.http.answer import LISTED, Route, answer_inference
from service.limits.admission import error_body, reserve_of
from service.limits.balance import BALANCE
from service.telemetry.counters import REFUSED
from service.telemetry.logs import REQUEST_ID, request_id_for
from service.telemetry.observation import After

log = logging.getLogger("tensorgate.app")

_INFER = re.compile(r"^/v2/models/([^/]+)/(?:versions/([^/]+)/)?infer$")
_PREDICT = re.compile(r"^/v1/models/([^/]+):predict$")


class InferFastPath:
    """Wraps the FastAPI app: the inference routes are answered here, everything else (and the
    lifespan) goes to the app. Outermost, so that none of Starlette's or FastAPI's own
    middleware (server errors, telemetry, body limit) runs for the hot routes."""

    def __init__(self, app: FastAPI) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and _encoded_slash(scope):
            await _refuse_encoded_slash(scope, send)
            return
        route = _route(scope) if scope["type"] == "http" and scope["method"] == "POST" else None
        dataplane: DataPlane | None = getattr(self.app.state, "dataplane", None)
        if route is None or dataplane is None:  # None only before the lifespan has started
            await self.app(scope, receive, send)
            return
        headers: dict[str, str] = {}
        for key, value in scope["headers"]:  # the first of repeated headers wins, as in Starlette
            name = key.decode("latin-1")
            # a list: every coding applies; two lengths of the JSON header: which? (a 400)
            if name in LISTED and name in headers:
                headers[name] += ", " + value.decode("latin-1")
            else:
                headers.setdefault(name, value.decode("latin-1"))
        request_id = request_id_for(headers.get("x-request-id", ""))
        REQUEST_ID.set(request_id)  # each request is its own task: the value is its own
        after: After = []  # the request's counting and logging: once its answer is sent
        try:
            answer = await answer_inference(
                dataplane, route, headers, receive, reserve_of(scope), scope.get("client"), after
            )
            raw = [(k.encode(), v.encode("latin-1")) for k, v in answer.headers.items()]
            raw.append((b"content-length", str(len(answer.body)).encode()))
            raw.append((b"x-request-id", request_id.encode()))
            if BALANCE.over_share():  # this worker holds more than its share: the client reconnects
                raw.append((b"connection", b"close"))
            await send({"type": "http.response.start", "status": answer.status, "headers": raw})
            await send({"type": "http.response.body", "body": answer.body})
        finally:
            for run in after:
                try:
                    run()
                except Exception:  # the answer is sent: nobody to tell but the log
                    log.exception("counting request %s after its answer failed", request_id)


def _encoded_slash(scope: Scope) -> bool:
    """Whether the path as sent holds an encoded slash (``%2F``): ASGI's ``path`` is decoded,
    so ``/v2/models/digits%2Fready`` was routed as ``/v2/models/digits/ready``, past any proxy
    that allows paths by their text."""
    raw: bytes = scope.get("raw_path") or b""
    return b"%" in raw and b"%2f" in raw.lower()


async def _refuse_encoded_slash(scope: Scope, send: Send) -> None:
    headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]}
    request_id = request_id_for(headers.get("x-request-id", ""))
    REQUEST_ID.set(request_id)
    REFUSED["bad_request"] += 1
    body = error_body(
        "the path holds an encoded slash (%2F): model names and versions have none, and the "
        "path is not routed decoded"
    )
    await send(
        {
            "type": "http.response.start",
            "status": 400,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
                (b"x-request-id", request_id.encode()),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})


def _route(scope: Scope) -> Route | None:
    path = scope["path"]
    if (infer := _INFER.match(path)) is not None:
        return Route("infer", infer[1], infer[2])
    if (predict := _PREDICT.match(path)) is not None:
        return Route("predict", predict[1])
    return None
