"""Fixtures shared by every test: the bundled models, real servers, real photos.

Each test is marked by its folder (``unit``, ``integration``, ``e2e``, ``chaos``, ``fuzz``)
unless it says otherwise: ``pytest -m unit`` runs on a fresh clone after ``make venv``, without
built models; every other kind needs ``make models`` first, and says so at once."""

from __future__ import annotations

import asyncio
import inspect
import io
import shutil
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import skimage.data
from PIL import Image

from tests.server import MODELS, Server

BUNDLED = ("efficientnet_lite0", "digits", "minilm")


KINDS = ("unit", "integration", "e2e", "chaos", "fuzz")
TESTS = Path(__file__).resolve().parent


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if not any(item.get_closest_marker(kind) for kind in KINDS):
            folder = item.path.relative_to(TESTS).parts[0]
            if folder in KINDS:
                item.add_marker(folder)


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem: pytest.Function) -> bool | None:
    """An ``async def`` test runs to its end on a fresh event loop of its own."""
    if not inspect.iscoroutinefunction(pyfuncitem.obj):
        return None
    arguments = {name: pyfuncitem.funcargs[name] for name in pyfuncitem._fixtureinfo.argnames}
    asyncio.run(pyfuncitem.obj(**arguments))
    return True


def pytest_runtest_setup(item: pytest.Item) -> None:
    if item.get_closest_marker("unit") is not None:
        return
    missing = [m for m in BUNDLED if not (MODELS / m / "1" / "manifest.json").exists()]
    if missing:
        pytest.exit(f"bundled models {missing} are not built: run `make models` first (only "
                    "`pytest -m unit` runs without them)", returncode=2)  # fmt: skip


@pytest.fixture(scope="session")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """One server on the bundled model repository, shared by the tests that only read."""
    log = tmp_path_factory.mktemp("server") / "server.log"
    running = Server(MODELS, log_path=log)
    try:
        running.wait_until()
        yield running
    finally:
        running.stop()


@pytest.fixture
def repository(tmp_path: Path) -> Path:
    """A fresh model repository holding copies of the bundled digits model (small, fast)."""
    root = tmp_path / "models"
    shutil.copytree(MODELS / "digits", root / "digits", ignore=shutil.ignore_patterns("build.py"))
    return root


def encode(array: np.ndarray, fmt: str, **options: object) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(array).save(buffer, format=fmt, **options)
    return buffer.getvalue()


@pytest.fixture(scope="session")
def chelsea_jpeg() -> bytes:
    return encode(skimage.data.chelsea(), "JPEG", quality=95)


@pytest.fixture(scope="session")
def coffee_jpeg() -> bytes:
    return encode(skimage.data.coffee(), "JPEG", quality=95)
