"""Batch-invariant serving (``EngineConfig(batch_invariant=True)``, ``kvtier serve
--batch-invariant``): a request's tokens and logprobs are the same bits whatever else shares its
steps, however its prompt is chunked, whether its prefix came from the cache, whether it was
preempted and recomputed, and with or without drafts.

The reference is always the same request run alone in a fresh engine; every comparison is exact
(``==`` on float32 logprobs, ``torch.equal`` on logits), over full-precision, ``q8``, ``q4_g32``
and TurboQuant pages. Without the mode the same bursts part (docs/serving.md: 9 of 32 answers
of a burst over ``q8`` pages).
"""

from __future__ import annotations

import concurrent.futures
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from openai import OpenAI

from kvtier.model import load_model
from kvtier.model.cpu_step import plan_for
from kvtier.quant.modes import TurboQuantConfig
from kvtier.sampling import SamplingParams
from kvtier.serve.engine import EngineConfig, LLMEngine
from kvtier.serve.params import RequestParams
from kvtier.serve.runner import ModelRunner
from kvtier.serve.speculate import SpeculativeConfig
from server_support import running_server
from step_support import invariant_logits

TEXTS = ["The capital of France is", "Write a haiku about the sea.", "List three prime numbers:",
         "Once upon a time, in a land far away, there lived a", "def fibonacci(n):",
         "What is the meaning of life? Answer briefly and then elaborate on it."]
STORAGE = {"fp": {}, "q8": {"kv_quant": "q8"}, "q4_g32": {"kv_quant": "q4_g32"},
           "turboquant": {"turboquant": TurboQuantConfig()}}


def _run(lm, prompts, params, **config) -> tuple[list, LLMEngine]:
    engine = LLMEngine(lm.model, lm.tokenizer, EngineConfig(batch_invariant=True, **config))
    return engine.generate(prompts, params), engine


def _assert_same_bits(got, alone) -> None:
    for g, a in zip(got, alone, strict=True):
        assert g.token_ids == a.token_ids
        assert [x.logprob for x in g.logprobs] == [x.logprob for x in a.logprobs]


@pytest.mark.parametrize("codes", ["fp", "q8", "turboquant"])
def test_a_tokens_bits_do_not_depend_on_the_tokens_beside_it_in_the_step(lm, codes) -> None:
    """The one-call step with ``invariant``: a sequence's logits at every position, computed a token
    a call, in calls of 48 beside two other sequences, in one call of 100 then a token at a time
    beside another, or a token at a time beside two or three others, are the same bits (140 positions:
    attention splits the keys)."""
    model, a = lm.model, lm.model.args
    step = plan_for(model)
    seqs = torch.randint(0, a.vocab_size, (4, 140), generator=torch.Generator().manual_seed(1))
    tables = torch.arange(36, dtype=torch.int32).view(4, 9)  # 9 blocks of 16 a sequence

    def run(calls) -> dict:
        return invariant_logits(step, a, seqs, tables, calls, STORAGE[codes])

    alone = run([[(0, p, p + 1)] for p in range(140)])
    beside = run([[(1, lo, lo + 48), (0, lo, lo + 48), (2, lo, lo + 5)] for lo in range(0, 96, 48)]
                 + [[(0, 96, 140), (1, 96, 140)]])
    chunked = run([[(2, 0, 100), (0, 0, 100)]] + [[(0, p, p + 1), (1, p - 100, p - 99)] for p in range(100, 140)])
    few = run([[(1, p, p + 1), (0, p, p + 1), (2, p, p + 1)] + [(3, p, p + 1)] * (p % 2) for p in range(140)])
    for other in (beside, chunked, few):  # (calls of 1, 2, 3-4 and more rows: loops of their own)
        assert all(torch.equal(alone[0, p], other[0, p]) for p in range(140))


@pytest.mark.parametrize("codes", list(STORAGE))
def test_a_burst_chunked_and_preempted_answers_as_each_request_alone(lm, codes) -> None:
    """Six requests together in a pool of 9 blocks and steps of 48 tokens (chunked prompts, and
    preemptions) give each request's tokens and logprobs of its run alone, bit for bit."""
    prompts = [lm.tokenizer.encode(t) for t in TEXTS]
    params = [RequestParams(max_tokens=16 + 3 * i, logprobs=0, ignore_eos=True) for i in range(len(prompts))]
    together, engine = _run(lm, prompts, params, num_blocks=9, max_batched_tokens=48, max_num_seqs=6,
                            **STORAGE[codes])
    assert engine.runner.storage_mode == codes and engine.stats()["preemptions"] > 0
    alone = [_run(lm, [p], [q], num_blocks=64, **STORAGE[codes])[0][0] for p, q in zip(prompts, params)]
    _assert_same_bits(together, alone)


