"""Bearer-token checks, compared in constant time: ``TG_API_TOKEN`` for inference and the
reads, ``TG_ADMIN_TOKEN`` for repository changes, on REST and gRPC alike."""

from __future__ import annotations

import hmac

from fastapi import Request

from service.errors import Unauthorized
from service.telemetry.counters import REFUSED


def check_bearer(request: Request, token: str | None, realm: str) -> None:
    """Pass when no token is configured or the request carries it; 401 otherwise."""
    if token is not None:
        check_authorization(request.headers.get("authorization", ""), token, realm)


def check_authorization(header: str, token: str | None, realm: str) -> None:
    """``header`` (an Authorization value) must carry ``token``, unless it is None."""
    if token is None:
        return
    scheme, _, given = header.partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(given.encode(), token.encode()):
        REFUSED["unauthorized"] += 1  # no request metric sees it: no model was looked up
        raise Unauthorized(
            f"this route needs 'Authorization: Bearer <{realm} token>'",
            headers={"WWW-Authenticate": f'Bearer realm="{realm}"'},
        )


async def require_admin(request: Request) -> None:
    check_bearer(request, request.app.state.dataplane.settings.admin_token, "admin")


def require_api(request: Request) -> None:
    """The API token check, called at the top of each protected route (no Depends: see deps)."""
    check_bearer(request, request.app.state.dataplane.settings.api_token, "api")
