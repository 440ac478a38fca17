"""Generation on the default model: every tier gives the tokens of a no-cache reference,
batches equal their batch-1 runs, and stop conditions end rows where they should."""

from __future__ import annotations

import pytest
import torch

from kvtier.config import KVCacheConfig
from kvtier.generate import (
    GenerationConfig,
    generate,
    generate_step,
    split_at_stop,
    stream_generate,
    stream_steps,
)
from kvtier.sampling import SamplingParams

TIERS = ("tail", "block", "ragged", "paged")
PROMPTS = (
    "The capital of France is",
    "Water boils at a temperature of one hundred degrees",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
)
N_NEW = 8


@pytest.fixture(scope="module")
def lm():
    from kvtier.model import load_model

    # one thread: on a machine shared by parallel jobs, OpenMP threads that wait for each
    # other cost far more than they gain on these tiny single-token matmuls
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield load_model(device="cpu", dtype=torch.float32, progress=False)
    torch.set_num_threads(threads)


def tier_config(tier: str) -> KVCacheConfig:
    """The tier's config; skipped with the reason while the tier has not landed."""
    cfg = KVCacheConfig(tier=tier, paged_num_blocks=32)  # a small paged pool: 512 tokens
    try:
        from kvtier.config import make_caches

        make_caches(1, cfg, batch_size=1)
    except (ImportError, TypeError) as e:  # module missing, or abstract methods not written yet
        pytest.skip(f"the {tier} tier is not available yet: {e}")
    return cfg


def reference_greedy(model, ids: list[int], n: int) -> list[int]:
    """Greedy tokens computed without reusing any cache: the whole sequence every step."""
    seq, out = list(ids), []
    with torch.inference_mode():
        for _ in range(n):
            caches = model.make_caches(KVCacheConfig(tier="tail"))
            logits = model(torch.tensor([seq]), caches)[0, -1]
            out.append(int(logits.argmax()))
            seq.append(out[-1])
    return out


@pytest.fixture(scope="module")
def prompt_ids(lm):
    return [lm.tokenizer.encode(p) for p in PROMPTS]


@pytest.fixture(scope="module")
def reference(lm, prompt_ids):
    return [reference_greedy(lm.model, ids, N_NEW) for ids in prompt_ids]


def steps(model, prompts, caches, n, **kw) -> list[list[int]]:
    """``n`` steps of generate_step, as one token list per row."""
    g = generate_step(model, prompts, caches, **kw)
    out = [next(g).tolist() for _ in range(n)]
    g.close()
    return [list(row) for row in zip(*out)]


@pytest.mark.parametrize("tier", TIERS)
def test_batch_1_greedy_equals_the_no_cache_reference(lm, prompt_ids, reference, tier):
    cfg = tier_config(tier)
    for ids, ref in zip(prompt_ids, reference):
        caches = lm.model.make_caches(cfg, batch_size=1)
        assert steps(lm.model, [ids], caches, N_NEW, prefill_chunk=7) == [ref]


@pytest.mark.parametrize("rows, chunk, forwards", [(1, None, 1), (1, 512, 2), (2, None, 1), (4, None, 2)])
def test_default_prefill_chunk_shares_2048_tokens_among_the_rows(lm, rows, chunk, forwards):
    """Prompts of 701 tokens (700 prefilled): one forward for one or two rows (2,048 and 1,024
    tokens a row), two for four rows (512 a row, the floor) or an explicit chunk of 512."""
    ids = (lm.tokenizer.encode(" ".join(PROMPTS)) * 40)[:701]
    calls = []
    caches = lm.model.make_caches(KVCacheConfig(tier="tail"), batch_size=rows)
    g = generate_step(lm.model, [ids] * rows, caches, prefill_chunk=chunk,
                      on_progress=lambda done, total: calls.append((done, total)))
    next(g)
    g.close()
    assert len(calls) == forwards and calls[-1] == (700, 700)
    assert caches[0].offset == 701  # the prompt and the first decode step's token


