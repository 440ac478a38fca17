"""The asynchronous copies of a tile of paged keys and values into shared memory, for the Gluon
decode kernels (:mod:`kvtier.kernels.gluon_decode`, :mod:`kvtier.kernels.gluon_swap`): a
split's keys, the tile's pages from the block table, then its rows of codes (or 16-bit values)
and, for quantised pages, their scales and zeros."""

from __future__ import annotations

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy as cp

    # Triton 3.6 names the asynchronous copy async_copy_global_to_shared, 3.9 async_load
    _async_load = getattr(cp, "async_load", None) or cp.async_copy_global_to_shared
    HAVE_GLUON = True
except ImportError:  # pragma: no cover - Triton without Gluon
    HAVE_GLUON = False


if HAVE_GLUON:

    @gluon.constexpr_function
    def tile_layout(vec, row, elem_bytes):
        """The swizzled shared layout of a tile of rows of ``row`` elements of ``elem_bytes``
        bytes, copied ``vec`` elements a chunk, so that eight rows' chunks read together (one
        8 x 16-byte matrix of ``ldmatrix``) fall on distinct banks: rows share a phase while they
        fit in one 128-byte bank line, and the phases cycle over the chunks a line holds (64-byte
        rows, q4's at head_dim 128: two rows a phase, four phases; one row a phase and eight were
        a two-way conflict). The same bytes seen with other elements
        (:func:`~kvtier.kernels.gluon_codes.as_int16`) take the same swizzle."""
        row_bytes, vec_bytes = row * elem_bytes, vec * elem_bytes
        per_phase = max(1, 128 // row_bytes)
        max_phase = max(1, min(8 // per_phase, row_bytes // vec_bytes))
        return gl.SwizzledSharedLayout(vec=vec, per_phase=per_phase, max_phase=max_phase, order=[1, 0])

    @gluon.jit
    def split_keys(KVLEN, QSTART, capacity, b, pid_s, split_len, BLOCK_N: gl.constexpr, CAUSAL: gl.constexpr):
        """The keys ``lo .. hi - 1`` of row ``b`` that split ``pid_s`` (of ``split_len`` keys)
        attends to, and their tiles of ``BLOCK_N``: the row's keys below its length (at most
        ``capacity``; ``CAUSAL``: up to its query's place, ``QSTART``)."""
        kv_len = gl.minimum(gl.load(KVLEN + b).to(gl.int32), capacity)
        if CAUSAL:  # the query sits at q_start: it sees keys 0 .. q_start
            kv_len = gl.minimum(kv_len, gl.load(QSTART + b).to(gl.int32) + 1)
        lo = pid_s * split_len
        hi = gl.minimum(kv_len, lo + split_len)
        return lo, hi, gl.cdiv(gl.maximum(hi - lo, 0), BLOCK_N)

    @gluon.jit
    def tile_pages(BT, bt_row, n0, hi, BLOCK_N: gl.constexpr, PAGE: gl.constexpr, CP: gl.constexpr, SC: gl.constexpr,
                   QUANT: gl.constexpr):  # fmt: skip
        """The pages of the tile of keys ``n0 ..`` from the block table, in the layouts of the
        copies of its rows (``CP``) and of its scales (``SC``; ``QUANT`` only)."""
        n = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, CP))
        blk = gl.load(bt_row + n.to(gl.uint32) // PAGE, mask=n < hi, other=0)
        if QUANT:
            ns = n0 + gl.arange(0, BLOCK_N, layout=SC)
            blks = gl.load(bt_row + ns.to(gl.uint32) // PAGE, mask=ns < hi, other=0)
        else:
            blks = blk
        return blk, blks

    @gluon.jit
    def issue_tile(
        K, V, KS, VS, KZ, VZ, blk, blks, k_smem, v_smem, ks_smem, vs_smem, kz_smem, vz_smem, stage, n0, hi, hk,
        stride_kb, stride_kn, stride_kh, stride_vb, stride_vn, stride_vh,
        stride_ksb, stride_ksn, stride_ksh, stride_vsb, stride_vsn, stride_vsh,
        BLOCK_N: gl.constexpr, DP: gl.constexpr, PAGE: gl.constexpr, CP: gl.constexpr, SC: gl.constexpr,
        QUANT: gl.constexpr, LIKE: gl.constexpr, NG: gl.constexpr, SG: gl.constexpr, TQ: gl.constexpr,
        CPV: gl.constexpr,
    ):  # fmt: skip
        """Asynchronous copies of the tile of keys ``n0 ..`` (on pages ``blk``; codes and,
        ``QUANT``, scales on pages ``blks``) into ``stage``. ``LIKE``: the values' (and their
        scales') strides are the keys': one offset a row serves both. ``NG`` > 0: ``NG`` scales
        and zeros a token (``KZ``, ``VZ``, with the scales' strides), in the layout ``SG``.
        ``TQ``: TurboQuant's values (int32 words, three a group of 3-bit codes, each group copied
        into a slot of four in the layout ``CPV``) and no zeros of theirs."""
        n = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, CP))
        ok2 = gl.expand_dims(n < hi, 1)
        pos = n.to(gl.uint32) % PAGE
        d = gl.expand_dims(gl.arange(0, DP, layout=gl.SliceLayout(0, CP)), 0)
        k_rows = gl.expand_dims(blk.to(gl.int64) * stride_kb + (pos * stride_kn + hk * stride_kh), 1) + d
        _async_load(k_smem.index(stage), K + k_rows, mask=ok2)
        if TQ:  # the same rows in CPV: word j of a row's copy is word 3 (j / 4) + j % 4 of its page row
            ROWV: gl.constexpr = gl.SliceLayout(1, CPV)
            j = gl.expand_dims(gl.arange(0, 4 * NG, layout=gl.SliceLayout(0, CPV)), 0)
            rows = gl.convert_layout(blk.to(gl.int64) * stride_vb + (pos * stride_vn + hk * stride_vh), ROWV,
                                     assert_trivial=True)  # fmt: skip
            okv = gl.convert_layout(n < hi, ROWV, assert_trivial=True)
            v_rows = gl.expand_dims(rows, 1) + ((j // 4) * 3 + j % 4)
            _async_load(v_smem.index(stage), V + v_rows, mask=gl.expand_dims(okv, 1) & (j % 4 < 3))
        else:
            if LIKE:
                v_rows = k_rows
            else:
                v_rows = gl.expand_dims(blk.to(gl.int64) * stride_vb + (pos * stride_vn + hk * stride_vh), 1) + d
            _async_load(v_smem.index(stage), V + v_rows, mask=ok2)
        if QUANT:
            ns = n0 + gl.arange(0, BLOCK_N, layout=SC)
            oks = ns < hi
            poss = ns.to(gl.uint32) % PAGE
            ks_rows = blks.to(gl.int64) * stride_ksb + (poss * stride_ksn + hk * stride_ksh)
            if LIKE:
                vs_rows = ks_rows
            else:
                vs_rows = blks.to(gl.int64) * stride_vsb + (poss * stride_vsn + hk * stride_vsh)
            if NG > 0:  # (BLOCK_N, NG) scales and zeros, NG a row: copies of 2 NG bytes
                g = gl.expand_dims(gl.arange(0, NG, layout=gl.SliceLayout(0, SG)), 0)
                ks_rows = gl.expand_dims(gl.multiple_of(ks_rows, NG), 1) + g
                vs_rows = gl.expand_dims(gl.multiple_of(vs_rows, NG), 1) + g
                oks = gl.expand_dims(oks, 1)
                _async_load(kz_smem.index(stage), KZ + ks_rows, mask=oks)
                if not TQ:
                    _async_load(vz_smem.index(stage), VZ + vs_rows, mask=oks)
            _async_load(ks_smem.index(stage), KS + ks_rows, mask=oks)
            _async_load(vs_smem.index(stage), VS + vs_rows, mask=oks)
        cp.commit_group()
