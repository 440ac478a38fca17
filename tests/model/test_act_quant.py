"""Int8 activations in the CPU decode step (kvtier.model.act_quant, ``KVTIER_ACT_QUANT=q8``).

The quantiser against its PyTorch twin (codes and scales equal), the int8 products against the
same arithmetic in float64 (equal up to float32 summation order) and against the exact products
(an approximation of them), each vector path, and the step with the mode on: close to the
exact step, the caches written the same way, the mode chosen per model or by the environment,
a bad mode refused before anything is written.
"""

from __future__ import annotations

import platform

import pytest
import torch
from test_cpu_step import PROMPT, decode, small_model
from test_packed import q4_1_weight, q8_0_weight

from kvtier.model import act_quant, cpu_step, step_kernels
from kvtier.model.packed import PackedLinear, pack_model, recover_q4_1, recover_q8_0


@pytest.fixture(autouse=True)
def _needs_kernels():
    if cpu_step.load_kernels() is None:
        pytest.skip("no C compiler builds the decode step here")


def builds():
    """The native library, and on x86 the AVX2-only and plain-C builds of the same source."""
    out = [("native", cpu_step.load_kernels())]
    if platform.machine() in ("x86_64", "AMD64"):
        from kvtier.kernels.native import build_library

        for name, flags in (("avx2", ("-mno-avx512f",)), ("plain", ("-mno-avx2", "-mno-f16c"))):
            out.append((name, step_kernels.Kernels(build_library("cpu_step", step_kernels.step_source(), flags))))
    return out


BUILDS = builds()


