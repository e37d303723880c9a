"""`tensorgate export` from a user's own module file, then `tensorgate serve` on the result."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.models import Mlp
from tests.server import REPO_ROOT, Server

pytestmark = pytest.mark.integration

USER_CODE = """
import torch
from torch import nn

class Mlp(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(1)
        self.layers = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 10))

    def forward(self, x):
        return self.layers(x)

def make():
    return Mlp().eval()
"""


def test_export_then_serve_a_users_module(tmp_path: Path) -> None:
    (tmp_path / "usermodel.py").write_text(USER_CODE)
    repository = tmp_path / "models"
    command = [
        sys.executable,
        "-m",
        "service",
        "export",
        "usermodel:make",
        "--name",
        "mlp",
        "--repository",
        str(repository),
        "--input",
        "x:FP32:64",
        "--output",
        "y:FP32:10",
        "--max-batch-size",
        "8",
        "--pt2-cpu",
        "native",
    ]
    path = os.pathsep.join(
        p for p in (str(tmp_path), str(REPO_ROOT), os.environ.get("PYTHONPATH")) if p
    )
    env = {**os.environ, "PYTHONPATH": path}
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    manifest = json.loads((repository / "mlp" / "1" / "manifest.json").read_text())
    # The default formats: portable ONNX and torch.export's compiled package, no TorchScript.
    assert manifest["artifacts"] == {"onnx": "model.onnx", "pt2": "model.pt2"}
    assert manifest["versions"]["onnx_exporter"] == "dynamo"
    assert manifest["versions"]["pt2_cpu"] == "native"  # this machine's, as --pt2-cpu asked
    assert manifest["parity"]["onnx"]["max_abs"] < 1e-4
    assert (repository / "mlp" / "config.yaml").read_text().startswith("backend: onnx")

    server = Server(repository, log_path=tmp_path / "server.log")
    try:
        server.wait_until()
        x = np.random.default_rng(0).standard_normal((3, 64)).astype(np.float32)
        body = {
            "inputs": [
                {"name": "x", "datatype": "FP32", "shape": [3, 64], "data": x.ravel().tolist()}
            ]
        }
        response = server.client.post("/v2/models/mlp/infer", json=body)
        assert response.status_code == 200, response.text
        with torch.no_grad():
            expected = Mlp().eval()(torch.from_numpy(x)).numpy()
        np.testing.assert_allclose(
            np.reshape(response.json()["outputs"][0]["data"], (3, 10)), expected, atol=1e-5
        )
        assert server.client.get("/v2/models/mlp").json()["verified"] is True
    finally:
        assert server.stop() == 0


def test_export_finds_the_users_module_in_the_current_folder_and_says_what_is_wrong(
    tmp_path: Path,
) -> None:
    """The README's ``tensorgate export mypackage.models:make_model`` runs from the user's
    project folder: the console script's Python looked only beside itself and failed with a
    traceback (``No module named 'mypackage'``). The module is found in the current folder;
    one that is not a Module, or not there at all, is one line saying so."""
    (tmp_path / "notamodel.py").write_text("def make():\n    return 42\n")
    (tmp_path / "needsmore.py").write_text("import nosuchdependency\n")
    script = Path(sys.executable).with_name("tensorgate")
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}  # the package, not the user's folder
    for factory, said in (
        ("notamodel:make", "notamodel:make gave int, not a torch.nn.Module"),
        ("nosuchmodule:make", "cannot import 'nosuchmodule' for nosuchmodule:make"),
        ("notamodel:other", "notamodel has no 'other' (from notamodel:other)"),
        ("needsmore:make", "No module named 'nosuchdependency', which it imports"),
    ):
        command = [str(script), "export", factory, "--name", "m", "--repository", "models"]
        command += ["--input", "x:FP32:4", "--output", "y:FP32:4"]
        done = subprocess.run(
            command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120
        )
        assert done.returncode == 2  # a usage error, as a bad --name is (it was 1)
        assert said in done.stderr, done.stderr
        assert "Traceback" not in done.stderr
    for name in ("../evil", "a/b", ".hidden", ""):  # a model is a folder of the repository
        command = [str(script), "export", "notamodel:make", "--name", name]
        command += ["--repository", "models", "--input", "x:FP32:4", "--output", "y:FP32:4"]
        done = subprocess.run(
            command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120
        )
        assert done.returncode == 2
        assert f"--name {name!r} is not a model name the server serves" in done.stderr
        assert "Traceback" not in done.stderr
    assert not (tmp_path / "evil").exists() and not (tmp_path / "models").exists()
