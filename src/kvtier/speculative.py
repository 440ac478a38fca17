"""Speculative decoding with exact verification, over every cache tier.

A drafter (:mod:`kvtier.drafters`) proposes up to ``k`` tokens per row; one
forward of the model verifies them all (the row's last committed token followed
by its drafts); each row keeps the longest prefix the target agrees with plus
one token of the target's own, so every verification commits at least one token
and the output is what plain decoding gives: token for token under greedy
decoding, in distribution under sampling (rejection sampling with residual
correction, Leviathan et al. 2023, Chen et al. 2023).

Rollback goes through the caches' own bookkeeping, never through a copy of the
history. The verification forward writes ``1 + drafts`` tokens per row; afterwards
:func:`~kvtier.drafters.roll_back` cuts every layer back to the committed lengths:

- the per-row tiers (a :class:`~kvtier.caches.base.RowKVCache`: ragged, paged)
  with ``set_lengths(committed)``, each row to its own length. The storage behind
  the dropped tokens stays with the row until it writes over it; on a tier whose
  rows hold blocks of a pool (``block_table_view()``), a finished row is
  ``release``d at once and its blocks return to the pool;
- the scalar tiers (tail, block; one row at a time) with ``trim``.

Layers, as in :mod:`kvtier.generate`: :func:`speculative_generate_step` yields
each cycle's new tokens per row; the streaming shell of :mod:`kvtier.generate`
(:func:`~kvtier.generate.stream_steps`) turns them into :class:`SpeculativeResponse`
objects (:func:`stream_speculative`, or ``stream_generate(..., drafter=...)``), and
``generate(..., drafter=...)`` returns the text.

Example::

    >>> from kvtier.model import load_model
    >>> from kvtier.drafters import NgramDrafter
    >>> from kvtier.generate import GenerationConfig, generate
    >>> lm = load_model()
    >>> generate(lm.model, lm.tokenizer, "Repeat: the cat sat on the mat.",
    ...          GenerationConfig(max_tokens=16), drafter=NgramDrafter())
    ' the cat sat on the mat...'
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import torch

from kvtier.caches.base import KVCache, RowKVCache
from kvtier.config import KVCacheConfig
from kvtier.drafters import Draft, Drafter, draw, roll_back
from kvtier.generate import (
    GenerationConfig,
    GenerationResponse,
    ProgressFn,
    Prompt,
    check_prompts,
    model_device,
    stream_steps,
)
from kvtier.limits import context_room
from kvtier.prefill import prefill
from kvtier.sampling import SamplingParams, process_logits

#: the most drafts a row may verify in one forward (``SpeculativeConfig.draft_tokens``)
MAX_DRAFT_TOKENS = 256


@dataclass(frozen=True)
class SpeculativeConfig:
    """How deep to draft.

    ``draft_tokens``: the most drafts a row verifies in one forward.

    ``adaptive=True``: each row's depth follows its recent acceptance and the drafter's
    cost (:class:`DepthPolicy`), from ``draft_tokens`` down to plain decoding, with a
    one-token probe now and then at depth zero; the stats say why a run decoded plainly
    (``depth_reason``). ``adaptive=False`` (fixed depth, ``--fixed-depth``): every
    verification asks each row for ``min(draft_tokens, tokens left - 1)`` drafts, whatever
    they cost or however often they fail (a drafter may still find fewer: n-gram lookup
    proposes none without a match).

    ``verify_cost``: what one more verified token adds to a forward, as a fraction of a
    one-token forward. ``draft_cost``: what one drafted token costs, in the same unit;
    ``None`` measures it from each cycle's times, starting from the drafter's estimate
    (``drafter.cost(model)``); a number fixes it, so that the depths, and so a seeded
    sampled run, repeat exactly.
    """

    draft_tokens: int = 6
    adaptive: bool = True
    verify_cost: float = 0.15
    draft_cost: float | None = None

    def __post_init__(self) -> None:
        k = self.draft_tokens
        if isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= MAX_DRAFT_TOKENS:
            raise ValueError(f"draft_tokens must be an int in [0, {MAX_DRAFT_TOKENS}] (0 = plain decoding; "
                             f"a verification forward takes 1 + draft_tokens tokens a row), got {k!r}")
        if not isinstance(self.adaptive, bool):
            raise ValueError(f"adaptive must be a bool, got {self.adaptive!r}")
        for name in ("verify_cost", "draft_cost"):
            c = getattr(self, name)
            if c is None and name == "draft_cost":
                continue
            if isinstance(c, bool) or not isinstance(c, (int, float)) or not 0.0 <= c < 10.0:
                raise ValueError(f"{name} must be a number in [0, 10) (one-token forwards), got {c!r}")


# -- verification ------------------------------------------------------------------------


def accept_drafts(
    logits: torch.Tensor,
    draft: Draft,
    params: SamplingParams,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Verify ``draft`` against the target's ``logits`` ``[B, 1 + K, V]`` (float).

    Position ``i`` of ``logits`` is the target's prediction after the last
    committed token and drafts ``0 .. i-1``. Returns ``(accepted, next_token)``,
    int64 ``[B]`` each: row ``r`` keeps ``tokens[r, :accepted[r]]`` and then
    ``next_token[r]``. Greedy params accept the longest prefix equal to the
    target's argmax; sampling params apply exact rejection sampling against
    ``process_logits(logits, params)``, the distribution plain sampling draws from.
    """
    B, T, V = logits.shape
    K = T - 1
    d = draft.tokens  # (B, K)
    dev = logits.device
    n = torch.tensor(draft.counts, dtype=torch.long, device=dev)  # (B,) real drafts per row
    rows = torch.arange(B, device=dev)
    real = torch.arange(K, device=dev) < n[:, None]  # (B, K): the rest is padding
    if params.greedy:
        target = logits.argmax(dim=-1)  # (B, 1 + K): what plain greedy decoding picks
        ok = (d == target[:, :K]) & real
        accepted = ok.long().cumprod(dim=1).sum(dim=1)  # the leading run of matches
        return accepted, target[rows, accepted]  # the target's own token after it
    p = process_logits(logits.reshape(B * T, V), params).view(B, T, V)  # target, as plain sampling
    if draft.probs is None:  # a draft without probabilities was drawn from a one-hot q
        q = torch.zeros(B, K, V, device=dev).scatter_(2, d[..., None], 1.0)
    else:
        q = draft.probs  # (B, K, V)
    p_d = p[:, :K].gather(2, d[..., None]).squeeze(2)  # (B, K) p(x) of each draft x
    q_d = q.gather(2, d[..., None]).squeeze(2)  # (B, K) q(x)
    # Accept x with probability min(1, p(x) / q(x)):
    #   q(x) <= p(x): always accept (u * q < p for every u < 1);
    #   q(x) >  p(x): accept with probability p(x) / q(x).
    u = torch.rand(B, K, device=dev, generator=generator)
    ok = (u * q_d < p_d) & real
    accepted = ok.long().cumprod(dim=1).sum(dim=1)  # (B,) drafts kept: the leading run
    # At the first position not kept, j = accepted:
    #   a rejected draft (j < n): sample the residual normalize(max(p_j - q_j, 0)), so that
    #     P(token) = q(x) min(1, p/q) + (1 - sum_y min(p, q)(y)) resid(x) = p(x);
    #   every draft kept (j == n): sample p_j itself (the bonus token; q_j = 0).
    p_j = p[rows, accepted]  # (B, V)
    rejected = (accepted < n)[:, None]
    q_j = q[rows, accepted.clamp(max=max(K - 1, 0))] if K else torch.zeros_like(p_j)
    resid = (p_j - q_j * rejected).clamp_min(0.0)
    mass = resid.sum(dim=-1, keepdim=True)
    resid = torch.where(mass > 0, resid / mass.clamp_min(1e-30), p_j)  # (p == q never rejects)
    return accepted, draw(resid, generator)


