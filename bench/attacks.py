"""Peak memory under each attack of #28, a normal client beside it. Loopback only, bounded.

    .venv/bin/python -m bench.attacks [--hold 10] [--only PNG] [--workers 1] [--repeat 1]
                                      [--client-nice 0]

One server as the README starts it (default settings but ``TG_WORKERS``: one worker by default,
so that one process holds everything; with ``--workers 2``, the default on 2 CPUs, a supervisor
and its workers, gRPC through the supervisor's front), serving digits, efficientnet_lite0 and an
identity model with a dynamic dim. For each attack in turn: the server's RSS before (every
process of it), its peak during (each process's VmHWM, reset before each attack through
/proc/PID/clear_refs, added up), its RSS two seconds after, and a normal client's latency
throughout (a digits request over REST every 50 ms: median, max, and how many failed), and
what became of 8 idle gRPC streams opened before it (each asked a request after: an idle
stream's read looks like a stalled one to the heap rule of ``service.grpc.arriving``). Each
attack is held ``--hold`` seconds where it holds anything; ``--repeat`` runs each attack that many
times in a row on the same server, a row each (the normal client's worst varies from run to run
more than between revisions: one run tells little). ``--client-nice N`` runs the threads of
the attacks that make concurrent calls (the uploads, the PNGs, the gRPC messages and streams)
at that nice value (the normal client and the server stay at 0): on a machine where
the attacking client shares the server's few CPUs, it tells the server's own delays from the
CPU time the client's threads take beside it (an attacker elsewhere takes none of it).
Writes bench/results/attacks.md.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import gzip
import io
import json
import multiprocessing
import os
import socket
import statistics
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import httpx

from bench.common import publish, table
from service.protocol.pb import grpc_service_pb2 as pb
from service.protocol.pb import grpc_service_pb2_grpc as pb_grpc
from service.settings import Settings
from tests.bystanders import IdleStreams
from tests.identity import binary_request, identity_message, write_identity_model
from tests.server import Server, copy_model

MIB = 1 << 20
CLIENT_NICE = [0]
"""The attack threads' nice value (``--client-nice``)."""


DIGIT = json.dumps(
    {"inputs": [{"name": "image", "datatype": "FP32", "shape": [1, 1, 8, 8], "data": [0.5] * 64}]}
).encode()


def status(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field}")


