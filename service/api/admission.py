"""The server-wide budget for request bodies: memory follows what the server holds, not what
clients send.

Each request's body limit (``max_body_bytes``) bounds one request; this bounds them all
together. A request whose declared ``Content-Length`` would take the bytes held past
``max_inflight_bytes`` is answered 503 with ``Retry-After`` before any of its body is read; the
body is then discarded as it arrives (closing at once would reset the connection under a client
that is still sending, before it could read the answer). A body without a declared length is counted
as it arrives and refused the same way once it would pass the budget. Bytes stay counted until
the request's answer has been sent, since decoding and inference hold them until then.
"""

from __future__ import annotations

import weakref

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from service.api.http import error_body
from service.connections import REFUSED
from service.errors import ServerBusy
from service.logs import REQUEST_ID, request_id_for

BUDGETS: weakref.WeakSet[BodyBudget] = weakref.WeakSet()
"""This process's budgets (one per server), for the metrics."""


class BodyBudget:
    """ASGI middleware holding request body bytes in flight under ``limit``."""

    def __init__(self, app: ASGIApp, limit: int, max_body_bytes: int) -> None:
        self.app = app
        self.limit = limit
        self.max_body_bytes = max_body_bytes
        self.held = 0
        """Body bytes of the requests being handled now (declared, or read so far)."""
        BUDGETS.add(self)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = _content_length(scope)
        # A body over the per-request limit is the route's to refuse (413): reserve nothing.
        reserved = declared if declared is not None and declared <= self.max_body_bytes else 0
        if reserved and self.held + reserved > self.limit:
            REFUSED["body_budget"] += 1
            await _refuse(scope, send, self._message(reserved))
            return
        self.held += reserved
        counted = 0

        async def counting_receive() -> Message:
            nonlocal counted
            message = await receive()
            size = len(message.get("body", b""))
            if size and self.held + size > self.limit:
                REFUSED["body_budget"] += 1
                raise ServerBusy(self._message(size))
            self.held += size
            counted += size
            return message

        try:
            await self.app(scope, receive if declared is not None else counting_receive, send)
        finally:
            self.held -= reserved + counted

    def _message(self, wanted: int) -> str:
        return (
            f"the server holds {self.held} bytes of request bodies and this one needs {wanted} "
            f"more; its limit is {self.limit} (TG_MAX_INFLIGHT_BYTES): retry shortly"
        )


def _content_length(scope: Scope) -> int | None:
    for key, value in scope["headers"]:
        if key == b"content-length":
            return int(value) if value.isdigit() and len(value) < 20 else None
    return None


async def _refuse(scope: Scope, send: Send, message: str) -> None:
    request_id = request_id_for(
        next((v.decode("latin-1") for k, v in scope["headers"] if k == b"x-request-id"), "")
    )
    REQUEST_ID.set(request_id)
    body = error_body(message)
    await send({
        "type": "http.response.start",
        "status": 503,
        "headers": [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
            (b"retry-after", b"1"),
            (b"x-request-id", request_id.encode()),
        ],
    })  # fmt: skip
    await send({"type": "http.response.body", "body": body})