class DepthPolicy:
    """Each row's draft depth from its recent acceptance and what a draft costs.

    ``alpha`` estimates the chance that a draft is accepted when the drafts before
    it were: accepted drafts over drafts judged (the accepted ones and the first
    rejected one), both decayed by ``decay`` per verification, with a prior of
    ``prior`` worth one draft. A verification with ``k`` drafts yields
    ``E(k) = 1 + alpha + ... + alpha^k`` tokens and costs ``1 + cost * k`` one-token
    forwards, ``cost = verify_cost + draft_cost``, so the depth is the ``k <= max_k``
    that maximises ``E(k) / (1 + cost k)``: zero (plain decoding) once ``alpha`` falls
    to about ``cost``, and always zero when ``cost >= 1`` (even drafts that are all
    accepted, ``E(k) = 1 + k``, cannot pay for ``1 + cost k``).

    ``draft_cost`` (a drafted token's time over a one-token forward of the target)
    starts at the caller's estimate; with ``measure`` each cycle's timings
    (:meth:`measure`) replace it, so a drafter estimated too dear (or too cheap) is
    judged by what it really costs on this machine, and a verification of a width
    already timed costs what it took (:meth:`cycle_cost`) rather than ``1 + verify_cost k``.

    A row at depth zero learns nothing, so it drafts one token (a probe) once it has
    been idle ``wait`` verifications, and at once at the start: the first cycle
    measures the drafter. A probe that leaves the depth at zero doubles the wait (up to
    ``max_wait``); one that lifts it resets the wait. A model drafter's probe first
    feeds the tokens it skipped, in one forward. Once measured costs say that no depth
    can win (:meth:`hopeless`), the row is not probed again.
    """

    def __init__(self, batch: int, max_k: int, *, verify_cost: float, draft_cost: float,
                 adaptive: bool = True, measure: bool = False, decay: float = 0.8,
                 prior: float = 0.6, wait: int = 4, max_wait: int = 64):
        self.max_k, self.adaptive, self.measured = max_k, adaptive, measure
        self.verify_cost, self.draft_cost = verify_cost, draft_cost
        self.decay, self.prior, self.first_wait, self.max_wait = decay, prior, wait, max_wait
        self.hits, self.judged = [0.0] * batch, [0.0] * batch
        self.idle, self.wait = [wait] * batch, [wait] * batch  # a probe is due at the start
        self.drafting_cycles, self.timings = 0, 0  # cycles that drafted, cycles measured
        self.verify_s: dict[int, tuple[int, float]] = {}  # drafts k -> (cycles, mean verification s)

    @property
    def cost(self) -> float:
        """One more draft's cost by the linear model, in one-token forwards of the target:
        verifying it and drafting it."""
        return self.verify_cost + self.draft_cost

    def cycle_cost(self, k: int) -> float:
        """A cycle with ``k`` drafts, in one-token forwards: its verification, ``1 + verify_cost k``
        or more where it was measured slower than that against a plain cycle (timing noise
        never makes a verification look cheaper than the model), plus the drafts."""
        verify = 1.0 + self.verify_cost * k
        if k in self.verify_s and 0 in self.verify_s:
            verify = max(verify, self.verify_s[k][1] / self.verify_s[0][1])
        return verify + self.draft_cost * k

    def alpha(self, row: int) -> float:
        return (self.hits[row] + self.prior) / (self.judged[row] + 1.0)

    def depths(self, live: Sequence[bool] | None = None) -> list[int]:
        """Per row (``live[r]``: still running): its best depth, or a probe (1) when due;
        ``max_k`` for every live row when not ``adaptive`` (fixed depth)."""
        live = [True] * len(self.hits) if live is None else list(live)
        if not self.adaptive:
            return [self.max_k * x for x in live]
        return [0 if not x else k if k else int(self.max_k > 0 and i >= w)
                for k, x, i, w in zip(self._plan(live), live, self.idle, self.wait)]

    def _plan(self, live: Sequence[bool]) -> list[int]:
        """Each live row's best depth, capped for the batch (0 for the others; no probes).

        A batch is static: it runs until its slowest row is done, and one forward's width
        is set by its deepest row. So depths are capped where the slowest live row's
        expected tokens per unit of cost peak: a deeper forward that only speeds up rows
        which finish early anyway would not shorten the batch."""
        alphas = [self.alpha(r) for r in range(len(self.hits))]
        best = [self._best([a]) if x else 0 for a, x in zip(alphas, live)]
        rows = [r for r, x in enumerate(live) if x]
        cap = self._best([alphas[r] for r in rows], [best[r] for r in rows])
        return [min(k, cap) for k in best]

    def _best(self, alphas: Sequence[float], limits: Sequence[int] | None = None) -> int:
        """The depth ``K`` maximising ``min_r E_r(min(K, limits[r])) / (1 + cost K)``."""
        limits = [self.max_k] * len(alphas) if limits is None else limits
        best_k, best = 0, 1.0
        sums = [1.0] * len(alphas)  # E_r(min(k, limits[r])): a^0 + ... in that order, k by k
        for k in range(1, max(limits, default=0) + 1):
            sums = [e + a**k if k <= lim else e for e, a, lim in zip(sums, alphas, limits)]
            rate = min(sums) / self.cycle_cost(k)
            if rate > best:
                best_k, best = k, rate
        return best_k

    def observe(self, chosen: Sequence[int], drafted: Sequence[int], accepted: Sequence[int]) -> None:
        """Book one verification: per row the depth asked, the drafts made and kept."""
        for r, (k, n, a) in enumerate(zip(chosen, drafted, accepted)):
            if k == 0:
                self.idle[r] += 1
            if n == 0:
                continue  # nothing drafted (or nothing to propose): no evidence, no cost
            probe = self.adaptive and self._best([self.alpha(r)]) == 0
            self.hits[r] = self.decay * self.hits[r] + a
            self.judged[r] = self.decay * self.judged[r] + a + (a < n)
            self.idle[r] = 0
            if probe:  # wait longer unless the probe lifted the depth
                lifted = self._best([self.alpha(r)]) > 0
                self.wait[r] = self.first_wait if lifted else min(2 * self.wait[r], self.max_wait)
                if self.timings and self.hopeless():  # measured: no acceptance could pay for it
                    self.wait[r] = math.inf

    def hopeless(self) -> bool:
        """No depth beats plain decoding even if every draft is accepted: ``1 + k`` tokens
        never outweigh ``cycle_cost(k)``."""
        return all(1 + k <= self.cycle_cost(k) for k in range(1, self.max_k + 1))

    def measure(self, k: int, draft_s: float, verify_s: float) -> None:
        """Book the times of a cycle that drafted up to ``k`` tokens per row: ``draft_s``
        drafting, ``verify_s`` the verification forward of width ``1 + k``.

        Verifications are timed per width (the mean of the last 8 of each), so a forward
        much slower at some widths than the linear model says is seen, and the depth moves
        away from it (one measured faster does not lower the cost below the model's); a cycle
        without drafts times the one-token forward. ``draft_cost``
        becomes the running mean of ``draft_s / (k * one-token forward)`` (the last 8 weigh
        most), the one-token forward standing in through the linear model until a plain
        cycle has run. The drafts of the first cycle that drafts are not timed: a model
        drafter feeds the whole prompt in it."""
        if not self.measured or verify_s <= 0.0:
            return
        n, mean = self.verify_s.get(k, (0, 0.0))
        self.verify_s[k] = (n + 1, mean + (verify_s - mean) / min(n + 1, 8))
        if k == 0:
            return
        self.drafting_cycles += 1
        if self.drafting_cycles == 1:
            return
        forward_s = self.verify_s[0][1] if 0 in self.verify_s else verify_s / (1.0 + self.verify_cost * k)
        cost = draft_s / (k * forward_s)
        self.timings += 1
        self.draft_cost += (cost - self.draft_cost) / min(self.timings, 8)

    def reason(self, live: Sequence[bool]) -> str:
        """Why the live rows (``live[r]``) decode plainly, in one line; ``""`` when one drafts
        (or the depth is fixed)."""
        rows = [r for r, x in enumerate(live) if x]
        if not self.adaptive or not rows or any(self._plan(live)):
            return ""
        if self.max_k == 0:
            return "draft_tokens is 0"
        source = "measured" if self.timings else "estimated"
        timed = 1 in self.verify_s or self.timings  # its verification, or its drafts
        cycle = f"{self.cycle_cost(1):.2f} ({'measured' if timed else 'estimated'})"
        if self.hopeless():
            draft = f"a draft costs {self.draft_cost:.2f} target forwards ({source})"
            if self.draft_cost < 0.05:  # drafting is next to free: the verification forwards cost
                return (f"{draft} but a cycle with one {cycle}: verification forwards cost more than the "
                        f"tokens they can add at a depth of at most {self.max_k} (a larger --draft-tokens, "
                        "or --fixed-depth, may pay)")
            return (f"{draft} and a cycle with one {cycle}: no depth beats plain decoding even if every "
                    "draft is accepted (a cheaper drafter would: ngram, early-exit:N, a smaller model)")
        worst = min(rows, key=self.alpha)
        return (f"a draft token is estimated to be accepted {self.alpha(worst):.0%} of the time (a prior of "
                f"{self.prior:.0%} and {self.judged[worst]:.1f} decayed judgements of its drafts), too seldom "
                f"to pay for what a cycle with one costs, {cycle} target forwards; probing again later")


