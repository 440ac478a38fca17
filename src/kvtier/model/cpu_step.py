"""A whole decode step of one sequence on the CPU in one C call (or a few tokens of it).

At one token the default model's decode step is 30 layers of small operations: four
matrix-vector products, two RMSNorms, RoPE, the cache write, attention and the SiLU
product each. The products read the weights (about 97 MB of block codes, the step's
real work); everything else is microseconds of PyTorch dispatch and Python per op,
which on the 2-core box added up to more than the products themselves. :class:`DecodeStep`
runs the same arithmetic for every layer, the final norm and the LM head inside one
OpenMP parallel region of a C function (:mod:`kvtier.model.step_kernels`):

- the products are the packed kernels' own task bodies (:mod:`kvtier.model.packed`:
  Q4_1 and Q8_0 codes, bit for bit the same outputs as :class:`PackedLinear`), or a
  float32 dot product for a layer that stayed float32; the threads share each product
  and meet at a barrier after it, instead of starting a parallel region per product;
- the add-and-RMSNorm, RoPE and SiLU product are the C kernels of
  :mod:`kvtier.kernels.cpu_fused` (the layered path's own arithmetic);
- the new key and value are written into the :class:`~kvtier.caches.tail_owned.TailOwnedKVCache`
  buffers at each layer's offset, and attention reads them in place: one task per KV head
  and split of its keys (at least 64 keys a split, four tasks a thread where the context
  allows), which reads each key and value row once for the head's whole query group and
  leaves its largest score, softmax sum and weighted values; a second pass merges the
  splits of each query head. Scores, the exponentials (eight at a time with AVX2, a
  polynomial within 2 units in the last place of ``expf``) and sums are float32.

So the logits differ from the layered forward only in attention's arithmetic (summation
order, the exponential), by float32 rounding. With int8 activations (``KVTIER_ACT_QUANT=q8``,
``model.act_quant``; :mod:`kvtier.model.act_quant`) the packed products multiply int8 codes of
their inputs instead: faster, and an approximation.

It serves :meth:`kvtier.model.llama.Transformer.forward` for one sequence and up to
:data:`MAX_TOKENS` tokens (a decode step, a speculative verification, a short prompt; token
``t`` of a call attends to the keys up to its own position) on the CPU in float32, without gradients and outside ``torch.compile``, when every layer's
cache is a tail-tier cache of that sequence and every projection is a
:class:`PackedLinear` or a float32 :class:`~kvtier.model.linear.Linear` (Llama, Mistral
and Qwen2 shapes; Qwen3's q/k norms keep the layered path). Anything else, and
``KVTIER_FUSED=0`` or ``KVTIER_DECODE_STEP=0``, takes the layered forward. The plan of
pointers is built once per model and rebuilt when a layer's modules or tensors change.

Example::

    >>> lm = load_model()                                # the default model, packed  # doctest: +SKIP
    >>> caches = lm.model.make_caches()                  # tail tier by default
    >>> lm.model(prompt_ids, caches)                     # a long prefill: the layered forward
    >>> lm.model(torch.tensor([[token]]), caches)        # one token: one C call
    >>> lm.model(torch.tensor([drafts]), caches)         # up to 16 tokens: one C call
"""

from __future__ import annotations

import ctypes
import functools
import weakref

import torch
from torch import nn

from kvtier.caches.paged import PagedKVCache
from kvtier.caches.tail_owned import TailOwnedKVCache
from kvtier.config import switched_off
from kvtier.kernels.reference import window_start
from kvtier.model import packed
from kvtier.model.act_quant import act_quant_of
from kvtier.model.linear import Linear
from kvtier.model.step_kernels import Kernels as _Kernels
from kvtier.model.step_kernels import Layer as _Layer
from kvtier.model.step_kernels import Lin as _Lin
from kvtier.model.step_kernels import Paged as _Paged
from kvtier.model.step_kernels import load_kernels
from kvtier.quant.codec import IdentityCodec
from kvtier.quant.fp8 import Fp8Codec
from kvtier.quant.kv_quant import GroupQ4Codec, Q4Codec, Q8Codec
from kvtier.quant.turboquant import TurboKeyCodec, TurboValueCodec

