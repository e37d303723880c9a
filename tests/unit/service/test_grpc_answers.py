"""gRPC's inference answers, served in process by a real grpc.aio server on 127.0.0.1."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest

from service.core.dataplane import OFFLOAD_BYTES, DataPlane
from service.protocol import grpc as codec
from service.protocol.grpc import pb
from service.settings import Settings
from tests.asgi import InProcess
from tests.identity import write_identity_model
from tests.server import free_port

pytestmark = pytest.mark.unit
STREAM = "/inference.GRPCInferenceService/ModelStreamInfer"


def _request(values: int, request_id: str, name: str = "in_FP32") -> pb.ModelInferRequest:
    request = pb.ModelInferRequest(model_name="identity", id=request_id)
    request.inputs.add(name=name, datatype="FP32", shape=[1, values])
    request.raw_input_contents.append(np.full(values, 0.5, np.float32).tobytes())
    return request


def test_stream_answers_are_serialized_by_the_handler_the_large_ones_off_the_event_loop(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """grpc serializes what a handler yields in the event loop's thread: a 60 MiB stream answer
    held the loop about 60 ms, and 90 ms more to wrap its ``ModelInferResponse`` in a
    ``ModelStreamInferResponse`` (#28). The stream's answers now reach grpc as bytes, each
    serialized by the handler (``codec.serialized``), a large one in the pool as ModelInfer's
    are; a failed request still answers its error and id."""
    write_identity_model(tmp_path / "identity", datatypes=("FP32",), width="w")
    serializing: dict[int, int] = {}  # answer bytes → the thread that serialized them
    real_offload = DataPlane.offload

    async def offload(self: DataPlane, size: int, fn: Any, *args: Any, **kwargs: Any) -> Any:
        if fn is codec.serialized:
            serialize = fn

            def fn(*args: Any) -> Any:
                serialized: bytes = serialize(*args)
                serializing[len(serialized)] = threading.get_ident()
                return serialized

        return await real_offload(self, size, fn, *args, **kwargs)

    monkeypatch.setattr(DataPlane, "offload", offload)
    settings = Settings(
        model_repository=tmp_path,
        grpc_port=free_port(),
        intra_op_threads=1,
        preprocess_threads=1,
        access_log=False,
    )
    running = InProcess(settings)
    try:
        loop = running.run(_thread())
        large = OFFLOAD_BYTES  # values: 4 bytes each
        with grpc.insecure_channel(f"127.0.0.1:{settings.grpc_port}") as channel:
            stream = channel.stream_stream(
                STREAM,
                request_serializer=pb.ModelInferRequest.SerializeToString,
                response_deserializer=pb.ModelStreamInferResponse.FromString,
            )
            sent = [_request(large, "large"), _request(3, "small"), _request(3, "bad", "nope")]
            answers = {a.infer_response.id: a for a in stream(_each(sent), timeout=60)}
    finally:
        running.close()
    assert set(answers) == {"large", "small", "bad"}
    for request_id, values in (("large", large), ("small", 3)):
        answer = answers[request_id]
        assert answer.error_message == ""
        assert list(answer.infer_response.outputs[0].shape) == [1, values]
        data = np.frombuffer(answer.infer_response.raw_output_contents[0], np.float32)
        np.testing.assert_array_equal(data, np.full(values, 0.5, np.float32))
    assert "nope" in answers["bad"].error_message
    assert answers["bad"].infer_response.model_name == "identity"
    sizes = sorted(serializing)
    assert len(sizes) == 2  # each answer that did not fail, serialized by the handler
    assert serializing[sizes[0]] == loop  # the small one, where the hop costs more
    assert serializing[sizes[1]] != loop  # the large one, in the pool


def _each(requests: list[pb.ModelInferRequest]) -> Iterator[pb.ModelInferRequest]:
    yield from requests


async def _thread() -> int:
    return threading.get_ident()
