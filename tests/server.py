"""A real ``tensorgate serve`` process on 127.0.0.1, for integration tests.

Started with the console script's own code path (``python -m service serve``), on a free port,
polled until ready (never slept on), and stopped by its PID with SIGTERM, then SIGKILL.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import IO

import httpx

REPO_ROOT = Path(__file__).resolve().parent.parent
MODELS = REPO_ROOT / "models"


def copy_model(name: str, destination: Path) -> Path:
    """A bundled model's folder (config, labels, built versions; not its build script) copied to
    ``destination``, for a test's own repository to change at will."""
    shutil.copytree(MODELS / name, destination, ignore=shutil.ignore_patterns("build.py"))
    return destination


_GIVEN: set[int] = set()


def free_port() -> int:
    """A port free on 127.0.0.1 now, and never one this process was given before.

    The kernel hands a port it just freed out again: two calls in a row returned the same port
    once, and a server's HTTP and gRPC listeners then fought over it (CI, test_grpc)."""
    while True:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port: int = sock.getsockname()[1]
        if port not in _GIVEN:
            _GIVEN.add(port)
            return port


class Server:
    """One server process and an httpx client for it."""

    def __init__(
        self,
        repository: Path,
        env: Mapping[str, str] | None = None,
        log_path: Path | None = None,
        port: int | None = None,
        command: Sequence[str] = (sys.executable, "-m", "service", "serve"),
        cwd: Path = REPO_ROOT,
    ) -> None:
        self.repository = repository
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.grpc_port = free_port()
        self.grpc_url = f"127.0.0.1:{self.grpc_port}"
        self.log_path = log_path
        environment = {
            **os.environ,
            "TG_PORT": str(self.port),
            "TG_GRPC_PORT": str(self.grpc_port),
            "TG_HOST": "127.0.0.1",
            "TG_MODEL_REPOSITORY": str(repository),
            "TG_WORKERS": "1",  # the tests of several workers say so
            "TG_INTRA_OP_THREADS": "1",
            "TG_PREPROCESS_THREADS": "2",
            **(env or {}),
        }
        self._log: IO[bytes] | None = open(log_path, "wb") if log_path else None  # noqa: SIM115 - closed in stop()
        self.process = subprocess.Popen(
            list(command),
            cwd=cwd,
            env=environment,
            stdout=self._log or subprocess.DEVNULL,
            stderr=subprocess.STDOUT,
        )
        self.client = httpx.Client(base_url=self.url, timeout=60)

    def wait_until(
        self, path: str = "/v2/health/ready", status: int = 200, timeout: float = 120
    ) -> None:
        """Poll ``path`` until it answers ``status``; fail with the server's log if it never does."""
        self.wait_for(lambda: self.client.get(path, timeout=2).status_code == status, timeout)

    def wait_for(self, condition: Callable[[], bool], timeout: float = 120) -> None:
        """Poll ``condition`` (connection errors count as false) until it holds."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(
                    f"server exited with {self.process.returncode}:\n{self.log(5000)}"
                )
            try:
                if condition():
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.05)
        raise TimeoutError(f"condition never held within {timeout}s:\n{self.log(5000)}")

    def wait_log(self, text: str, timeout: float = 10) -> None:
        """Wait until ``text`` is in the log: the server writes its log from a thread of its
        own, so a line may reach the file after the answer that followed it reached us."""
        self.wait_for(lambda: text in self.log(), timeout)

    def log(self, tail: int | None = None) -> str:
        if self.log_path is None or not self.log_path.exists():
            return "(no log captured)"
        text = self.log_path.read_text(errors="replace")
        return text[-tail:] if tail else text

    def stop(self) -> int:
        self.client.close()
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        if self._log is not None:
            self._log.close()
        return self.process.returncode
