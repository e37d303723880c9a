"""The model repository: discovers models and versions, loads them, tracks each one's state.

A folder is a model when it holds ``config.yaml``; its numeric subfolders are versions, served
per the config's ``version_policy``. A model or version that cannot be served is UNAVAILABLE
with the reason, in its metadata and logs; the others serve on. Loading a model again swaps
its new versions in only once they have passed their gates and warmup; the versions they
replace finish their in-flight requests, then unload. A version whose files, and the model's
other files, are as they were when it loaded serves on: it is not loaded and warmed again.
"""

from __future__ import annotations

import collections
import enum
import hashlib
import logging
import os
import re
import threading
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from stat import S_ISREG
from typing import Any

from preprocessing.pipeline import Models
from preprocessing.spec import PythonSpec
from service.batching.scheduler import BatchBudget
from service.datatypes import json_kind
from service.errors import (
    InvalidInput,
    LoadStopped,
    ModelLoadError,
    ModelLoadRefused,
    ModelLoadStopped,
    ModelNotFound,
    ModelNotReady,
    StepNotReady,
    TensorgateError,
)
from service.model_config import ModelConfig, VersionPolicy, load_model_config
from service.pipelines.code import last_frame
from service.repository.loader import LoadBound, load_version
from service.repository.serving import ServedVersion
from service.resources import ARTIFACTS
from service.settings import Settings

log = logging.getLogger("tensorgate.repository")

NAME_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]{0,127}$")


class ModelState(enum.StrEnum):
    LOADING = "LOADING"
    READY = "READY"
    UNAVAILABLE = "UNAVAILABLE"
    UNLOADED = "UNLOADED"


@dataclass(eq=False)
class ModelVersion:
    """One version of one model and where it stands."""

    name: str
    version: int
    path: Path
    state: ModelState = ModelState.LOADING
    reason: str = ""
    served: ServedVersion | None = None
    waits_for_step: bool = False
    """Refused because its replay called a model not loaded yet: tried again after them."""
    stopped: bool = False
    """Its load was stopped by an unload of the model, or by SIGTERM (nothing wrong in it)."""
    files: tuple[object, ...] = ()
    """Its folder's files as its load began (:func:`fingerprint`): a reload keeps it serving
    while they and its model's other files are unchanged."""


@dataclass(eq=False)
class ModelEntry:
    """A model folder: its config (or why it has none) and its versions."""

    name: str
    path: Path
    config: ModelConfig | None = None
    error: str = ""
    versions: dict[int, ModelVersion] = field(default_factory=dict)
    unloaded: bool = False
    """Unloaded on request: not served, and not counted against readiness."""
    held_unloaded: bool = False
    """Unloaded through the repository API: ``--poll`` does not load it again when its folder
    changes (it undid the operator's unload); a load through the API does."""
    last_load_error: str = ""
    """Why the last reload of this model was refused, while these versions serve on."""
    refused: bool = False
    """Its load, asked for while the server ran (nothing of it serving), failed: shown
    UNAVAILABLE with why (metadata, the index, inference's 503), and not counted against
    readiness: a failed load leaves the server serving what it served."""
    shown_loading: bool = False
    """Stands for a load asked for while the server ran, nothing of the model serving: its
    versions say LOADING until the load ends (it said UNLOADED, or 404 for a new folder), and
    it is not counted against readiness, as a refused one."""
    files: tuple[object, ...] = ()
    """The files of its folder outside its version folders (config.yaml, its code) as it was
    scanned: while they are unchanged, a reload keeps its unchanged versions serving."""

    def why_not(self, ready_too: bool = True) -> str:
        """Why it has nothing to serve: its error, or each version's reason (``ready_too``
        False: only those not READY)."""
        if self.error or not self.versions:
            return self.error or "no versions"
        return "; ".join(
            f"version {number}: {version.reason or version.state.value}"
            for number, version in sorted(self.versions.items())
            if ready_too or version.state is not ModelState.READY
        )


def check_load_parameters(names: Iterable[str]) -> None:
    """A load request's parameters: none is taken. Triton's ``config`` (a config to load
    instead of the folder's) and ``file:`` contents (a model sent in the request) have no
    meaning here: a model is its folder in the repository, its gates checked there; 400 rather
    than a load that silently ignored what was asked."""
    given = sorted(names)
    if given:
        raise InvalidInput(
            f"the load request's parameters {given} are not taken: a model loads from its "
            "folder in the repository (edit its config.yaml, or export a new version, then "
            "load it)"
        )


