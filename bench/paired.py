"""Old code against new code, alternately, in one sitting: the paired measurement that a claim
like "this change costs nothing" or "this buys 5 %" needs on a shared, drifting machine.

    .venv/bin/python -m bench.paired --old d5a6af0 [--pairs 5] [--seconds 5] [--defaults]
        [--backend torchscript|pt2]

The old revision is checked out in a temporary git worktree and served by this venv (its
packages are the same unless the locks changed between the two); the new side is the working
tree. Both servers serve one repository (efficientnet_lite0 and the W2 MLP) with the same
settings and stay up; each pair runs every workload against one server and then the other (the
order flips every pair), so that drift falls on both sides alike:
W1 (a 640×480 JPEG → top-5, v1 predict) at 16 and at 1 connection; W2 (the 64→256→10 MLP, a JSON
tensor, v2 infer) at 64 and at 1 connection. Loopback only; wrk is the client. With
``--backend``, efficientnet_lite0 is served from that artifact of its version instead of ONNX.
Writes bench/results/paired.md.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from bench.batching import W1_PATH, W2_PATH, jpeg_640x480, mlp_body, served_repository
from bench.common import publish, running, serve_tree, spread, table, worktree, wrk
from tests.server import REPO_ROOT

QUIET = {"TG_ACCESS_LOG": "false", "TG_LOG_LEVEL": "warning"}
ENV = {
    **QUIET,
    "TG_WORKERS": "1",  # a code change compared on one process (--defaults: the defaults)
    "TG_INTRA_OP_THREADS": "2",
    "TG_PREPROCESS_THREADS": "2",
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--old", required=True, help="the git revision to compare against")
    parser.add_argument("--pairs", type=int, default=5)
    parser.add_argument("--seconds", type=int, default=5)
    parser.add_argument(
        "--new-env",
        action="append",
        default=[],
        metavar="TG_NAME=VALUE",
        help="a setting for the new side only (e.g. TG_GRPC_PORT=0)",
    )
    parser.add_argument(
        "--defaults",
        action="store_true",
        help="both sides at the server's defaults (workers, threads), not one worker of 2 threads",
    )
    parser.add_argument(
        "--backend", choices=("onnx", "torchscript", "pt2"), default="onnx", help="W1's artifact"
    )
    args = parser.parse_args()
    new_env = dict(item.split("=", 1) for item in args.new_env)
    workloads = {
        "W1 c=16": (W1_PATH, jpeg_640x480(), "image/jpeg", 16),
        "W1 c=1": (W1_PATH, jpeg_640x480(), "image/jpeg", 1),
        "W2 c=64": (W2_PATH, mlp_body(), "application/json", 64),
        "W2 c=1": (W2_PATH, mlp_body(), "application/json", 1),
    }
    results: dict[tuple[str, str], list[tuple[float, float, float]]] = {}
    with tempfile.TemporaryDirectory() as tmp, worktree(args.old, Path(tmp) / "old") as old_tree:
        repository = served_repository(Path(tmp))
        if args.backend != "onnx":
            switch_backend(repository / "efficientnet_lite0", args.backend)
        base = QUIET if args.defaults else ENV
        servers = {
            "old": serve_tree(old_tree, repository, base),
            "new": serve_tree(REPO_ROOT, repository, {**base, **new_env}),
        }
        with running(servers) as urls:
            for pair in range(args.pairs):
                sides = ("old", "new") if pair % 2 == 0 else ("new", "old")
                for name, (path, body, content_type, connections) in workloads.items():
                    for side in sides:
                        result = wrk(
                            urls[side] + path,
                            body,
                            content_type,
                            connections=connections,
                            seconds=args.seconds,
                        )
                        assert result.errors == 0, (side, name, result)
                        results.setdefault((name, side), []).append(
                            (result.requests_per_s, result.p50_ms, result.p99_ms)
                        )
    rows = []
    for name in workloads:
        old, new = results[(name, "old")], results[(name, "new")]
        ratios = sorted(n[0] / o[0] for o, n in zip(old, new, strict=True))
        rows.append(
            [
                name,
                spread([r for r, _, _ in old], "{:.0f}"),
                spread([r for r, _, _ in new], "{:.0f}"),
                spread([p for _, p, _ in old], "{:.2f}"),
                spread([p for _, p, _ in new], "{:.2f}"),
                spread(sorted(p99 / p50 for _, p50, p99 in old), "{:.2f}"),
                spread(sorted(p99 / p50 for _, p50, p99 in new), "{:.2f}"),
                spread(ratios, "{:.3f}"),
            ]
        )
    header = [
        "workload",
        "old req/s",
        "new req/s",
        "old p50 ms",
        "new p50 ms",
        "old p99/p50",
        "new p99/p50",
        "new/old req/s",
    ]
    publish(
        "paired",
        f"# old ({args.old}) vs new (working tree), {args.pairs} alternating pairs "
        f"of {args.seconds} s{', default settings' if args.defaults else ''}"
        f"{'' if args.backend == 'onnx' else f', W1 from {args.backend}'}\n\n"
        f"median (min–max)\n\n{table(rows, header)}\n",
    )


def switch_backend(folder: Path, backend: str) -> None:
    """``folder`` (a link to a bundled model) made a folder of links to its files, with its
    config served from ``backend``'s artifact."""
    source = folder.resolve()
    folder.unlink()
    folder.mkdir()
    for path in source.iterdir():
        if path.name != "config.yaml":
            (folder / path.name).symlink_to(path)
    lines = (source / "config.yaml").read_text().splitlines()
    switched = [f"backend: {backend}" if x.startswith("backend:") else x for x in lines]
    (folder / "config.yaml").write_text("\n".join(switched) + "\n")


if __name__ == "__main__":
    main()
