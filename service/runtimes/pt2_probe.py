"""A ``model.pt2`` run in a child process before the process that needs it runs it.

    python -m service.runtimes.pt2_probe PACKAGE SIGNATURE.json INPUTS.npz OUTPUTS.npz DEVICE

A compiled AOTInductor package can abort the process that runs it: its kernels throw C++
exceptions nothing catches. With torch 2.13, a tagger (an embedding, two 1-D convolutions)
exported at batch 16 ran there and aborted at batch 1, 4 and 8 (``index out of bounds: 0 <=
tmp2 < 500L`` in a fused kernel, on valid ids): ``tensorgate export`` died checking it and left
its version folder half written, and the server that loaded such a package died at warmup,
every other model with it. So export checks a package's answers here, in a child, and the
server runs a package no export checked (no manifest) at each of its warmup shapes here first:
a child that dies is the package's refusal, naming the batch and the signal, and nothing else
stops.

The child loads the package as the server does (:class:`Pt2Runtime`), runs each batch of
``INPUTS.npz`` (keys ``<batch index>.<input name>``) and writes each output the same way; a
refusal of the runtime's is its message on stderr and exit status 3.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import numpy as np

from service.errors import ModelLoadError
from service.model_config import TensorConfig
from service.runtimes.base import RuntimeOptions, Signature

REFUSED = 3
"""The child's exit status for a refusal of the runtime's (its message on stderr)."""
MARK = "pt2_probe: batch "
"""What the child prints to stderr before each batch, so that a crash names it."""


class Pt2Aborted(ModelLoadError):
    """The package aborted the child process that ran it."""


def outputs_in_child(
    package: Path,
    batches: Sequence[Mapping[str, np.ndarray]],
    signature: Signature,
    device: str = "cpu",
    timeout_s: float = 600,
    check: Callable[[], object] | None = None,
) -> list[dict[str, np.ndarray]]:
    """Each batch's outputs, as ``package`` answers them in a child process (the server's own
    runtime there, on ``device``); :class:`Pt2Aborted` when the child dies, naming the batch
    (its rows) and how, and ModelLoadError for the runtime's own refusal. ``check`` is called
    while the child runs (a load's bound: the server stopping, an unload): what it raises ends
    the child, and is raised."""
    with tempfile.TemporaryDirectory(prefix="pt2-probe-") as tmp:
        inputs, outputs, described = Path(tmp, "in.npz"), Path(tmp, "out.npz"), Path(tmp, "sig")
        np.savez(
            inputs,
            allow_pickle=False,
            **{
                f"{i}.{name}": array
                for i, batch in enumerate(batches)
                for name, array in batch.items()
            },
        )
        described.write_text(
            json.dumps(
                {
                    side: [t.model_dump(mode="json") for t in tensors]
                    for side, tensors in (
                        ("inputs", signature.inputs),
                        ("outputs", signature.outputs),
                    )
                }
            )
        )
        command = [sys.executable, "-m", __name__, str(package), str(described), str(inputs)]
        status, stderr = _run(
            [*command, str(outputs), device], timeout_s, check, package, len(batches)
        )
        if status == REFUSED:
            raise ModelLoadError((stderr.strip().splitlines() or ["(it said nothing)"])[-1])
        if status != 0:
            raise Pt2Aborted(_died(package, batches, status, stderr))
        with np.load(outputs, allow_pickle=False) as saved:
            answers: list[dict[str, np.ndarray]] = [{} for _ in batches]
            for key in saved.files:
                index, _, name = key.partition(".")
                answers[int(index)][name] = saved[key]
    return answers


def _run(
    command: list[str],
    timeout_s: float,
    check: Callable[[], object] | None,
    package: Path,
    batches: int,
) -> tuple[int, str]:
    """The child's exit status and stderr; it is killed past ``timeout_s`` (Pt2Aborted) or
    when ``check`` raises (raised)."""
    child = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + timeout_s
    try:
        while True:
            try:
                _, stderr = child.communicate(timeout=0.1)
                return child.returncode, stderr
            except subprocess.TimeoutExpired:
                if check is not None:
                    check()
                if time.monotonic() > deadline:
                    raise Pt2Aborted(
                        f"{package.name} did not answer its {batches} batches within "
                        f"{timeout_s:g} s in a child process"
                    ) from None
    finally:
        if child.poll() is None:  # ended early: nothing outlives the load that started it
            child.kill()
            child.communicate()


def _died(
    package: Path, batches: Sequence[Mapping[str, np.ndarray]], status: int, stderr: str
) -> str:
    """Why the child died: at which batch, by which signal, with the C++ error it printed."""
    lines = stderr.strip().splitlines()
    marks = [line.removeprefix(MARK) for line in lines if line.startswith(MARK)]
    where = ""
    if marks:
        index = int(marks[-1])
        rows = [a.shape[0] for a in batches[index].values() if a.ndim]
        shapes = ", ".join(f"{n} {list(a.shape)}" for n, a in batches[index].items())
        where = f" at a batch of {rows[0] if rows else 1} ({shapes})"
    said = [line.strip() for line in lines if "what():" in line] or [
        line.strip() for line in lines if "Error" in line and not line.lstrip().startswith("frame")
    ]
    detail = f": {said[-1][:300]}" if said else ""
    if status > 0:  # a Python error of the run's
        return f"{package.name} failed{where} in a child process (exit status {status}{detail})"
    try:
        how = f"signal {signal.Signals(-status).name}"
    except ValueError:
        how = f"signal {-status}"
    return (
        f"{package.name} aborted the process that ran it{where} ({how}{detail}); a compiled "
        "package's kernels can abort on what eager PyTorch answers (an inductor bug), and in the "
        "server that would stop every model"
    )


def main(argv: Sequence[str]) -> int:
    package, described, inputs, outputs, device = argv
    import torch  # only in the child: the parent may not have imported it

    from service.runtimes.pt2 import Pt2Runtime

    sides = json.loads(Path(described).read_text())
    signature = Signature(
        tuple(TensorConfig.model_validate(t) for t in sides["inputs"]),
        tuple(TensorConfig.model_validate(t) for t in sides["outputs"]),
    )
    runtime = Pt2Runtime(RuntimeOptions(device, torch.get_num_threads()))
    try:
        runtime.load(Path(package), signature, max_batch_size=0)
    except ModelLoadError as exc:
        sys.stderr.write(f"{exc}\n")
        return REFUSED
    batches: dict[int, dict[str, np.ndarray]] = {}
    with np.load(inputs, allow_pickle=False) as saved:
        for key in saved.files:
            index, _, name = key.partition(".")
            batches.setdefault(int(index), {})[name] = saved[key]
    answers: dict[str, np.ndarray] = {}
    for index in sorted(batches):
        sys.stderr.write(f"{MARK}{index}\n")
        sys.stderr.flush()
        for name, array in runtime.run(batches[index]).items():
            answers[f"{index}.{name}"] = array
    np.savez(outputs, allow_pickle=False, **answers)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