# -- figures -------------------------------------------------------------------------------


@dataclass
class SpeculativeStats:
    """Figures of speculative cycles, all rows together (updated in place by
    :func:`speculative_generate_step`; responses carry copies)."""

    steps: int = 0  # verification forwards
    row_steps: int = 0  # verifications summed over the rows still running
    drafted: int = 0
    accepted: int = 0
    tokens: int = 0  # committed tokens: accepted drafts plus the target's own, one per row-step
    draft_s: float = 0.0  # proposing drafts
    step_s: float = 0.0  # whole cycles: drafting, verification, acceptance, rollback
    draft_cost: float = 0.0  # a drafted token's cost in one-token forwards (the depth policy's)
    depth_reason: str = ""  # why the latest cycle's rows decoded plainly ("" when they drafted)

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def tokens_per_step(self) -> float:
        """Mean tokens a row commits per verification forward (1.0 is plain decoding)."""
        return self.tokens / self.row_steps if self.row_steps else 0.0

    @property
    def time_per_step_s(self) -> float:
        return self.step_s / self.steps if self.steps else 0.0

    def copy(self) -> SpeculativeStats:
        return dataclasses.replace(self)

    def as_dict(self) -> dict[str, float | int]:
        return {**dataclasses.asdict(self), "acceptance_rate": self.acceptance_rate,
                "tokens_per_step": self.tokens_per_step, "time_per_step_s": self.time_per_step_s}


