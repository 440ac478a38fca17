"""The one-call CPU decode step (kvtier.model.cpu_step) against the layered forward.

Each test runs the same prompt and tokens twice, once through the step and once with
``KVTIER_DECODE_STEP=0`` (the layered forward with its C elementwise kernels), and
compares logits, greedy tokens, the caches' contents and their counters. Only attention's
summation order differs between the two, so logits agree to float32 rounding.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from test_packed import q4_1_weight, q8_0_weight
from torch import nn

from kvtier.caches.ragged import RaggedBatchKVCache
from kvtier.caches.tail_owned import TailOwnedKVCache
from kvtier.model import cpu_step
from kvtier.model.llama import ModelArgs, Transformer
from kvtier.model.packed import PackedLinear, pack_model

PROMPT = [[3, 17, 42, 8, 99, 5, 61, 23, 7]]


@pytest.fixture(autouse=True)
def _needs_kernels():
    if cpu_step.load_kernels() is None:
        pytest.skip("no C compiler builds the decode step here")


def small_model(*, packed: bool = True, seed: int = 0, **kw) -> Transformer:
    """A 3-layer model; with ``packed`` its projections are exact Q4_1 (wqkv, w13, w2) and
    Q8_0 (wo, LM head) weights, packed as the default model is, except layer 1's ``w2``,
    which stays float32 (a layer the GGUF left unquantised)."""
    torch.manual_seed(seed)
    args = dict(dim=64, n_layers=3, n_heads=4, n_kv_heads=2, hidden_dim=96, vocab_size=128)
    model = Transformer(ModelArgs(**{**args, **kw})).eval()
    with torch.no_grad():
        for i, (name, lin) in enumerate(n for n in model.named_modules() if isinstance(n[1], nn.Linear)):
            if not packed or name == "layers.1.feed_forward.w2":
                continue
            N, K = lin.weight.shape
            q8 = name.endswith(("wo", "output"))
            lin.weight.copy_(q8_0_weight(N, K, seed=i)[0] if q8 else q4_1_weight(N, K, seed=i)[0] * 4)
        for p in model.parameters():
            p.requires_grad_(False)
    if packed:
        stats = pack_model(model)
        assert stats["packed"] == {"q4_1": 8, "q8_0": 4} and stats["float32"] == 1
    return model


def decode(model, steps: int = 12, *, step_on: bool, monkeypatch, caches=None, num_layers=None,
           prompt=PROMPT):
    """Prefill ``prompt``, then ``steps`` greedy tokens one at a time: (logits [steps, V], caches)."""
    monkeypatch.setenv("KVTIER_DECODE_STEP", "1" if step_on else "0")
    caches = model.make_caches() if caches is None else caches
    out = []
    with torch.inference_mode():
        logits = model(torch.tensor(prompt), caches, last_only=True, num_layers=num_layers)
        for _ in range(steps):
            token = logits[0, -1].argmax().view(1, 1)
            logits = model(token, caches, num_layers=num_layers)
            assert logits.shape == (1, 1, model.args.vocab_size) and logits.dtype == torch.float32
            out.append(logits[0, -1].clone())
    return torch.stack(out), caches


def assert_same_decode(model, monkeypatch, **kw):
    want, want_caches = decode(model, step_on=False, monkeypatch=monkeypatch, **kw)
    got, got_caches = decode(model, step_on=True, monkeypatch=monkeypatch, **kw)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert torch.equal(got.argmax(-1), want.argmax(-1))
    for g, w in zip(got_caches, want_caches):
        assert g.offset == w.offset
        if not w.offset:  # a layer past num_layers
            assert g.keys is None
            continue
        for a, b in zip(g.fetch(), w.fetch()):
            # (float32 rounding: a key's error follows the size of the terms of its products, which
            # reach the largest keys, not its own size)
            torch.testing.assert_close(a, b, rtol=1e-4, atol=2e-6 * float(b.abs().max()))
        gs, ws = g.stats(), w.stats()
        for k in ("updates", "bytes", "grow_events", "capacity"):
            assert gs[k] == ws[k], k
    return got


@pytest.mark.parametrize("packed", [True, False], ids=["packed", "float32"])
def test_the_step_gives_the_layered_forwards_logits_tokens_and_caches(packed, monkeypatch):
    model = small_model(packed=packed)
    assert cpu_step.plan_for(model) is not None
    assert_same_decode(model, monkeypatch)


def test_the_step_grows_the_caches_across_their_capacity(monkeypatch):
    """Tail caches of step 4: the step itself grows them (9 prompt tokens, then 12 more)."""
    model = small_model()
    assert_same_decode(model, monkeypatch, caches=None)
    want, wc = decode(model, step_on=False, monkeypatch=monkeypatch,
                      caches=[TailOwnedKVCache(step=4) for _ in range(3)])
    got, gc = decode(model, step_on=True, monkeypatch=monkeypatch,
                     caches=[TailOwnedKVCache(step=4) for _ in range(3)])
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert [c.capacity for c in gc] == [24, 24, 24] and gc[0].stats()["grow_events"] == wc[0].stats()["grow_events"]


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("shape", [(64, 4, 2), (256, 4, 2), (128, 2, 2), (192, 3, 1), (256, 4, 1), (256, 2, 1)],
                         ids=["d16", "d64", "d64-g1", "d64-g3", "d64-g4", "d128"])
def test_long_contexts_split_each_kv_heads_keys_and_merge(monkeypatch, threads, shape):
    """600 keys: attention runs in splits of a KV head's keys (at least 64 each, 4 tasks a thread
    where the keys allow), each split's softmax parts merged; the vector exp's values too. Head
    dims of 64 and 128 take the one-token AVX2 loops (four keys' scores a pass, 64 keys' values
    a block, keys left over past a multiple of four); with AVX-512, a head dim of 64 weighs the
    values of a group of one to four query heads in one pass."""
    dim, heads, kv_heads = shape
    model = small_model(dim=dim, n_heads=heads, n_kv_heads=kv_heads)
    prompt = [torch.randint(0, 128, (600,), generator=torch.Generator().manual_seed(1)).tolist()]
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        assert_same_decode(model, monkeypatch, prompt=prompt, steps=4)
    finally:
        torch.set_num_threads(previous)


def test_qkv_bias_and_early_exit_take_the_step(monkeypatch):
    assert_same_decode(small_model(qkv_bias=True, arch="qwen2"), monkeypatch)
    assert_same_decode(small_model(), monkeypatch, num_layers=2)


def test_what_the_step_does_not_serve_takes_the_layered_forward(monkeypatch):
    model = small_model()
    step = cpu_step.plan_for(model)
    token = torch.tensor([[5]])
    with torch.inference_mode():
        ragged = [RaggedBatchKVCache(batch_size=1) for _ in range(3)]
        model(torch.tensor(PROMPT), ragged)
        assert step.run(token, ragged, 3) is None  # not the tail tier
        two_rows = model.make_caches(batch_size=2)
        model(torch.tensor(PROMPT * 2), two_rows)
        assert step.run(token, two_rows, 3) is None  # a cache of two rows
        before = [c.offset for c in two_rows]
        assert model(torch.tensor([[5], [6]]), two_rows).shape == (2, 1, 128)  # layered, two rows
        assert [c.offset for c in two_rows] == [b + 1 for b in before]
    assert cpu_step.plan_for(small_model(qk_norm=True, arch="qwen3")) is None  # q/k norms
    monkeypatch.setenv("KVTIER_DECODE_STEP", "0")
    assert cpu_step.plan_for(model) is None
    monkeypatch.setenv("KVTIER_DECODE_STEP", "1")
    monkeypatch.setenv("KVTIER_FUSED", "0")
    assert cpu_step.plan_for(model) is None


def test_a_token_out_of_range_raises_as_the_layered_forward_does_and_writes_nothing(monkeypatch):
    model = small_model()
    caches = model.make_caches()
    with torch.inference_mode():
        model(torch.tensor(PROMPT), caches)
        with pytest.raises(IndexError):
            model(torch.tensor([[128]]), caches)
    assert [c.offset for c in caches] == [len(PROMPT[0])] * 3


def test_the_plan_follows_replaced_modules_and_moved_tensors(monkeypatch):
    model = small_model()
    first = cpu_step.plan_for(model)
    assert cpu_step.plan_for(model) is first  # built once
    before = assert_same_decode(model, monkeypatch)
    with torch.no_grad():  # a new wo in layer 0: the plan must point at it
        old = model.layers[0].attention.wo
        model.layers[0].attention.wo = nn.Linear(old.in_features, old.out_features, bias=False)
        model.layers[0].attention.wo.weight.copy_(old.weight * 0.5)
    assert not isinstance(model.layers[0].attention.wo, PackedLinear)
    assert cpu_step.plan_for(model) is None  # a plain nn.Linear: not one the step runs
    from kvtier.model.linear import Linear

    with torch.no_grad():
        new = Linear(old.in_features, old.out_features, bias=False)
        new.weight.copy_(old.weight * 0.5)
        new.requires_grad_(False)
    model.layers[0].attention.wo = new
    assert cpu_step.plan_for(model) not in (None, first)
    changed = assert_same_decode(model, monkeypatch)
    assert not torch.allclose(changed, before)
    model.to(torch.float64).to(torch.float32)  # every tensor reallocated: the plan is dropped
    assert_same_decode(model, monkeypatch)


def test_a_replaced_parameter_rebuilds_the_plan(monkeypatch):
    """Parameters assigned through ``nn.Module`` (its registration hooks) are seen at once."""
    model = small_model()
    first = cpu_step.plan_for(model)
    assert cpu_step.plan_for(model) is first
    model.norm.weight = nn.Parameter(model.norm.weight.detach() * 1.5, requires_grad=False)
    assert cpu_step.plan_for(model) not in (None, first)
    assert_same_decode(model, monkeypatch, steps=3)


def test_new_rotary_frequencies_reach_the_plans_rotations(monkeypatch):
    """The plan keeps cos/sin rows; a rotary module recomputed for another base (a buffer
    assigned) drops them, and the step follows the layered forward."""
    model = small_model()
    before = assert_same_decode(model, monkeypatch, steps=3)
    model.rope.args = dataclasses.replace(model.rope.args, rope_theta=500.0)
    model.rope.reset()
    after = assert_same_decode(model, monkeypatch, steps=3)
    assert not torch.allclose(after, before)


def test_rotations_past_the_first_span_of_positions(monkeypatch):
    """The plan's cos/sin rows cover positions 1,024 at a time: a decode across position 1,024
    takes its rotations from the grown table."""
    model = small_model()
    prompt = [torch.randint(0, 128, (1018,), generator=torch.Generator().manual_seed(2)).tolist()]
    assert_same_decode(model, monkeypatch, prompt=prompt, steps=12)
    assert cpu_step.plan_for(model)._rope[0].shape[0] == 2048


def test_buffers_put_in_a_caches_place_are_checked_and_written(monkeypatch):
    """The plan skips the checks of buffers it checked before: copies put in their place are
    written at their own addresses, and float64 ones are refused with nothing changed."""
    model = small_model()
    token = torch.tensor([[5]])
    with torch.inference_mode():
        monkeypatch.setenv("KVTIER_DECODE_STEP", "0")
        want = model.make_caches()
        model(torch.tensor(PROMPT), want)
        model(token, want)
        model(token, want)
        monkeypatch.setenv("KVTIER_DECODE_STEP", "1")
        got = model.make_caches()
        model(torch.tensor(PROMPT), got)
        plan = cpu_step.plan_for(model)
        assert plan.run(token, got, 3) is not None
        for c in got:  # copies: the next step must write into them
            c.keys, c.values = c.keys.clone(), c.values.clone()
        assert plan.run(token, got, 3) is not None
        for g, w in zip(got, want):
            for a, b in zip(g.fetch(), w.fetch()):
                torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
        c = got[1]
        c.keys, c.values = c.keys.double(), c.values.double()
        offsets = [x.offset for x in got]
        assert plan.run(token, got, 3) is None
        assert [x.offset for x in got] == offsets


def test_gradients_keep_the_layered_forward(monkeypatch):
    model = small_model(packed=False)
    for p in model.parameters():
        p.requires_grad_(True)
    step = cpu_step.plan_for(model)
    caches = model.make_caches()
    model(torch.tensor(PROMPT), caches)
    assert step.run(torch.tensor([[5]]), caches, 3) is None  # would record no graph
    logits = model(torch.tensor([[5]]), caches)
    assert logits.requires_grad


@pytest.mark.parametrize("flags", [("-mno-avx512f",), ("-mno-avx2",)], ids=["avx2", "plain"])
def test_each_vector_path_of_the_step_gives_the_layered_forwards_logits(monkeypatch, flags):
    """The step built on purpose without AVX-512 and without AVX2 (a CPU with AVX-512 never runs
    those paths of the products and the exponential otherwise), against the layered forward."""
    import platform

    from kvtier.kernels.native import build_library
    from kvtier.model import step_kernels

    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("x86 vector flags")
    source = step_kernels.step_source()
    narrow = step_kernels.Kernels(build_library("cpu_step", source, flags))
    model = small_model()
    cpu_step.plan_for(model).kernels = narrow
    prompt = [torch.randint(0, 128, (200,), generator=torch.Generator().manual_seed(2)).tolist()]
    assert_same_decode(model, monkeypatch, prompt=prompt, steps=4)
    assert cpu_step.plan_for(model).kernels is narrow


def test_several_tokens_a_call_give_the_layered_forwards_logits(monkeypatch):
    """Up to MAX_TOKENS tokens of one sequence in one call (a speculative verification, a short
    prompt): every token's logits, causal among the new tokens, and ``last_only``; a longer input
    takes the layered forward."""
    model = small_model()
    g = torch.Generator().manual_seed(3)
    prompt = [torch.randint(0, 128, (40,), generator=g).tolist()]
    calls = [torch.randint(0, 128, (1, t), generator=g) for t in (2, 5, cpu_step.MAX_TOKENS, 3)]

    def run(step_on: bool):
        monkeypatch.setenv("KVTIER_DECODE_STEP", "1" if step_on else "0")
        caches = model.make_caches()
        with torch.inference_mode():
            model(torch.tensor(prompt), caches)  # 40 tokens: the layered forward either way
            out = [model(t, caches) for t in calls]
            out.append(model(calls[1], caches, last_only=True))
        return out, caches

    want, want_caches = run(False)
    got, got_caches = run(True)
    assert [tuple(x.shape) for x in got] == [(1, t.shape[1], 128) for t in calls] + [(1, 1, 128)]
    for g_, w_ in zip(got, want):
        torch.testing.assert_close(g_, w_, rtol=1e-4, atol=1e-4)
    for gc, wc in zip(got_caches, want_caches):
        assert gc.offset == wc.offset == 40 + 2 + 5 + cpu_step.MAX_TOKENS + 3 + 5
        torch.testing.assert_close(gc.fetch()[0], wc.fetch()[0], rtol=1e-4, atol=1e-5)
    step = cpu_step.plan_for(model)
    too_long = torch.zeros(1, cpu_step.MAX_TOKENS + 1, dtype=torch.long)
    with torch.inference_mode():
        assert step.run(too_long, got_caches, 3) is None


def test_two_threads_may_run_one_model_on_two_sequences(monkeypatch):
    """Each call works on its own copy of the plan and its own scratch, as the layered forward
    does: two threads decoding two sequences through one model get each sequence's own logits."""
    import threading

    model = small_model()
    g = torch.Generator().manual_seed(4)
    prompts = [[torch.randint(0, 128, (n,), generator=g).tolist()] for n in (30, 70)]
    want = [decode(model, 24, step_on=True, monkeypatch=monkeypatch, prompt=p)[0] for p in prompts]
    got, errors = [None, None], []

    def work(i):
        try:
            got[i] = decode(model, 24, step_on=True, monkeypatch=monkeypatch, prompt=prompts[i])[0]
        except Exception as e:  # noqa: BLE001 (reported below)
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors and all(not t.is_alive() for t in threads)
    for g_, w_ in zip(got, want):
        torch.testing.assert_close(g_, w_, rtol=1e-5, atol=1e-5)


