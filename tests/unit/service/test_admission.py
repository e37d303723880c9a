"""The server-wide budget for what clients make the server hold."""

from __future__ import annotations

import numpy as np
import pytest

from service.errors import PayloadTooLarge, ServerBusy
from service.limits.admission import BytesBudget
from service.telemetry.counters import REQUEST_HELD


def test_try_take_holds_only_what_fits_with_room_to_spare() -> None:
    """gRPC messages still arriving on one worker's own port hold the most a message may be
    only while as much again stays free for messages that have arrived (servicer._receive)."""
    budget = BytesBudget(limit=100)
    assert budget.try_take(40, spare=40)
    assert not budget.try_take(40, spare=40)  # 80 held would leave 20, not 40
    assert budget.held == 40  # a refusal counts nothing
    budget.take(60)  # what has arrived may still use the room kept spare
    assert budget.held == 100
    with pytest.raises(ServerBusy):
        budget.take(1)
    with pytest.raises(PayloadTooLarge):
        budget.take(101)  # more than the whole budget: never, not later
    budget.release(100)
    assert budget.try_take(100) and budget.held == 100


def test_outputs_are_held_while_their_memory_lives_views_and_all() -> None:
    """A batch's outputs were counted nowhere: an identity model's answers held as much again as
    the bodies admitted, and gRPC's heap rule took them for messages arriving."""
    budget = BytesBudget(limit=1 << 30)
    outputs = {"y": np.ones((4, 64 << 10), np.float32), "small": np.ones((4, 8), np.float32)}
    budget.hold_while_alive(outputs.values())
    assert budget.held == 4 * (256 << 10)  # the small one is not worth a weak reference
    parts = [outputs["y"][i : i + 1] for i in range(4)]  # split among the batch's requests
    del outputs
    assert budget.held == 4 * (256 << 10)  # the views keep the batch's memory
    del parts[:3]
    assert budget.held == 4 * (256 << 10)
    del parts
    assert budget.held == 0


def test_outputs_sharing_memory_are_held_once() -> None:
    budget = BytesBudget(limit=1 << 30)
    whole = np.ones((2, 1 << 20), np.uint8)
    budget.hold_while_alive([whole[:1], whole[1:], whole, [0.5] * 100_000])  # type: ignore[list-item]  # not an array, on purpose
    assert budget.held == 2 << 20  # and what is not an array is not counted, nor an error


def test_outputs_freed_while_the_budget_is_locked_are_let_go_after() -> None:
    """A finalizer runs in whichever thread drops the last reference, also in a garbage
    collection that began in :meth:`BytesBudget.take` with its lock held: it must not take the
    lock (it would wait for itself), only leave the size for the next holder."""
    budget = BytesBudget(limit=1 << 30)
    output = np.ones(1 << 20, np.uint8)
    budget.hold_while_alive([output])
    with budget._lock:  # as a collection inside take would
        del output  # the finalizer runs here
    assert budget.held == 0
    budget.take(10)
    assert budget.held == 10


def test_what_was_made_makes_large_requests_wait_not_small_ones_up_to_twice_the_limit() -> None:
    """A normal client's small request was refused 503 while an attack's answers, made and
    counted, filled the budget: refusing it would spare next to nothing. Small requests are
    judged by what was not made, and by everything against twice the limit: a model whose
    outputs far outgrow its inputs must not have small requests make more without end."""
    budget = BytesBudget(limit=64 << 20)  # small: at most 256 KiB
    budget.take(40 << 20)  # bodies
    budget.hold_while_alive([np.ones(30 << 20, np.uint8)])  # freed at once: counted, let go
    assert budget.held == 40 << 20 and budget.made == 0
    outputs = np.ones(60 << 20, np.uint8)
    budget.hold_while_alive([outputs])
    assert budget.held == 100 << 20 and budget.made == 60 << 20  # past the limit: made
    with pytest.raises(ServerBusy):
        budget.take(1 << 20)  # a large request's next megabyte waits
    with pytest.raises(ServerBusy):
        budget.take(200 << 10, already=100 << 10)  # 300 KiB in all: not a small request
    for _ in range(100):
        budget.take(200 << 10)  # small requests go on: 60 MiB of bodies, 119.5 MiB held
    budget.hold(9 << 20, made=True)  # a gRPC answer, say: 128.5 MiB held
    with pytest.raises(ServerBusy):
        budget.take(200 << 10)  # not past twice the limit
    budget.release(0, 9 << 20)
    del outputs  # its answers sent: a large request fits again
    budget.take(4 << 20)
    assert budget.held == (40 << 20) + 100 * (200 << 10) + (4 << 20) and budget.made == 0


