"""Paged decode as a Gluon kernel: the copies of the next tile in flight while a tile is scored.

Triton's pipeliner gives the MMA kernel (:mod:`kvtier.kernels.triton_attention`) one buffer a
tile: the copies of tile ``i + 1`` are issued after tile ``i``'s shared-memory reads, so inside a
program nothing overlaps the loads, and at half the bytes a tile (q8) three programs a
multiprocessor cannot keep the DRAM busy. This kernel, written in Gluon (Triton's explicit
layout and memory language), keeps a ring of ``NS`` stages in shared memory and issues the
asynchronous copies of tile ``i + NS - 1`` before it scores tile ``i``. Two stages (the
default) were the fastest on the H200 (benchmarks/RESULTS.md, 2026-12-03).

One program per (row, kv head, split) of a decode step (one query a row), the ``G`` query heads
of the kv head padded to 16 rows; the softmax runs on exp2. Pages (:data:`KINDS`):

- q8 (signed bytes, a float32 scale per token and head), as in the MMA kernel: the query is
  rounded to int8 (one scale a row) and scored against the key codes by an integer dot;
- q4 (offset-8 nibbles) and fp8 (e4m3 bytes), a float32 scale per token and head: fp16 dots,
  the query split into the channel parts below;
- q4_g32 (nibbles, an fp16 scale and zero a group of 32 channels): the keys' scales vary along
  the dots' depth, so they go on the operands: the codes become fp16 channel parts in registers
  as q4's do, and each takes its group's scale and zero in one FMA before the dots. Where the
  ``NG`` groups of ``G`` heads fill the 16 rows (``G NG = 16``, one warp: Llama-3-8B's 4 x 4),
  row ``g G + r`` scores head ``r`` once more and weighs the values of group ``g``: its
  probabilities take that group's value scales, a dot with ones sums its zeros, the value
  codes are operands as they are, and each output column is kept from its group's rows
  (:func:`~kvtier.kernels.gluon_codes.stacked_group_scales`). Otherwise the values' scales
  and zeros go on their operands as the keys' do;
- TurboQuant's default pages (unsigned 8-bit keys with an fp16 scale and zero a group of 32
  channels, 3-bit Lloyd-Max values with an fp16 scale a group; :mod:`kvtier.kernels.gluon_codes`):
  the keys become two channel parts in registers as fp8's bytes do, each taking its group's
  scale and zero as q4_g32's; the values are dequantised into an fp16 tile in shared memory
  first (a thread one group of one key, copied as 4-byte words: 12 bytes a group of codes),
  then weighed as 16-bit pages are (its default launch: on the kernel of swapped roles,
  :mod:`kvtier.kernels.gluon_swap`);
- 16-bit pages: the same loop in bf16/fp16.

``W`` warps a program (:data:`TILING` by page kind): four split a tile's keys for the scores and
the output's channels for the values, and meet at barriers for the row maximum, the row sum and
the probabilities' change of layout; one holds the whole tile and needs no barrier across warps,
at about twice the registers a thread. With ``AHEAD`` (a sweep's: no default launch takes it,
benchmarks/RESULTS.md 2026-12-04) iteration ``i`` scores tile ``i + 1``
(:func:`~kvtier.kernels.gluon_codes.tile_scores`, from a third stage of the ring) beside tile
``i``'s softmax and values, which it scored the iteration before.

Raw codes (``RAW``, :func:`~kvtier.kernels.gluon_plan.programs`): q4's nibbles and stacked
q4_g32's go to the tensor cores as they lie, each the bits of an fp16 subnormal (``c 2^-24``,
a high nibble ``c 2^-20``: the query's parts of odd channels take a sixteenth), exact, and the
dots are scaled back in float32; q4's offset of 8 comes off with each row's query sum (keys)
and probabilities' sum (values, a dot with ones).

One-byte tiles are read from shared memory as int16 (two bytes of one key an element): the
dot operands hold pairs along their depth, for values two keys of one channel, which a
transposing 16-bit load brings into one register and a byte permutation turns into the fp16
pairs of two channels (four for q4). Channel ``PARTS c + i`` lands in part ``i``, each with
its own accumulator; the output is stored interleaved back. Scales go on scores (keys) and
probabilities (values). Splits write the same partials and log-sum-exp as the MMA kernel,
merged by its merge kernel.
"""

from __future__ import annotations

import math
import warnings

import torch

from kvtier.kernels import gluon_swap
from kvtier.kernels.gluon_plan import plan
from kvtier.kernels.launch_plan import capability
from kvtier.kernels.triton_quant import (
    AFFINE,
    CENTROID,
    FLOAT8,
    FP,
    int8_key_format,
    round_half_even,
)

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy as cp
    from triton.experimental.gluon.language.nvidia.ampere import mma_v2

    # Triton 3.6 names the CTA barrier thread_barrier, 3.9 barrier
    _barrier = getattr(gl, "thread_barrier", None) or gl.barrier

    from kvtier.kernels.gluon_codes import (
        as_int16,
        byte_pairs,
        dequant_centroid_groups,
        grouped_quads,
        nibble_quads,
        stacked_group_scales,
        staging_layout,
        tile_scores,
    )
    from kvtier.kernels.gluon_tiles import issue_tile, split_keys, tile_layout, tile_pages

    HAVE_GLUON = True
