"""HTTP for every route, in one place: the one function that answers an inference request
(:func:`answer_inference`, given its route, headers and ASGI ``receive``), the one that turns
any error into a status, headers and body (:func:`error_answer`), and the small helpers the
other routes share. The plain-ASGI inference routes (:mod:`service.http.fast`) and the FastAPI
ones (:mod:`service.http.infer`, which also document the API) both call them."""

from __future__ import annotations

import asyncio
import io
import logging
import math
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar

import numpy as np
import orjson
from fastapi import Request, Response
from starlette.types import Receive

from service.cluster.view import Cluster
from service.core.dataplane import DataPlane
from service.errors import (
    InvalidInput,
    PayloadTooLarge,
    TensorgateError,
    UnsupportedMediaType,
)
from service.limits import compression
from service.limits.admission import error_body
from service.limits.auth import Peer, check_authorization
from service.protocol import v1, v2
from service.telemetry import tracing
from service.telemetry.counters import REFUSED
from service.telemetry.logs import REQUEST_ID
from service.telemetry.observation import After

log = logging.getLogger("tensorgate.app")

T = TypeVar("T")


class ClientGone(Exception):
    """The client disconnected while its request was read: nobody is there to answer."""


LISTED = ("content-encoding", "inference-header-content-length")
"""Request headers whose repeats are kept, joined as a list: the first alone would not be the
meaning (every coding applies; two lengths of a binary body's JSON header are a 400)."""


@dataclass(frozen=True, slots=True)
class Route:
    """Which inference route a request came to."""

    kind: Literal["infer", "predict", "preprocess"]
    model: str
    version: str | None = None


@dataclass(slots=True)
class Answer:
    """What to send: status, headers (lower-case names) and body."""

    status: int
    body: bytes
    headers: dict[str, str] = field(default_factory=dict)


JSON_HELD_PER_BYTE = 20
"""What a JSON body holds while it is decoded, per byte, and takes from the budget before it
is: orjson makes a Python object of every number (24 bytes and a list slot for ``0.5,``), and
numpy then copies them. Measured peaks for a million FP32 values: 20.0× the body for
``0.5``, 17.2× for integers, 13.6× for random float32 values. Binary tensors are viewed
where they lie (1×, counted as the body)."""

CLIENT_GONE = 499
"""nginx's status for a client that left before its answer: nobody reads it."""


async def answer_inference(
    dataplane: DataPlane,
    route: Route,
    headers: Mapping[str, str],
    receive: Receive,
    reserve: Callable[[int], None] | None = None,
    peer: Peer = None,
    after: After | None = None,
) -> Answer:
    """Answer one inference request: token, body (within its limit), decode, the core, encode;
    499 when the client leaves first, and any error as :func:`error_answer` maps it.
    ``headers`` are the request's, names in lower case (the first of repeated ones);
    ``reserve``: the server's budget for bodies in flight, told what a compressed body inflates
    to (:mod:`service.limits.admission`); ``peer``: the client's address (ASGI's ``client``);
    ``after``: where the request's counting and logging wait for the caller to run them once
    it has sent the answer (:meth:`DataPlane.call`), else they run before this returns."""
    settings = dataplane.settings
    trace = None
    tracing.note_caller(headers)
    if tracing.TRACER is not None:
        trace = tracing.begin(
            SPAN_NAMES[route.kind, route.version is not None], headers, REQUEST_ID.get() or ""
        )
    looked_up = False  # whether the request reached its model (its metrics count it then)
    try:
        check_authorization(headers.get("authorization", ""), settings.api_token, "api", peer)
        if route.kind == "infer":
            v2.check_media_type(headers.get("content-type", ""), route.model)
        body = await receive_body(receive, headers.get("content-length"), settings.max_body_bytes)
        encoding = headers.get("content-encoding")
        if encoding is not None:
            body = await dataplane.offload(
                len(body) * 4,
                compression.decompress,
                body,
                encoding,
                settings.max_body_bytes,
                reserve,
            )
        timeout_s = parse_timeout(headers.get("x-request-timeout"))
        if route.kind == "infer":
            header_length = v2.parse_header_length(headers.get(v2.HEADER_LENGTH), len(body))
            json_bytes = len(body) if header_length is None else header_length
            work: Awaitable[Answer] = _infer(
                dataplane, route, body, header_length, timeout_s, after
            )
        else:
            content_type = headers.get("content-type", "")
            json_bytes = v1.decode_work(body, content_type)
            work = _predict(dataplane, route, body, content_type, timeout_s, after)
        if reserve is not None and json_bytes:
            reserve(JSON_HELD_PER_BYTE * json_bytes)  # before it is parsed, past the body
        looked_up = True
        answer = await until_disconnect(receive, work)
    except ClientGone:
        answer = None
    except asyncio.CancelledError as exc:
        answer = error_answer(dataplane.drain.answer_for(exc), f"POST {route.kind} {route.model}")
    except Exception as exc:
        if not looked_up and isinstance(exc, (InvalidInput, UnsupportedMediaType)):
            REFUSED["bad_request"] += 1  # a header or an encoding: no model's metrics see it
        answer = error_answer(exc, f"POST {route.kind} {route.model}")
    if answer is None:
        answer = Answer(CLIENT_GONE, b"")
    elif answer.status == 200:
        # An answer made is held until it is sent (or compressed, one at a time when large):
        # counted, as the body was (16 identity answers of 61 MiB waiting their turn to be
        # compressed held as much again as the bodies the budget admitted), from before it
        # was made (``Call.encode``: as estimated then, as made now).
        budget = dataplane.budget
        if budget is not None:
            budget.hold_for_request(len(answer.body))  # in place of what was estimated
        wanted = compression.choose(headers.get("accept-encoding", ""))
        if wanted is not None and len(answer.body) >= compression.MIN_COMPRESS_BYTES:
            packed = await dataplane.offload(
                len(answer.body), compression.compress, answer.body, wanted
            )
            encoded = {"vary": "accept-encoding"}
            if packed is not None:  # else not worth it: sent as it is
                encoded["content-encoding"] = wanted
            body = answer.body if packed is None else packed
            answer = Answer(answer.status, body, {**answer.headers, **encoded})
            if budget is not None:
                budget.hold_for_request(len(body))
    if trace is not None:
        trace.end(
            answer.status >= 500,
            {"http.request.method": "POST", "http.response.status_code": answer.status},
        )
    return answer


