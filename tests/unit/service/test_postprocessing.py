from pathlib import Path

import numpy as np
import pytest

from service.errors import ModelLoadError
from service.model_config import ClassificationConfig, TensorConfig
from service.pipelines.classification import Classifier

OUT = (TensorConfig(name="logits", datatype="FP32", shape=(4,)),)


def test_top_k_labels_with_softmax_probabilities(tmp_path: Path) -> None:
    (tmp_path / "labels.txt").write_text("a\nb\nc\nd\n")
    classify = Classifier(ClassificationConfig(labels="labels.txt", top_k=2), tmp_path, OUT)
    logits = np.array([0.0, 3.0, 1.0, 3.0], np.float32)
    top = classify({"logits": logits})
    assert [t["label"] for t in top] == ["b", "d"]  # ties keep index order
    expected = np.exp(3.0) / np.exp(logits.astype(np.float64)).sum()
    assert top[0]["probability"] == pytest.approx(expected)


def test_without_softmax_scores_pass_through(tmp_path: Path) -> None:
    classify = Classifier(ClassificationConfig(softmax=False, top_k=9), tmp_path, OUT)
    top = classify({"logits": np.array([0.1, 0.4, 0.3, 0.2], np.float32)})
    assert [t["index"] for t in top] == [1, 2, 3, 0]
    assert top[0] == {"index": 1, "label": "1", "probability": pytest.approx(0.4)}


def test_label_count_must_match_the_output(tmp_path: Path) -> None:
    (tmp_path / "labels.txt").write_text("a\nb\n")
    with pytest.raises(ModelLoadError, match="has 2 labels, output 'logits' has 4 classes"):
        Classifier(ClassificationConfig(labels="labels.txt"), tmp_path, OUT)
    with pytest.raises(ModelLoadError, match="cannot read"):
        Classifier(ClassificationConfig(labels="missing.txt"), tmp_path, OUT)
    with pytest.raises(ModelLoadError, match="'probs' is not an output"):
        Classifier(ClassificationConfig(output="probs"), tmp_path, OUT)
