import gc

import pytest

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


def test_a_lone_images_second_thread_needs_two_cpus_the_setting_and_a_known_pillow(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    import preprocessing.halves
    from service import app
    from service.resources import SecondThread
    from service.settings import Settings
    from tests.server import MODELS

    second = SecondThread()
    app._enable_second_thread(Settings(model_repository=MODELS, cpus=2), second)
    assert second.on
    app._enable_second_thread(Settings(model_repository=MODELS, cpus=1), second)
    assert not second.on
    app._enable_second_thread(
        Settings(model_repository=MODELS, cpus=2, resize_halves=False), second
    )
    assert not second.on
    # A Pillow that orders its passes otherwise (as Pillow 12 did: always horizontal first).
    monkeypatch.setattr(preprocessing.halves, "vertical_first", lambda *size: False)
    app._enable_second_thread(Settings(model_repository=MODELS, cpus=2), second)
    assert not second.on
    assert "resized on one thread" in caplog.text


def test_every_image_pipeline_a_model_loads_gets_the_second_thread() -> None:
    from service.model_config import TensorConfig, load_model_config
    from service.pipelines.inputs import ImageInput, pipeline_for
    from service.resources import SECOND_THREAD
    from service.runtimes.base import Signature
    from tests.server import MODELS

    folder = MODELS / "efficientnet_lite0"
    config = load_model_config(folder / "config.yaml")
    signature = Signature(
        (TensorConfig(name="input", datatype="FP32", shape=(3, 224, 224)),),
        (TensorConfig(name="logits", datatype="FP32", shape=(1000,)),),
    )
    pipeline = pipeline_for(config, signature, folder / "1", "efficientnet_lite0")
    assert isinstance(pipeline, ImageInput)
    assert pipeline.pipeline._halves is SECOND_THREAD
