"""Quality of a cache mode: perplexity, KL divergence and top-1 agreement against full precision.

Every mode runs the model through a real cache: each window of text is fed in
chunks, each layer writes its keys and values into the cache (quantised on
write for the quantised modes) and reads attention back through the cache's own
read path, so the figures are those of decoding, not of fake quantisation.

Modes (``--modes``):

=========================  ======================================================
``fp`` (or ``off``)        full precision, through ``EvalConfig.tier`` (default: paged)
``q8`` ``q4`` ``q4_g32``   KV-Quant storage in the paged tier
``turboquant``             TurboQuant with its default codes (K ``q8_0``, V ``q3_0``)
``turboquant:K[r],V``      TurboQuant with key code ``K`` (``r``: rotated keys), value code ``V``
=========================  ======================================================

The names are those of :func:`kvtier.quant.modes.parse_mode`; a result keeps the
name as given.

Windows: ``context`` tokens each, starting every ``stride`` tokens (default:
``context``, no overlap); each window starts with empty caches and scores only
the tokens the previous window did not (the usual sliding-window perplexity;
every token but the first is scored exactly once, see :func:`windows`).

Example::

    >>> from kvtier.model import load_model
    >>> lm = load_model()
    >>> tokens = lm.tokenizer.encode(default_text())[:1024]
    >>> results = evaluate_modes(lm.model, tokens, EvalConfig(context=512, modes=("fp", "q8")))
    >>> [(r.mode, round(r.delta_pct, 2)) for r in results]  # q8's figure moves with the CPU's rounding
    [('fp', 0.0), ('q8', 0.21)]
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from kvtier.caches.base import KVCache
from kvtier.config import TIERS, KVCacheConfig, make_caches
from kvtier.quant.modes import FULL_PRECISION_ALIAS, TURBOQUANT, is_full_precision, parse_mode

DEFAULT_MODES = ("fp", "q8", "q4", "q4_g32", "turboquant")


@dataclass(frozen=True)
class EvalConfig:
    """What to evaluate and how the text is windowed."""

    #: tokens per window (each window starts with empty caches)
    context: int = 2048
    #: tokens between window starts (``None``: ``context``, no overlap)
    stride: int | None = None
    #: tokens of text evaluated at most (``None``: all of it)
    max_tokens: int | None = 4096
    #: tokens per forward while filling a window
    chunk: int = 256
    modes: tuple[str, ...] = DEFAULT_MODES
    #: tier of the ``fp`` mode (quantised modes always use the paged tier)
    tier: str = "paged"

    def __post_init__(self) -> None:
        for name in ("context", "chunk"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 2:
                raise ValueError(f"{name} must be an int >= 2, got {v!r}")
        stride = self.context if self.stride is None else self.stride
        if isinstance(stride, bool) or not isinstance(stride, int) or not 1 <= stride <= self.context:
            raise ValueError(f"stride must be an int in [1, context={self.context}], got {stride!r}")
        if self.max_tokens is not None and (
            isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 2
        ):
            raise ValueError(f"max_tokens must be an int >= 2 or None, got {self.max_tokens!r}")
        if not isinstance(self.modes, tuple) or not self.modes:
            raise ValueError(f"modes must be a non-empty tuple of mode names, got {self.modes!r}")
        storages = [parse_mode(m) for m in self.modes]  # raises ValueError naming a bad mode
        if len(set(storages)) != len(storages):
            raise ValueError(f"modes {self.modes} name a mode twice")
        if self.tier not in TIERS:
            raise ValueError(f"tier {self.tier!r} is unknown; accepted: {', '.join(TIERS)}")

    @property
    def window_stride(self) -> int:
        return self.context if self.stride is None else self.stride


@dataclass(frozen=True)
class ModeResult:
    """Figures of one mode. ``kl`` (nats per token) and ``top1`` compare with ``fp``."""

    mode: str
    ppl: float
    delta_pct: float
    bits_per_element: float
    kl: float
    top1: float
    tokens: int

    def as_dict(self) -> dict[str, float | int | str]:
        return {f: getattr(self, f) for f in self.__dataclass_fields__}


def mode_config(mode: str, base: KVCacheConfig | None = None, *, fp_tier: str = "paged") -> KVCacheConfig:
    """The :class:`KVCacheConfig` of a mode name (see the module docstring): ``base`` with
    the mode's storage; full precision on the ``fp_tier`` tier, the others on the paged tier.

    Example::

        >>> mode_config("turboquant:q5_0r,q4_0").turboquant
        TurboQuantConfig(key_quant='q5_0', value_quant='q4_0', rotate_keys=True, seed=0)
    """
    base = KVCacheConfig() if base is None else base
    kv_quant, turboquant = parse_mode(mode)
    tier = fp_tier if kv_quant is None and turboquant is None else "paged"
    return base.replace(tier=tier, kv_quant=kv_quant, turboquant=turboquant)


def parse_modes(text: str) -> tuple[str, ...]:
    """Mode names from a comma-separated list, where ``turboquant:KEY,VALUE`` keeps its comma:
    ``"fp,q8,turboquant:q5_0r,q4_0"`` -> ``("fp", "q8", "turboquant:q5_0r,q4_0")``."""
    modes: list[str] = []
    for piece in (p.strip() for p in text.split(",")):
        if modes and modes[-1].lower().startswith(f"{TURBOQUANT}:") and "," not in modes[-1]:
            modes[-1] += "," + piece
        elif piece:
            modes.append(piece)
    return tuple(modes)


def default_text() -> str:
    """The prose of Python's own ``pydoc_data.topics`` (present on every Python install)."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[k] for k in sorted(topics))


