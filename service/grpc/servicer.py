"""gRPC for every RPC, in one place, as :mod:`service.http.answer` is for HTTP: Triton's
``inference.GRPCInferenceService``, served by a ``grpc.aio`` server in the event loop uvicorn
runs (:mod:`service.grpc.server`: started and stopped by the app's lifespan).

These take care of the gRPC-specific things (metadata, deadlines, status codes) and delegate
to the same :class:`~service.core.dataplane.DataPlane` the REST routes call: gRPC and REST requests
share each model's scheduler, and so batch together. :func:`grpc_status` is the one mapping of
errors to gRPC status codes, Triton's.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, NamedTuple, TypeVar

import grpc
import numpy as np
from google.protobuf import json_format

from service.cluster.held import MESSAGE_COPIES
from service.cluster.view import Cluster
from service.core.dataplane import answer_bytes
from service.errors import (
    InvalidInput,
    MessageTimeout,
    ServerBusy,
    TensorgateError,
)
from service.grpc.arriving import Arriving, Waiting, Watched
from service.grpc.streaming import completion_order
from service.inference import InferenceResult
from service.limits.admission import HELD_MADE_BYTES, BytesBudget, shortened
from service.limits.auth import check_authorization
from service.limits.compression import MIN_COMPRESS_BYTES, shrinks
from service.protocol import grpc as codec
from service.protocol.pb import grpc_service_pb2 as pb
from service.protocol.pb import grpc_service_pb2_grpc as pb_grpc
from service.repository import metadata
from service.repository.models import check_load_parameters, check_unload_parameters
from service.telemetry import tracing
from service.telemetry.counters import REFUSED, REQUEST_HELD
from service.telemetry.logs import REQUEST_ID, request_id_for

log = logging.getLogger("tensorgate.grpc")

T = TypeVar("T")

SERVICE = "inference.GRPCInferenceService"
_CODES = {
    400: grpc.StatusCode.INVALID_ARGUMENT,
    401: grpc.StatusCode.UNAUTHENTICATED,
    404: grpc.StatusCode.NOT_FOUND,
    408: grpc.StatusCode.DEADLINE_EXCEEDED,
    409: grpc.StatusCode.ABORTED,
    413: grpc.StatusCode.RESOURCE_EXHAUSTED,
    415: grpc.StatusCode.INVALID_ARGUMENT,
    499: grpc.StatusCode.CANCELLED,
    503: grpc.StatusCode.UNAVAILABLE,
    504: grpc.StatusCode.DEADLINE_EXCEEDED,
}
SHARED_MEMORY = (
    "shared memory is not supported by tensorgate: send tensors in raw_input_contents "
    "(the server may run on another machine than its clients)"
)
TRACING = (
    "Triton's trace settings are not taken: tracing is OpenTelemetry's, set at start "
    "(TG_TRACING, OTEL_TRACES_SAMPLER, OTEL_EXPORTER_OTLP_ENDPOINT; docs/deploy.md, Tracing)"
)
ADMIN_OFF = "the model repository RPCs are off: the server has no admin token (TG_ADMIN_TOKEN)"
ARRIVING_S = 0.02
"""How long a ModelInfer message may take to arrive whole before it holds TG_MAX_BODY_BYTES of
the budget (:meth:`InferenceServicer._receive`): a message within grpc's stream window (64 KiB)
is whole at once; over loopback 1 MiB took 1.5 ms, 60 MiB 115 ms."""
STREAM_IN_FLIGHT = 64
"""Requests of one ModelStreamInfer stream being answered at once; the next is read when one is
done (gRPC's flow control holds the client back), so a stream holds a bounded amount."""


MAX_COMPRESS_BYTES = 64 << 10
"""Larger answers go as they are. gRPC compresses an answer (zlib) in the thread that sends it,
the event loop every request shares: about 33 ms a MiB of float32 outputs, which shrink by
7-8 % (docs/performance.md, "gRPC answers and compression"). Under 32 answers of 60 MiB a small
REST request waited 0.5 s at the median. At this size an answer costs the loop at most about
2 ms. REST compresses on the pool (:mod:`service.http.answer`)."""


SAMPLE_BYTES = 4 << 10
"""What of an answer's largest output is compressed (at level 1) to see whether the answer
shrinks: float32 outputs do not (7-8 %), and compressing 64 KiB of them cost the loop 2 ms."""


class Answered(NamedTuple):
    """An inference message's answer, not yet serialized."""

    encoded: codec.Encoded
    size: int
    """Its outputs' bytes: what serializing it goes through. Not ``ByteSize()``: upb serializes
    the whole message to count it."""
    compress: bool
    """Whether gRPC should compress it (:func:`worth_compressing`)."""


def worth_compressing(result: InferenceResult) -> bool:
    """Whether an answer is compressed, with an encoding the client accepts
    (``grpc-accept-encoding``; see :func:`start_grpc`): not a small one, not one too large to
    compress on the event loop (:data:`MAX_COMPRESS_BYTES`), and not one whose largest output
    does not shrink by a tenth in a sample of :data:`SAMPLE_BYTES` from its middle (texts are
    taken to shrink)."""
    if not MIN_COMPRESS_BYTES <= answer_bytes(result) <= MAX_COMPRESS_BYTES:
        return False
    data = max(result.outputs, key=lambda output: output.data.nbytes).data
    if data.dtype == object:
        return True
    return shrinks(np.ascontiguousarray(data).reshape(-1).view(np.uint8).data, SAMPLE_BYTES)


def grpc_status(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """Any error → its gRPC status and message, as Triton maps HTTP's: a client's error keeps
    its message; anything else is our bug, logged, INTERNAL."""
    if isinstance(exc, TensorgateError):
        if exc.status == 500:
            log.error("gRPC call failed: %s", exc.message, exc_info=exc.__cause__)
        return _CODES.get(exc.status, grpc.StatusCode.INTERNAL), shortened(exc.message)
    log.error("gRPC call: internal error", exc_info=exc)
    return grpc.StatusCode.INTERNAL, (
        f"internal server error (request {REQUEST_ID.get() or ''}); see the server log"
    )


_SERVER_ERRORS = {
    grpc.StatusCode.UNKNOWN,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.UNIMPLEMENTED,
    grpc.StatusCode.INTERNAL,
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.DATA_LOSS,
}
"""The codes OpenTelemetry's RPC conventions count as a server span's error."""


def _text(metadata: dict[str, Any]) -> dict[str, str]:
    """Metadata as a propagator reads it: text values only (binary ``-bin`` keys dropped)."""
    return {k: v for k, v in metadata.items() if isinstance(v, str)}


def _end(trace: tracing.RequestTrace, code: grpc.StatusCode) -> None:
    status = code.value[0]
    trace.end(
        code in _SERVER_ERRORS,
        {"rpc.system": "grpc", "rpc.service": SERVICE, "rpc.grpc.status_code": status},
    )


class InferenceServicer(pb_grpc.GRPCInferenceServiceServicer):
    """``inference.GRPCInferenceService`` over the DataPlane. Every RPC but the health ones asks
    for the API token (``authorization: Bearer …`` metadata) when one is set."""

    def __init__(
        self, cluster: Cluster, budget: BytesBudget | None = None, unseen: bool = False
    ) -> None:
        self.cluster = cluster
        self.dataplane = cluster.dataplane
        """Inference, and the repository's read-only views; the whole server is ``cluster``'s."""
        self.settings = self.dataplane.settings
        self.budget = budget
        """The server's budget for request bodies in flight (:mod:`service.limits.admission`):
        an inference request's message holds its size in it until answered."""
        self.unseen = unseen
        """Whether a ModelInfer message still arriving holds TG_MAX_BODY_BYTES of the budget
        until it has (:meth:`_receive`): on a port of its own, where no front counts what
        clients send (``service.cluster.front``)."""
        self.arriving = Arriving.where_available(
            budget, self.dataplane.repository.model_changes, self.settings.body_timeout_s
        )
        """Reads of messages still arriving, the newest ended when the heap outside the budget
        grows past half of it while they wait (:mod:`service.grpc.arriving`)."""
        self.closing = asyncio.Event()
        """Set when the server stops: open streams stop reading and end."""

    async def _answer(
        self,
        context: grpc.aio.ServicerContext[Any, Any],
        work: Callable[[], Awaitable[T]],
        token: str | None = "api",
        span: str | None = None,
    ) -> T:
        """Check the token, run ``work``, and turn its error into the call's status. ``span``:
        the RPC's name, for an inference RPC traced (:mod:`service.telemetry.tracing`)."""
        headers = dict(context.invocation_metadata() or ())
        request_id = request_id_for(str(headers.get("x-request-id", "")))
        REQUEST_ID.set(request_id)
        if token == "admin" and self.settings.admin_token is None:
            # as REST, where the routes exist only with the token
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, ADMIN_OFF)
        trace = None
        if span is not None:  # an inference call: its caller's trace, recorded or not
            carrier = _text(headers)
            tracing.note_caller(carrier)
            if tracing.TRACER is not None:
                trace = tracing.begin(span, carrier, request_id)
        try:
            if token is not None:
                expected = (
                    self.settings.admin_token if token == "admin" else self.settings.api_token
                )
                given = str(headers.get("authorization", ""))
                check_authorization(given, expected, token, context.peer)
            answer = await work()
        except Exception as exc:
            code, message = grpc_status(exc)
            if trace is not None:
                _end(trace, code)
        except asyncio.CancelledError as exc:
            code, message = grpc_status(self.dataplane.drain.answer_for(exc))
            if trace is not None:
                _end(trace, code)
        else:
            if trace is not None:
                _end(trace, grpc.StatusCode.OK)
            # the id the log has it under, as REST's X-Request-ID answer header
            context.set_trailing_metadata((("x-request-id", REQUEST_ID.get() or request_id),))
            return answer
        context.set_trailing_metadata((("x-request-id", REQUEST_ID.get() or request_id),))
        # The status set and nothing returned, not ``abort()``: its exception's traceback holds
        # this frame, and through ``work`` the request's message, in a cycle only a full
        # collection frees (+60 MiB kept per refused 60 MiB call, #28 finding 1). grpc sends no
        # message for a status that is not OK.
        context.set_code(code)
        context.set_details(message)
        return None  # type: ignore[return-value]  # grpc answers the status alone

    def _health_token(self) -> str | None:
        return "api" if self.settings.protect_health_and_metrics else None

    async def ServerLive(self, request: Any, context: Any) -> pb.ServerLiveResponse:
        async def live() -> pb.ServerLiveResponse:
            return pb.ServerLiveResponse(live=(await self.cluster.probe("live"))[0])

        return await self._answer(context, live, self._health_token())

    async def ServerReady(self, request: Any, context: Any) -> pb.ServerReadyResponse:
        async def ready() -> pb.ServerReadyResponse:
            return pb.ServerReadyResponse(ready=(await self.cluster.probe("ready"))[0])

        return await self._answer(context, ready, self._health_token())

    async def ModelReady(
        self, request: pb.ModelReadyRequest, context: Any
    ) -> pb.ModelReadyResponse:
        async def ready() -> pb.ModelReadyResponse:
            # Not ready, not an error: REST answers 404 or 503 for these, which tritonclient's
            # HTTP is_model_ready reads as False, and Triton's gRPC answers ready=false for a
            # model it does not know, so that its gRPC client says False too (not an exception).
            try:
                ok = await self.cluster.model_ready(request.name, request.version or None)
            except TensorgateError:
                ok = False
            return pb.ModelReadyResponse(ready=ok)

        return await self._answer(context, ready, self._health_token())

    async def ServerMetadata(self, request: Any, context: Any) -> pb.ServerMetadataResponse:
        async def server() -> pb.ServerMetadataResponse:
            return pb.ServerMetadataResponse(**metadata.server(self.settings))

        return await self._answer(context, server)

    async def ModelMetadata(
        self, request: pb.ModelMetadataRequest, context: Any
    ) -> pb.ModelMetadataResponse:
        async def model() -> pb.ModelMetadataResponse:
            found = metadata.model(self.dataplane.repository, request.name, request.version or None)
            tensor = pb.ModelMetadataResponse.TensorMetadata
            return pb.ModelMetadataResponse(
                name=found["name"],
                versions=found["versions"],
                platform=found["platform"],
                inputs=[tensor(**t) for t in found["inputs"]],
                outputs=[tensor(**t) for t in found["outputs"]],
            )

        return await self._answer(context, model)

    async def ModelInfer(  # reads its own message, answers bytes
        self, requests: object, context: grpc.aio.ServicerContext[Any, Any]
    ) -> bytes:
        """Served as a client-streaming handler (the wire is the same as a unary call's), so
        that it runs when the call's headers arrive, not once gRPC holds the whole message:
        the token is checked before any of the message is read (gRPC's flow control holds the
        client back meanwhile), and a message that does not arrive in full within
        TG_BODY_TIMEOUT_S is DEADLINE_EXCEEDED and let go, as REST's slow bodies are 408.
        The answer is serialized here, on the pool when it is large."""

        given = any(key == "x-request-id" for key, _ in context.invocation_metadata() or ())

        def parsed(message: pb.ModelInferRequest) -> None:
            if message.id and not given:  # the OIP request's own id, as a stream's requests
                REQUEST_ID.set(request_id_for(message.id))

        async def infer() -> bytes:
            request = await self._receive(context)
            answered = await self._infer(request, context.time_remaining(), parsed)
            if not answered.compress:
                context.disable_next_message_compression()
            serialized = await self.dataplane.offload(
                answered.size, codec.serialized, answered.encoded
            )
            if (budget := self.budget) is not None and len(serialized) >= HELD_MADE_BYTES:
                # Made, and held until its client has taken it (until the call is over), twice:
                # grpc copies it into a buffer of its own and keeps these bytes until it is sent
                # (unsent answers of 6 MiB grew the heap by 12 MiB each).
                size = MESSAGE_COPIES * len(serialized)
                budget.hold(size, made=True)
                context.add_done_callback(lambda _: budget.release(0, size))
            return serialized

        return await self._answer(context, infer, span=f"{SERVICE}/ModelInfer")

    async def _receive(self, context: grpc.aio.ServicerContext[Any, Any]) -> codec.Unparsed:
        """The call's one message, within TG_BODY_TIMEOUT_S.

        Where clients reach this server's port directly (:attr:`unseen`), a message not whole
        within :data:`ARRIVING_S` of being asked for holds TG_MAX_BODY_BYTES (the most it can
        be) of the budget until it is, or is UNAVAILABLE at once, and let go, when that would
        leave less than as much again for messages that have arrived: grpcio tells nothing of
        a message until all of it has arrived, and 16 connections each stalled short of the
        end of a 12 MiB message held all 192 MiB (#28 finding 2). A small message is whole by
        then (grpc's stream window holds it before the handler asks), so small calls never
        wait for room; what arrives before the check is bounded by the link's speed over
        :data:`ARRIVING_S` and, on a stream not being read, by its flow-control window
        (``grpc.http2.bdp_probe`` off: :func:`service.grpc.server.start_grpc`)."""
        limit_s = self.settings.body_timeout_s
        reading = asyncio.ensure_future(context.read())
        held = 0
        waiting: Waiting | None = None
        if self.arriving is not None:  # behind the front too: interleaved calls arrive together
            waiting = self.arriving.counting(reading, stream=False, after_s=ARRIVING_S)
        try:
            if self.unseen and self.budget is not None:
                await asyncio.wait((reading,), timeout=ARRIVING_S)
                if not reading.done():
                    held = self._hold_arriving(self.budget)
            message = await asyncio.wait_for(reading, limit_s)
        except asyncio.CancelledError:
            if waiting is not None and waiting.ended is not None and reading.cancelled():
                raise ServerBusy(waiting.ended) from None
            raise
        except TimeoutError:
            raise MessageTimeout(
                f"the request message did not arrive in full within {limit_s:g} s "
                "(TG_BODY_TIMEOUT_S)"
            ) from None
        finally:
            reading.cancel()  # refused or timed out: grpc lets the message go with the call
            if waiting is not None and self.arriving is not None:
                self.arriving.done(waiting)
            if held and self.budget is not None:
                self.budget.release(held)  # the message, whole, is counted as its size next
        if not isinstance(message, codec.Unparsed):  # grpc.aio.EOF: the client sent none
            raise InvalidInput("ModelInfer takes one ModelInferRequest; the call sent none")
        return message

    def _hold_arriving(self, budget: BytesBudget) -> int:
        """Hold the most a message may be for one still arriving, or refuse it (UNAVAILABLE).
        One such size of the budget is left to messages that have arrived, where the budget
        holds two (messages stalled short of their ends must not refuse every small call); a
        budget of less than two holds one message arriving at a time, and so never refuses one
        for good (TG_MAX_INFLIGHT_BYTES may be as low as TG_MAX_BODY_BYTES)."""
        size = self.settings.max_body_bytes
        if budget.try_take(size, spare=min(size, budget.limit - size)):
            return size
        REFUSED["body_budget"] += 1
        raise ServerBusy(
            f"this call's message was still arriving after {ARRIVING_S * 1000:.0f} ms; until "
            f"it has, it holds the most a message may be ({size} bytes, TG_MAX_BODY_BYTES), "
            f"and the server holds {budget.held} of its {budget.limit} bytes for requests in "
            "flight (TG_MAX_INFLIGHT_BYTES): retry shortly"
        )

    async def _infer(
        self,
        request: codec.Unparsed,
        timeout_s: float | None,
        parsed: Callable[[pb.ModelInferRequest], None] | None = None,
    ) -> Answered:
        """One inference message: its size taken from the budget before it is parsed (past it:
        UNAVAILABLE, and the bytes are let go unread), parsed on the pool when large (its raw
        contents stay views of the bytes: :func:`codec.parse_infer`), answered (with the bytes
        its outputs hold). ``parsed`` is told the message once it is parsed."""
        raw, request.raw = request.raw, b""
        size = MESSAGE_COPIES * len(raw)
        if self.budget is not None:
            self.budget.take(size)
        held = [size]
        REQUEST_HELD.set(held)  # this call's task: what the core takes next is told of it
        try:
            wire = len(raw)
            message = await self.dataplane.offload(wire, codec.parse_infer, raw)
            del raw  # from here the message and its contents' views hold what is needed
            typed = codec.TYPED_HELD_PER_ELEMENT * codec.typed_elements(message.message)
            if typed and self.budget is not None:
                self.budget.take(typed, size)  # what typed contents hold while decoded
                size += typed
                held[0] = size
            if parsed is not None:
                parsed(message.message)
            return await self._answer_infer(message, timeout_s)
        finally:
            if self.budget is not None:
                self.budget.release(held[0])  # what the call holds now, all of it

    async def _answer_infer(self, parsed: codec.InferMessage, timeout_s: float | None) -> Answered:
        dataplane = self.dataplane
        request = parsed.message
        # Raw contents are views, decoded without a copy, but for BYTES ones: unpacked item by
        # item into objects of their own.
        strings = sum(
            len(content)
            for tensor, content in zip(request.inputs, parsed.contents, strict=False)
            if tensor.datatype == "BYTES"
        )
        with dataplane.call("grpc", request.model_name, request.model_version or None) as call:
            decoded = await call.decode(
                codec.decode_work(request) + strings,
                codec.decode_request,
                parsed,
                timeout_s,
                dataplane.settings.max_tensor_elements,
            )
            result = await call.infer(decoded)
            raw = bool(parsed.contents)
            encoded = await call.encode(codec.encode_result, result, raw, pooled=True)
            return Answered(encoded, answer_bytes(result), worth_compressing(result))

    async def ModelStreamInfer(
        self,
        request_iterator: AsyncIterator[codec.Unparsed],
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> AsyncIterator[bytes]:
        """Each request of the stream answered as ModelInfer answers it, concurrently (they
        batch together, and with everyone else's), in the order they complete: clients match
        answers by request id. A request that fails gets ``error_message`` (and its id) and the
        stream goes on. The token is the stream's, checked once; a stream opened while the
        server drains is UNAVAILABLE, and one still open when it stops ends UNAVAILABLE after
        its requests in flight are answered. Each answer is serialized here, on the pool when
        it is large, as ModelInfer's is (grpc serializes on the event loop)."""
        headers = dict(context.invocation_metadata() or ())
        stream_id = str(headers.get("x-request-id", ""))
        try:
            check_authorization(
                str(headers.get("authorization", "")),
                self.settings.api_token,
                "api",
                context.peer,
            )
            if self.dataplane.drain.refusing:
                raise ServerBusy("the server is shutting down; send this request elsewhere")
        except Exception as exc:
            await context.abort(*grpc_status(exc))

        carrier = _text(headers)
        tracing.note_caller(carrier)

        async def answer(request: codec.Unparsed) -> tuple[bytes, bool]:
            names = ["", "", ""]  # the message's model, version and id, once parsed
            request_id = request_id_for(stream_id)
            REQUEST_ID.set(request_id)  # this request's task; its own id once parsed
            trace = None
            if tracing.TRACER is not None:
                trace = tracing.begin(f"{SERVICE}/ModelStreamInfer", carrier, request_id)

            def parsed(message: pb.ModelInferRequest) -> None:
                names[:] = [message.model_name, message.model_version, message.id]
                if message.id:
                    own = request_id_for(message.id)
                    REQUEST_ID.set(own)
                    if trace is not None:
                        trace.span.set_attribute("tensorgate.request_id", own)

            try:
                answered = await self._infer(request, context.time_remaining(), parsed)
                serialized = await self.dataplane.offload(
                    answered.size, codec.serialized, answered.encoded, True
                )
                if trace is not None:
                    _end(trace, grpc.StatusCode.OK)
            except (Exception, asyncio.CancelledError) as exc:
                if isinstance(exc, asyncio.CancelledError):
                    exc = self.dataplane.drain.answer_for(exc)
                code, message = grpc_status(exc)
                if trace is not None:
                    _end(trace, code)
                model, version, id_ = names
                failed = pb.ModelInferResponse(model_name=model, model_version=version, id=id_)
                response = pb.ModelStreamInferResponse(error_message=message, infer_response=failed)
                return response.SerializeToString(), False
            return serialized, answered.compress

        requests: AsyncIterator[codec.Unparsed] = request_iterator
        watched: Watched[codec.Unparsed] | None = None
        if self.arriving is not None:
            requests = watched = await self.arriving.watch(request_iterator)
        try:
            answers = completion_order(requests, answer, STREAM_IN_FLIGHT, self.closing)
            budget = self.budget
            async for response, compress in answers:
                if not compress:
                    context.disable_next_message_compression()
                # made, and held (twice, as a ModelInfer answer) until it has been sent: the next
                # answer is asked for then
                if budget is None or len(response) < HELD_MADE_BYTES:
                    yield response
                    continue
                size = MESSAGE_COPIES * len(response)
                budget.hold(size, made=True)
                try:
                    yield response
                finally:
                    budget.release(0, size)
        finally:
            if watched is not None:
                watched.close()
        if watched is not None and watched.ended is not None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, watched.ended)
        if self.closing.is_set():
            await context.abort(
                grpc.StatusCode.UNAVAILABLE,
                "the server is shutting down: open a new stream (to another replica)",
            )

    async def ModelConfig(
        self, request: pb.ModelConfigRequest, context: Any
    ) -> pb.ModelConfigResponse:
        async def config() -> pb.ModelConfigResponse:
            body = metadata.config(self.dataplane.repository, request.name, request.version or None)
            response = pb.ModelConfigResponse()
            json_format.ParseDict(body, response.config, ignore_unknown_fields=True)
            return response

        return await self._answer(context, config)

    async def ModelStatistics(
        self, request: pb.ModelStatisticsRequest, context: Any
    ) -> pb.ModelStatisticsResponse:
        async def statistics() -> pb.ModelStatisticsResponse:
            name, version = request.name or None, request.version or None
            stats = await self.cluster.statistics(name, version)
            response = pb.ModelStatisticsResponse()
            json_format.ParseDict(stats, response, ignore_unknown_fields=True)
            return response

        return await self._answer(context, statistics)

    async def RepositoryIndex(
        self, request: pb.RepositoryIndexRequest, context: Any
    ) -> pb.RepositoryIndexResponse:
        async def index() -> pb.RepositoryIndexResponse:
            rows = self.dataplane.repository.index()
            if request.ready:
                rows = [row for row in rows if row["state"] == "READY"]
            entry = pb.RepositoryIndexResponse.ModelIndex
            return pb.RepositoryIndexResponse(
                models=[entry(**{k: v or "" for k, v in row.items()}) for row in rows]
            )

        return await self._answer(context, index, "admin")

    async def RepositoryModelLoad(
        self, request: pb.RepositoryModelLoadRequest, context: Any
    ) -> pb.RepositoryModelLoadResponse:
        async def load() -> pb.RepositoryModelLoadResponse:
            check_load_parameters(request.parameters)
            await self.cluster.load_model(request.model_name)
            return pb.RepositoryModelLoadResponse()

        return await self._answer(context, load, "admin")

    async def RepositoryModelUnload(
        self, request: pb.RepositoryModelUnloadRequest, context: Any
    ) -> pb.RepositoryModelUnloadResponse:
        async def unload() -> pb.RepositoryModelUnloadResponse:
            check_unload_parameters(
                {
                    name: getattr(value, value.WhichOneof("parameter_choice") or "bool_param")
                    for name, value in request.parameters.items()
                }
            )
            await self.cluster.unload_model(request.model_name)
            return pb.RepositoryModelUnloadResponse()

        return await self._answer(context, unload, "admin")

    async def SystemSharedMemoryStatus(self, request: Any, context: Any) -> None:
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, SHARED_MEMORY)

    async def SystemSharedMemoryRegister(self, request: Any, context: Any) -> None:
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, SHARED_MEMORY)

    async def SystemSharedMemoryUnregister(self, request: Any, context: Any) -> None:
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, SHARED_MEMORY)

    async def CudaSharedMemoryStatus(self, request: Any, context: Any) -> None:
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, SHARED_MEMORY)

    async def CudaSharedMemoryRegister(self, request: Any, context: Any) -> None:
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, SHARED_MEMORY)

    async def CudaSharedMemoryUnregister(self, request: Any, context: Any) -> None:
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, SHARED_MEMORY)

    async def TraceSetting(self, request: Any, context: Any) -> None:
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, TRACING)

    async def LogSettings(self, request: Any, context: Any) -> None:
        await context.abort(
            grpc.StatusCode.UNIMPLEMENTED, "log settings are set at start (TG_LOG_LEVEL)"
        )
