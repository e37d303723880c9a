"""``tensorgate export``: a module factory and a few flags → a versioned artifact folder and
the ``config.yaml`` that serves it as export checked it."""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import importlib
import inspect
import logging
import os
import shutil
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pydantic
import torch
import yaml

from preprocessing.spec import PreprocessingSpec, PythonSpec, TextSpec
from preprocessing.text import TextPipeline
from service.artifacts.code import code_facts
from service.artifacts.manifest import Manifest
from service.datatypes import TO_NUMPY
from service.errors import ModelLoadError
from service.export.exporter import (
    DEFAULT_OPSET,
    FORMATS,
    ExportError,
    export_model,
    other_versions,
)
from service.model_config import TensorConfig, describe_validation_error, yaml_problem
from service.repository.models import NAME_PATTERN

log = logging.getLogger("tensorgate.export")
GOLDEN_ROWS = 4
GOLDEN_TEXTS = (
    "a short sentence",
    "The quick brown fox jumps over the lazy dog, and then it does so again.",
    "tokens",
    "Serving a model is easy; serving it as it was trained is the hard part.",
)
WRITTEN_BY = "# Written by `tensorgate export`"
"""The last line of a config.yaml that export wrote: a later export may replace it; a config
without it is the user's and is kept."""
SPEC = pydantic.TypeAdapter(PreprocessingSpec)


