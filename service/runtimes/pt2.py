"""AOTInductor packages (``model.pt2``, from ``torch.export``) on libtorch.

The package is machine code compiled ahead of time for one torch release, one kind of device and
one CPU target (:mod:`service.artifacts.cpu_targets`): what it needs is read from the package
itself before it is loaded, and a package this process cannot run is refused with both sides
named, not left to fail in a kernel. Loading needs no compiler. Inputs, outputs, streams and
inference mode are :class:`~service.runtimes.libtorch.TorchRuntime`'s, as for TorchScript;
there is no module to put in eval mode: ``tensorgate export`` exported it in eval mode, and a
compiled graph has no ``training`` flag left to flip (nor CUDA graphs, which the config
refuses for pt2).
"""

from __future__ import annotations

import json
import logging
import os
import zipfile
from pathlib import Path

import torch
from torch._inductor.package import load_package  # type: ignore[attr-defined]  # not re-exported in its stubs

from service.artifacts.manifest import check_pt2
from service.datatypes import TO_NUMPY
from service.errors import ModelLoadError
from service.runtimes.base import Signature
from service.runtimes.libtorch import TorchRuntime

TORCH_KEY = "tensorgate.torch"
"""The package metadata key ``tensorgate export`` writes the compiling torch's version under."""
CPU_KEY = "tensorgate.cpu"
"""… the CPU target it compiled for (:mod:`service.artifacts.cpu_targets`) under."""
CPU_FLAGS_KEY = "tensorgate.cpu_flags"
"""… and the /proc/cpuinfo flags that target needs, space-separated."""
_METADATA_SUFFIX = "wrapper_metadata.json"


def package_needs(path: Path) -> dict[str, str]:
    """What a package says it needs, from its metadata file (read without loading it):
    ``AOTI_DEVICE_KEY``, ``AOTI_CPU_ISA``, ``AOTI_COMPUTE_CAPABILITY``, and what ``tensorgate
    export`` adds: ``tensorgate.torch``, ``tensorgate.cpu``, ``tensorgate.cpu_flags``."""
    try:
        with zipfile.ZipFile(path) as package:
            names = [n for n in package.namelist() if n.endswith(_METADATA_SUFFIX)]
            if not names:
                raise ModelLoadError(f"{path.name} holds no AOTInductor model metadata")
            needs: dict[str, str] = json.loads(package.read(names[0]))
    except (OSError, zipfile.BadZipFile, json.JSONDecodeError) as exc:
        raise ModelLoadError(f"{path.name} is not an AOTInductor package: {exc}") from None
    return needs


class _IsaChecked(logging.Filter):
    """Drops torch's warning that a package's ``AOTI_CPU_ISA`` is not this CPU's widest, which
    a package for a portable CPU target always gets: :func:`check_pt2` checked what it needs."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args if isinstance(record.args, tuple) else ()
        return not (
            str(record.msg).startswith("Device information mismatch")
            and args[:1] == ("AOTI_CPU_ISA",)
        )


_ISA_CHECKED = _IsaChecked()


class Pt2Runtime(TorchRuntime):
    """Runs ``model.pt2`` (``torch._inductor.aoti_compile_and_package``) on CPU or CUDA."""

    artifact = "model.pt2"
    shares_threads = False
    """Its batches keep every CPU's threads, beside another batch too: switching them per batch
    as TorchScript does served efficientnet_lite0 at W1 c=16 with a p99/p50 of 4.0 and 5.9
    against 1.45 and 1.47, in two sittings (docs/performance.md, "torch runtimes at the
    defaults"); why, I did not find."""

    def load(self, path: Path, declared: Signature | None, max_batch_size: int) -> Signature:
        if declared is None:
            raise ModelLoadError(
                "an AOTInductor package carries no tensor names or datatypes: name 'inputs' and "
                "'outputs' in config.yaml, or export it with `tensorgate export` to get a manifest"
            )
        device = torch.device(self.options.device)
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ModelLoadError(f"device {device} asked for, but torch sees no CUDA device")
        needs = package_needs(path)
        if TORCH_KEY not in needs:  # not made by `tensorgate export`, which proves its indexes
            refuse_unranged(
                declared,
                "export the model with `tensorgate export`, which proves "
                "which inputs index a table",
            )
        check_pt2(
            {
                "torch": needs.get(TORCH_KEY),
                "device": needs.get("AOTI_DEVICE_KEY"),
                "cpu": needs.get(CPU_KEY),
                "cpu_flags": needs.get(CPU_FLAGS_KEY),
                "cpu_isa": needs.get("AOTI_CPU_ISA"),
            },
            torch.__version__,
            {device.type},
        )
        logging.getLogger("torch.export.pt2_archive._package").addFilter(_ISA_CHECKED)
        # On the CPU every instance thread shares this runtime; a package runs one call per
        # runner at a time, so it gets as many runners as calls can usefully run at once (the
        # runners share the weights, each has its own activations).
        threads = self.options.intra_op_threads
        runners = 1 if device.type == "cuda" else max(1, (os.cpu_count() or 1) // threads)
        try:
            module = load_package(
                str(path),
                num_runners=runners,
                device_index=device.index if device.index is not None else -1,
            )
        except RuntimeError as exc:
            raise ModelLoadError(f"cannot load {path.name}: {exc}") from None
        return self._bind(module, device, declared)


def refuse_unranged(declared: Signature, how: str) -> None:
    """ModelLoadError for an integer input without a range: a compiled ``model.pt2`` kernel
    aborts the whole process on an out-of-range index. ``how``: the other way out."""
    unbounded = [
        t.name for t in declared.inputs if t.range is None and TO_NUMPY[t.datatype].kind in "iu"
    ]
    if unbounded:
        raise ModelLoadError(
            f"integer input '{unbounded[0]}' has no range, and a compiled model.pt2 kernel "
            "aborts the whole process on an out-of-range index: declare the values it may take "
            f"in config.yaml (range: [low, high]), or {how}"
        )


def refuse_unranged_copy(path: Path, declared: Signature) -> None:
    """For a ``model.pt2`` served without a manifest: one `tensorgate export` made (its torch
    key) was loaded unranged, the ranges export proved being in the manifest.json left behind,
    and one id past its table aborted a worker. (One export did not make is refused by the
    runtime's load whatever its folder holds.)"""
    if TORCH_KEY in package_needs(path):
        refuse_unranged(
            declared,
            "copy its whole version folder (its manifest.json records the ranges "
            "`tensorgate export` proved)",
        )
