"""The plain-ASGI inference routes answer exactly as the FastAPI routes do, for every outcome
(200, 400, 401, 404, 413, 499, 500, 503, 504): both call one implementation, and this proves
they agree, in process (ASGI calls to the app uvicorn runs and to the bare FastAPI app).
"""

from __future__ import annotations

import base64
import io
from collections.abc import Iterator
from pathlib import Path
from unittest import mock

import numpy as np
import orjson
import pytest
from PIL import Image

from service.core.dataplane import Call
from service.settings import Settings
from tests.asgi import InProcess, Reply
from tests.server import copy_model

pytestmark = pytest.mark.integration
TOKEN = "fast-path-token-01"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
HEADER, TIMEOUT = "Inference-Header-Content-Length", "X-Request-Timeout"
COMPARED_HEADERS = ("content-type", "inference-header-content-length", "www-authenticate")


@pytest.fixture(scope="module")
def inprocess(tmp_path_factory: pytest.TempPathFactory) -> Iterator[InProcess]:
    root = tmp_path_factory.mktemp("routes") / "models"
    copy_model("digits", root / "digits")
    settings = Settings(
        model_repository=Path(root),
        api_token=TOKEN,
        max_body_bytes=100_000,
        intra_op_threads=1,
        preprocess_threads=1,
        access_log=False,
    )
    running = InProcess(settings)
    try:
        yield running
    finally:
        running.close()


def _digits_json(rows: int = 2) -> bytes:
    data = np.random.default_rng(rows).random((rows, 1, 8, 8), dtype=np.float32)
    return orjson.dumps(
        {
            "id": "r1",
            "inputs": [
                {
                    "name": "image",
                    "datatype": "FP32",
                    "shape": [rows, 1, 8, 8],
                    "data": data.ravel().tolist(),
                }
            ],
        }
    )


def _digits_binary() -> tuple[bytes, dict[str, str]]:
    data = np.random.default_rng(7).random((3, 1, 8, 8), dtype=np.float32)
    header = orjson.dumps(
        {
            "inputs": [
                {
                    "name": "image",
                    "datatype": "FP32",
                    "shape": [3, 1, 8, 8],
                    "parameters": {"binary_data_size": data.nbytes},
                }
            ],
            "outputs": [{"name": "logits", "parameters": {"binary_data": True}}],
        }
    )
    headers = {
        "Inference-Header-Content-Length": str(len(header)),
        "Content-Type": "application/octet-stream",
    }
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


def both(
    inprocess: InProcess, method: str, path: str, body: bytes, headers: dict[str, str], **how: bool
) -> tuple[Reply, Reply]:
    pairs = [(k, v) for k, v in headers.items()]
    return (
        inprocess.request(inprocess.serving, method, path, body, pairs, **how),
        inprocess.request(inprocess.app, method, path, body, pairs, **how),
    )


def assert_alike(plain: Reply, fastapi: Reply, request_id: str) -> None:
    assert plain.status == fastapi.status, (plain, fastapi)
    assert plain.body == fastapi.body
    assert plain.headers["x-request-id"] == fastapi.headers["x-request-id"] == request_id
    for name in COMPARED_HEADERS:
        assert plain.headers.get(name) == fastapi.headers.get(name), name
    if plain.status >= 400 and plain.body:
        error = orjson.loads(plain.body)
        assert error["request_id"] == request_id and error["error"]


@pytest.mark.parametrize("case", list(CASES))
def test_the_plain_asgi_route_answers_as_the_fastapi_route_does(
    inprocess: InProcess, case: str
) -> None:
    method, path, body, headers = CASES[case]
    request_id = f"case-{case.replace(' ', '-')}"
    plain, fastapi = both(inprocess, method, path, body, {**headers, "X-Request-ID": request_id})
    assert_alike(plain, fastapi, request_id)


def test_a_client_that_leaves_gets_499_on_both(inprocess: InProcess) -> None:
    headers = {**AUTH, "X-Request-ID": "gone"}
    plain, fastapi = both(
        inprocess, "POST", "/v2/models/digits/infer", _digits_json(), headers, disconnect=True
    )
    assert plain.status == 499
    assert_alike(plain, fastapi, "gone")


def test_a_bug_is_a_500_naming_the_request_on_both(inprocess: InProcess) -> None:
    headers = {**AUTH, "X-Request-ID": "bug"}
    with mock.patch.object(Call, "infer", side_effect=RuntimeError("a bug of ours")):
        plain, fastapi = both(inprocess, "POST", "/v2/models/digits/infer", _digits_json(), headers)
    assert plain.status == 500
    assert b"internal server error (request bug); see the server log" in plain.body
    assert_alike(plain, fastapi, "bug")


def test_draining_is_a_503_with_retry_after_on_both(inprocess: InProcess) -> None:
    headers = {**AUTH, "X-Request-ID": "drain"}
    inprocess.dataplane.drain.refusing = True
    try:
        plain, fastapi = both(
            inprocess, "POST", PREDICT, _png(), {**headers, "Content-Type": "image/png"}
        )
    finally:
        inprocess.dataplane.drain.refusing = False
    assert plain.status == 503 and plain.headers["retry-after"] == "1"
    assert_alike(plain, fastapi, "drain")


def test_draining_refuses_preprocess_as_it_refuses_inference(inprocess: InProcess) -> None:
    """``:preprocess`` runs the model's preprocessing: past pre-stop it was still served, and
    the exit did not wait for the ones running."""
    path = PREDICT.replace(":predict", ":preprocess")
    assert (
        inprocess.request(inprocess.serving, "POST", path, _png(), list(PNG.items())).status == 200
    )
    inprocess.dataplane.drain.refusing = True
    try:
        reply = inprocess.request(inprocess.serving, "POST", path, _png(), list(PNG.items()))
    finally:
        inprocess.dataplane.drain.refusing = False
    assert reply.status == 503 and reply.headers["retry-after"] == "1"
    assert b"the server is shutting down" in reply.body


def test_a_deadline_that_passes_in_the_queue_is_a_504_on_both(inprocess: InProcess) -> None:
    body = orjson.loads(_digits_json())
    body["parameters"] = {"timeout": 1}  # one microsecond
    plain, fastapi = both(
        inprocess,
        "POST",
        "/v2/models/digits/infer",
        orjson.dumps(body),
        {**AUTH, "X-Request-ID": "late"},
    )
    assert plain.status == 504
    assert_alike(plain, fastapi, "late")


def test_requests_are_counted_in_the_model_statistics(inprocess: InProcess) -> None:
    stats = inprocess.dataplane.repository.served_versions()[0][1].stats
    before = stats.inference_count
    for _ in range(3):
        reply = inprocess.request(
            inprocess.serving, "POST", "/v2/models/digits/infer", _digits_json(), list(AUTH.items())
        )
        assert reply.status == 200
    assert stats.inference_count - before == 6


def test_a_repeated_header_counts_once_its_first_value_as_in_starlette(
    inprocess: InProcess,
) -> None:
    headers = [
        ("Authorization", f"Bearer {TOKEN}"),
        ("Authorization", "Bearer wrong"),
        ("X-Request-ID", "first-id"),
        ("X-Request-ID", "second-id"),
    ]
    for app in (inprocess.serving, inprocess.app):
        reply = inprocess.request(app, "POST", "/v2/models/digits/infer", _digits_json(), headers)
        assert reply.status == 200, reply
        assert reply.headers["x-request-id"] == "first-id"
