"""The adaptive speculative depth (kvtier.speculative.DepthPolicy) on its own, fed scripted
acceptances and timings: backing off and probing again, drafters too dear to win,
measured draft and verification costs, and batches paced by their slowest row."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.speculative import MAX_DRAFT_TOKENS, DepthPolicy, SpeculativeConfig


def test_depth_policy_backs_off_and_probes_again():
    policy = DepthPolicy(1, max_k=6, verify_cost=0.2, draft_cost=0.0)
    for _ in range(3):
        k = policy.depths()[0]
        policy.observe([k], [k], [0])
    assert policy.depths() == [0]  # drafts keep failing: plain decoding
    reason = policy.reason([True])  # an estimate, said to be one (not a measured rate)
    judged = policy.judged[0]  # three drafts rejected, decayed: no hits, so the prior over judged + 1
    assert f"estimated to be accepted {0.6 / (judged + 1):.0%} of the time (a prior of 60% and {judged:.1f} " \
        "decayed" in reason and 2 < judged < 3, reason
    assert "probing" in reason
    waits = []
    for _ in range(3):  # it tries one draft again after 4, then 8, then 16 plain steps
        idle = 0
        while policy.depths() == [0]:
            policy.observe([0], [0], [0])
            idle += 1
        assert policy.depths() == [1]
        policy.observe([1], [1], [0])
        waits.append(idle)
    assert waits == [4, 8, 16]
    for _ in range(10):  # drafts that hold: the full depth
        k = max(policy.depths()[0], 1)
        policy.observe([k], [k], [k])
    assert policy.depths() == [6] and policy.reason([True]) == ""
    fixed = DepthPolicy(2, max_k=5, verify_cost=0.2, draft_cost=3.0, adaptive=False)
    assert fixed.depths() == [5, 5] and fixed.depths([True, False]) == [5, 0]


def test_a_drafter_as_dear_as_the_target_probes_rarely_and_says_why():
    """cost >= 1: even drafts that are all accepted cannot beat plain decoding."""
    policy = DepthPolicy(1, max_k=6, verify_cost=0.15, draft_cost=1.0)
    chosen = []
    for _ in range(100):
        k = policy.depths()[0]
        chosen.append(k)
        policy.observe([k], [k], [k])  # every draft accepted
    probes = [i for i, k in enumerate(chosen) if k]
    assert set(chosen) == {0, 1} and probes[0] == 0  # the first cycle drafts
    assert [b - a - 1 for a, b in zip(probes, probes[1:])] == [8, 16, 32]  # waits double
    reason = policy.reason([True])
    assert "no depth beats plain decoding" in reason and "1.00" in reason and "estimated" in reason
    # measured so (a cycle with one draft: 1 + 1.2 one-token forwards), it is not probed again
    timed = DepthPolicy(1, max_k=6, verify_cost=0.15, draft_cost=1.0, measure=True)
    chosen = []
    for _ in range(200):
        k = timed.depths()[0]
        chosen.append(k)
        timed.measure(k, draft_s=1.2 * k, verify_s=1.0 + 0.15 * k)
        timed.observe([k], [k], [k])
    assert [i for i, k in enumerate(chosen) if k] == [0, 9]  # the first probe's drafts are not timed
    assert timed.draft_cost == pytest.approx(1.2) and "(measured)" in timed.reason([True])


def test_depth_policy_measures_the_drafter():
    policy = DepthPolicy(1, max_k=6, verify_cost=0.25, draft_cost=1.0, measure=True)
    policy.measure(4, draft_s=40.0, verify_s=2.0)  # the first drafting cycle: a model drafter's prefill
    assert policy.draft_cost == 1.0 and policy.timings == 0
    policy.measure(4, draft_s=0.4, verify_s=2.0)  # by the cost model a one-token forward takes 1.0 s
    assert policy.draft_cost == pytest.approx(0.1) and policy.reason([True]) == ""  # it drafts
    policy.measure(2, draft_s=2.0, verify_s=1.5)  # 1.0 s per draft now: the mean of the two
    assert policy.draft_cost == pytest.approx(0.55)
    policy.measure(0, draft_s=0.0, verify_s=0.5)  # a plain cycle times a one-token forward itself
    policy.measure(4, draft_s=0.2, verify_s=9.0)  # a verification much slower at this width
    assert policy.draft_cost == pytest.approx((0.1 + 1.0 + 0.1) / 3)  # 0.2 s / (4 * 0.5 s)
    unmeasured = DepthPolicy(1, max_k=6, verify_cost=0.25, draft_cost=1.0)
    unmeasured.measure(4, 0.4, 2.0)
    unmeasured.measure(4, 0.4, 2.0)
    assert unmeasured.draft_cost == 1.0  # a fixed draft_cost stays
    assert "no depth beats plain decoding" in unmeasured.reason([True])


def test_depth_policy_steers_clear_of_a_width_measured_slow():
    """Verifications of 5 to 7 tokens measured 8x to 10x a plain step (the linear model says
    1.6x to 1.9x): the depth steps down to 3, where the linear cost model alone stays at 6.
    A width measured faster than the model does not lower its cost (timing noise)."""
    linear = DepthPolicy(1, max_k=6, verify_cost=0.15, draft_cost=0.0)
    policy = DepthPolicy(1, max_k=6, verify_cost=0.15, draft_cost=0.0, measure=True)
    for p in (linear, policy):
        for _ in range(10):
            p.observe([6], [6], [6])  # drafts that hold
    policy.measure(0, 0.0, 1.0)
    policy.measure(6, 0.0, 10.0)
    seen = [policy.depths()[0]]
    for k, slow in ((5, 9.0), (4, 8.0)):  # an unmeasured width is tried, found slow, left
        policy.measure(k, 0.0, slow)
        seen.append(policy.depths()[0])
    assert linear.depths() == [6] and seen == [5, 4, 3]
    policy.measure(1, 0.0, 0.5)
    assert policy.cycle_cost(6) == pytest.approx(10.0) and policy.cycle_cost(1) == pytest.approx(1.15)


def test_depth_policy_follows_the_slowest_row_of_a_batch():
    policy = DepthPolicy(4, max_k=6, verify_cost=0.2, draft_cost=0.0)
    for _ in range(8):  # rows 0 and 1 accept everything, rows 2 and 3 nothing
        ks = policy.depths()
        policy.observe(ks, [6, 6, 6, 6], [6, 6, 0, 0])
    assert [policy._best([policy.alpha(r)]) for r in range(4)] == [6, 6, 0, 0]
    # the failing rows set the batch's pace: deeper forwards would not shorten it
    assert policy.depths() == [0, 0, 0, 0]
    # once they are done, the others draft at full depth
    assert policy.depths([True, True, False, False]) == [6, 6, 0, 0]
    # a weaker row caps the batch where it gains most
    weak = DepthPolicy(2, max_k=6, verify_cost=0.2, draft_cost=0.0)
    for _ in range(8):
        weak.observe([6, 6], [6, 6], [6, 1])
    k_weak = weak._best([weak.alpha(1)])
    assert 0 < k_weak < 6 and weak.depths() == [k_weak, k_weak]


def _best_by_definition(policy: DepthPolicy, alphas, limits) -> int:
    """``DepthPolicy._best`` as its docstring defines it, each expectation summed anew."""
    best_k, best = 0, 1.0
    for k in range(1, max(limits, default=0) + 1):
        expected = min(sum(a**i for i in range(min(k, lim) + 1)) for a, lim in zip(alphas, limits))
        if expected / policy.cycle_cost(k) > best:
            best_k, best = k, expected / policy.cycle_cost(k)
    return best_k


@settings(max_examples=300, deadline=None)
@given(alphas=st.lists(st.floats(0.0, 0.999), min_size=1, max_size=4), data=st.data(),
       verify_cost=st.floats(0.0, 0.5), draft_cost=st.floats(0.0, 0.5))
def test_best_depth_equals_its_definition(alphas, data, verify_cost, draft_cost):
    policy = DepthPolicy(len(alphas), 24, verify_cost=verify_cost, draft_cost=draft_cost)
    limits = data.draw(st.lists(st.integers(0, 24), min_size=len(alphas), max_size=len(alphas)))
    assert policy._best(alphas, limits) == _best_by_definition(policy, alphas, limits)
    assert policy._best(alphas) == _best_by_definition(policy, alphas, [24] * len(alphas))


def test_the_deepest_policy_plans_in_linear_time():
    """At MAX_DRAFT_TOKENS the depth search takes one power of each row's acceptance a
    depth (it summed each expectation anew: quadratic, minutes a step at a depth of 100,000)."""
    powers = []

    class Alpha(float):  # counts the powers taken of it
        def __pow__(self, n):
            powers.append(n)
            return float(self) ** n

    policy = DepthPolicy(2, MAX_DRAFT_TOKENS, verify_cost=0.0, draft_cost=0.0)
    assert policy._best([Alpha(0.99), Alpha(0.999)]) == MAX_DRAFT_TOKENS  # free drafts: as deep as allowed
    assert len(powers) == 2 * MAX_DRAFT_TOKENS
    policy.hits, policy.judged = [50.0, 50.0], [50.0, 50.0]  # every draft accepted so far
    assert policy.depths() == [MAX_DRAFT_TOKENS, MAX_DRAFT_TOKENS]


@pytest.mark.parametrize("k", [-1, MAX_DRAFT_TOKENS + 1, 100_000, True, 2.0])
def test_draft_tokens_out_of_range_is_refused(k):
    with pytest.raises(ValueError, match=f"draft_tokens must be an int in \\[0, {MAX_DRAFT_TOKENS}\\]"):
        SpeculativeConfig(draft_tokens=k)


def test_a_free_drafter_whose_verifications_cost_too_much_is_not_told_to_find_a_cheaper_one():
    # --speculative ngram --draft-tokens 1: drafts cost nothing, but a width-2 verification was
    # timed at 2.24 one-token forwards; the reason said "a cheaper drafter would: ngram" and
    # called the measured cycle "estimated"
    policy = DepthPolicy(1, max_k=1, verify_cost=0.15, draft_cost=0.0, measure=True)
    policy.measure(0, draft_s=0.0, verify_s=1.0)
    for _ in range(3):
        policy.measure(1, draft_s=0.0, verify_s=2.24)
    assert policy.hopeless()
    reason = policy.reason([True])
    assert reason == ("a draft costs 0.00 target forwards (measured) but a cycle with one 2.24 (measured): "
                      "verification forwards cost more than the tokens they can add at a depth of at most 1 "
                      "(a larger --draft-tokens, or --fixed-depth, may pay)")
    costly = DepthPolicy(1, max_k=6, verify_cost=0.15, draft_cost=1.0)  # never timed
    assert "(estimated) and a cycle with one 2.15 (estimated): no depth beats" in costly.reason([True])
