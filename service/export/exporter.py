"""PyTorch module → the model repository's artifacts, with proof that they agree.

:func:`export_model` writes any of ``model.onnx`` (ONNX, through ``torch.export`` and the dynamo
exporter), ``model.pt2`` (an AOTInductor package compiled from ``torch.export``, for the device it
is exported on and a portable CPU target) and ``model.pt`` (TorchScript, deprecated upstream)
into a version folder. It replays fixed golden inputs, and the same rows at the smallest and
largest batch and length, through eager PyTorch and each artifact, and refuses (``ExportError``,
naming the max abs/rel error) when they disagree beyond tolerance. It then writes ``golden.npz``
and ``manifest.json``, which the server's load gates check. Imported only by ``tensorgate
export`` and build scripts: the server never needs it.
"""

from __future__ import annotations

import contextlib
import copy
import datetime
import functools
import inspect
import logging
import mimetypes
import platform
import re
import shutil
import tempfile
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, ParamSpec

import numpy as np
import torch
from torch.export import Dim, ExportedProgram

from preprocessing.pipeline import BadInput, Item, Models, Pipeline, answer_one
from preprocessing.spec import PreprocessingSpec, PythonSpec, TextSpec, spec_hash
from service.artifacts import cpu_targets
from service.artifacts.code import CodeFacts, code_facts, plain
from service.artifacts.manifest import (
    GOLDEN,
    MANIFEST,
    Manifest,
    Tolerance,
    aside_prefix,
    read_manifest,
    unfinished_export,
)
from service.artifacts.shapes import ShapeFacts, guess_axes
from service.core.validation import check_made
from service.datatypes import TO_NUMPY
from service.errors import ModelLoadError, TensorgateError
from service.export import shapes as export_shapes
from service.model_config import TensorConfig
from service.pipelines.code import last_frame, load_pipeline
from service.pipelines.inputs import check_names
from service.runtimes.base import Signature, shape_fits
from service.runtimes.pt2 import CPU_FLAGS_KEY, CPU_KEY, TORCH_KEY, package_needs
from service.runtimes.pt2_probe import outputs_in_child
from service.runtimes.torchscript import training_refusal

log = logging.getLogger("tensorgate.export")
P = ParamSpec("P")
DEFAULT_OPSET = 18  # the dynamo exporter's own; a lower one goes through onnx's version converter
FORMATS = ("onnx", "pt2", "torchscript")
ANSWERS = "answers"
"""The version folder's copy of a ``kind: python`` pipeline's raw golden items."""
DEFAULT_FORMATS = ("onnx", "pt2")
"""What ``tensorgate export`` writes unless told otherwise: the portable graph (no torch at serve
time, any onnxruntime device) and torch's own compiled package. TorchScript only when asked:
upstream deprecated it in favour of ``torch.export``."""
PT2_ARTIFACT = "model.pt2"
WRITTEN = ("model.onnx", PT2_ARTIFACT, "model.pt", MANIFEST, GOLDEN, ANSWERS)
"""What an export writes into its version folder (a text spec's tokenizer is put there by the
caller, before)."""

Probe = dict[str, np.ndarray]
Runner = Callable[[Probe], dict[str, np.ndarray]]


class ExportError(RuntimeError):
    """The module cannot be exported faithfully; the message says where it diverged."""


@dataclass
class _Job:
    """What every format's step needs: the module, the probes and their eager outputs."""

    module: torch.nn.Module
    out_dir: Path
    inputs: Sequence[TensorConfig]
    outputs: Sequence[TensorConfig]
    max_batch_size: int
    opset: int
    tolerance: Tolerance
    probes: list[Probe]
    eager: list[dict[str, np.ndarray]]
    dynamic: tuple[dict[int, Any], ...]
    program: ExportedProgram | None
    not_exported: str
    device: str | None
    pt2_cpu: str
    odd: list[Probe] = field(default_factory=list)
    """Probes with a NaN or an infinity in a float input (:func:`_non_finite_probes`)."""
    odd_eager: list[dict[str, np.ndarray]] = field(default_factory=list)
    non_finite: dict[str, str] = field(default_factory=dict)
    """Each runtime (as :meth:`check` names it) that answers :attr:`odd` unlike eager PyTorch,
    with how."""

    def check(self, what: str, run: Runner, odd_run: Runner | None = None) -> dict[str, float]:
        """The worst abs/rel error of ``run`` against eager PyTorch over every probe; then
        :attr:`odd` (through ``odd_run``, else ``run``), each run after the probes, whose
        disagreement is noted in :attr:`non_finite`, not refused."""
        pairs = zip(self.probes, self.eager, strict=True)
        results = [_compare(what, want, run(probe), self.tolerance) for probe, want in pairs]
        odd_run = odd_run or run
        for probe, want in zip(self.odd, self.odd_eager, strict=True):
            try:
                why = _non_finite_difference(probe, want, odd_run(probe), what)
            except Exception as exc:  # eager answered it: a request would fail here
                why = f"{what} fails where eager PyTorch answers: {_first_line(exc)}"
            if why and what not in self.non_finite:
                self.non_finite[what] = why
        return {k: max(r[k] for r in results) for k in ("max_abs", "max_rel")}


RUNS_AS = {"onnx": "onnxruntime", "pt2": "AOTInductor", "torchscript": "TorchScript"}
"""Each format's runtime, as :meth:`_Job.check` is told it."""


def _non_finite_probes(
    probe: Probe, inputs: Sequence[TensorConfig], outputs: Sequence[TensorConfig], module: Any
) -> tuple[list[Probe], list[dict[str, np.ndarray]]]:
    """For each float input without a range (a request may send it NaN or an infinity, and
    is answered): ``probe`` with that input's first value NaN, and with it +inf; and eager
    PyTorch's answers, from a copy of ``module`` (one may change itself on such a value; a probe
    eager fails on is left out)."""
    odd: list[Probe] = []
    answers: list[dict[str, np.ndarray]] = []
    floats = [t for t in inputs if t.range is None and probe[t.name].dtype.kind == "f"]
    if not floats:
        return odd, answers
    try:
        eager_run = partial(_run_module, copy.deepcopy(module), inputs, outputs)
    except Exception:  # a module that cannot be copied: not probed
        log.debug("non-finite inputs not probed: the module cannot be copied")
        return odd, answers
    for tensor in floats:
        for value in (np.nan, np.inf):
            changed = {name: array.copy() for name, array in probe.items()}
            changed[tensor.name].flat[0] = value
            try:
                answers.append(eager_run(changed))
            except Exception:  # eager refuses it: nothing to compare
                continue
            odd.append(changed)
    return odd, answers


