"""Dynamic batching under load (issue: batching and backpressure). Loopback only, bounded.

    .venv/bin/python -m bench.batching [--seconds 10] [--repeats 1]

W1: a real 640×480 JPEG → efficientnet_lite0 top-5 (v1 predict), at concurrency 1/4/16/64.
W2: a 64→256→10 MLP with a JSON tensor (v2 infer), at concurrency 1 and 64.
Ceilings in the same run: (a) the W1 pipeline in process — decode + preprocess + model at the
best batch size, same thread settings, no HTTP; (b) a no-op endpoint on the same HTTP stack;
(c) the W2 model served one request = one inference (max_batch_size 1).
The load generator is wrk (C, one thread, keep-alive): it costs the 2-core machine far less
CPU than a Python client would. Writes bench/results/batching.md.
"""

from __future__ import annotations

import argparse
import io
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import orjson
import skimage.data
import torch
import yaml
from PIL import Image

from bench.common import WrkResult, publish, table, wrk
from bench.protocol import _wait_for_noop
from preprocessing import ImagePipeline, ImageSpec
from service.export import export_model
from service.model_config import TensorConfig
from service.runtimes import create_runtime
from service.runtimes.base import RuntimeOptions
from tests.models import Mlp
from tests.server import MODELS, Server, free_port

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
    export_model(Mlp().eval(), root / "mlp" / "1", name="mlp", inputs=[x], outputs=[y],
                 golden_inputs=golden, max_batch_size=64, formats=("onnx",))  # fmt: skip
    (root / "mlp" / "config.yaml").write_text(yaml.safe_dump({
        "backend": "onnx", "max_batch_size": 64, "warmup": {"batch_sizes": [1, 8, 64]},
        "batching": {"max_queue_delay_ms": 0, "max_queue_size": 1024},
    }))  # fmt: skip
    naive = root / "mlp_naive"
    naive.mkdir()
    (naive / "1").symlink_to(root / "mlp" / "1")
    (naive / "config.yaml").write_text(yaml.safe_dump({
        "backend": "onnx", "max_batch_size": 1, "warmup": {"batch_sizes": [1]},
        "batching": {"max_queue_size": 1024},
    }))  # fmt: skip


def pipelined(
    image: bytes, pipeline: ImagePipeline, runtime: object, size: int, workers: int
) -> float:
    """Images/s when a thread pool preprocesses while the model runs batches of ``size``."""
    count = 128
    started = time.perf_counter()
    with ThreadPoolExecutor(workers) as pool:
        futures = [pool.submit(pipeline, image) for _ in range(count)]
        for start in range(0, count, size):
            batch = np.stack([f.result() for f in futures[start : start + size]])
            runtime.run({"input": batch})
    return count / (time.perf_counter() - started)


