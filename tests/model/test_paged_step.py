"""The one-call CPU decode step over paged caches (``DecodeStep.run_paged``, the serving
engine's CPU decode) against the layered forward.

Each test runs the same rows twice through :class:`~kvtier.serve.runner.ModelRunner`, once
with the step and once with ``KVTIER_DECODE_STEP=0`` (the layered forward over the same kind
of pages), and compares the logits, the greedy tokens and the pages. Only attention's
summation order (and, for float32 layers, the products') differs, so they agree to float32
rounding; over coded pages (``q8``, ``q4``, ``fp8``, ``q4_g32``, TurboQuant) a key or value a
rounding apart may take the next code, so there the codes agree within one step (a bit
stream's bytes all but one in a thousand) and the logits to a thousandth of their size.
"""

from __future__ import annotations

import pytest
import torch
from test_cpu_step import small_model

from kvtier.model import cpu_step
from kvtier.serve.runner import ModelRunner
from kvtier.serve.scheduler import ScheduledRow, StepBatch
from step_support import ON_X86, built_step, invariant_logits


@pytest.fixture(autouse=True)
def _needs_kernels():
    if cpu_step.load_kernels() is None:
        pytest.skip("no C compiler builds the decode step here")


def prompts(lens, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 128, (n,), generator=g).tolist() for n in lens]


