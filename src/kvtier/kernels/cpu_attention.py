"""Decode attention over float32, q8 or fp8 pages on the CPU: a small C kernel that reads the pages in place.

The PyTorch reference (:func:`kvtier.kernels.paged.paged_attention_reference`) gathers
each row's pages into a contiguous copy and calls SDPA on it; at 32 rows of 64-576
tokens that gather is a third of a decode step. :func:`paged_decode_cpu` computes the
same attention for a decode step (one query per row) straight from the page table:

- one task per row (per row and KV head when there are fewer than twice as many rows
  as threads), spread over PyTorch's OpenMP threads;
- a task reads each of its row's blocks whole (``[block_size, H_kv, D]`` is
  contiguous) and asks for the next block while it scores the current one;
- two passes: scores of every query head of the KV head's group (``q . k * scale``),
  then softmax weights and the weighted sum of the values, in float32.

Only the order of the float32 sums differs from the reference (and, for coded pages,
that a key's scale multiplies its score instead of each element, and fp8's key centre
is left out, which the softmax ignores). The kernel covers float32 queries over float32
pages of the lossless codec, ``q8`` pages (int8 codes) and ``fp8`` pages (e4m3 bytes
through a 256-entry table), with a float32 scale per token and head; anything else
returns ``None`` and the caller serves the reference. Table entries and lengths are checked
inside the kernel, before anything is read: a bad one raises ``ValueError``.

Example::

    >>> out = paged_decode_cpu(q, kp, vp, tables, q_start, kv_len, k_codec=c, v_codec=c,
    ...                        k_sidecars={}, v_sidecars={})   # doctest: +SKIP
"""

from __future__ import annotations

import ctypes
import functools
import math

import torch

from kvtier.kernels.native import load_or_warn
from kvtier.quant.codec import Codec, IdentityCodec
from kvtier.quant.fp8 import FP8_DTYPE, Fp8Codec
from kvtier.quant.kv_quant import Q8Codec

