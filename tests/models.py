"""Tiny real PyTorch models that tests export and serve."""

from __future__ import annotations

import torch
from torch import nn


class TrainModeNet(nn.Module):
    """Dropout and BatchNorm: its output changes call to call unless eval() is in force."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Sequential(
            nn.Linear(8, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Dropout(0.5), nn.Linear(32, 4)
        )
        # Give BatchNorm running statistics unlike a batch's own, so train/eval differ visibly.
        self.body[1].running_mean.fill_(0.3)
        self.body[1].running_var.fill_(2.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


class Mlp(nn.Module):
    """64 → 256 → 10, the kind of tiny model whose serving cost is all overhead."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(1)
        self.layers = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


class DropsARow(nn.Module):
    """Breaks the batch contract: returns one row fewer than it was given."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x[1:] * 2.0


class Slow(nn.Module):
    """Spends a while on every batch (a chain of small ops), to fill queues in tests."""

    def __init__(self, steps: int) -> None:
        super().__init__()
        self.steps = steps
        self.register_buffer("w", torch.eye(16) * 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x
        for _ in range(self.steps):
            y = torch.tanh(y @ self.w) + x
        return y


class Poisoned(nn.Module):
    """Fails the whole batch when any of its values is negative: one bad request among others,
    as an embedding lookup fails on one id out of range."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if bool((x < 0).any()):
            raise RuntimeError("a negative value poisons this model")
        return x * 2.0


class Dawdle(nn.Module):
    """Runs as many steps as its first input value says: 1 for a normal request, 10 for one
    slowed ten times, a billion for an instance that hangs."""

    def __init__(self, steps_per_unit: int) -> None:
        super().__init__()
        self.steps_per_unit = steps_per_unit
        self.register_buffer("w", torch.eye(16) * 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x
        for _ in range(int(x[0, 0]) * self.steps_per_unit):
            y = torch.tanh(y @ self.w) + x
        return y


class TinyText(nn.Module):
    """Token ids and mask (dynamic batch and length) → a mean-pooled, normalised embedding:
    minilm's signature in miniature."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(2)
        self.embed = nn.Embedding(100, 16)
        self.mix = nn.Linear(16, 8)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        mask = attention_mask.unsqueeze(-1).to(torch.float32)
        hidden = torch.tanh(self.mix(self.embed(input_ids)))
        pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
        return nn.functional.normalize(pooled, dim=1)


class Copy(nn.Module):
    """Returns its input unchanged, in whatever dtype it came (a fresh tensor, not a view of the
    input)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.clone()


class NormsWithoutStats(nn.Module):
    """A batch norm that keeps no running statistics normalises by the batch's in eval mode too:
    traced in eval mode its graph says training=True, rightly."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.BatchNorm1d(8, track_running_stats=False)
        self.out = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.norm(x))


class _LinearHead(nn.Module):
    """8 features → 4 outputs; the dropout test modules below differ only in their forward."""

    def __init__(self) -> None:
        super().__init__()
        self.out = nn.Linear(8, 4)


class AlwaysDrops(_LinearHead):
    """F.dropout without training=self.training: its default, True, drops in eval mode too."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(nn.functional.dropout(x, 0.5))


class GuardedDrops(_LinearHead):
    """Dropout only in training, by the module's own test: the branch never runs in eval."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            x = nn.functional.dropout(x, 0.5)
        return self.out(x)


class DropsNothing(_LinearHead):
    """Dropout of p = 0, the identity in training too."""

    def __init__(self) -> None:
        super().__init__()
        self.drop = nn.Dropout(0.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.drop(x))


class InvertedGuard(_LinearHead):
    """Dropout only in training, tested the other way round (``not self.training``)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training:
            return self.out(x)
        return self.out(nn.functional.dropout(x, 0.5))


class Attends(nn.Module):
    """nn.MultiheadAttention with dropout over (3, 8) sequences: a trace in train() fixes the
    dropout_p of scaled_dot_product_attention, which it passes only in training."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.attention = nn.MultiheadAttention(8, 2, dropout=0.5, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.attention(x, x, x, need_weights=False)[0]


class InstanceNormed(_LinearHead):
    """An instance norm over 2 channels of 4: with running statistics it uses them in eval mode
    only (a trace in train() fixes use_input_stats); without, each item's own, in both."""

    def __init__(self, running: bool = True) -> None:
        super().__init__()
        self.norm = nn.InstanceNorm1d(2, track_running_stats=running)
        if running:  # statistics unlike an item's own, so that train and eval differ visibly
            self.norm.running_mean.fill_(0.5)
            self.norm.running_var.fill_(3.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.norm(x.view(-1, 2, 4)).flatten(1))


class Noisy(_LinearHead):
    """Gaussian noise added on every call, eval() or not (a regulariser left in forward): no
    dropout or normalisation op, so only its answers show it."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(x + torch.randn_like(x))


class ConvTagger(nn.Module):
    """Tags over token ids: an embedding of 500, two 1-D convolutions. With torch 2.13, its
    AOTInductor package, exported with a dynamic batch, aborts its process at a batch smaller
    than the one it was traced at (``index out of bounds`` in a fused kernel, on valid ids)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(1)
        self.embedding = nn.Embedding(500, 16)
        self.conv = nn.Conv1d(16, 32, 3, padding=1)
        self.out = nn.Conv1d(32, 5, 1)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embedding(ids).transpose(1, 2)
        return self.out(torch.relu(self.conv(x))).transpose(1, 2)


class Scores(nn.Module):
    """8 features → a score in (0, 1) through a ReLU: eager PyTorch answers a NaN feature with
    a NaN score; torch 2.13's AOTInductor compiles the ReLU into one that drops the NaN."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.hidden = nn.Linear(8, 16)
        self.out = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(self.out(torch.relu(self.hidden(x))))
