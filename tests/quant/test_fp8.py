"""kvtier.quant.fp8: the e4m3 codec against a pure-Python e4m3 table.

References: every e4m3fn value decoded from its bits by the format's definition
(sign, 4-bit exponent of bias 7, 3-bit mantissa, subnormals at exponent 0, no
infinities, 0x7F/0xFF NaN), and round-to-nearest-even onto that table.
"""

from __future__ import annotations

import math

import pytest
import torch

from kvtier.caches.paged_codecs import select_codecs
from kvtier.quant import CodecUnsupported, Fp8Codec, codec_for_mode, fp8, make_codecs, parse_mode

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def e4m3_value(bits: int) -> float:
    """The value of an e4m3fn byte by the format's definition (NaN for 0x7F and 0xFF)."""
    sign = -1.0 if bits & 0x80 else 1.0
    e, m = (bits >> 3) & 0xF, bits & 7
    if e == 0xF and m == 7:
        return math.nan
    if e == 0:
        return sign * m / 8 * 2.0**-6
    return sign * (1 + m / 8) * 2.0 ** (e - 7)


FINITE = sorted({e4m3_value(b) for b in range(256) if not math.isnan(e4m3_value(b))})


def nearest_even(y: float) -> float:
    """Round ``y`` (|y| <= 448) to the nearest e4m3 value, ties to the even mantissa."""
    i = min(range(len(FINITE)), key=lambda k: abs(FINITE[k] - y))
    best = FINITE[i]
    for j in (i - 1, i + 1):
        if 0 <= j < len(FINITE) and abs(FINITE[j] - y) == abs(best - y):
            # a tie: keep the value whose code has an even mantissa (bit 0 clear)
            code = torch.tensor(FINITE[j]).to(torch.float8_e4m3fn).view(torch.uint8).item()
            if code & 1 == 0:
                best = FINITE[j]
    return best


def test_table_is_the_format():
    codes = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    for b in range(256):
        want = e4m3_value(b)
        assert (math.isnan(want) and math.isnan(codes[b])) or codes[b].item() == want
    assert max(FINITE) == fp8.FP8_MAX and len(FINITE) == 253  # +-0 are one value


def test_hand_computed():
    codec = Fp8Codec(4, torch.float32)
    x = torch.tensor([[[448.0, -224.0, 1.0, 0.0]], [[0.0, 0.0, 0.0, 0.0]]])  # (2, 1, 4)
    payload, side = codec.encode(x)
    assert payload.dtype == torch.uint8 and payload.shape == (2, 1, 4)
    assert side["scale"].dtype == torch.float32 and side["scale"].shape == (2, 1, 1)
    assert side["scale"][0, 0, 0] == 1.0 and side["scale"][1, 0, 0] == 0.0
    assert payload[0, 0].tolist() == [0x7E, 0xF6, 0x38, 0x00]  # e4m3 bits: 1.75 * 2^8, -1.75 * 2^7, 1, 0
    assert payload[1].eq(0).all()  # a zero vector codes as +0
    assert torch.equal(codec.decode(payload, side), x)


@pytest.mark.parametrize("dim", [16, 64, 128])
def test_codes_are_nearest_even_of_the_scaled_vector(dim):
    codec = Fp8Codec(dim, torch.float32)
    x = torch.randn(40, 2, dim) * torch.logspace(-3, 2, 40).reshape(40, 1, 1)
    payload, side = codec.encode(x)
    scale = x.abs().amax(-1, keepdim=True) / torch.tensor(448.0)
    assert torch.equal(side["scale"], scale)
    y = (x / scale).flatten().tolist()
    want = torch.tensor([nearest_even(v) for v in y])
    assert torch.equal(payload.view(torch.float8_e4m3fn).float().flatten(), want)


def test_error_bounds():
    codec = Fp8Codec(128, torch.float32)
    x = torch.randn(4096, 2, 128)
    x_hat = codec.roundtrip(x)
    scale = x.abs().amax(-1, keepdim=True) / 448
    # three mantissa bits: half an ulp is 2^-4 of the value, and 2^-10 of the scale below 2^-6
    assert ((x_hat - x).abs() <= x.abs() * 2.0**-4 + scale * 2.0**-10 + 1e-12).all()
    rel = float((x_hat - x).square().sum() / x.square().sum())
    assert 3e-4 < rel < 1e-3  # 6.6e-4 measured: 3 mantissa bits, relative error up to 2^-4
    # outlier channels cost e4m3 nothing where q8 loses the small ones
    x[..., 5] *= 30
    rel_out = float((codec.roundtrip(x) - x).square().sum() / x.square().sum())
    q8 = codec_for_mode("q8", 128, torch.float32)[0]
    assert rel_out < 1e-4 < float((q8.roundtrip(x) - x).square().sum() / x.square().sum())