def test_a_requests_answer_is_counted_in_place_of_its_estimate_and_let_go_with_it() -> None:
    """A REST answer is counted from before it is made (its outputs' size, an estimate), then
    as made, then compressed: each count replaces the last, and the request's end lets go of
    the last. Made first and counted after, 16 answers of 61 MiB peaked at 3 × their bodies
    where 2 × was counted."""
    budget = BytesBudget(limit=1 << 30)
    held = [0, 0]
    token = REQUEST_HELD.set(held)
    try:
        budget.take(10 << 20)  # the body (BodyBudget counts it in held[0])
        held[0] += 10 << 20
        assert budget.hold_for_request(40 << 20) == 40 << 20  # JSON text, estimated
        assert budget.held == 50 << 20 and budget.made == 40 << 20
        assert budget.hold_for_request(30 << 20) == 30 << 20  # as made
        assert budget.hold_for_request(1000) == 0  # compressed: too small to count
        assert budget.held == 10 << 20 and budget.made == 0 and held == [10 << 20, 0]
        budget.hold_for_request(20 << 20)
    finally:
        REQUEST_HELD.reset(token)
    budget.release(held[0], held[1])  # as BodyBudget does once the answer is sent
    assert budget.held == 0 and budget.made == 0
    assert budget.hold_for_request(20 << 20) == 0  # outside a REST request: not counted


def test_an_error_answer_holds_at_most_4096_characters_of_its_message() -> None:
    """Messages name what the client sent: a 1 MB input name was answered a 1 MB error (the
    log keeps the message whole)."""
    import orjson

    from service.limits.admission import error_body, shortened

    name = "x" * 1_000_000
    body = orjson.loads(error_body(f"model 'm' has no input ['{name}']"))
    assert len(body["error"]) < 4200
    assert body["error"].endswith("… (995931 more characters left out)")
    assert shortened("short") == "short"


def test_decodes_take_turns_within_the_gate_and_one_alone_always_runs() -> None:
    """What images being decoded hold together stays within the capacity, a decode waiting
    its turn meanwhile; one larger than the whole capacity runs when it is alone; none is
    refused."""
    import threading

    from service.limits.admission import DecodeGate

    gate = DecodeGate(100)
    seen: list[int] = []
    order: list[str] = []
    holding, release = threading.Event(), threading.Event()

    def decode(name: str, size: int, hold: threading.Event | None = None) -> None:
        with gate.holding(size):
            seen.append(gate.held)
            order.append(name)
            if hold is not None:
                holding.set()
                hold.wait(10)

    first = threading.Thread(target=decode, args=("first", 60, release))
    first.start()
    assert holding.wait(10)
    waiting = [
        threading.Thread(target=decode, args=args) for args in (("second", 60), ("huge", 500))
    ]
    for thread in waiting:
        thread.start()
    for _ in range(1000):  # both have found the gate held (bounded: 10 s at most)
        if gate.waited == 2:
            break
        threading.Event().wait(0.01)
    assert gate.waited == 2 and order == ["first"]
    release.set()
    for thread in (first, *waiting):
        thread.join(10)
    assert order[0] == "first" and sorted(order[1:]) == ["huge", "second"]
    assert max(s for s in seen if s != 500) <= 100 and 500 in seen  # alone, the huge one
    assert gate.held == 0