def check_unload_parameters(parameters: Mapping[str, object]) -> None:
    """An unload request's parameters: only tritonclient's ``unload_dependents`` (true or
    false), which changes nothing here: a pipeline whose step is unloaded stays loaded and
    says it cannot serve (:meth:`ModelRepository.state`) until the step is loaded again."""
    others = sorted(set(parameters) - {"unload_dependents"})
    if others:
        raise InvalidInput(
            "the unload request takes only the parameter 'unload_dependents' (true or false); "
            f"got {others}"
        )
    dependents = parameters.get("unload_dependents", False)
    if not isinstance(dependents, bool):
        raise InvalidInput(
            "the unload request's parameter 'unload_dependents' is true or false, not "
            f"{json_kind(dependents)}"
        )


class ModelRepository:
    """Discovers and loads the models of one repository folder."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.root = settings.model_repository
        self.models: dict[str, ModelEntry] = {}
        self.loading_done = threading.Event()
        self.stopping = threading.Event()
        """Set when the server stops: a load under way ends at its next warmup batch."""
        self._changes: dict[str, threading.Lock] = {}
        """One load or unload of a model at a time; other models' go on beside it."""
        self._loads: dict[str, set[LoadBound]] = {}
        """Each model's loads under way: an unload, or the server stopping, ends them."""
        self._guard = threading.Lock()  # guards the two dicts above, and _changed
        self._changed = 0
        """Loads begun or ended and unloads done so far (:meth:`model_changes`)."""
        self._fingerprints: dict[str, tuple[object, ...]] = {}
        self.steps: Models | None = None
        self.replaying: collections.Counter[str] = collections.Counter()
        """Pipelines that call a model being loaded (directly or through others), by the loads
        under way: they serve on until the replay of their answers through what it loaded
        passes or fails (the core's ``load_model``)."""
        self.budget: BatchBudget | None = None
        """The server's budget, where batches hold what they concatenate (set by the app)."""
        """The server's models, for pipeline code that calls them (set by the app)."""

    # -- discovery and loading --------------------------------------------------------------

    def scan(self) -> None:
        """Find models and the versions to serve; every version starts LOADING."""
        if not self.root.is_dir():
            raise ModelLoadError(f"model repository {self.root} is not a directory")
        for name, folder in self.on_disk(chosen_only=True).items():
            self.models[name] = self._scan_model(name, folder)
            self._fingerprints[name] = fingerprint(folder)
        if self.settings.model_name is None:
            for folder, why in configless_folders(self.root):
                log.warning(
                    "%s %s, so it is not served: a model's folder needs config.yaml naming its "
                    "backend (e.g. backend: onnx) and a version folder (1/) holding the model",
                    folder,
                    why,
                )
        if self.settings.models and (missing := set(self.settings.models) - set(self.models)):
            raise ModelLoadError(f"models {sorted(missing)} are not in {self.root}")
        if not self.models:  # the CLI refuses this unless models may come later
            log.warning(
                "%s holds no model folder yet: nothing is served until one is loaded through "
                "the repository API or appears (--poll)",
                self.root,
            )

    def on_disk(self, chosen_only: bool = False) -> dict[str, Path]:
        """Each model's name and folder as the repository holds them now; ``chosen_only``:
        only those ``settings.models`` names (all when unset)."""
        if self.settings.model_name is not None:
            return {
                self.settings.model_name: single_model_folder(self.root, self.settings.model_name)
            }
        found = {p.name: p for p in sorted(self.root.iterdir()) if (p / "config.yaml").is_file()}
        if chosen_only and self.settings.models:
            return {n: p for n, p in found.items() if n in self.settings.models}
        return found

    def _scan_model(self, name: str, folder: Path) -> ModelEntry:
        entry = _scan_model(name, folder)
        entry.error = self.relative(entry.error)
        return entry

    @staticmethod
    def _broken(version: ModelVersion, reason: str) -> None:
        """A served version that no longer answers its golden inputs takes no more requests."""
        version.state, version.reason = ModelState.UNAVAILABLE, reason
        log.error("model %s version %d is unavailable: %s", version.name, version.version, reason)

    def load_all(self) -> None:
        """Load every discovered version, one after another (called off the event loop)."""
        # Models with their own code last, and again while that loads more of them: their
        # end-to-end replay may call other models (steps), which must be loaded first.
        order = sorted(self.models.values(), key=lambda e: _has_code(e.config))
        try:
            for entry in order:
                self._load_entry(entry)
            waiting = [v for e in order for v in e.versions.values() if v.waits_for_step]
            while waiting:
                for version in waiting:
                    entry = self.models[version.name]
                    assert entry.config is not None
                    self._load_version(entry.config, version)
                still = [v for v in waiting if v.waits_for_step]
                if len(still) == len(waiting):
                    break
                waiting = still
        finally:
            self.loading_done.set()

    def _load_entry(self, entry: ModelEntry) -> None:
        for version in entry.versions.values():
            assert entry.config is not None
            if version.served is None:  # else kept from the entry it replaces
                self._load_version(entry.config, version)

    def _load_version(self, config: ModelConfig, version: ModelVersion) -> None:
        if self.stopping.is_set():
            version.state, version.reason = ModelState.UNAVAILABLE, "the server is shutting down"
            return
        bound = LoadBound(self.stopping, self.settings.load_timeout_s)
        # first: a change meanwhile loads it again
        version.files = fingerprint(version.path, skip=_written_by_server(config))
        with self._guard:
            self._loads.setdefault(version.name, set()).add(bound)
            self._changed += 1
        try:
            loaded = load_version(
                version.name, version.path, config, self.settings, self.steps, bound
            )
        except ModelLoadError as exc:
            version.state, version.reason = ModelState.UNAVAILABLE, self.relative(str(exc))
            version.waits_for_step = isinstance(exc, StepNotReady)
            version.stopped = isinstance(exc, LoadStopped)
            # a reload's version may fail while the one serving goes on (load_model says so)
            log.error("model %s version %d did not load: %s", version.name, version.version, exc)
            return
        except (Exception, SystemExit, KeyboardInterrupt) as exc:  # the last two: a model's code
            version.state = ModelState.UNAVAILABLE
            said = " ".join(str(exc).split())
            version.reason = self.relative(
                f"unexpected error while loading: {type(exc).__name__}: {said}{last_frame(exc)}"
            )
            log.exception("model %s version %d failed to load", version.name, version.version)
            return
        finally:
            with self._guard:
                self._loads[version.name].discard(bound)
                self._changed += 1
        version.waits_for_step = False
        version.served = ServedVersion(
            loaded,
            partial(self._broken, version),
            self.budget,
            self.settings.inline_batch_us,
        )
        version.state = ModelState.READY
        log.info("model %s version %d is ready", version.name, version.version)

    def load_model(self, name: str, polled: bool = False) -> ModelEntry:
        """(Re)load one model from its folder; swap its versions in once they are ready.

        Blocking: call it off the event loop. Raises ModelLoadRefused when any version the
        folder asks for could not be loaded: none is swapped in, and the versions already
        serving go on (a load that left one of them UNAVAILABLE made the server unready, for
        an operator's request).
        """
        folder = self._folder(name)
        with self._change(name):
            old = self.models.get(name)
            if polled and old is not None and old.held_unloaded:  # unloaded meanwhile
                return old
            # Recorded first: a model that fails is retried by --poll only when it changes.
            self._fingerprints[name] = fingerprint(folder)
            fresh = self._scan_model(name, folder)
            # nothing of it serves (a model that failed at startup keeps its own state)
            unserved = old is None or old.unloaded or old.refused or old.shown_loading
            kept = [] if old is None or unserved else _keep_unchanged(old, fresh)
            if unserved and fresh.versions:
                # nothing of it serves: shown LOADING meanwhile (fresh's own versions are
                # not: one READY would take requests before the load is known to succeed)
                self.models[name] = _shown_loading(fresh)
            try:
                self._load_entry(fresh)
            except BaseException:  # e.g. a model's own code: never leave the stand-in
                _retire(fresh, kept)  # the versions it loaded before
                if old is None:
                    self.models.pop(name, None)
                else:
                    self.models[name] = old
                raise
            versions = fresh.versions.values()
            if (
                fresh.error
                or not versions
                or any(v.state is not ModelState.READY for v in versions)
            ):
                reasons = fresh.why_not()
                _retire(fresh, kept)
                if old is None or unserved:
                    fresh.refused = True
                    self.models[name] = fresh  # its metadata says why, as at startup
                else:
                    old.last_load_error = reasons
                    serving = [v for v in old.versions.values() if v.served]
                    on = " (nothing of it serves)"
                    if serving:
                        on = f", {_versions(serving)} serving on"
                    log.error("model %s: reload refused%s: %s", name, on, reasons)
                if any(v.stopped for v in versions):
                    raise ModelLoadStopped(f"the load of '{name}' did not finish: {reasons}")
                raise ModelLoadRefused(f"failed to load '{name}': {reasons}")
            self.models[name] = fresh  # one assignment: requests see the old or the new entry
            unchanged = f" ({_versions(kept)} unchanged, serving on)" if kept else ""
            log.info("model %s loaded: versions %s%s", name, sorted(fresh.versions), unchanged)
        if old is not None:
            _retire(old, kept)
        return fresh

    def stop_loading(self, name: str) -> bool:
        """Stop a load of ``name`` under way (at its next warmup batch): whether one was."""
        with self._guard:
            loading = list(self._loads.get(name, ()))
        for bound in loading:
            bound.cancel(f"model '{name}' was unloaded meanwhile")
        return bool(loading)

    def unload_model(self, name: str, requested: bool = True) -> None:
        """Stop serving a model; in-flight requests finish first. Blocking. ``requested``:
        through the repository API, so that ``--poll`` leaves it unloaded and it is listed
        UNLOADED; else its folder went: it is forgotten (a folder of its name that comes back
        is loaded)."""
        if not self.stop_loading(name):
            self.entry(name)  # 404 before waiting on anything
        with self._change(name):
            entry = self.models.get(name)
            if entry is None:  # its first load, stopped: nothing served to retire
                log.info("model %s: its load was stopped by an unload", name)
                return
            if requested:
                self.models[name] = ModelEntry(
                    name, entry.path, entry.config, unloaded=True, held_unloaded=True
                )
            else:  # its folder is gone: no more in the repository, its index or its metrics
                del self.models[name]
            # a folder of its name that comes back is new, also with the same files' times
            self._fingerprints.pop(name, None)
        _retire(entry)
        with self._guard:
            self._changed += 1
        log.info("model %s unloaded", name)

    def _change(self, name: str) -> threading.Lock:
        with self._guard:
            return self._changes.setdefault(name, threading.Lock())

    def changes(self) -> tuple[list[str], list[str]]:
        """Models whose folder changed since they were loaded, and models whose folder is gone
        (for ``--poll``). A model that failed to load is retried only when its folder changes;
        one unloaded through the API stays unloaded until it is loaded through it."""
        every = self.on_disk()
        chosen = self.on_disk(chosen_only=True)
        models = list(self.models.items())  # a snapshot: loads change the dict meanwhile
        loaded = {n for n, e in models if not e.unloaded}  # also through the API
        held = {n for n, e in models if e.held_unloaded}
        changed = [
            name
            for name, folder in every.items()
            if (name in chosen or name in loaded)
            and name not in held
            and NAME_PATTERN.match(name)
            and self._fingerprints.get(name) != fingerprint(folder)
        ]
        gone = [n for n in loaded | held if n not in every]  # not: left out of TG_MODELS
        return changed, gone

    def _folder(self, name: str) -> Path:
        if not NAME_PATTERN.match(name):  # no such folder could be: the client's mistake
            said = repr(name) if len(name) <= 64 else f"{name[:64]!r}… ({len(name)} characters)"
            raise InvalidInput(f"model name {said} is not valid (letters, digits, _ . -)")
        folder = self.on_disk().get(name)
        if folder is None:
            raise ModelNotFound(f"no model '{name}' in the repository (no {name}/config.yaml)")
        return folder

    # -- lookup ---------------------------------------------------------------------------

    def entry(self, name: str) -> ModelEntry:
        """The model called ``name``, or 404."""
        entry = self.models.get(name) if NAME_PATTERN.match(name) else None
        if entry is None:
            # The models are not listed: this answer goes to any caller, authenticated or not.
            raise ModelNotFound(f"unknown model '{name}'")
        return entry

    def version(self, name: str, version: str | None = None) -> ModelVersion:
        """A version of a model (the newest READY one by default), or 404/503."""
        entry = self.entry(name)
        if entry.unloaded:
            raise ModelNotReady(
                f"model '{name}' is unloaded; load it again to serve it", retry_after_s=30
            )
        if version is None:
            ready = [v for v in entry.versions.values() if v.state is ModelState.READY]
            if ready:
                return max(ready, key=lambda v: v.version)
            if not entry.versions:
                raise ModelNotReady(
                    f"model '{name}' is unavailable: {entry.error}", retry_after_s=30
                )
            return max(entry.versions.values(), key=lambda v: v.version)
        if not _is_number(version) or int(version) not in entry.versions:
            raise ModelNotFound(
                f"model '{name}' has no version '{version}'; it serves {sorted(entry.versions)}"
            )
        return entry.versions[int(version)]

    def ready_model(
        self, name: str, version: str | None = None, whole: bool = True
    ) -> tuple[ModelVersion, ServedVersion]:
        """A version that can take requests now, or 404/503 naming why not. ``whole`` False:
        for its model alone (a pipeline step, ``:preprocess``), whatever its own code's steps."""
        found = self.version(name, version)
        if found.state is not ModelState.READY or found.served is None:
            detail = f": {found.reason}" if found.reason else ""
            raise ModelNotReady(
                f"model '{name}' version {found.version} is {found.state.value}{detail}",
                retry_after_s=1 if found.state is ModelState.LOADING else 30,
                version=found.version,
            )
        if whole and found.served.loaded.steps and (missing := self.missing_step(found)):
            raise ModelNotReady(
                f"model '{name}' version {found.version} cannot serve: {missing}",
                retry_after_s=30,
                version=found.version,
            )
        return found, found.served

    def missing_step(self, version: ModelVersion, ignore: frozenset[str] = frozenset()) -> str:
        """Why a READY version cannot serve for want of a model its code calls (one its
        load's replay called: unloaded, not ready, gone, or loaded again since that replay
        and not being replayed through now (:attr:`replaying`): its answers through the step
        as it is now are unproven), or ""."""
        steps = version.served.loaded.steps if version.served is not None else ()
        for step in steps:
            if step.model in ignore:
                continue
            try:
                found = self.version(step.model, step.asked)
            except TensorgateError as exc:
                return f"its pipeline step '{step.model}': {exc.message}"
            if found.state is not ModelState.READY or found.served is None:
                detail = f": {found.reason}" if found.reason else ""
                return (
                    f"its pipeline step '{step.model}' version {found.version} is "
                    f"{found.state.value}{detail}"
                )
            if (
                step.serial is not None
                and found.served.loaded.serial != step.serial
                and self.replaying[version.name] <= 0
            ):
                entry = self.models.get(version.name)
                refused = entry.last_load_error if entry is not None else ""
                return (
                    f"its pipeline step '{step.model}' version {found.version} was loaded after "
                    "this version's end-to-end replay ran through the one before; "
                    + (
                        f"replaying its answers through it failed: {refused}"
                        if refused
                        else f"reload '{version.name}' to replay its answers through it (a load "
                        "of the step through the server does)"
                    )
                )
        return ""

    def dependents(self, name: str) -> list[str]:
        """The models with a version whose code called ``name`` in its load's replay."""
        return sorted(
            {
                v.name
                for v, served in self.served_versions()
                if v.name != name and any(s.model == name for s in served.loaded.steps)
            }
        )

    def depending_on(self, name: str) -> set[str]:
        """The models whose code calls ``name``, directly or through others' code."""
        found: set[str] = set()
        todo = [name]
        while todo:
            for caller in self.dependents(todo.pop()):
                if caller not in found and caller != name:
                    found.add(caller)
                    todo.append(caller)
        return found

    def steps_of(self, name: str) -> set[str]:
        """The models the serving versions of ``name`` called in their loads' replays."""
        return {
            step.model
            for v, served in self.served_versions()
            if v.name == name
            for step in served.loaded.steps
        }

    def stale(self) -> list[str]:
        """The models with a serving version whose load's replay ran through a step that has
        been loaded again since (it serves, another load of it): their answers through it are
        unproven until a reload replays them."""
        found: set[str] = set()
        for version, served in self.served_versions():
            for step in served.loaded.steps:
                try:
                    now = self.version(step.model, step.asked)
                except TensorgateError:  # gone: missing_step says so; nothing to replay through
                    continue
                if (
                    step.serial is not None
                    and now.served is not None
                    and now.state is ModelState.READY
                    and now.served.loaded.serial != step.serial
                ):
                    found.add(version.name)
        return sorted(found)

    def state(self, version: ModelVersion) -> tuple[ModelState, str]:
        """A version's state and reason as callers see them: a READY version whose step
        cannot serve is UNAVAILABLE, saying which, until the step serves again."""
        if version.state is ModelState.READY and (missing := self.missing_step(version)):
            return ModelState.UNAVAILABLE, f"cannot serve: {missing}"
        return version.state, version.reason

    def served_versions(self) -> list[tuple[ModelVersion, ServedVersion]]:
        """Every READY version with what serves it."""
        return [
            (v, v.served)
            for entry in list(self.models.values())
            for v in entry.versions.values()
            if v.served is not None and v.state is ModelState.READY
        ]

    # -- state ----------------------------------------------------------------------------

    def model_changes(self) -> tuple[int, bool]:
        """How many loads have begun or ended and unloads been done, and whether a load is under
        way: what the process holds changes with them (:mod:`service.grpc.arriving`)."""
        with self._guard:
            return self._changed, any(self._loads.values())

    def all_ready(self) -> bool:
        """Whether every model meant to load is READY."""
        return self.loading_done.is_set() and not self.problems()

    def any_ready(self) -> bool:
        return bool(self.served_versions())

    def refuse_unserved(self, name: str) -> bool:
        """Mark ``name`` refused (not counted against readiness, as a load asked for while the
        server ran and refused) when nothing of it serves here; whether it was."""
        entry = self.models.get(name)
        if entry is None or entry.unloaded or entry.refused:
            return False
        if any(v.state is ModelState.READY for v in entry.versions.values()):
            return False
        entry.refused = True
        return True

    def problems(self) -> dict[str, str]:
        """Each model meant to load that is not READY, with why: also a READY pipeline that
        cannot serve for a step its code calls (:meth:`missing_step`), unless that step was
        unloaded on request (asked for, not a fault)."""
        found: dict[str, str] = {}
        for name, entry in list(self.models.items()):
            if entry.unloaded or entry.refused or entry.shown_loading:
                continue
            if (
                entry.error
                or not entry.versions
                or any(v.state is not ModelState.READY for v in entry.versions.values())
            ):
                found[name] = entry.why_not(ready_too=False)
                continue
            for version in list(entry.versions.values()):
                if (why := self._step_problem(version)) is not None:
                    found[name] = f"version {version.version} cannot serve: {why}"
                    break
        return found

    def _step_problem(self, version: ModelVersion) -> str | None:
        """Why ``version`` cannot serve for want of a step, its steps unloaded on request aside
        (each on its own: another step's fault still counts); None when it can."""
        steps = version.served.loaded.steps if version.served is not None else ()
        if not steps:
            return None
        unloaded = frozenset(
            step.model
            for step in steps
            if (entry := self.models.get(step.model)) is not None and entry.unloaded
        )
        return self.missing_step(version, unloaded) or None

    def relative(self, text: str) -> str:
        """``text`` with the repository's own path left out: what a caller reads (the
        readiness probe's answer goes to anyone) names a model's files from its folder."""
        return text.replace(f"{self.root.resolve()}/", "").replace(f"{self.root}/", "")

    def index(self) -> list[dict[str, Any]]:
        """One row per model version (or per model without versions), as the OIP index shows."""
        rows: list[dict[str, Any]] = []
        for name, entry in sorted(self.models.items()):  # sorted: a list made at once
            if entry.unloaded:
                rows.append(
                    {"name": name, "state": ModelState.UNLOADED.value, "reason": "unloaded"}
                )
            elif not entry.versions:
                rows.append(
                    {"name": name, "state": ModelState.UNAVAILABLE.value, "reason": entry.error}
                )
            for number, version in sorted(entry.versions.items()):
                state, reason = self.state(version)
                rows.append(
                    {"name": name, "version": str(number), "state": state.value, "reason": reason}
                )
        chosen = self.settings.models
        for name in sorted(set(self.on_disk()) - set(self.models)):
            # as Triton's index: every model of the repository, also one never loaded
            if chosen and name not in chosen:
                reason = "not loaded: TG_MODELS does not name it (load it)"
            else:
                reason = "not loaded: its folder appeared after the server started (load it)"
            rows.append({"name": name, "state": ModelState.UNLOADED.value, "reason": reason})
        return rows

    def close(self) -> None:
        for entry in list(self.models.values()):
            _retire(entry)


