"""gRPC vs REST binary vs REST JSON on one server, in one sitting, alternating (issue #16).

    .venv/bin/python -m bench.grpc [--seconds 5] [--rounds 3]

One server holds efficientnet_lite0 and the W2 MLP, with gRPC on. Both sides are driven by
load generators written in C, so that neither protocol's client starves the 2-core machine
more than the other's: wrk (HTTP/1.1, keep-alive connections) for REST, and h2load (nghttp2)
for gRPC. A unary gRPC call is one HTTP/2 POST of a length-prefixed protobuf message
(``content-type: application/grpc``); h2load sends it as any other body, on one connection
with N concurrent streams (what a gRPC client's channel does), and counts requests/s and the
mean latency (it reports no percentiles). Cells: W2 (1×64 FP32) at 1 and 64 concurrent,
efficientnet_lite0 (1×3×224×224 FP32 tensor) at 1 and 16. Each round runs every cell once, the
protocols in an order that flips every round; figures are medians over rounds (min–max).
For W2, the same frame also goes to an empty grpc.aio server (every call answered with an empty
message, in a process of its own): the library's ceiling on this machine, whatever a server
does with the calls. Writes bench/results/grpc.md.
"""

from __future__ import annotations

import argparse
import re
import shutil
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import grpc
import numpy as np
import orjson

from bench.batching import mlp_models
from bench.common import publish, table, wrk
from service.protocol.pb import grpc_service_pb2 as pb
from tests.server import MODELS, Server, free_port

SERVER_ENV = {"TG_ACCESS_LOG": "false", "TG_LOG_LEVEL": "warning", "TG_INTRA_OP_THREADS": "2"}
GRPC_PATH = "/inference.GRPCInferenceService/ModelInfer"


def bodies(model: str, shape: tuple[int, ...], name: str) -> dict[str, tuple[bytes, int | None]]:
    """The same tensor as a REST JSON body, a REST binary body, and a gRPC frame."""
    x = np.random.default_rng(1).standard_normal(shape).astype(np.float32)
    json_body = orjson.dumps({"inputs": [{"name": name, "datatype": "FP32", "shape": list(shape),
                                          "data": x.ravel().tolist()}]})  # fmt: skip
    header = orjson.dumps({"inputs": [{"name": name, "datatype": "FP32", "shape": list(shape),
                                       "parameters": {"binary_data_size": x.nbytes}}]})  # fmt: skip
    request = pb.ModelInferRequest(model_name=model, raw_input_contents=[x.tobytes()])
    tensor = request.inputs.add()
    tensor.name, tensor.datatype = name, "FP32"
    tensor.shape.extend(shape)
    message = request.SerializeToString()
    frame = b"\x00" + struct.pack(">I", len(message)) + message  # gRPC's length prefix
    return {"REST JSON": (json_body, None), "REST binary": (header + x.tobytes(), len(header)),
            "gRPC": (frame, None)}  # fmt: skip


def h2load(url: str, frame: bytes, streams: int, seconds: int) -> tuple[float, float]:
    """Requests/s and mean latency (ms) of unary gRPC calls, ``streams`` at once on one
    HTTP/2 connection."""
    binary = shutil.which("h2load")
    if binary is None:
        raise SystemExit("h2load is not installed: `apt-get install nghttp2-client`")
    with tempfile.NamedTemporaryFile(suffix=".bin") as body:
        body.write(frame)
        body.flush()
        out = subprocess.run(
            [binary, "-D", str(seconds), "-c", "1", "-m", str(streams), "-d", body.name,
             "-H", "content-type: application/grpc", "-H", "te: trailers", url + GRPC_PATH],
            capture_output=True, text=True, timeout=seconds + 60, check=True,
        ).stdout  # fmt: skip
    rate = re.search(r"finished in [\d.]+\w+, ([\d.]+) req/s", out)
    failed = re.search(r"requests: .* (\d+) failed", out)
    mean = re.search(r"time for request:\s+\S+\s+\S+\s+(\S+)", out)
    assert rate and failed and mean, out
    assert int(failed.group(1)) == 0, out
    value = float(re.sub(r"[a-z]+$", "", mean.group(1)))
    unit = re.search(r"[a-z]+$", mean.group(1))
    ms = (
        value / 1000
        if unit and unit.group(0) == "us"
        else value * 1000
        if unit and unit.group(0) == "s"
        else value
    )
    return float(rate.group(1)), ms


EMPTY_SERVER = """
import asyncio, sys
import grpc
import uvloop

async def empty(request, context):
    return b""

async def main():
    server = grpc.aio.server()
    handler = grpc.unary_unary_rpc_method_handler(empty)
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(
        "inference.GRPCInferenceService", {"ModelInfer": handler})])
    server.add_insecure_port("127.0.0.1:" + sys.argv[1])
    await server.start()
    await server.wait_for_termination()

uvloop.run(main())
"""
"""The ceiling of grpcio's asyncio server on this machine: every call answered with an empty
message, no decoding, no model, in an event loop of its own (as the server's, uvloop)."""


