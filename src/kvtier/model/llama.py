"""One decoder for the Llama family: Llama 2/3, SmolLM2, Mistral, Qwen2 (qkv bias), Qwen3 (q/k norm).

Reads top to bottom: config, model, block, attention, MLP, RMSNorm (RoPE: :mod:`kvtier.model.rope`).

The model never knows which cache tier it runs on. Each layer writes its new
keys and values with ``cache.update(k, v, **cache_kwargs)`` and reads attention
back with ``cache.attention(q)``; positions for RoPE come from the cache's
offset before the write (an ``int``, or a ``[B]`` tensor for tiers whose rows
advance at different rates), so every row is rotated at its own positions.

Example::

    >>> import torch
    >>> from kvtier.model.llama import ModelArgs, Transformer
    >>> args = ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, hidden_dim=128,
    ...                  vocab_size=100)
    >>> model = Transformer(args)
    >>> caches = model.make_caches()
    >>> model(torch.tensor([[1, 2, 3]]), caches).shape      # prefill: (B, T, V)
    torch.Size([1, 3, 100])
    >>> model(torch.tensor([[4]]), caches).shape            # decode at position 3
    torch.Size([1, 1, 100])
"""

from __future__ import annotations

import functools
import math
from collections.abc import Collection
from dataclasses import asdict, dataclass, field
from itertools import islice
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from kvtier.caches.base import KVCache
from kvtier.config import switched_off
from kvtier.kernels.precision import PREFILL_MIN_TOKENS, narrow_dtype, prefill_matmuls
from kvtier.kernels.reference import check_window
from kvtier.model.linear import Linear, prefill_dtype_of

# (ROPE_TYPES, rope_inv_freq and rotate_half re-exported: RoPE lived here before kvtier.model.rope)
from kvtier.model.rope import (  # noqa: F401
    ROPE_TYPES,
    RotaryEmbedding,
    apply_rope,
    check_rope_scaling,
    rope_inv_freq,
    rotate_half,
)

ARCHES = ("llama", "mistral", "qwen2", "qwen3", "phi3")


