"""HTTP routes by concern. These take care of the HTTP-specific things and delegate the
business logic to :class:`service.dataplane.DataPlane`."""

from fastapi import APIRouter

from service.api import health, infer, metadata, repository
from service.settings import Settings


def router(settings: Settings) -> APIRouter:
    """Every route of the server; the repository routes only when an admin token is set."""
    root = APIRouter()
    for module in (health, metadata, infer):
        root.include_router(module.router)
    if settings.admin_token is not None:
        root.include_router(repository.router)
    return root
