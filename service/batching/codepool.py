"""Where one model version's own code (its pre- and postprocessing) runs, within each request's
deadline.

A thread cannot be stopped: code that hangs past its request's deadline is answered 504 and
goes on running. In a plain pool of ``TG_PREPROCESS_THREADS`` threads, two such requests to a
model on 2 CPUs held both threads, and every later request to the model waited behind them and
was answered 504 too, "did not finish" though its code had never started (a new user's walk:
10 of 10 good requests, with a 3 s sleep against a 2 s timeout). So a request whose code is
left running past its answer gives its thread's place to a spare one: the model keeps
``threads`` threads for requests still waiting on their code, up to ``spare`` more threads in
all for code left running. Past that the model's requests wait for a thread, as before, and
one that does not get one within its deadline is a 504 saying so.

Every count lives on the event loop: a run takes its place there, and gives it back in a
callback the thread's end schedules there.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from threading import Event
from typing import TypeVar

from service.errors import DeadlineExceeded

T = TypeVar("T")


@dataclass(slots=True)
class _Run:
    """One run of the code, as the pool counts it."""

    finished: bool = False
    left: bool = False
    """Its request was answered (or cancelled) while it ran: a spare thread took its place."""


class CodePool:
    """``threads`` threads for a model's own code, and up to ``spare`` more in place of those
    still running code whose request was already answered (see the module)."""

    def __init__(self, threads: int, name: str, spare: int | None = None) -> None:
        self.threads = threads
        self.spare = max(4, 2 * threads) if spare is None else spare
        self.executor = ThreadPoolExecutor(threads + self.spare, thread_name_prefix=name)
        self.running = 0
        """Runs on a thread now, ``left`` ones included."""
        self.left = 0
        """Runs whose request was answered while they ran, still running."""
        self._waiting: list[asyncio.Future[None]] = []

    def _free(self) -> bool:
        return self.running < self.threads + min(self.left, self.spare)

    async def run(
        self, fn: Callable[[], T], deadline: float, model: str, step: str, gone: Event
    ) -> T:
        """``fn()`` on one of the pool's threads, answered 504 past ``deadline`` (monotonic):
        whether it did not start by then (every thread busy) or did not finish. Once the request
        is answered or cancelled, ``gone`` is set (steps the code calls next are refused)."""
        loop = asyncio.get_running_loop()
        try:
            await self._turn(loop, deadline)
        except TimeoutError:
            gone.set()
            busy = f"its {self.running} code threads were all busy"
            if self.left:
                busy += f", {self.left} of them with code of requests already answered"
            raise DeadlineExceeded(
                f"model '{model}': its {step} code did not start within the request's "
                f"deadline: {busy} (TG_PREPROCESS_THREADS sets how many)"
            ) from None
        except asyncio.CancelledError:
            gone.set()
            raise
        run = _Run()
        started = self.executor.submit(fn)  # RuntimeError once shut down: nothing counted
        self.running += 1

        def finished(_: Future[T]) -> None:
            with contextlib.suppress(RuntimeError):  # the loop closed meanwhile: nobody counts
                loop.call_soon_threadsafe(self._finished, run)

        started.add_done_callback(finished)
        try:
            return await asyncio.wait_for(
                asyncio.shield(asyncio.wrap_future(started)),
                max(0.0, deadline - time.monotonic()),
            )
        except TimeoutError:
            gone.set()
            self._leave(run)
            raise DeadlineExceeded(
                f"model '{model}': its {step} code did not finish within the request's deadline"
            ) from None
        except asyncio.CancelledError:
            gone.set()
            self._leave(run)
            raise

    async def _turn(self, loop: asyncio.AbstractEventLoop, deadline: float) -> None:
        """Until a thread is free for one more run (TimeoutError at ``deadline``)."""
        while not self._free():
            waiter: asyncio.Future[None] = loop.create_future()
            self._waiting.append(waiter)
            try:
                await asyncio.wait_for(waiter, max(0.0, deadline - time.monotonic()))
            finally:
                with contextlib.suppress(ValueError):
                    self._waiting.remove(waiter)

    def _leave(self, run: _Run) -> None:
        if not run.finished and not run.left:
            run.left = True
            self.left += 1
            self._wake()

    def _finished(self, run: _Run) -> None:
        run.finished = True
        self.running -= 1
        if run.left:
            self.left -= 1
        self._wake()

    def _wake(self) -> None:
        """Each waiting run looks again (few wait: they are one model's requests)."""
        for waiter in self._waiting:
            if not waiter.done():
                waiter.set_result(None)

    def shutdown(self) -> None:
        """No more runs; threads end with their work (a hung one: never)."""
        self.executor.shutdown(wait=False, cancel_futures=True)
