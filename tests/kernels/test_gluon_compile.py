"""The Gluon decode kernel compiled for the GPUs it serves, on a machine without one
(``benchmarks/tools/gluon_offline.py``, in a fresh process: the tests here run Triton's
interpreter, which compiles nothing). Every page kind's default launch must assemble for
sm_90 at head_dim 64 and 128 within its register cap and a multiprocessor's shared memory,
and for sm_80 all but fp8, which ``gluon_decode.supported`` refuses there. The kernel's
results on a GPU: ``test_gluon_decode.py``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TOOL = ROOT / "benchmarks" / "tools" / "gluon_offline.py"
#: shared memory a block may take on sm_80 and sm_90 (227 KB)
SHARED_LIMIT = 232_448


def _compile(arch: int, head_dims: str, *more: str) -> list[dict]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), env.get("PYTHONPATH", "")])
    r = subprocess.run([sys.executable, str(TOOL), "--json", "--arch", str(arch), "--head-dims", head_dims, *more],
                       env=env, capture_output=True, text=True, timeout=600)
    if r.returncode == 3:
        pytest.skip(r.stderr.strip())
    assert r.returncode in (0, 1), r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])  # (Triton prints a failed assembly's PTX before it)


@pytest.fixture(scope="module")
def sm90():
    return _compile(90, "64,128")


def test_every_kind_assembles_for_sm90_within_its_caps(sm90):
    from kvtier.kernels.gluon_decode import KINDS
    from kvtier.kernels.gluon_plan import MAXNREG_BY_KIND, SWAPPED

    assert sorted((r["kind"], r["head_dim"]) for r in sm90) == sorted((k, d) for k in KINDS for d in (64, 128))
    for r in sm90:
        assert "error" not in r, r
        cap = SWAPPED[r["kind"]][0] if r["swap"] else MAXNREG_BY_KIND.get(r["kind"], 255)
        assert 0 < r["registers"] <= cap, r
        assert r["shared"] <= SHARED_LIMIT, r
        assert r["loop"] > 0, r


def test_sm80_assembles_every_kind_but_fp8():
    from kvtier.kernels.gluon_decode import KINDS

    rows = {r["kind"]: r for r in _compile(80, "128")}
    assert sorted(rows) == sorted(KINDS)
    for kind, r in rows.items():
        assert ("error" in r) == (kind == "fp8"), r


def test_stacked_q4_g32_weighs_values_in_fp16_pairs(sm90):
    """Stacked q4_g32 (head_dim 128, raw codes) puts the values' scales and zeros on the
    probabilities in fp16, two keys an instruction (``HMUL2``; ``gluon_codes.stacked_group_scales``),
    and converts only the keys' scales and zeros to float32: a thread's 8 keys of 2 groups, a
    scale and a zero each (before: 64 conversions a tile, no ``HMUL2``)."""
    r = next(r for r in sm90 if r["kind"] == "q4_g32" and r["head_dim"] == 128)
    ops = r["loop_ops"]
    assert sum(ops.values()) == r["loop"], r
    assert ops.get("HMUL2", 0) >= 16, ops
    assert ops.get("HADD2.F32", 0) <= 32, ops


@pytest.mark.parametrize("kind", ["q4", "q4_g32", "tq"])
def test_the_swapped_kernel_takes_half_the_tensor_core_steps_in_fewer_registers(sm90, kind):
    """q4, q4_g32 and TurboQuant on the kernels of swapped roles (``gluon_swap``): the dots' 16
    rows are keys and channels, not a kv head's 4 query rows padded to 16, so a tile takes half
    the tensor-core instructions (the decode kernel's q4 adds two for its probabilities' sums;
    the swapped q4_g32 two for each half's zeros a 16 keys) in fewer registers. TurboQuant's
    default launch (here, 512 pairs) is the swapped one, within its cap."""
    swapped = _compile(90, "64,128", "--kinds", kind, "--swap", "on")
    unswapped = _compile(90, "64,128", "--kinds", kind, "--swap", "off")
    for r, base in zip(swapped, unswapped, strict=True):
        assert "error" not in r and "error" not in base and r["swap"] and not base["swap"], (r, base)

        def hmma(x):
            return sum(n for op, n in x["loop_ops"].items() if op.startswith("HMMA"))

        extra = 8 if kind == "q4_g32" else 2
        assert 2 * hmma(r) <= hmma(base) + extra and hmma(r) > 0, (r["loop_ops"], base["loop_ops"])
        assert r["registers"] < base["registers"] and r["loop"] < base["loop"] and r["stack"] == 0, (r, base)
        default = next(x for x in sm90 if x["kind"] == kind and x["head_dim"] == r["head_dim"])
        assert default["swap"] == (kind == "tq"), default
