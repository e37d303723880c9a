"""What the chaos cases share: a repository, a load of checked requests, the server's memory.

Every case sends traffic to 127.0.0.1 only, in loops bounded in count and time, and asserts the
same two things beside its own: no accepted request is lost or answered wrongly, and the server
ends ready.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import numpy as np
import torch
import yaml

from tests.models import Dawdle

INPUTS = [np.full((1, 1, 8, 8), v, np.float32) for v in (0.0, 0.25, 0.5, 0.75, 1.0)]


def digits_body(x: np.ndarray) -> dict[str, object]:
    return {
        "inputs": [
            {
                "name": "image",
                "datatype": "FP32",
                "shape": list(x.shape),
                "data": x.ravel().tolist(),
            }
        ]
    }


def add_dawdle(root: Path, steps_per_unit: int = 2000, **config: object) -> None:
    """A model whose first input value says how many steps it runs (tests.models.Dawdle)."""
    folder = root / "dawdle"
    (folder / "1").mkdir(parents=True)
    torch.jit.script(Dawdle(steps_per_unit)).save(str(folder / "1" / "model.pt"))
    content = {
        "backend": "torchscript",
        "max_batch_size": 1,
        "inputs": [{"name": "x", "datatype": "FP32", "shape": [16]}],
        "outputs": [{"name": "y", "datatype": "FP32", "shape": [16]}],
        "warmup": {"batch_sizes": [1]},
        **config,
    }
    (folder / "config.yaml").write_text(yaml.safe_dump(content))


def dawdle_body(units: float) -> dict[str, object]:
    return {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 16], "data": [units] * 16}]}


def reference(url: str) -> list[np.ndarray]:
    """The digits model's answer to each of INPUTS, from a server in its normal state."""
    with httpx.Client(base_url=url, timeout=30) as client:
        answers = []
        for x in INPUTS:
            response = client.post("/v2/models/digits/infer", json=digits_body(x))
            response.raise_for_status()
            answers.append(np.array(response.json()["outputs"][0]["data"]))
        return answers


@dataclass
class Load:
    """Threads sending digits requests until stopped (or ``limit_s``), each answer checked
    against its reference: what a client saw, by kind."""

    url: str
    expected: list[np.ndarray]
    clients: int = 4
    limit_s: float = 120.0
    timeout_s: float = 10.0
    seen: Counter[str] = field(default_factory=Counter)
    latencies: list[float] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _threads: list[threading.Thread] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def start(self) -> Load:
        for index in range(self.clients):
            thread = threading.Thread(target=self._run, args=(index,), daemon=True)
            thread.start()
            self._threads.append(thread)
        return self

    def stop(self) -> Counter[str]:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=self.timeout_s + 5)
        return self.seen

    def wait_for(self, kind: str, count: int, timeout: float = 60) -> None:
        """Until ``count`` more answers of ``kind`` have been seen (polled, bounded)."""
        target = self.seen[kind] + count
        deadline = time.monotonic() + timeout
        while self.seen[kind] < target:
            assert time.monotonic() < deadline, f"only {dict(self.seen)} within {timeout} s"
            self._stop.wait(0.02)

    def _run(self, index: int) -> None:
        ends = time.monotonic() + self.limit_s
        with httpx.Client(base_url=self.url, timeout=self.timeout_s) as client:
            n = index
            while not self._stop.is_set() and time.monotonic() < ends:
                n += 1
                which = n % len(INPUTS)
                started = time.perf_counter()
                try:
                    response = client.post(
                        "/v2/models/digits/infer", json=digits_body(INPUTS[which])
                    )
                except httpx.TransportError as exc:
                    self._record(f"connection: {type(exc).__name__}")
                    self._stop.wait(0.05)  # the server is gone: do not spin
                    continue
                if response.status_code != 200:
                    self._record(f"status {response.status_code}")
                    continue
                data = np.array(response.json()["outputs"][0]["data"])
                right = np.allclose(data, self.expected[which], atol=1e-4)
                self._record("right" if right else "WRONG", time.perf_counter() - started)

    def _record(self, kind: str, latency: float | None = None) -> None:
        with self._lock:
            self.seen[kind] += 1
            if latency is not None:
                self.latencies.append(latency)


def peak_rss_bytes(pid: int) -> int:
    """The process's peak resident set (VmHWM)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM in /proc status")


def reset_peak_rss(pid: int) -> None:
    """Start VmHWM again from the current RSS (Linux ≥ 4.0: write 5 to clear_refs)."""
    Path(f"/proc/{pid}/clear_refs").write_text("5")