def _scan_model(name: str, folder: Path) -> ModelEntry:
    entry = ModelEntry(name, folder, files=fingerprint(folder, versions=False))
    if not NAME_PATTERN.match(name):
        entry.error = f"model name {name!r} must match {NAME_PATTERN.pattern}"
        return entry
    try:
        entry.config = load_model_config(folder / "config.yaml")
    except ModelLoadError as exc:
        entry.error = str(exc)
        log.error("model %s cannot be loaded: %s", name, exc)
        return entry
    found = sorted(int(p.name) for p in folder.iterdir() if p.is_dir() and _is_number(p.name))
    chosen = select_versions(found, entry.config.version_policy)
    if not chosen:
        entry.error = (
            f"no version folder to serve in {folder} (found {found}, policy "
            f"{entry.config.version_policy.model_dump(exclude_defaults=True)}); "
            "run `make models` or export one"
        )
        log.error("model %s cannot be loaded: %s", name, entry.error)
    for number in chosen:
        entry.versions[number] = ModelVersion(name, number, folder / str(number))
    return entry


def _is_number(text: str) -> bool:
    """A version number: ASCII digits only (``str.isdigit`` also takes ``²`` and ``①``, which
    ``int`` refuses)."""
    return text.isascii() and text.isdigit() and len(text) <= 18


