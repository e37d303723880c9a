"""Settings an operator meets when deploying: tokens from mounted secrets, the container health
command, misspelt variables, one-line setting errors, and one model served under KServe's name."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from tests.server import REPO_ROOT, Server, copy_model

pytestmark = pytest.mark.integration

TOKEN = "a-mounted-secret-token"
DIGIT = {
    "inputs": [{"name": "image", "datatype": "FP32", "shape": [1, 1, 8, 8], "data": [0.5] * 64}]
}


def tensorgate(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "service", *args],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, **env},
    )


def test_a_token_file_protects_health_and_the_health_command_sends_it(
    repository: Path, tmp_path: Path
) -> None:
    secret = tmp_path / "api-token"
    secret.write_text(TOKEN + "\n")  # as `kubectl create secret --from-file` leaves it
    env = {
        "TG_API_TOKEN_FILE": str(secret),
        "TG_PROTECT_HEALTH_AND_METRICS": "true",
        "TG_API_TOKN": "misspelt",
    }
    server = Server(repository, env=env, log_path=tmp_path / "server.log")
    try:
        server.client.headers["Authorization"] = f"Bearer {TOKEN}"
        server.wait_until()
        assert server.client.post("/v2/models/digits/infer", json=DIGIT).status_code == 200
        assert (
            server.client.get("/v2/health/ready", headers={"Authorization": ""}).status_code == 401
        )
        probe_env = {**env, "TG_PORT": str(server.port), "TG_HOST": "0.0.0.0"}
        for probe in ("live", "ready", "startup"):
            done = tensorgate("health", probe, env=probe_env)
            assert done.returncode == 0, done.stderr
        without_token = {k: v for k, v in probe_env.items() if k != "TG_API_TOKEN_FILE"}
        assert "TG_API_TOKEN_FILE" not in os.environ
        refused = tensorgate("health", env=without_token)
        assert refused.returncode == 1  # 401 is not healthy, and a user running it reads why
        assert refused.stderr.startswith(
            f"tensorgate health ready: 127.0.0.1:{server.port} answered 401 "
        ), refused.stderr
        assert refused.stderr.count("\n") == 1
    finally:
        assert server.stop() == 0
    assert (
        "TG_API_TOKN is not a tensorgate setting and is ignored; did you mean TG_API_TOKEN?"
        in server.log()
    )


def test_the_health_command_fails_when_nothing_listens(tmp_path: Path) -> None:
    from tests.server import free_port

    done = tensorgate("health", env={"TG_PORT": str(free_port())})
    assert done.returncode == 1
    assert "Connection refused" in done.stderr


@pytest.mark.parametrize(
    ("env", "message"),
    [
        (
            {"TG_API_TOKEN": "short"},
            "tensorgate: invalid setting: TG_API_TOKEN is 5 characters long",
        ),
        (
            {"TG_PORT": "eighty"},
            "tensorgate: invalid setting: TG_PORT: Input should be a valid integer",
        ),
        (  # was each worker's lifespan traceback
            {"TG_MODEL_REPOSITORY": "/nonexistent/models"},
            "tensorgate: invalid setting: TG_MODEL_REPOSITORY: /nonexistent/models is not a "
            "directory",
        ),
        (  # was each worker's lifespan traceback
            {"TG_MODELS": "digits,nosuch"},
            "tensorgate: invalid setting: TG_MODELS: 'nosuch' not in models (its model folders",
        ),
        (
            {"TG_MODELS": "digits,,minilm"},
            "tensorgate: invalid setting: TG_MODELS: an empty model name in 'digits,,minilm'",
        ),
    ],
)
def test_a_bad_setting_is_one_line_not_a_traceback(env: dict[str, str], message: str) -> None:
    done = tensorgate("serve", env=env)
    assert done.returncode == 2
    assert done.stderr.startswith(message)
    assert "Traceback" not in done.stderr


@pytest.mark.parametrize(
    ("flag", "named"),
    [("--port=99999", "--port"), ("--poll=-1", "--poll"), ("--grpc-port=-2", "--grpc-port")],
)
def test_a_bad_flag_is_named_as_the_flag(flag: str, named: str) -> None:
    """A flag's error named its variable (`--port 99999`: "TG_PORT: ...")."""
    done = tensorgate("serve", flag, env={})
    assert done.returncode == 2
    assert done.stderr.startswith(f"tensorgate: invalid setting: {named}: Input should be ")


