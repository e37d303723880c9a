"""Instructions the HTTP/1.1 connection layer costs a request: old code against new.

    .venv/bin/python -m bench.http_layer --old 6961ee9 [--requests 1000 3000]

A change to the connection guards (:mod:`service.limits.connections`) moves a request's cost by
a microsecond or two, far less than wall-clock rates on this shared 2-core machine move between
runs (timed in one process, the same code read 9.0 to 15.9 µs a request from one run to the
next). This feeds a W2-like request (a POST of the MLP's JSON tensor, headers as wrk sends them,
the whole request in one read) to the guarded protocol on one keep-alive connection, with a fake
transport and an ASGI app that answers at once, and counts the instructions the process runs
under valgrind's callgrind (deterministic, unlike time): the difference between two request
counts, divided by the requests between them, is the per-request figure (uvicorn's parser and
cycle, the guards, the app's task, the answer), free of the start-up both runs share. Without
valgrind it reads the time spent in ``data_received`` instead (noisy). Writes
bench/results/http_layer.md.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from bench.common import publish, table, worktree
from tests.server import REPO_ROOT

WARM = 2000
SETS = 5

DRIVER = r"""
import asyncio, sys, time
tree, n, warm, sets = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
sys.path.insert(0, tree)
import uvloop
from uvicorn.config import Config
from uvicorn.server import ServerState
from service.limits.connections import ConnectionLimits, guarded_protocol

BODY = (b'{"inputs":[{"name":"x","datatype":"FP32","shape":[1,64],"data":['
        + b",".join([b"0.5"] * 64) + b"]}]}")
REQUEST = (b"POST /v2/models/mlp/infer HTTP/1.1\r\nHost: 127.0.0.1:8000\r\nUser-Agent: wrk\r\n"
           b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(BODY)) + BODY

async def app(scope, receive, send):
    if scope["type"] != "http":
        return
    await receive()
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-length", b"2")]})
    await send({"type": "http.response.body", "body": b"{}"})

class Transport(asyncio.Transport):
    def __init__(self):
        super().__init__()
        self.writes, self.closing = 0, False
    def get_extra_info(self, name, default=None):
        return {"peername": ("127.0.0.1", 5555), "sockname": ("127.0.0.1", 8000)}.get(name, default)
    def write(self, data): self.writes += 1
    def is_closing(self): return self.closing
    def close(self): self.closing = True
    def pause_reading(self): pass
    def resume_reading(self): pass
    def set_write_buffer_limits(self, *args, **kwargs): pass
    def get_write_buffer_size(self): return 0

async def main():
    config = Config(app, http="httptools", log_level="error", access_log=False, lifespan="off")
    config.load()
    limits = ConnectionLimits(max_connections=1000, max_header_bytes=8192, header_timeout_s=30,
                              body_timeout_s=30)
    protocol = guarded_protocol(limits)(config=config, server_state=ServerState(), app_state={})
    transport = Transport()
    protocol.connection_made(transport)
    spent = []
    for count in [warm] + [n] * sets:
        begun, took = transport.writes, 0
        for i in range(count):
            clock = time.perf_counter_ns()
            protocol.data_received(REQUEST)
            took += time.perf_counter_ns() - clock
            while transport.writes <= begun + i:  # the answer's first write
                await asyncio.sleep(0)
        spent.append(took / count / 1e3)
    print("DATA_RECEIVED_US", min(spent[1:]))
    transport.closing = True

uvloop.run(main())
"""


def run(tree: Path, requests: int, counted: bool) -> float:
    """Instructions the whole run took (``counted``), else the least µs in data_received."""
    command = [sys.executable, "-c", DRIVER, str(tree), str(requests), str(WARM), str(SETS)]
    with tempfile.TemporaryDirectory() as tmp:
        if counted:
            out = Path(tmp) / "callgrind.out"
            command = ["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}", *command]
        done = subprocess.run(
            command,
            capture_output=True,
            text=True,
            timeout=1800,
            check=True,
            env={**os.environ, "PYTHONHASHSEED": "0"},  # str hashes, and so dicts, alike each run
        )
    if counted:
        found = re.search(r"Collected : (\d+)", done.stderr)
        if found is None:
            raise RuntimeError(f"callgrind counted nothing:\n{done.stderr[-2000:]}")
        return float(found.group(1))
    return float(done.stdout.split()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--old", required=True, help="the git revision to compare against")
    parser.add_argument("--requests", type=int, nargs=2, default=[1000, 3000])
    args = parser.parse_args()
    counted = shutil.which("valgrind") is not None
    low, high = args.requests
    figures: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as tmp, worktree(args.old, Path(tmp) / "old") as old_tree:
        for side, tree in (("old", old_tree), ("new", REPO_ROOT)):
            if counted:
                between = (high - low) * SETS
                figures[side] = (run(tree, high, True) - run(tree, low, True)) / between
            else:
                figures[side] = run(tree, high, False)
            print(side, f"{figures[side]:,.0f}", flush=True)
    unit = "instructions/request" if counted else "µs/request in data_received"
    rows = [
        [
            f"{figures['old']:,.0f}",
            f"{figures['new']:,.0f}",
            f"{figures['new'] / figures['old']:.3f}",
        ]
    ]
    publish(
        "http_layer",
        f"# The HTTP/1.1 connection layer per W2-like request ({unit})\n\n"
        f"{table(rows, [f'old ({args.old})', 'new', 'new / old'])}\n",
    )


if __name__ == "__main__":
    main()
