"""KServe's Python SDK (``kserve.InferenceRESTClient``, v2 protocol) against a real server.

The SDK reads health from the JSON body (``{"live": true}``), not the status code, and offers
live, ready, model ready and infer; it has no model-metadata call, so metadata is read with
its own httpx client the same way it reads the other routes. The client runs in a process of
its own: the SDK registers the same protobuf names as tritonclient.grpc, which other tests of
this session import, and one process cannot hold both.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from tests.server import REPO_ROOT, Server

pytestmark = pytest.mark.integration

CLIENT = textwrap.dedent("""
    import asyncio, sys
    import httpx, numpy as np
    from kserve import InferenceRESTClient, InferInput, InferRequest, RESTConfig

    url, binary = sys.argv[1], sys.argv[2] == "binary"

    async def run():
        client = InferenceRESTClient(RESTConfig(protocol="v2", timeout=60))
        try:
            assert await client.is_server_live(url) is True
            assert await client.is_server_ready(url) is True
            assert await client.is_model_ready(url, "digits") is True
            x = np.random.default_rng(0).standard_normal((2, 1, 8, 8)).astype(np.float32)
            tensor = InferInput("image", list(x.shape), "FP32")
            tensor.set_data_from_numpy(x, binary_data=binary)
            request = InferRequest(model_name="digits", infer_inputs=[tensor], request_id="k-1")
            response = await client.infer(url, request, model_name="digits")
            assert response.id == "k-1", response.id
            outputs = {o.name: o for o in response.outputs}
            assert set(outputs) == {"logits", "classification"}, set(outputs)
            output = outputs["logits"]
            assert output.as_numpy().shape == (2, 10)
            expected = httpx.post(
                f"{url}/v2/models/digits/infer",
                json={"inputs": [{"name": "image", "datatype": "FP32", "shape": [2, 1, 8, 8],
                                  "data": x.ravel().tolist()}]},
            ).json()["outputs"][0]["data"]
            np.testing.assert_allclose(output.as_numpy().ravel(), expected, atol=1e-6)
            metadata = (await client._client.get(f"{url}/v2/models/digits")).json()
            assert metadata["platform"] == "pytorch_libtorch", metadata["platform"]
        finally:
            await client.close()

    asyncio.run(run())
    print("ok")
""")


@pytest.mark.parametrize("binary", ["json", "binary"])
def test_kserve_sdk_health_and_infer(server: Server, binary: str) -> None:
    done = subprocess.run(
        [sys.executable, "-c", CLIENT, server.url, binary],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]