# -- layer 1: tokens ---------------------------------------------------------------------------


def check_speculative(speculative):
    """``speculative`` itself when it is ``None`` or a :class:`SpeculativeConfig`; a
    ``ValueError`` with the fix otherwise."""
    if speculative is None or isinstance(speculative, SpeculativeConfig):
        return speculative
    fix = "SpeculativeConfig(draft_tokens=...)"
    if isinstance(speculative, dict):
        fix = "SpeculativeConfig(**speculative)"
    elif isinstance(speculative, int) and not isinstance(speculative, bool):
        fix = f"SpeculativeConfig(draft_tokens={speculative!r})"
    raise ValueError(f"speculative must be a SpeculativeConfig or None, got {type(speculative).__name__} "
                     f"{speculative!r:.60}; build one with {fix}")


def speculative_generate_step(
    model,
    prompts: Sequence[Sequence[int]],
    caches: list[KVCache],
    drafter: Drafter,
    *,
    params: SamplingParams | None = None,
    speculative: SpeculativeConfig | None = None,
    max_tokens: int | None = None,
    stop_token_ids: frozenset[int] = frozenset(),
    prefill_chunk: int | None = GenerationConfig.prefill_chunk,
    generator: torch.Generator | None = None,
    stats: SpeculativeStats | None = None,
    on_progress: ProgressFn | None = None,
    on_prefilled: Callable[[], None] | None = None,
) -> Iterator[list[list[int]]]:
    """Yield, per verification, the new tokens of each row (``B`` lists; empty once a row is done).

    ``prompts``, ``caches``, ``prefill_chunk``, ``on_progress`` and ``on_prefilled``
    are those of :func:`kvtier.generate.generate_step`: per-row tiers take prompts
    of any lengths in one batch, scalar tiers one prompt. A row is done after
    ``max_tokens`` tokens or a token of ``stop_token_ids`` (kept as its last token);
    the generator returns when every row is done (never without those limits).
    """
    if max_tokens is not None and (isinstance(max_tokens, bool) or not isinstance(max_tokens, int)
                                   or max_tokens < 1):
        raise ValueError(f"max_tokens must be an int >= 1 or None (the context), got {max_tokens!r}")
    params = SamplingParams() if params is None else params
    spec = SpeculativeConfig() if check_speculative(speculative) is None else speculative
    stats = SpeculativeStats() if stats is None else stats
    rows = check_prompts(prompts)
    room = context_room(model, rows)  # ids and prompt lengths, before any forward (kvtier.limits)
    device = model_device(model)
    per_row = isinstance(caches[0], RowKVCache)
    if not per_row and len(rows) > 1:
        raise ValueError(
            f"the {caches[0].tier} tier keeps one length for every row, but its {len(rows)} rows "
            "would accept different drafts; use the ragged or paged tier, or stream_speculative "
            "(which runs such a batch row by row)"
        )
    with torch.inference_mode():
        prefill(model, rows, caches, prefill_chunk, device, on_progress)
        if on_prefilled is not None:
            on_prefilled()
        run = _Rows(rows, device, max_tokens, stop_token_ids)
        run.left = [min(n, r) for n, r in zip(run.left, room)]  # a row stops at the context
        estimate = drafter.cost(model) if spec.draft_cost is None else spec.draft_cost
        # the ranks of a tensor-parallel group keep the estimate: each would time its own cycles
        # and pick its own depth, and their collectives would differ in size
        policy = DepthPolicy(len(rows), spec.draft_tokens, verify_cost=spec.verify_cost,
                             draft_cost=estimate, adaptive=spec.adaptive,
                             measure=spec.draft_cost is None and not _ranks_share_the_model())
        while not all(run.done):
            t0 = time.perf_counter()
            new = speculative_step(model, caches, run, drafter, policy, params, generator,
                                   stats, per_row)
            stats.step_s += time.perf_counter() - t0
            yield new



