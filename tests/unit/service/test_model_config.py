import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
from pydantic import ValidationError

from service.errors import ModelLoadError, ModelLoadRefused
from service.model_config import VersionPolicy, load_model_config
from service.repository.models import ModelRepository, select_versions
from service.repository.serving import ServedVersion
from service.settings import Settings
from tests.identity import write_identity_model


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "config.yaml"
    path.write_text(text)
    return path


def test_a_minimal_config_names_only_the_backend(tmp_path: Path) -> None:
    config = load_model_config(write(tmp_path, "backend: onnx\n"))
    assert config.backend == "onnx"
    assert config.max_batch_size == 0
    assert config.version_policy.latest == 1


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (  # pydantic's "Extra inputs are not permitted", at every level
            "backend: onnx\nmax_batch_sise: 16\n",
            "max_batch_sise: not a setting here; did you mean max_batch_size?",
        ),
        (
            "backend: onnx\nbatching: {max_queue_delay_mss: 2}\n",
            "batching.max_queue_delay_mss: not a setting here; did you mean max_queue_delay_ms?",
        ),
        (
            "backend: onnx\npreprocessing: {kind: image, resize: 8, crop: 8, meen: [0, 0, 0]}\n",
            "preprocessing.meen: not a setting here; did you mean mean?",
        ),
        (
            "backend: onnx\ninputs: [{name: x, datatype: FP32, shape: [3], rnage: [0, 1]}]\n",
            "inputs.0.rnage: not a setting here; did you mean range?",
        ),
        (  # the key a config writes, not the field's name (cls)
            "backend: onnx\npreprocessing: {kind: python, module: p, clas: P}\n",
            "preprocessing.class: Field required; preprocessing.clas: not a setting here; did "
            "you mean class?",
        ),
        (  # PyYAML's four lines, naming "<unicode string>"
            "backend: onnx\nmax_batch_size: [16\n",
            "cannot read YAML: line 3, column 1: expected ',' or ']', but got '<stream end>' "
            "(while parsing a flow sequence, which began at line 2, column 17)",
        ),
    ],
)
def test_a_misspelt_key_or_broken_yaml_is_one_line_saying_where(
    tmp_path: Path, text: str, message: str
) -> None:
    path = write(tmp_path, text)
    with pytest.raises(ModelLoadError) as caught:
        load_model_config(path)
    assert str(caught.value) == f"{path}: {message}"


def test_an_empty_config_says_so(tmp_path: Path) -> None:
    """It said "expected a mapping of settings, got NoneType"."""
    path = write(tmp_path, "# nothing yet\n")
    with pytest.raises(ModelLoadError, match="config.yaml is empty: a model's config names its"):
        load_model_config(path)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("backend: tensorflow\n", "backend: Input should be 'onnx', 'torchscript' or 'pt2'"),
        ("max_batch_size: 4\n", "backend: Field required"),
        ("backend: onnx\nmax_batch_size: -1\n", "max_batch_size: Input should be greater than"),
        (
            "backend: onnx\nwarmup: {batch_sizes: [1, 0]}\n",
            "warmup.batch_sizes: batch sizes must be ≥ 1",
        ),
        ("backend: onnx\ninputs: [{name: x, datatype: FLOAT, shape: [3]}]\n", "inputs.0.datatype"),
        (
            "backend: onnx\ninputs: [{name: x, datatype: FP32, shape: [0]}]\n",
            "inputs.0.shape: each dim must be -1",
        ),
        ("backend: onnx\nbatch_size: 4\n", "batch_size: not a setting here; did you mean"),
        (
            "backend: onnx\npreprocessing: {kind: image, mean: [1, 2]}\n",
            "preprocessing.mean: has 2 values",
        ),
        ("backend: onnx\ndevice: gpu\n", "device: String should match pattern"),
        ("- a list\n", "expected a mapping of settings, got list"),
        ("backend: [unclosed\n", "cannot read YAML"),
    ],
)
def test_errors_name_the_file_and_the_field(tmp_path: Path, text: str, message: str) -> None:
    path = write(tmp_path, text)
    with pytest.raises(ModelLoadError) as caught:
        load_model_config(path)
    assert str(caught.value).startswith(f"{path}: ")
    assert message.split(":")[0] in str(caught.value)
    assert message.split(": ", 1)[-1].split(" (")[0][:30] in str(caught.value)
    assert str(caught.value).count("(got ") <= 1  # a validator's own was said twice