HASHED_BELOW = 1 << 16
"""Files smaller than this (a config, code, a manifest) are fingerprinted by their bytes too:
an edit of the same length within the file system's time tick leaves the times alike."""
RACY_NS = 2_000_000_000
"""A file changed this recently may change again within its time tick: its bytes are hashed
again at each fingerprint, not taken from :data:`_DIGESTS` (git's "racily clean" rule)."""
NOT_THE_MODEL = frozenset({"__pycache__", "tensorrt_cache"})
"""Folders the server (or Python) writes into a model's folder: bytecode of its code, ONNX
Runtime's TensorRT engines (``gpu.tensorrt_cache``'s default). Not part of what a load read."""
_DIGESTS: dict[tuple[str, int, int, int], bytes] = {}
"""Each small file's hash by path, size and times: a poll hashes only what changed."""


def fingerprint(
    folder: Path, versions: bool = True, skip: frozenset[str] = NOT_THE_MODEL
) -> tuple[object, ...]:
    """What changes when a model's config or any file of its versions does (linked folders
    followed; folders named in ``skip`` left out); ``versions`` False: only the files outside
    its version folders.

    Each regular file's size, modification and change time (ctime, which moves with every
    write, copy or rename, also one that keeps the modification time: ``cp -p``, ``rsync
    -a``), and the bytes of small ones; a file that goes meanwhile is left out. Not inodes:
    some FUSE file systems give a file a new one when their cache expires."""
    entries: list[tuple[str, int, int, int, bytes]] = []
    seen: set[tuple[int, int]] = set()
    for top, folders, files in os.walk(folder, followlinks=True):
        here = Path(top)
        try:
            where = os.stat(top)
        except OSError:
            continue
        if (where.st_dev, where.st_ino) in seen:  # a link back up: walked already
            folders.clear()
            continue
        seen.add((where.st_dev, where.st_ino))
        folders[:] = [
            f
            for f in folders
            if f not in skip and (versions or here != folder or not _is_number(f))
        ]
        for name in files:
            path = here / name
            try:
                stat = path.stat()
                if not S_ISREG(stat.st_mode):  # a named pipe would block the read for good
                    continue
                digest = _digest(path, stat) if stat.st_size < HASHED_BELOW else b""
            except OSError:  # gone meanwhile, or unreadable: the load says why, if it matters
                continue
            relative = str(path.relative_to(folder))
            entries.append((relative, stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns, digest))
    return tuple(sorted(entries))


