"""A model's own pipeline code as part of its artifact: what export records, and the gates.

A ``preprocessing: {kind: python, ...}`` model runs code from its folder. ``tensorgate export``
records :func:`code_facts` of it (each source file's sha256 and the version of each
third-party distribution the code imports) and :class:`AnswerPair` s (raw items and the answer
the eager pipeline gave). At load, :func:`check_code` refuses a version whose code or a
distribution's version changed since, naming what changed, and :func:`check_answers` refuses
one whose raw → answer replay disagrees beyond the manifest's tolerance.

Local modules are the ones the code imports relatively (``from .features import scale``),
found by reading the sources, not by running them. Imports of tensorgate's own packages
(``preprocessing``, ``service``) are the server's own and pinned with it; the standard
library is Python's, pinned by the image.
"""

from __future__ import annotations

import ast
import hashlib
import importlib.metadata
import importlib.util
import math
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from preprocessing.spec import PythonSpec
from service.errors import ModelLoadError

OWN_PACKAGES = frozenset({"preprocessing", "service"})
"""Top-level packages of tensorgate itself: not recorded as the code's dependencies."""


@dataclass(frozen=True, slots=True)
class CodeFacts:
    """What a model's code is made of: its source files and the distributions it imports."""

    files: Mapping[str, str]
    """Each source file, relative to the model's folder (or the package's), → its sha256."""
    packages: Mapping[str, str]
    """Each third-party distribution the sources import → its version."""

    def as_json(self) -> dict[str, Any]:
        return {"files": dict(self.files), "packages": dict(self.packages)}

    @classmethod
    def from_json(cls, raw: Mapping[str, Any]) -> CodeFacts:
        return cls(dict(raw.get("files", {})), dict(raw.get("packages", {})))


def module_file(spec: PythonSpec, folder: Path) -> Path:
    """The file ``spec.module`` names: ``<folder>/<module>.py``, or an installed package's."""
    if spec.package is None:
        return folder / f"{spec.module.replace('.', '/')}.py"
    found = importlib.util.find_spec(spec.module)
    if found is None or found.origin is None:
        raise ModelLoadError(f"preprocessing.module '{spec.module}' is not installed")
    return Path(found.origin)


def code_facts(spec: PythonSpec, folder: Path) -> CodeFacts:
    """The code's source files (the module and the local modules it imports, transitively)
    with their sha256, and the installed version of every distribution they import."""
    entry = module_file(spec, folder)
    root = folder if spec.package is None else entry.parent
    files: dict[str, str] = {}
    top_level: set[str] = set()
    pending = [entry]
    while pending:
        path = pending.pop()
        name = path.relative_to(root).as_posix()
        if name in files:
            continue
        try:
            source = path.read_bytes()
        except OSError as exc:
            raise ModelLoadError(f"preprocessing: cannot read {path}: {exc}") from None
        files[name] = hashlib.sha256(source).hexdigest()
        local, imported = _imports(source, path, root)
        if spec.package is None:  # a model's folder; an installed package imports as it may
            _check_absolute_locals(imported, path, root)
        pending.extend(local)
        top_level |= imported
    packages = _distributions(top_level)
    if spec.package is not None:
        distribution = spec.package.split("==")[0]
        packages[distribution] = _version(distribution)
    return CodeFacts(dict(sorted(files.items())), dict(sorted(packages.items())))


def check_code(recorded: CodeFacts, served: CodeFacts) -> None:
    """Gate: the served code is the exported code, file by file and distribution by
    distribution; the refusal names the first difference."""
    for name, digest in recorded.files.items():
        now = served.files.get(name)
        if now is None:
            raise ModelLoadError(
                f"preprocessing code: {name} was exported with the model but is gone"
            )
        if now != digest:
            raise ModelLoadError(
                f"preprocessing code: {name} changed since export (sha256 {now[:12]}…, exported "
                f"{digest[:12]}…); re-export the model with the code it is to be served with"
            )
    added = sorted(set(served.files) - set(recorded.files))
    if added:
        raise ModelLoadError(f"preprocessing code now imports {added}, which export did not see")
    for distribution, version in recorded.packages.items():
        now = served.packages.get(distribution)
        if now != version:
            raise ModelLoadError(
                f"preprocessing code imports {distribution} {now or '(not installed)'}; it was "
                f"exported with {distribution} {version}"
            )


@dataclass(frozen=True, slots=True)
class AnswerPair:
    """One raw item (a file in the version folder) and the answer the eager pipeline gave."""

    file: str
    content_type: str | None
    answer: Any


def read_answer_pairs(raw: Sequence[Mapping[str, Any]]) -> list[AnswerPair]:
    return [AnswerPair(p["file"], p.get("content_type"), p["answer"]) for p in raw]


