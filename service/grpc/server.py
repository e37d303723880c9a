"""The gRPC server in uvicorn's event loop: Triton's ``inference.GRPCInferenceService``
(:mod:`service.grpc.servicer`) and the standard ``grpc.health.v1.Health``, started and stopped by
the app's lifespan."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
from google.protobuf.message import Message

from service.cluster.supervisor import Worker
from service.cluster.view import Cluster
from service.errors import InvalidInput
from service.grpc.servicer import SERVICE, InferenceServicer
from service.limits.admission import BytesBudget
from service.protocol.grpc import Unparsed, parse
from service.protocol.pb import grpc_service_pb2 as pb
from service.protocol.pb import health_pb2, health_pb2_grpc

log = logging.getLogger("tensorgate.grpc")

_COMPRESSION_LEVEL_LOW = 1
"""grpc_compression_level GRPC_COMPRESS_LEVEL_LOW: gzip when the client accepts it, else
deflate, else none (grpc.Compression names algorithms only)."""
_HealthStatus = health_pb2.HealthCheckResponse.ServingStatus


class HealthServicer(health_pb2_grpc.HealthServicer):
    """``grpc.health.v1.Health`` for Kubernetes ``grpc:`` probes: SERVING when the server is
    ready (the service ``""`` or ``inference.GRPCInferenceService``). Open, whatever the token
    settings: a kubelet's probe sends no metadata, and the answer is one word."""

    WATCH_INTERVAL_S = 1.0

    def __init__(self, cluster: Cluster) -> None:
        self.cluster = cluster

    async def _status(self, service: str) -> Any:
        if service not in ("", SERVICE):
            return None
        ready = (await self.cluster.probe("ready"))[0]
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


PARSED_BY_HANDLER = frozenset({"ModelInfer", "ModelStreamInfer"})
"""The RPCs whose handlers take :class:`~service.protocol.grpc.Unparsed` messages and parse
them themselves, after the token and the budget (:meth:`InferenceServicer._infer`)."""


MAX_STREAMS_PER_CONNECTION = 128
"""Calls (and streams) one gRPC connection carries at once, HTTP/2's SETTINGS_MAX_CONCURRENT_
STREAMS: a client's next call waits for one to end. Each holds at most its message, so a
connection holds a bounded amount (it was any number of streams, #28 finding 2)."""

SERIALIZED_BY_HANDLER = frozenset({"ModelInfer", "ModelStreamInfer"})
"""The RPCs whose handlers answer bytes they serialized themselves, on the pool when large:
grpc serializes on the event loop, about 60 ms of it for a 60 MiB answer (and a stream's answer
built by wrapping a ``ModelInferResponse`` copied it again on the loop, 90 ms)."""

READ_BY_HANDLER = frozenset({"ModelInfer"})
"""Unary RPCs served by a client-streaming handler that reads the one message itself
(:meth:`InferenceServicer.ModelInfer`): the wire is the same, and the handler runs when the
call's headers arrive, so the token and a time limit apply before the message is held."""


def inference_handlers(servicer: InferenceServicer) -> dict[str, grpc.RpcMethodHandler]:
    """``inference.GRPCInferenceService``'s method handlers, from its descriptor, as the
    generated ``add_GRPCInferenceServiceServicer_to_server`` makes them but for how requests
    are parsed: never by grpc's deserializer (on the event loop, before the token, a malformed
    message UNKNOWN naming a Python class). The inference RPCs parse their own; every other
    RPC's message is parsed here, a malformed one INVALID_ARGUMENT naming the message."""
    handlers = {}
    for method in pb.DESCRIPTOR.services_by_name["GRPCInferenceService"].methods:
        behaviour = getattr(servicer, method.name)
        if method.name not in PARSED_BY_HANDLER:
            behaviour = _parsing(behaviour, getattr(pb, method.input_type.name))
        reads_itself = method.name in READ_BY_HANDLER
        make = _HANDLER_KINDS[method.client_streaming or reads_itself, method.server_streaming]
        handlers[method.name] = make(
            behaviour,
            request_deserializer=Unparsed,
            response_serializer=_as_serialized
            if method.name in SERIALIZED_BY_HANDLER
            else getattr(pb, method.output_type.name).SerializeToString,
        )
    return handlers


def _as_serialized(message: bytes) -> bytes:
    return message


_HANDLER_KINDS: dict[tuple[bool, bool], Callable[..., grpc.RpcMethodHandler]] = {
    (False, False): grpc.unary_unary_rpc_method_handler,
    (False, True): grpc.unary_stream_rpc_method_handler,
    (True, False): grpc.stream_unary_rpc_method_handler,
    (True, True): grpc.stream_stream_rpc_method_handler,
}


