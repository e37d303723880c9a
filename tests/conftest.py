"""Fixtures shared by every test: the bundled models, real servers, real photos.

Each test is marked by its folder (``unit``, ``integration``, ``e2e``, ``chaos``, ``fuzz``)
unless it says otherwise: ``pytest -m unit`` runs on a fresh clone after ``make venv``, without
built models; every other kind needs ``make models`` first, and says so at once."""

from __future__ import annotations

import asyncio
import inspect
import io
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import pytest
import skimage.data
from PIL import Image

from tests.server import MODELS, Server, copy_model

if TYPE_CHECKING:
    from service.model_config import TensorConfig

BUNDLED = ("efficientnet_lite0", "digits", "minilm", "wine", "faces")


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
    wanted = inspect.signature(pyfuncitem.obj).parameters
    arguments = {name: value for name, value in pyfuncitem.funcargs.items() if name in wanted}
    asyncio.run(pyfuncitem.obj(**arguments))
    return True


def pytest_runtest_setup(item: pytest.Item) -> None:
    if item.get_closest_marker("unit") is not None:
        return
    missing = [m for m in BUNDLED if not (MODELS / m / "1" / "manifest.json").exists()]
    if missing:
        pytest.exit(
            f"bundled models {missing} are not built: run `make models` first (only "
            "`pytest -m unit` runs without them)",
            returncode=2,
        )


@pytest.fixture(scope="session", autouse=True)
def lock_checks_started(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[None]:
    """tests/e2e/test_locks.py's dry runs, started with the session when any of its tests is
    selected: they wait on PyPI for one to two minutes, and so wait beside the tests before
    them instead of in the suite's time (pip takes about half a CPU meanwhile)."""
    if not any(item.path.name == "test_locks.py" for item in request.session.items):
        yield
        return
    from tests.e2e import test_locks

    test_locks.STARTED.update(test_locks.start_dry_runs(tmp_path_factory.mktemp("locks")))
    try:
        yield
    finally:
        test_locks.stop_dry_runs(test_locks.STARTED)


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
    copy_model("digits", root / "digits")
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


@dataclass(frozen=True)
class Exported:
    """A test model exported once per session in every format (pt2 compiles take seconds)."""

    version: Path
    """The version folder: model.onnx, model.pt2, model.pt, manifest.json, golden.npz."""
    inputs: tuple[TensorConfig, ...]
    outputs: tuple[TensorConfig, ...]
    max_batch_size: int
    buckets: tuple[int, ...] = ()


@pytest.fixture(scope="session")
def exported(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Exported]:
    """tests.models' Mlp, TinyText (dynamic batch and length) and TrainModeNet (handed over in
    training mode) exported as onnx, pt2 and torchscript by ``export_model``, as ``tensorgate
    export`` does."""
    from service.export.exporter import FORMATS, export_model
    from service.model_config import TensorConfig
    from tests.models import Mlp, TinyText, TrainModeNet

    root = tmp_path_factory.mktemp("exported")
    rng = np.random.default_rng(0)
    ids = {"input_ids": rng.integers(1, 100, (3, 8)), "attention_mask": np.ones((3, 8), np.int64)}
    ids["attention_mask"][1, 5:] = 0
    text_inputs = tuple(
        TensorConfig(name=n, datatype="INT64", shape=(-1,)) for n in ("input_ids", "attention_mask")
    )

    def floats(name: str, width: int) -> TensorConfig:
        return TensorConfig(name=name, datatype="FP32", shape=(width,))

    models = {
        "mlp": (
            Mlp().eval(),
            {"x": rng.standard_normal((3, 64)).astype(np.float32)},
            Exported(root / "mlp", (floats("x", 64),), (floats("y", 10),), max_batch_size=8),
        ),
        "tiny_text": (
            TinyText().eval(),
            ids,
            Exported(
                root / "tiny_text",
                text_inputs,
                (floats("embedding", 8),),
                max_batch_size=4,
                buckets=(4, 8, 16),
            ),
        ),
        # Handed over in training mode: every artifact must still answer as eval() does.
        "train_mode": (
            TrainModeNet().train(),
            {"x": rng.standard_normal((3, 8)).astype(np.float32)},
            Exported(root / "train_mode", (floats("x", 8),), (floats("y", 4),), max_batch_size=8),
        ),
    }
    for name, (module, golden, spec) in models.items():
        export_model(
            module,
            spec.version,
            name=name,
            inputs=spec.inputs,
            outputs=spec.outputs,
            golden_inputs=golden,
            max_batch_size=spec.max_batch_size,
            formats=FORMATS,
            required=FORMATS,
            buckets=spec.buckets,
        )
    return {name: spec for name, (_, _, spec) in models.items()}
