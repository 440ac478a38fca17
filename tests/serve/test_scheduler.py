"""Scheduler: continuous batching, chunked prefill under a budget, admission, preemption.

The reference is a toy model over a simulated paged cache: a step writes each fed
token into its row's slot (``blocks[pos // bs]``), and a sampled token is a
function of the tokens *read back from the row's blocks* (with a sliding window, of its
last ``window`` tokens only: the blocks before may have been released). A request's outputs must
equal the outputs of running it alone, however it was batched, chunked, shared
or preempted; and the pool must be whole again at the end.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.serve.prefix import BlockManager
from kvtier.serve.scheduler import (
    QueueFull,
    Request,
    Scheduler,
    SchedulerConfig,
    StepBatch,
)


def next_token(tokens: list[int]) -> int:
    return sum((i + 1) * t for i, t in enumerate(tokens)) % 7 + 1


def alone(prompt: list[int], max_tokens: int, window: int | None = None) -> list[int]:
    tokens = list(prompt)
    for _ in range(max_tokens):
        tokens.append(next_token(tokens[-window:] if window else tokens))
    return tokens[len(prompt):]


class ToyRunner:
    """Writes fed tokens into block slots; samples from what the blocks hold."""

    def __init__(self, bm: BlockManager, window: int | None = None):
        self.bm, self.slots, self.window = bm, {}, window

    def execute(self, batch: StepBatch) -> dict[str, int]:
        bs = self.bm.block_size
        out = {}
        written = set()
        for row in batch.rows:
            assert len(row.blocks) * bs >= row.start + len(row.token_ids), "a row lacks blocks"
            for i, t in enumerate(row.token_ids):
                pos = row.start + i
                block = row.blocks[pos // bs]
                assert self.bm.ref_count(block) == 1, "a write into a shared block"
                assert (block, pos % bs) not in written, "two rows write one slot"
                written.add((block, pos % bs))
                self.slots[block, pos % bs] = t
            if row.sample:
                n = row.start + len(row.token_ids)
                first = max(0, n - self.window) if self.window else 0
                seen = [self.slots[row.blocks[p // bs], p % bs] for p in range(first, n)]
                out[row.request_id] = next_token(seen)
        return out


def run(s: Scheduler, arrivals: dict[int, list[Request]], max_steps: int = 10_000) -> dict[str, list]:
    runner, outputs, step = ToyRunner(s.blocks, s.config.window), {}, 0
    while s.has_unfinished() or any(k >= step for k in arrivals):
        for req in arrivals.get(step, []):
            s.add(req)
            outputs[req.request_id] = req
        batch = s.schedule()
        cfg = s.config
        assert len(batch.rows) <= cfg.max_num_seqs and batch.num_tokens <= cfg.max_batched_tokens
        assert len({r.request_id for r in batch.rows}) == len(batch.rows)
        sampled = runner.execute(batch)
        s.update(batch, sampled)
        step += 1
        assert step < max_steps, "the scheduler made no progress"
    return {rid: req.output_token_ids for rid, req in outputs.items()}


def test_lifecycle_chunked_prefill_then_decode() -> None:
    bm = BlockManager(16, 4)
    s = Scheduler(SchedulerConfig(max_model_len=64, max_num_seqs=2, max_batched_tokens=4), bm)
    prompt = list(range(1, 11))
    s.add(Request("a", prompt, max_tokens=3))
    chunks = []
    while s.has_unfinished():
        batch = s.schedule()
        chunks.append([(r.start, len(r.token_ids), r.sample) for r in batch.rows])
        s.update(batch, {rid: 5 for rid in batch.sampled})
    assert chunks == [[(0, 4, False)], [(4, 4, False)], [(8, 2, True)], [(10, 1, True)], [(11, 1, True)]]
    assert bm.num_free_blocks == 16 and bm.num_cached_blocks == 3  # 12 computed tokens: 3 full blocks


def test_decode_rows_first_then_prefill_with_the_rest_of_the_budget() -> None:
    s = Scheduler(SchedulerConfig(max_model_len=64, max_num_seqs=4, max_batched_tokens=6),
                  BlockManager(32, 4))
    s.add(Request("a", [1, 2], max_tokens=8))
    s.add(Request("b", [3, 4], max_tokens=8))
    b = s.schedule()
    s.update(b, {rid: 1 for rid in b.sampled})
    s.add(Request("c", list(range(1, 20)), max_tokens=2))
    b = s.schedule()
    assert [(r.request_id, len(r.token_ids)) for r in b.rows] == [("a", 1), ("b", 1), ("c", 4)]


def test_decode_rows_go_longest_context_first() -> None:
    """Decode rows come longest context first (the attention kernel starts its programs in
    row order), oldest first among equals; prompt chunks follow, oldest first."""
    s = Scheduler(SchedulerConfig(max_model_len=64, max_num_seqs=5, max_batched_tokens=64),
                  BlockManager(64, 4))
    for rid, n in (("a", 3), ("b", 9), ("c", 5), ("d", 9)):
        s.add(Request(rid, list(range(1, n + 1)), max_tokens=8))
    b = s.schedule()
    s.update(b, {rid: 1 for rid in b.sampled})
    s.add(Request("e", list(range(100, 130)), max_tokens=2))
    b = s.schedule()
    assert [(r.request_id, r.start) for r in b.rows] == [("b", 9), ("d", 9), ("c", 5), ("a", 3), ("e", 0)]


def test_prefix_hit_skips_the_cached_blocks() -> None:
    bm = BlockManager(32, 4)
    s = Scheduler(SchedulerConfig(max_model_len=64), bm)
    system = list(range(1, 13))
    out = run(s, {0: [Request("a", system + [1, 2], max_tokens=2)]})
    s.add(Request("b", system + [3], max_tokens=2))
    first = s.schedule().rows[0]
    assert (first.start, first.token_ids) == (12, (3,)) and s.requests["b"].num_cached_tokens == 12
    assert (bm.prefix_hits, bm.prefix_queries) == (12, 14 + 13)
    assert out["a"] == alone(system + [1, 2], 2)


def test_a_request_wanting_its_prompts_logits_skips_the_cache_and_takes_small_chunks() -> None:
    """No prefix hit (every position must be computed), chunks marked all_logits of at most
    max_prompt_logits tokens a step for all such requests together (a second one waits for
    its share), beside a request that takes the rest of the budget."""
    bm = BlockManager(512, 16)
    k = 512
    s = Scheduler(SchedulerConfig(max_model_len=4096, max_batched_tokens=2048, max_prompt_logits=k), bm)
    system = list(range(1, 65))
    run(s, {0: [Request("a", system + [1, 2], max_tokens=2)]})  # 4 blocks cached
    ids = system + [7] * (2 * k + 100)
    b, c = Request("b", ids, max_tokens=2, prompt_logits=True), Request("c", system + [9] * 3000, max_tokens=2)
    d = Request("d", [5] * 400, max_tokens=2, prompt_logits=True)
    for r in (b, c, d):
        s.add(r)
    rows = []
    for _ in range(3):
        batch = s.schedule()
        rows.append([(r.request_id, r.start, len(r.token_ids), r.all_logits) for r in batch.rows])
        s.update(batch, {rid: 1 for rid in batch.sampled})
    assert rows[0] == [("b", 0, k, True), ("c", 64, 2048 - k, False)]  # c's cached 64 skipped
    # d waits: b took this step's share of logits (before the shared cap: d ran 72 tokens here)
    assert rows[1] == [("b", k, k, True), ("c", 64 + 2048 - k, 3064 - (2112 - k), False)]
    # c decodes; b's last chunk, and d with the rest of the share
    assert rows[2] == [("c", 3064, 1, False), ("b", 2 * k, 164, True), ("d", 0, k - 164, True)]
    assert b.num_cached_tokens == 0 and c.num_cached_tokens == 64
    b.prompt_logits = False  # (what the engine does once it has them)
    assert [(r.request_id, r.start, len(r.token_ids), r.all_logits) for r in s.schedule().rows] == [
        ("b", len(ids), 1, False), ("d", k - 164, 400 - (k - 164), True)]


def test_admission_waits_for_blocks_and_preemption_recomputes() -> None:
    bm = BlockManager(6, 4)  # 24 slots: two requests of 5 + 8 tokens cannot both finish
    s = Scheduler(SchedulerConfig(max_model_len=24, max_num_seqs=4, max_batched_tokens=16), bm)
    reqs = {0: [Request(f"r{i}", [i + 1] * 5, max_tokens=8) for i in range(3)]}
    want = {f"r{i}": alone([i + 1] * 5, 8) for i in range(3)}
    assert run(s, reqs) == want
    assert s.num_preemptions > 0 and bm.num_free_blocks == 6


def test_queue_bound_and_context_are_enforced() -> None:
    s = Scheduler(SchedulerConfig(max_model_len=16, max_waiting=1), BlockManager(8, 4))
    s.add(Request("a", [1], max_tokens=1))
    with pytest.raises(QueueFull, match="max_waiting 1"):
        s.add(Request("b", [1], max_tokens=1))
    with pytest.raises(ValueError, match="already in use"):
        s.add(Request("a", [1], max_tokens=1))
    with pytest.raises(ValueError, match="exceed the context of 16"):
        s.add(Request("c", [1] * 10, max_tokens=7))
    assert s.num_waiting == 1 and list(s.requests) == ["a"]
    with pytest.raises(ValueError, match="max_batched_tokens 2 is below"):
        SchedulerConfig(max_model_len=8, max_num_seqs=4, max_batched_tokens=2)
    with pytest.raises(ValueError, match="could never fit"):
        Scheduler(SchedulerConfig(max_model_len=64), BlockManager(8, 4))
    with pytest.raises(ValueError, match="prompt_token_ids"):
        Request("x", [], max_tokens=1)


def test_the_priority_policy_admits_low_values_first_and_preempts_high_ones() -> None:
    """vLLM's priority scheduling: the waiting queue by (priority, arrival); a preemption takes
    the running request of the highest value (the newest among equals), which goes back at its
    place; first come, first served refuses a priority it would ignore."""
    bm = BlockManager(8, 2)
    s = Scheduler(SchedulerConfig(max_model_len=16, max_num_seqs=1, policy="priority"), bm)
    for rid, prio in (("a", 5), ("b", 0), ("c", 1), ("d", 0), ("e", -1)):
        s.add(Request(rid, [1, 2], max_tokens=1, priority=prio))
    order = []
    while s.has_unfinished():
        batch = s.schedule()
        order += [r.request_id for r in batch.rows]
        s.update(batch, {rid: 1 for rid in batch.sampled})
    assert order == ["e", "b", "d", "c", "a"]
    # two running, the pool full: the one of the higher value (b, though it came first) is preempted
    bm = BlockManager(4, 2)
    s = Scheduler(SchedulerConfig(max_model_len=8, max_num_seqs=2, policy="priority"), bm)
    for rid, prio in (("b", 3), ("a", 1), ("w", 2)):  # (b runs, then a; w waits, between them)
        s.add(Request(rid, [1, 2, 3], max_tokens=4, priority=prio))
        batch = s.schedule()
        s.update(batch, {rid: 1 for rid in batch.sampled})
    assert [r.request_id for r in s.running] == ["b", "a"] and bm.num_free_blocks == 0
    batch = s.schedule()  # (b's fifth token needs a block: b, the higher value, is preempted, not a)
    assert batch.preempted == ("b",) and [r.request_id for r in s.waiting] == ["w", "b"]
    with pytest.raises(ValueError, match="priority 2 needs the priority scheduling policy"):
        Scheduler(SchedulerConfig(max_model_len=8), BlockManager(4, 2)).add(Request("x", [1], max_tokens=1, priority=2))
    with pytest.raises(ValueError, match="scheduling policy must be one of fcfs, priority, got 'lifo'"):
        SchedulerConfig(max_model_len=8, policy="lifo")
    with pytest.raises(ValueError, match="priority must be an int"):
        Request("x", [1], max_tokens=1, priority=1.5)


def test_abort_frees_blocks_whatever_the_state() -> None:
    bm = BlockManager(8, 4)
    s = Scheduler(SchedulerConfig(max_model_len=32, max_num_seqs=1), bm)
    s.add(Request("a", [1] * 6, max_tokens=4))
    s.add(Request("b", [2] * 6, max_tokens=4))
    batch = s.schedule()
    s.update(batch, {rid: 1 for rid in batch.sampled})
    assert s.abort("a") and s.abort("b") and not s.abort("a")
    assert bm.num_free_blocks == 8 and not s.has_unfinished()


def test_blocks_behind_a_sliding_window_are_released() -> None:
    """A window of 6 keys over blocks of 2: two requests of 4 + 16 tokens (10 blocks each whole)
    run side by side in 10 blocks, each holding at most the blocks its window reaches; the
    released places name the scratch block (id ``num_blocks``); the pool is whole at the end."""
    bm = BlockManager(10, 2)
    s = Scheduler(SchedulerConfig(max_model_len=20, max_num_seqs=2, window=6), bm)
    reqs = [Request(rid, p, max_tokens=16) for rid, p in (("a", [1, 2, 3, 1]), ("b", [2, 2, 1, 3]))]
    for req in reqs:
        s.add(req)
    runner, held = ToyRunner(bm, 6), []
    while s.has_unfinished():
        batch = s.schedule()
        s.update(batch, runner.execute(batch))
        for req in s.running:
            k = len(req.behind)
            assert req.blocks[:k] == [10] * k  # (the blocks themselves may serve another request by now)
            held.append(len(req.blocks) - k)
    # (19 tokens computed at the end: blocks 0 .. 6 behind the last token's window, in each)
    assert s.num_preemptions == 0 and max(held) <= 5 and s.released_blocks == 2 * 7
    assert bm.num_free_blocks == 10 and bm.num_used_blocks == 0
    assert [r.output_token_ids for r in reqs] == [alone(r.prompt_token_ids, 16, 6) for r in reqs]
    with pytest.raises(ValueError, match="window must be an int >= 1"):
        SchedulerConfig(max_model_len=24, window=0)


@pytest.mark.parametrize("window", [8, None])
def test_a_chain_released_behind_a_window_is_evicted_tail_first(window) -> None:
    """A request's head blocks, released early behind its window, go after its tail in the prefix
    cache's LRU when it ends: evicting one block then costs the chain's tail, as without a
    window, not its head (which would leave every later block of it unreachable)."""
    bm = BlockManager(16, 4)
    s = Scheduler(SchedulerConfig(max_model_len=64, window=window), bm)
    a = Request("a", [1, 2, 3, 1, 2, 3], max_tokens=34)
    run(s, {0: [a]})  # 39 tokens computed: 9 blocks cached
    run(s, {0: [Request("b", [3] * 30, max_tokens=1)]})  # 8 blocks: the 7 never cached and one evicted
    assert len(bm.match_prefix(a.token_ids[:36])) == 8  # (36 tokens: the first 8 of the 9 blocks)


def test_a_window_no_wider_than_a_block_releases_nothing() -> None:
    """Blocks are released only behind windows wider than a block: the newest hashed block, whose
    hash the next full block chains on, must stay."""
    bm = BlockManager(16, 4)
    s = Scheduler(SchedulerConfig(max_model_len=24, window=4), bm)
    out = run(s, {0: [Request("a", [1, 2, 3], max_tokens=12)]})
    assert out["a"] == alone([1, 2, 3], 12, 4) and s.released_blocks == 0


@settings(max_examples=60, deadline=None)
@given(
    prompts=st.lists(st.tuples(st.lists(st.integers(1, 3), min_size=1, max_size=14),
                               st.integers(1, 9), st.integers(0, 6), st.booleans()),
                     min_size=1, max_size=8),
    num_blocks=st.integers(8, 24),
    max_num_seqs=st.integers(1, 5),
    extra_budget=st.integers(0, 12),
    caching=st.booleans(),
    priorities=st.none() | st.lists(st.integers(-2, 2), min_size=8, max_size=8),
    window=st.none() | st.integers(1, 9),
)
def test_any_workload_gives_each_request_its_solo_output(prompts, num_blocks, max_num_seqs,
                                                         extra_budget, caching, priorities, window) -> None:
    """Also with a sliding window (blocks of 2: released behind windows of 3 and more)."""
    bm = BlockManager(num_blocks, 2, enable_prefix_caching=caching)
    cfg = SchedulerConfig(max_model_len=16, max_num_seqs=max_num_seqs, max_batched_tokens=max_num_seqs + extra_budget,
                          policy="fcfs" if priorities is None else "priority", window=window)
    s = Scheduler(cfg, bm)
    shared = [1, 2, 3, 1, 2]
    arrivals: dict[int, list[Request]] = {}
    want = {}
    for i, (prompt, max_tokens, at, share) in enumerate(prompts):
        prompt = (shared + prompt if share else prompt)[:15]
        max_tokens = min(max_tokens, 16 - len(prompt))
        arrivals.setdefault(at, []).append(Request(f"r{i}", prompt, max_tokens,
                                                   priority=0 if priorities is None else priorities[i]))
        want[f"r{i}"] = alone(prompt, max_tokens, window)
    assert run(s, arrivals) == want
    assert bm.num_free_blocks == num_blocks and bm.num_used_blocks == 0


def test_the_scheduling_policy_flag_reaches_the_engine_config(capsys) -> None:
    from kvtier import cli
    from kvtier.serve.cli import configs_from_args

    parse = cli.build_parser().parse_args
    assert configs_from_args(parse(["serve", "--scheduling-policy", "priority"]))[0].scheduling_policy == "priority"
    assert configs_from_args(parse(["serve"]))[0].scheduling_policy == "fcfs"
    with pytest.raises(SystemExit):
        parse(["serve", "--scheduling-policy", "lifo"])
    assert "invalid choice: 'lifo'" in capsys.readouterr().err


def test_vllms_spellings_of_the_step_flags_are_taken() -> None:
    from kvtier import cli
    from kvtier.serve.cli import configs_from_args

    args = cli.build_parser().parse_args(["serve", "--max-num-batched-tokens", "1024", "--tensor-parallel-size", "2"])
    assert configs_from_args(args)[0].max_batched_tokens == 1024 and args.tensor_parallel == 2
    assert cli.build_parser().parse_args(["serve", "-tp", "3"]).tensor_parallel == 3
