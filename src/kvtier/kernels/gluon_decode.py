"""Paged decode as a Gluon kernel: the copies of the next tile in flight while a tile is scored.

Triton's pipeliner gives the MMA kernel (:mod:`kvtier.kernels.triton_attention`) one buffer a
tile: the copies of tile ``i + 1`` are issued after tile ``i``'s shared-memory reads, so inside a
program nothing overlaps the loads, and at half the bytes a tile (q8) three programs a
multiprocessor cannot keep the DRAM busy. This kernel, written in Gluon (Triton's explicit
layout and memory language), keeps a ring of ``NS`` stages in shared memory and issues the
asynchronous copies of tile ``i + NS - 1`` before it scores tile ``i``. Two stages (the
default) were the fastest on the H200: 96 registers and 35 KB of shared memory a program
let five programs share a multiprocessor (benchmarks/RESULTS.md, 2026-12-03, tenth session).

One program per (row, kv head, split) of a decode step (one query a row), the ``G`` query heads
of the kv head padded to 16 rows. q8 pages (codes with a float32 scale per token and head), as
in the MMA kernel: the query is rounded to int8 (one scale a row) and scored against the key
codes by an integer dot; the softmax runs on exp2; each key's value scale is applied to the
probabilities, and the value codes (exact in fp16), read from shared memory straight into the
dot's operand layout, meet them in an fp16 dot. 16-bit pages: the same loop in bf16/fp16.
Splits write the same partials and log-sum-exp as the MMA kernel, merged by its merge kernel.
"""

from __future__ import annotations

import functools
import math
import warnings
from dataclasses import replace

import torch

from kvtier.kernels.launch_plan import plan_launch
from kvtier.kernels.triton_quant import FP, int8_key_format, round_half_even

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy as cp
    from triton.experimental.gluon.language.nvidia.ampere import mma_v2

    # Triton 3.6 names the asynchronous copy async_copy_global_to_shared and the CTA barrier
    # thread_barrier; 3.9 async_load and barrier
    _async_load = getattr(cp, "async_load", None) or cp.async_copy_global_to_shared
    _barrier = getattr(gl, "thread_barrier", None) or gl.barrier
    HAVE_GLUON = True
except ImportError:  # pragma: no cover - Triton without Gluon
    HAVE_GLUON = False


#: a register cap for the kernel (``None``: the compiler's choice), for sweeps
MAXNREG: int | None = None

