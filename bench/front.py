"""What the supervisor's gRPC front costs (#28, finding 12): this tree against an older one.

    .venv/bin/python -m bench.front [--old 6a78eba] [--runs 5] [--seconds 4]

Two servers with their defaults (one worker per CPU) serve the W2 MLP: this working tree,
whose supervisor listens on the gRPC port and forwards each connection to a worker
(service/cluster/front.py), and ``--old`` (a git worktree), whose workers bound the port with
SO_REUSEPORT and answered the connections the kernel gave them directly. Alternately, ``--runs``
times each, h2load sends unary ModelInfer calls (1×64 FP32) in each cell: one connection with
one stream (a lone client's latency), one connection with 64 streams, and 8 connections with 8
streams each (spread over the workers). For each cell: calls/s and the mean latency of each
tree, their ratio, and the supervisor's CPU time per call (/proc): what forwarding costs.
Writes bench/results/front.md.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from collections import defaultdict
from pathlib import Path

from bench.batching import served_repository
from bench.common import cpu_seconds, publish, running, serve_tree, spread, table, worktree
from bench.grpc import bodies, h2load
from tests.server import REPO_ROOT, free_port

CELLS = ((1, 1), (1, 64), (8, 8))
"""(connections, streams on each)."""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--old", default="6a78eba")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--seconds", type=int, default=4)
    args = parser.parse_args()
    frame = bodies("mlp", (1, 64), "x")["gRPC"][0]
    # (tree, cell) -> [(calls/s, mean ms, supervisor CPU µs a call)]
    measured: dict[tuple[str, tuple[int, int]], list[tuple[float, float, float]]]
    measured = defaultdict(list)
    with tempfile.TemporaryDirectory() as tmp, worktree(args.old, Path(tmp) / "old") as old:
        repository = served_repository(Path(tmp))
        trees = {"this tree": REPO_ROOT, args.old: old}
        grpc_ports = {name: free_port() for name in trees}
        servers = {
            name: serve_tree(tree, repository, {}, grpc_port=grpc_ports[name])
            for name, tree in trees.items()
        }
        with running(servers):
            for run in range(args.runs):
                order = list(trees) if run % 2 == 0 else list(reversed(trees))
                for cell in CELLS:
                    for name in order:
                        pid = servers[name][0].pid
                        before = cpu_seconds(pid, children=False)
                        rate, mean_ms = h2load(
                            f"http://127.0.0.1:{grpc_ports[name]}",
                            frame,
                            streams=cell[1],
                            seconds=args.seconds,
                            connections=cell[0],
                        )
                        calls = rate * args.seconds
                        cost_us = (cpu_seconds(pid, children=False) - before) / calls * 1e6
                        measured[(name, cell)].append((rate, mean_ms, cost_us))
                        print(name, cell, f"{rate:.0f}/s {mean_ms:.2f} ms {cost_us:.1f} µs")
    new, older = "this tree", args.old
    rows = []
    for cell in CELLS:
        a, b = measured[(new, cell)], measured[(older, cell)]
        rows.append(
            [
                f"{cell[0]} × {cell[1]}",
                f"{statistics.median(r for r, _, _ in a):,.0f}",
                f"{statistics.median(r for r, _, _ in b):,.0f}",
                spread([x[0] / y[0] for x, y in zip(a, b, strict=True)], "{:.3f}"),
                spread([x[1] / y[1] for x, y in zip(a, b, strict=True)], "{:.3f}"),
                f"{statistics.median(c for _, _, c in a):.1f}",
                f"{statistics.median(c for _, _, c in b):.1f}",
            ]
        )
    command = f"python -m bench.front --old {args.old} --runs {args.runs} --seconds {args.seconds}"
    publish(
        "front",
        f"`{command}` (W2 MLP over gRPC, h2load, both servers at their defaults)\n\n"
        + table(
            rows,
            [
                "connections × streams",
                "calls/s, this tree",
                f"calls/s, {older}",
                "calls/s ratio",
                "mean latency ratio",
                "supervisor µs/call, this tree",
                f"supervisor µs/call, {older}",
            ],
        )
        + "\n",
    )


if __name__ == "__main__":
    main()