def _written_by_server(config: ModelConfig) -> frozenset[str]:
    """:data:`NOT_THE_MODEL`, and the folder the model's own ``gpu.tensorrt_cache`` names."""
    return NOT_THE_MODEL | set(Path(config.gpu.tensorrt_cache).parts[:1])


def _digest(path: Path, stat: os.stat_result) -> bytes:
    key = (str(path), stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns)
    racy = time.time_ns() - max(stat.st_mtime_ns, stat.st_ctime_ns) < RACY_NS
    if not racy and (known := _DIGESTS.get(key)) is not None:
        return known
    with path.open("rb") as file:
        digest = hashlib.blake2b(file.read(HASHED_BELOW)).digest()
    if not racy:
        if len(_DIGESTS) > 1 << 16:  # bounded: a repository of that many small files rehashes
            _DIGESTS.clear()
        _DIGESTS[key] = digest
    return digest


def _keep_unchanged(old: ModelEntry, fresh: ModelEntry) -> list[ModelVersion]:
    """Put in ``fresh`` the versions of ``old`` that serve and whose files, and the model's
    others (its config, its code), are as they were loaded: a reload serves them on without
    loading and warming them again. The versions kept."""
    if fresh.error or old.files != fresh.files:
        return []
    kept = [
        version
        for number, version in old.versions.items()
        if number in fresh.versions
        and version.state is ModelState.READY
        and version.served is not None
        and not version.served.closing
        # a pipeline that calls other models replays its answers through them again: they
        # may have changed since
        and not version.served.loaded.steps
        and version.path == fresh.versions[number].path
        and old.config is not None
        and version.files == fingerprint(version.path, skip=_written_by_server(old.config))
    ]
    for version in kept:
        fresh.versions[version.version] = version
    return kept