def empty_server() -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    process = subprocess.Popen([sys.executable, "-c", EMPTY_SERVER, str(port)])
    url = f"127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while True:
        try:
            with grpc.insecure_channel(url) as channel:
                grpc.channel_ready_future(channel).result(timeout=1)
            return process, url
        except grpc.FutureTimeoutError:
            if time.monotonic() > deadline:
                process.kill()
                raise


def check_grpc(server: Server, model: str, frame: bytes) -> None:
    """One call through the real client stack: the frame must be a valid request."""
    request = pb.ModelInferRequest.FromString(frame[5:])
    with grpc.insecure_channel(server.grpc_url) as channel:
        call = channel.unary_unary(GRPC_PATH, request_serializer=pb.ModelInferRequest.SerializeToString,
                                   response_deserializer=pb.ModelInferResponse.FromString)  # fmt: skip
        answer = call(request, timeout=30)
    assert answer.model_name == model and answer.raw_output_contents, answer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    cells = [("W2", "mlp", (1, 64), "x", 1), ("W2", "mlp", (1, 64), "x", 64),
             ("efficientnet_lite0", "efficientnet_lite0", (1, 3, 224, 224), "input", 1),
             ("efficientnet_lite0", "efficientnet_lite0", (1, 3, 224, 224), "input", 16)]  # fmt: skip
    results: dict[tuple[str, int, str], list[tuple[float, float]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "models"
        root.mkdir()
        (root / "efficientnet_lite0").symlink_to(MODELS / "efficientnet_lite0")
        mlp_models(root)
        server = Server(root, env=SERVER_ENV)
        ceiling, ceiling_url = empty_server()
        try:
            server.wait_until(timeout=300)
            payloads = {(m, s): bodies(m, s, n) for _, m, s, n, _ in cells}
            for (model, _), kinds in payloads.items():
                check_grpc(server, model, kinds["gRPC"][0])
            for round_ in range(args.rounds):
                for label, model, shape, _, concurrency in cells:
                    kinds = payloads[(model, shape)]
                    order = list(kinds) if round_ % 2 == 0 else list(kinds)[::-1]
                    for kind in order:
                        body, header_length = kinds[kind]
                        if kind == "gRPC":
                            figure = h2load(
                                f"http://{server.grpc_url}", body, concurrency, args.seconds
                            )
                        else:
                            ct = (
                                "application/json"
                                if header_length is None
                                else "application/octet-stream"
                            )
                            result = wrk(f"{server.url}/v2/models/{model}/infer", body, ct,
                                         connections=concurrency, seconds=args.seconds,
                                         header_length=header_length)  # fmt: skip
                            assert result.errors == 0, (kind, label, result)
                            figure = (result.requests_per_s, result.p50_ms)
                        results.setdefault((label, concurrency, kind), []).append(figure)
                    if label == "W2":  # the library's own ceiling, in the same rotation
                        figure = h2load(f"http://{ceiling_url}", kinds["gRPC"][0], concurrency,
                                        args.seconds)  # fmt: skip
                        results.setdefault((label, concurrency, "ceiling"), []).append(figure)
        finally:
            server.stop()
            ceiling.terminate()
            ceiling.wait(timeout=30)
    rows = []
    for label, _, _, _, concurrency in cells:
        row = [label, str(concurrency)]
        for kind in ("REST JSON", "REST binary", "gRPC"):
            figures = results[(label, concurrency, kind)]
            rates = [r for r, _ in figures]
            row.append(f"{statistics.median(rates):.0f} ({min(rates):.0f}–{max(rates):.0f})")
        grpc_rate = statistics.median(r for r, _ in results[(label, concurrency, "gRPC")])
        binary_rate = statistics.median(r for r, _ in results[(label, concurrency, "REST binary")])
        row.append(f"{grpc_rate / binary_rate:.2f}")
        ceiling = [r for r, _ in results.get((label, concurrency, "ceiling"), [])]
        row.append(f"{statistics.median(ceiling) / binary_rate:.2f}" if ceiling else "")
        rows.append(row)
    header = ["workload", "concurrent", "REST JSON req/s", "REST binary req/s", "gRPC req/s",
              "gRPC / REST binary", "empty grpc.aio server / REST binary"]  # fmt: skip
    publish("grpc", f"# gRPC vs REST, {args.rounds} alternating rounds of {args.seconds} s\n\n"
                    f"median (min–max)\n\n{table(rows, header)}\n")  # fmt: skip


if __name__ == "__main__":
    main()
