import json
import logging
import re
from pathlib import Path
from unittest import mock

import numpy as np
import pytest
import torch

from preprocessing.spec import ImageSpec, PythonSpec, spec_hash
from service.artifacts.manifest import Tolerance
from service.artifacts.shapes import Follow
from service.export import exporter
from service.export.cli import (
    Overwrites,
    check_tensors,
    golden_input,
    load_module,
    parse_tensor,
    read_spec,
)
from service.export.exporter import ExportError, export_model
from service.model_config import TensorConfig
from tests.models import AlwaysDrops, Mlp, TrainModeNet
from tests.user_models import Heatmap, ShiftedLookup, Tagger

X = TensorConfig(name="x", datatype="FP32", shape=(64,))
Y = TensorConfig(name="y", datatype="FP32", shape=(10,))


def golden() -> dict[str, np.ndarray]:
    return {"x": np.random.default_rng(0).standard_normal((3, 64)).astype(np.float32)}


def test_export_writes_both_artifacts_golden_and_manifest(tmp_path: Path) -> None:
    spec = ImageSpec(resize=8, crop=8)
    manifest = export_model(
        Mlp().eval(),
        tmp_path,
        name="mlp",
        inputs=[X],
        outputs=[Y],
        golden_inputs=golden(),
        max_batch_size=16,
        preprocessing=spec,
        metrics={"accuracy": 0.5},
        formats=("onnx", "torchscript"),
    )
    assert {p.name for p in tmp_path.iterdir()} == {
        "model.onnx",
        "model.pt",
        "golden.npz",
        "manifest.json",
    }
    written = json.loads((tmp_path / "manifest.json").read_text())
    assert written["preprocessing_hash"] == spec_hash(spec) == manifest.preprocessing_hash
    assert written["dynamic_axes"] == {"x": {"0": "batch"}, "y": {"0": "batch"}}
    assert written["versions"]["torch"] == torch.__version__
    assert written["opset"] == 18
    assert written["versions"]["onnx_exporter"] == "dynamo"
    assert "onnx_exporter_fallback" not in written["versions"]
    assert written["metrics"] == {"accuracy": 0.5}
    assert manifest.parity["onnx"]["max_abs"] < 1e-4
    with np.load(tmp_path / "golden.npz") as files:
        expected = Mlp().eval()(torch.from_numpy(golden()["x"])).detach().numpy()
        np.testing.assert_array_equal(files["output.y"], expected)


def test_export_of_a_module_left_in_train_mode_warns_and_exports_eval(tmp_path: Path) -> None:
    x = TensorConfig(name="x", datatype="FP32", shape=(8,))
    y = TensorConfig(name="y", datatype="FP32", shape=(4,))
    rows = {"x": np.ones((4, 8), np.float32)}
    with pytest.warns(UserWarning, match="was in training mode"):
        export_model(
            TrainModeNet().train(),
            tmp_path,
            name="t",
            inputs=[x],
            outputs=[y],
            golden_inputs=rows,
            max_batch_size=4,
            formats=("torchscript",),
        )
    loaded = torch.jit.load(str(tmp_path / "model.pt"))
    assert not loaded.training


def export_too_exactly(out_dir: Path) -> None:
    """An ONNX export whose parity check fails (after the file is written): no tolerance."""
    with pytest.raises(ExportError, match="max abs error .* max rel error"):
        export_model(
            Mlp().eval(),
            out_dir=out_dir,
            name="mlp",
            inputs=[X],
            outputs=[Y],
            golden_inputs=golden(),
            max_batch_size=16,
            tolerance=Tolerance(atol=1e-30, rtol=0.0),
            formats=("onnx",),
        )


def test_disagreement_beyond_tolerance_fails_with_the_error_size(tmp_path: Path) -> None:
    export_too_exactly(tmp_path)