def test_a_plan_does_not_keep_its_model_alive():
    import gc
    import weakref

    model = small_model()
    assert cpu_step.plan_for(model) is not None
    ref = weakref.ref(model)
    del model
    gc.collect()
    assert ref() is None


# -- float16 caches (TailOwnedKVCache(kv_dtype=torch.float16)) ---------------------------------------


def served_by_the_step(monkeypatch) -> list:
    """Counts the calls the one-call step served (a ``None`` from ``run`` is the layered forward's)."""
    served, run = [], cpu_step.DecodeStep.run

    def counting(self, *a, **kw):
        out = run(self, *a, **kw)
        served.append(out is not None)
        return out

    monkeypatch.setattr(cpu_step.DecodeStep, "run", counting)
    return served


def assert_same_half_decode(model, monkeypatch, kv_dtype=torch.float16, **kw):
    """The step over float16 caches against the layered forward over float16 caches: logits to
    float32 rounding; layer 0's stored keys and values bit for bit (both round the same float32
    keys to nearest even), later layers' within a float16 unit (their inputs differ by float32
    rounding); the same counters. Returns the logits."""
    def caches():
        return [TailOwnedKVCache(kv_dtype=kv_dtype) for _ in range(model.args.n_layers)]

    want, wc = decode(model, step_on=False, monkeypatch=monkeypatch, caches=caches(), **kw)
    served = served_by_the_step(monkeypatch)
    got, gc = decode(model, step_on=True, monkeypatch=monkeypatch, caches=caches(), **kw)
    assert len(served) > 1 and set(served[1:]) == {kv_dtype == torch.float16}  # (the decode steps)
    # (later layers' keys may sit one float16 unit apart, as below: 2^-8 at magnitude 4, which
    # moved a logit by up to 3.4e-3 where the products' float32 sums round otherwise, with the
    # AVX2 digits; with float32 caches the same two paths' logits are 1.3e-5 apart)
    torch.testing.assert_close(got, want, rtol=2e-3, atol=5e-3)
    assert torch.equal(got.argmax(-1), want.argmax(-1))
    for i, (g, w) in enumerate(zip(gc, wc)):
        assert g.keys.dtype == kv_dtype and g.offset == w.offset
        for a, b in zip(g.fetch(), w.fetch()):
            if i == 0:
                assert torch.equal(a, b)
            else:
                torch.testing.assert_close(a.float(), b.float(), rtol=2e-3, atol=2e-3)
        for k in ("updates", "bytes", "grow_events", "capacity"):
            assert g.stats()[k] == w.stats()[k], k
    return got


