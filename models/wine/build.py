"""Build wine: train a small MLP on scikit-learn's wine data through the model's own code.

    python models/wine/build.py [--version 1]

Training fits :class:`pipeline.WinePipeline`'s statistics on the training split (and refuses
to build if config.yaml's ``params`` are not those statistics), then reads every record through
``preprocessing.torch.PipelineDataset`` over that class: the code the server runs. Fields are
dropped at random while training (about one in ten), so the model learns what a missing
measurement (imputed and flagged by the pipeline) means. The held-out accuracy, measured
end to end (record → pipeline → model → answer), goes into the manifest; the integration
tests re-measure it over HTTP.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch
import yaml
from sklearn.datasets import load_wine
from sklearn.model_selection import train_test_split
from torch import nn

from preprocessing.pipeline import Item, answer_one
from preprocessing.spec import PythonSpec
from preprocessing.torch import PipelineDataset
from service.export.exporter import export_model
from service.model_config import TensorConfig

HERE = Path(__file__).resolve().parent
SEED = 0
DROP = 0.1
"""The chance each field of a training record is left out."""

sys.path.insert(0, str(HERE))
from pipeline import WinePipeline  # noqa: E402  (this folder's code, as training imports it)


def load_split() -> tuple[list[dict[str, float]], list[int], list[dict[str, float]], list[int]]:
    """The wines as JSON records, split 75/25 (stratified, fixed seed)."""
    wine = load_wine()
    records = [dict(zip(wine.feature_names, map(float, row), strict=True)) for row in wine.data]
    labels = [int(t) for t in wine.target]
    train_x, test_x, train_y, test_y = train_test_split(
        records, labels, test_size=0.25, random_state=SEED, stratify=labels
    )
    return train_x, train_y, test_x, test_y


def with_gaps(records: list[dict[str, float]], rng: random.Random) -> list[dict[str, Any]]:
    return [{k: v for k, v in r.items() if rng.random() >= DROP} for r in records]


def train(pipeline: WinePipeline, epochs: int = 200) -> tuple[nn.Module, float, int, int]:
    torch.manual_seed(SEED)
    rng = random.Random(SEED)
    train_x, train_y, test_x, test_y = load_split()
    model = nn.Sequential(nn.Linear(26, 32), nn.ReLU(), nn.Dropout(0.1), nn.Linear(32, 3))
    optimiser = torch.optim.Adam(model.parameters(), lr=1e-2, weight_decay=1e-4)
    for _ in range(epochs):
        data = PipelineDataset(pipeline, with_gaps(train_x, rng), train_y)
        model.train()
        for features, y in torch.utils.data.DataLoader(data, batch_size=32, shuffle=True):
            optimiser.zero_grad()
            nn.functional.cross_entropy(model(features["features"]), y).backward()
            optimiser.step()
    model.eval()

    def run(batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        with torch.inference_mode():
            return {"logits": model(torch.from_numpy(batch["features"])).numpy()}

    answers = [answer_one(pipeline, Item(value=r), run) for r in test_x]
    correct = sum(int(a["index"] == t) for a, t in zip(answers, test_y, strict=True))
    return model, correct / len(test_y), correct, len(test_y)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--version", type=int, default=1)
    args = parser.parse_args()
    config = yaml.safe_load((HERE / "config.yaml").read_text())
    spec = PythonSpec.model_validate(config["preprocessing"])
    train_x, _, test_x, _ = load_split()
    fitted = WinePipeline.fit(train_x, spec.params["fields"], spec.params["classes"])
    if fitted != spec.params:
        sys.exit(
            "config.yaml's preprocessing.params are not the training split's statistics; "
            f"set them to:\n{yaml.safe_dump(fitted, default_flow_style=None, width=100)}"
        )
    pipeline = WinePipeline(**spec.params)
    model, accuracy, correct, size = train(pipeline)
    print(f"wine: held-out accuracy {accuracy:.4f} ({correct}/{size}), end to end")
    with tempfile.TemporaryDirectory() as scratch:
        items = []
        gappy = [test_x[0], {k: v for k, v in test_x[1].items() if k != "proline"}, test_x[2]]
        for index, record in enumerate(gappy):  # one with a field missing: imputation replays
            path = Path(scratch) / f"wine-{index}.json"
            path.write_text(json.dumps(record))
            items.append(path)
        export_model(
            model,
            HERE / str(args.version),
            name="wine",
            inputs=[TensorConfig(name="features", datatype="FP32", shape=(26,))],
            outputs=[TensorConfig(name="logits", datatype="FP32", shape=(3,))],
            golden_inputs=None,  # the items' preprocessed batch
            max_batch_size=config["max_batch_size"],
            preprocessing=spec,
            answer_items=items,
            code_folder=HERE,
            formats=("onnx", "torchscript"),
            required=("onnx",),
            metrics={
                "heldout_accuracy": accuracy,
                "heldout_correct": correct,
                "heldout_size": size,
            },
        )


if __name__ == "__main__":
    main()
