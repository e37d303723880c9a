"""What a model's load does to the pipelines that call it (``DataPlane.load_model``): they
serve on while it loads, and each whose replay ran through another load of a step is reloaded,
those calling others after them, also when the caller of the load has gone. A repository of
plain objects stands in for the real one, whose serials and steps it keeps as names."""

from __future__ import annotations

import asyncio
import collections
import threading
from types import SimpleNamespace
from typing import Any

import pytest

from service.core.dataplane import DataPlane
from service.errors import ModelLoadRefused


class Repository:
    """Models by name, each calling ``calls`` and recording, at its load, the load number of
    each model it calls; a load gives a model a new number."""

    def __init__(self, calls: dict[str, set[str]]) -> None:
        self.calls = calls
        self.serial = dict.fromkeys(calls, 0)
        self.seen = {name: {step: 0 for step in steps} for name, steps in calls.items()}
        self.replaying: collections.Counter[str] = collections.Counter()
        self.loads: list[str] = []
        self.release: dict[str, threading.Event] = {}
        self.refuse: set[str] = set()
        self.marked_during: dict[str, list[dict[str, int]]] = {}
        """What ``replaying`` held as each load of a model began."""

    def load_model(self, name: str, polled: bool = False) -> Any:
        self.marked_during.setdefault(name, []).append(dict(self.replaying))
        if name in self.release:
            assert self.release[name].wait(10)
        self.loads.append(name)
        if name in self.refuse:
            raise ModelLoadRefused(f"failed to load '{name}'")
        self.serial[name] += 1
        self.seen[name] = {step: self.serial[step] for step in self.calls[name]}
        return SimpleNamespace(versions={})

    def dependents(self, name: str) -> list[str]:
        return sorted(n for n, steps in self.calls.items() if name in steps)

    def depending_on(self, name: str) -> set[str]:
        found: set[str] = set()
        todo = [name]
        while todo:
            for caller in self.dependents(todo.pop()):
                if caller not in found:
                    found.add(caller)
                    todo.append(caller)
        return found

    def steps_of(self, name: str) -> set[str]:
        return set(self.calls[name])

    def stale(self) -> list[str]:
        return sorted(
            name
            for name, seen in self.seen.items()
            if any(self.serial[step] != at for step, at in seen.items())
        )


def core(repository: Repository) -> Any:
    """A DataPlane of ``repository`` alone: all its loads ask of one."""
    plane: Any = DataPlane.__new__(DataPlane)
    plane.repository = repository
    return plane


async def test_a_pipeline_calling_another_is_replayed_after_it() -> None:
    """P calls A and Q, Q's code calls A: a load of A reloads Q first, then P (through the new
    Q); P, replayed first, ran through the Q about to be replaced and stayed stale."""
    repository = Repository({"A": set(), "Q": {"A"}, "P": {"A", "Q"}})
    await core(repository).load_model("A")
    assert repository.loads == ["A", "Q", "P"]
    assert repository.stale() == []
    assert repository.marked_during["A"] == [{"P": 1, "Q": 1}]  # they served on meanwhile
    assert repository.replaying == {}


async def test_a_refused_replay_leaves_the_others_going_and_the_pipeline_stale() -> None:
    repository = Repository({"A": set(), "P": {"A"}, "R": {"A"}})
    repository.refuse.add("P")
    await core(repository).load_model("A")
    assert repository.loads == ["A", "P", "R"]
    assert repository.stale() == ["P"] and repository.replaying == {}  # P: UNAVAILABLE


async def test_two_loads_of_a_step_keep_its_pipeline_serving_until_both_replayed() -> None:
    """The second load's replay of P ran while the first had already let P go: P was
    UNAVAILABLE (503) for the whole of it."""
    repository = Repository({"A": set(), "P": {"A"}})
    plane = core(repository)
    repository.release["A"] = threading.Event()
    first = asyncio.ensure_future(plane.load_model("A"))
    await asyncio.sleep(0.05)
    assert repository.replaying == {"P": 1}
    second = asyncio.ensure_future(plane.load_model("A"))
    await asyncio.sleep(0.05)
    assert repository.replaying == {"P": 2}
    repository.release["A"].set()
    await asyncio.gather(first, second)
    assert repository.replaying == {} and repository.stale() == []
    assert repository.loads.count("P") >= 1
    assert all(marks["P"] >= 1 for marks in repository.marked_during["P"])  # serving on


async def test_a_load_whose_caller_left_still_replays_its_pipelines() -> None:
    """A gRPC client that cancelled its RepositoryModelLoad cancelled the handler: the swap
    went on in its thread, the replays never ran, and the pipeline stayed UNAVAILABLE."""
    repository = Repository({"A": set(), "P": {"A"}})
    repository.release["A"] = threading.Event()
    caller = asyncio.ensure_future(core(repository).load_model("A"))
    await asyncio.sleep(0.05)
    caller.cancel()
    with pytest.raises(asyncio.CancelledError):
        await caller
    repository.release["A"].set()
    for _ in range(200):
        if "P" in repository.loads:
            break
        await asyncio.sleep(0.01)
    assert repository.loads == ["A", "P"] and repository.stale() == []
    await asyncio.sleep(0.01)
    assert repository.replaying == {}