def quantize(kernels, x: torch.Tensor, *, pairs: bool = False):
    M, K = x.shape
    q = torch.empty(M, K, dtype=torch.int8)
    dx, sx = torch.empty(M, K // 32), torch.empty(M, K // 32)
    kernels.quantize_rows_q8(x.data_ptr(), q.data_ptr(), dx.data_ptr(), sx.data_ptr(), M, K, int(pairs))
    return q, dx, sx


def activations(M: int, K: int, seed: int = 0) -> torch.Tensor:
    """Random rows with the awkward blocks: all zeros, one value, exact halves of a code step,
    large and tiny magnitudes."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=g) * torch.logspace(-3, 2, M)[:, None]
    x[0, :32] = 0.0
    if K >= 96:
        x[0, 32:64] = 0.0
        x[0, 40] = -3.0
        x[0, 64:96] = torch.arange(32) + 0.5  # a scale of exactly 1, codes at exact halves: ties
        x[0, 64] = 127.0
    return x


@pytest.mark.parametrize("name,kernels", BUILDS, ids=[b[0] for b in BUILDS])
def test_the_quantiser_gives_the_reference_codes_and_scales(name, kernels):
    x = activations(5, 576)
    q, dx, sx = quantize(kernels, x)
    want_q, want_dx, want_sx = act_quant.quantize_rows_reference(x)
    assert torch.equal(q, want_q)
    assert torch.equal(dx, want_dx) and torch.equal(sx, want_sx)
    assert torch.equal(q[0, :32], torch.zeros(32, dtype=torch.int8)) and dx[0, 0] == 0
    assert q.abs().max() == 127
    # the rounding error of a block is at most half a code step
    back = q.float().reshape(5, -1, 32) * dx[..., None]
    assert ((back - x.reshape(5, -1, 32)).abs() <= dx[..., None] / 2 * (1 + 1e-5)).all()


@pytest.mark.parametrize("name,kernels", BUILDS, ids=[b[0] for b in BUILDS])
@pytest.mark.parametrize("K", [64, 96, 576, 288])
def test_the_pair_layout_for_q4_1_products(name, kernels, K):
    """Blocks 2p and 2p + 1 share 64 bytes (low halves, then high halves); an odd last block
    stays in order; the scales do not move."""
    x = activations(3, K, seed=K)
    q, dx, sx = quantize(kernels, x, pairs=True)
    want_q, want_dx, want_sx = act_quant.quantize_rows_reference(x)
    assert torch.equal(q, act_quant.pair_layout(want_q))
    assert torch.equal(dx, want_dx) and torch.equal(sx, want_sx)
    row = torch.arange(K, dtype=torch.int8 if K <= 127 else torch.int16).view(1, K)
    laid = act_quant.pair_layout(row)[0].tolist()
    assert laid[:64] == [*range(0, 16), *range(32, 48), *range(16, 32), *range(48, 64)]
    if (K // 32) % 2:
        assert laid[-32:] == list(range(K - 32, K))


def _q4_1(kernels, x, N, K, seed):
    w = q4_1_weight(N, K, seed=seed)[0]
    codes, d, m = recover_q4_1(w)
    q, dx, sx = quantize(kernels, x, pairs=True)
    y = torch.empty(x.shape[0], N)
    kernels.q4_1_q8_gemv(q.data_ptr(), dx.data_ptr(), sx.data_ptr(), codes.data_ptr(), d.data_ptr(),
                         m.data_ptr(), y.data_ptr(), x.shape[0], N, K, 2)
    return w, y


def _q8_0(kernels, x, N, K, seed):
    w = q8_0_weight(N, K, seed=seed)[0]
    codes, d = recover_q8_0(w)
    q, dx, _ = quantize(kernels, x)
    y = torch.empty(x.shape[0], N)
    kernels.q8_0_q8_gemv(q.data_ptr(), dx.data_ptr(), codes.data_ptr(), d.data_ptr(), y.data_ptr(),
                         x.shape[0], N, K, 2)
    return w, y


@pytest.mark.parametrize("name,kernels", BUILDS, ids=[b[0] for b in BUILDS])
@pytest.mark.parametrize("fmt", ["q4_1", "q8_0"])
@pytest.mark.parametrize("M,N,K", [(1, 64, 64), (1, 97, 576), (1, 8, 288), (3, 40, 1536), (5, 33, 96),
                                   (16, 18, 256)])
def test_int8_products_are_the_quantised_activations_times_the_exact_weights(name, kernels, fmt, M, N, K):
    x = activations(M, K, seed=M + N)
    w, y = (_q4_1 if fmt == "q4_1" else _q8_0)(kernels, x, N, K, seed=N)
    want = act_quant.reference_product(x, w)  # float64
    scale = (x.abs().double() @ w.abs().double().T).clamp_min(1e-30)  # the size of the terms summed
    assert ((y.double() - want).abs() / scale).max() < 1e-5
    exact = x.double() @ w.double().T
    rel = (y.double() - exact).norm() / exact.norm()
    assert 1e-6 < rel < 2e-2, rel  # an approximation, and a close one


#: a prompt longer than the step's MAX_TOKENS: its prefill takes the layered forward
LONG_PROMPT = [torch.randint(0, 128, (40,), generator=torch.Generator().manual_seed(5)).tolist()]


def forced(model, tokens, monkeypatch, *, step_on: bool = True):
    """Logits [len(tokens), V] of ``tokens`` fed one at a time after LONG_PROMPT (through the step,
    or the layered forward)."""
    monkeypatch.setenv("KVTIER_DECODE_STEP", "1" if step_on else "0")
    caches = model.make_caches()
    with torch.inference_mode():
        model(torch.tensor(LONG_PROMPT), caches)
        out = torch.cat([model(torch.tensor([[t]]), caches)[0] for t in tokens])
    return out, caches


def packed_model(q8_0: tuple[str, ...], **shape) -> torch.nn.Module:
    """small_model's three layers with every projection exact Q4_1 but those whose names end with
    ``q8_0`` (Q8_0), all packed."""
    model = small_model(packed=False, **shape)
    with torch.no_grad():
        for i, (name, lin) in enumerate(n for n in model.named_modules() if isinstance(n[1], torch.nn.Linear)):
            N, K = lin.weight.shape
            fmt_q8 = name.endswith(q8_0)
            lin.weight.copy_(q8_0_weight(N, K, seed=i)[0] if fmt_q8 else q4_1_weight(N, K, seed=i)[0] * 4)
    stats = pack_model(model)
    assert stats["float32"] == 0
    return model


IN_PLACE = dict(dim=128, n_heads=2, n_kv_heads=1, hidden_dim=512)
#: models: head dim 16 and hidden 96 (wo's and w2's inputs quantised on their own, a float32
#: w2 in layer 1); head dim 64 and hidden 512 (quantised where the merge and the SiLU write
#: them: in pairs of blocks for Q4_1's wo and w2, in order for a Q8_0 wo)
MODELS = {
    "apart": lambda: small_model(),
    "in_place_q4_1": lambda: packed_model(("output",), **IN_PLACE),
    "in_place_q8_0_wo": lambda: packed_model(("wo", "output"), **IN_PLACE),
}


@pytest.mark.parametrize("make", MODELS.values(), ids=MODELS.keys())
def test_the_step_with_int8_activations_is_the_model_with_rounded_activations(monkeypatch, make):
    """The step with ``q8`` gives the layered forward's logits when every packed product's input
    is rounded as the reference quantiser rounds it (float32 summation order apart), and stays
    near the exact step's."""
    model = make()
    monkeypatch.delenv(act_quant.ENV_VAR, raising=False)
    tokens = torch.randint(0, 128, (24,), generator=torch.Generator().manual_seed(4)).tolist()
    exact, exact_caches = forced(model, tokens, monkeypatch)
    model.act_quant = "q8"
    got, got_caches = forced(model, tokens, monkeypatch)

    exact_forward = PackedLinear.forward

    def rounded_input(self, x):  # (the decode steps' rows; the 40-token prefill stays exact)
        rows = x.reshape(-1, self.in_features)
        if rows.shape[0] > cpu_step.MAX_TOKENS:
            return exact_forward(self, x)
        q, dx, _ = act_quant.quantize_rows_reference(rows)
        back = (q.float().reshape(rows.shape[0], -1, 32) * dx[..., None]).reshape(x.shape)
        return exact_forward(self, back)

    monkeypatch.setattr(PackedLinear, "forward", rounded_input)
    want, want_caches = forced(model, tokens, monkeypatch, step_on=False)
    # The two forwards differ in attention's float32 summation order, so an activation that lies
    # within rounding of a code boundary can take the neighbouring code in one of them: a step
    # with such a flip moves by about 1e-3; every other step agrees to float32 rounding.
    rel = ((got - want).norm(dim=-1) / want.norm(dim=-1)).tolist()
    assert sum(r < 1e-5 for r in rel) >= 0.9 * len(rel) and max(rel) < 2e-2, rel
    n = len(LONG_PROMPT[0])
    for g, w, e in zip(got_caches, want_caches, exact_caches):
        assert g.offset == w.offset == e.offset == n + len(tokens)
        assert torch.equal(g.fetch()[0][:, :, :n], e.fetch()[0][:, :, :n])  # a long prefill: exact
        assert torch.equal(w.fetch()[0][:, :, :n], e.fetch()[0][:, :, :n])
    # an approximation of the exact step: most logits within a few percent (this small random
    # model amplifies some rows' rounding more than a trained one does), most argmaxes kept
    assert not torch.equal(got, exact)
    rel = (got - exact).norm(dim=-1) / exact.norm(dim=-1)
    assert rel.median() < 0.03, rel
    assert (got.argmax(-1) == exact.argmax(-1)).float().mean() >= 0.75


@pytest.mark.parametrize("make", MODELS.values(), ids=MODELS.keys())
def test_several_tokens_a_call_with_int8_activations(monkeypatch, make):
    """A call of several tokens (a verification) quantises each row on its own: the same logits
    as one token a call, up to float32 summation order."""
    model = make()
    model.act_quant = "q8"
    monkeypatch.setenv("KVTIER_DECODE_STEP", "1")
    tokens = [11, 29, 3, 77, 64]
    with torch.inference_mode():
        one = model.make_caches()
        model(torch.tensor(PROMPT), one)
        singles = torch.cat([model(torch.tensor([[t]]), one)[0] for t in tokens])
        many = model.make_caches()
        model(torch.tensor(PROMPT), many)
        together = model(torch.tensor([tokens]), many)[0]
    torch.testing.assert_close(together, singles, rtol=1e-4, atol=1e-4)


def test_the_mode_comes_from_the_model_else_the_environment(monkeypatch):
    model = small_model()
    monkeypatch.setenv(act_quant.ENV_VAR, "q8")
    assert act_quant.act_quant_of(model) == "q8"
    model.act_quant = "none"  # the model's own setting wins
    assert act_quant.act_quant_of(model) == "none"
    model.act_quant = None
    monkeypatch.setenv(act_quant.ENV_VAR, " Q8 ")
    assert act_quant.act_quant_of(model) == "q8"
    monkeypatch.setenv(act_quant.ENV_VAR, "")
    assert act_quant.act_quant_of(model) == "none"
    exact, _ = decode(model, steps=3, step_on=True, monkeypatch=monkeypatch)  # (the environment: off)
    monkeypatch.setenv(act_quant.ENV_VAR, "q8")
    model.act_quant = None
    q8, _ = decode(model, steps=3, step_on=True, monkeypatch=monkeypatch)
    assert not torch.equal(exact, q8)  # (the environment: q8)


def test_a_bad_mode_is_refused_before_anything_is_written(monkeypatch):
    model = small_model()
    monkeypatch.setenv("KVTIER_DECODE_STEP", "1")
    caches = model.make_caches()
    with torch.inference_mode():
        model(torch.tensor(PROMPT), caches)
    before = [c.fetch()[0].clone() for c in caches]
    monkeypatch.setenv(act_quant.ENV_VAR, "int4")
    with pytest.raises(ValueError, match=r"KVTIER_ACT_QUANT='int4' is unknown; accepted: none, q8"), \
            torch.inference_mode():
        model(torch.tensor([[5]]), caches)
    assert all(c.offset == len(PROMPT[0]) for c in caches)
    assert all(torch.equal(c.fetch()[0], b) for c, b in zip(caches, before))
    with pytest.raises(ValueError, match="act_quant='fp8' is unknown"):
        act_quant.parse_act_quant("fp8")


def test_float32_weights_keep_the_exact_products(monkeypatch):
    """A model whose projections are float32 (nothing packed) computes the same logits with the
    mode on: only packed products take int8 activations."""
    model = small_model(packed=False)
    monkeypatch.delenv(act_quant.ENV_VAR, raising=False)
    want, _ = decode(model, steps=4, step_on=True, monkeypatch=monkeypatch)
    model.act_quant = "q8"
    got, _ = decode(model, steps=4, step_on=True, monkeypatch=monkeypatch)
    assert torch.equal(got, want)

