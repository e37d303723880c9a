"""Compressed requests and answers with NVIDIA's client, and a compression bomb."""

from __future__ import annotations

import gzip
import zlib
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as tgrpc
import tritonclient.http as thttp

from tests.server import Server

pytestmark = pytest.mark.integration


@pytest.mark.parametrize("algorithm", ["gzip", "deflate"])
@pytest.mark.parametrize("binary", [False, True])
def test_tritonclient_compresses_requests_and_answers(
    server: Server, algorithm: str, binary: bool
) -> None:
    client = thttp.InferenceServerClient(server.url.removeprefix("http://"))
    x = np.random.default_rng(0).standard_normal((2, 3, 224, 224)).astype(np.float32)
    tensor = thttp.InferInput("input", list(x.shape), "FP32")
    tensor.set_data_from_numpy(x, binary_data=binary)
    wanted = [thttp.InferRequestedOutput("logits", binary_data=binary)]
    plain = client.infer("efficientnet_lite0", [tensor], outputs=wanted).as_numpy("logits")
    squeezed = client.infer(
        "efficientnet_lite0", [tensor], outputs=wanted,
        request_compression_algorithm=algorithm, response_compression_algorithm=algorithm,
    ).as_numpy("logits")  # fmt: skip
    np.testing.assert_allclose(squeezed, plain, atol=1e-5)


def test_answers_are_compressed_only_when_asked_and_worth_it(server: Server) -> None:
    body = {"inputs": [{"name": "image", "datatype": "FP32", "shape": [8, 1, 8, 8],
                        "data": [0.5] * 512}]}  # fmt: skip
    asked = server.client.post(
        "/v2/models/digits/infer", json=body, headers={"accept-encoding": "gzip"}
    )
    assert asked.status_code == 200 and asked.headers["content-encoding"] == "gzip"
    assert asked.json()["outputs"][0]["shape"] == [8, 10]  # httpx inflates it
    small = dict(body, inputs=[dict(body["inputs"][0], shape=[1, 1, 8, 8], data=[0.5] * 64)])
    plain = server.client.post(
        "/v2/models/digits/infer", json=small, headers={"accept-encoding": "identity"}
    )
    assert "content-encoding" not in plain.headers


def test_grpc_compression_as_the_client_asks(server: Server) -> None:
    client = tgrpc.InferenceServerClient(server.grpc_url)
    x = np.ones((1, 1, 8, 8), np.float32)
    tensor = tgrpc.InferInput("image", list(x.shape), "FP32")
    tensor.set_data_from_numpy(x)
    for algorithm in ("gzip", "deflate"):
        result = client.infer("digits", [tensor], compression_algorithm=algorithm)
        assert result.as_numpy("logits").shape == (1, 10)


def _rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


@pytest.mark.parametrize("encoding", ["gzip", "deflate"])
def test_a_compression_bomb_is_413_and_memory_stays_flat(server: Server, encoding: str) -> None:
    inflated = 1 << 30  # 1 GiB of zeros, far above TG_MAX_BODY_BYTES (64 MiB)
    chunk = bytes(1 << 20)
    packer = zlib.compressobj(9, zlib.DEFLATED, 31 if encoding == "gzip" else 15)
    bomb = b"".join(packer.compress(chunk) for _ in range(inflated >> 20)) + packer.flush()
    assert len(bomb) < 2 << 20
    before = _rss_kib(server.process.pid)
    response = server.client.post(
        "/v2/models/digits/infer", content=bomb,
        headers={"content-encoding": encoding, "content-type": "application/json"},
    )  # fmt: skip
    assert response.status_code == 413, response.text
    assert "inflates past the limit" in response.json()["error"]
    grown_mib = (_rss_kib(server.process.pid) - before) / 1024
    assert grown_mib < 64 + 16, grown_mib  # at most the body limit, never the bomb's size
    bad = server.client.post(
        "/v2/models/digits/infer", content=gzip.compress(b"{}")[:-6],
        headers={"content-encoding": "gzip"},
    )  # fmt: skip
    assert bad.status_code == 400
