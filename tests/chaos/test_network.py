"""Network faults between clients and a real server (#28): slow links, connections cut
mid-request and mid-answer, half-closes, deadlines over a slow link, on both protocols,
through :class:`tests.chaos.netfault.FaultyProxy` on 127.0.0.1. Each case asserts no wrong
answer, nothing lost (every connection left whole is answered, and rightly), the budget and
the in-flight count back to zero, and a normal client served beside it."""

from __future__ import annotations

import json
import random
import socket
import statistics
import threading
import time
from collections import Counter
from collections.abc import Iterator

import grpc
import httpx
import numpy as np
import pytest

from service.protocol.pb import grpc_service_pb2 as pb
from service.protocol.pb import grpc_service_pb2_grpc as pb_grpc
from tests.chaos.conftest import INPUTS, Load, digits_body, reference
from tests.chaos.netfault import Faults, FaultyProxy
from tests.identity import binary_request, write_identity_model
from tests.server import Server, copy_model

pytestmark = pytest.mark.chaos

BODY_TIMEOUT_S = 3.0


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    root = tmp_path_factory.mktemp("network") / "models"
    copy_model("digits", root / "digits")
    write_identity_model(root / "identity", max_batch_size=8, datatypes=("FP32",), width="w")
    env = {"TG_WORKERS": "1", "TG_BODY_TIMEOUT_S": str(BODY_TIMEOUT_S)}
    served = Server(root, env=env, log_path=root.parent / "server.log")
    try:
        served.wait_until()
        yield served
    finally:
        served.stop()


@pytest.fixture(scope="module")
def expected(server: Server) -> list[np.ndarray]:
    return reference(server.url)