def test_dtypes_leading_dims_and_bits():
    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        codec = Fp8Codec(64, dtype)
        x = torch.randn(3, 5, 2, 64).to(dtype)
        out = codec.roundtrip(x)
        assert out.dtype == dtype and out.shape == x.shape
    assert Fp8Codec(128, torch.bfloat16).bits_per_element() == 8.25
    assert Fp8Codec(128, torch.bfloat16).bytes_per_token_head() == 132


def test_bad_input_names_the_fix():
    codec = Fp8Codec(64, torch.float32)
    with pytest.raises(ValueError, match="floating tensor"):
        codec.encode(torch.ones(2, 64, dtype=torch.int32))
    with pytest.raises(ValueError, match="head_dim 64"):
        codec.encode(torch.ones(2, 32))
    payload, side = codec.encode(torch.randn(2, 64))
    with pytest.raises(ValueError, match="uint8"):
        codec.decode(payload.view(torch.int8), side)
    with pytest.raises(ValueError, match="sidecars"):
        codec.decode(payload, {})


def test_mode_names_and_make_codecs():
    assert parse_mode("FP8") == ("fp8", None)
    k, v = make_codecs(64, torch.bfloat16, kv_quant="fp8")
    assert isinstance(k, Fp8Codec) and isinstance(v, Fp8Codec)
    assert codec_for_mode("fp8", 64, torch.float16)[0].name == "fp8"


def test_without_float8_the_paged_tier_stores_full_precision(monkeypatch):
    monkeypatch.setattr(fp8, "FP8_DTYPE", None)
    with pytest.raises(CodecUnsupported, match="float8_e4m3fn"):
        Fp8Codec(64, torch.bfloat16)
    choice = select_codecs(64, torch.bfloat16, "fp8")
    assert choice.mode == "fp" and "float8_e4m3fn" in choice.kv_quant_disabled_reason


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("centred", [False, True])
def test_cuda_matches_cpu(centred):
    codec = Fp8Codec(128, torch.bfloat16)
    x = (torch.randn(1000, 4, 128) + 4 * torch.randn(4, 128)).to(torch.bfloat16)
    if centred:
        codec.set_centre(x.transpose(0, 1)[None])  # (1, H, N, D)
    p_cpu, s_cpu = codec.encode(x)
    p_gpu, s_gpu = codec.encode(x.cuda())
    assert torch.equal(p_gpu.cpu(), p_cpu)
    assert torch.equal(s_gpu["scale"].cpu(), s_cpu["scale"])
    assert torch.equal(codec.decode(p_gpu, s_gpu).cpu(), codec.decode(p_cpu, s_cpu))


# -- the key centre -----------------------------------------------------------------------------
def offset_keys(seed: int = 0) -> torch.Tensor:
    """Keys ``[B=2, H=3, T=40, D=64]`` whose channels carry offsets shared by every token, as
    a model's key channels do."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(2, 3, 40, 64, generator=g) + 6 * torch.randn(1, 3, 1, 64, generator=g)


def test_centred_keys_round_trip_closer_than_plain_codes():
    keys = offset_keys()
    x = keys.transpose(1, 2).reshape(-1, 3, 64)  # (N, H, D), as the paged tier encodes
    plain, centred = Fp8Codec(64, torch.float32), Fp8Codec(64, torch.float32)
    centred.set_centre(keys)
    torch.testing.assert_close(centred.centre, keys.mean(dim=(0, 2)))
    err_plain = (plain.roundtrip(x) - x).norm()
    err_centred = (centred.roundtrip(x) - x).norm()  # decode adds the centre back
    assert err_centred < 0.5 * err_plain
    payload, side = centred.encode(x)
    torch.testing.assert_close(payload, plain.encode(x - centred.centre)[0], rtol=0, atol=0)


def test_centre_is_set_once_and_needs_the_head_layout():
    codec = Fp8Codec(64, torch.float32)
    with pytest.raises(ValueError, match=r"keys \[B, H, T, 64\]"):
        codec.set_centre(torch.zeros(3, 40, 64))
    codec.set_centre(offset_keys())
    with pytest.raises(ValueError, match="already set"):
        codec.set_centre(offset_keys(1))
    with pytest.raises(ValueError, match=r"\[\.\.\., 3, D\] vectors"):
        codec.encode(torch.zeros(5, 64))  # no head dim to match the centre
    assert not make_codecs(64, torch.float32, kv_quant="q8")[0].centres_keys  # only fp8 centres
