"""The deploy files agree with the server, and the image's exact command line works.

No Docker engine or cluster here: the Dockerfile is parsed, its ENTRYPOINT + CMD are run as a
real process with the compose file's environment, and probed the way Kubernetes would.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from service.app import create_app
from service.settings import Settings
from tests.server import MODELS, REPO_ROOT, free_port

DEPLOY = REPO_ROOT / "deploy"
DOCKERFILE = (REPO_ROOT / "Dockerfile").read_text()
COMPOSE = yaml.safe_load((DEPLOY / "compose.yaml").read_text())
SETTINGS_ENV = {f"TG_{name.upper()}" for name in Settings.model_fields}
ROUTES = set(create_app(Settings(model_repository=MODELS)).openapi()["paths"])


def stages() -> dict[str, list[str]]:
    """Dockerfile instructions (continuations joined) per stage name."""
    lines = re.sub(r"\\\n", " ", DOCKERFILE).splitlines()
    found: dict[str, list[str]] = {}
    current = ""
    for line in lines:
        line = line.strip()
        if line.startswith("FROM "):
            current = line.split(" AS ")[-1].strip() if " AS " in line else line
            found[current] = []
        elif line and not line.startswith("#") and current:
            found[current].append(line)
    return found


def instruction(stage: str, keyword: str) -> list[str]:
    return [line[len(keyword) + 1 :] for line in stages()[stage] if line.startswith(keyword + " ")]


def image_env(stage: str) -> dict[str, str]:
    env: dict[str, str] = {}
    for line in instruction(stage, "ENV"):
        for token in shlex.split(line):
            key, _, value = token.partition("=")
            env[key] = value
    return env


def k8s() -> list[dict[str, Any]]:
    rendered = subprocess.run(["kubectl", "kustomize", str(DEPLOY / "k8s" / "overlays" / "gpu")],
                              capture_output=True, text=True, check=True).stdout  # fmt: skip
    return list(yaml.safe_load_all(rendered))


def deployment() -> dict[str, Any]:
    (found,) = [d for d in k8s() if d["kind"] == "Deployment"]
    return found


def test_probe_paths_are_routes_the_server_has() -> None:
    container = deployment()["spec"]["template"]["spec"]["containers"][0]
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["httpGet"]["path"] in ROUTES
    for stage in ("cpu", "gpu"):
        (check,) = instruction(stage, "HEALTHCHECK")
        assert "/v2/health/ready" in check and "/v2/health/ready" in ROUTES
    assert "/v2/health/ready" in " ".join(COMPOSE["x-tensorgate"]["healthcheck"]["test"])
    assert (
        deployment()["spec"]["template"]["metadata"]["annotations"]["prometheus.io/path"] in ROUTES
    )


def test_ports_agree_everywhere() -> None:
    port = str(Settings.model_fields["port"].default)
    for stage in ("cpu", "gpu"):
        assert image_env(stage)["TG_PORT"] == port
        assert instruction(stage, "EXPOSE") == [port]
    assert COMPOSE["x-tensorgate"]["environment"]["TG_PORT"] == port
    assert all(
        p.endswith(f":{port}") for s in COMPOSE["services"].values() for p in s.get("ports", [])
    )
    container = deployment()["spec"]["template"]["spec"]["containers"][0]
    assert container["ports"][0]["containerPort"] == int(port)
    config = next(d for d in k8s() if d["kind"] == "ConfigMap")
    assert config["data"]["TG_PORT"] == port


def test_every_env_var_is_a_setting_the_server_reads() -> None:
    names = set(COMPOSE["x-tensorgate"]["environment"])
    names |= set(COMPOSE["services"]["tensorgate-cpu"]["environment"])
    names |= set(next(d for d in k8s() if d["kind"] == "ConfigMap")["data"])
    for stage in ("cpu", "gpu"):
        names |= {k for k in image_env(stage) if k.startswith("TG_")}
    runtime = yaml.safe_load((DEPLOY / "kserve" / "servingruntime.yaml").read_text())
    names |= {e["name"] for e in runtime["spec"]["containers"][0]["env"]}
    assert names - SETTINGS_ENV == set()


def test_grace_periods_cover_the_drain() -> None:
    data = next(d for d in k8s() if d["kind"] == "ConfigMap")["data"]
    spec = deployment()["spec"]["template"]["spec"]
    pre_stop_hook = spec["containers"][0]["lifecycle"]["preStop"]["sleep"]["seconds"]
    drain = float(data["TG_DRAIN_PRE_STOP_S"]) + float(data["TG_DRAIN_GRACE_S"])
    assert spec["terminationGracePeriodSeconds"] >= pre_stop_hook + drain
    env = COMPOSE["x-tensorgate"]["environment"]
    compose_grace = int(COMPOSE["x-tensorgate"]["stop_grace_period"].removesuffix("s"))
    assert compose_grace >= float(env["TG_DRAIN_PRE_STOP_S"]) + float(env["TG_DRAIN_GRACE_S"])
    for stage in ("cpu", "gpu"):
        assert instruction(stage, "STOPSIGNAL") == ["SIGTERM"]
    assert COMPOSE["x-tensorgate"]["stop_signal"] == "SIGTERM"


def test_security_context_is_locked_down() -> None:
    spec = deployment()["spec"]["template"]["spec"]
    container = spec["containers"][0]
    assert spec["securityContext"]["runAsNonRoot"] is True
    assert spec["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert container["securityContext"]["capabilities"]["drop"] == ["ALL"]
    assert container["resources"]["requests"] == container["resources"]["limits"]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "1"
    for stage in ("cpu", "gpu"):
        assert instruction(stage, "USER") == ["10001:10001"]


def _kserve_check(data: Any, model: type, path: str = "") -> None:
    """Check a manifest against the KServe SDK's generated models (from the CRD OpenAPI):
    unknown fields and wrong types fail, as the API server's schema validation would."""
    import kserve.models
    import kubernetes.client.models

    if not isinstance(data, dict):
        raise AssertionError(f"{path}: expected an object for {model.__name__}")
    by_json = {json_name: attr for attr, json_name in model.attribute_map.items()}
    for key, value in data.items():
        assert key in by_json, f"{path}.{key}: not a field of {model.__name__}"
        kind = model.openapi_types[by_json[key]]
        _kserve_value(value, kind, f"{path}.{key}", kserve.models, kubernetes.client.models)


