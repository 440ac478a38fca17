"""Drafters for speculative decoding (:mod:`kvtier.speculative`), the :class:`Draft`
they return, and :func:`roll_back`, which cuts per-layer caches back to per-row
lengths for the verifier and for the model drafters' own caches alike.

Each drafter offers ``propose(contexts, ks, *, params, generator) -> Draft``, ``reset()``
and ``cost(target)``:

- :class:`NgramDrafter`: prompt lookup. The longest recent n-gram (n from 4 down
  to 1) ending the context is looked up earlier in the prompt and output, and the
  tokens that followed it are proposed. No model call; no probabilities (each
  draft counts as a one-hot ``q``).
- :class:`ModelDrafter`: a smaller model with the same tokenizer, decoding ``k``
  tokens with its own caches (greedy, or sampled from ``process_logits`` with the
  target's sampling parameters, returning those ``q``).
- :class:`EarlyExitDrafter`: self-speculation through the target's own first ``N``
  layers, final norm and LM head (``model(..., num_layers=N)``), no extra weights.

A model drafter keeps, per row, the tokens its caches hold. On each call it
keeps the longest common prefix of those and the new context, drops the rest
from its caches (:func:`roll_back`, as the target's caches), and feeds what is
new: the tokens the target accepted and its own next token.

Example::

    >>> drafter = NgramDrafter()
    >>> d = drafter.propose([[5, 6, 7, 8, 5, 6]], [3], params=SamplingParams(), generator=None)
    >>> d.tokens.tolist(), d.counts
    ([[7, 8, 5]], [3])
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from kvtier.caches.base import KVCache, RowKVCache
from kvtier.config import KVCacheConfig, make_caches
from kvtier.generate import model_device
from kvtier.sampling import SamplingParams, process_logits

#: a catch-up of more tokens than this per row is fed in several forwards
CATCH_UP_CHUNK = 512

# -- what a drafter returns ------------------------------------------------------------------


@dataclass(frozen=True)
class Draft:
    """Proposed tokens of ``B`` rows.

    ``tokens``: int64 ``[B, K]``; row ``r``'s drafts are ``tokens[r, :counts[r]]``,
    the rest is padding. ``probs``: float32 ``[B, K, V]``, the distribution each
    draft was drawn from (``q``), or ``None`` for a drafter without probabilities
    (each draft then counts as drawn from a one-hot ``q``).
    """

    tokens: torch.Tensor
    counts: list[int]
    probs: torch.Tensor | None = None

    @staticmethod
    def empty(batch: int, device: torch.device | str) -> Draft:
        return Draft(torch.zeros(batch, 0, dtype=torch.long, device=device), [0] * batch)


class Drafter(Protocol):
    """What the speculative loop asks of a drafter: ``propose`` at most ``ks[r]`` drafts
    continuing ``contexts[r]`` (prompt and committed tokens), ``reset`` (a new batch
    follows), and the ``cost`` of one drafted token as a fraction of one forward of
    ``target``: an estimate, which the depth policy starts from and then replaces by
    what it measures (:class:`kvtier.speculative.DepthPolicy`)."""

    def propose(self, contexts: Sequence[Sequence[int]], ks: Sequence[int], *,
                params: SamplingParams, generator: torch.Generator | None) -> Draft: ...

    def reset(self) -> None: ...

    def cost(self, target) -> float: ...


def draw(probs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """One token per row from ``probs`` ``[B, V]`` (rows summing to 1) -> ``[B]`` int64.

    The exponential race of :func:`kvtier.sampling.sample`: ``argmax(probs / E)``
    with ``E`` i.i.d. Exponential(1), no host sync.
    """
    race = torch.empty_like(probs).exponential_(1.0, generator=generator)
    race.clamp_(min=torch.finfo(race.dtype).tiny)
    return (probs / race).argmax(dim=-1)


# -- rolling caches back ----------------------------------------------------------------------


def roll_back(caches: list[KVCache], lengths: Sequence[int]) -> None:
    """Cut every layer's rows back to ``lengths`` (``B`` host ints), dropping the newer tokens
    (rejected drafts) without copying any history.

    Per-row tiers (:class:`~kvtier.caches.base.RowKVCache`): ``set_lengths(lengths)``, each
    row to its own length. Scalar tiers keep one length for every row: ``trim`` to it,
    which needs every row at the same length. A length past what a row holds raises
    ``ValueError`` on the first layer, before any layer changes.
    """
    if isinstance(caches[0], RowKVCache):
        for cache in caches:
            cache.set_lengths(lengths)
        return
    drop = caches[0].offset - lengths[0]
    if len(set(lengths)) > 1 or drop < 0:
        raise ValueError(
            f"the {caches[0].tier} tier keeps one length for every row ({caches[0].offset} now); it "
            f"cannot cut rows back to {list(lengths)} (run its rows one at a time)"
        )
    for cache in caches:
        cache.trim(drop)


# -- drafters ---------------------------------------------------------------------------------


class NgramDrafter:
    """Prompt lookup: propose what followed the most recent earlier occurrence of the
    longest n-gram (``max_ngram`` down to ``min_ngram`` tokens) that ends the context."""

    def __init__(self, max_ngram: int = 4, min_ngram: int = 1):
        for name, v in (("max_ngram", max_ngram), ("min_ngram", min_ngram)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be an int >= 1, got {v!r}")
        if min_ngram > max_ngram:
            raise ValueError(f"min_ngram {min_ngram} is above max_ngram {max_ngram}")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram

    def reset(self) -> None:
        """Nothing to forget: every call reads the whole context."""

    def cost(self, target) -> float:
        return 0.0

    def propose(self, contexts: Sequence[Sequence[int]], ks: Sequence[int], *,
                params: SamplingParams | None = None, generator=None) -> Draft:
        """Up to ``ks[r]`` tokens per row, on the CPU (the verification moves them)."""
        found = [self.lookup(c, k) if k > 0 else [] for c, k in zip(contexts, ks)]
        K = max(map(len, found))
        tokens = torch.tensor([f + [0] * (K - len(f)) for f in found], dtype=torch.long)  # (B, K)
        return Draft(tokens.reshape(len(found), K), [len(f) for f in found])

    def lookup(self, context: Sequence[int], k: int) -> list[int]:
        """The ``k`` tokens that followed the latest earlier match of the longest n-gram
        ending ``context``; ``[]`` when none matches. A copy that reaches the end of the
        context goes on from the tokens it proposed (so a repeating pattern continues)."""
        ctx = list(context)
        L = len(ctx)
        for n in range(min(self.max_ngram, L - 1), self.min_ngram - 1, -1):
            tail = ctx[L - n:]
            first = tail[0]
            for s in range(L - n - 1, -1, -1):  # the latest start first; s + n < L
                if ctx[s] == first and ctx[s:s + n] == tail:
                    return continuation(ctx, s + n, k)
        return []


def continuation(ctx: Sequence[int], start: int, k: int) -> list[int]:
    """The ``k`` tokens of ``ctx`` from ``start`` on; past its end, the copy goes on from the
    tokens it has copied (so a repeating pattern continues)."""
    L, out = len(ctx), []
    for j in range(start, start + k):
        out.append(ctx[j] if j < L else out[j - L])
    return out


def _active_params(args, n_layers: int) -> int:
    """Weights one token reads through ``n_layers`` layers and the LM head (not the embedding)."""
    head = args.vocab_size * args.dim
    embeddings = head * (1 if args.tie_embeddings else 2)
    per_layer = (args.n_params - embeddings - args.dim) / args.n_layers
    return int(n_layers * per_layer + head)


class ModelDrafter:
    """Drafts with ``model`` (the first ``num_layers`` layers, default all), which must
    share the target's tokenizer. Its caches are its own: ``cache_config``'s tier, by
    default the tail tier for one row and the ragged tier for several."""

    def __init__(self, model, *, num_layers: int | None = None,
                 cache_config: KVCacheConfig | None = None):
        n = model.args.n_layers if num_layers is None else num_layers
        if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= model.args.n_layers:
            raise ValueError(f"num_layers must be an int in [1, {model.args.n_layers}], got {n!r}")
        if cache_config is not None and not isinstance(cache_config, KVCacheConfig):
            raise ValueError(f"cache_config must be a KVCacheConfig or None, got {cache_config!r}")
        self.model, self.num_layers, self.cache_config = model, n, cache_config
        self.reset()

    def reset(self) -> None:
        self.caches = None
        self.fed: list[list[int]] = []  # per row, the tokens the caches hold
        self.held: list[int] = []  # their counts while a call runs (fed lags by the drafts)

    def cost(self, target) -> float:
        own = _active_params(self.model.args, self.num_layers)
        return own / _active_params(target.args, target.args.n_layers)

    def propose(self, contexts: Sequence[Sequence[int]], ks: Sequence[int], *,
                params: SamplingParams, generator: torch.Generator | None = None) -> Draft:
        """``max(ks)`` tokens per row decoded in lock-step, cut to ``ks[r]`` (``probs``
        when sampling)."""
        B, K = len(contexts), max(ks)
        if K == 0:
            return Draft.empty(B, model_device(self.model))
        with torch.inference_mode():
            logits = self._catch_up([list(c) for c in contexts])  # (B, V)
            tokens, probs = [], []
            for i in range(K):
                if params.greedy:
                    d = logits.argmax(dim=-1)  # (B,)
                else:
                    q = process_logits(logits, params)  # (B, V): the distribution d is drawn from
                    d = draw(q, generator)
                    probs.append(q)
                tokens.append(d)
                if i + 1 < K:  # the last draft is fed next time, if it is accepted
                    logits = self._forward(d[:, None], [1] * B)
            drafts = torch.stack(tokens, dim=1)  # (B, K)
        for fed, row in zip(self.fed, drafts[:, : K - 1].tolist()):
            fed.extend(row)
        return Draft(drafts, [min(k, K) for k in ks], torch.stack(probs, dim=1) if probs else None)

    # -- the drafter's caches -----------------------------------------------------------------
    def _start(self, batch: int) -> None:
        config = self.cache_config or KVCacheConfig(tier="tail" if batch == 1 else "ragged")
        if batch > 1 and not config.per_row:
            raise ValueError(f"the drafter's {config.tier} tier keeps one length for every row; "
                             f"give it a ragged or paged cache_config for {batch} rows")
        self.caches = make_caches(self.num_layers, config, batch_size=batch)
        self.per_row = isinstance(self.caches[0], RowKVCache)
        self.fed = [[] for _ in range(batch)]

    def _catch_up(self, contexts: list[list[int]]) -> torch.Tensor:
        """Bring the caches to ``contexts`` minus each row's last token; return the logits
        ``[B, V]`` after each whole context."""
        if self.caches is None or len(self.fed) != len(contexts):
            self._start(len(contexts))
        keep = [min(_common_prefix(f, c), len(c) - 1) for f, c in zip(self.fed, contexts)]
        dev = model_device(self.model)
        roll_back(self.caches, keep)
        self.fed = [c[:k] for c, k in zip(contexts, keep)]
        self.held = list(keep)
        rest = [c[k:] for c, k in zip(contexts, keep)]  # at least one token per row
        vocab = self.model.args.vocab_size
        if max(max(r) for r in rest) >= vocab:
            raise ValueError(f"a context holds a token id past the drafter's vocabulary of {vocab}; "
                             "the drafter must share the target's tokenizer")
        widths = [len(r) for r in rest]
        if len(set(widths)) == 1 and widths[0] <= CATCH_UP_CHUNK:
            logits = self._forward(torch.tensor(rest, device=dev), widths)
        else:
            longest = max(widths) - 1  # all but each row's last token first, right-padded
            for s in range(0, longest, CATCH_UP_CHUNK):
                part = [r[s: min(s + CATCH_UP_CHUNK, len(r) - 1)] for r in rest]
                w = max(map(len, part))
                block = [p + [0] * (w - len(p)) for p in part]
                self._forward(torch.tensor(block, device=dev), [len(p) for p in part])
            logits = self._forward(torch.tensor([[r[-1]] for r in rest], device=dev), [1] * len(rest))
        for fed, r in zip(self.fed, rest):
            fed.extend(r)
        return logits

    def _forward(self, tokens: torch.Tensor, commit: list[int]) -> torch.Tensor:
        """Feed ``tokens`` ``[B, W]`` at each row's length; row ``r`` keeps its first
        ``commit[r]``. Returns the logits ``[B, V]`` of the last column."""
        kw = None
        if self.per_row:  # host rows: the caches' books keep the lengths
            start = torch.tensor(self.held, dtype=torch.long)
            kw = {"write_start": start, "new_offsets": start + torch.tensor(commit)}
        logits = self.model(tokens, self.caches, cache_kwargs=kw, num_layers=self.num_layers,
                            last_only=True)  # (B, 1, V)
        self.held = [h + c for h, c in zip(self.held, commit)]
        return logits[:, -1]


class EarlyExitDrafter(ModelDrafter):
    """Self-speculation: the target's first ``num_layers`` layers, final norm and LM head."""

    def __init__(self, model, num_layers: int, *, cache_config: KVCacheConfig | None = None):
        n = model.args.n_layers
        if isinstance(num_layers, bool) or not isinstance(num_layers, int) or not 1 <= num_layers < n:
            raise ValueError(f"num_layers must be an int in [1, {n - 1}] (below the model's {n} layers, "
                             f"to save anything), got {num_layers!r}")
        super().__init__(model, num_layers=num_layers, cache_config=cache_config)


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


