"""What the limits count and the metrics read: refusals by reason, and the body bytes each
server's budget holds. The limits (``service/limits/``) write here; the metrics collector
(:mod:`service.telemetry.metrics`) reads; neither imports the other."""

from __future__ import annotations

import collections
import contextvars
import weakref
from typing import Protocol

REASONS = (
    "too_many",
    "too_many_from_client",
    "header_too_large",
    "chunk_line_too_large",
    "header_timeout",
    "body_timeout",
    "write_timeout",
    "body_budget",
    "unauthorized",
    "too_large",
    "draining",
    "bad_request",
    "invalid_http",
)
"""Every reason :data:`REFUSED` counts, each exposed from 0 (a reason counted but missing here
was never exposed: three were, until they were listed)."""
REFUSED: collections.Counter[str] = collections.Counter()
"""Connections and requests refused by a guard of the process, by reason: ``too_many``,
``too_many_from_client``,
``header_too_large``, ``chunk_line_too_large``, ``header_timeout``, ``body_timeout``,
``write_timeout``, ``invalid_http`` (bytes the HTTP/1.1 parser rejects: uvicorn's 400
``Invalid HTTP request received: `` and what it found)
(:mod:`service.limits.connections`), ``body_budget`` (:mod:`service.limits.admission`), and
the refusals made before a request reaches a model, which the request metrics never see:
``unauthorized`` (a missing or wrong token), ``too_large`` (a REST body past
``TG_MAX_BODY_BYTES``, sent or inflated), ``draining`` (the server shutting down) and
``bad_request`` (a REST request's 400 or 415 for its headers or encoding: a bad
``X-Request-Timeout``, ``Inference-Header-Content-Length`` or ``Content-Encoding``, or a
body that does not inflate; a v1 ``Content-Type`` the model does not take is that model's
``unsupported`` outcome)."""


class HoldsBytes(Protocol):
    @property
    def held(self) -> int: ...


_BUDGETS: weakref.WeakSet[HoldsBytes] = weakref.WeakSet()


def register_budget(budget: HoldsBytes) -> None:
    """Count ``budget``'s held bytes in :func:`bytes_held` for as long as it lives."""
    _BUDGETS.add(budget)


def bytes_held() -> int:
    """Body bytes held now by every budget of this process."""
    return sum(budget.held for budget in _BUDGETS)


REQUEST_HELD: contextvars.ContextVar[list[int] | None] = contextvars.ContextVar(
    "tensorgate_request_held", default=None
)
"""The bytes the request being handled holds in the budget (its body, what it inflated to, its
JSON's share, its gRPC message): what it takes next is refused 413 when the two together could
never fit (:meth:`BytesBudget.take`'s ``already``). A REST request's has a second item: what
was made for it, its answer (:meth:`BytesBudget.hold_for_request`)."""


def request_held() -> int:
    """What the request being handled holds in the budget (0 outside one)."""
    held = REQUEST_HELD.get()
    return 0 if held is None else held[0]
