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


@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("GET", "/v2/models/digits%2Fready"),
        ("GET", "/v2/models/digits%2fversions%2F1%2Fstats"),
        ("POST", "/v2/models/digits%2Fversions%2F1/infer"),
    ],
)
def test_an_encoded_slash_in_the_path_is_400_not_routed_decoded(
    hostile: tuple[Server, Path], method: str, path: str
) -> None:
    """The path was routed decoded: digits%2Fready answered as digits/ready, past a proxy
    that allows paths by their text."""
    server, _ = hostile
    answer = server.client.request(method, path, json=DIGIT if method == "POST" else None)
    assert answer.status_code == 400, (path, answer.status_code, answer.text)
    assert answer.json()["error"].startswith("the path holds an encoded slash (%2F)")
    assert answer.headers["x-request-id"] == answer.json()["request_id"]


@pytest.mark.parametrize(
    ("method", "path"), [("GET", "/v2/health/ready/"), ("POST", "/v2/models/digits/infer/")]
)
def test_a_trailing_slash_is_404_naming_the_route_not_a_redirect_to_the_host_sent(
    hostile: tuple[Server, Path], method: str, path: str
) -> None:
    """A 307 to a Location built from the request's Host header (evil.example's)."""
    server, _ = hostile
    answer = server.client.request(
        method, path, headers={"host": "evil.example"}, json=DIGIT if method == "POST" else None
    )
    assert answer.status_code == 404, answer.text
    assert answer.json()["error"] == f"no route {path}"
    assert "location" not in answer.headers


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


def test_poll_leaves_a_model_unloaded_through_the_api_and_loads_a_folder_that_comes_back(
    hostile: tuple[Server, Path],
) -> None:
    """An operator's unload was undone by --poll at the model's next change ("poll: model
    wine2 reloaded"); a folder removed and put back as it was (copied with its files' times)
    was never loaded again."""
    server, root = hostile
    admin = {"Authorization": f"Bearer {ADMIN}"}
    folder, marker = root / "kept", root / "marker"

    def state(name: str) -> str:
        return str(server.client.get(f"/v2/models/{name}").json().get("state"))

    copy_model("digits", folder)
    try:
        server.wait_for(lambda: state("kept") == "READY", timeout=60)
        server.wait_log("poll: model kept reloaded")  # logged just after it is READY
        assert server.client.post("/v2/repository/models/kept/unload", headers=admin).is_success
        reloads = server.log().count("poll: model kept reloaded")  # its first load, by --poll
        config = folder / "config.yaml"
        config.write_text(config.read_text() + "# changed after the unload\n")
        copy_model("digits", marker)  # loaded by a poll that has seen the change too
        server.wait_for(lambda: state("marker") == "READY", timeout=60)
        assert state("kept") == "UNLOADED"
        assert server.log().count("poll: model kept reloaded") == reloads
        assert server.client.post("/v2/repository/models/kept/load", headers=admin).is_success
        assert state("kept") == "READY"
        # its folder goes (--poll unloads it), and comes back as it was: --poll loads it
        shutil.move(folder, root.parent / "kept-away")
        server.wait_log("poll: model kept unloaded (its folder is gone)")
        # forgotten, as a folder never there (it stayed UNLOADED in the index and metrics)
        assert server.client.get("/v2/models/kept").status_code == 404
        assert 'model="kept"' not in server.client.get("/metrics").text
        rows = server.client.post("/v2/repository/index", headers=admin).json()
        assert "kept" not in {row["name"] for row in rows}
        shutil.move(root.parent / "kept-away", folder)
        server.wait_for(lambda: state("kept") == "READY", timeout=60)
        assert server.client.post("/v2/models/kept/infer", json=DIGIT).status_code == 200
    finally:
        shutil.rmtree(folder, ignore_errors=True)
        shutil.rmtree(root.parent / "kept-away", ignore_errors=True)
        shutil.rmtree(marker, ignore_errors=True)
        # --poll unloads them (their folders are gone) before the next test counts models
        server.wait_for(lambda: "READY" not in {state("kept"), state("marker")}, timeout=30)