def _non_finite_difference(
    probe: Probe, eager: Mapping[str, np.ndarray], served: Mapping[str, np.ndarray], what: str
) -> str:
    """How ``served`` answers ``probe`` (a NaN or an infinity in one input) unlike ``eager``:
    another set of non-finite values in a float output; "" when alike."""
    for name, want in eager.items():
        got = np.asarray(served[name])
        if want.dtype.kind != "f" or got.shape != want.shape:
            continue
        alike = all(
            np.array_equal(test(want), test(got)) for test in (np.isnan, np.isposinf, np.isneginf)
        )
        if not alike:
            given, value = next(
                (n, a.flat[0])
                for n, a in probe.items()
                if a.dtype.kind == "f" and not np.isfinite(a.flat[0])
            )
            return (
                f"{value} in input '{given}' makes {int((~np.isfinite(want)).sum())} of output "
                f"'{name}''s values NaN or infinite in eager PyTorch, "
                f"{int((~np.isfinite(got)).sum())} in {what}"
            )
    return ""


Artifact = tuple[str, dict[str, float], dict[str, str | None]]
"""A format's file name in the version folder, its parity, and versions for the manifest."""


def _undone_on_failure(export: Callable[P, Manifest]) -> Callable[P, Manifest]:
    """``export``, whose failure takes back what it wrote, and keeps what was there: a failed
    export left a version folder of a ``model.onnx`` and no manifest or config, which the
    server then skipped or refused. The files an export writes (:data:`WRITTEN`) are moved
    aside first and put back on failure (deleted on success: an artifact not made again is
    not left beside a manifest that does not name it); what the export made besides is
    removed, with ``out_dir`` and its model folder when it made them (the model folder only
    when empty: another version's export may be writing there)."""
    signature = inspect.signature(export)

    def undone(*args: P.args, **kwargs: P.kwargs) -> Manifest:
        out_dir = Path(signature.bind(*args, **kwargs).arguments["out_dir"])
        made = [folder for folder in (out_dir.parent, out_dir) if not folder.exists()]
        out_dir.parent.mkdir(parents=True, exist_ok=True)
        aside = Path(tempfile.mkdtemp(prefix=aside_prefix(out_dir), dir=out_dir.parent))
        failed = True
        try:
            for name in WRITTEN:
                if (out_dir / name).exists():
                    (out_dir / name).rename(aside / name)
            before = set(out_dir.rglob("*")) if out_dir.exists() else set()
            try:
                manifest = export(*args, **kwargs)
            except BaseException:
                _take_back(out_dir, before, out_dir in made)
                for kept in aside.iterdir():  # what the failed export had replaced
                    kept.rename(out_dir / kept.name)
                raise
            failed = False
            return manifest
        finally:
            shutil.rmtree(aside, ignore_errors=True)
            if not failed:  # what exports of it that never finished set aside is obsolete now
                while (stale := unfinished_export(out_dir)) is not None:
                    shutil.rmtree(stale, ignore_errors=True)
            if failed and out_dir.parent in made:  # empty unless another export writes there
                with contextlib.suppress(OSError):
                    out_dir.parent.rmdir()

    functools.update_wrapper(undone, export)  # its name, docs and signature
    return undone


def _take_back(out_dir: Path, before: set[Path], made: bool) -> None:
    """Remove what a failed export made: ``out_dir`` itself when it ``made`` it, else the paths
    under it that are not in ``before``."""
    if made:
        shutil.rmtree(out_dir, ignore_errors=True)
        return
    for path in sorted(set(out_dir.rglob("*")) - before, key=lambda p: len(p.parts), reverse=True):
        _remove(path)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