def _kserve_value(value: Any, kind: str, path: str, *modules: Any) -> None:
    if kind.startswith(("list[", "List[")):
        assert isinstance(value, list), f"{path}: expected a list"
        for i, item in enumerate(value):
            _kserve_value(item, kind[5:-1], f"{path}[{i}]", *modules)
    elif kind.startswith(("dict(", "Dict[")):
        assert isinstance(value, dict), f"{path}: expected a mapping"
    elif kind in ("str", "int", "bool", "float", "object"):
        expected = {"str": str, "int": int, "bool": bool, "float": (int, float), "object": object}[
            kind
        ]
        assert isinstance(value, expected), f"{path}: expected {kind}, got {value!r}"
    else:
        model = next((getattr(m, kind) for m in modules if hasattr(m, kind)), None)
        assert model is not None, f"{path}: no model class {kind}"
        _kserve_check(value, model, path)


@pytest.mark.parametrize(
    ("file", "model"),
    [
        ("servingruntime.yaml", "V1alpha1ServingRuntime"),
        ("inferenceservice.yaml", "V1beta1InferenceService"),
    ],
)
def test_kserve_resources_match_their_crd_models(file: str, model: str) -> None:
    import kserve.models

    document = yaml.safe_load((DEPLOY / "kserve" / file).read_text())
    _kserve_check(document, getattr(kserve.models, model), file)
    if model == "V1alpha1ServingRuntime":
        spec = document["spec"]
        assert spec["protocolVersions"] == ["v2"]
        assert {f["name"] for f in spec["supportedModelFormats"]} == {"onnx", "pytorch"}


@pytest.mark.integration
def test_the_images_command_line_starts_serves_and_drains(tmp_path: Path) -> None:
    """ENTRYPOINT + CMD of the cpu target with the compose file's environment, outside Docker."""
    (entrypoint,) = instruction("cpu", "ENTRYPOINT")
    (cmd,) = instruction("cpu", "CMD")
    argv = json.loads(entrypoint) + json.loads(cmd)
    env = {**os.environ, **image_env("cpu"), **COMPOSE["x-tensorgate"]["environment"],
           **COMPOSE["services"]["tensorgate-cpu"]["environment"]}  # fmt: skip
    port = free_port()
    env.update(TG_PORT=str(port), TG_HOST="127.0.0.1", TG_MODEL_REPOSITORY=str(MODELS),
               TG_DRAIN_PRE_STOP_S="0.5", PATH=f"{REPO_ROOT / '.venv' / 'bin'}:{env['PATH']}")  # fmt: skip
    log = tmp_path / "server.log"
    with log.open("wb") as out:
        process = subprocess.Popen(
            argv, env=env, stdout=out, stderr=subprocess.STDOUT, cwd=tmp_path
        )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300  # the startupProbe's budget: 5 s × 60
        while time.monotonic() < deadline:
            assert process.poll() is None, log.read_text()[-3000:]
            try:
                if httpx.get(f"{url}/v2/health/ready", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.2)  # the probe period, scaled down
        assert httpx.get(f"{url}/v2/health/ready").json() == {"ready": True}
        assert httpx.get(f"{url}/v2/health/live").json() == {"live": True}
        answer = httpx.post(
            f"{url}/v1/models/minilm:predict", json={"instances": ["from the image"]}
        )
        assert answer.status_code == 200 and len(answer.json()["predictions"][0]) == 384
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=60) == 0
    finally:
        if process.poll() is None:
            process.kill()
    text = log.read_text()
    assert "running torch 2.13.0+cpu, onnxruntime 1.32.0" in text  # TG_EXPECT_* matched


def test_the_kserve_check_refuses_unknown_fields_and_wrong_types() -> None:
    import kserve.models

    document = yaml.safe_load((DEPLOY / "kserve" / "servingruntime.yaml").read_text())
    document["spec"]["protocolVersion"] = ["v2"]  # the field is protocolVersions
    with pytest.raises(AssertionError, match="protocolVersion: not a field"):
        _kserve_check(document, kserve.models.V1alpha1ServingRuntime, "runtime")
    document = yaml.safe_load((DEPLOY / "kserve" / "servingruntime.yaml").read_text())
    document["spec"]["multiModel"] = "no"
    with pytest.raises(AssertionError, match="expected bool"):
        _kserve_check(document, kserve.models.V1alpha1ServingRuntime, "runtime")
