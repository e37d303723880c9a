"""Logs are written off the event loop: a log pipe that nobody reads never stalls serving, and
no line is lost once it drains."""

from __future__ import annotations

import fcntl
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import orjson
import pytest

from tests.server import REPO_ROOT, free_port

pytestmark = pytest.mark.integration

DIGIT = {
    "inputs": [{"name": "image", "datatype": "FP32", "shape": [1, 1, 8, 8], "data": [0.5] * 64}]
}
REQUESTS = 1500


def test_a_stalled_log_pipe_does_not_stall_serving(repository: Path) -> None:
    port = free_port()
    env = {
        **os.environ,
        "TG_PORT": str(port),
        "TG_HOST": "127.0.0.1",
        "TG_MODEL_REPOSITORY": str(repository),
        "TG_WORKERS": "1",  # one process writing to the pipe
        "TG_INTRA_OP_THREADS": "1",
        "TG_PREPROCESS_THREADS": "1",
        "TG_ACCESS_LOG": "true",
        "TG_DRAIN_PRE_STOP_S": "0",
    }
    process = subprocess.Popen(
        [sys.executable, "-m", "service", "serve"],
        cwd=REPO_ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    assert process.stdout is not None
    capacity = fcntl.fcntl(process.stdout.fileno(), fcntl.F_GETPIPE_SZ)
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=10) as client:
            ready = threading.Event()
            for _ in range(2400):  # up to 2 min, polled (the pipe is not read meanwhile)
                try:
                    if client.get("/v2/health/ready").status_code == 200:
                        ready.set()
                        break
                except httpx.TransportError:
                    pass
                assert process.poll() is None, "server exited"
                ready.wait(0.05)
            assert ready.is_set(), "server never became ready"
            # Far more log than the pipe holds: with a writer on the event loop, the loop would
            # block in write() once the pipe is full, and these requests would time out.
            for _ in range(REQUESTS):
                assert client.post("/v2/models/digits/infer", json=DIGIT).status_code == 200
        process.send_signal(signal.SIGTERM)
        output, _ = process.communicate(timeout=60)  # the pipe drains: every line arrives
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert process.returncode == 0
    assert len(output) > 4 * capacity  # the pipe was full for most of the load
    lines = [orjson.loads(line) for line in output.splitlines()]
    served = [e for e in lines if e["logger"] == "tensorgate.access" and e.get("status") == 200]
    assert len(served) == REQUESTS
    assert lines[-1]["msg"].startswith("Finished server process")  # the last line got out too