def blocks_for(lens, steps, block_size):
    """Disjoint block lists, interleaved ids (row r's blocks are not consecutive), with room for
    ``steps`` more tokens."""
    need = [-(-(n + steps) // block_size) for n in lens]
    return [tuple(1 + r + len(lens) * i for i in range(k)) for r, k in enumerate(need)]


def decode(model, monkeypatch, lens, *, step_on: bool, steps: int = 6, block_size: int = 16, **runner_kw):
    """Prefill rows of ``lens`` prompt tokens (the layered forward), then ``steps`` greedy decode
    steps of every row together: (logits ``[steps, B, V]``, the runner)."""
    blocks = blocks_for(lens, steps, block_size)
    runner = ModelRunner(model, num_blocks=1 + len(lens) * max(map(len, blocks)), block_size=block_size,
                         **runner_kw)
    monkeypatch.setenv("KVTIER_DECODE_STEP", "1" if step_on else "0")
    last = []
    for r, (ids, bl) in enumerate(zip(prompts(lens), blocks)):
        last.append(int(runner.execute(StepBatch((ScheduledRow(f"r{r}", tuple(ids), 0, bl, True),)))[0].argmax()))
    out = []
    for s in range(steps):
        batch = StepBatch(tuple(ScheduledRow(f"r{r}", (last[r],), n + s, bl, True)
                                for r, (n, bl) in enumerate(zip(lens, blocks))))
        logits = runner.execute(batch)
        assert logits.shape == (len(lens), model.args.vocab_size)
        out.append(logits.clone())
        last = logits.argmax(-1).tolist()
    return torch.stack(out), runner


def assert_same(model, monkeypatch, lens, **kw):
    want, wr = decode(model, monkeypatch, lens, step_on=False, **kw)
    got, gr = decode(model, monkeypatch, lens, step_on=True, **kw)
    coded = kw.get("kv_quant") is not None or kw.get("turboquant") is not None
    tol = 1e-3 * float(want.abs().max()) if coded else 1e-4
    torch.testing.assert_close(got, want, rtol=1e-4, atol=tol)
    assert torch.equal(got.argmax(-1), want.argmax(-1))
    for g, w in zip(gr.caches, wr.caches):
        pairs = [(g.pool.key_cache, w.pool.key_cache), (g.pool.value_cache, w.pool.value_cache)]
        if not coded:
            for a, b in pairs:
                torch.testing.assert_close(a, b, rtol=1e-4, atol=2e-6 * float(b.abs().max()))
            continue
        for a, b in pairs:  # (four-bit codes two a byte, each within one of the other's; e4m3 bytes in order)
            assert (a != b).float().mean() < 1e-3
            if kw.get("turboquant") is None:  # (TurboQuant's bit streams: the bytes alone)
                a, b = a.to(torch.int16), b.to(torch.int16)
                if g.pool.key_cache.dtype == torch.uint8:
                    a, b = torch.stack([a & 15, a >> 4]), torch.stack([b & 15, b >> 4])
                assert int((a - b).abs().max()) <= 1
        for name in ("k_sidecars", "v_sidecars"):  # (q4_g32's float16 scales and zeros: an ulp apart at most)
            mine, theirs = getattr(g.pool, name), getattr(w.pool, name)
            assert mine.keys() == theirs.keys()
            for key in mine:
                torch.testing.assert_close(mine[key], theirs[key], rtol=1e-3 if mine[key].dtype == torch.float16
                                           else 1e-4, atol=0)
    return got


def counting(monkeypatch) -> list:
    """Record each ``run_paged`` call's result (``None``: it declined)."""
    calls, real = [], cpu_step.DecodeStep.run_paged

    def run_paged(self, *a, **kw):
        out = real(self, *a, **kw)
        calls.append(out)
        return out

    monkeypatch.setattr(cpu_step.DecodeStep, "run_paged", run_paged)
    return calls


@pytest.mark.parametrize(("packed", "kv_quant"),
                         [(True, None), (False, None), (True, "q8"), (True, "q4"), (True, "fp8")],
                         ids=["packed", "float32", "q8-pages", "q4-pages", "fp8-pages"])
def test_the_paged_step_gives_the_layered_forwards_logits_tokens_and_pages(packed, kv_quant, monkeypatch):
    """Rows of 9, 70, 1 and 33 prompt tokens over interleaved blocks of 16, six steps; float32
    pages, or ``q8``, ``q4`` and ``fp8`` codes with a scale a row (``fp8`` keys less their
    centre), which the step writes as the codec does and reads with their scales."""
    calls = counting(monkeypatch)
    assert_same(small_model(packed=packed), monkeypatch, [9, 70, 1, 33], kv_quant=kv_quant)
    # every decode step, and the one-token prompt (a row of one token is a decode row)
    assert len(calls) == 7 and all(c is not None for c in calls)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("shape", [(64, 4, 2), (256, 4, 2), (128, 2, 2), (192, 3, 1), (256, 4, 1), (256, 2, 1)],
                         ids=["d16", "d64", "d64-g1", "d64-g3", "d64-g4", "d128"])
def test_long_rows_split_their_keys_beside_short_ones(monkeypatch, threads, shape):
    """A row of 600 keys beside rows of 5 and 130: every row's keys in splits of the longest's
    (the short rows' later splits empty), merged per query head. Head dims 64 and 128 take the
    vector loops (with AVX-512, a head dim of 64 weighs a group of one to four heads' values in
    one pass), 16 the plain ones."""
    dim, heads, kv_heads = shape
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        assert_same(small_model(dim=dim, n_heads=heads, n_kv_heads=kv_heads), monkeypatch, [600, 5, 130], steps=2)
    finally:
        torch.set_num_threads(previous)


@pytest.mark.parametrize(("kv_quant", "shape"), [
    (kv, shape) for kv in ("q8", "q4", "fp8", "q4_g32")
    for shape in ((32, 4, 2) if kv == "q4_g32" else (16, 4, 2), (64, 3, 1), (128, 2, 1))],
    ids=lambda v: v if isinstance(v, str) else f"d{v[0]}")
def test_coded_pages_of_every_head_dim(monkeypatch, shape, kv_quant):
    """``q8``, ``q4``, ``fp8`` and ``q4_g32`` pages through each of the step's loops: the plain
    ones (head dim 16, 32 for ``q4_g32``'s groups), a group weighing its values in one pass
    (64, three query heads a KV head) and the 8-lane loops (128), a long row split beside short
    ones on two threads."""
    head_dim, heads, kv_heads = shape
    calls = counting(monkeypatch)
    previous = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        assert_same(small_model(dim=head_dim * heads, n_heads=heads, n_kv_heads=kv_heads), monkeypatch, [300, 5, 130],
                    steps=2, kv_quant=kv_quant)
    finally:
        torch.set_num_threads(previous)
    assert calls and all(c is not None for c in calls)


@pytest.mark.parametrize("codes", ["q8_0,q3_0", "q8_0r,q4_0", "q5_0r,q4_0", "q5_0r,q3_0", "q4_0,q2_0",
                                   "int2,q8_0"])
@pytest.mark.parametrize("shape", [(64, 3, 1), (128, 2, 1)], ids=["d64-g3", "d128"])
def test_turboquant_pages(monkeypatch, shape, codes):
    """TurboQuant pages: group-affine keys of 8, 5, 4 or 2 bits (a byte, bit-packed, ``q4_g32``'s
    layout), rotated or not (the step rotates the queries), and Lloyd-Max values of 3, 4, 2 or
    8 bits in the rotated domain (attention's output rotated back), written as the codecs write
    them; 8- and 5-bit keys with 3- or 4-bit values through the vector loops, the others
    converted a row at a time; a long row split beside short ones on two threads."""
    from kvtier.quant.modes import parse_turboquant

    head_dim, heads, kv_heads = shape
    calls = counting(monkeypatch)
    previous = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        assert_same(small_model(dim=head_dim * heads, n_heads=heads, n_kv_heads=kv_heads), monkeypatch,
                    [300, 5, 130], steps=2, turboquant=parse_turboquant(codes))
    finally:
        torch.set_num_threads(previous)
    assert calls and all(c is not None for c in calls)


@pytest.mark.parametrize("flags", [("-mno-avx512f",), ("-mno-avx2",)], ids=["avx2", "plain"])
def test_coded_pages_on_each_vector_path(monkeypatch, flags):
    """``q8``, ``q4``, ``fp8``, ``q4_g32`` and TurboQuant pages through the step built without AVX-512 (the 8-lane loops weigh
    the values) and without AVX2 (rows converted one at a time), head dims 64 and 128."""
    from kvtier.quant.modes import parse_turboquant

    if not ON_X86:
        pytest.skip("x86 vector flags")
    narrow = built_step(flags)
    calls = counting(monkeypatch)
    for dim, heads in ((192, 3), (256, 2)):
        model = small_model(dim=dim, n_heads=heads, n_kv_heads=1)
        cpu_step.plan_for(model).kernels = narrow
        for kv_quant in ("q8", "q4", "fp8", "q4_g32"):
            assert_same(model, monkeypatch, [150, 7], steps=2, kv_quant=kv_quant)
        for codes in ("q5_0r,q3_0", "q8_0,q4_0"):
            assert_same(model, monkeypatch, [150, 7], steps=2, turboquant=parse_turboquant(codes))
        assert cpu_step.plan_for(model).kernels is narrow
    assert calls and all(c is not None for c in calls)


@pytest.mark.parametrize("block_size", [1, 4, 32])
def test_block_sizes_of_a_power_of_two(block_size, monkeypatch):
    calls = counting(monkeypatch)
    assert_same(small_model(), monkeypatch, [9, 40], steps=3, block_size=block_size)
    assert calls and all(c is not None for c in calls)


def test_pages_the_step_does_not_read_take_the_layered_forward(monkeypatch):
    """Blocks of 12 tokens (not a power of two): the step declines, writing nothing, and the
    layered forward serves; so it does over fp8 pages until the first keys fixed their centre (a
    prompt of one token first)."""
    model = small_model()
    calls = counting(monkeypatch)
    decode(model, monkeypatch, [9, 20], step_on=True, steps=2, block_size=12)
    assert len(calls) == 2 and all(c is None for c in calls)
    calls.clear()
    decode(model, monkeypatch, [1, 20], step_on=True, steps=2, kv_quant="fp8")
    assert [c is None for c in calls] == [True, False, False]
    monkeypatch.setenv("KVTIER_DECODE_STEP", "0")
    assert cpu_step.plan_for(model) is None


def test_tokens_of_one_sequence_in_one_call_see_one_another():
    """Three tokens of one sequence and one of another in one call give the logits of feeding
    them a call at a time; ``select`` picks rows (a row may repeat)."""
    model = small_model()
    step = cpu_step.plan_for(model)
    lens, bs = [9, 20], 16
    blocks = blocks_for(lens, 4, bs)
    table = torch.tensor([list(b) + [0] * (4 - len(b)) for b in blocks], dtype=torch.int32)

    def fresh():
        runner = ModelRunner(model, num_blocks=12, block_size=bs)
        for r, (ids, bl) in enumerate(zip(prompts(lens), blocks)):
            runner.execute(StepBatch((ScheduledRow(f"r{r}", tuple(ids), 0, bl, True),)))
        return runner

    toks, rows, pos = [5, 77, 3, 40], [0, 0, 0, 1], [9, 10, 11, 20]
    with torch.inference_mode():
        together = fresh()
        got = step.run_paged(torch.tensor(toks), torch.tensor(pos), table[rows], together.caches)
        apart = fresh()
        want = torch.cat([step.run_paged(torch.tensor([t]), torch.tensor([p]), table[[r]], apart.caches)
                          for t, r, p in zip(toks, rows, pos)])
        picked = step.run_paged(torch.tensor(toks), torch.tensor(pos), table[rows], fresh().caches,
                                select=torch.tensor([3, 0, 0]))
        spread = step.run_paged(torch.tensor(toks), torch.tensor(pos), table[rows], fresh().caches,
                                select=torch.tensor([3, 0, 1, 2, 3, 1]))  # more rows than tokens
    assert got.shape == (4, 128)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(picked, got[[3, 0, 0]], rtol=0, atol=0)
    torch.testing.assert_close(spread, got[[3, 0, 1, 2, 3, 1]], rtol=0, atol=0)
    for a, b in zip(together.caches, apart.caches):
        torch.testing.assert_close(a.pool.key_cache, b.pool.key_cache)


def test_bad_input_raises_before_anything_is_written(monkeypatch):
    model = small_model()
    step = cpu_step.plan_for(model)
    monkeypatch.setenv("KVTIER_DECODE_STEP", "1")
    runner = ModelRunner(model, num_blocks=8, block_size=16)
    runner.execute(StepBatch((ScheduledRow("a", tuple(prompts([9])[0]), 0, (2,), True),)))
    before = [(c.pool.key_cache.clone(), c.pool.value_cache.clone()) for c in runner.caches]
    table = torch.tensor([[2, 0]], dtype=torch.int32)
    for toks, pos, tab, sel, match in (
        ([128], [9], table, None, r"token ids must lie in \[0, 128\), got 128\.\.128"),
        ([-1], [9], table, None, "token ids"),
        ([5], [32], table, None, r"positions must lie in \[0, 32\) \(2 table columns of 16 tokens\), got 32"),
        ([5], [-1], table, None, "positions must lie"),
        ([5], [9], torch.tensor([[9, 0]], dtype=torch.int32), None, r"block ids must lie in \[0, 9\), got 0\.\.9"),
        ([5], [9], table, torch.tensor([1]), r"select must name tokens of the 1 given \(indices in \[0, 1\)\)"),
        ([5], [9], table, torch.tensor([], dtype=torch.long), "select must name tokens"),
    ):
        with pytest.raises(ValueError, match=match):
            step.run_paged(torch.tensor(toks), torch.tensor(pos), tab, runner.caches, select=sel)
    with pytest.raises(ValueError, match="int32"):
        step.run_paged(torch.tensor([5]), torch.tensor([9]), table.long(), runner.caches)
    with pytest.raises(ValueError, match=r"rows \[0\] hold no block for position \[16\]"):
        runner.execute(StepBatch((ScheduledRow("a", (5,), 16, (2,), True),)))
    for c, (k, v) in zip(runner.caches, before):
        assert torch.equal(c.pool.key_cache, k) and torch.equal(c.pool.value_cache, v)


@pytest.mark.parametrize("rows", [1, 3], ids=["one-row", "three-rows"])
def test_drafted_rows_give_the_packed_forwards_logits(rows, monkeypatch):
    """A step of drafted rows (4 tokens, 3 of them drafts; 3 tokens, 2 drafts) and a decode row
    is one C call: the sampled logits and each drafted row's logits of its drafts and the
    position before them (``draft_logits``) of the layered packed forward."""
    model = small_model()
    lens, bs = [9, 40, 17][:rows], 16
    blocks = blocks_for(lens, 6, bs)
    fed = [((7, 50, 3, 9), 3), ((8, 2, 61), 2), ((5,), 0)][:rows]
    calls = counting(monkeypatch)

    def step(on: bool):
        monkeypatch.setenv("KVTIER_DECODE_STEP", "1" if on else "0")
        runner = ModelRunner(model, num_blocks=1 + len(lens) * max(map(len, blocks)), block_size=bs)
        for r, (ids, bl) in enumerate(zip(prompts(lens), blocks)):
            runner.execute(StepBatch((ScheduledRow(f"r{r}", tuple(ids), 0, bl, True),)))
        batch = StepBatch(tuple(ScheduledRow(f"r{r}", toks, n, bl, True, draft=d)
                                for r, ((toks, d), n, bl) in enumerate(zip(fed, lens, blocks))))
        return runner.execute(batch), runner.draft_logits

    want, want_drafts = step(False)
    got, got_drafts = step(True)
    assert len(calls) == 1 and calls[0] is not None  # (the prompts take the layered forward)
    assert got.shape == (rows, 128)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert sorted(got_drafts) == sorted(want_drafts) == [f"r{r}" for r in range(min(rows, 2))]
    for rid, w in want_drafts.items():
        assert got_drafts[rid].shape == w.shape == (fed[int(rid[1])][1] + 1, 128)
        torch.testing.assert_close(got_drafts[rid], w, rtol=1e-4, atol=1e-4)


def test_mostly_dense_weights_take_the_step_for_a_few_rows_only_without_avx512(monkeypatch):
    """Dense float32 weights: without AVX-512 the step's plain loops lose to oneDNN's matmuls from
    about ``DENSE_ROWS`` rows, so larger decode steps take the layered forward there (same logits);
    an AVX-512 build's row-block loops take up to ``DENSE_ROWS_AVX512``."""
    assert cpu_step.plan_for(small_model()).dense is False  # one float32 layer of twelve
    model = small_model(packed=False)
    step = cpu_step.plan_for(model)
    assert step.dense is True
    calls = counting(monkeypatch)
    few = [9, 3, 30, 17][: cpu_step.DENSE_ROWS]
    more = few + [5, 12, 40, 7, 21]
    native = step.kernels
    if native.lanes >= 16:
        assert step.takes_rows(cpu_step.DENSE_ROWS_AVX512) and not step.takes_rows(cpu_step.DENSE_ROWS_AVX512 + 1)
        assert_same(model, monkeypatch, more, steps=2)
        assert len(calls) == 2 and all(c is not None for c in calls)
        calls.clear()
    if not ON_X86:
        return
    step.kernels = built_step(("-mno-avx512f",))
    try:
        assert step.kernels.lanes < 16
        assert step.takes_rows(cpu_step.DENSE_ROWS) and not step.takes_rows(cpu_step.DENSE_ROWS + 1)
        assert_same(model, monkeypatch, few, steps=2)
        assert len(calls) == 2 and all(c is not None for c in calls)
        calls.clear()
        assert_same(model, monkeypatch, few + [5], steps=2)
        assert calls == []
    finally:
        step.kernels = native


def test_a_step_from_a_second_thread_gives_the_same_logits(monkeypatch):
    """The server runs steps in a thread of its own, after the main thread has run parallel
    regions (loading the model): the step's threads then meet at its own barrier, not libgomp's.
    Its logits are those of the same steps run in the main thread, bit for bit."""
    import threading

    model = small_model()
    want, _ = decode(model, monkeypatch, [9, 70, 33], step_on=True, steps=4)
    got = {}

    def run():
        got["logits"], _ = decode(model, monkeypatch, [9, 70, 33], step_on=True, steps=4)

    torch.ones(1 << 20).sum()  # (a parallel region of the main thread's own)
    worker = threading.Thread(target=run)
    worker.start()
    worker.join(timeout=120)
    assert not worker.is_alive()
    assert torch.equal(got["logits"], want)


@pytest.mark.parametrize("kv_quant", [None, "q8", "turboquant"])
def test_generate_on_the_paged_tier_decodes_in_one_call(monkeypatch, kv_quant):
    """``kvtier generate --tier paged``: each planned decode step of a batch of two rows of
    different lengths runs as one call (``run_planned``), the plan booked by every cache, with
    the layered forward's greedy tokens (float32 pages: all 24 steps; coded pages: the first 8,
    before a key a rounding apart takes the next code and the texts may part) and its lengths."""
    from itertools import islice

    from kvtier.config import KVCacheConfig
    from kvtier.generate import generate_step
    from kvtier.quant.modes import parse_mode

    q, tq = parse_mode(kv_quant or "fp")
    model = small_model(dim=128, n_heads=2, n_kv_heads=1)  # (head dim 64: TurboQuant serves)
    calls, real = [], cpu_step.DecodeStep.run_planned

    def run_planned(self, *a, **kw):
        calls.append(real(self, *a, **kw))
        return calls[-1]

    monkeypatch.setattr(cpu_step.DecodeStep, "run_planned", run_planned)
    rows = prompts([9, 30], seed=4)

    def tokens(step_on: bool):
        monkeypatch.setenv("KVTIER_DECODE_STEP", "1" if step_on else "0")
        caches = model.make_caches(KVCacheConfig(tier="paged", paged_num_blocks=16, paged_block_size=16,
                                                 kv_quant=q, turboquant=tq), batch_size=2)
        out = torch.stack(list(islice(generate_step(model, rows, caches, cuda_graph=False), 24))).T.tolist()
        return out, caches[0].lengths

    want, want_len = tokens(False)
    assert not calls
    got, got_len = tokens(True)
    assert len(calls) == 24 and all(c is not None for c in calls)
    keep = 24 if kv_quant is None else 8
    assert [g[:keep] for g in got] == [w[:keep] for w in want] and got_len == want_len == [9 + 23, 30 + 23]


@pytest.mark.parametrize("flags", [(), ("-mno-avx512f",)], ids=["native", "avx2"])
@pytest.mark.parametrize("shape", [(64, 3, 1), (64, 4, 1), (64, 2, 2), (128, 2, 1)], ids=["d64-g3", "d64-g4", "d64-g1",
                                                                                          "d128-g2"])
def test_a_run_of_one_sequences_tokens_attends_as_each_token_alone(shape, flags):
    """A call's tokens of one sequence at consecutive positions attend as a run (each key and value
    read once for up to 16 of them) and give, with ``invariant``, the very logits of a token a call:
    calls of 50 tokens beside 23 of another sequence, then its other 27, over 150 positions (two splits of 128
    keys), full-precision and coded pages, head dims 64 and 128, one to four query heads a KV head,
    with and without AVX-512 (the values two tokens at a time, or the 8-lane loop)."""
    from kvtier.quant.modes import TurboQuantConfig

    if flags and not ON_X86:
        pytest.skip("x86 vector flags")
    head_dim, heads, kv_heads = shape
    model = small_model(dim=head_dim * heads, n_heads=heads, n_kv_heads=kv_heads)
    step = cpu_step.plan_for(model)
    if flags:
        step.kernels = built_step(flags)
    a = model.args
    seqs = torch.randint(0, a.vocab_size, (2, 150), generator=torch.Generator().manual_seed(2))
    tables = torch.arange(20, dtype=torch.int32).view(2, 10)  # 10 blocks of 16 a sequence

    def run(calls, storage) -> dict:
        return invariant_logits(step, a, seqs, tables, calls, storage)

    for storage in ({}, {"kv_quant": "q8"}, {"kv_quant": "q4_g32"}, {"turboquant": TurboQuantConfig()}):
        alone = run([[(s, p, p + 1)] for p in range(150) for s in (0, 1)], storage)
        runs = run([call for lo in range(0, 150, 50) for call in ([(0, lo, lo + 50), (1, lo, lo + 23)],
                                                                    [(1, lo + 23, lo + 50)])], storage)
        assert alone.keys() == runs.keys()
        bad = [k for k in alone if not torch.equal(alone[k], runs[k])]
        assert not bad, f"{storage}: {len(bad)} of {len(alone)} positions differ, first {bad[:3]}"


@pytest.mark.parametrize("flags", [(), ("-mno-avx512f",)], ids=["native", "avx2"])
def test_dense_weights_give_each_token_alone_its_own_bits(flags):
    """Float32 projections (a model left unpacked): with ``invariant``, a token's logits are the same
    bits in a call of one token as in calls of 1 to 17 tokens of two sequences (the product's rows
    in blocks of one to four, outputs four at a time from eight rows, else one), with a hidden width
    that is not a multiple of 16 (the last block of a sum masked) and a vocabulary that is not one
    of 4 (the last task's outputs fewer); and within float32 rounding of the layered forward."""
    if flags and not ON_X86:
        pytest.skip("x86 vector flags")
    model = small_model(packed=False, hidden_dim=90, vocab_size=130)
    step = cpu_step.plan_for(model)
    assert step.dense
    if flags:
        step.kernels = built_step(flags)
    a = model.args
    seqs = torch.randint(0, a.vocab_size, (2, 40), generator=torch.Generator().manual_seed(3))
    tables = torch.arange(6, dtype=torch.int32).view(2, 3)  # 3 blocks of 16 a sequence
    alone = invariant_logits(step, a, seqs, tables, [[(s, p, p + 1)] for p in range(40) for s in (0, 1)], {})
    sizes = ((2, 1), (5, 5), (9, 8), (3, 3), (7, 6), (4, 5), (6, 6), (1, 2), (3, 4))  # each sequence's tokens a call
    calls, at = [], [0, 0]
    for n0, n1 in sizes:
        calls.append([(0, at[0], at[0] + n0), (1, at[1], at[1] + n1)])
        at = [at[0] + n0, at[1] + n1]
    rows = [n0 + n1 for n0, n1 in sizes]
    assert at == [40, 40] and {r % 4 for r in rows} == {0, 1, 2, 3} and max(rows) >= 8  # blocks of 1-4, wide
    together = invariant_logits(step, a, seqs, tables, calls, {})
    assert alone.keys() == together.keys()
    bad = [k for k in alone if not torch.equal(alone[k], together[k])]
    assert not bad, f"{len(bad)} of {len(alone)} positions differ, first {bad[:3]}"
    with torch.inference_mode():
        for s in (0, 1):
            layered = model(seqs[s][None], model.make_caches())[0]
            torch.testing.assert_close(torch.stack([alone[(s, p)] for p in range(40)]), layered,
                                       rtol=1e-4, atol=1e-4)
