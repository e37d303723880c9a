"""Memory after an attack, and what keeping it costs (#28 finding 15). Loopback only, bounded.

    .venv/bin/python -m bench.memory [--rounds 3] [--requests 16] [--pairs 40]

1. A served identity model with a dynamic dim and no buckets (max_batch_size 8), sent
   ``--requests`` concurrent binary requests of 61 MiB, ``--rounds`` times: the server's RSS
   before, its peak (VmHWM) and its RSS two seconds after each round.
2. onnxruntime's CPU arena, on and off, for one efficientnet_lite0 image in process: blocks of
   ten runs alternated ``--pairs`` times (a model whose shapes are bounded keeps the arena).
Writes bench/results/memory.md.
"""

from __future__ import annotations

import argparse
import gzip
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import numpy as np

from bench.common import publish, table

REPO = Path(__file__).resolve().parent.parent
MIB = 1 << 20


def status(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field}")


def attack(rounds: int, requests: int, compress: bool = False) -> list[list[str]]:
    sys.path.insert(0, str(REPO))
    from tests.identity import binary_request, write_identity_model
    from tests.server import Server

    with tempfile.TemporaryDirectory() as folder:
        root = Path(folder) / "models"
        write_identity_model(root / "identity", max_batch_size=8, datatypes=("FP32",), width="w")
        server = Server(root, env={"TG_INTRA_OP_THREADS": "2"}, log_path=Path(folder) / "log")
        try:
            server.wait_until()
            pid = server.process.pid
            body, header = binary_request(61 * MIB // 4)
            headers = {"Inference-Header-Content-Length": str(header)}
            if compress:  # 61 MiB of ones: about 60 KB on the wire, inflated by the server
                body = gzip.compress(body, compresslevel=6)
                headers["Content-Encoding"] = "gzip"
            codes: list[int] = []

            def send() -> None:
                answer = httpx.post(
                    f"{server.url}/v2/models/identity/infer",
                    content=body,
                    headers=headers,
                    timeout=300,
                )
                codes.append(answer.status_code)

            kind = "gzip" if compress else "binary"
            rows = [[f"{kind}: before", f"{status(pid, 'VmRSS') / MIB:.0f}", ""]]
            for index in range(rounds):
                threads = [threading.Thread(target=send) for _ in range(requests)]
                for thread in threads:
                    thread.start()
                for thread in threads:
                    thread.join()
                time.sleep(2)
                served = f"{codes.count(200)} of {len(codes)} answered 200 so far"
                rows.append(
                    [
                        f"{kind}: 2 s after round {index + 1}",
                        f"{status(pid, 'VmRSS') / MIB:.0f}",
                        served,
                    ]
                )
            rows.append([f"{kind}: peak (VmHWM)", f"{status(pid, 'VmHWM') / MIB:.0f}", ""])
            return rows
        finally:
            server.stop()


def arena(pairs: int) -> list[list[str]]:
    import onnxruntime as ort

    def session(on: bool) -> ort.InferenceSession:
        options = ort.SessionOptions()
        options.intra_op_num_threads, options.inter_op_num_threads = 2, 1
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
        options.enable_cpu_mem_arena = on
        path = REPO / "models" / "efficientnet_lite0" / "1" / "model.onnx"
        return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])

    sessions = {True: session(True), False: session(False)}
    name = sessions[True].get_inputs()[0].name
    feed = {name: np.random.default_rng(0).random((1, 3, 224, 224), np.float32)}
    times: dict[bool, list[float]] = {True: [], False: []}
    for s in sessions.values():
        for _ in range(20):
            s.run(None, feed)
    for _ in range(pairs):
        for on, s in sessions.items():
            started = time.perf_counter()
            for _ in range(10):
                s.run(None, feed)
            times[on].append((time.perf_counter() - started) / 10 * 1000)
    on, off = statistics.median(times[True]), statistics.median(times[False])
    return [
        ["arena on (bounded shapes)", f"{on:.2f}", f"{min(times[True]):.2f}", "1.00"],
        ["arena off", f"{off:.2f}", f"{min(times[False]):.2f}", f"{off / on:.2f}"],
    ]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--pairs", type=int, default=40)
    args = parser.parse_args()
    memory = attack(args.rounds, args.requests) + attack(args.rounds, args.requests, True)
    cost = arena(args.pairs)
    text = "\n\n".join(
        [
            "# Memory after an attack (`python -m bench.memory`)",
            f"{args.requests} concurrent binary requests of 61 MiB (as they are, then gzipped), "
            f"{args.rounds} rounds, identity model with a dynamic dim (max_batch_size 8), "
            "default budget (1 GiB here):",
            table(memory, ["when", "server RSS MiB", ""]),
            f"onnxruntime's CPU arena, one efficientnet_lite0 image in process ({args.pairs} "
            "alternated blocks of 10 runs):",
            table(cost, ["", "median ms", "min ms", "median / arena on"]),
        ]
    )
    publish("memory", text + "\n")


if __name__ == "__main__":
    main()
