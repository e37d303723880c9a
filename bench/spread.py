"""How the workers share 16 keep-alive connections, this tree against an older one (#27).

    .venv/bin/python -m bench.spread [--old 659194a] [--runs 5] [--seconds 4]

Two servers with their defaults (one worker per CPU) serve one repository (efficientnet_lite0
and the W2 MLP): this working tree and ``--old`` (a git worktree). Alternately, ``--runs`` times
each, wrk opens 16 new connections at once and sends W1 (a 640×480 JPEG → top-5) for
``--seconds``. For each run: req/s and p99/p50 from wrk, and from the access log, which worker
answered each request and its p50: the ratio of the slowest worker's p50 to the fastest's is
1.0 when the connections are spread evenly. Writes bench/results/spread.md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from collections import defaultdict
from pathlib import Path

from bench.batching import W1_PATH, jpeg_640x480, served_repository
from bench.common import publish, running, serve_tree, spread, table, worktree, wrk
from tests.server import REPO_ROOT


def per_worker_p50(log: Path, start: int) -> dict[int, float]:
    """The p50 duration (ms) of each worker's requests logged after byte ``start``."""
    durations: dict[int, list[float]] = defaultdict(list)
    with log.open("rb") as file:
        file.seek(start)
        for line in file:
            if b'"duration_ms"' in line:
                row = json.loads(line)
                durations[row["worker"]].append(row["duration_ms"])
    return {worker: statistics.median(d) for worker, d in durations.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--old", default="659194a")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--seconds", type=int, default=4)
    args = parser.parse_args()
    image = jpeg_640x480()
    measured: dict[str, list[tuple[float, float, float]]] = defaultdict(list)
    with tempfile.TemporaryDirectory() as tmp, worktree(args.old, Path(tmp) / "old") as old:
        repository = served_repository(Path(tmp))
        trees = {"this tree": REPO_ROOT, args.old: old}
        logs = {name: Path(tmp) / f"{i}.log" for i, name in enumerate(trees)}
        servers = {
            name: serve_tree(tree, repository, {}, logs[name]) for name, tree in trees.items()
        }
        with running(servers) as urls:
            for run in range(args.runs):
                order = list(trees) if run % 2 == 0 else list(reversed(trees))
                for name in order:
                    start = logs[name].stat().st_size
                    result = wrk(
                        urls[name] + W1_PATH,
                        image,
                        "image/jpeg",
                        connections=16,
                        seconds=args.seconds,
                    )
                    assert result.errors == 0, (name, result)
                    p50s = per_worker_p50(logs[name], start)
                    assert len(p50s) > 1, (name, p50s)  # the access log names both workers
                    imbalance = max(p50s.values()) / min(p50s.values())
                    measured[name].append(
                        (result.requests_per_s, result.p99_ms / result.p50_ms, imbalance)
                    )
    rows = [
        [
            name,
            spread([r for r, _, _ in runs], "{:.0f}"),
            spread([p for _, p, _ in runs], "{:.2f}"),
            spread([i for _, _, i in runs], "{:.2f}"),
            " ".join(f"{i:.2f}" for _, _, i in runs),
        ]
        for name, runs in measured.items()
    ]
    header = ["server", "W1 c=16 req/s", "p99/p50", "slowest / fastest worker p50", "each run"]
    publish(
        "spread",
        f"# 16 connections over the workers, {args.runs} alternating runs of {args.seconds} s\n\n"
        f"median (min–max)\n\n{table(rows, header)}\n",
    )


if __name__ == "__main__":
    main()
