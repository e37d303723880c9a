"""gRPC for every RPC, in one place, as :mod:`service.api.http` is for HTTP: Triton's
``inference.GRPCInferenceService`` and the standard ``grpc.health.v1.Health``, served by a
``grpc.aio`` server in the event loop uvicorn runs (started and stopped by the app's lifespan).

These take care of the gRPC-specific things (metadata, deadlines, status codes) and delegate
to the same :class:`~service.dataplane.DataPlane` the REST routes call: gRPC and REST requests
share each model's scheduler, and so batch together. :func:`grpc_status` is the one mapping of
errors to gRPC status codes, Triton's.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import grpc
from google.protobuf import json_format

from service import metadata, workers
from service.api.auth import check_authorization
from service.dataplane import DataPlane
from service.errors import ModelNotFound, TensorgateError
from service.logs import REQUEST_ID, request_id_for
from service.protocol import grpc as codec
from service.protocol.pb import grpc_service_pb2 as pb
from service.protocol.pb import grpc_service_pb2_grpc as pb_grpc
from service.protocol.pb import health_pb2, health_pb2_grpc

log = logging.getLogger("tensorgate.grpc")

T = TypeVar("T")

SERVICE = "inference.GRPCInferenceService"
_CODES = {
    400: grpc.StatusCode.INVALID_ARGUMENT,
    401: grpc.StatusCode.UNAUTHENTICATED,
    404: grpc.StatusCode.NOT_FOUND,
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
ADMIN_OFF = "the model repository RPCs are off: the server has no admin token (TG_ADMIN_TOKEN)"
_HealthStatus = health_pb2.HealthCheckResponse.ServingStatus


def grpc_status(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """Any error → its gRPC status and message, as Triton maps HTTP's: a client's error keeps
    its message; anything else is our bug, logged, INTERNAL."""
    if isinstance(exc, TensorgateError):
        if exc.status == 500:
            log.error("gRPC call failed: %s", exc.message, exc_info=exc.__cause__)
        return _CODES.get(exc.status, grpc.StatusCode.INTERNAL), exc.message
    log.error("gRPC call: internal error", exc_info=exc)
    return grpc.StatusCode.INTERNAL, (
        f"internal server error (request {REQUEST_ID.get() or ''}); see the server log"
    )


class InferenceServicer(pb_grpc.GRPCInferenceServiceServicer):
    """``inference.GRPCInferenceService`` over the DataPlane. Every RPC but the health ones asks
    for the API token (``authorization: Bearer …`` metadata) when one is set."""

    def __init__(self, dataplane: DataPlane) -> None:
        self.dataplane = dataplane
        self.settings = dataplane.settings

    async def _answer(
        self,
        context: grpc.aio.ServicerContext[Any, Any],
        work: Callable[[], Awaitable[T]],
        token: str | None = "api",
    ) -> T:
        """Check the token, run ``work``, and turn its error into the call's status."""
        headers = dict(context.invocation_metadata() or ())
        REQUEST_ID.set(request_id_for(str(headers.get("x-request-id", ""))))
        if token == "admin" and self.settings.admin_token is None:
            # as REST, where the routes exist only with the token
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, ADMIN_OFF)
        try:
            if token is not None:
                expected = (
                    self.settings.admin_token if token == "admin" else self.settings.api_token
                )
                check_authorization(str(headers.get("authorization", "")), expected, token)
            return await work()
        except Exception as exc:
            code, message = grpc_status(exc)
        await context.abort(code, message)
        raise AssertionError("abort() returns only by raising")  # pragma: no cover

    def _health_token(self) -> str | None:
        return "api" if self.settings.protect_health_and_metrics else None

    async def ServerLive(self, request: Any, context: Any) -> pb.ServerLiveResponse:
        async def live() -> pb.ServerLiveResponse:
            return pb.ServerLiveResponse(live=(await workers.probe(self.dataplane, "live"))[0])

        return await self._answer(context, live, self._health_token())

    async def ServerReady(self, request: Any, context: Any) -> pb.ServerReadyResponse:
        async def ready() -> pb.ServerReadyResponse:
            return pb.ServerReadyResponse(ready=(await workers.probe(self.dataplane, "ready"))[0])

        return await self._answer(context, ready, self._health_token())

    async def ModelReady(
        self, request: pb.ModelReadyRequest, context: Any
    ) -> pb.ModelReadyResponse:
        async def ready() -> pb.ModelReadyResponse:
            try:
                ok = await workers.model_ready(
                    self.dataplane, request.name, request.version or None
                )
            except TensorgateError as exc:  # REST answers 503 for these: not ready, not an error
                if isinstance(exc, ModelNotFound):
                    raise
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
                name=found["name"], versions=found["versions"], platform=found["platform"],
                inputs=[tensor(**t) for t in found["inputs"]],
                outputs=[tensor(**t) for t in found["outputs"]],
            )  # fmt: skip

        return await self._answer(context, model)

    async def ModelInfer(
        self, request: pb.ModelInferRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.ModelInferResponse:
        async def infer() -> pb.ModelInferResponse:
            remaining = context.time_remaining()
            dataplane = self.dataplane

            async def decode() -> Any:
                return codec.decode_request(
                    request, remaining, dataplane.settings.max_tensor_elements
                )

            raw = bool(request.raw_input_contents)
            return await dataplane.infer(
                request.model_name, request.model_version or None, "grpc", decode,
                lambda result: codec.encode_result(result, raw),
            )  # fmt: skip

        return await self._answer(context, infer)

    async def ModelStreamInfer(
        self, request_iterator: Any, context: grpc.aio.ServicerContext[Any, Any]
    ) -> None:
        await context.abort(
            grpc.StatusCode.UNIMPLEMENTED,
            "ModelStreamInfer (decoupled models) is not supported: call ModelInfer",
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
            stats = await workers.statistics(self.dataplane, name, version)
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
            await workers.load_model(self.dataplane, request.model_name)
            return pb.RepositoryModelLoadResponse()

        return await self._answer(context, load, "admin")

    async def RepositoryModelUnload(
        self, request: pb.RepositoryModelUnloadRequest, context: Any
    ) -> pb.RepositoryModelUnloadResponse:
        async def unload() -> pb.RepositoryModelUnloadResponse:
            await workers.unload_model(self.dataplane, request.model_name)
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
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "tracing is not supported")

    async def LogSettings(self, request: Any, context: Any) -> None:
        await context.abort(
            grpc.StatusCode.UNIMPLEMENTED, "log settings are set at start (TG_LOG_LEVEL)"
        )


class HealthServicer(health_pb2_grpc.HealthServicer):
    """``grpc.health.v1.Health`` for Kubernetes ``grpc:`` probes: SERVING when the server is
    ready (the service ``""`` or ``inference.GRPCInferenceService``). Open, whatever the token
    settings: a kubelet's probe sends no metadata, and the answer is one word."""

    WATCH_INTERVAL_S = 1.0

    def __init__(self, dataplane: DataPlane) -> None:
        self.dataplane = dataplane

    async def _status(self, service: str) -> Any:
        if service not in ("", SERVICE):
            return None
        ready = (await workers.probe(self.dataplane, "ready"))[0]
        return _HealthStatus.SERVING if ready else _HealthStatus.NOT_SERVING

    async def Check(
        self, request: health_pb2.HealthCheckRequest, context: Any
    ) -> health_pb2.HealthCheckResponse:
        status = await self._status(request.service)
        if status is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"unknown service {request.service!r}")
        return health_pb2.HealthCheckResponse(status=status)

    async def Watch(
        self, request: health_pb2.HealthCheckRequest, context: Any
    ) -> AsyncIterator[health_pb2.HealthCheckResponse]:
        last = None
        while True:
            status = await self._status(request.service)
            status = _HealthStatus.SERVICE_UNKNOWN if status is None else status
            if status != last:
                yield health_pb2.HealthCheckResponse(status=status)
                last = status
            await asyncio.sleep(self.WATCH_INTERVAL_S)


async def start_grpc(dataplane: DataPlane) -> grpc.aio.Server:
    """A started gRPC server on ``TG_HOST:TG_GRPC_PORT`` in the running event loop."""
    settings = dataplane.settings
    server = grpc.aio.server(
        options=[
            # Triton's meaning: a larger message is RESOURCE_EXHAUSTED, checked by gRPC itself
            # after decompression, before any of it reaches Python.
            ("grpc.max_receive_message_length", settings.max_body_bytes),
            ("grpc.max_send_message_length", -1),
        ],
    )
    pb_grpc.add_GRPCInferenceServiceServicer_to_server(  # type: ignore[no-untyped-call]  # generated code is untyped
        InferenceServicer(dataplane), server
    )
    health_pb2_grpc.add_HealthServicer_to_server(  # type: ignore[no-untyped-call]  # generated code is untyped
        HealthServicer(dataplane), server
    )
    host = f"[{settings.host}]" if ":" in settings.host else settings.host
    port = server.add_insecure_port(f"{host}:{settings.grpc_port}")
    await server.start()
    log.info("gRPC listening on %s:%d", settings.host, port)
    return server
