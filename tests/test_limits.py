"""The model's limits at every generation entry (kvtier.limits): token ids in the vocabulary
and prompts within the context are checked before any forward, and a row that reaches
the end of the context stops with ``finish_reason="length"``.

The model is a tiny random Llama whose context is cut to 16 positions; the reference
is the same weights with a 512-position context, decoded greedily without a cache.
"""

from __future__ import annotations

import pytest
import torch

from kvtier.config import KVCacheConfig
from kvtier.drafters import NgramDrafter
from kvtier.generate import GenerationConfig, generate, generate_step, stream_generate
from kvtier.limits import context_room
from kvtier.model.architectures import build_random, get_args
from kvtier.model.llama import ModelArgs
from kvtier.speculative import speculative_generate_step

CONTEXT, VOCAB = 16, 256
TIERS = ("tail", "block", "ragged", "paged")


def tiny(context: int):
    args = ModelArgs.from_dict({**get_args("tiny-llama").to_dict(), "max_position_embeddings": context})
    return build_random(args, seed=3, std=0.5)  # std 0.5: tokens that vary from step to step


@pytest.fixture(scope="module")
def model():
    return tiny(CONTEXT)


@pytest.fixture(scope="module")
def wide():
    """The same weights with room to go past ``CONTEXT``: the reference."""
    return tiny(512)


class IdsTokenizer:
    """Token ids as text (``<7>``), no end-of-sequence id: only the limits end a row."""

    eos_token_ids = ()

    def stream_decoder(self):
        return self

    def feed(self, token: int) -> str:
        return f"<{token}>"

    def flush(self) -> str:
        return ""


def greedy(model, ids: list[int], n: int) -> list[int]:
    """``n`` greedy tokens, each from a forward over the whole sequence (no cache reused)."""
    seq = list(ids)
    with torch.inference_mode():
        for _ in range(n):
            logits = model(torch.tensor([seq]), model.make_caches(KVCacheConfig(tier="tail")))
            seq.append(int(logits[0, -1].argmax()))
    return seq[len(ids):]


def prompt(n: int, seed: int) -> list[int]:
    """``n`` ids with a repeated stretch, so that the n-gram drafter has something to propose."""
    gen = torch.Generator().manual_seed(seed)
    head = torch.randint(VOCAB, ((n + 1) // 2,), generator=gen).tolist()
    return (head * 2)[:n]


def test_context_room_counts_the_positions_left(model):
    assert context_room(model, [prompt(3, 0), prompt(CONTEXT, 1), [0]]) == [14, 1, CONTEXT]


@pytest.mark.parametrize("row, words", [
    (prompt(CONTEXT + 1, 0), ["17 tokens", "context is 16", "shorten it"]),
    ([1, VOCAB, 2], ["[256]", "vocabulary [0, 256)", "tokenizer"]),
    ([1, -1, 2], ["[-1]", "vocabulary [0, 256)"]),
    ([1, 2.0], ["[2.0]", "vocabulary"]),
])
def test_context_room_names_the_value_and_the_fix(model, row, words):
    with pytest.raises(ValueError) as e:
        context_room(model, [[5], row])
    assert "prompt 1" in str(e.value)
    for w in words:
        assert w in str(e.value)


ENTRIES = {
    "generate_step": lambda m, rows, caches: next(generate_step(m, rows, caches)),
    "speculative_generate_step": lambda m, rows, caches: next(
        speculative_generate_step(m, rows, caches, NgramDrafter(), max_tokens=4)),
    "stream_generate": lambda m, rows, caches: next(stream_generate(
        m, IdsTokenizer(), rows, GenerationConfig(max_tokens=4), caches=caches)),
    "generate": lambda m, rows, caches: generate(
        m, IdsTokenizer(), rows, GenerationConfig(max_tokens=4), caches=caches),
    "generate+drafter": lambda m, rows, caches: generate(
        m, IdsTokenizer(), rows, GenerationConfig(max_tokens=4), caches=caches,
        drafter=NgramDrafter()),
}


@pytest.mark.parametrize("mistake", ["too_long", "id_past_vocab"])
@pytest.mark.parametrize("entry", list(ENTRIES))
def test_every_entry_refuses_before_any_forward(model, entry, mistake):
    bad = prompt(CONTEXT + 1, 0) if mistake == "too_long" else [3, VOCAB + 7, 4]
    rows = [prompt(4, 1), bad]  # the bad prompt comes second: row 0 must not run first
    caches = model.make_caches(KVCacheConfig(tier="ragged"), batch_size=2)
    forwards = []
    hook = model.register_forward_pre_hook(lambda *a: forwards.append(1))
    try:
        with pytest.raises(ValueError, match="prompt 1"):
            ENTRIES[entry](model, rows, caches)
    finally:
        hook.remove()
    assert forwards == [] and all(c.empty() for c in caches)


def test_the_default_model_refuses_a_prompt_past_its_context_and_ids_past_its_vocabulary(lm):
    with pytest.raises(ValueError, match="8401 tokens but the model's context is 8192"):
        generate(lm.model, lm.tokenizer, [1] * 8401, GenerationConfig(max_tokens=4))
    with pytest.raises(ValueError, match=r"\[49152\] outside the model's vocabulary \[0, 49152\)"):
        generate(lm.model, lm.tokenizer, [1, 49152], GenerationConfig(max_tokens=4))


def test_generate_step_ends_where_the_context_does(model, wide):
    rows = [prompt(10, 2)]  # room: 16 - 10 + 1 = 7 tokens
    got = [y.tolist() for y in generate_step(model, rows, model.make_caches())]
    assert [t for (t,) in got] == greedy(wide, rows[0], 7)


@pytest.mark.parametrize("speculative", [False, True], ids=["plain", "speculative"])
@pytest.mark.parametrize("tier", TIERS)
def test_a_row_that_reaches_the_context_stops_with_length(model, wide, tier, speculative):
    rows = [prompt(10, 2), prompt(4, 4)]  # room: 7 and 13 tokens, max_tokens 20
    kw = {"drafter": NgramDrafter()} if speculative else {}
    out: dict[int, list] = {0: [], 1: []}
    cfg = KVCacheConfig(tier=tier, paged_block_size=4, paged_num_blocks=16)
    for r in stream_generate(model, IdsTokenizer(), rows, GenerationConfig(max_tokens=20),
                             cache_config=cfg, **kw):
        out[r.row].append((r.token, r.finish_reason))
    for row, ids in enumerate(rows):
        room = CONTEXT - len(ids) + 1
        tokens, reasons = zip(*out[row])
        assert list(tokens) == greedy(wide, ids, room)
        assert reasons == (None,) * (room - 1) + ("length",)
