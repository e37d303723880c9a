"""The request-duration histograms against prometheus_client's own; GPU metrics: NVML cannot
run on these GPU-less machines, so a stand-in with NVML's calls checks the translation; the
absence path runs for real."""

from __future__ import annotations

from types import ModuleType, SimpleNamespace

import pytest
from prometheus_client import CollectorRegistry, Histogram, generate_latest

from service.telemetry.metrics import LATENCY_BUCKETS, DurationHistogram, _GpuCollector


def test_duration_histograms_expose_exactly_what_prometheus_client_would() -> None:
    ours, theirs = CollectorRegistry(), CollectorRegistry()
    fast = DurationHistogram("tg_seconds", "Help.", ("model", "protocol"), LATENCY_BUCKETS, ours)
    reference = Histogram(
        "tg_seconds", "Help.", ["model", "protocol"], buckets=LATENCY_BUCKETS, registry=theirs
    )
    # on a bound (le is inclusive), between bounds, zero, past the last bound
    values = [0.0, 0.0001, 0.0005, 0.0007, 0.002, 3.0, 10.0, 11.5]
    for labels in (("a", "v2"), ("b", "grpc")):
        for value in values:
            fast.labels(*labels).observe(value)
            reference.labels(*labels).observe(value)
    created = {line for line in generate_latest(theirs).decode().splitlines() if "_created" in line}
    expected = [
        line for line in generate_latest(theirs).decode().splitlines() if line not in created
    ]
    assert generate_latest(ours).decode().splitlines() == expected


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
    # torch half imported, as a scrape meets a model still loading: it was a 500
    monkeypatch.setitem(sys.modules, "torch", ModuleType("torch"))
    assert list(collector.collect()) == []


def test_every_refusal_reason_counted_is_one_the_metrics_expose() -> None:
    """Three reasons were counted and never exposed: the collector kept its own list."""
    import re
    from pathlib import Path

    from service.telemetry.counters import REASONS

    root = Path(__file__).resolve().parents[3] / "service"
    counted = {
        reason
        for path in root.rglob("*.py")
        for reason in re.findall(r'REFUSED\["(\w+)"\]', path.read_text())
    }
    assert counted and counted <= set(REASONS), counted - set(REASONS)
