"""Inputs whose preprocessing would cost what the client sent rather than what the model gets:
each is refused with a 400 naming the limit, or answered at a cost bounded by the model's input,
measured as the growth of the server's peak resident memory (VmHWM)."""

from __future__ import annotations

import io
import struct
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import pytest
from PIL import Image

from tests.server import Server, copy_model

pytestmark = pytest.mark.integration

BOUND = 200 * 2**20
"""What the server's peak RSS may grow by while it answers one test's requests."""


def peak_rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM in /proc status")


def peak_growth(server: Server, requests: Callable[[], None]) -> int:
    """How far the server's peak RSS rises above its RSS now while ``requests`` run."""
    Path(f"/proc/{server.process.pid}/clear_refs").write_text("5")  # VmHWM := VmRSS
    before = peak_rss_bytes(server.process.pid)
    requests()
    return peak_rss_bytes(server.process.pid) - before


def strip(size: tuple[int, int]) -> bytes:
    buffer = io.BytesIO()
    Image.new("L", size, 128).save(buffer, format="PNG")
    return buffer.getvalue()


def test_strip_images_get_a_400_naming_the_limit_and_cost_next_to_nothing(server: Server) -> None:
    """10000×1 and 1×10000 PNGs of about a hundred bytes, four at once: resized whole, each
    would be 2.56 M × 256 pixels (2.4 GiB apiece)."""
    bodies = [strip((10_000, 1)), strip((1, 10_000))] * 2
    answers: list[httpx.Response] = []

    def post(body: bytes) -> httpx.Response:
        with httpx.Client(base_url=server.url, timeout=60) as client:
            return client.post(
                "/v1/models/efficientnet_lite0:predict",
                content=body,
                headers={"content-type": "image/png"},
            )

    def send() -> None:
        with ThreadPoolExecutor(4) as pool:
            answers.extend(pool.map(post, bodies))

    grown = peak_growth(server, send)
    for answer in answers:
        assert answer.status_code == 400, answer.text
        error = answer.json()["error"]
        assert "an aspect ratio of 10000:1" in error
        assert "up to 20:1" in error
    assert grown < BOUND, f"peak RSS grew {grown / 2**20:.0f} MiB"


def predict(server: Server, body: bytes, media_type: str) -> httpx.Response:
    """efficientnet_lite0's v1 predict of one image's bytes."""
    return server.client.post(
        "/v1/models/efficientnet_lite0:predict", content=body, headers={"content-type": media_type}
    )


def test_a_dds_file_with_an_unknown_pixel_format_gets_a_400(server: Server) -> None:
    header = struct.pack("<4s7I", b"DDS ", 124, 0x1007, 4, 4, 0, 0, 0) + bytes(44)
    pixel_format = struct.pack("<2I4s5I", 32, 0x4, b"ABCD", 0, 0, 0, 0, 0)
    dds = header + pixel_format + struct.pack("<5I", 0x1000, 0, 0, 0, 0) + bytes(64)
    answer = predict(server, dds, "application/octet-stream")
    assert answer.status_code == 400, answer.text
    assert (
        "not in a format this server reads (JPEG, PNG, WEBP, GIF, BMP, TIFF)"
        in answer.json()["error"]
    )


def test_a_jpeg_of_20000_empty_scans_gets_a_400_and_the_model_serves_on(server: Server) -> None:
    """674 KB: an 8192² progressive JPEG with 20,000 scans of no data. The decoder passes over
    every block once a scan: 46 s on the model instance's own thread (a lone request is
    preprocessed there), every other request to the model waiting behind it."""
    buffer = io.BytesIO()
    Image.new("RGB", (8192, 8192), (120, 30, 200)).save(
        buffer, "JPEG", progressive=True, quality=50
    )
    jpeg = buffer.getvalue()
    first = jpeg.index(b"\xff\xda")
    crafted = jpeg[:first] + jpeg[first : first + 14] * 20_000 + jpeg[first:]
    assert jpeg[first + 2 : first + 4] == b"\x00\x0c" and len(crafted) < 700_000
    answer = predict(server, crafted, "image/jpeg")
    assert answer.status_code == 400, answer.text
    assert (
        "JPEG has more than 100 scans; this server decodes JPEGs of at most 100"
        in answer.json()["error"]
    )
    photo = io.BytesIO()
    Image.new("RGB", (640, 480), (10, 200, 30)).save(photo, "JPEG", progressive=True)
    served = predict(server, photo.getvalue(), "image/jpeg")
    assert served.status_code == 200, served.text


