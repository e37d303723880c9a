"""The face pipeline (MTCNN as a model's own code over three served models) under load, and
the same pipeline run eagerly in one process as the ceiling.

    .venv/bin/python -m bench.faces [--seconds 10]

Serves faces, faces_pnet, faces_rnet and faces_onet from the bundled repository and sends
the astronaut (512 × 512 JPEG, one face) to ``/v1/models/faces:predict`` from 1 and from 8
connections (wrk, loopback only): requests/s, p50 and p99, and each step model's mean batch
(its calls over its executions in that run: how many requests' steps shared a batch; and
its rows over its executions). The ceiling is the same pipeline over the
eager networks, one image after another in this process (``answer_one``). Writes
bench/results/faces.md.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

import httpx

from bench.common import publish, table, wait_until_up, wrk
from bench.paired import serve
from tests.integration.test_faces import build, eager_faces
from tests.server import MODELS, REPO_ROOT

STEPS = ("faces_pnet", "faces_rnet", "faces_onet")


def counts(url: str) -> dict[str, tuple[int, int, int]]:
    """Each step model's calls (requests), rows and executions (batches) so far."""
    found = {}
    for name in STEPS:
        stats: Any = httpx.get(f"{url}/v2/models/{name}/stats").json()["model_stats"][0]
        calls = stats["inference_stats"]["success"]["count"]
        found[name] = (calls, stats["inference_count"], stats["execution_count"])
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=int, default=10)
    args = parser.parse_args()
    image = build().photo("astronaut")
    eager_faces(image)  # warm
    started, done = time.perf_counter(), 0
    while time.perf_counter() - started < args.seconds:
        assert len(eager_faces(image)) == 1
        done += 1
    ceiling = done / (time.perf_counter() - started)
    rows = [["eager, in process", f"{ceiling:.1f}", "", "", ""]]
    repository = Path(MODELS)
    process, url = serve(REPO_ROOT, repository)
    try:
        wait_until_up(f"{url}/v2/health/ready", timeout_s=600)
        for connections in (1, 8):
            before = counts(url)
            result = wrk(
                f"{url}/v1/models/faces:predict",
                image,
                "image/jpeg",
                connections=connections,
                seconds=args.seconds,
            )
            assert result.errors == 0, result
            after = counts(url)
            delta = {n: [a - b for a, b in zip(after[n], before[n], strict=True)] for n in STEPS}
            batches = ", ".join(
                f"{name.removeprefix('faces_')} {calls / max(1, runs):.2f} calls "
                f"({rows / max(1, runs):.1f} rows)"
                for name, (calls, rows, runs) in delta.items()
            )
            rows.append(
                [
                    f"served, c={connections}",
                    f"{result.requests_per_s:.1f}",
                    f"{result.p50_ms:.1f}",
                    f"{result.p99_ms:.1f}",
                    batches,
                ]
            )
    finally:
        process.terminate()
        process.wait(timeout=60)
    header = ["run", "images/s", "p50 ms", "p99 ms", "mean batch per step"]
    publish(
        "faces",
        f"# the face pipeline, astronaut 512 × 512, {args.seconds} s each\n\n"
        f"{table(rows, header)}\n",
    )


if __name__ == "__main__":
    main()
