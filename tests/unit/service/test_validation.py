"""A request's inputs against a model's signature (``service.core.validation``): the 400s'
words, where a slip is likely."""

from __future__ import annotations

import re

import numpy as np
import pytest

from service.core.validation import check_inputs, check_range
from service.errors import InvalidInput
from service.inference import InputTensor
from service.model_config import ModelConfig, TensorConfig
from service.runtimes.base import Signature

ID = TensorConfig(name="item_id", datatype="INT64", shape=(1,))
DENSE = TensorConfig(name="dense", datatype="FP32", shape=(8,))
SIGNATURE = Signature(inputs=(ID, DENSE), outputs=())


def tensor(name: str, datatype: str, data: np.ndarray) -> InputTensor:
    return InputTensor(name, datatype, data.shape, data)


def config(**fields: object) -> ModelConfig:
    return ModelConfig.model_validate({"backend": "onnx", "max_batch_size": 8, **fields})


def refusal(inputs: list[InputTensor], model: ModelConfig) -> str:
    with pytest.raises(InvalidInput) as refused:
        check_inputs(inputs, SIGNATURE, model, "ctr")
    return str(refused.value)


def test_a_rows_lone_value_sent_bare_is_told_how_to_send_it() -> None:
    dense = tensor("dense", "FP32", np.zeros((1, 8), np.float32))
    bare = tensor("item_id", "INT64", np.array([3]))
    assert refusal([bare, dense], config()) == (
        "input 'item_id': expected INT64 [-1, 1], got INT64 [1]: one dim short; the first dim "
        "counts rows, each of shape [1] (a row's lone value is sent as [v], not v)"
    )
    # cast from another datatype, the same slip is told the same
    bare = tensor("item_id", "INT32", np.array([3], np.int32))
    assert refusal([bare, dense], config(cast_inputs=True)).endswith(
        "got [1]: one dim short; the first dim counts rows, each of shape [1] "
        "(a row's lone value is sent as [v], not v)"
    )


def test_a_row_without_its_batch_dim_is_one_dim_short_and_other_shapes_are_not() -> None:
    ids = tensor("item_id", "INT64", np.array([[3]]))
    row = tensor("dense", "FP32", np.zeros(8, np.float32))
    assert refusal([ids, row], config()).endswith(
        "got FP32 [8]: one dim short; the first dim counts rows, each of shape [8]"
    )
    wide = tensor("dense", "FP32", np.zeros((1, 9), np.float32))
    assert refusal([ids, wide], config()) == "input 'dense': expected FP32 [-1, 8], got FP32 [1, 9]"
    other = tensor("dense", "FP64", np.zeros(8))  # its datatype is what is wrong first
    assert refusal([ids, other], config()) == "input 'dense': expected FP32 [-1, 8], got FP64 [8]"
    unbatched = config(max_batch_size=0)  # no rows to count: [8] is what it takes
    check_inputs([tensor("item_id", "INT64", np.array([3])), row], SIGNATURE, unbatched, "ctr")


def test_a_pipelines_raw_input_is_named_beside_the_models_inputs() -> None:
    """A model with preprocessing also takes its raw BYTES input alone: its metadata lists
    it, and the 400 for an unknown input named only the model's own."""
    ids = tensor("item_id", "INT64", np.array([[3]]))
    with pytest.raises(InvalidInput) as refused:
        check_inputs([tensor("x", "FP32", np.zeros(1))], SIGNATURE, config(), "m", raw_input="raw")
    assert str(refused.value) == (
        "model 'm' has no input ['x']; its inputs are ['dense', 'item_id'], or its raw input "
        "'raw' (BYTES) alone"
    )
    with pytest.raises(InvalidInput) as refused:
        check_inputs([ids], SIGNATURE, config(), "m", raw_input="raw")
    assert str(refused.value).endswith(
        "takes ['dense', 'item_id'], or its raw input 'raw' (BYTES) alone"
    )


@pytest.mark.parametrize(
    ("values", "said"),
    [  # it said "got values from 1 to 20", 1 being in range; and "from nan to nan"
        ([[1, 20], [3, 30]], "got 20 at [0, 1] (2 values outside it)"),
        ([[1.0, float("nan")]], "got nan at [0, 1] (1 value outside it)"),
        ([[-1, 2]], "got -1 at [0, 0] (1 value outside it)"),
        ([[2**63 - 1]], "got 9223372036854775807 at [0, 0] (1 value outside it)"),  # not 9.22e+18
    ],
)
def test_a_value_out_of_range_is_named_with_where_it_is(values: list[object], said: str) -> None:
    with pytest.raises(InvalidInput) as refused:
        check_range("category", np.array(values), (0, 9))
    assert refused.value.message == (f"input 'category': values must lie within [0, 9]; {said}")


def test_a_value_out_of_range_names_the_row_as_the_client_calls_it() -> None:
    """v1's rows are instances: "at [1, 0]" named a tensor the client never sent."""
    with pytest.raises(InvalidInput) as refused:
        check_range("cat", np.array([[1], [11]]), (0, 9), rows_are="instances[{}]")
    assert refused.value.message.endswith("got 11 in instances[1] at [0] (1 value outside it)")
    with pytest.raises(InvalidInput) as refused:
        check_range("cat", np.array([1, 11]), (0, 9), rows_are="instances[{}]")
    assert refused.value.message.endswith("got 11 in instances[1] (1 value outside it)")