@_undone_on_failure
def export_model(
    module: torch.nn.Module,
    out_dir: Path,
    *,
    name: str,
    inputs: Sequence[TensorConfig],
    outputs: Sequence[TensorConfig],
    golden_inputs: Mapping[str, np.ndarray] | None,
    max_batch_size: int,
    preprocessing: PreprocessingSpec | None = None,
    answer_items: Sequence[Path] = (),
    code_folder: Path | None = None,
    models: Models | None = None,
    opset: int = DEFAULT_OPSET,
    tolerance: Tolerance | None = None,
    metrics: Mapping[str, float] | None = None,
    formats: Sequence[str] = DEFAULT_FORMATS,
    required: Sequence[str] = (),
    buckets: Sequence[int] = (),
    device: str | None = None,
    pt2_cpu: str | None = None,
) -> Manifest:
    """Export ``module`` into ``out_dir`` (a version folder) and return the manifest written.

    A format that fails (``torch.export`` refuses the module, or the artifact disagrees with
    eager PyTorch) is left out, with why in the log and the manifest's ``skipped``; ExportError
    when one of ``required`` fails, or every format does. ``buckets`` are the sizes each
    dynamic (-1) dim is warmed and padded to (a text spec's buckets when empty; needed when an
    input has a dynamic dim); ``device`` is where the ``pt2`` package will run (default: CUDA
    when torch sees it, else the CPU); ``pt2_cpu`` the CPU it is compiled for
    (:mod:`service.artifacts.cpu_targets`; default ``x86-64-v3`` on x86-64).

    With a ``kind: python`` ``preprocessing``, the code (in the model's folder, ``out_dir``'s
    parent, where the server imports it from; ``code_folder``, when given, must be that
    folder) is hashed into the manifest, and each of ``answer_items``
    (raw item files, at least one) is copied into the version folder with the answer the eager
    pipeline gives it, which the server replays at load. ``golden_inputs`` may then be None:
    the items' preprocessed batch is the golden input. ``models``: what the pipeline's
    ``self.models`` calls at export (e.g. :class:`~preprocessing.pipeline.LocalModels` over the
    eager step modules); the server replays the answers against its own served models.
    """
    unknown = sorted(set(formats) - set(FORMATS))
    if unknown:
        raise ExportError(f"unknown formats {unknown}: choose from {', '.join(FORMATS)}")
    if bf16 := [t.name for t in (*inputs, *outputs) if t.datatype == "BF16"]:
        # The parity checks compare in numpy, which has no bfloat16 (the server holds BF16 as
        # bit patterns, service/datatypes.py).
        raise ExportError(
            f"tensors {bf16} are BF16, which the server serves but `export` does not check: "
            "export with FP32 tensors (and cast inside the module), or serve a BF16 ONNX model "
            "from its own folder"
        )
    _check_input_order(module, inputs)
    pt2_cpu = pt2_cpu or cpu_targets.default_target()
    try:
        cpu_targets.check_target(pt2_cpu)
    except ValueError as exc:
        raise ExportError(str(exc)) from None
    if not buckets and isinstance(preprocessing, TextSpec):
        buckets = preprocessing.buckets
    buckets = tuple(sorted(set(buckets)))
    dynamic_inputs = [t.name for t in inputs if -1 in t.shape]
    if dynamic_inputs and not buckets:
        raise ExportError(
            f"inputs {dynamic_inputs} have dynamic (-1) dims: name the sizes to serve them at "
            "with buckets (--buckets 64,128,256), which the server warms, pads to where padding "
            "leaves the answer unchanged, and bounds (a larger size is refused)"
        )
    tolerance = tolerance or Tolerance()
    out_dir.mkdir(parents=True, exist_ok=True)
    module = _prepare(module)
    code = None
    if isinstance(preprocessing, PythonSpec):
        if code_folder is not None and code_folder.resolve() != out_dir.parent.resolve():
            raise ExportError(  # it exported, and every load then failed: "cannot read x.py"
                f"code_folder {code_folder} is not the model's folder ({out_dir.parent}, the "
                "version folder's parent), where the server imports the code from: put the "
                "code there, or export with `tensorgate export`, which copies it"
            )
        code = _code(preprocessing, code_folder or out_dir.parent, name, answer_items)
        try:
            check_names(code.pipeline, inputs, outputs, classifies=False)
        except ModelLoadError as exc:
            raise ExportError(str(exc)) from None
        if models is not None:
            code.pipeline.models = models
        if golden_inputs is None:
            golden_inputs = code.golden_inputs(
                Signature(tuple(inputs), tuple(outputs)), max_batch_size > 0
            )
    if golden_inputs is None:
        raise ExportError("golden_inputs are needed (only a kind: python pipeline makes them)")
    golden = {t.name: np.ascontiguousarray(golden_inputs[t.name]) for t in inputs}
    probes = [golden, *_shape_probes(golden, inputs, max_batch_size, buckets)]
    eager_run = partial(_run_module, module, inputs, outputs)
    if code is not None:
        code.try_items(eager_run, max_batch_size > 0)
    try:
        eager = [eager_run(p) for p in probes]
    except ExportError:
        raise
    except Exception as exc:  # the module's own error, of any type: the inputs do not fit it
        given = ", ".join(f"{n} {a.dtype} {list(a.shape)}" for n, a in probes[0].items())
        if (
            isinstance(exc, IndexError)
            and "out of range" in str(exc)
            and (
                ranged := [  # inputs whose golden values reach an end of their declared range
                    f"{t.name} {t.range[0]:g}..{t.range[1]:g}"
                    for t in inputs
                    if t.range and np.isin(t.range, probes[0][t.name]).any()
                ]
            )
        ):
            given += (
                f"; values at an end of their declared range, {', '.join(ranged)}: a range "
                "wider than a table the module indexes, such as an nn.Embedding's rows, fails so"
            )
        raise ExportError(
            f"the module fails on inputs of the declared shapes and datatypes ({given}): "
            f"{type(exc).__name__}: {_first_line(exc)} (check --input)"
        ) from exc
    for answered in eager:
        _check_output_shapes(answered, outputs, max_batch_size > 0)
    if max_batch_size > 1:
        _check_rows_alone(eager_run, golden, eager[0], tolerance)
    dynamic = _dynamic_shapes(inputs, max_batch_size, buckets)
    program, not_exported = _exported_program(module, _tensors(probes[-1], inputs), dynamic)
    if program is None and _recurrent(module) and dynamic_inputs:
        not_exported += (
            " (torch.export unrolls nn.LSTM, nn.GRU and nn.RNN over the time steps, so it cannot "
            "keep their length dynamic: pytorch/pytorch#115092; the ONNX artifact keeps the "
            "recurrent op)"
        )
    batched = max_batch_size > 0
    shapes = _shape_facts(
        program, eager_run, probes, eager, inputs, outputs, batched, buckets, tolerance
    )
    inputs = _with_ranges(module, program, probes[0], inputs)
    if program is not None:
        _warn_of_unbounded_indexes(program, inputs)
    job = _Job(
        module,
        out_dir,
        inputs,
        outputs,
        max_batch_size,
        opset,
        tolerance,
        probes,
        eager,
        dynamic,
        program,
        not_exported,
        device,
        pt2_cpu,
    )
    job.odd, job.odd_eager = _non_finite_probes(probes[0], inputs, outputs, module)
    versions = _versions()
    artifacts: dict[str, str] = {}
    parity: dict[str, dict[str, float]] = {}
    skipped: dict[str, str] = {}
    for fmt in formats:
        try:
            artifact, parity[fmt], made = _STEPS[fmt](job)
        except Exception as exc:  # each exporter and runtime raises its own types
            reason = str(exc) if isinstance(exc, ExportError) else _first_line(exc)
            if fmt in required:
                raise ExportError(f"{fmt}: {reason}") from exc
            log.warning("%s left out: %s", fmt, reason)
            skipped[fmt] = reason
            parity.pop(fmt, None)
            continue
        artifacts[fmt] = artifact
        versions.update(made)
    if not artifacts:
        hint = ""
        if "torchscript" not in formats and any(_DATA_DEPENDENT in r for r in skipped.values()):
            hint = (
                "; a branch on a tensor's values stops torch.export, and tracing keeps only the "
                "branch its example took: --formats torchscript scripts the module and keeps "
                "each branch (or write the branch with torch.cond)"
            )
        raise ExportError(
            "no format could be exported: "
            + "; ".join(f"{f}: {r}" for f, r in skipped.items())
            + hint
        )

    non_finite = {f: job.non_finite[RUNS_AS[f]] for f in artifacts if RUNS_AS[f] in job.non_finite}
    for fmt, why in non_finite.items():
        log.warning(
            "%s answers non-finite inputs unlike eager PyTorch (%s): served from it, its float "
            "inputs take finite values only (a NaN or an infinity is a 400)",
            fmt,
            why,
        )
    answers = code.answers(eager_run, out_dir, max_batch_size > 0) if code else []
    arrays = {f"input.{k}": v for k, v in golden.items()}
    arrays.update({f"output.{k}": v for k, v in eager[0].items()})
    np.savez(out_dir / GOLDEN, allow_pickle=False, **arrays)
    manifest = Manifest(
        name=name,
        max_batch_size=max_batch_size,
        inputs=tuple(inputs),
        outputs=tuple(outputs),
        dynamic_axes=_dynamic_axes([*inputs, *outputs], max_batch_size),
        opset=_opset(out_dir / "model.onnx") if "onnx" in artifacts else None,
        versions=versions,
        artifacts=artifacts,
        skipped=skipped,
        shapes=shapes,
        preprocessing=preprocessing.model_dump(mode="json") if preprocessing else None,
        preprocessing_hash=spec_hash(preprocessing) if preprocessing else None,
        code=code.facts.as_json() if code else None,
        answers=answers,
        tolerance=tolerance,
        parity=parity,
        non_finite=non_finite,
        metrics=dict(metrics or {}),
        created=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    )
    (out_dir / MANIFEST).write_text(manifest.model_dump_json(indent=2) + "\n")
    log.debug("exported %s to %s: parity %s", name, out_dir, parity)
    _warn_of_versions_with_other_code(out_dir.parent, out_dir, manifest)
    return manifest


