"""What a model's load does to the pipelines that call it (``DataPlane.load_model``): they
serve on while it loads, and each whose replay ran through another load of a step is reloaded,
those calling others after them, also when the caller of the load has gone. A repository of
plain objects stands in for the real one, whose serials and steps it keeps as names."""

from __future__ import annotations

import asyncio
import collections
import threading
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from service.core.dataplane import DataPlane
from service.errors import ModelLoadRefused
from service.repository.loader import Step
from service.repository.models import ModelEntry, ModelRepository, ModelState, ModelVersion
from service.settings import Settings


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
        self.stopping = threading.Event()
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


async def until(condition: Callable[[], bool]) -> None:
    """Polled, bounded: until ``condition`` holds (a load's thread reached a point)."""
    for _ in range(1000):
        if condition():
            return
        await asyncio.sleep(0.005)
    raise TimeoutError("the condition never held")


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
    await until(lambda: len(repository.marked_during.get("A", [])) == 1)  # first load holds
    assert repository.replaying == {"P": 1}
    second = asyncio.ensure_future(plane.load_model("A"))
    await until(lambda: len(repository.marked_during.get("A", [])) == 2)  # so does the second
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
    await until(lambda: "A" in repository.marked_during)  # its load holds, in its thread
    caller.cancel()
    with pytest.raises(asyncio.CancelledError):
        await caller
    repository.release["A"].set()
    await until(lambda: "P" in repository.loads and not repository.replaying)
    assert repository.loads == ["A", "P"] and repository.stale() == []
    assert repository.replaying == {}


async def test_a_pipeline_that_calls_a_stale_one_through_others_waits_for_them() -> None:
    """C calls Q2 and S, Q2 calls Q1, Q1 calls S: a load of S found C and Q1 stale, replayed C
    first (through the Q2 about to be replaced), and C stayed stale (503)."""
    repository = Repository({"S": set(), "Q1": {"S"}, "Q2": {"Q1"}, "C": {"Q2", "S"}})
    await core(repository).load_model("S")
    assert repository.loads == ["S", "Q1", "Q2", "C"]
    assert repository.stale() == []


async def test_a_refused_replay_is_tried_again_by_its_steps_loads_not_by_any_load() -> None:
    """Every load of any model reloaded (and warmed, and replayed) each pipeline refused once."""
    repository = Repository({"A": set(), "X": set(), "P": {"A"}})
    repository.refuse.add("P")
    plane = core(repository)
    await plane.load_model("A")
    await plane.load_model("X")
    assert repository.loads == ["A", "P", "X"]
    await plane.load_model("A")
    assert repository.loads == ["A", "P", "X", "A", "P"]


async def test_a_refused_load_still_answers_its_caller_with_the_refusal() -> None:
    repository = Repository({"A": set(), "P": {"A"}})
    repository.refuse.add("A")
    with pytest.raises(ModelLoadRefused, match="failed to load 'A'"):
        await core(repository).load_model("A")
    assert repository.loads == ["A"] and repository.replaying == {}


def test_the_repository_tells_a_pipeline_replayed_through_another_load_of_its_step(
    tmp_path: Path,
) -> None:
    """The real repository's view, with stand-ins for what serves: which load of each step a
    pipeline's replay ran through, against the one serving now."""
    repository = ModelRepository(Settings(model_repository=tmp_path))

    def serve(name: str, serial: int, steps: tuple[Step, ...] = ()) -> ModelVersion:
        served: Any = SimpleNamespace(loaded=SimpleNamespace(serial=serial, steps=steps))
        version = ModelVersion(name, 1, tmp_path / name / "1", ModelState.READY, served=served)
        repository.models[name] = ModelEntry(name, tmp_path / name, versions={1: version})
        return version

    serve("A", 7)
    pipeline = serve("P", 8, (Step("A", None, 7),))
    assert repository.depending_on("A") == {"P"} and repository.steps_of("P") == {"A"}
    assert repository.stale() == [] and repository.missing_step(pipeline) == ""
    serve("A", 9)  # loaded again
    assert repository.stale() == ["P"]
    said = repository.missing_step(pipeline)
    assert said.startswith("its pipeline step 'A' version 1 was loaded after this version's")
    assert "reload 'P' to replay its answers through it" in said
    assert repository.state(pipeline)[0] is ModelState.UNAVAILABLE
    repository.replaying["P"] += 1  # a load of A under way: P serves on meanwhile
    assert repository.missing_step(pipeline) == ""
    repository.models["P"].last_load_error = "failed to load 'P': version 1: end-to-end ..."
    repository.replaying["P"] -= 1
    assert "replaying its answers through it failed: failed to load 'P'" in (
        repository.missing_step(pipeline)
    )
    # a strict readiness says so: a READY pipeline that cannot serve is not ready (it said so)
    repository.loading_done.set()
    assert repository.problems()["P"].startswith(
        "version 1 cannot serve: its pipeline step 'A' version 1 was loaded after"
    )
    assert not repository.all_ready()
    repository.models["A"].unloaded = True  # unloaded on request: asked for, not a fault
    assert "P" not in repository.problems()
    # another step's fault counts, whichever step was unloaded
    serve("B", 3)
    serve("P", 8, (Step("A", None, 7), Step("B", None, 2)))
    repository.models["A"].unloaded = True
    assert repository.problems()["P"].startswith(
        "version 1 cannot serve: its pipeline step 'B' version 1 was loaded after"
    )
