"""GPU metrics: NVML cannot run on these GPU-less machines, so a stand-in with NVML's calls
checks the translation; the absence path runs for real."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from service.metrics import _GpuCollector


class FakeNvml:
    """The four NVML calls the collector makes, for two devices (NVML's own names)."""

    def nvmlDeviceGetCount(self) -> int:
        return 2

    def nvmlDeviceGetHandleByIndex(self, index: int) -> int:
        return index

    def nvmlDeviceGetMemoryInfo(self, handle: int) -> SimpleNamespace:
        return SimpleNamespace(used=(handle + 1) * 2**30, total=80 * 2**30)

    def nvmlDeviceGetUtilizationRates(self, handle: int) -> SimpleNamespace:
        return SimpleNamespace(gpu=40 + handle)


def test_nvml_figures_become_per_device_gauges() -> None:
    families = {f.name: f for f in _GpuCollector._from_nvml(FakeNvml())}
    used = {
        s.labels["device"]: s.value for s in families["tensorgate_gpu_memory_used_bytes"].samples
    }
    assert used == {"0": 2**30, "1": 2 * 2**30}
    busy = [s.value for s in families["tensorgate_gpu_utilization_ratio"].samples]
    assert busy == [0.40, 0.41]


def test_without_nvml_there_is_nothing_to_report_and_nothing_breaks(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Whatever this machine has: NVML made unimportable, and torch not imported."""
    import sys

    monkeypatch.setitem(sys.modules, "pynvml", None)  # import pynvml raises ImportError
    monkeypatch.delitem(sys.modules, "torch", raising=False)
    collector = _GpuCollector()
    assert list(collector.collect()) == []