def _versions(versions: list[ModelVersion]) -> str:
    """``version 1`` or ``versions 1, 2``."""
    numbers = ", ".join(str(v.version) for v in versions)
    return ("version " if len(versions) == 1 else "versions ") + numbers


def single_model_folder(root: Path, model_name: str, setting: str = "TG_MODEL_NAME") -> Path:
    """``model_name``'s folder: the repository itself, or the one model folder in it;
    ModelLoadError naming ``setting`` and what the repository holds otherwise."""
    if (root / "config.yaml").is_file():
        return root
    folders = sorted(p for p in root.iterdir() if (p / "config.yaml").is_file())
    if len(folders) != 1:
        raise ModelLoadError(
            f"{setting}: {model_name!r} is set, so {root} must be one model's folder "
            "(config.yaml at its root) or hold exactly one model folder; it holds "
            f"{[p.name for p in folders]}"
        )
    return folders[0]


def _shown_loading(entry: ModelEntry) -> ModelEntry:
    """What stands for ``entry`` while it loads: its versions, LOADING, serving nothing."""
    versions = {n: ModelVersion(v.name, n, v.path) for n, v in entry.versions.items()}
    return ModelEntry(entry.name, entry.path, entry.config, versions=versions, shown_loading=True)


def _retire(entry: ModelEntry, kept: list[ModelVersion] | None = None) -> None:
    """Close an entry's loaded versions after their in-flight requests finish (but those
    ``kept``: they serve on in the entry that replaces it)."""
    for version in entry.versions.values():
        if version.served is not None and version not in (kept or ()):
            version.served.close()


