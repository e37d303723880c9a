"""The import graph of service/: no circle, and no layer importing one above it.

Every import counts, at module level, inside functions and under ``TYPE_CHECKING`` alike: a
lazy import hides an edge, it does not remove it. The layers, lowest first, are the folders a
request crosses (docs/architecture.md); the top level holds the vocabulary (imported by all)
and the composition root (importing all).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests.server import REPO_ROOT

pytestmark = pytest.mark.unit

LAYERS = (
    {
        "service",
        "service.errors",
        "service.model_config",
        "service.settings",
        "service.resources",
        "service.inference",
        "service.datatypes",
    },
    {"service.protocol"},
    {"service.artifacts"},
    {"service.runtimes"},
    {"service.batching"},
    {"service.pipelines"},
    {"service.repository"},
    {"service.telemetry"},
    {"service.core"},
    {"service.limits"},
    {"service.cluster"},
    {"service.http", "service.grpc"},
    {"service.export"},
    {"service.app", "service.cli", "service.__main__"},
)
"""Each module may import its own layer and those before it. ``service.http`` and
``service.grpc`` share a layer, and neither may import the other (the check below)."""


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO_ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def graph() -> dict[str, set[str]]:
    modules = {
        module_name(p): p
        for p in (REPO_ROOT / "service").rglob("*.py")
        if "pb" not in p.relative_to(REPO_ROOT).parts  # generated gRPC stubs
    }
    edges: dict[str, set[str]] = {}
    for name, path in modules.items():
        found: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets = [f"{node.module}.{alias.name}" for alias in node.names]
                targets.append(node.module)
            for target in targets:
                # the longest module name the target starts with: `from service.x import y`
                # is an edge to service.x.y when that is a module, else to service.x
                while target and target not in modules:
                    target = target.rpartition(".")[0]
                if target and target != name:
                    found.add(target)
        edges[name] = found
    return edges


def layer(module: str) -> int:
    for rank, members in enumerate(LAYERS):
        if module in members:
            return rank
    candidates = [
        rank
        for rank, members in enumerate(LAYERS)
        for member in members
        if member != "service" and module.startswith(member + ".")
    ]
    assert candidates, f"{module} is in no layer: add its folder to LAYERS"
    return max(candidates)


def test_no_module_imports_a_layer_above_its_own() -> None:
    upward = [
        f"{module} (layer {layer(module)}) imports {target} (layer {layer(target)})"
        for module, targets in graph().items()
        for target in targets
        if layer(target) > layer(module)
    ]
    assert not upward, "\n".join(sorted(upward))


def test_http_and_grpc_do_not_import_each_other() -> None:
    crossing = [
        f"{module} imports {target}"
        for module, targets in graph().items()
        for target in targets
        for a, b in (("service.http", "service.grpc"), ("service.grpc", "service.http"))
        if module.startswith(a) and target.startswith(b)
    ]
    assert not crossing, crossing


def test_the_import_graph_has_no_circle() -> None:
    edges = graph()
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    circles: list[list[str]] = []

    def visit(module: str, path: list[str]) -> None:
        state[module] = 1
        for target in sorted(edges.get(module, ())):
            if state.get(target) == 1:
                circles.append([*path[path.index(target) :], target])
            elif target not in state:
                visit(target, [*path, target])
        state[module] = 2

    for module in sorted(edges):
        if module not in state:
            visit(module, [module])
    assert not circles, "\n".join(" → ".join(c) for c in circles)


def test_the_server_never_imports_the_offline_exporter() -> None:
    edges = graph()
    reached, todo = set(), ["service.app"]
    while todo:
        module = todo.pop()
        if module not in reached:
            reached.add(module)
            todo.extend(edges.get(module, ()))
    assert not {m for m in reached if m.startswith("service.export")}, sorted(reached)
