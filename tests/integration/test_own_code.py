"""A model's own pre- and post-processing code (``preprocessing: {kind: python}``), served with
the same gates as the built-in specs.

Two kinds of model: the bundled ``wine`` (a tabular MLP trained at build time through its own
``pipeline.py``), and a small ``scorer`` exported here whose code imports a local module that
reads a data file, and can be made to fail, hang or raise for one item.
"""

from __future__ import annotations

import base64
import collections
import json
import os
import random
import shutil
import subprocess
import sys
import threading
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
import yaml

from preprocessing.pipeline import Item, LocalModels
from preprocessing.spec import PythonSpec
from preprocessing.torch import PipelineDataset
from service.export.exporter import export_model
from service.model_config import TensorConfig
from tests.server import REPO_ROOT, Server, copy_model

pytestmark = pytest.mark.integration

SCORER = '''
"""A test model's own code: a record {"x": [4 numbers]} → x, and y → the best label."""
import time
from pathlib import Path

import numpy as np

from preprocessing.pipeline import BadInput, Pipeline

from .labels import label


class Scorer(Pipeline):
    raw_input = "record"

    def __init__(self, scale):
        self.scale = scale

    def preprocess(self, item, context):
        record = item.json()
        if not isinstance(record, dict):
            raise BadInput("a record is a JSON object")
        context["slow"] = record.get("slow")  # what parameters() is to take its time over
        if "hang" in record:
            time.sleep(record["hang"])
            Path(record["done"]).write_text("woke")  # the hung step ended
        if "bug" in record:
            raise KeyError("a bug in the code")
        if "exit" in record:  # a helper's sys.exit(), reached by one request's input
            raise SystemExit(3)
        if "interrupt" in record:
            raise KeyboardInterrupt
        if "listed" in record:
            return [1.0, 2.0]  # not a dict of arrays
        x = record.get("x")
        if not isinstance(x, list) or len(x) != 4:
            raise BadInput(f"'x' must be a list of 4 numbers, got {x!r}")
        context["sent"], context["type"] = x, item.content_type
        return {"x": np.asarray(x, dtype=np.float32) * self.scale}

    def postprocess(self, outputs, context):
        y = outputs["y"]
        sent, kind = context["sent"], context["type"]
        return {"label": label(int(y.argmax())), "y": y.tolist(), "sent": sent, "type": kind}

    def parameters(self, contexts):
        for context in contexts:
            if context["slow"]:
                time.sleep(context["slow"]["s"])
                Path(context["slow"]["done"]).write_text("said")
        return {}
'''
LABELS = """
from pathlib import Path

NAMES = (Path(__file__).parent / "labels.txt").read_text().split()


def label(index):
    return NAMES[index]
"""
ADMIN = "admin-token-of-16+"
SPEC = {"kind": "python", "module": "scorer", "class": "Scorer", "params": {"scale": 0.5}}


def write_scorer(folder: Path, version: str = "1") -> None:
    """The scorer model: its code, its data file, an exported version and a config."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "scorer.py").write_text(SCORER)
    (folder / "labels.py").write_text(LABELS)
    (folder / "labels.txt").write_text("left right\n")
    export_scorer(folder, version)
    write_config(folder, SPEC)


def write_config(folder: Path, spec: dict[str, object]) -> None:
    """The config of a test model whose code is ``spec``: ONNX, batches of up to 8, warm."""
    config = {
        "backend": "onnx",
        "max_batch_size": 8,
        "preprocessing": spec,
        "warmup": {"batch_sizes": "all"},
    }
    (folder / "config.yaml").write_text(yaml.safe_dump(config))


CHAIN = '''
"""A pipeline over two models: its own, then the scorer's, called from postprocess."""
import time
from pathlib import Path

import numpy as np

from preprocessing.pipeline import Pipeline


class Chain(Pipeline):
    raw_input = "record"

    def preprocess(self, item, context):
        record = item.json()
        context["step"] = record.get("step", "scorer")
        context["version"] = record.get("version", 1)  # an int, as code may well pass it
        context["wait"] = record.get("wait", 0)  # slow code, as a model's own may be
        time.sleep(record.get("pre", 0))  # slow preprocessing too
        context["done"] = record.get("done")  # a file to touch once the step was tried
        context["rows"] = record.get("rows", 1)  # a step of many rows (crops of one image)
        context["as_list"] = record.get("as_list", False)  # the inputs as pairs, not a dict
        return {"x": np.asarray(record["x"], dtype=np.float32)}

    def postprocess(self, outputs, context):
        time.sleep(context["wait"])
        first = outputs["y"]
        again = np.concatenate([first, first]).astype(np.float32)[None]
        again = np.repeat(again, context["rows"], axis=0)
        inputs = [("x", again)] if context["as_list"] else {"x": again}
        try:
            second = self.models.infer(
                context["step"], inputs, version=context["version"]
            )["y"][0]
        finally:
            if context["done"]:
                Path(context["done"]).write_text("tried")
        return {"first": first.tolist(), "second": second.tolist()}