def select_versions(found: list[int], policy: VersionPolicy) -> list[int]:
    """The version numbers a policy serves out of those found (ascending)."""
    if policy.all:
        return found
    if policy.specific is not None:
        return [v for v in found if v in policy.specific]
    return found[-(policy.latest or 1) :]


def _has_code(config: ModelConfig | None) -> bool:
    return config is not None and isinstance(config.preprocessing, PythonSpec)


def configless_folders(root: Path) -> list[tuple[Path, str]]:
    """Folders of ``root`` that look like a model (a version folder, or a model file where a
    version folder should be) but have no config.yaml, so the repository skips them; each
    with what it lacks."""
    found = []
    for folder in sorted(root.iterdir()):
        try:
            if not folder.is_dir() or (folder / "config.yaml").is_file():
                continue
            children = list(folder.iterdir())
        except OSError:  # unreadable, or gone meanwhile: not worth failing the scan for
            continue
        if any(_is_number(c.name) and c.is_dir() for c in children):
            found.append((folder, "has version folders but no config.yaml"))
        elif loose := sorted(c.name for c in children if c.name in ARTIFACTS):
            found.append(
                (
                    folder,
                    f"holds {loose[0]} outside a version folder and has no config.yaml (move it "
                    f"to {folder.name}/1/{loose[0]})",
                )
            )
    return found
