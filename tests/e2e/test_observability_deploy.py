"""What operators observe the server with agrees with the server: the Prometheus rules (promtool
checks and unit-tests them), the Grafana dashboard, the autoscaling and monitoring kustomize
components, and the compose profile `observability`.

Scrape-free: the metric names come from the server's own registry (``Metrics``), not from a
running server. promtool is Debian's prometheus package; without it the promtool tests skip,
saying so (the Makefile installs it).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

import service.telemetry.metrics as metrics_module
from service.repository.models import ModelRepository
from service.settings import Settings
from service.telemetry.metrics import Metrics
from tests.e2e.manifests import COMPOSE, DEPLOY
from tests.kube import kubectl

pytestmark = pytest.mark.e2e

RULES_FILE = DEPLOY / "prometheus" / "rules.yaml"
RULES = yaml.safe_load(RULES_FILE.read_text())
DASHBOARD = json.loads((DEPLOY / "grafana" / "tensorgate.json").read_text())
K8S = DEPLOY / "k8s"
PROMTOOL = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(
    PROMTOOL is None, reason="promtool is missing: install Debian's prometheus package"
)

# Reported only where there is a GPU, so absent from a registry built here; each must still be
# a name service/telemetry/metrics.py exports (checked below).
GPU_METRICS = {
    "tensorgate_gpu_memory_used_bytes",
    "tensorgate_gpu_memory_total_bytes",
    "tensorgate_gpu_utilization_ratio",
    "tensorgate_gpu_torch_allocated_bytes",
    "tensorgate_gpu_torch_reserved_bytes",
}
# Server-wide series: every other tensorgate_* series has a `model` label, which the dashboard
# must filter by its variable.
WITHOUT_MODEL = {
    "tensorgate_refused_total",
    "tensorgate_memory_limit_bytes",
    "tensorgate_request_body_bytes_in_flight",
    *GPU_METRICS,
}
TARGET_LABELS = {"job", "instance"}  # what Prometheus adds at scrape
SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count")}
PROMQL_WORDS = {"and", "or", "unless", "bool", "offset", "by", "without", "on", "ignoring"}
GRAFANA_VARIABLES = {"$model": ".*", "$__rate_interval": "1m", "$__range": "1h"}


@pytest.fixture(scope="module")
def server_metrics(tmp_path_factory: pytest.TempPathFactory) -> set[str]:
    """Every series name the server exposes (counters with _total, histograms' three)."""
    repository = ModelRepository(Settings(model_repository=tmp_path_factory.mktemp("models")))
    names = set()
    for family in Metrics(repository).registry.collect():
        names |= {family.name + s for s in SUFFIXES.get(family.type, ("",))}
    return names | GPU_METRICS


def metric_names(expr: str) -> set[str]:
    """The series names an expression selects (recording rules' names included)."""
    expr = re.sub(r"\{[^}]*\}", "{}", expr)  # matchers: label names and values
    expr = re.sub(r'"[^"]*"', '""', expr)  # strings: label_replace's arguments
    expr = re.sub(r"\[[^]]*\]", "", expr)  # ranges
    expr = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", expr)
    name = r"(?<![\w:$.])([a-zA-Z_:][\w:]*)(?![\w:])(?!\s*\()"  # not a number's 1e9 or a call
    found = set(re.findall(name, expr))
    return found - PROMQL_WORDS


def selectors(expr: str) -> list[tuple[str, str]]:
    """(metric, matchers) of each selector; matchers "" when the name stands alone."""
    found = re.findall(r"([a-zA-Z_:][a-zA-Z0-9_:]*)\s*\{([^}]*)\}", expr)
    bare = re.sub(r"[a-zA-Z_:][a-zA-Z0-9_:]*\s*\{[^}]*\}", "", expr)
    return found + [(name, "") for name in metric_names(bare)]


def kept_labels(expr: str) -> set[str]:
    """Labels a query's result may have: those every `by (...)` keeps (less `le` once
    histogram_quantile has used it), else the target's own."""
    groups = [
        {label.strip() for label in found.split(",") if label.strip()}
        for found in re.findall(r"\bby\s*\(([^)]*)\)", expr)
    ]
    if not groups:
        return TARGET_LABELS | {"device"}
    kept = set.intersection(*groups)
    return kept - {"le"} if "histogram_quantile" in expr else kept


def panels() -> list[dict[str, Any]]:
    return [p for p in DASHBOARD["panels"] if p["type"] != "row"]


def alerts() -> list[dict[str, Any]]:
    return [rule for group in RULES["groups"] for rule in group["rules"] if "alert" in rule]


def promtool(*args: str, cwd: Path | None = None) -> str:
    assert PROMTOOL is not None
    done = subprocess.run(
        [PROMTOOL, *args], capture_output=True, text=True, cwd=cwd, timeout=120, check=False
    )
    assert done.returncode == 0, f"promtool {' '.join(args)}:\n{done.stdout}{done.stderr}"
    return done.stdout


def render_with(component: Path, tmp_path: Path) -> list[dict[str, Any]]:
    """The cpu overlay with one optional component, as an operator's overlay would add it
    (kustomize takes relative paths only)."""
    kustomization = {
        "apiVersion": "kustomize.config.k8s.io/v1beta1",
        "kind": "Kustomization",
        "resources": [os.path.relpath(K8S / "overlays" / "cpu", tmp_path)],
        "components": [os.path.relpath(component, tmp_path)],
    }
    (tmp_path / "kustomization.yaml").write_text(yaml.safe_dump(kustomization))
    done = subprocess.run(
        [kubectl(), "kustomize", str(tmp_path)], capture_output=True, text=True, check=False
    )
    assert done.returncode == 0, done.stderr
    return [d for d in yaml.safe_load_all(done.stdout) if d]


# -- alert rules ------------------------------------------------------------------------------


@needs_promtool
def test_rules_pass_promtool_check_and_their_unit_tests() -> None:
    assert "SUCCESS" in promtool("check", "rules", str(RULES_FILE))
    assert "SUCCESS" in promtool("test", "rules", "rules_test.yaml", cwd=DEPLOY / "prometheus")
    promtool("check", "config", str(DEPLOY / "prometheus" / "prometheus.yml"))


def test_every_alert_is_a_threshold_with_for_severity_and_runbook() -> None:
    """`<quantity> <op> <number>`, so that the quantity alone graphs on a healthy server; each
    alert waits (`for`), says how bad (severity) and what to check first (runbook)."""
    assert len(alerts()) >= 8
    for rule in alerts():
        name = rule["alert"]
        assert re.fullmatch(r"(?s).*\S\s*(>|<|>=|==)\s*-?[0-9.]+", rule["expr"].strip()), name
        assert "for" in rule, name
        assert rule["labels"]["severity"] in {"critical", "warning"}, name
        for key in ("summary", "description", "runbook"):
            assert rule["annotations"][key].strip(), (name, key)


def test_rules_read_only_the_servers_metrics_and_their_own_records(
    server_metrics: set[str],
) -> None:
    records = {r["record"] for g in RULES["groups"] for r in g["rules"] if "record" in r}
    assert all(name.startswith("tensorgate:") for name in records)
    for group in RULES["groups"]:
        for rule in group["rules"]:
            used = metric_names(rule["expr"])
            assert used, rule
            assert used <= server_metrics | records, (rule.get("alert", rule.get("record")), used)


def test_every_alert_in_the_docs_table() -> None:
    doc = (DEPLOY.parent / "docs" / "deploy.md").read_text()
    for rule in alerts():
        assert f"`{rule['alert']}`" in doc, rule["alert"]


def test_prometheus_rule_holds_exactly_the_rules_file_groups() -> None:
    """The Operator's copy is generated (deploy/prometheus/prometheusrule.py), never edited."""
    operator = yaml.safe_load((K8S / "monitoring" / "prometheusrule.yaml").read_text())
    assert operator["apiVersion"] == "monitoring.coreos.com/v1"
    assert operator["kind"] == "PrometheusRule"
    assert operator["spec"]["groups"] == RULES["groups"]


# -- dashboard --------------------------------------------------------------------------------


def test_dashboard_is_provisionable() -> None:
    assert DASHBOARD["uid"] == "tensorgate" and DASHBOARD["title"]
    assert DASHBOARD["schemaVersion"] >= 39
    variables = {v["name"]: v for v in DASHBOARD["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    model = variables["model"]
    assert model["definition"] == "label_values(tensorgate_model_state, model)"
    assert model["query"]["query"] == model["definition"]
    assert model["multi"] is True and model["includeAll"] is True
    assert model["datasource"]["uid"] == "${datasource}"
    ids = [p["id"] for p in DASHBOARD["panels"]]
    assert len(ids) == len(set(ids))
    for panel in DASHBOARD["panels"]:
        assert panel["type"] and panel["title"], panel.get("id")
        assert {"h", "w", "x", "y"} <= panel["gridPos"].keys(), panel["title"]
        assert panel["gridPos"]["x"] + panel["gridPos"]["w"] <= 24, panel["title"]
    for panel in panels():
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]
        assert panel["targets"], panel["title"]
        refs = [t["refId"] for t in panel["targets"]]
        assert len(refs) == len(set(refs)), panel["title"]
        for target in panel["targets"]:
            assert target["expr"].strip() and target["datasource"]["uid"] == "${datasource}"


def test_dashboard_shows_what_on_call_needs() -> None:
    used = {name for p in panels() for t in p["targets"] for name in metric_names(t["expr"])}
    for metric in (
        "tensorgate_requests_total",
        "tensorgate_request_duration_seconds_bucket",
        "tensorgate_queue_duration_seconds_bucket",
        "tensorgate_compute_duration_seconds_bucket",
        "tensorgate_preprocess_duration_seconds_bucket",
        "tensorgate_postprocess_duration_seconds_bucket",
        "tensorgate_batch_size_bucket",
        "tensorgate_queued_requests",
        "tensorgate_queue_capacity",
        "tensorgate_instances",
        "tensorgate_instances_busy",
        "tensorgate_model_state",
        "tensorgate_unwarmed_shape_requests_total",
        "process_resident_memory_bytes",
        "tensorgate_memory_limit_bytes",
        "tensorgate_gpu_memory_used_bytes",
        "tensorgate_out_of_memory_total",
        "tensorgate_refused_total",
        "tensorgate_longest_batch_seconds",
    ):
        assert metric in used, metric
    titles = {p["title"] for p in DASHBOARD["panels"]}
    for rule in alerts():  # the panels a runbook points at exist
        for title in re.findall(r'dashboard \("?([^")]+)"?\)', rule["annotations"]["runbook"]):
            assert title in titles, (rule["alert"], title)


def test_dashboard_queries_use_the_servers_metrics_the_model_variable_and_kept_labels(
    server_metrics: set[str],
) -> None:
    for panel in panels():
        for target in panel["targets"]:
            expr, where = target["expr"], (panel["title"], target["refId"])
            used = metric_names(expr)
            assert used and used <= server_metrics, (where, used - server_metrics)
            for metric, matchers in selectors(expr):
                if metric.startswith("tensorgate_") and metric not in WITHOUT_MODEL:
                    assert 'model=~"$model"' in matchers, (where, metric)
            legend = set(re.findall(r"\{\{\s*(\w+)\s*\}\}", target.get("legendFormat", "")))
            assert legend <= kept_labels(expr), (where, legend - kept_labels(expr))


def test_the_expression_helpers_see_what_promql_means() -> None:
    expr = 'sum by (model) (rate(a_total{model=~"$model",le="1"}[5m])) / on (job) b and vector(0)'
    assert metric_names(expr) == {"a_total", "b"}
    assert metric_names("x * 1e9 > 0.5") == {"x"}
    assert metric_names('label_replace(x, "model", "(no model)", "model", "")') == {"x"}
    assert kept_labels(expr) == {"model"}
    assert kept_labels("histogram_quantile(0.9, sum by (model, le) (rate(x_bucket[1m])))") == {
        "model"
    }
    assert selectors('x{model=~"$model"} / y') == [("x", 'model=~"$model"'), ("y", "")]


@needs_promtool
def test_dashboard_queries_parse(tmp_path: Path) -> None:
    rules = []
    for n, target in enumerate(t for p in panels() for t in p["targets"]):
        expr = target["expr"]
        for name in sorted(GRAFANA_VARIABLES, key=len, reverse=True):
            expr = expr.replace(name, GRAFANA_VARIABLES[name])
        rules.append({"record": f"dashboard:query_{n}", "expr": expr})
    path = tmp_path / "queries.yaml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    promtool("check", "rules", str(path))


def test_gpu_metric_names_are_the_servers() -> None:
    source = Path(metrics_module.__file__).read_text()
    for name in GPU_METRICS:
        assert f'"{name}"' in source, name


# -- kustomize components -----------------------------------------------------------------------


def test_keda_replaces_the_base_hpa_with_the_same_targets(tmp_path: Path) -> None:
    objects = render_with(K8S / "components" / "keda", tmp_path)
    kinds = [d["kind"] for d in objects]
    assert "HorizontalPodAutoscaler" not in kinds  # KEDA makes its own; two would fight
    (scaled,) = [d for d in objects if d["kind"] == "ScaledObject"]
    (deployment,) = [d for d in objects if d["kind"] == "Deployment"]
    assert scaled["spec"]["scaleTargetRef"]["name"] == deployment["metadata"]["name"]
    base_hpa = yaml.safe_load((K8S / "base" / "hpa.yaml").read_text())["spec"]
    assert scaled["spec"]["minReplicaCount"] == base_hpa["minReplicas"]
    assert scaled["spec"]["maxReplicaCount"] == base_hpa["maxReplicas"]
    (pods,) = [m["pods"] for m in base_hpa["metrics"] if m["type"] == "Pods"]
    triggers = {t["name"]: t for t in scaled["spec"]["triggers"] if t["type"] == "prometheus"}
    assert set(triggers) == {"pending-requests", "requests-in-flight"}
    for trigger in triggers.values():
        assert trigger["metricType"] == "AverageValue"  # the sum over pods, divided by pods
    pending = triggers["pending-requests"]["metadata"]
    assert pending["threshold"] == pods["target"]["averageValue"]
    assert pods["metric"]["name"] in pending["query"]
    assert "tensorgate_requests_in_flight" in triggers["requests-in-flight"]["metadata"]["query"]


def test_prometheus_adapter_serves_the_metric_the_base_hpa_reads(tmp_path: Path) -> None:
    objects = render_with(K8S / "components" / "prometheus-adapter", tmp_path)
    (hpa,) = [d for d in objects if d["kind"] == "HorizontalPodAutoscaler"]
    (pods,) = [m["pods"] for m in hpa["spec"]["metrics"] if m["type"] == "Pods"]
    (config,) = [d for d in objects if d["kind"] == "ConfigMap" and "config.yaml" in d["data"]]
    rules = yaml.safe_load(config["data"]["config.yaml"])["rules"]
    served = {rule["name"]["as"] for rule in rules}
    assert pods["metric"]["name"] in served
    for rule in rules:
        assert rule["resources"]["overrides"].keys() == {"namespace", "pod"}
        assert "<<.LabelMatchers>>" in rule["metricsQuery"]


def test_monitoring_component_ships_the_rules_monitor_and_dashboard(tmp_path: Path) -> None:
    objects = render_with(K8S / "monitoring", tmp_path)
    by_kind = {d["kind"]: d for d in objects if d["kind"] != "ConfigMap"}
    assert by_kind["PrometheusRule"]["spec"]["groups"] == RULES["groups"]
    assert by_kind["ServiceMonitor"]["spec"]["endpoints"][0]["path"] == "/metrics"
    (dashboard,) = [
        d
        for d in objects
        if d["kind"] == "ConfigMap" and d["metadata"].get("labels", {}).get("grafana_dashboard")
    ]
    assert dashboard["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert dashboard["metadata"]["name"] == "tensorgate-dashboard"  # no hash suffix
    assert json.loads(dashboard["data"]["tensorgate.json"]) == DASHBOARD


# -- compose profile ----------------------------------------------------------------------------

PINNED = {
    "prometheus": r"prom/prometheus:v2\.\d+\.\d+",
    "grafana": r"grafana/grafana:11\.\d+\.\d+",
    "jaeger": r"jaegertracing/all-in-one:1\.\d+\.\d+",
}


def mounts(service: str) -> dict[str, Path]:
    """Container path → host file of each of a compose service's bind mounts."""
    found = {}
    for volume in COMPOSE["services"][service].get("volumes", []):
        source, target, mode = volume.split(":")
        assert mode == "ro", (service, volume)
        found[target] = (DEPLOY / source).resolve()
    return found


def test_observability_profile_pins_its_images_and_mounts_files_that_exist() -> None:
    for name, image in PINNED.items():
        service = COMPOSE["services"][name]
        assert service["profiles"] == ["observability"], name
        assert re.fullmatch(image, service["image"]), (name, service["image"])
        for target, source in mounts(name).items():
            assert source.is_file(), (name, target, source)


def test_prometheus_scrapes_the_tensorgate_services_and_loads_the_rules() -> None:
    files = mounts("prometheus")
    config_path = next(
        a.split("=", 1)[1]
        for a in COMPOSE["services"]["prometheus"]["command"]
        if a.startswith("--config.file=")
    )
    config = yaml.safe_load(files[config_path].read_text())
    for rule_file in config["rule_files"]:
        inside = str(Path(config_path).parent / rule_file)
        assert files[inside] == RULES_FILE.resolve()
    (job,) = config["scrape_configs"]
    assert job["metrics_path"] == "/metrics"
    assert config["global"]["scrape_interval"] == "15s"
    port = COMPOSE["x-tensorgate"]["environment"]["TG_PORT"]
    targets = {t for c in job["static_configs"] for t in c["targets"]}
    assert targets == {f"{name}:{port}" for name in ("tensorgate", "tensorgate-cpu")}
    assert targets <= {f"{name}:{port}" for name in COMPOSE["services"]}


def test_grafana_provisions_the_datasource_and_the_dashboard() -> None:
    files = mounts("grafana")
    datasources = [t for t in files if t.startswith("/etc/grafana/provisioning/datasources/")]
    dashboards = [t for t in files if t.startswith("/etc/grafana/provisioning/dashboards/")]
    assert len(datasources) == len(dashboards) == 1
    (source,) = yaml.safe_load(files[datasources[0]].read_text())["datasources"]
    assert source["type"] == "prometheus" and source["url"] == "http://prometheus:9090"
    assert "9090" in COMPOSE["services"]["prometheus"]["ports"][0].split(":")
    (provider,) = yaml.safe_load(files[dashboards[0]].read_text())["providers"]
    folder = provider["options"]["path"]
    shipped = [
        t for t, s in files.items() if s == (DEPLOY / "grafana" / "tensorgate.json").resolve()
    ]
    assert [str(Path(t).parent) for t in shipped] == [folder]


def test_tracing_is_off_unless_asked_and_goes_to_the_profiles_jaeger() -> None:
    for name in ("tensorgate", "tensorgate-cpu"):
        env = COMPOSE["services"][name]["environment"]
        assert env["OTEL_TRACES_EXPORTER"] == "${OTEL_TRACES_EXPORTER:-none}", name
        assert env["OTEL_SERVICE_NAME"] == "tensorgate", name
        assert env["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://jaeger:4318", name
    jaeger = COMPOSE["services"]["jaeger"]
    published = {p.split(":")[-1] for p in jaeger["ports"]}
    assert {"4318", "16686"} <= published