@pytest.mark.parametrize("tier", ("ragged", "paged"))
def test_batch_of_different_lengths_in_one_cache_equals_batch_1(lm, prompt_ids, reference, tier):
    cfg = tier_config(tier)
    assert len({len(p) for p in prompt_ids}) == 3
    for chunk in (5, 512):
        caches = lm.model.make_caches(cfg, batch_size=3)
        assert steps(lm.model, prompt_ids, caches, N_NEW, prefill_chunk=chunk) == reference
        # each row committed its own prompt and tokens, none of the padding
        lengths = [len(p) + N_NEW - 1 for p in prompt_ids]
        assert caches[0].offset.tolist() == lengths


@pytest.mark.parametrize("tier", TIERS)
def test_generate_batch_equals_batch_1_on_every_tier(lm, prompt_ids, reference, tier):
    # scalar tiers run rows of different lengths one by one; per-row tiers in one batch
    cfg = tier_config(tier)
    config = GenerationConfig(max_tokens=N_NEW, stop_token_ids=(), stop=())
    tok = lm.tokenizer
    batch = generate(lm.model, tok, prompt_ids, config, cache_config=cfg)
    expected = [_text_until_eos(tok, ref) for ref in reference]
    assert batch == expected


def _text_until_eos(tok, tokens: list[int]) -> str:
    out = []
    for t in tokens:
        if t in tok.eos_token_ids:
            break
        out.append(t)
    return tok.decode(out)


def test_scalar_tier_batch_of_equal_lengths_runs_in_lock_step(lm, prompt_ids, reference):
    ids = prompt_ids[0]
    caches = lm.model.make_caches(KVCacheConfig(tier="tail"))
    assert steps(lm.model, [ids, ids], caches, 6) == [reference[0][:6]] * 2
    assert caches[0].keys.shape[0] == 2  # one cache of batch 2, not two runs


def test_scalar_tier_refuses_rows_of_different_lengths(lm, prompt_ids):
    caches = lm.model.make_caches(KVCacheConfig(tier="tail"))
    with pytest.raises(ValueError, match="ragged or paged"):
        steps(lm.model, prompt_ids[:2], caches, 1)
    assert caches[0].offset == 0  # nothing written
    with pytest.raises(ValueError, match="cache_config instead of caches"):
        list(stream_generate(lm.model, lm.tokenizer, prompt_ids[:2], caches=caches))


def test_bad_prompts(lm):
    caches = lm.model.make_caches(KVCacheConfig(tier="tail"))
    with pytest.raises(ValueError, match="no token"):
        steps(lm.model, [[1, 2], []], caches, 1)
    with pytest.raises(ValueError, match="token-id list"):
        steps(lm.model, [1, 2, 3], caches, 1)
    with pytest.raises(ValueError, match="prompts must be"):
        generate(lm.model, lm.tokenizer, [])
    with pytest.raises(ValueError, match="prompts must be.*got None"):
        generate(lm.model, lm.tokenizer, None)
    for bad in (torch.tensor([1.0, 2.0]), torch.zeros(1, 1, 2, dtype=torch.long), torch.tensor([True])):
        with pytest.raises(ValueError, match="integer token ids, \\[T\\] or \\[B, T\\]"):
            generate(lm.model, lm.tokenizer, bad)
    with pytest.raises(ValueError, match=r"GenerationConfig, got dict; build one with GenerationConfig\(\*\*config\)"):
        generate(lm.model, lm.tokenizer, "hi", {"max_tokens": 2})
    with pytest.raises(ValueError, match=r"prompts are bytes, not text or token ids; decode them first"):
        generate(lm.model, lm.tokenizer, b"hello")  # before: read as the ids 104, 101, 108, ...
    for bad in ([1, [2, 3]], ["hi", b"there"], [[1, 2], [3.5]]):
        with pytest.raises(ValueError, match=r"prompt 0|prompt 1 must be a string or a list of int token ids"):
            generate(lm.model, lm.tokenizer, bad)
    with pytest.raises(ValueError, match=r"cache_config must be a KVCacheConfig"):
        generate(lm.model, lm.tokenizer, "hi", cache_config="paged")
    with pytest.raises(ValueError, match=r"caches must be a non-empty list"):
        generate(lm.model, lm.tokenizer, "hi", caches=[])


