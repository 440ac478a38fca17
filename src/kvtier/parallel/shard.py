"""Slicing a loaded Llama-family model into one rank's shard, in place.

What each rank keeps (``N`` ranks, rank ``r``; ``H_q``/``H_kv`` query/KV heads):

==================  =====================================================  ==================
weight              rows or columns kept                                   after it
==================  =====================================================  ==================
``wqkv`` (+ bias)   rows of q heads ``[r H_q/N, (r+1) H_q/N)``, and the     (nothing)
                    matching k and v heads ``[r H_kv/N, (r+1) H_kv/N)``
``wo``              the columns of those q heads                           all-reduce
``w13``             rows ``[a, b)`` of gate and ``[a, b)`` of up            (nothing)
``w2``              columns ``[a, b)``                                     all-reduce
embedding           vocabulary rows ``[r V', (r+1) V')``, ``V' = ceil(V/N)``  all-reduce
LM head             the same rows (tied or not)                            gather (all-reduce)
norms, RoPE         everything (replicated)
==================  =====================================================  ==================

``[a, b)`` is rank ``r``'s share of the MLP's hidden size (uneven shares are
fine). Each attention layer then holds ``H_q/N`` query and ``H_kv/N`` KV heads, so
its cache (any tier, quantised pages included) stores only this rank's KV heads:
the model code is unchanged, the caches simply see fewer heads. Query heads stay
with their KV group because both are split in contiguous, equal runs.

Example (one rank of one, no communication; see :func:`kvtier.parallel.launch`)::

    >>> model = build_random("tiny-llama")
    >>> check_shardable(model.args, 2)      # 2 KV heads: fine
    >>> check_shardable(model.args, 4)
    Traceback (most recent call last):
    ValueError: tensor parallel size 4 does not divide the 2 KV heads ...
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch
from torch import nn

from kvtier.model.linear import Linear
from kvtier.model.llama import Attention, FeedForward, ModelArgs, Transformer
from kvtier.parallel.group import TensorParallel
from kvtier.parallel.layers import (
    RowParallelLinear,
    VocabParallelEmbedding,
    VocabParallelLMHead,
    split_range,
    vocab_shard_rows,
)


def check_shardable(args: ModelArgs, world_size: int) -> None:
    """Refuse a split that cannot work: KV heads (and with them query heads) must divide
    evenly over the ranks, since each rank owns whole KV heads and their query groups."""
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"tensor parallel size must be an int >= 1, got {world_size!r}")
    if args.n_kv_heads % world_size:
        divisors = [n for n in range(1, args.n_kv_heads + 1) if args.n_kv_heads % n == 0]
        raise ValueError(
            f"tensor parallel size {world_size} does not divide the {args.n_kv_heads} KV heads "
            f"of this model (each rank owns whole KV heads); use --tensor-parallel "
            f"{' or '.join(map(str, divisors))}"
        )


def is_sharded(model: Transformer) -> bool:
    return isinstance(model.output, VocabParallelLMHead)


@torch.no_grad()
def shard_model(model: Transformer, tp: TensorParallel) -> Transformer:
    """Cut ``model`` (full weights, any device, meta included) down to rank ``tp.rank``'s
    shard in place and install the all-reduces; returns it. One rank of one is left as is.

    The sliced weights are copies, so the full tensors are freed once nothing else
    holds them. Afterwards ``model.args`` describes the shard: this rank's
    ``n_heads``, ``n_kv_heads`` and ``hidden_dim`` (``dim``, ``head_dim`` and
    ``vocab_size`` stay whole), so code that sizes caches from the args (the serving
    engine's page pool, bytes per token) sizes this rank's; each ``Attention`` and
    ``FeedForward`` holds the same local counts.
    """
    check_shardable(model.args, tp.world_size)
    if is_sharded(model):
        raise ValueError("this model is already sharded; shard a freshly loaded model")
    if tp.world_size == 1:
        return model
    for layer in model.layers:
        _shard_attention(layer.attention, tp)
        _shard_mlp(layer.feed_forward, tp)
    _shard_vocab(model, tp)
    attn, mlp = model.layers[0].attention, model.layers[0].feed_forward
    model.args = dataclasses.replace(model.args, n_heads=attn.n_heads, n_kv_heads=attn.n_kv_heads,
                                     hidden_dim=mlp.hidden_dim)
    return model


def _rows(w: torch.Tensor, ranges: Sequence[tuple[int, int]], dim: int = 0) -> torch.Tensor:
    """The concatenated slices ``[a, b)`` of ``w`` along ``dim``, as a new tensor."""
    return torch.cat([w.narrow(dim, a, b - a) for a, b in ranges], dim=dim).contiguous()


def _linear(weight: torch.Tensor, bias: torch.Tensor | None) -> Linear:
    """A column shard: the model's own :class:`~kvtier.model.linear.Linear` (its products, and a
    bfloat16 prefill's) over ``weight``'s rows."""
    out_features, in_features = weight.shape
    lin = Linear(in_features, out_features, bias=bias is not None, device="meta")
    lin.weight = nn.Parameter(weight, requires_grad=False)
    if bias is not None:
        lin.bias = nn.Parameter(bias, requires_grad=False)
    return lin


def _shard_attention(attn: Attention, tp: TensorParallel) -> None:
    Hq, Hkv, D = attn.n_heads, attn.n_kv_heads, attn.head_dim
    hq, hkv, r = Hq // tp.world_size, Hkv // tp.world_size, tp.rank
    ranges = [(r * hq * D, (r + 1) * hq * D),  # q heads
              ((Hq + r * hkv) * D, (Hq + (r + 1) * hkv) * D),  # k heads
              ((Hq + Hkv + r * hkv) * D, (Hq + Hkv + (r + 1) * hkv) * D)]  # v heads
    bias = attn.wqkv.bias
    attn.wqkv = _linear(_rows(attn.wqkv.weight, ranges),
                        None if bias is None else _rows(bias, ranges))
    attn.wo = RowParallelLinear(_rows(attn.wo.weight, ranges[:1], dim=1), tp.group)
    attn.n_heads, attn.n_kv_heads = hq, hkv


def _shard_mlp(mlp: FeedForward, tp: TensorParallel) -> None:
    H = mlp.hidden_dim
    a, b = split_range(H, tp.world_size, tp.rank)
    mlp.w13 = _linear(_rows(mlp.w13.weight, [(a, b), (H + a, H + b)]), None)  # [gate | up]
    mlp.w2 = RowParallelLinear(_rows(mlp.w2.weight, [(a, b)], dim=1), tp.group)
    mlp.hidden_dim = b - a


def _vocab_rows(w: torch.Tensor, tp: TensorParallel, vocab_size: int) -> torch.Tensor:
    """Rank ``tp.rank``'s ``ceil(V / N)`` rows of ``w`` ``[V, dim]``, zero-padded at the end."""
    rows = vocab_shard_rows(vocab_size, tp.world_size)
    start = min(tp.rank * rows, vocab_size)
    end = min(start + rows, vocab_size)
    shard = w.new_zeros((rows, w.shape[1]))
    shard[: end - start] = w[start:end]
    return shard


def _shard_vocab(model: Transformer, tp: TensorParallel) -> None:
    V = model.args.vocab_size
    start = tp.rank * vocab_shard_rows(V, tp.world_size)
    emb = _vocab_rows(model.tok_embeddings.weight, tp, V)
    model.tok_embeddings = VocabParallelEmbedding(emb, start, tp.group)
    head = emb if model.args.tie_embeddings else _vocab_rows(model.output.weight, tp, V)
    model.output = VocabParallelLMHead(head, start, V, tp.world_size, tp.group)
    model.tie_weights()  # tied: one shard serves both


@torch.no_grad()
def build_random_shard(
    args: ModelArgs,
    tp: TensorParallel,
    *,
    dtype: torch.dtype = torch.bfloat16,
    seed: int = 0,
    std: float = 0.02,
) -> Transformer:
    """Rank ``tp.rank``'s shard of a random-weight model, allocated directly on ``tp.device``.

    The full weights never exist anywhere: the model is built and sharded on the
    meta device, then only the shard is materialised and filled (``N(0, std)``,
    norms one; each rank from its own seeded generator). For shapes that do not
    fit one device (a 70B model in bf16 is about 140 GB). The weights differ from
    :func:`kvtier.model.build_random`'s; to compare against one device, build the
    full model and :func:`shard_model` it instead.
    """
    model = Transformer(args, device="meta").to(dtype=dtype)
    shard_model(model, tp)
    model.to_empty(device=tp.device)
    model.tie_weights()  # to_empty makes a new tensor per module
    gen = torch.Generator(device=tp.device).manual_seed(seed + 7919 * tp.rank)
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            p.fill_(1.0)
        else:
            p.normal_(0.0, std, generator=gen)
    return model.eval()