def children(pid: int) -> list[int]:
    """The processes ``pid`` started (a supervisor's workers)."""
    return [int(child) for child in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


def _probe(url: str, stop: Any, ready: Any, out: Any) -> None:
    """The normal client's loop, in a process of its own (the attack's clients would otherwise
    hold its GIL and add their own delays to what it measures)."""
    latencies: list[float] = []
    failed = 0
    with httpx.Client(base_url=url, timeout=30) as client:
        while not stop.wait(0.05):
            started = time.perf_counter()
            try:
                answer = client.post(
                    "/v2/models/digits/infer",
                    content=DIGIT,
                    headers={"Content-Type": "application/json"},
                )
                ok = answer.status_code == 200
            except httpx.HTTPError:
                ok = False
            latencies.append(time.perf_counter() - started)
            failed += not ok
            ready.set()  # its first request made
    out.put((latencies, failed))


class Probe:
    """A normal client: one digits request over REST every 50 ms, its latencies kept."""

    def __init__(self, url: str) -> None:
        context = multiprocessing.get_context("spawn")
        self._stop, self._ready = context.Event(), context.Event()
        self._out: Any = context.Queue()
        args = (url, self._stop, self._ready, self._out)
        self._process = context.Process(target=_probe, args=args)
        self.latencies: list[float] = []
        self.failed = 0

    def __enter__(self) -> Probe:
        self._process.start()
        if not self._ready.wait(60):
            raise RuntimeError("the normal client made no request within 60 s")
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self.latencies, self.failed = self._out.get(timeout=60)
        self._process.join(30)


def concurrently(count: int, work: Callable[[int], object]) -> list[object]:
    results: list[object] = [None] * count

    def run(index: int) -> None:
        if CLIENT_NICE[0]:  # this thread only (Linux: a thread's nice value is its own)
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), CLIENT_NICE[0])
        try:
            results[index] = work(index)
        except Exception as exc:  # an attack's call that fails is part of what it measures
            results[index] = exc

    threads = [threading.Thread(target=run, args=(i,)) for i in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return results


def outcome(results: list[object]) -> str:
    counts: dict[str, int] = {}
    for result in results:
        if isinstance(result, grpc.Call):  # grpc's errors are calls too
            key = result.code().name
        elif isinstance(result, Exception):
            key = type(result).__name__
        else:
            key = str(result)
        counts[key] = counts.get(key, 0) + 1
    return ", ".join(f"{v} × {k}" for k, v in sorted(counts.items()))


def uploads(server: Server, hold: float, compress: bool = False) -> str:
    """16 concurrent binary requests of 61 MiB to the dynamic-dim identity (#28 14, 15)."""
    body, header = binary_request(61 * MIB // 4)
    headers = {"Inference-Header-Content-Length": str(header)}
    if compress:
        body = gzip.compress(body, compresslevel=6)
        headers["Content-Encoding"] = "gzip"
    url = f"{server.url}/v2/models/identity/infer"
    results = concurrently(
        16, lambda _: httpx.post(url, content=body, headers=headers, timeout=300).status_code
    )
    return outcome(results)


def heads(server: Server, hold: float) -> str:
    """16 heads declaring 61 MiB bodies, no body byte sent, held (#28 4)."""
    socks = []
    for _ in range(16):
        sock = socket.create_connection(("127.0.0.1", server.port))
        sock.sendall(
            b"POST /v2/models/identity/infer HTTP/1.1\r\nHost: x\r\n"
            b"Content-Type: application/octet-stream\r\nContent-Length: %d\r\n\r\n" % (61 * MIB)
        )
        socks.append(sock)
    time.sleep(hold)
    for sock in socks:
        sock.close()
    return "16 heads held"


def unread(server: Server, hold: float) -> str:
    """200 requests for 1 MiB answers that are never read (#28 5)."""
    body, header = binary_request(MIB // 4)
    head = (
        b"POST /v2/models/identity/infer HTTP/1.1\r\nHost: x\r\n"
        b"Content-Type: application/octet-stream\r\nInference-Header-Content-Length: %d\r\n"
        b"Content-Length: %d\r\n\r\n" % (header, len(body))
    )
    socks = []
    for _ in range(200):
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.settimeout(30)
        sock.connect(("127.0.0.1", server.port))
        with contextlib.suppress(OSError):  # the server may refuse it before it is all sent
            sock.sendall(head + body)
        socks.append(sock)
    time.sleep(hold)
    for sock in socks:
        sock.close()
    return "200 answers left unread"


def pngs(server: Server, hold: float) -> str:
    """4 concurrent v1 predicts of 1,024 one-pixel PNGs (108 KB each) (#28 6)."""
    buffer = io.BytesIO()
    from PIL import Image

    Image.new("RGB", (1, 1), (200, 10, 10)).save(buffer, format="PNG")
    item = {"b64": base64.b64encode(buffer.getvalue()).decode()}
    body = json.dumps({"instances": [item] * 1024}).encode()
    url = f"{server.url}/v1/models/efficientnet_lite0:predict"
    return outcome(
        concurrently(4, lambda _: httpx.post(url, content=body, timeout=300).status_code)
    )


def channel(server: Server) -> grpc.Channel:
    return grpc.insecure_channel(
        server.grpc_url,
        options=[
            ("grpc.max_send_message_length", -1),
            ("grpc.max_receive_message_length", -1),
            ("grpc.use_local_subchannel_pool", 1),
        ],
    )


def grpc_refused(server: Server, hold: float) -> str:
    """30 calls of 60 MiB to a model that does not exist, one after another (#28 1)."""
    request = identity_message(60 * MIB // 4, "nosuch")
    results: list[object] = []
    with channel(server) as chan:
        stub = pb_grpc.GRPCInferenceServiceStub(chan)
        for _ in range(30):
            try:
                stub.ModelInfer(request, timeout=60)
                results.append("OK")
            except grpc.RpcError as exc:
                results.append(exc)
    return outcome(results)


def grpc_messages(server: Server, hold: float) -> str:
    """2 connections × 16 concurrent calls of 60 MiB, complete messages (#28 2)."""
    request = identity_message(60 * MIB // 4)
    channels = [channel(server), channel(server)]
    stubs = [pb_grpc.GRPCInferenceServiceStub(c) for c in channels]

    def call(index: int) -> str:
        stubs[index % 2].ModelInfer(request, timeout=120)
        return "OK"

    try:
        return outcome(concurrently(32, call))
    finally:
        for chan in channels:
            chan.close()


def grpc_streams(server: Server, hold: float) -> str:
    """2 connections × a stream of 16 requests of 60 MiB, every answer read."""
    request = identity_message(60 * MIB // 4)
    channels = [channel(server), channel(server)]

    def stream(index: int) -> str:
        stub = pb_grpc.GRPCInferenceServiceStub(channels[index])
        answers = stub.ModelStreamInfer(iter([request] * 16), timeout=240)
        failed = [a.error_message for a in answers if a.error_message]
        return f"{len(failed)} failed: {failed[0]}" if failed else "OK"

    try:
        return outcome(concurrently(2, stream))
    finally:
        for chan in channels:
            chan.close()


def grpc_stream_unread(server: Server, hold: float) -> str:
    """A ModelStreamInfer stream sending 64 KiB requests whose answers it never reads (#28 8)."""
    stop = threading.Event()
    sent = [0]

    def requests() -> Iterator[pb.ModelInferRequest]:
        message = identity_message(16 * 1024)
        while not stop.is_set():
            sent[0] += 1
            yield message

    with channel(server) as chan:
        stream = pb_grpc.GRPCInferenceServiceStub(chan).ModelStreamInfer(requests())
        time.sleep(hold)  # nothing read
        stop.set()
        stream.cancel()
    return f"{sent[0]} requests taken from the client"


def idle(server: Server, hold: float) -> str:
    """4,000 idle connections from one client (#28 16)."""
    socks = []
    for _ in range(4000):
        try:
            socks.append(socket.create_connection(("127.0.0.1", server.port), timeout=5))
        except OSError:
            break
    opened = len(socks)
    time.sleep(hold)
    for sock in socks:
        sock.close()
    return f"{opened} connections opened"


ATTACKS: list[tuple[str, str, Callable[[Server, float], str]]] = [
    ("REST", "16 × 61 MiB binary uploads, dynamic-dim model (14, 15)", uploads),
    ("REST", "16 × 61 MiB gzipped (60 KB each on the wire) (14)", lambda s, h: uploads(s, h, True)),
    ("REST", "16 heads declaring 61 MiB, no body (4)", heads),
    ("REST", "200 answers of 1 MiB never read (5)", unread),
    ("REST", "4 × 1,024 one-pixel PNGs, v1 predict (6)", pngs),
    ("REST", "4,000 idle connections from one client (16)", idle),
    ("gRPC", "30 refused calls of 60 MiB in turn (1)", grpc_refused),
    ("gRPC", "2 connections × 16 calls of 60 MiB (2)", grpc_messages),
    ("gRPC", "2 connections × a stream of 16 requests of 60 MiB (2, 8)", grpc_streams),
    ("gRPC", "a stream whose answers are never read (8)", grpc_stream_unread),
]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--hold", type=float, default=10.0)
    parser.add_argument(
        "--only", default="", help="run only the attacks whose name contains this (e.g. PNG)"
    )
    parser.add_argument("--workers", type=int, default=1, help="TG_WORKERS (2 or more: the front)")
    parser.add_argument("--repeat", type=int, default=1, help="runs of each attack, a row each")
    parser.add_argument(
        "--client-nice", type=int, default=0, help="the attack threads' nice value (0 to 19)"
    )
    args = parser.parse_args()
    CLIENT_NICE[0] = args.client_nice
    env = {"TG_WORKERS": str(args.workers)}
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        root = Path(folder) / "models"
        copy_model("digits", root / "digits")
        copy_model("efficientnet_lite0", root / "efficientnet_lite0")
        write_identity_model(root / "identity", max_batch_size=8, datatypes=("FP32",), width="w")
        server = Server(root, env=env, log_path=Path(folder) / "server.log")
        try:
            server.wait_until(timeout=300)
            pid = server.process.pid
            for _ in range(20):  # the first requests' own high water
                server.client.post("/v2/models/digits/infer", content=DIGIT)
            # as the server resolves it here: each worker's, for all of them
            budget = Settings(workers=args.workers).max_inflight_bytes * args.workers
            selected = [entry for entry in ATTACKS if args.only in entry[1]]
            for protocol, name, attack in [e for e in selected for _ in range(args.repeat)]:
                pids = [pid, *children(pid)]  # now: a worker may have been replaced
                before = sum(status(p, "VmRSS") for p in pids)
                for p in pids:
                    Path(f"/proc/{p}/clear_refs").write_text("5")  # VmHWM := VmRSS
                bystander = IdleStreams(server.grpc_url, 8)
                if (first := bystander.ask()) != ["answered"] * 8:
                    raise RuntimeError(f"the idle streams' first requests: {first}")
                with Probe(server.url) as probe:
                    what = attack(server, args.hold)
                time.sleep(2)
                stream = outcome(
                    ["open" if said == "answered" else said for said in bystander.ask()]
                )
                bystander.close()
                after = sum(status(p, "VmRSS") for p in pids)
                peak = sum(status(p, "VmHWM") for p in pids)
                lat = sorted(probe.latencies)
                rows.append(
                    [
                        protocol,
                        name,
                        what,
                        f"{before / MIB:.0f}",
                        f"{peak / MIB:.0f}",
                        f"{(peak - before) / budget:.2f}",
                        f"{after / MIB:.0f} ({after / before:.2f} ×)",
                        f"{statistics.median(lat) * 1000:.0f} / {lat[-1] * 1000:.0f}"
                        if lat
                        else "-",
                        f"{probe.failed} of {len(lat)}",
                        stream,
                    ]
                )
                print(" | ".join(rows[-1]), flush=True)
        finally:
            server.stop()
    text = "\n\n".join(
        [
            "# Peak memory under each attack (`python -m bench.attacks`)",
            (
                "One worker (`TG_WORKERS=1`)"
                if args.workers == 1
                else f"{args.workers} workers behind the supervisor and its gRPC front"
            )
            + f": body budget {budget / MIB:.0f} MiB"
            + (f"; the attack's threads at nice {args.client_nice}" if args.client_nice else "")
            + ". Peak: VmHWM of each process, added up, "
            f"reset before each attack; held {args.hold:g} s where the attack holds anything; "
            "after: 2 s after it ended. Normal client: a digits request over REST every 50 ms "
            "throughout. Idle gRPC streams: 8 on one connection, opened before the attack, a "
            "request answered on each, asked another 2 s after (open: answered). Numbers in "
            "parentheses: the finding of #28.",
            table(
                rows,
                [
                    "protocol",
                    "attack",
                    "what the attack got",
                    "RSS before MiB",
                    "peak MiB",
                    "(peak − before) / budget",
                    "RSS after MiB",
                    "normal client median / max ms",
                    "normal client failed",
                    "8 idle gRPC streams opened before",
                ],
            ),
        ]
    )
    publish("attacks", text + "\n")


if __name__ == "__main__":
    main()
