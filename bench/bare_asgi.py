"""The lone W1 image behind uvicorn and one thread hop: between ``bench.bare_server`` and
tensorgate.

    .venv/bin/python -m bench.bare_asgi PORT

uvicorn with the server's event loop and HTTP parser (uvloop, httptools) and a plain ASGI
application: a POST's body is read, handed to one worker thread that decodes, preprocesses,
runs ONNX Runtime at batch 1 and takes the top-5 exactly as the in-process side of
:func:`bench.batching.one_image_pairs` does, and its JSON is written back (any GET is answered
``{}``, for readiness). What the event loop, the ASGI layer and the hand-off to a thread and
back cost at least, against which ``bench.lone`` sets the rest of tensorgate's way.
"""

from __future__ import annotations

import asyncio
import sys
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import orjson
import uvicorn

from bench.batching import in_process, top5
from service.resources import available_cpus

_pipeline, _runtime = in_process(available_cpus())
_classifier = top5()
_thread = ThreadPoolExecutor(1)


def _answer(body: bytes) -> bytes:
    outputs = _runtime.run({"input": _pipeline(body)[None]})
    return orjson.dumps(_classifier({"logits": outputs["logits"][0]}))


async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    if scope["type"] != "http":
        return
    answer = b"{}"
    if scope["method"] == "POST":
        body, more = b"", True
        while more:
            message = await receive()
            body += message.get("body", b"")
            more = message.get("more_body", False)
        answer = await asyncio.get_running_loop().run_in_executor(_thread, _answer, body)
    headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(answer))]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": answer})


if __name__ == "__main__":
    uvicorn.run(
        app,
        host="127.0.0.1",
        port=int(sys.argv[1]),
        loop="uvloop",
        http="httptools",
        lifespan="off",
        access_log=False,
        log_level="warning",
    )