def _parsing(
    behaviour: Callable[[Any, grpc.aio.ServicerContext[Any, Any]], Awaitable[Any]],
    message_type: type[Message],
) -> Callable[[Unparsed, grpc.aio.ServicerContext[Any, Any]], Awaitable[Any]]:
    """A unary RPC's behaviour, given its message parsed (these are small)."""

    async def handle(request: Unparsed, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
        try:
            message = parse(message_type, request.raw)
        except InvalidInput as exc:
            context.set_code(grpc.StatusCode.INVALID_ARGUMENT)
            context.set_details(exc.message)
            return None
        return await behaviour(message, context)

    return handle


class GrpcServer:
    """The started gRPC server, as the app's lifespan holds it."""

    def __init__(self, server: grpc.aio.Server, servicer: InferenceServicer) -> None:
        self.server = server
        self.servicer = servicer

    async def stop(self, grace_s: float) -> None:
        """End open streams once their requests in flight are answered (an idle stream would
        otherwise hold the server for the whole grace), and stop within ``grace_s``."""
        self.servicer.closing.set()
        await self.server.stop(grace_s)
        if self.servicer.arriving is not None:
            await self.servicer.arriving.stop()


async def start_grpc(cluster: Cluster, budget: BytesBudget | None = None) -> GrpcServer:
    """A started gRPC server on ``TG_HOST:TG_GRPC_PORT`` in the running event loop; its
    inference requests hold their size in ``budget``, REST's budget for bodies in flight."""
    settings = cluster.dataplane.settings
    worker = Worker.from_environment()
    # One of several workers is reached through the supervisor's front, which counts what each
    # client sent (service/cluster/front.py). On a port of its own, nothing sees a message
    # before grpc has received it whole: a ModelInfer message still arriving holds the most a
    # message may be (InferenceServicer._receive), and grpc's BDP probing, which grows each
    # stream's flow-control window towards the link's bandwidth-delay product whether or not
    # a handler reads it (16 calls that no handler read held +130 MiB; with it off, +2 MiB),
    # is off: a stream takes in its window (64 KiB) until a handler asks for its message, and
    # then that message. Over loopback, 60 MiB and 1 MiB calls took the same time either way.
    unseen = worker is None
    own_port = [("grpc.http2.bdp_probe", 0)] if unseen else []
    server = grpc.aio.server(
        options=[
            # Triton's meaning: a larger message is RESOURCE_EXHAUSTED, checked by gRPC itself
            # after decompression, before any of it reaches Python.
            ("grpc.max_receive_message_length", settings.max_body_bytes),
            ("grpc.max_send_message_length", -1),
            # Answers compressed as the client accepts: a compression *level* makes gRPC pick,
            # call by call, an encoding (gzip first) from the client's grpc-accept-encoding, and
            # none when it lists none. Python never sees that header (nor a request's
            # grpc-encoding), and an algorithm set per call is sent whatever the client accepts
            # (a client without it fails), so the level is the way. Small answers are left as
            # they are, and so are large ones and any that would not shrink (worth_compressing).
            ("grpc.default_compression_level", _COMPRESSION_LEVEL_LOW),
            # The bounds HTTP connections have (service/limits/connections.py): at most
            # TG_MAX_CONNECTIONS open (one more is closed before gRPC reads from it), and
            # TG_HEADER_TIMEOUT_S for a new connection's HTTP/2 preface and settings to arrive
            # (a silent socket is closed then).
            ("grpc.max_allowed_incoming_connections", settings.max_connections),
            ("grpc.max_concurrent_streams", MAX_STREAMS_PER_CONNECTION),
            # The cap is HTTP/2's: streams open on the connection. grpc's overload protection
            # also counts calls whose answer has gone but which Python has not let go yet, and
            # refused (REFUSED_STREAM, UNAVAILABLE at the client) a burst's next call in the
            # slot its client had rightly reused: 193 of 400 calls at once on one channel.
            # A rapid reset (200,000 streams opened and reset at once) cost the server about
            # the CPU it cost the client, and 4 MiB, without it.
            ("grpc.http.overload_protection", 0),
            ("grpc.server_handshake_timeout_ms", max(1, round(settings.header_timeout_s * 1000))),
            # grpcio binds with SO_REUSEPORT by default, which lets any process of this user bind
            # the port beside the server and take its calls.
            ("grpc.so_reuseport", 0),
            *own_port,
        ],
    )
    servicer = InferenceServicer(cluster, budget, unseen)
    handlers = inference_handlers(servicer)
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(SERVICE, handlers)])
    server.add_registered_method_handlers(SERVICE, handlers)  # grpc's fast path, as generated
    health_pb2_grpc.add_HealthServicer_to_server(  # type: ignore[no-untyped-call]  # generated code is untyped
        HealthServicer(cluster), server
    )
    if worker is None:
        host = f"[{settings.host}]" if ":" in settings.host else settings.host
        port = server.add_insecure_port(f"{host}:{settings.grpc_port}")
        await server.start()
        log.info("gRPC listening on %s:%d", settings.host, port)
    else:  # one of several: the supervisor listens on the port, and forwards (cluster/front.py)
        path = worker.grpc_socket_path(worker.index)
        path.unlink(missing_ok=True)  # a dead predecessor's
        server.add_insecure_port(f"unix:{path}")
        await server.start()
        log.info("gRPC listening on %s (forwarded from port %d)", path, settings.grpc_port)
    return GrpcServer(server, servicer)
