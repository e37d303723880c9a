"""What each HTTP-stack choice buys: uvloop vs asyncio's own loop, httptools vs h11, orjson vs
the standard json module, numpy decoding vs pydantic validation of tensor data.

    .venv/bin/python -m bench.stack [--seconds 6]

Served: the W2 model (64→256→10 MLP, JSON tensor, 64 connections, wrk) on tensorgate's app
under each loop × parser pair, and with uvicorn's own httptools protocol instead of the one that
writes each response at once; the chosen pair first and last (so drift shows). In process: a
request's JSON decoding and a response's encoding, both ways. Writes bench/results/stack.md.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import orjson
from pydantic import BaseModel

from bench.batching import SERVER_ENV, mlp_models, read_response
from bench.common import publish, table, wait_until_up, wrk
from service.inference import InferenceResult, OutputTensor
from service.protocol.v2 import decode_request, encode_result
from tests.server import free_port

# "guarded" is tensorgate's own: uvicorn's httptools protocol with the connection bounds of
# service/limits/connections.py (what `tensorgate serve` runs). It runs first and last.
PAIRS = [
    ("uvloop", "guarded"),
    ("uvloop", "httptools"),
    ("asyncio", "httptools"),
    ("uvloop", "h11"),
    ("asyncio", "h11"),
    ("uvloop", "guarded"),
]


def serve(repository: Path, port: int, loop: str, http: str) -> None:
    """The child process: tensorgate's app as ``tensorgate serve`` builds it, on one pair."""
    import uvicorn

    from service.app import create_app, serving_app
    from service.limits.connections import ConnectionLimits, guarded_protocol
    from service.settings import Settings
    from service.telemetry import logs

    settings = Settings(
        model_repository=repository,
        port=port,
        access_log=False,
        log_level="warning",
        intra_op_threads=2,
    )
    logs.configure(settings.log_level)
    app = create_app(settings)
    protocol: type[asyncio.Protocol] | str = http
    if http == "guarded":
        protocol = guarded_protocol(
            ConnectionLimits(
                settings.max_connections,
                settings.max_header_bytes,
                settings.header_timeout_s,
                settings.body_timeout_s,
            )
        )
    config = uvicorn.Config(
        serving_app(app, settings),
        host="127.0.0.1",
        port=port,
        loop=loop,
        http=protocol,
        log_config=None,
        access_log=False,
    )
    uvicorn.Server(config).run()