@pytest.mark.parametrize(
    ("policy", "expected"),
    [
        (VersionPolicy(latest=1), [7]),
        (VersionPolicy(latest=2), [3, 7]),
        (VersionPolicy(specific=(1, 3, 9)), [1, 3]),
        (VersionPolicy(all=True), [1, 3, 7]),
    ],
)
def test_version_policy_selects_versions(policy: VersionPolicy, expected: list[int]) -> None:
    assert select_versions([1, 3, 7], policy) == expected


@pytest.mark.parametrize(
    ("policy", "named"),
    [
        ({"latest": 1, "all": True}, "latest and all: true"),
        ({"latest": 2, "specific": [1]}, "latest and specific"),
        ({"specific": [1], "all": True}, "specific and all: true"),
        ({"specific": [], "latest": 2}, "latest and specific"),
    ],
)
def test_a_version_policy_naming_two_is_refused(policy: dict[str, object], named: str) -> None:
    """``{latest: 1, all: true}`` loaded every version without a word (all won)."""
    with pytest.raises(ValidationError) as caught:
        VersionPolicy.model_validate(policy)
    assert f"name one of latest, specific and all: true (got {named})" in str(caught.value)
    assert VersionPolicy.model_validate({"latest": 2, "all": False}).latest == 2


def test_a_value_range_is_written_only_when_set() -> None:
    """Manifests and configs without one stay readable by servers that predate the field."""
    from service.model_config import TensorConfig

    plain = TensorConfig(name="x", datatype="FP32", shape=(3,))
    assert "range" not in plain.model_dump_json()
    ids = TensorConfig(name="ids", datatype="INT64", shape=(-1,), range=(0, 30521))
    assert TensorConfig.model_validate_json(ids.model_dump_json()) == ids
    with pytest.raises(ValueError, match="BYTES values have no range"):
        TensorConfig(name="s", datatype="BYTES", shape=(1,), range=(0, 1))
    with pytest.raises(ValueError, match="low ≤ high"):
        TensorConfig(name="x", datatype="FP32", shape=(1,), range=(2, 1))


def test_a_warmup_of_more_rows_than_the_bound_is_refused_naming_it(tmp_path: Path) -> None:
    """#28 finding 13: ``warmup: all`` with ``max_batch_size: 100000`` ran for hours."""
    path = tmp_path / "config.yaml"
    path.write_text("backend: onnx\nmax_batch_size: 100000\nwarmup: {batch_sizes: all}\n")
    with pytest.raises(
        ModelLoadError, match=r"warmup runs 5000050000 rows in all .* at most 16384"
    ):
        load_model_config(path)
    path.write_text(
        "backend: onnx\nmax_batch_size: 100000\nwarmup: {batch_sizes: [1, 64, 100000]}\n"
    )
    with pytest.raises(ModelLoadError, match="warmup runs 100065 rows"):
        load_model_config(path)
    path.write_text("backend: onnx\nmax_batch_size: 180\nwarmup: {batch_sizes: all}\n")
    assert load_model_config(path).max_batch_size == 180  # 16,290 rows: within