def test_cached_prefixes_and_drafts_answer_as_alone_and_undrafted(lm) -> None:
    """A shared system prompt served from the prefix cache, and n-gram drafts, change no bit: every
    answer equals its run alone without drafts (the drafted tokens are computed as decoded ones)."""
    system = "You are a helpful assistant who answers questions about history and science with care. " * 2
    prompts = [lm.tokenizer.encode(system + q) for q in ("Who built the pyramids?", "Why is the sky blue?")]
    prompts.append(lm.tokenizer.encode("1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 1, 2,"))
    params = [RequestParams(max_tokens=24, logprobs=0, ignore_eos=True)] * len(prompts)
    engine = LLMEngine(lm.model, lm.tokenizer, EngineConfig(num_blocks=64, kv_quant="q8", batch_invariant=True,
                                                            speculative=SpeculativeConfig()))
    got = engine.generate(prompts[:1], params[:1]) + engine.generate(prompts[1:], params[1:])
    stats = engine.stats()
    assert stats["prefix_hits"] > 0 and stats["spec_accepted_tokens"] > 0
    alone = [_run(lm, [p], [q], num_blocks=64, kv_quant="q8")[0][0] for p, q in zip(prompts, params)]
    _assert_same_bits(got, alone)


def test_calls_cut_short_by_the_scores_budget_change_no_bit(lm, monkeypatch) -> None:
    """At long contexts a step runs in calls of fewer tokens (the scores' budget); here a few
    tokens a call against whole steps: the same answers."""
    from kvtier.serve import runner

    prompts = [lm.tokenizer.encode(t) for t in TEXTS[:3]]
    params = [RequestParams(max_tokens=12, logprobs=0, ignore_eos=True)] * 3
    whole, _ = _run(lm, prompts, params, num_blocks=64)
    monkeypatch.setattr(runner, "INVARIANT_SCORE_BYTES", 4 * lm.model.args.n_heads * 40 * 3)  # 3 tokens at 40
    _assert_same_bits(_run(lm, prompts, params, num_blocks=64)[0], whole)


def test_asynchronous_scheduling_feeds_pending_tokens_to_the_same_step(lm) -> None:
    """With asynchronous scheduling on the CPU (a decode row's token still in the step before's
    tokens) the answers are still those of each request alone, synchronously."""
    prompts = [lm.tokenizer.encode(t) for t in TEXTS[:4]]
    params = [RequestParams(max_tokens=20, logprobs=0, ignore_eos=True)] * 4
    together, _ = _run(lm, prompts, params, num_blocks=64, kv_quant="q8", async_scheduling=True)
    _assert_same_bits(together, [_run(lm, [p], [q], num_blocks=64, kv_quant="q8")[0][0] for p, q in zip(prompts, params)])


def test_a_seeded_sampled_request_beside_others_with_drafts_on_samples_as_alone(lm) -> None:
    """How many drafts a row gets hangs on the step (``disable_by_batch_size``, the token budget), and
    rejection sampling draws by it: in the mode a sampled row is not drafted, so a seeded request's
    tokens are its tokens alone (before: drafted alone, not beside another request, they parted at
    the second token)."""
    spec = SpeculativeConfig(disable_by_batch_size=1)
    code = lm.tokenizer.encode("def f(x): return x + 1\ndef g(x): return x + 1\ndef h(x):")
    sampled = RequestParams(max_tokens=24, logprobs=0, sampling=SamplingParams(temperature=0.8, seed=7))
    greedy = RequestParams(max_tokens=24, logprobs=0, ignore_eos=True)
    alone, _ = _run(lm, [code], [sampled], num_blocks=64, speculative=spec)
    beside, _ = _run(lm, [code, code], [sampled, greedy], num_blocks=64, speculative=spec)
    _assert_same_bits(beside[:1], alone)


def test_prompt_logprobs_are_each_positions_logits_alone(lm) -> None:
    """Prompt logprobs come from the same per-token step: equal to the prompt's run alone."""
    prompts = [lm.tokenizer.encode(t) for t in TEXTS[:3]]
    params = [RequestParams(max_tokens=4, prompt_logprobs=0, logprobs=0, ignore_eos=True)] * 3
    together, _ = _run(lm, prompts, params, num_blocks=64, kv_quant="q8")
    for got, p, q in zip(together, prompts, params):
        alone = _run(lm, [p], [q], num_blocks=64, kv_quant="q8")[0][0]
        assert got.prompt_logprobs == alone.prompt_logprobs and got.prompt_logprobs[1:]
        _assert_same_bits([got], [alone])


