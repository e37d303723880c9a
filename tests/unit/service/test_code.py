"""A model's own code as part of its artifact: what export records of it, and the gates."""

from __future__ import annotations

import importlib.metadata
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

from preprocessing.pipeline import BadInput, Item, ItemsDiffer, Pipeline, Rows, answer_one, stack
from preprocessing.spec import PythonSpec, spec_hash
from service.artifacts.code import AnswerPair, check_answers, check_code, code_facts
from service.errors import ModelLoadError
from service.pipelines.code import load_pipeline

pytestmark = pytest.mark.unit

SPEC = PythonSpec.model_validate({"kind": "python", "module": "main", "class": "Doubler"})


def write_code(folder: Path) -> None:
    (folder / "helpers").mkdir(parents=True)
    (folder / "main.py").write_text(
        "import numpy as np\nimport json, os.path\nfrom .util import twice\n"
        "from .helpers import deep\nfrom preprocessing.pipeline import Pipeline\n\n"
        "class Doubler(Pipeline):\n"
        "    def preprocess(self, item, context):\n"
        "        return {'x': np.asarray([twice(item.json())], dtype=np.float32)}\n"
    )
    (folder / "util.py").write_text("def twice(v):\n    return 2 * v\n")
    (folder / "helpers" / "__init__.py").write_text("from . import deep\n")
    (folder / "helpers" / "deep.py").write_text("DEPTH = 1\n")
    (folder / "unused.py").write_text("raise SystemExit('never imported')\n")


def test_code_facts_hash_the_module_and_the_local_modules_it_imports_only(tmp_path: Path) -> None:
    write_code(tmp_path)
    facts = code_facts(SPEC, tmp_path)
    assert sorted(facts.files) == ["helpers/__init__.py", "helpers/deep.py", "main.py", "util.py"]
    # third-party distributions only: not the standard library, not tensorgate's own packages
    assert facts.packages == {"numpy": importlib.metadata.version("numpy")}


@pytest.mark.parametrize("statement", ["import util", "from util import twice"])
def test_an_absolute_import_of_a_module_beside_the_code_is_refused_saying_how(
    tmp_path: Path, statement: str
) -> None:
    """Export copied the code without it, and its load failed with a bare ModuleNotFoundError:
    the model's folder is a package of its own, never on sys.path."""
    write_code(tmp_path)
    main = tmp_path / "main.py"
    main.write_text(main.read_text().replace("from .util import twice", statement))
    with pytest.raises(ModelLoadError) as refused:
        code_facts(SPEC, tmp_path)
    assert str(refused.value) == (
        "preprocessing: main.py imports util, a module beside it, absolutely: import it "
        "relatively (from . import util, or from .util import ...): the model's folder is "
        "imported as a package of its own, never from sys.path"
    )


def test_the_code_gate_names_the_file_that_changed_or_the_distribution(tmp_path: Path) -> None:
    write_code(tmp_path)
    recorded = code_facts(SPEC, tmp_path)
    check_code(recorded, code_facts(SPEC, tmp_path))
    (tmp_path / "helpers" / "deep.py").write_text("DEPTH = 2\n")
    with pytest.raises(ModelLoadError, match=r"helpers/deep.py changed since export"):
        check_code(recorded, code_facts(SPEC, tmp_path))
    older = type(recorded)(recorded.files, {"numpy": "1.0.0"})
    write_code(tmp_path / "again")
    with pytest.raises(ModelLoadError, match=r"imports numpy 2\..*exported with numpy 1\.0\.0"):
        check_code(older, code_facts(SPEC, tmp_path / "again"))


def test_a_pipeline_loads_from_its_folder_and_relative_imports_work(tmp_path: Path) -> None:
    write_code(tmp_path)
    pipeline = load_pipeline(SPEC, tmp_path, "doubler")
    assert pipeline.preprocess(Item(value=3), {})["x"].tolist() == [6.0]
    (tmp_path / "util.py").write_text(
        "def twice(v):\n    return 20 * v\n"
    )  # same size, same second
    again = load_pipeline(SPEC, tmp_path, "doubler")
    assert again.preprocess(Item(value=3), {})["x"].tolist() == [60.0]  # sources, never stale .pyc


