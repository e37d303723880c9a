"""First request after ready vs steady state, per shape (issues: dynamic shapes, #18).

    .venv/bin/python -m bench.warmup [--steady 10]

For minilm served from its ONNX, TorchScript and pt2 artifacts, each with the bundled warmup and
with none: start a fresh server, wait for ready, then per shape send one request of that shape
(the first) and then ``--steady`` more; report the first latency, the median of the rest, and
their ratio (target ≤ 1.5 with warmup). The shapes: one text of exactly each bucket's tokens,
then 2, 4, 8 and 16 such texts of 64 tokens in one request (each a batch of that many rows).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import httpx
import yaml

from bench.common import publish, table
from tests.server import MODELS, Server

BUCKETS = (16, 32, 64, 128, 256)
SHAPES = [(1, tokens) for tokens in BUCKETS] + [(rows, 64) for rows in (2, 4, 8, 16)]
"""(texts in the request, tokens in each)"""


def repository(root: Path, backend: str, warm: bool) -> None:
    folder = root / "minilm"
    folder.mkdir(parents=True)
    (folder / "1").symlink_to(MODELS / "minilm" / "1")
    config = yaml.safe_load((MODELS / "minilm" / "config.yaml").read_text())
    config["backend"] = backend
    if not warm:
        config["warmup"] = {"batch_sizes": []}
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
        repository(root, backend, warm)
        server = Server(root, env={"TG_ACCESS_LOG": "false", "TG_LOG_LEVEL": "warning",
                                   "TG_INTRA_OP_THREADS": "2"})  # fmt: skip
        try:
            server.wait_until(timeout=300)
            for texts, tokens in SHAPES:
                batch = ["word " * (tokens - 2)] * texts  # + [CLS] and [SEP] = `tokens` tokens
                first = latency(server.client, batch)
                rest = statistics.median(latency(server.client, batch) for _ in range(steady))
                rows.append([backend, "yes" if warm else "no", str(texts), str(tokens),
                             f"{first:.1f}", f"{rest:.1f}", f"{first / rest:.2f}"])  # fmt: skip
        finally:
            server.stop()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steady", type=int, default=10)
    args = parser.parse_args()
    rows = []
    for backend in ("onnx", "torchscript", "pt2"):
        for warm in (True, False):
            rows += measure(backend, warm, args.steady)
    text = (
        "# Warmup benchmark: minilm, first request of each shape vs steady\n\n"
        + table(
            rows,
            ["backend", "warmup", "texts", "tokens", "first ms", "steady p50 ms", "first / steady"],
        )
        + "\n"
    )
    publish("warmup", text)


if __name__ == "__main__":
    main()
