"""Models of the kinds ML engineers bring, for ``tensorgate export`` as the README shows it.

Each factory hands its module over still in ``train()`` mode (dropout and batch norm live), as
a training script would: export must serve it as ``eval()`` answers. Seeded, so that a test
can rebuild the eager module and compare.
"""

from __future__ import annotations

import torch
from torch import nn


class ClickThrough(nn.Module):
    """An item id (an ``nn.Embedding`` of 1,000 items) and 8 dense features → a click
    probability."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(11)
        self.items = nn.Embedding(1000, 16)
        self.dense = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU())
        self.head = nn.Sequential(nn.Dropout(0.3), nn.Linear(32, 1))

    def forward(self, item_id: torch.Tensor, dense: torch.Tensor) -> torch.Tensor:
        features = torch.cat([self.items(item_id[:, 0]), self.dense(dense)], dim=1)
        return torch.sigmoid(self.head(features))


class Heatmap(nn.Module):
    """A fully convolutional detector head over an image of any H × W: unpadded ("valid")
    convolutions, one strided, so an output cell sees only the pixels below and right of it
    and zero padding at the bottom and right leaves the real region's answer unchanged. Its
    output is ``((h - 5) // 2 + 1) × ((w - 5) // 2 + 1)``."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(12)
        self.body = nn.Sequential(
            nn.Conv2d(3, 8, 3),
            nn.BatchNorm2d(8),
            nn.ReLU(),
            nn.Conv2d(8, 8, 3, stride=2),
            nn.ReLU(),
            nn.Dropout2d(0.2),
            nn.Conv2d(8, 1, 1),
        )

    def forward(self, image: torch.Tensor) -> torch.Tensor:
        return self.body(image)


class Tagger(nn.Module):
    """Token ids of any length → a score per tag per token, through a one-way LSTM: a token's
    answer depends only on the tokens before it, so padding after the end changes nothing."""

    def __init__(self, bidirectional: bool = False) -> None:
        super().__init__()
        torch.manual_seed(13)
        self.embed = nn.Embedding(50, 16)
        self.lstm = nn.LSTM(16, 24, batch_first=True, bidirectional=bidirectional)
        self.tags = nn.Sequential(nn.Dropout(0.1), nn.Linear(48 if bidirectional else 24, 5))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        hidden, _ = self.lstm(self.embed(ids))
        return self.tags(hidden)


class PooledClassifier(nn.Module):
    """Any H × W image → 4 class scores through global average pooling, which averages the
    padding in: padding changes its answer, so it must run at exact sizes."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(14)
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.head = nn.Linear(8, 4)

    def forward(self, image: torch.Tensor) -> torch.Tensor:
        pooled = torch.relu(self.conv(image)).mean(dim=(2, 3))
        return self.head(pooled)


class Strided(nn.Module):
    """A heatmap at half the image's size: a padded convolution, then a padded one of stride 2.
    At an odd size the second one's last window reads the first one's answer on the padding,
    which is not zero: padding is exact from even sizes only."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(16)
        self.first = nn.Conv2d(3, 8, 3, padding=1)
        self.second = nn.Conv2d(8, 1, 3, stride=2, padding=1)

    def forward(self, image: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(self.second(torch.relu(self.first(image))))


class Breaks(nn.Module):
    """Works until it meets a value above 100, which corrupts its own weights and fails: the
    model is then broken for every later request, which only a golden replay can tell."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(15)
        self.weight = nn.Parameter(torch.randn(4, 2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if bool(x.max() > 100.0):
            self.weight.fill_(float("nan"))
            raise RuntimeError("poisoned")
        return x @ self.weight


class ShiftedLookup(nn.Module):
    """An embedding indexed by ``item_id + 1``: no range export can prove on the input, so an
    id of 999 fails inside the runtime, alone."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(16)
        self.items = nn.Embedding(1000, 4)

    def forward(self, item_id: torch.Tensor) -> torch.Tensor:
        return self.items(item_id[:, 0] + 1)


class TextEncoder(nn.Module):
    """Token ids and mask from a real tokenizer (all-MiniLM-L6-v2's 30,522-token vocabulary)
    → a masked mean of their embeddings: minilm's signature, for a text spec's export."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(17)
        self.embed = nn.Embedding(30522, 8)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        mask = attention_mask.unsqueeze(-1).to(torch.float32)
        return (self.embed(input_ids) * mask).sum(1) / mask.sum(1).clamp(min=1.0)


class TextTagger(nn.Module):
    """Token ids and mask → 3 scores a token (each token's own: padding leaves them as they
    are), the output whose length follows the text's."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(18)
        self.embed, self.head = nn.Embedding(30522, 8), nn.Linear(8, 3)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(input_ids)) * attention_mask.unsqueeze(-1)


def make_ctr() -> nn.Module:
    return ClickThrough().train()


def make_heatmap() -> nn.Module:
    return Heatmap().train()


def make_tagger() -> nn.Module:
    return Tagger().train()


def make_pooled() -> nn.Module:
    return PooledClassifier().train()


def make_strided() -> nn.Module:
    return Strided()


def make_breaks() -> nn.Module:
    return Breaks().train()


def make_shifted() -> nn.Module:
    return ShiftedLookup().train()


def make_text() -> nn.Module:
    return TextEncoder().train()


def make_text_tagger() -> nn.Module:
    return TextTagger()


def make_linear() -> nn.Module:
    """Linear(4, 2) as the own-code tests build it (seed 0): the model of a pipeline's code."""
    torch.manual_seed(0)
    return nn.Linear(4, 2)
