"""Fault injection against a real server: kill, hang, delay, poison, memory pressure,
connection floods and broken artifacts. Each case is bounded in time, sends traffic to
127.0.0.1 only, and asserts that no accepted request was lost or answered wrongly and that
the server ends ready. Timings are printed (``-s``), never asserted, except where the case
itself is a time bound a client relies on."""

from __future__ import annotations

import contextlib
import io
import os
import shutil
import signal
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
import yaml
from PIL import Image

from tests.chaos.conftest import (
    INPUTS,
    Load,
    add_dawdle,
    dawdle_body,
    digits_body,
    peak_rss_bytes,
    reference,
    reset_peak_rss,
)
from tests.models import Poisoned
from tests.server import Server

pytestmark = pytest.mark.chaos

CONNECTION_ERRORS = {
    "connection: ConnectError",
    "connection: RemoteProtocolError",
    "connection: ReadError",
    "connection: WriteError",
}


def only(seen: dict[str, int], allowed: set[str]) -> None:
    unexpected = {kind: n for kind, n in seen.items() if kind not in allowed}
    assert not unexpected, f"clients saw {unexpected} (all: {dict(seen)})"


def test_kill_9_under_load_then_restart(repository: Path, tmp_path: Path) -> None:
    """Clients see only connection errors or 503 while the server is gone, and right answers
    before and after; the restarted server is ready."""
    first = Server(repository, log_path=tmp_path / "first.log")
    second: Server | None = None
    try:
        first.wait_until()
        load = Load(first.url, reference(first.url)).start()
        load.wait_for("right", 50)
        first.process.send_signal(signal.SIGKILL)
        first.process.wait(timeout=10)
        killed = time.monotonic()
        second = Server(repository, log_path=tmp_path / "second.log", port=first.port)
        second.wait_until()
        print(f"\nkill -9 → ready again in {time.monotonic() - killed:.1f} s")
        load.wait_for("right", 50)
        seen = load.stop()
        only(seen, {"right", "status 503"} | CONNECTION_ERRORS)
        assert second.client.get("/v2/health/ready").status_code == 200
    finally:
        first.stop()
        if second is not None:
            assert second.stop() == 0


def test_a_hung_instance_fails_liveness_others_serve_and_a_restart_recovers(
    repository: Path, tmp_path: Path
) -> None:
    add_dawdle(repository)
    env = {"TG_STUCK_INSTANCE_S": "1", "TG_DRAIN_GRACE_S": "1"}
    server = Server(repository, env=env, log_path=tmp_path / "hung.log")
    restarted: Server | None = None
    try:
        server.wait_until()
        load = Load(server.url, reference(server.url)).start()

        def hang() -> None:  # a request that never finishes: its client gives up after 20 s
            with contextlib.suppress(httpx.TransportError):
                httpx.post(
                    f"{server.url}/v2/models/dawdle/infer", json=dawdle_body(1e9), timeout=20
                )

        threading.Thread(target=hang, daemon=True).start()
        server.wait_for(lambda: server.client.get("/v2/health/live").status_code == 503, timeout=30)
        reason = server.client.get("/v2/health/live").json()["reason"]
        assert "model 'dawdle' version 1 instance 0 has run one batch for" in reason
        load.wait_for("right", 30)  # the other model serves on meanwhile
        # What the kubelet does once liveness fails: kill, start again.
        server.process.send_signal(signal.SIGKILL)
        server.process.wait(timeout=10)
        restarted = Server(
            repository, env=env, log_path=tmp_path / "restarted.log", port=server.port
        )
        restarted.wait_until()
        assert restarted.client.get("/v2/health/live").json() == {"live": True}
        load.wait_for("right", 30)
        seen = load.stop()
        only(seen, {"right", "status 503"} | CONNECTION_ERRORS)
    finally:
        server.stop()
        if restarted is not None:
            restarted.stop()


def test_a_model_slowed_tenfold_gives_503_and_504_never_500(
    repository: Path, tmp_path: Path
) -> None:
    add_dawdle(repository, batching={"max_queue_size": 4})
    server = Server(repository, log_path=tmp_path / "slow.log")
    try:
        server.wait_until()
        load = Load(server.url, reference(server.url), clients=2).start()
        load.wait_for("right", 20)
        normal_s = float("inf")
        with httpx.Client(base_url=server.url) as client:
            for _ in range(3):
                started = time.perf_counter()
                client.post("/v2/models/dawdle/infer", json=dawdle_body(1)).raise_for_status()
                normal_s = min(normal_s, time.perf_counter() - started)

        def slowed(_: int) -> int:
            # A deadline three normal requests long: a slowed one takes ten.
            with httpx.Client(base_url=server.url, timeout=60) as client:
                headers = {"X-Request-Timeout": f"{max(normal_s * 3, 0.02):.3f}"}
                return client.post(
                    "/v2/models/dawdle/infer", json=dawdle_body(10), headers=headers
                ).status_code

        with ThreadPoolExecutor(8) as pool:
            statuses = list(pool.map(slowed, range(24)))
        seen = load.stop()
        print(
            f"\nslowed model: {sorted(statuses)}; digits p99 under it "
            f"{np.percentile(load.latencies, 99) * 1000:.1f} ms"
        )
        assert set(statuses) <= {200, 503, 504}, statuses
        assert 503 in statuses and 504 in statuses, statuses  # both bounds acted
        only(seen, {"right"})
        assert server.client.get("/v2/health/ready").status_code == 200
    finally:
        server.stop()


