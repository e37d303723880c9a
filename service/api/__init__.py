"""HTTP routes by concern. These take care of the HTTP-specific things and delegate the
business logic to :class:`service.dataplane.DataPlane`."""

from fastapi import APIRouter

from service.api import health, infer, metadata


def router() -> APIRouter:
    """Every route of the server."""
    root = APIRouter()
    for module in (health, metadata, infer):
        root.include_router(module.router)
    return root
