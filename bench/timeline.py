"""Where a lone W1 image's served time goes, stage by stage (#27).

    .venv/bin/python -m bench.timeline [--images 300] [--access-log] [--old REV]

A one-worker server (``TG_WORKERS=1``: the stages are marked in the process that serves)
is started through this module's ``serve`` command, which wraps the functions a request goes
through (the HTTP protocol's read, the inference route, the core's call, the scheduler, the
image pipeline, the runtime, the answer's writes) so that each records a timestamp as it is
entered and left, with ``time.perf_counter_ns`` (CLOCK_MONOTONIC, the client's clock too).
The client sends ``--images`` lone 640×480 JPEGs, one at a time on one keep-alive connection,
2 ms apart (``--alternate``: with the same image run in the client's process between them, as
``bench.lone`` does), and marks when it sent each and when it had read each answer. Each request's
marks, in order, give the median time from one mark to the next: what the event loop does
before it hands the image to the instance's thread, the thread's decode, resize, normalise and
model, the way back, and what the client waits for after the answer is written. The wraps
cost a microsecond or two each: the stages are what to compare, the sum is not the served time
of ``bench.lone``. ``--old REV`` runs the same against tensorgate as of a git revision too
(a worktree), alternately. Writes bench/results/timeline.md.
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

MARKS: list[tuple[str, int]] = []


def _mark(label: str) -> None:
    MARKS.append((label, time.perf_counter_ns()))


def _wrap(owner: Any, name: str, entered: str, left: str | None) -> None:
    """``owner.name`` marking ``entered`` as it is called and ``left`` as it returns (a
    coroutine function: as its coroutine does)."""
    original = getattr(owner, name, None)
    if original is None:  # an older tree without it: that stage is not marked
        return

    def marked(*args: Any, **kwargs: Any) -> Any:
        _mark(entered)
        try:
            return original(*args, **kwargs)
        finally:
            if left is not None:
                _mark(left)

    async def marked_async(*args: Any, **kwargs: Any) -> Any:
        _mark(entered)
        try:
            return await original(*args, **kwargs)
        finally:
            if left is not None:
                _mark(left)

    setattr(owner, name, marked_async if inspect.iscoroutinefunction(original) else marked)


def serve(out: Path) -> int:
    """The server, its stages marked; SIGUSR1 writes the marks so far to ``out``."""
    import preprocessing.image as image
    import service.batching.scheduler as scheduler
    import service.core.dataplane as dataplane
    import service.http.answer as answer
    import service.http.fast as fast
    import service.http.writes as writes
    import service.limits.connections as connections
    import service.protocol.v1 as v1
    import service.runtimes.onnx as onnx
    import service.telemetry.observation as observation
    from service.cli import main

    stages: list[tuple[Any, str, str, str | None]] = [  # in a request's order
        (connections.GuardedHttpProtocol, "data_received", "read", "read end"),
        (fast.InferFastPath, "__call__", "route", "route end"),
        (answer, "receive_body", "body", None),
        (answer, "until_disconnect", "watched", None),
        (dataplane.Call, "__enter__", "call", "call entered"),
        (v1, "decode_predict", "decode request", "decoded request"),
        (dataplane.Call, "infer", "infer", "inferred"),
        (scheduler.Scheduler, "submit", "submit", "submitted"),
        (scheduler, "plan", "plan", None),
        (scheduler, "collate", "instance", "prepared"),
        (image.ImagePipeline, "decode", "jpeg", "jpeg end"),
        (image, "resize_in_halves", "resize in halves", "resized"),
        (image.ImagePipeline, "_tensor", "tensor", "tensor end"),
        (onnx.OnnxRuntime, "run", "model", "model end"),
        (scheduler, "split", "outputs split", None),
        (v1, "encode_predictions", "encode", "encoded"),
        (dataplane.Call, "__exit__", "call exit", "call exited"),
        (observation.Observer, "finish", "finish", "finished"),
        (writes.OneWrite, "write", "write", "written"),
    ]
    for owner, name, entered, left in stages:
        _wrap(owner, name, entered, left)

    def dump(*_: Any) -> None:
        written = out.with_suffix(".partial")
        written.write_text(json.dumps(list(MARKS)))
        written.replace(out)  # whole or absent to the reader

    signal.signal(signal.SIGUSR1, dump)
    return main(["serve"])


def _requests(
    tree: Path, repository: Path, images: int, access_log: bool, alternate: bool
) -> list[list[tuple[str, int]]]:
    """Each lone request's marks, the client's send first and its read last."""
    from bench.batching import W1_PATH, in_process, jpeg_640x480, read_response, top5
    from bench.common import running
    from service.resources import available_cpus
    from tests.server import free_port

    image = jpeg_640x480()
    between = _pause
    if alternate:  # the same image in this process between requests, as bench.lone's turns
        pipeline, runtime = in_process(available_cpus())
        classifier = top5()

        def between() -> None:
            classifier({"logits": runtime.run({"input": pipeline(image)[None]})["logits"][0]})

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "marks.json"
        port = free_port()
        env = {k: v for k, v in os.environ.items() if not k.startswith("TG_")}
        env.update(
            TG_PORT=str(port),
            TG_HOST="127.0.0.1",
            TG_GRPC_PORT=str(free_port()),
            TG_MODEL_REPOSITORY=str(repository),
            TG_WORKERS="1",
            TG_ACCESS_LOG=str(access_log).lower(),
            TG_LOG_LEVEL="info" if access_log else "warning",
            PYTHONPATH=str(tree),
        )
        here = Path(__file__).resolve()
        process = subprocess.Popen(
            [sys.executable, str(here), "serve", str(out)],
            cwd=tree,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        request = (
            f"POST {W1_PATH} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: image/jpeg\r\n"
            f"Content-Length: {len(image)}\r\n\r\n"
        ).encode() + image
        sent: list[tuple[int, int]] = []
        with running({"server": (process, port)}):
            with socket.create_connection(("127.0.0.1", port)) as sock:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                for _ in range(20):  # warm: the first answers are not what is measured
                    sock.sendall(request)
                    read_response(sock)
                # a warm request's marks after its answer may land after this: they come
                # before any read, and no request takes them
                skip = _marks(process, out)
                for _ in range(images):
                    between()
                    started = time.perf_counter_ns()
                    sock.sendall(request)
                    read_response(sock)
                    sent.append((started, time.perf_counter_ns()))
            # the last request's marks after its answer may be missing: its sequence is then
            # not the usual one, and _stages leaves it out
            marks = _marks(process, out)[len(skip) :]
    requests: list[list[tuple[str, int]]] = []
    answered = True
    for label, at in marks:  # a request's marks begin with its first read after an answer
        if label == "read" and answered:
            requests.append([])
            answered = False
        answered = answered or label == "route end"
        if requests:
            requests[-1].append((label, at))
    return [
        [("client sent", start), *marks, ("client read", end)]
        for (start, end), marks in zip(sent, requests, strict=False)
    ]


def _pause() -> None:
    time.sleep(0.002)  # the pace: each image alone, the server idle before it


def _marks(process: subprocess.Popen[bytes], out: Path) -> list[tuple[str, int]]:
    """The server's marks so far (it writes them on SIGUSR1)."""
    out.unlink(missing_ok=True)
    process.send_signal(signal.SIGUSR1)
    for _ in range(500):
        with contextlib.suppress(FileNotFoundError):
            return [(label, at) for label, at in json.loads(out.read_text())]
        time.sleep(0.01)  # polled: the server writes the file when its signal handler runs
    raise TimeoutError("the server never wrote its marks")