def test_token_id_tensors_are_prompts(lm, prompt_ids):
    config = GenerationConfig(max_tokens=4)
    ids = prompt_ids[0]
    one = generate(lm.model, lm.tokenizer, ids, config)
    assert generate(lm.model, lm.tokenizer, torch.tensor(ids), config) == one  # [T]: one prompt
    batch = generate(lm.model, lm.tokenizer, torch.tensor([ids, ids], dtype=torch.int32), config)
    assert batch == [one, one]  # [B, T]: a batch
    numpy = pytest.importorskip("numpy")
    as_numpy = list(numpy.array(ids))  # numpy integers, as tokenizers' arrays give them
    assert generate(lm.model, lm.tokenizer, as_numpy, config) == one
    assert generate(lm.model, lm.tokenizer, [as_numpy, list(torch.tensor(ids))], config) == [one, one]


def test_stream_text_is_the_decoded_tokens_and_stats_count_them(lm, prompt_ids, reference):
    config = GenerationConfig(max_tokens=N_NEW)
    responses = list(stream_generate(lm.model, lm.tokenizer, prompt_ids[2], config,
                                     cache_config=KVCacheConfig()))
    tokens = [r.token for r in responses]
    assert tokens == reference[2]
    assert "".join(r.text for r in responses) == lm.tokenizer.decode(tokens)
    assert [r.finish_reason for r in responses] == [None] * (N_NEW - 1) + ["length"]
    last = responses[-1].stats
    assert last.prompt_tokens == len(prompt_ids[2])
    assert last.generation_tokens == N_NEW and last.decode_tokens == N_NEW - 1
    assert last.prefill_tokens_per_s > 0 and last.decode_tokens_per_s > 0


def test_stop_token_ends_the_row_without_text(lm, prompt_ids, reference):
    stop_id = reference[2][3]
    assert stop_id not in reference[2][:3]
    config = GenerationConfig(max_tokens=N_NEW, stop_token_ids=(stop_id,))
    responses = list(stream_generate(lm.model, lm.tokenizer, prompt_ids[2], config,
                                     cache_config=KVCacheConfig()))
    assert [r.token for r in responses] == reference[2][:4]
    assert responses[-1].finish_reason == "stop" and responses[-1].text == ""
    assert "".join(r.text for r in responses) == lm.tokenizer.decode(reference[2][:3])