SPAN_NAMES = {
    ("infer", False): "POST /v2/models/{name}/infer",
    ("infer", True): "POST /v2/models/{name}/versions/{version}/infer",
    ("predict", False): "POST /v1/models/{name}:predict",
    ("preprocess", False): "POST /v1/models/{name}:preprocess",
}
"""Each inference route's server span name: its template (a name per model would make every
model its own operation in a tracing backend's index)."""


async def _infer(
    dataplane: DataPlane,
    route: Route,
    body: bytes,
    header_length: int | None,
    timeout_s: float | None,
    after: After | None = None,
) -> Answer:
    with dataplane.call("v2", route.model, route.version, after) as call:
        request = await call.decode(
            v2.decode_work(body, header_length),
            v2.decode_request,
            body,
            header_length,
            dataplane.settings.max_tensor_elements,
            route.model,
            route.version,
            timeout_s,
        )
        result = await call.infer(request)
        binary = v2.binary_default(request)
        # JSON text is written off the loop when large (20 M values held every other request
        # for 0.64 s); a binary answer is one copy of the outputs, and stays
        asked = request.outputs
        text = (
            not binary
            if asked is None
            else any(not o.parameters.get("binary_data", binary) for o in asked)
        )
        content, headers = await call.encode(v2.encode_result, result, binary, pooled=text)
    return Answer(200, content, headers)


async def _predict(
    dataplane: DataPlane,
    route: Route,
    body: bytes,
    content_type: str,
    timeout_s: float | None,
    after: After | None = None,
) -> Answer:
    decode = (v1.decode_predict, route.model, body, content_type, timeout_s)
    if route.kind == "preprocess":
        with dataplane.draining():
            tensors = await dataplane.preprocess(
                await dataplane.offload(v1.decode_work(body, content_type), *decode)
            )
            archive = await dataplane.offload(len(body) + 65536, _npz, tensors)
        return Answer(200, archive, {"content-type": "application/x-npz"})
    with dataplane.call("v1", route.model, None, after) as call:
        request = await call.decode(v1.decode_work(body, content_type), *decode)
        result = await call.infer(request)
        content = await call.encode(v1.encode_predictions, result, pooled=True)
    return Answer(200, content, {"content-type": "application/json"})


def error_answer(exc: BaseException, what: str) -> Answer:
    """Any error → its answer: a client's error with its status and ``{"error", "request_id"}``;
    anything else is our bug: 500, logged with its traceback, its body naming the request id."""
    if isinstance(exc, TensorgateError):
        if exc.status == 500:
            log.error("%s failed: %s", what, exc.message, exc_info=exc.__cause__)
        return Answer(
            exc.status,
            error_body(exc.message),
            {"content-type": "application/json", **_lower(exc.headers)},
        )
    log.error("%s: internal error", what, exc_info=exc)
    request_id = REQUEST_ID.get() or ""
    body = error_body(f"internal server error (request {request_id}); see the server log")
    return Answer(500, body, {"content-type": "application/json"})