@pytest.mark.parametrize("shape", [(64, 4, 2), (256, 4, 2), (128, 2, 2), (192, 3, 1), (256, 4, 1), (256, 2, 1)],
                         ids=["d16", "d64", "d64-g1", "d64-g3", "d64-g4", "d128"])
def test_float16_caches_give_the_layered_forwards_logits(monkeypatch, shape):
    """Head dims 64 and 128 read the float16 rows in the one-token AVX2 loops (converted as they
    are loaded), 16 converts a split's rows first; 300 keys, several splits."""
    dim, heads, kv_heads = shape
    model = small_model(dim=dim, n_heads=heads, n_kv_heads=kv_heads)
    prompt = [torch.randint(0, 128, (300,), generator=torch.Generator().manual_seed(5)).tolist()]
    half = assert_same_half_decode(model, monkeypatch, prompt=prompt, steps=4)
    full, _ = decode(model, 4, step_on=True, monkeypatch=monkeypatch, prompt=prompt)
    assert 0 < (half - full).abs().max() < 5e-2  # float16 keys and values: near, not equal


@pytest.mark.parametrize("flags", [("-mno-avx512f",), ("-mno-avx2", "-mno-f16c")], ids=["avx2", "plain"])
def test_float16_caches_on_each_vector_path(monkeypatch, flags):
    """Without AVX2 and F16C the step converts with its own round-to-nearest-even code: layer 0's
    stored float16 keys and values equal torch's ``.to(float16)`` of the same float32 keys (the
    layered forward's products built with the same flags, so both compute the same keys)."""
    import platform

    from kvtier.kernels.native import build_library
    from kvtier.model import packed_kernels, step_kernels
    from kvtier.model.packed import PackedLinear

    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("x86 vector flags")
    source = step_kernels.step_source()
    narrow = step_kernels.Kernels(build_library("cpu_step", source, flags))
    products = packed_kernels.PackedKernels(build_library("packed", packed_kernels._C_SOURCE, flags))
    model = small_model(dim=256, n_heads=4, n_kv_heads=2)
    for module in model.modules():
        if isinstance(module, PackedLinear):
            module.kernels = products
    cpu_step.plan_for(model).kernels = narrow
    prompt = [torch.randint(0, 128, (150,), generator=torch.Generator().manual_seed(6)).tolist()]
    assert_same_half_decode(model, monkeypatch, prompt=prompt, steps=3)
    assert cpu_step.plan_for(model).kernels is narrow


