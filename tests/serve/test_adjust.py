"""LogitAdjustments: every adjusted row of a step at once, against each row done alone with the
library's own pieces (bias added, stop ids held back, kvtier.sampling.apply_penalties) and the
bans written out (allowed ids, bad words against the row's own output); slots taken, given back
and reused with nothing of their former request left."""

from __future__ import annotations

import random

import pytest
import torch

from kvtier.generate import GenerationConfig, RowText
from kvtier.sampling import apply_penalties
from kvtier.serve.adjust import LogitAdjustments
from kvtier.serve.live import Live
from kvtier.serve.params import RequestParams
from kvtier.serve.scheduler import Request

V = 50
DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA")])]


def live(rid: str, rng: random.Random) -> Live:
    """A request with a random mix of bias, min_tokens (stop ids 3 and 4), penalties, allowed
    ids and bad words of one to three tokens (over a few ids, so that their prefixes occur)."""
    words = tuple(tuple(rng.randrange(6) for _ in range(rng.randint(1, 3))) for _ in range(rng.choice([0, 0, 2, 4])))
    params = RequestParams(
        allowed_token_ids=tuple(rng.sample(range(V), 30)) + (0, 1, 2, 5) if rng.random() < 0.3 else (),
        bad_words=words,
        max_tokens=20, min_tokens=rng.choice([0, 0, 5]),
        presence_penalty=rng.choice([0.0, 0.5, -1.0]), frequency_penalty=rng.choice([0.0, 0.7]),
        repetition_penalty=rng.choice([1.0, 1.0, 1.3, 0.8]),
        logit_bias=tuple((t, rng.uniform(-5, 5)) for t in rng.sample(range(V), rng.choice([0, 0, 3]))))
    req = Request(rid, [rng.randrange(V) for _ in range(rng.randint(1, 12))], max_tokens=20)
    text = RowText(None, GenerationConfig(max_tokens=20), frozenset({3, 4}), params.min_tokens)
    return Live(req, params, text, None, 0.0)


def alone(logits: torch.Tensor, lv: Live, generated: list[int]) -> torch.Tensor:
    """The row's adjusted logits done by hand."""
    p, out = lv.params, logits.clone()[None]
    for t, b in p.logit_bias:
        out[0, t] += b
    if p.allowed_token_ids:
        out[0, [t for t in range(V) if t not in p.allowed_token_ids]] = float("-inf")
    out[0, [w[0] for w in p.bad_words if len(w) == 1]] = float("-inf")
    if lv.holds_stops():
        out[0, [3, 4]] = float("-inf")
    counts = torch.bincount(torch.tensor(generated, dtype=torch.long), minlength=V)[None].int()
    seen = torch.zeros(1, V, dtype=torch.bool)
    seen[0, lv.request.prompt_token_ids] = True
    out = apply_penalties(out, counts, seen, presence=p.presence_penalty, frequency=p.frequency_penalty,
                          repetition=p.repetition_penalty)[0]
    ends = [w[-1] for w in p.bad_words if len(w) > 1 and generated[len(generated) - len(w) + 1:] == list(w[:-1])]
    if ends and not torch.isneginf(out[[t for t in range(V) if t not in ends]]).all():
        out[ends] = float("-inf")  # (unless nothing else is left to sample)
    return out


@pytest.mark.parametrize("device", DEVICES)
def test_all_rows_at_once_equal_each_row_alone_through_reused_slots(device) -> None:
    rng, adj = random.Random(0), LogitAdjustments()
    lives, generated, n = {}, {}, 0
    for _step in range(30):
        for _ in range(rng.randint(0, 3)):  # arrivals
            lives[f"r{n}"], generated[f"r{n}"] = live(f"r{n}", rng), []
            n += 1
        for rid in [r for r in lives if rng.random() < 0.15]:  # endings: slots go back
            del lives[rid]
            adj.release(rid)
        batch = list(lives.values())
        if not batch:
            continue
        logits = torch.randn(len(batch) + 2, V) * 3  # two rows of others, unadjusted
        logits[:, :6] += 3  # (ids 0-5 picked often: the bad words' prefixes occur)
        logits = logits.to(device)
        rows = [i + 1 for i in range(len(batch)) if adj.applies(batch[i])]
        moved = [batch[i - 1] for i in rows]
        if not rows:
            continue
        out, index = adj.apply(logits, rows, moved)
        for j, (i, lv) in enumerate(zip(rows, moved, strict=True)):
            torch.testing.assert_close(out[j].cpu(), alone(logits[i].cpu(), lv, generated[lv.request.request_id]))
        picked = out.argmax(dim=-1)
        full = torch.zeros(logits.shape[0], dtype=torch.long, device=device)
        full[rows] = picked
        adj.count(index, full)
        for lv, t in zip(moved, picked.tolist(), strict=True):
            generated[lv.request.request_id].append(t)
            lv.request.token_ids.append(t)  # (num_output_tokens: min_tokens' hold ends)
    assert n > 30 and set(adj.slots) <= set(lives)  # ended requests hold no slot
    assert set(adj.free).isdisjoint(adj.slots.values()) and len(adj.free) + len(adj.slots) == adj.size


