"""ShapePolicy: requests' dynamic dims bounded, padded to warmed buckets, outputs cropped back."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from service.artifacts.shapes import Axis, Follow, ShapeFacts, ShapePolicy, apply_crop
from service.batching.scheduler import runtime_message
from service.errors import InvalidInput, ModelLoadError
from service.export.shapes import EagerRun
from service.model_config import ModelConfig, TensorConfig

pytestmark = pytest.mark.unit

IMAGE = TensorConfig(name="image", datatype="FP32", shape=(3, -1, -1))
CONFIG = ModelConfig(backend="onnx", max_batch_size=4, buckets=(32, 64))
HEAT = {
    "heat": {
        2: Follow(input="image", dim=2, sizes=tuple((n - 5) // 2 + 1 for n in range(1, 65))),
        3: Follow(input="image", dim=3),
    }
}


def facts(pad: bool = True) -> ShapeFacts:
    axes = (Axis(dims=(("image", 2),), min=5, max=64), Axis(dims=(("image", 3),), min=5, max=64))
    return ShapeFacts(
        axes=axes,
        buckets=(32, 64),
        pad=pad,
        reason="" if pad else "it pools",
        follows=HEAT if pad else {},
    )


def test_each_dim_is_padded_to_its_bucket_and_outputs_cropped_to_the_callers_size() -> None:
    policy = ShapePolicy.of(CONFIG, [IMAGE], facts())
    image = np.ones((2, 3, 20, 40), np.float32)
    fitted, crop = policy.fit({"image": image}, "m")
    assert fitted["image"].shape == (2, 3, 32, 64)
    assert fitted["image"][:, :, 20:].sum() == 0 and fitted["image"][:, :, :, 40:].sum() == 0
    outputs = {"heat": np.zeros((2, 1, (32 - 5) // 2 + 1, 64)), "other": np.zeros((2, 7))}
    cropped = apply_crop(outputs, crop)
    assert cropped["heat"].shape == (2, 1, (20 - 5) // 2 + 1, 40)
    assert cropped["other"].shape == (2, 7)


def test_a_size_on_a_bucket_is_neither_padded_nor_cropped() -> None:
    fitted, crop = ShapePolicy.of(CONFIG, [IMAGE], facts()).fit(
        {"image": np.ones((1, 3, 32, 64), np.float32)}, "m"
    )
    assert fitted["image"].shape == (1, 3, 32, 64) and crop == {}


@pytest.mark.parametrize(
    ("h", "message"),
    [
        (
            65,
            "dim 2 is 65, above the largest bucket (64) of model 'm'; model 'm' takes 5 to 64 there",
        ),
        (4, "input 'image': dim 2 is 4; model 'm' takes 5 to 64 there"),
    ],
)
def test_sizes_outside_the_exported_range_are_refused_naming_input_dim_and_range(
    h: int, message: str
) -> None:
    policy = ShapePolicy.of(CONFIG, [IMAGE], facts())
    with pytest.raises(InvalidInput, match=re.escape(message)):
        policy.fit({"image": np.ones((1, 3, h, 32), np.float32)}, "m")


def test_without_safe_padding_only_the_buckets_are_taken() -> None:
    policy = ShapePolicy.of(CONFIG, [IMAGE], facts(pad=False))
    with pytest.raises(InvalidInput, match=r"takes only \[32, 64\] there, since padding changes"):
        policy.fit({"image": np.ones((1, 3, 40, 32), np.float32)}, "m")
    fitted, crop = policy.fit({"image": np.ones((1, 3, 64, 32), np.float32)}, "m")
    assert fitted["image"].shape == (1, 3, 64, 32) and crop == {}
    with pytest.raises(
        InvalidInput, match=re.escape("of model 'm'; model 'm' takes only [32, 64]")
    ):
        policy.fit({"image": np.ones((1, 3, 65, 32), np.float32)}, "m")  # not "5 to 64"


def test_padding_exact_from_even_sizes_pads_those_and_takes_odd_ones_at_a_bucket_only() -> None:
    """H padded from even sizes only, W from any: an odd W is padded, an odd H refused."""
    base = facts()
    height = base.axes[0].model_copy(update={"multiple": 2})
    even = base.model_copy(
        update={"axes": (height, base.axes[1]), "reason": "a stride-2 conv reads it"}
    )
    assert ShapeFacts.model_validate_json(even.model_dump_json()) == even
    assert "multiple" not in base.model_dump_json()  # a server before it loads what it can keep to
    policy = ShapePolicy.of(CONFIG, [IMAGE], even)
    fitted, crop = policy.fit({"image": np.ones((1, 3, 20, 41), np.float32)}, "m")
    assert fitted["image"].shape == (1, 3, 32, 64) and crop
    with pytest.raises(
        InvalidInput,
        match=re.escape(
            "input 'image': dim 2 is 21; model 'm' takes multiples of 2 from 5 to 64 there, or "
            "exactly [32, 64], since padding changes its answer at other sizes (a stride-2 conv"
        ),
    ):
        policy.fit({"image": np.ones((1, 3, 21, 40), np.float32)}, "m")
    odd = ShapePolicy.of(
        ModelConfig(backend="onnx", max_batch_size=4, buckets=(33, 64)), [IMAGE], even
    )
    assert odd.fit({"image": np.ones((1, 3, 33, 64), np.float32)}, "m")[1] == {}  # a bucket


def test_warmup_runs_every_combination_of_the_axes_buckets() -> None:
    sizes = ShapePolicy.of(CONFIG, [IMAGE], facts()).warm_sizes()
    assert sorted((s["image", 2], s["image", 3]) for s in sizes) == [
        (32, 32),
        (32, 64),
        (64, 32),
        (64, 64),
    ]


def test_inputs_of_one_axis_must_agree() -> None:
    ids = TensorConfig(name="ids", datatype="INT64", shape=(-1,))
    mask = TensorConfig(name="mask", datatype="INT64", shape=(-1,))
    axis = Axis(dims=(("ids", 1), ("mask", 1)), min=1, max=16)
    shapes = ShapeFacts(axes=(axis,), buckets=(8, 16), pad=True)
    config = ModelConfig(backend="onnx", max_batch_size=4, buckets=(8, 16))
    policy = ShapePolicy.of(config, [ids, mask], shapes)
    with pytest.raises(InvalidInput, match="must have the same size"):
        policy.fit({"ids": np.ones((1, 5), np.int64), "mask": np.ones((1, 6), np.int64)}, "m")
    fitted, _ = policy.fit(
        {"ids": np.ones((1, 5), np.int64), "mask": np.ones((1, 5), np.int64)}, "m"
    )
    assert fitted["ids"].shape == fitted["mask"].shape == (1, 8)
    assert [s[("ids", 1)] for s in policy.warm_sizes()] == [8, 16]


def test_buckets_beyond_what_was_exported_are_a_load_refusal() -> None:
    config = ModelConfig(backend="onnx", max_batch_size=4, buckets=(32, 128))
    with pytest.raises(ModelLoadError, match=r"buckets \[128\] lie outside .* \(5 to 64\)"):
        ShapePolicy.of(config, [IMAGE], facts())


def test_without_export_facts_every_dynamic_dim_pads_and_nothing_is_cropped() -> None:
    policy = ShapePolicy.of(CONFIG, [IMAGE], None)
    fitted, crop = policy.fit({"image": np.ones((1, 3, 3, 40), np.float32)}, "m")
    assert fitted["image"].shape == (1, 3, 32, 64) and crop == {}
    unbounded = ShapePolicy.of(ModelConfig(backend="onnx", max_batch_size=4), [IMAGE], None)
    fitted, _ = unbounded.fit({"image": np.ones((1, 3, 300, 7), np.float32)}, "m")
    assert fitted["image"].shape == (1, 3, 300, 7)
    texts = TensorConfig(name="texts", datatype="BYTES", shape=(-1,))
    fitted, _ = ShapePolicy.of(CONFIG, [texts], None).fit(
        {"texts": np.array([[b"a", b"b", b"c"]], dtype=object)}, "m"
    )
    assert fitted["texts"].tolist() == [[b"a", b"b", b"c"] + [b""] * 29]  # not the int 0


def test_runtime_messages_lose_node_names_status_codes_and_paths() -> None:
    ort = RuntimeError(
        "[ONNXRuntimeError] : 2 : INVALID_ARGUMENT : Non-zero status code returned while running "
        "Gather node. Name:'node_embedding' Status Message: indices element out of data bounds, "
        "idx=1000 must be within the inclusive range [-1000,999]"
    )
    assert runtime_message(ort) == (
        "indices element out of data bounds, idx=1000 must be within the inclusive range "
        "[-1000,999]"
    )
    torchscript = RuntimeError(
        "The following operation failed in the TorchScript interpreter.\n"
        'File "/root/models/x/code/__torch__.py", line 12\n    return x[i]\n'
        "RuntimeError: index 9 is out of bounds for /tmp/model.pt"
    )
    assert runtime_message(torchscript) == "RuntimeError: index 9 is out of bounds for …"
    aoti = RuntimeError(  # c10::Error from an AOTInductor package, its C++ backtrace after
        "run_func_( container_handle_, input_handles.data(), input_handles.size(), "
        "output_handles.data(), output_handles.size(), reinterpret_cast<AOTInductorStreamHandle>"
        "(stream_handle), proxy_executor_handle_) API call failed at /pytorch/torch/csrc/"
        "inductor/aoti_runner/model_container_runner.cpp, line 147\n"
        "Exception raised from run at /pytorch/torch/csrc/runner.cpp:147 (most recent call "
        "first):\nframe #0: c10::Error::Error(c10::SourceLocation) + 0x98 (0x7f in /x/libc10.so)\n"
        "frame #31: <unknown function> + 0x1098ec (0x7fb66b3278ec in /lib/libc.so.6)"
    )
    assert runtime_message(aoti) == (
        "the compiled model.pt2 kernel failed on it (its error is in the server log)"
    )
    torch_check = RuntimeError(  # c10::Error from an op called from Python: a line for its frames
        "index 12 is out of bounds for dimension 0 with size 10\n"
        "Exception raised from checkIndex at /pytorch/aten/src/ATen/native/Indexing.cpp:71 "
        "(most recent call first):\nframe #0: c10::Error::Error() + 0x98 (0x7f in /x/libc10.so)\n"
        "(<omitting python frames>)\n"
        "frame #9: <unknown function> + 0x1098ec (0x7fb66b3278ec in /lib/libc.so.6)\n"
        "(<omitting python frames>)"
    )
    assert runtime_message(torch_check) == "index 12 is out of bounds for dimension 0 with size 10"


def _eager(module: Callable[..., Any], output: str = "y") -> EagerRun:
    """Runs ``module`` on a batch's inputs, in order, as export's eager run does."""
    import torch

    def run(batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        with torch.no_grad():
            tensors = [torch.from_numpy(v) for v in batch.values()]
            return {output: module(*tensors).numpy()}

    return run


def test_padding_that_changes_a_maximum_is_found_whatever_the_golden_rows_values() -> None:
    """Zeros padded among normal values leave a maximum over the padded dim where it was, so
    the check passed and the server padded: an all-negative input of 5 was answered as eager
    answers it padded to 8 (by 1.07), and a convolution's max-pool over pixels in [0, 1] by
    0.061. A mean over the dim changes with any values; a per-position map does not."""
    import torch

    from service.artifacts.manifest import Tolerance
    from service.export.shapes import padding_verdict

    torch.manual_seed(0)
    linear = torch.nn.Linear(4, 4)
    conv = torch.nn.Sequential(
        torch.nn.Conv2d(3, 8, 3), torch.nn.ReLU(), torch.nn.AdaptiveMaxPool2d(1), torch.nn.Flatten()
    )
    golden = np.random.default_rng(0).standard_normal((4, 6, 4)).astype(np.float32)
    image = np.random.default_rng(1).standard_normal((4, 3, 12, 12)).astype(np.float32)
    tolerance = Tolerance(atol=1e-4, rtol=1e-3)
    sequence = (Axis(dims=(("x", 1),), min=1, max=16),)
    follows = {"y": {1: Follow(input="x", dim=1)}}
    cases: list[tuple[Callable[..., Any], np.ndarray, Any, Any, str | None]] = [
        (lambda x: linear(x.amax(dim=1)), golden, sequence, {}, "made all negative"),
        (
            conv,
            image,
            (Axis(dims=(("x", 2),), min=3, max=32), Axis(dims=(("x", 3),), min=3, max=32)),
            {},
            "changes output 'y'",
        ),
        (lambda x: linear(x.mean(dim=1)), golden, sequence, {}, "padding the golden rows from"),
        (lambda x: linear(x), golden, sequence, follows, None),
    ]
    for module, rows, axes, crops, said in cases:
        with torch.no_grad():
            why, multiples = padding_verdict(
                _eager(module), {"x": rows}, axes, (8, 16, 32), crops, tolerance
            )
        if said is None:
            assert (why, multiples) == ("", (1,) * len(axes))
        else:
            assert said in why and multiples == (), why


def test_padding_exact_at_multiples_of_a_stride_only_is_found_axis_by_axis() -> None:
    """The golden rows were checked at one size, 3/4 of the smallest bucket: always even. A
    stride-2 convolution after a padded one reads the padding at an odd size's last window,
    and a pooling window of 2 with ceil_mode averages a padding zero there: served padded,
    every odd size was wrong (by 0.036 at 13×13, 1.09 for the pooling). Export now also cuts
    the rows along each axis to the largest odd multiple of 1, 2, 4 … 32 below their size: a
    net of four such convolutions is padded from multiples of 16, one striding along H alone
    from any W, and one that reads the padding at multiples of 32 too is not padded at all."""
    import torch
    import torch.nn.functional as F

    from service.artifacts.manifest import Tolerance
    from service.export.shapes import padding_verdict

    torch.manual_seed(0)

    def strided(times: int, along_h: bool = False) -> torch.nn.Module:
        """Padded stride-2 convolutions; ``along_h``: along H alone, W unpadded ("valid")."""
        pad, stride = ((1, 0), (2, 1)) if along_h else (1, 2)
        layers: list[torch.nn.Module] = [torch.nn.Conv2d(3, 4, 3, padding=pad), torch.nn.ReLU()]
        for _ in range(times):
            layers += [torch.nn.Conv2d(4, 4, 3, stride=stride, padding=pad), torch.nn.Sigmoid()]
        return torch.nn.Sequential(*layers)

    def follows(strides: tuple[int, ...]) -> dict[str, dict[int, Follow]]:
        """Output dims of size ceil(n / stride) for an input dim of size n (a stride of 0:
        n - 4, two valid convolutions)."""
        return {
            "y": {
                i + 2: Follow(
                    input="x",
                    dim=i + 2,
                    sizes=tuple(-(-n // s) if s else max(n - 4, 0) for n in range(1, 129)),
                )
                for i, s in enumerate(strides)
            }
        }

    def image(side: int) -> dict[str, np.ndarray]:
        return {"x": np.random.default_rng(1).uniform(0, 1, (2, 3, side, side)).astype(np.float32)}

    spatial = tuple(Axis(dims=(("x", i),), min=1, max=128) for i in (2, 3))
    pool = _eager(lambda x: F.avg_pool1d(x, 2, 2, ceil_mode=True))
    series = {"x": np.random.default_rng(2).standard_normal((2, 2, 12)).astype(np.float32)}
    sequence = (Axis(dims=(("x", 2),), min=1, max=32),)
    pooled = {"y": {2: Follow(input="x", dim=2, sizes=tuple(-(-n // 2) for n in range(1, 33)))}}
    cases = [
        (_eager(strided(1)), image(12), spatial, follows((2, 2)), (16, 32), (2, 2)),
        (_eager(strided(4)), image(32), spatial, follows((16, 16)), (64, 128), (16, 16)),
        (_eager(strided(1, along_h=True)), image(12), spatial, follows((2, 0)), (16, 32), (2, 1)),
        (_eager(strided(6)), image(64), spatial, follows((64, 64)), (96, 128), ()),
        (pool, series, sequence, pooled, (16, 32), (2,)),
    ]
    tolerance = Tolerance(atol=1e-5, rtol=1e-4)
    for run, rows, axes, crops, buckets, wanted in cases:
        with torch.no_grad():
            why, multiples = padding_verdict(run, rows, axes, buckets, crops, tolerance)
        assert multiples == wanted, (multiples, why)
        assert why.startswith("padding the golden rows cut shorter from "), why


def test_the_padding_variants_leave_masks_alone_and_skip_values_a_module_cannot_take() -> None:
    """Made all negative, a float mask of ones (additive masking) turned the real keys into
    padding, and a padding-safe model was served at exact buckets only; float ids made
    negative raised out of export (an embedding's index error)."""
    import torch

    from service.artifacts.manifest import Tolerance
    from service.export.shapes import padding_verdict

    torch.manual_seed(0)
    query, table = torch.nn.Linear(8, 8), torch.nn.Embedding(100, 4)

    def attend(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        scores = torch.einsum("bld,bmd->blm", query(x), x) + (1.0 - mask)[:, None, :] * -1e4
        pooled = (torch.softmax(scores, -1) @ x) * mask[..., None]
        return pooled.sum(1) / mask.sum(1, keepdim=True)

    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 5, 8)).astype(np.float32)
    golden = {"x": x, "mask": np.ones((2, 5), np.float32)}
    axes = (Axis(dims=(("x", 1), ("mask", 1)), min=1, max=32),)
    assert padding_verdict(_eager(attend, "out"), golden, axes, (8, 16), {}, Tolerance()) == (
        "",
        (1,),
    )
    ids = {"ids": np.array([[1, 2, 3, 4, 5]] * 2, np.float32)}
    follows = {"out": {1: Follow(input="ids", dim=1)}}
    lookup = _eager(lambda i: table(i.long()), "out")
    axes = (Axis(dims=(("ids", 1),), min=1, max=32),)
    assert padding_verdict(lookup, ids, axes, (8, 16), follows, Tolerance()) == ("", (1,))
