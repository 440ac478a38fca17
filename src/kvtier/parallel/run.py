"""A loaded model, sharded over the ranks, handed to the same code that runs it on one device.

:func:`load_sharded` loads a model's full weights on the CPU (a GGUF file or a
Hugging Face folder, as :func:`kvtier.model.load_model` does), keeps this rank's
shard (:func:`~kvtier.parallel.shard.shard_model`) and moves only that to the
rank's device. :func:`run_sharded` starts the ranks
(:func:`~kvtier.parallel.launch.run_ranks`) and calls ``fn(lm, *args)`` on each
with its shard: generation code runs unchanged on every rank (SPMD), and rank 0
alone prints (the other ranks' stdout and stderr are silenced).

Example::

    >>> from kvtier.generate import generate
    >>> def answer(lm, prompt):
    ...     return generate(lm.model, lm.tokenizer, prompt)
    >>> run_sharded(answer, 3, args=("The capital of France is",))   # doctest: +SKIP
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch

from kvtier.model.loading import LoadedModel, default_dtype, load_model, model_args
from kvtier.parallel.group import DEFAULT_TIMEOUT_S, TensorParallel
from kvtier.parallel.launch import run_ranks
from kvtier.parallel.shard import check_shardable, shard_model


def load_sharded(path: str | os.PathLike | None, tp: TensorParallel, *,
                 dtype: torch.dtype | None = None) -> LoadedModel:
    """Rank ``tp.rank``'s shard of the model at ``path`` (``None``: the embedded default) on
    ``tp.device``, in ``dtype`` (default: bfloat16 on CUDA, float32 on the CPU).

    The full weights pass through this process's CPU memory once, in ``dtype``;
    the device only ever holds the shard. Raises ``ValueError`` (before touching the
    device) when the model's KV heads do not divide over the ranks.
    """
    dtype = default_dtype(tp.device) if dtype is None else dtype
    lm = load_model(path, device="cpu", dtype=dtype, progress=False)
    check_shardable(lm.args, tp.world_size)
    lm.model = shard_model(lm.model, tp).to(tp.device)
    return lm


def run_sharded(
    fn: Callable[..., Any],
    world_size: int,
    *,
    args: tuple = (),
    model: str | os.PathLike | None = None,
    device_type: str = "cpu",
    dtype: torch.dtype | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> Any:
    """Call ``fn(lm, *args)`` on ``world_size`` ranks, ``lm`` each rank's
    :func:`load_sharded` shard of ``model``; returns rank 0's result (spawned ranks) or
    this rank's (under ``torchrun``).

    ``fn`` and ``args`` must be picklable when spawning. A ``ValueError`` raised on
    any rank (an unshardable model, a bad flag) reaches the caller as a ``ValueError``.
    """
    check_shardable(model_args(model), world_size)  # before a rank starts (and loads the weights)
    return run_ranks(_sharded_rank, world_size, args=(fn, model, dtype, args),
                     device_type=device_type, timeout_s=timeout_s)


def _sharded_rank(tp: TensorParallel, fn, model, dtype, args) -> Any:
    return fn(load_sharded(model, tp, dtype=dtype), *args)
