"""config.yaml's input ranges against those the export recorded (the integration side, with a
served model, is in tests/integration/test_own_models.py)."""

from __future__ import annotations

import pytest

from service.errors import ModelLoadError
from service.model_config import TensorConfig
from service.repository.loader import _within_exported_ranges


def ids(bounds: tuple[float, float] | None, name: str = "item_id") -> TensorConfig:
    return TensorConfig(name=name, datatype="INT64", shape=(1,), range=bounds)


EXPORTED = (ids((0, 999)), TensorConfig(name="dense", datatype="FP32", shape=(8,)))


@pytest.mark.parametrize(
    ("given", "served", "warned"),
    [
        ((0, 999), (0, 999), None),
        ((10, 20), (10, 20), None),  # narrowed by the user: theirs
        (None, (0, 999), "config.yaml drops the range its export recorded, [0, 999]"),
        ((-5, 500), (0, 500), "config.yaml widens to [-5, 500] the range"),
        ((-5, 1999), (0, 999), "served with [0, 999]"),
    ],
)
def test_a_config_may_narrow_an_exported_range_never_drop_or_widen_it(
    given: tuple[float, float] | None, served: tuple[float, float], warned: str | None
) -> None:
    warnings: list[str] = []
    dense = TensorConfig(name="dense", datatype="FP32", shape=(8,))
    kept = _within_exported_ranges((ids(given), dense), EXPORTED, warnings)
    assert kept[0].range == served and kept[1] == dense
    if warned is None:
        assert warnings == []
    else:
        (warning,) = warnings
        assert warning.startswith("input 'item_id': ") and warned in warning


def test_a_config_range_with_nothing_in_the_exported_one_is_refused() -> None:
    with pytest.raises(
        ModelLoadError,
        match=r"input 'item_id': config.yaml's range \[2000, 3000\] has no value within \[0, 999\]",
    ):
        _within_exported_ranges((ids((2000, 3000)),), EXPORTED, [])


def test_an_input_the_export_recorded_no_range_for_keeps_the_configs() -> None:
    warnings: list[str] = []
    kept = _within_exported_ranges((ids((0, 5), name="other"),), EXPORTED, warnings)
    assert kept[0].range == (0, 5) and warnings == []