_C_SOURCE = r"""
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>
/* out[b, h*G + g] = softmax_j(q[b, h*G + g] . k[b, j, h] * scale) @ v[b, j, h] over keys
   first[b] <= j < min(kv_len[b], q_start[b] + 1) (first NULL: 0, a sliding window's first key
   otherwise), pages [num_blocks, bs, Hkv, D]: float32 values (CODE
   0), or one byte per element with one float32 scale per (token, head), [num_blocks, bs,
   Hkv, 1]: int8 codes (CODE 1, q8) or codes looked up in a 256-entry table (CODE 2, fp8's
   e4m3 bytes); a key is q . codes * its scale, a value codes * its scale. A task is (row b,
   a run of Hkv / hsplit KV heads). The entry points return 0; b + 1 when row b is longer
   than its table or names a block outside [0, num_blocks) (checked first: nothing is
   read); -1 when scratch memory ran out. One task body serves every storage: each entry
   point's parallel loop inlines it with CODE a constant, and with D a constant for head
   dims 64 and 128, so each gets its own loops (a constant D also drops the vector loops'
   peeling and remainders, which cost more than the work at D = 64). */
typedef struct {
  const float* q; int64_t q_sb, q_sh; const void *kp, *vp; const float *ks, *vs, *lut;
  const int32_t* tables; const int64_t *q_start, *kv_len, *first; float* out;
  int64_t B, Hq, Hkv, D, bs, max_blocks, num_blocks; float scale; int64_t hsplit;
} Args;

static int check(const Args* a) {
  for (int64_t b = 0; b < a->B; b++) {
    const int64_t n = a->kv_len[b] < a->q_start[b] + 1 ? a->kv_len[b] : a->q_start[b] + 1;
    const int32_t* tb = a->tables + b * a->max_blocks;
    if (n > a->max_blocks * a->bs) return (int)(b + 1);
    for (int64_t i = 0; i < (n + a->bs - 1) / a->bs; i++)
      if (tb[i] < 0 || tb[i] >= a->num_blocks) return (int)(b + 1);
  }
  return 0;
}

/* one task; 1 when its scratch could not be allocated */
static inline __attribute__((always_inline)) int task(const Args* a, int64_t task, const int CODE,
                                                     const int64_t DC) {
  const int64_t Hkv = a->Hkv, D = DC ? DC : a->D, bs = a->bs, G = a->Hq / Hkv, Hrun = Hkv / a->hsplit;
  const int64_t blk = bs * Hkv * D, width = CODE ? 1 : 4;
  const float* lut = a->lut;
  const int64_t b = task / a->hsplit, h0 = (task % a->hsplit) * Hrun;
  const int64_t n = a->kv_len[b] < a->q_start[b] + 1 ? a->kv_len[b] : a->q_start[b] + 1;
  const int64_t lo = a->first ? a->first[b] : 0;  /* keys before it: out of the window */
  float* o = a->out + (b * a->Hq + h0 * G) * D;
  if (n <= lo) { memset(o, 0, Hrun * G * D * sizeof(float)); return 0; }
  const int32_t* tb = a->tables + b * a->max_blocks;
  const int64_t nblk = (n + bs - 1) / bs, R = Hrun * G;
  float* s = malloc((R * n + R * D + R) * sizeof(float));  /* scores [R, n], acc [R, D], sums [R] */
  if (!s) return 1;
  float* acc = s + R * n;
  float* sum = acc + R * D;
  memset(acc, 0, R * D * sizeof(float));
  for (int64_t pass = 0; pass < 2; pass++) {  /* 0: scores from the keys, 1: sum of the values */
    const char* pages = pass == 0 ? (const char*)a->kp : (const char*)a->vp;
    const float* scales = pass == 0 ? a->ks : a->vs;
    for (int64_t i = 0; i < nblk; i++) {
      const int64_t at = (int64_t)tb[i] * blk;  /* the block's first element */
      if (i + 1 < nblk) {  /* the next block's rows of these heads, while this one is used */
        const char* next = pages + ((int64_t)tb[i + 1] * blk + h0 * D) * width;
        for (int64_t t = 0; t < bs; t++)
          for (int64_t c = 0; c < Hrun * D * width; c += 64) __builtin_prefetch(next + t * Hkv * D * width + c);
      }
      const int64_t m = n - i * bs < bs ? n - i * bs : bs;
      for (int64_t t = 0; t < m; t++) {
        const int64_t j = i * bs + t;
        if (j < lo) {  /* out of the window: weight 0 */
          for (int64_t r = 0; pass == 0 && r < R; r++) s[r * n + j] = -INFINITY;
          continue;
        }
        for (int64_t h = 0; h < Hrun; h++) {
          const int64_t row = at + (t * Hkv + h0 + h) * D;  /* the (token, head) vector's element */
          const float* xf = (const float*)pages + row;
          const int8_t* xq = (const int8_t*)pages + row;
          const uint8_t* xb = (const uint8_t*)pages + row;
          const float xs = CODE ? scales[row / D] : 1.f;
          float codes[D];  /* the vector's codes as floats, once for the whole query group */
          const float* x = xf;
          if (CODE) {
            #pragma omp simd
            for (int64_t d = 0; d < D; d++) codes[d] = CODE == 1 ? (float)xq[d] : lut[xb[d]];
            x = codes;
          }
          for (int64_t g = 0; g < G; g++) {
            const int64_t r = h * G + g;
            if (pass == 0) {
              const float* qr = a->q + b * a->q_sb + ((h0 + h) * G + g) * a->q_sh;
              float dot = 0.f;
              #pragma omp simd reduction(+:dot)
              for (int64_t d = 0; d < D; d++) dot += qr[d] * x[d];
              s[r * n + j] = dot * xs * a->scale;
            } else {
              const float p = s[r * n + j] * xs;
              float* ar = acc + r * D;
              #pragma omp simd
              for (int64_t d = 0; d < D; d++) ar[d] += p * x[d];
            }
          }
        }
      }
    }
    if (pass == 0) {  /* scores -> exp(score - max); their sum divides at the end */
      for (int64_t r = 0; r < R; r++) {
        float* sr = s + r * n;
        float mx = sr[lo], tot = 0.f;
        #pragma omp simd reduction(max:mx)
        for (int64_t j = lo + 1; j < n; j++) mx = sr[j] > mx ? sr[j] : mx;
        for (int64_t j = 0; j < n; j++) { sr[j] = expf(sr[j] - mx); tot += sr[j]; }
        sum[r] = tot;
      }
    }
  }
  for (int64_t r = 0; r < R; r++) {
    const float inv = 1.f / sum[r];
    for (int64_t d = 0; d < D; d++) o[r * D + d] = acc[r * D + d] * inv;
  }
  free(s);
  return 0;
}

#define ENTRY(NAME, CODE)                                                                       \
  int NAME(const float* q, int64_t q_sb, int64_t q_sh, const void* kp, const void* vp,          \
           const float* ks, const float* vs, const float* lut, const int32_t* tables,           \
           const int64_t* q_start, const int64_t* kv_len, const int64_t* first,                 \
           float* out, int64_t B, int64_t Hq, int64_t Hkv, int64_t D,                           \
           int64_t bs, int64_t max_blocks, int64_t num_blocks, float scale, int64_t hsplit,     \
           int threads) {                                                                       \
    const Args a = {q, q_sb, q_sh, kp, vp, ks, vs, lut, tables, q_start, kv_len, first, out,    \
                    B, Hq, Hkv, D, bs, max_blocks, num_blocks, scale, hsplit};                  \
    const int bad = check(&a);                                                                  \
    if (bad) return bad;                                                                        \
    int failed = 0;                                                                             \
    _Pragma("omp parallel for schedule(dynamic, 1) num_threads(threads)")                        \
    for (int64_t t = 0; t < B * hsplit; t++) {                                                  \
      const int oom = D == 64 ? task(&a, t, CODE, 64) : D == 128 ? task(&a, t, CODE, 128)       \
                                                                 : task(&a, t, CODE, 0);        \
      if (oom) {                                                                                \
        _Pragma("omp atomic write")                                                             \
        failed = 1;                                                                             \
      }                                                                                         \
    }                                                                                           \
    return failed ? -1 : 0;                                                                     \
  }
ENTRY(paged_decode_f32, 0)
ENTRY(paged_decode_q8, 1)
ENTRY(paged_decode_fp8, 2)
"""

