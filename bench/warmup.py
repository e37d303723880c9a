"""First request after ready vs steady state, per shape (issues: dynamic shapes, #18, #23).

    .venv/bin/python -m bench.warmup [--steady 10] [--only text|image] [--rounds 3]

For minilm served from its ONNX, TorchScript and pt2 artifacts, each with the bundled warmup and
with none: start a fresh server, wait for ready, then per shape send one request of that shape
(the first) and then ``--steady`` more; report the first latency, the median of the rest, and
their ratio (target ≤ 1.5 with warmup). The shapes: one text of exactly each bucket's tokens,
then 2, 4, 8 and 16 such texts of 64 tokens in one request (each a batch of that many rows).

Then a user's own dynamic image model (tests/user_models.py ``Heatmap``: a fully convolutional
head over any H × W), exported as ``tensorgate export`` does, served from ONNX and pt2 with the
config export writes (buckets 128, 256, 512; warmed and padded) and with none (no buckets, no
warmup: every size runs as it comes); the shapes: one image at sizes between and on the buckets,
then 2, 3 and 4 images of 200 × 240, in Triton's binary tensor extension.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np
import yaml

from bench.common import publish, table
from tests.server import MODELS, Server

BUCKETS = (16, 32, 64, 128, 256)
SHAPES = [(1, tokens) for tokens in BUCKETS] + [(rows, 64) for rows in (2, 4, 8, 16)]
"""(texts in the request, tokens in each)"""


def repository(root: Path, source: Path, backend: str, warm: bool) -> None:
    """``root`` holding the model of ``source`` (its folder) served from ``backend``; without
    ``warm``, with no warmup and no buckets (a text spec's own buckets stay: they are its
    padding)."""
    folder = root / source.name
    folder.mkdir(parents=True)
    (folder / "1").symlink_to(source / "1")
    config = yaml.safe_load((source / "config.yaml").read_text())
    config["backend"] = backend
    if not warm:
        config["warmup"] = {"batch_sizes": []}
        config.pop("buckets", None)
    (folder / "config.yaml").write_text(yaml.safe_dump(config))


def latency(client: httpx.Client, texts: list[str]) -> float:
    started = time.perf_counter()
    response = client.post("/v1/models/minilm:predict", json={"instances": texts})
    elapsed = time.perf_counter() - started
    response.raise_for_status()
    return elapsed * 1000


def measure(backend: str, warm: bool, steady: int) -> list[list[str]]:
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "models"
        repository(root, MODELS / "minilm", backend, warm)
        server = Server(
            root,
            env={"TG_ACCESS_LOG": "false", "TG_LOG_LEVEL": "warning", "TG_INTRA_OP_THREADS": "2"},
        )
        try:
            server.wait_until(timeout=300)
            for texts, tokens in SHAPES:
                batch = ["word " * (tokens - 2)] * texts  # + [CLS] and [SEP] = `tokens` tokens
                first = latency(server.client, batch)
                rest = statistics.median(latency(server.client, batch) for _ in range(steady))
                rows.append(
                    [
                        backend,
                        "yes" if warm else "no",
                        str(texts),
                        str(tokens),
                        f"{first:.1f}",
                        f"{rest:.1f}",
                        f"{first / rest:.2f}",
                    ]
                )
        finally:
            server.stop()
    return rows


IMAGE_BUCKETS = (128, 256, 512)
IMAGE_SHAPES = [
    (1, h, w) for h, w in ((128, 128), (100, 150), (256, 256), (200, 300), (512, 512), (360, 480))
]
IMAGE_SHAPES += [(rows, 200, 240) for rows in (2, 3, 4)]
"""(images in the request, H, W)"""


def export_heatmap(root: Path) -> None:
    """The Heatmap exported into ``root`` as the CLI would (config.yaml included)."""
    from service.export.cli import golden_input, parse_tensor, write_config
    from service.export.exporter import export_model
    from tests.user_models import make_heatmap

    image, heat = parse_tensor("image:FP32:3,-1,-1"), parse_tensor("heat:FP32:1,-1,-1")
    folder = root / "heatmap"
    manifest = export_model(
        make_heatmap(),
        folder / "1",
        name="heatmap",
        inputs=[image],
        outputs=[heat],
        golden_inputs={"image": golden_input(image, 4, 0, 96)},
        max_batch_size=4,
        buckets=IMAGE_BUCKETS,
        pt2_cpu="native",
    )
    write_config(folder / "config.yaml", manifest, "onnx", None)


def image_latency(client: httpx.Client, rows: int, h: int, w: int) -> float:
    """One request in Triton's binary tensor extension (a JSON body of megapixels would time
    the JSON codec, not the shape)."""
    data = np.full((rows, 3, h, w), 0.5, np.float32).tobytes()
    header = json.dumps(
        {
            "inputs": [
                {
                    "name": "image",
                    "datatype": "FP32",
                    "shape": [rows, 3, h, w],
                    "parameters": {"binary_data_size": len(data)},
                }
            ],
            "outputs": [{"name": "heat", "parameters": {"binary_data": True}}],
        }
    ).encode()
    started = time.perf_counter()
    response = client.post(
        "/v2/models/heatmap/infer",
        content=header + data,
        headers={
            "Inference-Header-Content-Length": str(len(header)),
            "Content-Type": "application/octet-stream",
        },
    )
    elapsed = time.perf_counter() - started
    response.raise_for_status()
    return elapsed * 1000


def measure_images(
    exported: Path, backend: str, warm: bool, steady: int, rounds: int
) -> list[list[str]]:
    """Per shape, the median over ``rounds`` fresh servers of the first request and of the
    steady median (one first request is one sample: a round of noise on a shared machine)."""
    firsts: list[list[float]] = [[] for _ in IMAGE_SHAPES]
    rests: list[list[float]] = [[] for _ in IMAGE_SHAPES]
    unwarmed = []
    for _ in range(rounds):
        with tempfile.TemporaryDirectory() as tmp:
            root = Path(tmp) / "models"
            repository(root, exported / "heatmap", backend, warm)
            server = Server(
                root,
                env={
                    "TG_ACCESS_LOG": "false",
                    "TG_LOG_LEVEL": "warning",
                    "TG_INTRA_OP_THREADS": "2",
                },
            )
            try:
                server.wait_until(timeout=300)
                server.client.get("/v2/models/heatmap").raise_for_status()  # the connection
                for i, (images, h, w) in enumerate(IMAGE_SHAPES):
                    firsts[i].append(image_latency(server.client, images, h, w))
                    rests[i].append(
                        statistics.median(
                            image_latency(server.client, images, h, w) for _ in range(steady)
                        )
                    )
                stats = server.client.get("/v2/models/heatmap/stats").json()["model_stats"][0]
                unwarmed.append(stats["unwarmed_shape_count"])
            finally:
                server.stop()
    rows = []
    for (images, h, w), first, rest in zip(IMAGE_SHAPES, firsts, rests, strict=True):
        a, b = statistics.median(first), statistics.median(rest)
        rows.append(
            [
                backend,
                "export's" if warm else "none",
                str(images),
                f"{h}×{w}",
                f"{a:.1f}",
                f"{b:.1f}",
                f"{a / b:.2f}",
            ]
        )
    rows[-1][1] += f" (unwarmed: {max(unwarmed)})"
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steady", type=int, default=10)
    parser.add_argument("--only", choices=["text", "image"])
    parser.add_argument("--rounds", type=int, default=3, help="fresh servers per image config")
    args = parser.parse_args()
    text = ""
    if args.only != "image":
        rows = []
        for backend in ("onnx", "torchscript", "pt2"):
            for warm in (True, False):
                rows += measure(backend, warm, args.steady)
        header = [
            "backend",
            "warmup",
            "texts",
            "tokens",
            "first ms",
            "steady p50 ms",
            "first / steady",
        ]
        text += "# Warmup benchmark: minilm, first request of each shape vs steady\n\n"
        text += table(rows, header) + "\n"
    if args.only != "text":
        rows = []
        with tempfile.TemporaryDirectory() as tmp:
            exported = Path(tmp)
            export_heatmap(exported)
            for backend in ("onnx", "pt2"):
                for warm in (True, False):
                    rows += measure_images(exported, backend, warm, args.steady, args.rounds)
        header = [
            "backend",
            "config",
            "images",
            "H × W",
            "first ms",
            "steady p50 ms",
            "first / steady",
        ]
        text += "\n# Warmup benchmark: a dynamic H × W image model, first vs steady\n\n"
        text += table(rows, header) + "\n"
    publish("warmup", text)


if __name__ == "__main__":
    main()
