"""Tensor parallelism on the CPU: gloo, spawned ranks, greedy tokens against one rank's.

Each spawn starts fresh interpreters (a few seconds each on two cores), so every
test that spawns does all its work in one launch; every launch has a deadline,
every group a collective timeout, so a failure here cannot hang.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import tempfile
import time

import pytest
import torch
import torch.distributed as dist
from torch.multiprocessing.spawn import ProcessExitedException

from kvtier.config import KVCacheConfig
from kvtier.drafters import make_drafter
from kvtier.generate import GenerationConfig, generate_step, stream_generate
from kvtier.model import ModelArgs, build_random
from kvtier.model.architectures import get_args
from kvtier.parallel import (
    TensorParallel,
    TensorParallelError,
    check_same_device,
    check_shardable,
    check_world,
    launch,
    run_sharded,
    shard_model,
)
from kvtier.parallel.launch import _failure, _Report
from kvtier.parallel.layers import split_range
from kvtier.sampling import SamplingParams
from kvtier.speculative import stream_speculative

DEADLINE_S = 120.0  # a whole launch; far above what one takes, far below a hang
#: 8 query heads over 4 KV heads; an MLP and a vocabulary that do not split evenly over 2
TINY = ModelArgs(dim=128, n_layers=2, n_heads=8, n_kv_heads=4, head_dim=16, hidden_dim=191,
                 vocab_size=257, max_position_embeddings=512)
#: (name, config, prompts): the scalar tiers run prompts of one length in lock step
TIERS = (
    ("tail", KVCacheConfig(tier="tail", step=8), [[1, 2, 3, 4, 5], [9, 8, 7, 6, 5]]),
    ("block", KVCacheConfig(tier="block", owned_block_size=4), [[1, 2, 3, 4, 5], [9, 8, 7, 6, 5]]),
    ("ragged", KVCacheConfig(tier="ragged", step=8), [[1, 2, 3, 4, 5, 6, 7], [200, 3]]),
    ("paged", KVCacheConfig(tier="paged", paged_block_size=4, paged_num_blocks=64),
     [[1, 2, 3, 4, 5, 6, 7], [200, 3]]),
    ("paged q8", KVCacheConfig(tier="paged", paged_block_size=4, paged_num_blocks=64,
                               kv_quant="q8"), [[1, 2, 3, 4, 5, 6, 7], [200, 3]]),
)
NEW_TOKENS = 10


def greedy(model, config: KVCacheConfig, prompts, n: int = NEW_TOKENS, params=None):
    """``n`` tokens per row from the engine's token-step generator, and the KV heads the
    first layer's cache holds."""
    caches = model.make_caches(config, batch_size=len(prompts))
    steps = generate_step(model, prompts, caches, params=params)
    tokens = [next(steps).tolist() for _ in range(n)]
    steps.close()
    state = caches[0].state  # keys (B, H_kv, T, D) or pages (blocks, block_size, H_kv, D)
    heads = state["keys"].shape[1] if "keys" in state else state["key_cache"].shape[2]
    return tokens, heads


# -- in this process: the refusals ------------------------------------------------------------
def test_split_range_covers_every_item_once():
    for n, world in ((191, 2), (257, 3), (4, 4), (3, 5)):
        ranges = [split_range(n, world, r) for r in range(world)]
        assert [i for a, b in ranges for i in range(a, b)] == list(range(n))
        assert max(b - a for a, b in ranges) - min(b - a for a, b in ranges) <= 1


def test_kv_heads_that_do_not_divide_are_refused():
    smollm2 = get_args("smollm2-135m")  # 9 query heads, 3 KV heads
    with pytest.raises(ValueError, match=r"size 2 does not divide the 3 KV heads.*1 or 3"):
        check_shardable(smollm2, 2)
    check_shardable(smollm2, 3)
    with pytest.raises(ValueError, match="size must be an int >= 1"):
        check_shardable(smollm2, 0)