__all__ = ["DENSE_ROWS", "DENSE_ROWS_AVX512", "DecodeStep", "decode_step_enabled", "forget", "load_kernels", "plan_for"]

_FORMATS = {"float32": 0, "q4_1": 1, "q8_0": 2}
#: most tokens one call takes (a speculative verification, a short prompt); longer inputs take the
#: layered forward, whose prefill multiplies dequantised weights
MAX_TOKENS = 16
#: most tokens a call of a plan whose weights are mostly dense float32 (:attr:`DecodeStep.dense`)
#: is worth taking on a build without AVX-512 (:meth:`DecodeStep.takes_rows`), whose float32
#: products are plain loops: the default model's dense step at a 200-token context, 2-core CPU,
#: against the layered forward: 4 rows 48.4 against 54.4 ms, 8 rows 69.8 against 62.4 ms. With
#: AVX-512 they take a row block's weights once (``dense_rows_task``) and beat the layered forward
#: at every count measured, up to :data:`DENSE_ROWS_AVX512`: an engine's decode steps of 8, 32
#: and 128 rows 1.48x, 1.16x and 1.03x the throughput (2-core Zen 4, 2026-12-07)
DENSE_ROWS = 4
DENSE_ROWS_AVX512 = 128


def decode_step_enabled() -> bool:
    """Whether the environment allows the one-call step (``KVTIER_FUSED`` and
    ``KVTIER_DECODE_STEP`` not ``0``/``false``/``no``/``off``)."""
    return not (switched_off("KVTIER_FUSED") or switched_off("KVTIER_DECODE_STEP"))


def _cpu_f32(t: torch.Tensor | None) -> bool:
    return t is None or (t.device.type == "cpu" and t.dtype == torch.float32 and t.is_contiguous())