def test_what_the_mode_cannot_serve_is_refused_by_name(lm, monkeypatch) -> None:
    with pytest.raises(ValueError, match="batch_invariant must be a bool"):
        EngineConfig(batch_invariant=1)
    with pytest.raises(ValueError, match=r"fp8 pages \(--kv-quant fp8\) take their centre"):
        ModelRunner(lm.model, num_blocks=8, kv_quant="fp8", batch_invariant=True)
    with pytest.raises(ValueError, match=r"block_size 24 \(--block-size\) is not a power of two"):
        ModelRunner(lm.model, num_blocks=8, block_size=24, batch_invariant=True)
    half = load_model(device="cpu", dtype=torch.bfloat16, progress=False)
    with pytest.raises(ValueError, match=r"the model is bfloat16 and the step runs float32 \(--dtype float32\)"):
        ModelRunner(half.model, num_blocks=8, batch_invariant=True)
    del half
    monkeypatch.setenv("KVTIER_PREFILL_DTYPE", "bfloat16")
    with pytest.raises(ValueError, match="the prefill dtype is bfloat16"):
        ModelRunner(lm.model, num_blocks=8, batch_invariant=True)
    monkeypatch.delenv("KVTIER_PREFILL_DTYPE")
    monkeypatch.setenv("KVTIER_DECODE_STEP", "0")
    with pytest.raises(ValueError, match="KVTIER_DECODE_STEP or KVTIER_FUSED turns the one-call step off"):
        LLMEngine(lm.model, lm.tokenizer, EngineConfig(num_blocks=8, batch_invariant=True))


@pytest.mark.parametrize("flags, env, why", [
    (["--kv-quant", "fp8"], {}, "fp8 pages (--kv-quant fp8) take their centre"),
    (["--dtype", "bfloat16"], {}, "the model is bfloat16 and the step runs float32 (--dtype float32)"),
    (["--prefill-dtype", "bfloat16"], {}, "the prefill dtype is bfloat16 (--prefill-dtype, KVTIER_PREFILL_DTYPE)"),
    ([], {"KVTIER_PREFILL_DTYPE": "bfloat16"}, "the prefill dtype is bfloat16"),
    (["--block-size", "24"], {}, "block_size 24 (--block-size) is not a power of two; use 16"),
    ([], {"KVTIER_DECODE_STEP": "0"}, "KVTIER_DECODE_STEP or KVTIER_FUSED turns the one-call step off"),
    ([], {"KVTIER_FUSED": "0"}, "KVTIER_DECODE_STEP or KVTIER_FUSED turns the one-call step off"),
])
def test_the_server_refuses_what_its_settings_rule_out_before_the_model_loads(
        flags, env, why, tmp_path, monkeypatch, capsys) -> None:
    """A refusal the flags and environment decide comes before the model is read: the model named
    does not exist, and the error is still the mode's."""
    from kvtier import cli

    # (set here, so that teardown restores it: kvtier serve writes --prefill-dtype into the
    # environment for its ranks)
    monkeypatch.setenv("KVTIER_PREFILL_DTYPE", "float32")
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    argv = ["serve", "--batch-invariant", "--device", "cpu", "--model", str(tmp_path / "missing.gguf"), *flags]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvtier: error: batch-invariant steps run every token through the CPU's one-call "
                          "step, which cannot serve here: ") and why in err, err


def test_the_server_refuses_tensor_parallel_before_any_rank_starts() -> None:
    run = subprocess.run([sys.executable, "-m", "kvtier.cli", "serve", "--batch-invariant", "--tensor-parallel", "2"],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode != 0 and "does not combine with --tensor-parallel" in run.stderr
    assert "rank" not in run.stderr  # (refused in the launcher: no rank loaded the model)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_mode_is_refused_on_cuda() -> None:
    from kvtier.model import ModelArgs, build_random

    args = ModelArgs(dim=128, n_layers=2, n_heads=4, n_kv_heads=2, hidden_dim=256, vocab_size=256)
    gpu = build_random(args, dtype=torch.bfloat16, device="cuda")
    with pytest.raises(ValueError, match="the model is on cuda"):
        LLMEngine(gpu, None, EngineConfig(num_blocks=8, batch_invariant=True))


def test_the_server_answers_a_concurrent_burst_as_each_request_alone(tmp_path: Path) -> None:
    """``kvtier serve --batch-invariant`` over ``q8`` pages: six chat completions at once (threads
    of the openai client) give the texts and logprobs of the same six sent one after another."""
    with running_server(tmp_path / "serve.log", "--batch-invariant", "--kv-quant", "q8", "--num-blocks", "64",
                        "--max-batched-tokens", "64") as url:
        client = OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
        model = client.models.list().data[0].id

        def ask(text: str) -> tuple[str, list[float]]:
            r = client.chat.completions.create(model=model, messages=[{"role": "user", "content": text}],
                                               max_tokens=20, temperature=0, logprobs=True)
            return r.choices[0].message.content, [t.logprob for t in r.choices[0].logprobs.content]

        deadline = time.monotonic() + 240
        alone = [ask(t) for t in TEXTS]
        with concurrent.futures.ThreadPoolExecutor(len(TEXTS)) as pool:
            together = list(pool.map(ask, TEXTS))
        assert time.monotonic() < deadline
        assert together == alone and all(lp for _, lp in alone)
    assert "| batch-invariant" in (tmp_path / "serve.log").read_text()  # the start-up line says so