def _lower(headers: Mapping[str, str]) -> dict[str, str]:
    return {k.lower(): v for k, v in headers.items()}


def _npz(tensors: dict[str, np.ndarray]) -> bytes:
    buffer = io.BytesIO()
    np.savez(buffer, allow_pickle=False, **tensors)
    return buffer.getvalue()


def dataplane_of(request: Request) -> DataPlane:
    """The app's DataPlane.

    Read straight from app state rather than injected with ``Depends``: FastAPI's dependency
    resolution cost more than half of a small request's server time (docs/performance.md).
    """
    dataplane: DataPlane = request.app.state.dataplane
    return dataplane


def cluster_of(request: Request) -> Cluster:
    """The app's :class:`~service.cluster.view.Cluster`: the whole server, for the routes
    that answer for it (health, statistics, metrics, repository), read as the DataPlane is."""
    cluster: Cluster = request.app.state.cluster
    return cluster


def json_response(
    content: Any, status_code: int = 200, headers: Mapping[str, str] | None = None
) -> Response:
    """orjson-encoded JSON; no pydantic on the way out."""
    return Response(
        orjson.dumps(content, option=orjson.OPT_SERIALIZE_NUMPY),
        status_code=status_code,
        headers=headers,
        media_type="application/json",
    )


async def read_body(request: Request, limit: int) -> bytes:
    """The request body, refused with 413 as soon as it is known to exceed ``limit`` bytes."""
    return await receive_body(request.receive, request.headers.get("content-length"), limit)


async def receive_body(receive: Receive, declared: str | None, limit: int) -> bytes:
    """The body from ASGI ``receive``; 413 once it is known to exceed ``limit`` bytes."""
    if declared is not None and declared.isascii() and declared.isdigit() and int(declared) > limit:
        REFUSED["too_large"] += 1
        raise PayloadTooLarge(f"request body is {declared} bytes; the limit is {limit}")
    # Each chunk goes into one growing buffer as it comes and is let go; getvalue() hands the
    # buffer over without a copy, so the body is held once, not twice as a list of chunks and
    # their join would hold it at the join. A body of one chunk is that chunk.
    first = b""
    joined: io.BytesIO | None = None
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientGone("the client disconnected before it sent the whole body")
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            REFUSED["too_large"] += 1
            raise PayloadTooLarge(f"request body exceeds the limit of {limit} bytes")
        if joined is None and not first:
            first = chunk
        elif chunk:
            if joined is None:
                joined = io.BytesIO()
                joined.write(first)
                first = b""
            joined.write(chunk)
        if not message.get("more_body", False):
            return first if joined is None else joined.getvalue()


def parse_timeout(raw: str | None) -> float | None:
    """An ``X-Request-Timeout`` value: seconds, > 0; None when absent. A longer one than a
    day is held to a day, as ``parameters.timeout`` is (``DataPlane.deadline``): it refused
    one, saying only "must be seconds > 0"."""
    if raw is None:
        return None
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not 0 < value < math.inf:
        raise InvalidInput(f"X-Request-Timeout must be a positive number of seconds (got {raw!r})")
    return value


async def until_disconnect(receive: Receive, work: Awaitable[T]) -> T | None:
    """Await ``work`` in this task; if the client disconnects first, cancel it and return None.

    ``receive`` is the request's ASGI receive, its body already read. Cancelling drops the
    request from its model's queue, so a batch never runs for a client that is gone. The work
    runs in the request's own task (a second task and ``asyncio.wait`` cost a request more than
    the watcher does), so cancelling the request, as at shutdown, cancels its work too.
    """
    current = asyncio.current_task()
    assert current is not None
    gone = False

    async def watch() -> None:
        nonlocal gone
        # The body has been read, so the next message the server sends is the disconnect.
        while (await receive())["type"] != "http.disconnect":
            pass
        gone = True
        current.cancel()

    watcher = asyncio.ensure_future(watch())
    try:
        result = await work
    except asyncio.CancelledError:
        if not gone or current.cancelling() > 1:
            raise  # cancelled from elsewhere too (shutdown): that cancellation goes on
        current.uncancel()
        return None
    except Exception:
        if not gone:
            raise
        current.uncancel()  # the work turned the cancellation into an error on its way out
        return None
    finally:
        watcher.cancel()
    if gone:  # the work swallowed the cancellation; nobody is there for its result
        current.uncancel()
        return None
    return result
