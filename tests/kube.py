"""The pinned kubectl (from requirements/deploy.txt, installed by `make check-deploy` into
.venv-deploy/bin) and the rendered kustomize overlays, for tests that read the manifests."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

import yaml

REPO_ROOT = Path(__file__).resolve().parent.parent
PINNED_KUBECTL = REPO_ROOT / ".venv-deploy" / "bin" / "kubectl"
OVERLAYS = REPO_ROOT / "deploy" / "k8s" / "overlays"


def kubectl() -> str:
    """Path of the pinned kubectl, else the one on PATH; fails naming both when neither exists."""
    if PINNED_KUBECTL.is_file():
        return str(PINNED_KUBECTL)
    found = shutil.which("kubectl")
    if found is None:
        raise FileNotFoundError(
            f"no kubectl: {PINNED_KUBECTL} is missing (make check-deploy installs it) "
            "and none is on PATH"
        )
    return found


def render(overlay: str) -> list[dict[str, Any]]:
    """The objects `kubectl kustomize deploy/k8s/overlays/<overlay>` renders."""
    done = subprocess.run(
        [kubectl(), "kustomize", str(OVERLAYS / overlay)],
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        raise RuntimeError(f"kubectl kustomize {overlay} failed: {done.stderr}")
    return [doc for doc in yaml.safe_load_all(done.stdout) if doc]
