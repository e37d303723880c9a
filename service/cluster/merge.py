"""Several workers' answers as one server's: Triton's statistics and Prometheus metrics."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import orjson
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

if TYPE_CHECKING:
    pass

log = logging.getLogger("tensorgate.workers")


def merge_statistics(answers: list[dict[str, Any]]) -> dict[str, Any]:
    """Triton's statistics of several workers as one: counts and durations add up, batch
    statistics add up by batch size, ``last_inference`` is the latest."""
    merged: dict[tuple[str, str], dict[str, Any]] = {}
    for answer in answers:
        for model in answer["model_stats"]:
            key = (model["name"], model["version"])
            if key in merged:
                _add(merged[key], model)
            else:
                merged[key] = orjson.loads(orjson.dumps(model))  # a copy to add into
    return {"model_stats": list(merged.values())}


def _add(into: dict[str, Any], other: dict[str, Any]) -> None:
    for key, value in other.items():
        if key == "last_inference":
            into[key] = max(into.get(key) or 0, value or 0)
        elif key == "batch_stats":
            sizes = {entry["batch_size"]: entry for entry in into.setdefault(key, [])}
            for entry in value:
                if entry["batch_size"] in sizes:
                    _add(sizes[entry["batch_size"]], entry)
                else:
                    into[key].append(orjson.loads(orjson.dumps(entry)))
            into[key].sort(key=lambda entry: entry["batch_size"])
        elif key == "batch_size":
            continue
        elif isinstance(value, dict):
            _add(into.setdefault(key, {}), value)
        elif isinstance(value, int | float) and not isinstance(value, bool):
            into[key] = into.get(key, 0) + value


LOWEST = {"process_start_time_seconds"}
"""Gauges that are the least over workers (when the server started)."""
SUMMED_GAUGES = {
    "process_virtual_memory_bytes",
    "process_resident_memory_bytes",
    "process_open_fds",
    "tensorgate_pending_requests",
    "tensorgate_queued_requests",
    "tensorgate_requests_in_flight",
    "tensorgate_queue_capacity",
    "tensorgate_instances",
    "tensorgate_instances_busy",
    "tensorgate_request_body_bytes_in_flight",
}
"""Gauges of what each worker holds, so the server holds their sum. Every other gauge (a
model's state, warmup time, a GPU's memory) describes one thing each worker sees alike, and is
the greatest over workers."""


def merge_metrics(texts: list[str]) -> bytes:
    """Several workers' exposition texts as one: counters and histograms add up; gauges add
    up, take the least or the greatest, as :data:`SUMMED_GAUGES` and :data:`LOWEST` say."""
    families: dict[str, Metric] = {}
    values: dict[str, dict[tuple[str, tuple[tuple[str, str], ...]], float]] = {}
    for text in texts:
        for family in text_string_to_metric_families(text):
            if family.name not in families:
                families[family.name] = Metric(family.name, family.documentation, family.type)
                values[family.name] = {}
            samples = values[family.name]
            for sample in family.samples:
                key = (sample.name, tuple(sorted(sample.labels.items())))
                if key not in samples:
                    samples[key] = sample.value
                elif family.type != "gauge" or family.name in SUMMED_GAUGES:
                    samples[key] += sample.value
                elif family.name in LOWEST:
                    samples[key] = min(samples[key], sample.value)
                else:
                    samples[key] = max(samples[key], sample.value)
    for name, family in families.items():
        for (sample_name, labels), value in values[name].items():
            family.add_sample(sample_name, dict(labels), value)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Fixed(list(families.values())))
    return generate_latest(registry)


class _Fixed:
    """A collector of metric families computed elsewhere."""

    def __init__(self, families: list[Metric]) -> None:
        self.families = families

    def collect(self) -> list[Metric]:
        return self.families