def test_a_failed_export_takes_back_what_it_wrote_and_keeps_what_was_there(
    tmp_path: Path,
) -> None:
    """An export that failed after writing its first artifact left a version folder of a
    ``model.onnx`` alone (no manifest, no config): a model the server skipped or refused. It
    is taken back: the folders the export made, or, in a folder that was there, the files it
    added; what was there before (a tokenizer a build put beside it) stays."""
    (tmp_path / "models").mkdir()
    export_too_exactly(tmp_path / "models" / "mlp" / "1")
    assert not (tmp_path / "models" / "mlp").exists()
    assert (tmp_path / "models").is_dir()  # there before: only what the export made goes
    kept = tmp_path / "kept" / "1"
    kept.mkdir(parents=True)
    before = {"tokenizer.json": "{}", "model.onnx": "the old graph", "manifest.json": "{}"}
    for name, text in before.items():
        (kept / name).write_text(text)
    export_too_exactly(kept)  # it wrote a model.onnx of its own before it failed
    assert {p.name: p.read_text() for p in kept.iterdir()} == before
    assert [p.name for p in kept.parent.iterdir()] == ["1"]  # nothing set aside is left


class Centred(torch.nn.Module):
    """Each row less the batch's mean row: a row's answer depends on the others."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x - x.mean(0, keepdim=True)


def test_a_module_whose_rows_depend_on_each_other_is_refused_unless_unbatched(
    tmp_path: Path,
) -> None:
    """The server batches concurrent requests and pads batches with copies of the last row:
    such a module answered one request of rows [1]*4, [2]*4, [3]*4 -1.25, -0.25, 0.75 (its batch
    padded to 4) where eager PyTorch answers -1, 0, 1. The parity checks compare artifact and
    eager at the same rows, and passed. Unbatched, the rows are the module's own dim."""
    x, y = (TensorConfig(name=n, datatype="FP32", shape=(4,)) for n in "xy")
    with pytest.raises(
        ExportError,
        match=r"each row must be answered as if it were alone.*golden row 0's output 'y' among "
        r"the 3 rows differs from its output alone by up to .*--max-batch-size 0",
    ):
        export_model(
            Centred(),
            tmp_path / "batched",
            name="centred",
            inputs=[x],
            outputs=[y],
            golden_inputs={"x": np.arange(12, dtype=np.float32).reshape(3, 4)},
            max_batch_size=4,
            formats=("onnx",),
        )
    rows = [TensorConfig(name=n, datatype="FP32", shape=(3, 4)) for n in "xy"]
    export_model(
        Centred(),
        tmp_path / "unbatched",
        name="centred",
        inputs=rows[:1],
        outputs=rows[1:],
        golden_inputs={"x": np.arange(12, dtype=np.float32).reshape(3, 4)},
        max_batch_size=0,
        formats=("onnx",),
    )


class Masked(torch.nn.Module):
    def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return ids.float() * mask


def test_inputs_declared_out_of_forwards_order_are_refused_naming_it(tmp_path: Path) -> None:
    """--input mask --input ids for forward(ids, mask) exported and served with the values of
    each fed to the other, by position: a client sending them by name got answers off."""
    ids, mask = (TensorConfig(name=n, datatype="FP32", shape=(4,)) for n in ("ids", "mask"))
    y = TensorConfig(name="y", datatype="FP32", shape=(4,))
    rows = {"ids": np.ones((2, 4), np.float32), "mask": np.ones((2, 4), np.float32)}
    with pytest.raises(
        ExportError,
        match=re.escape(
            "input 'mask' is declared first, and is forward()'s second parameter: the inputs "
            "feed forward(ids, mask) in the order they are declared"
        ),
    ):
        export_model(
            Masked(),
            tmp_path / "swapped",
            name="m",
            inputs=[mask, ids],
            outputs=[y],
            golden_inputs=rows,
            max_batch_size=4,
            formats=("onnx",),
        )
    renamed = [ids.model_copy(update={"name": "tokens"}), mask.model_copy(update={"name": "m"})]
    export_model(
        Masked(),
        tmp_path / "renamed",
        name="m",
        inputs=renamed,
        outputs=[y],
        golden_inputs={"tokens": rows["ids"], "m": rows["mask"]},
        max_batch_size=4,
        formats=("onnx",),
    )