def encode_text(tokenizer, text: str, max_tokens: int | None = None) -> list[int]:
    """Token ids of ``text``, at most ``max_tokens`` (encoding only as much text as that needs)."""
    if max_tokens is not None:
        # 16 characters per token is far above English's ~4: one encode is nearly always enough
        ids = tokenizer.encode(text[: 16 * max_tokens])
        if len(ids) >= max_tokens or len(text) <= 16 * max_tokens:
            return ids[:max_tokens]
    return tokenizer.encode(text)[:max_tokens]


def windows(n_tokens: int, context: int, stride: int) -> list[tuple[int, int, int]]:
    """``(begin, end, first_scored)`` of each window over ``n_tokens`` tokens.

    Windows start every ``stride`` tokens, but never after the token before the
    first one they score (without overlap, a window starts one token early), so
    token ``p`` (predicted from the logits at ``p - 1``) is scored in exactly one
    window, the first that reaches it; token 0 is never scored.
    """
    out, prev_end, begin = [], 1, 0
    while prev_end < n_tokens:
        begin = min(begin, prev_end - 1)
        end = min(begin + context, n_tokens)
        out.append((begin, end, prev_end))
        prev_end, begin = end, begin + stride
    return out


def evaluate_modes(
    model,
    tokens: Sequence[int],
    config: EvalConfig | None = None,
    *,
    base: KVCacheConfig | None = None,
    on_progress: Callable[[int, int], None] | None = None,
) -> list[ModeResult]:
    """Perplexity, KL and top-1 agreement of every mode in ``config.modes``.

    ``tokens``: the text's token ids. ``base``: tier geometry for every mode
    (block sizes, backend), default ``KVCacheConfig()``. Full precision is always
    computed (first) as the reference even when ``config.modes`` omits it.
    ``on_progress(done, total)`` counts scored tokens.
    """
    config = EvalConfig() if config is None else config
    tokens = list(tokens)[: config.max_tokens]
    if len(tokens) < 2:
        raise ValueError(f"the text holds {len(tokens)} token{'s' * (len(tokens) != 1)}; perplexity "
                         "needs at least 2")
    limit = model.args.max_position_embeddings
    if config.context > limit:
        raise ValueError(f"context {config.context} is longer than the model's {limit} positions; "
                         f"pass a context of {limit} or less (--context)")
    ref = next((m for m in config.modes if is_full_precision(m)), FULL_PRECISION_ALIAS)
    modes = (ref,) + tuple(m for m in config.modes if m != ref)
    base = KVCacheConfig() if base is None else base
    # a paged pool of exactly one window (the default 1024 blocks would be mostly idle)
    blocks = math.ceil(min(config.context, len(tokens)) / base.paged_block_size)
    cfgs = {m: mode_config(m, base.replace(paged_num_blocks=blocks), fp_tier=config.tier) for m in modes}
    acc = {m: _Acc() for m in modes}
    device = next(model.parameters()).device
    ids = torch.tensor(tokens, dtype=torch.long, device=device)
    spans = windows(len(tokens), config.context, config.window_stride)
    total = sum(end - first for _, end, first in spans)
    with torch.inference_mode():
        for begin, end, first in spans:
            caches = {m: make_caches(model.args.n_layers, cfgs[m], batch_size=1) for m in modes}
            for s in range(begin, end, config.chunk):
                e = min(s + config.chunk, end)
                _score_chunk(model, ids, s, e, first, end, caches, acc)
                if on_progress is not None:
                    on_progress(acc[ref].count, total)
            for m in modes:
                acc[m].bits = bits_per_element(caches[m])
    fp_ppl = acc[ref].ppl
    return [
        ModeResult(
            mode=m, ppl=acc[m].ppl, delta_pct=100.0 * (acc[m].ppl / fp_ppl - 1.0),
            bits_per_element=acc[m].bits, kl=acc[m].kl_sum / acc[m].count,
            top1=acc[m].agree / acc[m].count, tokens=acc[m].count,
        )
        for m in modes
        if m in config.modes
    ]


