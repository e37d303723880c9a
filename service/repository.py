"""The model repository: discovers models and versions, loads them, tracks each one's state.

A folder is a model when it holds ``config.yaml``; its numeric subfolders are versions, served
per the config's ``version_policy``. A model or version that cannot be served is UNAVAILABLE
with the reason, in its metadata and logs; the others serve on.
"""

from __future__ import annotations

import enum
import logging
import re
import threading
from dataclasses import dataclass, field
from pathlib import Path

from service.errors import ModelLoadError, ModelNotFound, ModelNotReady
from service.loader import LoadedModel, load_version
from service.model_config import ModelConfig, VersionPolicy, load_model_config
from service.settings import Settings

log = logging.getLogger("tensorgate.repository")

NAME_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]{0,127}$")


class ModelState(enum.StrEnum):
    LOADING = "LOADING"
    READY = "READY"
    UNAVAILABLE = "UNAVAILABLE"


@dataclass(eq=False)
class ModelVersion:
    """One version of one model and where it stands."""

    name: str
    version: int
    path: Path
    state: ModelState = ModelState.LOADING
    reason: str = ""
    loaded: LoadedModel | None = None


@dataclass(eq=False)
class ModelEntry:
    """A model folder: its config (or why it has none) and its versions."""

    name: str
    path: Path
    config: ModelConfig | None = None
    error: str = ""
    versions: dict[int, ModelVersion] = field(default_factory=dict)


class ModelRepository:
    """Discovers and loads the models of one repository folder."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.root = settings.model_repository
        self.models: dict[str, ModelEntry] = {}
        self.loading_done = threading.Event()

    def scan(self) -> None:
        """Find models and the versions to serve; every version starts LOADING."""
        if not self.root.is_dir():
            raise ModelLoadError(f"model repository {self.root} is not a directory")
        wanted = set(self.settings.models) if self.settings.models else None
        for folder in sorted(p for p in self.root.iterdir() if (p / "config.yaml").is_file()):
            if wanted is not None and folder.name not in wanted:
                continue
            self.models[folder.name] = self._scan_model(folder)
        if wanted is not None and (missing := wanted - set(self.models)):
            raise ModelLoadError(f"models {sorted(missing)} are not in {self.root}")

    def _scan_model(self, folder: Path) -> ModelEntry:
        entry = ModelEntry(folder.name, folder)
        if not NAME_PATTERN.match(folder.name):
            entry.error = f"model name {folder.name!r} must match {NAME_PATTERN.pattern}"
            return entry
        try:
            entry.config = load_model_config(folder / "config.yaml")
        except ModelLoadError as exc:
            entry.error = str(exc)
            log.error("model %s is unavailable: %s", folder.name, exc)
            return entry
        found = sorted(int(p.name) for p in folder.iterdir() if p.is_dir() and p.name.isdigit())
        chosen = select_versions(found, entry.config.version_policy)
        if not chosen:
            entry.error = (
                f"no version folder to serve in {folder} (found {found}, policy "
                f"{entry.config.version_policy.model_dump(exclude_defaults=True)}); "
                "run `make models` or export one"
            )
            log.error("model %s is unavailable: %s", folder.name, entry.error)
        for number in chosen:
            entry.versions[number] = ModelVersion(folder.name, number, folder / str(number))
        return entry

    def load_all(self) -> None:
        """Load every discovered version, one after another (called off the event loop)."""
        try:
            for entry in self.models.values():
                for version in entry.versions.values():
                    assert entry.config is not None
                    self._load(entry.config, version)
        finally:
            self.loading_done.set()

    def _load(self, config: ModelConfig, version: ModelVersion) -> None:
        try:
            version.loaded = load_version(version.name, version.path, config, self.settings)
        except ModelLoadError as exc:
            version.state, version.reason = ModelState.UNAVAILABLE, str(exc)
            log.error("model %s version %d is unavailable: %s", version.name, version.version, exc)
            return
        except Exception as exc:
            version.state = ModelState.UNAVAILABLE
            version.reason = f"unexpected error while loading: {type(exc).__name__}: {exc}"
            log.exception("model %s version %d failed to load", version.name, version.version)
            return
        version.state = ModelState.READY
        log.info("model %s version %d is ready", version.name, version.version)

    def entry(self, name: str) -> ModelEntry:
        """The model called ``name``, or 404."""
        entry = self.models.get(name) if NAME_PATTERN.match(name) else None
        if entry is None:
            raise ModelNotFound(f"unknown model '{name}'; this server has {sorted(self.models)}")
        return entry

    def version(self, name: str, version: str | None = None) -> ModelVersion:
        """A version of a model (the newest READY one by default), or 404."""
        entry = self.entry(name)
        if version is None:
            ready = [v for v in entry.versions.values() if v.state is ModelState.READY]
            if ready:
                return max(ready, key=lambda v: v.version)
            if not entry.versions:
                raise ModelNotReady(
                    f"model '{name}' is unavailable: {entry.error}", retry_after_s=30
                )
            return max(entry.versions.values(), key=lambda v: v.version)
        if not version.isdigit() or int(version) not in entry.versions:
            raise ModelNotFound(
                f"model '{name}' has no version '{version}'; it serves {sorted(entry.versions)}"
            )
        return entry.versions[int(version)]

    def ready_model(
        self, name: str, version: str | None = None
    ) -> tuple[ModelVersion, LoadedModel]:
        """A version that can take requests now, or 404/503 naming why not."""
        found = self.version(name, version)
        if found.state is not ModelState.READY or found.loaded is None:
            detail = f": {found.reason}" if found.reason else ""
            raise ModelNotReady(
                f"model '{name}' version {found.version} is {found.state.value}{detail}",
                retry_after_s=1 if found.state is ModelState.LOADING else 30,
            )
        return found, found.loaded

    def all_ready(self) -> bool:
        """Whether every model meant to load is READY."""
        return self.loading_done.is_set() and all(
            not entry.error
            and entry.versions
            and all(v.state is ModelState.READY for v in entry.versions.values())
            for entry in self.models.values()
        )

    def any_ready(self) -> bool:
        return any(
            v.state is ModelState.READY for e in self.models.values() for v in e.versions.values()
        )

    def close(self) -> None:
        for entry in self.models.values():
            for version in entry.versions.values():
                if version.loaded is not None:
                    version.loaded.close()


def select_versions(found: list[int], policy: VersionPolicy) -> list[int]:
    """The version numbers a policy serves out of those found (ascending)."""
    if policy.all:
        return found
    if policy.specific is not None:
        return [v for v in found if v in policy.specific]
    return found[-(policy.latest or 1) :]
