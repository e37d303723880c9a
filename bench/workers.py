"""One server process against several (``TG_WORKERS``), alternately, in one sitting (#17).

    .venv/bin/python -m bench.workers [--workers 2] [--pairs 5] [--seconds 5]

Both servers serve one repository (efficientnet_lite0 and the W2 MLP) with the CPUs of this
machine shared as the server would share them by default (``TG_CPUS`` split among workers) and
stay up; each pair runs every workload against one and then the other, the order flipping
every pair: W1 (a 640×480 JPEG → top-5, v1 predict) at 16 and 1 connections, W2 (the 64→256→10 MLP, a
JSON tensor, v2 infer) at 64 and 1. wrk is the client (one thread), on the same machine.
Reported per workload: requests/s, p50 and the mean batch size (rows per model execution,
from the statistics extension, which sums over workers), min/median/max over pairs, and the
ratio several/one; then the RSS of each process (the supervisor and every worker).
Writes bench/results/workers.md.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import httpx
import numpy as np
import orjson
import psutil

from bench.batching import W1_PATH, jpeg_640x480, mlp_models
from bench.common import publish, spread, table, wait_until_up, wrk
from bench.paired import serve
from tests.server import MODELS, REPO_ROOT


def executions(url: str, model: str) -> tuple[int, int]:
    """Rows and executions so far (summed over workers)."""
    stats = httpx.get(f"{url}/v2/models/{model}/stats", timeout=30).json()["model_stats"][0]
    return stats["inference_count"], stats["execution_count"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--pairs", type=int, default=5)
    parser.add_argument("--seconds", type=int, default=5)
    args = parser.parse_args()
    image = jpeg_640x480()
    x = np.random.default_rng(1).standard_normal((1, 64)).astype(np.float32)
    mlp = orjson.dumps(
        {
            "inputs": [
                {"name": "x", "datatype": "FP32", "shape": [1, 64], "data": x.ravel().tolist()}
            ]
        }
    )
    workloads = {
        "W1 c=16": ("efficientnet_lite0", W1_PATH, image, "image/jpeg", 16),
        "W1 c=1": ("efficientnet_lite0", W1_PATH, image, "image/jpeg", 1),
        "W2 c=64": ("mlp", "/v2/models/mlp/infer", mlp, "application/json", 64),
        "W2 c=1": ("mlp", "/v2/models/mlp/infer", mlp, "application/json", 1),
    }
    sides = {"one": "1", "several": str(args.workers)}
    results: dict[tuple[str, str], list[tuple[float, float, float]]] = {}
    memory: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        repository = Path(tmp) / "models"
        repository.mkdir()
        (repository / "efficientnet_lite0").symlink_to(MODELS / "efficientnet_lite0")
        mlp_models(repository)
        # The settings a deployment gets by default, with the worker count set: threads are
        # the CPUs divided among the workers (TG_INTRA_OP_THREADS/TG_PREPROCESS_THREADS unset).
        unset = {"TG_INTRA_OP_THREADS": "0", "TG_PREPROCESS_THREADS": "0"}
        servers = {
            side: serve(REPO_ROOT, repository, {**unset, "TG_WORKERS": count})
            for side, count in sides.items()
        }
        try:
            for _, url in servers.values():
                wait_until_up(f"{url}/v2/health/ready", timeout_s=300)
            for pair in range(args.pairs):
                order = ("one", "several") if pair % 2 == 0 else ("several", "one")
                for name, (model, path, body, content_type, connections) in workloads.items():
                    for side in order:
                        url = servers[side][1]
                        rows, runs = executions(url, model)
                        result = wrk(
                            url + path,
                            body,
                            content_type,
                            connections=connections,
                            seconds=args.seconds,
                        )
                        assert result.errors == 0, (side, name, result)
                        rows_after, runs_after = executions(url, model)
                        batch = (rows_after - rows) / max(1, runs_after - runs)
                        results.setdefault((name, side), []).append(
                            (result.requests_per_s, result.p50_ms, batch)
                        )
            for side, (process, _) in servers.items():
                tree = [psutil.Process(process.pid), *psutil.Process(process.pid).children()]
                memory[side] = [p.memory_info().rss / 2**20 for p in tree]
        finally:
            for process, _ in servers.values():
                process.terminate()
                process.wait(timeout=60)
    rows_out = []
    for name in workloads:
        one, several = results[(name, "one")], results[(name, "several")]
        ratios = sorted(s[0] / o[0] for o, s in zip(one, several, strict=True))
        rows_out.append(
            [
                name,
                spread([r[0] for r in one], "{:.0f}"),
                spread([r[0] for r in several], "{:.0f}"),
                spread(ratios, "{:.2f}"),
                spread([r[1] for r in one], "{:.2f}"),
                spread([r[1] for r in several], "{:.2f}"),
                spread([r[2] for r in one], "{:.1f}"),
                spread([r[2] for r in several], "{:.1f}"),
            ]
        )
    header = [
        "workload",
        "1 req/s",
        f"{args.workers} req/s",
        f"{args.workers}/1",
        "1 p50 ms",
        f"{args.workers} p50 ms",
        "1 batch",
        f"{args.workers} batch",
    ]
    rss = "\n".join(
        f"- {side} ({sides[side]} worker(s)): "
        + ", ".join(f"{mib:.0f}" for mib in values)
        + f" MiB (process first, then its workers; total {sum(values):.0f} MiB)"
        for side, values in memory.items()
    )
    publish(
        "workers",
        f"# 1 vs {args.workers} workers, {args.pairs} alternating pairs of "
        f"{args.seconds} s, {psutil.cpu_count()} CPUs\n\nmedian (min–max)\n\n"
        f"{table(rows_out, header)}\n\nRSS after the runs:\n{rss}\n",
    )


if __name__ == "__main__":
    main()