def test_one_model_folder_serves_under_the_name_kserve_gives(tmp_path: Path) -> None:
    """KServe's storage initializer leaves the storageUri's folder in /mnt/models; the runtime's
    args pass the InferenceService's name as --model-name."""
    storage = tmp_path / "mnt-models"
    copy_model("digits", storage)
    server = Server(storage, env={"TG_MODEL_NAME": "my-digits"}, log_path=tmp_path / "server.log")
    try:
        server.wait_until()
        assert server.client.get("/v2/models/my-digits/ready").json() == {
            "name": "my-digits",
            "ready": True,
        }
        assert server.client.post("/v2/models/my-digits/infer", json=DIGIT).status_code == 200
        assert server.client.get("/v2/models/digits").status_code == 404
    finally:
        assert server.stop() == 0


def test_a_model_name_over_a_repository_of_several_models_names_them(tmp_path: Path) -> None:
    root = tmp_path / "models"
    for name in ("a", "b"):
        copy_model("digits", root / name)
    server = Server(root, env={"TG_MODEL_NAME": "one"}, log_path=tmp_path / "server.log")
    try:
        assert server.process.wait(timeout=60) == 2  # a setting's error, as any other's
    finally:
        server.stop()
    # one line, before any worker starts (it was a traceback in every worker's startup)
    assert server.log() == (
        f"tensorgate: invalid setting: TG_MODEL_NAME: 'one' is set, so {root} must be one "
        "model's folder (config.yaml at its root) or hold exactly one model folder; it holds "
        "['a', 'b']\n"
    )


def test_a_repository_that_would_serve_nothing_is_one_line_naming_the_fix(
    tmp_path: Path,
) -> None:
    """One model's own folder given as the repository was served as no model (with a warning
    to move its 1/model.onnx to 1/1/), and a folder of no models said ready: a server up and
    ready that answers every request 404."""
    copy_model("digits", tmp_path / "digits")
    (tmp_path / "empty").mkdir()
    (tmp_path / "loose" / "m" / "1").mkdir(parents=True)
    (tmp_path / "loose" / "m" / "1" / "model.onnx").write_bytes(b"")
    said = {}
    for folder in ("digits", "empty", "loose"):
        done = tensorgate("serve", "--model-repository", str(tmp_path / folder), env={})
        assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
        said[folder] = done.stderr
    assert said["digits"] == (
        f"tensorgate: invalid setting: --model-repository: {tmp_path}/digits is one model's "
        f"folder (it holds config.yaml): serve the folder that holds it (--model-repository "
        f"{tmp_path}), or this model alone with --model-name <name>\n"
    )
    assert said["empty"].startswith(
        f"tensorgate: invalid setting: --model-repository: {tmp_path}/empty holds no model "
        "folder (a folder with config.yaml and a version folder, 1/, holding the model), so "
        "nothing would be served"
    )
    assert said["loose"].endswith(f"; {tmp_path}/loose/m has version folders but no config.yaml\n")


def test_an_empty_repository_serves_once_models_can_come_later(tmp_path: Path) -> None:
    """With the repository API (or --poll) a model can be loaded later: it starts, and says
    that it serves nothing yet."""
    root = tmp_path / "models"
    root.mkdir()
    server = Server(root, env={"TG_ADMIN_TOKEN": TOKEN}, log_path=tmp_path / "server.log")
    try:
        server.wait_until()
        server.wait_log("holds no model folder yet: nothing is served until one is loaded")
        copy_model("digits", root / "digits")
        admin = {"Authorization": f"Bearer {TOKEN}"}
        loaded = server.client.post("/v2/repository/models/digits/load", headers=admin)
        assert loaded.status_code == 200, loaded.text
        assert server.client.post("/v2/models/digits/infer", json=DIGIT).status_code == 200
    finally:
        assert server.stop() == 0


def test_the_schema_command_prints_the_config_schema_and_ends_quietly_into_a_closed_pipe() -> None:
    """`tensorgate schema | head` ended in a BrokenPipeError traceback."""
    whole = tensorgate("schema", env={})
    assert whole.returncode == 0, whole.stderr
    assert json.loads(whole.stdout)["title"] == "ModelConfig"
    piped = subprocess.run(
        f"set -o pipefail; {shlex.quote(sys.executable)} -m service schema | head -c 10",
        shell=True,
        executable="/bin/bash",
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert piped.stdout == whole.stdout[:10]
    assert piped.returncode == 0 and piped.stderr == "", piped.stderr