def test_poisoned_requests_mixed_into_load_fail_alone(tmp_path: Path) -> None:
    root = tmp_path / "models"
    (root / "poisoned" / "1").mkdir(parents=True)
    torch.jit.script(Poisoned()).save(str(root / "poisoned" / "1" / "model.pt"))
    (root / "poisoned" / "config.yaml").write_text(
        yaml.safe_dump(
            {
                "backend": "torchscript",
                "max_batch_size": 16,
                "inputs": [{"name": "x", "datatype": "FP32", "shape": [4]}],
                "outputs": [{"name": "y", "datatype": "FP32", "shape": [4]}],
                "batching": {"max_queue_delay_ms": 20},
                "warmup": {"batch_sizes": [1, 2, 4, 8, 16]},
            }
        )
    )
    server = Server(root, log_path=tmp_path / "poison.log")
    try:
        server.wait_until()

        def client(index: int) -> list[tuple[float, int, list[float] | None]]:
            results = []
            with httpx.Client(base_url=server.url, timeout=30) as http:
                for n in range(40):
                    value = -1.0 if (index + n) % 10 == 0 else float(index + n)
                    body = {
                        "inputs": [
                            {"name": "x", "datatype": "FP32", "shape": [1, 4], "data": [value] * 4}
                        ]
                    }
                    answer = http.post("/v2/models/poisoned/infer", json=body)
                    data = (
                        answer.json()["outputs"][0]["data"] if answer.status_code == 200 else None
                    )
                    results.append((value, answer.status_code, data))
            return results

        with ThreadPoolExecutor(8) as pool:
            results = [r for batch in pool.map(client, range(8)) for r in batch]
        for value, status, data in results:
            if value < 0:
                # 400 when it shared a batch with valid requests (they ran, so its input is
                # the cause); 500 when it ran alone, as the load thinned out (nothing tells a
                # bad input from a broken model then). tests/integration/test_poison.py pins
                # the 400 deterministically.
                assert status in (400, 500)
            else:
                assert status == 200 and data == [value * 2] * 4, (value, status, data)
        assert any(status == 400 for value, status, _ in results if value < 0)
        isolated = [
            line
            for line in server.client.get("/metrics").text.splitlines()
            if line.startswith("tensorgate_isolated_batches_total")
        ]
        print(f"\n{isolated}")
    finally:
        server.stop()


def test_memory_pressure_stays_under_a_stated_bound(repository: Path, tmp_path: Path) -> None:
    """Forty 30 MB uploads at once and strip images (10000×1 pixels, a hundred bytes each) at
    once: the server's peak RSS grows by less than BOUND, and it answers every one with a 4xx
    or 503, never a 500."""
    bound = 768 * 2**20
    env = {"TG_MAX_BODY_BYTES": str(40 * 2**20), "TG_MAX_INFLIGHT_BYTES": str(160 * 2**20)}
    server = Server(repository, env=env, log_path=tmp_path / "memory.log")
    try:
        server.wait_until()
        expected = reference(server.url)
        reset_peak_rss(server.process.pid)
        baseline = peak_rss_bytes(server.process.pid)
        junk = b'{"inputs": [' + b" " * (30 * 2**20) + b"]}"

        def upload(_: int) -> int:
            with httpx.Client(base_url=server.url, timeout=120) as client:
                return client.post("/v2/models/digits/infer", content=junk).status_code

        strip = io.BytesIO()
        Image.new("L", (10000, 1), 128).save(strip, format="PNG")

        def stripe(_: int) -> int:
            with httpx.Client(base_url=server.url, timeout=120) as client:
                return client.post(
                    "/v1/models/digits:predict",
                    content=strip.getvalue(),
                    headers={"Content-Type": "image/png"},
                ).status_code

        with ThreadPoolExecutor(48) as pool:
            uploads = pool.map(upload, range(40))
            stripes = pool.map(stripe, range(8))
            statuses = list(uploads) + list(stripes)
        grown = peak_rss_bytes(server.process.pid) - baseline
        print(
            f"\npeak RSS grew {grown / 2**20:.0f} MiB (bound {bound / 2**20:.0f}); statuses {sorted(set(statuses))}"
        )
        assert all(s in (200, 400, 413, 503) for s in statuses), statuses
        assert 503 in statuses  # the body budget refused some before reading them
        assert grown < bound
        assert reference(server.url)[2].tolist() == expected[2].tolist()
    finally:
        server.stop()