def test_declared_output_datatype_must_match(tmp_path: Path) -> None:
    wrong = TensorConfig(name="y", datatype="FP64", shape=(10,))
    with pytest.raises(ExportError, match="declared FP64, the module returns float32"):
        export_mlp(tmp_path, [wrong])


def export_mlp(folder: Path, outputs: list[TensorConfig], max_batch_size: int = 16) -> None:
    export_model(
        Mlp().eval(),
        folder,
        name="mlp",
        inputs=[X],
        outputs=outputs,
        golden_inputs=golden(),
        max_batch_size=max_batch_size,
    )


@pytest.mark.parametrize(
    ("shape", "max_batch_size", "words"),
    [
        ((7,), 16, "output 'y' is declared FP32 [7] a row; the module returns [10] a row"),
        ((2, -1), 16, "output 'y' is declared FP32 [2, -1] a row; the module returns [10] a row"),
        ((-1,), 0, "output 'y' is declared FP32 [-1]; the module returns [3, 10]"),
    ],
)
def test_declared_output_shape_must_match(
    tmp_path: Path, shape: tuple[int, ...], max_batch_size: int, words: str
) -> None:
    """A shape the module does not return is refused at export: the server would refuse the
    config it wrote at load (declared [7], the graph has [10])."""
    wrong = TensorConfig(name="y", datatype="FP32", shape=shape)
    with pytest.raises(ExportError, match=re.escape(words)):
        export_mlp(tmp_path, [wrong], max_batch_size)
    assert not tmp_path.exists() or not any(tmp_path.iterdir())


def test_inputs_the_module_does_not_take_are_an_export_error_naming_them(tmp_path: Path) -> None:
    """A declared input of the wrong size was torch's traceback; it is one line."""
    wide = TensorConfig(name="x", datatype="FP32", shape=(65,))
    with pytest.raises(ExportError, match=re.escape("fails on inputs of the declared shapes")):
        export_model(
            Mlp().eval(),
            tmp_path,
            name="mlp",
            inputs=[wide],
            outputs=[TensorConfig(name="y", datatype="FP32", shape=(10,))],
            golden_inputs={"x": np.zeros((2, 65), np.float32)},
            max_batch_size=16,
        )


def test_a_module_returning_another_count_of_outputs_says_how_many(tmp_path: Path) -> None:
    two = [
        TensorConfig(name="y", datatype="FP32", shape=(10,)),
        TensorConfig(name="z", datatype="FP32", shape=(10,)),
    ]
    with pytest.raises(
        ExportError, match=re.escape("forward() returns 1 value; 2 output(s) are declared (y, z)")
    ):
        export_mlp(tmp_path, two)