# -- config ------------------------------------------------------------------------------
@dataclass(frozen=True)
class ModelArgs:
    """Shape and options of a Llama-family decoder.

    ``head_dim`` defaults to ``dim // n_heads``. ``rope_scaling`` is ``None`` or a
    Hugging Face style dict: ``{"rope_type": "llama3", "factor": 8.0,
    "low_freq_factor": 1.0, "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192}`` or ``{"rope_type": "linear",
    "factor": f}``.

    ``sliding_window``: a query at position ``p`` sees only the keys at ``p - sliding_window + 1
    .. p`` (Mistral 7B v0.1, Qwen2 with ``use_sliding_window``), in the layers
    ``sliding_layers`` names (``None``: every layer); ``None``: the whole context.
    """

    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    hidden_dim: int
    vocab_size: int
    head_dim: int | None = None
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = field(default=None, hash=False)
    tie_embeddings: bool = False
    qkv_bias: bool = False
    qk_norm: bool = False
    max_position_embeddings: int = 4096
    arch: str = "llama"
    sliding_window: int | None = None
    sliding_layers: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        for name in ("dim", "n_layers", "n_heads", "n_kv_heads", "hidden_dim", "vocab_size",
                     "max_position_embeddings"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise ValueError(f"ModelArgs.{name} must be a positive int, got {v!r}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"n_heads {self.n_heads} is not a multiple of n_kv_heads {self.n_kv_heads}; "
                "grouped-query attention needs n_heads % n_kv_heads == 0"
            )
        if self.head_dim is None:
            if self.dim % self.n_heads:
                raise ValueError(
                    f"dim {self.dim} is not divisible by n_heads {self.n_heads}; pass head_dim"
                )
            object.__setattr__(self, "head_dim", self.dim // self.n_heads)
        if isinstance(self.head_dim, bool) or not isinstance(self.head_dim, int) or \
                self.head_dim <= 0 or self.head_dim % 2:
            raise ValueError(f"head_dim must be a positive even int (RoPE rotates pairs), "
                             f"got {self.head_dim!r}")
        if not (self.norm_eps > 0):
            raise ValueError(f"norm_eps must be > 0, got {self.norm_eps!r}")
        if not (self.rope_theta > 0):
            raise ValueError(f"rope_theta must be > 0, got {self.rope_theta!r}")
        if self.arch not in ARCHES:
            raise ValueError(f"arch {self.arch!r} is unknown; accepted: {', '.join(ARCHES)}")
        if self.rope_scaling is not None:
            check_rope_scaling(self.rope_scaling, self.head_dim, self.max_position_embeddings)
        self._check_window()

    def _check_window(self) -> None:
        layers = self.sliding_layers
        check_window(self.sliding_window, "sliding_window")
        if layers is None:
            return
        if isinstance(layers, (str, bytes)) or not isinstance(layers, Collection) or not all(
                isinstance(i, int) and not isinstance(i, bool) and 0 <= i < self.n_layers for i in layers):
            raise ValueError(f"sliding_layers must be layer indices in [0, {self.n_layers}) or None (every "
                             f"layer), got {layers!r}")
        object.__setattr__(self, "sliding_layers", tuple(sorted(set(layers))))  # (a list from JSON)

    def window_of(self, layer: int) -> int | None:
        """The sliding window of layer ``layer`` (``None``: it sees the whole context)."""
        if self.sliding_window is None or (self.sliding_layers is not None and layer not in self.sliding_layers):
            return None
        return self.sliding_window

    @property
    def windowed(self) -> bool:
        """Whether some layer has a sliding window (:attr:`sliding_window`)."""
        return self.sliding_window is not None and self.sliding_layers != ()

    @property
    def window_everywhere(self) -> int | None:
        """The sliding window when every layer has it (no layer reads a key before a query's last
        ``window``), else ``None``."""
        layers = self.sliding_layers
        return self.sliding_window if layers is None or len(layers) == self.n_layers else None

    @property
    def n_params(self) -> int:
        """Number of weights (tied embeddings counted once)."""
        D, Hq, Hkv = self.head_dim, self.n_heads, self.n_kv_heads
        attn = self.dim * (Hq + 2 * Hkv) * D + Hq * D * self.dim
        attn += (Hq + 2 * Hkv) * D if self.qkv_bias else 0
        attn += 2 * D if self.qk_norm else 0
        block = attn + 3 * self.dim * self.hidden_dim + 2 * self.dim
        head = 0 if self.tie_embeddings else self.vocab_size * self.dim
        return self.n_layers * block + self.vocab_size * self.dim + self.dim + head

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModelArgs:
        return cls(**d)


# -- model -------------------------------------------------------------------------------
class Transformer(nn.Module):
    """The decoder. ``forward(tokens, caches)`` returns float32 logits ``[B, T, vocab]``."""

    def __init__(self, args: ModelArgs, *, device: torch.device | str | None = None):
        super().__init__()
        self.args = args
        emb = torch.empty(args.vocab_size, args.dim, device=device)
        if emb.device.type != "meta":  # (normal_ on meta would import torch._dynamo: seconds)
            nn.init.normal_(emb)
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim, _weight=emb)
        self.layers = nn.ModuleList(TransformerBlock(args, device) for _ in range(args.n_layers))
        for i, layer in enumerate(self.layers):
            layer.attention.window = args.window_of(i)
        self.norm = RMSNorm(args.dim, args.norm_eps, device)
        self.output = Linear(args.dim, args.vocab_size, bias=False, device=device)
        self.rope = RotaryEmbedding(args, device)
        self.tie_weights()

    def tie_weights(self) -> None:
        """Share the embedding with the LM head when the config says so."""
        if self.args.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight

    def _apply(self, fn, recurse=True):
        from kvtier.model.cpu_step import forget

        forget(self)  # the one-call decode step's pointers would be stale
        return super()._apply(fn, recurse)

    def make_caches(self, config=None, batch_size: int = 1) -> list[KVCache]:
        """One fresh cache per layer, of the tier ``config`` (default: the environment) selects."""
        from kvtier.config import make_caches

        return make_caches(self.args.n_layers, config, batch_size=batch_size)

    def forward(
        self,
        tokens: torch.Tensor,
        caches: list[KVCache],
        *,
        positions: torch.Tensor | None = None,
        cache_kwargs: dict[str, Any] | None = None,
        num_layers: int | None = None,
        last_only: bool = False,
        select: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Run ``tokens`` ``[B, T]`` (int64) through the first ``num_layers`` layers.

        Each layer appends its K/V to ``caches[i]`` (``cache.update(k, v,
        **cache_kwargs)``) and attends through ``cache.attention(q)``.
        ``positions`` ``[B, T]`` (int64) default to the cache's write position
        before this call, ``cache_kwargs["write_start"]`` if given, else
        ``caches[0].offset`` (int or ``[B]``), plus ``arange(T)``.
        ``num_layers`` (default all) stops early and applies the final norm and
        LM head (early-exit drafting). ``last_only`` keeps only the last column;
        ``select`` (int64 ``[k]``, on the tokens' device) only those columns (the last
        token of each sequence packed into one row).

        Returns float32 logits ``[B, T, vocab]`` (``[B, 1, vocab]`` with ``last_only``,
        ``[B, k, vocab]`` with ``select``).
        """
        n = self._check_forward(tokens, caches, positions, num_layers)
        kwargs = cache_kwargs or {}
        # on the CPU one C call where it can (kvtier.model.cpu_step): a few tokens of one sequence,
        # or a decode step a step plan made over paged caches (kvtier.cuda_graph.PlannedDecoder)
        one = tokens.shape[0] == 1 and not kwargs
        planned = kwargs.keys() == {"plan", "write_start"} and n == len(self.layers)
        if (one or planned) and positions is None and select is None and tokens.device.type == "cpu" \
                and cpu_kernels(self.tok_embeddings.weight):
            from kvtier.model.cpu_step import plan_for

            step = plan_for(self)
            logits = None if step is None else (step.run(tokens, caches, n, last_only=last_only) if one
                                                else step.run_planned(tokens, caches, kwargs["plan"], last_only))
            if logits is not None:
                return logits
        # a float32 model's prefill may multiply in bfloat16 (kvtier.kernels.precision); the LM head
        # keeps float32 (logits are what a caller reads: their log-probabilities, a perplexity)
        # (more than 64 tokens a row: a prompt, not a batch of decode steps or a verification of drafts)
        with prefill_matmuls(prefill_dtype_of(self) if tokens.shape[1] > PREFILL_MIN_TOKENS else None):
            h = self._layers(tokens, caches, positions, kwargs, n, last_only, select)
        return self.output(h).float()

    def _layers(self, tokens, caches, positions, kwargs, n, last_only, select) -> torch.Tensor:
        """:meth:`forward` through the layers and the final norm (PyTorch's ops, the fused kernels):
        the normalised hidden states of the positions whose logits are asked for."""
        if positions is None:
            positions = self._positions_from_cache(tokens, caches[0], kwargs)
        positions = positions.to(tokens.device)  # (B, T)
        x = self.tok_embeddings(tokens)  # (B, T, dim)
        cos, sin = self.rope(positions, x.dtype)  # (B, T, 1, D) each
        def columns(t: torch.Tensor) -> torch.Tensor:  # the positions whose logits are asked for
            if last_only:
                return t[:, -1:]  # (B, 1, dim)
            return t if select is None else t[:, select]  # (B, T or k, dim)

        ops = elementwise_ops(x)
        if ops is not None:  # each residual add rides with the next RMSNorm
            delta = None
            for layer, cache in zip(islice(self.layers, n), caches):
                x, delta = layer.forward_fused(x, delta, cos, sin, cache, kwargs)
            return ops.add_rms_norm(columns(x), columns(delta), self.norm.weight, self.norm.eps)[1]
        for layer, cache in zip(islice(self.layers, n), caches):
            x = layer(x, cos, sin, cache, kwargs)
        return self.norm(columns(x))

    def _check_forward(self, tokens, caches, positions, num_layers) -> int:
        if not isinstance(tokens, torch.Tensor) or tokens.dim() != 2 or tokens.dtype != torch.long:
            got = (tuple(tokens.shape), tokens.dtype) if isinstance(tokens, torch.Tensor) else tokens
            raise ValueError(f"tokens must be an int64 tensor [batch, tokens], got {got}; "
                             "use torch.tensor([ids], dtype=torch.long)")
        if tokens.shape[1] == 0:
            raise ValueError("tokens holds 0 positions; pass at least one token")
        n = self.args.n_layers if num_layers is None else num_layers
        if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= self.args.n_layers:
            raise ValueError(f"num_layers must be an int in [1, {self.args.n_layers}], got {n!r}")
        if len(caches) < n:
            raise ValueError(f"{len(caches)} caches given for {n} layers; build them with "
                             "model.make_caches()")
        if positions is not None and (not isinstance(positions, torch.Tensor)
                                      or positions.shape != tokens.shape):
            got = tuple(positions.shape) if isinstance(positions, torch.Tensor) else positions
            raise ValueError(f"positions must be a tensor shaped like tokens {tuple(tokens.shape)}, "
                             f"got {got}")
        return n

    @staticmethod
    def _positions_from_cache(tokens: torch.Tensor, cache: KVCache, kwargs: dict) -> torch.Tensor:
        start = kwargs.get("write_start")
        if start is None:
            start = cache.offset
        B, T = tokens.shape
        steps = torch.arange(T, device=tokens.device)  # (T,)
        if isinstance(start, torch.Tensor):
            return start.to(device=tokens.device, dtype=torch.long).reshape(B, 1) + steps  # (B, T)
        return (steps + int(start)).expand(B, T)  # (B, T)


def fused_kernels(x: torch.Tensor) -> bool:
    """Whether the Triton elementwise kernels (:mod:`kvtier.kernels.triton_fused`), and at one
    row the matrix-vector kernel (:func:`project`), serve ``x``: fp16/bf16 on CUDA, outside
    ``torch.compile`` (which fuses these steps itself), unless ``KVTIER_FUSED=0``."""
    return (x.is_cuda and x.dtype in (torch.float16, torch.bfloat16) and _fused_available()
            and not torch.compiler.is_compiling())


def cpu_kernels(x: torch.Tensor) -> bool:
    """Whether the C elementwise kernels (:mod:`kvtier.kernels.cpu_fused`) serve ``x``: float32
    on the CPU, where they built, outside ``torch.compile`` and autograd (they have no
    backward: a forward that records gradients keeps PyTorch's ops), unless ``KVTIER_FUSED=0``."""
    return (x.device.type == "cpu" and x.dtype == torch.float32 and _cpu_fused_available()
            and not (torch.is_grad_enabled() and x.requires_grad) and not torch.compiler.is_compiling())


def elementwise_ops(x: torch.Tensor):
    """The module of fused elementwise kernels (``rope``, ``add_rms_norm``, ``silu_mul``) that
    serves ``x``: :mod:`kvtier.kernels.triton_fused` where :func:`fused_kernels`,
    :mod:`kvtier.kernels.cpu_fused` where :func:`cpu_kernels`, else ``None`` (PyTorch's ops)."""
    if fused_kernels(x):
        from kvtier.kernels import triton_fused

        return triton_fused
    if cpu_kernels(x):
        from kvtier.kernels import cpu_fused

        return cpu_fused
    return None


def project(lin: nn.Module, x: torch.Tensor, *, silu_mul: bool = False) -> torch.Tensor:
    """``lin(x)`` (``lin(silu(gate) * up)`` of ``x = [gate, up]`` with ``silu_mul``), through the
    Triton matrix-vector kernel (:mod:`kvtier.kernels.triton_gemv`) where it is faster: one row of
    fp16/bf16 on CUDA (the fused kernels on), a plain :class:`Linear` without bias whose outputs
    are no more than its inputs (``wo``, ``w2``). cuBLAS splits those over K at one row and sums
    the parts in a second launch; on the H200 the kernel takes Llama-3-8B's ``wo`` in 11.0 us
    against 13.6 us and ``w2`` in 30.5 against 32.3 us (``benchmarks/tools/gemv_sweep.py``), and
    with ``silu_mul`` it applies the SiLU product as it reads ``x``, one launch fewer."""
    fused = fused_kernels(x)
    width = x.shape[-1] // 2 if silu_mul else x.shape[-1]
    if (fused and type(lin) is Linear and lin.bias is None and x.numel() == x.shape[-1]
            and width == lin.in_features and lin.out_features <= lin.in_features
            and lin.weight.dtype == x.dtype and lin.weight.is_contiguous()):
        from kvtier.kernels.triton_gemv import gemv

        return gemv(x, lin.weight, silu_mul=silu_mul)
    if not silu_mul:
        return lin(x)
    ops = elementwise_ops(x)
    if ops is not None:
        return lin(ops.silu_mul(x))
    gate, up = x.split(width, dim=-1)
    return lin(F.silu(gate) * up)


def _fused_off() -> bool:
    return switched_off("KVTIER_FUSED")


@functools.cache
def _fused_available() -> bool:
    if _fused_off():
        return False
    try:
        import kvtier.kernels.triton_fused  # noqa: F401
    except ImportError:  # no Triton: PyTorch's ops
        return False
    return True


@functools.cache
def _cpu_fused_available() -> bool:
    if _fused_off():
        return False
    from kvtier.kernels.cpu_fused import load_kernels

    return load_kernels() is not None  # no compiler: a warning, and PyTorch's ops


# -- block ---------------------------------------------------------------------------------
class TransformerBlock(nn.Module):
    def __init__(self, args: ModelArgs, device=None):
        super().__init__()
        self.attention = Attention(args, device)
        self.feed_forward = FeedForward(args, device)
        self.attention_norm = RMSNorm(args.dim, args.norm_eps, device)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps, device)

    def forward(self, x, cos, sin, cache: KVCache, cache_kwargs: dict) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), cos, sin, cache, cache_kwargs)
        return h + self.feed_forward(self.ffn_norm(h))

    def forward_fused(self, x, delta, cos, sin, cache: KVCache, cache_kwargs: dict):
        """:meth:`forward` of the residual stream ``x + delta`` (``delta`` ``None``: ``x``) through
        the fused kernels; ``(h, ffn_out)``, whose sum is :meth:`forward`'s result."""
        add_rms_norm = elementwise_ops(x).add_rms_norm
        norm = self.attention_norm
        h, n = add_rms_norm(x, delta, norm.weight, norm.eps)
        a = self.attention(n, cos, sin, cache, cache_kwargs)
        h, n = add_rms_norm(h, a, self.ffn_norm.weight, self.ffn_norm.eps)
        return h, self.feed_forward(n)


# -- attention -------------------------------------------------------------------------------
class Attention(nn.Module):
    """GQA attention with one fused QKV projection; K/V go through the cache."""

    def __init__(self, args: ModelArgs, device=None):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = args.n_heads, args.n_kv_heads, args.head_dim
        qkv_dim = (args.n_heads + 2 * args.n_kv_heads) * args.head_dim
        self.wqkv = Linear(args.dim, qkv_dim, bias=args.qkv_bias, device=device)
        self.wo = Linear(args.n_heads * args.head_dim, args.dim, bias=False, device=device)
        self.q_norm = RMSNorm(args.head_dim, args.norm_eps, device) if args.qk_norm else None
        self.k_norm = RMSNorm(args.head_dim, args.norm_eps, device) if args.qk_norm else None
        self.scale = 1.0 / math.sqrt(args.head_dim)
        #: the keys a query sees (its own and the ``window - 1`` before), ``None``: every key; the
        #: model sets it per layer (:meth:`ModelArgs.window_of`)
        self.window: int | None = None

    def forward(self, x, cos, sin, cache: KVCache, cache_kwargs: dict) -> torch.Tensor:
        B, T, _ = x.shape
        Hq, Hkv, D = self.n_heads, self.n_kv_heads, self.head_dim
        qkv = self.wqkv(x).view(B, T, Hq + 2 * Hkv, D)  # (B, T, H_q + 2 H_kv, D)
        qk, v = qkv.split([Hq + Hkv, Hkv], dim=2)  # (B, T, H_q + H_kv, D), (B, T, H_kv, D)
        if self.q_norm is not None:  # Qwen3: RMSNorm over each head of q and of k
            qk = torch.cat([self.q_norm(qk[:, :, :Hq]), self.k_norm(qk[:, :, Hq:])], dim=2)
        ops = elementwise_ops(x)
        if ops is not None:
            qk = ops.rope(qk, cos, sin).transpose(1, 2)  # (B, H_q + H_kv, T, D): one kernel
        else:
            qk = apply_rope(qk, cos, sin).transpose(1, 2)  # (B, H_q + H_kv, T, D): one rotation
        q, k = qk.split([Hq, Hkv], dim=1)  # (B, H_q, T, D), (B, H_kv, T, D)
        cache.update(k, v.transpose(1, 2), **cache_kwargs)  # v: (B, H_kv, T, D)
        if self.window is None:
            out = cache.attention(q, scale=self.scale)  # (B, H_q, T, D)
        else:
            out = cache.attention(q, scale=self.scale, window=self.window)
        return project(self.wo, out.transpose(1, 2).reshape(B, T, Hq * D))  # (B, T, dim)


# -- MLP ---------------------------------------------------------------------------------------
class FeedForward(nn.Module):
    """SwiGLU: ``w2(silu(gate(x)) * up(x))`` with gate and up fused into ``w13``."""

    def __init__(self, args: ModelArgs, device=None):
        super().__init__()
        self.hidden_dim = args.hidden_dim
        self.w13 = Linear(args.dim, 2 * args.hidden_dim, bias=False, device=device)
        self.w2 = Linear(args.hidden_dim, args.dim, bias=False, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        low = narrow_dtype(x)
        if low is not None:  # a bfloat16 prefill (kvtier.kernels.precision): the SiLU product stays in it
            gate, up = self.w13(x.to(low)).split(self.hidden_dim, dim=-1)  # (B, T, hidden) each
            return self.w2(F.silu(gate) * up).float()
        return project(self.w2, self.w13(x), silu_mul=True)  # w13: (B, T, 2 hidden), gate then up


# -- norm ----------------------------------------------------------------------------------------
class RMSNorm(nn.Module):
    """``x * rsqrt(mean(x^2) + eps) * weight`` over the last dimension (one fused op)."""

    def __init__(self, dim: int, eps: float, device=None):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, device=device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
