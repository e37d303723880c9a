"""The deploy files agree with the server, and the image's exact command line works.

No Docker engine or cluster here: the Dockerfile is parsed, its ENTRYPOINT + CMD are run as a
real process with the compose file's environment, and probed the way Kubernetes would.
"""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

import pytest
import yaml

from service.app import create_app
from service.settings import Settings
from tests.e2e.manifests import (
    COMPOSE,
    DEPLOY,
    containers_with_probes,
    deployment,
    image_env,
    instruction,
    k8s,
    serving_runtime,
)
from tests.server import MODELS, REPO_ROOT

SETTINGS_ENV = {f"TG_{name.upper()}" for name in Settings.model_fields}
ROUTES = set(create_app(Settings(model_repository=MODELS)).openapi()["paths"])


def test_probe_paths_are_routes_the_server_has() -> None:
    for where, container in containers_with_probes():
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert container[probe]["httpGet"]["path"] in ROUTES, (where, probe)
    for stage in ("cpu", "gpu"):
        (check,) = instruction(stage, "HEALTHCHECK")
        assert json.loads(check.split("CMD", 1)[1]) == ["tensorgate", "health", "ready"]
    assert COMPOSE["x-tensorgate"]["healthcheck"]["test"] == [
        "CMD",
        "tensorgate",
        "health",
        "ready",
    ]
    assert (
        deployment()["spec"]["template"]["metadata"]["annotations"]["prometheus.io/path"] in ROUTES
    )


def test_probes_mean_what_kubernetes_means() -> None:
    """Startup ends when loading has, whatever the outcome (a refused model is a NotReady pod,
    not a restart loop); one slow readiness probe does not drop the endpoint; every probe asks
    the port the container declares."""
    for where, container in containers_with_probes():
        ports = {p.get("name"): p["containerPort"] for p in container["ports"]}
        assert container["startupProbe"]["httpGet"]["path"] == "/v2/health/startup", where
        assert container["readinessProbe"]["httpGet"]["path"] == "/v2/health/ready", where
        assert container["livenessProbe"]["httpGet"]["path"] == "/v2/health/live", where
        assert container["readinessProbe"]["failureThreshold"] >= 3, where
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            port = container[probe]["httpGet"]["port"]
            assert ports.get(port, port) in ports.values(), (where, probe, port)


SIZED_BY_CPUS = {"TG_WORKERS", "TG_INTRA_OP_THREADS", "TG_PREPROCESS_THREADS"}


def test_workers_and_threads_follow_the_cpu_limit_everywhere() -> None:
    """Both overlays and the KServe runtime pass the container's own limits.cpu as TG_CPUS
    (downward API), and nothing sets the worker count or the thread pools to a number that
    could disagree with it: the server derives both from TG_CPUS."""
    for where, container in containers_with_probes():
        env = {e["name"]: e for e in container.get("env", [])}
        assert "cpu" in container["resources"]["limits"], where
        field = env["TG_CPUS"]["valueFrom"]["resourceFieldRef"]
        assert field["resource"] == "limits.cpu", where
        assert field["containerName"] == container["name"], where
        assert str(field.get("divisor", "1")) == "1", where
        assert not SIZED_BY_CPUS & set(env), where
    for overlay in ("cpu", "gpu"):
        data = next(d for d in k8s(overlay) if d["kind"] == "ConfigMap")["data"]
        assert not SIZED_BY_CPUS & set(data), overlay
    for service in COMPOSE["services"].values():  # compose: the server reads its cgroup quota
        assert not SIZED_BY_CPUS & set(service.get("environment", {}))
    assert not SIZED_BY_CPUS & set(COMPOSE["x-tensorgate"]["environment"])


