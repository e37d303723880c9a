"""The event loop's CPU per W2 request with no HTTP and no load generator: old code against new.

    .venv/bin/python -m bench.inprocess --old d5a6af0 [--runs 3] [--rounds 100]

Wall-clock rates on this shared 2-core machine move by more than the per-request costs a
change of the hot path is about (a load generator shares the CPUs, and the kernel's share of a
request moves with it). This drives the served ASGI app itself, in its process, with no socket:
``--rounds`` rounds of 64 concurrent W2 requests (a JSON tensor to the 64→256→10 MLP, v2 infer)
through the whole app (body budget, route, decoding, the core, the batch, the answer), and reads
the event loop thread's CPU time (``time.thread_time``) around each round set. The least of
6 sets is a process's figure: the cost with the least interference. The old revision runs from
a temporary git worktree with this venv; each run starts a fresh process per side, the order
flipping every run. Writes bench/results/inprocess.md.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

from bench.batching import mlp_models
from bench.common import publish, spread, table, worktree
from tests.server import REPO_ROOT

SETS = 6

DRIVER = r"""
import asyncio, os, sys, time
tree, root, rounds = sys.argv[1], sys.argv[2], int(sys.argv[3])
sys.path.insert(0, tree)
os.chdir(tree)
os.environ.update({"TG_ACCESS_LOG": "false", "TG_LOG_LEVEL": "warning", "TG_WORKERS": "1",
                   "TG_INTRA_OP_THREADS": "2", "TG_PREPROCESS_THREADS": "2",
                   "TG_MODEL_REPOSITORY": root, "TG_GRPC_PORT": "0"})
import numpy as np, orjson, uvloop
from service.app import create_app, serving_app
from service.settings import Settings

settings = Settings()
app = create_app(settings)
asgi = serving_app(app, settings)
x = np.random.default_rng(1).standard_normal((1, 64)).astype(np.float32)
body = orjson.dumps({"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 64],
                                 "data": x.ravel().tolist()}]})
scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
         "scheme": "http", "path": "/v2/models/mlp/infer", "raw_path": b"/v2/models/mlp/infer",
         "query_string": b"", "root_path": "", "client": ("127.0.0.1", 1),
         "server": ("127.0.0.1", 8000), "state": {},
         "headers": [(b"host", b"127.0.0.1"), (b"content-type", b"application/json"),
                     (b"content-length", str(len(body)).encode())]}

async def request():
    sent = False
    async def receive():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        await asyncio.Event().wait()  # the client never leaves
    status = []
    async def send(message):
        if message["type"] == "http.response.start":
            status.append(message["status"])
    await asgi(dict(scope), receive, send)
    assert status == [200], status

async def main():
    messages = asyncio.Queue()
    started = asyncio.Event()
    async def send(message):
        if message["type"] == "lifespan.startup.complete":
            started.set()
    await messages.put({"type": "lifespan.startup"})
    lifespan = asyncio.create_task(
        asgi({"type": "lifespan", "asgi": {"version": "3.0"}, "state": {}}, messages.get, send))
    await started.wait()
    while not app.state.dataplane.ready()[0]:
        await asyncio.sleep(0.1)
    async def run(n):
        for _ in range(n):
            await asyncio.gather(*(request() for _ in range(64)))
    await run(max(1, rounds // 5))  # warm
    figures = []
    for _ in range(int(sys.argv[4])):
        started_s = time.thread_time()
        await run(rounds)
        figures.append((time.thread_time() - started_s) / (rounds * 64) * 1e6)
    print("LOOP_US", min(figures))
    await messages.put({"type": "lifespan.shutdown"})
    await lifespan

uvloop.run(main())
"""


def loop_us(tree: Path, repository: Path, rounds: int) -> float:
    """The least event-loop CPU µs per request over the sets of one fresh process on ``tree``."""
    out = subprocess.run(
        [sys.executable, "-c", DRIVER, str(tree), str(repository), str(rounds), str(SETS)],
        capture_output=True,
        text=True,
        timeout=900,
        check=True,
    ).stdout
    return float(next(line for line in out.splitlines() if line.startswith("LOOP_US")).split()[1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--old", required=True, help="the git revision to compare against")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=100, help="rounds of 64 per set")
    args = parser.parse_args()
    figures: dict[str, list[float]] = {"old": [], "new": []}
    with tempfile.TemporaryDirectory() as tmp, worktree(args.old, Path(tmp) / "old") as old_tree:
        repository = Path(tmp) / "models"
        repository.mkdir()
        mlp_models(repository)
        trees = {"old": old_tree, "new": REPO_ROOT}
        for run in range(args.runs):
            for side in ("old", "new") if run % 2 == 0 else ("new", "old"):
                figures[side].append(loop_us(trees[side], repository, args.rounds))
                print(side, f"{figures[side][-1]:.1f} µs", flush=True)
    ratios = [n / o for o, n in zip(figures["old"], figures["new"], strict=True)]
    rows = [
        [
            spread(figures["old"], "{:.1f}"),
            spread(figures["new"], "{:.1f}"),
            spread(ratios, "{:.3f}"),
        ]
    ]
    header = [f"old ({args.old}) µs/request", "new µs/request", "new / old"]
    publish(
        "inprocess",
        f"# Event-loop CPU per W2 request in process, {args.runs} runs "
        f"(median, min–max)\n\n{table(rows, header)}\n",
    )


if __name__ == "__main__":
    main()
