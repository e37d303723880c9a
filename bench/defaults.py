"""The defaults against the configurations they replace, alternately, in one sitting (#27).

    .venv/bin/python -m bench.defaults [--pairs 5] [--seconds 4] [--tail-seconds 12]

Three servers of the working tree serve one repository (efficientnet_lite0 and the W2 MLP) and
stay up: the server with **no setting at all** (its defaults), the **old default** (one worker
per two CPUs, its threads the CPUs divided among workers, each image resized on one thread,
every batch on its instance's thread: ``TG_WORKERS=1 TG_RESIZE_HALVES=false
TG_INLINE_BATCH_US=0`` on 2 CPUs) and **one worker per CPU, one thread each**
(``TG_WORKERS=2 TG_INTRA_OP_THREADS=1 TG_PREPROCESS_THREADS=1 TG_RESIZE_HALVES=false`` on 2
CPUs; small batches on the loop, as at the defaults). Each pair runs every workload against
each server, the order rotating every pair: W1 (a 640×480 JPEG → top-5, v1 predict) at 1 and 16 connections, W2 (the 64→256→10 MLP, a JSON
tensor, v2 infer) at 64 and 1. wrk is the client (one thread), on the same CPUs. Then a lone
image, alternately in this process (decode, preprocess, ONNX Runtime at batch 1 with the CPUs'
threads, top-5, the image resized on one thread) and served, one at a time
(``bench.batching.one_image_pairs``), against the defaults, the old default, and a fourth
server for this only: the defaults with each image resized on one thread
(``TG_RESIZE_HALVES=false``), the servers in turns over 4 rounds; and against the defaults once
more, in process with the runtime as the server makes it (two sessions: every CPU's threads,
spinning while a run lasts, for a batch alone; ``bench.batching.in_process_alike``), which
tells what serving costs from what the server's runtime settings give. Last, W1 at 16
connections once more against the three, in rounds of ``--tail-seconds`` (the issue's 12 s),
for its p99/p50: wrk opens its 16 connections at once, and the second and a half after such a
burst holds many of that workload's slow requests (docs/performance.md, "W1's tail"), which a
4 s round weighs three times as much as a 12 s one. Writes
bench/results/defaults.md.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from bench.batching import (
    W1_PATH,
    W2_PATH,
    in_process,
    in_process_alike,
    jpeg_640x480,
    mlp_body,
    one_image_pairs,
    served_repository,
    top5,
)
from bench.common import publish, rotating, running, serve_tree, spread, table
from service.resources import available_cpus
from tests.server import REPO_ROOT

QUIET = {"TG_ACCESS_LOG": "false", "TG_LOG_LEVEL": "warning"}


ONE_THREAD_RESIZE = "defaults, resize on one thread"
LONE_ROUNDS = 4


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pairs", type=int, default=5)
    parser.add_argument("--seconds", type=int, default=4)
    parser.add_argument("--images", type=int, default=400, help="lone images per side")
    parser.add_argument(
        "--tail-seconds", type=int, default=12, help="W1 at 16 connections' rounds for p99/p50"
    )
    args = parser.parse_args()
    cpus = available_cpus()
    configs = {
        "defaults": {},
        "old default": {
            "TG_WORKERS": str(max(1, cpus // 2)),
            "TG_RESIZE_HALVES": "false",
            "TG_INLINE_BATCH_US": "0",
        },
        "1 thread per worker": {
            "TG_WORKERS": str(cpus),
            "TG_INTRA_OP_THREADS": "1",
            "TG_PREPROCESS_THREADS": "1",
            "TG_RESIZE_HALVES": "false",
        },
    }
    image = jpeg_640x480()
    workloads = {
        "W1 c=1": (W1_PATH, image, "image/jpeg", 1),
        "W1 c=16": (W1_PATH, image, "image/jpeg", 16),
        "W2 c=64": (W2_PATH, mlp_body(), "application/json", 64),
        "W2 c=1": (W2_PATH, mlp_body(), "application/json", 1),
    }
    names = list(configs)
    # Lone images only: the defaults with each image resized on one thread, which tells what
    # the resize in halves (preprocessing.halves) gives a lone image from what the workers do.
    lone_configs = {**configs, ONE_THREAD_RESIZE: {"TG_RESIZE_HALVES": "false"}}
    lone_names = ["defaults", ONE_THREAD_RESIZE, "old default"]
    lone: dict[str, list[tuple[float, float]]] = {name: [] for name in lone_names}
    alike: list[tuple[float, float]] = []
    with tempfile.TemporaryDirectory() as tmp:
        repository = served_repository(Path(tmp))
        servers = {
            name: serve_tree(REPO_ROOT, repository, {**QUIET, **settings})
            for name, settings in lone_configs.items()
        }
        with running(servers) as every:
            urls = {name: every[name] for name in names}
            measured = rotating(urls, workloads, args.pairs, args.seconds)
            pipeline, runtime = in_process(cpus)
            same = in_process_alike(cpus, pipeline(image)[None])
            for turn in range(LONE_ROUNDS):  # the servers in turns: the machine drifts
                shift = turn % len(lone_names)
                for name in lone_names[shift:] + lone_names[:shift]:
                    lone[name].append(
                        one_image_pairs(
                            image,
                            pipeline,
                            runtime,
                            top5(),
                            servers[name][1],
                            W1_PATH,
                            args.images // LONE_ROUNDS,
                        )
                    )
                    if name == "defaults":
                        alike.append(
                            one_image_pairs(
                                image,
                                pipeline,
                                same,
                                top5(),
                                servers[name][1],
                                W1_PATH,
                                args.images // LONE_ROUNDS,
                            )
                        )
            tail = rotating(urls, {"W1 c=16": workloads["W1 c=16"]}, args.pairs, args.tail_seconds)
    results = {
        key: [(r.requests_per_s, r.p50_ms, r.p99_ms) for r in runs]
        for key, runs in measured.items()
    }
    rows = []
    for workload in workloads:
        new = results[(workload, "defaults")]
        row = [workload]
        for name in names:
            row.append(spread([r for r, _, _ in results[(workload, name)]], "{:.0f}"))
        for name in names[1:]:
            ratios = sorted(
                n[0] / o[0] for n, o in zip(new, results[(workload, name)], strict=True)
            )
            row.append(spread(ratios, "{:.3f}"))
        for name in names:
            p99_p50 = sorted(p99 / p50 for _, p50, p99 in results[(workload, name)])
            row.append(spread(p99_p50, "{:.2f}"))
        rows.append(row)
    header = [
        "workload",
        *(f"{n} req/s" for n in names),
        *(f"defaults / {n}" for n in names[1:]),
        *(f"{n} p99/p50" for n in names),
    ]
    lone_rows = [
        [
            name,
            spread([inside for inside, _ in rounds], "{:.2f}"),
            spread([served for _, served in rounds], "{:.2f}"),
            spread(sorted(inside / served for inside, served in rounds), "{:.3f}"),
        ]
        for name, rounds in [*lone.items(), ("defaults, vs the server's runtime", alike)]
    ]
    tail_rows = [
        [
            name,
            spread([r.requests_per_s for r in runs], "{:.0f}"),
            spread([r.p50_ms for r in runs], "{:.1f}"),
            spread([r.p99_ms for r in runs], "{:.1f}"),
            spread(sorted(r.p99_ms / r.p50_ms for r in runs), "{:.2f}"),
        ]
        for name in names
        for runs in [tail[("W1 c=16", name)]]
    ]
    publish(
        "defaults",
        f"# defaults vs the configurations they replace ({cpus} CPUs), {args.pairs} rotating "
        f"pairs of {args.seconds} s\n\nmedian (min–max)\n\n{table(rows, header)}\n\n"
        f"A lone image, {args.images} alternately in process and served, in {LONE_ROUNDS} "
        "rounds of the servers in turn (median (min–max) of the rounds' medians, ms):\n\n"
        + table(lone_rows, ["server", "in process ms", "served ms", "served / in process rate"])
        + f"\n\nW1 at 16 connections in rounds of {args.tail_seconds} s, {args.pairs} rotating "
        "pairs (median (min–max)):\n\n"
        + table(tail_rows, ["server", "req/s", "p50 ms", "p99 ms", "p99/p50"])
        + "\n",
    )


if __name__ == "__main__":
    main()