def _stages(requests: list[list[tuple[str, int]]]) -> list[tuple[str, float]]:
    """Median µs between consecutive marks, for the sequence most requests took."""
    sequences: dict[tuple[str, ...], list[list[tuple[str, int]]]] = {}
    for marks in requests:
        sequences.setdefault(tuple(label for label, _ in marks), []).append(marks)
    usual = max(sequences.values(), key=len)
    return [
        (
            f"{usual[0][i - 1][0]} → {usual[0][i][0]}",
            statistics.median((m[i][1] - m[i - 1][1]) / 1e3 for m in usual),
        )
        for i in range(1, len(usual[0]))
    ]


def main() -> None:
    from bench.batching import served_repository
    from bench.common import publish, table, worktree
    from tests.server import REPO_ROOT

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--images", type=int, default=300)
    parser.add_argument("--access-log", action="store_true", help="the access log on")
    parser.add_argument("--old", help="a git revision: its stages too, alternately")
    parser.add_argument("--rounds", type=int, default=1, help="runs of each tree")
    parser.add_argument(
        "--alternate",
        action="store_true",
        help="the image in this process between requests (bench.lone's turns), not a 2 ms pause",
    )
    args = parser.parse_args()
    results: dict[str, list[list[tuple[str, int]]]] = {}
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
        trees = {"new": REPO_ROOT}
        if args.old:
            trees = {args.old: stack.enter_context(worktree(args.old, Path(tmp) / "old")), **trees}
        repository = served_repository(Path(tmp))
        for _ in range(args.rounds):
            for name, tree in trees.items():
                results.setdefault(name, []).extend(
                    _requests(tree, repository, args.images, args.access_log, args.alternate)
                )
    sections = []
    for name, requests in results.items():
        stages = _stages(requests)
        served = statistics.median((r[-1][1] - r[0][1]) / 1e3 for r in requests)
        rows = [[stage, f"{us:.1f}"] for stage, us in stages]
        sections.append(
            f"## {name}: {len(requests)} lone images, served in {served:.0f} µs (median)\n\n"
            + table(rows, ["from → to", "median µs"])
        )
    publish(
        "timeline",
        "# A lone W1 image's stages, one worker"
        + (", access log on" if args.access_log else "")
        + (", the image in process between requests" if args.alternate else "")
        + "\n\n"
        + "\n\n".join(sections)
        + "\n",
    )


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "serve":
        sys.path[0] = os.getcwd()  # the tree served, not bench/ (whose grpc.py is not grpc)
        sys.exit(serve(Path(sys.argv[2])))
    main()