@pytest.mark.parametrize("device", DEVICES)
def test_many_rows_grow_the_slots_and_keep_each_rows_counts(device) -> None:
    adj = LogitAdjustments()
    lives = [Live(Request(f"r{i}", [1, 2], max_tokens=8), RequestParams(frequency_penalty=1.0), RowText(
        None, GenerationConfig(max_tokens=8), frozenset(), 0), None, 0.0) for i in range(20)]
    logits = torch.zeros(20, V, device=device)
    for step in range(3):
        out, index = adj.apply(logits, list(range(20)), lives)
        tokens = torch.tensor([(i + step) % V if i % 2 else i % V for i in range(20)], device=device)
        adj.count(index, tokens)
    assert adj.size == 32  # 8, 16, 32
    out, _ = adj.apply(logits, list(range(20)), lives)
    for i in range(20):  # odd rows: three tokens once each; even rows: one token three times
        want = torch.zeros(V)
        for step in range(3):
            want[(i + step) % V if i % 2 else i % V] -= 1.0
        torch.testing.assert_close(out[i].cpu(), want)


@pytest.mark.parametrize("device", DEVICES)
def test_a_row_whose_bad_words_ban_all_it_may_sample_samples_as_if_they_did_not(device) -> None:
    """Allowed ids 5 and 7, bad words (5, 7) and (5, 5): after a 5 nothing is left, and that row
    alone keeps its logits; a row beside it with the same words but every id allowed has 5 and
    7 banned after its 5."""
    words = ((5, 7), (5, 5))
    rows = [Live(Request(f"r{i}", [1, 2], max_tokens=8), RequestParams(allowed_token_ids=allowed, bad_words=words),
                 RowText(None, GenerationConfig(max_tokens=8), frozenset(), 0), None, 0.0)
            for i, allowed in enumerate([(5, 7), ()])]
    adj = LogitAdjustments()
    logits = torch.zeros(2, V, device=device)
    logits[:, 5], logits[:, 7] = 2.0, 1.0
    out, index = adj.apply(logits, [0, 1], rows)
    assert out[:, 5].tolist() == [2.0, 2.0] and torch.isneginf(out[0, 8:]).all() and out[1, 8] == 0.0
    adj.count(index, torch.tensor([5, 5], device=device))
    out, _ = adj.apply(logits, [0, 1], rows)
    assert out[0, [5, 7]].tolist() == [2.0, 1.0] and torch.isneginf(out[0, 8:]).all()  # nothing else: as before
    assert torch.isneginf(out[1, [5, 7]]).all() and out[1, 8] == 0.0


@pytest.mark.parametrize("device", DEVICES)
def test_guided_choices_allow_the_next_tokens_of_those_still_followed(device) -> None:
    """Choices sharing prefixes, one a prefix of another: each step allows exactly the next tokens
    of the choices the row's tokens still follow, and the stop ids (3, 4) once one is whole;
    random picks among them end as a whole choice; a row beside them is untouched."""
    choices = ((5, 6, 7), (5, 6), (5, 8, 9, 10), (11,))
    rng, adj = random.Random(3), LogitAdjustments()
    for trial in range(12):
        lives = [Live(Request(f"g{trial}-{i}", [1], max_tokens=8), RequestParams(guided_choice=choices),
                      RowText(None, GenerationConfig(max_tokens=8), frozenset({3, 4}), 0), None, 0.0) for i in range(2)]
        bias = Live(Request(f"b{trial}", [1], max_tokens=8), RequestParams(logit_bias=((1, 2.0),)),
                    RowText(None, GenerationConfig(max_tokens=8), frozenset({3, 4}), 0), None, 0.0)
        out_tokens: list[list[int]] = [[], []]
        while lives:
            logits = torch.randn(len(lives) + 1, V, device=device)
            out, index = adj.apply(logits, list(range(len(lives) + 1)), [*lives, bias])
            picked = []
            for j, got in enumerate(out_tokens[: len(lives)]):
                follows = [c for c in choices if c[: len(got)] == tuple(got)]
                want = {c[len(got)] for c in follows if len(c) > len(got)} | ({3, 4} if tuple(got) in choices else set())
                assert set(torch.isfinite(out[j]).nonzero()[:, 0].tolist()) == want, (got, want)
                picked.append(rng.choice(sorted(want)))
            want = logits[-1].clone()
            want[1] += 2.0
            torch.testing.assert_close(out[-1], want)
            adj.count(index, torch.tensor([*picked, 0], device=device))
            for j in reversed(range(len(lives))):
                if picked[j] in (3, 4):
                    assert tuple(out_tokens[j]) in choices
                    adj.release(lives[j].request.request_id)
                    del lives[j], out_tokens[j]
                else:
                    out_tokens[j].append(picked[j])
        adj.release(bias.request.request_id)
    assert not adj.guided and not adj.slots
