"""Readiness waits for every warmup shape; start-up time is logged with its parts."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from tests.server import MODELS, Server

pytestmark = pytest.mark.integration


def test_ready_stays_503_until_every_bucket_of_every_model_has_run(tmp_path: Path) -> None:
    server = Server(MODELS, log_path=tmp_path / "server.log")
    observed: list[tuple[int, str]] = []
    try:
        server.wait_until("/v2/health/live")
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            # Readiness first: loading may finish between requests, and a later "not started"
            # or "LOADING" then means readiness was false when it was read.
            ready = server.client.get("/v2/health/ready")
            started = server.client.get("/v2/health/startup").status_code
            state = server.client.get("/v2/models/minilm").json()["state"]
            observed.append((ready.status_code, state))
            if started == 503:  # loading: neither started nor ready
                assert ready.status_code == 503
            if ready.status_code == 200:
                break
        assert observed[-1][0] == 200, server.log(3000)
        not_ready = [entry for entry in observed if entry[0] == 503]
        assert not_ready, "readiness was never observed as 503 during start-up"
        assert all(code == 503 for code, state in observed if state == "LOADING")
        assert server.client.get("/v2/health/startup").json() == {"started": True}
        metadata = server.client.get("/v2/models/minilm").json()
        expected = {f"batch_{b}_len_{n}" for b in (1, 2, 4, 8, 16) for n in (16, 32, 64, 128, 256)}
        assert set(metadata["warmup_timings_s"]) == expected
        assert all(seconds > 0 for seconds in metadata["warmup_timings_s"].values())
        efficientnet = server.client.get("/v2/models/efficientnet_lite0").json()
        assert set(efficientnet["warmup_timings_s"]) == {f"batch_{b}" for b in range(1, 33)}
    finally:
        assert server.stop() == 0
    lines = [json.loads(line) for line in server.log().splitlines() if line.startswith("{")]
    (startup,) = [line for line in lines if line["msg"].startswith("startup finished")]
    assert startup["startup_s"] >= startup["warmup_s"] > 0
    assert {"load_s", "gates_s", "warmup_s"} <= set(startup)