def test_models_whose_names_differ_only_in_punctuation_run_their_own_code(tmp_path: Path) -> None:
    """``lz-x`` and ``lz_x`` were both imported as the package ``lz_x``: a lazy import of one
    model's module ran the other's."""
    for name, factor in (("lz-x", 2), ("lz_x", 3), ("lz.x", 4)):
        write_code(tmp_path / name)
        (tmp_path / name / "main.py").write_text(
            "import numpy as np\nfrom preprocessing.pipeline import Pipeline\n\n"
            "class Doubler(Pipeline):\n"
            "    def preprocess(self, item, context):\n"
            "        from .util import twice  # at the first request, as code may\n\n"
            "        return {'x': np.asarray([twice(item.json())], dtype=np.float32)}\n"
        )
        (tmp_path / name / "util.py").write_text(f"def twice(v):\n    return {factor} * v\n")
    pipelines = {
        name: load_pipeline(SPEC, tmp_path / name, name) for name in ("lz-x", "lz_x", "lz.x")
    }
    answers = {n: p.preprocess(Item(value=1), {})["x"].tolist() for n, p in pipelines.items()}
    assert answers == {"lz-x": [2.0], "lz_x": [3.0], "lz.x": [4.0]}


def test_a_class_that_is_not_a_pipeline_or_fails_to_build_is_one_line(tmp_path: Path) -> None:
    (tmp_path / "main.py").write_text("class Doubler:\n    pass\n")
    with pytest.raises(ModelLoadError, match="not a subclass of preprocessing.pipeline.Pipeline"):
        load_pipeline(SPEC, tmp_path, "m")
    (tmp_path / "main.py").write_text(
        "from preprocessing.pipeline import Pipeline\nclass Doubler(Pipeline):\n"
        "    def __init__(self):\n        raise ValueError('no stats')\n"
    )
    with pytest.raises(ModelLoadError, match=r"ValueError: no stats at main.py:4"):
        load_pipeline(SPEC, tmp_path, "m")
    (tmp_path / "feats.py").write_text("SCALE = 2\n")
    (tmp_path / "main.py").write_text("from feats import SCALE\n")  # as if it were on sys.path
    with pytest.raises(ModelLoadError, match=r"import it relatively \(from \.feats import"):
        load_pipeline(SPEC, tmp_path, "m")


def test_the_spec_hash_covers_the_params() -> None:
    other = SPEC.model_copy(update={"params": {"scale": 2}})
    assert spec_hash(other) != spec_hash(SPEC)


def test_answers_compare_numbers_within_tolerance_and_the_rest_exactly() -> None:
    pair = AnswerPair("a.json", None, {"label": "cat", "scores": [0.5, 0.25], "n": 2})
    check_answers([pair], lambda _: {"label": "cat", "scores": [0.50001, 0.25], "n": 2}, 1e-3, 1e-4)
    for wrong, where in [
        ({"label": "dog", "scores": [0.5, 0.25], "n": 2}, "answer.label is 'dog'"),
        ({"label": "cat", "scores": [0.6, 0.25], "n": 2}, r"answer.scores\[0\] is 0.6"),
        ({"label": "cat", "scores": [0.5], "n": 2}, "answer.scores has 1 entries, exported 2"),
    ]:
        with pytest.raises(ModelLoadError, match=where):
            check_answers([pair], lambda _, w=wrong: w, 1e-3, 1e-4)


class _Rows(Pipeline):
    def preprocess(self, item: Item, context: dict[str, object]) -> dict[str, np.ndarray]:
        context["n"] = len(item.json())
        return {"x": np.asarray(item.json(), dtype=np.float32)}

    def postprocess(self, outputs: Mapping[str, np.ndarray], context: dict[str, object]) -> object:
        return {"sum": float(outputs["x"].sum()), "n": context["n"]}


def test_answer_one_is_preprocess_run_postprocess_with_the_context_carried() -> None:
    answer = answer_one(_Rows(), Item(b"[1, 2, 3]", "application/json"), lambda batch: batch)
    assert answer == {"sum": 6.0, "n": 3}


@pytest.mark.parametrize("raw", [[1, 2, 3], b"[1, 2, 3]"])
def test_answer_one_takes_raw_items_as_pipeline_dataset_does(raw: object) -> None:
    """The docs pair PipelineDataset(pipeline, items, labels), which takes raw JSON values or
    bytes, with answer_one: given a record, it failed in the user's own code ('dict' object has
    no attribute 'json')."""
    assert answer_one(_Rows(), raw, lambda batch: batch) == {"sum": 6.0, "n": 3}


def test_stack_refuses_items_of_different_shapes_as_bad_input() -> None:
    assert stack([{"x": np.zeros(2)}, {"x": np.ones(2)}])["x"].shape == (2, 2)
    with pytest.raises(BadInput, match=r"items make 'x' of different shapes \(\[2\], \[3\]\)"):
        stack([{"x": np.zeros(2)}, {"x": np.zeros(3)}])


