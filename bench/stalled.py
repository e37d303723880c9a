"""gRPC messages stalled short of their end (#28 finding 2), against this tree and an older
one, alternately. Loopback only, bounded.

    .venv/bin/python -m bench.stalled [--against REV] [--rounds 2] [--hold 10] [--streams]
                                      [--workers N]

Each tree serves digits and the identity model with its defaults (several workers on 2 or
more CPUs: gRPC through the supervisor's front; ``--workers 1``: one worker on its own port).
The attack: ``--calls`` connections, each one ModelInfer of 60 MiB (``--streams``: a
ModelStreamInfer stream of one such request) passed through a proxy on 127.0.0.1 that stops
1 KiB short of the message's end and holds the connection open. Measured: the workers' RSS together before, their
peak (the sum of each worker's VmHWM, reset before the attack), their RSS 2 s after the attack
went, and a normal gRPC client's latency throughout (a small digits call every 50 ms on a
connection of its own, in a process of its own). Writes bench/results/stalled.md.
"""

from __future__ import annotations

import argparse
import multiprocessing
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import grpc

from bench.attacks import MIB, status
from bench.common import publish, serve_tree, table, wait_until_up, worktree
from service.protocol.pb import grpc_service_pb2 as pb
from service.protocol.pb import grpc_service_pb2_grpc as pb_grpc
from service.settings import Settings
from tests.chaos.netfault import Faults, FaultyProxy
from tests.identity import identity_message, write_identity_model
from tests.server import REPO_ROOT, copy_model, free_port

DIGIT = pb.ModelInferRequest(
    model_name="digits",
    inputs=[{"name": "image", "datatype": "FP32", "shape": [1, 1, 8, 8]}],
    raw_input_contents=[bytes(256)],
)


def _probe(target: str, stop: Any, ready: Any, out: Any) -> None:
    latencies: list[float] = []
    failed = 0
    with grpc.insecure_channel(target, options=[("grpc.use_local_subchannel_pool", 1)]) as chan:
        stub = pb_grpc.GRPCInferenceServiceStub(chan)
        while not stop.wait(0.05):
            started = time.perf_counter()
            try:
                stub.ModelInfer(DIGIT, timeout=30)
            except grpc.RpcError:
                failed += 1
            latencies.append(time.perf_counter() - started)
            ready.set()
    out.put((latencies, failed))


def workers(pid: int) -> list[int]:
    children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    return [int(child) for child in children] or [pid]


def attack(
    server: int, grpc_port: int, calls: int, hold: float, streams: bool, budget: int
) -> list[str]:
    pids = workers(server)
    before = sum(status(pid, "VmRSS") for pid in pids)
    for pid in pids:
        Path(f"/proc/{pid}/clear_refs").write_text("5")  # VmHWM := VmRSS
    context = multiprocessing.get_context("spawn")
    stop, ready, out = context.Event(), context.Event(), context.Queue()
    probe = context.Process(target=_probe, args=(f"127.0.0.1:{grpc_port}", stop, ready, out))
    probe.start()
    ready.wait(60)
    request = identity_message(60 * MIB // 4)
    size = request.ByteSize()
    proxy = FaultyProxy(grpc_port, lambda _: Faults(stall_up_after=size - 1024))
    channels, futures = [], []
    try:
        for _ in range(calls):
            chan = grpc.insecure_channel(
                f"127.0.0.1:{proxy.port}",
                options=[
                    ("grpc.max_send_message_length", -1),
                    ("grpc.use_local_subchannel_pool", 1),
                ],
            )
            channels.append(chan)
            stub = pb_grpc.GRPCInferenceServiceStub(chan)
            if streams:
                futures.append(stub.ModelStreamInfer(iter([request])))
            else:
                futures.append(stub.ModelInfer.future(request))
        time.sleep(hold)
        passed = proxy.passed_up
        ended = sum(future.done() for future in futures)
    finally:
        proxy.close()
        for chan in channels:
            chan.close()
    time.sleep(2)
    stop.set()
    latencies, failed = out.get(timeout=60)
    probe.join(30)
    peak = sum(status(pid, "VmHWM") for pid in pids)
    after = sum(status(pid, "VmRSS") for pid in pids)
    latencies.sort()
    return [
        f"{passed / MIB:.0f} of {calls * size / MIB:.0f}",
        f"{ended} of {calls}",
        f"{before / MIB:.0f}",
        f"{peak / MIB:.0f}",
        f"{(peak - before) / budget:.2f}",
        f"{after / MIB:.0f} ({after / before:.2f} ×)",
        f"{statistics.median(latencies) * 1000:.0f} / {latencies[-1] * 1000:.0f}",
        f"{failed} of {len(latencies)}",
    ]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--against", default="a252712", help="the older tree's revision")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--calls", type=int, default=32)
    parser.add_argument("--hold", type=float, default=10.0)
    parser.add_argument("--streams", action="store_true", help="ModelStreamInfer, not ModelInfer")
    parser.add_argument("--workers", type=int, help="TG_WORKERS (default: the server's own)")
    args = parser.parse_args()
    settings = {} if args.workers is None else {"TG_WORKERS": str(args.workers)}
    budget = Settings(workers=args.workers or 0).max_inflight_bytes  # a worker's, as it sizes it
    rows = []
    with (
        tempfile.TemporaryDirectory() as folder,
        worktree(args.against, Path(folder) / "old") as old,
    ):
        root = Path(folder) / "models"
        copy_model("digits", root / "digits")
        write_identity_model(root / "identity", max_batch_size=8, datatypes=("FP32",), width="w")
        for turn in range(args.rounds):
            for name, tree in (("this tree", REPO_ROOT), (args.against, old))[
                :: 1 - 2 * (turn % 2)
            ]:
                grpc_port = free_port()
                log = Path(folder) / "server.log"
                process, port = serve_tree(tree, root, settings, log, grpc_port)
                try:
                    wait_until_up(f"http://127.0.0.1:{port}/v2/health/ready", timeout_s=300)
                    outcome = attack(
                        process.pid, grpc_port, args.calls, args.hold, args.streams, budget
                    )
                    rows.append([name, *outcome])
                    print(" | ".join(rows[-1]), flush=True)
                finally:
                    process.terminate()
                    process.wait(60)
    publish(
        "stalled",
        "# gRPC messages stalled 1 KiB short of 60 MiB (`python -m bench.stalled`)\n\n"
        f"{args.calls} connections, one {'stream' if args.streams else 'call'} each, held "
        f"{args.hold:g} s; default settings{', ' + str(settings) if settings else ''}.\n\n"
        + table(
            rows,
            [
                "tree",
                "MiB passed to the server",
                "calls ended while held",
                "workers' RSS before MiB",
                "peak MiB",
                "(peak − before) / a worker's budget",
                "RSS after MiB",
                "normal gRPC client median / max ms",
                "normal client failed",
            ],
        )
        + "\n",
    )


if __name__ == "__main__":
    main()