def _ranks_share_the_model() -> bool:
    """Whether this process is one rank of several (``torch.distributed``, a tensor-parallel
    group): the depth must then be one every rank computes alike."""
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1

def speculative_step(model, caches, run, drafter, policy, params, generator, stats,
                     per_row) -> list[list[int]]:
    """One cycle: draft, verify in one forward, accept, roll the caches back; new tokens per row."""
    B = len(run.contexts)
    live = [not d for d in run.done]
    stats.depth_reason = policy.reason(live)
    ks = [max(0, min(k, left - 1)) for k, left in zip(policy.depths(live), run.left)]  # done rows: 0
    t0 = time.perf_counter()
    if max(ks) > 0:
        draft = drafter.propose(run.contexts, ks, params=params, generator=generator)
        draft = dataclasses.replace(draft, tokens=draft.tokens.to(run.device))  # n-gram: host ids
    else:
        draft = Draft.empty(B, run.device)
    t_draft = time.perf_counter()
    stats.draft_s += t_draft - t0
    # verify: [last committed token, d_1 .. d_K] per row, one forward
    tokens = torch.cat([run.last[:, None], draft.tokens], dim=1)  # (B, 1 + K)
    if per_row:  # each row writes at its own length and commits its own block; finished rows nothing
        ends = [n + (not d) * (1 + c) for n, d, c in zip(run.lengths, run.done, draft.counts)]
        kw = {"write_start": torch.tensor(run.lengths), "new_offsets": torch.tensor(ends)}  # host rows
        logits = model(tokens, caches, cache_kwargs=kw)  # (B, 1 + K, V)
    else:
        logits = model(tokens, caches)
    accepted, nxt = accept_drafts(logits, draft, params, generator)  # (B,) each
    if run.stop is not None and draft.tokens.shape[1]:  # an accepted stop token ends its row:
        accepted, nxt = run.cut_at_stop(draft.tokens, accepted, nxt)  # it becomes the next token
    acc = accepted.tolist()  # the one host sync of a cycle
    policy.measure(draft.tokens.shape[1], t_draft - t0, time.perf_counter() - t_draft)
    # roll back: keep the last committed token and the accepted drafts
    committed = [n + (not d) * (1 + a) for n, d, a in zip(run.lengths, run.done, acc)]
    roll_back(caches, committed)
    stats.steps += 1
    stats.row_steps += B - sum(run.done)
    stats.drafted += sum(draft.counts)
    stats.accepted += sum(acc)
    policy.observe(ks, draft.counts, acc)
    stats.draft_cost = policy.draft_cost
    new = run.advance(draft.tokens.tolist(), acc, nxt, committed)
    stats.tokens += sum(map(len, new))
    if any(run.released) and not all(run.done) and per_row and caches[0].block_table_view() is not None:
        run.release(caches)  # rows that hold blocks of a pool give them back as soon as they finish
    return new