if HAVE_GLUON:

    @gluon.jit
    def _issue_tile(
        K, V, KS, VS, BT, k_smem, v_smem, ks_smem, vs_smem, stage, n0, hi, bt_row, hk,
        stride_kb, stride_kn, stride_kh, stride_vb, stride_vn, stride_vh,
        stride_ksb, stride_ksn, stride_ksh, stride_vsb, stride_vsn, stride_vsh,
        BLOCK_N: gl.constexpr, D: gl.constexpr, PAGE: gl.constexpr, CP: gl.constexpr, SC: gl.constexpr,
        QUANT: gl.constexpr,
    ):  # fmt: skip
        """Asynchronous copies of the tile of keys ``n0 ..`` (codes and, ``QUANT``, scales) into ``stage``."""
        n = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, CP))
        ok = n < hi
        blk = gl.load(bt_row + n // PAGE, mask=ok, other=0).to(gl.int64)
        pos = n % PAGE
        d = gl.expand_dims(gl.arange(0, D, layout=gl.SliceLayout(0, CP)), 0)
        ok2 = gl.expand_dims(ok, 1)
        k_rows = gl.expand_dims(blk * stride_kb + (pos * stride_kn + hk * stride_kh), 1)
        v_rows = gl.expand_dims(blk * stride_vb + (pos * stride_vn + hk * stride_vh), 1)
        _async_load(k_smem.index(stage), K + k_rows + d, mask=ok2)
        _async_load(v_smem.index(stage), V + v_rows + d, mask=ok2)
        if QUANT:
            ns = n0 + gl.arange(0, BLOCK_N, layout=SC)
            oks = ns < hi
            blks = gl.load(bt_row + ns // PAGE, mask=oks, other=0).to(gl.int64)
            poss = ns % PAGE
            ks_ptr = KS + blks * stride_ksb + (poss * stride_ksn + hk * stride_ksh)
            vs_ptr = VS + blks * stride_vsb + (poss * stride_vsn + hk * stride_vsh)
            _async_load(ks_smem.index(stage), ks_ptr, mask=oks)
            _async_load(vs_smem.index(stage), vs_ptr, mask=oks)
        cp.commit_group()

    @gluon.jit
    def _decode_kernel(
        Q, stride_qb, stride_qh,
        K, stride_kb, stride_kn, stride_kh,
        V, stride_vb, stride_vn, stride_vh,
        KS, stride_ksb, stride_ksn, stride_ksh,
        VS, stride_vsb, stride_vsn, stride_vsh,
        BT, stride_btb, capacity, KVLEN, QSTART,
        OUT, stride_ob, stride_oh, PO, PL,
        qk_scale, H_KV, split_len, num_splits,
        G: gl.constexpr, D: gl.constexpr, BLOCK_N: gl.constexpr, PAGE: gl.constexpr, NS: gl.constexpr,
        SPLIT: gl.constexpr, QUANT: gl.constexpr, CAUSAL: gl.constexpr,
    ):  # fmt: skip
        # QUANT: q8 codes (one byte) and a scale a token; else 16-bit keys and values
        VEC: gl.constexpr = 16 if QUANT else 8  # elements of a 16-byte copy
        MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, 4], instr_shape=[16, 8])
        KW: gl.constexpr = 4 if QUANT else 2  # elements a 32-bit register holds along the dot's depth
        QA: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=KW)
        KB: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=MMA, k_width=KW)
        PA: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2)
        VB: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=MMA, k_width=2)
        # 16-byte copies, a row of D elements across D // VEC threads
        CP: gl.constexpr = gl.BlockedLayout([1, VEC], [32 // (D // VEC), D // VEC], [4, 1], [1, 0])
        SC: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
        QL: gl.constexpr = gl.BlockedLayout([1, D // 16], [2, 16], [4, 1], [1, 0])
        TILE: gl.constexpr = gl.SwizzledSharedLayout(vec=VEC, per_phase=1, max_phase=8, order=[1, 0])
        FLAT: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[0])
        ROWS: gl.constexpr = gl.SliceLayout(1, MMA)
        COLS: gl.constexpr = gl.SliceLayout(0, MMA)

        pid_bh = gl.program_id(0)
        pid_s = gl.program_id(1)
        b = pid_bh // H_KV
        hk = pid_bh % H_KV

        # the query rows of this kv head (log2 domain); q8: int8 codes, one scale a row
        mq = gl.arange(0, 16, layout=gl.SliceLayout(1, QL))
        dq = gl.arange(0, D, layout=gl.SliceLayout(0, QL))
        q_ptr = Q + b * stride_qb + gl.expand_dims((hk * G + mq) * stride_qh, 1) + gl.expand_dims(dq, 0)
        q = gl.load(q_ptr, mask=gl.expand_dims(mq < G, 1), other=0.0).to(gl.float32) * qk_scale
        if QUANT:
            q_max = gl.max(gl.abs(q), axis=1)
            q_sc = gl.where(q_max > 0.0, q_max / 127.0, 1.0)
            qa = gl.convert_layout(round_half_even(q / gl.expand_dims(q_sc, 1)).to(gl.int8), QA)
            q_sc = gl.convert_layout(q_sc, ROWS)
        else:
            qa = gl.convert_layout(q.to(K.dtype.element_ty), QA)

        kv_len = gl.minimum(gl.load(KVLEN + b).to(gl.int32), capacity)
        if CAUSAL:  # the query sits at q_start: it sees keys 0 .. q_start
            kv_len = gl.minimum(kv_len, gl.load(QSTART + b).to(gl.int32) + 1)
        lo = pid_s * split_len
        hi = gl.minimum(kv_len, lo + split_len)
        n_tiles = gl.cdiv(gl.maximum(hi - lo, 0), BLOCK_N)
        bt_row = BT + b * stride_btb

        k_smem = gl.allocate_shared_memory(K.dtype.element_ty, [NS, BLOCK_N, D], TILE)
        v_smem = gl.allocate_shared_memory(V.dtype.element_ty, [NS, BLOCK_N, D], TILE)
        if QUANT:
            ks_smem = gl.allocate_shared_memory(gl.float32, [NS, BLOCK_N], FLAT)
            vs_smem = gl.allocate_shared_memory(gl.float32, [NS, BLOCK_N], FLAT)
        else:  # no scales: never touched
            ks_smem = k_smem
            vs_smem = v_smem
        for j in gl.static_range(NS - 1):
            _issue_tile(K, V, KS, VS, BT, k_smem, v_smem, ks_smem, vs_smem, j, lo + j * BLOCK_N, hi, bt_row, hk,
                        stride_kb, stride_kn, stride_kh, stride_vb, stride_vn, stride_vh,
                        stride_ksb, stride_ksn, stride_ksh, stride_vsb, stride_vsn, stride_vsh,
                        BLOCK_N, D, PAGE, CP, SC, QUANT)  # fmt: skip

        m_i = gl.full([16], float("-inf"), gl.float32, ROWS)
        l_i = gl.zeros([16], gl.float32, ROWS)
        acc = gl.zeros([16, D], gl.float32, MMA)
        for i in range(n_tiles):
            cp.wait_group(NS - 2)  # this thread's copies of tile i have landed
            _barrier()  # everyone's have, and everyone is done with tile i - 1's stage
            _issue_tile(K, V, KS, VS, BT, k_smem, v_smem, ks_smem, vs_smem, (i + NS - 1) % NS,
                        lo + (i + NS - 1) * BLOCK_N, hi, bt_row, hk,
                        stride_kb, stride_kn, stride_kh, stride_vb, stride_vn, stride_vh,
                        stride_ksb, stride_ksn, stride_ksh, stride_vsb, stride_vsn, stride_vsh,
                        BLOCK_N, D, PAGE, CP, SC, QUANT)  # fmt: skip
            st = i % NS
            kt = k_smem.index(st).permute((1, 0)).load(KB)  # (D, BLOCK_N)
            if QUANT:
                s = mma_v2(qa, kt, gl.zeros([16, BLOCK_N], gl.int32, MMA))
                s = s.to(gl.float32) * gl.expand_dims(q_sc, 1) * gl.expand_dims(ks_smem.index(st).load(COLS), 0)
            else:
                s = mma_v2(qa, kt, gl.zeros([16, BLOCK_N], gl.float32, MMA))
            n = lo + i * BLOCK_N + gl.arange(0, BLOCK_N, layout=COLS)
            s = gl.where(gl.expand_dims(n < hi, 0), s, float("-inf"))
            m_new = gl.maximum(m_i, gl.max(s, axis=1))
            m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = gl.exp2(m_i - m_safe)
            p = gl.exp2(s - gl.expand_dims(m_safe, 1))
            l_i = l_i * alpha + gl.sum(p, axis=1)
            m_i = m_new
            if QUANT:
                p = p * gl.expand_dims(vs_smem.index(st).load(COLS), 0)
                pa = gl.convert_layout(p.to(gl.float16), PA)
                vt = v_smem.index(st).load(VB).to(gl.float16)  # (BLOCK_N, D) codes, exact in fp16
            else:
                pa = gl.convert_layout(p.to(V.dtype.element_ty), PA)
                vt = v_smem.index(st).load(VB)
            acc = mma_v2(pa, vt, acc * gl.expand_dims(alpha, 1))
        cp.wait_group(0)

        rows = gl.arange(0, 16, layout=ROWS)
        cols = gl.expand_dims(gl.arange(0, D, layout=COLS), 0)
        row_ok = rows < G
        hq = hk * G + rows
        l_safe = gl.where(l_i == 0.0, 1.0, l_i)
        out = acc / gl.expand_dims(l_safe, 1)
        if SPLIT:
            r = b * (H_KV * G) + hq  # (B, Hq, T=1, splits, D) partials, (B, Hq, 1, splits) lse
            lse = gl.where(l_i == 0.0, float("-inf"), m_i + gl.log2(l_safe))
            gl.store(PL + r * num_splits + pid_s, lse, mask=row_ok)
            po = PO + gl.expand_dims((r * num_splits + pid_s) * D, 1) + cols
            gl.store(po, out.to(PO.dtype.element_ty), mask=gl.expand_dims(row_ok, 1))
        else:
            o = OUT + b * stride_ob + gl.expand_dims(hq * stride_oh, 1) + cols
            gl.store(o, out.to(OUT.dtype.element_ty), mask=gl.expand_dims(row_ok, 1))


def launch_decode(
    q: torch.Tensor, k_payload: torch.Tensor, v_payload: torch.Tensor, k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None, block_tables: torch.Tensor, kv_len: torch.Tensor, q_start: torch.Tensor | None,
    capacity: int, out: torch.Tensor, po: torch.Tensor, pl: torch.Tensor, *, qk_scale: float, splits: int, split_len: int,
    block_n: int = 64, stages: int = 2,
) -> None:
    """Launch on validated inputs: ``q`` ``[B, Hq, 1, D]``, payloads ``[num_blocks, page, H_kv, D]``
    (int8 codes with scales ``[num_blocks, page, H_kv, 1]`` float32, or 16-bit values with
    ``None``); the query of row ``b`` sees keys ``0 .. min(kv_len[b], q_start[b] + 1) - 1``
    (``q_start`` ``None``: every key below ``kv_len``); partials into ``po``/``pl`` when
    ``splits > 1`` (merged by the caller), else the output into ``out``."""
    B, Hq, _, D = q.shape
    H_kv, page = k_payload.shape[2], k_payload.shape[1]
    quant = k_scale is not None
    ks, vs = (k_scale, v_scale) if quant else (k_payload, v_payload)
    _decode_kernel[(B * H_kv, splits)](
        q, q.stride(0), q.stride(1),
        k_payload, k_payload.stride(0), k_payload.stride(1), k_payload.stride(2),
        v_payload, v_payload.stride(0), v_payload.stride(1), v_payload.stride(2),
        ks, ks.stride(0), ks.stride(1), ks.stride(2),
        vs, vs.stride(0), vs.stride(1), vs.stride(2),
        block_tables, block_tables.stride(0), capacity, kv_len, q_start if q_start is not None else kv_len,
        out, out.stride(0), out.stride(1), po, pl,
        qk_scale, H_kv, split_len, splits,
        G=Hq // H_kv, D=D, BLOCK_N=block_n, PAGE=page, NS=stages, SPLIT=splits > 1, QUANT=quant,
        CAUSAL=q_start is not None, num_warps=4, **({"maxnreg": MAXNREG} if MAXNREG else {}),
    )  # fmt: skip


def pages_kind(k_fmt, v_fmt, q: torch.Tensor, k_payload: torch.Tensor | None = None) -> str | None:
    """``"q8"`` (signed bytes, one scale a token and head, keys and values), ``"fp"`` (pages
    in the queries' dtype) or ``None``: the pages this kernel reads."""
    D = q.shape[-1]
    if int8_key_format(k_fmt, D) and int8_key_format(v_fmt, D):
        return "q8"
    if k_fmt.mode == FP and v_fmt.mode == FP and (k_payload is None or k_payload.dtype == q.dtype):
        return "fp"
    return None


def supported(k_fmt, v_fmt, q: torch.Tensor, group: int, k_payload: torch.Tensor | None = None) -> str | None:
    """Why this kernel cannot take a decode step over these pages (``None``: it can)."""
    D = q.shape[-1]
    if not HAVE_GLUON:
        return "this Triton has no Gluon (triton.experimental.gluon)"
    if q.device.type != "cuda" or not _capable(q.device.index if q.device.index is not None else torch.cuda.current_device()):
        return "it needs a CUDA GPU of compute capability 8.0+"
    if q.dtype not in (torch.float16, torch.bfloat16):
        return f"it takes fp16 or bf16 queries, not {q.dtype}"
    if pages_kind(k_fmt, v_fmt, q, k_payload) is None:
        return "it reads q8 keys and values (signed bytes, one scale a token and head) or pages in the queries' dtype"
    if D not in (64, 128) or group > 16:
        return f"it takes head_dim 64 or 128 and up to 16 query heads a kv head, not {D} and {group}"
    return None


@functools.cache
def _capable(index: int) -> bool:
    return torch.cuda.get_device_capability(index) >= (8, 0)


#: page kinds whose default launch failed in this process, and why (the MMA kernel takes them)
FAILED: dict[str, str] = {}


def takes_by_default(kinds, cfg, k_fmt, v_fmt, q: torch.Tensor, group: int, k_payload: torch.Tensor) -> bool:
    """Whether a decode step over these pages goes here when ``cfg`` names no kernel: its kind is
    in ``kinds`` (``triton_attention.GLUON_DECODE``), ``cfg`` sets nothing of the MMA kernel's (a
    tile, stages, warps, int8 queries off), the kernel can run it, and it has not failed here."""
    if cfg.block_m or cfg.block_n or cfg.num_stages or cfg.num_warps or cfg.int8_queries is False:
        return False
    kind = pages_kind(k_fmt, v_fmt, q, k_payload)
    return kind in kinds and kind not in FAILED and supported(k_fmt, v_fmt, q, group, k_payload) is None


def try_decode(q, k_payload, v_payload, k_fmt, v_fmt, **kw) -> torch.Tensor | None:
    """A step that :func:`takes_by_default` sent here, or ``None`` when the kernel fails on this
    GPU (a compile or launch error): then this kind of pages is put in :data:`FAILED`, with one
    warning, and the caller's other kernel takes this step and the next ones."""
    try:
        return _step(q, k_payload, v_payload, k_fmt, v_fmt, **kw)
    except Exception as e:  # any failure of an optional kernel: the MMA kernel serves
        kind = pages_kind(k_fmt, v_fmt, q, k_payload)
        FAILED[kind] = f"{type(e).__name__}: {e}"
        warnings.warn(
            f"the Gluon decode kernel failed on {kind} pages ({FAILED[kind][:200]}); their decode steps "
            "go to the MMA kernel from now on", RuntimeWarning, stacklevel=3,
        )
        return None


def decode(q, k_payload, v_payload, k_fmt, v_fmt, *, cfg, **kw) -> torch.Tensor:
    """A decode step (``q`` ``[B, Hq, 1, D]``) asked of this kernel by name; ``cfg``'s ``block_n``
    (default 64 keys for q8 pages, 32 for 16-bit ones) and ``num_stages`` (default 2) set the
    tile and the ring. Raises ``ValueError`` naming what it cannot run."""
    if cfg.block_n not in (None, 32, 64, 128) or (cfg.num_stages is not None and cfg.num_stages < 2):
        raise ValueError(
            f"decode_kernel='gluon' takes block_n 32, 64 or 128 and num_stages >= 2 (a tile in flight "
            f"while one is scored), got block_n={cfg.block_n}, num_stages={cfg.num_stages}; leave them unset "
            "for the defaults"
        )
    why = supported(k_fmt, v_fmt, q, q.shape[1] // k_payload.shape[2], k_payload)
    if why is not None:
        raise ValueError(f"decode_kernel='gluon' cannot take this step: {why}; leave decode_kernel unset")
    return _step(q, k_payload, v_payload, k_fmt, v_fmt, cfg=cfg, **kw)


def _step(q, k_payload, v_payload, k_fmt, v_fmt, *, block_tables, kv_len, q_start, capacity, scale, out, out_dtype,
          cfg) -> torch.Tensor:
    # that module imports this one
    from kvtier.kernels.triton_attention import LOG2E, merge_splits, split_partials

    B, Hq, _, D = q.shape
    H_kv = k_payload.shape[2]
    quant = k_fmt.scale is not None
    block_n = cfg.block_n or (64 if quant else 32)
    stages = cfg.num_stages or 2
    plan_cfg = replace(cfg, block_n=block_n)
    *_, splits, split_len, base = plan_launch(B, H_kv, Hq // H_kv, 1, capacity, q.device, plan_cfg, quant)
    if out is None:
        out = torch.empty((B, Hq, 1, D), dtype=out_dtype, device=q.device)
    po, pl = split_partials(out, splits)
    sm_scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    launch_decode(q, k_payload, v_payload, k_fmt.scale, v_fmt.scale, block_tables, kv_len, q_start, capacity, out, po, pl,
                  qk_scale=sm_scale * LOG2E, splits=splits, split_len=split_len, block_n=block_n, stages=stages)
    merge_splits(po, pl, out, splits, base, split_len, block_n)  # as the MMA kernel's launch
    return out
