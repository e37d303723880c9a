"""Every format through export → load gates → served answers, and pt2's own gates, in one real
server that has no C++ compiler on its PATH: serving an AOTInductor package compiles nothing.

tests.models' Mlp, TinyText and TrainModeNet are exported once per session (conftest's
``exported``); each is served from each of its artifacts, beside pt2 copies broken one way each.
"""

from __future__ import annotations

import itertools
import json
import shutil
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import yaml

from service.artifacts import cpu_targets
from service.artifacts.cpu_targets import PORTABLE
from service.runtimes.pt2 import CPU_FLAGS_KEY, TORCH_KEY
from tests.conftest import Exported
from tests.models import Mlp, TinyText, TrainModeNet
from tests.server import Server

pytestmark = pytest.mark.integration

BACKENDS = ("onnx", "pt2", "torchscript")
PLATFORMS = {"onnx": "onnxruntime_onnx", "pt2": "pytorch_aoti", "torchscript": "pytorch_libtorch"}
FILES = {"onnx": "model.onnx", "pt2": "model.pt2", "torchscript": "model.pt"}


def _model(root: Path, name: str, spec: Exported, backend: str, **config: Any) -> Path:
    folder = root / name
    shutil.copytree(spec.version, folder / "1")
    content = {
        "backend": backend,
        "max_batch_size": spec.max_batch_size,
        "warmup": {"batch_sizes": "all"},
        **config,
    }
    if spec.buckets:
        content["buckets"] = list(spec.buckets)
    (folder / "config.yaml").write_text(yaml.safe_dump(content))
    return folder


def _edit_manifest(folder: Path, **versions: str) -> None:
    path = folder / "1" / "manifest.json"
    manifest = json.loads(path.read_text())
    manifest["versions"].update(versions)
    path.write_text(json.dumps(manifest))


@pytest.fixture(scope="module")
def served(
    tmp_path_factory: pytest.TempPathFactory, exported: dict[str, Exported]
) -> Iterator[Server]:
    root = tmp_path_factory.mktemp("pt2") / "models"
    for name, spec in exported.items():
        for backend in BACKENDS:
            _model(root, f"{name}_{backend}", spec, backend)
    mlp = exported["mlp"]
    bare = _model(
        root,
        "bare_pt2",
        mlp,
        "pt2",
        inputs=[t.model_dump() for t in mlp.inputs],
        outputs=[t.model_dump() for t in mlp.outputs],
    )
    for extra in ("manifest.json", "golden.npz", "model.onnx", "model.pt"):
        (bare / "1" / extra).unlink()
    tampered = _model(root, "tampered_pt2", mlp, "pt2")
    with np.load(tampered / "1" / "golden.npz") as golden:
        arrays = {k: golden[k] for k in golden.files}
    arrays["output.y"] = arrays["output.y"] + 0.5
    np.savez(tampered / "1" / "golden.npz", **arrays)
    _edit_manifest(_model(root, "older_torch_pt2", mlp, "pt2"), torch="2.12.1")
    _edit_manifest(_model(root, "cuda_pt2", mlp, "pt2"), pt2_device="cuda")
    # No compiler anywhere the server could look: the interpreter is started by its full path.
    server = Server(
        root,
        env={"PATH": str(root.parent / "no-compiler"), "CC": "", "CXX": ""},
        log_path=root.parent / "server.log",
    )
    try:
        server.wait_until("/v2/health/startup")
        yield server
    finally:
        server.stop()


def _infer(server: Server, model: str, arrays: dict[str, np.ndarray]) -> np.ndarray:
    datatypes = {np.dtype(np.float32): "FP32", np.dtype(np.int64): "INT64"}
    inputs = [
        {
            "name": n,
            "datatype": datatypes[a.dtype],
            "shape": list(a.shape),
            "data": a.ravel().tolist(),
        }
        for n, a in arrays.items()
    ]
    response = server.client.post(f"/v2/models/{model}/infer", json={"inputs": inputs})
    assert response.status_code == 200, response.text
    output = response.json()["outputs"][0]
    return np.reshape(output["data"], output["shape"])