@pytest.mark.parametrize("world", [2, 99])
def test_an_unshardable_split_is_refused_before_a_rank_starts(monkeypatch, world):
    """run_sharded and serve_sharded read the model's shape from its header first (99 ranks
    each loading the model would take minutes before the first of them refused)."""
    from kvtier.parallel import launch, run, serve

    def no_ranks(*a, **k):
        raise AssertionError("a rank was started")

    for module in (launch, run, serve):
        monkeypatch.setattr(module, "run_ranks", no_ranks, raising=False)
    with pytest.raises(ValueError, match=f"size {world} does not divide the 3 KV heads"):
        run.run_sharded(print, world)
    with pytest.raises(ValueError, match=f"size {world} does not divide the 3 KV heads"):
        serve.serve_sharded(print, world)


def test_world_refusals():
    with pytest.raises(ValueError, match="size must be an int >= 1, got 0"):
        check_world(0, "cpu")
    with pytest.raises(ValueError, match="pass no index"):
        check_world(2, "cuda:1")
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    with pytest.raises(ValueError, match=f"needs one GPU per rank, but {gpus} GPU"):
        check_world(gpus + 1, "cuda")


def test_shard_refuses_before_changing_the_model():
    model = build_random(TINY)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    tp = TensorParallel(0, 3, 0, torch.device("cpu"), "gloo", 10.0)  # 3 does not divide 4
    with pytest.raises(ValueError, match="size 3 does not divide the 4 KV heads"):
        shard_model(model, tp)
    after = model.state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)


# -- spawned ranks: the tiny random Llama ---------------------------------------------------------
def _tiny_rank(tp: TensorParallel):
    model = shard_model(build_random(TINY), tp)
    attn, a = model.layers[0].attention, model.args
    heads = (attn.n_heads, attn.n_kv_heads, model.layers[0].feed_forward.hidden_dim,
             a.n_heads, a.n_kv_heads, a.hidden_dim)
    out = {name: greedy(model, config, prompts) for name, config, prompts in TIERS}
    # sampling without a seed: every rank draws from its global RNG, seeded alike by launch
    sampled, _ = greedy(model, TIERS[3][1], TIERS[3][2], params=SamplingParams(temperature=1.0))
    everyone = [None] * tp.world_size
    dist.all_gather_object(everyone, sampled)
    mixed = TensorParallel(tp.rank, tp.world_size, tp.local_rank,
                           torch.device("meta" if tp.rank else "cpu"), tp.backend, tp.timeout_s)
    try:
        check_same_device(mixed)
        refused = None
    except ValueError as e:
        refused = str(e)
    return {"tiers": out, "heads": heads, "sampled": everyone, "mixed": refused, "prefill": _prefill_logits(model)}


def _prefill_logits(model) -> dict[str, torch.Tensor]:
    """The last logits of a 100-token prompt, prefilled in float32 and in bfloat16."""
    ids = torch.arange(100)[None] * 7 % TINY.vocab_size
    out = {}
    with torch.inference_mode():
        for name in ("float32", "bfloat16"):
            model.prefill_dtype = name
            out[name] = model(ids, model.make_caches(KVCacheConfig(tier="tail")))[0, -1]
    return out


def test_tiny_llama_two_ranks_equal_one_rank_on_every_tier():
    got = launch(_tiny_rank, 2, timeout_s=30, deadline_s=DEADLINE_S)
    model = build_random(TINY)
    # query heads, KV heads, MLP hidden (191 -> 96 + 95) of the layers, and the args alike
    assert got["heads"] == (4, 2, 96) * 2
    for name, config, prompts in TIERS:
        want, heads = greedy(model, config, prompts)
        tokens, rank_heads = got["tiers"][name]
        assert tokens == want, name
        assert (heads, rank_heads) == (4, 2), name  # each rank's cache holds its 2 KV heads
    assert got["sampled"][0] == got["sampled"][1]
    # a bfloat16 prefill on the ranks (column and row shards alike) is near one process's
    one, ranks = _prefill_logits(model), got["prefill"]
    assert torch.allclose(ranks["float32"], one["float32"], atol=1e-5)
    assert not torch.equal(ranks["bfloat16"], ranks["float32"])
    scale = one["float32"].abs().max()
    for narrow in (ranks["bfloat16"], one["bfloat16"]):
        assert (narrow - one["float32"]).abs().max() < 0.05 * scale
    assert got["mixed"].startswith("mixed devices across ranks: ['cpu', 'meta']")


# -- spawned ranks: SmolLM2 over 3 ranks ------------------------------------------------------------
SMOL_PROMPT = "The capital of France is"
SMOL_TIERS = ("tail", "block", "ragged", "paged", "q8")
SPEC_PROMPT = "Repeat exactly: the quick brown fox jumps over the lazy dog. the quick brown fox"