#: the forms of ``kvtier generate --speculative``
DRAFTER_SPECS = ("ngram", "early-exit:N", "model:PATH")


def parse_drafter_spec(spec: str) -> tuple[str, str | int | None]:
    """``"ngram"`` -> ``("ngram", None)``; ``"early-exit:N"`` -> ``("early-exit", N)``;
    ``"model:PATH"`` -> ``("model", PATH)``. ``ValueError`` for anything else."""
    kind, _, arg = spec.partition(":")
    if kind == "ngram" and not arg:
        return kind, None
    if kind == "early-exit" and arg.isdigit() and int(arg) >= 1:
        return kind, int(arg)
    if kind == "model" and arg:
        return kind, arg
    raise ValueError(f"--speculative {spec!r} is not understood; accepted: {', '.join(DRAFTER_SPECS)} "
                     "(N a layer count >= 1, PATH a model with the same tokenizer)")


def make_drafter(spec: str, target) -> NgramDrafter | ModelDrafter:
    """The drafter ``spec`` names (:func:`parse_drafter_spec`) for the loaded ``target``
    (a :class:`kvtier.model.LoadedModel`); a draft model loads on the target's device and dtype."""
    kind, arg = parse_drafter_spec(spec)
    if kind == "ngram":
        return NgramDrafter()
    if kind == "early-exit":
        return EarlyExitDrafter(target.model, arg)
    from kvtier.model import load_model

    param = next(target.model.parameters())
    draft = load_model(arg, device=param.device, dtype=param.dtype, progress=False)
    if draft.args.vocab_size != target.args.vocab_size:
        raise ValueError(f"the draft model {arg} has a vocabulary of {draft.args.vocab_size} tokens, "
                         f"the target {target.args.vocab_size}; they must share the tokenizer")
    return ModelDrafter(draft.model)