def other_versions(model_dir: Path, out_dir: Path) -> Iterator[tuple[Path, Manifest]]:
    """The model's other version folders that have a readable manifest, with it (one that
    does not is not this export's to judge: the server says why at load)."""
    for version in sorted(p for p in model_dir.iterdir() if p.is_dir() and p.name.isdigit()):
        if version == out_dir:
            continue
        try:
            other = read_manifest(version)
        except ModelLoadError:
            continue
        if other is not None:
            yield version, other


def _warn_of_versions_with_other_code(model_dir: Path, out_dir: Path, manifest: Manifest) -> None:
    """A model's code lives in its folder, shared by its versions: say which of the others
    were exported with other code, which the server now refuses to load."""
    if manifest.code is None:
        return
    files = manifest.code.get("files", {})
    for version, other in other_versions(model_dir, out_dir):
        if other.code is None:
            continue
        changed = sorted(
            name
            for name in {*files, *other.code.get("files", {})}
            if files.get(name) != other.code.get("files", {}).get(name)
        )
        if changed:
            log.warning(
                "version %s of %s was exported with other code (%s): the code in the model's "
                "folder is its versions' alike, so the server now refuses to load version %s "
                "(export it again, or serve its code from another model folder)",
                version.name,
                model_dir.name,
                ", ".join(changed),
                version.name,
            )


@dataclass
class _Code:
    """A ``kind: python`` pipeline at export: its facts, the pipeline, and its raw items."""

    facts: CodeFacts
    pipeline: Pipeline
    items: list[tuple[Path, str | None]]

    def golden_inputs(self, signature: Signature, batched: bool) -> dict[str, np.ndarray]:
        """The items' preprocessed batch (the first item's, where items make different shapes),
        as the golden inputs of the artifact's own parity gate; refused as the server would
        refuse it when it does not fit the model's inputs (names, datatypes, shapes)."""
        items = [Item(path.read_bytes(), kind) for path, kind in self.items]
        try:
            try:
                batch = self.pipeline.preprocess_batch(items, [{} for _ in items])
            except BadInput:
                batch = self.pipeline.preprocess_batch(items[:1], [{}])
        except Exception as exc:  # the code's own: one line naming it, not a traceback
            raise ExportError(
                f"the pipeline's preprocessing failed on {self.items[0][0]}: "
                f"{type(exc).__name__}: {exc}{last_frame(exc)}"
            ) from exc
        try:
            check_made(batch, signature, True, "")  # the batch of items: batched here
        except TensorgateError as exc:
            said = exc.message.removeprefix("model '': ")
            made = len(next(iter(batch.values()), ()))  # the items the batch holds
            of = self.items[0][0] if made == 1 else f"its {made} answer items"
            raise ExportError(
                f"the pipeline's preprocessing of {of}: {said} (check its preprocess, and --input)"
            ) from None
        return batch if batched else {name: array[0] for name, array in batch.items()}

    def try_items(self, run: Runner, batched: bool) -> None:
        """Each item through the eager pipeline, before any artifact is compiled: a pipeline
        that fails on one is said at once, not after ONNX and pt2 were made (25 s)."""
        for path, kind in self.items:
            self._answer(path, Item(path.read_bytes(), kind), run, batched)

    def _answer(self, path: Path, item: Item, run: Runner, batched: bool) -> Any:
        try:
            return answer_one(self.pipeline, item, run, batched)
        except Exception as exc:
            raise ExportError(
                f"the pipeline failed on {path}: {type(exc).__name__}: {exc}{last_frame(exc)}"
            ) from exc

    def answers(self, run: Runner, out_dir: Path, batched: bool) -> list[dict[str, Any]]:
        """Each item copied into ``out_dir``/answers with the eager pipeline's answer."""
        folder = out_dir / ANSWERS
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir()
        pairs = []
        for index, (path, kind) in enumerate(self.items):
            kept = folder / f"{index}-{path.name}"
            shutil.copyfile(path, kept)
            answer = self._answer(path, Item(kept.read_bytes(), kind), run, batched)
            pairs.append(
                {
                    "file": kept.relative_to(out_dir).as_posix(),
                    "content_type": kind,
                    "answer": plain(answer),
                }
            )
        return pairs


def _code(spec: PythonSpec, folder: Path, name: str, items: Sequence[Path]) -> _Code:
    if not items:
        raise ExportError(
            "a kind: python pipeline needs raw items to record its end-to-end answers "
            "(answer_items, --answer-items FILE...)"
        )
    try:
        facts = code_facts(spec, folder)
    except ModelLoadError as exc:
        said = str(exc)
        if spec.package is None and not (folder / f"{spec.module.replace('.', '/')}.py").is_file():
            said += (
                f"; export_model imports a kind: python pipeline's code from the model's "
                f"folder ({folder}, the version folder's parent) and copies nothing: put the "
                "code there first (`tensorgate export --preprocessing spec.yaml` copies it from "
                "beside the spec)"
            )
        raise ExportError(said) from None
    try:
        pipeline = load_pipeline(spec, folder, name)
    except ModelLoadError as exc:
        raise ExportError(str(exc)) from None
    try:
        pipeline.warm()
    except Exception as exc:
        raise ExportError(
            f"the pipeline's warm() failed: {type(exc).__name__}: {exc}{last_frame(exc)}"
        ) from exc
    return _Code(facts, pipeline, [(Path(i), mimetypes.guess_type(str(i))[0]) for i in items])


