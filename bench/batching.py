"""Dynamic batching under load (issue: batching and backpressure). Loopback only, bounded.

    .venv/bin/python -m bench.batching [--seconds 10] [--repeats 1]

W1: a real 640×480 JPEG → efficientnet_lite0 top-5 (v1 predict), at concurrency 1/4/16/64.
W2: a 64→256→10 MLP with a JSON tensor (v2 infer), at concurrency 1 and 64.
Ceilings in the same run: (a) the W1 pipeline in process — decode + preprocess + model at the
best batch size, same thread settings, no HTTP; (b) a no-op endpoint on the same HTTP stack;
(c) the W2 model served one request = one inference (max_batch_size 1).
The load generator is wrk (C, one thread, keep-alive): it costs the 2-core machine far less
CPU than a Python client would. The two concurrency-1 ratios compare latencies taken in
alternation, so that the machine's drift cannot fall on one side only: W1's from one image in
process (decode to top-5) and one served request in turn, a few hundred of each, from a plain
keep-alive socket; W2's from one-second wrk runs against each model in turn.
Writes bench/results/batching.md.
"""

from __future__ import annotations

import argparse
import io
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import orjson
import skimage.data
import torch
import yaml
from PIL import Image

from bench.common import WrkResult, publish, table, wait_until_up, wrk
from preprocessing import ImagePipeline, ImageSpec
from service.export.exporter import export_model
from service.model_config import TensorConfig, load_model_config
from service.pipelines.classification import Classifier
from service.runtimes import create_runtime
from service.runtimes.base import Runtime, RuntimeOptions
from service.settings import Settings
from tests.models import Mlp
from tests.server import MODELS, Server, free_port

W1_PATH = "/v1/models/efficientnet_lite0:predict"
SERVER_ENV = {"TG_ACCESS_LOG": "false", "TG_LOG_LEVEL": "warning"}


def jpeg_640x480() -> bytes:
    image = Image.fromarray(skimage.data.chelsea()).resize((640, 480), Image.Resampling.BICUBIC)
    buffer = io.BytesIO()
    image.save(buffer, format="JPEG", quality=90)
    return buffer.getvalue()


def mlp_models(root: Path) -> None:
    x = TensorConfig(name="x", datatype="FP32", shape=(64,))
    y = TensorConfig(name="y", datatype="FP32", shape=(10,))
    golden = {"x": np.random.default_rng(0).standard_normal((4, 64)).astype(np.float32)}
    export_model(
        Mlp().eval(),
        root / "mlp" / "1",
        name="mlp",
        inputs=[x],
        outputs=[y],
        golden_inputs=golden,
        max_batch_size=64,
        formats=("onnx",),
    )
    (root / "mlp" / "config.yaml").write_text(
        yaml.safe_dump(
            {
                "backend": "onnx",
                "max_batch_size": 64,
                "warmup": {"batch_sizes": [1, 8, 64]},
                "batching": {"max_queue_delay_ms": 0, "max_queue_size": 1024},
            }
        )
    )
    naive = root / "mlp_naive"
    naive.mkdir()
    (naive / "1").symlink_to(root / "mlp" / "1")
    (naive / "config.yaml").write_text(
        yaml.safe_dump(
            {
                "backend": "onnx",
                "max_batch_size": 1,
                "warmup": {"batch_sizes": [1]},
                "batching": {"max_queue_size": 1024},
            }
        )
    )


def pipelined(
    image: bytes,
    pipeline: ImagePipeline,
    runtime: Runtime,
    size: int,
    workers: int,
    seconds: float,
) -> float:
    """Images/s when a thread pool preprocesses the next images while the model runs batches
    of ``size``, for ``seconds``."""
    done = 0
    with ThreadPoolExecutor(workers) as pool:
        ahead = deque(pool.submit(pipeline, image) for _ in range(2 * size))
        started = time.perf_counter()
        while time.perf_counter() - started < seconds:
            batch = np.stack([ahead.popleft().result() for _ in range(size)])
            ahead.extend(pool.submit(pipeline, image) for _ in range(size))
            runtime.run({"input": batch})
            done += size
        elapsed = time.perf_counter() - started
    return done / elapsed


def in_process(threads: int) -> tuple[ImagePipeline, Runtime]:
    """The W1 pipeline and model, in this process, with the server's thread settings."""
    config = yaml.safe_load((MODELS / "efficientnet_lite0" / "config.yaml").read_text())
    pipeline = ImagePipeline(ImageSpec.model_validate(config["preprocessing"]))
    runtime = create_runtime("onnx", RuntimeOptions("cpu", threads))
    runtime.load(MODELS / "efficientnet_lite0" / "1" / "model.onnx", None, 32)
    return pipeline, runtime