@pytest.mark.parametrize("backend", BACKENDS)
def test_each_format_serves_verified_answers_equal_to_eager(served: Server, backend: str) -> None:
    rng = np.random.default_rng(7)
    for rows in range(1, 9):  # every batch size, each warmed: none may meet a cold shape
        x = rng.standard_normal((rows, 64)).astype(np.float32)
        with torch.inference_mode():
            want = Mlp().eval()(torch.from_numpy(x)).numpy()
        np.testing.assert_allclose(_infer(served, f"mlp_{backend}", {"x": x}), want, atol=1e-5)
        # Exported from a module left in training mode: its dropout and batch statistics are off.
        x = rng.standard_normal((rows, 8)).astype(np.float32)
        with torch.inference_mode():
            want = TrainModeNet().eval()(torch.from_numpy(x)).numpy()
        got = _infer(served, f"train_mode_{backend}", {"x": x})
        np.testing.assert_allclose(got, want, atol=1e-5)
    # Every batch size at every bucket and between buckets (padded up to the next one).
    for rows, length in itertools.product(range(1, 5), (3, 4, 8, 11, 16)):
        ids = rng.integers(1, 100, (rows, length))
        mask = np.ones_like(ids)
        mask[0, length // 2 + 1 :] = 0
        with torch.inference_mode():
            want = TinyText().eval()(torch.from_numpy(ids), torch.from_numpy(mask)).numpy()
        got = _infer(served, f"tiny_text_{backend}", {"input_ids": ids, "attention_mask": mask})
        np.testing.assert_allclose(got, want, atol=1e-5)
    for model in (f"mlp_{backend}", f"tiny_text_{backend}", f"train_mode_{backend}"):
        metadata = served.client.get(f"/v2/models/{model}").json()
        assert metadata["verified"] is True
        assert metadata["platform"] == PLATFORMS[backend]
        config = served.client.get(f"/v2/models/{model}/config")  # Triton's view of each format
        assert config.status_code == 200, config.text
        assert config.json()["platform"] == PLATFORMS[backend]
        assert config.json()["default_model_filename"] == FILES[backend]
        stats = served.client.get(f"/v2/models/{model}/stats").json()["model_stats"][0]
        assert stats["unwarmed_shape_count"] == 0


@pytest.mark.parametrize(
    ("model", "cause"),
    [
        ("tampered_pt2", "golden replay: output 'y' differs from the exported model's"),
        ("older_torch_pt2", "model.pt2 was compiled by torch 2.12.1, this server runs torch 2."),
        ("cuda_pt2", "model.pt2 was compiled for cuda, this server runs it on cpu"),
    ],
)
def test_a_pt2_that_cannot_run_as_exported_is_refused_naming_both_sides(
    served: Server, model: str, cause: str
) -> None:
    if model == "cuda_pt2" and torch.cuda.is_available():
        pytest.skip("a CUDA package runs here: the refusal is for machines without a GPU")
    metadata = served.client.get(f"/v2/models/{model}").json()
    assert metadata["state"] == "UNAVAILABLE"
    assert cause in metadata["reason"]
    assert served.client.get(f"/v2/models/{model}/ready").status_code == 503


def test_a_bare_pt2_serves_unverified_with_each_skipped_gate_named(served: Server) -> None:
    metadata = served.client.get("/v2/models/bare_pt2").json()
    assert metadata["state"] == "READY"
    assert metadata["verified"] is False
    assert all("skipped: no manifest.json" in w for w in metadata["warnings"])
    x = np.ones((2, 64), np.float32)
    np.testing.assert_allclose(
        _infer(served, "bare_pt2", {"x": x}), _infer(served, "mlp_pt2", {"x": x}), atol=1e-6
    )


# Integration, not unit: the `exported` fixture compiles three pt2 packages (30 s here).
def test_pt2_manifest_records_what_the_package_needs_to_load(
    exported: dict[str, Exported],
) -> None:
    for spec in exported.values():
        manifest = json.loads((spec.version / "manifest.json").read_text())
        assert manifest["artifacts"]["pt2"] == "model.pt2"
        assert manifest["parity"]["pt2"]["max_abs"] < 1e-4
        versions = manifest["versions"]
        assert versions["pt2_device"] == "cpu"  # no GPU here: compiled for the CPU
        assert versions["pt2_cpu"] == cpu_targets.default_target()
        needed = cpu_targets.needed_flags(versions["pt2_cpu"])
        assert versions["pt2_cpu_flags"] == " ".join(sorted(needed))
        assert versions["onnx_exporter"] == "dynamo"
        with zipfile.ZipFile(spec.version / "model.pt2") as package:
            (meta,) = [n for n in package.namelist() if n.endswith("wrapper_metadata.json")]
            metadata = json.loads(package.read(meta))
            (wrapper,) = [n for n in package.namelist() if n.endswith("wrapper.cpp")]
            commands = package.read(wrapper).decode().partition("// Compile cmd")[2]
        assert metadata[TORCH_KEY] == torch.__version__
        assert metadata[CPU_FLAGS_KEY] == versions["pt2_cpu_flags"]
        if versions["pt2_cpu"] == PORTABLE:
            # The package's own record of how it was compiled: for the level, not this machine.
            assert "-march=x86-64-v3" in commands
            assert "-march=native" not in commands and "-mavx512" not in commands
