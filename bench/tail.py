"""W1 at 16 connections' p99/p50 at the defaults, by efficientnet's preferred batch sizes, by the
bound of its adaptive queue delay and by the client's CPU priority, alternately, in one sitting
(#27, docs/performance.md "W1's tail").

    .venv/bin/python -m bench.tail [--preferred 4 --preferred 2 --preferred 2,4]
        [--delay-ms 2 --delay-ms 10] [--wrk-nice 0 --wrk-nice -10] [--rounds 4] [--seconds 12]

One server of the working tree at its defaults for each ``--preferred`` (efficientnet_lite0's
``batching.preferred_batch_sizes``) and ``--delay-ms`` (its ``batching.max_queue_delay_ms``:
how long a batch may wait for requests still on their way; unset, the default), its config
otherwise as bundled, all up together; each
round runs wrk (one thread, 16 connections, the 640×480 JPEG → top-5 of ``bench.batching``)
for ``--seconds`` against each server at each ``--wrk-nice`` (a negative one needs root: it
tells whether the client's share of the two CPUs makes the tail), the order reversed every
other round. Writes bench/results/tail.md.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from bench.batching import W1_PATH, jpeg_640x480
from bench.common import publish, running, serve_tree, settle, spread, table, wrk
from tests.server import REPO_ROOT

QUIET = {"TG_ACCESS_LOG": "false", "TG_LOG_LEVEL": "warning"}
MODEL = REPO_ROOT / "models" / "efficientnet_lite0"
BUNDLED = "batching: {preferred_batch_sizes: [4]}"


def repository(root: Path, preferred: str, delay_ms: float | None = None) -> Path:
    """A repository of efficientnet_lite0 alone (its built artifact linked), preferring
    ``preferred`` (comma-separated sizes), its queue delay bounded by ``delay_ms`` (None: the
    default)."""
    folder = root / "models" / "efficientnet_lite0"
    folder.mkdir(parents=True)
    for name in ("1", "labels.txt"):
        (folder / name).symlink_to(MODEL / name)
    config = (MODEL / "config.yaml").read_text()
    if BUNDLED not in config:
        raise SystemExit(f"{MODEL / 'config.yaml'} no longer says {BUNDLED!r}: update bench.tail")
    sizes = ", ".join(str(int(size)) for size in preferred.split(","))
    delay = "" if delay_ms is None else f", max_queue_delay_ms: {delay_ms:g}"
    replaced = config.replace(BUNDLED, f"batching: {{preferred_batch_sizes: [{sizes}]{delay}}}")
    (folder / "config.yaml").write_text(replaced)
    return folder.parent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preferred", action="append", help="e.g. 4, or 2,4 (repeatable)")
    parser.add_argument("--delay-ms", type=float, action="append", help="delay bound (repeatable)")
    parser.add_argument("--wrk-nice", type=int, action="append", help="wrk's nice (repeatable)")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--seconds", type=int, default=12)
    args = parser.parse_args()
    preferred: list[str] = args.preferred or ["4"]
    delays: list[float | None] = args.delay_ms or [None]
    nices: list[int] = args.wrk_nice or [0]
    body = jpeg_640x480()
    configs = [(p, d) for p in preferred for d in delays]
    variants = [(c, n) for c in configs for n in nices]
    results: dict[tuple[Config, int], list[tuple[float, float, float]]] = {v: [] for v in variants}
    with tempfile.TemporaryDirectory() as tmp:
        servers = {
            c: serve_tree(REPO_ROOT, repository(Path(tmp) / f"r{i}", *c), QUIET)
            for i, c in enumerate(configs)
        }
        with running(servers) as urls:
            for c in configs:  # warm: the first connections, the allocator, the caches
                wrk(urls[c] + W1_PATH, body, "image/jpeg", connections=16, seconds=2)
                settle(urls[c])
            for round_ in range(args.rounds):
                order = variants if round_ % 2 == 0 else variants[::-1]
                for c, nice in order:
                    run = wrk(
                        urls[c] + W1_PATH,
                        body,
                        "image/jpeg",
                        connections=16,
                        seconds=args.seconds,
                        nice=nice,
                    )
                    settle(urls[c])  # the next run starts beside nothing this one left
                    results[(c, nice)].append((run.requests_per_s, run.p50_ms, run.p99_ms))
                    print(
                        f"{_name(c)}, wrk nice {nice}: {run.requests_per_s:.1f} req/s, "
                        f"p50 {run.p50_ms:.1f} ms, p99 {run.p99_ms:.1f} ms",
                        flush=True,
                    )
    rows = [
        [
            f"[{c[0]}]",
            "default" if c[1] is None else f"{c[1]:g}",
            str(nice),
            spread([r for r, _, _ in runs], "{:.0f}"),
            spread([p50 for _, p50, _ in runs], "{:.1f}"),
            spread([p99 for _, _, p99 in runs], "{:.1f}"),
            spread(sorted(p99 / p50 for _, p50, p99 in runs), "{:.2f}"),
        ]
        for (c, nice), runs in results.items()
    ]
    publish(
        "tail",
        f"# W1 at 16 connections, {args.rounds} alternating rounds of {args.seconds} s\n\n"
        "median (min–max)\n\n" + table(rows, [*HEADERS]) + "\n",
    )


HEADERS = ("preferred sizes", "delay bound ms", "wrk nice", "req/s", "p50 ms", "p99 ms", "p99/p50")
Config = tuple[str, float | None]
"""A server's preferred sizes and delay bound (None: the default)."""


def _name(config: Config) -> str:
    preferred, delay = config
    return f"preferred [{preferred}], delay " + ("default" if delay is None else f"{delay:g} ms")


if __name__ == "__main__":
    main()