def _warn_of_unbounded_indexes(program: ExportedProgram, inputs: Sequence[TensorConfig]) -> None:
    """Say which inputs reach an index no range bounds: served without one, onnxruntime reads
    a negative id as counting from the end (another row, where PyTorch refuses it) and fails a
    request whose id is past the table."""
    declared = {t.name for t in inputs if t.range is not None}
    for name, how in export_shapes.unproven_indexes(program, inputs).items():
        if name not in declared:
            log.warning(
                "input '%s' reaches an index (%s) whose bounds export cannot prove: declare the "
                "values it may take (--input %s:DTYPE:DIMS:LOW..HIGH), or the server takes any "
                "(from model.onnx a negative one reads a row counted from the end, where "
                "PyTorch refuses it; one past the table fails its request)",
                name,
                how,
                name,
            )


def _pt2_step(job: _Job) -> Artifact:
    program = job.program
    if program is None:
        raise ExportError(
            f"{job.not_exported}; make the module exportable, or leave pt2 out of the formats"
        )
    declared = {t.name for t in job.inputs if t.range is not None}
    unproven = {
        name: how
        for name, how in export_shapes.unproven_indexes(program, job.inputs).items()
        if name not in declared
    }
    if unproven:
        name, how = next(iter(unproven.items()))
        raise ExportError(
            f"input '{name}' reaches an index ({how}) whose bounds export cannot prove, and a "
            "compiled model.pt2 kernel aborts the whole process on an out-of-range index: "
            f"declare the values it may take (--input {name}:DTYPE:DIMS:LOW..HIGH, refused "
            "outside with a 400) or leave pt2 out of the formats"
        )
    device = job.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device != "cpu":  # compiled where its weights and inputs are
        example = tuple(t.to(device) for t in _tensors(job.probes[-1], job.inputs))
        moved = copy.deepcopy(job.module).to(device)
        program, not_exported = _exported_program(moved, example, job.dynamic)
        if program is None:
            raise ExportError(not_exported)
    path = job.out_dir / PT2_ARTIFACT
    versions = _export_pt2(program, path, job.pt2_cpu)
    signature = Signature(tuple(job.inputs), tuple(job.outputs))
    try:  # in a child: a package's kernel can abort the process that runs it
        answers = iter(outputs_in_child(path, job.probes, signature, device))
    except BaseException as exc:
        path.unlink(missing_ok=True)  # not left beside a manifest that does not name it
        if isinstance(exc, ModelLoadError):
            raise ExportError(f"the AOTInductor package: {exc}") from None
        raise
    try:  # a child of their own: one that dies on a NaN leaves the package served on numbers
        odd = iter(outputs_in_child(path, job.odd, signature, device) if job.odd else [])
    except ModelLoadError as exc:
        job.non_finite["AOTInductor"] = f"it fails on a NaN or an infinity: {exc}"
        odd = iter([])
    parity = job.check("AOTInductor", lambda _: next(answers), lambda _: next(odd))
    return PT2_ARTIFACT, parity, versions


def _onnx_step(job: _Job) -> Artifact:
    path = job.out_dir / "model.onnx"
    fallback = job.not_exported if job.program is None else None
    parity: dict[str, float] = {}
    try:
        if job.program is not None:
            _export_onnx_dynamo(job.program, path, job.inputs, job.outputs, job.opset)
            parity = job.check("onnxruntime", partial(_run_onnx, path))
    except Exception as exc:  # the exporter, onnxruntime and the check raise many types
        fallback = f"the dynamo exporter failed: {_first_line(exc)}"
    versions: dict[str, str | None] = {
        "onnx_exporter": "dynamo" if fallback is None else "torchscript"
    }
    if fallback is not None:
        log.warning("ONNX: %s; using the TorchScript-based exporter instead", fallback)
        versions["onnx_exporter_fallback"] = fallback
        _export_onnx(
            job.module, job.probes[0], path, job.inputs, job.outputs, job.max_batch_size, job.opset
        )
        parity = job.check("onnxruntime", partial(_run_onnx, path))
    return "model.onnx", parity, versions


def _torchscript_step(job: _Job) -> Artifact:
    log.warning(
        "writing TorchScript (model.pt): torch deprecated it in favour of torch.export; "
        "serve model.pt2 (backend: pt2) or model.onnx instead (docs/models.md)"
    )
    path = job.out_dir / "model.pt"
    scripted = _export_torchscript(job.module, _tensors(job.probes[0], job.inputs), path)
    run = partial(_run_module, scripted, job.inputs, job.outputs)
    return "model.pt", job.check("TorchScript", run), {}


_STEPS: dict[str, Callable[[_Job], Artifact]] = {
    "onnx": _onnx_step,
    "pt2": _pt2_step,
    "torchscript": _torchscript_step,
}


def _recurrent(module: torch.nn.Module) -> bool:
    return any(isinstance(m, torch.nn.RNNBase) for m in module.modules())


def _shape_facts(
    program: ExportedProgram | None,
    eager_run: Runner,
    probes: list[Probe],
    eager: list[dict[str, np.ndarray]],
    inputs: Sequence[TensorConfig],
    outputs: Sequence[TensorConfig],
    batched: bool,
    buckets: tuple[int, ...],
    tolerance: Tolerance,
) -> ShapeFacts | None:
    """The dynamic dims' axes and ranges, the output dims that follow them, and whether
    padding to the buckets leaves the answer unchanged (:mod:`service.export.shapes`)."""
    if not any(-1 in t.shape for t in inputs):
        return None
    longest = max(buckets)
    if program is not None:
        found, batch_symbols = export_shapes.graph_axes(program, inputs, batched, longest)
        axes = tuple(found.values())
        follows, why = export_shapes.graph_follows(program, outputs, found, batch_symbols, batched)
    else:
        axes = tuple(a.model_copy(update={"max": longest}) for a in guess_axes(inputs, batched))
        real = probes[0][axes[0].dims[0][0]].shape[axes[0].dims[0][1]]
        large = (longest, eager[-1]) if len(probes) > 1 else (real, eager[0])
        follows, why = export_shapes.probed_follows(outputs, axes, (real, eager[0]), large, batched)
    for axis in axes:
        if below := [b for b in buckets if b < axis.min]:
            name, index = axis.dims[0]
            raise ExportError(
                f"buckets {below} are below the smallest size input '{name}' dim {index} takes "
                f"({axis.min}, as torch.export found)"
            )
    multiples: tuple[int, ...] = ()
    if not why:
        why, multiples = export_shapes.padding_verdict(
            eager_run, probes[0], axes, buckets, follows, tolerance
        )
    pad = bool(multiples)
    if pad:
        axes = tuple(
            axis.model_copy(update={"multiple": multiple})
            for axis, multiple in zip(axes, multiples, strict=True)
        )
    if strided := [axis for axis in axes if axis.multiple > 1]:
        log.warning(
            "padding changes this model's answer at some sizes (%s): it will be padded from "
            "multiples of %s, and take other sizes at exactly the buckets %s",
            why,
            ", ".join(
                f"{a.multiple} along input '{a.dims[0][0]}' dim {a.dims[0][1]}" for a in strided
            ),
            list(buckets),
        )
    if why and not pad:
        log.warning(
            "padding changes this model's answer (%s): it will be served at exactly the buckets %s",
            why,
            list(buckets),
        )
    return ShapeFacts(
        axes=axes, buckets=buckets, pad=pad, reason=why, follows=follows if pad else {}
    )