def _kv_buffers(k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether the step reads and writes these buffers: float32, or float16 (``kv_dtype``)."""
    return (k.device.type == "cpu" and k.dtype in (torch.float32, torch.float16) and v.dtype == k.dtype
            and k.is_contiguous() and v.is_contiguous())


def _linear_entry(lin: nn.Module, keep: list) -> _Lin | None:
    """The C description of one projection, or ``None`` when the step cannot run it."""
    if type(lin) not in (packed.PackedLinear, Linear):  # (tensor-parallel shards, adapters, ...)
        return None
    bias = lin.bias
    if not _cpu_f32(bias):
        return None
    if type(lin) is packed.PackedLinear:
        ts = (lin.codes, lin.d, lin.m)
        if any(t is not None and (t.device.type != "cpu" or not t.is_contiguous()) for t in ts) \
                or lin.d.dtype != torch.float16 or (lin.m is not None and lin.m.dtype != torch.float16):
            return None
        fmt, w, d, m = _FORMATS[lin.fmt], lin.codes, lin.d, lin.m
    elif type(lin) is Linear:
        if not _cpu_f32(lin.weight):
            return None
        fmt, w, d, m = 0, lin.weight, None, None
    keep.extend(t for t in (w, d, m, bias) if t is not None)  # (the plan holds what it points at)
    ptr = lambda t: None if t is None else t.data_ptr()  # noqa: E731
    return _Lin(fmt, ptr(w), ptr(d), ptr(m), ptr(bias), lin.out_features, lin.in_features)


class DecodeStep:
    """The pointer plan of one :class:`~kvtier.model.llama.Transformer` for :func:`decode_step`.

    :meth:`build` returns ``None`` when the model does not qualify; :meth:`run` runs up to
    :data:`MAX_TOKENS` tokens, or returns ``None`` (nothing touched) when the input or the caches
    do not qualify. The plan refers to its model weakly: the model's plan is kept in a weak
    mapping keyed by the model, which must not keep the model alive.
    """

    def __init__(self, model, kernels: _Kernels, layers, head: _Lin, keep: list):
        a = model.args
        self._model = weakref.ref(model)
        self.kernels = kernels
        self.layers, self.head, self._keep = layers, head, keep
        self.dims = (a.dim, a.n_heads, a.n_kv_heads, a.head_dim, a.hidden_dim)
        self._like = torch.empty(1, a.n_kv_heads, 0, a.head_dim)  # the buffers' shape, for empty caches
        self.eps = float(model.norm.eps)
        self.scale = float(model.layers[0].attention.scale)
        #: the layers' sliding window (``None``: none; each layer's is its entry's ``window``, 0 for
        #: none): over a buffer (:meth:`run`) a step of several tokens reaching past it is left to the
        #: layered forward, which masks each query's own window; over pages each token past it
        #: attends alone (:meth:`run_paged`)
        self.window = a.sliding_window if a.windowed else None
        self.needs_grad = any(t.requires_grad for t in keep if isinstance(t, torch.Tensor))
        self._rope: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None  # cos, sin, inv_freq
        #: id(cache) -> weak references to the K / V buffers this plan checked (or grew) for it,
        #: their addresses and capacity: a step over the same buffers skips their checks, which
        #: cost about 10 us a cache after a step has swept the CPU's caches
        self._buffers: dict[int, tuple] = {}
        #: id(cache) -> weak references to the key and value pages :meth:`run_paged` checked for it
        self._page_checks: dict[int, tuple] = {}
        lins = [head] + [getattr(ly, f) for ly in layers for f in ("wqkv", "wo", "w13", "w2")]
        #: most of the weights are dense float32 (not packed codes): without AVX-512 the step's
        #: plain float32 loops then lose to oneDNN's matmuls from about :data:`DENSE_ROWS` rows
        self.dense = 2 * sum(x.N * x.K for x in lins if x.fmt == 0) > sum(x.N * x.K for x in lins)

    def rope_rows(self, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos / sin ``[P, D]`` of positions ``[0, P)``, ``P >= end``: the model's rotary module
        run once for a span of positions (grown 1,024 at a time) rather than every step (its
        values per position are the same bits either way)."""
        rope = self._rope  # (read once: another thread may replace it meanwhile)
        if rope is None or rope[0].shape[0] < end:
            P = -(-end // 1024) * 1024
            module = self.model.rope
            cos, sin = module(torch.arange(P).view(1, P), torch.float32)
            rope = self._rope = (cos.reshape(P, -1).contiguous(), sin.reshape(P, -1).contiguous(),
                                 module.inv_freq)
        return rope[0], rope[1]

    @property
    def model(self):
        return self._model()

    @staticmethod
    def key_objects(model) -> list:
        """What the plan's pointers depend on: every layer's modules and norms (the plan keeps
        them, so that no other object takes their ids while it lives). Read through the modules'
        own dicts: ``nn.Module.__getattr__`` would cost about half a millisecond a step."""
        mods = model._modules
        objs = [mods["tok_embeddings"]._parameters["weight"], mods["norm"]._parameters["weight"],
                mods["output"]]
        for layer in mods["layers"]._modules.values():
            sub = layer._modules
            at, ff = sub["attention"]._modules, sub["feed_forward"]._modules
            objs += [sub["attention_norm"]._parameters["weight"], sub["ffn_norm"]._parameters["weight"],
                     at["wqkv"], at["wo"], ff["w13"], ff["w2"]]
        return objs

    @classmethod
    def build(cls, model) -> DecodeStep | None:
        kernels = load_kernels()
        a = model.args
        if kernels is None or a.qk_norm or a.n_heads % a.n_kv_heads:
            return None
        keep: list = []
        layers = (_Layer * a.n_layers)()
        for i, layer in enumerate(model.layers):
            at, ff = layer.attention, layer.feed_forward
            norms = (layer.attention_norm.weight, layer.ffn_norm.weight)
            lins = [_linear_entry(at.wqkv, keep), _linear_entry(at.wo, keep),
                    _linear_entry(ff.w13, keep), _linear_entry(ff.w2, keep)]
            if any(x is None for x in lins) or not all(_cpu_f32(n) for n in norms):
                return None
            keep.extend(norms)
            layers[i].attn_norm, layers[i].ffn_norm = norms[0].data_ptr(), norms[1].data_ptr()
            layers[i].wqkv, layers[i].wo, layers[i].w13, layers[i].w2 = lins
            layers[i].window = a.window_of(i) or 0
        head = _linear_entry(model.output, keep)
        if head is None or not _cpu_f32(model.norm.weight) or not _cpu_f32(model.tok_embeddings.weight):
            return None
        keep += [model.norm.weight, model.tok_embeddings.weight]
        return cls(model, kernels, layers, head, keep + cls.key_objects(model))

    def run(self, tokens: torch.Tensor, caches, n: int, *, last_only: bool = False) -> torch.Tensor | None:
        """Logits ``[1, T, vocab]`` (``[1, 1, vocab]`` of the last with ``last_only``) of ``tokens``
        ``[1, T]``, ``T <= MAX_TOKENS``, through the first ``n`` layers, each writing into its cache;
        ``None``, with nothing changed, when a cache is not a tail-tier cache of one row taking
        float32 (stored as float32 or float16) of the model's shape, a token is out of range, or
        ``T > 1`` tokens reach past a sliding window (the layered forward then serves it, and raises
        what it raises). One token past a layer's window reads that layer's last ``window`` keys."""
        dim, Hq, Hkv, D, hidden = self.dims
        T = tokens.shape[1]
        if (torch.is_grad_enabled() and self.needs_grad) or not 1 <= T <= MAX_TOKENS or (
                T > 1 and self.window is not None and caches[0].offset + T > self.window):
            return None
        model = self.model
        act_q8 = act_quant_of(model) == "q8"  # (raises for a bad mode before anything changes)
        vocab = model.args.vocab_size
        ids = tokens[0].tolist()
        if min(ids) < 0 or max(ids) >= vocab:
            return None
        used = caches[:n]
        known = self._buffers
        recs = []  # per cache, what this plan recorded of its current buffers, else None
        for c in used:
            if type(c) is not TailOwnedKVCache:
                return None
            k, v = c.keys, c.values
            rec = known.get(id(c))
            if rec is not None and (k is None or rec[0]() is not k or rec[1]() is not v):
                rec = None
            recs.append(rec)
            if rec is None and k is not None and not (
                    k.shape[0] == 1 and k.shape[1] == Hkv and k.shape[3] == D and v.shape == k.shape
                    and c.dtype == torch.float32 and _kv_buffers(k, v)):
                return None
            if rec is None and k is None and c.kv_dtype not in (None, torch.float16):
                return None
        # this call's copy of the plan, and its own scratch: two threads may run one model on
        # two sequences' caches, as the layered forward allows
        layers = type(self.layers).from_buffer_copy(self.layers)
        stride = 0
        if len(known) > 4096:  # (entries of caches gone)
            known.clear()
        for layer, c, rec in zip(layers, used, recs):  # everything is checked: from here on it writes
            off = c.offset
            if rec is None or off + T > rec[4]:
                c.make_room(T, self._like, self._like)
                k, v = c.keys, c.values
                rec = known[id(c)] = (weakref.ref(k), weakref.ref(v), k.data_ptr(), v.data_ptr(),
                                      c.capacity, int(k.dtype == torch.float16))
            # one token past its layer's window: the buffers from the window's first key on (the rows'
            # addresses as before, the keys ahead of it out of sight)
            first = 0 if self.window is None else window_start(off, layer.window or None)
            skip = first * D * (2 if rec[5] else 4)
            layer.k, layer.v, layer.offset, layer.cap = rec[2] + skip, rec[3] + skip, off - first, rec[4]
            layer.kind = layer.vkind = rec[5]
            stride = max(stride, rec[4])
        start = caches[0].offset
        cos, sin = self.rope_rows(start + T)
        row = start * D * cos.element_size()  # (bytes to the first token's row)
        tokens = tokens.contiguous()  # (int64: the forward checked)
        kmax = -(-max(dim, hidden, Hq * D) // 32) * 32
        need = T * (dim * 4 + (3 * Hq + 3 * Hkv) * D + 3 * hidden) + Hq * T * stride \
            + Hq * T * (stride // 64 + 1) * (D + 2) + (T * (kmax // 4 + 2 * (kmax // 32)) if act_q8 else 0)
        scratch = torch.empty(need)
        rows = 1 if last_only else T
        logits = torch.empty(1, rows, vocab)
        self.kernels.decode_step(layers, n, ctypes.byref(self.head), model.norm.weight.data_ptr(),
                                 model.tok_embeddings.weight.data_ptr(), tokens.data_ptr(),
                                 cos.data_ptr() + row, sin.data_ptr() + row, T, None, rows, None, dim, Hq, Hkv, D,
                                 hidden, self.eps, self.scale, scratch.data_ptr(), stride,
                                 logits.data_ptr(), int(act_q8), 0, kmax, torch.get_num_threads())
        for c in used:
            c.commit_written(T)
        return logits

    def takes_rows(self, rows: int) -> bool:
        """Whether a decode call of ``rows`` tokens is worth the step rather than the layered
        forward: always, but where most weights are dense float32 only up to
        :data:`DENSE_ROWS_AVX512` with the AVX-512 loops for them
        (:attr:`~kvtier.model.step_kernels.Kernels.lanes`), :data:`DENSE_ROWS` without."""
        return not self.dense or rows <= (DENSE_ROWS_AVX512 if self.kernels.lanes >= 16 else DENSE_ROWS)

    def run_paged(self, tokens: torch.Tensor, positions: torch.Tensor, tables: torch.Tensor, caches,
                  select: torch.Tensor | None = None, *, invariant: bool = False) -> torch.Tensor | None:
        """Logits ``[len(select), vocab]`` (every token's without ``select``) of ``N`` tokens of
        several sequences over paged caches, each writing its key and value into every layer's
        pages: token ``t`` (``tokens`` int64 ``[N]``) at ``positions[t]`` (int64 ``[N]``), its
        pages those of block table ``tables[t]`` (int32 ``[N, W]``, every layer's alike), seeing
        the keys at positions ``<= positions[t]`` (a sequence's tokens of one call see one
        another's, as a verification's do); ``positions[t]`` must lie in the blocks the caller gave
        the token (a table's padding is read as block ids). ``None``, with nothing changed, when
        the caches are not one :class:`~kvtier.caches.paged.PagedKVCache` a layer with pages the
        step reads (float32 of the lossless codec, or ``q8``, ``q4``, ``fp8``, ``q4_g32`` or
        TurboQuant codes, which it writes as the codecs do: :func:`_page_kinds`), the model's
        shape and blocks of a power of two tokens, or an input is off the CPU. Tokens of one sequence
        at consecutive positions (a run) attend together, each key read once for them; a token past
        a layer's sliding window (:attr:`window`) attends alone, to its own window's keys. A token,
        position or block id out of range raises ``ValueError`` before anything is written.

        ``invariant``: every token's logits, keys and values the same bits whatever other tokens
        the call holds (batch-invariant): a lone token's products take the rows' loops instead of
        one row's own (:mod:`kvtier.model.packed_digits`), and attention splits each token's keys
        every 128 positions instead of by the call's size. Not bit-equal to ``invariant=False``."""
        dim, Hq, Hkv, D, hidden = self.dims
        model = self.model
        N = tokens.shape[0] if tokens.dim() == 1 else -1
        if (N < 1 or (torch.is_grad_enabled() and self.needs_grad) or len(caches) != len(self.layers)
                or any(t.device.type != "cpu" for t in (tokens, positions, tables))):
            return None
        pages = self._pages(caches)
        if pages is None:
            return None
        num_blocks, bs = pages[0][0].shape[:2]
        width = tables.shape[1] if tables.dim() == 2 else 0
        tokens, positions = tokens.contiguous(), positions.to(torch.int64).contiguous()
        tables = tables.contiguous()
        if tables.dtype != torch.int32 or tables.shape[0] != N or width < 1 or positions.shape != (N,) \
                or tokens.dtype != torch.int64:
            raise ValueError(f"run_paged takes tokens int64 [N], positions [N] and tables int32 [N, W]; got "
                             f"{tokens.dtype} {tuple(tokens.shape)}, {tuple(positions.shape)} and "
                             f"{tables.dtype} {tuple(tables.shape)}")
        vocab = model.args.vocab_size
        lo, hi = torch.stack([tokens.min(), tokens.max(), positions.min(), positions.max(),
                              tables.min().long(), tables.max().long()]).view(3, 2).T.tolist()
        if lo[0] < 0 or hi[0] >= vocab:
            raise ValueError(f"token ids must lie in [0, {vocab}), got {lo[0]}..{hi[0]}")
        if lo[1] < 0 or hi[1] >= width * bs:
            raise ValueError(f"positions must lie in [0, {width * bs}) ({width} table columns of {bs} "
                             f"tokens), got {lo[1]}..{hi[1]}; give the rows their blocks first")
        if lo[2] < 0 or hi[2] >= num_blocks:
            raise ValueError(f"block ids must lie in [0, {num_blocks}), got {lo[2]}..{hi[2]}")
        n_out, spread = N, None
        if select is not None:
            select = select.to(torch.int64).contiguous()
            if select.dim() != 1 or not select.numel() or int(select.min()) < 0 or int(select.max()) >= N:
                raise ValueError(f"select must name tokens of the {N} given (indices in [0, {N})), got "
                                 f"{select.tolist()}")
            if select.numel() > N:  # (more rows than tokens: each token's logits once, then spread)
                select, spread = select.unique(return_inverse=True)
            n_out = select.shape[0]
        act_q8 = act_quant_of(model) == "q8"
        layers = type(self.layers).from_buffer_copy(self.layers)
        for layer, (k, v, kinds, *sides, value_tables, key_rotation) in zip(layers, pages):
            layer.k, layer.v, layer.offset, layer.cap = k.data_ptr(), v.data_ptr(), 0, 0
            layer.kind, layer.vkind = kinds
            layer.ks, layer.vs, layer.kz, layer.vz, layer.kc = (None if t is None else t.data_ptr() for t in sides)
            layer.vtab, layer.vbnd, layer.vrot = ((None,) * 3 if value_tables is None
                                                  else (t.data_ptr() for t in value_tables))
            layer.krot = None if key_rotation is None else key_rotation.data_ptr()
        stride = hi[1] + 1  # (keys the furthest token sees)
        cos, sin = self.rope_rows(stride)
        cos, sin = cos.index_select(0, positions), sin.index_select(0, positions)
        paged = _Paged(positions.data_ptr(), tables.data_ptr(), width, bs.bit_length() - 1)
        kmax = -(-max(dim, hidden, Hq * D) // 32) * 32
        need = N * (dim * 4 + (3 * Hq + 3 * Hkv) * D + 3 * hidden) + Hq * N * stride \
            + Hq * N * (stride // 64 + 1) * (D + 2) + (N * (kmax // 4 + 2 * (kmax // 32)) if act_q8 else 0)
        scratch = torch.empty(need)
        logits = torch.empty(n_out, vocab)
        self.kernels.decode_step(layers, len(layers), ctypes.byref(self.head), model.norm.weight.data_ptr(),
                                 model.tok_embeddings.weight.data_ptr(), tokens.data_ptr(), cos.data_ptr(),
                                 sin.data_ptr(), N, None if select is None else select.data_ptr(), n_out,
                                 ctypes.byref(paged), dim, Hq, Hkv, D, hidden, self.eps, self.scale,
                                 scratch.data_ptr(), stride, logits.data_ptr(), int(act_q8), int(invariant), kmax,
                                 torch.get_num_threads())
        return logits if spread is None else logits[spread]

    def run_planned(self, tokens: torch.Tensor, caches, plan, last_only: bool = False) -> torch.Tensor | None:
        """Logits ``[B, 1, vocab]`` of a decode step of ``tokens`` ``[B, 1]`` that a
        :class:`~kvtier.caches.step_plan.StepPlanner` planned over paged caches (a sequence
        generated on the paged tier, ``kvtier.cuda_graph.PlannedDecoder``): :meth:`run_paged` at
        the plan's positions through its block table, then every cache books the plan. ``None``,
        with nothing changed, where the plan or the pages do not qualify."""
        if (tokens.dim() != 2 or tokens.shape[1] != 1 or plan.tokens != 1 or not plan.valid
                or plan.block_tables is None or plan.write_start.shape != (tokens.shape[0],)
                or any(type(c) is not PagedKVCache for c in caches)):
            return None
        logits = self.run_paged(tokens[:, 0], plan.write_start, plan.block_tables, caches)
        if logits is None:
            return None
        for c in caches:
            c.commit_planned(plan)
        return logits[:, None]

    def _pages(self, caches) -> list[tuple] | None:
        """Each layer's pages where :meth:`run_paged` reads and writes them, ``(keys, values,
        (key kind, value kind), key scales, value scales, key zeros, value zeros, key centre,
        value tables, key rotation)`` (``None`` where the kinds have none), else ``None``. A
        cache's pages, once checked, are remembered while they and their sidecars live."""
        known, out = self._page_checks, []
        if len(known) > 4096:  # (entries of caches gone)
            known.clear()
        shape = None
        for c in caches:
            held = _page_tensors(c)
            rec = known.get(id(c))
            if rec is None or any((r() if r is not None else None) is not t for r, t in zip(rec[1], held)):
                kinds = _page_kinds(c, self.dims) if isinstance(c, PagedKVCache) else None
                if kinds is None:
                    return None
                rec = known[id(c)] = (kinds, tuple(None if t is None else weakref.ref(t) for t in held),
                                      _value_tables(c.codecs.v_codec), _key_rotation(c.codecs.k_codec))
            k, v, *sides = held
            if shape is None:
                shape = k.shape
            elif k.shape != shape:
                return None
            out.append((k, v, rec[0], *sides, rec[2], rec[3]))
        return out


#: how pages hold a row, as the step's C side names it (``KV_F32`` ... ``KV_A8``; TurboQuant's
#: b-bit values ``KV_LM + b``, its keys of other bits ``KV_AF + b``)
_KV_F32, _KV_Q8, _KV_Q4, _KV_FP8, _KV_G32, _KV_A8, _KV_LM, _KV_AF = 0, 2, 3, 4, 5, 6, 16, 32
_CODE_KINDS = {IdentityCodec: _KV_F32, Q8Codec: _KV_Q8, Q4Codec: _KV_Q4, Fp8Codec: _KV_FP8, GroupQ4Codec: _KV_G32}


def _page_tensors(c) -> tuple:
    """What the step reads of a paged cache: its pages, their scales and zeros and the keys'
    centre (each ``None`` where absent)."""
    pool, codecs = getattr(c, "pool", None), getattr(c, "codecs", None)
    k, v = getattr(pool, "key_cache", None), getattr(pool, "value_cache", None)
    if k is None or codecs is None:
        return k, v, None, None, None, None, None
    ks, vs = pool.k_sidecars, pool.v_sidecars
    return k, v, ks.get("scale"), vs.get("scale"), ks.get("zero"), vs.get("zero"), codecs.k_codec.centre


def _kind_of(codec) -> int | None:
    """The step's kind for one side's codec of float32 rows, ``None`` where it has none: the
    lossless, ``q8``, ``q4``, ``fp8`` and ``q4_g32`` codecs, TurboQuant's keys (group-affine, 4
    bits in ``q4_g32``'s layout, 8 a byte, others bit-packed; rotated or not) and its values."""
    if codec.dtype != torch.float32:
        return None
    if type(codec) is TurboValueCodec:
        return _KV_LM + codec.bits
    if type(codec) is TurboKeyCodec:
        return {8: _KV_A8, 4: _KV_G32}.get(codec.bits, _KV_AF + codec.bits)
    return _CODE_KINDS.get(type(codec)) if codec.rotation is None else None


def _page_kinds(c, dims) -> tuple[int, int] | None:
    """How ``c``'s pages hold a key and a value row, where :meth:`DecodeStep.run_paged` can read
    and write them (:func:`_kind_of`; float32 pages for both or neither; ``fp8`` keys centred once
    the first keys fixed the centre, before which the layered forward writes): ``[blocks, bs,
    H_kv, ...]`` of the model's ``dims`` with the kinds' sidecars, contiguous on the CPU, ``bs`` a
    power of two; else ``None``."""
    k, v, *_, centre = _page_tensors(c)
    if k is None:
        return None
    kc, vc = c.codecs.k_codec, c.codecs.v_codec
    kinds = _kind_of(kc), _kind_of(vc)
    if None in kinds or (kinds[0] == _KV_F32) != (kinds[1] == _KV_F32) or vc.centre is not None \
            or (centre is None) == (kinds[0] == _KV_FP8):
        return None
    Hkv, D = dims[2], dims[3]
    rows = (k.shape[0], k.shape[1], Hkv)  # (blocks, block size, KV heads)
    tensors = [] if centre is None else [centre]
    if centre is not None and (centre.dtype != torch.float32 or tuple(centre.shape) != (Hkv, D)):
        return None
    for codec, pages, sidecars in ((kc, k, c.pool.k_sidecars), (vc, v, c.pool.v_sidecars)):
        # (the layout each codec gives its pages: the C side reads exactly that)
        specs = {s.name: (s.dtype, rows + (s.groups,)) for s in codec.sidecar_specs()}
        if codec.head_dim != D or tuple(pages.shape) != rows + (codec.packed_dim(),) \
                or pages.dtype != codec.payload_dtype \
                or {n: (t.dtype, tuple(t.shape)) for n, t in sidecars.items()} != specs:
            return None
        tensors += [pages, *sidecars.values()]
    ok = D % 2 == 0 and rows[1] & (rows[1] - 1) == 0  # (each codec checked its own head dim: groups of 32 ...)
    return kinds if ok and all(t.device.type == "cpu" and t.is_contiguous() for t in tensors) else None


def _key_rotation(codec) -> torch.Tensor | None:
    """Rotated TurboQuant keys' signs / sqrt(D), float32 on the CPU (``None`` for others)."""
    return codec.rotation.scaled_signs() if type(codec) is TurboKeyCodec and codec.rotation is not None else None


def _value_tables(codec) -> tuple | None:
    """TurboQuant values' centroids, inner boundaries and rotation signs / sqrt(D), float32 on
    the CPU (``None`` for other codecs)."""
    if type(codec) is not TurboValueCodec:
        return None
    return (codec.centroids().contiguous(), codec.quantizer.boundaries_tensor().contiguous(),
            codec.rotation.scaled_signs())


_PLANS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def plan_for(model) -> DecodeStep | None:
    """The model's :class:`DecodeStep` (built on first use, rebuilt when its layers' modules or
    norms change), or ``None`` when the model does not qualify or the environment turns it off."""
    if not decode_step_enabled() or torch.compiler.is_compiling():
        return None
    emb = model.tok_embeddings.weight
    if emb.device.type != "cpu" or emb.dtype != torch.float32:
        return None
    entry = _PLANS.get(model)
    if entry is not None and entry[2] == _registrations[0]:
        return entry[1]  # no module, parameter or buffer was assigned anywhere since the check
    _watch_registrations()
    seen = _registrations[0]
    key = tuple(map(id, DecodeStep.key_objects(model)))
    if entry is None or entry[0] != key:
        entry = (key, DecodeStep.build(model), seen)
    else:  # the same modules; the rotary module's frequencies (a buffer) may be new
        plan = entry[1]
        if plan is not None and plan._rope is not None and plan._rope[2] is not model.rope.inv_freq:
            plan._rope = None
        entry = (key, plan, seen)
    _PLANS[model] = entry
    return entry[1]


def forget(model) -> None:
    """Drop the model's plan (its tensors moved: ``Module._apply``)."""
    _PLANS.pop(model, None)


#: modules, parameters and buffers assigned to any module since the first plan
#: (``nn.Module.__setattr__`` and ``register_*`` call PyTorch's global registration hooks). A
#: step whose count is unchanged since its model's last check skips walking the layers: after
#: a step has streamed the weights through the caches that walk costs about half a
#: millisecond, 4% of a step.
_registrations = [0]


def _count_registration(module, name, value) -> None:
    _registrations[0] += 1


@functools.cache
def _watch_registrations() -> None:
    from torch.nn.modules import module as nn_module

    nn_module.register_module_module_registration_hook(_count_registration)
    nn_module.register_module_parameter_registration_hook(_count_registration)
    nn_module.register_module_buffer_registration_hook(_count_registration)
