"""Bystanders an attack must leave be: idle gRPC streams (bench.attacks and the round-three
tests open them before an attack and ask each a request after it)."""

from __future__ import annotations

import queue
from collections.abc import Iterator

import grpc

from service.protocol.pb import grpc_service_pb2 as pb
from service.protocol.pb import grpc_service_pb2_grpc as pb_grpc

DIGITS_MESSAGE = pb.ModelInferRequest(
    model_name="digits",
    inputs=[{"name": "image", "datatype": "FP32", "shape": [1, 1, 8, 8]}],
    raw_input_contents=[bytes(4 * 64)],
)


class IdleStreams:
    """``count`` ModelStreamInfer streams to digits on one connection to ``target``, each asked
    a request when :meth:`ask` is called, idle in between. An idle stream's read looks like a
    stalled message's (``service.grpc.arriving``), and only the oldest reads are kept when the
    heap grows: whether an attack's memory ends streams that sent nothing."""

    def __init__(self, target: str, count: int = 8) -> None:
        options = [("grpc.use_local_subchannel_pool", 1)]  # a connection of their own
        self.channel = grpc.insecure_channel(target, options=options)
        stub = pb_grpc.GRPCInferenceServiceStub(self.channel)
        self.requests: list[queue.Queue[pb.ModelInferRequest | None]] = []
        self.answers: list[Iterator[pb.ModelStreamInferResponse]] = []
        for _ in range(count):
            requests: queue.Queue[pb.ModelInferRequest | None] = queue.Queue()
            self.requests.append(requests)
            self.answers.append(stub.ModelStreamInfer(iter(requests.get, None), timeout=900))

    def ask(self) -> list[str]:
        """A request on each stream: "answered", the answer's error, or the code that ended
        the stream."""
        said = []
        for requests, answers in zip(self.requests, self.answers, strict=True):
            requests.put(DIGITS_MESSAGE)
            try:
                said.append(next(answers).error_message or "answered")
            except grpc.RpcError as exc:
                said.append(exc.code().name)
            except StopIteration:
                said.append("ended")
        return said

    def close(self) -> None:
        for requests in self.requests:
            requests.put(None)
        self.channel.close()
