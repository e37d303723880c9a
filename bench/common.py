"""Shared pieces of the benchmarks: servers on 127.0.0.1, wrk runs, result tables."""

from __future__ import annotations

import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
WRK_SCRIPT = """
wrk.method = "POST"
local f = io.open(os.getenv("TG_BENCH_BODY"), "rb")
wrk.body = f:read("*all")
f:close()
wrk.headers["Content-Type"] = os.getenv("TG_BENCH_CONTENT_TYPE")
local header = os.getenv("TG_BENCH_HEADER_LENGTH")
if header ~= nil and header ~= "" then
  wrk.headers["Inference-Header-Content-Length"] = header
end
"""


@dataclass
class WrkResult:
    requests_per_s: float
    p50_ms: float
    p90_ms: float
    p99_ms: float
    requests: int
    errors: int


def require_wrk() -> str:
    path = shutil.which("wrk")
    if path is None:
        raise SystemExit("wrk is not installed: `apt-get install wrk` (make bench does it)")
    return path


def wrk(
    url: str,
    body: bytes,
    content_type: str,
    *,
    connections: int,
    seconds: int,
    header_length: int | None = None,
    nice: int = 0,
) -> WrkResult:
    """POST ``body`` to ``url`` from ``connections`` keep-alive connections for ``seconds``;
    wrk at ``nice`` (below 0 only as root)."""
    with tempfile.TemporaryDirectory() as tmp:
        body_path = Path(tmp) / "body"
        body_path.write_bytes(body)
        script = Path(tmp) / "post.lua"
        script.write_text(WRK_SCRIPT)
        env = {
            "TG_BENCH_BODY": str(body_path),
            "TG_BENCH_CONTENT_TYPE": content_type,
            "TG_BENCH_HEADER_LENGTH": "" if header_length is None else str(header_length),
            "PATH": "/usr/bin:/bin",
        }
        command = [
            *(["nice", "-n", str(nice)] if nice else []),
            require_wrk(),
            "-t1",
            f"-c{connections}",
            f"-d{seconds}s",
            "--latency",
            "--timeout",
            "30s",
            "-s",
            str(script),
            url,
        ]
        out = subprocess.run(
            command, env=env, capture_output=True, text=True, timeout=seconds + 60, check=True
        ).stdout
    return parse_wrk(out)


def parse_wrk(out: str) -> WrkResult:
    def latency(pct: str) -> float:
        match = re.search(rf"^\s+{pct}%\s+([\d.]+)(us|ms|s)\s*$", out, re.MULTILINE)
        if match is None:
            return float("nan")
        value, unit = float(match.group(1)), match.group(2)
        return value / 1000 if unit == "us" else value * 1000 if unit == "s" else value

    rps = re.search(r"Requests/sec:\s+([\d.]+)", out)
    total = re.search(r"(\d+) requests in", out)
    non2xx = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
    socket = re.search(r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)", out)
    errors = int(non2xx.group(1)) if non2xx else 0
    if socket:
        errors += sum(int(g) for g in socket.groups())
    return WrkResult(
        float(rps.group(1)) if rps else 0.0,
        latency("50"),
        latency("90"),
        latency("99"),
        int(total.group(1)) if total else 0,
        errors,
    )


def table(rows: list[list[str]], header: list[str]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def publish(name: str, text: str) -> None:
    """Write a report to bench/results/<name>.md and print it."""
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{name}.md").write_text(text)
    print(text)


def serve_tree(
    tree: Path,
    repository: Path,
    settings: Mapping[str, str],
    log: Path | None = None,
    grpc_port: int | None = None,
) -> tuple[subprocess.Popen[bytes], int]:
    """A server of ``tree`` (this checkout, or a :func:`worktree`) on 127.0.0.1 serving
    ``repository`` with only ``settings`` of the TG_* variables (none of this shell's): its
    defaults for the rest, gRPC on ``grpc_port`` (a free one if None). Its output goes to
    ``log``, else nowhere. The process and its HTTP port."""
    from tests.server import free_port

    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("TG_")}
    env.update(
        TG_PORT=str(port),
        TG_HOST="127.0.0.1",
        TG_GRPC_PORT=str(grpc_port or free_port()),
        TG_MODEL_REPOSITORY=str(repository),
        **settings,
    )
    with log.open("wb") if log is not None else open(os.devnull, "wb") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "service", "serve"],
            cwd=tree,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    return process, port