class Branchy(torch.nn.Module):
    """Data-dependent control flow: torch.export refuses it, tracing records one path."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 2.0 if bool(x.sum() > 0) else x


def test_an_untraceable_module_falls_back_to_the_torchscript_onnx_exporter_saying_why(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    x = TensorConfig(name="x", datatype="FP32", shape=(4,))
    with caplog.at_level(logging.WARNING, logger="tensorgate.export"):
        manifest = export_model(
            Branchy(),
            tmp_path,
            name="b",
            inputs=[x],
            outputs=[x.model_copy(update={"name": "y"})],
            golden_inputs={"x": np.ones((2, 4), np.float32)},
            max_batch_size=4,
            formats=("onnx",),
        )
    assert manifest.versions["onnx_exporter"] == "torchscript"
    reason = manifest.versions["onnx_exporter_fallback"]
    assert reason is not None and reason.startswith("torch.export failed")
    assert f"ONNX: {reason}; using the TorchScript-based exporter instead" in caplog.text


def export_branchy(tmp_path: Path, golden: np.ndarray, formats: tuple[str, ...]) -> None:
    x = TensorConfig(name="x", datatype="FP32", shape=(4,))
    export_model(
        Branchy(),
        tmp_path,
        name="b",
        inputs=[x],
        outputs=[x.model_copy(update={"name": "y"})],
        golden_inputs={"x": golden},
        max_batch_size=4,
        formats=formats,
    )


def test_pt2_of_an_untraceable_module_is_refused_naming_torch_export(tmp_path: Path) -> None:
    with pytest.raises(
        ExportError,
        match=r"torch.export failed.* at test_export.py:\d+ in forward \(return x \* 2.0 if "
        r"bool\(x.sum\(\) > 0\) else x\).*leave pt2 out of the formats",
    ):
        export_branchy(tmp_path, np.ones((2, 4), np.float32), ("pt2",))


def test_when_a_branch_on_values_fails_every_format_export_says_torchscript_keeps_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The helper's user read that no format could be exported, and not which one could. (A
    branch on the whole batch's sum makes each row's answer depend on the others', which export
    says first: that check is set aside here to reach the formats' own.)"""
    golden = np.array([[1.0] * 4, [-3.0] * 4], np.float32)
    with pytest.raises(ExportError, match="a branch on the whole batch's values"):
        export_branchy(tmp_path / "coupled", golden, ("onnx", "pt2"))
    monkeypatch.setattr(exporter, "_check_rows_alone", lambda *args: None)
    with pytest.raises(ExportError) as failed:  # one branch traced, the other met by a probe
        export_branchy(tmp_path, golden, ("onnx", "pt2"))
    message = str(failed.value)
    assert message.startswith("no format could be exported: onnx: ")
    assert message.endswith(
        "a branch on a tensor's values stops torch.export, and tracing keeps only the branch "
        "its example took: --formats torchscript scripts the module and keeps each branch (or "
        "write the branch with torch.cond)"
    )


def test_a_torchscript_export_the_server_would_refuse_for_training_mode_fails(
    tmp_path: Path,
) -> None:
    """F.dropout without training= drops in eval mode: export wrote model.pt, and the server
    refused it at every load."""
    x = TensorConfig(name="x", datatype="FP32", shape=(8,))
    with pytest.raises(ExportError, match="torchscript: model.pt runs in training mode"):
        export_model(
            AlwaysDrops(),
            tmp_path,
            name="d",
            inputs=[x],
            outputs=[TensorConfig(name="y", datatype="FP32", shape=(4,))],
            golden_inputs={"x": np.ones((2, 8), np.float32)},
            max_batch_size=4,
            formats=("torchscript",),
            required=["torchscript"],
        )


def test_writing_torchscript_warns_that_it_is_deprecated_upstream(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="tensorgate.export"):
        export_model(
            Mlp().eval(),
            tmp_path,
            name="mlp",
            inputs=[X],
            outputs=[Y],
            golden_inputs=golden(),
            max_batch_size=16,
            formats=("torchscript",),
        )
    assert "torch deprecated it in favour of torch.export" in caplog.text


def test_unknown_formats_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ExportError, match=r"unknown formats \['tflite'\]"):
        export_model(
            Mlp().eval(),
            tmp_path,
            name="mlp",
            inputs=[X],
            outputs=[Y],
            golden_inputs=golden(),
            max_batch_size=16,
            formats=("tflite",),
        )


@pytest.mark.parametrize("bidirectional", [False, True])
def test_export_measures_whether_padding_changes_a_taggers_answer(
    tmp_path: Path, bidirectional: bool
) -> None:
    ids = TensorConfig(name="ids", datatype="INT64", shape=(-1,))
    tags = TensorConfig(name="tags", datatype="FP32", shape=(-1, 5))
    golden = {"ids": np.random.default_rng(0).integers(0, 50, (2, 6))}
    manifest = export_model(
        Tagger(bidirectional),
        tmp_path,
        name="t",
        inputs=[ids],
        outputs=[tags],
        golden_inputs=golden,
        max_batch_size=4,
        formats=("onnx",),
        buckets=(8, 16),
    )
    shapes = manifest.shapes
    assert shapes is not None
    # One-way, a token sees only those before it: padding after the end changes nothing. Both
    # ways, the backward pass starts in the padding.
    assert shapes.pad is not bidirectional
    if bidirectional:
        assert "padding the golden rows from 6 to 8 changes output 'tags'" in shapes.reason
    else:
        assert shapes.follows["tags"][1] == Follow(input="ids", dim=1)
    assert manifest.inputs[0].range == (0, 49)  # it indexes nn.Embedding(50, 16)
    written = json.loads((tmp_path / "manifest.json").read_text())["inputs"][0]
    assert written["range"] == [0, 49]  # as a user writes ids in config.yaml, not 0.0 and 49.0