def embed(server: Server, text: str) -> tuple[np.ndarray, dict[str, object]]:
    answer = server.client.post("/v1/models/minilm:predict", json={"instances": [text]})
    assert answer.status_code == 200, answer.text
    body = answer.json()
    return np.asarray(body["predictions"][0], np.float64), body.get("parameters", {})


TEN_MB = 10 * 2**20
TEXTS = {
    # prose: 256 tokens needed from 2.4 M of them
    "prose": ("the quick brown fox jumps over the lazy dog. " * (TEN_MB // 45 + 1))[:TEN_MB],
    # sparse: ten million spaces, then two words
    "spaces then words": " " * (TEN_MB - 11) + "hello world",
    # one word of ten million letters: a single [UNK]
    "one word": "a" * TEN_MB,
}
SAME_AS = {
    "prose": "the quick brown fox jumps over the lazy dog. " * 40,
    "spaces then words": "hello world",
    "one word": "a" * 101,
}


@pytest.mark.parametrize("name", sorted(TEXTS))
def test_a_10_mb_text_is_answered_at_a_bounded_cost_with_the_tokens_it_holds(
    server: Server, name: str
) -> None:
    """The answer is the one for a short text with the same kept tokens, and the peak RSS grows
    by less than BOUND (tokenized whole, the prose grew it by 1.47 GiB)."""
    answers: list[tuple[np.ndarray, dict[str, object]]] = []
    grown = peak_growth(server, lambda: answers.append(embed(server, TEXTS[name])))
    (embedding, parameters) = answers[0]
    expected, expected_parameters = embed(server, SAME_AS[name])
    assert embedding.shape == (384,)
    np.testing.assert_allclose(embedding, expected, atol=1e-6)
    assert parameters == expected_parameters
    assert grown < BOUND, f"peak RSS grew {grown / 2**20:.0f} MiB"


def rgba(side: int) -> bytes:
    """A ``side``² RGBA PNG of one colour: a few KB that decode into 20 bytes a pixel."""
    buffer = io.BytesIO()
    Image.new("RGBA", (side, side), (10, 200, 30, 128)).save(buffer, format="PNG")
    return buffer.getvalue()


def test_large_decodes_take_turns_within_the_budget_and_none_is_refused(tmp_path: Path) -> None:
    """An 8192² RGBA PNG of 261 KB held 1.28 GiB while it decoded, counted nowhere: eight at
    once took a server from 1.5 to 4.8 GiB. Now images being decoded hold at most
    TG_MAX_INFLIGHT_BYTES together (one alone always runs): four 2048² RGBA PNGs (80 MiB each
    while decoding) sent at once to a server of 96 MiB decode one at a time, and each is
    answered, none refused; the peak stays near one decode's."""
    copy_model("digits", tmp_path / "models" / "digits")
    env = {
        "TG_WORKERS": "1",
        "TG_MAX_INFLIGHT_BYTES": str(96 * 2**20),
        "TG_PREPROCESS_THREADS": "4",
    }
    server = Server(tmp_path / "models", env=env, log_path=tmp_path / "server.log")
    try:
        server.wait_until()
        body = rgba(2048)
        answers: list[httpx.Response] = []

        def post(_: int) -> httpx.Response:
            with httpx.Client(base_url=server.url, timeout=120) as client:
                return client.post(
                    "/v1/models/digits:predict", content=body, headers={"content-type": "image/png"}
                )

        def send() -> None:
            with ThreadPoolExecutor(4) as pool:
                answers.extend(pool.map(post, range(4)))

        post(0)  # the first decode's own allocations settle first
        grown = peak_growth(server, send)
        assert [a.status_code for a in answers] == [200] * 4, [a.text for a in answers]
        # one decode at a time: 68 MiB here; all four at once: 165 MiB
        assert grown < 120 * 2**20, f"peak RSS grew {grown / 2**20:.0f} MiB"
    finally:
        server.stop()
