"""The server-wide budget for request bodies: memory follows what the server holds, not what
clients send.

Each request's body limit (``max_body_bytes``) bounds one request; this bounds them all
together. A body is counted as its bytes arrive, never as declared: a ``Content-Length`` is a
promise, and heads promising the whole budget with no body behind them would otherwise refuse
everyone else for as long as the body timeout (#28 finding 4). Once the bytes held would pass
``max_inflight_bytes``, the request is answered 503 with ``Retry-After`` and the rest of its
body is discarded as it arrives (closing at once would reset the connection under a client
that is still sending, before it could read the answer). A compressed body holds what it
inflates to as well, counted as it inflates (:data:`RESERVE`): past the budget, 503 before it
is inflated further. Bytes stay counted until the request's answer has been sent, since
decoding and inference hold them until then. gRPC inference requests hold their message's size
in the same budget while they are answered (:mod:`service.grpc.servicer`): gRPC has received the
message by then, so past the budget it is answered UNAVAILABLE at once and let go, instead of
held through decoding and the queue.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import orjson
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from service.errors import PayloadTooLarge, ServerBusy
from service.telemetry.counters import REFUSED, REQUEST_HELD, register_budget
from service.telemetry.logs import REQUEST_ID

RESERVE = "tensorgate.reserve"
"""The ASGI scope key of a request's ``reserve(size)``: hold ``size`` more bytes for this request
(its body inflating), or raise :class:`ServerBusy`. Callable from any thread."""


def error_body(message: str) -> bytes:
    """``{"error": ...}`` as the protocol says, plus the request id to find it in the logs."""
    return orjson.dumps({"error": message, "request_id": REQUEST_ID.get()})


def reserve_of(scope: Scope) -> Callable[[int], None] | None:
    """The request's ``reserve`` (None outside a budget, as in process)."""
    reserve: Callable[[int], None] | None = scope.get(RESERVE)
    return reserve


class BytesBudget:
    """The bytes of request bodies (and gRPC messages) this server holds, under ``limit``.
    Made with the app and handed to what takes from it: :class:`BodyBudget` for REST, the
    gRPC servicer for its messages."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.held = 0
        """Bytes of the requests being handled now (declared or read so far, and what
        compressed ones have inflated to)."""
        self.high = 0
        """The most held since :class:`service.limits.memory.Trimmer` last looked."""
        self._lock = threading.Lock()  # bodies inflate on the thread pool
        register_budget(self)

    def take(self, size: int, already: int = 0) -> None:
        """Hold ``size`` more bytes for a request that holds ``already``, or raise
        :class:`ServerBusy` (503, gRPC's UNAVAILABLE) when that would pass the limit. Callable
        from any thread. A request that would hold more than the whole limit can never be
        served: :class:`PayloadTooLarge` (413), not a 503 to retry for ever (its body, then 20
        times its JSON, or what it inflates to, each fitting alone, had been a 503)."""
        if already + size > self.limit:
            REFUSED["body_budget"] += 1
            raise PayloadTooLarge(
                f"this request needs {already + size} bytes held at once while it is read and "
                "decoded; "
                f"the server holds at most {self.limit} for every request together "
                "(TG_MAX_INFLIGHT_BYTES): send it in smaller requests, or its tensors in "
                "binary (a JSON body holds about 20 times its size while it is decoded)"
            )
        with self._lock:
            if self.held + size > self.limit:
                REFUSED["body_budget"] += 1
                raise ServerBusy(
                    f"the server holds {self.held} bytes of request bodies and this one "
                    f"needs {size} more; its limit is {self.limit} (TG_MAX_INFLIGHT_BYTES): "
                    "retry shortly"
                )
            self.held += size
            if self.held > self.high:
                self.high = self.held

    def try_take(self, size: int, spare: int = 0) -> bool:
        """Hold ``size`` more bytes if they fit with ``spare`` still free; False (nothing
        refused, nothing counted) if not: for what the server can do another way, such as a
        batch run a request at a time."""
        with self._lock:
            if self.held + size + spare > self.limit:
                return False
            self.held += size
            if self.held > self.high:
                self.high = self.held
            return True

    def hold(self, size: int) -> None:
        """Count ``size`` more bytes (fewer when negative) that are already held and cannot be
        refused: answers written and not yet taken by their clients
        (:mod:`service.limits.connections`). They make the next bodies wait their turn."""
        with self._lock:
            self.held += size
            if self.held > self.high:
                self.high = self.held

    def release(self, size: int) -> None:
        """Give back ``size`` bytes once the request that held them has been answered."""
        with self._lock:
            self.held -= size


class BodyBudget:
    """ASGI middleware holding REST request bodies in flight in ``budget``."""

    def __init__(self, app: ASGIApp, budget: BytesBudget) -> None:
        self.app = app
        self.budget = budget

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        held = [0]

        def reserve(size: int) -> None:
            self.budget.take(size, held[0])
            held[0] += size

        async def counting_receive() -> Message:
            message = await receive()
            reserve(len(message.get("body", b"")))
            return message

        scope[RESERVE] = reserve
        REQUEST_HELD.set(held)  # this request's task (and those it starts) see what it holds
        try:
            await self.app(scope, counting_receive, send)
        finally:
            self.budget.release(held[0])
