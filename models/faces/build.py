"""Build faces: MTCNN's three networks as three served models, and the pipeline over them.

    python models/faces/build.py [--version 1]

The networks are defined in nets.py; their trained weights (``pnet.pt``, ``rnet.pt``,
``onet.pt``, about 2 MB) are read from the wheel of the PyPI package facenet-pytorch (MIT),
which is downloaded without its dependencies (it pins an old torch) into ``.weights/``. Each
network is exported to its own model folder (``faces_pnet`` over any H × W within its buckets,
``faces_rnet`` and ``faces_onet`` over batches of crops); ``faces`` is the pipeline
(detector.py), whose end-to-end answers on scikit-image's photos are recorded against the
eager networks and replayed by the server against the served ones.
"""

from __future__ import annotations

import argparse
import io
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable
from pathlib import Path

import numpy as np
import skimage.data
import torch
import yaml
from PIL import Image
from torch import nn

from preprocessing.pipeline import LocalModels
from preprocessing.spec import PythonSpec
from service.export.exporter import export_model
from service.model_config import TensorConfig

HERE = Path(__file__).resolve().parent
MODELS = HERE.parent
WHEEL = "facenet-pytorch==2.6.0"
PNET_BUCKETS = (16, 32, 64, 128, 256, 384)
"""Pyramid levels' sides: the largest level of an image shrunk to 640 is 0.6 × 640 = 384."""

sys.path.insert(0, str(HERE))
from nets import ONet, PNet, RNet  # noqa: E402  (this folder's code)

NETS: dict[str, tuple[type[nn.Module], str, tuple[str, ...]]] = {
    "faces_pnet": (PNet, "image", ("prob", "offsets")),
    "faces_rnet": (RNet, "crops", ("prob", "offsets")),
    "faces_onet": (ONet, "crops", ("prob", "offsets", "landmarks")),
}


class ImageSize(nn.Module):
    """The faces model's own network: the image's size, passed through (the work is in the
    pipeline's steps)."""

    def forward(self, size: torch.Tensor) -> torch.Tensor:
        return size * 1


def weights() -> dict[str, dict[str, torch.Tensor]]:
    """Each network's state dict, from facenet-pytorch's wheel (downloaded once)."""
    folder = HERE / ".weights"
    wheels = sorted(folder.glob("facenet_pytorch-*.whl"))
    if not wheels:
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "--no-deps",
                "--quiet",
                WHEEL,
                "-d",
                str(folder),
            ],
            check=True,
        )
        wheels = sorted(folder.glob("facenet_pytorch-*.whl"))
    found = {}
    with zipfile.ZipFile(wheels[-1]) as wheel:
        for name in NETS:
            data = wheel.read(f"facenet_pytorch/data/{name.removeprefix('faces_')}.pt")
            found[name] = torch.load(io.BytesIO(data), weights_only=True)
    return found


def photo(name: str) -> bytes:
    array = getattr(skimage.data, name)()
    if array.ndim == 2:
        array = np.stack([array] * 3, axis=-1)
    buffer = io.BytesIO()
    Image.fromarray(array[..., :3]).save(buffer, format="JPEG", quality=95)
    return buffer.getvalue()


def eager(
    module: nn.Module, key: str, outputs: tuple[str, ...]
) -> Callable[..., dict[str, np.ndarray]]:
    def run(batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        with torch.inference_mode():
            answers = module(torch.from_numpy(batch[key]))
        return {name: t.numpy() for name, t in zip(outputs, answers, strict=True)}

    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--version", type=int, default=1)
    args = parser.parse_args()
    state = weights()
    steps = {}
    rng = np.random.default_rng(0)
    for name, (cls, key, outputs) in NETS.items():
        module = cls()
        module.load_state_dict(state[name])
        module.eval()
        steps[name] = eager(module, key, outputs)
        config = yaml.safe_load((MODELS / name / "config.yaml").read_text())
        side = 40 if name == "faces_pnet" else {"faces_rnet": 24, "faces_onet": 48}[name]
        inner = (3, -1, -1) if name == "faces_pnet" else (3, side, side)
        example = rng.uniform(-1, 1, (2, 3, side, side + (12 if name == "faces_pnet" else 0)))
        out_shapes = {"prob": 2, "offsets": 4, "landmarks": 10}
        export_model(
            module,
            MODELS / name / str(args.version),
            name=name,
            inputs=[TensorConfig(name=key, datatype="FP32", shape=inner)],
            outputs=[
                TensorConfig(
                    name=o,
                    datatype="FP32",
                    shape=(out_shapes[o], -1, -1) if name == "faces_pnet" else (out_shapes[o],),
                )
                for o in outputs
            ],
            golden_inputs={key: example.astype(np.float32)},
            max_batch_size=config["max_batch_size"],
            buckets=PNET_BUCKETS if name == "faces_pnet" else (),
            formats=("onnx",),
            required=("onnx",),
        )
    config = yaml.safe_load((HERE / "config.yaml").read_text())
    with tempfile.TemporaryDirectory() as scratch:
        items = []
        for name in ("astronaut", "camera", "coffee"):  # one face, one face, none
            path = Path(scratch) / f"{name}.jpg"
            path.write_bytes(photo(name))
            items.append(path)
        manifest = export_model(
            ImageSize(),
            HERE / str(args.version),
            name="faces",
            inputs=[TensorConfig(name="size", datatype="INT32", shape=(2,))],
            outputs=[TensorConfig(name="shape", datatype="INT32", shape=(2,))],
            golden_inputs=None,
            max_batch_size=config["max_batch_size"],
            preprocessing=PythonSpec.model_validate(config["preprocessing"]),
            answer_items=items,
            code_folder=HERE,
            formats=("onnx",),
            required=("onnx",),
            models=LocalModels(steps),
        )
    found = [len(pair["answer"]) for pair in manifest.answers]
    print(f"faces: {found} faces in astronaut, camera, coffee (eager)")


if __name__ == "__main__":
    main()
