"""Postprocessing: raw outputs → what a v1 ``predict`` caller wants (top-k labels)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from service.errors import ModelLoadError
from service.model_config import ClassificationConfig, TensorConfig


class Classifier:
    """Top-k ``{"index", "label", "probability"}`` from one row of a logits output."""

    def __init__(
        self, config: ClassificationConfig, model_dir: Path, outputs: tuple[TensorConfig, ...]
    ) -> None:
        by_name = {t.name: t for t in outputs}
        self.output = config.output or outputs[0].name
        if self.output not in by_name:
            raise ModelLoadError(
                f"postprocessing.output '{self.output}' is not an output of the model "
                f"({sorted(by_name)})"
            )
        classes = by_name[self.output].shape[-1] if by_name[self.output].shape else -1
        self.labels: list[str] | None = None
        if config.labels is not None:
            path = model_dir / config.labels
            try:
                self.labels = path.read_text().splitlines()
            except OSError as exc:
                raise ModelLoadError(f"postprocessing.labels: cannot read {path}: {exc}") from None
            if classes != -1 and len(self.labels) != classes:
                raise ModelLoadError(
                    f"postprocessing.labels: {path.name} has {len(self.labels)} labels, "
                    f"output '{self.output}' has {classes} classes"
                )
        self.top_k = config.top_k
        self.softmax = config.softmax

    def __call__(
        self, row: Mapping[str, np.ndarray], top_k: int | None = None
    ) -> list[dict[str, Any]]:
        logits = row[self.output].astype(np.float64).reshape(-1)
        k = min(top_k or self.top_k, logits.size)
        # softmax keeps the order: pick the top k from the logits, normalise only those k
        top = np.argpartition(-logits, k - 1)[:k]
        top = top[np.argsort(-logits[top], kind="stable")].tolist()
        if self.softmax:
            exp = np.exp(logits - logits[top[0]])  # top[0] is the largest logit
            scores = (exp[top] / exp.sum()).tolist()
        else:
            scores = logits[top].tolist()
        labels = self.labels
        return [
            {"index": i, "label": labels[i] if labels else str(i), "probability": p}
            for i, p in zip(top, scores, strict=True)
        ]


def top_values(output: np.ndarray, top_k: int) -> np.ndarray:
    """Rows of ``output`` (numbers) → BYTES ``[rows, k]`` of ``"value:index"``, largest first:
    Triton's classification of an output without labels (its values as they are, no softmax;
    integers as integers, ranked exactly, floats with 6 decimals)."""
    rows = output.reshape(len(output), -1)
    k = min(top_k, rows.shape[1])
    floats = rows.dtype.kind == "f"
    written = "{:.6f}:{}" if floats else "{}:{}"
    array = np.empty((len(rows), k), dtype=object)
    for i, row in enumerate(rows):
        if floats:  # NaN last
            top = np.argsort(-row, kind="stable")[:k]
        else:  # integers exactly (-row wraps unsigned ones), ties lowest index first
            top = (row.size - 1 - np.argsort(row[::-1], kind="stable")[::-1])[:k]
        array[i, :] = [written.format(row[j].item(), j).encode() for j in top.tolist()]
    return array


CLASSIFICATION = "classification"
"""The virtual output a model with classification postprocessing offers over v2."""
ANSWER = "answer"
"""The virtual output of a model whose pipeline's code postprocesses: one JSON text per item."""


def classification_tensor(
    classifier: Classifier, output: np.ndarray, top_k: int | None = None
) -> np.ndarray:
    """Rows of ``output`` → BYTES ``[rows, k]`` of ``"probability:index:label"``, best first.

    The element format of Triton's classification extension, so its clients parse it as is.
    """
    rows = []
    for row in output:
        top = classifier({classifier.output: row}, top_k)
        rows.append([f"{t['probability']:.6f}:{t['index']}:{t['label']}".encode() for t in top])
    width = max((len(r) for r in rows), default=0)
    array = np.empty((len(rows), width), dtype=object)
    for i, row in enumerate(rows):
        array[i, :] = row
    return array
