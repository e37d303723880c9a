"""JSON vs binary tensors for one 1×3×224×224 FP32 input (issue: the whole OIP over REST).

    .venv/bin/python -m bench.protocol [--seconds 10] [--connections 4]

1. In process: decode + encode time of the JSON path and of the binary path.
2. Served, with wrk on loopback:
   - a no-op endpoint on the same stack receiving the same binary bytes (the framework ceiling);
   - binary and JSON infer to a "sink" model (ReduceSum, near-zero compute): protocol cost;
   - binary and JSON infer to efficientnet_lite0: what a real model sees.
Writes bench/results/protocol.md and prints it.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import onnx
import orjson
from onnx import TensorProto, helper

from bench.common import WrkResult, publish, table, wait_until_up, wrk
from service.inference import InferenceResult, OutputTensor
from service.protocol.v2 import decode_request, encode_result
from tests.server import MODELS, Server, free_port

SHAPE = [1, 3, 224, 224]


def bodies() -> dict[str, tuple[bytes, int | None]]:
    x = np.random.default_rng(0).standard_normal(SHAPE).astype(np.float32)
    json_body = orjson.dumps(
        {
            "inputs": [
                {"name": "input", "datatype": "FP32", "shape": SHAPE, "data": x.ravel().tolist()}
            ]
        }
    )
    header = orjson.dumps(
        {
            "inputs": [
                {
                    "name": "input",
                    "datatype": "FP32",
                    "shape": SHAPE,
                    "parameters": {"binary_data_size": x.nbytes},
                }
            ],
            "parameters": {"binary_data_output": True},
        }
    )
    return {"json": (json_body, None), "binary": (header + x.tobytes(), len(header))}


def codec_times(reps: int) -> list[list[str]]:
    logits = np.random.default_rng(1).standard_normal((1, 1000)).astype(np.float32)
    rows = []
    for kind, (body, header_length) in bodies().items():
        binary = kind == "binary"
        result = InferenceResult(
            "m", "1", None, [OutputTensor("logits", "FP32", logits)], {}, {}, None, True
        )
        decode, encode = [], []
        for _ in range(reps):
            started = time.perf_counter()
            decode_request(body, header_length)
            decoded = time.perf_counter()
            encode_result(result, binary)
            encode.append(time.perf_counter() - decoded)
            decode.append(decoded - started)
        rows.append(
            [
                kind,
                f"{len(body) / 1e6:.2f} MB",
                f"{statistics.median(decode) * 1e3:.3f}",
                f"{statistics.median(encode) * 1e3:.3f}",
            ]
        )
    return rows


def sink_model(root: Path) -> None:
    node = helper.make_node("ReduceSum", ["input"], ["total"], keepdims=0, axes=[1, 2, 3])
    graph = helper.make_graph(
        [node],
        "sink",
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["batch", 3, 224, 224])],
        [helper.make_tensor_value_info("total", TensorProto.FLOAT, ["batch"])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 11)])
    model.ir_version = 8
    (root / "sink" / "1").mkdir(parents=True)
    onnx.save(model, str(root / "sink" / "1" / "model.onnx"))
    (root / "sink" / "config.yaml").write_text("backend: onnx\nmax_batch_size: 8\n")


def served(seconds: int, connections: int) -> list[list[str]]:
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "models"
        root.mkdir()
        sink_model(root)
        (root / "efficientnet_lite0").symlink_to(MODELS / "efficientnet_lite0")
        env = {"TG_ACCESS_LOG": "false", "TG_LOG_LEVEL": "warning", "TG_INTRA_OP_THREADS": "2"}
        server = Server(root, env=env)
        noop_port = free_port()
        noop = subprocess.Popen([sys.executable, "bench/noop_server.py", str(noop_port)])
        try:
            server.wait_until()
            payloads = bodies()
            binary, header_length = payloads["binary"]
            runs: list[tuple[str, str, bytes, int | None]] = [
                ("no-op endpoint, same bytes", f"http://127.0.0.1:{noop_port}/noop", binary, None),
                ("sink model, binary", f"{server.url}/v2/models/sink/infer", binary, header_length),
                ("sink model, JSON", f"{server.url}/v2/models/sink/infer", *payloads["json"]),
                (
                    "efficientnet_lite0, binary",
                    f"{server.url}/v2/models/efficientnet_lite0/infer",
                    binary,
                    header_length,
                ),
                (
                    "efficientnet_lite0, JSON",
                    f"{server.url}/v2/models/efficientnet_lite0/infer",
                    *payloads["json"],
                ),
            ]
            wait_until_up(f"http://127.0.0.1:{noop_port}/noop", "POST")
            results: dict[str, WrkResult] = {}
            for label, url, body, length in runs:
                content_type = "application/octet-stream" if length else "application/json"
                results[label] = result = wrk(
                    url,
                    body,
                    content_type,
                    connections=connections,
                    seconds=seconds,
                    header_length=length,
                )
                rows.append(
                    [
                        label,
                        f"{result.requests_per_s:.1f}",
                        f"{result.p50_ms:.2f}",
                        f"{result.p99_ms:.2f}",
                        str(result.errors),
                    ]
                )
            ceiling = results["no-op endpoint, same bytes"].requests_per_s
            sink = results["sink model, binary"].requests_per_s
            rows.append(["**sink binary / no-op**", f"**{sink / ceiling:.3f}**", "", "", ""])
        finally:
            noop.terminate()
            noop.wait(timeout=30)
            server.stop()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seconds", type=int, default=10)
    parser.add_argument("--connections", type=int, default=4)
    parser.add_argument("--reps", type=int, default=30)
    args = parser.parse_args()
    report = [
        "# Protocol benchmark: one 1×3×224×224 FP32 tensor",
        "",
        "## In process (median ms; encode = a 1×1000 FP32 output)",
        "",
        table(codec_times(args.reps), ["path", "body", "decode ms", "encode ms"]),
        "",
        f"## Served (wrk, 1 thread, {args.connections} connections, {args.seconds} s each)",
        "",
        table(
            served(args.seconds, args.connections),
            ["target", "req/s", "p50 ms", "p99 ms", "errors"],
        ),
    ]
    publish("protocol", "\n".join(report) + "\n")


if __name__ == "__main__":
    main()
