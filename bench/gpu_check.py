"""The GPU check: parity on the device, W1 throughput and latency, memory, in-process ceiling.

    bench/gpu_check.sh            (sets up, then runs this)

Starts the server on the bundled models (``device: auto`` takes CUDA when onnxruntime/torch see
it; the golden replay at load is the parity check on that device), runs W1 (efficientnet_lite0:
a 640×480 JPEG through v1 predict, and a preprocessed FP32 tensor as binary v2) at concurrency
1/16/64 with wrk, reads GPU memory from nvidia-smi when there is one, measures the same model's
in-process ceiling on the same device, and writes a Markdown report.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import time
from pathlib import Path
from typing import Literal

import numpy as np
import onnxruntime as ort
import orjson
import yaml

from bench.batching import jpeg_640x480
from bench.common import table, wrk
from preprocessing import ImagePipeline, ImageSpec
from service.artifacts.manifest import read_manifest
from service.model_config import GpuConfig
from service.runtimes import create_runtime, resolve_device
from service.runtimes.base import RuntimeOptions, Signature
from tests.server import MODELS, Server

MODEL = MODELS / "efficientnet_lite0"


def gpu_memory() -> str:
    if shutil.which("nvidia-smi") is None:
        return "no nvidia-smi (no GPU)"
    out = subprocess.run(
        ["nvidia-smi", "--query-gpu=name,memory.used,memory.total", "--format=csv,noheader"],
        capture_output=True,
        text=True,
        check=False,
    ).stdout.strip()
    return out or "nvidia-smi answered nothing"


def ceiling(
    device: str, seconds: float, io_binding: Literal["auto", "on", "off"] = "auto"
) -> tuple[float, float]:
    """Images/s of the model alone at batch 32 on the device, and ms for one image."""
    gpu = GpuConfig(io_binding=io_binding)
    runtime = create_runtime(
        "onnx", RuntimeOptions(device, os.cpu_count() or 1, gpu=gpu, cache_dir=MODEL / "1")
    )
    runtime.load(MODEL / "1" / "model.onnx", None, 32)
    batch = np.random.default_rng(0).standard_normal((32, 3, 224, 224)).astype(np.float32)
    one = batch[:1].copy()
    for _ in range(3):
        runtime.run({"input": batch})
        runtime.run({"input": one})
    started, runs = time.perf_counter(), 0
    while time.perf_counter() - started < seconds:
        runtime.run({"input": batch})
        runs += 1
    throughput = runs * 32 / (time.perf_counter() - started)
    started = time.perf_counter()
    for _ in range(20):
        runtime.run({"input": one})
    return throughput, (time.perf_counter() - started) / 20 * 1000


def cuda_graphs_check(seconds: float) -> str:
    """digits (TorchScript) eager vs CUDA-graph replay at batch 32: parity and ms per batch."""
    device = resolve_device("auto", "torchscript")
    if not device.startswith("cuda"):
        return "skipped: torch sees no CUDA device."
    manifest = read_manifest(MODELS / "digits" / "1")
    assert manifest is not None
    signature = Signature(manifest.inputs, manifest.outputs)
    batch = {"image": np.random.default_rng(0).standard_normal((32, 1, 8, 8)).astype(np.float32)}
    timings, outputs = {}, {}
    for label, gpu in (("eager", GpuConfig()), ("CUDA graphs", GpuConfig(cuda_graphs=True))):
        runtime = create_runtime("torchscript", RuntimeOptions(device, 1, gpu=gpu))
        runtime.load(MODELS / "digits" / "1" / "model.pt", signature, 32)
        runtime.warmup(batch)
        outputs[label] = runtime.run(batch)["logits"]
        started, runs = time.perf_counter(), 0
        while time.perf_counter() - started < seconds / 2:
            runtime.run(batch)
            runs += 1
        timings[label] = (time.perf_counter() - started) / runs * 1000
    diff = float(np.abs(outputs["eager"] - outputs["CUDA graphs"]).max())
    return (
        f"digits at batch 32 on {device}: eager {timings['eager']:.3f} ms, CUDA graphs "
        f"{timings['CUDA graphs']:.3f} ms per batch (host round trip included); largest output "
        f"difference {diff:.2e}."
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seconds", type=int, default=8)
    parser.add_argument("--out", type=Path, default=Path("bench/results/gpu_check.md"))
    args = parser.parse_args()
    device = resolve_device("auto", "onnx")
    config = yaml.safe_load((MODEL / "config.yaml").read_text())
    pipeline = ImagePipeline(ImageSpec.model_validate(config["preprocessing"]))
    image = jpeg_640x480()
    tensor = pipeline(image)[None]
    header = orjson.dumps(
        {
            "inputs": [
                {
                    "name": "input",
                    "datatype": "FP32",
                    "shape": list(tensor.shape),
                    "parameters": {"binary_data_size": tensor.nbytes},
                }
            ],
            "outputs": [{"name": "classification", "parameters": {"binary_data": True}}],
        }
    )
    binary = header + tensor.tobytes()
    rows, parity = [], []
    server = Server(MODELS, env={"TG_ACCESS_LOG": "false", "TG_LOG_LEVEL": "warning"})
    try:
        server.wait_until(timeout=420)
        for name in ("efficientnet_lite0", "digits", "minilm"):
            meta = server.client.get(f"/v2/models/{name}").json()
            parity.append([name, meta["state"], meta.get("device", "?"), str(meta.get("verified"))])
        memory_loaded = gpu_memory()
        for label, url, body, ctype, length in (
            (
                "JPEG, v1 predict",
                f"{server.url}/v1/models/efficientnet_lite0:predict",
                image,
                "image/jpeg",
                None,
            ),
            (
                "FP32 tensor, v2 binary",
                f"{server.url}/v2/models/efficientnet_lite0/infer",
                binary,
                "application/octet-stream",
                len(header),
            ),
        ):
            for c in (1, 16, 64):
                result = wrk(
                    url, body, ctype, connections=c, seconds=args.seconds, header_length=length
                )
                rows.append(
                    [
                        label,
                        str(c),
                        f"{result.requests_per_s:.1f}",
                        f"{result.p50_ms:.1f}",
                        f"{result.p99_ms:.1f}",
                        str(result.errors),
                    ]
                )
        memory_loaded_after = gpu_memory()
    finally:
        server.stop()
    best, single_ms = ceiling(device, args.seconds)
    if device.startswith("cuda"):
        unbound, _ = ceiling(device, args.seconds, io_binding="off")
        binding = f"Without IO binding (`gpu.io_binding: off`): {unbound:.1f} images/s at batch 32."
    else:
        binding = "IO binding is for CUDA (`gpu.io_binding: auto`): not compared on the CPU."
    graphs = cuda_graphs_check(args.seconds)
    report = (
        "\n".join(
            [
                "# GPU check",
                "",
                f"Device chosen by `device: auto`: **{device}**; onnxruntime providers available: "
                f"{', '.join(ort.get_available_providers())}; GPU: {gpu_memory()}.",
                "",
                "## Parity (golden replay at load, on the serving device)",
                "",
                table(parity, ["model", "state", "device", "verified (gates passed)"]),
                "",
                "## W1: efficientnet_lite0 served (wrk)",
                "",
                table(rows, ["input", "concurrency", "req/s", "p50 ms", "p99 ms", "errors"]),
                "",
                f"GPU memory after load: {memory_loaded}; after the load runs: {memory_loaded_after}.",
                "",
                "## In-process ceiling, same model and device",
                "",
                f"{best:.1f} images/s at batch 32 (model only, random inputs); one image: {single_ms:.2f} ms.",
                binding,
                "",
                "## CUDA graphs (TorchScript)",
                "",
                graphs,
            ]
        )
        + "\n"
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(report)
    print(report)


if __name__ == "__main__":
    main()
