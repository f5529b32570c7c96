"""Two small models with deterministic generated data for the scenarios and benchmarks.

- ``gpt``: a 2-layer decoder-only transformer on a synthetic language (each token mostly
  follows a fixed successor table), AdamW with decay / no-decay param groups, linear warmup
  then cosine decay, gradient clipping, dropout (so RNG state matters on restore).
- ``cnn``: conv + BatchNorm + ReLU blocks on 16x16 images whose class sets a coloured
  pattern, SGD with momentum and weight decay, step decay of the rate (BatchNorm running
  statistics are the buffers the control message carries).

Batches are a pure function of (seed, rank, iteration), so the data position of a restored
job is just its iteration.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from checkmate.errors import CheckmateError

# ----------------------------------------------------------------------------- GPT


@dataclass(frozen=True)
class GPTConfig:
    vocab: int = 64
    context: int = 32
    width: int = 64
    layers: int = 2
    heads: int = 4
    dropout: float = 0.1


class Block(nn.Module):
    def __init__(self, c: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(c.width)
        self.attn = nn.MultiheadAttention(c.width, c.heads, dropout=c.dropout, batch_first=True)
        self.ln2 = nn.LayerNorm(c.width)
        self.mlp = nn.Sequential(nn.Linear(c.width, 4 * c.width), nn.GELU(),
                                 nn.Linear(4 * c.width, c.width), nn.Dropout(c.dropout))
        # A plain attribute, not a buffer: it is derived from the config, never checkpointed.
        self.mask = torch.triu(torch.ones(c.context, c.context, dtype=torch.bool), diagonal=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = x.shape[1]
        h = self.ln1(x)
        a, _ = self.attn(h, h, h, attn_mask=self.mask[:t, :t], need_weights=False)
        x = x + a
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    def __init__(self, c: GPTConfig = GPTConfig()) -> None:
        super().__init__()
        self.c = c
        self.tok = nn.Embedding(c.vocab, c.width)
        self.pos = nn.Embedding(c.context, c.width)
        self.drop = nn.Dropout(c.dropout)
        self.blocks = nn.ModuleList(Block(c) for _ in range(c.layers))
        self.ln = nn.LayerNorm(c.width)
        self.head = nn.Linear(c.width, c.vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1])
        x = self.drop(self.tok(idx) + self.pos(pos))
        for b in self.blocks:
            x = b(x)
        return self.head(self.ln(x))


def _successors(vocab: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randperm(vocab, generator=g)


def gpt_batch(seed: int, rank: int, iteration: int, batch: int, c: GPTConfig
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """Sequences where each token is its successor-table entry 90% of the time."""
    succ = _successors(c.vocab, seed)
    g = torch.Generator().manual_seed(seed * 7_777_777 + rank * 1_000 + iteration)
    seq = torch.empty(batch, c.context + 1, dtype=torch.long)
    seq[:, 0] = torch.randint(c.vocab, (batch,), generator=g)
    noise = torch.rand(batch, c.context, generator=g) < 0.1
    rand = torch.randint(c.vocab, (batch, c.context), generator=g)
    for t in range(c.context):
        seq[:, t + 1] = torch.where(noise[:, t], rand[:, t], succ[seq[:, t]])
    return seq[:, :-1], seq[:, 1:]


def warmup_cosine(warmup: int, total: int, floor: float = 0.1) -> Callable[[int], float]:
    def f(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        p = min(1.0, (step - warmup) / max(1, total - warmup))
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * p))
    return f


# ----------------------------------------------------------------------------- CNN


class TinyCNN(nn.Module):
    def __init__(self, classes: int = 4, width: int = 16) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, width, 3, padding=1, bias=False), nn.BatchNorm2d(width), nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(width, 2 * width, 3, padding=1, bias=False), nn.BatchNorm2d(2 * width),
            nn.ReLU(), nn.AdaptiveAvgPool2d(1))
        self.fc = nn.Linear(2 * width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.features(x).flatten(1))


def cnn_batch(seed: int, rank: int, iteration: int, batch: int, classes: int = 4
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """Images whose class picks a fixed colour pattern, plus noise."""
    pg = torch.Generator().manual_seed(seed)
    patterns = torch.randn(classes, 3, 16, 16, generator=pg)
    g = torch.Generator().manual_seed(seed * 7_777_777 + rank * 1_000 + iteration)
    y = torch.randint(classes, (batch,), generator=g)
    x = patterns[y] + 1.0 * torch.randn(batch, 3, 16, 16, generator=g)
    return x, y


# ----------------------------------------------------------------------------- registry


@dataclass
class Workload:
    """Everything a trainer loop needs for one model."""

    name: str
    model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: Any
    max_grad_norm: float | None
    batch: Callable[[int, int], tuple[torch.Tensor, torch.Tensor]]  # (rank, iteration)
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def build_gpt(seed: int, steps: int, batch: int = 8, width: int = 64, layers: int = 2
              ) -> Workload:
    from checkmate.optim import AdamW

    c = GPTConfig(width=width, layers=layers)
    torch.manual_seed(seed)
    model = TinyGPT(c)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = AdamW([{"params": decay, "weight_decay": 0.1},
                 {"params": no_decay, "weight_decay": 0.0}], lr=3e-3, betas=(0.9, 0.95))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup_cosine(max(1, steps // 10), steps))

    def loss(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.reshape(-1, c.vocab), y.reshape(-1))

    return Workload("gpt", model, opt, sched, 1.0,
                    lambda r, i: gpt_batch(seed, r, i, batch, c), loss)


def build_cnn(seed: int, steps: int, batch: int = 16, width: int = 16) -> Workload:
    from checkmate.optim import SGD

    torch.manual_seed(seed)
    model = TinyCNN(width=width)
    opt = SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=5e-4)
    half = max(1, steps // 2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 if s < half else 0.2)
    return Workload("cnn", model, opt, sched, None,
                    lambda r, i: cnn_batch(seed, r, i, batch), F.cross_entropy)


class StandIn:
    """Accelerator stand-in: forward and backward replaced by a configured compute time.

    A GPU job's CPU idles while the GPU computes; this trainer sleeps ``seconds`` instead,
    then produces gradients of the real size that are real: one true backward of the
    initial model on this rank's first batch, taken at construction, scaled per iteration
    by an exact float32 factor (deterministic, so a restore redraws the same). They reach
    the parameters through autograd (``loss = c · Σ p·g``), so the gradient path -- DDP
    hooks, the ring, the shadows -- runs as for a real backward. Loss values mean nothing.
    """

    def __init__(self, w: Workload, rank: int, seconds: float) -> None:
        if not 0 <= seconds <= 60:
            raise CheckmateError(f"stand_in must be seconds in [0, 60], got {seconds}")
        self.seconds = seconds
        self.params = [p for p in w.model.parameters() if p.requires_grad]
        x, y = w.batch(rank, 0)
        w.model.zero_grad(set_to_none=True)
        w.loss(w.model(x), y).backward()
        self.grads = [torch.zeros_like(p) if p.grad is None else p.grad.detach().clone()
                      for p in self.params]
        w.model.zero_grad(set_to_none=True)

    def loss(self, iteration: int) -> torch.Tensor:
        """Wait the compute time; return a loss whose backward gives this iteration's
        gradients."""
        import time

        time.sleep(self.seconds)
        scale = 1.0 + (iteration % 8) / 32  # exact in float32
        return scale * sum((p * g).sum() for p, g in zip(self.params, self.grads,
                                                          strict=True))


MODELS: dict[str, Callable[..., Workload]] = {"gpt": build_gpt, "cnn": build_cnn}
DEFAULT_MODEL = "gpt"


def build(name: str, seed: int, steps: int, **kw: Any) -> Workload:
    try:
        f = MODELS[name]
    except KeyError:
        raise CheckmateError(f"unknown model {name!r} (choose from {', '.join(MODELS)})") \
            from None
    return f(seed, steps, **kw)
