"""Every distribution the server's code imports is declared and locked.

Each .py in service/ and preprocessing/ is parsed; every third-party top-level module it imports
(at module level or inside a function, and literal ``__import__``/``import_module`` names) is
mapped to its distribution with importlib.metadata.packages_distributions(), which must be
(a) named in requirements/cpu.in and gpu.in, (b) in pyproject's [project].dependencies or in both
the cpu and gpu extras, and (c) pinned in requirements/cpu.txt and gpu.txt. The few exceptions
are explicit below.
"""

from __future__ import annotations

import ast
import importlib.metadata
import sys
import tomllib
from collections import defaultdict
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from packaging.requirements import InvalidRequirement, Requirement
from packaging.utils import canonicalize_name

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
REQUIREMENTS = ROOT / "requirements"
FIRST_PARTY = ("service", "preprocessing")

# The export command's own files: what only they (and modules only they import) use may come
# from the `export` extra (and the dev lock, which `make models` exports with) instead.
EXPORT_ENTRY = {"service/export/exporter.py", "service/export/cli.py"}
# GPU only: the gpu extra and gpu.in/gpu.txt, never the CPU image.
GPU_ONLY = {"nvidia-ml-py"}
# The GPU image's build of a distribution the CPU image uses (same import name).
GPU_VARIANT = {"onnxruntime": "onnxruntime-gpu"}
# Imported names not installed in the test environment (the dev lock is CPU-only).
NOT_INSTALLED_HERE = {"pynvml": "nvidia-ml-py"}


@dataclass
class Declared:
    """The distribution names each declaration holds (canonical), pins with their versions."""

    cpu_in: set[str]
    gpu_in: set[str]
    dependencies: set[str]
    extras: dict[str, set[str]]
    locks: dict[str, dict[str, str]] = field(default_factory=dict)


def _name(line: str) -> str | None:
    line = line.split(" #", 1)[0].strip()
    if not line or line.startswith(("#", "-")):
        return None
    try:
        return canonicalize_name(Requirement(line).name)
    except InvalidRequirement:
        return None


def names_in(path: Path) -> set[str]:
    return {n for line in path.read_text().splitlines() if (n := _name(line))}


def pins_in(path: Path) -> dict[str, str]:
    pins: dict[str, str] = {}
    for line in path.read_text().splitlines():
        if (name := _name(line)) is not None:
            specifiers = list(Requirement(line.split(" #", 1)[0]).specifier)
            if len(specifiers) == 1 and specifiers[0].operator == "==":
                pins[name] = specifiers[0].version
    return pins


def declared() -> Declared:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]

    def requirement(text: str) -> str:
        return canonicalize_name(Requirement(text).name)

    return Declared(
        cpu_in=names_in(REQUIREMENTS / "cpu.in"),
        gpu_in=names_in(REQUIREMENTS / "gpu.in"),
        dependencies={requirement(r) for r in project["dependencies"]},
        extras={
            k: {requirement(r) for r in v} for k, v in project["optional-dependencies"].items()
        },
        locks={lock: pins_in(REQUIREMENTS / f"{lock}.txt") for lock in ("cpu", "gpu", "dev")},
    )


# ---- what the code imports ----------------------------------------------------------------


def source_files() -> list[Path]:
    return sorted(p for d in FIRST_PARTY for p in (ROOT / d).rglob("*.py"))


def _module_file(dotted: str) -> str | None:
    """service.runtimes.onnx → its file relative to ROOT, if first-party."""
    base = ROOT.joinpath(*dotted.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate.relative_to(ROOT).as_posix()
    return None


def _dynamic_imports(tree: ast.AST) -> Iterator[str]:
    """``__import__("x")``/``importlib.import_module("x")``, also over a literal tuple of names
    (``for name in ("onnx", "onnxruntime"): __import__(name)``)."""
    loop_names: dict[str, list[str]] = {}
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.For)
            and isinstance(node.target, ast.Name)
            and isinstance(node.iter, ast.Tuple | ast.List)
        ):
            values = [e.value for e in node.iter.elts if isinstance(e, ast.Constant)]
            strings = [v for v in values if isinstance(v, str)]
            if strings and len(strings) == len(node.iter.elts):
                loop_names[node.target.id] = strings
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and node.args):
            continue
        func = node.func
        name = func.id if isinstance(func, ast.Name) else getattr(func, "attr", None)
        if name not in ("__import__", "import_module"):
            continue
        arg = node.args[0]
        if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
            yield arg.value
        elif isinstance(arg, ast.Name) and arg.id in loop_names:
            yield from loop_names[arg.id]


def imports_of(path: Path) -> set[str]:
    """Absolute dotted names this file imports (relative imports resolved)."""
    tree = ast.parse(path.read_text(), str(path))
    package = path.relative_to(ROOT).with_suffix("").parts[:-1]
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parent = package[: len(package) - node.level + 1]
                base = ".".join((*parent, node.module or "")).rstrip(".")
            else:
                base = node.module or ""
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)  # maybe submodules
    found.update(_dynamic_imports(tree))
    return found


def imports_by_file() -> dict[str, set[str]]:
    return {p.relative_to(ROOT).as_posix(): imports_of(p) for p in source_files()}


