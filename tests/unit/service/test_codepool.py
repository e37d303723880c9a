"""A model's own code pool: code left running past its request's answer gives its thread's
place to a spare one, up to the spares; past them a request waits, and is a 504 saying its code
never started."""

import asyncio
import threading
import time
from collections.abc import Callable

import pytest

from service.batching.codepool import CodePool
from service.errors import DeadlineExceeded


def _hang(release: threading.Event, ran: list[str], label: str) -> Callable[[], str]:
    def run() -> str:
        ran.append(label)
        release.wait(10)
        return label

    return run


async def test_a_run_past_its_deadline_hands_its_place_to_a_spare_until_the_spares_are_gone() -> (
    None
):
    pool = CodePool(1, "test-code", spare=1)
    release, ran = threading.Event(), []
    try:
        soon = time.monotonic() + 0.1
        gone = threading.Event()
        with pytest.raises(DeadlineExceeded, match="its preprocessing code did not finish"):
            await pool.run(_hang(release, ran, "first"), soon, "m", "preprocessing", gone)
        assert gone.is_set() and (pool.running, pool.left) == (1, 1)
        # its thread still runs the first; the spare runs the next at once
        assert await pool.run(lambda: "second", time.monotonic() + 5, "m", "x", gone) == "second"
        with pytest.raises(DeadlineExceeded):  # the spare left running too
            await pool.run(_hang(release, ran, "third"), time.monotonic() + 0.1, "m", "x", gone)
        assert (pool.running, pool.left) == (2, 2)
        # no spare is left: the next waits for a thread, and says it never started
        with pytest.raises(DeadlineExceeded) as waited:
            await pool.run(lambda: "fourth", time.monotonic() + 0.2, "m", "postprocessing", gone)
        assert str(waited.value) == (
            "model 'm': its postprocessing code did not start within the request's deadline: "
            "its 2 code threads were all busy, 2 of them with code of requests already "
            "answered (TG_PREPROCESS_THREADS sets how many)"
        )
        assert ran == ["first", "third"]
        # the hung ones end: their places come back, and a waiting run starts as one frees
        waiting = asyncio.ensure_future(
            pool.run(lambda: "fifth", time.monotonic() + 5, "m", "x", threading.Event())
        )
        await asyncio.sleep(0.05)
        assert not waiting.done()
        release.set()
        assert await waiting == "fifth"
        for _ in range(100):
            if pool.running == 0:
                break
            await asyncio.sleep(0.01)
        assert (pool.running, pool.left) == (0, 0)
    finally:
        release.set()
        pool.shutdown()


async def test_an_error_of_the_code_is_raised_and_frees_its_thread() -> None:
    pool = CodePool(1, "test-code", spare=0)

    def fails() -> None:
        raise ValueError("the code's own")

    try:
        with pytest.raises(ValueError, match="the code's own"):
            await pool.run(fails, time.monotonic() + 5, "m", "x", threading.Event())
        await asyncio.sleep(0.05)
        assert await pool.run(lambda: 1, time.monotonic() + 5, "m", "x", threading.Event()) == 1
    finally:
        pool.shutdown()
