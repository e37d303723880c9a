"""Freed memory goes back to the system once the budget has let go of enough."""

from __future__ import annotations

from service.limits.admission import BytesBudget
from service.limits.memory import TRIM_AFTER_BYTES, Trimmer, malloc_trim


def test_a_trim_follows_what_the_budget_let_go_and_never_a_quiet_server() -> None:
    trims: list[int] = []
    budget = BytesBudget(limit=1 << 30)
    trimmer = Trimmer(budget, trim=lambda: trims.append(budget.held))
    assert not trimmer.check()  # nothing was ever held
    budget.take(TRIM_AFTER_BYTES)
    assert not trimmer.check()  # still held: nothing to give back
    budget.release(TRIM_AFTER_BYTES - 1)
    assert not trimmer.check()  # one byte short of the threshold
    budget.release(1)
    assert trimmer.check() and trims == [0]
    assert not trimmer.check()  # once: the high-water mark starts again from what is held
    budget.hold(2 * TRIM_AFTER_BYTES)  # answers unsent count too
    budget.hold(-2 * TRIM_AFTER_BYTES)
    assert trimmer.check() and trimmer.trims == 2


def test_this_c_library_trims_for_real() -> None:
    trim = malloc_trim()
    assert trim is not None  # glibc, here and in the image
    trim()
