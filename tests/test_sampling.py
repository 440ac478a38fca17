"""Sampling: each filter against a distribution computed by hand, and seeded draws."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.sampling import SamplingParams, apply_penalties, make_generator, process_logits, sample

# probabilities 0.4, 0.3, 0.2, 0.1 at temperature 1
P = torch.tensor([0.4, 0.3, 0.2, 0.1])
LOGITS = P.log()[None]  # (1, 4)


def _close(a: torch.Tensor, b: list[float]) -> None:
    torch.testing.assert_close(a, torch.tensor([b], dtype=torch.float32), atol=1e-6, rtol=1e-6)


def test_greedy_is_one_hot_at_argmax():
    logits = torch.tensor([[0.1, 2.0, -1.0], [5.0, 0.0, 4.9]])
    _close(process_logits(logits[:1], SamplingParams()), [0.0, 1.0, 0.0])
    assert sample(logits, SamplingParams()).tolist() == [1, 0]


def test_temperature_only():
    # softmax(log p / T) = p^(1/T) / sum p^(1/T)
    T = 0.5
    w = [0.4**2, 0.3**2, 0.2**2, 0.1**2]
    _close(process_logits(LOGITS, SamplingParams(temperature=T)), [x / sum(w) for x in w])


def test_top_k():
    _close(process_logits(LOGITS, SamplingParams(temperature=1.0, top_k=2)), [4 / 7, 3 / 7, 0, 0])
    # k at least the vocabulary keeps everything
    _close(process_logits(LOGITS, SamplingParams(temperature=1.0, top_k=9)), P.tolist())


def test_top_p():
    # 0.4 < 0.6, 0.4+0.3 >= 0.6: keep two
    _close(process_logits(LOGITS, SamplingParams(temperature=1.0, top_p=0.6)), [4 / 7, 3 / 7, 0, 0])
    # 0.4 alone reaches 0.35: keep one
    _close(process_logits(LOGITS, SamplingParams(temperature=1.0, top_p=0.35)), [1, 0, 0, 0])
    # tiny p still keeps the most likely token
    _close(process_logits(LOGITS, SamplingParams(temperature=1.0, top_p=1e-6)), [1, 0, 0, 0])
    # order of the vocabulary does not matter
    perm = torch.tensor([2, 0, 3, 1])
    out = process_logits(LOGITS[:, perm], SamplingParams(temperature=1.0, top_p=0.6))
    _close(out, torch.tensor([4 / 7, 3 / 7, 0, 0])[perm].tolist())


def test_min_p():
    # floor 0.6 * 0.4 = 0.24: keep 0.4 and 0.3
    _close(process_logits(LOGITS, SamplingParams(temperature=1.0, min_p=0.6)), [4 / 7, 3 / 7, 0, 0])
    # floor 0.45 * 0.4 = 0.18: keep three
    _close(process_logits(LOGITS, SamplingParams(temperature=1.0, min_p=0.45)), [4 / 9, 3 / 9, 2 / 9, 0])


def test_filters_compose_in_order():
    # top-k 3 -> [4,3,2]/9; top-p 0.5 -> 4/9 < 0.5, 7/9 >= 0.5: keep two -> [4,3]/7;
    # min-p 0.8: floor 0.8*4/7 = 0.457 > 3/7: keep one
    params = SamplingParams(temperature=1.0, top_k=3, top_p=0.5, min_p=0.8)
    _close(process_logits(LOGITS, params), [1, 0, 0, 0])
    params = SamplingParams(temperature=1.0, top_k=3, top_p=0.5, min_p=0.7)
    _close(process_logits(LOGITS, params), [4 / 7, 3 / 7, 0, 0])


def test_rows_are_independent():
    logits = torch.stack([P.log(), P.flip(0).log()])  # (2, 4)
    out = process_logits(logits, SamplingParams(temperature=1.0, top_k=1))
    torch.testing.assert_close(out, torch.tensor([[1.0, 0, 0, 0], [0, 0, 0, 1.0]]))


def test_seeded_draws_repeat_and_differ_by_seed():
    logits = torch.randn(4, 1000, generator=torch.Generator().manual_seed(0))
    params = SamplingParams(temperature=1.0, seed=123)

    def draws(p):
        gen = make_generator(p, "cpu")
        return torch.stack([sample(logits, p, gen) for _ in range(20)])

    assert torch.equal(draws(params), draws(params))
    assert not torch.equal(draws(params), draws(SamplingParams(temperature=1.0, seed=124)))


def test_draw_frequencies_match_the_distribution():
    params = SamplingParams(temperature=1.0, top_k=3, seed=7)
    gen = make_generator(params, "cpu")
    n = 20000
    tokens = sample(LOGITS.expand(n, 4), params, gen)
    freq = torch.bincount(tokens, minlength=4).float() / n
    expected = torch.tensor([4 / 9, 3 / 9, 2 / 9, 0.0])
    # 5 standard errors of a binomial proportion
    tol = 5 * math.sqrt(0.25 / n)
    assert (freq - expected).abs().max().item() < tol, (freq, expected)
    assert freq[3].item() == 0.0  # a filtered token is never drawn


@settings(max_examples=30, deadline=None)
@given(
    seed=st.integers(0, 2**16),
    temperature=st.floats(0.1, 3.0),
    top_k=st.integers(0, 40),
    top_p=st.floats(0.05, 1.0),
    min_p=st.floats(0.0, 0.9),
)
def test_processed_rows_are_distributions_and_draws_are_supported(
    seed, temperature, top_k, top_p, min_p
):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(3, 50, generator=g) * 3
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, seed=seed)
    probs = process_logits(logits, params)
    torch.testing.assert_close(probs.sum(-1), torch.ones(3))
    assert (probs >= 0).all()
    # the most likely token always survives
    assert (probs.gather(1, logits.argmax(-1, keepdim=True)) > 0).all()
    if top_k:
        assert ((probs > 0).sum(-1) <= top_k).all()
    tokens = sample(logits, params, make_generator(params, "cpu"))
    assert (probs.gather(1, tokens[:, None]) > 0).all()


def test_top_k_keeps_k_tokens_where_low_temperatures_make_probabilities_subnormal():
    """seed 33, temperature 0.1, top_k 33: the 33rd and 34th tokens of row 1 have logits 0.22 apart,
    and their probabilities (about 1e-39) rounded to one subnormal value; ranked by probability both
    were kept (34 tokens). Ranked by logit, 33."""
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(33)) * 3
    params = SamplingParams(temperature=0.1, top_k=33, seed=33)
    probs = process_logits(logits, params)
    assert ((probs > 0).sum(-1) <= 33).all()
    kept = (logits / 0.1 >= torch.topk(logits / 0.1, 33, dim=-1).values[:, -1:])
    assert not (probs > 0)[~kept].any()  # nothing outside the 33 largest logits


@pytest.mark.parametrize(
    "kwargs, word",
    [
        ({"temperature": -1.0}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_k": -2}, "top_k"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"min_p": -0.1}, "min_p"),
        ({"seed": -1}, "seed"),
        ({"seed": 1.5}, "seed"),
        ({"seed": 2**64}, r"seed must be an int in \[0, 2\*\*64\)"),
    ],
)
def test_bad_params_raise_value_error_naming_the_field(kwargs, word):
    with pytest.raises(ValueError, match=word):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("params", [SamplingParams(temperature=1e-40), SamplingParams(temperature=1e-6),
                                    SamplingParams(temperature=1.0, top_p=1e-300)],
                         ids=["temperature_1e-40", "temperature_1e-6", "top_p_1e-300"])
def test_extreme_params_keep_the_most_likely_token(params):
    """A temperature that overflows float32 logits decodes greedily, and a top_p that rounds to
    0 in float32 keeps the first token: before, both gave NaN rows and token 0."""
    logits = torch.tensor([[1.0, 2.0, 5.0], [3.0, -1.0, 0.5]])
    probs = process_logits(logits, params)
    assert torch.equal(probs, torch.tensor([[0.0, 0.0, 1.0], [1.0, 0.0, 0.0]]))
    assert sample(logits, params, torch.Generator().manual_seed(0)).tolist() == [2, 0]


def test_seeds_up_to_the_generators_range_are_taken():
    make_generator(SamplingParams(temperature=1.0, seed=2**64 - 1), "cpu")


def test_bad_logits_shape():
    with pytest.raises(ValueError, match=r"\[batch, vocab\]"):
        sample(torch.randn(1, 2, 5), SamplingParams())
    with pytest.raises(ValueError, match=r"\[batch, vocab\]"):
        process_logits(torch.randn(5), SamplingParams(temperature=1.0))


def test_penalties_by_hand() -> None:
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0]])
    counts = torch.tensor([[0, 2, 1, 0, 0]], dtype=torch.int32)
    prompt = torch.tensor([[False, False, False, True, False]])
    got = apply_penalties(logits, counts, prompt, presence=0.5, frequency=0.25, repetition=2.0)
    # tokens 1 and 2 generated (twice, once), token 3 in the prompt: repetition first, then
    # frequency x count and presence on the generated ones
    want = torch.tensor([[2.0, -1.0 * 2 - 0.25 * 2 - 0.5, 0.5 / 2 - 0.25 - 0.5, 3.0 / 2, -2.0]])
    assert torch.allclose(got, want)
    assert torch.equal(logits, torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0]]))  # not in place
    # off: the same values, a new tensor
    same = apply_penalties(logits, counts, None)
    assert torch.equal(same, logits) and same.data_ptr() != logits.data_ptr()
    # repetition without a prompt mask: the generated tokens only
    only = apply_penalties(logits, counts, None, repetition=2.0)
    assert torch.allclose(only, torch.tensor([[2.0, -2.0, 0.25, 3.0, -2.0]]))
