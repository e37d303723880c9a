"""The plain-ASGI inference routes answer exactly as the FastAPI routes do, for every outcome.

Two real servers on one repository, one with the fast path (the default) and one with
TG_FAST_PATH=false; each request goes to both and the answers are compared byte for byte.
"""

from __future__ import annotations

import base64
import io
import shutil
from collections.abc import Iterator

import numpy as np
import orjson
import pytest
from PIL import Image

from tests.server import MODELS, Server

pytestmark = pytest.mark.integration
TOKEN = "fast-path-token-01"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
HEADER, TIMEOUT = "Inference-Header-Content-Length", "X-Request-Timeout"
COMPARED_HEADERS = ("content-type", "inference-header-content-length", "www-authenticate")


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Server, Server]]:
    root = tmp_path_factory.mktemp("fast")
    shutil.copytree(MODELS / "digits", root / "models" / "digits")
    env = {"TG_API_TOKEN": TOKEN, "TG_MAX_BODY_BYTES": "100000"}
    fast = Server(root / "models", env=env, log_path=root / "fast.log")
    slow = Server(root / "models", env={**env, "TG_FAST_PATH": "false"}, log_path=root / "slow.log")
    try:
        fast.wait_until()
        slow.wait_until()
        yield fast, slow
    finally:
        fast.stop()
        slow.stop()


def _digits_json(rows: int = 2) -> bytes:
    data = np.random.default_rng(rows).random((rows, 1, 8, 8), dtype=np.float32)
    return orjson.dumps({"id": "r1", "inputs": [{"name": "image", "datatype": "FP32",
                         "shape": [rows, 1, 8, 8], "data": data.ravel().tolist()}]})  # fmt: skip


def _digits_binary() -> tuple[bytes, dict[str, str]]:
    data = np.random.default_rng(7).random((3, 1, 8, 8), dtype=np.float32)
    header = orjson.dumps({
        "inputs": [{"name": "image", "datatype": "FP32", "shape": [3, 1, 8, 8],
                    "parameters": {"binary_data_size": data.nbytes}}],
        "outputs": [{"name": "logits", "parameters": {"binary_data": True}}],
    })  # fmt: skip
    headers = {"Inference-Header-Content-Length": str(len(header)),
               "Content-Type": "application/octet-stream"}  # fmt: skip
    return header + data.tobytes(), headers


def _png() -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(np.arange(64, dtype=np.uint8).reshape(8, 8) * 4).save(buffer, format="PNG")
    return buffer.getvalue()


BINARY, BINARY_HEADERS = _digits_binary()
PREDICT = "/v1/models/digits:predict"
PNG = {**AUTH, "Content-Type": "image/png"}
INSTANCES = orjson.dumps({"instances": [{"b64": base64.b64encode(_png()).decode()}] * 2})
CASES: dict[str, tuple[str, str, bytes, dict[str, str]]] = {
    "json": ("POST", "/v2/models/digits/infer", _digits_json(), AUTH),
    "versioned": ("POST", "/v2/models/digits/versions/1/infer", _digits_json(3), AUTH),
    "binary": ("POST", "/v2/models/digits/infer", BINARY, {**AUTH, **BINARY_HEADERS}),
    "no token": ("POST", "/v2/models/digits/infer", _digits_json(), {}),
    "wrong token": ("POST", "/v2/models/digits/infer", _digits_json(), {"Authorization": "x"}),
    "unknown model": ("POST", "/v2/models/nosuch/infer", _digits_json(), AUTH),
    "unknown version": ("POST", "/v2/models/digits/versions/9/infer", _digits_json(), AUTH),
    "bad json": ("POST", "/v2/models/digits/infer", b'{"inputs": [', AUTH),
    "wrong shape": (
        "POST",
        "/v2/models/digits/infer",
        orjson.dumps(
            {"inputs": [{"name": "image", "datatype": "FP32", "shape": [1, 2], "data": [1, 2]}]}
        ),
        AUTH,
    ),
    "too large": ("POST", "/v2/models/digits/infer", b" " * 200_000, AUTH),
    "bad header length": ("POST", "/v2/models/digits/infer", BINARY, {**AUTH, HEADER: "-3"}),
    "bad timeout": ("POST", "/v2/models/digits/infer", _digits_json(), {**AUTH, TIMEOUT: "soon"}),
    "wrong method": ("GET", "/v2/models/digits/infer", b"", AUTH),
    "predict image": ("POST", PREDICT, _png(), PNG),
    "predict instances": ("POST", PREDICT, INSTANCES, {**AUTH, "Content-Type": "application/json"}),
    "predict no token": ("POST", PREDICT, _png(), {"Content-Type": "image/png"}),
    "predict unknown model": ("POST", "/v1/models/nosuch:predict", _png(), PNG),
    "predict corrupt image": ("POST", PREDICT, b"\x89PNG not really", PNG),
    "predict unsupported type": ("POST", PREDICT, b"hello", {**AUTH, "Content-Type": "text/csv"}),
    "predict too large": ("POST", PREDICT, b"x" * 200_000, PNG),
    "predict bad timeout": ("POST", PREDICT, _png(), {**PNG, TIMEOUT: "-1"}),
    "predict wrong method": ("GET", PREDICT, b"", AUTH),
}


@pytest.mark.parametrize("case", list(CASES))
def test_the_fast_path_answers_as_the_fastapi_route_does(
    servers: tuple[Server, Server], case: str
) -> None:
    method, path, body, headers = CASES[case]
    answers = []
    for server in servers:
        request_headers = {**headers, "X-Request-ID": f"case-{case.replace(' ', '-')}"}
        response = server.client.request(method, path, content=body, headers=request_headers)
        answers.append(response)
    fast, slow = answers
    assert fast.status_code == slow.status_code, (fast.text, slow.text)
    assert fast.content == slow.content
    assert (
        fast.headers["x-request-id"]
        == slow.headers["x-request-id"]
        == request_headers["X-Request-ID"]
    )
    for name in COMPARED_HEADERS:
        assert fast.headers.get(name) == slow.headers.get(name), name
    if fast.status_code >= 400 and method == "POST":
        error = fast.json()
        assert error["request_id"] == request_headers["X-Request-ID"] and error["error"]


def test_fast_path_requests_are_counted_and_logged_like_any_other(
    servers: tuple[Server, Server],
) -> None:
    fast, _ = servers
    before = fast.client.get("/v2/models/digits/stats", headers=AUTH).json()["model_stats"][0]
    for _ in range(3):
        assert fast.client.post("/v2/models/digits/infer", content=_digits_json(),
                                headers=AUTH).status_code == 200  # fmt: skip
    after = fast.client.get("/v2/models/digits/stats", headers=AUTH).json()["model_stats"][0]
    assert after["inference_count"] - before["inference_count"] == 6
    assert '"logger":"tensorgate.access"' in fast.log().replace(" ", "")


def test_a_repeated_header_counts_once_its_first_value_as_in_starlette(
    servers: tuple[Server, Server],
) -> None:
    headers = [("Authorization", f"Bearer {TOKEN}"), ("Authorization", "Bearer wrong"),
               ("X-Request-ID", "first-id"), ("X-Request-ID", "second-id")]  # fmt: skip
    for server in servers:
        response = server.client.post("/v2/models/digits/infer", content=_digits_json(),
                                      headers=headers)  # fmt: skip
        assert response.status_code == 200, response.text
        assert response.headers["x-request-id"] == "first-id"
