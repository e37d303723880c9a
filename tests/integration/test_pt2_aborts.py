"""A compiled model.pt2 that aborts the process running it stops neither an export nor a server.

torch 2.13's inductor compiles ConvTagger (an embedding, two 1-D convolutions), exported with a
dynamic batch, into a package that aborts its process (SIGABRT, a C++ exception) at a batch
smaller than the one it was traced at, on valid ids. Export checked the package in its own
process and died, leaving the version folder half written; a server given such a package died
at warmup, every other model with it (a new user's walk)."""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from service.export.exporter import export_model
from service.model_config import TensorConfig
from tests.models import ConvTagger
from tests.server import Server, copy_model

pytestmark = pytest.mark.integration

IDS = TensorConfig(name="ids", datatype="INT64", shape=(-1,), range=(0, 499))
TAGS = TensorConfig(name="tags", datatype="FP32", shape=(-1, 5))


def test_export_leaves_out_a_package_that_aborts_and_writes_the_rest(tmp_path: Path) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        manifest = export_model(
            ConvTagger(),
            tmp_path / "tagger" / "1",
            name="tagger",
            inputs=[IDS.model_copy(update={"range": None})],
            outputs=[TAGS],
            golden_inputs={"ids": np.random.default_rng(0).integers(0, 500, (4, 12))},
            max_batch_size=16,
            buckets=(16, 32, 64),
            formats=("onnx", "pt2"),
        )
    assert "onnx" in manifest.artifacts and "pt2" not in manifest.artifacts
    said = manifest.skipped["pt2"]
    assert "model.pt2 aborted the process that ran it at a batch of " in said
    assert "(signal SIGABRT" in said
    assert sorted(p.name for p in (tmp_path / "tagger" / "1").iterdir()) == [
        "golden.npz",
        "manifest.json",
        "model.onnx",
    ]


def test_a_server_refuses_a_bare_package_that_aborts_and_serves_the_others(
    tmp_path: Path,
) -> None:
    root = tmp_path / "models"
    copy_model("digits", root / "digits")
    version = root / "tagger" / "1"
    version.mkdir(parents=True)
    ids = torch.zeros((16, 64), dtype=torch.int64)
    batch, length = torch.export.Dim("batch", max=16), torch.export.Dim("length", max=64)
    program = torch.export.export(
        ConvTagger().eval(), (ids,), dynamic_shapes=({0: batch, 1: length},)
    )
    torch._inductor.aoti_compile_and_package(program, package_path=str(version / "model.pt2"))
    config = {
        "backend": "pt2",
        "max_batch_size": 16,
        "inputs": [IDS.model_dump(mode="json", exclude_none=True)],
        "outputs": [TAGS.model_dump(mode="json", exclude_none=True)],
        "buckets": [16, 32, 64],
        "warmup": {"batch_sizes": [1, 16]},
    }
    (root / "tagger" / "config.yaml").write_text(yaml.safe_dump(config))
    server = Server(root, {"TG_STRICT_READINESS": "false"})
    try:
        server.wait_until()
        metadata = server.client.get("/v2/models/tagger").json()
        assert metadata["state"] == "UNAVAILABLE"
        said = "model.pt2 aborted the process that ran it at a batch of 1 (ids [1, 16])"
        assert said in metadata["reason"]
        digit = {"inputs": [{"name": "image", "datatype": "FP32", "shape": [1, 1, 8, 8]}]}
        digit["inputs"][0]["data"] = [0.5] * 64
        assert server.client.post("/v2/models/digits/infer", json=digit).status_code == 200
        assert server.process.poll() is None
    finally:
        server.stop()