def run_export(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if not NAME_PATTERN.match(args.name):
        log.error(
            "export failed: --name %r is not a model name the server serves (it must match %s: "
            "a folder of the repository, no path)",
            args.name,
            NAME_PATTERN.pattern,
        )
        return 2
    try:
        module = load_module(args.factory)
        inputs = [parse_tensor(text) for text in args.input]
        outputs = [parse_tensor(text) for text in args.output]
        check_tensors(inputs, outputs, args.buckets)
    except SystemExit as exc:  # what the arguments name is wrong: 2, as every usage error
        if not isinstance(exc.code, str):
            raise
        log.error("export failed: %s", exc.code)
        return 2
    model_dir = args.repository / args.name
    out_dir = model_dir / str(args.model_version)
    formats = [f.strip() for f in args.formats.split(",") if f.strip()]
    if args.backend is not None and args.backend not in formats:
        log.error("--backend %s is not among --formats %s", args.backend, ",".join(formats))
        return 2
    written = Overwrites()  # what export_model writes, it takes back itself on failure
    try:
        code = _export(args, module, inputs, outputs, model_dir, out_dir, formats, written)
    except BaseException:
        written.undo()  # nothing of a failed export is left, and nothing it replaced is lost
        raise
    if code != 0:
        written.undo()
    return code


def _export(
    args: argparse.Namespace,
    module: torch.nn.Module,
    inputs: list[TensorConfig],
    outputs: list[TensorConfig],
    model_dir: Path,
    out_dir: Path,
    formats: list[str],
    written: Overwrites,
) -> int:
    try:
        preprocessing = (
            read_spec(args.preprocessing, out_dir, written) if args.preprocessing else None
        )
    except ValueError as exc:
        log.error("export failed: %s", exc)
        return 2
    buckets = [int(b) for b in args.buckets.split(",") if b.strip()]
    rows = min(GOLDEN_ROWS, args.max_batch_size) if args.max_batch_size > 0 else 0
    golden: dict[str, np.ndarray] | None
    if isinstance(preprocessing, TextSpec):
        tokens = TextPipeline(preprocessing, out_dir)(list(GOLDEN_TEXTS[: max(rows, 1)]))
        golden = {"input_ids": tokens.input_ids, "attention_mask": tokens.attention_mask}
    elif isinstance(preprocessing, PythonSpec):
        golden = None  # the answer items, preprocessed by the code
    else:
        # Dynamic dims below the smallest bucket, so that export can see what padding does.
        length = max(1, 3 * min(buckets) // 4) if buckets else 8
        golden = {t.name: golden_input(t, rows, i, length) for i, t in enumerate(inputs)}
    try:
        manifest = export_model(
            module,
            out_dir,
            name=args.name,
            inputs=inputs,
            outputs=outputs,
            golden_inputs=golden,
            max_batch_size=args.max_batch_size,
            preprocessing=preprocessing,
            answer_items=args.answer_items,
            code_folder=model_dir,
            opset=args.opset or DEFAULT_OPSET,
            formats=formats,
            required=[args.backend] if args.backend else [],
            buckets=buckets,
            pt2_cpu=args.pt2_cpu,
        )
    except ExportError as exc:
        log.error("export failed: %s", exc)
        return 1
    backend = args.backend or next(f for f in FORMATS if f in manifest.artifacts)
    config = model_dir / "config.yaml"
    wrote = write_config(config, manifest, backend, preprocessing)
    if wrote:
        _warn_of_versions_without(backend, model_dir, out_dir)
    log.info("%s", summary(manifest, out_dir, config, backend, wrote))
    return 0


def _warn_of_versions_without(backend: str, model_dir: Path, out_dir: Path) -> None:
    """The config.yaml export wrote is the model's, its versions' alike: say which of the
    others have no artifact for the backend it names (served beside this one, by
    ``version_policy``, each would be refused)."""
    for version, other in other_versions(model_dir, out_dir):
        if backend not in other.artifacts:
            log.warning(
                "version %s of %s has no %s artifact (it has %s), and config.yaml now names "
                "backend %s: served beside this one (version_policy), it would be refused",
                version.name,
                model_dir.name,
                backend,
                ", ".join(sorted(other.artifacts)),
                backend,
            )


class Overwrites:
    """Files an export writes beside others' (the model's code, shared by its versions), each
    with what was there before, so that an export that fails leaves the folder as it was: it
    had replaced the code version 1 was exported with, and version 1 was refused at its next
    load."""

    def __init__(self) -> None:
        self.before: dict[Path, bytes | None] = {}
        self.made: list[Path] = []

    def copy(self, source: Path, target: Path) -> None:
        if target not in self.before:
            self.before[target] = target.read_bytes() if target.is_file() else None
        self.folder(target.parent)
        shutil.copyfile(source, target)

    def folder(self, path: Path) -> None:
        """``path`` and its parents made, each remembered if this export made it."""
        missing = [p for p in (path, *path.parents) if not p.exists()]
        path.mkdir(parents=True, exist_ok=True)
        self.made.extend(reversed(missing))

    def undo(self) -> None:
        for target, content in self.before.items():
            if content is None:
                target.unlink(missing_ok=True)
            else:
                target.write_bytes(content)
        for folder in reversed(self.made):  # the deepest first, each only if left empty
            with contextlib.suppress(OSError):
                folder.rmdir()


def read_spec(path: Path, out_dir: Path, written: Overwrites) -> PreprocessingSpec:
    """The image, text or python spec in ``path``. A text spec's tokenizer is copied from
    beside it into the version folder, where the server reads it (its sha256 checked first); a
    python spec's module and the local modules it imports, from beside it into the model's
    folder (``out_dir``'s parent), where the server imports them."""
    try:
        data = yaml.safe_load(path.read_text())
        if isinstance(data, dict) and set(data) == {"preprocessing"}:
            raise ValueError(
                f"{path}: this file is the spec itself, as config.yaml's preprocessing: holds "
                "it; drop the 'preprocessing:' level (its keys, kind: first, at the top)"
            )
        spec = SPEC.validate_python(data)
    except OSError as exc:
        raise ValueError(f"{path}: cannot read it ({exc.strerror})") from None
    except yaml.YAMLError as exc:
        raise ValueError(f"{path}: cannot read YAML: {yaml_problem(exc)}") from None
    except pydantic.ValidationError as exc:
        raise ValueError(f"{path}: {describe_validation_error(exc, PreprocessingSpec)}") from None
    if isinstance(spec, TextSpec):
        source = path.parent / spec.tokenizer
        if not source.is_file():
            raise ValueError(f"{path}: the tokenizer {source} is not there")
        digest = hashlib.sha256(source.read_bytes()).hexdigest()
        if digest != spec.tokenizer_sha256:
            raise ValueError(
                f"{path}: {source} has sha256 {digest}, the spec says {spec.tokenizer_sha256}"
            )
        written.copy(source, out_dir / spec.tokenizer)
    if isinstance(spec, PythonSpec) and spec.package is None:
        model_dir = out_dir.parent
        try:
            files = code_facts(spec, path.parent).files
        except ModelLoadError as exc:
            raise ValueError(f"{path}: {exc}") from None
        if path.parent.resolve() != model_dir.resolve():
            for name in files:
                written.copy(path.parent / name, model_dir / name)
    return spec


def served_config(
    manifest: Manifest, backend: str, preprocessing: PreprocessingSpec | None
) -> dict[str, Any]:
    """The config that serves the artifact as export checked it: its tensors with their value
    ranges, the buckets of its dynamic dims, a warmup that leaves no shape the server can run
    cold, and the preprocessing it was exported with."""
    content: dict[str, Any] = {"backend": backend, "max_batch_size": manifest.max_batch_size}
    content["inputs"] = [t.model_dump(mode="json") for t in manifest.inputs]
    content["outputs"] = [t.model_dump(mode="json") for t in manifest.outputs]
    shapes = manifest.shapes
    if shapes is not None and not isinstance(preprocessing, TextSpec):
        content["buckets"] = list(shapes.buckets)
    if manifest.max_batch_size > 0:
        content["warmup"] = warmup(manifest.max_batch_size, dynamic=shapes is not None)
    if preprocessing is not None:
        python = isinstance(preprocessing, PythonSpec)  # written as users write it: class:
        content["preprocessing"] = preprocessing.model_dump(
            mode="json", by_alias=python, exclude_none=python
        )
    return content


def warmup(max_batch_size: int, dynamic: bool) -> dict[str, Any]:
    """Every batch size, where that is one shape each; with dynamic dims, whose buckets
    multiply the count, powers of two and every batch padded up to one (docs/models.md)."""
    if not dynamic:
        return {"batch_sizes": "all"}
    sizes = sorted({min(2**k, max_batch_size) for k in range(max_batch_size.bit_length() + 1)})
    return {"batch_sizes": sizes, "pad_batches": True}


def write_config(
    path: Path, manifest: Manifest, backend: str, preprocessing: PreprocessingSpec | None
) -> bool:
    """Write config.yaml unless the user's own is there (one export wrote is replaced)."""
    if path.exists() and WRITTEN_BY not in path.read_text():
        log.warning(
            "kept %s, which export did not write: compare it with %s",
            path,
            served_config(manifest, backend, preprocessing),
        )
        return False
    footer = f"{WRITTEN_BY} from what it checked; delete this line to keep your edits."
    body = yaml.safe_dump(served_config(manifest, backend, preprocessing), sort_keys=False)
    path.write_text(f"{body}{footer}\n")
    return True


def summary(manifest: Manifest, out_dir: Path, config: Path, backend: str, written: bool) -> str:
    parity = ", ".join(
        f"{fmt} (max abs error {p['max_abs']:.2g})" for fmt, p in manifest.parity.items()
    )
    line = f"exported {manifest.name} to {out_dir}: {parity}"
    if manifest.skipped:
        line += f"; left out {', '.join(manifest.skipped)} (see above)"
    if manifest.shapes is not None:
        shapes = manifest.shapes
        how = "padded to" if shapes.pad else "served at exactly"
        line += f"; dynamic dims {how} {list(shapes.buckets)}"
        if shapes.pad and (strided := [a for a in shapes.axes if a.multiple > 1]):
            each = ", ".join(f"{a.dims[0][0]} dim {a.dims[0][1]}: {a.multiple}" for a in strided)
            line += f" from multiples ({each}; other sizes: exactly a bucket)"
    return line + (f"; {config} serves {backend}" if written else f"; kept {config}")


def load_module(spec: str) -> torch.nn.Module:
    """``package.module:attr`` → a module: attr is a Module, or a callable that returns one.
    The module is found from the current folder first, as ``python -m`` finds it (the
    console script's own folder is the one Python puts first)."""
    module_name, _, attribute = spec.partition(":")
    if not attribute:
        raise SystemExit(f"factory must be module:callable, got {spec!r}")
    if "" not in sys.path and os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        imported = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        missing = exc.name or ""
        if module_name == missing or module_name.startswith(missing + "."):
            raise SystemExit(
                f"cannot import {module_name!r} for {spec}: {exc} (run from the folder that "
                "holds it, or install it into this environment)"
            ) from None
        raise SystemExit(
            f"importing {module_name!r} for {spec} failed: {exc}, which it imports (install it "
            "into this environment)"
        ) from None
    if not hasattr(imported, attribute):
        raise SystemExit(f"{module_name} has no {attribute!r} (from {spec})")
    target = getattr(imported, attribute)
    if isinstance(target, torch.nn.Module):
        module = target
    else:
        if not callable(target):
            raise SystemExit(
                f"{spec} is a {type(target).__name__}: name a torch.nn.Module, or a callable "
                "that returns one"
            )
        try:
            inspect.signature(target).bind()
        except TypeError as exc:  # what calling it would say, before anything of it runs
            raise SystemExit(
                f"{spec} must be callable with no arguments (a factory that builds the module, "
                f"e.g. def make_model(): return Net(width=64)), but: {exc}"
            ) from None
        except ValueError:  # no signature to read (a builtin): calling it will tell
            pass
        module = target()
    if not isinstance(module, torch.nn.Module):
        raise SystemExit(f"{spec} gave {type(module).__name__}, not a torch.nn.Module")
    return module


def parse_tensor(text: str) -> TensorConfig:
    """``name:DTYPE:d1,d2`` → TensorConfig (shape without batch dim); ``name:DTYPE`` (or
    ``name:DTYPE:``) is one value a row; ``name:DTYPE:d1:LOW..HIGH`` adds the values it may take
    (inclusive), refused outside with a 400."""
    try:
        name, datatype, *rest = text.split(":")
        dims, *bounds = rest or [""]
        shape = tuple(int(d) for d in dims.split(",") if d)
        spec: dict[str, Any] = {"name": name, "datatype": datatype, "shape": shape}
        if bounds:
            (span,) = bounds
            low, high = span.split("..")
            spec["range"] = (float(low), float(high))
        return TensorConfig.model_validate(spec)
    except pydantic.ValidationError as exc:
        raise SystemExit(
            f"tensor {text!r}: {describe_validation_error(exc, TensorConfig)}"
        ) from None
    except ValueError as exc:
        raise SystemExit(
            f"tensor must be NAME:DTYPE:D1,D2,...[:LOW..HIGH] (got {text!r}): {exc}"
        ) from None


def check_tensors(inputs: list[TensorConfig], outputs: list[TensorConfig], buckets: str) -> None:
    """What the command line's tensors must be together: each name once, and buckets only for
    dynamic dims (SystemExit saying what is wrong)."""
    names = [t.name for t in (*inputs, *outputs)]
    if twice := sorted({n for n in names if names.count(n) > 1}):
        raise SystemExit(f"tensor names must differ: {twice} named more than once")
    if buckets.strip() and not any(-1 in t.shape for t in inputs):
        raise SystemExit(
            f"--buckets {buckets}: no input has a dynamic (-1) dim for them to size (e.g. "
            "--input ids:INT64:-1)"
        )


def golden_input(spec: TensorConfig, rows: int, seed: int, length: int = 8) -> np.ndarray:
    """Fixed pseudo-random inputs for parity checks (dynamic dims take ``length``), within the
    input's declared range, both of its ends among them (ids 20..69 of a table indexed by
    ``ids - 20``: ids from 0 failed the module, and parity was checked on inputs the server
    would refuse)."""
    rng = np.random.default_rng(seed)
    shape = ((rows,) if rows else ()) + tuple(length if d == -1 else d for d in spec.shape)
    dtype = TO_NUMPY[spec.datatype]
    if spec.range is not None and dtype.kind in "iuf":
        low, high = spec.range
        values: np.ndarray
        if dtype.kind == "f":
            values = rng.uniform(low, high, shape)
        else:
            values = rng.integers(int(low), int(high), shape, endpoint=True)
        if values.size >= 2:
            values.flat[0], values.flat[-1] = low, high
        return values.astype(dtype)
    if dtype.kind == "f":
        return rng.standard_normal(shape).astype(dtype)
    if dtype.kind == "b":
        return rng.integers(0, 2, shape).astype(dtype)
    return rng.integers(0, 10, shape).astype(dtype)