class _Rows:
    """Host and device bookkeeping of the rows: contexts, cache lengths, budgets, done flags."""

    def __init__(self, rows: list[list[int]], device, max_tokens: int | None, stop_ids: frozenset[int]):
        self.device = device
        self.contexts = [list(r) for r in rows]  # prompt + committed tokens; the last is not cached yet
        self.lengths = [len(r) - 1 for r in rows]  # what the caches hold per row (host)
        self.last = torch.tensor([r[-1] for r in rows], dtype=torch.long, device=device)
        self.left = [max_tokens if max_tokens is not None else 1 << 62] * len(rows)
        self.stop_ids = stop_ids
        self.stop = torch.tensor(sorted(stop_ids), device=device) if stop_ids else None
        self.done = [False] * len(rows)
        self.released = [False] * len(rows)  # done rows whose pool blocks may return to the pool

    def advance(self, drafts: list[list[int]], accepted: list[int], nxt: torch.Tensor,
                committed: list[int]) -> list[list[int]]:
        """Book a cycle; returns each row's new tokens (a stop token can only come last)."""
        out = []
        for r, (row, a, t) in enumerate(zip(drafts, accepted, nxt.tolist())):
            if self.done[r]:
                out.append([])
                continue
            toks = row[:a] + [t]
            self.contexts[r].extend(toks)
            self.left[r] -= len(toks)
            if t in self.stop_ids or self.left[r] <= 0:
                self.done[r] = self.released[r] = True
            out.append(toks)
        self.lengths, self.last = committed, nxt
        return out

    def cut_at_stop(self, drafts: torch.Tensor, accepted: torch.Tensor, nxt: torch.Tensor):
        """Cut each row's accepted drafts ``[B, K]`` before its first stop token, which becomes
        its next token; returns the new ``(accepted, next_token)``."""
        K = drafts.shape[1]
        hit = torch.isin(drafts, self.stop) & (torch.arange(K, device=drafts.device) < accepted[:, None])
        first = torch.where(hit.any(dim=1), hit.long().argmax(dim=1), accepted)  # (B,)
        rows = torch.arange(drafts.shape[0], device=drafts.device)
        return first, torch.where(first < accepted, drafts[rows, first.clamp(max=K - 1)], nxt)

    def release(self, caches: list[RowKVCache]) -> None:
        """Empty finished rows (their blocks return to the pool); they then write and commit nothing."""
        rows = [r for r, x in enumerate(self.released) if x]
        for cache in caches:
            cache.release(rows)
        self.lengths = [0 if x else n for n, x in zip(self.lengths, self.released)]
        self.released = [False] * len(self.released)