def test_dynamic_dims_without_buckets_are_refused_saying_what_to_pass(tmp_path: Path) -> None:
    ids = TensorConfig(name="ids", datatype="INT64", shape=(-1,))
    tags = TensorConfig(name="tags", datatype="FP32", shape=(-1, 5))
    with pytest.raises(
        ExportError, match=r"inputs \[.ids.\] have dynamic \(-1\) dims: .* \(--buckets"
    ):
        export_model(
            Tagger(),
            tmp_path,
            name="t",
            inputs=[ids],
            outputs=[tags],
            golden_inputs={"ids": np.zeros((2, 6), np.int64)},
            max_batch_size=4,
        )


def test_padding_is_measured_from_each_dims_own_size(tmp_path: Path) -> None:
    """Golden images of 20 × 30: each dim padded from its own size and cut back by its own
    output size, so a fully convolutional head that padding leaves unchanged is found so."""
    image = TensorConfig(name="image", datatype="FP32", shape=(3, -1, -1))
    heat = TensorConfig(name="heat", datatype="FP32", shape=(1, -1, -1))
    golden = {"image": np.random.default_rng(0).standard_normal((2, 3, 20, 30), np.float32)}
    manifest = export_model(
        Heatmap(),
        tmp_path,
        name="h",
        inputs=[image],
        outputs=[heat],
        golden_inputs=golden,
        max_batch_size=2,
        formats=("onnx",),
        buckets=(32, 64),
    )
    assert manifest.shapes is not None
    assert manifest.shapes.pad, manifest.shapes.reason