def check_answers(
    pairs: list[AnswerPair],
    answer: Callable[[AnswerPair], Any],
    rtol: float,
    atol: float,
) -> None:
    """Gate: ``answer`` (the served pipeline, raw item → answer) agrees with every recorded
    answer: numbers within tolerance, everything else exactly."""
    for pair in pairs:
        got = answer(pair)
        where = _difference(pair.answer, plain(got), rtol, atol, "answer")
        if where is not None:
            raise ModelLoadError(
                f"end-to-end golden replay of {pair.file}: {where}; the pipeline (code or "
                "model) no longer answers as it did at export"
            )


def _difference(want: Any, got: Any, rtol: float, atol: float, at: str) -> str | None:
    """Where ``got`` differs from ``want`` (JSON values), or None."""
    if isinstance(want, bool) or isinstance(got, bool):
        return None if want == got else f"{at} is {got!r}, exported {want!r}"
    if isinstance(want, int | float) and isinstance(got, int | float):
        if math.isnan(want) and math.isnan(got):
            return None
        if abs(got - want) <= atol + rtol * abs(want):
            return None
        return f"{at} is {got!r}, exported {want!r}"
    if isinstance(want, list) and isinstance(got, list):
        if len(want) != len(got):
            return f"{at} has {len(got)} entries, exported {len(want)}"
        for i, (w, g) in enumerate(zip(want, got, strict=True)):
            found = _difference(w, g, rtol, atol, f"{at}[{i}]")
            if found is not None:
                return found
        return None
    if isinstance(want, dict) and isinstance(got, dict):
        if set(want) != set(got):
            return f"{at} has keys {sorted(got)}, exported {sorted(want)}"
        for key in want:
            found = _difference(want[key], got[key], rtol, atol, f"{at}.{key}")
            if found is not None:
                return found
        return None
    return None if want == got else f"{at} is {got!r}, exported {want!r}"


def plain(value: Any) -> Any:
    """An answer as JSON would carry it (numpy scalars and arrays as numbers and lists)."""
    return orjson.loads(orjson.dumps(value, option=orjson.OPT_SERIALIZE_NUMPY))


def _imports(source: bytes, path: Path, root: Path) -> tuple[list[Path], set[str]]:
    """The local files ``source`` imports relatively, and the top-level names it imports
    absolutely."""
    try:
        tree = ast.parse(source, filename=str(path))
    except SyntaxError as exc:
        raise ModelLoadError(f"preprocessing: {path.name} does not parse: {exc}") from None
    local: list[Path] = []
    top_level: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            top_level.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level == 0:
                top_level.add((node.module or "").split(".")[0])
                continue
            base = path.parent
            for _ in range(node.level - 1):
                base = base.parent
            parts = node.module.split(".") if node.module else []
            targets = [parts] if parts else [[alias.name] for alias in node.names]
            for target in targets:
                candidate = base.joinpath(*target)
                for found in (candidate.with_suffix(".py"), candidate / "__init__.py"):
                    if found.is_file() and found.resolve().is_relative_to(root.resolve()):
                        local.append(found)
                        break
    return local, top_level - {""}


def _check_absolute_locals(names: set[str], path: Path, root: Path) -> None:
    """ModelLoadError for ``import helpers`` of a module beside the code that nothing installed
    provides: the model's folder is a package of its own, never on ``sys.path``, so it only
    imports relatively. Export copied the code without it, and loading it then failed with a
    bare ModuleNotFoundError (a new user's walk)."""
    root = root.resolve()
    for name in sorted(names):
        beside = root / name
        if not (beside.with_suffix(".py").is_file() or (beside / "__init__.py").is_file()):
            continue
        if name in sys.stdlib_module_names:
            continue
        try:
            found = importlib.util.find_spec(name)
        except (ImportError, ValueError):
            found = None
        origin = found.origin if found is not None else None
        if found is not None and not (origin and Path(origin).resolve().is_relative_to(root)):
            continue  # an installed module of that name is what the import means
        raise ModelLoadError(
            f"preprocessing: {path.name} imports {name}, a module beside "
            f"it, absolutely: import it relatively (from . import {name}, or from .{name} "
            "import ...): the model's folder is imported as a package of its own, never from "
            "sys.path"
        )


def _distributions(names: set[str]) -> dict[str, str]:
    """The installed distribution (and version) of each third-party top-level name."""
    providers = importlib.metadata.packages_distributions()
    found: dict[str, str] = {}
    for name in sorted(names):
        if name in sys.stdlib_module_names or name in OWN_PACKAGES or name == "__future__":
            continue
        for distribution in providers.get(name, []):
            found[distribution] = _version(distribution)
    return found


def _version(distribution: str) -> str:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return "(not installed)"
