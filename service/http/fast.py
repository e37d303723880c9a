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
from service.errors import InvalidInput
from service.http.answer import LISTED, Answer, Route, answer_inference, error_answer
from service.limits.admission import reserve_of
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
            _, request_id = _headers(scope)
            REFUSED["bad_request"] += 1
            await _send(send, error_answer(InvalidInput(ENCODED_SLASH), "request"), request_id)
            return
        route = _route(scope) if scope["type"] == "http" and scope["method"] == "POST" else None
        dataplane: DataPlane | None = getattr(self.app.state, "dataplane", None)
        if route is None or dataplane is None:  # None only before the lifespan has started
            await self.app(scope, receive, send)
            return
        headers, request_id = _headers(scope)
        after: After = []  # the request's counting and logging: once its answer is sent
        try:
            answer = await answer_inference(
                dataplane, route, headers, receive, reserve_of(scope), scope.get("client"), after
            )
            await _send(send, answer, request_id)
        finally:
            for run in after:
                try:
                    run()
                except Exception:  # the answer is sent: nobody to tell but the log
                    log.exception("counting request %s after its answer failed", request_id)


def _headers(scope: Scope) -> tuple[dict[str, str], str]:
    """The request's headers (names in lower case, the first of repeated ones as in Starlette,
    :data:`LISTED` ones joined) and its request id, set for the request's task."""
    headers: dict[str, str] = {}
    for key, value in scope["headers"]:
        name = key.decode("latin-1")
        # a list: every coding applies; two lengths of the JSON header: which? (a 400)
        if name in LISTED and name in headers:
            headers[name] += ", " + value.decode("latin-1")
        else:
            headers.setdefault(name, value.decode("latin-1"))
    request_id = request_id_for(headers.get("x-request-id", ""))
    REQUEST_ID.set(request_id)  # each request is its own task: the value is its own
    return headers, request_id


async def _send(send: Send, answer: Answer, request_id: str) -> None:
    raw = [(k.encode(), v.encode("latin-1")) for k, v in answer.headers.items()]
    raw.append((b"content-length", str(len(answer.body)).encode()))
    raw.append((b"x-request-id", request_id.encode()))
    if BALANCE.over_share():  # this worker holds more than its share: the client reconnects
        raw.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": answer.status, "headers": raw})
    await send({"type": "http.response.body", "body": answer.body})


ENCODED_SLASH = (
    "the path holds an encoded slash (%2F): model names and versions have none, and the path "
    "is not routed decoded"
)


def _encoded_slash(scope: Scope) -> bool:
    """Whether the path as sent holds an encoded slash (``%2F``): ASGI's ``path`` is decoded,
    so ``/v2/models/digits%2Fready`` was routed as ``/v2/models/digits/ready``, past any proxy
    that allows paths by their text."""
    raw: bytes = scope.get("raw_path") or b""
    return b"%" in raw and b"%2f" in raw.lower()


def _route(scope: Scope) -> Route | None:
    path = scope["path"]
    if (infer := _INFER.match(path)) is not None:
        return Route("infer", infer[1], infer[2])
    if (predict := _PREDICT.match(path)) is not None:
        return Route("predict", predict[1])
    return None
