"""The bundled models served from their AOTInductor packages (``backend: pt2``) answer as their
manifests and the ONNX artifacts do: digits' held-out accuracy exactly, efficientnet_lite0's
top-5 on real photos, minilm's embeddings against sentence-transformers."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator

import numpy as np
import pytest

from tests.integration.test_bundled_models import (
    ESPRESSO,
    assert_digits_accuracy,
    predict,
    served_tensor,
)
from tests.integration.test_text_model import assert_matches_sentence_transformers, reference
from tests.server import MODELS, Server

pytestmark = pytest.mark.integration
BUNDLED = ("digits", "efficientnet_lite0", "minilm")


@pytest.fixture(scope="module")
def pt2_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """The bundled repository, each config switched to ``backend: pt2``."""
    root = tmp_path_factory.mktemp("bundled_pt2") / "models"
    for name in BUNDLED:
        shutil.copytree(MODELS / name, root / name, ignore=shutil.ignore_patterns("build.py"))
        config = root / name / "config.yaml"
        lines = config.read_text().splitlines()
        config.write_text(
            "\n".join("backend: pt2" if x.startswith("backend:") else x for x in lines) + "\n"
        )
    server = Server(root, log_path=root.parent / "server.log")
    try:
        server.wait_until()
        yield server
    finally:
        server.stop()


def test_every_bundled_model_serves_verified_from_its_pt2(pt2_server: Server) -> None:
    for name in BUNDLED:
        metadata = pt2_server.client.get(f"/v2/models/{name}").json()
        assert (metadata["platform"], metadata["verified"]) == ("pytorch_aoti", True), metadata


def test_digits_from_pt2_reproduces_the_held_out_accuracy_exactly(pt2_server: Server) -> None:
    assert_digits_accuracy(pt2_server)


def test_efficientnet_from_pt2_answers_the_photos_as_onnx_does(
    pt2_server: Server, server: Server, chelsea_jpeg: bytes, coffee_jpeg: bytes
) -> None:
    tolerance = json.loads((MODELS / "efficientnet_lite0" / "1" / "manifest.json").read_text())
    atol = tolerance["tolerance"]["atol"]
    for photo in (chelsea_jpeg, coffee_jpeg):
        (from_pt2,) = predict(pt2_server, "efficientnet_lite0", photo, "image/jpeg")
        (from_onnx,) = predict(server, "efficientnet_lite0", photo, "image/jpeg")
        assert [p["index"] for p in from_pt2] == [p["index"] for p in from_onnx]
        np.testing.assert_allclose(
            [p["probability"] for p in from_pt2], [p["probability"] for p in from_onnx], atol=atol
        )
        assert served_tensor(pt2_server, "efficientnet_lite0", photo).tobytes() == (
            served_tensor(server, "efficientnet_lite0", photo).tobytes()
        )
    (coffee,) = predict(pt2_server, "efficientnet_lite0", coffee_jpeg, "image/jpeg")
    assert coffee[0]["index"] == ESPRESSO


def test_minilm_from_pt2_matches_sentence_transformers(
    pt2_server: Server, reference: object
) -> None:
    assert_matches_sentence_transformers(pt2_server, reference)


__all__ = ["reference"]  # the fixture, shared with test_text_model