def _with_ranges(
    module: torch.nn.Module,
    program: ExportedProgram | None,
    golden: Probe,
    inputs: Sequence[TensorConfig],
) -> list[TensorConfig]:
    """The inputs with the value ranges the graph proves (an input's own range is kept). A
    module torch.export cannot keep dynamic is read at the golden inputs' static shapes."""
    if program is None:
        torch_log = logging.getLogger("torch")
        level = torch_log.level
        torch_log.setLevel(logging.CRITICAL)  # its second refusal, at length, says nothing new
        try:
            program, _ = _exported_program(module, _tensors(golden, inputs), None)
        finally:
            torch_log.setLevel(level)
    if program is None:
        return list(inputs)
    found = export_shapes.index_ranges(program, inputs)
    typed = [t for t in inputs if t.name in found and TO_NUMPY[t.datatype].kind in "iu"]
    ranged = {t.name: found[t.name] for t in typed if t.range is None}
    for name, (low, high) in ranged.items():
        log.info(
            "input '%s' indexes a table of %d rows: values outside [%d, %d] are refused",
            name,
            high + 1,
            low,
            high,
        )
    return [
        t.model_copy(update={"range": ranged[t.name]}) if t.name in ranged else t for t in inputs
    ]


def _prepare(module: torch.nn.Module) -> torch.nn.Module:
    training = [n or "(root)" for n, m in module.named_modules() if m.training]
    if training:
        warnings.warn(
            f"module was in training mode ({len(training)} submodules, e.g. {training[:3]}); "
            "exporting it in eval mode",
            stacklevel=3,
        )
    module.eval()
    for parameter in module.parameters():
        parameter.requires_grad_(False)
    return module


def _tensors(arrays: Probe, inputs: Sequence[TensorConfig]) -> tuple[torch.Tensor, ...]:
    return tuple(torch.from_numpy(arrays[t.name].copy()) for t in inputs)


def _shape_probes(
    golden: Probe, inputs: Sequence[TensorConfig], max_batch_size: int, buckets: Sequence[int]
) -> list[Probe]:
    """The golden rows at one row, and at ``max_batch_size`` rows padded (with zeros, as the
    server pads) to the longest bucket: every artifact must answer at both ends of its range.
    The last probe is the largest, the one that ``torch.export`` traces (a dim of size 1 would
    be taken for a constant)."""
    if max_batch_size < 2:
        return []
    longest = max(buckets, default=0)
    smallest: Probe = {}
    largest: Probe = {}
    for tensor in inputs:
        array = golden[tensor.name]
        smallest[tensor.name] = array[:1]
        rows = np.take(array, np.arange(max_batch_size) % len(array), axis=0)
        pad = [(0, 0)] + [
            (0, max(longest - n, 0)) if d == -1 else (0, 0)
            for d, n in zip(tensor.shape, array.shape[1:], strict=True)
        ]
        largest[tensor.name] = np.pad(rows, pad)
    return [smallest, largest]


def _dynamic_shapes(
    inputs: Sequence[TensorConfig], max_batch_size: int, buckets: Sequence[int]
) -> tuple[dict[int, Any], ...]:
    """torch.export's dims: the batch over 1..max_batch_size and each -1 dim up to the longest
    bucket. DYNAMIC (not AUTO): a module that pins a dim to its example's size is refused, not
    exported for that size alone; dims that must be equal (ids and mask) are found by torch.
    Each range reaches 3 at least: torch.export takes sizes 0 and 1 for constants, so a range
    that ends at 2, the traced size, conflicts with the one it infers (the server still sends
    no more than the config's sizes)."""
    longest = max(buckets, default=None)
    shapes = []
    for tensor in inputs:
        dims: dict[int, Any] = {}
        if max_batch_size > 1:
            dims[0] = Dim.DYNAMIC(min=1, max=max(max_batch_size, 3))
        offset = 1 if max_batch_size > 0 else 0
        for i, dim in enumerate(tensor.shape):
            if dim == -1:
                dims[i + offset] = Dim.DYNAMIC(
                    min=1, max=None if longest is None else max(longest, 3)
                )
        shapes.append(dims)
    return tuple(shapes)


def _exported_program(
    module: torch.nn.Module,
    example: tuple[torch.Tensor, ...],
    shapes: tuple[dict[int, Any], ...] | None,
) -> tuple[ExportedProgram | None, str]:
    """The module through ``torch.export``, or None and the first line of why it could not."""
    try:
        return torch.export.export(module, example, dynamic_shapes=shapes), ""
    except Exception as exc:  # torch.export raises many unrelated types for untraceable code
        return None, f"torch.export failed: {_first_line(exc)}{_user_line(exc)}"


