"""A v1 image request alone in flight crosses threads once, as the README says: the event loop
hands its raw image to the model's instance thread, which preprocesses it and runs the model,
and hands the answer back. Counted at the event loop, for a small and a large JPEG."""

from __future__ import annotations

import asyncio
import io
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import skimage.data
from PIL import Image

from service.settings import Settings
from tests.asgi import InProcess
from tests.server import copy_model

pytestmark = pytest.mark.integration


def jpeg(size: tuple[int, int], quality: int) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(skimage.data.astronaut()).resize(size).save(buffer, "JPEG", quality=quality)
    return buffer.getvalue()


@pytest.fixture(scope="module")
def app(tmp_path_factory: pytest.TempPathFactory) -> Iterator[InProcess]:
    root = tmp_path_factory.mktemp("hops")
    copy_model("efficientnet_lite0", root / "efficientnet_lite0")
    running = InProcess(Settings(model_repository=root, access_log=False))
    try:
        yield running
    finally:
        running.close()


@pytest.mark.parametrize("size", [(96, 64), (512, 512)])
def test_a_lone_image_request_crosses_threads_once(
    app: InProcess, size: tuple[int, int], monkeypatch: pytest.MonkeyPatch
) -> None:
    body = jpeg(size, quality=95)
    assert size == (96, 64) or len(body) > 64 * 1024  # a large body too: offload is by work
    hops: list[Any] = []
    loop = app.loop
    submit = ThreadPoolExecutor.submit

    def counting(executor: ThreadPoolExecutor, fn: Any, /, *args: Any, **kwargs: Any) -> Any:
        try:
            here = asyncio.get_running_loop()
        except RuntimeError:  # a thread with no loop (the instance's, handing half a resize on)
            here = None
        if here is loop:  # the loop's own hand-offs: run_in_executor's and the scheduler's
            hops.append(getattr(fn, "__qualname__", repr(fn)))
        return submit(executor, fn, *args, **kwargs)

    monkeypatch.setattr(ThreadPoolExecutor, "submit", counting)
    reply = app.request(
        app.serving,
        "POST",
        "/v1/models/efficientnet_lite0:predict",
        body,
        [("content-type", "image/jpeg")],
    )
    monkeypatch.undo()
    assert reply.status == 200, reply.body
    assert len(hops) == 1, hops  # the instance thread's: preprocessing and the model together