def served(seconds: int) -> list[list[str]]:
    x = np.random.default_rng(1).standard_normal((1, 64)).astype(np.float32)
    body = orjson.dumps(
        {
            "inputs": [
                {"name": "x", "datatype": "FP32", "shape": [1, 64], "data": x.ravel().tolist()}
            ]
        }
    )
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "models"
        root.mkdir()
        mlp_models(root)
        for loop, http in PAIRS:
            port = free_port()
            child = subprocess.Popen(
                [sys.executable, "-m", "bench.stack", "--serve", str(root), str(port), loop, http],
                env={**os.environ, **SERVER_ENV},
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            try:
                wait_until_up(f"http://127.0.0.1:{port}/v2/health/ready")
                url = f"http://127.0.0.1:{port}/v2/models/mlp/infer"
                wrk(url, body, "application/json", connections=64, seconds=2)  # settle, unmeasured
                result = wrk(url, body, "application/json", connections=64, seconds=seconds)
                rows.append(
                    [
                        f"{loop} + {http}",
                        f"{result.requests_per_s:.0f}",
                        f"{result.p50_ms:.2f}",
                        f"{result.p99_ms:.2f}",
                        str(result.errors),
                    ]
                )
            finally:
                child.terminate()
                child.wait(timeout=30)
    return rows


def alternating(requests: int) -> list[list[str]]:
    """tensorgate's guarded protocol against uvicorn's own httptools protocol, under uvloop: single
    W2 requests sent to a server of each kind in turn (``requests`` each, keep-alive sockets),
    so that the machine's drift falls on both alike; a difference of 1 % shows."""
    x = np.random.default_rng(1).standard_normal((1, 64)).astype(np.float32)
    body = orjson.dumps(
        {
            "inputs": [
                {"name": "x", "datatype": "FP32", "shape": [1, 64], "data": x.ravel().tolist()}
            ]
        }
    )
    head = (
        f"POST /v2/models/mlp/infer HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: "
        f"application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    ).encode()
    kinds = ("guarded", "httptools")
    times: dict[str, list[float]] = {kind: [] for kind in kinds}
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
        root = Path(tmp) / "models"
        root.mkdir()
        mlp_models(root)
        sockets = {}
        for kind in kinds:
            port = free_port()
            child = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "bench.stack",
                    "--serve",
                    str(root),
                    str(port),
                    "uvloop",
                    kind,
                ],
                env={**os.environ, **SERVER_ENV},
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            stack.callback(child.wait, 30)
            stack.callback(child.terminate)
            wait_until_up(f"http://127.0.0.1:{port}/v2/health/ready")
            sock = stack.enter_context(socket.create_connection(("127.0.0.1", port)))
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sockets[kind] = sock
        for turn in range(requests + 200):  # the first 200 of each warm up, unmeasured
            for kind in kinds if turn % 2 else kinds[::-1]:
                started = time.perf_counter()
                sockets[kind].sendall(head + body)
                read_response(sockets[kind])
                if turn >= 200:
                    times[kind].append((time.perf_counter() - started) * 1e6)
    rows = []
    for kind in kinds:
        values = sorted(times[kind])
        quartile = len(values) // 4
        rows.append(
            [
                kind,
                f"{values[quartile]:.0f}",
                f"{statistics.median(values):.0f}",
                f"{values[3 * quartile]:.0f}",
            ]
        )
    return rows


class _Tensor(BaseModel):
    name: str
    datatype: str
    shape: list[int]
    data: list[float]


class _Request(BaseModel):
    inputs: list[_Tensor]


def _pydantic_decode(body: bytes) -> np.ndarray:
    request = _Request.model_validate_json(body)
    tensor = request.inputs[0]
    return np.asarray(tensor.data, dtype=np.float32).reshape(tensor.shape)


def _median_ms(fn: Callable[[], Any], reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1000


def in_process() -> list[list[str]]:
    rng = np.random.default_rng(0)
    rows = []
    for label, shape, reps in (
        ("1×64 FP32 (W2)", (1, 64), 2000),
        ("1×3×224×224 FP32", (1, 3, 224, 224), 10),
    ):
        array = rng.standard_normal(shape).astype(np.float32)
        body = orjson.dumps(
            {
                "inputs": [
                    {
                        "name": "x",
                        "datatype": "FP32",
                        "shape": list(shape),
                        "data": array.ravel().tolist(),
                    }
                ]
            }
        )
        ours = _median_ms(lambda b=body: decode_request(b), reps)
        theirs = _median_ms(lambda b=body: _pydantic_decode(b), reps)
        rows.append(
            [
                f"decode {label}",
                "orjson → numpy",
                f"{ours:.3f}",
                "pydantic model",
                f"{theirs:.3f}",
                f"{theirs / ours:.1f}",
            ]
        )
    output = OutputTensor("y", "FP32", rng.standard_normal((1, 1000)).astype(np.float32))
    result = InferenceResult("m", "1", None, [output], {}, {}, None, True)
    ours = _median_ms(lambda: encode_result(result, False), 2000)
    theirs = _median_ms(
        lambda: json.dumps(
            {
                "model_name": "m",
                "model_version": "1",
                "outputs": [
                    {
                        "name": "y",
                        "datatype": "FP32",
                        "shape": [1, 1000],
                        "data": output.data.ravel().tolist(),
                    }
                ],
            }
        ).encode(),
        2000,
    )
    rows.append(
        [
            "encode 1×1000 FP32 output",
            "orjson from numpy",
            f"{ours:.3f}",
            "json.dumps",
            f"{theirs:.3f}",
            f"{theirs / ours:.1f}",
        ]
    )
    return rows


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--serve":
        serve(Path(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5])
        return
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seconds", type=int, default=6)
    parser.add_argument("--requests", type=int, default=4000)
    args = parser.parse_args()
    report = [
        "# HTTP stack choices",
        "",
        f"## Served: W2 MLP, JSON tensor, 64 connections, wrk {args.seconds} s each",
        "",
        table(served(args.seconds), ["loop + parser", "req/s", "p50 ms", "p99 ms", "errors"]),
        "",
        f"## Single W2 requests alternating between two servers, {args.requests} each (µs)",
        "",
        table(alternating(args.requests), ["protocol (uvloop)", "p25", "p50", "p75"]),
        "",
        "## In process (median ms)",
        "",
        table(in_process(), ["work", "chosen", "ms", "alternative", "ms", "alternative / chosen"]),
    ]
    publish("stack", "\n".join(report) + "\n")


if __name__ == "__main__":
    main()
