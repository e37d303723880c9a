"""until_disconnect (a client gone mid-request) and the coalescing transport, on real loops and
real sockets; the body read from ASGI messages."""

from __future__ import annotations

import asyncio
import tracemalloc
from typing import Any

import pytest

from service.errors import InvalidInput, PayloadTooLarge, Unauthorized
from service.http.answer import parse_timeout, receive_body, until_disconnect
from service.limits import auth
from service.limits.auth import check_authorization
from service.telemetry.counters import REFUSED


class Messages:
    """An ASGI ``receive`` fed by the test: what the server would deliver after the body."""

    def __init__(self) -> None:
        self.queue: asyncio.Queue[dict[str, Any]] = asyncio.Queue()

    async def __call__(self) -> dict[str, Any]:
        return await self.queue.get()

    def disconnect(self) -> None:
        self.queue.put_nowait({"type": "http.disconnect"})


async def long_work(cancelled: asyncio.Event) -> int:
    """A minute of work that notes being cancelled."""
    try:
        await asyncio.sleep(60)
    except asyncio.CancelledError:
        cancelled.set()
        raise
    return 1


async def test_work_that_finishes_returns_its_result_and_leaves_no_task() -> None:
    tasks = len(asyncio.all_tasks())
    result = await until_disconnect(Messages(), asyncio.sleep(0.001, result=7))
    await asyncio.sleep(0)  # let the cancelled watcher finish
    assert (result, len(asyncio.all_tasks())) == (7, tasks)  # no task left behind


async def test_a_disconnect_cancels_the_work_and_returns_none() -> None:
    cancelled = asyncio.Event()

    receive = Messages()
    asyncio.get_running_loop().call_later(0.01, receive.disconnect)
    result = await until_disconnect(receive, long_work(cancelled))
    await asyncio.sleep(0)  # the task is usable afterwards: not left cancelling
    current = asyncio.current_task()
    assert current is not None
    result = result, cancelled.is_set(), current.cancelling()
    assert result == (None, True, 0)


@pytest.mark.parametrize("ending", ["raises", "returns"])
async def test_work_that_mishandles_the_cancellation_still_leaves_the_task_usable(
    ending: str,
) -> None:
    """Work that turns the disconnect's cancellation into an error, or swallows it."""

    async def work() -> int:
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            if ending == "raises":
                raise RuntimeError("cleanup failed") from None
        return 1

    receive = Messages()
    asyncio.get_running_loop().call_later(0.01, receive.disconnect)
    result = await until_disconnect(receive, work())
    await asyncio.sleep(0)  # would raise CancelledError if a cancellation were left pending
    current = asyncio.current_task()
    assert current is not None
    result = result, current.cancelling()
    assert result == (None, 0)


async def test_errors_of_the_work_reach_the_caller() -> None:
    async def work() -> int:
        raise ValueError("bad input")

    with pytest.raises(ValueError, match="bad input"):
        await until_disconnect(Messages(), work())


async def test_cancelling_the_request_cancels_its_work() -> None:
    cancelled = asyncio.Event()

    request = asyncio.ensure_future(until_disconnect(Messages(), long_work(cancelled)))
    await asyncio.sleep(0.01)
    request.cancel()
    with pytest.raises(asyncio.CancelledError):
        await request
    result = cancelled.is_set()
    assert result


def body_messages(chunks: list[bytes]) -> Any:
    """An ASGI ``receive`` that delivers ``chunks`` as one body, as uvicorn would."""
    pending = list(chunks)

    async def receive() -> dict[str, Any]:
        chunk = pending.pop(0)
        return {"type": "http.request", "body": chunk, "more_body": bool(pending)}

    return receive


@pytest.mark.parametrize(
    "chunks",
    [[b""], [b"whole"], [b"", b"ab", b"", b"cd", b""], [b"a", b"b", b"c"], [b"", b""]],
)
async def test_a_body_is_its_chunks_in_order(chunks: list[bytes]) -> None:
    assert await receive_body(body_messages(chunks), None, 100) == b"".join(chunks)