def _smol_config(name: str) -> KVCacheConfig:
    if name == "q8":
        return KVCacheConfig(tier="paged", kv_quant="q8", paged_num_blocks=64)
    return KVCacheConfig(tier=name, paged_num_blocks=64)


def _smol_tokens(lm) -> dict[str, list]:
    """6 greedy tokens on every tier, and 8 of speculative decoding (n-gram drafts,
    early-exit drafts from the first 8 layers) on the paged tier; ``measured``: whether each
    speculative run's depth policy timed its cycles."""
    import kvtier.speculative as spec_module

    gen = GenerationConfig(max_tokens=6)
    out = {name: [r.token for r in stream_generate(lm.model, lm.tokenizer, SMOL_PROMPT, gen,
                                                   cache_config=_smol_config(name))]
           for name in SMOL_TIERS}
    real, measured = spec_module.DepthPolicy, []

    class Spy(real):
        def __init__(self, *a, **kw):
            measured.append(kw["measure"])
            super().__init__(*a, **kw)

    spec_module.DepthPolicy = Spy
    try:
        for spec in ("ngram", "early-exit:8"):
            stream = stream_speculative(lm.model, lm.tokenizer, SPEC_PROMPT,
                                        GenerationConfig(max_tokens=8), drafter=make_drafter(spec, lm),
                                        cache_config=_smol_config("paged"))
            out[spec] = [r.token for r in stream]
    finally:
        spec_module.DepthPolicy = real
    out["measured"] = measured
    return out


def _smol_rank(lm):
    return _smol_tokens(lm)


def test_smollm2_three_ranks_equal_one_rank_on_every_tier_and_speculative(lm):
    got = run_sharded(_smol_rank, 3, dtype=torch.float32, timeout_s=60)
    want = _smol_tokens(lm)
    # one process times its drafting cycles; ranks keep the estimate, else each picks its own
    # depth and their collectives differ in size (a gloo abort, 2 runs of 6 before)
    assert want.pop("measured") == [True, True] and got.pop("measured") == [False, False]
    assert got.keys() == want.keys() and len(want["ngram"]) == len(want["early-exit:8"]) == 8
    for name in want:
        assert got[name] == want[name], name


def test_cli_generate_three_ranks_equals_one(lm, capfd):
    from kvtier.cli import main

    argv = ["generate", SMOL_PROMPT, "--raw", "--max-tokens", "5", "--device", "cpu",
            "--dtype", "float32", "--tier", "paged", "--json"]
    assert main(argv + ["--tensor-parallel", "3"]) == 0
    captured = capfd.readouterr()
    out = captured.out.strip().splitlines()
    assert len(out) == 1  # rank 0 alone prints
    sharded = json.loads(out[0])
    assert sharded["cache"]["ranks"] == 3 and " on each of 3 ranks" in captured.err  # rank 0's share
    want = [r.token for r in stream_generate(lm.model, lm.tokenizer, SMOL_PROMPT,
                                             GenerationConfig(max_tokens=5),
                                             cache_config=KVCacheConfig(tier="paged"))]
    assert sharded["tokens"] == want


def _tiny_gpu_rank(tp: TensorParallel):
    model = shard_model(build_random(TINY, device=tp.device, std=0.3), tp)
    return {name: greedy(model, config, prompts)[0] for name, config, prompts in TIERS}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_ranks_meet_over_nccl_and_give_one_process_tokens(monkeypatch):
    """Spawned ranks, one a GPU (one on a one-GPU machine, two where there are two), meet
    over NCCL at the launcher's store; every tier's greedy tokens are one process's."""
    monkeypatch.setenv("NCCL_NVLS_ENABLE", "0")  # multicast stays off on a shared host
    ranks = min(2, torch.cuda.device_count())
    got = launch(_tiny_gpu_rank, ranks, device_type="cuda", timeout_s=60, deadline_s=DEADLINE_S)
    model = build_random(TINY, device="cuda", std=0.3)
    for name, config, prompts in TIERS:
        assert got[name] == greedy(model, config, prompts)[0], name


