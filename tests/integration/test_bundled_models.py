"""The bundled models, served for real, against eager PyTorch and their training pipeline."""

from __future__ import annotations

import base64
import importlib.util
import io
from types import ModuleType
from typing import Any

import numpy as np
import pytest
import skimage.data
import torch
import yaml
from PIL import Image

from preprocessing import ImageSpec
from preprocessing.torch import ImageTransform
from tests.conftest import encode
from tests.server import MODELS, Server

CATS = {285, 281}  # Egyptian cat, tabby
ESPRESSO = 967

pytestmark = pytest.mark.integration


def build_script(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"build_{name}", MODELS / name / "build.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def served_spec(name: str) -> ImageSpec:
    config = yaml.safe_load((MODELS / name / "config.yaml").read_text())
    return ImageSpec.model_validate(config["preprocessing"])


def predict(server: Server, model: str, body: bytes, content_type: str) -> list[Any]:
    response = server.client.post(
        f"/v1/models/{model}:predict", content=body, headers={"content-type": content_type}
    )
    assert response.status_code == 200, response.text
    predictions: list[Any] = response.json()["predictions"]
    return predictions


def served_tensor(server: Server, model: str, body: bytes) -> np.ndarray:
    response = server.client.post(
        f"/v1/models/{model}:preprocess", content=body, headers={"content-type": "image/png"}
    )
    assert response.status_code == 200, response.text
    with np.load(io.BytesIO(response.content)) as tensors:
        return tensors[tensors.files[0]][0]


@pytest.fixture(scope="module")
def eager_efficientnet() -> torch.nn.Module:
    return build_script("efficientnet_lite0").build_module()


def test_chelsea_is_a_cat_and_coffee_is_espresso(
    server: Server, chelsea_jpeg: bytes, coffee_jpeg: bytes
) -> None:
    (cat,) = predict(server, "efficientnet_lite0", chelsea_jpeg, "image/jpeg")
    (coffee,) = predict(server, "efficientnet_lite0", coffee_jpeg, "image/jpeg")
    assert cat[0]["index"] in CATS
    assert cat[0]["label"] in ("Egyptian cat", "tabby")
    assert coffee[0] == {
        "index": ESPRESSO,
        "label": "espresso",
        "probability": coffee[0]["probability"],
    }
    for top in (cat, coffee):
        assert len(top) == 5
        probabilities = [p["probability"] for p in top]
        assert probabilities == sorted(probabilities, reverse=True)
        assert 0 < sum(probabilities) <= 1 + 1e-6


def test_b64_instances_answer_like_raw_bodies(
    server: Server, chelsea_jpeg: bytes, coffee_jpeg: bytes
) -> None:
    body = {
        "instances": [{"b64": base64.b64encode(b).decode()} for b in (chelsea_jpeg, coffee_jpeg)]
    }
    response = server.client.post("/v1/models/efficientnet_lite0:predict", json=body)
    assert response.status_code == 200, response.text
    batched = response.json()["predictions"]
    singles = [
        predict(server, "efficientnet_lite0", b, "image/jpeg")[0]
        for b in (chelsea_jpeg, coffee_jpeg)
    ]
    for got, want in zip(batched, singles, strict=True):
        assert [p["index"] for p in got] == [p["index"] for p in want]
        np.testing.assert_allclose(
            [p["probability"] for p in got], [p["probability"] for p in want], atol=1e-5
        )


def test_served_probabilities_match_eager_pytorch_fed_by_the_same_pipeline(
    server: Server, chelsea_jpeg: bytes, eager_efficientnet: torch.nn.Module
) -> None:
    tensor = ImageTransform(served_spec("efficientnet_lite0"))(chelsea_jpeg)
    with torch.inference_mode():
        eager = torch.softmax(eager_efficientnet(tensor[None]).double(), 1)[0].numpy()
    # The whole vector, through v2 infer on the server's own preprocessed tensor...
    batch = served_tensor(server, "efficientnet_lite0", chelsea_jpeg)[None]
    response = server.client.post(
        "/v2/models/efficientnet_lite0/infer",
        json={
            "inputs": [
                {
                    "name": "input",
                    "datatype": "FP32",
                    "shape": list(batch.shape),
                    "data": batch.ravel().tolist(),
                }
            ]
        },
    )
    assert response.status_code == 200, response.text
    logits = np.asarray(response.json()["outputs"][0]["data"], np.float64)
    served = np.exp(logits - logits.max())
    np.testing.assert_allclose(served / served.sum(), eager, atol=1e-4)
    # ...and the top-5 that predict answers from the raw JPEG.
    (top,) = predict(server, "efficientnet_lite0", chelsea_jpeg, "image/jpeg")
    for entry in top:
        assert entry["probability"] == pytest.approx(eager[entry["index"]], abs=1e-4)


def _variants() -> dict[str, tuple[bytes, set[int]]]:
    cat = Image.fromarray(skimage.data.chelsea())
    coffee = Image.fromarray(skimage.data.coffee())
    exif = Image.Exif()
    exif[0x0112] = 6  # stored rotated 90° anticlockwise: display after rotating clockwise
    return {
        "png": (encode(np.asarray(cat), "PNG"), CATS),
        "greyscale": (encode(np.asarray(cat.convert("L")), "PNG"), CATS),
        "alpha": (encode(np.asarray(cat.convert("RGBA")), "PNG"), CATS),
        "coffee-greyscale": (encode(np.asarray(coffee.convert("L")), "PNG"), {ESPRESSO}),
        "exif-rotated-jpeg": (
            encode(
                np.asarray(cat.transpose(Image.Transpose.ROTATE_90)),
                "JPEG",
                exif=exif.tobytes(),
                quality=95,
            ),
            CATS,
        ),
    }


VARIANTS = _variants()


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_image_variants_get_the_expected_answer_and_the_training_tensor(
    server: Server, variant: str
) -> None:
    data, expected = VARIANTS[variant]
    (top,) = predict(server, "efficientnet_lite0", data, "application/octet-stream")
    assert top[0]["index"] in expected
    training_side = ImageTransform(served_spec("efficientnet_lite0"))(data).numpy()
    assert served_tensor(server, "efficientnet_lite0", data).tobytes() == training_side.tobytes()


@pytest.mark.parametrize("shape", ["tall", "wide"])
def test_a_tall_and_a_wide_photo_get_the_training_tensor(server: Server, shape: str) -> None:
    """Alone, with two CPUs, an image is resized in halves on two threads (preprocessing.halves;
    the wiring: tests/unit/service/test_app.py), and Pillow orders its passes by the shape:
    vertical first for this tall one. Either way, the training side's pixels."""
    upright = np.rot90(skimage.data.coffee())
    stacked = np.concatenate([upright, upright], axis=0 if shape == "tall" else 1)
    data = encode(np.ascontiguousarray(stacked), "PNG")  # 400 × 1200, or 800 × 600
    training_side = ImageTransform(served_spec("efficientnet_lite0"))(data).numpy()
    assert served_tensor(server, "efficientnet_lite0", data).tobytes() == training_side.tobytes()


def test_exif_orientation_is_honoured_by_the_server(server: Server) -> None:
    upright = served_tensor(server, "efficientnet_lite0", VARIANTS["png"][0])
    rotated_with_exif = served_tensor(
        server, "efficientnet_lite0", VARIANTS["exif-rotated-jpeg"][0]
    )
    stored = Image.fromarray(skimage.data.chelsea()).transpose(Image.Transpose.ROTATE_90)
    ignoring_exif = served_tensor(server, "efficientnet_lite0", encode(np.asarray(stored), "JPEG"))
    honoured = np.abs(rotated_with_exif - upright).mean()
    assert honoured < 0.1 < np.abs(ignoring_exif - upright).mean()


def test_digits_served_accuracy_equals_the_offline_accuracy_exactly(server: Server) -> None:
    assert_digits_accuracy(server)


def assert_digits_accuracy(server: Server) -> None:
    """Over HTTP, digits gets exactly the held-out images right that its manifest says."""
    manifest = server.client.get("/v2/models/digits").json()
    assert manifest["verified"] is True
    recorded = __import__("json").loads((MODELS / "digits" / "1" / "manifest.json").read_text())
    _, _, test_images, test_labels = build_script("digits").load_split()
    correct = 0
    for start in range(0, len(test_images), 50):
        chunk = test_images[start : start + 50]
        instances = [
            {"b64": base64.b64encode(encode(np.asarray(i), "PNG")).decode()} for i in chunk
        ]
        response = server.client.post("/v1/models/digits:predict", json={"instances": instances})
        assert response.status_code == 200, response.text
        for prediction, label in zip(
            response.json()["predictions"], test_labels[start:], strict=False
        ):
            correct += int(prediction[0]["label"] == str(label))
    assert len(test_images) == recorded["metrics"]["heldout_size"]
    assert correct == recorded["metrics"]["heldout_correct"]
    assert correct / len(test_images) == pytest.approx(recorded["metrics"]["heldout_accuracy"])
