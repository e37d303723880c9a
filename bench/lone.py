"""What serving a lone image costs: tensorgate against the thinnest server possible (#27).

    .venv/bin/python -m bench.lone [--rounds 6] [--images 300] [--also "one worker:TG_WORKERS=1"]
                                   [--old REV]

#27 asks a lone W1 image (a 640×480 JPEG → efficientnet_lite0 → top-5) served at 0.95 × the
rate of the same pipeline in process. Three servers stay up: tensorgate at its defaults,
``bench.bare_server`` (the in-process pipeline behind a blocking socket in one thread: no
framework, no event loop, no hand-off) and ``bench.bare_asgi`` (the same pipeline run on one
worker thread behind uvicorn with tensorgate's event loop and HTTP parser: what the stack
tensorgate is built on costs at least). Each round measures all, the order rotating, with
:func:`bench.batching.one_image_pairs` (one image in this process, one served, in turns, on one
keep-alive connection). The bare server's ratio is the most any server could reach here, the
rest being the request's way in and the answer's way out; uvicorn's, the floor of any server
on uvicorn with the work on a thread; tensorgate's against them is what tensorgate itself
costs. ``--also "LABEL:NAME=VALUE,..."`` adds a tensorgate with those
settings (repeatable), measured in the same rounds; ``--old REV`` adds tensorgate at its
defaults as of that git revision (a worktree), the old side of a change. Writes
bench/results/lone.md.
"""

from __future__ import annotations

import argparse
import contextlib
import subprocess
import sys
import tempfile
from pathlib import Path

from bench.batching import (
    W1_PATH,
    in_process,
    jpeg_640x480,
    one_image_pairs,
    served_repository,
    top5,
)
from bench.common import publish, running, serve_tree, spread, table, worktree
from bench.defaults import QUIET
from service.resources import available_cpus
from tests.server import REPO_ROOT, free_port

BARE = "bare server (one thread, blocking socket)"
ASGI = "uvicorn, one thread hop"
DEFAULTS = "tensorgate (defaults)"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--images", type=int, default=300, help="lone images per side")
    parser.add_argument(
        "--also",
        action="append",
        default=[],
        metavar="LABEL:NAME=VALUE,...",
        help="a tensorgate with these settings too",
    )
    parser.add_argument("--old", help="a git revision: tensorgate at its defaults as of it, too")
    args = parser.parse_args()
    cpus = available_cpus()
    image = jpeg_640x480()
    configs: dict[str, dict[str, str]] = {DEFAULTS: {}}
    for also in args.also:
        label, _, pairs = also.partition(":")
        configs[label] = dict(pair.split("=", 1) for pair in pairs.split(",") if pair)
    old = f"tensorgate at {args.old} (defaults)"
    trees = {name: REPO_ROOT for name in configs}
    times: dict[str, list[tuple[float, float]]] = {
        name: [] for name in [*configs, *([old] if args.old else []), BARE, ASGI]
    }
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
        if args.old:
            trees[old] = stack.enter_context(worktree(args.old, Path(tmp) / "old"))
            configs[old] = {}
        repository = served_repository(Path(tmp))
        port = free_port()
        bare = subprocess.Popen(
            [sys.executable, "-m", "bench.bare_server", str(port)],
            cwd=REPO_ROOT,
            stdout=subprocess.DEVNULL,
        )
        asgi_port = free_port()
        asgi = subprocess.Popen(
            [sys.executable, "-m", "bench.bare_asgi", str(asgi_port)],
            cwd=REPO_ROOT,
            stdout=subprocess.DEVNULL,
        )
        servers = {
            **{
                name: serve_tree(trees[name], repository, {**QUIET, **settings})
                for name, settings in configs.items()
            },
            BARE: (bare, port),
            ASGI: (asgi, asgi_port),
        }
        with running(servers) as urls:
            ports = {name: int(url.rsplit(":", 1)[1]) for name, url in urls.items()}
            pipeline, runtime = in_process(cpus)
            classifier = top5()
            names = list(times)
            for turn in range(args.rounds):  # the order rotating: the machine drifts
                shift = turn % len(names)
                for name in names[shift:] + names[:shift]:
                    inside, out = one_image_pairs(
                        image,
                        pipeline,
                        runtime,
                        classifier,
                        ports[name],
                        W1_PATH,
                        args.images // args.rounds,
                    )
                    times[name].append((inside, out))
    rows = [
        [
            name,
            spread([inside for inside, _ in times[name]], "{:.2f}"),
            spread([out for _, out in times[name]], "{:.2f}"),
            spread([out - inside for inside, out in times[name]], "{:.2f}"),
            spread([inside / out for inside, out in times[name]], "{:.3f}"),
        ]
        for name in times
    ]
    over_bare = [
        bare / served for (_, bare), (_, served) in zip(times[BARE], times[DEFAULTS], strict=True)
    ]
    over_asgi = [
        asgi / served for (_, asgi), (_, served) in zip(times[ASGI], times[DEFAULTS], strict=True)
    ]
    over_old = ""
    if args.old:
        ratios = [o / n for (_, o), (_, n) in zip(times[old], times[DEFAULTS], strict=True)]
        over_old = f"\ntensorgate's rate over its rate at {args.old}, round by round: " + spread(
            ratios, "{:.3f}"
        )
    publish(
        "lone",
        f"# A lone W1 image: tensorgate and the thinnest server ({cpus} CPUs), {args.rounds} "
        f"rounds of {args.images // args.rounds} images a side\n\nmedian (min–max) of the "
        f"rounds' medians\n\n"
        + table(
            rows,
            ["server", "in process ms", "served ms", "served − in process ms", "in-process rate"],
        )
        + "\n\ntensorgate's rate at its defaults / the bare server's, round by round: "
        + spread(over_bare, "{:.3f}")
        + "\ntensorgate's rate at its defaults / uvicorn's with one thread hop, round by round: "
        + spread(over_asgi, "{:.3f}")
        + over_old
        + "\n",
    )


if __name__ == "__main__":
    main()
