"""Named model shapes, for benchmarks on shapes whose weights we do not ship.

``build_random("llama3-8b", dtype=torch.bfloat16, device="cuda")`` creates the
model directly on the target device (built on the meta device, then
materialised there and filled with seeded normal weights): no CPU staging and
no default initialisation pass.

Example::

    >>> import torch
    >>> from kvtier.model.architectures import build_random
    >>> model = build_random("tiny-llama", dtype=torch.float32, device="cpu")
    >>> model.args.n_layers, model.args.vocab_size
    (2, 256)
"""

from __future__ import annotations

import torch

from kvtier.model.llama import ModelArgs, Transformer

_LLAMA3_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}

ARCHITECTURES: dict[str, ModelArgs] = {
    "smollm2-135m": ModelArgs(
        dim=576, n_layers=30, n_heads=9, n_kv_heads=3, hidden_dim=1536, vocab_size=49152,
        rope_theta=100000.0, tie_embeddings=True, max_position_embeddings=8192,
    ),
    "llama2-7b": ModelArgs(
        dim=4096, n_layers=32, n_heads=32, n_kv_heads=32, hidden_dim=11008, vocab_size=32000,
        max_position_embeddings=4096,
    ),
    "llama3-8b": ModelArgs(
        dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, hidden_dim=14336, vocab_size=128256,
        rope_theta=500000.0, max_position_embeddings=8192,
    ),
    "llama3.1-8b": ModelArgs(
        dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, hidden_dim=14336, vocab_size=128256,
        rope_theta=500000.0, rope_scaling=_LLAMA3_SCALING, max_position_embeddings=131072,
    ),
    "mistral-7b": ModelArgs(
        dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, hidden_dim=14336, vocab_size=32768,
        rope_theta=1000000.0, max_position_embeddings=32768, arch="mistral",
    ),
    "qwen2-7b": ModelArgs(
        dim=3584, n_layers=28, n_heads=28, n_kv_heads=4, hidden_dim=18944, vocab_size=152064,
        norm_eps=1e-6, rope_theta=1000000.0, qkv_bias=True, max_position_embeddings=32768,
        arch="qwen2",
    ),
    "qwen3-8b": ModelArgs(
        dim=4096, n_layers=36, n_heads=32, n_kv_heads=8, head_dim=128, hidden_dim=12288,
        vocab_size=151936, norm_eps=1e-6, rope_theta=1000000.0, qk_norm=True,
        max_position_embeddings=40960, arch="qwen3",
    ),
    # tiny shapes for tests: every feature switched on somewhere
    "tiny-llama": ModelArgs(
        dim=64, n_layers=2, n_heads=4, n_kv_heads=2, hidden_dim=128, vocab_size=256,
        tie_embeddings=True, max_position_embeddings=512,
    ),
    "tiny-llama3": ModelArgs(
        dim=64, n_layers=2, n_heads=4, n_kv_heads=2, hidden_dim=128, vocab_size=256,
        rope_theta=500000.0, max_position_embeddings=512,
        rope_scaling={**_LLAMA3_SCALING, "original_max_position_embeddings": 64},
    ),
    "tiny-mistral": ModelArgs(
        dim=64, n_layers=2, n_heads=4, n_kv_heads=1, hidden_dim=96, vocab_size=256,
        rope_theta=1000000.0, max_position_embeddings=512, arch="mistral",
    ),
    "tiny-qwen2": ModelArgs(
        dim=64, n_layers=2, n_heads=4, n_kv_heads=2, hidden_dim=128, vocab_size=256,
        norm_eps=1e-6, qkv_bias=True, tie_embeddings=True, max_position_embeddings=512,
        arch="qwen2",
    ),
    "tiny-qwen3": ModelArgs(
        dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=32, hidden_dim=128,
        vocab_size=256, norm_eps=1e-6, qk_norm=True, max_position_embeddings=512, arch="qwen3",
    ),
}


def get_args(name: str, *, n_layers: int | None = None) -> ModelArgs:
    """The :class:`ModelArgs` of a named architecture, optionally with fewer layers."""
    if name not in ARCHITECTURES:
        raise ValueError(
            f"architecture {name!r} is unknown; accepted: {', '.join(ARCHITECTURES)}"
        )
    args = ARCHITECTURES[name]
    return args if n_layers is None else with_layers(args, n_layers)


def with_layers(args: ModelArgs, n_layers: int) -> ModelArgs:
    """``args`` with ``n_layers`` layers (its first ones: a sliding window keeps to those it names)."""
    layers = args.sliding_layers
    return ModelArgs.from_dict({**args.to_dict(), "n_layers": n_layers,
                                "sliding_layers": None if layers is None else [i for i in layers if i < n_layers]})


@torch.no_grad()
def build_random(
    name: str | ModelArgs,
    *,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    seed: int = 0,
    n_layers: int | None = None,
    std: float = 0.02,
) -> Transformer:
    """A :class:`Transformer` of a named shape with seeded random weights.

    Weights are allocated once, directly on ``device`` in ``dtype``: linear and
    embedding weights ``N(0, std)``, biases ``N(0, std)``, norm weights one.
    The same ``(name, seed, device)`` gives the same weights.
    """
    args = name if isinstance(name, ModelArgs) else get_args(name, n_layers=n_layers)
    if isinstance(name, ModelArgs) and n_layers is not None:
        args = with_layers(args, n_layers)
    model = Transformer(args, device="meta").to(dtype=dtype)  # costs nothing on meta
    model.to_empty(device=device)
    model.tie_weights()  # to_empty makes a new tensor per module
    gen = torch.Generator(device=device).manual_seed(seed)
    for pname, p in model.named_parameters():  # tied weights appear once
        if pname.endswith("norm.weight"):
            p.fill_(1.0)
        else:
            p.normal_(0.0, std, generator=gen)
    return model.eval()