def test_rows_make_what_stack_makes_each_row_into_its_place_from_any_thread() -> None:
    rows = [{"x": np.full((3, 2), i, np.float32), "m": np.arange(4) + i} for i in range(64)]
    into = Rows(len(rows))
    with ThreadPoolExecutor(4) as pool:  # put in whatever order the threads finish
        list(pool.map(lambda i: into.put(i, rows[i]), reversed(range(len(rows)))))
    batch = into.batch()
    assert batch.keys() == {"x", "m"}
    for name, array in batch.items():
        stacked = np.stack([row[name] for row in rows])
        assert array.dtype == stacked.dtype and np.array_equal(array, stacked)


def test_rows_refuse_items_whose_rows_differ_in_shape_as_bad_input() -> None:
    into = Rows(2)
    into.put(0, {"x": np.zeros(2)})
    into.put(1, {"x": np.zeros(3)})
    with pytest.raises(BadInput, match=r"'x' of different shapes \(\[2\], \[3\]\)"):
        into.batch()


@pytest.mark.parametrize(
    ("first", "second", "message"),
    [
        ({"x": np.zeros(2)}, {"y": np.zeros(2)}, "item 0 makes ['x'], item 1 ['y']"),
        ({"x": np.zeros(2)}, {"x": np.zeros(2), "y": np.zeros(2)}, "item 1 ['x', 'y']"),
        ({"x": np.zeros(2), "y": np.zeros(2)}, {"x": np.zeros(2)}, "item 0 makes ['x', 'y']"),
    ],
)
@pytest.mark.parametrize("order", [(0, 1), (1, 0)])
def test_rows_whose_input_names_differ_are_the_codes_mistake(
    first: dict[str, np.ndarray],
    second: dict[str, np.ndarray],
    message: str,
    order: tuple[int, int],
) -> None:
    """Whichever row comes first (the pool's first to finish): the same error, naming both
    items; not the client's BadInput (a 400), as it was."""
    into = Rows(2)
    rows = (first, second)
    for index in order:
        into.put(index, rows[index])
    with pytest.raises(ItemsDiffer) as differ:
        into.batch()
    assert str(differ.value).startswith("items make different inputs: item 0 makes ")
    assert message in str(differ.value)
    assert not isinstance(differ.value, BadInput)


@pytest.mark.parametrize(
    "rows",
    [
        [np.asarray([1, 2]), np.asarray([1.5, 2.0]), np.asarray([3, 4])],  # ints, floats
        [np.zeros(2, np.float32), np.ones(2, np.float64)],
        [np.array(["ab"]), np.array(["abcd"])],
        [np.zeros(2, ">f8"), np.ones(2, "<f8")],
    ],
)
def test_rows_widen_datatypes_as_stacking_does(rows: list[np.ndarray]) -> None:
    items = [{"x": row} for row in rows]
    into = Rows(len(items))
    for index, row in enumerate(items):
        into.put(index, row)
    stacked = np.stack(rows)
    assert into.batch()["x"].dtype == stacked.dtype
    assert np.array_equal(into.batch()["x"], stacked)
    streamed = stack(iter(items), len(items))["x"]  # a generator, as preprocess_batch passes
    assert streamed.dtype == stacked.dtype and np.array_equal(streamed, stacked)


def test_an_item_is_bytes_text_or_json_as_sent() -> None:
    assert Item(value={"a": 1}).bytes() == b'{"a":1}'
    assert Item(value="héllo").text() == "héllo" and Item(value="s").json() == "s"
    assert Item(b'{"a": 1}').json() == {"a": 1}
    with pytest.raises(BadInput, match="not valid JSON"):
        Item(b"{").json()
    with pytest.raises(BadInput, match="UTF-8"):
        Item(b"\xff").text()


def test_names_the_server_adds_must_not_be_the_models_own() -> None:
    """A request could not say which it meant: the load (and the export) refuses them."""
    from preprocessing.pipeline import Pipeline
    from service.errors import ModelLoadError
    from service.model_config import TensorConfig
    from service.pipelines.inputs import check_names

    class Answers(Pipeline):
        raw_input = "features"

        def postprocess(self, outputs: object, context: object) -> object:
            return outputs

    features = TensorConfig(name="features", datatype="FP32", shape=(3,))
    other = TensorConfig(name="x", datatype="FP32", shape=(3,))
    answer = TensorConfig(name="answer", datatype="FP32", shape=(3,))
    classification = TensorConfig(name="classification", datatype="FP32", shape=(3,))
    with pytest.raises(ModelLoadError, match="raw input 'features' is also an input"):
        check_names(Answers(), [features], [other], classifies=False)
    with pytest.raises(ModelLoadError, match="an output named 'answer'"):
        check_names(Answers(), [other], [answer], classifies=False)
    with pytest.raises(ModelLoadError, match="an output named 'classification'"):
        check_names(None, [other], [classification], classifies=True)
    check_names(None, [features], [answer, classification], classifies=False)  # a plain model