# -- spawned ranks that fail ---------------------------------------------------------------------------
def _raising_rank(tp: TensorParallel):
    x = torch.ones(4)
    dist.all_reduce(x)  # both ranks get here
    if tp.rank == 1:
        raise RuntimeError("rank 1 fails on purpose")
    dist.all_reduce(x)  # rank 0 waits for a peer that is gone
    return "rank 0 should not get here"


def test_a_rank_that_raises_stops_the_others(monkeypatch, tmp_path):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # where torch names its error files
    with pytest.raises(TensorParallelError, match="rank 1 of 2: RuntimeError: rank 1 fails on purpose"):
        launch(_raising_rank, 2, timeout_s=20, deadline_s=DEADLINE_S)
    assert list(tmp_path.iterdir()) == []  # the raising rank's traceback file is gone with it


def _leaving_rank(tp: TensorParallel):
    if tp.rank == 1:
        return None  # leaves cleanly: the parent has nothing to stop, rank 0 must not hang
    x = torch.ones(4)
    dist.all_reduce(x)
    return "rank 0 should not get here"


def test_a_rank_that_leaves_makes_the_collective_raise():
    with pytest.raises(TensorParallelError, match="rank 0 of 2: .*Error"):
        launch(_leaving_rank, 2, timeout_s=5, deadline_s=DEADLINE_S)


def _unshardable_rank(tp: TensorParallel):
    three_kv_heads = ModelArgs(dim=96, n_layers=1, n_heads=6, n_kv_heads=3, hidden_dim=64,
                               vocab_size=64)
    shard_model(build_random(three_kv_heads), tp)


def test_a_callers_mistake_on_a_rank_comes_back_as_value_error():
    with pytest.raises(ValueError, match=r"rank \d of 2: ValueError: .*does not divide the 3 KV heads"):
        launch(_unshardable_rank, 2, timeout_s=20, deadline_s=DEADLINE_S)


def _tensor_rank(tp: TensorParallel):
    return {"logits": torch.arange(3.0) + tp.rank, "ranks": tp.world_size}


def test_rank_zeros_tensors_come_back_by_value():
    # the queue's pickler shared the tensor's storage through a handle that was gone once the
    # worker exited: FileNotFoundError from inside multiprocessing
    got = launch(_tensor_rank, 2, timeout_s=20, deadline_s=DEADLINE_S)
    assert got["ranks"] == 2 and torch.equal(got["logits"], torch.arange(3.0))


def test_the_rendezvous_port_is_held_before_the_ranks_start(monkeypatch):
    # the port was bind(0)-and-released by the parent and bound again by rank 0's store once it
    # had started: anything could take it in between. Here a thief binds it just before the
    # workers start; the run must not notice.
    import torch.multiprocessing as mp

    start = mp.start_processes
    stolen = []

    def steal_then_start(fn, args, **kwargs):
        port = next(int(a.rsplit(":", 1)[1]) if isinstance(a, str) else a[1] for a in args
                    if isinstance(a, str) and a.startswith("tcp://") or isinstance(a, tuple) and len(a) == 2)
        thief = socket.socket()
        try:
            thief.bind(("127.0.0.1", port))
            thief.listen()
            stolen.append(thief)
        except OSError:  # held by the launcher: what should happen
            thief.close()
        return start(fn, args, **kwargs)

    monkeypatch.setattr(mp, "start_processes", steal_then_start)
    try:
        got = launch(_tensor_rank, 2, timeout_s=20, deadline_s=DEADLINE_S)
    finally:
        for thief in stolen:
            thief.close()
    assert not stolen, "the rendezvous port was free when the workers started"
    assert got["ranks"] == 2


def _killed_rank(tp: TensorParallel):
    x = torch.ones(4)
    dist.all_reduce(x)
    if tp.rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)  # as the kernel's out-of-memory killer would
    dist.all_reduce(x)  # rank 0 loses its peer
    return "rank 0 should not get here"


def test_a_rank_killed_by_a_signal_is_named_not_the_rank_that_lost_it():
    with pytest.raises(TensorParallelError, match=r"^rank 1 of 2 died \(signal SIGKILL\); the other ranks"):
        launch(_killed_rank, 2, timeout_s=20, deadline_s=DEADLINE_S)


class _Process:
    def __init__(self, exitcode):
        self.exitcode = exitcode