@contextmanager
def running(servers: Mapping[str, tuple[subprocess.Popen[bytes], int]]) -> Iterator[dict[str, str]]:
    """Servers started with :func:`serve_tree` (name → process and HTTP port), once each is
    ready: name → base URL. Every one is stopped afterwards, whatever happened."""
    try:
        for _, port in servers.values():
            wait_until_up(f"http://127.0.0.1:{port}/v2/health/ready", timeout_s=300)
        yield {name: f"http://127.0.0.1:{port}" for name, (_, port) in servers.items()}
    finally:
        for process, _ in servers.values():
            process.terminate()
            process.wait(timeout=60)


def wait_until_up(url: str, method: str = "GET", timeout_s: float = 120) -> None:
    """Poll ``url`` until it answers 200 (connection errors: not yet); TimeoutError after."""
    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if httpx.request(method, url, content=b"").status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.05)  # poll interval
    raise TimeoutError(f"{url} did not answer 200 within {timeout_s:g} s")


def spread(values: list[float], fmt: str) -> str:
    """``median (min–max)`` of ``values``, each formatted with ``fmt``."""
    low, mid, high = (fmt.format(v) for v in (min(values), statistics.median(values), max(values)))
    return f"{mid} ({low}–{high})"


@contextmanager
def worktree(revision: str, folder: Path) -> Iterator[Path]:
    """``revision`` checked out at ``folder`` (a detached git worktree of this repository),
    removed afterwards: the old side of an old-vs-new benchmark."""
    root = Path(__file__).resolve().parent.parent
    subprocess.run(
        ["git", "worktree", "add", "--detach", str(folder), revision],
        cwd=root,
        check=True,
        capture_output=True,
    )
    try:
        yield folder
    finally:
        subprocess.run(
            ["git", "worktree", "remove", "--force", str(folder)],
            cwd=root,
            check=False,
            capture_output=True,
        )


Workload = tuple[str, bytes, str, int]
"""A wrk workload: path, body, content type, connections."""


def rotating(
    urls: dict[str, str],
    workloads: dict[str, Workload],
    pairs: int,
    seconds: int,
    cpu: tuple[Mapping[str, int], dict[tuple[str, str], list[float]]] | None = None,
) -> dict[tuple[str, str], list[WrkResult]]:
    """Every workload against every server (``urls``: name → base URL), ``pairs`` times, the
    order of the servers rotating each time, so that a drifting machine falls on all alike.
    Results by (workload, server), one per pair; any wrk error fails the run. With ``cpu``
    (each server's process id, and where to put them): the server's CPU µs a request in
    each run too (:func:`cpu_seconds`)."""
    names = list(urls)
    results: dict[tuple[str, str], list[WrkResult]] = {}
    for pair in range(pairs):
        order = names[pair % len(names) :] + names[: pair % len(names)]
        for workload, (path, body, content_type, connections) in workloads.items():
            for name in order:
                before = 0.0 if cpu is None else cpu_seconds(cpu[0][name])
                result = wrk(
                    urls[name] + path,
                    body,
                    content_type,
                    connections=connections,
                    seconds=seconds,
                )
                assert result.errors == 0, (name, workload, result)
                results.setdefault((workload, name), []).append(result)
                if cpu is not None:
                    used = cpu_seconds(cpu[0][name]) - before
                    cpu[1].setdefault((workload, name), []).append(1e6 * used / result.requests)
                settle(urls[name])
    return results


def cpu_seconds(pid: int, children: bool = True) -> float:
    """User and system CPU of ``pid`` and, unless told not to, its children (a server's
    supervisor and workers)."""
    kids = []
    if children:
        kids = subprocess.run(
            ["pgrep", "-P", str(pid)], capture_output=True, text=True, check=False
        ).stdout.split()
    total = 0
    for process in [str(pid), *kids]:
        with open(f"/proc/{process}/stat") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()
        total += int(fields[11]) + int(fields[12])  # utime, stime
    return total / os.sysconf("SC_CLK_TCK")


SETTLE_S = 0.25
"""After a server's in-flight count reads 0: what a thread may still run of a request wrk
left (a preprocessing, one batch: about 70 ms for W1's batch of 4 on one thread)."""


def settle(url: str, timeout_s: float = 30) -> None:
    """Wait until the server at ``url`` has done with the requests wrk left in flight when it
    stopped (their clients gone, each ends 499 after the work already under way).

    Without it, the next run, on another server sharing these CPUs, began beside that work:
    in bench.defaults' W1 c=16 the images left half-done took the CPUs of the next run's
    first 0.3 s, and that start was its p99 (two sittings of 8 pairs, the same two trees:
    p99/p50 median 1.54 without the wait, 1.30 with it)."""
    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        text = httpx.get(f"{url}/metrics", timeout=10).text
        match = re.search(r"^tensorgate_requests_in_flight (\S+)$", text, re.MULTILINE)
        if match is None or float(match.group(1)) == 0:
            break
        time.sleep(0.05)  # poll interval
    time.sleep(SETTLE_S)