def test_a_model_folder_without_config_is_named_in_the_log_not_skipped_silently(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A new user's folder of only ``1/model.onnx`` was skipped with no word: 404 for the
    model, ready with nothing served. It is still not a model, and the log says why."""
    write_identity_model(tmp_path / "served", datatypes=("FP32",))
    write_identity_model(tmp_path / "plain", datatypes=("FP32",))
    (tmp_path / "plain" / "config.yaml").unlink()
    (tmp_path / "notes").mkdir()  # not a model either, and nothing like one
    (tmp_path / "loose").mkdir()  # a model file where its version folder should be
    (tmp_path / "plain" / "1" / "model.onnx").rename(tmp_path / "loose" / "model.onnx")
    repository = ModelRepository(Settings(model_repository=tmp_path))
    with caplog.at_level("WARNING", logger="tensorgate.repository"):
        repository.scan()
    assert set(repository.models) == {"served"}
    loose, plain = [r.getMessage() for r in caplog.records]
    assert str(tmp_path / "plain") in plain and "has version folders but no config.yaml" in plain
    assert str(tmp_path / "loose") in loose
    assert "holds model.onnx outside a version folder" in loose and "loose/1/model.onnx" in loose


def test_the_index_lists_the_models_tg_models_leaves_out_as_unloaded(tmp_path: Path) -> None:
    """As Triton's index does in explicit mode: an operator may load them through the API, so
    the index says they are there (it listed only what TG_MODELS named)."""
    for name in ("chosen", "other"):
        write_identity_model(tmp_path / name, datatypes=("FP32",))
    repository = ModelRepository(Settings(model_repository=tmp_path, models=["chosen"]))
    repository.scan()
    assert set(repository.models) == {"chosen"}
    rows = {row["name"]: row for row in repository.index()}
    assert rows["other"] == {
        "name": "other",
        "state": "UNLOADED",
        "reason": "not loaded: TG_MODELS does not name it (load it)",
    }
    assert rows["chosen"]["state"] == "LOADING"  # scanned, its load not run here


def test_poll_keeps_a_model_loaded_through_the_api_that_tg_models_leaves_out(
    tmp_path: Path,
) -> None:
    """--poll read a loaded model TG_MODELS does not name as gone, and unloaded it 0.4 s
    after the operator loaded it (as the index invites)."""
    for name in ("chosen", "other"):
        write_identity_model(tmp_path / name, datatypes=("FP32",))
    settings = Settings(model_repository=tmp_path, models=["chosen"], intra_op_threads=1)
    repository = ModelRepository(settings)
    try:
        repository.scan()
        repository.load_all()
        repository.load_model("other")
        assert repository.changes() == ([], [])
        (tmp_path / "other" / "config.yaml").write_text(
            (tmp_path / "other" / "config.yaml").read_text() + "\n# changed\n"
        )
        assert repository.changes() == (["other"], [])  # reloaded when it changes
        shutil.rmtree(tmp_path / "other")
        assert repository.changes() == ([], ["other"])  # and let go once its folder is gone
    finally:
        repository.close()


@pytest.fixture
def unloaded(tmp_path: Path) -> Iterator[ModelRepository]:
    """A repository of one model, ``m``, loaded and then unloaded through the API."""
    write_identity_model(tmp_path / "m", datatypes=("FP32",))
    repository = ModelRepository(Settings(model_repository=tmp_path, intra_op_threads=1))
    try:
        repository.scan()
        repository.load_all()
        repository.unload_model("m")
        yield repository
    finally:
        repository.close()


def test_poll_leaves_a_held_unload_and_forgets_it_once_its_folder_is_gone(
    unloaded: ModelRepository, tmp_path: Path
) -> None:
    """An API unload holds through --poll's reloads (also one the poll had already chosen to
    run), and an unloaded model whose folder goes is forgotten too."""
    config = tmp_path / "m" / "config.yaml"
    config.write_text(config.read_text() + "\n# changed\n")
    assert unloaded.changes() == ([], [])
    assert unloaded.load_model("m", polled=True).unloaded  # chosen before the unload
    assert unloaded.index() == [{"name": "m", "state": "UNLOADED", "reason": "unloaded"}]
    shutil.rmtree(tmp_path / "m")
    assert unloaded.changes() == ([], ["m"])
    unloaded.unload_model("m", requested=False)
    assert unloaded.index() == [] and "m" not in unloaded.models


class _Interrupted(BaseException):
    """What a model's own code may raise that is no Exception."""


def test_a_load_that_raises_leaves_no_loading_stand_in(
    unloaded: ModelRepository, monkeypatch: pytest.MonkeyPatch
) -> None:
    shown: list[str] = []

    def interrupted(entry: object) -> None:
        shown.append(unloaded.index()[0]["state"])  # the stand-in, while it loads
        raise _Interrupted

    monkeypatch.setattr(unloaded, "_load_entry", interrupted)
    with pytest.raises(_Interrupted):
        unloaded.load_model("m")
    assert shown == ["LOADING"]
    assert unloaded.index() == [{"name": "m", "state": "UNLOADED", "reason": "unloaded"}]