def test_a_connection_flood_leaves_room_for_a_normal_client(
    repository: Path, tmp_path: Path
) -> None:
    """2,000 idle connections and 200 that send a byte now and then, from another address: a
    normal client's requests are still each answered within a second. (From one address, the
    flood past TG_MAX_CONNECTIONS_PER_CLIENT is refused: it is the flooder's share.)"""
    env = {"TG_HEADER_TIMEOUT_S": "30"}
    server = Server(repository, env=env, log_path=tmp_path / "flood.log")
    idle: list[socket.socket] = []
    slow: list[socket.socket] = []
    try:
        server.wait_until()
        expected = reference(server.url)
        flooder = ("127.0.0.2", 0)
        for _ in range(2000):
            address = ("127.0.0.1", server.port)
            idle.append(socket.create_connection(address, timeout=10, source_address=flooder))
        for _ in range(200):
            sock = socket.create_connection(
                ("127.0.0.1", server.port), timeout=10, source_address=flooder
            )
            sock.sendall(b"POST /v2/models/digits/infer HTTP/1.1\r\n")
            slow.append(sock)
        latencies = []
        with httpx.Client(base_url=server.url, timeout=1.0) as client:
            for n in range(50):
                for sock in slow[n % 10 :: 10]:  # the slow ones keep trickling
                    with contextlib.suppress(OSError):
                        sock.sendall(b"X")
                started = time.perf_counter()
                answer = client.post("/v2/models/digits/infer", json=digits_body(INPUTS[n % 5]))
                latencies.append(time.perf_counter() - started)
                assert answer.status_code == 200
                np.testing.assert_allclose(
                    answer.json()["outputs"][0]["data"], expected[n % 5], atol=1e-4
                )
        print(f"\nunder the flood: max {max(latencies) * 1000:.1f} ms over 50 requests")
    finally:
        for sock in idle + slow:
            sock.close()
        server.stop()


def test_broken_artifacts_during_poll_never_stop_the_old_version(
    repository: Path, tmp_path: Path
) -> None:
    """Garbage model file, bad golden, half-copied version, invalid YAML, a deleted version:
    each new state is refused with its reason in the metadata while version 1 serves on."""
    server = Server(repository, env={"TG_POLL_INTERVAL_S": "0.2"}, log_path=tmp_path / "poll.log")
    folder = repository / "digits"
    pristine = tmp_path / "pristine"
    shutil.copytree(folder, pristine)
    try:
        server.wait_until()
        load = Load(server.url, reference(server.url), clients=2).start()

        def refused(cause: str) -> None:
            def shown() -> bool:
                metadata = server.client.get("/v2/models/digits").json()
                return cause in metadata.get("last_load_error", "")

            server.wait_for(shown, timeout=60)
            metadata = server.client.get("/v2/models/digits").json()
            assert metadata["state"] == "READY" and metadata["version"] == "1", metadata
            assert metadata["reason"].startswith("version 1 serves; the last reload was refused")
            load.wait_for("right", 10)

        def restore() -> None:
            shutil.rmtree(folder)
            shutil.copytree(pristine, folder)
            server.wait_for(
                lambda: "last_load_error" not in server.client.get("/v2/models/digits").json(),
                timeout=60,
            )

        shutil.copytree(folder / "1", folder / "2")
        (folder / "2" / "model.onnx").write_bytes(os.urandom(4096))
        (folder / "2" / "model.pt").write_bytes(os.urandom(4096))
        refused("2:")
        restore()

        shutil.copytree(folder / "1", folder / "2")
        golden = dict(np.load(folder / "2" / "golden.npz"))
        golden = {k: (v + 1.0 if k.startswith("output") else v) for k, v in golden.items()}
        np.savez(folder / "2" / "golden.npz", **golden)
        refused("golden")
        restore()

        (folder / "2").mkdir()
        shutil.copy(
            folder / "1" / "manifest.json", folder / "2" / "manifest.json"
        )  # the rest never came
        refused("missing")
        restore()

        (folder / "config.yaml").write_text("backend: [onnx\n")
        refused("config.yaml")
        restore()

        shutil.rmtree(folder / "1")  # deleted under a serving version
        refused("no version folder")
        restore()

        seen = load.stop()
        only(seen, {"right"})
        assert server.client.get("/v2/health/ready").status_code == 200
    finally:
        server.stop()
