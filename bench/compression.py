"""What compressing a gRPC answer costs the event loop, and what it saves (#28, finding 2's
latency).

    .venv/bin/python -m bench.compression [--calls 5]

gRPC compresses an answer in the thread that sends it, which for ``grpc.aio`` is the event
loop every request shares. For answers of several sizes, of float32 noise (what most model
outputs look like to zlib) and of zeros: zlib's time and ratio in process at levels 6 and 1,
then one server's ModelInfer time (an identity model echoing the tensor; best of ``--calls``)
from a client accepting gzip and from one accepting only identity, one after the other.
Answers over ``MAX_COMPRESS_BYTES``, and smaller ones whose sample does not shrink by a tenth
(noise), go plain whatever the client accepts, so their two times should agree. Writes bench/results/compression.md.
"""

from __future__ import annotations

import argparse
import tempfile
import time
import zlib
from pathlib import Path

import grpc
import numpy as np

from bench.common import publish, table
from service.grpc.servicer import MAX_COMPRESS_BYTES, worth_compressing
from service.inference import InferenceResult, OutputTensor
from service.protocol.pb import grpc_service_pb2 as pb
from service.protocol.pb import grpc_service_pb2_grpc as pb_grpc
from tests.identity import write_identity_model
from tests.server import Server

SIZES_KIB = (16, 64, 1024, 16 * 1024)
OPTIONS = [
    ("grpc.max_send_message_length", -1),
    ("grpc.max_receive_message_length", -1),
    ("grpc.use_local_subchannel_pool", 1),
]
IDENTITY_ONLY = [("grpc.compression_enabled_algorithms_bitset", 1)]


def payload(kind: str, kib: int) -> bytes:
    values = kib * 256
    if kind == "zeros":
        return bytes(4 * values)
    return np.random.default_rng(0).standard_normal(values).astype(np.float32).tobytes()


def compressed(data: bytes) -> bool:
    """Whether the server compresses this answer, one FP32 output of these bytes, for a client
    that accepts gzip (its own rule)."""
    output = OutputTensor("out_FP32", "FP32", np.frombuffer(data, np.float32))
    return worth_compressing(InferenceResult("identity", "1", None, [output], {}, {}, None, True))


def zlib_ms(data: bytes, level: int) -> tuple[float, float]:
    """zlib's best time of three at ``level`` (ms) and the compressed size over the size."""
    times, size = [], 0
    for _ in range(3):
        started = time.perf_counter()
        size = len(zlib.compress(data, level))
        times.append(time.perf_counter() - started)
    return min(times) * 1000, size / len(data)


def served_ms(address: str, data: bytes, options: list[tuple[str, int]], calls: int) -> float:
    values = len(data) // 4
    request = pb.ModelInferRequest(
        model_name="identity",
        inputs=[{"name": "in_FP32", "datatype": "FP32", "shape": [1, values]}],
        raw_input_contents=[data],
    )
    with grpc.insecure_channel(address, options=OPTIONS + options) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        stub.ModelInfer(request, timeout=120)  # the connection's setup
        times = []
        for _ in range(calls):
            started = time.perf_counter()
            stub.ModelInfer(request, timeout=120)
            times.append(time.perf_counter() - started)
    return min(times) * 1000


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--calls", type=int, default=5)
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        root = Path(folder) / "models"
        write_identity_model(root / "identity", max_batch_size=8, datatypes=("FP32",), width="w")
        server = Server(root, env={"TG_WORKERS": "1"}, log_path=Path(folder) / "server.log")
        try:
            server.wait_until(timeout=300)
            for kind in ("float32 noise", "zeros"):
                for kib in SIZES_KIB:
                    data = payload(kind, kib)
                    level6, ratio = zlib_ms(data, 6)
                    level1, _ = zlib_ms(data, 1)
                    gzip = served_ms(server.grpc_url, data, [], args.calls)
                    plain = served_ms(server.grpc_url, data, IDENTITY_ONLY, args.calls)
                    rows.append(
                        [
                            kind,
                            f"{kib:,}",
                            "yes" if compressed(data) else "no",
                            f"{level6:.2f}",
                            f"{level1:.2f}",
                            f"{ratio:.2f}",
                            f"{gzip:.1f}",
                            f"{plain:.1f}",
                            f"{gzip / plain:.2f}",
                        ]
                    )
                    print(" | ".join(rows[-1]), flush=True)
        finally:
            server.stop()
    text = "\n\n".join(
        [
            "# What compressing a gRPC answer costs (`python -m bench.compression`)",
            f"One worker; MAX_COMPRESS_BYTES = {MAX_COMPRESS_BYTES >> 10} KiB. zlib: in process, "
            f"best of 3. Served: ModelInfer on an identity model, best of {args.calls} calls.",
            table(
                rows,
                [
                    "data",
                    "answer KiB",
                    "compressed when the client accepts",
                    "zlib level 6 ms",
                    "zlib level 1 ms",
                    "compressed / size",
                    "served ms, client accepts gzip",
                    "served ms, identity only",
                    "gzip / identity",
                ],
            ),
        ]
    )
    publish("compression", text)


if __name__ == "__main__":
    main()
