"""Bearer-token checks, compared in constant time: ``TG_API_TOKEN`` for inference and the
reads, ``TG_ADMIN_TOKEN`` for repository changes, on REST and gRPC alike."""

from __future__ import annotations

import hmac
import logging
import time
from collections.abc import Callable

from fastapi import Request

from service.errors import Unauthorized
from service.telemetry.counters import REFUSED

log = logging.getLogger("tensorgate.auth")

Peer = tuple[str, int] | Callable[[], str] | None
"""A caller's address: ASGI's ``client`` (host, port), or gRPC's ``context.peer``, asked
only when a request is refused."""

REFUSALS_LOGGED_EVERY_S = 10.0
"""At most one warning a token (api, admin) this often: a client guessing tokens fills the
counter, not the log."""


class Refusals:
    """The log's account of requests refused for their token: the first at once, those that
    follow it within ``every_s`` counted in the next line."""

    def __init__(self, every_s: float = REFUSALS_LOGGED_EVERY_S) -> None:
        self.every_s = every_s
        self._logged: dict[str, float] = {}  # realm -> when its last line was written
        self._unlogged: dict[str, int] = {}

    def note(self, realm: str, peer: Peer) -> None:
        now = time.monotonic()
        count = self._unlogged.get(realm, 0) + 1
        if realm in self._logged and now - self._logged[realm] < self.every_s:
            self._unlogged[realm] = count
            return
        self._logged[realm], self._unlogged[realm] = now, 0
        log.warning(
            "refused %d request(s) without the %s token (a missing or wrong 'Authorization: "
            "Bearer') since the last such line, the latest from %s",
            count,
            realm,
            _address(peer),
        )


def _address(peer: Peer) -> str:
    if isinstance(peer, tuple):
        return f"{peer[0]}:{peer[1]}"
    return peer() if peer is not None else "an unknown address"


REFUSALS = Refusals()


def check_bearer(request: Request, token: str | None, realm: str) -> None:
    """Pass when no token is configured or the request carries it; 401 otherwise."""
    if token is not None:
        peer = (request.client.host, request.client.port) if request.client else None
        check_authorization(request.headers.get("authorization", ""), token, realm, peer)


def check_authorization(header: str, token: str | None, realm: str, peer: Peer = None) -> None:
    """``header`` (an Authorization value) must carry ``token``, unless it is None; ``peer``:
    the caller's address, for the log."""
    if token is None:
        return
    scheme, _, given = header.partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(given.encode(), token.encode()):
        REFUSED["unauthorized"] += 1  # no request metric sees it: no model was looked up
        REFUSALS.note(realm, peer)
        raise Unauthorized(
            f"this route needs 'Authorization: Bearer <{realm} token>'",
            headers={"WWW-Authenticate": f'Bearer realm="{realm}"'},
        )


async def require_admin(request: Request) -> None:
    check_bearer(request, request.app.state.dataplane.settings.admin_token, "admin")


def require_api(request: Request) -> None:
    """The API token check, called at the top of each protected route (no Depends: see deps)."""
    check_bearer(request, request.app.state.dataplane.settings.api_token, "api")
