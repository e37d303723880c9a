"""Every bundled model served from every artifact it ships answers as its manifest and its
reference say: digits' held-out accuracy exactly, efficientnet_lite0's top-5 on real photos as
the ONNX artifact does, minilm's embeddings as sentence-transformers'.

test_bundled_models serves each model from its configured backend; here one server serves all
three from ``model.pt2`` and another from the third format (digits from ONNX, efficientnet_lite0
and minilm from TorchScript), so every (model, format) pair goes export → gates → answers.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import numpy as np
import pytest

from service.runtimes import PLATFORMS
from tests.integration.test_bundled_models import (
    ESPRESSO,
    assert_digits_accuracy,
    predict,
    served_tensor,
)
from tests.integration.test_text_model import assert_matches_sentence_transformers, reference
from tests.server import MODELS, Server, copy_model

pytestmark = pytest.mark.integration
BUNDLED = ("digits", "efficientnet_lite0", "minilm")
FORMATS = {
    "pt2": {"digits": "pt2", "efficientnet_lite0": "pt2", "minilm": "pt2"},
    "third": {"digits": "onnx", "efficientnet_lite0": "torchscript", "minilm": "torchscript"},
}


@pytest.fixture(scope="module", params=list(FORMATS))
def formats(request: pytest.FixtureRequest) -> dict[str, str]:
    """Which backend each bundled model is served from."""
    backends: dict[str, str] = FORMATS[request.param]
    return backends


@pytest.fixture(scope="module")
def swapped(tmp_path_factory: pytest.TempPathFactory, formats: dict[str, str]) -> Iterator[Server]:
    """The bundled repository, each config switched to the backend ``formats`` names."""
    root = tmp_path_factory.mktemp("bundled") / "models"
    for name, backend in formats.items():
        copy_model(name, root / name)
        config = root / name / "config.yaml"
        lines = config.read_text().splitlines()
        config.write_text(
            "\n".join(f"backend: {backend}" if x.startswith("backend:") else x for x in lines)
            + "\n"
        )
    server = Server(root, log_path=root.parent / "server.log")
    try:
        server.wait_until()
        yield server
    finally:
        server.stop()


def test_every_bundled_model_serves_verified(swapped: Server, formats: dict[str, str]) -> None:
    for name in BUNDLED:
        metadata = swapped.client.get(f"/v2/models/{name}").json()
        platform = PLATFORMS[formats[name]]
        assert (metadata["platform"], metadata["verified"]) == (platform, True), metadata
        stats = swapped.client.get(f"/v2/models/{name}/stats").json()["model_stats"][0]
        assert stats["unwarmed_shape_count"] == 0


def test_digits_reproduces_the_held_out_accuracy_exactly(swapped: Server) -> None:
    assert_digits_accuracy(swapped)


def test_efficientnet_answers_the_photos_as_onnx_does(
    swapped: Server, server: Server, chelsea_jpeg: bytes, coffee_jpeg: bytes
) -> None:
    tolerance = json.loads((MODELS / "efficientnet_lite0" / "1" / "manifest.json").read_text())
    atol = tolerance["tolerance"]["atol"]
    for photo in (chelsea_jpeg, coffee_jpeg):
        (served,) = predict(swapped, "efficientnet_lite0", photo, "image/jpeg")
        (from_onnx,) = predict(server, "efficientnet_lite0", photo, "image/jpeg")
        assert [p["index"] for p in served] == [p["index"] for p in from_onnx]
        np.testing.assert_allclose(
            [p["probability"] for p in served], [p["probability"] for p in from_onnx], atol=atol
        )
        assert served_tensor(swapped, "efficientnet_lite0", photo).tobytes() == (
            served_tensor(server, "efficientnet_lite0", photo).tobytes()
        )
    (coffee,) = predict(swapped, "efficientnet_lite0", coffee_jpeg, "image/jpeg")
    assert coffee[0]["index"] == ESPRESSO


def test_minilm_matches_sentence_transformers(swapped: Server, reference: object) -> None:
    assert_matches_sentence_transformers(swapped, reference)


__all__ = ["reference"]  # the fixture, shared with test_text_model
