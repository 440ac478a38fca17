"""The layers a tensor-parallel rank runs in place of the full ones (Megatron-style).

A column-parallel linear is a plain ``nn.Linear`` holding some of the output
rows (``wqkv``: this rank's query, key and value heads; ``w13``: its slices of
gate and up), so it needs no class of its own. What communicates:

- :class:`RowParallelLinear` (``wo``, ``w2``): the rank's input columns, then one
  all-reduce that sums the ranks' partial outputs.
- :class:`VocabParallelEmbedding`: the rank's rows of the vocabulary; a token
  outside them gives zeros, and an all-reduce adds the one rank that holds it.
- :class:`VocabParallelLMHead`: logits of the rank's vocabulary rows, gathered
  into the full ``[..., vocab]`` on every rank (so every rank samples the same token).

The vocabulary is split in equal shards of ``ceil(vocab / world)`` rows; the last
shard is padded with zero rows, which the LM head cuts off again.

Every collective is in place on a tensor of fixed shape, so a CUDA graph
captures it with the rest of a decode step.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

from kvtier.kernels.precision import narrow_dtype
from kvtier.model.linear import narrow_linear


def split_range(n: int, world_size: int, rank: int) -> tuple[int, int]:
    """``[start, end)`` of rank ``rank``'s share of ``n`` items split as evenly as they go
    (the first ``n % world_size`` ranks take one more)."""
    base, extra = divmod(n, world_size)
    start = rank * base + min(rank, extra)
    return start, start + base + (rank < extra)


def vocab_shard_rows(vocab_size: int, world_size: int) -> int:
    """Rows of every rank's vocabulary shard: ``ceil(vocab_size / world_size)``."""
    return -(-vocab_size // world_size)


class RowParallelLinear(nn.Module):
    """``y = sum over ranks of x_r @ W_r^T``: ``x`` ``[..., in/world]`` holds this rank's
    input features, ``weight`` ``[out, in/world]`` the matching columns; returns the full
    ``[..., out]`` on every rank (one all-reduce)."""

    def __init__(self, weight: torch.Tensor, group: dist.ProcessGroup | None = None):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=weight.requires_grad)
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        low = narrow_dtype(x)  # a bfloat16 prefill (kvtier.kernels.precision)
        y = F.linear(x, self.weight) if low is None else narrow_linear(x, self.weight, None, low).float()  # (..., out)
        dist.all_reduce(y, group=self.group)  # (this rank's partial sum, then every rank's)
        return y


class VocabParallelEmbedding(nn.Module):
    """Embedding rows ``[start, start + rows)`` of the vocabulary; ``weight`` ``[rows, dim]``.

    ``forward(tokens)`` (int64, any shape) returns ``[*tokens.shape, dim]`` on every
    rank: each rank looks up the tokens it holds, zeros the others, and an
    all-reduce adds the ranks up.
    """

    def __init__(self, weight: torch.Tensor, start: int, group: dist.ProcessGroup | None = None):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=weight.requires_grad)
        self.start, self.group = start, group

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        local = tokens - self.start  # (B, T): row in this shard, if it is one
        outside = (local < 0) | (local >= self.weight.shape[0])  # (B, T)
        x = F.embedding(local.masked_fill(outside, 0), self.weight)  # (B, T, dim)
        x = x.masked_fill(outside[..., None], 0)
        dist.all_reduce(x, group=self.group)
        return x


class VocabParallelLMHead(nn.Module):
    """Logits over the whole vocabulary from this rank's rows ``weight`` ``[rows, dim]``,
    rows ``[start, start + rows)`` of the (padded) vocabulary.

    ``forward(x)`` (``[..., dim]``) computes ``[..., rows]`` here and returns
    ``[..., vocab_size]``, bit for bit the same on every rank. The shards meet by an
    all-reduce of a zero-filled ``[..., world * rows]`` buffer in which each rank
    fills its own slice (adding zeros is exact): the same bits as an all-gather,
    through the one collective every backend and torch version captures in a CUDA
    graph, for ``world`` times the traffic of a ``[B, 1, vocab]`` step, which is small.
    """

    def __init__(self, weight: torch.Tensor, start: int, vocab_size: int, world_size: int,
                 group: dist.ProcessGroup | None = None):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=weight.requires_grad)
        self.start, self.vocab_size, self.world_size, self.group = start, vocab_size, world_size, group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = self.weight.shape[0]
        logits = x.new_zeros((*x.shape[:-1], self.world_size * rows))  # (..., padded vocab)
        logits[..., self.start : self.start + rows] = F.linear(x, self.weight)  # (..., rows)
        dist.all_reduce(logits, group=self.group)
        return logits[..., : self.vocab_size]  # (..., vocab)