# -- layer 2: responses ---------------------------------------------------------------------------


@dataclass(frozen=True)
class SpeculativeResponse(GenerationResponse):
    """A :class:`~kvtier.generate.GenerationResponse` with the speculative figures so far."""

    speculative: SpeculativeStats = field(default_factory=SpeculativeStats)


def stream_speculative(
    model,
    tokenizer,
    prompts: Prompt | Sequence[Prompt],
    config: GenerationConfig | None = None,
    *,
    drafter: Drafter,
    speculative: SpeculativeConfig | None = None,
    cache_config: KVCacheConfig | None = None,
    caches: list[KVCache] | None = None,
    prompt_cache=None,
    on_progress: ProgressFn | None = None,
) -> Iterator[SpeculativeResponse]:
    """:func:`kvtier.generate.stream_generate` with speculative decoding (what
    ``stream_generate(..., drafter=drafter)`` runs): the same arguments, plus the
    ``drafter`` and the :class:`SpeculativeConfig`. A batch runs as one on the per-row
    tiers, and row by row on the scalar tiers (each row then equals its batch-1 run).
    """
    config = GenerationConfig() if config is None else config
    check_speculative(speculative)  # here, not in the generator: before any prompt is read
    stats = SpeculativeStats()

    def steps(rows, caches, *, generator, stop_ids, on_progress, on_prefilled):
        drafter.reset()
        return speculative_generate_step(
            model, rows, caches, drafter, params=config.sampling, speculative=speculative,
            max_tokens=config.max_tokens, stop_token_ids=stop_ids, prefill_chunk=config.prefill_chunk,
            generator=generator, stats=stats, on_progress=on_progress, on_prefilled=on_prefilled,
        )

    def respond(row, text, token, reason, gen_stats) -> SpeculativeResponse:
        return SpeculativeResponse(row, text, token, reason, gen_stats, stats.copy())

    return stream_steps(model, tokenizer, prompts, config, steps, respond=respond, lockstep=False,
                        cache_config=cache_config, caches=caches, prompt_cache=prompt_cache,
                        on_progress=on_progress)