def test_stop_string_is_cut_from_the_output(lm, prompt_ids, reference):
    full = lm.tokenizer.decode(reference[2])
    stop = full[len(full) // 2 : len(full) // 2 + 3]  # spans a token boundary most likely
    expected = full[: full.find(stop)]
    config = GenerationConfig(max_tokens=N_NEW, stop=(stop,))
    responses = list(stream_generate(lm.model, lm.tokenizer, prompt_ids[2], config,
                                     cache_config=KVCacheConfig()))
    assert "".join(r.text for r in responses) == expected
    assert responses[-1].finish_reason == "stop"
    assert len(responses) < N_NEW


def test_rows_that_finish_stop_while_others_go_on(lm, prompt_ids, reference):
    cfg = tier_config("paged")
    stop_id = reference[0][2]  # row 0 stops at its third token
    rows_with_stop = [i for i, ref in enumerate(reference) if stop_id in ref]
    config = GenerationConfig(max_tokens=N_NEW, stop_token_ids=(stop_id,))
    responses = list(stream_generate(lm.model, lm.tokenizer, prompt_ids, config, cache_config=cfg))
    for row, ref in enumerate(reference):
        got = [r.token for r in responses if r.row == row]
        cut = ref.index(stop_id) + 1 if row in rows_with_stop else N_NEW
        assert got == ref[:cut]


@pytest.mark.parametrize("tier, lockstep, calls", [("ragged", False, [[0, 1]]), ("tail", True, [[0, 1]]),
                                                     ("tail", False, [[0], [1]])])
def test_the_streaming_shell_runs_any_step_function(lm, tier, lockstep, calls):
    """A scripted step function that commits several tokens per forward: the shell groups
    the rows (per-row tier: one batch; scalar tier: lock step when allowed, else row by
    row), cuts each row at max_tokens, and counts what it streamed."""
    script = {0: [[11, 12], [13, 14]], 1: [[21], [22, 23]]}  # per row, the tokens of each forward
    seen = []

    def steps(rows, caches, *, generator, stop_ids, on_progress, on_prefilled):
        ids = [next(i for i, ids in enumerate(prompts) if ids == r) for r in rows]
        seen.append((ids, len(caches), caches[0].tier))
        for forward in range(2):
            yield [script[i][forward] for i in ids]

    prompts = [[1, 2, 3], [4, 5, 6]]
    config = GenerationConfig(max_tokens=3, stop_token_ids=())
    out = list(stream_steps(lm.model, lm.tokenizer, prompts, config, steps, lockstep=lockstep,
                            cache_config=tier_config(tier)))
    assert seen == [(ids, lm.args.n_layers, tier) for ids in calls]
    got = {row: [r.token for r in out if r.row == row] for row in (0, 1)}
    assert got == {0: [11, 12, 13], 1: [21, 22, 23]}  # row 0 is cut at max_tokens (14 dropped)
    assert [r.finish_reason for r in out if r.row == 0] == [None, None, "length"]
    assert "".join(r.text for r in out if r.row == 0) == lm.tokenizer.decode([11, 12, 13])
    last = out[-1].stats
    assert last.generation_tokens == 6 and last.prompt_tokens == 6
    assert last.decode_tokens == 3  # the tokens of the forwards after each group's first
    if len(calls) == 2:  # row by row: all of row 0's responses come first
        assert [r.row for r in out] == [0, 0, 0, 1, 1, 1]
    with pytest.raises(ValueError, match="needs a drafter"):
        next(stream_generate(lm.model, lm.tokenizer, prompts, config, speculative=object(),
                             cache_config=tier_config(tier)))


def test_seeded_sampling_repeats_and_follows_the_seed(lm):
    def run(seed):
        params = SamplingParams(temperature=1.0, top_p=0.95, seed=seed)
        return generate(lm.model, lm.tokenizer, "Tell me a story:", GenerationConfig(
            max_tokens=6, sampling=params, stop_token_ids=()), cache_config=KVCacheConfig())

    first = run(1)
    assert run(1) == first
    assert run(2) != first


def test_split_at_stop():
    assert split_at_stop("hello wor", ("world",)) == ("hello ", "wor", False)
    assert split_at_stop("hello world!", ("world",)) == ("hello ", "", True)
    assert split_at_stop("abc", ()) == ("abc", "", False)
    # vLLM's include_stop_str_in_output: the text ends with the stop string; of two found at one
    # place the longer, of two at different places the first
    assert split_at_stop("hello world!", ("world",), include=True) == ("hello world", "", True)
    assert split_at_stop("a. b.\n", (".", ".\n"), include=True) == ("a.", "", True)
    assert split_at_stop("a.\nb", (".", ".\n"), include=True) == ("a.\n", "", True)
    assert split_at_stop("x stop", ("op", "st"), include=True) == ("x st", "", True)
    assert split_at_stop("ab", ("bx", "abz")) == ("", "ab", False)
    assert split_at_stop("ab", ("bx",), hold=False) == ("ab", "", False)
    # the earliest stop string wins
    assert split_at_stop("xx END yy STOP", ("STOP", "END")) == ("xx ", "", True)


@pytest.mark.parametrize(
    "kwargs, word",
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"stop": "END"}, "stop"),
        ({"stop": ("",)}, "stop"),
        ({"stop_token_ids": (-1,)}, "stop_token_ids"),
        ({"prefill_chunk": 0}, "prefill_chunk"),
        ({"sampling": {"temperature": 1.0}}, "sampling"),
    ],
)
def test_generation_config_checks_its_fields(kwargs, word):
    with pytest.raises(ValueError, match=word):
        GenerationConfig(**kwargs)