def in_process_ceiling(
    image: bytes, threads: int, preprocess_threads: int
) -> tuple[list[list[str]], float, float]:
    """Images/s of decode + preprocess + model in one process, for each batch size: one after
    the other, and with a preprocessing pool overlapping the model (the best is the ceiling)."""
    config = yaml.safe_load((MODELS / "efficientnet_lite0" / "config.yaml").read_text())
    pipeline = ImagePipeline(ImageSpec.model_validate(config["preprocessing"]))
    runtime = create_runtime("onnx", RuntimeOptions("cpu", threads))
    runtime.load(MODELS / "efficientnet_lite0" / "1" / "model.onnx", None, 32)
    started = time.perf_counter()
    for _ in range(32):
        pipeline(image)
    preprocess_s = (time.perf_counter() - started) / 32
    rows, best, single_latency = [], 0.0, 0.0
    for size in (1, 4, 8, 16, 32):
        batch = np.stack([pipeline(image)] * size)
        runtime.run({"input": batch})
        repeats = max(2, 64 // size)
        started = time.perf_counter()
        for _ in range(repeats):
            runtime.run({"input": batch})
        model_s = (time.perf_counter() - started) / (repeats * size)
        per_image = model_s + preprocess_s
        best = max(best, 1 / per_image)
        if size == 1:
            single_latency = per_image * 1000
        overlapped = pipelined(image, pipeline, runtime, size, preprocess_threads)
        best = max(best, overlapped)
        rows.append([str(size), f"{preprocess_s * 1000:.2f}", f"{model_s * 1000:.2f}",
                     f"{1 / per_image:.1f}", f"{overlapped:.1f}"])  # fmt: skip
    return rows, best, single_latency


def mean_batch(server: Server, model: str, before: dict[str, int]) -> float:
    stats = server.client.get(f"/v2/models/{model}/stats").json()["model_stats"][0]
    executions = stats["execution_count"] - before["execution_count"]
    return (stats["inference_count"] - before["inference_count"]) / max(1, executions)


def snapshot(server: Server, model: str) -> dict[str, int]:
    stats: dict[str, int] = server.client.get(f"/v2/models/{model}/stats").json()["model_stats"][0]
    return stats


def measure(server: Server, model: str, url: str, body: bytes, content_type: str,
            connections: int, seconds: int) -> tuple[WrkResult, float]:  # fmt: skip
    before = snapshot(server, model)
    result = wrk(url, body, content_type, connections=connections, seconds=seconds)
    return result, mean_batch(server, model, before)


def run(seconds: int, threads: int, preprocess_threads: int) -> tuple[str, dict[str, float]]:
    image = jpeg_640x480()
    ceiling_rows, ceiling, single_ms = in_process_ceiling(image, threads, preprocess_threads)
    x = np.random.default_rng(1).standard_normal((1, 64)).astype(np.float32)
    mlp_body = orjson.dumps({"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 64],
                                         "data": x.ravel().tolist()}]})  # fmt: skip
    figures: dict[str, float] = {"ceiling_a": ceiling, "single_ms": single_ms}
    w1_rows, w2_rows = [], []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "models"
        root.mkdir()
        (root / "efficientnet_lite0").symlink_to(MODELS / "efficientnet_lite0")
        mlp_models(root)
        env = {**SERVER_ENV, "TG_INTRA_OP_THREADS": str(threads),
               "TG_PREPROCESS_THREADS": str(preprocess_threads)}  # fmt: skip
        server = Server(root, env=env)
        noop_port = free_port()
        noop = subprocess.Popen([sys.executable, "bench/noop_server.py", str(noop_port)])
        try:
            server.wait_until(timeout=300)
            _wait_for_noop(noop_port)
            noop_result = wrk(f"http://127.0.0.1:{noop_port}/noop", image, "image/jpeg",
                              connections=16, seconds=seconds)  # fmt: skip
            figures["ceiling_b"] = noop_result.requests_per_s
            for c in (1, 4, 16, 64):
                result, batch = measure(server, "efficientnet_lite0",
                                        f"{server.url}/v1/models/efficientnet_lite0:predict",
                                        image, "image/jpeg", c, seconds)  # fmt: skip
                figures[f"w1_c{c}"] = result.requests_per_s
                figures[f"w1_c{c}_p50"] = result.p50_ms
                figures[f"w1_c{c}_p99"] = result.p99_ms
                w1_rows.append([str(c), f"{result.requests_per_s:.1f}", f"{result.p50_ms:.1f}",
                                f"{result.p90_ms:.1f}", f"{result.p99_ms:.1f}", f"{batch:.2f}",
                                str(result.errors)])  # fmt: skip
            for model in ("mlp", "mlp_naive"):
                for c in (1, 64):
                    result, batch = measure(server, model, f"{server.url}/v2/models/{model}/infer",
                                            mlp_body, "application/json", c, seconds)  # fmt: skip
                    figures[f"{model}_c{c}"] = result.requests_per_s
                    figures[f"{model}_c{c}_p50"] = result.p50_ms
                    w2_rows.append([model, str(c), f"{result.requests_per_s:.0f}", f"{result.p50_ms:.2f}",
                                    f"{result.p99_ms:.2f}", f"{batch:.2f}", str(result.errors)])  # fmt: skip
        finally:
            noop.terminate()
            noop.wait(timeout=30)
            server.stop()
    ratios = [
        ["W1 c=16 / in-process ceiling (a)", f"{figures['w1_c16'] / ceiling:.3f}", "≥ 0.95"],
        ["W1 c=16 p99 / p50", f"{figures['w1_c16_p99'] / figures['w1_c16_p50']:.2f}", "≤ 1.3"],
        ["W1 c=1 p50 / in-process latency of one image", f"{figures['w1_c1_p50'] / single_ms:.2f}", "≤ 1.1"],
        ["W2 c=64 / naive baseline (c) c=64", f"{figures['mlp_c64'] / figures['mlp_naive_c64']:.2f}", "≥ 2.4"],
        ["W2 c=1 p50 / naive c=1 p50", f"{figures['mlp_c1_p50'] / figures['mlp_naive_c1_p50']:.2f}", "≤ 1.0"],
    ]  # fmt: skip
    report = "\n".join([
        f"Threads: intra-op {threads}, preprocess {preprocess_threads}; wrk {seconds} s per row.",
        "", "### In-process ceiling (a): decode + preprocess + model, per image", "",
        table(ceiling_rows, CEILING_HEADER),
        "", f"(b) no-op endpoint, same JPEG body, 16 connections: {figures['ceiling_b']:.0f} req/s",
        "", "### W1: 640×480 JPEG → efficientnet_lite0 top-5", "",
        table(w1_rows, ["concurrency", "req/s", "p50 ms", "p90 ms", "p99 ms", "mean batch", "errors"]),
        "", "### W2: 64→256→10 MLP, JSON tensor", "",
        table(w2_rows, ["model", "concurrency", "req/s", "p50 ms", "p99 ms", "mean batch", "errors"]),
        "", "### Ratios", "", table(ratios, ["ratio", "measured", "target"]),
    ])  # fmt: skip
    return report, figures


CEILING_HEADER = [
    "batch", "preprocess ms", "model ms", "images/s sequential", "images/s preprocessing overlapped"
]  # fmt: skip


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