def metric(server: Server, name: str) -> float:
    for line in server.client.get("/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"no {name} in /metrics")


def settled(server: Server) -> None:
    """Nothing held once the faults are over: no bytes in the budget, no request in flight
    (bar the one asking), and ready."""
    server.wait_for(
        lambda: (
            metric(server, "tensorgate_request_body_bytes_in_flight") == 0
            and metric(server, "tensorgate_requests_in_flight") <= 1
        ),
        timeout=30,
    )
    assert server.client.get("/v2/health/ready").status_code == 200


def test_a_slow_link_is_answered_rightly_and_its_deadlines_hold(
    server: Server, expected: list[np.ndarray]
) -> None:
    proxy = FaultyProxy(server.port, lambda _: Faults(rate=32_000, latency_s=0.01))
    grpc_proxy = FaultyProxy(server.grpc_port, lambda _: Faults(rate=32_000))
    normal = Load(server.url, expected, clients=2, limit_s=90).start()
    slow = Load(proxy.url, expected, clients=4, limit_s=90).start()
    try:
        slow.wait_for("right", 20, timeout=60)
        # A body slower than TG_BODY_TIMEOUT_S: 1 MiB at 32 kB/s would take 33 s to arrive
        body, header = binary_request(1 << 18)
        started = time.monotonic()
        try:
            answer = httpx.post(
                f"{proxy.url}/v2/models/identity/infer",
                content=body,
                headers={"Inference-Header-Content-Length": str(header)},
                timeout=60,
            )
            outcome = str(answer.status_code)
        except httpx.TransportError as exc:  # the server closed while the client still sent
            outcome = type(exc).__name__
        took = time.monotonic() - started
        print(f"slow body: {outcome} after {took:.1f} s")
        assert outcome in {"408", "WriteError", "ReadError", "RemoteProtocolError"}
        assert took < BODY_TIMEOUT_S + 10  # not the 33 s the body would take
        # gRPC over the same link: a deadline the message cannot make is kept
        with grpc.insecure_channel(f"127.0.0.1:{grpc_proxy.port}") as channel:
            stub = pb_grpc.GRPCInferenceServiceStub(channel)
            values = np.ones(1 << 18, np.float32)
            request = pb.ModelInferRequest(
                model_name="identity",
                inputs=[{"name": "in_FP32", "datatype": "FP32", "shape": [1, values.size]}],
                raw_input_contents=[values.tobytes()],
            )
            started = time.monotonic()
            with pytest.raises(grpc.RpcError) as failed:
                stub.ModelInfer(request, timeout=2)
            assert failed.value.code() is grpc.StatusCode.DEADLINE_EXCEEDED
            assert time.monotonic() - started < 10
            small = pb.ModelInferRequest(
                model_name="identity",
                inputs=[{"name": "in_FP32", "datatype": "FP32", "shape": [1, 4]}],
                raw_input_contents=[np.arange(4, dtype=np.float32).tobytes()],
            )
        # A fresh connection over the same link serves (the first still carries what the
        # client had written of the message when it gave up). A channel's own subchannel pool:
        # grpc otherwise hands a new channel to the same target the old TCP connection.
        with grpc.insecure_channel(
            f"127.0.0.1:{grpc_proxy.port}", options=[("grpc.use_local_subchannel_pool", 1)]
        ) as channel:
            stub = pb_grpc.GRPCInferenceServiceStub(channel)
            answer = stub.ModelInfer(small, timeout=30)
            assert np.frombuffer(answer.raw_output_contents[0], np.float32).tolist() == [0, 1, 2, 3]
        assert grpc_proxy.connections == 2  # the answer came over a connection of its own
    finally:
        seen_slow, seen_normal = slow.stop(), normal.stop()
        proxy.close()
        grpc_proxy.close()
    print(f"slow link: {dict(seen_slow)}; direct beside it: {dict(seen_normal)}")
    assert set(seen_slow) == {"right"} and set(seen_normal) == {"right"}
    assert statistics.median(normal.latencies) < 1.0
    settled(server)


def test_connections_cut_mid_request_or_mid_answer_lose_nothing_and_give_back_the_budget(
    server: Server, expected: list[np.ndarray]
) -> None:
    random.seed(28)
    requests = 120
    bodies = [json.dumps(digits_body(INPUTS[i % len(INPUTS)])).encode() for i in range(requests)]
    # Connection i: cut while the client sends (i % 3 == 0), while the answer comes back
    # (i % 3 == 1), or left whole (i % 3 == 2). One client in turn: connection i is request i.
    plan = [
        Faults(cut_up_after=random.randrange(1, len(bodies[i]) + 100))
        if i % 3 == 0
        else Faults(cut_down_after=random.randrange(1, 400))
        if i % 3 == 1
        else Faults()
        for i in range(requests)
    ]
    proxy = FaultyProxy(server.port, lambda i: plan[i] if i < requests else Faults())
    normal = Load(server.url, expected, clients=2, limit_s=90).start()
    seen: Counter[str] = Counter()
    try:
        for i, body in enumerate(bodies):
            try:
                answer = httpx.post(
                    f"{proxy.url}/v2/models/digits/infer",
                    content=body,
                    headers={"Content-Type": "application/json"},
                    timeout=15,
                )
            except httpx.TransportError as exc:
                assert i % 3 != 2, f"connection {i} was left whole and got {exc!r}"
                seen[f"cut ({type(exc).__name__})"] += 1
                continue
            if answer.status_code != 200:
                assert i % 3 != 2, f"connection {i} was left whole and got {answer.status_code}"
                seen[f"status {answer.status_code}"] += 1
                continue
            data = np.array(answer.json()["outputs"][0]["data"])
            right = np.allclose(data, expected[i % len(INPUTS)], atol=1e-4)
            seen["right" if right else "WRONG"] += 1
    finally:
        seen_normal = normal.stop()
        proxy.close()
    print(
        f"cut connections: {dict(seen)}, {proxy.cuts} cuts; direct beside them: {dict(seen_normal)}"
    )
    assert seen["WRONG"] == 0
    assert seen["right"] >= requests // 3  # every whole connection, and cuts past the answer
    assert proxy.cuts >= requests // 3
    assert set(seen_normal) == {"right"}
    assert statistics.median(normal.latencies) < 1.0
    settled(server)


def test_a_half_close_through_the_link_is_answered(server: Server) -> None:
    proxy = FaultyProxy(server.port, lambda _: Faults(rate=64_000, latency_s=0.005))
    try:
        body = json.dumps(digits_body(INPUTS[2])).encode()
        head = (
            "POST /v2/models/digits/infer HTTP/1.1\r\nHost: x\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
        ).encode()
        with socket.create_connection(("127.0.0.1", proxy.port), timeout=30) as sock:
            sock.sendall(head + body)
            sock.shutdown(socket.SHUT_WR)  # nothing more from this client
            received = b""
            while chunk := sock.recv(65536):
                received += chunk
        interim, _, answer = received.partition(b"\r\n\r\n")  # the probe for a gone client
        assert interim == b"HTTP/1.1 100 Continue", received[:300]
        assert answer.startswith(b"HTTP/1.1 200 OK"), received[:300]
        assert b'"outputs"' in received
    finally:
        proxy.close()
    settled(server)


def test_the_proxy_itself_passes_bytes_unchanged() -> None:
    """The fault tool, checked: with no faults, what goes through comes back whole."""
    echo = socket.create_server(("127.0.0.1", 0))
    port = echo.getsockname()[1]
    payload = bytes(range(256)) * 4096  # 1 MiB

    def serve() -> None:
        conn, _ = echo.accept()
        with conn:
            while data := conn.recv(65536):
                conn.sendall(data)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    proxy = FaultyProxy(port, lambda _: Faults())
    try:
        with socket.create_connection(("127.0.0.1", proxy.port), timeout=30) as sock:
            sender = threading.Thread(
                target=lambda: (sock.sendall(payload), sock.shutdown(socket.SHUT_WR))
            )
            sender.start()
            received = bytearray()
            while chunk := sock.recv(65536):
                received += chunk
            sender.join()
        assert bytes(received) == payload
    finally:
        proxy.close()
        echo.close()
        thread.join(5)
