"""Server-wide bounds on what clients may hold: connections, request heads, slow senders and
request bodies in flight. Raw sockets on 127.0.0.1, every wait bounded."""

from __future__ import annotations

import contextlib
import json
import re
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from service.protocol.pb import grpc_service_pb2 as pb
from tests.server import Server, copy_model

pytestmark = pytest.mark.integration

LIMITS = {
    "TG_MAX_CONNECTIONS": "40",
    "TG_MAX_CONNECTIONS_PER_CLIENT": "10",
    "TG_MAX_HEADER_BYTES": "8192",
    "TG_HEADER_TIMEOUT_S": "1.5",
    "TG_BODY_TIMEOUT_S": "1.5",
    "TG_MAX_BODY_BYTES": "400000",
    "TG_MAX_INFLIGHT_BYTES": "1000000",
}
SHORT_HEADER = {"Inference-Header-Content-Length": "10"}
"""A body whose JSON part is its first 10 bytes: the rest counts once, as binary tensors."""
DIGIT = json.dumps(
    {"inputs": [{"name": "image", "datatype": "FP32", "shape": [1, 1, 8, 8], "data": [0.5] * 64}]}
).encode()


@pytest.fixture(scope="module")
def guarded(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    root = tmp_path_factory.mktemp("limits") / "models"
    copy_model("digits", root / "digits")
    server = Server(root, env=LIMITS, log_path=root.parent / "server.log")
    try:
        server.wait_until()
        yield server
    finally:
        server.stop()


def connect(server: Server, source: str = "") -> socket.socket:
    """A connection to the server, from ``source`` (another loopback address) if given."""
    source_address = (source, 0) if source else None
    return socket.create_connection(
        ("127.0.0.1", server.port), timeout=15, source_address=source_address
    )


def read_all(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes (bounded by the socket's timeout)."""
    chunks = []
    with contextlib.suppress(ConnectionResetError):
        while chunk := sock.recv(65536):
            chunks.append(chunk)
    return b"".join(chunks)


def head(path: str = "/v2/models/digits/infer", length: int = len(DIGIT)) -> bytes:
    return (
        f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"Content-Length: {length}\r\n\r\n"
    ).encode()


def refused(server: Server) -> dict[str, float]:
    found = {}
    for line in server.client.get("/metrics").text.splitlines():
        if line.startswith("tensorgate_refused_total{"):
            reason = line.split('reason="')[1].split('"')[0]
            found[reason] = float(line.rsplit(" ", 1)[1])
    return found


def gauge(server: Server, name: str) -> float:
    for line in server.client.get("/metrics").text.splitlines():
        if line.startswith(f"{name} "):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"no {name} in /metrics")


def in_flight(server: Server) -> float:
    return gauge(server, "tensorgate_request_body_bytes_in_flight")


def served(server: Server) -> bool:
    return server.client.post("/v2/models/digits/infer", content=DIGIT).status_code == 200


def test_a_connection_that_never_sends_is_answered_408_and_closed(guarded: Server) -> None:
    before = refused(guarded)["header_timeout"]
    with connect(guarded) as sock:
        answer = read_all(sock)
    assert answer.startswith(b"HTTP/1.1 408 ")
    assert b"the request head did not arrive within 1.5 s" in answer
    assert refused(guarded)["header_timeout"] == before + 1


def test_empty_lines_between_requests_hold_no_connection_open(guarded: Server) -> None:
    """A CRLF between requests (which the parser skips) cancelled uvicorn's keep-alive timer
    and started no head's: one every 0.5 s held an answered connection open for good. Now the
    keep-alive timeout (5 s) closes it all the same."""
    with connect(guarded) as sock:
        sock.sendall(b"GET /v2/health/live HTTP/1.1\r\nHost: t\r\n\r\n")
        assert sock.recv(65536).startswith(b"HTTP/1.1 200 ")
        sock.settimeout(0.5)
        answered = time.monotonic()
        closed = None
        while closed is None and time.monotonic() - answered < 30:  # bounded: it stops
            try:
                sock.sendall(b"\r\n")
                if sock.recv(65536) == b"":
                    closed = time.monotonic() - answered
            except TimeoutError:
                continue
            except (BrokenPipeError, ConnectionResetError):
                closed = time.monotonic() - answered
    assert closed is not None, "still open 30 s after its answer, past its 5 s keep-alive"


def test_a_head_sent_a_byte_at_a_time_is_cut_off(guarded: Server) -> None:
    """Slowloris: each byte arrives in time for any per-read timeout, the whole head never."""
    request = head()
    with connect(guarded) as sock:
        started = time.monotonic()
        answer = b""
        for byte in request:
            try:
                sock.sendall(bytes([byte]))
            except (BrokenPipeError, ConnectionResetError):
                break
            sock.settimeout(0.2)
            with contextlib.suppress(TimeoutError):
                answer = sock.recv(65536)
                if answer:
                    break
            assert time.monotonic() - started < 30, "the server never cut the slow head off"
        sock.settimeout(15)
        answer += read_all(sock)
    assert answer.startswith(b"HTTP/1.1 408 ")


def test_a_body_that_stops_arriving_is_answered_408(guarded: Server) -> None:
    with connect(guarded) as sock:
        sock.sendall(head(length=10_000) + b'{"inputs": ')
        answer = read_all(sock)
    assert answer.startswith(b"HTTP/1.1 408 ")
    assert b"the request body did not arrive within 1.5 s" in answer
    assert served(guarded)  # the request it held is gone; others are served


def test_a_head_over_the_limit_is_answered_431(guarded: Server) -> None:
    with connect(guarded) as sock:
        sock.sendall(b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\n")
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            for _ in range(100):  # 100 × 1 KiB of headers, far past 8 KiB
                sock.sendall(b"X-Padding: " + b"a" * 1010 + b"\r\n")
        answer = read_all(sock)
    assert answer.startswith(b"HTTP/1.1 431 ")
    assert b"exceeds 8192 bytes" in answer


@pytest.mark.parametrize("size", [9_000, 30_000, 100_000, 250_000])
def test_a_head_over_the_limit_in_one_write_is_answered_431(guarded: Server, size: int) -> None:
    """The whole head in one read, after a request on the same connection: the bytes of a read
    a head begins in were not counted (it may end a previous body), and heads of up to about
    200 KB were served against a limit of 64 KiB."""
    before = refused(guarded)["header_too_large"]
    with connect(guarded) as sock:
        sock.sendall(b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\n\r\n")
        assert sock.recv(65536).startswith(b"HTTP/1.1 200 ")
        padding = b"X-Padding: " + b"a" * (size - 60) + b"\r\n"
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            sock.sendall(b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\n" + padding + b"\r\n")
        answer = read_all(sock)
    assert answer.startswith(b"HTTP/1.1 431 "), answer[:200]
    assert refused(guarded)["header_too_large"] == before + 1
    assert served(guarded)


def digits_answered(server: Server) -> float:
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in server.client.get("/metrics").text.splitlines()
        if line.startswith('tensorgate_requests_total{model="digits"')
    )


def test_nothing_after_a_head_over_the_limit_reaches_the_application(guarded: Server) -> None:
    """The parser went on past a refused head: a request after it in the same write reached
    the application, and a WebSocket upgrade crashed uvicorn's handler (an ERROR traceback in
    the log, the client an empty close)."""
    before = digits_answered(guarded)
    big = (
        b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\nConnection: Upgrade\r\n"
        b"Upgrade: websocket\r\nX-Padding: " + b"a" * 20_000 + b"\r\n\r\n"
    )
    with connect(guarded) as sock:
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            sock.sendall(big + head() + DIGIT)
        answer = read_all(sock)
    assert answer.startswith(b"HTTP/1.1 431 ") and answer.count(b"HTTP/1.1 ") == 1, answer
    assert served(guarded)
    assert digits_answered(guarded) == before + 1  # the one just served, not the one after
    assert "Fatal error" not in guarded.log() and "KeyError" not in guarded.log()


def test_a_request_asking_for_an_upgrade_is_answered_as_it_was(guarded: Server) -> None:
    """curl --http2 on an http:// URL asks for h2c: answered as HTTP/1.1 (uvicorn's own
    answer). The trailers' counter made every such request a 400."""
    request = (
        b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\nConnection: Upgrade, HTTP2-Settings\r\n"
        b"Upgrade: h2c\r\nHTTP2-Settings: AAMAAABkAAQCAAAAAAIAAAAA\r\n\r\n"
    )
    with connect(guarded) as sock:
        sock.sendall(request)
        answer = sock.recv(65536)
        assert answer.startswith(b"HTTP/1.1 200 "), answer[:200]
        # and the connection goes on as HTTP/1.1 (llhttp parsed nothing after an upgrade's
        # head: the next request went unanswered)
        sock.sendall(b"GET /v2/health/ready HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        assert read_all(sock).startswith(b"HTTP/1.1 200 ")


UPGRADE = b"Connection: Upgrade, HTTP2-Settings\r\nUpgrade: h2c\r\nHTTP2-Settings: AAMAAABkAAQCAAAAAAIAAAAA\r\n"


@pytest.mark.parametrize("framing", ["content-length", "chunked"])
@pytest.mark.parametrize("apart", [False, True], ids=["one write", "head and body apart"])
def test_a_post_asking_for_an_upgrade_is_served_with_its_body(
    guarded: Server, framing: str, apart: bool
) -> None:
    """``curl --http2 -d @request.json http://...`` asks for h2c on its POST. llhttp reads no
    body after an upgrade's head: the request was answered as if empty (400) and the body's
    bytes went unparsed, as did every later request on the connection."""
    if framing == "chunked":
        request_head = head().replace(
            b"Content-Length: %d\r\n" % len(DIGIT), b"Transfer-Encoding: chunked\r\n"
        )
        body = b"%x\r\n%s\r\n0\r\n\r\n" % (len(DIGIT), DIGIT)
    else:
        request_head, body = head(), DIGIT
    request_head = request_head.replace(b"Host: 127.0.0.1\r\n", b"Host: 127.0.0.1\r\n" + UPGRADE)
    before = refused(guarded)["invalid_http"]
    with connect(guarded) as sock:
        answer = sent_apart(
            sock,
            [request_head, body + head() + DIGIT]
            if apart
            else [request_head + body + head() + DIGIT],
            close_after=True,
        )
    assert statuses(answer) == [200, 200, 200], answer[-300:]  # the two, and close_after's
    first = answer.split(b"\r\n\r\n", 1)[1]
    plain = guarded.client.post("/v2/models/digits/infer", content=DIGIT).json()
    assert json.loads(first[: first.index(b"HTTP/1.1")])["outputs"] == plain["outputs"]
    assert refused(guarded)["invalid_http"] == before


def test_trailers_past_the_limit_are_answered_431(guarded: Server) -> None:
    """A chunked body's trailers went into the request's headers, unbounded."""
    trailers = b"".join(b"X-T%d: %s\r\n" % (i, b"a" * 1000) for i in range(20))
    request = (
        b"POST /v2/models/digits/infer HTTP/1.1\r\nHost: x\r\n"
        b"Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
        + b"%x\r\n" % len(DIGIT)
        + DIGIT
        + b"\r\n0\r\n"
        + trailers
        + b"\r\n"
    )
    with connect(guarded) as sock:
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            sock.sendall(request)
        answer = read_all(sock)
    assert answer.startswith(b"HTTP/1.1 431 "), answer[:200]
    five = b"".join(b"X-T%d: %s\r\n" % (i, b"a" * 1000) for i in range(5))
    within = request.replace(trailers, five)  # 5 KB of trailers, within the 8 KiB
    with connect(guarded) as sock:
        sock.sendall(within)
        assert sock.recv(65536).startswith(b"HTTP/1.1 200 ")


def test_a_body_is_not_counted_as_the_next_requests_head(guarded: Server) -> None:
    """A head split over two writes, its 30 KB body and the start of the next head in the
    second: the whole read was charged to the next head, a 431 at a limit of 8 KiB."""
    body = DIGIT + b" " * 30_000
    first, rest = head(length=len(body)).split(b"Host:")
    with connect(guarded) as sock:
        sock.sendall(first)
        time.sleep(0.1)  # apart, so that the server reads them apart (no wait for the server)
        sock.sendall(b"Host:" + rest + body + b"GET /v2/health/live HTTP/1.1\r\n")
        time.sleep(0.1)  # the same
        sock.sendall(b"Host: x\r\nConnection: close\r\n\r\n")
        answer = read_all(sock)
    assert answer.count(b"HTTP/1.1 200 ") == 2, answer[:300]


def statuses(answer: bytes) -> list[int]:
    return [int(status) for status in re.findall(rb"HTTP/1\.1 (\d{3}) ", answer)]


def sent_apart(sock: socket.socket, writes: list[bytes], close_after: bool = False) -> bytes:
    """Each of ``writes`` on its own, then everything the server sends until it closes (with
    ``close_after``, once a last request asks it to)."""
    with contextlib.suppress(BrokenPipeError, ConnectionResetError):
        for i, write in enumerate(writes):
            if i:
                time.sleep(0.05)  # apart, so that the server reads them apart
            sock.sendall(write)
        if close_after:
            sock.sendall(b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    return read_all(sock)


@pytest.mark.parametrize("bad", ["too large", "malformed"])
def test_a_refusal_on_a_pipelined_connection_comes_after_the_earlier_answers(
    guarded: Server, bad: str
) -> None:
    """#28, round three: two requests and, before their answers, a third whose head is too
    large (431) or malformed (400), all on one connection. The refusal was written and the
    connection closed at once: the first two answers were lost. HTTP/1.1 answers in order."""
    third = (
        b"GET /v2/health/live HTTP/1.1\r\nX-Padding: " + b"a" * 9000 + b"\r\n\r\n"
        if bad == "too large"
        else b"GET /v2/health/live HTTP/1.1\r\nBad Header\r\n\r\n"
    )
    before = digits_answered(guarded)
    reason = "header_too_large" if bad == "too large" else "invalid_http"
    refusals = refused(guarded)[reason]
    with connect(guarded) as sock:
        answer = sent_apart(sock, [head() + DIGIT + head() + DIGIT + third])
    assert statuses(answer) == [200, 200, 431 if bad == "too large" else 400], answer[-300:]
    assert digits_answered(guarded) == before + 2  # the third reached no application
    assert refused(guarded)[reason] == refusals + 1  # the parser's 400 was counted nowhere
    if bad == "malformed":  # saying what was wrong (uvicorn's said only that it was invalid)
        # in JSON, as every other error: {"error": ...}
        said = b'{"error":"Invalid HTTP request received: Invalid header token"}'
        assert answer.endswith(b"\r\n\r\n" + said)
        assert b"content-type: application/json\r\n" in answer.rsplit(b"HTTP/1.1 400", 1)[1]


def exact_head(size: int) -> bytes:
    """A request head of ``size`` bytes, its request line to its final CRLFCRLF."""
    base = b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\nConnection: close\r\nX-Padding: \r\n\r\n"
    return base.replace(b"X-Padding: ", b"X-Padding: " + b"a" * (size - len(base)))


SPLITS = {
    "one write": lambda h: [h],
    "at its CRLFCRLF": lambda h: [h[:-4], h[-4:]],
    "in its final CRLF": lambda h: [h[:-1], h[-1:]],
    "mid-header": lambda h: [h[:100], h[100:5000], h[5000:]],
    "its last bytes one at a time": lambda h: [h[:-6], *(bytes([b]) for b in h[-6:])],
    "after a body in the same read": lambda h: [head()[:-2], b"\r\n" + DIGIT + h],
    "with the next request in the same read": lambda h: [
        h[:50],
        h[50:] + b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\n\r\n",
    ],
}


@pytest.mark.parametrize("split", SPLITS)
def test_a_head_of_the_limit_is_served_and_one_byte_more_refused_however_it_is_split(
    guarded: Server, split: str
) -> None:
    """#28, round three: a head's size was read from its URL and headers, or from the reads
    it spanned (which may hold a previous body): one of 8,193 bytes against 8,192 was served
    in one write and refused split in some places. What counts is the request line, header
    lines and the final CRLFCRLF, however the reads split them."""
    served_before = [200] if split == "after a body in the same read" else []
    with connect(guarded) as sock:
        answer = sent_apart(sock, SPLITS[split](exact_head(8192)))
    assert statuses(answer) == [*served_before, 200], answer[-300:]
    with connect(guarded) as sock:
        answer = sent_apart(sock, SPLITS[split](exact_head(8193)))
    assert statuses(answer) == [*served_before, 431], answer[-300:]


def chunked(body: bytes) -> bytes:
    return (
        b"POST /v2/models/digits/infer HTTP/1.1\r\nHost: x\r\n"
        b"Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n" + body
    )


def test_a_chunk_size_line_past_the_header_limit_is_answered_413(guarded: Server) -> None:
    """#28, round three: a chunk-size line whose extension never ends was bounded only by the
    body timeout (408 after 1.5 s here, 60 s by default), read all the while. It is bounded
    as a head is, by TG_MAX_HEADER_BYTES (each line, its CRLF included)."""
    before = refused(guarded)["chunk_line_too_large"]
    with connect(guarded) as sock:
        answer = sent_apart(sock, [chunked(b"%x;ext=" % len(DIGIT)), b"a" * 20_000])
    assert statuses(answer) == [413], answer[:300]  # not 408: before the body timeout
    assert b"chunk-size line" in answer and b"exceeds 8192 bytes" in answer
    assert refused(guarded)["chunk_line_too_large"] == before + 1
    line = b"%x;ext=%s\r\n" % (len(DIGIT), b"a" * (8192 - 7 - len(b"%x" % len(DIGIT))))
    assert len(line) == 8192
    with connect(guarded) as sock:  # a line of the limit is served
        sock.sendall(chunked(line + DIGIT + b"\r\n0\r\n\r\n"))
        assert sock.recv(65536).startswith(b"HTTP/1.1 200 ")


def test_a_trailer_line_that_never_ends_is_answered_431(guarded: Server) -> None:
    """#28, round three: trailers were counted as each line ended, so one that never did was
    bounded only by the body timeout, while httptools joined each read of it onto the last."""
    before = refused(guarded)["header_too_large"]
    last = b"%x\r\n%s\r\n0\r\nX-Trailer: " % (len(DIGIT), DIGIT)
    with connect(guarded) as sock:
        answer = sent_apart(sock, [chunked(last), b"a" * 4000, b"a" * 4000, b"a" * 4000])
    assert statuses(answer) == [431], answer[:300]  # not 408: before the body timeout
    assert b"trailers exceed 8192 bytes" in answer
    assert refused(guarded)["header_too_large"] == before + 1


def test_a_head_under_the_limit_is_served(guarded: Server) -> None:
    answer = guarded.client.get("/v2/health/live", headers={"X-Padding": "a" * 4000})
    assert answer.status_code == 200


def test_past_the_connection_limit_new_connections_get_503_and_the_rest_serve(
    guarded: Server,
) -> None:
    held = []
    try:
        for i in range(45):  # the limit is 40 (the test client holds one more), 10 a client
            sock = connect(guarded, f"127.0.0.{2 + i // 9}")
            held.append(sock)
        with connect(guarded) as extra:
            answer = read_all(extra)
        assert answer.startswith(b"HTTP/1.1 503 ")
        assert b"retry-after: 1" in answer.lower()
        assert b"40 connections open, its limit" in answer
    finally:
        for sock in held:
            sock.close()
    guarded.wait_for(lambda: served(guarded), timeout=30)  # closed ones free their slots
    assert refused(guarded)["too_many"] >= 1


def test_one_client_holds_at_most_its_share_of_the_connections(guarded: Server) -> None:
    """#28 finding 16: the connection cap was global, so 4,096 silent connections from one
    client made 118 of 125 other clients' requests 503."""
    before = refused(guarded).get("too_many_from_client", 0)
    held = []
    try:
        held = [connect(guarded, "127.0.0.2") for _ in range(10)]
        with connect(guarded, "127.0.0.2") as extra:
            answer = read_all(extra)
        assert answer.startswith(b"HTTP/1.1 503 ")
        assert b"this client has 10 connections open" in answer
        assert b"TG_MAX_CONNECTIONS_PER_CLIENT" in answer
        assert served_from(guarded, "127.0.0.3")  # another client is served
    finally:
        for sock in held:
            sock.close()
    assert refused(guarded)["too_many_from_client"] == before + 1
    guarded.wait_for(lambda: served_from(guarded, "127.0.0.2"))  # closed: its share is back


def served_from(server: Server, source: str) -> bool:
    with connect(server, source) as sock:
        sock.sendall(head() + DIGIT)
        return sock.recv(65536).startswith(b"HTTP/1.1 200 ")


def test_bodies_past_the_inflight_budget_get_503_as_they_arrive(tmp_path: Path) -> None:
    """Two uploads stalled one byte short of 400 kB hold 800 kB of a 1 MB budget: a third is
    refused once its bytes pass it, and so is a 300 kB gRPC message (the protocols share the
    budget), a small request still fits, and the budget comes back when the stalled clients
    leave."""
    root = tmp_path / "models"
    copy_model("digits", root / "digits")
    server = Server(root, env={**LIMITS, "TG_BODY_TIMEOUT_S": "120"}, log_path=tmp_path / "log")
    stalled: list[socket.socket] = []
    try:
        server.wait_until()
        stalled = [connect(server) for _ in range(2)]
        for sock in stalled:
            sock.sendall(head(length=400_000) + b"{" + b" " * 399_998)
        big = b"x" * 300_000
        server.wait_for(lambda: in_flight(server) == 799_998, timeout=60)  # both as arrived
        answer = server.client.post("/v2/models/digits/infer", content=big, headers=SHORT_HEADER)
        assert answer.status_code == 503
        assert answer.headers["retry-after"] == "1"
        assert "TG_MAX_INFLIGHT_BYTES" in answer.json()["error"]
        with grpc.insecure_channel(server.grpc_url) as channel:
            infer = model_infer(channel)
            with pytest.raises(grpc.RpcError) as refused_call:
                infer(padded_digit(300_000), timeout=30)
            assert refused_call.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "TG_MAX_INFLIGHT_BYTES" in (refused_call.value.details() or "")
            assert served(server)  # a small body still fits
            for sock in stalled:
                sock.close()
            server.wait_for(  # read now, and refused for what it is
                lambda: (
                    server.client.post(
                        "/v2/models/digits/infer", content=big, headers=SHORT_HEADER
                    ).status_code
                    == 400
                ),
                timeout=60,
            )
            assert infer(padded_digit(300_000), timeout=30).outputs  # the budget came back
        assert refused(server)["body_budget"] >= 2
        assert in_flight(server) == 0
    finally:
        for sock in stalled:
            sock.close()
        server.stop()


def test_a_json_body_holds_what_it_decodes_into(guarded: Server) -> None:
    """#28 finding 14: a JSON body holds 14–20 times its size while orjson and numpy decode it,
    and the budget counted it once. A JSON body is now held at 20× before it is parsed; one
    that could never fit the whole budget is 413, not a 503 to retry for ever."""
    values = json.dumps([0.5] * 13_000).encode()  # 52 kB: 1.04 MB held, the budget is 1 MB
    body = b'{"inputs": [{"name": "image", "datatype": "FP32", "shape": [1, 1, 8, 8], "data": '
    answer = guarded.client.post("/v2/models/digits/infer", content=body + values + b"}]}")
    assert answer.status_code == 413, answer.text
    assert "holds about 20 times its size" in answer.json()["error"]
    assert "TG_MAX_INFLIGHT_BYTES" in answer.json()["error"]
    assert served(guarded)  # a small JSON body fits (20 × 400 bytes)
    assert in_flight(guarded) == 0


def test_heads_without_bodies_hold_nothing_of_the_budget(tmp_path: Path) -> None:
    """#28 finding 4: the budget was taken from the declared Content-Length, so 16 heads with
    no body bytes (3 kB) made every REST and gRPC inference 503/UNAVAILABLE for the body
    timeout. Now a head holds what has arrived: nothing."""
    root = tmp_path / "models"
    copy_model("digits", root / "digits")
    env = {
        **LIMITS,
        "TG_BODY_TIMEOUT_S": "120",
        "TG_MAX_CONNECTIONS": "64",
        "TG_MAX_CONNECTIONS_PER_CLIENT": "64",
    }
    server = Server(root, env=env, log_path=tmp_path / "log")
    heads: list[socket.socket] = []
    try:
        server.wait_until()
        heads = [connect(server) for _ in range(16)]
        for sock in heads:
            sock.sendall(head(length=400_000))
        for _ in range(10):  # the heads reach the app within these rounds, and hold nothing
            assert served(server)
            assert in_flight(server) == 0
            time.sleep(0.1)
        big = server.client.post(
            "/v2/models/digits/infer", content=b"x" * 300_000, headers=SHORT_HEADER
        )
        assert big.status_code == 400, big.text  # read, and refused for what it is
        with grpc.insecure_channel(server.grpc_url) as channel:
            assert model_infer(channel)(padded_digit(300_000), timeout=30).outputs
    finally:
        for sock in heads:
            sock.close()
        server.stop()


def test_grpc_connections_are_bounded_and_silent_ones_closed(guarded: Server) -> None:
    """TG_MAX_CONNECTIONS bounds gRPC connections too: with every slot held by sockets that
    never speak, one more is closed before anything is read from it; the silent ones are
    closed after TG_HEADER_TIMEOUT_S, and gRPC serves again."""
    host, port = guarded.grpc_url.rsplit(":", 1)
    silent = [socket.create_connection((host, int(port)), timeout=15) for _ in range(40)]
    try:
        for sock in silent:  # the server's first frame: gRPC has accepted it, a slot is taken
            assert sock.recv(9)
        with socket.create_connection((host, int(port)), timeout=15) as extra:
            assert read_all(extra) == b""  # closed, nothing sent: no slot for it
        for sock in silent:  # closed by the server once the handshake time is up
            read_all(sock)
    finally:
        for sock in silent:
            sock.close()
    with grpc.insecure_channel(guarded.grpc_url) as channel:
        infer = model_infer(channel)
        assert infer(padded_digit(0), timeout=30).outputs


def model_infer(channel: grpc.Channel) -> grpc.UnaryUnaryMultiCallable:
    """ModelInfer on ``channel``, with the server's own messages."""
    return channel.unary_unary(
        "/inference.GRPCInferenceService/ModelInfer",
        request_serializer=pb.ModelInferRequest.SerializeToString,
        response_deserializer=pb.ModelInferResponse.FromString,
    )


def padded_digit(size: int) -> pb.ModelInferRequest:
    """A valid digits request of about ``size`` bytes: a request parameter pads it."""
    request = pb.ModelInferRequest(model_name="digits", raw_input_contents=[bytes(4 * 64)])
    request.inputs.add(name="image", datatype="FP32", shape=[1, 1, 8, 8])
    request.parameters["padding"].string_param = "x" * size
    return request


def test_a_body_over_the_per_request_limit_is_still_413(guarded: Server) -> None:
    answer = guarded.client.post("/v2/models/digits/infer", content=b"x" * 500_000)
    assert answer.status_code == 413


def test_typed_contents_hold_what_they_decode_into(guarded: Server) -> None:
    """#28 finding 14, gRPC: typed ``contents`` hold about 48 bytes a value while decoded (a
    Python number each), 16 times their size on the wire; they counted at twice it."""

    def typed(rows: int) -> pb.ModelInferRequest:
        request = pb.ModelInferRequest(model_name="digits")
        tensor = request.inputs.add(name="image", datatype="FP32", shape=[rows, 1, 8, 8])
        tensor.contents.fp32_contents.extend([0.5] * (rows * 64))
        return request

    with grpc.insecure_channel(guarded.grpc_url) as channel:
        infer = model_infer(channel)
        with pytest.raises(grpc.RpcError) as refused:
            infer(typed(469), timeout=30)  # 120 kB on the wire, 1.44 MB held: past 1 MB
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "TG_MAX_INFLIGHT_BYTES" in (refused.value.details() or "")
        assert len(infer(typed(4), timeout=30).outputs) > 0  # a small one is served
    assert in_flight(guarded) == 0
