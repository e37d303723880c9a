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
For W2, the same requests also go to two empty servers, each in a process of its own and
answering every request with an empty message: a grpc.aio server (gRPC's library ceiling on this
machine, whatever a server does with the calls) and a bare ASGI app on uvicorn with uvloop and
httptools (REST's). Each run also reads the event loop's CPU time (the serving process's main
thread, from /proc) per request answered: what each protocol's stack costs the loop that every
request shares. Writes bench/results/grpc.md.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from functools import partial
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
    json_body = orjson.dumps(
        {
            "inputs": [
                {"name": name, "datatype": "FP32", "shape": list(shape), "data": x.ravel().tolist()}
            ]
        }
    )
    header = orjson.dumps(
        {
            "inputs": [
                {
                    "name": name,
                    "datatype": "FP32",
                    "shape": list(shape),
                    "parameters": {"binary_data_size": x.nbytes},
                }
            ]
        }
    )
    request = pb.ModelInferRequest(model_name=model, raw_input_contents=[x.tobytes()])
    tensor = request.inputs.add()
    tensor.name, tensor.datatype = name, "FP32"
    tensor.shape.extend(shape)
    message = request.SerializeToString()
    frame = b"\x00" + struct.pack(">I", len(message)) + message  # gRPC's length prefix
    return {
        "REST JSON": (json_body, None),
        "REST binary": (header + x.tobytes(), len(header)),
        "gRPC": (frame, None),
    }


def h2load(
    url: str, frame: bytes, streams: int, seconds: int, connections: int = 1
) -> tuple[float, float]:
    """Requests/s and mean latency (ms) of unary gRPC calls, ``streams`` at once on each of
    ``connections`` HTTP/2 connections."""
    binary = shutil.which("h2load")
    if binary is None:
        raise SystemExit("h2load is not installed: `apt-get install nghttp2-client`")
    with tempfile.NamedTemporaryFile(suffix=".bin") as body:
        body.write(frame)
        body.flush()
        out = subprocess.run(
            [
                binary,
                "-D",
                str(seconds),
                "-c",
                str(connections),
                "-t",
                str(min(connections, 2)),
                "-m",
                str(streams),
                "-d",
                body.name,
                "-H",
                "content-type: application/grpc",
                "-H",
                "te: trailers",
                url + GRPC_PATH,
            ],
            capture_output=True,
            text=True,
            timeout=seconds + 60,
            check=True,
        ).stdout
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

EMPTY_REST_SERVER = """
import sys
import uvicorn

async def app(scope, receive, send):
    if scope["type"] != "http":
        return
    more = True
    while more:
        more = (await receive()).get("more_body", False)
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-length", b"0")]})
    await send({"type": "http.response.body", "body": b""})

uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[1]), log_level="warning",
            access_log=False, loop="uvloop", http="httptools")
"""
"""REST's ceiling, the same way: every request's body read and an empty answer sent, on the
HTTP stack tensorgate serves on (uvicorn, uvloop, httptools), with no framework."""


def loop_cpu_s(pid: int) -> float:
    """CPU seconds the process's main thread (its event loop) has used."""
    fields = Path(f"/proc/{pid}/task/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def empty_rest_server() -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    process = subprocess.Popen([sys.executable, "-c", EMPTY_REST_SERVER, str(port)])

    def listening() -> None:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()

    started(process, listening, OSError)
    return process, f"http://127.0.0.1:{port}"


def empty_server() -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    process = subprocess.Popen([sys.executable, "-c", EMPTY_SERVER, str(port)])
    url = f"127.0.0.1:{port}"

    def ready() -> None:
        with grpc.insecure_channel(url) as channel:
            grpc.channel_ready_future(channel).result(timeout=1)

    started(process, ready, grpc.FutureTimeoutError)
    return process, url


def started(
    process: subprocess.Popen[bytes], check: Callable[[], None], not_yet: type[Exception]
) -> None:
    """Call ``check`` until it stops raising ``not_yet`` (30 s at most; then kill ``process``)."""
    deadline = time.monotonic() + 30
    while True:
        try:
            check()
            return
        except not_yet:
            if time.monotonic() > deadline:
                process.kill()
                raise
            time.sleep(0.1)  # between two polls of a server that is starting


def check_grpc(server: Server, model: str, frame: bytes) -> None:
    """One call through the real client stack: the frame must be a valid request."""
    request = pb.ModelInferRequest.FromString(frame[5:])
    with grpc.insecure_channel(server.grpc_url) as channel:
        call = channel.unary_unary(
            GRPC_PATH,
            request_serializer=pb.ModelInferRequest.SerializeToString,
            response_deserializer=pb.ModelInferResponse.FromString,
        )
        answer = call(request, timeout=30)
    assert answer.model_name == model and answer.raw_output_contents, answer


Figure = tuple[float, float, float]
"""Requests/s, latency (ms), event-loop CPU µs per request."""


def measured(pid: int, run: Callable[[], tuple[float, float]], seconds: int) -> Figure:
    """``run()``'s requests/s and latency, and the event-loop CPU µs per request it cost."""
    before = loop_cpu_s(pid)
    rate, latency = run()
    return rate, latency, (loop_cpu_s(pid) - before) / (rate * seconds) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    seconds = args.seconds
    cells = [
        ("W2", "mlp", (1, 64), "x", 1),
        ("W2", "mlp", (1, 64), "x", 64),
        ("efficientnet_lite0", "efficientnet_lite0", (1, 3, 224, 224), "input", 1),
        ("efficientnet_lite0", "efficientnet_lite0", (1, 3, 224, 224), "input", 16),
    ]
    results: dict[tuple[str, int, str], list[Figure]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "models"
        root.mkdir()
        (root / "efficientnet_lite0").symlink_to(MODELS / "efficientnet_lite0")
        mlp_models(root)
        server = Server(root, env=SERVER_ENV)
        ceiling, ceiling_url = empty_server()
        rest_ceiling, rest_ceiling_url = empty_rest_server()
        pid = server.process.pid

        def rest(url: str, body: bytes, header_length: int | None, n: int) -> tuple[float, float]:
            ct = "application/json" if header_length is None else "application/octet-stream"
            result = wrk(url, body, ct, connections=n, seconds=seconds, header_length=header_length)
            assert result.errors == 0, (url, result)
            return result.requests_per_s, result.p50_ms

        try:
            server.wait_until(timeout=300)
            payloads = {(m, s): bodies(m, s, n) for _, m, s, n, _ in cells}
            for (model, _), kinds in payloads.items():
                check_grpc(server, model, kinds["gRPC"][0])
            for round_ in range(args.rounds):
                for label, model, shape, _, n in cells:
                    kinds = payloads[(model, shape)]
                    order = list(kinds) if round_ % 2 == 0 else list(kinds)[::-1]
                    for kind in order:
                        body, header_length = kinds[kind]
                        if kind == "gRPC":
                            run = partial(h2load, f"http://{server.grpc_url}", body, n, seconds)
                        else:
                            url = f"{server.url}/v2/models/{model}/infer"
                            run = partial(rest, url, body, header_length, n)
                        figure = measured(pid, run, seconds)
                        results.setdefault((label, n, kind), []).append(figure)
                    if label == "W2":  # the libraries' own ceilings, in the same rotation
                        frame = kinds["gRPC"][0]
                        run = partial(h2load, f"http://{ceiling_url}", frame, n, seconds)
                        figure = measured(ceiling.pid, run, seconds)
                        results.setdefault((label, n, "ceiling"), []).append(figure)
                        body, header_length = kinds["REST binary"]
                        run = partial(rest, f"{rest_ceiling_url}/x", body, header_length, n)
                        figure = measured(rest_ceiling.pid, run, seconds)
                        results.setdefault((label, n, "REST ceiling"), []).append(figure)
        finally:
            server.stop()
            for process in (ceiling, rest_ceiling):
                process.terminate()
                process.wait(timeout=30)
    publish("grpc", report(results, cells, args.rounds, seconds))


def report(
    results: dict[tuple[str, int, str], list[Figure]],
    cells: list[tuple[str, str, tuple[int, ...], str, int]],
    rounds: int,
    seconds: int,
) -> str:
    def median(label: str, n: int, kind: str, index: int) -> float:
        return statistics.median(f[index] for f in results[(label, n, kind)])

    rows, loop_rows = [], []
    for label, _, _, _, n in cells:
        row = [label, str(n)]
        for kind in ("REST JSON", "REST binary", "gRPC"):
            rates = [f[0] for f in results[(label, n, kind)]]
            row.append(f"{statistics.median(rates):.0f} ({min(rates):.0f}–{max(rates):.0f})")
        binary = median(label, n, "REST binary", 0)
        row.append(f"{median(label, n, 'gRPC', 0) / binary:.2f}")
        for kind in ("ceiling", "REST ceiling"):
            row.append(
                f"{median(label, n, kind, 0) / binary:.2f}" if (label, n, kind) in results else ""
            )
        rows.append(row)
        if label == "W2":
            loop_rows.append(
                [label, str(n)]
                + [
                    f"{median(label, n, kind, 2):.0f}"
                    for kind in ("REST binary", "gRPC", "REST ceiling", "ceiling")
                ]
            )
    header = [
        "workload",
        "concurrent",
        "REST JSON req/s",
        "REST binary req/s",
        "gRPC req/s",
        "gRPC / REST binary",
        "empty grpc.aio server / REST binary",
        "empty REST server / REST binary",
    ]
    loop_header = [
        "workload",
        "concurrent",
        "REST binary",
        "gRPC",
        "empty REST server",
        "empty grpc.aio server",
    ]
    return (
        f"# gRPC vs REST, {rounds} alternating rounds of {seconds} s\n\n"
        f"Requests/s, median (min–max)\n\n{table(rows, header)}\n\n"
        "Event-loop CPU per request answered, µs (the serving process's main thread), median\n\n"
        f"{table(loop_rows, loop_header)}\n"
    )


if __name__ == "__main__":
    main()
