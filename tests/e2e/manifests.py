"""What the deploy files say, parsed once: the Dockerfile's stages, the compose file, the
rendered Kubernetes overlays and the KServe resources. No Docker engine or cluster is needed."""

from __future__ import annotations

import re
import shlex
from typing import Any

import yaml

from tests.kube import render
from tests.server import REPO_ROOT

DEPLOY = REPO_ROOT / "deploy"
DOCKERFILE = (REPO_ROOT / "Dockerfile").read_text()
COMPOSE = yaml.safe_load((DEPLOY / "compose.yaml").read_text())


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


def k8s(overlay: str = "gpu") -> list[dict[str, Any]]:
    return render(overlay)


def deployment(overlay: str = "gpu") -> dict[str, Any]:
    (found,) = [d for d in k8s(overlay) if d["kind"] == "Deployment"]
    return found


def serving_runtime() -> dict[str, Any]:
    document: dict[str, Any] = yaml.safe_load(
        (DEPLOY / "kserve" / "servingruntime.yaml").read_text()
    )
    return document


def containers_with_probes() -> list[tuple[str, dict[str, Any]]]:
    """Every container the manifests run the server in: both overlays and the KServe runtime."""
    found = [
        (f"overlay {o}", deployment(o)["spec"]["template"]["spec"]["containers"][0])
        for o in ("cpu", "gpu")
    ]
    found.append(("kserve", serving_runtime()["spec"]["containers"][0]))
    return found