@pytest.mark.parametrize("flags", [(), ("-mno-avx2", "-mno-f16c")], ids=["native", "plain"])
def test_the_steps_float16_rounding_is_torchs(flags):
    """Every float32 the step may store, rounded as torch's ``.to(float16)`` rounds it: ties to
    even, subnormal halves, overflow to infinity, signed zeros, infinities; NaN stays NaN. And
    every float16 read back as float32 as torch reads it."""
    import platform

    from kvtier.kernels.native import build_library
    from kvtier.model import step_kernels

    if flags and platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("x86 vector flags")
    source = step_kernels.step_source()
    kernels = step_kernels.Kernels(build_library("cpu_step", source, flags))
    g = torch.Generator().manual_seed(7)
    halves = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(torch.float16).float()
    finite = halves[torch.isfinite(halves)]
    ties = (finite.double() + torch.finfo(torch.float16).eps * finite.abs().double() / 2).float()  # some exact ties
    x = torch.cat([finite, ties, finite.nextafter(torch.tensor(float("inf"))),
                   finite.nextafter(torch.tensor(float("-inf"))), torch.randn(20000, generator=g) * 10.0 ** torch.randint(
                       -9, 6, (20000,), generator=g).float(),
                   torch.tensor([0.0, -0.0, 65504.0, 65519.99, 65520.0, 1e6, -1e6, float("inf"), float("-inf"),
                                 2.0**-24, 2.0**-25, 3 * 2.0**-26, 2.0**-26, -(2.0**-25)])])
    y = torch.empty(x.numel(), dtype=torch.int16)
    kernels.round_to_half(x.data_ptr(), y.data_ptr(), x.numel())
    assert torch.equal(y, x.to(torch.float16).view(torch.int16))
    nan = torch.tensor([float("nan")] * 4)
    kernels.round_to_half(nan.data_ptr(), y.data_ptr(), 4)
    assert torch.isnan(y[:4].view(torch.float16)).all()
    # and back: every float16 (subnormals, infinities, NaNs) read as torch reads it
    bits = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16)
    wide = torch.empty(bits.numel())
    kernels.widen_half(bits.data_ptr(), wide.data_ptr(), bits.numel())
    want = bits.view(torch.float16).float()
    assert torch.equal(torch.isnan(wide), torch.isnan(want))
    assert torch.equal(wide[~torch.isnan(want)], want[~torch.isnan(want)])


def test_float16_caches_in_calls_of_several_tokens(monkeypatch):
    model = small_model(dim=256, n_heads=4, n_kv_heads=2)
    served = served_by_the_step(monkeypatch)
    outs = []
    for step_on in (False, True):
        monkeypatch.setenv("KVTIER_DECODE_STEP", "1" if step_on else "0")
        caches = [TailOwnedKVCache(kv_dtype=torch.float16) for _ in range(3)]
        with torch.inference_mode():
            model(torch.tensor(PROMPT * 1), caches)
            outs.append([model(torch.tensor([[5, 9, 11, 2, 7]]), caches), model(torch.tensor([[1, 3]]), caches)])
    assert served[-2:] == [True, True]
    # the second call reads keys each path rounded to float16 from its own float32 keys (equal
    # to float32 rounding), so a key may sit one float16 unit apart: logits within 2e-3
    for g_, w_ in zip(outs[1], outs[0]):
        torch.testing.assert_close(g_, w_, rtol=2e-3, atol=2e-3)


def test_bfloat16_caches_take_the_layered_forward(monkeypatch):
    assert_same_half_decode(small_model(), monkeypatch, kv_dtype=torch.bfloat16, steps=3)
