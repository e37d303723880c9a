"""HTTP routes by concern. These take care of the HTTP-specific things and delegate the
business logic to :class:`service.core.dataplane.DataPlane`."""

from fastapi import APIRouter

from service.http import health, infer, metadata, metrics, repository
from service.settings import Settings


def routers(settings: Settings) -> list[APIRouter]:
    """Every route of the server; the repository routes only when an admin token is set.

    Included into the app one level deep: each level of nested routers costs every request
    another matching pass. Inference routes come first, as the hottest.
    """
    chosen = [infer.router, health.router, metadata.router, metrics.router]
    if settings.admin_token is not None:
        chosen.append(repository.router)
    return chosen
