"""Load gates, bring-your-own artifacts and inference hygiene, in one real server.

One repository holds an intact model, one broken copy per gate, a bare ONNX file, a TorchScript
module saved in training mode (scripted: served in eval mode; traced: refused) and a model that
breaks the batch contract. Each broken one must
be UNAVAILABLE with a reason naming its cause while the others serve.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from tests.models import DropsARow, TrainModeNet
from tests.server import Server

pytestmark = pytest.mark.integration

DIGIT_BATCH = np.random.default_rng(3).standard_normal((3, 1, 8, 8)).astype(np.float32)


def _clone(root: Path, name: str) -> Path:
    shutil.copytree(root / "digits", root / name)
    return root / name


def _edit_json(path: Path, **changes: object) -> None:
    data = json.loads(path.read_text())
    data.update(changes)
    path.write_text(json.dumps(data))


def _torchscript_model(
    root: Path, name: str, module: torch.nn.Module, width: int, out: int, traced: bool = False
) -> None:
    folder = root / name
    (folder / "1").mkdir(parents=True)
    archive = torch.jit.trace(module, torch.zeros(2, width)) if traced else torch.jit.script(module)
    archive.save(str(folder / "1" / "model.pt"))
    (folder / "config.yaml").write_text(
        yaml.safe_dump(
            {
                "backend": "torchscript",
                "max_batch_size": 8,
                "inputs": [{"name": "x", "datatype": "FP32", "shape": [width]}],
                "outputs": [{"name": "y", "datatype": "FP32", "shape": [out]}],
                "warmup": {"batch_sizes": [2]},
            }
        )
    )


@pytest.fixture(scope="module")
def gated(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    root = tmp_path_factory.mktemp("gates") / "models"
    shutil.copytree(Path(__file__).parents[2] / "models" / "digits", root / "digits")

    tampered = _clone(root, "tampered_golden")
    with np.load(tampered / "1" / "golden.npz") as golden:
        arrays = {k: golden[k] for k in golden.files}
    arrays["output.logits"] = arrays["output.logits"] + 0.5
    np.savez(tampered / "1" / "golden.npz", **arrays)

    future = _clone(root, "future_torch")
    _edit_json(future / "1" / "manifest.json", versions={"torch": "3.1.0"})

    opset = _clone(root, "unknown_opset")
    (opset / "config.yaml").write_text(
        (opset / "config.yaml").read_text().replace("backend: torchscript", "backend: onnx")
    )
    _edit_json(opset / "1" / "manifest.json", opset=99)

    edited = _clone(root, "edited_preprocessing")
    (edited / "config.yaml").write_text(
        (edited / "config.yaml").read_text().replace("mean: [0.5]", "mean: [0.45]")
    )

    byo = root / "bring_your_own" / "1"
    byo.mkdir(parents=True)
    shutil.copy(root / "digits" / "1" / "model.onnx", byo / "model.onnx")
    (byo.parent / "config.yaml").write_text("backend: onnx\nmax_batch_size: 8\n")
    unbatched = root / "unbatched" / "1"  # the same file, its config naming only the backend
    unbatched.mkdir(parents=True)
    shutil.copy(root / "digits" / "1" / "model.onnx", unbatched / "model.onnx")
    (unbatched.parent / "config.yaml").write_text("backend: onnx\n")

    _torchscript_model(root, "train_mode", TrainModeNet().train(), width=8, out=4)
    _torchscript_model(
        root, "traced_in_training", TrainModeNet().train(), width=8, out=4, traced=True
    )
    _torchscript_model(root, "drops_a_row", DropsARow(), width=4, out=4)

    server = Server(root, log_path=root.parent / "server.log")
    try:
        # Readiness stays 503 (broken models): wait until loading has finished instead.
        server.wait_until("/v2/health/startup")
        yield server
    finally:
        server.stop()


@pytest.mark.parametrize(
    ("model", "cause"),
    [
        ("tampered_golden", "golden replay: output 'logits' differs from the exported model's"),
        ("future_torch", "exported with torch 3.1.0, this server runs torch 2."),
        ("unknown_opset", "ONNX opset 99 cannot run on onnxruntime"),
        ("edited_preprocessing", "preprocessing in config.yaml differs from the one this artifact"),
        ("traced_in_training", "model.pt runs in training mode whatever eval() says: its graph"),
    ],
)
def test_each_gate_leaves_its_model_unavailable_with_the_cause(
    gated: Server, model: str, cause: str
) -> None:
    metadata = gated.client.get(f"/v2/models/{model}").json()
    assert metadata["state"] == "UNAVAILABLE"
    assert cause in metadata["reason"]
    assert gated.client.get(f"/v2/models/{model}/ready").status_code == 503
    refused = gated.client.post(f"/v2/models/{model}/infer", json={"inputs": []})
    assert refused.status_code == 503
    assert cause in refused.json()["error"]
    assert cause in gated.log()


def test_the_intact_model_serves_while_others_are_refused(gated: Server) -> None:
    assert gated.client.get("/v2/models/digits/ready").json() == {"name": "digits", "ready": True}
    response = gated.client.post(
        "/v2/models/digits/infer",
        json={
            "inputs": [
                {
                    "name": "image",
                    "datatype": "FP32",
                    "shape": [3, 1, 8, 8],
                    "data": DIGIT_BATCH.ravel().tolist(),
                }
            ]
        },
    )
    assert response.status_code == 200
    ready = gated.client.get("/v2/health/ready")
    assert ready.status_code == 503  # strict readiness: every model meant to load must be READY
    assert "tampered_golden" in ready.json()["reason"]
    assert gated.client.get("/v2/health/live").json() == {"live": True}
    # Started all the same: a startupProbe passes, so Kubernetes keeps a NotReady pod that says
    # why instead of restarting it every few minutes.
    assert gated.client.get("/v2/health/startup").json() == {"started": True}


def test_a_bare_model_s_dims_that_no_warmup_can_cover_are_named_with_what_to_set(
    gated: Server,
) -> None:
    """Served with max_batch_size 0, the graph's dynamic leading dim is one request's own:
    every size ran cold (the unwarmed counter went up), and nothing said so."""
    warnings = gated.client.get("/v2/models/unbatched").json()["warnings"]
    (said,) = [w for w in warnings if "dynamic dims without buckets" in w]
    assert "('image' dim 0)" in said and "set buckets in config.yaml" in said
    assert "or max_batch_size if the first dim of ['image'] is a batch" in said


def test_a_bare_onnx_file_loads_unverified_with_its_signature_from_the_graph(
    gated: Server,
) -> None:
    metadata = gated.client.get("/v2/models/bring_your_own").json()
    assert metadata["state"] == "READY"
    assert metadata["verified"] is False
    assert len(metadata["warnings"]) == 3
    assert all("skipped: no manifest.json" in w for w in metadata["warnings"])
    assert metadata["inputs"] == [{"name": "image", "datatype": "FP32", "shape": [-1, 1, 8, 8]}]
    body = {
        "inputs": [
            {
                "name": "image",
                "datatype": "FP32",
                "shape": [3, 1, 8, 8],
                "data": DIGIT_BATCH.ravel().tolist(),
            }
        ]
    }
    bare = gated.client.post("/v2/models/bring_your_own/infer", json=body).json()
    verified = gated.client.post("/v2/models/digits/infer", json=body).json()
    np.testing.assert_allclose(
        bare["outputs"][0]["data"], verified["outputs"][0]["data"], atol=1e-4
    )


def test_a_module_saved_in_training_mode_is_served_in_eval_mode(gated: Server) -> None:
    x = np.random.default_rng(5).standard_normal((4, 8)).astype(np.float32)
    body = {
        "inputs": [{"name": "x", "datatype": "FP32", "shape": [4, 8], "data": x.ravel().tolist()}]
    }
    answers = [gated.client.post("/v2/models/train_mode/infer", json=body) for _ in range(3)]
    assert all(a.status_code == 200 for a in answers)
    data = [a.json()["outputs"][0]["data"] for a in answers]
    assert data[0] == data[1] == data[2]
    with torch.no_grad():
        expected = TrainModeNet().eval()(torch.from_numpy(x)).numpy()
    np.testing.assert_allclose(np.reshape(data[0], (4, 4)), expected, atol=1e-5)


def test_a_model_returning_the_wrong_number_of_rows_gets_a_500_naming_it(gated: Server) -> None:
    body = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [3, 4], "data": [1.0] * 12}]}
    response = gated.client.post("/v2/models/drops_a_row/infer", json=body)
    assert response.status_code == 500
    assert response.json()["error"] == (
        "model 'drops_a_row' returned 2 rows of output 'y' for a batch of 3 (batch size mismatch)"
    )
    assert gated.client.get("/v2/models/digits/ready").status_code == 200