class _Acc:
    def __init__(self) -> None:
        self.nll = self.kl_sum = 0.0
        self.count = self.agree = 0
        self.bits = float("nan")

    @property
    def ppl(self) -> float:
        return math.exp(self.nll / self.count)


def _score_chunk(model, ids, s, e, first, end, caches, acc) -> None:
    """Feed tokens ``[s, e)`` to every mode's caches and score the targets they predict.

    The logits at position ``p`` predict token ``p + 1``: this chunk scores the
    targets in ``[s + 1, e + 1)`` that lie in the window's scored span ``[first, end)``.
    """
    lo, hi = max(first, s + 1), min(e + 1, end)
    if lo >= hi:
        for c in caches.values():
            model(ids[None, s:e], c, last_only=True)
        return
    targets = ids[lo:hi]  # (n,)
    ref = None
    for m, c in caches.items():
        logits = model(ids[None, s:e], c)[0, lo - 1 - s : hi - 1 - s]  # (n, V) float32
        logp = torch.log_softmax(logits, dim=-1)
        a = acc[m]
        a.nll -= logp.gather(1, targets[:, None]).sum().item()
        a.count += targets.numel()
        if ref is None:  # full precision comes first
            ref = logp
            a.agree += targets.numel()
            continue
        a.kl_sum += (ref.exp() * (ref - logp)).sum().item()
        a.agree += (ref.argmax(-1) == logp.argmax(-1)).sum().item()


def bits_per_element(caches: list[KVCache]) -> float:
    """Stored bits per K/V element, sidecars (scales, zeros) included, of the first layer's cache."""
    from kvtier.caches.paged import PagedKVCache

    c = caches[0]
    if isinstance(c, PagedKVCache) and c.codecs is not None:
        k, v = c.codecs.k_codec, c.codecs.v_codec
        return 4.0 * (k.bytes_per_token_head() + v.bytes_per_token_head()) / k.head_dim
    k, _ = c.fetch()
    return 8.0 * k.element_size()
