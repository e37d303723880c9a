"""The image classifier served through a Python implementation of its preprocessing against
the built-in image spec, in one server, alternately, in one sitting.

    .venv/bin/python -m bench.own_code [--pairs 5] [--seconds 5]

``efficientnet_python`` is efficientnet_lite0 exported again (ONNX) with ``preprocessing:
{kind: python}``: a ``Pipeline`` subclass whose ``preprocess`` runs the same steps
(``ImagePipeline`` over the same spec), with the same top-5 postprocessing. What differs is
only how the server runs a model's own code: always in the thread pool, bounded by the
request's deadline, its output checked against the signature (a built-in pipeline, alone in
flight, runs on the instance's thread instead). W1 (a 640×480 JPEG → top-5, v1 predict) at 1
and 16 connections; loopback only; wrk is the client. Writes bench/results/own_code.md.
"""

from __future__ import annotations

import argparse
import importlib.util
import shutil
import tempfile
from pathlib import Path

import yaml

from bench.batching import jpeg_640x480
from bench.common import publish, spread, table, wait_until_up, wrk
from bench.paired import serve
from preprocessing.spec import PythonSpec
from service.export.exporter import export_model
from service.model_config import TensorConfig
from tests.server import MODELS, REPO_ROOT

CODE = '''
"""The built-in image steps, as a model's own code."""
from preprocessing.image import ImagePipeline
from preprocessing.pipeline import Pipeline
from preprocessing.spec import ImageSpec


class ImageSteps(Pipeline):
    raw_input = "input_bytes"
    json_items = False

    def __init__(self, **spec):
        self.pipeline = ImagePipeline(ImageSpec(**spec))

    def preprocess(self, item, context):
        return {"input": self.pipeline(item.bytes())}
'''


def python_twin(repository: Path, image: Path) -> None:
    """efficientnet_lite0 with its image spec as a python pipeline, exported to ONNX."""
    folder = repository / "efficientnet_python"
    folder.mkdir()
    (folder / "imagesteps.py").write_text(CODE)
    shutil.copyfile(MODELS / "efficientnet_lite0" / "labels.txt", folder / "labels.txt")
    config = yaml.safe_load((MODELS / "efficientnet_lite0" / "config.yaml").read_text())
    image_spec = {k: v for k, v in config["preprocessing"].items() if k != "kind"}
    spec = {"kind": "python", "module": "imagesteps", "class": "ImageSteps", "params": image_spec}
    config["preprocessing"] = spec
    (folder / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    build = importlib.util.spec_from_file_location("build", MODELS / "efficientnet_lite0/build.py")
    assert build is not None and build.loader is not None
    module = importlib.util.module_from_spec(build)
    build.loader.exec_module(module)
    export_model(
        module.build_module(),
        folder / "1",
        name="efficientnet_python",
        inputs=[TensorConfig(name="input", datatype="FP32", shape=(3, 224, 224))],
        outputs=[TensorConfig(name="logits", datatype="FP32", shape=(1000,))],
        golden_inputs=None,
        max_batch_size=config["max_batch_size"],
        preprocessing=PythonSpec.model_validate(spec),
        answer_items=[image],
        formats=("onnx",),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pairs", type=int, default=5)
    parser.add_argument("--seconds", type=int, default=5)
    args = parser.parse_args()
    image = jpeg_640x480()
    models = {"built-in spec": "efficientnet_lite0", "python code": "efficientnet_python"}
    connections = (1, 16)
    results: dict[tuple[int, str], list[tuple[float, float]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        repository = Path(tmp) / "models"
        repository.mkdir()
        (repository / "efficientnet_lite0").symlink_to(MODELS / "efficientnet_lite0")
        item = Path(tmp) / "cat.jpg"
        item.write_bytes(image)
        python_twin(repository, item)
        process, url = serve(REPO_ROOT, repository)
        try:
            wait_until_up(f"{url}/v2/health/ready", timeout_s=300)
            for pair in range(args.pairs):
                order = list(models) if pair % 2 == 0 else list(reversed(models))
                for count in connections:
                    for side in order:
                        path = f"/v1/models/{models[side]}:predict"
                        result = wrk(
                            url + path, image, "image/jpeg", connections=count, seconds=args.seconds
                        )
                        assert result.errors == 0, (side, count, result)
                        results.setdefault((count, side), []).append(
                            (result.requests_per_s, result.p50_ms)
                        )
        finally:
            process.terminate()
            process.wait(timeout=60)
    rows = []
    for count in connections:
        ours, code = results[(count, "built-in spec")], results[(count, "python code")]
        ratios = sorted(c[0] / o[0] for o, c in zip(ours, code, strict=True))
        rows.append(
            [
                f"W1 c={count}",
                spread([r for r, _ in ours], "{:.1f}"),
                spread([r for r, _ in code], "{:.1f}"),
                spread([p for _, p in ours], "{:.1f}"),
                spread([p for _, p in code], "{:.1f}"),
                spread(ratios, "{:.3f}"),
            ]
        )
    header = [
        "workload",
        "spec req/s",
        "code req/s",
        "spec p50 ms",
        "code p50 ms",
        "code/spec req/s",
    ]
    publish(
        "own_code",
        f"# built-in image spec vs the same steps as python code, {args.pairs} "
        f"alternating pairs of {args.seconds} s\n\nmedian (min–max)\n\n"
        f"{table(rows, header)}\n",
    )


if __name__ == "__main__":
    main()