def test_metrics_are_scraped_once() -> None:
    """Scrape hints on the Pod only; the ServiceMonitor (Prometheus Operator) selects the
    Service by its labels and names its port."""
    for overlay in ("cpu", "gpu"):
        objects = k8s(overlay)
        service = next(d for d in objects if d["kind"] == "Service")
        assert not any(
            k.startswith("prometheus.io/") for k in service["metadata"].get("annotations", {})
        )
        pod = deployment(overlay)["spec"]["template"]["metadata"]["annotations"]
        assert pod["prometheus.io/scrape"] == "true" and pod["prometheus.io/path"] == "/metrics"
        monitor = yaml.safe_load(
            (DEPLOY / "k8s" / "monitoring" / "servicemonitor.yaml").read_text()
        )
        assert monitor["kind"] == "ServiceMonitor"
        selector = monitor["spec"]["selector"]["matchLabels"]
        assert selector.items() <= service["metadata"]["labels"].items()
        (endpoint,) = monitor["spec"]["endpoints"]
        assert endpoint["port"] in {p["name"] for p in service["spec"]["ports"]}
        assert endpoint["path"] in ROUTES


def test_kserve_runtime_follows_kserve_conventions() -> None:
    runtime = serving_runtime()
    assert "annotations" not in runtime["metadata"]  # KServe copies spec.annotations to pods
    assert runtime["spec"]["annotations"]["prometheus.kserve.io/path"] in ROUTES
    container = runtime["spec"]["containers"][0]
    assert runtime["spec"]["annotations"]["prometheus.kserve.io/port"] == str(
        container["ports"][0]["containerPort"]
    )
    assert all(f["autoSelect"] is False for f in runtime["spec"]["supportedModelFormats"])
    args = container["args"]
    assert args[args.index("--model-name") + 1] == "{{.Name}}"
    assert args[args.index("--port") + 1] == str(container["ports"][0]["containerPort"])


def test_images_and_compose_serve_what_they_ship() -> None:
    """No VOLUME over the shipped models (a rebuild would keep serving the old ones) and no
    named compose volume; OCI labels name source, version and revision."""
    for stage in ("cpu", "gpu"):
        assert instruction(stage, "VOLUME") == []
        labels = " ".join(instruction(stage, "LABEL"))
        for key in ("source", "version", "revision"):
            assert f"org.opencontainers.image.{key}=" in labels, (stage, key)
    assert "volumes" not in COMPOSE
    for name, service in COMPOSE["services"].items():
        for volume in service.get("volumes", []):
            assert str(volume).endswith(":ro"), (name, volume)


def test_ports_agree_everywhere() -> None:
    """HTTP on TG_PORT and gRPC on TG_GRPC_PORT (8000 and 8001, as Triton) in the images, compose,
    the ConfigMap, the Deployment's named container ports and the Service."""
    http = str(Settings.model_fields["port"].default)
    grpc = str(Settings.model_fields["grpc_port"].default)
    for stage in ("cpu", "gpu"):
        assert image_env(stage)["TG_PORT"] == http
        assert image_env(stage)["TG_GRPC_PORT"] == grpc
        assert instruction(stage, "EXPOSE") == [f"{http} {grpc}"]
    environment = COMPOSE["x-tensorgate"]["environment"]
    assert (environment["TG_PORT"], environment["TG_GRPC_PORT"]) == (http, grpc)
    for name in ("tensorgate", "tensorgate-cpu"):
        inside = sorted(p.split(":")[-1] for p in COMPOSE["services"][name]["ports"])
        assert inside == sorted([http, grpc]), name
    for overlay in ("cpu", "gpu"):
        container = deployment(overlay)["spec"]["template"]["spec"]["containers"][0]
        assert {p["name"]: p["containerPort"] for p in container["ports"]} == {
            "http": int(http),
            "grpc": int(grpc),
        }
        objects = k8s(overlay)
        data = next(d for d in objects if d["kind"] == "ConfigMap")["data"]
        assert (data["TG_PORT"], data["TG_GRPC_PORT"]) == (http, grpc)
        service = next(d for d in objects if d["kind"] == "Service")
        assert {p["name"]: p["targetPort"] for p in service["spec"]["ports"]} == {
            "http": "http",
            "grpc": "grpc",
        }
        policy = next(d for d in objects if d["kind"] == "NetworkPolicy")
        allowed = {p["port"] for rule in policy["spec"]["ingress"] for p in rule["ports"]}
        assert allowed == {int(http), int(grpc)}


