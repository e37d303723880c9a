"""ONNX Runtime vs TorchScript vs AOTInductor (pt2) on the CPU, in one sitting (issue #18).

    .venv/bin/python -m bench.formats [--seconds 5] [--threads 2]
    .venv/bin/python -m bench.formats --lengths 16,32,64,128,256 [--idle-ms 10]

Per bundled model (efficientnet_lite0: W1, the real JPEG → top-5; minilm: one 64-token text) and
per artifact, at batch 1 and at the preferred batch: in process (preprocessing once, then the
runtime alone, as an instance thread runs it) and served (one v2 request of that many rows at a
time to a real server on 127.0.0.1). Rows/s and p50 latency; the formats alternate in rounds so
that a noisy neighbour hits all of them alike.

With ``--lengths``: minilm in process only, one text of each length at batch 1, each call
back to back and each after ``--idle-ms`` of idleness (as a served request arrives after the
previous answer has gone): what the served path adds that a tight loop does not see.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import numpy as np
import skimage.data
import yaml

from bench.common import publish, table
from preprocessing.image import ImagePipeline
from preprocessing.spec import ImageSpec, TextSpec
from preprocessing.text import TextPipeline
from service.artifacts.manifest import read_manifest
from service.runtimes import create_runtime
from service.runtimes.base import Runtime, RuntimeOptions, Signature
from tests.conftest import encode
from tests.server import MODELS, Server

BACKENDS = ("onnx", "torchscript", "pt2")
PREFERRED = {"efficientnet_lite0": 4, "minilm": 8}


def inputs(model: str, rows: int) -> dict[str, np.ndarray]:
    """One preprocessed request, repeated to ``rows`` rows."""
    config = yaml.safe_load((MODELS / model / "config.yaml").read_text())
    if model == "minilm":
        tokens = TextPipeline(
            TextSpec.model_validate(config["preprocessing"]), MODELS / model / "1"
        )
        batch = tokens(["word " * 62])  # + [CLS] and [SEP]: 64 tokens, the 64 bucket
        arrays = {"input_ids": batch.input_ids, "attention_mask": batch.attention_mask}
    else:
        pipeline = ImagePipeline(ImageSpec.model_validate(config["preprocessing"]))
        arrays = {"input": pipeline(encode(skimage.data.chelsea(), "JPEG", quality=95))[None]}
    return {k: np.repeat(v, rows, axis=0) for k, v in arrays.items()}


def timed(call: Callable[[], object], seconds: float, idle_s: float = 0.0) -> list[float]:
    call()
    laps = []
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        if idle_s:
            time.sleep(idle_s)  # the idle gap measured (--idle-ms), not a wait for anything
        started = time.perf_counter()
        call()
        laps.append(time.perf_counter() - started)
    return laps


def loaded(model: str, threads: int) -> dict[str, Runtime]:
    """Each artifact of ``model`` loaded in this process, as the server loads it."""
    manifest = read_manifest(MODELS / model / "1")
    assert manifest is not None
    runtimes = {}
    for backend in BACKENDS:
        runtime = create_runtime(backend, RuntimeOptions("cpu", threads))
        runtime.load(
            MODELS / model / "1" / runtime.artifact,
            Signature(manifest.inputs, manifest.outputs),
            manifest.max_batch_size,
        )
        runtimes[backend] = runtime
    return runtimes


def lengths(args: argparse.Namespace) -> None:
    """minilm at batch 1 per text length, back to back and after an idle pause, in process."""
    runtimes = loaded("minilm", args.threads)
    medians: dict[tuple[int, str, float], list[float]] = {}
    sizes = [int(n) for n in args.lengths.split(",")]
    for _ in range(args.rounds):
        for tokens in sizes:
            ids = np.full((1, tokens), 2773, np.int64)  # "word"
            ids[0, 0], ids[0, -1] = 101, 102  # [CLS] ... [SEP]
            batch = {"input_ids": ids, "attention_mask": np.ones_like(ids)}
            for idle in (0.0, args.idle_ms / 1000):
                for backend, runtime in runtimes.items():
                    laps = timed(partial(runtime.run, batch), args.seconds, idle)
                    medians.setdefault((tokens, backend, idle), []).append(statistics.median(laps))
    # Each round's median, the best and the worst round: a neighbour's burst of CPU hits some
    # rounds, and what it does to each artifact is worth seeing too.
    rows = [
        [
            str(tokens),
            f"{idle * 1000:g}",
            backend,
            f"{min(runs) * 1e3:.2f}",
            f"{max(runs) * 1e3:.2f}",
        ]
        for (tokens, backend, idle), runs in sorted(medians.items())
    ]
    header = ["tokens", "idle ms", "artifact", "p50 ms, best round", "p50 ms, worst round"]
    publish("formats_lengths", table(rows, header))


def served_call(server: Server, model: str, batch: dict[str, np.ndarray]) -> Callable[[], object]:
    datatypes = {"float32": "FP32", "int64": "INT64"}
    body = {
        "inputs": [
            {
                "name": n,
                "datatype": datatypes[str(a.dtype)],
                "shape": list(a.shape),
                "data": a.ravel().tolist(),
            }
            for n, a in batch.items()
        ]
    }

    def call() -> object:
        response = server.client.post(f"/v2/models/{model}/infer", json=body)
        response.raise_for_status()
        return response

    return call


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--lengths", help="minilm in process per text length (comma-separated)")
    parser.add_argument("--idle-ms", type=float, default=10.0)
    args = parser.parse_args()
    if args.lengths:
        lengths(args)
        return
    laps: dict[tuple[str, str, str, int], list[float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        servers = {}
        for backend in BACKENDS:
            root = Path(tmp) / backend
            for model in PREFERRED:
                (root / model).mkdir(parents=True)
                (root / model / "1").symlink_to(MODELS / model / "1")
                config = yaml.safe_load((MODELS / model / "config.yaml").read_text())
                config["backend"] = backend
                (root / model / "config.yaml").write_text(yaml.safe_dump(config))
                if (MODELS / model / "labels.txt").exists():
                    (root / model / "labels.txt").symlink_to(MODELS / model / "labels.txt")
            servers[backend] = Server(
                root, env={"TG_LOG_LEVEL": "warning", "TG_INTRA_OP_THREADS": str(args.threads)}
            )
        runtimes = {
            (model, backend): runtime
            for model in PREFERRED
            for backend, runtime in loaded(model, args.threads).items()
        }
        try:
            for server in servers.values():
                server.wait_until(timeout=600)
            for _ in range(args.rounds):
                for model, preferred in PREFERRED.items():
                    for rows in (1, preferred):
                        batch = inputs(model, rows)
                        for backend in BACKENDS:
                            run = partial(runtimes[model, backend].run, batch)
                            key = (model, backend, "in process", rows)
                            laps.setdefault(key, []).extend(timed(run, args.seconds))
                            call = served_call(servers[backend], model, batch)
                            key = (model, backend, "served", rows)
                            laps.setdefault(key, []).extend(timed(call, args.seconds))
        finally:
            for server in servers.values():
                server.stop()
    rows_out = []
    for (model, backend, where, rows), times in sorted(laps.items()):
        p50 = statistics.median(times)
        rows_out.append(
            [model, where, str(rows), backend, f"{rows / p50:.1f}", f"{p50 * 1000:.2f}"]
        )
    publish("formats", table(rows_out, ["model", "where", "batch", "artifact", "rows/s", "p50 ms"]))


if __name__ == "__main__":
    main()