class Offset(torch.nn.Module):
    """Ids 20..69 index a table of 50 as ``ids - 20``."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(3)
        self.table = torch.nn.Embedding(50, 2)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.table(ids - 20).sum(1)


def test_the_command_line_s_golden_inputs_lie_within_a_declared_range(tmp_path: Path) -> None:
    """They were ids 0 to 9 whatever the range: export of this module failed ("check
    --input"), and parity was checked on inputs the server would refuse."""
    ids = parse_tensor("ids:INT64:4:20..69")
    golden = golden_input(ids, 4, seed=0)
    assert (golden.min(), golden.max()) == (20, 69)  # both ends, and nothing outside
    floats = golden_input(parse_tensor("x:FP32:3:-1..1"), 4, seed=1)
    assert (floats.min(), floats.max()) == (-1, 1)
    manifest = export_model(
        Offset(),
        tmp_path,
        name="offset",
        inputs=[ids],
        outputs=[TensorConfig(name="out", datatype="FP32", shape=(2,))],
        golden_inputs={"ids": golden},
        max_batch_size=4,
        formats=("onnx",),
    )
    assert manifest.inputs[0].range == (20, 69) and "onnx" in manifest.artifacts


def test_a_range_wider_than_the_modules_table_says_so_at_export(tmp_path: Path) -> None:
    """It said "IndexError: index out of range in self (check --input)", naming no range."""
    ids = TensorConfig(name="item_id", datatype="INT64", shape=(1,), range=(0, 1000))
    with pytest.raises(ExportError) as refused:
        export_model(
            ShiftedLookup(),  # 1,000 rows, indexed by id + 1: ids 0..998 fit
            tmp_path,
            name="shifted",
            inputs=[ids],
            outputs=[TensorConfig(name="vector", datatype="FP32", shape=(4,))],
            golden_inputs={"item_id": np.array([[0], [1000]], np.int64)},
            max_batch_size=4,
            formats=("onnx",),
        )
    said = "values at an end of their declared range, item_id 0..1000: a range wider than a table"
    assert said in str(refused.value)


def test_an_input_reaching_an_index_no_range_bounds_is_named_at_export(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """From model.onnx a negative id reads a row counted from the end, where PyTorch refuses
    it: export says which input to declare, for every format, not only when it leaves pt2 out."""
    ids = TensorConfig(name="item_id", datatype="INT64", shape=(1,))
    with caplog.at_level(logging.WARNING, logger="tensorgate.export"):
        export_model(
            ShiftedLookup(),
            tmp_path,
            name="shifted",
            inputs=[ids],
            outputs=[TensorConfig(name="vector", datatype="FP32", shape=(4,))],
            golden_inputs={"item_id": np.arange(4, dtype=np.int64)[:, None]},
            max_batch_size=4,
            formats=("onnx",),
        )
    (warning,) = [r.getMessage() for r in caplog.records if "reaches an index" in r.getMessage()]
    assert "input 'item_id'" in warning and "--input item_id:DTYPE:DIMS:LOW..HIGH" in warning


RECORDS = """
import numpy as np
from preprocessing.pipeline import Pipeline


class Records(Pipeline):
    def preprocess(self, item, context):
        {fails}
        return {{"x": np.asarray(item.json()["x"], dtype=np.float32) * {scale}}}
"""


def test_a_failed_export_leaves_the_model_folder_as_it_was_and_says_which_versions_it_orphans(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Export copies a model's code into its folder, which its versions share: a version 2 whose
    export failed had replaced the code version 1 was exported with, and version 1 was refused
    at its next load."""
    from service.cli import main

    item = tmp_path / "item.json"
    item.write_text('{"x": [1, 2, 3, 4]}')

    def export(version: int, fails: str, scale: float, formats: str = "onnx") -> int:
        source = tmp_path / f"src{version}-{scale}"
        source.mkdir()
        (source / "records.py").write_text(RECORDS.format(fails=fails, scale=scale))
        (source / "spec.yaml").write_text("kind: python\nmodule: records\nclass: Records\n")
        return main(
            [
                "export",
                "tests.user_models:make_linear",
                *("--name", "tab", "--version", str(version)),
                *("--repository", str(tmp_path / "models")),
                *("--input", "x:FP32:4", "--output", "y:FP32:2", "--max-batch-size", "4"),
                *("--formats", formats, "--preprocessing", str(source / "spec.yaml")),
                *("--answer-items", str(item)),
            ]
        )

    folder = tmp_path / "models" / "tab"
    assert export(1, "pass", 1.0) == 0
    code = (folder / "records.py").read_text()
    with caplog.at_level(logging.ERROR, logger="tensorgate.export"):
        assert export(2, "raise RuntimeError('oops')", 2.0) == 1  # one line, no traceback
    assert any("RuntimeError: oops at records.py:" in r.getMessage() for r in caplog.records), (
        caplog.text
    )
    assert (folder / "records.py").read_text() == code  # version 1's code, as exported
    assert sorted(p.name for p in folder.iterdir()) == ["1", "config.yaml", "records.py"]
    with caplog.at_level(logging.WARNING, logger="tensorgate.export"):
        assert export(2, "pass", 3.0) == 0  # other code, exported: version 1 is orphaned
    assert any(
        "version 1 of tab was exported with other code (records.py)" in r.getMessage()
        for r in caplog.records
    )
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="tensorgate.export"):
        assert export(3, "pass", 3.0, formats="torchscript") == 0  # config.yaml now torchscript
    lacking = [r.getMessage() for r in caplog.records if "artifact" in r.getMessage()]
    assert [m.split(" has no")[0] for m in lacking] == ["version 1 of tab", "version 2 of tab"]
    assert "no torchscript artifact (it has onnx)" in lacking[0]


def test_the_command_line_s_tensors_say_what_is_wrong_with_them() -> None:
    assert parse_tensor("cls:INT64").shape == () == parse_tensor("cls:INT64:").shape
    with pytest.raises(SystemExit, match=r"tensor 'x:FLOAT:6': datatype: Input should be 'BOOL'"):
        parse_tensor("x:FLOAT:6")  # pydantic's words, without its link
    x, other_x = parse_tensor("x:FP32:4"), parse_tensor("x:FP32:2")
    with pytest.raises(SystemExit, match=r"tensor names must differ: \['x'\] named more than once"):
        check_tensors([x, other_x], [parse_tensor("y:FP32:2")], "")
    with pytest.raises(SystemExit, match=r"--buckets 8,16: no input has a dynamic \(-1\) dim"):
        check_tensors([x], [parse_tensor("y:FP32:2")], "8,16")
    check_tensors([parse_tensor("ids:INT64:-1")], [parse_tensor("y:FP32:-1,2")], "8,16")


FACTORIES = """
import torch

def needs_arg(width):
    return torch.nn.Linear(width, 2)

def make():
    return torch.nn.Linear(3, 2)

NOT_A_MODULE = 3
"""


def test_a_factory_that_cannot_be_called_bare_is_one_line_naming_why(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """It was a traceback ending in TypeError, where every other bad factory is one line."""
    (tmp_path / "factories.py").write_text(FACTORIES)
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(
        SystemExit,
        match=r"factories:needs_arg must be callable with no arguments .*missing a required "
        r"argument: 'width'",
    ):
        load_module("factories:needs_arg")
    with pytest.raises(SystemExit, match=r"factories:NOT_A_MODULE is a int: name a torch.nn"):
        load_module("factories:NOT_A_MODULE")
    assert isinstance(load_module("factories:make"), torch.nn.Linear)


def test_a_spec_file_wrapped_in_preprocessing_says_to_unwrap_it(tmp_path: Path) -> None:
    """A user copying config.yaml's block into spec.yaml read pydantic's "Unable to extract tag
    using discriminator 'kind'"."""
    spec = tmp_path / "spec.yaml"
    spec.write_text("preprocessing:\n  kind: image\n  resize: 8\n")
    with pytest.raises(
        ValueError, match=r"this file is the spec itself.*drop the 'preprocessing:'"
    ):
        read_spec(spec, tmp_path / "out", Overwrites())
    spec.write_text("kind: image\nresize: 8\n")
    assert read_spec(spec, tmp_path / "out", Overwrites()).kind == "image"


MAKES = """
import numpy as np

from preprocessing.pipeline import Pipeline


class Records(Pipeline):
    raw_input = "record"

    def preprocess(self, item, context):
        features = np.asarray(item.json()["features"], np.float32)
        return {MADE}
"""

STEPS = """
import numpy as np

from preprocessing.pipeline import Pipeline


class Records(Pipeline):
    raw_input = "record"

    def preprocess(self, item, context):
        found = self.models.infer("detector", {"image": np.zeros((1, 2), np.float32)})
        return {"features": found["boxes"][:, :2].astype(np.float32)}
"""


class Casting(torch.nn.Module):
    """A module that takes any float dtype: export's run of it cannot see the pipeline's."""

    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Linear(2, 3)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.net(features.float())


def export_records(
    root: Path, code: str, code_in: str = "records", code_folder: bool = True, version: int = 1
) -> Path:
    """Export :class:`Casting` with ``code`` (``records.py``, written in ``root / code_in``)
    as the pipeline of ``root / "records"``: the answer item's path. ``code_folder``: name
    the code's folder to export_model (else it looks in the model's own)."""
    (root / code_in).mkdir(exist_ok=True)
    (root / code_in / "records.py").write_text(code)
    item = root / "example.json"
    item.write_text(json.dumps({"features": [0.5, -1.0]}))
    export_model(
        Casting(),
        root / "records" / str(version),
        name="records",
        inputs=[TensorConfig(name="features", datatype="FP32", shape=(2,))],
        outputs=[TensorConfig(name="logits", datatype="FP32", shape=(3,))],
        golden_inputs=None,
        max_batch_size=8,
        preprocessing=PythonSpec.model_validate(
            {"kind": "python", "module": "records", "class": "Records"}
        ),
        answer_items=[item],
        code_folder=root / code_in if code_folder else None,
        formats=("onnx",),
    )
    return item


@pytest.mark.parametrize(
    ("made", "said"),
    [
        (  # exported as float64, then every load refused it ("the graph has FP64 [2]")
            '{"features": features.astype(np.float64)}',
            "its pipeline made 'features' float64, the model takes FP32: return it "
            ".astype(np.float32) from the pipeline's code (numpy computes in float64 where a "
            "float64 array, a list's too, takes part)",
        ),
        (  # a KeyError traceback
            '{"feats": features}',
            "its pipeline made inputs ['feats'], the model takes ['features']",
        ),
        (  # blamed --input: "the module fails on inputs of the declared shapes"
            '{"features": features[:1]}',
            "the item preprocesses to 'features' [1], the model takes [2]",
        ),
    ],
)
def test_a_pipeline_that_makes_what_the_model_does_not_take_is_refused_at_export(
    tmp_path: Path, made: str, said: str
) -> None:
    with pytest.raises(ExportError) as refused:
        export_records(tmp_path, MAKES.replace("{MADE}", made))
    assert str(refused.value) == (
        f"the pipeline's preprocessing of {tmp_path / 'example.json'}: {said} (check its "
        "preprocess, and --input)"
    )
    assert not (tmp_path / "records" / "1").exists()  # nothing left that a load would refuse


def test_a_pipeline_that_fails_on_an_answer_item_is_said_before_anything_is_compiled(
    tmp_path: Path,
) -> None:
    """Its postprocess failing on an item was found only once ONNX and pt2 had been made
    (25 s on a small model): now before any artifact."""
    failing = MAKES.replace("{MADE}", '{"features": features}') + (
        "\n    def postprocess(self, outputs, context):\n        raise KeyError('label')\n"
    )
    compiled: list[exporter._Job] = []
    original = exporter._onnx_step

    def step(job: exporter._Job) -> exporter.Artifact:
        compiled.append(job)
        return original(job)

    with (
        mock.patch.dict(exporter._STEPS, {"onnx": step}),
        pytest.raises(ExportError) as refused,
    ):
        export_records(tmp_path, failing)
    assert "the pipeline failed on" in str(refused.value)
    assert "KeyError: 'label'" in str(refused.value)
    assert compiled == []


def test_a_pipeline_calling_a_model_export_was_not_given_says_how_to_give_it(
    tmp_path: Path,
) -> None:
    """It said "KeyError: no model 'detector' here (LocalModels has [])" at pipeline.py."""
    with pytest.raises(ExportError) as refused:
        export_records(tmp_path, STEPS)
    assert "no model 'detector' here (LocalModels has [])" in str(refused.value)
    assert "export_model(..., models=LocalModels({'detector': a function of a batch}))" in str(
        refused.value
    )


def test_code_outside_the_model_folder_is_refused_at_export(tmp_path: Path) -> None:
    """export_model(code_folder=<the user's source folder>) exported, and wrote no code where
    the server imports it from: every load then failed ("cannot read records.py")."""
    with pytest.raises(ExportError, match="code_folder .* is not the model's folder"):
        export_records(tmp_path, MAKES.replace("{MADE}", '{"features": features}'), "src")


def test_export_model_says_which_versions_were_exported_with_other_code(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Only `tensorgate export` said so; a pipeline that calls other models is exported from
    Python, and its version 1 was then refused at load without a word."""
    export_records(tmp_path, MAKES.replace("{MADE}", '{"features": features}'))
    other = MAKES.replace("{MADE}", '{"features": features * 1}')
    with caplog.at_level(logging.WARNING, logger="tensorgate.export"):
        export_records(tmp_path, other, version=2)
    assert "version 1 of records was exported with other code (records.py)" in caplog.text


def test_code_not_in_the_model_folder_says_export_model_copies_nothing(tmp_path: Path) -> None:
    """Without code_folder it was a ModelLoadError traceback: "preprocessing: cannot read"."""
    made = MAKES.replace("{MADE}", '{"features": features}')
    with pytest.raises(ExportError) as refused:
        export_records(tmp_path, made, "src", code_folder=False)
    said = str(refused.value)
    assert "records.py" in said and "export_model imports a kind: python pipeline's code" in said
    assert f"from the model's folder ({tmp_path / 'records'}" in said
