import gc

from service.app import _GC_THRESHOLDS, _settle_heap


def test_after_loading_the_heap_is_frozen_and_young_collections_are_rarer() -> None:
    """What the server does once its models are loaded: what loading made is never walked by
    the garbage collector again, and young objects are collected less often."""
    before = gc.get_threshold()
    try:
        _settle_heap()
        assert gc.get_freeze_count() > 1000  # modules, classes, loaded objects
        assert gc.get_threshold() == _GC_THRESHOLDS
    finally:
        gc.unfreeze()
        gc.set_threshold(*before)


def test_an_unexpected_error_is_a_500_that_names_the_request_like_every_other_answer() -> None:
    from fastapi.testclient import TestClient

    from service.app import create_app
    from service.settings import Settings
    from tests.server import MODELS

    app = create_app(Settings(model_repository=MODELS))

    async def broken() -> None:
        raise RuntimeError("a bug")

    app.add_api_route("/broken", broken)
    client = TestClient(app, raise_server_exceptions=False)  # no lifespan: nothing loads
    response = client.get("/broken", headers={"X-Request-ID": "bug-1"})
    assert response.status_code == 500
    assert response.headers["x-request-id"] == "bug-1"
    assert response.json() == {
        "error": "internal server error (request bug-1); see the server log",
        "request_id": "bug-1",
    }