class CpuAttentionKernels:
    """The compiled entry points of :data:`_C_SOURCE` (``paged_decode_f32``, ``_q8``, ``_fp8``),
    called through ctypes."""

    def __init__(self, lib: ctypes.CDLL):
        self._decode = {"fp": lib.paged_decode_f32, "q8": lib.paged_decode_q8, "fp8": lib.paged_decode_fp8}
        for fn in self._decode.values():
            fn.argtypes = ([ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64] + [ctypes.c_void_p] * 10
                           + [ctypes.c_int64] * 7 + [ctypes.c_float, ctypes.c_int64, ctypes.c_int])
            fn.restype = ctypes.c_int
        # fp8's table: the float32 value of every e4m3 byte (NaN for the two NaN codes)
        self._e4m3 = torch.arange(256, dtype=torch.uint8).view(FP8_DTYPE).float() if FP8_DTYPE else None

    def decode(self, storage, q, key_pages, value_pages, k_scale, v_scale, block_tables, q_start, kv_len,
               scale, out, first=None) -> None:
        """Run the kernel for ``storage`` (``"fp"``, ``"q8"`` or ``"fp8"``) on checked tensors
        (see :func:`paged_decode_cpu`) into ``out``; ``k_scale``/``v_scale``: the codes' scales;
        ``first``: int64 ``[B]``, each row's first key (``None``: 0)."""
        B, Hq = q.shape[:2]
        num_blocks, bs, Hkv, D = key_pages.shape
        threads = torch.get_num_threads()
        few_rows = q.shape[0] < 2 * threads
        hsplit = Hkv if few_rows else 1  # split the rows by KV head too
        ks, vs = (None, None) if k_scale is None else (k_scale.data_ptr(), v_scale.data_ptr())
        lut = self._e4m3.data_ptr() if storage == "fp8" else None
        bad = self._decode[storage](
            q.data_ptr(), q.stride(0), q.stride(1), key_pages.data_ptr(), value_pages.data_ptr(), ks, vs, lut,
            block_tables.data_ptr(), q_start.data_ptr(), kv_len.data_ptr(),
            None if first is None else first.data_ptr(), out.data_ptr(),
            B, Hq, Hkv, D, bs, block_tables.shape[1], num_blocks, scale, hsplit, threads,
        )  # fmt: skip
        if bad < 0:
            raise MemoryError(f"the CPU decode kernel could not allocate its scores ({B} rows)")
        if bad:
            b = bad - 1
            n = min(int(kv_len[b]), int(q_start[b]) + 1)
            used = block_tables[b, : max(0, -(-n // bs))].tolist()
            raise ValueError(
                f"row {b} reads {n} keys (kv_len {int(kv_len[b])}, q_start {int(q_start[b])}) from "
                f"{block_tables.shape[1]} table columns of {bs} tokens: its blocks {used} must lie in "
                f"[0, {num_blocks}) and number at least ceil({n} / {bs})"
            )


@functools.cache
def load_kernels() -> CpuAttentionKernels | None:
    """Compile (once per machine, :mod:`kvtier.kernels.native`) and load the kernel; ``None``
    where no C compiler builds it (a warning says why; the reference then serves every call)."""
    return load_or_warn("cpu_attention", _C_SOURCE, CpuAttentionKernels, "the PyTorch reference serves")


def paged_decode_cpu(
    q: torch.Tensor,
    key_pages: torch.Tensor,
    value_pages: torch.Tensor,
    block_tables: torch.Tensor,
    q_start: torch.Tensor,
    kv_len: torch.Tensor,
    *,
    k_codec: Codec,
    v_codec: Codec,
    k_sidecars: dict[str, torch.Tensor],
    v_sidecars: dict[str, torch.Tensor],
    scale: float | None = None,
    first: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """A decode step's attention ``[B, H_q, 1, D]`` float32, or ``None`` where the kernel does not serve.

    Arguments as :func:`kvtier.kernels.paged.paged_attention_reference`: ``q``
    ``[B, H_q, 1, D]`` float32 (last dim contiguous); pages ``[num_blocks, block_size,
    H_kv, D]``, contiguous: float32 of the lossless codec, or the one-byte codes of ``q8``
    or ``fp8`` (both keys and values, codecs of float32) with their ``scale`` sidecars
    ``[num_blocks, block_size, H_kv, 1]`` (fp8's key centre is left out: it shifts every
    score of a query by the same ``q . c``, which the softmax ignores); ``block_tables``
    int32 ``[B, max_blocks]``; ``q_start``, ``kv_len`` integer ``[B]``. Row ``b`` attends to keys ``j < min(kv_len[b],
    q_start[b] + 1)`` and, with ``first`` (integer ``[B]``: a sliding window's first key), ``j >=
    first[b]``; a row that sees none gets zeros. ``None`` for anything else (more
    than one query per row, another dtype or codec, a tensor off the CPU, no C
    compiler): the reference serves those.
    """
    storage = _storage(k_codec, v_codec, key_pages, value_pages, k_sidecars, v_sidecars)
    if (
        storage is None
        or q.dim() != 4 or q.shape[2] != 1 or q.dtype != torch.float32 or q.device.type != "cpu"
        or q.stride(3) != 1 or key_pages.shape[3] != q.shape[3] or q.shape[1] % key_pages.shape[2]
        or block_tables.dtype != torch.int32 or block_tables.dim() != 2 or block_tables.shape[0] != q.shape[0]
        or block_tables.device.type != "cpu"
    ):  # fmt: skip
        return None
    kernels = load_kernels()
    if kernels is None:
        return None
    B = q.shape[0]
    rows = [t.to(torch.int64).contiguous() for t in (q_start, kv_len, *([] if first is None else [first]))]
    if any(tuple(t.shape) != (B,) for t in rows):
        raise ValueError(f"q_start, kv_len and first must be [{B}], got {[tuple(t.shape) for t in rows]}")
    if first is not None and bool((rows[2] < 0).any()):
        raise ValueError(f"first must be >= 0 per row (a row's first key), got {rows[2].tolist()}")
    block_tables = block_tables.contiguous()  # (a plan's table is a view of its columns)
    out = torch.empty(B, q.shape[1], 1, q.shape[3], dtype=torch.float32)
    scale = 1.0 / math.sqrt(q.shape[3]) if scale is None else scale
    k_scale, v_scale = (None, None) if storage == "fp" else (k_sidecars["scale"], v_sidecars["scale"])
    kernels.decode(storage, q, key_pages, value_pages, k_scale, v_scale, block_tables, *rows[:2], scale, out,
                   *rows[2:])
    return out


#: coded pages the kernel reads: the codec, its storage name and its payload dtype
_CODED = {Q8Codec: ("q8", torch.int8), Fp8Codec: ("fp8", torch.uint8)}


def _storage(k_codec, v_codec, key_pages, value_pages, k_sidecars, v_sidecars) -> str | None:
    """``"fp"``, ``"q8"`` or ``"fp8"`` where the kernel reads these pages, else ``None``."""
    pages = (key_pages, value_pages)
    if (
        key_pages.dim() != 4 or key_pages.shape != value_pages.shape
        or any(not p.is_contiguous() or p.device.type != "cpu" for p in pages)
        or type(k_codec) is not type(v_codec) or k_codec.dtype != torch.float32 or v_codec.dtype != torch.float32
    ):  # fmt: skip
        return None
    if type(k_codec) is IdentityCodec and all(p.dtype == torch.float32 for p in pages):
        return "fp"
    codes = _CODED.get(type(k_codec))
    if codes is None or v_codec.centre is not None or any(p.dtype != codes[1] for p in pages):
        return None
    want = (*key_pages.shape[:3], 1)
    scales = [side.get("scale") for side in (k_sidecars, v_sidecars)]
    if all(isinstance(t, torch.Tensor) and tuple(t.shape) == want and t.dtype == torch.float32
           and t.is_contiguous() and t.device.type == "cpu" for t in scales):
        return codes[0]  # a key centre needs nothing: it moves every score of a query alike
    return None


__all__ = ["paged_decode_cpu", "load_kernels", "CpuAttentionKernels"]
