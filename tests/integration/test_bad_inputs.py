"""Every bad input gets a 4xx naming the problem, and the server carries on serving."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from tests.server import Server

pytestmark = pytest.mark.integration

DIGIT = {"name": "image", "datatype": "FP32", "shape": [1, 1, 8, 8], "data": [0.0] * 64}


def infer_body(**changes: Any) -> bytes:
    tensor = {**DIGIT, **changes}
    return orjson.dumps({"inputs": [{k: v for k, v in tensor.items() if v is not None}]})


CASES = [
    (
        "unknown model",
        "POST",
        "/v2/models/nope/infer",
        infer_body(),
        "application/json",
        404,
        "unknown model 'nope'",
    ),
    (
        "unknown version",
        "POST",
        "/v2/models/digits/versions/7/infer",
        infer_body(),
        "application/json",
        404,
        "has no version '7'",
    ),
    (
        "wrong datatype",
        "POST",
        "/v2/models/digits/infer",
        infer_body(datatype="FP64"),
        "application/json",
        400,
        "input 'image': expected FP32 [-1, 1, 8, 8], got FP64 [1, 1, 8, 8]",
    ),
    (
        "wrong shape",
        "POST",
        "/v2/models/digits/infer",
        infer_body(shape=[1, 8, 8, 1]),
        "application/json",
        400,
        "expected FP32 [-1, 1, 8, 8], got FP32 [1, 8, 8, 1]",
    ),
    (
        "missing input",
        "POST",
        "/v2/models/digits/infer",
        infer_body(name="pixels"),
        "application/json",
        400,
        "has no input ['pixels']",
    ),
    (
        "element count",
        "POST",
        "/v2/models/digits/infer",
        infer_body(data=[0.0] * 63),
        "application/json",
        400,
        "needs 64 elements, 'data' has 63",
    ),
    (
        "malformed JSON",
        "POST",
        "/v2/models/digits/infer",
        b'{"inputs": [',
        "application/json",
        400,
        "not valid JSON",
    ),
    (
        "empty infer body",
        "POST",
        "/v2/models/digits/infer",
        b"",
        "application/json",
        400,
        "request body is empty",
    ),
    (
        "too many rows",
        "POST",
        "/v2/models/digits/infer",
        infer_body(shape=[1025, 1, 8, 8], data=[0.0] * 64 * 1025),
        "application/json",
        413,
        "1025 rows is above the 1024 one request may carry",
    ),
    (
        "zero rows",
        "POST",
        "/v2/models/digits/infer",
        infer_body(shape=[0, 1, 8, 8], data=[]),
        "application/json",
        400,
        "needs at least 1 row",
    ),
    (
        "unknown output",
        "POST",
        "/v2/models/digits/infer",
        orjson.dumps({"inputs": [DIGIT], "outputs": [{"name": "probs"}]}),
        "application/json",
        400,
        "requested output 'probs' is not an output",
    ),
    (
        "non-image body",
        "POST",
        "/v1/models/efficientnet_lite0:predict",
        b"%PDF-1.4 not an image",
        "image/jpeg",
        400,
        "cannot decode image",
    ),
    (
        "empty predict body",
        "POST",
        "/v1/models/efficientnet_lite0:predict",
        b"",
        "image/jpeg",
        400,
        "request body is empty",
    ),
    (
        "bad base64",
        "POST",
        "/v1/models/efficientnet_lite0:predict",
        b'{"instances": [{"b64": "***"}]}',
        "application/json",
        400,
        "is not valid base64",
    ),
    (
        "instances not a list",
        "POST",
        "/v1/models/efficientnet_lite0:predict",
        b'{"instances": 3}',
        "application/json",
        400,
        '{"instances": [...]}',
    ),
    (
        "unsupported content type",
        "POST",
        "/v1/models/efficientnet_lite0:predict",
        b"hello",
        "text/plain",
        415,
        "Content-Type 'text/plain' is not accepted by 'efficientnet_lite0:predict'; send "
        'application/json with {"instances": [...]} (texts, JSON values',
    ),
    (
        "an image to v2 infer",  # it was a 400 about UTF-8 surrogates, the JPEG parsed as JSON
        "POST",
        "/v2/models/efficientnet_lite0/infer",
        b"\xff\xd8\xff\xe0 a JPEG",
        "image/jpeg",
        415,
        "send a raw image to POST /v1/models/efficientnet_lite0:predict",
    ),
    ("unknown model metadata", "GET", "/v2/models/nope", b"", "", 404, "unknown model 'nope'"),
    ("unknown model ready", "GET", "/v2/models/nope/ready", b"", "", 404, "unknown model"),
    ("traversal path", "GET", "/v2/models/..%2F..%2Fetc", b"", "", 400, "an encoded slash (%2F)"),
    ("dot-dot name", "GET", "/v2/models/%2e%2e/ready", b"", "", 404, "unknown model '..'"),
    ("unknown route", "GET", "/v2/nothing/here", b"", "", 404, "no route /v2/nothing/here"),
]


@pytest.mark.parametrize(
    ("method", "path", "body", "content_type", "status", "message"),
    [case[1:] for case in CASES],
    ids=[case[0] for case in CASES],
)
def test_bad_input_gets_a_4xx_naming_the_problem(
    server: Server,
    method: str,
    path: str,
    body: bytes,
    content_type: str,
    status: int,
    message: str,
) -> None:
    headers = {"content-type": content_type} if content_type else {}
    response = server.client.request(method, path, content=body, headers=headers)
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == "application/json"
    assert message in response.json()["error"]


def test_server_keeps_serving_after_every_bad_input(server: Server) -> None:
    for _, method, path, body, content_type, _, _ in CASES:
        server.client.request(method, path, content=body, headers={"content-type": content_type})
    assert server.client.get("/v2/health/ready").json() == {"ready": True}
    response = server.client.post("/v2/models/digits/infer", content=infer_body())
    assert response.status_code == 200
    assert response.json()["outputs"][0]["shape"] == [1, 10]
