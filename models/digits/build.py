"""Build digits: train a small CNN on scikit-learn's digits through the shared pipeline.

    python models/digits/build.py [--version 1]

Training reads images through ``preprocessing.torch.ImageDataset`` built from the spec in
config.yaml: the same pipeline object type, from the same spec, that the server applies. The
held-out accuracy goes into the manifest; the integration tests re-measure it over HTTP.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import torch
import yaml
from PIL import Image
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch import nn

from preprocessing import ImageSpec
from preprocessing.torch import ImageDataset
from service.export.exporter import FORMATS, export_model
from service.model_config import TensorConfig

HERE = Path(__file__).resolve().parent
SEED = 0


class DigitsNet(nn.Module):
    """conv-bn-relu ×2 → pool → dropout → linear: small, but with the layers eval() matters for."""

    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 16, 3, padding=1),
            nn.BatchNorm2d(16),
            nn.ReLU(),
            nn.Conv2d(16, 32, 3, padding=1),
            nn.BatchNorm2d(32),
            nn.ReLU(),
            nn.MaxPool2d(2),
        )
        self.head = nn.Sequential(nn.Flatten(), nn.Dropout(0.25), nn.Linear(32 * 4 * 4, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))


def load_split() -> tuple[list[Image.Image], list[int], list[Image.Image], list[int]]:
    """The digits as 8-bit greyscale images, split 75/25 (stratified, fixed seed)."""
    digits = load_digits()
    pixels = np.round(digits.images * (255.0 / 16.0)).astype(np.uint8)
    images = [Image.fromarray(p, mode="L") for p in pixels]
    labels = [int(t) for t in digits.target]
    train_x, test_x, train_y, test_y = train_test_split(
        images, labels, test_size=0.25, random_state=SEED, stratify=labels
    )
    return train_x, train_y, test_x, test_y


def train(spec: ImageSpec, epochs: int = 30) -> tuple[nn.Module, torch.Tensor, list[int], float]:
    torch.manual_seed(SEED)
    train_x, train_y, test_x, test_y = load_split()
    train_set = ImageDataset(train_x, train_y, spec)
    loader = torch.utils.data.DataLoader(train_set, batch_size=64, shuffle=True)
    model = DigitsNet()
    optimiser = torch.optim.Adam(model.parameters(), lr=3e-3)
    for _ in range(epochs):
        model.train()
        for x, y in loader:
            optimiser.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            optimiser.step()
    test_set = ImageDataset(test_x, test_y, spec)
    held_out = torch.stack([test_set[i][0] for i in range(len(test_set))])
    model.eval()
    with torch.inference_mode():
        predicted = model(held_out).argmax(1).tolist()
    correct = sum(int(p == t) for p, t in zip(predicted, test_y, strict=True))
    return model, held_out, test_y, correct / len(test_y)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--version", type=int, default=1)
    args = parser.parse_args()
    config = yaml.safe_load((HERE / "config.yaml").read_text())
    spec = ImageSpec.model_validate(config["preprocessing"])
    model, held_out, test_y, accuracy = train(spec)
    print(f"digits: held-out accuracy {accuracy:.4f} on {len(test_y)} images")
    export_model(
        model,
        HERE / str(args.version),
        name="digits",
        inputs=[TensorConfig(name="image", datatype="FP32", shape=(1, 8, 8))],
        outputs=[TensorConfig(name="logits", datatype="FP32", shape=(10,))],
        golden_inputs={"image": held_out[:8].numpy()},
        max_batch_size=config["max_batch_size"],
        preprocessing=spec,
        formats=FORMATS,
        required=FORMATS,  # a bundled model serves from each (test_bundled_formats)
        metrics={
            "heldout_accuracy": accuracy,
            "heldout_correct": round(accuracy * len(test_y)),
            "heldout_size": len(test_y),
        },
    )


if __name__ == "__main__":
    main()