def export_only_files(graph: dict[str, set[str]]) -> set[str]:
    """The export entry files and first-party files only they import (transitively)."""
    importers: dict[str, set[str]] = defaultdict(set)
    for file, names in graph.items():
        for name in names:
            target = _module_file(name)
            if target is not None and target != file:
                importers[target].add(file)
    only = set(EXPORT_ENTRY)
    changed = True
    while changed:
        changed = False
        for file in graph:
            if file not in only and importers[file] and importers[file] <= only:
                only.add(file)
                changed = True
    return only


def third_party(
    graph: dict[str, set[str]], installed: Mapping[str, list[str]] | None = None
) -> dict[str, set[str]]:
    """Third-party module → the files importing it: the top-level name, or the whole dotted
    name in a namespace package several distributions share (``google.protobuf.x``)."""
    users: dict[str, set[str]] = defaultdict(set)
    for file, names in graph.items():
        for name in names:
            parts = name.split(".")
            top = parts[0]
            if (
                top
                and top not in sys.stdlib_module_names
                and top not in (*FIRST_PARTY, "__future__")
            ):
                shared = installed is not None and len(installed.get(top, [])) > 1
                if not shared:
                    users[top].add(file)
                elif len(parts) > 1:  # the bare namespace (`from google import x`) is no one's
                    users[name].add(file)
    return users


def distribution_of(module: str, installed: Mapping[str, list[str]]) -> str:
    if module in NOT_INSTALLED_HERE:
        return NOT_INSTALLED_HERE[module]
    top, _, rest = module.partition(".")
    dists = installed.get(top)
    if not dists:
        raise LookupError(f"`import {module}`: no installed distribution provides it")
    parts = module.split(".")
    for depth in range(len(parts), 1, -1) if rest and len(dists) > 1 else ():
        # a namespace package: the distribution whose files hold the deepest part named
        stem = "/".join(parts[:depth])
        holding = [
            d
            for d in dists
            if any(
                str(f) == f"{stem}.py" or str(f).startswith(f"{stem}/")
                for f in importlib.metadata.files(d) or ()
            )
        ]
        if len(holding) == 1:
            return canonicalize_name(holding[0])
    return canonicalize_name(dists[0])


# ---- the check ----------------------------------------------------------------------------


def problems(dist: str, used_by: set[str], export_only: bool, have: Declared) -> list[str]:
    gpu = GPU_VARIANT.get(dist, dist)
    as_gpu = f" (as {gpu})" if gpu != dist else ""
    where = ", ".join(sorted(used_by))
    found: list[str] = []

    def need(ok: bool, what: str) -> None:
        if not ok:
            found.append(f"{dist} (imported by {where}) is not {what}")

    if export_only:
        need(
            dist in have.dependencies
            or dist in have.extras.get("export", set())
            or (dist in have.extras.get("cpu", set()) and gpu in have.extras.get("gpu", set())),
            "in pyproject's dependencies or its export extra",
        )
        need(dist in have.locks["dev"], "pinned in requirements/dev.txt")
        return found
    if dist in GPU_ONLY:
        need(dist in have.extras.get("gpu", set()), "in pyproject's gpu extra")
        need(dist in have.gpu_in, "named in requirements/gpu.in")
        need(dist in have.locks["gpu"], "pinned in requirements/gpu.txt")
        return found
    need(dist in have.cpu_in, "named in requirements/cpu.in")
    need(gpu in have.gpu_in, f"named in requirements/gpu.in{as_gpu}")
    need(
        dist in have.dependencies
        or (dist in have.extras.get("cpu", set()) and gpu in have.extras.get("gpu", set())),
        "in pyproject's [project].dependencies nor in both its cpu and gpu extras",
    )
    need(dist in have.locks["cpu"], "pinned in requirements/cpu.txt")
    need(gpu in have.locks["gpu"], f"pinned in requirements/gpu.txt{as_gpu}")
    return found


def all_problems(have: Declared) -> list[str]:
    graph = imports_by_file()
    export_files = export_only_files(graph)
    installed = importlib.metadata.packages_distributions()
    found: list[str] = []
    for module, files in sorted(third_party(graph, installed).items()):
        try:
            dist = distribution_of(module, installed)
        except LookupError as exc:
            found.append(str(exc))
            continue
        found += problems(dist, files, export_only=files <= export_files, have=have)
    return found


def test_every_imported_distribution_is_declared_and_locked() -> None:
    found = all_problems(declared())
    assert not found, "undeclared runtime dependencies:\n  " + "\n  ".join(found)


def test_the_scan_sees_the_imports_it_must() -> None:
    """A guard on the scanner itself: direct, in-function and dynamic imports all count."""
    graph = imports_by_file()
    users = third_party(graph)
    for module in ("fastapi", "starlette", "prometheus_client", "torch", "onnxruntime", "pynvml"):
        assert module in users, module
    assert users["onnx"] <= export_only_files(graph)  # __import__ over ("onnx", "onnxruntime")
    assert "service/app.py" not in export_only_files(graph)


def test_a_distribution_missing_from_the_cpu_lock_is_named() -> None:
    have = declared()
    have.locks["cpu"].pop("prometheus-client")
    found = all_problems(have)
    assert any(p.startswith("prometheus-client ") and "cpu.txt" in p for p in found), found
