"""Wine records → the model's features, and its logits → an answer: the code training used.

``build.py`` fits the statistics on the training split (:meth:`WinePipeline.fit`) and trains
through :meth:`WinePipeline.preprocess`; the server runs this very file, whose sha256 export
recorded, with the statistics from config.yaml's ``params``.

A record is a JSON object of the 13 measurements, in any order; a missing (or null) field is
imputed with the training median and flagged, so the model knows it was not measured.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from preprocessing.pipeline import Arrays, BadInput, Item, Pipeline


class WinePipeline(Pipeline):
    """13 measurements → 13 standardised values + 13 missing flags (FP32 [26])."""

    raw_input = "record"

    def __init__(
        self,
        fields: Sequence[str],
        median: Sequence[float],
        mean: Sequence[float],
        std: Sequence[float],
        classes: Sequence[str],
    ) -> None:
        if not len(fields) == len(median) == len(mean) == len(std):
            raise ValueError("fields, median, mean and std must have one entry per field")
        self.fields = tuple(fields)
        self.median = np.asarray(median, dtype=np.float64)
        self.mean = np.asarray(mean, dtype=np.float64)
        self.std = np.asarray(std, dtype=np.float64)
        self.classes = tuple(classes)
        self._known = frozenset(self.fields)

    @classmethod
    def fit(
        cls, records: Sequence[Mapping[str, float]], fields: Sequence[str], classes: Sequence[str]
    ) -> dict[str, Any]:
        """The params (JSON, six significant digits) for training records."""
        values = np.array([[r[f] for f in fields] for r in records], dtype=np.float64)

        def rounded(array: np.ndarray) -> list[float]:
            return [float(f"{v:.6g}") for v in array]

        return {
            "fields": list(fields),
            "median": rounded(np.median(values, axis=0)),
            "mean": rounded(values.mean(axis=0)),
            "std": rounded(values.std(axis=0)),
            "classes": list(classes),
        }

    def preprocess(self, item: Item, context: dict[str, Any]) -> Arrays:
        record = item.json()
        if not isinstance(record, dict):
            raise BadInput(
                f"a wine is a JSON object of its measurements, not {type(record).__name__}"
            )
        unknown = sorted(set(record) - self._known)
        if unknown:
            raise BadInput(f"unknown fields {unknown}; a wine has {list(self.fields)}")
        values = self.median.copy()
        missing = np.zeros(len(self.fields), dtype=np.float64)
        for index, name in enumerate(self.fields):
            value = record.get(name)
            if value is None:
                missing[index] = 1.0
                continue
            if (
                isinstance(value, bool)
                or not isinstance(value, int | float)
                or not math.isfinite(value)
            ):
                raise BadInput(f"field '{name}' must be a finite number, not {value!r}")
            values[index] = value
        context["missing"] = [f for f, m in zip(self.fields, missing, strict=True) if m]
        scaled = (values - self.mean) / self.std
        with np.errstate(over="ignore"):  # said below, by field
            features = np.concatenate([scaled, missing]).astype(np.float32)
        if not np.isfinite(features).all():  # finite as sent, past float32 once scaled
            huge = [f for f, x in zip(self.fields, features, strict=False) if not np.isfinite(x)]
            raise BadInput(f"fields {huge} are out of range: infinite as the model's float32")
        return {"features": features}

    def postprocess(self, outputs: Mapping[str, np.ndarray], context: dict[str, Any]) -> Any:
        logits = outputs["logits"].astype(np.float64)
        probabilities = np.exp(logits - logits.max())
        probabilities /= probabilities.sum()
        best = int(probabilities.argmax())
        return {
            "class": self.classes[best],
            "index": best,
            "probability": round(float(probabilities[best]), 6),
            "imputed": context["missing"],
        }
