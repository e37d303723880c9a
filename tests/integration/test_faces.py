"""The bundled face detector: MTCNN as a model's own code over three served models.

Real photos that ship with scikit-image: the astronaut has one face, the cameraman one, the
coffee cup and the cat none. The served answer is compared with the same pipeline run here
in this process over the eager networks.
"""

from __future__ import annotations

import base64
import importlib.util
import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from functools import cache
from types import ModuleType
from typing import Any

import numpy as np
import pytest
import yaml

from preprocessing.pipeline import Item, LocalModels, answer_one
from tests.server import MODELS, Server, copy_model

pytestmark = pytest.mark.integration


@cache
def build() -> ModuleType:
    spec = importlib.util.spec_from_file_location("faces_build", MODELS / "faces" / "build.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def eager_faces(image: bytes) -> list[dict[str, Any]]:
    """The pipeline, in this process, over the eager networks with the same weights."""
    faces = build()
    state = faces.weights()
    steps = {}
    for name, (cls, key, outputs) in faces.NETS.items():
        module = cls()
        module.load_state_dict(state[name])
        steps[name] = faces.eager(module.eval(), key, outputs)
    import detector  # type: ignore[import-not-found]  # faces' folder, put on sys.path by build

    config = yaml.safe_load((MODELS / "faces" / "config.yaml").read_text())
    pipeline = detector.FaceDetector(**config["preprocessing"]["params"])
    pipeline.models = LocalModels(steps)
    answer: list[dict[str, Any]] = answer_one(pipeline, Item(image), lambda batch: batch)
    return answer


def detect(server: Server, image: bytes) -> list[dict[str, Any]]:
    response = server.client.post(
        "/v1/models/faces:predict", content=image, headers={"Content-Type": "image/jpeg"}
    )
    assert response.status_code == 200, response.text
    (faces,) = response.json()["predictions"]
    return list(faces)


def test_the_astronaut_has_one_face_with_its_landmarks_inside_it(server: Server) -> None:
    (face,) = detect(server, build().photo("astronaut"))
    x1, y1, x2, y2 = face["box"]
    assert face["score"] > 0.99
    assert 150 < x1 < x2 < 300 and 30 < y1 < y2 < 200  # her face, in the 512 × 512 photo
    assert len(face["landmarks"]) == 5
    for x, y in face["landmarks"]:
        assert x1 <= x <= x2 and y1 <= y <= y2
    (left_eye, right_eye, _, left_mouth, _) = face["landmarks"]
    assert left_eye[0] < right_eye[0] and left_eye[1] < left_mouth[1]


@pytest.mark.parametrize(("photo", "count"), [("camera", 1), ("coffee", 0), ("chelsea", 0)])
def test_photos_give_the_faces_they_have(server: Server, photo: str, count: int) -> None:
    assert len(detect(server, build().photo(photo))) == count


@pytest.mark.parametrize("photo", ["astronaut", "camera"])
def test_the_served_answer_is_the_eager_pipelines(server: Server, photo: str) -> None:
    image = build().photo(photo)
    served, eager = detect(server, image), eager_faces(image)
    assert len(served) == len(eager) == 1
    np.testing.assert_allclose(served[0]["box"], eager[0]["box"], atol=0.5)
    np.testing.assert_allclose(served[0]["landmarks"], eager[0]["landmarks"], atol=0.5)
    assert served[0]["score"] == pytest.approx(eager[0]["score"], abs=1e-3)


def test_boxes_are_in_the_callers_pixels_whatever_the_size(server: Server) -> None:
    """An image above max_side (640) is shrunk for the pyramid; the answer is scaled back."""
    import io

    from PIL import Image

    photo = Image.open(io.BytesIO(build().photo("astronaut")))
    big = photo.resize((1024, 1024), Image.Resampling.BICUBIC)
    buffer = io.BytesIO()
    big.save(buffer, format="JPEG", quality=95)
    (small,) = detect(server, build().photo("astronaut"))
    (large,) = detect(server, buffer.getvalue())
    np.testing.assert_allclose(large["box"], [2 * v for v in small["box"]], atol=12)


def test_v2_takes_the_image_as_bytes_and_answers_json_as_v1_does(server: Server) -> None:
    image = build().photo("astronaut")
    encoded = base64.b64encode(image).decode()
    response = server.client.post(
        "/v1/models/faces:predict", json={"instances": [{"b64": encoded}]}
    )
    assert response.status_code == 200
    assert json.loads(_binary_infer(server, image)) == response.json()["predictions"][0]


def _binary_infer(server: Server, image: bytes) -> bytes:
    import struct

    header = json.dumps({
        "inputs": [{"name": "image_bytes", "datatype": "BYTES", "shape": [1],
                    "parameters": {"binary_data_size": len(image) + 4}}],
        "outputs": [{"name": "answer"}],
    }).encode()  # fmt: skip
    response = server.client.post(
        "/v2/models/faces/infer",
        content=header + struct.pack("<I", len(image)) + image,
        headers={"Inference-Header-Content-Length": str(len(header))},
    )
    assert response.status_code == 200, response.text
    (output,) = response.json()["outputs"]
    assert output["name"] == "answer"
    return str(output["data"][0]).encode()


def test_not_an_image_is_a_400_naming_the_model(server: Server) -> None:
    response = server.client.post(
        "/v1/models/faces:predict", content=b"not an image", headers={"Content-Type": "image/png"}
    )
    assert response.status_code == 400
    assert response.json()["error"].startswith("model 'faces': ")


@pytest.fixture(scope="module")
def batching_steps(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """faces and its networks, the networks waiting up to 5 ms for more calls and four pipeline
    threads: calls of concurrent requests meet in a queue by design, not by the timing of a
    loaded machine (with no delay they met, or not, as the CPUs allowed)."""
    root = tmp_path_factory.mktemp("faces") / "models"
    for name in ("faces", "faces_pnet", "faces_rnet", "faces_onet"):
        copy_model(name, root / name)
    for name in ("faces_pnet", "faces_rnet", "faces_onet"):
        config = root / name / "config.yaml"
        document = yaml.safe_load(config.read_text())
        document["batching"] = {**document.get("batching", {}), "max_queue_delay_ms": 5}
        config.write_text(yaml.safe_dump(document))
    running = Server(root, env={"TG_PREPROCESS_THREADS": "4"}, log_path=root.parent / "log")
    try:
        running.wait_until(timeout=180)
        yield running
    finally:
        running.stop()


def test_concurrent_requests_batch_at_every_step(batching_steps: Server) -> None:
    server = batching_steps

    def counts() -> dict[str, tuple[int, int]]:
        found = {}
        for name in ("faces_pnet", "faces_rnet", "faces_onet"):
            stats = server.client.get(f"/v2/models/{name}/stats").json()["model_stats"][0]
            calls = stats["inference_stats"]["success"]["count"]  # requests, not rows
            found[name] = (calls, stats["execution_count"])
        return found

    images = [build().photo(name) for name in ("astronaut", "camera")] * 8
    before = counts()
    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(lambda image: detect(server, image), images))
    assert [len(a) for a in answers] == [1] * 16
    after = counts()
    inferences = sum(after[n][0] - before[n][0] for n in after)
    executions = sum(after[n][1] - before[n][1] for n in after)
    assert executions < inferences, (before, after)  # calls of different requests shared batches


def test_the_steps_meet_no_unwarmed_shape(server: Server) -> None:
    """The detector's pyramid makes an image size per scale; its steps ran them as they came
    (58 unwarmed shapes on faces_pnet before the first client's request, from the load's own
    replay), each a shape the runtime had never met. They run at the steps' warmed buckets,
    as a request's own tensors do, and the answer is the same (the parity test above)."""
    for photo in ("astronaut", "camera", "coffee"):
        detect(server, build().photo(photo))
    for step in ("faces_pnet", "faces_rnet", "faces_onet"):
        stats = server.client.get(f"/v2/models/{step}/stats").json()["model_stats"][0]
        assert stats["inference_count"] > 0, step
        assert stats["unwarmed_shape_count"] == 0, step


def test_statistics_time_the_pipelines_steps(server: Server) -> None:
    detect(server, build().photo("astronaut"))
    stats = server.client.get("/v2/models/faces/stats").json()["model_stats"][0]
    assert stats["inference_stats"]["compute_output"]["ns"] > 0
