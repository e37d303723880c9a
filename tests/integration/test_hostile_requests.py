"""Requests and repository states an attacker or an unlucky operator makes: each gets a clear
4xx (never a 500), costs what the server produces rather than what it was sent, and leaves the
server serving."""

from __future__ import annotations

import base64
import io
import shutil
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from tests.server import Server, copy_model

pytestmark = pytest.mark.integration

ADMIN = "hostile-admin-token"
DIGIT = {
    "inputs": [{"name": "image", "datatype": "FP32", "shape": [1, 1, 8, 8], "data": [0.5] * 64}]
}


@pytest.fixture(scope="module")
def hostile(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Server, Path]]:
    root = tmp_path_factory.mktemp("hostile") / "models"
    copy_model("digits", root / "digits")
    env = {"TG_ADMIN_TOKEN": ADMIN, "TG_POLL_INTERVAL_S": "0.2"}
    server = Server(root, env=env, log_path=root.parent / "server.log")
    try:
        server.wait_until()
        yield server, root
    finally:
        server.stop()


@pytest.mark.parametrize("version", ["²", "①", "%C2%B2", "٣", "1" * 40])
def test_versions_are_ascii_digits_and_anything_else_is_404(
    hostile: tuple[Server, Path], version: str
) -> None:
    server, _ = hostile
    for method, path in (
        ("GET", f"/v2/models/digits/versions/{version}"),
        ("GET", f"/v2/models/digits/versions/{version}/ready"),
        ("GET", f"/v2/models/digits/versions/{version}/config"),
        ("POST", f"/v2/models/digits/versions/{version}/infer"),
    ):
        answer = server.client.request(method, path, json=DIGIT if method == "POST" else None)
        assert answer.status_code == 404, (path, answer.status_code, answer.text)
        assert "has no version" in answer.json()["error"]


def test_an_unknown_model_is_404_without_naming_the_others(hostile: tuple[Server, Path]) -> None:
    server, _ = hostile
    answer = server.client.post("/v2/models/nope/infer", json=DIGIT)
    assert answer.status_code == 404
    assert answer.json()["error"] == "unknown model 'nope'"
    assert "digits" not in answer.text


def test_an_output_asked_for_twice_is_400(hostile: tuple[Server, Path]) -> None:
    server, _ = hostile
    body = {**DIGIT, "outputs": [{"name": "logits"}] * 1000}
    answer = server.client.post("/v2/models/digits/infer", json=body)
    assert answer.status_code == 400
    assert "output 'logits' is requested more than once" in answer.json()["error"]


def test_preprocess_answers_a_bounded_number_of_rows(hostile: tuple[Server, Path]) -> None:
    """1×1 PNGs are 70 bytes each; what :preprocess answers for each is the model's input row."""
    server, _ = hostile
    png = io.BytesIO()
    Image.fromarray(np.zeros((1, 1), np.uint8)).save(png, format="PNG")
    image = {"b64": base64.b64encode(png.getvalue()).decode()}
    answer = server.client.post("/v1/models/digits:preprocess", json={"instances": [image] * 1024})
    assert answer.status_code == 413
    assert ":preprocess answers at most 32" in answer.json()["error"]
    answer = server.client.post("/v1/models/digits:preprocess", json={"instances": [image] * 32})
    assert answer.status_code == 200
    assert np.load(io.BytesIO(answer.content))["image"].shape[0] == 32


def test_a_refused_reload_says_what_serves_and_why(hostile: tuple[Server, Path]) -> None:
    server, root = hostile
    config = root / "digits" / "config.yaml"
    good = config.read_text()
    try:
        config.write_text(good + "\nthis is: [not yaml\n")
        answer = server.client.post(
            "/v2/repository/models/digits/load", headers={"Authorization": f"Bearer {ADMIN}"}
        )
        assert answer.status_code == 400
        metadata = server.client.get("/v2/models/digits").json()
        assert metadata["state"] == "READY"
        assert metadata["reason"].startswith("version 1 serves; the last reload was refused: ")
        assert "config.yaml" in metadata["last_load_error"]
        assert server.client.post("/v2/models/digits/infer", json=DIGIT).status_code == 200
    finally:
        config.write_text(good)
    # --poll reloads the repaired folder; the refusal is then history
    server.wait_for(
        lambda: "reason" not in server.client.get("/v2/models/digits").json(), timeout=60
    )


def test_a_version_folder_with_a_non_ascii_name_does_not_stop_polling(
    hostile: tuple[Server, Path],
) -> None:
    """A folder named '²' passes str.isdigit() and fails int(): it once killed --poll for good."""
    server, root = hostile
    (root / "digits" / "²").mkdir()
    try:
        shutil.copytree(root / "digits" / "1", root / "digits" / "2")
        config = root / "digits" / "config.yaml"
        config.write_text(
            config.read_text().replace("version_policy: {latest: 1}", "version_policy: {all: true}")
        )
        server.wait_for(
            lambda: server.client.get("/v2/models/digits/versions/2/ready").status_code == 200,
            timeout=60,
        )
        assert server.client.get("/v2/models/digits").json()["versions"] == ["1", "2"]
    finally:
        shutil.rmtree(root / "digits" / "²")