def _export_pt2(program: ExportedProgram, path: Path, cpu: str) -> dict[str, str | None]:
    """Compile the AOTInductor package for ``cpu``; return what it needs to load, for the
    manifest."""
    from torch._inductor import aoti_compile_and_package

    metadata = {
        TORCH_KEY: torch.__version__,
        CPU_KEY: cpu,
        CPU_FLAGS_KEY: " ".join(sorted(cpu_targets.needed_flags(cpu))),
    }
    # Freezing folds the weights into the graph as constants and lays out the matrix products'
    # weights once, at compile time, for oneDNN; unfrozen, every call to MKL's sgemm packs the
    # weight matrix again, which costs more than the product for short inputs
    # (docs/performance.md#artifacts). Inductor freezes only where autograd is off.
    options = {"aot_inductor.metadata": metadata, "freezing": True}
    with torch.no_grad():
        aoti_compile_and_package(
            program,
            package_path=str(path),
            inductor_configs={**options, **cpu_targets.inductor_options(cpu)},
        )
    needs = package_needs(path)
    return {
        "pt2_device": needs.get("AOTI_DEVICE_KEY"),
        "pt2_cpu": cpu,
        "pt2_cpu_flags": needs.get(CPU_FLAGS_KEY),
        "pt2_cpu_isa": needs.get("AOTI_CPU_ISA") or None,
        "pt2_compute_capability": needs.get("AOTI_COMPUTE_CAPABILITY") or None,
    }


def _export_torchscript(
    module: torch.nn.Module, example: tuple[torch.Tensor, ...], path: Path
) -> torch.jit.ScriptModule:
    try:
        scripted = torch.jit.script(module)
    except Exception as exc:  # torch.jit raises many unrelated types for unscriptable code
        warnings.warn(
            f"torch.jit.script failed ({_first_line(exc)}); falling back to torch.jit.trace, "
            "which records one path through data-dependent control flow",
            stacklevel=3,
        )
        with torch.no_grad():
            scripted = torch.jit.trace(module, example)  # type: ignore[no-untyped-call]  # torch.jit is untyped
    scripted.save(str(path))  # type: ignore[no-untyped-call]  # torch.jit is untyped
    loaded: torch.jit.ScriptModule = torch.jit.load(str(path)).eval()  # type: ignore[no-untyped-call]  # torch.jit is untyped
    if refusal := training_refusal(path.name, loaded):  # what the server would refuse at load
        path.unlink()  # not left beside the formats that did export
        raise ExportError(refusal)
    return loaded


def _run_module(
    module: torch.nn.Module,
    inputs: Sequence[TensorConfig],
    outputs: Sequence[TensorConfig],
    arrays: Probe,
) -> dict[str, np.ndarray]:
    with torch.inference_mode():
        return _as_outputs(module(*_tensors(arrays, inputs)), outputs)


def _export_onnx_dynamo(
    program: ExportedProgram,
    path: Path,
    inputs: Sequence[TensorConfig],
    outputs: Sequence[TensorConfig],
    opset: int,
) -> None:
    # A warning for each torchvision operator it cannot register, and each optimiser pass at
    # INFO: nothing a user acts on.
    for name in ("torch.onnx._internal.exporter._registration", "onnxscript", "onnx_ir"):
        logging.getLogger(name).setLevel(logging.ERROR)
    torch.onnx.export(
        program,
        (),
        str(path),
        input_names=[t.name for t in inputs],
        opset_version=opset,
        dynamo=True,
        external_data=False,  # one self-contained file, as the version folder's layout expects
        verbose=False,
    )
    _name_outputs(path, [t.name for t in outputs])


def _name_outputs(path: Path, names: Sequence[str]) -> None:
    """Give the graph's outputs their declared names. The exporter's own output_names renames
    without looking, and an output called after an operator (``embedding``) then clashes with
    the value that operator's node already carries: that value is renamed first."""
    import onnx

    model = onnx.load(str(path))
    graph = model.graph
    renames = {o.name: new for o, new in zip(graph.output, names, strict=True) if o.name != new}
    taken = {n for node in graph.node for n in (*node.input, *node.output)}
    renames.update({new: f"{new}_inner" for new in renames.values() if new in taken})
    for node in graph.node:
        node.input[:] = [renames.get(n, n) for n in node.input]
        node.output[:] = [renames.get(n, n) for n in node.output]
    for value in (*graph.input, *graph.output, *graph.value_info, *graph.initializer):
        value.name = renames.get(value.name, value.name)
    onnx.save(model, str(path))


def _export_onnx(
    module: torch.nn.Module,
    golden: Probe,
    path: Path,
    inputs: Sequence[TensorConfig],
    outputs: Sequence[TensorConfig],
    max_batch_size: int,
    opset: int,
) -> None:
    """The TorchScript-based exporter, the fallback for what the dynamo exporter cannot do."""
    axes = _dynamic_axes([*inputs, *outputs], max_batch_size)
    with warnings.catch_warnings(), torch.no_grad():
        # Its deprecation warnings are why this is the fallback; the caller logged the reason.
        warnings.simplefilter("ignore")
        torch.onnx.export(
            module,
            _tensors(golden, inputs),
            str(path),
            input_names=[t.name for t in inputs],
            output_names=[t.name for t in outputs],
            dynamic_axes={k: dict(v) for k, v in axes.items()},
            opset_version=opset,
            dynamo=False,
        )


def _opset(path: Path) -> int:
    """The ai.onnx opset the file was written with."""
    import onnx

    model = onnx.load(str(path), load_external_data=False)
    return int(next(o.version for o in model.opset_import if o.domain in ("", "ai.onnx")))


_DATA_DEPENDENT = "data-dependent expression"
"""What torch.export says of a branch on a tensor's values (``if x.sum() > 0:``)."""
_RAISED_AT = re.compile(
    r'The following call raised this error:\n\s*File "([^"]+)", line (\d+), in (\S+)\n\s*(.*)'
)