'''
CHAIN_SPEC = {"kind": "python", "module": "chain", "class": "Chain"}


def linear(seed: int) -> torch.nn.Linear:
    torch.manual_seed(seed)
    return torch.nn.Linear(4, 2)


def eager(module: torch.nn.Module, x: list[float]) -> list[float]:
    with torch.inference_mode():
        return list(module(torch.tensor([x], dtype=torch.float32))[0].tolist())


def write_chain(folder: Path, step: str = "scorer") -> None:
    """A model whose pipeline calls the scorer model (or ``step``): exported against the eager
    scorer."""
    folder.mkdir(parents=True)
    (folder / "chain.py").write_text(CHAIN)
    item = folder.parent / f"{folder.name}-item.json"
    item.write_text(json.dumps({"x": [0.5, 1.0, -1.0, 2.0], "step": step}))
    scorer = linear(0)

    def run_scorer(batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        with torch.inference_mode():
            return {"y": scorer(torch.from_numpy(batch["x"])).numpy()}

    export_model(
        linear(1),
        folder / "1",
        name="chain",
        inputs=[TensorConfig(name="x", datatype="FP32", shape=(4,))],
        outputs=[TensorConfig(name="y", datatype="FP32", shape=(2,))],
        golden_inputs=None,
        max_batch_size=8,
        preprocessing=PythonSpec.model_validate(CHAIN_SPEC),
        answer_items=[item],
        formats=("onnx",),
        models=LocalModels({step: run_scorer}),
    )
    write_config(folder, CHAIN_SPEC)


def export_with_the_cli(repository: Path, source: Path) -> None:
    """As the README shows: the code beside a spec file, `tensorgate export --preprocessing
    spec.yaml --answer-items ...`; export copies the code into the model's folder."""
    (source / "scorer.py").write_text(SCORER)
    (source / "labels.py").write_text(LABELS)
    (source / "labels.txt").write_text("left right\n")
    (source / "spec.yaml").write_text(yaml.safe_dump(SPEC))
    (source / "item.json").write_text(json.dumps({"x": [3, 2, 1, 0]}))
    # labels.txt is data, not code: export copies the code it finds; data is the user's to place
    (repository / "from_cli").mkdir()
    shutil.copyfile(source / "labels.txt", repository / "from_cli" / "labels.txt")
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "service",
            "export",
            "tests.user_models:make_linear",
            "--name",
            "from_cli",
            "--repository",
            str(repository),
            "--input",
            "x:FP32:4",
            "--output",
            "y:FP32:2",
            "--max-batch-size",
            "4",
            "--formats",
            "onnx",
            "--preprocessing",
            str(source / "spec.yaml"),
            "--answer-items",
            str(source / "item.json"),
        ],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0, done.stderr


def export_scorer(folder: Path, version: str = "1", seed: int = 0) -> None:
    torch.manual_seed(seed)
    module = torch.nn.Linear(4, 2)
    item = folder.parent / f"{folder.name}-item.json"
    item.write_text(json.dumps({"x": [1.0, -2.0, 3.0, 0.5]}))
    export_model(
        module,
        folder / version,
        name=folder.name,
        inputs=[TensorConfig(name="x", datatype="FP32", shape=(4,))],
        outputs=[TensorConfig(name="y", datatype="FP32", shape=(2,))],
        golden_inputs=None,
        max_batch_size=8,
        preprocessing=PythonSpec.model_validate(SPEC),
        answer_items=[item],
        formats=("onnx",),
    )


@pytest.fixture(scope="module")
def repository(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("own-code")
    copy_model("wine", root / "wine")
    write_scorer(root / "scorer")
    write_chain(root / "chain")  # loads before the scorer it calls by name: the server waits
    write_chain(root / "selfie", step="selfie")  # calls itself
    write_scorer(root / "swapped")  # a step that gets other weights (its own gates pass)
    write_chain(root / "over_swapped", step="swapped")
    export_with_the_cli(root, tmp_path_factory.mktemp("user-src"))
    for change, _ in CHANGES:
        folder = root / ("edited_" + _folder_name(change))
        write_scorer(folder)
        _change(folder, change)
    bare = root / "unimportable"
    write_scorer(bare)
    for name in ("manifest.json", "golden.npz"):
        (bare / "1" / name).unlink()
    scorer = bare / "scorer.py"
    scorer.write_text(scorer.read_text().replace("import time", "import tiem"))
    config = yaml.safe_load((bare / "config.yaml").read_text())
    config.update(
        inputs=[{"name": "x", "datatype": "FP32", "shape": [4]}],
        outputs=[{"name": "y", "datatype": "FP32", "shape": [2]}],
    )
    (bare / "config.yaml").write_text(yaml.safe_dump(config))
    return root


@pytest.fixture(scope="module")
def server(repository: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    log = tmp_path_factory.mktemp("own-code-log") / "server.log"
    server = Server(
        repository,
        env={"TG_STRICT_READINESS": "false", "TG_ADMIN_TOKEN": ADMIN},
        log_path=log,
    )
    try:
        server.wait_until()
        yield server
    finally:
        server.stop()


def wine_split() -> tuple[list[dict[str, float]], list[int]]:
    import importlib.util

    spec = importlib.util.spec_from_file_location("wine_build", REPO_ROOT / "models/wine/build.py")
    assert spec is not None and spec.loader is not None
    build = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(build)
    _, _, test_x, test_y = build.load_split()
    return test_x, test_y


def shuffled(record: dict[str, float], seed: int) -> dict[str, float]:
    keys = list(record)
    random.Random(seed).shuffle(keys)
    return {k: record[k] for k in keys}


def predict(
    server: Server, model: str, instances: Sequence[object], headers: dict[str, str] | None = None
) -> httpx.Response:
    return server.client.post(
        f"/v1/models/{model}:predict", json={"instances": instances}, headers=headers
    )


# -- wine: the tabular example --------------------------------------------------------------------


def test_wine_held_out_accuracy_over_http_equals_the_offline_one_exactly(server: Server) -> None:
    records, labels = wine_split()
    manifest = json.loads((REPO_ROOT / "models/wine/1/manifest.json").read_text())
    answers = []
    for start in range(0, len(records), 8):  # fields in any order
        chunk = [shuffled(r, i) for i, r in enumerate(records[start : start + 8], start)]
        response = predict(server, "wine", chunk)
        assert response.status_code == 200, response.text
        answers.extend(response.json()["predictions"])
    correct = sum(int(a["index"] == t) for a, t in zip(answers, labels, strict=True))
    assert correct == manifest["metrics"]["heldout_correct"]
    assert {a["class"] for a in answers} <= {"class_0", "class_1", "class_2"}


def test_wine_over_v2_answers_json_texts_equal_to_v1(server: Server) -> None:
    records, _ = wine_split()
    v1 = predict(server, "wine", records[:3]).json()["predictions"]
    body = {
        "inputs": [
            {
                "name": "record",
                "datatype": "BYTES",
                "shape": [3],
                "data": [json.dumps(r) for r in records[:3]],
            }
        ]
    }
    response = server.client.post("/v2/models/wine/infer", json=body)
    assert response.status_code == 200, response.text
    (output,) = response.json()["outputs"]
    assert (output["name"], output["datatype"], output["shape"]) == ("answer", "BYTES", [3])
    assert [json.loads(text) for text in output["data"]] == v1
    # the model's own tensors are still there, by name
    body["outputs"] = [{"name": "logits"}]
    logits = server.client.post("/v2/models/wine/infer", json=body).json()["outputs"][0]
    assert logits["shape"] == [3, 3]


def test_wine_missing_fields_are_imputed_as_in_training_and_said(server: Server) -> None:
    records, _ = wine_split()
    gappy: dict[str, float | None] = {
        k: v for k, v in records[0].items() if k not in ("proline", "hue")
    }
    gappy["ash"] = None
    (answer,) = predict(server, "wine", [gappy]).json()["predictions"]
    assert sorted(answer["imputed"]) == ["ash", "hue", "proline"]


@pytest.mark.parametrize(
    ("instance", "says"),
    [
        ({"alcohol": "strong"}, "field 'alcohol' must be a finite number, not 'strong'"),
        ({"colour": 3}, "unknown fields ['colour']"),
        # finite as JSON, infinite as float32 once scaled: it was a 200 with the model's garbage
        ({"alcohol": 1e308}, "fields ['alcohol'] are out of range: infinite as the model's"),
        ("a red", "a wine is a JSON object of its measurements, not str"),
        ([1, 2, 3], "a wine is a JSON object of its measurements, not list"),
    ],
)
def test_a_bad_record_is_a_400_naming_the_model_and_what_the_code_said(
    server: Server, instance: object, says: str
) -> None:
    response = predict(server, "wine", [instance])
    assert response.status_code == 400
    assert response.json()["error"].startswith(f"model 'wine': {says}")


def test_a_bad_record_among_several_is_named_by_its_place(server: Server) -> None:
    """Its 400 named no instance: which of 3 was it?"""
    records, _ = wine_split()
    response = predict(server, "wine", [records[0], records[1], {"colour": 3}])
    assert response.status_code == 400
    assert response.json()["error"].startswith(
        "model 'wine': item at index 2 (of 3): unknown fields"
    )


def test_one_bad_record_among_concurrent_requests_fails_alone_and_they_batch(
    server: Server,
) -> None:
    records, _ = wine_split()
    expected = predict(server, "wine", records[:24]).json()["predictions"]
    before = server.client.get("/v2/models/wine/stats").json()["model_stats"][0]

    def one(index: int) -> httpx.Response:
        if index == 12:
            return predict(server, "wine", [{"alcohol": "lots"}])
        return predict(server, "wine", [records[index]])

    with ThreadPoolExecutor(24) as pool:
        responses = list(pool.map(one, range(24)))
    for index, response in enumerate(responses):
        if index == 12:
            assert response.status_code == 400
            assert "field 'alcohol' must be a finite number, not 'lots'" in response.text
        else:
            assert response.status_code == 200, response.text
            assert response.json()["predictions"] == [expected[index]]
    after = server.client.get("/v2/models/wine/stats").json()["model_stats"][0]
    inferences = after["inference_count"] - before["inference_count"]
    executions = after["execution_count"] - before["execution_count"]
    assert inferences == 23 and executions < inferences  # requests shared batches
    timing = after["inference_stats"]
    assert timing["compute_input"]["ns"] > 0 and timing["compute_output"]["ns"] > 0


def test_preprocess_returns_what_the_training_adapter_makes_byte_for_byte(server: Server) -> None:
    records, _ = wine_split()
    response = server.client.post("/v1/models/wine:preprocess", json={"instances": records[:2]})
    assert response.status_code == 200
    import io

    served = np.load(io.BytesIO(response.content))["features"]
    config = yaml.safe_load((REPO_ROOT / "models/wine/config.yaml").read_text())
    spec = PythonSpec.model_validate(config["preprocessing"])
    import sys

    sys.path.insert(0, str(REPO_ROOT / "models/wine"))
    try:
        from pipeline import WinePipeline  # type: ignore[import-not-found]  # models/wine, on sys.path
    finally:
        sys.path.remove(str(REPO_ROOT / "models/wine"))
    dataset = PipelineDataset(WinePipeline(**spec.params), records[:2], [0, 0])
    trained = np.stack([dataset[i][0]["features"].numpy() for i in range(2)])
    assert served.dtype == trained.dtype and served.tobytes() == trained.tobytes()


# -- the scorer: failures of the code, and the gates ----------------------------------------------


def test_the_scorer_answers_through_its_code_and_a_local_module(server: Server) -> None:
    (answer,) = predict(server, "scorer", [{"x": [1, 2, 3, 4]}]).json()["predictions"]
    assert answer["label"] in ("left", "right") and answer["sent"] == [1, 2, 3, 4]
    torch.manual_seed(0)
    eager = torch.nn.Linear(4, 2)(torch.tensor([[0.5, 1.0, 1.5, 2.0]]))[0].tolist()
    np.testing.assert_allclose(answer["y"], eager, rtol=1e-5, atol=1e-6)


def test_a_bug_in_the_code_is_a_500_with_the_traceback_in_the_log_only(server: Server) -> None:
    response = predict(server, "scorer", [{"bug": 1}], headers={"X-Request-ID": "code-bug"})
    assert response.status_code == 500
    assert "a bug in the code" not in response.text and "code-bug" in response.text
    server.wait_for(lambda: "KeyError: 'a bug in the code'" in server.log(), timeout=10)
    assert predict(server, "scorer", [{"x": [0, 0, 0, 1]}]).status_code == 200


def test_code_that_exits_or_returns_no_arrays_fails_only_its_request(server: Server) -> None:
    """A ``sys.exit()`` in a model's code (SystemExit, or KeyboardInterrupt) went through the
    pool's future into the event loop and ended the server, every model with it; over REST
    the client got a plain-text 500 without its request id."""
    import tritonclient.grpc as tgrpc

    for n, record in enumerate(({"exit": 1}, {"interrupt": 1}, {"listed": 1})):
        request_id = f"code-exit-{n}"
        response = predict(server, "scorer", [record], headers={"X-Request-ID": request_id})
        assert response.status_code == 500, response.text
        assert response.json()["request_id"] == request_id
    for logged in (
        "its code raised SystemExit",
        "its code raised KeyboardInterrupt",
        "preprocess() returned list, not a dict of numpy arrays",
    ):
        server.wait_for(lambda logged=logged: logged in server.log(), timeout=10)
    client = tgrpc.InferenceServerClient(server.grpc_url)
    try:
        item = tgrpc.InferInput("record", [1], "BYTES")
        item.set_data_from_numpy(np.array([json.dumps({"exit": 1}).encode()], dtype=object))
        with pytest.raises(tgrpc.InferenceServerException) as failed:
            client.infer("scorer", [item])
        assert failed.value.status() == "StatusCode.INTERNAL"
    finally:
        client.close()
    assert server.process.poll() is None  # still serving, every model
    assert predict(server, "scorer", [{"x": [0, 0, 0, 1]}]).status_code == 200


def test_a_hanging_step_is_a_504_at_the_deadline_and_the_server_serves_on(
    server: Server, tmp_path: Path
) -> None:
    """Two steps that hang hold both of the scorer's code threads (TG_PREPROCESS_THREADS=2):
    another model's code runs on threads of its own (in one shared pool, it waited), and once
    they are answered 504 spare threads take their places, so the scorer's next request runs
    while they still hang (it waited behind them, and was a 504 too)."""
    woke = [tmp_path / "woke-1", tmp_path / "woke-2"]
    hung = [{"hang": 6, "x": [0, 0, 0, 0], "done": str(path)} for path in woke]
    with ThreadPoolExecutor(2) as clients:
        responses = list(
            clients.map(
                lambda item: predict(server, "scorer", [item], {"X-Request-Timeout": "0.5"}), hung
            )
        )
    for response in responses:
        assert response.status_code == 504
        assert "model 'scorer': its preprocessing code did not finish" in response.json()["error"]
    assert not any(path.exists() for path in woke)  # answered at the deadline; still hung
    assert predict(server, "wine", [{"hue": 1.0}]).status_code == 200
    assert predict(server, "scorer", [{"x": [0, 1, 0, 0]}]).status_code == 200
    assert not any(path.exists() for path in woke)  # served while the scorer's threads hung
    for path in woke:
        server.wait_for(path.exists, timeout=30)  # its code threads are free again
    assert predict(server, "scorer", [{"x": [0, 1, 0, 0]}]).status_code == 200


def test_slow_parameters_code_holds_no_other_request_and_meets_the_deadline(
    server: Server, tmp_path: Path
) -> None:
    """A pipeline's parameters() ran on the event loop, past the request's deadline: one
    that slept 3 s held /v2/health/live and every model for 3 s, then answered 200."""
    said = tmp_path / "said"
    item = {"x": [0, 0, 1, 0], "slow": {"s": 4, "done": str(said)}}
    headers = {"X-Request-Timeout": "0.5", "X-Request-ID": "slow-parameters"}
    response = predict(server, "scorer", [item], headers)
    assert response.status_code == 504, response.text
    assert "model 'scorer': its postprocessing code did not finish" in response.json()["error"]
    # the access line shows where the time went (it said postprocess_ms 0.0 for a failure)
    server.wait_for(lambda: "slow-parameters" in server.log(), timeout=10)
    (line,) = [
        json.loads(text)
        for text in server.log().splitlines()
        if text.startswith("{") and '"request_id":"slow-parameters"' in text.replace(" ", "")
    ]
    assert line["status"] == 504 and line["postprocess_ms"] >= 300, line
    assert server.client.get("/v2/health/live").status_code == 200
    assert predict(server, "wine", [{"hue": 1.0}]).status_code == 200
    assert not said.exists()  # all that while, parameters() slept
    server.wait_for(said.exists, timeout=30)


def test_metadata_offers_the_raw_input_and_the_answer_output(server: Server) -> None:
    metadata = server.client.get("/v2/models/scorer").json()
    assert {"name": "record", "datatype": "BYTES", "shape": [-1]} in metadata["inputs"]
    assert {"name": "answer", "datatype": "BYTES", "shape": [-1]} in metadata["outputs"]


def _load(server: Server, name: str) -> httpx.Response:
    return server.client.post(
        f"/v2/repository/models/{name}/load", headers={"Authorization": f"Bearer {ADMIN}"}
    )


def _reason(server: Server, name: str) -> str:
    metadata = server.client.get(f"/v2/models/{name}").json()
    assert metadata["state"] == "UNAVAILABLE", metadata
    return str(metadata["reason"])


def _change(folder: Path, change: str) -> None:
    if change == "one byte of scorer.py":
        path = folder / "scorer.py"
        path.write_text(path.read_text().replace("* self.scale", "/ self.scale"))
    elif change == "one byte of labels.py":
        path = folder / "labels.py"
        path.write_text(path.read_text().replace("NAMES[index]", "NAMES[~index]"))
    elif change == "numpy's version":
        manifest = folder / "1" / "manifest.json"
        data = json.loads(manifest.read_text())
        data["code"]["packages"]["numpy"] = "1.0.0"
        manifest.write_text(json.dumps(data))
    elif change == "an answer item gone":
        next((folder / "1" / "answers").iterdir()).unlink()
    else:  # its data file, not code: only the end-to-end replay can see it
        (folder / "labels.txt").write_text("right left\n")


CHANGES = [
    ("one byte of scorer.py", "preprocessing code: scorer.py changed since export"),
    ("one byte of labels.py", "preprocessing code: labels.py changed since export"),
    ("numpy's version", "preprocessing code imports numpy 2."),
    ("its data file", "end-to-end golden replay of answers/0-"),
    (  # was "unexpected error while loading: FileNotFoundError: ... at pathlib.py:1044"
        "an answer item gone",
        "(listed in manifest.json), cannot be read (No such file or directory): export the "
        "version again",
    ),
]


def _folder_name(change: str) -> str:
    return "scorer_" + change.split()[-1].replace(".", "_").replace("'", "")


@pytest.mark.parametrize(("change", "says"), CHANGES)
def test_a_version_whose_pipeline_changed_since_export_is_unavailable_naming_what(
    server: Server, change: str, says: str
) -> None:
    """Changed before the server started: the version never serves, and says why in a line."""
    reason = _reason(server, "edited_" + _folder_name(change))
    assert says in reason and "\n" not in reason
    assert (
        predict(server, "edited_" + _folder_name(change), [{"x": [1, 0, 0, 0]}]).status_code == 503
    )


@pytest.mark.parametrize(("change", "says"), CHANGES)
def test_a_reload_of_a_changed_pipeline_is_refused_and_accepted_after_re_export(
    server: Server, repository: Path, change: str, says: str
) -> None:
    """Changed while served: the repository API's load goes through the same gates (the
    version already serving serves on), and a re-export makes the change the served one."""
    name = _folder_name(change)
    folder = repository / name
    shutil.rmtree(folder, ignore_errors=True)
    write_scorer(folder)
    assert _load(server, name).status_code == 200
    before = predict(server, name, [{"x": [1, 0, 0, 0]}]).json()["predictions"]
    _change(folder, change)
    refused = _load(server, name)
    assert refused.status_code == 400 and says in refused.json()["error"], refused.text
    assert predict(server, name, [{"x": [1, 0, 0, 0]}]).json()["predictions"] == before
    shutil.rmtree(folder / "1")
    export_scorer(folder)  # re-export: the code (or data) now is what the model ships with
    assert _load(server, name).status_code == 200, _load(server, name).text
    after = predict(server, name, [{"x": [1, 0, 0, 0]}])
    assert after.status_code == 200
    if change not in ("numpy's version", "an answer item gone"):  # neither changes answers
        assert after.json()["predictions"] != before  # the new code (or data) serves
    assert predict(server, "wine", [{"hue": 1.0}]).status_code == 200  # others serve on


def test_code_that_cannot_be_imported_is_a_load_refusal_in_one_line(server: Server) -> None:
    """(Without a manifest, the only way past the code gate: a bare model.onnx.)"""
    reason = _reason(server, "unimportable")
    assert "preprocessing code scorer.Scorer failed to load: ModuleNotFoundError" in reason
    assert "No module named 'tiem'" in reason and "\n" not in reason
    assert "Traceback" in server.log()


def test_code_that_calls_its_own_model_as_a_step_is_refused_saying_so(server: Server) -> None:
    """It could never load, and its reason said "unknown model 'selfie'"."""
    reason = _reason(server, "selfie")
    assert "its pipeline calls its own model 'selfie' as a step" in reason, reason


def test_code_is_only_loaded_from_the_repository(server: Server) -> None:
    """A request cannot name code: the spec lives in config.yaml, and a request that tries to
    load a model from elsewhere is refused before any file is read."""
    body = {"parameters": {"config": json.dumps({"preprocessing": SPEC})}}
    response = server.client.post(
        "/v2/repository/models/..%2F..%2Fetc/load",
        json=body,
        headers={"Authorization": f"Bearer {ADMIN}"},
    )
    assert response.status_code in (400, 404)


def test_export_records_the_code_and_its_answers(repository: Path) -> None:
    manifest = json.loads((repository / "scorer/1/manifest.json").read_text())
    assert sorted(manifest["code"]["files"]) == ["labels.py", "scorer.py"]
    assert "numpy" in manifest["code"]["packages"]
    (pair,) = manifest["answers"]
    assert pair["content_type"] == "application/json"
    assert (repository / "scorer/1" / pair["file"]).is_file()
    assert pair["answer"]["sent"] == [1.0, -2.0, 3.0, 0.5]
    assert Item((repository / "scorer/1" / pair["file"]).read_bytes()).json()["x"][0] == 1.0


# -- a pipeline over several models ---------------------------------------------------------------


def test_a_pipeline_step_calls_another_served_model_and_answers_as_eager(server: Server) -> None:
    x = [0.5, -1.0, 2.0, 0.25]
    (answer,) = predict(server, "chain", [{"x": x}]).json()["predictions"]
    first = eager(linear(1), x)
    np.testing.assert_allclose(answer["first"], first, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(answer["second"], eager(linear(0), first * 2), rtol=1e-5, atol=1e-5)


def test_steps_of_concurrent_requests_batch_at_the_step_model(server: Server) -> None:
    def stats() -> dict[str, int]:
        found = server.client.get("/v2/models/scorer/stats").json()["model_stats"][0]
        return {k: found[k] for k in ("inference_count", "execution_count")}

    before = stats()
    with ThreadPoolExecutor(16) as pool:
        responses = list(
            pool.map(lambda i: predict(server, "chain", [{"x": [i, 0, 0, 1]}]), range(32))
        )
    assert all(r.status_code == 200 for r in responses)
    after = stats()
    inferences = after["inference_count"] - before["inference_count"]
    executions = after["execution_count"] - before["execution_count"]
    assert inferences == 32 and executions < inferences
    # on /metrics too, as protocol "step": its dashboard panels showed the step model idle
    samples = {
        line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
        for line in server.client.get("/metrics").text.splitlines()
        if line.startswith("tensorgate_") and 'model="scorer"' in line
    }
    steps = (
        'tensorgate_requests_total{model="scorer",outcome="success",protocol="step",version="1"}'
    )
    assert samples[steps] >= 32
    for failed in ("error", "unavailable", "timeout"):  # from 0, so that rate() sees the first
        assert steps.replace("success", failed) in samples
    assert samples['tensorgate_compute_duration_seconds_count{model="scorer"}'] >= 32
    assert (
        samples['tensorgate_request_duration_seconds_count{model="scorer",protocol="step"}'] >= 32
    )


@pytest.mark.parametrize(
    ("step", "status", "says"),
    [
        # the code's own mistakes are its 500s, not the client's 404 or 400
        ("nosuch", 500, "pipeline step 'nosuch': unknown model 'nosuch'"),
        ("edited_scorer_scorer_py", 503, "pipeline step 'edited_scorer_scorer_py': model "),
        ("wine", 500, "pipeline step 'wine': the code sent inputs ['x']; model 'wine' takes"),
    ],
)
def test_a_step_that_fails_fails_the_request_naming_the_step(
    server: Server, step: str, status: int, says: str
) -> None:
    response = predict(server, "chain", [{"x": [1, 2, 3, 4], "step": step}])
    assert response.status_code == status
    assert says in response.json()["error"]
    assert predict(server, "chain", [{"x": [1, 2, 3, 4]}]).status_code == 200


@pytest.mark.parametrize(
    ("record", "says"),
    [
        # 2,000 rows of a small request: the code's, not the client's 413
        (
            {"rows": 2000},
            "pipeline step 'scorer': model 'scorer': 2000 rows is above the 1024 one request "
            "may carry (max_request_rows): the code sent more than the model takes in one "
            "request; send it in parts, or raise the limit in its config.yaml",
        ),
        # the inputs as (name, array) pairs: said so, without the arrays' contents
        (
            {"as_list": True},
            "pipeline step 'scorer': models.infer() takes a mapping of input name to array, "
            "e.g. {'image': batch}; the code sent a list",
        ),
    ],
)
def test_a_step_the_code_asks_wrongly_for_is_its_500(
    server: Server, record: dict[str, object], says: str
) -> None:
    response = predict(server, "chain", [{"x": [1, 2, 3, 4], **record}])
    assert response.status_code == 500, response.text
    assert says in response.json()["error"]
    assert predict(server, "chain", [{"x": [1, 2, 3, 4]}]).status_code == 200


def test_a_pipeline_whose_step_is_unloaded_says_so_until_the_step_serves_again(
    server: Server,
) -> None:
    """The steps its load's replay called: while one is unloaded the pipeline is not ready
    (REST, gRPC, metadata, the index, its state metric) and a request is a 503 naming the
    step before any work; the step's own unload does not make the server unready."""
    import tritonclient.grpc as tgrpc

    said = "its pipeline step 'scorer': model 'scorer' is unloaded"
    admin = {"authorization": f"Bearer {ADMIN}"}
    unloaded = server.client.post(
        "/v2/repository/models/scorer/unload", headers={"Authorization": f"Bearer {ADMIN}"}
    )
    assert unloaded.status_code == 200, unloaded.text
    client = tgrpc.InferenceServerClient(server.grpc_url)
    try:
        assert server.client.get("/v2/models/chain/ready").status_code == 503
        assert not client.is_model_ready("chain")
        metadata = server.client.get("/v2/models/chain").json()
        assert metadata["state"] == "UNAVAILABLE" and said in metadata["reason"], metadata
        (row,) = [
            r for r in client.get_model_repository_index(headers=admin).models if r.name == "chain"
        ]
        assert row.state == "UNAVAILABLE" and said in row.reason
        assert 'tensorgate_model_state{model="chain",state="UNAVAILABLE",version="1"} 1.0' in (
            server.client.get("/metrics").text
        )
        series = 'tensorgate_requests_total{model="chain",outcome="unavailable",'
        series += 'protocol="v1",version="1"} '

        def unavailable() -> float:  # a series from 0 on, for the error-ratio alert
            (line,) = [s for s in server.client.get("/metrics").text.splitlines() if series in s]
            return float(line.removeprefix(series))

        before = unavailable()
        response = predict(server, "chain", [{"x": [1, 2, 3, 4]}])
        assert response.status_code == 503 and said in response.json()["error"], response.text
        assert unavailable() == before + 1  # counted by its version, not version=""
        assert server.client.get("/v2/health/ready").status_code == 200
    finally:
        client.close()
        assert _load(server, "scorer").status_code == 200
    assert server.client.get("/v2/models/chain/ready").status_code == 200
    assert server.client.get("/v2/models/chain").json()["state"] == "READY"
    assert predict(server, "chain", [{"x": [1, 2, 3, 4]}]).status_code == 200


def test_a_step_loaded_with_other_answers_leaves_its_pipeline_unavailable_until_they_match(
    server: Server,
) -> None:
    """A step's load replays the answers of each pipeline that calls it through it: a step
    that now answers otherwise leaves the pipeline UNAVAILABLE, naming the step and the failed
    replay. The pipeline kept serving, READY and verified, answers its own gate refused."""
    folder = server.repository / "swapped"
    pipeline = {"x": [0.5, 1.0, -1.0, 2.0], "step": "swapped"}
    assert predict(server, "over_swapped", [pipeline]).status_code == 200
    try:
        export_scorer(folder, seed=5)  # version 1 again, other weights: its own gates pass
        assert _load(server, "swapped").status_code == 200
        metadata = server.client.get("/v2/models/over_swapped").json()
        assert metadata["state"] == "UNAVAILABLE", metadata
        assert (
            "its pipeline step 'swapped' version 1 was loaded after this version's end-to-end "
            "replay ran through the one before; replaying its answers through it failed: "
        ) in metadata["reason"]
        assert "end-to-end golden replay" in metadata["reason"]
        response = predict(server, "over_swapped", [pipeline])
        assert response.status_code == 503, response.text
        assert server.client.get("/v2/models/over_swapped/ready").status_code == 503
        assert server.client.get("/v2/models/swapped/ready").status_code == 200  # the step serves
    finally:
        export_scorer(folder)  # its weights back: the replay passes again
        assert _load(server, "swapped").status_code == 200
    assert server.client.get("/v2/models/over_swapped").json()["state"] == "READY"
    assert predict(server, "over_swapped", [pipeline]).status_code == 200


def test_a_step_model_reloaded_under_traffic_fails_no_pipeline_request(server: Server) -> None:
    """The step's version was looked up on the code's thread and used on the loop: a reload
    in between retired it, and the pipeline's request failed 503 'unloaded while the request
    waited' (6 of a few hundred in 15 reloads); direct requests were never failed."""
    stop = threading.Event()
    statuses: list[int] = []

    def send() -> None:
        while not stop.is_set():
            statuses.append(predict(server, "chain", [{"x": [1, 2, 3, 4]}] * 4).status_code)

    with ThreadPoolExecutor(3) as clients:
        sending = [clients.submit(send) for _ in range(3)]
        try:
            for _ in range(8):
                os.utime(server.repository / "scorer" / "1" / "model.onnx")  # else kept
                assert _load(server, "scorer").status_code == 200
        finally:
            stop.set()
        for done in sending:
            done.result()
    assert statuses and set(statuses) == {200}, collections.Counter(statuses)


def test_a_model_exported_with_the_cli_and_its_written_config_serves_its_code(
    server: Server, repository: Path
) -> None:
    folder = repository / "from_cli"
    assert sorted(p.name for p in folder.glob("*.py")) == ["labels.py", "scorer.py"]
    config = yaml.safe_load((folder / "config.yaml").read_text())
    assert config["preprocessing"] == SPEC
    (answer,) = predict(server, "from_cli", [{"x": [1, 2, 3, 4]}]).json()["predictions"]
    assert answer["sent"] == [1, 2, 3, 4] and answer["label"] in ("left", "right")


def test_the_code_serves_over_grpc_with_tritons_own_client(server: Server) -> None:
    import tritonclient.grpc as tgrpc

    client = tgrpc.InferenceServerClient(server.grpc_url)
    try:
        record = tgrpc.InferInput("record", [2], "BYTES")
        items = [json.dumps({"x": [1, 2, 3, 4]}).encode(), b"[1]"]
        record.set_data_from_numpy(np.array(items[:1], dtype=object).repeat(2))
        result = client.infer("scorer", [record], outputs=[tgrpc.InferRequestedOutput("answer")])
        answers = [json.loads(a) for a in result.as_numpy("answer")]
        assert [a["sent"] for a in answers] == [[1, 2, 3, 4], [1, 2, 3, 4]]
        record = tgrpc.InferInput("record", [1], "BYTES")
        record.set_data_from_numpy(np.array(items[1:], dtype=object))
        with pytest.raises(tgrpc.InferenceServerException, match="a record is a JSON object"):
            client.infer("scorer", [record])
    finally:
        client.close()


def test_items_come_as_sent_with_their_content_type(server: Server) -> None:
    """A v1 body's item has the body's Content-Type (it had none: code that branched on it
    passed the load's replay, whose items have their files' types, and answered otherwise
    served); {"b64": ...} instances beside JSON values are their decoded bytes (they came as
    the JSON object {"b64": ...}, which code written to the docs failed on: a 500)."""
    body = json.dumps({"x": [1, 2, 3, 4]}).encode()
    raw = server.client.post(
        "/v1/models/scorer:predict",
        content=body,
        headers={"Content-Type": "application/octet-stream"},
    )
    assert raw.status_code == 200, raw.text
    assert raw.json()["predictions"][0]["type"] == "application/octet-stream"
    encoded = {"b64": base64.b64encode(body).decode()}
    mixed = predict(server, "scorer", [encoded, {"x": [4, 3, 2, 1]}])
    assert mixed.status_code == 200, mixed.text
    answers = mixed.json()["predictions"]
    assert [a["sent"] for a in answers] == [[1, 2, 3, 4], [4, 3, 2, 1]]
    assert [a["type"] for a in answers] == [None, None]  # inside JSON: no type of their own


def test_postprocess_and_its_steps_run_within_the_requests_deadline(server: Server) -> None:
    """postprocess() had a deadline of its own from its start: with `X-Request-Timeout: 1`,
    0.7 s of preprocess then 0.7 s of postprocess answered 200 after 1.4 s. And a timeout
    parameter of 1e16 µs, past what a thread can wait for a step, was a 500."""
    record = {"x": [1, 2, 3, 4], "pre": 0.7, "wait": 0.7}
    late = predict(server, "chain", [record], {"X-Request-Timeout": "1"})
    assert late.status_code == 504, late.text
    assert "postprocessing code did not finish within the request's deadline" in late.text
    text = {"name": "record", "datatype": "BYTES", "shape": [1], "data": ['{"x": [1, 2, 3, 4]}']}
    far = server.client.post(
        "/v2/models/chain/infer", json={"inputs": [text], "parameters": {"timeout": 1e16}}
    )
    assert far.status_code == 200, far.text


def test_a_step_called_after_its_client_left_is_not_run(server: Server, tmp_path: Path) -> None:
    def calls() -> int:
        stats = server.client.get("/v2/models/scorer/stats").json()["model_stats"][0]
        return int(stats["inference_stats"]["success"]["count"])

    before = calls()
    done = tmp_path / "tried"
    with pytest.raises(httpx.ReadTimeout):
        server.client.post(
            "/v1/models/chain:predict",
            json={"instances": [{"x": [1, 2, 3, 4], "wait": 1.0, "done": str(done)}]},
            timeout=0.3,
        )
    server.wait_for(done.exists, timeout=30)  # the code woke after its client left, tried
    assert calls() == before
    assert predict(server, "chain", [{"x": [1, 2, 3, 4]}]).status_code == 200
    assert calls() == before + 1
