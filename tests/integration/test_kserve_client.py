"""KServe's Python SDK (``kserve.InferenceRESTClient``, v2 protocol) against a real server.

The SDK reads health from the JSON body (``{"live": true}``), not the status code, and offers
live, ready, model ready and infer; it has no model-metadata call, so metadata is read with
its own httpx client the same way it reads the other routes.
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from kserve import InferenceRESTClient, InferInput, InferRequest, RESTConfig

from tests.server import Server

pytestmark = pytest.mark.integration


@pytest.mark.parametrize("binary", [False, True])
def test_kserve_sdk_health_and_infer(server: Server, binary: bool) -> None:
    async def run() -> None:
        client = InferenceRESTClient(RESTConfig(protocol="v2", timeout=60))
        try:
            assert await client.is_server_live(server.url) is True
            assert await client.is_server_ready(server.url) is True
            assert await client.is_model_ready(server.url, "digits") is True
            x = np.random.default_rng(0).standard_normal((2, 1, 8, 8)).astype(np.float32)
            tensor = InferInput("image", list(x.shape), "FP32")
            tensor.set_data_from_numpy(x, binary_data=binary)
            request = InferRequest(model_name="digits", infer_inputs=[tensor], request_id="k-1")
            response = await client.infer(server.url, request, model_name="digits")
            assert response.id == "k-1"
            outputs = {o.name: o for o in response.outputs}
            assert set(outputs) == {"logits", "classification"}
            output = outputs["logits"]
            assert output.as_numpy().shape == (2, 10)
            expected = server.client.post(
                "/v2/models/digits/infer",
                json={"inputs": [{"name": "image", "datatype": "FP32", "shape": [2, 1, 8, 8],
                                  "data": x.ravel().tolist()}]},
            ).json()["outputs"][0]["data"]  # fmt: skip
            np.testing.assert_allclose(output.as_numpy().ravel(), expected, atol=1e-6)
            metadata = (await client._client.get(f"{server.url}/v2/models/digits")).json()
            assert metadata["platform"] == "pytorch_libtorch"
        finally:
            await client.close()

    asyncio.run(run())