def in_process_alike(threads: int, image: np.ndarray) -> Runtime:
    """The W1 model as a server of ``threads`` CPUs whose default workers share them makes its
    runtime: a session of every CPU's threads for a batch alone (its threads spinning while a
    run lasts) and one of the worker's share, warmed with ``image`` (a batch of one)."""
    settings = Settings(cpus=threads)  # its workers and their share, as the server sizes them
    runtime = create_runtime(
        "onnx",
        RuntimeOptions("cpu", settings.intra_op_threads, shared_threads=settings.shared_threads),
    )
    runtime.load(MODELS / "efficientnet_lite0" / "1" / "model.onnx", None, 32)
    runtime.warmup({"input": image})
    return runtime


def top5() -> Classifier:
    """The W1 model's top-5 postprocessing, as the server builds it from its config."""
    folder = MODELS / "efficientnet_lite0"
    config = load_model_config(folder / "config.yaml")
    assert config.postprocessing is not None
    logits = TensorConfig(name="logits", datatype="FP32", shape=(1000,))
    return Classifier(config.postprocessing, folder, (logits,))


def in_process_ceiling(
    image: bytes, pipeline: ImagePipeline, runtime: Runtime, preprocess_threads: int
) -> tuple[list[list[str]], int]:
    """Images/s of decode + preprocess + model in one process, for each batch size: one after
    the other, and with a preprocessing pool overlapping the model. Returns the table and the
    batch size that did best overlapped (a short scan: the ceiling itself is measured later,
    beside the served runs)."""
    started = time.perf_counter()
    for _ in range(32):
        pipeline(image)
    preprocess_s = (time.perf_counter() - started) / 32
    rows, best, best_size = [], 0.0, 1
    for size in (1, 4, 8, 16, 32):
        batch = np.stack([pipeline(image)] * size)
        runtime.run({"input": batch})
        repeats = max(2, 64 // size)
        started = time.perf_counter()
        for _ in range(repeats):
            runtime.run({"input": batch})
        model_s = (time.perf_counter() - started) / (repeats * size)
        per_image = model_s + preprocess_s
        overlapped = pipelined(image, pipeline, runtime, size, preprocess_threads, 1.5)
        if overlapped > best:
            best, best_size = overlapped, size
        rows.append(
            [
                str(size),
                f"{preprocess_s * 1000:.2f}",
                f"{model_s * 1000:.2f}",
                f"{1 / per_image:.1f}",
                f"{overlapped:.1f}",
            ]
        )
    return rows, best_size


def one_image_pairs(
    image: bytes,
    pipeline: ImagePipeline,
    runtime: Runtime,
    classifier: Classifier,
    port: int,
    path: str,
    count: int,
) -> tuple[float, float]:
    """Median ms of one image in process and of one W1 request served, at concurrency 1,
    taken alternately one image at a time, ``count`` of each: the machine's speed changes
    within seconds, and the difference measured is 10 %.

    The client is a keep-alive socket with the request's bytes made once, which costs the
    served side what sending and receiving the bytes costs (counted against the server)."""
    head = (
        f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: image/jpeg\r\n"
        f"Content-Length: {len(image)}\r\n\r\n"
    ).encode()
    request = head + image
    singles, served = [], []
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for turn in range(count):
            for side in (0, 1) if turn % 2 else (1, 0):
                started = time.perf_counter()
                if side == 0:
                    outputs = runtime.run({"input": pipeline(image)[None]})
                    classifier({"logits": outputs["logits"][0]})
                    singles.append(time.perf_counter() - started)
                else:
                    sock.sendall(request)
                    read_response(sock)
                    served.append(time.perf_counter() - started)
    return statistics.median(singles) * 1000, statistics.median(served) * 1000


def read_response(sock: socket.socket) -> bytes:
    """One HTTP/1.1 response with a Content-Length; its body. Anything but 200 is an error."""
    data = b""
    while b"\r\n\r\n" not in data:
        data += sock.recv(65536) or _closed()
    head, _, body = data.partition(b"\r\n\r\n")
    if not head.startswith(b"HTTP/1.1 200"):
        raise RuntimeError(f"W1 request failed: {head[:200]!r}")
    match = re.search(rb"(?im)^content-length:\s*(\d+)", head)
    assert match is not None, head
    while len(body) < int(match.group(1)):
        body += sock.recv(65536) or _closed()
    return body


def _closed() -> bytes:
    raise RuntimeError("the server closed the connection")


def alternating_p50(url: str, other: str, body: bytes, seconds: int) -> tuple[float, float]:
    """Median p50 ms of ``url`` and of ``other`` at concurrency 1 from one-second wrk runs that
    alternate between them for ``seconds`` each: two latencies of half a millisecond are
    compared, and the machine drifts more than their difference from one run to the next."""
    first, second = [], []
    for _ in range(seconds):
        first.append(wrk(url, body, "application/json", connections=1, seconds=1).p50_ms)
        second.append(wrk(other, body, "application/json", connections=1, seconds=1).p50_ms)
    return statistics.median(first), statistics.median(second)


def mean_batch(server: Server, model: str, before: dict[str, int]) -> float:
    stats = server.client.get(f"/v2/models/{model}/stats").json()["model_stats"][0]
    executions = stats["execution_count"] - before["execution_count"]
    return (stats["inference_count"] - before["inference_count"]) / max(1, executions)


def snapshot(server: Server, model: str) -> dict[str, int]:
    stats: dict[str, int] = server.client.get(f"/v2/models/{model}/stats").json()["model_stats"][0]
    return stats


def measure(
    server: Server,
    model: str,
    url: str,
    body: bytes,
    content_type: str,
    connections: int,
    seconds: int,
) -> tuple[WrkResult, float]:
    before = snapshot(server, model)
    result = wrk(url, body, content_type, connections=connections, seconds=seconds)
    return result, mean_batch(server, model, before)


def run(seconds: int, threads: int, preprocess_threads: int) -> tuple[str, dict[str, float]]:
    image = jpeg_640x480()
    pipeline, runtime = in_process(threads)
    classifier = top5()
    ceiling_rows, best_size = in_process_ceiling(image, pipeline, runtime, preprocess_threads)
    x = np.random.default_rng(1).standard_normal((1, 64)).astype(np.float32)
    mlp_body = orjson.dumps(
        {
            "inputs": [
                {"name": "x", "datatype": "FP32", "shape": [1, 64], "data": x.ravel().tolist()}
            ]
        }
    )
    figures: dict[str, float] = {}
    w1_rows, w2_rows, paired_rows = [], [], []
    ratios: dict[str, list[float]] = {name: [] for name in RATIOS}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "models"
        root.mkdir()
        (root / "efficientnet_lite0").symlink_to(MODELS / "efficientnet_lite0")
        mlp_models(root)
        env = {
            **SERVER_ENV,
            "TG_INTRA_OP_THREADS": str(threads),
            "TG_PREPROCESS_THREADS": str(preprocess_threads),
        }
        server = Server(root, env=env)
        noop_port = free_port()
        noop = subprocess.Popen([sys.executable, "bench/noop_server.py", str(noop_port)])
        w1_url = f"{server.url}{W1_PATH}"
        try:
            server.wait_until(timeout=300)
            wait_until_up(f"http://127.0.0.1:{noop_port}/noop", "POST")
            noop_result = wrk(
                f"http://127.0.0.1:{noop_port}/noop",
                image,
                "image/jpeg",
                connections=16,
                seconds=seconds,
            )
            figures["ceiling_b"] = noop_result.requests_per_s
            for c in (1, 4, 16, 64):
                result, batch = measure(
                    server, "efficientnet_lite0", w1_url, image, "image/jpeg", c, seconds
                )
                w1_rows.append(
                    [
                        str(c),
                        f"{result.requests_per_s:.1f}",
                        f"{result.p50_ms:.1f}",
                        f"{result.p90_ms:.1f}",
                        f"{result.p99_ms:.1f}",
                        f"{batch:.2f}",
                        str(result.errors),
                    ]
                )
            for model in ("mlp", "mlp_naive"):
                for c in (1, 64):
                    result, batch = measure(
                        server,
                        model,
                        f"{server.url}/v2/models/{model}/infer",
                        mlp_body,
                        "application/json",
                        c,
                        seconds,
                    )
                    figures[f"{model}_c{c}"] = result.requests_per_s
                    w2_rows.append(
                        [
                            model,
                            str(c),
                            f"{result.requests_per_s:.0f}",
                            f"{result.p50_ms:.2f}",
                            f"{result.p99_ms:.2f}",
                            f"{batch:.2f}",
                            str(result.errors),
                        ]
                    )
            # The ratios: each from a pair of runs made one right after the other, in rounds,
            # so that the machine's drift (it is shared) hits both sides of a ratio alike. The
            # server idles while this process runs the in-process side.
            half = max(2, seconds // 2)
            mlp_url = f"{server.url}/v2/models/mlp/infer"
            naive_url = f"{server.url}/v2/models/mlp_naive/infer"
            for round_ in range(1, ROUNDS + 1):
                ceiling = pipelined(image, pipeline, runtime, best_size, preprocess_threads, half)
                w1 = wrk(w1_url, image, "image/jpeg", connections=16, seconds=half)
                single, w1_one_p50 = one_image_pairs(
                    image, pipeline, runtime, classifier, server.port, W1_PATH, 40 * half
                )
                mlp = wrk(mlp_url, mlp_body, "application/json", connections=64, seconds=half)
                naive = wrk(naive_url, mlp_body, "application/json", connections=64, seconds=half)
                mlp_one, naive_one = alternating_p50(mlp_url, naive_url, mlp_body, half)
                measured = [
                    w1.requests_per_s / ceiling,
                    w1.p99_ms / w1.p50_ms,
                    w1_one_p50 / single,
                    mlp.requests_per_s / naive.requests_per_s,
                    mlp_one / naive_one,
                ]
                for name, value in zip(RATIOS, measured, strict=True):
                    ratios[name].append(value)
                paired_rows.append(
                    [
                        str(round_),
                        f"{ceiling:.1f}",
                        f"{w1.requests_per_s:.1f}",
                        f"{w1.p50_ms:.1f} / {w1.p99_ms:.1f}",
                        f"{single:.2f}",
                        f"{w1_one_p50:.2f}",
                        f"{mlp.requests_per_s:.0f}",
                        f"{naive.requests_per_s:.0f}",
                        f"{mlp_one:.3f}",
                        f"{naive_one:.3f}",
                    ]
                )
        finally:
            noop.terminate()
            noop.wait(timeout=30)
            server.stop()
    ratio_rows = []
    for name, target in RATIOS.items():
        values = sorted(ratios[name])
        figures[name] = statistics.median(values)
        ratio_rows.append(
            [name, f"{values[0]:.2f}", f"**{figures[name]:.2f}**", f"{values[-1]:.2f}", target]
        )
    report = "\n".join(
        [
            f"Threads: intra-op {threads}, preprocess {preprocess_threads}; wrk {seconds} s per row.",
            "",
            "### In-process scan: decode + preprocess + model, per image",
            "",
            table(ceiling_rows, CEILING_HEADER),
            "",
            f"(b) no-op endpoint, same JPEG body, 16 connections: {figures['ceiling_b']:.0f} req/s",
            "",
            "### W1: 640×480 JPEG → efficientnet_lite0 top-5",
            "",
            table(
                w1_rows,
                ["concurrency", "req/s", "p50 ms", "p90 ms", "p99 ms", "mean batch", "errors"],
            ),
            "",
            "### W2: 64→256→10 MLP, JSON tensor",
            "",
            table(
                w2_rows,
                ["model", "concurrency", "req/s", "p50 ms", "p99 ms", "mean batch", "errors"],
            ),
            "",
            f"### Paired rounds ({half} s per run; ceiling (a) at batch {best_size}, the scan's best)",
            "",
            table(paired_rows, PAIRED_HEADER),
            "",
            f"### Ratios (min / median / max over the {ROUNDS} rounds)",
            "",
            table(ratio_rows, ["ratio", "min", "median", "max", "target"]),
        ]
    )
    return report, figures


ROUNDS = 3
RATIOS = {  # name: target
    "W1 c=16 / in-process ceiling (a)": "≥ 0.95",
    "W1 c=16 p99 / p50": "≤ 1.3",
    "W1 c=1 p50 / in-process latency of one image": "≤ 1.1",
    "W2 c=64 / naive baseline (c) c=64": "≥ 2.4",
    "W2 c=1 p50 / naive c=1 p50": "≤ 1.0",
}
PAIRED_HEADER = [
    "round",
    "(a) in-process img/s",
    "W1 c=16 req/s",
    "W1 c=16 p50 / p99 ms",
    "one image in process ms",
    "W1 c=1 p50 ms",
    "W2 c=64 req/s",
    "naive c=64 req/s",
    "W2 c=1 p50 ms",
    "naive c=1 p50 ms",
]
CEILING_HEADER = [
    "batch",
    "preprocess ms",
    "model ms",
    "images/s sequential",
    "images/s preprocessing overlapped",
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seconds", type=int, default=10)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--preprocess-threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    report, _ = run(args.seconds, args.threads, args.preprocess_threads)
    text = "# Batching benchmark\n\n" + report + "\n"
    publish("batching", text)


if __name__ == "__main__":
    main()


def mlp_body() -> bytes:
    """W2's request: one row of the 64→256→10 MLP as a JSON tensor (v2 infer)."""
    x = np.random.default_rng(1).standard_normal((1, 64)).astype(np.float32)
    tensor = {"name": "x", "datatype": "FP32", "shape": [1, 64], "data": x.ravel().tolist()}
    return orjson.dumps({"inputs": [tensor]})


def served_repository(root: Path) -> Path:
    """The repository the side-by-side benches serve: efficientnet_lite0 (W1) and the MLP (W2)."""
    repository = root / "models"
    repository.mkdir()
    (repository / "efficientnet_lite0").symlink_to(MODELS / "efficientnet_lite0")
    mlp_models(repository)
    return repository


W2_PATH = "/v2/models/mlp/infer"