def test_a_reload_keeps_the_unchanged_versions_serving_and_loads_the_rest(
    tmp_path: Path,
) -> None:
    """A reload loaded and warmed every version again, also those whose files had not changed
    (and briefly held two copies of each). Now only a changed version loads; a change to the
    config (or to any file outside the version folders) loads them all."""
    folder = tmp_path / "m"
    write_identity_model(folder, datatypes=("FP32",), version_policy="{all: true}")
    shutil.copytree(folder / "1", folder / "2")
    repository = ModelRepository(Settings(model_repository=tmp_path, intra_op_threads=1))

    def served() -> dict[int, ServedVersion]:
        """Each version serving, by its number."""
        versions = repository.models["m"].versions.items()
        return {n: v.served for n, v in versions if v.served is not None}

    try:
        repository.scan()
        repository.load_all()
        first = served()
        assert set(first) == {1, 2}  # both serve

        repository.load_model("m")  # nothing changed: both serve on, nothing loaded
        assert served() == first and not any(s.closing for s in first.values())

        model = folder / "2" / "model.onnx"
        stat = model.stat()  # a new time (as a copy over it gives): version 2 changed
        os.utime(model, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000))
        repository.load_model("m")
        second = served()
        assert second[1] is first[1] and second[2] is not first[2]
        assert first[2].closing and not first[1].closing

        model.write_bytes(b"not onnx")  # a reload refused keeps what serves, closes nothing
        with pytest.raises(ModelLoadRefused, match="version 2"):
            repository.load_model("m")
        assert served() == second and not any(s.closing for s in second.values())
        shutil.rmtree(folder / "2")
        shutil.copytree(folder / "1", folder / "2")

        config = folder / "config.yaml"
        config.write_text(config.read_text() + "# changed\n")  # every version loads again
        repository.load_model("m")
        third = served()
        assert not set(map(id, third.values())) & set(map(id, second.values()))
        assert all(s.closing for s in second.values())
    finally:
        repository.close()


def test_a_reload_loads_a_version_changed_with_its_old_times_or_through_a_link(
    tmp_path: Path,
) -> None:
    """Size and modification time alone kept a version whose file was replaced by one of the
    same size with the old time copied on (``cp -p``, ``rsync -a``), or changed inside a
    folder linked into it: the old model served on, silently."""
    folder = tmp_path / "m"
    write_identity_model(folder, datatypes=("FP32",))
    store = tmp_path / "store"
    (store / "a").mkdir(parents=True)
    (store / "a" / "vocab.txt").write_text("a b\n")
    (folder / "1" / "assets").symlink_to(store / "a")
    repository = ModelRepository(Settings(model_repository=tmp_path, intra_op_threads=1))
    try:
        repository.scan()
        repository.load_all()
        first = repository.models["m"].versions[1].served

        model = folder / "1" / "model.onnx"
        stat = model.stat()
        replaced = tmp_path / "replaced.onnx"
        replaced.write_bytes(model.read_bytes())  # the same size (and bytes, here)
        os.utime(replaced, ns=(stat.st_atime_ns, stat.st_mtime_ns))  # and the old times
        os.replace(replaced, model)
        repository.load_model("m")
        second = repository.models["m"].versions[1].served
        assert second is not first

        (store / "a" / "vocab.txt").write_text("b a\n")  # the same length, through the link
        repository.load_model("m")
        assert repository.models["m"].versions[1].served is not second
    finally:
        repository.close()


def test_what_the_server_writes_or_cannot_read_is_not_part_of_a_version(tmp_path: Path) -> None:
    """Bytecode of a model's code and ONNX Runtime's TensorRT engines are written into the
    model's folder after its load: counted, the next poll reloaded it. A named pipe blocked
    the read of its bytes for good."""
    from service.repository.models import fingerprint

    write_identity_model(tmp_path / "m", datatypes=("FP32",))
    before = fingerprint(tmp_path / "m")
    for folder in ("__pycache__", "1/tensorrt_cache", "1/helpers/__pycache__"):
        (tmp_path / "m" / folder).mkdir(parents=True)
        (tmp_path / "m" / folder / "written").write_bytes(b"by the server")
    os.mkfifo(tmp_path / "m" / "1" / "pipe")
    assert fingerprint(tmp_path / "m") == before
