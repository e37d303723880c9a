"""The server-wide budget for what clients make the server hold."""

from __future__ import annotations

import pytest

from service.errors import PayloadTooLarge, ServerBusy
from service.limits.admission import BytesBudget


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
