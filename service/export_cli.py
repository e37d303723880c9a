"""``tensorgate export``: a module factory and a few flags → a versioned artifact folder."""

from __future__ import annotations

import argparse
import importlib
import logging
from typing import Any

import numpy as np
import torch
import yaml

from preprocessing.spec import ImageSpec
from service.export import DEFAULT_OPSET, ExportError, export_model
from service.model_config import TensorConfig
from service.protocol.datatypes import TO_NUMPY

log = logging.getLogger("tensorgate.export")
GOLDEN_ROWS = 4


def run_export(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    module = load_module(args.factory)
    inputs = [parse_tensor(text) for text in args.input]
    outputs = [parse_tensor(text) for text in args.output]
    preprocessing = None
    if args.preprocessing is not None:
        preprocessing = ImageSpec.model_validate(yaml.safe_load(args.preprocessing.read_text()))
    model_dir = args.repository / args.name
    out_dir = model_dir / str(args.model_version)
    formats = [f.strip() for f in args.formats.split(",") if f.strip()]
    if args.backend not in formats:
        log.error("--backend %s is not among --formats %s", args.backend, ",".join(formats))
        return 2
    buckets = [int(b) for b in args.buckets.split(",") if b.strip()]
    rows = min(GOLDEN_ROWS, args.max_batch_size) if args.max_batch_size > 0 else 0
    golden = {t.name: golden_input(t, rows, seed=i) for i, t in enumerate(inputs)}
    try:
        manifest = export_model(
            module, out_dir, name=args.name, inputs=inputs, outputs=outputs,
            golden_inputs=golden, max_batch_size=args.max_batch_size,
            preprocessing=preprocessing, opset=args.opset or DEFAULT_OPSET, formats=formats,
            buckets=buckets, pt2_cpu=args.pt2_cpu,
        )  # fmt: skip
    except ExportError as exc:
        log.error("export failed: %s", exc)
        return 1
    config = model_dir / "config.yaml"
    if not config.exists():
        content: dict[str, Any] = {"backend": args.backend, "max_batch_size": args.max_batch_size}
        if preprocessing is not None:
            content["preprocessing"] = preprocessing.model_dump(mode="json")
        config.write_text(yaml.safe_dump(content, sort_keys=False))
        log.info("wrote %s", config)
    log.info("exported %s version %d: parity %s", args.name, args.model_version, manifest.parity)
    return 0


def load_module(spec: str) -> torch.nn.Module:
    """``package.module:attr`` → a module: attr is a Module, or a callable that returns one."""
    module_name, _, attribute = spec.partition(":")
    if not attribute:
        raise SystemExit(f"factory must be module:callable, got {spec!r}")
    target = getattr(importlib.import_module(module_name), attribute)
    module = target if isinstance(target, torch.nn.Module) else target()
    if not isinstance(module, torch.nn.Module):
        raise SystemExit(f"{spec} gave {type(module).__name__}, not a torch.nn.Module")
    return module


def parse_tensor(text: str) -> TensorConfig:
    """``name:DTYPE:d1,d2`` → TensorConfig (shape without batch dim)."""
    try:
        name, datatype, dims = text.split(":")
        shape = tuple(int(d) for d in dims.split(",") if d)
        return TensorConfig.model_validate({"name": name, "datatype": datatype, "shape": shape})
    except ValueError as exc:
        raise SystemExit(f"tensor must be NAME:DTYPE:D1,D2,... (got {text!r}): {exc}") from None


def golden_input(spec: TensorConfig, rows: int, seed: int) -> np.ndarray:
    """Fixed pseudo-random inputs for parity checks (dynamic dims take 8)."""
    rng = np.random.default_rng(seed)
    shape = ((rows,) if rows else ()) + tuple(8 if d == -1 else d for d in spec.shape)
    dtype = TO_NUMPY[spec.datatype]
    if dtype.kind == "f":
        return rng.standard_normal(shape).astype(dtype)
    if dtype.kind == "b":
        return rng.integers(0, 2, shape).astype(dtype)
    return rng.integers(0, 10, shape).astype(dtype)
