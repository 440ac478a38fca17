"""Tensor parallelism over ``torch.distributed``: NCCL on CUDA, gloo on the CPU.

Megatron-style: each rank holds its query and KV heads (and so the caches of its
KV heads, any tier), its share of the MLP, and its rows of the vocabulary; one
all-reduce after attention, one after the MLP, an all-gather of the logits.

- :mod:`~kvtier.parallel.group`: process groups, refusals, the rank's place.
- :mod:`~kvtier.parallel.layers`: row-parallel linear, vocabulary-parallel embedding and head.
- :mod:`~kvtier.parallel.shard`: slicing a loaded model into one rank's shard.
- :mod:`~kvtier.parallel.launch`: spawning the ranks, or joining ``torchrun``'s.
- :mod:`~kvtier.parallel.run`: load, shard and run the same code on every rank.

See ``docs/scaling.md``.
"""

from kvtier.parallel.group import (
    TensorParallel,
    check_same_device,
    check_world,
    destroy_tensor_parallel,
    init_from_torchrun,
    init_tensor_parallel,
)
from kvtier.parallel.launch import TensorParallelError, launch, run_ranks
from kvtier.parallel.run import load_sharded, run_sharded
from kvtier.parallel.shard import build_random_shard, check_shardable, shard_model

__all__ = [
    "TensorParallel",
    "TensorParallelError",
    "build_random_shard",
    "check_same_device",
    "check_shardable",
    "check_world",
    "destroy_tensor_parallel",
    "init_from_torchrun",
    "init_tensor_parallel",
    "launch",
    "load_sharded",
    "run_ranks",
    "run_sharded",
    "shard_model",
]