def _user_line(exc: BaseException) -> str:
    """The module's own line that torch.export's message names, as ' at file:line in function
    (code)'; empty where it names none (its first line alone never does)."""
    found = _RAISED_AT.search(str(exc))
    if found is None:
        return ""
    path, line, function, code = found.groups()
    return f" at {Path(path).name}:{line} in {function} ({code.strip()})"


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _run_onnx(path: Path, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    import onnxruntime as ort

    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    names = [o.name for o in session.get_outputs()]
    return dict(zip(names, session.run(names, dict(inputs)), strict=True))


def _as_outputs(result: object, outputs: Sequence[TensorConfig]) -> dict[str, np.ndarray]:
    if isinstance(result, torch.Tensor):
        result = (result,)
    if isinstance(result, dict):
        result = tuple(result[t.name] for t in outputs)
    if not isinstance(result, (tuple, list)):
        raise ExportError(
            f"forward() must return {len(outputs)} tensor(s) (--output), got a "
            f"{type(result).__name__}"
        )
    if len(result) != len(outputs):
        raise ExportError(
            f"forward() returns {len(result)} value{'' if len(result) == 1 else 's'}; "
            f"{len(outputs)} output(s) are declared "
            f"({', '.join(t.name for t in outputs)})"
        )
    arrays = {}
    for spec, tensor in zip(outputs, result, strict=True):
        array = tensor.detach().cpu().numpy()
        if array.dtype != TO_NUMPY[spec.datatype]:
            raise ExportError(
                f"output '{spec.name}' is declared {spec.datatype}, "
                f"the module returns {array.dtype}"
            )
        arrays[spec.name] = array
    return arrays


def _check_output_shapes(
    made: Mapping[str, np.ndarray], outputs: Sequence[TensorConfig], batched: bool
) -> None:
    """Each output the module returned has the shape it is declared with (a -1 dim takes any
    size): a config that declares another shape would be refused by the server at load."""
    for spec in outputs:
        got = made[spec.name].shape
        row = got[1:] if batched else got
        if not shape_fits(((-1,) if batched else ()) + spec.shape, got):
            raise ExportError(
                f"output '{spec.name}' is declared {spec.datatype} {list(spec.shape)}"
                f"{' a row' if batched else ''}; the module returns {list(row)}"
                f"{' a row' if batched else ''} (fix --output, or the module)"
            )


def _compare(
    what: str,
    eager: Mapping[str, np.ndarray],
    served: Mapping[str, np.ndarray],
    tolerance: Tolerance,
) -> dict[str, float]:
    worst_abs = worst_rel = 0.0
    for name, want in eager.items():
        got = served[name]
        if got.shape != want.shape:
            raise ExportError(f"{what}: output '{name}' has shape {got.shape}, eager {want.shape}")
        error = np.abs(got.astype(np.float64) - want.astype(np.float64))
        scale = np.abs(want.astype(np.float64))
        max_abs = float(error.max(initial=0.0))
        max_rel = float((error / np.maximum(scale, 1e-12)).max(initial=0.0))
        worst_abs, worst_rel = max(worst_abs, max_abs), max(worst_rel, max_rel)
        if not np.all(error <= tolerance.atol + tolerance.rtol * scale):
            raise ExportError(
                f"{what} disagrees with eager PyTorch on output '{name}': max abs error "
                f"{max_abs:.3g}, max rel error {max_rel:.3g} (tolerance atol={tolerance.atol:g}, "
                f"rtol={tolerance.rtol:g})"
            )
    return {"max_abs": worst_abs, "max_rel": worst_rel}


def _check_input_order(module: torch.nn.Module, inputs: Sequence[TensorConfig]) -> None:
    """The inputs feed ``forward`` by position: one named as another of its parameters would
    feed that one's values to the other, and a client sending it by name get answers off with
    no error (``--input mask --input ids`` for ``forward(ids, mask)`` exported and served)."""
    try:
        parameters = inspect.signature(module.forward).parameters.values()
    except (TypeError, ValueError):  # a builtin or C++ forward: no names to read
        return
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    names = [p.name for p in parameters if p.kind in kinds]
    for position, tensor in enumerate(inputs):
        if tensor.name in names and names.index(tensor.name) != position:
            raise ExportError(
                f"input '{tensor.name}' is declared {_ordinal(position)}, and is forward()'s "
                f"{_ordinal(names.index(tensor.name))} parameter: the inputs feed "
                f"forward({', '.join(names)}) in the order they are declared, so declare them "
                "in that order (or name them otherwise)"
            )


def _ordinal(index: int) -> str:
    """0 → "first"."""
    words = ("first", "second", "third", "fourth", "fifth", "sixth", "seventh", "eighth")
    return words[index] if index < len(words) else f"number {index + 1}"


ROWS_ALONE = 4
"""Golden rows whose answers alone are compared with their answers among the others."""


def _check_rows_alone(
    run: Runner, golden: Probe, together: Mapping[str, np.ndarray], tolerance: Tolerance
) -> None:
    """Each golden row answered alone as it is among the others (in eager PyTorch), or
    ExportError. The server batches concurrent requests together and pads a batch with copies
    of its last row: a module whose rows depend on each other (statistics over the batch dim)
    would answer each client by the others' rows. The checks at one row and at
    ``max_batch_size`` rows compare the artifact with eager PyTorch at the same rows, and pass."""
    rows = len(next(iter(golden.values())))
    if rows < 2:
        return
    floor = Tolerance()  # a kernel for 3 rows and one for 1 differ in the last bits: not this
    atol, rtol = max(tolerance.atol, floor.atol), max(tolerance.rtol, floor.rtol)

    def worst(got: Mapping[str, np.ndarray], want: Mapping[str, np.ndarray]) -> tuple[str, float]:
        """The first output off ``want`` beyond the tolerance, and its largest error; ("", 0)."""
        for name, wanted in want.items():
            want64 = wanted.astype(np.float64)
            error = np.abs(got[name].astype(np.float64) - want64)
            if not np.all(error <= atol + rtol * np.abs(want64)):
                return name, float(np.nanmax(error))
        return "", 0.0

    if worst(run(golden), together)[0]:
        return  # answers one batch twice differently: refused at load, in those words
    for i in range(min(rows, ROWS_ALONE)):
        alone = run({name: array[i : i + 1] for name, array in golden.items()})
        name, error = worst({n: a[i : i + 1] for n, a in together.items()}, alone)
        if name:
            raise ExportError(
                f"each row must be answered as if it were alone, and the module's are not: "
                f"golden row {i}'s output '{name}' among the {rows} rows differs from its "
                f"output alone by up to {error:.3g}. The server batches concurrent requests "
                "together and pads a batch with copies of its last row, so one client's answer "
                "would depend on another's rows (statistics over the batch dim, such as "
                "x.mean(0), or a branch on the whole batch's values). Export it with "
                "--max-batch-size 0 (no batch dim), the rows a dim of its input"
            )


def _dynamic_axes(
    tensors: Sequence[TensorConfig], max_batch_size: int
) -> dict[str, dict[int, str]]:
    axes: dict[str, dict[int, str]] = {}
    offset = 1 if max_batch_size > 0 else 0
    for tensor in tensors:
        dims = {0: "batch"} if offset else {}
        for i, dim in enumerate(tensor.shape):
            if dim == -1:
                dims[i + offset] = f"{tensor.name}_{i + offset}"
        if dims:
            axes[tensor.name] = dims
    return axes


def _versions() -> dict[str, str | None]:
    versions: dict[str, str | None] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
    }
    for package in ("onnx", "onnxruntime"):
        try:
            versions[package] = __import__(package).__version__
        except ImportError:
            versions[package] = None
    return versions