async def test_a_body_past_the_limit_is_refused_as_its_chunks_come() -> None:
    before = REFUSED["too_large"]
    with pytest.raises(PayloadTooLarge, match="exceeds the limit of 5 bytes"):
        await receive_body(body_messages([b"abc", b"def", b"never read"]), None, 5)
    with pytest.raises(PayloadTooLarge, match="request body is 9 bytes; the limit is 5"):
        await receive_body(body_messages([b"never read"]), "9", 5)
    # counted where an operator looks (tensorgate_refused_total): no request metric sees them
    assert REFUSED["too_large"] == before + 2


def test_a_missing_or_wrong_token_is_counted_where_an_operator_looks() -> None:
    before = REFUSED["unauthorized"]
    for header in ("", "Bearer wrong", "Basic right"):
        with pytest.raises(Unauthorized):
            check_authorization(header, "right", "api")
    check_authorization("Bearer right", "right", "api")
    assert REFUSED["unauthorized"] == before + 3


def test_refused_tokens_are_logged_with_the_caller_at_most_once_a_while(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An admin 401 was only a count: no line said that someone was trying tokens, or from
    where. A guessing client must not fill the log either: one line a realm per period."""
    now = [100.0]
    monkeypatch.setattr(auth.time, "monotonic", lambda: now[0])
    monkeypatch.setattr(auth, "REFUSALS", auth.Refusals(every_s=10))

    def grpc_peer() -> str:  # gRPC's context.peer: asked only once a token is refused
        return "ipv4:10.0.0.9:5002"

    with caplog.at_level("WARNING", logger="tensorgate.auth"):
        for peer in (("10.0.0.7", 5000), ("10.0.0.8", 5001), grpc_peer):
            with pytest.raises(Unauthorized):
                check_authorization("Bearer guess", "right", "admin", peer)
        with pytest.raises(Unauthorized):
            check_authorization("", "right", "api")  # a realm of its own
        now[0] += 10
        with pytest.raises(Unauthorized):
            check_authorization("", "right", "admin", ("10.0.0.7", 5003))
    assert [r.getMessage() for r in caplog.records] == [
        "refused 1 request(s) without the admin token (a missing or wrong 'Authorization: "
        "Bearer') since the last such line, the latest from 10.0.0.7:5000",
        "refused 1 request(s) without the api token (a missing or wrong 'Authorization: "
        "Bearer') since the last such line, the latest from an unknown address",
        "refused 3 request(s) without the admin token (a missing or wrong 'Authorization: "
        "Bearer') since the last such line, the latest from 10.0.0.7:5003",
    ]


async def test_a_body_of_many_chunks_is_held_once_not_twice() -> None:
    """A list of chunks and their join hold the body twice at the join (#28 finding 14)."""
    size, piece = 32 << 20, 64 << 10
    pending = size // piece

    async def receive() -> dict[str, Any]:  # each chunk made as it is asked for, as a socket would
        nonlocal pending
        pending -= 1
        return {
            "type": "http.request",
            "body": bytes([pending % 251]) * piece,
            "more_body": pending > 0,
        }

    tracemalloc.start()
    try:
        body = await receive_body(receive, str(size), size)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert len(body) == size and body[:1] == bytes([(size // piece - 1) % 251])
    assert peak < 1.3 * size, f"peak {peak >> 20} MiB for a body of {size >> 20} MiB"


def test_a_request_timeout_header_past_a_day_is_taken_as_the_parameter_is() -> None:
    """X-Request-Timeout: 100000 was a 400 "must be seconds > 0", where parameters.timeout of
    as long was held to a day (the deadline holds both to a day)."""
    assert parse_timeout("100000") == 100_000.0
    assert parse_timeout("0.25") == 0.25 and parse_timeout(None) is None
    for bad in ("0", "-1", "soon", "nan", "inf"):
        with pytest.raises(InvalidInput, match="must be a positive number of seconds"):
            parse_timeout(bad)
