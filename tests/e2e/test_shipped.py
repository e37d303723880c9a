"""What ships is what is tested: the server run from the images' own dependency set, with the
command lines and environments that the Dockerfile, compose, Kubernetes and KServe declare.

`.venv-runtime` is built exactly as the Dockerfile's cpu stage builds /opt/venv (the CPU lock
plus `pip install --no-deps .`, nothing from the dev lock; `make runtime-venv`). Each case starts
the declared command from it, outside Docker, and then acts as the orchestrator would: it waits
within the declared startup budget, asks every probe the manifest declares, sends a real photo
and a text, and stops the process with SIGTERM within the declared grace. Only what cannot be
kept on a shared machine is changed, and each change is named: the address becomes 127.0.0.1
and the declared port a free one; /models (or /mnt/models) becomes the built repository.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest
import yaml

from tests.e2e.manifests import COMPOSE, DEPLOY, image_env, instruction, k8s, serving_runtime
from tests.server import MODELS, REPO_ROOT, free_port

pytestmark = pytest.mark.e2e

RUNTIME_BIN = REPO_ROOT / ".venv-runtime" / "bin"
CATS = {"Egyptian cat", "tabby"}


@dataclass
class Shipped:
    """One declared way of running the server, made runnable here."""

    argv: list[str]
    env: dict[str, str]
    port: int
    grpc_port: int
    startup_budget_s: float
    grace_s: float
    probes: list[str] = field(default_factory=list)
    """Health paths the manifest's probes ask (the image's HEALTHCHECK runs a command)."""
    healthcheck: list[str] | None = None
    image_model: str = "efficientnet_lite0"
    text_model: str | None = "minilm"


@pytest.fixture(scope="module")
def runtime_bin() -> Path:
    if not (RUNTIME_BIN / "tensorgate").is_file():
        pytest.fail(
            f"{RUNTIME_BIN}/tensorgate is missing: `make runtime-venv` builds it (make test does)"
        )
    return RUNTIME_BIN


def base_env(stage: str, home: Path) -> dict[str, str]:
    """The image's own ENV, its PATH pointing at the runtime venv instead of /opt/venv, and
    nothing from this test process but what the machine needs (OpenBLAS' CPU hints)."""
    env = image_env(stage)
    env["PATH"] = (
        env["PATH"].replace("/opt/venv/bin", str(RUNTIME_BIN)).replace("$PATH", "/usr/bin:/bin")
    )
    env["HOME"] = env["XDG_CACHE_HOME"] = str(home)
    env.update({k: v for k, v in os.environ.items() if k.startswith("OPENBLAS_")})
    return env


def entrypoint(stage: str) -> list[str]:
    (found,) = instruction(stage, "ENTRYPOINT")
    return list(json.loads(found))


def resolved(container: dict[str, Any]) -> dict[str, str]:
    """A container's env as the kubelet would set it: values, and the downward API's
    resourceFieldRef (a CPU limit rounded up to whole divisors)."""
    env: dict[str, str] = {}
    for entry in container.get("env", []):
        if "value" in entry:
            env[entry["name"]] = entry["value"]
            continue
        ref = entry["valueFrom"]["resourceFieldRef"]
        assert ref["resource"] == "limits.cpu", entry
        limit = str(container["resources"]["limits"]["cpu"])
        cpus = float(limit[:-1]) / 1000 if limit.endswith("m") else float(limit)
        env[entry["name"]] = str(math.ceil(cpus / float(ref.get("divisor", "1"))))
    return env


def probe_paths(container: dict[str, Any]) -> list[str]:
    return [
        container[p]["httpGet"]["path"] for p in ("startupProbe", "readinessProbe", "livenessProbe")
    ]


def interpolated(environment: dict[str, str]) -> dict[str, str]:
    """Values as compose passes them from a shell that sets none of the variables they name:
    ``${NAME:-default}`` becomes its default (and ``${NAME}`` empty)."""
    pattern = re.compile(r"\$\{(\w+)(?::?-([^}]*))?\}")
    return {k: pattern.sub(lambda m: m[2] or "", str(v)) for k, v in environment.items()}


def image_case(home: Path) -> Shipped:
    """The cpu image's ENTRYPOINT + CMD with compose's environment for the tensorgate-cpu service."""
    (cmd,) = instruction("cpu", "CMD")
    service = COMPOSE["services"]["tensorgate-cpu"]
    env = {
        **base_env("cpu", home),
        **interpolated(COMPOSE["x-tensorgate"]["environment"]),
        **interpolated(service.get("environment", {})),
    }
    declared = int(env["TG_PORT"])
    assert any(p.endswith(f":{declared}") for p in service["ports"])
    assert any(p.endswith(f":{env['TG_GRPC_PORT']}") for p in service["ports"])
    port, grpc = free_port(), free_port()
    env.update(
        TG_PORT=str(port),
        TG_GRPC_PORT=str(grpc),
        TG_HOST="127.0.0.1",
        TG_MODEL_REPOSITORY=str(MODELS),
    )
    healthcheck = COMPOSE["x-tensorgate"]["healthcheck"]["test"][1:]  # after "CMD"
    grace = float(COMPOSE["x-tensorgate"]["stop_grace_period"].removesuffix("s"))
    start_period = float(COMPOSE["x-tensorgate"]["healthcheck"]["start_period"].removesuffix("s"))
    return Shipped(
        entrypoint("cpu") + json.loads(cmd),
        env,
        port,
        grpc,
        start_period,
        grace,
        healthcheck=healthcheck,
    )


def kubernetes_case(home: Path) -> Shipped:
    """The cpu overlay's Deployment: image ENTRYPOINT + its args, ConfigMap envFrom + env."""
    objects = k8s("cpu")
    (deployment,) = [d for d in objects if d["kind"] == "Deployment"]
    pod = deployment["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    (config,) = [d for d in objects if d["kind"] == "ConfigMap"]
    assert [e["configMapRef"]["name"] for e in container["envFrom"]] == [config["metadata"]["name"]]
    env = {**base_env("cpu", home), **config["data"], **resolved(container)}
    (http,) = [p for p in container["ports"] if p["name"] == "http"]
    (grpc_declared,) = [p for p in container["ports"] if p["name"] == "grpc"]
    assert int(env["TG_PORT"]) == http["containerPort"]
    assert int(env["TG_GRPC_PORT"]) == grpc_declared["containerPort"]
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["httpGet"]["port"] in ("http", http["containerPort"])
    port, grpc = free_port(), free_port()
    env.update(
        TG_PORT=str(port),
        TG_GRPC_PORT=str(grpc),
        TG_HOST="127.0.0.1",
        TG_MODEL_REPOSITORY=str(MODELS),
    )
    argv = container.get("command", entrypoint("cpu")) + container["args"]
    startup = container["startupProbe"]
    return Shipped(
        argv,
        env,
        port,
        grpc,
        startup["periodSeconds"] * startup["failureThreshold"],
        pod["terminationGracePeriodSeconds"],
        probes=probe_paths(container),
    )


def kserve_case(home: Path, name: str, folder: str) -> Shipped:
    """The ServingRuntime's args with KServe's placeholders filled, one model folder as the
    storage initializer leaves it in /mnt/models. The runtime names the GPU image; here its
    CPU twin's ENV and ENTRYPOINT stand in (the same server, no CUDA)."""
    (container,) = serving_runtime()["spec"]["containers"]
    storage = home / "mnt-models"
    shutil.copytree(
        MODELS / folder, storage, ignore=shutil.ignore_patterns("build.py", "__pycache__")
    )
    (declared,) = [p["containerPort"] for p in container["ports"]]
    port, grpc = free_port(), free_port()
    args = [a.replace("{{.Name}}", name) for a in container["args"]]
    replaced = {
        "--host": "127.0.0.1",
        "--port": str(port),
        "--grpc-port": str(grpc),
        "--model-repository": str(storage),
    }
    assert args[args.index("--port") + 1] == str(declared)
    for flag, value in replaced.items():
        args[args.index(flag) + 1] = value
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["httpGet"]["port"] == declared
    env = {**base_env("cpu", home), **resolved(container)}
    startup = container["startupProbe"]
    text = name if folder == "minilm" else None
    return Shipped(
        entrypoint("cpu") + args,
        env,
        port,
        grpc,
        startup["periodSeconds"] * startup["failureThreshold"],
        30.0,  # the pod's terminationGracePeriodSeconds: KServe leaves Kubernetes' default
        probes=probe_paths(container),
        image_model=name if folder != "minilm" else "",
        text_model=text,
    )


def isvc_name() -> str:
    document = yaml.safe_load((DEPLOY / "kserve" / "inferenceservice.yaml").read_text())
    name: str = document["metadata"]["name"]
    return name


CASES = {
    "image+compose": image_case,
    "kubernetes-cpu-overlay": kubernetes_case,
    "kserve-image-model": lambda home: kserve_case(home, isvc_name(), "efficientnet_lite0"),
    "kserve-text-model": lambda home: kserve_case(home, "minilm-embeddings", "minilm"),
}


@pytest.fixture
def running(
    request: pytest.FixtureRequest, tmp_path: Path, runtime_bin: Path
) -> Iterator[tuple[Shipped, subprocess.Popen[bytes], Path]]:
    case: Shipped = CASES[request.param](tmp_path)
    log = tmp_path / "server.log"
    with log.open("wb") as out:
        process = subprocess.Popen(
            case.argv, env=case.env, stdout=out, stderr=subprocess.STDOUT, cwd=tmp_path
        )
    try:
        yield case, process, log
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


@pytest.mark.parametrize("running", list(CASES), indirect=True)
def test_what_ships_starts_answers_and_drains(
    running: tuple[Shipped, subprocess.Popen[bytes], Path], chelsea_jpeg: bytes
) -> None:
    case, process, log = running
    url = f"http://127.0.0.1:{case.port}"
    deadline = time.monotonic() + case.startup_budget_s
    with httpx.Client(base_url=url, timeout=30) as client:
        while True:  # as the startup probe polls, scaled down in period
            assert process.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, (
                f"not started within {case.startup_budget_s} s:\n{log.read_text()[-3000:]}"
            )
            try:
                if client.get("/v2/health/ready", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        for path in case.probes:
            answer = client.get(path)
            assert answer.status_code == 200, (path, answer.text)
        with grpc.insecure_channel(f"127.0.0.1:{case.grpc_port}") as channel:
            # /grpc.health.v1.Health/Check, as a kubelet `grpc:` probe asks: SERVING
            check = channel.unary_unary("/grpc.health.v1.Health/Check")
            assert check(b"", timeout=10) == b"\x08\x01"
        if case.healthcheck is not None:
            done = subprocess.run(
                case.healthcheck, env=case.env, capture_output=True, text=True, timeout=30
            )
            assert done.returncode == 0, done.stderr
        if case.image_model:
            answer = client.post(
                f"/v1/models/{case.image_model}:predict",
                content=chelsea_jpeg,
                headers={"Content-Type": "image/jpeg"},
            )
            assert answer.status_code == 200, answer.text
            assert answer.json()["predictions"][0][0]["label"] in CATS
        if case.text_model:
            answer = client.post(
                f"/v1/models/{case.text_model}:predict",
                json={"instances": ["what ships is what is tested"]},
            )
            assert answer.status_code == 200, answer.text
            assert len(answer.json()["predictions"][0]) == 384
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=case.grace_s) == 0, log.read_text()[-3000:]
    text = log.read_text()
    assert "running torch 2.13.0+cpu, onnxruntime" in text  # the image's TG_EXPECT_* pins held
    assert "is not a tensorgate setting" not in text  # every variable the manifests set is read