def test_kserve_runtime_serves_grpc_v2_too() -> None:
    runtime = serving_runtime()
    assert runtime["spec"]["protocolVersions"] == ["v2", "grpc-v2"]
    args = runtime["spec"]["containers"][0]["args"]
    assert args[args.index("--grpc-port") + 1] == "9000"  # what KServe's grpc-v2 examples use


def test_every_env_var_is_a_setting_the_server_reads() -> None:
    names = set(COMPOSE["x-tensorgate"]["environment"])
    names |= set(COMPOSE["services"]["tensorgate-cpu"]["environment"])
    names |= set(next(d for d in k8s() if d["kind"] == "ConfigMap")["data"])
    for stage in ("cpu", "gpu"):
        names |= {k for k in image_env(stage) if k.startswith("TG_")}
    for _, container in containers_with_probes():
        names |= {e["name"] for e in container.get("env", [])}
    # OTEL_*: OpenTelemetry's standard variables, read by its SDK (service/telemetry/tracing.py)
    assert {n for n in names - SETTINGS_ENV if not n.startswith("OTEL_")} == set()


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


def test_every_read_only_container_has_a_writable_tmp() -> None:
    """The supervisor of several workers (the default past one CPU) keeps its workers' sockets
    and shared counts in a folder under /tmp: the KServe runtime's read-only root filesystem
    had no /tmp mounted, so its server could not start with 2 CPUs."""
    runtime = yaml.safe_load((DEPLOY / "kserve" / "servingruntime.yaml").read_text())["spec"]
    pod = deployment()["spec"]["template"]["spec"]
    for spec in (pod, runtime):
        for container in spec["containers"]:
            if not container.get("securityContext", {}).get("readOnlyRootFilesystem"):
                continue
            mounts = {m["mountPath"]: m["name"] for m in container.get("volumeMounts", [])}
            assert "/tmp" in mounts, container["name"]
            volume = next(v for v in spec["volumes"] if v["name"] == mounts["/tmp"])
            assert "emptyDir" in volume


def kserve_check(document: Any, model: str) -> str:
    """What KServe's SDK models say of ``document`` ("" when it fits), from a process of its own:
    the SDK registers the same protobuf names as tritonclient.grpc, and one process cannot hold
    both (tests/e2e/kserve_check.py)."""
    done = subprocess.run(
        [sys.executable, "-m", "tests.e2e.kserve_check", model],
        input=json.dumps(document),
        capture_output=True,
        text=True,
        cwd=REPO_ROOT,
        timeout=120,
    )
    assert done.returncode in (0, 1), done.stderr
    return done.stdout.strip()


@pytest.mark.parametrize(
    ("file", "model"),
    [
        ("servingruntime.yaml", "V1alpha1ServingRuntime"),
        ("inferenceservice.yaml", "V1beta1InferenceService"),
    ],
)
def test_kserve_resources_match_their_crd_models(file: str, model: str) -> None:
    document = yaml.safe_load((DEPLOY / "kserve" / file).read_text())
    assert kserve_check(document, model) == ""
    if model == "V1alpha1ServingRuntime":
        spec = document["spec"]
        assert "v2" in spec["protocolVersions"]
        assert {f["name"] for f in spec["supportedModelFormats"]} == {"onnx", "pytorch"}


def test_the_kserve_check_refuses_unknown_fields_and_wrong_types() -> None:
    document = yaml.safe_load((DEPLOY / "kserve" / "servingruntime.yaml").read_text())
    document["spec"]["protocolVersion"] = ["v2"]  # the field is protocolVersions
    assert "protocolVersion: not a field" in kserve_check(document, "V1alpha1ServingRuntime")
    document = yaml.safe_load((DEPLOY / "kserve" / "servingruntime.yaml").read_text())
    document["spec"]["multiModel"] = "no"
    assert "expected bool" in kserve_check(document, "V1alpha1ServingRuntime")