except ImportError:  # pragma: no cover - Triton without Gluon
    HAVE_GLUON = False


#: for sweeps: a register cap for the kernel (``None``: the compiler's choice), the warps a
#: program and programs a wave of the split plan in place of :data:`TILING`'s, each tile scored
#: an iteration ahead (``None``: not), raw codes or not in place of :func:`programs`' choice
#: (``None``: its), and the kernel of swapped roles (:mod:`kvtier.kernels.gluon_swap`) wherever
#: it can run a launch, or nowhere, in place of :func:`programs`' choice (``None``: its)
MAXNREG: int | None = None
WARPS: int | None = None
RESIDENT: int | None = None
AHEAD: bool | None = None
RAW: bool | None = None
SWAP: bool | None = None

if HAVE_GLUON:

    @gluon.jit
    def _decode_kernel(
        Q, stride_qb, stride_qh,
        K, stride_kb, stride_kn, stride_kh,
        V, stride_vb, stride_vn, stride_vh,
        KS, stride_ksb, stride_ksn, stride_ksh,
        VS, stride_vsb, stride_vsn, stride_vsh, KZ, VZ,
        BT, stride_btb, capacity, KVLEN, QSTART,
        OUT, stride_ob, stride_oh, PO, PL,
        qk_scale, H_KV, split_len, num_splits,
        G: gl.constexpr, D: gl.constexpr, BLOCK_N: gl.constexpr, PAGE: gl.constexpr, NS: gl.constexpr,
        SPLIT: gl.constexpr, KIND: gl.constexpr, CAUSAL: gl.constexpr, LIKE: gl.constexpr, W: gl.constexpr,
        STACK: gl.constexpr, AHEAD: gl.constexpr, RAW: gl.constexpr,
    ):  # fmt: skip
        # W warps split the tile's keys (scores) and the output's channels (values)
        # KIND: the pages (KINDS); all but 16-bit ones hold one-byte codes (or two nibbles a byte)
        QUANT: gl.constexpr = KIND != 0
        # q4_g32 and TurboQuant: a scale, and a zero, a group of NG (q4_g32's on its operands in
        # registers; TurboQuant's tiles dequantised into fp16 tiles, then the loop of 16-bit pages)
        GROUPED: gl.constexpr = KIND == 4 or KIND == 5
        TQ: gl.constexpr = KIND == 5  # TurboQuant: 8-bit keys, 3-bit values (int32 words)
        NG: gl.constexpr = D // 32 if GROUPED else 0
        # STACK (asked for, where q4_g32's NG groups of G heads fill the 16 rows of one warp): row
        # g G + r scores head r, and its probabilities take the values' scales and zeros of group
        # g (stacked_group_scales), which the rows' output columns in group g keep; the value
        # codes are operands as they are
        STACKED: gl.constexpr = STACK and KIND == 4 and G * NG == 16 and W == 1
        # RAW: nibbles as operands as they lie (subnormal fp16: nibble_quads), the dots scaled back in
        # float32 (the query's odd parts a sixteenth): q4's keys and values, stacked q4_g32's (its
        # keys' scales and zeros on the scores: stacked_key_scores)
        RAWC: gl.constexpr = RAW and (KIND == 2 or STACKED)
        NG1: gl.constexpr = NG if GROUPED else 1
        DP: gl.constexpr = D // 2 if (KIND == 2 or KIND == 4) else D  # stored elements a row (nibbles: two a byte)
        # one-byte codes are read as int16 (a key's two bytes an element) and become PARTS
        # operands of interleaved channels (channel PARTS c + i in part i): two, four for q4
        PARTS: gl.constexpr = 4 if (KIND == 2 or KIND == 4) else (2 if (KIND == 1 or KIND == 3) else 1)
        # the keys' parts: PARTS, and TurboQuant's 8-bit keys two (its values dequantised, one)
        KPARTS: gl.constexpr = 2 if TQ else PARTS
        TOKEN_SCALES: gl.constexpr = QUANT and not GROUPED  # one scale a token, on scores and probabilities
        QP: gl.constexpr = KPARTS if KIND >= 2 else 1  # the query's parts (q8 keys: an int8 dot)
        # elements of a 16-byte copy; 8-byte ones where 16-byte ones would cover more rows than
        # the tile has (q4 at head_dim 64 and 32 keys)
        VEC16: gl.constexpr = 16 if QUANT else 8
        VEC: gl.constexpr = VEC16 if 32 * W * VEC16 <= BLOCK_N * DP else VEC16 // 2
        MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, W], instr_shape=[16, 8])
        KW: gl.constexpr = 4 if KIND == 1 else 2  # elements a 32-bit register holds along the dot's depth
        QA: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=KW)
        KB: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=MMA, k_width=KW)
        PA: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2)
        VB: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=MMA, k_width=2)
        # 16-byte copies, a row of DP elements across DP // VEC threads
        CP: gl.constexpr = gl.BlockedLayout([1, VEC], [32 // (DP // VEC), DP // VEC], [W, 1], [1, 0])
        # the scales: one a token (SC), or NG of each of scales and zeros (SG)
        SG: gl.constexpr = gl.BlockedLayout([1, NG1], [32, 1], [W, 1], [1, 0])
        SC: gl.constexpr = gl.SliceLayout(1, SG) if GROUPED else gl.BlockedLayout([1], [32], [W], [0])
        # the codes a thread dequantises (TurboQuant's values): one group of one key, four words
        DQW2: gl.constexpr = gl.BlockedLayout([1, 4], [32 // NG1, NG1], [W, 1], [1, 0])
        DQW3: gl.constexpr = gl.BlockedLayout([1, 1, 4], [32 // NG1, NG1, 1], [W, 1, 1], [2, 1, 0])
        # TurboQuant's value words copied with the key rows' threads (4 NG words a row)
        TPR: gl.constexpr = DP // VEC
        CPV: gl.constexpr = gl.BlockedLayout([1, 4 * NG // TPR], [32 // TPR, TPR], [W, 1], [1, 0]) if TQ else CP
        QD: gl.constexpr = D // QP  # query channels a dot operand
        QL: gl.constexpr = gl.BlockedLayout([1, QD // 16], [2, 16], [W, 1], [1, 0])
        TILE: gl.constexpr = tile_layout(VEC, DP, 1 if QUANT else 2)
        # one-byte tiles seen as int16, the same bytes
        TILE16: gl.constexpr = tile_layout(VEC // 2, DP // 2, 2)
        AC: gl.constexpr = D // PARTS  # accumulator columns
        FLAT: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[0])
        ROWS: gl.constexpr = gl.SliceLayout(1, MMA)
        COLS: gl.constexpr = gl.SliceLayout(0, MMA)

        pid_bh = gl.program_id(0)
        pid_s = gl.program_id(1)
        b = pid_bh // H_KV
        hk = pid_bh % H_KV

        # the query rows of this kv head (log2 domain). q8: int8 codes, one scale a row; q4 and
        # fp8: the QP parts in fp16
        mq = gl.arange(0, 16, layout=gl.SliceLayout(1, QL))
        dq = gl.arange(0, QD, layout=gl.SliceLayout(0, QL))
        mh = mq % G if STACKED else mq  # the head of each row
        q_ptr = Q + b * stride_qb + gl.expand_dims((hk * G + mh) * stride_qh, 1)
        q_ptr = q_ptr + gl.expand_dims(dq * QP, 0)
        q_ok = gl.expand_dims(mh < G, 1)
        q_sc = qk_scale  # (q8's: the query codes' scales)
        if QP > 1:  # the query's parts in fp16 (channel QP c + j in part j)
            if RAWC and STACKED:  # row g G + r: its group g's channels only (4 c + i: group c // 8)
                q_ok = q_ok & (gl.expand_dims(dq // (32 // QP), 0) == gl.expand_dims(mq // G, 1))
            q0 = (gl.load(q_ptr, mask=q_ok, other=0.0).to(gl.float32) * qk_scale).to(gl.float16)
            q1 = (gl.load(q_ptr + 1, mask=q_ok, other=0.0).to(gl.float32) * qk_scale).to(gl.float16)
            q2 = q0
            q3 = q0
            if PARTS == 4:
                q2 = (gl.load(q_ptr + 2, mask=q_ok, other=0.0).to(gl.float32) * qk_scale).to(gl.float16)
                q3 = (gl.load(q_ptr + 3, mask=q_ok, other=0.0).to(gl.float32) * qk_scale).to(gl.float16)
            if RAWC:  # each row's query sum (q4's c - 8: minus 8 of it), then the odd parts a sixteenth
                q_sc = gl.convert_layout(gl.sum(q0.to(gl.float32), axis=1) + gl.sum(q1.to(gl.float32), axis=1)
                                         + gl.sum(q2.to(gl.float32), axis=1) + gl.sum(q3.to(gl.float32), axis=1),
                                         ROWS)  # fmt: skip
                q1 = (q1.to(gl.float32) * 0.0625).to(gl.float16)
                q3 = (q3.to(gl.float32) * 0.0625).to(gl.float16)
                if STACKED:  # its scores come 2^-24 of the head's (stacked_key_scores): exp2 scales them back
                    q_sc = q_sc * 5.9604644775390625e-08
            qa = gl.convert_layout(q0, QA)
            qb = gl.convert_layout(q1, QA)
            qc = qa  # (the parts tile_scores takes for four)
            qd = qa
            if PARTS == 4:
                qc = gl.convert_layout(q2, QA)
                qd = gl.convert_layout(q3, QA)
        else:
            q = gl.load(q_ptr, mask=q_ok, other=0.0).to(gl.float32) * qk_scale
            if KIND == 1:
                q_max = gl.max(gl.abs(q), axis=1)
                q_sc = gl.where(q_max > 0.0, q_max / 127.0, 1.0)
                qa = gl.convert_layout(round_half_even(q / gl.expand_dims(q_sc, 1)).to(gl.int8), QA)
                q_sc = gl.convert_layout(q_sc, ROWS)
            else:
                qa = gl.convert_layout(q.to(gl.float16 if GROUPED else K.dtype.element_ty), QA)
        if QP < 2:  # (the parts tile_scores does not take)
            qb = qa
            qc = qa
            qd = qa

        lo, hi, n_tiles = split_keys(KVLEN, QSTART, capacity, b, pid_s, split_len, BLOCK_N, CAUSAL)
        bt_row = BT + b * stride_btb

        FLAT2: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[1, 0])
        k_smem = gl.allocate_shared_memory(K.dtype.element_ty, [NS, BLOCK_N, DP], TILE)
        if TQ:
            v_smem = gl.allocate_shared_memory(V.dtype.element_ty, [NS, BLOCK_N, 4 * NG], FLAT2)
        else:
            v_smem = gl.allocate_shared_memory(V.dtype.element_ty, [NS, BLOCK_N, DP], TILE)
        if GROUPED:
            ks_smem = gl.allocate_shared_memory(gl.float16, [NS, BLOCK_N, NG], FLAT2)
            vs_smem = gl.allocate_shared_memory(gl.float16, [NS, BLOCK_N, NG], FLAT2)
            kz_smem = gl.allocate_shared_memory(gl.float16, [NS, BLOCK_N, NG], FLAT2)
            if TQ:  # TurboQuant's values have no zeros: never touched
                vz_smem = vs_smem
            else:
                vz_smem = gl.allocate_shared_memory(gl.float16, [NS, BLOCK_N, NG], FLAT2)
            if TQ:  # the dequantised values of the tile being scored
                STG: gl.constexpr = staging_layout(BLOCK_N, D)
                v_fp = gl.allocate_shared_memory(gl.float16, [BLOCK_N, D], STG)
        elif QUANT:
            ks_smem = gl.allocate_shared_memory(gl.float32, [NS, BLOCK_N], FLAT)
            vs_smem = gl.allocate_shared_memory(gl.float32, [NS, BLOCK_N], FLAT)
            kz_smem = ks_smem  # no zeros: never touched
            vz_smem = vs_smem
        else:  # no scales: never touched
            ks_smem = k_smem
            vs_smem = v_smem
            kz_smem = k_smem
            vz_smem = v_smem
        for j in gl.static_range(NS - 1):
            blk, blks = tile_pages(BT, bt_row, lo + j * BLOCK_N, hi, BLOCK_N, PAGE, CP, SC, QUANT)
            issue_tile(K, V, KS, VS, KZ, VZ, blk, blks, k_smem, v_smem, ks_smem, vs_smem, kz_smem, vz_smem, j,
                       lo + j * BLOCK_N, hi, hk,
                       stride_kb, stride_kn, stride_kh, stride_vb, stride_vn, stride_vh,
                       stride_ksb, stride_ksn, stride_ksh, stride_vsb, stride_vsn, stride_vsh,
                       BLOCK_N, DP, PAGE, CP, SC, QUANT, LIKE, NG, SG, TQ, CPV)  # fmt: skip
        # the pages of the tile to copy next are read from the block table an iteration early,
        # so the copies never wait on that load (1-3% on the H200)
        blk, blks = tile_pages(BT, bt_row, lo + (NS - 1) * BLOCK_N, hi, BLOCK_N, PAGE, CP, SC, QUANT)

        m_i = gl.full([16], float("-inf"), gl.float32, ROWS)
        SX: gl.constexpr = 16777216.0 if RAWC and STACKED else 1.0  # the scores' factor, in exp2's FMA
        l_i = gl.zeros([16], gl.float32, ROWS)
        acc = gl.zeros([16, AC], gl.float32, MMA)  # channels PARTS c + 0, 1, 2, 3
        acc1 = gl.zeros([16, AC], gl.float32, MMA)
        acc2 = gl.zeros([16, AC], gl.float32, MMA)
        acc3 = gl.zeros([16, AC], gl.float32, MMA)
        # STACKED: each row's group's zeros weighed, summed over the keys by a dot with ones
        z_acc = gl.zeros([16, 8], gl.float32, MMA)
        ones = gl.full([BLOCK_N, 8], 1.0, gl.float16, VB)
        if AHEAD:  # tile 0's scores before the loop, whose iteration i scores tile i + 1 (NS >= 3)
            cp.wait_group(NS - 2)
            _barrier()
            s_next = tile_scores(k_smem.index(0), ks_smem.index(0), kz_smem.index(0), qa, qb, qc, qd, q_sc,
                                 KIND, PARTS, KPARTS, NG, BLOCK_N, D, TILE16, KB, MMA, RAWC, G)  # fmt: skip
        for i in range(n_tiles):
            # this thread's copies of tile i (AHEAD: i + 1) have landed
            cp.wait_group(NS - 3 if AHEAD else NS - 2)
            _barrier()  # everyone's have, and everyone is done with tile i - 1's stage
            n_next = lo + (i + NS - 1) * BLOCK_N
            issue_tile(K, V, KS, VS, KZ, VZ, blk, blks, k_smem, v_smem, ks_smem, vs_smem, kz_smem, vz_smem,
                       (i + NS - 1) % NS, n_next, hi, hk,
                       stride_kb, stride_kn, stride_kh, stride_vb, stride_vn, stride_vh,
                       stride_ksb, stride_ksn, stride_ksh, stride_vsb, stride_vsn, stride_vsh,
                       BLOCK_N, DP, PAGE, CP, SC, QUANT, LIKE, NG, SG, TQ, CPV)  # fmt: skip
            blk, blks = tile_pages(BT, bt_row, n_next + BLOCK_N, hi, BLOCK_N, PAGE, CP, SC, QUANT)
            st = i % NS
            if TQ:  # everyone is done with the last tile's fp16 values (the barrier above)
                dequant_centroid_groups(v_smem.index(st), vs_smem.index(st), v_fp, BLOCK_N, D, NG, DQW2, DQW3)
                _barrier()
            if AHEAD:  # this tile's scores from the last iteration; the next tile's now
                s = s_next
                sa = (i + 1) % NS
                s_next = tile_scores(k_smem.index(sa), ks_smem.index(sa), kz_smem.index(sa), qa, qb, qc, qd, q_sc,
                                     KIND, PARTS, KPARTS, NG, BLOCK_N, D, TILE16, KB, MMA, RAWC, G)  # fmt: skip
            else:
                s = tile_scores(k_smem.index(st), ks_smem.index(st), kz_smem.index(st), qa, qb, qc, qd, q_sc,
                                KIND, PARTS, KPARTS, NG, BLOCK_N, D, TILE16, KB, MMA, RAWC, G)  # fmt: skip
            n = lo + i * BLOCK_N + gl.arange(0, BLOCK_N, layout=COLS)
            s = gl.where(gl.expand_dims(n < hi, 0), s, float("-inf"))
            m_new = gl.maximum(m_i, gl.max(s, axis=1) * SX)
            m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = gl.exp2(m_i - m_safe)
            p = gl.exp2(s * SX - gl.expand_dims(m_safe, 1))
            l_i = l_i * alpha + gl.sum(p, axis=1)
            m_i = m_new
            if PARTS > 1:  # one-byte codes as operands: q8, q4 and fp8 (exact in fp16) and q4_g32's
                if TOKEN_SCALES:  # the values' scales on the probabilities
                    p = p * gl.expand_dims(vs_smem.index(st).load(COLS), 0)
                if STACKED:
                    p, pz = stacked_group_scales(p, vs_smem.index(st), vz_smem.index(st), NG, G)
                    z_acc = mma_v2(gl.convert_layout(pz.to(gl.float16), PA), ones, z_acc * gl.expand_dims(alpha, 1))
                pa = gl.convert_layout(p.to(gl.float16), PA)
                if RAWC and KIND == 2:  # q4's raw values: the probabilities' sums, for the offset of 8
                    z_acc = mma_v2(pa, ones, z_acc * gl.expand_dims(alpha, 1))
                vt = as_int16(v_smem.index(st), [BLOCK_N, D // PARTS], TILE16).load(VB)
                a2 = gl.expand_dims(alpha, 1)
                if PARTS == 4:
                    if KIND == 4 and not STACKED:
                        v0, v1, v2, v3 = grouped_quads(vt, vs_smem.index(st), vz_smem.index(st), NG, False)
                    else:
                        v0, v1, v2, v3 = nibble_quads(vt, KIND == 2, RAWC)
                    acc2 = mma_v2(pa, v2, acc2 * a2)
                    acc3 = mma_v2(pa, v3, acc3 * a2)
                else:
                    v0, v1 = byte_pairs(vt, KIND == 3)
                acc = mma_v2(pa, v0, acc * a2)
                acc1 = mma_v2(pa, v1, acc1 * a2)
            elif GROUPED:
                pa = gl.convert_layout(p.to(gl.float16), PA)
                acc = mma_v2(pa, v_fp.load(VB), acc * gl.expand_dims(alpha, 1))
            else:
                pa = gl.convert_layout(p.to(V.dtype.element_ty), PA)
                acc = mma_v2(pa, v_smem.index(st).load(VB), acc * gl.expand_dims(alpha, 1))
        cp.wait_group(0)

        rows = gl.arange(0, 16, layout=ROWS)
        # the output's channels of the accumulators' columns: PARTS c + i in acc i
        cols = gl.expand_dims(gl.arange(0, AC, layout=COLS), 0) * PARTS
        if RAWC:  # raw nibbles' dots back to codes (q4: c - 8)
            zq = gl.expand_dims(gl.max(z_acc, axis=1), 1) * 8.0 if KIND == 2 else 0.0
            acc, acc1 = acc * 16777216.0 - zq, acc1 * 1048576.0 - zq
            acc2, acc3 = acc2 * 16777216.0 - zq, acc3 * 1048576.0 - zq
        if STACKED:  # column c (channels 4 c + i) is in group 4 c // 32: rows g G + r of group g
            hq = hk * G + rows % G
            row_ok = gl.expand_dims(rows // G, 1) == gl.expand_dims(gl.arange(0, AC, layout=COLS) // (32 // PARTS), 0)
            z = gl.expand_dims(gl.max(z_acc, axis=1), 1)  # (its eight columns alike)
            acc, acc1, acc2, acc3 = acc + z, acc1 + z, acc2 + z, acc3 + z
        else:
            hq = hk * G + rows
            row_ok = gl.expand_dims(rows < G, 1)
        l_safe = gl.expand_dims(gl.where(l_i == 0.0, 1.0, l_i), 1)
        if SPLIT:
            r = b * (H_KV * G) + hq  # (B, Hq, T=1, splits, D) partials, (B, Hq, 1, splits) lse
            lse = gl.where(l_i == 0.0, float("-inf"), m_i + gl.log2(gl.where(l_i == 0.0, 1.0, l_i)))
            gl.store(PL + r * num_splits + pid_s, lse, mask=rows < G)
            o = PO + gl.expand_dims((r * num_splits + pid_s) * D, 1) + cols
        else:
            o = OUT + b * stride_ob + gl.expand_dims(hq * stride_oh, 1) + cols
        gl.store(o, (acc / l_safe).to(o.dtype.element_ty), mask=row_ok)
        if PARTS >= 2:
            gl.store(o + 1, (acc1 / l_safe).to(o.dtype.element_ty), mask=row_ok)
        if PARTS == 4:
            gl.store(o + 2, (acc2 / l_safe).to(o.dtype.element_ty), mask=row_ok)
            gl.store(o + 3, (acc3 / l_safe).to(o.dtype.element_ty), mask=row_ok)


#: the page kinds the kernel reads, by its ``KIND``: 16-bit values; q8 (signed bytes), q4
#: (offset-8 nibbles, the low one the even channel) and fp8 (e4m3 bytes), each with one float32
#: scale a token and head; q4_g32 (nibbles, an fp16 scale and zero a group of 32 channels);
#: TurboQuant's default (keys unsigned 8-bit codes, an fp16 scale and zero a group of 32
#: channels; values 3-bit Lloyd-Max codes, an fp16 scale a group; both in the rotated domain,
#: which the caller enters and leaves)
KINDS = {"fp": 0, "q8": 1, "q4": 2, "fp8": 3, "q4_g32": 4, "tq": 5}

def launch_decode(
    q: torch.Tensor, k_payload: torch.Tensor, v_payload: torch.Tensor, k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None, block_tables: torch.Tensor, kv_len: torch.Tensor, q_start: torch.Tensor | None,
    capacity: int, out: torch.Tensor, po: torch.Tensor, pl: torch.Tensor, *, kind: str, qk_scale: float, splits: int,
    split_len: int, block_n: int = 64, stages: int = 2, warps: int = 4, k_zero: torch.Tensor | None = None,
    v_zero: torch.Tensor | None = None, maxnreg: int | None = None, stack: bool = False, ahead: bool = False,
    raw: bool = False, swap: bool = False,
) -> None:
    """Launch on validated inputs: ``q`` ``[B, Hq, 1, D]``, payloads ``[num_blocks, page, H_kv, D']``
    of ``kind`` (:data:`KINDS`; one-byte codes with scales ``[num_blocks, page, H_kv, 1]``
    float32; q4_g32 nibbles with fp16 scales and zeros ``[num_blocks, page, H_kv, D / 32]`` of
    equal strides; or 16-bit values with ``None``) on ``warps`` warps a program; the query of
    row ``b`` sees keys ``0 .. min(kv_len[b], q_start[b] + 1) - 1`` (``q_start`` ``None``: every
    key below ``kv_len``); partials into ``po``/``pl`` when ``splits > 1`` (merged by the
    caller), else the output into ``out``. ``ahead``: each tile scored an iteration early
    (``stages`` >= 3); ``raw``: nibbles as operands as they lie (:func:`programs`); ``swap``: the
    launch on the kernel of swapped roles (:mod:`kvtier.kernels.gluon_swap`: q4's raw one-warp
    launches, TurboQuant's one-warp ones), whose arguments these are too. ``maxnreg``: a cap on the registers a thread
    (:data:`MAXNREG`, set for a sweep, wins; neither: the compiler's choice)."""
    B, Hq, _, D = q.shape
    H_kv, page = k_payload.shape[2], k_payload.shape[1]
    ks, vs = (k_scale, v_scale) if k_scale is not None else (k_payload, v_payload)
    kz = k_zero if k_zero is not None else ks
    vz = v_zero if v_zero is not None else vs
    if kind == "tq":  # the 3-bit values are read as int32 words (a group of 32 codes is 12 bytes)
        v_payload = v_payload.view(torch.int32)
    if kz.stride() != ks.stride() or vz.stride() != vs.stride():
        raise ValueError("the zeros must have their scales' strides: they share one row offset in the kernel")
    like = k_payload.stride()[:3] == v_payload.stride()[:3] and ks.stride()[:3] == vs.stride()[:3]
    cap = MAXNREG or maxnreg
    if swap and not gluon_swap.takes(kind, raw, warps, ahead, Hq // H_kv, D):
        raise ValueError(f"the swapped kernel takes q4's raw and TurboQuant's one-warp launches of up to 8 query "
                         f"heads a kv head and q4_g32's of up to 4 at head_dim 64 or 128, not {kind} pages "
                         f"(raw={raw}, warps={warps}, ahead={ahead}, {Hq // H_kv} heads, head_dim {D})")  # fmt: skip
    kernel = gluon_swap.kernel(kind) if swap else _decode_kernel
    kernel[(B * H_kv, splits)](
        q, q.stride(0), q.stride(1),
        k_payload, k_payload.stride(0), k_payload.stride(1), k_payload.stride(2),
        v_payload, v_payload.stride(0), v_payload.stride(1), v_payload.stride(2),
        ks, ks.stride(0), ks.stride(1), ks.stride(2),
        vs, vs.stride(0), vs.stride(1), vs.stride(2), kz, vz,
        block_tables, block_tables.stride(0), capacity, kv_len, q_start if q_start is not None else kv_len,
        out, out.stride(0), out.stride(1), po, pl,
        qk_scale, H_kv, split_len, splits,
        G=Hq // H_kv, D=D, BLOCK_N=block_n, PAGE=page, NS=stages, SPLIT=splits > 1, KIND=KINDS[kind],
        CAUSAL=q_start is not None, LIKE=like, W=warps, STACK=stack, AHEAD=ahead, RAW=raw, num_warps=warps,
        **({"maxnreg": cap} if cap else {}),
    )  # fmt: skip


def _kind(fmt, head_dim: int) -> str | None:
    if fmt.mode == FP:
        return "fp"
    if fmt.group == 32 and fmt.scale is not None and head_dim % 32 == 0:  # TurboQuant's default halves
        if fmt.mode == AFFINE and fmt.bits == 8 and fmt.offset == 0 and not fmt.signed and fmt.zero is not None:
            return "tq_keys"
        if fmt.mode == CENTROID and fmt.bits == 3 and fmt.zero is None:
            return "tq_values"
    if (fmt.mode == AFFINE and fmt.bits == 4 and fmt.group == 32 and fmt.offset == 0 and fmt.zero is not None
            and fmt.scale is not None and fmt.rotation is None and head_dim % 32 == 0):
        return "q4_g32"
    if fmt.group != head_dim or fmt.zero is not None or fmt.scale is None:
        return None
    if int8_key_format(fmt, head_dim):
        return "q8"
    if fmt.mode == AFFINE and fmt.bits == 4 and fmt.offset == -8 and not fmt.signed:
        return "q4"
    return "fp8" if fmt.mode == FLOAT8 else None


def pages_kind(k_fmt, v_fmt, q: torch.Tensor, k_payload: torch.Tensor | None = None) -> str | None:
    """The kind of pages (:data:`KINDS`) of keys and values alike (``"tq"``: TurboQuant's 8-bit
    keys with its 3-bit values), or ``None``: pages this kernel does not read. ``"fp"`` pages
    hold the queries' dtype."""
    kind, v_kind = _kind(k_fmt, q.shape[-1]), _kind(v_fmt, q.shape[-1])
    if (kind, v_kind) == ("tq_keys", "tq_values"):
        return "tq"
    if kind != v_kind or kind in ("tq_keys", "tq_values"):
        return None
    return None if kind == "fp" and k_payload is not None and k_payload.dtype != q.dtype else kind


def supported(k_fmt, v_fmt, q: torch.Tensor, group: int, k_payload: torch.Tensor | None = None, *,
              kind: str | None = None) -> str | None:
    """Why this kernel cannot take a decode step over these pages (``None``: it can); ``kind``:
    their :func:`pages_kind`, where the caller has it."""
    D = q.shape[-1]
    if not HAVE_GLUON:
        return "this Triton has no Gluon (triton.experimental.gluon)"
    cc = capability(q.device)
    if cc < (8, 0):
        return "it needs a CUDA GPU of compute capability 8.0+"
    if q.dtype not in (torch.float16, torch.bfloat16):
        return f"it takes fp16 or bf16 queries, not {q.dtype}"
    kind = kind or pages_kind(k_fmt, v_fmt, q, k_payload)
    if kind == "fp8" and cc < (8, 9):  # (its e4m3 pairs' conversion; sm_80 does not assemble it)
        return f"fp8 pages need compute capability 8.9+ (this GPU: {cc[0]}.{cc[1]})"
    if kind is None:
        return (
            "it reads keys and values of one kind: q8, q4 or fp8 codes with one scale a token and head, "
            "q4_g32 codes, or pages in the queries' dtype; or TurboQuant's 8-bit keys with 3-bit values"
        )
    if D not in (64, 128) or group > 16:
        return f"it takes head_dim 64 or 128 and up to 16 query heads a kv head, not {D} and {group}"
    return None


#: page kinds whose default launch failed in this process, and why (the MMA kernel takes them)
FAILED: dict[str, str] = {}


def takes_by_default(kinds, cfg, k_fmt, v_fmt, q: torch.Tensor, group: int, k_payload: torch.Tensor,
                     pairs: int) -> str | None:
    """The kind of pages of a decode step that goes here when ``cfg`` names no kernel, else
    ``None``: its kind is in ``kinds`` (``triton_attention.GLUON_DECODE``) and the launch's
    ``pairs`` (rows x kv heads) within that kind's limit, ``cfg`` sets nothing of the MMA
    kernel's (a tile, stages, warps, int8 queries off), the kernel can run it, and it has not
    failed here."""
    if cfg.block_m or cfg.block_n or cfg.num_stages or cfg.num_warps or cfg.int8_queries is False:
        return None
    kind = pages_kind(k_fmt, v_fmt, q, k_payload)
    if kind not in kinds or kind in FAILED or (kinds[kind] is not None and pairs > kinds[kind]):
        return None
    return kind if supported(k_fmt, v_fmt, q, group, k_payload, kind=kind) is None else None


def try_decode(q, k_payload, v_payload, k_fmt, v_fmt, *, kind: str, **kw) -> torch.Tensor | None:
    """A step over pages of ``kind`` that :func:`takes_by_default` sent here, or ``None`` when the
    kernel fails on this GPU (a compile or launch error): then this kind of pages is put in
    :data:`FAILED`, with one warning, and the caller's other kernel takes this step and the next
    ones."""
    try:
        return _step(q, k_payload, v_payload, k_fmt, v_fmt, kind=kind, **kw)
    except Exception as e:  # any failure of an optional kernel: the MMA kernel serves
        FAILED[kind] = f"{type(e).__name__}: {e}"
        warnings.warn(
            f"the Gluon decode kernel failed on {kind} pages ({FAILED[kind][:200]}); their decode steps "
            "go to the MMA kernel from now on", RuntimeWarning, stacklevel=3,
        )
        return None


def decode(q, k_payload, v_payload, k_fmt, v_fmt, *, cfg, **kw) -> torch.Tensor:
    """A decode step (``q`` ``[B, Hq, 1, D]``) asked of this kernel by name; ``cfg``'s ``block_n``
    (default by page kind, :data:`TILING`), ``num_stages`` (default 2) and ``num_warps`` (default
    :data:`TILING`'s) set the tile, the ring and the warps a program.
    Raises ``ValueError`` naming what it cannot run."""
    if (cfg.block_n not in (None, 16, 32, 64, 128) or (cfg.num_stages is not None and cfg.num_stages < 2)
            or cfg.num_warps not in (None, 1, 2, 4)):
        raise ValueError(
            f"decode_kernel='gluon' takes block_n 16, 32, 64 or 128, num_stages >= 2 (a tile in flight "
            f"while one is scored) and num_warps 1, 2 or 4, got block_n={cfg.block_n}, "
            f"num_stages={cfg.num_stages}, num_warps={cfg.num_warps}; leave them unset for the defaults"
        )
    kind = pages_kind(k_fmt, v_fmt, q, k_payload)
    why = supported(k_fmt, v_fmt, q, q.shape[1] // k_payload.shape[2], k_payload, kind=kind)
    if why is not None:
        raise ValueError(f"decode_kernel='gluon' cannot take this step: {why}; leave decode_kernel unset")
    return _step(q, k_payload, v_payload, k_fmt, v_fmt, kind=kind, cfg=cfg, **kw)


def _step(q, k_payload, v_payload, k_fmt, v_fmt, *, kind, block_tables, kv_len, q_start, capacity, scale, out,
          out_dtype, cfg) -> torch.Tensor:
    # that module imports this one
    from kvtier.kernels.triton_attention import LOG2E, merge_splits, split_partials

    B, Hq, _, D = q.shape
    p = plan(kind, B, Hq, k_payload.shape[2], D, capacity, q.device, cfg, warps=WARPS, resident=RESIDENT, ahead=AHEAD,
             swap=SWAP, raw=RAW)
    if out is None:
        out = torch.empty((B, Hq, 1, D), dtype=out_dtype, device=q.device)
    po, pl = split_partials(out, p.splits)
    sm_scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    launch_decode(q, k_payload, v_payload, k_fmt.scale, v_fmt.scale, block_tables, kv_len, q_start, capacity, out, po, pl,
                  kind=kind, qk_scale=sm_scale * LOG2E, splits=p.splits, split_len=p.split_len, block_n=p.block_n,
                  stages=p.stages, warps=p.warps, k_zero=k_fmt.zero, v_zero=v_fmt.zero, maxnreg=p.launch.maxnreg,
                  stack=p.launch.stack, ahead=p.ahead, raw=p.launch.raw, swap=p.launch.swap)
    merge_splits(po, pl, out, p.splits, p.base, p.split_len, p.block_n)  # as the MMA kernel's launch
    return out