def test_a_killed_rank_comes_before_the_survivors_reports():
    # rank 1 killed (SIGKILL), rank 0 reported the broken connection and was then terminated
    # (SIGTERM) by the parent: the error named rank 0, the healthy one
    lost = _Report(0, False, when=1.0, kind="other", message="RuntimeError: Connection closed by peer")
    e = ProcessExitedException("process 0 terminated with signal SIGTERM", error_index=0, error_pid=1,
                               exit_code=-15, signal_name="SIGTERM")
    err = _failure([lost], e, 2, [_Process(-signal.SIGTERM), _Process(-signal.SIGKILL)])
    assert str(err) == ("rank 1 of 2 died (signal SIGKILL); the other ranks were stopped "
                        "(then rank 0: RuntimeError: Connection closed by peer)")
    # gloo's own message is long: the survivor's part of the line is cut at 200 characters
    long = _Report(0, False, when=1.0, kind="other", message="RuntimeError: " + "x" * 300)
    err = _failure([long], e, 2, [_Process(-signal.SIGTERM), _Process(-signal.SIGKILL)])
    assert str(err).endswith("x" * 186 + "...)") and len(str(err)) < 300
    # a rank that reported its own failure is named as before, whatever the others' codes
    own = _Report(1, False, when=0.5, kind="value", message="ValueError: bad")
    err = _failure([own], e, 2, [_Process(-signal.SIGTERM), _Process(1)])
    assert isinstance(err, ValueError) and str(err) == "rank 1 of 2: ValueError: bad"


def _sleeping_rank(tp: TensorParallel, folder: str):
    with open(os.path.join(folder, str(tp.rank)), "w") as f:
        f.write(str(os.getpid()))
    time.sleep(120)


def test_ctrl_c_in_the_parent_stops_the_workers(tmp_path):
    # a SIGINT to the parent alone (not to its process group) left the workers running to the
    # end of their work, and the parent waited for them at exit
    def interrupt_once_both_started(signum, frame):
        if len(list(tmp_path.iterdir())) == 2:
            raise KeyboardInterrupt
        signal.setitimer(signal.ITIMER_REAL, 0.5)

    previous = signal.signal(signal.SIGALRM, interrupt_once_both_started)
    signal.setitimer(signal.ITIMER_REAL, 0.5)
    t0 = time.monotonic()
    try:
        with pytest.raises(KeyboardInterrupt):
            launch(_sleeping_rank, 2, args=(str(tmp_path),), timeout_s=20, deadline_s=DEADLINE_S)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    assert time.monotonic() - t0 < 60  # not the workers' 120 s
    for pid_file in tmp_path.iterdir():
        with pytest.raises(ProcessLookupError):  # stopped and reaped
            os.kill(int(pid_file.read_text()), 0)


def test_cli_says_a_failed_rank_in_one_line(monkeypatch, capsys):
    # TensorParallelError is a RuntimeError: the command line printed a Python traceback
    import kvtier.parallel
    from kvtier import cli

    def died(*args, **kwargs):
        raise TensorParallelError("rank 1 of 3 died (signal SIGKILL); the other ranks were stopped\n"
                                  "Traceback (most recent call last): ...")

    monkeypatch.setattr(kvtier.parallel, "run_sharded", died)
    assert cli.main(["generate", "Hi", "--device", "cpu", "--tensor-parallel", "3"]) == 1
    err = capsys.readouterr().err
    assert err == "kvtier: error: rank 1 of 3 died (signal SIGKILL); the other ranks were stopped\n"


@pytest.mark.parametrize("tier, message", [
    ("paged", "CUDA-graph decode cannot serve: the model is on cpu; CUDA graphs need a CUDA device"),
    ("tail", "CUDA-graph decode needs the ragged or paged tier, not 'tail'"),
])
def test_cuda_graph_is_refused_before_any_rank_starts(capsys, monkeypatch, tier, message):
    from kvtier import cli, cli_run

    def spawned(args):
        raise AssertionError("ranks were spawned")  # before: 3 ranks loaded, then "rank 2 of 3: ..."

    monkeypatch.setattr(cli_run, "_run_tensor_parallel", spawned)
    argv = ["generate", "hi", "--cuda-graph", "--tier", tier, "--tensor-parallel", "3", "--device", "cpu"]
    assert cli.main(argv) == 2
    assert capsys.readouterr().err.startswith(f"kvtier: error: {message}")
