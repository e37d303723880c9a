"""schemathesis against the official Open Inference Protocol document and our own OpenAPI.

Generated requests go to a real server holding the bundled models; path parameters are drawn
from the models it really serves, so that generated bodies reach validation and the models.
Checks: no 5xx ever, and every documented response conforms to its schema.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import hypothesis
import pytest
import schemathesis
import yaml
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import response_schema_conformance

from service.app import create_app
from service.settings import Settings
from tests.server import MODELS, REPO_ROOT, Server

pytestmark = pytest.mark.integration

SPEC = REPO_ROOT / "tests" / "specs" / "open_inference_rest.yaml"  # vendored: tests/specs/README.md
MODEL_NAMES = ["digits", "efficientnet_lite0", "nope"]
VERSIONS = ["1", "2"]
CHECKS = [not_a_server_error, response_schema_conformance]
SETTINGS = hypothesis.settings(
    max_examples=25,
    deadline=None,
    suppress_health_check=list(hypothesis.HealthCheck),
    derandomize=True,
    database=None,
)


def _restrict(parameter: dict[str, Any]) -> None:
    """Draw path parameters from real names (and one unknown), not from all strings."""
    name = parameter.get("name", "").lower()
    if parameter.get("in") == "path" and name in ("model_name", "name"):
        parameter["schema"] = {"type": "string", "enum": MODEL_NAMES}
    elif parameter.get("in") == "path" and name in ("model_version", "version"):
        parameter["schema"] = {"type": "string", "enum": VERSIONS}


def _walk_parameters(paths: dict[str, Any]) -> None:
    for item in paths.values():
        for parameter in item.get("parameters", []):
            _restrict(parameter)
        for operation in item.values():
            if isinstance(operation, dict):
                for parameter in operation.get("parameters", []):
                    _restrict(parameter)


def official_schema(path: Path) -> dict[str, Any]:
    """The OIP document with its known defects handled in memory (see tests/specs/README.md)."""
    raw: dict[str, Any] = yaml.safe_load(path.read_text())
    paths: dict[str, Any] = {}
    for template, item in raw["paths"].items():
        fixed = template.replace("${MODEL_NAME}", "{MODEL_NAME}").replace(
            "${MODEL_VERSION}", "{MODEL_VERSION}"
        )
        paths[fixed] = item
        if "/versions/{MODEL_VERSION}" in fixed:  # the prose makes /versions/<v> optional
            unversioned = copy.deepcopy(item)
            unversioned["parameters"] = [
                p for p in unversioned.get("parameters", []) if p["name"] != "MODEL_VERSION"
            ]
            paths[fixed.replace("/versions/{MODEL_VERSION}", "")] = unversioned
    raw["paths"] = paths
    _walk_parameters(paths)
    return raw


def own_schema() -> dict[str, Any]:
    raw: dict[str, Any] = create_app(Settings(model_repository=MODELS)).openapi()
    _walk_parameters(raw["paths"])
    return raw


official = schemathesis.openapi.from_dict(official_schema(SPEC))
own = schemathesis.openapi.from_dict(own_schema())


@official.parametrize()
@SETTINGS
def test_official_oip_document(case: schemathesis.Case, server: Server) -> None:
    case.call_and_validate(base_url=server.url, checks=CHECKS, timeout=60)


@own.parametrize()
@SETTINGS
def test_own_openapi_document(case: schemathesis.Case, server: Server) -> None:
    case.call_and_validate(base_url=server.url, checks=CHECKS, timeout=60)
