"""Turning next-token logits into tokens: greedy, temperature, top-k, top-p, min-p; and
the penalties a server's requests ask for (:func:`apply_penalties`).

:func:`process_logits` returns the exact distribution a token is drawn from, so
speculative decoding can use the same probabilities for its acceptance test;
:func:`sample` draws from it (greedy is a plain argmax).

Order of the filters (each one renormalises what it keeps):

1. temperature: ``softmax(logits / temperature)``;
2. top-k: keep the ``k`` largest probabilities (ties with the ``k``-th are kept);
3. top-p: keep the smallest set of the largest probabilities whose sum reaches ``p``;
4. min-p: keep the tokens whose probability is at least ``min_p`` times the largest.

Example::

    >>> import torch
    >>> params = SamplingParams(temperature=0.7, top_p=0.9, seed=0)
    >>> gen = make_generator(params, "cpu")
    >>> logits = torch.randn(2, 32000)                 # (B, V) float32
    >>> sample(logits, params, gen).shape              # (B,) int64
    torch.Size([2])
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

#: temperatures below this decode greedily, as vLLM's do: logits divided by a smaller one can
#: overflow float32 (1e-40 made every probability NaN), and above it a sample is all but greedy
GREEDY_BELOW = 1e-5


@dataclass(frozen=True)
class SamplingParams:
    """How to pick the next token. ``temperature`` 0 (or below :data:`GREEDY_BELOW`) is
    greedy (the filters do not apply).

    ``top_k == 0`` keeps every token, ``top_p == 1`` and ``min_p == 0`` disable
    their filters; ``seed`` makes sampling reproducible (``None``: torch's global RNG).
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None

    def __post_init__(self) -> None:
        t = self.temperature
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t < 0:
            raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got {t!r}")
        k = self.top_k
        if isinstance(k, bool) or not isinstance(k, int) or k < 0:
            raise ValueError(f"top_k must be an int >= 0 (0 = off), got {k!r}")
        p = self.top_p
        if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0.0 < p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1] (1 = off), got {p!r}")
        m = self.min_p
        if isinstance(m, bool) or not isinstance(m, (int, float)) or not 0.0 <= m <= 1.0:
            raise ValueError(f"min_p must be in [0, 1] (0 = off), got {m!r}")
        s = self.seed
        if s is not None and (isinstance(s, bool) or not isinstance(s, int) or not 0 <= s < 2**64):
            raise ValueError(f"seed must be an int in [0, 2**64) or None, got {s!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW


def make_generator(params: SamplingParams, device: torch.device | str) -> torch.Generator | None:
    """A ``torch.Generator`` on ``device`` seeded with ``params.seed`` (``None`` without a seed)."""
    if params.seed is None:
        return None
    gen = torch.Generator(device=torch.device(device))
    gen.manual_seed(params.seed)
    return gen


def _check_logits(logits: torch.Tensor) -> None:
    if not isinstance(logits, torch.Tensor) or logits.dim() != 2 or not logits.is_floating_point():
        shape = tuple(logits.shape) if isinstance(logits, torch.Tensor) else type(logits).__name__
        raise ValueError(
            f"logits must be a floating [batch, vocab] tensor, got {shape}; "
            "take the last position with logits[:, -1]"
        )


def process_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution :func:`sample` draws from, ``[B, V]`` float32 rows summing to 1.

    ``logits``: ``[B, V]`` (any float dtype). Greedy params give a one-hot row at
    the argmax (the distribution greedy decoding samples from).
    """
    _check_logits(logits)
    if params.greedy:
        probs = torch.zeros(logits.shape, dtype=torch.float32, device=logits.device)
        return probs.scatter_(1, logits.argmax(dim=-1, keepdim=True), 1.0)
    scaled = logits.float() / params.temperature
    probs = torch.softmax(scaled, dim=-1)  # (B, V)
    if 0 < params.top_k < probs.shape[-1]:
        # (ranked by logit: at a low temperature the far tokens' probabilities reach float32's
        # subnormals, where different logits round to one value and a rank by probability
        # would keep more than top_k)
        kth = torch.topk(scaled, params.top_k, dim=-1).values[:, -1:]  # (B, 1)
        probs = _renormalise(probs.masked_fill(scaled < kth, 0.0))
    if params.top_p < 1.0:
        sorted_p, order = torch.sort(probs, dim=-1, descending=True)
        # drop a token when the tokens before it already reach top_p (the first is always kept)
        drop_sorted = (sorted_p.cumsum(dim=-1) - sorted_p) >= params.top_p
        drop_sorted[:, 0] = False  # also where top_p rounds to 0 in float32 (below 1.4e-45)
        drop = torch.zeros_like(drop_sorted).scatter_(1, order, drop_sorted)
        probs = _renormalise(probs.masked_fill(drop, 0.0))
    if params.min_p > 0.0:
        floor = params.min_p * probs.amax(dim=-1, keepdim=True)  # (B, 1)
        probs = _renormalise(probs.masked_fill(probs < floor, 0.0))
    return probs


def _renormalise(probs: torch.Tensor) -> torch.Tensor:
    return probs / probs.sum(dim=-1, keepdim=True)


def sample(
    logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None = None
) -> torch.Tensor:
    """Draw one token per row: ``logits`` ``[B, V]`` -> ``[B]`` int64 on the same device.

    Greedy is ``argmax``. Otherwise the token is ``argmax(probs / E)`` with ``E``
    i.i.d. Exponential(1) (the exponential-race form of categorical sampling: no
    device-to-host sync, unlike ``torch.multinomial``), drawn from ``generator``.
    """
    if params.greedy:
        _check_logits(logits)
        return logits.argmax(dim=-1)
    probs = process_logits(logits, params)
    race = torch.empty_like(probs).exponential_(1.0, generator=generator)
    race.clamp_(min=torch.finfo(race.dtype).tiny)  # a zero draw would give 0/0 for a dropped token
    return (probs / race).argmax(dim=-1)


def apply_penalties(logits: torch.Tensor, counts: torch.Tensor, prompt_seen: torch.Tensor | None, *,
                    presence: float = 0.0, frequency: float = 0.0, repetition: float = 1.0) -> torch.Tensor:
    """Penalised ``logits`` ``[B, V]`` (a new tensor) of rows whose generated tokens so far are
    counted in ``counts`` ``[B, V]`` (``prompt_seen`` ``[B, V]`` bool: the prompt's tokens,
    or ``None``), in vLLM's order:

    1. repetition (HF's and vLLM's, over the prompt's and the generated tokens): a seen
       token's logit is divided by ``repetition`` where it is positive, multiplied where not;
    2. frequency and presence (OpenAI's, over the generated tokens):
       ``logit - frequency * count - presence * (count > 0)``.
    """
    out = logits.float()
    generated = counts > 0
    if repetition != 1.0:
        seen = generated if prompt_seen is None else generated | prompt_seen
        out = torch.where(seen, torch.where(out > 0, out / repetition, out * repetition), out)
    if frequency:
        out = out - frequency * counts
    if presence:
        out = out - presence * generated
    return out if out is not logits else out.clone()
