"""Small batches on the event loop against every batch handed to its instance's thread.

    .venv/bin/python -m bench.inline [--pairs 5] [--seconds 4]

Two servers of this tree serve one repository (efficientnet_lite0 and the W2 MLP), at the
defaults but for one setting: ``TG_INLINE_BATCH_US`` at its default (a batch whose shape ran
within 200 µs runs on the loop's thread) and 0 (every batch on its instance's thread, as
before). Rotating pairs of wrk runs: W2 (the 64→256→10 MLP, a JSON tensor, v2 infer) at 1 and
64 connections, and W1 (a 640×480 JPEG → top-5, v1 predict) at 1 connection, whose batches are
never run on the loop (its image is preprocessed on the instance's thread, and its model runs
for milliseconds): the control. Besides req/s, the servers' CPU time a request (every process
of the server, from /proc), which the machine's drift moves less than a rate. Writes
bench/results/inline.md.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from bench.batching import W1_PATH, W2_PATH, jpeg_640x480, mlp_body, served_repository
from bench.common import publish, rotating, running, serve_tree, spread, table
from tests.server import REPO_ROOT

QUIET = {"TG_ACCESS_LOG": "false", "TG_LOG_LEVEL": "warning"}
CONFIGS = {"on the loop (default)": {}, "TG_INLINE_BATCH_US=0": {"TG_INLINE_BATCH_US": "0"}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pairs", type=int, default=5)
    parser.add_argument("--seconds", type=int, default=4)
    args = parser.parse_args()
    workloads = {
        "W2 c=1": (W2_PATH, mlp_body(), "application/json", 1),
        "W2 c=64": (W2_PATH, mlp_body(), "application/json", 64),
        "W1 c=1": (W1_PATH, jpeg_640x480(), "image/jpeg", 1),
    }
    names = list(CONFIGS)
    cpu: dict[tuple[str, str], list[float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        repository = served_repository(Path(tmp))
        servers = {
            name: serve_tree(REPO_ROOT, repository, {**QUIET, **settings})
            for name, settings in CONFIGS.items()
        }
        with running(servers) as urls:
            pids = {name: process.pid for name, (process, _) in servers.items()}
            measured = rotating(urls, workloads, args.pairs, args.seconds, (pids, cpu))
    rates = {key: [r.requests_per_s for r in runs] for key, runs in measured.items()}
    on, off = names
    rows = []
    for workload in workloads:
        ratios = [a / b for a, b in zip(rates[(workload, on)], rates[(workload, off)], strict=True)]
        rows.append(
            [
                workload,
                spread(rates[(workload, on)], "{:.0f}"),
                spread(rates[(workload, off)], "{:.0f}"),
                spread(ratios, "{:.3f}"),
                spread(cpu[(workload, on)], "{:.0f}"),
                spread(cpu[(workload, off)], "{:.0f}"),
            ]
        )
    header = [
        "workload",
        f"{on} req/s",
        f"{off} req/s",
        "ratio",
        f"{on} server CPU µs a request",
        f"{off} server CPU µs a request",
    ]
    publish(
        "inline",
        f"# Small batches on the loop ({args.pairs} rotating pairs of {args.seconds} s; "
        "median (min–max); wrk -t1 on the same CPUs)\n\n" + table(rows, header) + "\n",
    )


if __name__ == "__main__":
    main()
