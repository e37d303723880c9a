import pytest
from pydantic import ValidationError

from preprocessing.spec import ImageSpec, spec_hash

IMAGENET = ImageSpec(
    color="RGB", resize=256, crop=224, mean=(0.485, 0.456, 0.406), std=(0.229, 0.224, 0.225)
)


def test_hash_ignores_whether_defaults_are_written_out() -> None:
    implicit = ImageSpec(resize=256, crop=224)
    explicit = ImageSpec(
        kind="image",
        color="RGB",
        resize=256,
        crop=224,
        interpolation="bilinear",
        scale=1 / 255,
        mean=(0.0,),
        std=(1.0,),
        layout="NCHW",
        dtype="float32",
    )
    assert spec_hash(implicit) == spec_hash(explicit)


def test_hash_is_pinned_so_existing_manifests_stay_valid() -> None:
    # If this changes, every manifest ever exported stops matching its config: don't.
    assert spec_hash(IMAGENET) == PINNED_IMAGENET_HASH


@pytest.mark.parametrize(
    "change",
    [
        {"color": "BGR"},
        {"resize": 257},
        {"crop": 223},
        {"mean": (0.5, 0.5, 0.5)},
        {"std": (0.2, 0.2, 0.2)},
        {"layout": "NHWC"},
        {"interpolation": "bicubic"},
        {"scale": 1.0},
    ],
)
def test_hash_changes_with_every_field(change: dict[str, object]) -> None:
    changed = IMAGENET.model_copy(update=change)
    assert spec_hash(changed) != spec_hash(IMAGENET)


def test_hash_comes_out_the_same_from_yaml_style_lists() -> None:
    from_yaml = ImageSpec.model_validate(
        {"resize": 256, "crop": 224, "mean": [0.485, 0.456, 0.406], "std": [0.229, 0.224, 0.225]}
    )
    assert spec_hash(from_yaml) == spec_hash(IMAGENET)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"mean": (0.1, 0.2)}, "has 2 values; color RGB needs 1 or 3"),
        ({"std": (0.0,)}, "must not contain 0"),
        ({"resize": 0}, "greater than 0"),
        ({"color": "CMYK"}, "Input should be 'RGB', 'BGR' or 'L'"),
        ({"colour": "RGB"}, "Extra inputs are not permitted"),
    ],
)
def test_invalid_specs_say_what_is_wrong(fields: dict[str, object], message: str) -> None:
    with pytest.raises(ValidationError, match=message.replace("(", r"\(")):
        ImageSpec.model_validate(fields)


PINNED_IMAGENET_HASH = "sha256:207de7509778ad0cdee2942e81cc3c7e20a3595276fd3fee94bcaa53e7f5eda6"