def test_a_failed_load_of_a_new_model_is_shown_and_leaves_the_server_ready(
    hostile: tuple[Server, Path],
) -> None:
    """A model whose first load fails is UNAVAILABLE with why, as at startup (it was 404
    "unknown model" after the load's 400), names its files from its own folder (the
    repository's path is nobody's business), and leaves the server ready with what it served."""
    server, root = hostile
    admin = {"Authorization": f"Bearer {ADMIN}"}
    folder = root / "broken"
    folder.mkdir()
    try:
        (folder / "config.yaml").write_text("backend: onnx\nmax_batch_size: 4\nno_such_key: 1\n")
        answer = server.client.post("/v2/repository/models/broken/load", headers=admin)
        assert answer.status_code == 400
        error = answer.json()["error"]
        assert error.startswith("failed to load 'broken': broken/config.yaml: "), error
        assert "no_such_key" in error and str(root) not in error and "{" not in error
        metadata = server.client.get("/v2/models/broken").json()
        assert metadata["state"] == "UNAVAILABLE"
        assert metadata["reason"].startswith("broken/config.yaml: ") and str(root) not in str(
            metadata
        )
        inference = server.client.post("/v2/models/broken/infer", json=DIGIT)
        assert inference.status_code == 503 and "broken/config.yaml" in inference.text
        assert server.client.get("/v2/health/ready").status_code == 200
        rows = server.client.post("/v2/repository/index", headers=admin).json()
        assert {"name": "broken", "state": "UNAVAILABLE"}.items() <= next(
            row for row in rows if row["name"] == "broken"
        ).items()
        ready = server.client.post("/v2/repository/index", headers=admin, json={"ready": True})
        assert {row["name"] for row in ready.json()} == {"digits"}  # its versions
    finally:
        shutil.rmtree(folder)


def test_a_load_that_refuses_one_version_is_400_and_leaves_the_server_as_it_was(
    hostile: tuple[Server, Path],
) -> None:
    """A reload where one version of several fails: it answered 200, swapped in the broken
    version UNAVAILABLE beside the good ones, and made the whole server unready."""
    server, root = hostile
    admin = {"Authorization": f"Bearer {ADMIN}"}
    staged, folder = root.parent / "pair-staged", root / "pair"
    copy_model("digits", staged)
    shutil.copytree(staged / "1", staged / "2")
    config = staged / "config.yaml"
    config.write_text(config.read_text().replace("{latest: 1}", "{all: true}"))
    staged.rename(folder)  # whole at once: --poll may load it first, as the request would
    try:
        assert server.client.post("/v2/repository/models/pair/load", headers=admin).is_success
        shutil.copytree(folder / "1", folder / "3.tmp")
        (folder / "3.tmp" / "model.pt").write_bytes(b"not a TorchScript model")
        (folder / "3.tmp").rename(folder / "3")
        answer = server.client.post("/v2/repository/models/pair/load", headers=admin)
        assert answer.status_code == 400, answer.text
        error = answer.json()["error"]
        assert "failed to load 'pair': version 1: READY; version 2: READY; version 3: " in error
        # the log says what serves on, not that the model is unavailable (it said so)
        server.wait_log("model pair: reload refused, versions 1, 2 serving on: version 1: READY")
        log = server.log()
        assert "model pair version 3 did not load: " in log
        assert "model pair version 3 is unavailable" not in log
        # the model's reason names every version serving (it named the latest alone)
        reason = server.client.get("/v2/models/pair").json()["reason"]
        assert reason.startswith("versions 1, 2 serve; the last reload was refused: "), reason
        reason = server.client.get("/v2/models/pair/versions/1").json()["reason"]
        assert reason.startswith("version 1 serves; the last reload was refused: "), reason
        for version in (1, 2):
            assert server.client.get(f"/v2/models/pair/versions/{version}/ready").is_success
        assert server.client.get("/v2/models/pair/versions/3/ready").status_code == 404
        assert server.client.post("/v2/models/pair/infer", json=DIGIT).status_code == 200
        assert server.client.get("/v2/health/ready").status_code == 200
    finally:
        shutil.rmtree(folder)


@pytest.mark.parametrize(
    ("path", "body", "words"),
    [
        ("models/digits/load", b"{bad", "the load request is not valid JSON"),
        ("models/digits/load", b"[1]", "the load request must be a JSON object"),
        (
            "models/digits/load",
            b'{"parameters": {"config": "{\\"max_batch_size\\": 2}"}}',
            "the load request's parameters ['config'] are not taken: a model loads from its "
            "folder in the repository",
        ),
        ("models/digits/unload", b'{"parameters": {"x": 1}}', "takes only the parameter"),
        ("index", b'{"ready": "yes"}', "the index request's 'ready' must be true or false"),
    ],
)
def test_repository_requests_say_what_they_do_not_take(
    hostile: tuple[Server, Path], path: str, body: bytes, words: str
) -> None:
    """Triton's config override and a malformed body were answered 200 and ignored: a user
    who asked for a config of their own was told it loaded."""
    server, _ = hostile
    answer = server.client.post(
        f"/v2/repository/{path}",
        content=body,
        headers={"Authorization": f"Bearer {ADMIN}", "Content-Type": "application/json"},
    )
    assert answer.status_code == 400, answer.text
    assert words in answer.json()["error"]
    assert server.client.get("/v2/models/digits/ready").status_code == 200
