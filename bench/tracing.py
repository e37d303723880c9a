"""What tracing costs: the same code served with tracing off and on, alternately, in one sitting.

    .venv/bin/python -m bench.tracing [--pairs 5] [--seconds 4]

Three servers of the working tree serve one repository (efficientnet_lite0 and the W2 MLP, as
bench.paired): one as shipped (tracing off), one with ``OTEL_TRACES_EXPORTER=otlp`` exporting
every span (the SDK's default sampler: all) over OTLP/HTTP to a collector on 127.0.0.1, and one
sampling 1 % of the traces that start here (``OTEL_TRACES_SAMPLER=parentbased_traceidratio``,
``OTEL_TRACES_SAMPLER_ARG=0.01``: a client's sampled ``traceparent`` is still followed). The
collector is a sink in this process that reads each export and answers 200, so the server pays
for all of its side (span objects, the batch processor, protobuf encoding, HTTP) and the
collector's own work is small. On a 2-CPU machine the collector shares the CPUs with the
server and wrk, as a sidecar would. Writes bench/results/tracing.md.
"""

from __future__ import annotations

import argparse
import http.server
import tempfile
import threading
from pathlib import Path
from typing import ClassVar

from bench.batching import W1_PATH, W2_PATH, jpeg_640x480, mlp_body, served_repository
from bench.common import publish, rotating, spread, table, wait_until_up
from bench.paired import serve
from tests.server import REPO_ROOT


class _Sink(http.server.BaseHTTPRequestHandler):
    """Reads an OTLP export and answers 200 (counts the bytes)."""

    received: ClassVar[list[int]] = [0, 0]  # exports, bytes
    protocol_version = "HTTP/1.1"

    def do_POST(self) -> None:
        size = int(self.headers.get("content-length", "0"))
        self.rfile.read(size)
        _Sink.received[0] += 1
        _Sink.received[1] += size
        self.send_response(200)
        self.send_header("content-type", "application/x-protobuf")
        self.send_header("content-length", "0")
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pairs", type=int, default=5)
    parser.add_argument("--seconds", type=int, default=4)
    args = parser.parse_args()
    sink = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Sink)
    threading.Thread(target=sink.serve_forever, daemon=True).start()
    traced = {
        "OTEL_TRACES_EXPORTER": "otlp",
        "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{sink.server_address[1]}",
    }
    workloads = {
        "W1 c=16": (W1_PATH, jpeg_640x480(), "image/jpeg", 16),
        "W2 c=64": (W2_PATH, mlp_body(), "application/json", 64),
        "W2 c=1": (W2_PATH, mlp_body(), "application/json", 1),
    }
    sampled = {
        **traced,
        "OTEL_TRACES_SAMPLER": "parentbased_traceidratio",
        "OTEL_TRACES_SAMPLER_ARG": "0.01",
    }
    with tempfile.TemporaryDirectory() as tmp:
        repository = served_repository(Path(tmp))
        servers = {
            "off": serve(REPO_ROOT, repository),
            "on": serve(REPO_ROOT, repository, traced),
            "1 %": serve(REPO_ROOT, repository, sampled),
        }
        try:
            for _, url in servers.values():
                wait_until_up(f"{url}/v2/health/ready", timeout_s=300)
            urls = {side: url for side, (_, url) in servers.items()}
            measured = rotating(urls, workloads, args.pairs, args.seconds)
        finally:
            for process, _ in servers.values():
                process.terminate()
                process.wait(timeout=60)
            sink.shutdown()
    results = {key: [(r.requests_per_s, r.p50_ms) for r in runs] for key, runs in measured.items()}
    rows = []
    for name in workloads:
        off, on, some = (results[(name, side)] for side in ("off", "on", "1 %"))
        rows.append(
            [
                name,
                spread([r for r, _ in off], "{:.0f}"),
                spread([p for _, p in off], "{:.2f}"),
                spread([p for _, p in on], "{:.2f}"),
                spread(sorted(n[0] / o[0] for o, n in zip(off, on, strict=True)), "{:.3f}"),
                spread(sorted(n[0] / o[0] for o, n in zip(off, some, strict=True)), "{:.3f}"),
            ]
        )
    header = [
        "workload",
        "off req/s",
        "off p50 ms",
        "all p50 ms",
        "all/off req/s",
        "1 %/off req/s",
    ]
    exports, size = _Sink.received
    publish(
        "tracing",
        f"# tracing off, all traced, 1 % sampled (OTLP/HTTP to a sink on 127.0.0.1), "
        f"{args.pairs} alternating "
        f"pairs of {args.seconds} s\n\nmedian (min–max)\n\n{table(rows, header)}\n\n"
        f"The sink received {exports} exports, {size / 1e6:.1f} MB.\n",
    )


if __name__ == "__main__":
    main()