def test_inputs_of_different_batch_sizes_are_each_named() -> None:
    model = config()
    specs = (
        TensorConfig(name="dense", datatype="FP32", shape=(5,)),
        TensorConfig(name="cat", datatype="INT64", shape=(1,)),
    )
    inputs = [
        InputTensor("dense", "FP32", (2, 5), np.zeros((2, 5), np.float32)),
        InputTensor("cat", "INT64", (1, 1), np.zeros((1, 1), np.int64)),
    ]
    with pytest.raises(InvalidInput) as refused:
        check_inputs(inputs, Signature(specs, ()), model, "m")
    assert refused.value.message == (
        "inputs have different batch sizes (the first dim): 'cat' 1 row, 'dense' 2 rows"
    )


def test_cast_inputs_casts_only_values_the_models_type_holds_and_never_bools() -> None:
    dense = tensor("dense", "FP32", np.zeros((1, 8), np.float32))
    ids = tensor("item_id", "FP64", np.array([[5.7]]))
    assert refusal([ids, dense], config(cast_inputs=True)) == (
        "input 'item_id': 5.7 is not an integer (INT64), so it is not cast from FP64 to INT64 "
        "(cast_inputs casts only values the model's type holds)"
    )
    wide = tensor("dense", "FP64", np.full((1, 8), 1e300))
    assert "1e+300 is past FP32's range" in refusal(
        [tensor("item_id", "INT64", np.array([[5]])), wide], config(cast_inputs=True)
    )
    flag = tensor("item_id", "BOOL", np.array([[True]]))  # true is no id
    assert refusal([flag, dense], config(cast_inputs=True)) == (
        "input 'item_id': expected INT64 [-1, 1], got BOOL [1, 1]"
    )
    fine = tensor("item_id", "FP64", np.array([[5.0]]))
    batch = check_inputs([fine, dense], SIGNATURE, config(cast_inputs=True), "ctr")
    assert batch["item_id"].dtype == np.int64 and batch["item_id"].tolist() == [[5]]


def test_ragged_rows_are_padded_only_after_their_padded_size_is_taken() -> None:
    """v1 rows of their own lengths: one row of 32 tokens among 1,000 rows of one pads them
    all to 32. What the padding makes is given to ``take`` (the budget's) before it is made,
    which may refuse it; each row's own size comes back for its crop."""
    from service.artifacts.shapes import Axis
    from service.core.validation import ragged_instance_tensors
    from service.errors import PayloadTooLarge

    specs = (
        TensorConfig(name="ids", datatype="INT64", shape=(-1,)),
        TensorConfig(name="mask", datatype="INT64", shape=(-1,)),
    )
    axes = (Axis(dims=(("ids", 1), ("mask", 1)), min=1, max=32),)
    rows = [{"ids": [5], "mask": [1]}] * 999 + [{"ids": list(range(32)), "mask": [1] * 32}]
    taken: list[int] = []
    tensors, sizes = ragged_instance_tensors(rows, specs, axes, "m", taken.append)
    assert taken == [2 * 1000 * 32 * 8]
    assert [t.data.shape for t in tensors] == [(1000, 32), (1000, 32)]
    assert tensors[0].data[0].tolist() == [5] + [0] * 31
    assert sizes[0] == {("ids", 1): 1, ("mask", 1): 1} and sizes[-1][("ids", 1)] == 32

    def refuse(size: int) -> None:
        raise PayloadTooLarge(f"{size} bytes")

    with pytest.raises(PayloadTooLarge, match="512000 bytes"):
        ragged_instance_tensors(rows, specs, axes, "m", refuse)


def test_ragged_rows_are_held_to_their_ranges_row_by_row_not_with_their_padding() -> None:
    """Ids from 1: the padding's zeros are the server's, not a value the client sent out of
    range (a 400 for a valid request); an id the client sent out of range names its row."""
    from service.artifacts.shapes import Axis
    from service.core.validation import ragged_instance_tensors

    specs = (TensorConfig(name="ids", datatype="INT64", shape=(-1,), range=(1, 99)),)
    axes = (Axis(dims=(("ids", 1),), min=1, max=8),)
    tensors, _ = ragged_instance_tensors([[1, 2, 3], [4]], specs, axes, "m", lambda _: None)
    assert tensors[0].data.tolist() == [[1, 2, 3], [4, 0, 0]]
    signature = Signature(inputs=specs, outputs=())
    check_inputs(tensors, signature, config(), "m", ranges_checked=True)
    with pytest.raises(InvalidInput, match=r"input 'ids': values must lie within \[1, 99\]"):
        check_inputs(tensors, signature, config(), "m")  # the zeros, had they been sent
    with pytest.raises(InvalidInput, match=r"^instances\[1\]: input 'ids': values must lie"):
        ragged_instance_tensors([[1, 2, 3], [0]], specs, axes, "m", lambda _: None)


def test_v1_rows_of_unlike_nesting_name_the_instance() -> None:
    """ "[1] is a number, [0] a list of 1" read like values; they are instances."""
    from service.core.validation import instance_tensors

    cat = TensorConfig(name="cat", datatype="INT64", shape=(1,))
    with pytest.raises(
        InvalidInput,
        match=re.escape(
            "instances for input 'cat' are not INT64 rows of shape [1]: its nested lists are not "
            "all of one length: instances[1].cat is a number, instances[0].cat a list of 1"
        ),
    ):
        instance_tensors([{"cat": [3]}, {"cat": 4}], (cat,))
    with pytest.raises(InvalidInput, match=re.escape("instances[1] is a number, instances[0] a")):
        instance_tensors([[3], 4], (cat,))
