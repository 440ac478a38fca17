"""The engine's side of one live request (:class:`Live`): its text, its sampler, and its prompt
logprobs, gathered chunk by chunk (what moves its logits is :mod:`kvtier.serve.adjust`'s)."""

from __future__ import annotations

import torch

from kvtier.caches.paged_shared import to_device
from kvtier.generate import RowText
from kvtier.serve.params import RequestParams, TokenLogprob
from kvtier.serve.scheduler import Request

__all__ = ["Live"]


class Live:
    """The engine's side of one running request: text, sampling, times, prompt logprobs."""

    def __init__(self, request: Request, params: RequestParams, text: RowText, generator, now: float):
        self.request, self.params, self.text, self.generator = request, params, text, generator
        self.matcher = None  # its structured output's place in the grammar (kvtier.serve.structured)
        self.ngrams = None  # its n-grams for speculative drafts (kvtier.serve.speculate.NgramIndex)
        self.arrival, self.first_token = now, None
        # prompt logprobs: one entry per prompt token gathered so far (the first has none), until
        # they are given out with the first output
        self.prompt: list[TokenLogprob | None] | None = None
        if params.prompt_logprobs is not None:
            self.prompt = [None]
            request.prompt_logits = request.num_prompt_tokens > 1

    def holds_stops(self) -> bool:
        """Whether its stop ids are held back this step (fewer than ``min_tokens`` are out)."""
        return bool(self.params.min_tokens and self.text.stop_ids
                    and self.request.num_output_tokens < self.params.min_tokens)

    # -- prompt logprobs ------------------------------------------------------------------------------
    def prompt_logprobs(self, start: int, logits: torch.Tensor) -> tuple[torch.Tensor, ...] | None:
        """From the logits ``[T, V]`` of positions ``start ..`` of the prompt, the logprobs of the
        prompt tokens they predict: (chosen ``[m]``, top values ``[m, k]``, top ids ``[m, k]``,
        ranks ``[m]``), copies on their way to the host; ``None`` where they predict none (the
        last position)."""
        ids = self.request.prompt_token_ids
        m = min(logits.shape[0], len(ids) - 1 - start)
        if m <= 0:
            return None
        targets = to_device(torch.tensor(ids[start + 1 : start + 1 + m]), logits.device)
        lp = torch.log_softmax(logits[:m].float(), dim=-1)
        chosen = lp.gather(1, targets[:, None])[:, 0]
        k = self.params.prompt_logprobs
        vals, idx = lp.topk(k, dim=-1) if k else (lp[:, :0], targets[:, None][:, :0])
        rank = (lp > chosen[:, None]).sum(dim=-1) + 1
        return tuple(t.to("cpu", non_blocking=True) for t in (chosen, vals, idx, rank))

    def take_prompt(self, start: int, chosen: list[float], vals: list[list[float]], idx: list[list[int]],
                    rank: list[int]) -> None:
        """Keep the prompt logprobs of positions ``start + 1 ..`` not kept yet (a request preempted
        half way through its prompt computes its first chunks again)."""
        ids = self.request.prompt_token_ids
        for j, lp in enumerate(chosen):
            pos = start + 1 + j
            if pos == len(self.prompt):
                self.prompt.append(TokenLogprob(ids[pos], lp, tuple(zip(idx[j], vals[j])), rank[j]))
        if len(self.prompt) == len(ids):
            self.request.prompt_logits = False

    def give_prompt(self) -> tuple[TokenLogprob | None, ...] | None:
        """The prompt logprobs, once, for the first output (``None`` afterwards or when not asked)."""
        if self.prompt is None:
            return None
        assert len(self.prompt) == self.request.num_prompt_tokens, "the first token came before its prompt's logprobs"
        out, self.prompt = tuple(self.prompt), None
        return out

