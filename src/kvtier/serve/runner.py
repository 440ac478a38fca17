"""The model and its paged caches: one :class:`~kvtier.serve.scheduler.StepBatch` in, logits out.

:class:`ModelRunner` holds the model and one
:class:`~kvtier.caches.paged_shared.SharedBlockPagedKVCache` per layer over a pool
of ``num_blocks`` blocks allocated up front. It keeps no books of its own: each
step it binds the caches' rows to the batch's block lists and start positions,
runs the forward(s) and returns the logits of the sampled rows. Tensor parallelism
can therefore broadcast the batch and call :meth:`ModelRunner.execute` on every rank.

How a step runs. Rows that feed one token (decode, or a one-token chunk) go through
one forward ``[B, 1]`` whose positions, lengths, write slots and block table are
computed once for every layer (:func:`~kvtier.caches.paged_shared.decode_plan`).
Rows that feed a prompt chunk run in a second forward, packed: their tokens side
by side in one row ``[1, N]`` (:func:`~kvtier.caches.paged_shared.packed_plan`), so
every projection multiplies all ``N`` tokens at once and no position is padded;
only attention puts each chunk back in a row of its own. (A padded ``[B, T_max]``
forward of a 256-token chunk beside 1-token decode rows would compute 256
positions for each of those rows; packed, a decode row is one token among the
chunks'.) On CUDA a step that has prompt chunks runs its decode rows in the packed
forward too (``decode_in_prompt_steps``): one pass over the weights instead of two,
and the decode forward's launch, for a token each in the chunks' matmuls. On the
CPU they keep their own forward by default, whose attention kernel is made for them.

A row marked ``all_logits`` (a prompt chunk whose logprobs are asked for) also gets the
logits of every position it feeds: the LM head multiplies those positions too, in the same
forward, and :attr:`ModelRunner.prompt_logits` holds them until the next step.

On CUDA, decode forwards can be replayed from CUDA graphs
(:mod:`kvtier.serve.graphs`), one per batch-size bucket.

Batch-invariant steps (``batch_invariant``, CPU only). Every token of a step, prompt tokens too,
is a row of the one-call step with ``invariant`` (:meth:`~kvtier.model.cpu_step.DecodeStep.run_paged`),
which computes each token's logits, keys and values as it computes them for that token alone: a
request's answer is then the same bits whatever else shares its steps, however its prompt is
chunked, whether its prefix came from the cache or it was preempted and recomputed.

Tokens still on the device. With asynchronous scheduling the engine schedules and
launches a step before the previous step's sampled tokens reach the host: a decode
row then feeds :data:`~kvtier.serve.scheduler.PENDING`, and :class:`PendingTokens`
says where in the previous step's token tensor its token is. The step's token input
is fixed up on the device (:func:`fill_pending`), with no sync.

Example::

    >>> runner = ModelRunner(model, num_blocks=256)
    >>> logits = runner.execute(batch)                      # (n_sampled, vocab) float32
"""

from __future__ import annotations

import bisect
import math
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from kvtier.caches.paged_codecs import select_codecs
from kvtier.caches.paged_shared import (
    RowBinding,
    SharedBlockPagedKVCache,
    chunk_plan,
    decode_plan,
    decode_starts,
    packed_plan,
    to_device,
)
from kvtier.caches.state_checks import free_bytes
from kvtier.model.cpu_step import decode_step_enabled, plan_for
from kvtier.model.linear import prefill_dtype_of
from kvtier.quant.modes import TurboQuantConfig
from kvtier.serve.offload import HostBlocks
from kvtier.serve.scheduler import PENDING, ScheduledRow, StepBatch

__all__ = ["ModelRunner", "PendingTokens", "blocks_for_memory", "context_of", "host_blocks_for", "pool_blocks", "fed_tokens", "fill_pending", "kv_bytes_per_block",
           "smallest_bucket", "token_rows"]


#: how a refusal of batch-invariant steps begins (:func:`invariant_refusal` says why)
INVARIANT_REFUSED = "batch-invariant steps run every token through the CPU's one-call step, which cannot serve here: "


def invariant_refusal(device: torch.device, kv_quant: str | None, block_size: int, dtype: torch.dtype,
                      prefill_dtype: torch.dtype) -> str | None:
    """Why these settings alone rule out batch-invariant steps, or ``None``: what
    :class:`ModelRunner` checks before the model's shape and its pages, so that ``kvtier serve``
    refuses them before it loads a model."""
    if device.type != "cpu":
        return f"the model is on {device}, and batch-invariant steps run on the CPU (--device cpu)"
    if not decode_step_enabled():
        return "KVTIER_DECODE_STEP or KVTIER_FUSED turns the one-call step off; unset it"
    if kv_quant == "fp8":
        return ("fp8 pages (--kv-quant fp8) take their centre from the first keys written, so a request's codes "
                "depend on which request came first; use q8, q4, q4_g32, TurboQuant or full-precision pages")
    if block_size & (block_size - 1):
        return f"block_size {block_size} (--block-size) is not a power of two; use 16"
    if prefill_dtype != torch.float32:
        return ("the prefill dtype is bfloat16 (--prefill-dtype, KVTIER_PREFILL_DTYPE), which every token "
                "computed alone would not use; leave it float32")
    if dtype != torch.float32:
        return f"the model is {str(dtype).removeprefix('torch.')} and the step runs float32 (--dtype float32)"
    return None


@dataclass(frozen=True)
class PendingTokens:
    """The tokens of the step in flight: ``tokens`` ``[n]`` (int64, on the model's device) and
    the position of each sampled request's token in it, ``index[request_id]``."""

    tokens: torch.Tensor
    index: Mapping[str, int]

    def code(self, row: ScheduledRow) -> int:
        """A decode row's token id, a :data:`PENDING` one as ``-1 - i`` (``i`` its position in
        :attr:`tokens`); a ``KeyError`` names a pending row the step in flight did not sample."""
        return row.token_ids[0] if row.token_ids[0] != PENDING else -1 - self.index[row.request_id]

    def codes(self, rows: Sequence[ScheduledRow]) -> list[int]:
        """:meth:`code` of each decode row."""
        return [self.code(r) for r in rows]


#: most rows a CPU decode step runs in one C call (a drafted step's tokens each a row; more: the
#: layered forward). On the 2-core CPU the call was 1.1-2.6x faster up to 64 rows, and 1.3-2.4x for
#: drafted steps of up to 160 tokens; its scratch grows with the rows times the longest context
ONE_CALL_TOKENS = 256
#: most bytes of scores a batch-invariant call holds (heads x tokens x the furthest position): a
#: long context takes fewer tokens a call (where a call ends does not change a token's bits)
INVARIANT_SCORE_BYTES = 256 * 2**20


def fed_tokens(rows: Sequence[ScheduledRow], pending: PendingTokens | None
               ) -> tuple[list[tuple[int, ...]], PendingTokens | None]:
    """Each row's token ids, a pending decode token coded as :meth:`PendingTokens.codes` does, and
    the ``pending`` to fill them in from (``None`` when every token is on the host). Only a
    request's last token can be pending, so only the rows' last tokens are looked at; a
    ``ValueError`` when a row is pending and ``pending`` is ``None``."""
    if not any(r.token_ids[-1] == PENDING for r in rows):
        return [r.token_ids for r in rows], None
    if pending is None:
        raise ValueError("a decode row feeds a pending token but no PendingTokens were given")
    return [(pending.code(r),) if r.token_ids[-1] == PENDING else r.token_ids for r in rows], pending


def fill_pending(tokens: torch.Tensor, pending: PendingTokens | None) -> torch.Tensor:
    """Replace, in place, each code ``-1 - i`` of ``tokens`` by ``pending.tokens[i]`` (on the
    device, no sync); ``tokens`` itself."""
    if pending is not None:
        src = (-1 - tokens).clamp_(min=0)
        tokens.copy_(torch.where(tokens < 0, pending.tokens[src], tokens))
    return tokens


def token_rows(rows: Sequence[ScheduledRow]) -> list[ScheduledRow]:
    """``rows`` (decode rows and drafted rows) as decode rows of one token each: token ``j`` of a
    row at its position ``start + j``, over the row's blocks. In one decode forward each such row
    writes its key and value before attention reads them, so a draft sees the tokens before it, as
    in the row's own forward."""
    return [ScheduledRow(r.request_id, (t,), r.start + j, r.blocks, True)
            for r in rows for j, t in enumerate(r.token_ids)]


def smallest_bucket(buckets: Sequence[int], n: int) -> int:
    """The smallest of ``buckets`` (ascending) that holds ``n`` rows; ``n`` itself past the largest."""
    return next((b for b in buckets if b >= n), n)


def kv_bytes_per_block(model_args, dtype: torch.dtype, block_size: int, kv_quant: str | None = None,
                       turboquant: TurboQuantConfig | None = None) -> int:
    """Bytes one block of ``block_size`` tokens takes over every layer (payload and sidecars)."""
    choice = select_codecs(model_args.head_dim, dtype, kv_quant, turboquant)
    per_token_head = choice.k_codec.bytes_per_token_head() + choice.v_codec.bytes_per_token_head()
    return model_args.n_layers * block_size * model_args.n_kv_heads * per_token_head


def blocks_for_memory(gib: float, model_args, dtype: torch.dtype, block_size: int,
                      kv_quant: str | None = None, turboquant: TurboQuantConfig | None = None) -> int:
    """How many blocks fit in ``gib`` GiB of keys and values (at least 1)."""
    if isinstance(gib, bool) or not isinstance(gib, (int, float)) or not gib > 0:
        raise ValueError(f"kv memory must be a number of GiB > 0, got {gib!r}")
    per_block = kv_bytes_per_block(model_args, dtype, block_size, kv_quant, turboquant)
    if gib * 2**30 < per_block:
        raise ValueError(f"{gib:g} GiB of keys and values hold no block of {block_size} tokens (one takes "
                         f"{per_block / 2**30:.3g} GiB over the model's layers); give more memory (--kv-memory) or "
                         "smaller blocks (--block-size)")
    return math.floor(gib * 2**30 / per_block)


def host_blocks_for(gib: float, model_args, dtype: torch.dtype, block_size: int, kv_quant: str | None = None,
                    turboquant: TurboQuantConfig | None = None, pool_on_host: int = 0) -> int:
    """Slots of a host tier of ``gib`` GiB (:mod:`kvtier.serve.offload`), each a block of every
    layer; refused where it holds no block, or where the host has not that memory free beside
    ``pool_on_host`` blocks of a pool in the same memory (a CPU engine's)."""
    per_block = kv_bytes_per_block(model_args, dtype, block_size, kv_quant, turboquant)
    n = math.floor(gib * 2**30 / per_block)
    if n < 1:
        raise ValueError(f"--kv-offload-memory {gib:g} GiB holds no block of {block_size} tokens (one takes "
                         f"{per_block / 2**30:.3g} GiB over the model's layers); give more")
    free = free_bytes(torch.device("cpu"))
    if free is not None and (n + pool_on_host) * per_block > free:
        pool = f" and the pool's {pool_on_host * per_block / 2**30:.1f} GiB" if pool_on_host else ""
        raise ValueError(f"a host tier of {gib:g} GiB{pool} are more than the {free / 2**30:.1f} GiB this host has "
                         "free; lower --kv-offload-memory (or --kv-memory)")
    return n


def pool_blocks(num_blocks: int | None, gib: float, model_args, dtype: torch.dtype, device: torch.device,
                block_size: int, kv_quant: str | None = None, turboquant: TurboQuantConfig | None = None) -> int:
    """The pool's blocks: ``num_blocks``, else as many as ``gib`` GiB hold
    (:func:`blocks_for_memory`); refused where ``device`` has not the memory for them and the
    scratch block (:func:`check_pool_fits`)."""
    n = num_blocks or blocks_for_memory(gib, model_args, dtype, block_size, kv_quant, turboquant)
    check_pool_fits(n, kv_bytes_per_block(model_args, dtype, block_size, kv_quant, turboquant), device)
    return n


def context_of(max_model_len: int | None, model_args, num_blocks: int, block_size: int) -> int:
    """Prompt plus generated tokens of one request at most: ``max_model_len`` (``None``: the
    model's positions), capped by what the pool holds; more than the model's positions is a
    ``ValueError`` (never a silent cap)."""
    most = model_args.max_position_embeddings
    if (max_model_len or 0) > most:
        raise ValueError(f"--max-model-len {max_model_len} is more than the model's {most} positions "
                         f"(EngineConfig.max_model_len); give at most {most}, or leave it unset for the model's")
    return min(max_model_len or most, num_blocks * block_size)


def check_pool_fits(num_blocks: int, per_block: int, device: torch.device) -> None:
    """Refuse, before anything is allocated, a pool of ``num_blocks`` blocks of ``per_block``
    bytes and its scratch block that ``device`` has no free memory for."""
    free = free_bytes(device)
    if free is not None and (num_blocks + 1) * per_block > free:
        raise ValueError(f"a pool of {num_blocks} blocks takes {num_blocks * per_block / 2**30:.1f} GiB of keys and "
                         f"values, more than the {free / 2**30:.1f} GiB free on {device}; lower --kv-memory or "
                         "--num-blocks, or quantise the pages (--kv-quant, --turboquant)")


class ModelRunner:
    """Runs steps of ``model`` over shared-block paged caches (see the module docstring).

    ``num_blocks`` x ``block_size``: the pool every layer allocates now, on the
    model's device and in its dtype; ``kv_quant`` / ``turboquant`` /
    ``attention_backend`` as for :class:`~kvtier.caches.paged.PagedKVCache`.
    ``cuda_graph``: replay decode steps from CUDA graphs (``None``: on CUDA when the
    paged kernels are Triton's; ``False``: never); ``max_num_seqs`` (or ``graph_rows``, rows the
    graphs hold when drafted steps, a row a token, should fit them too) and ``max_model_len``
    bound the graphs' shapes. ``decode_in_prompt_steps``: run a step's
    decode rows in its packed prompt forward when it has prompt chunks (``None``: on CUDA).
    ``host_blocks``: slots of the host tier (:mod:`kvtier.serve.offload`) that the batches'
    ``copies`` move blocks through, before the step's forward. ``pad_logit_rows``: the LM head of a packed forward multiplies its rows padded to a
    decode-graph bucket (:func:`~kvtier.serve.graphs.graph_buckets` of ``max_num_seqs``), the
    padding dropped after (``None``: on CUDA). On the H200 a row count new to the process
    kept the host in the GEMM's launch until the GPU had drained (benchmarks/RESULTS.md,
    2026-12-03); the graphs' capture has run every bucket.
    """

    def __init__(self, model, *, num_blocks: int, block_size: int = 16, kv_quant: str | None = None,
                 turboquant: TurboQuantConfig | None = None, attention_backend: str = "auto",
                 cuda_graph: bool | None = None, max_num_seqs: int = 64, graph_rows: int | None = None,
                 max_model_len: int | None = None, decode_in_prompt_steps: bool | None = None,
                 pad_logit_rows: bool | None = None, batch_invariant: bool = False, host_blocks: int = 0):
        self.model = model
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        if decode_in_prompt_steps is not None and not isinstance(decode_in_prompt_steps, bool):
            raise ValueError(f"decode_in_prompt_steps must be a bool or None, got {decode_in_prompt_steps!r}")
        self.decode_in_prompt_steps = (self.device.type == "cuda" if decode_in_prompt_steps is None
                                       else decode_in_prompt_steps)
        if pad_logit_rows is not None and not isinstance(pad_logit_rows, bool):
            raise ValueError(f"pad_logit_rows must be a bool or None, got {pad_logit_rows!r}")
        from kvtier.serve.graphs import graph_buckets  # (graphs imports this module)

        pad = self.device.type == "cuda" if pad_logit_rows is None else pad_logit_rows
        self.logit_buckets = graph_buckets(max_num_seqs) if pad else []
        a = model.args
        self.block_size, self.num_blocks = block_size, num_blocks
        # one scratch block past the manager's: padding rows of a captured step write there
        self.caches = [SharedBlockPagedKVCache(block_size, num_blocks + 1, kv_quant=kv_quant,
                                               turboquant=turboquant, attention_backend=attention_backend)
                       for _ in range(a.n_layers)]
        if isinstance(host_blocks, bool) or not isinstance(host_blocks, int) or host_blocks < 0:
            raise ValueError(f"host_blocks must be an int >= 0, got {host_blocks!r}")
        for c in self.caches:
            c.allocate(a.n_kv_heads, a.head_dim, self.dtype, self.device)
        #: the host tier the batches' ``copies`` save blocks to and load them from
        self.host = HostBlocks(self.caches, host_blocks) if host_blocks else None
        if not isinstance(batch_invariant, bool):
            raise ValueError(f"batch_invariant must be a bool, got {batch_invariant!r}")
        self.batch_invariant = batch_invariant
        if batch_invariant and (why := self._invariant_unavailable(kv_quant)) is not None:
            raise ValueError(INVARIANT_REFUSED + why)
        #: the last step's ``all_logits`` rows: request id -> (first position, logits ``[T, V]``)
        self.prompt_logits: dict[str, tuple[int, torch.Tensor]] = {}
        self.draft_logits: dict[str, torch.Tensor] = {}  # request id -> [draft + 1, V] of the last step
        self.graphs = None
        if cuda_graph and self.device.type != "cuda":
            raise ValueError(f"CUDA-graph decode needs a CUDA device, the model is on {self.device}; "
                             "leave cuda_graph unset or False")
        if cuda_graph is not False and self.device.type == "cuda":
            from kvtier.serve.graphs import DecodeGraphs, graphs_unavailable

            why = graphs_unavailable(model, self.caches)
            if why is None:
                width = math.ceil((max_model_len or a.max_position_embeddings) / block_size)
                try:
                    self.graphs = DecodeGraphs(model, self.caches, graph_rows or max_num_seqs, width,
                                               scratch=num_blocks)
                except RuntimeError as e:  # a capture that fails: decode eagerly, unless asked not to
                    if cuda_graph:
                        raise
                    warnings.warn(f"kvtier serve: decoding without CUDA graphs ({e})", RuntimeWarning,
                                  stacklevel=2)
            elif cuda_graph:
                raise ValueError(f"CUDA-graph decode cannot serve: {why}")

    @property
    def storage_mode(self) -> str:
        """The codec the pages use (``fp``, ``q8``, ...; after any fallback)."""
        return self.caches[0].codecs.mode

    @property
    def nbytes(self) -> int:
        return sum(c.nbytes for c in self.caches)

    def execute(self, batch: StepBatch, pending: PendingTokens | None = None) -> torch.Tensor:
        """Run ``batch``; logits ``[n_sampled, vocab]`` (float32) of its sampled rows, in row order.

        ``pending``: where the decode rows that feed :data:`~kvtier.serve.scheduler.PENDING`
        find their tokens. The logits may be a view of a CUDA graph's buffer, which the next
        step overwrites: read them (or launch what reads them) before calling again. The
        ``all_logits`` rows' logits of every position go to :attr:`prompt_logits`, those of a
        row's drafts and the position before them (``[draft + 1, vocab]``) to :attr:`draft_logits`."""
        self.prompt_logits, self.draft_logits = {}, {}
        if batch.copies:
            if self.host is None:
                raise ValueError(f"the batch copies {len(batch.copies)} blocks to or from a host tier, and this "
                                 "runner has none; build it with host_blocks (the engine's kv_offload_gib)")
            with torch.inference_mode():
                self.host.apply(batch.copies)
        if not batch.rows:
            return torch.empty(0, self.model.args.vocab_size, device=self.device)
        if self.batch_invariant:
            with torch.inference_mode():
                return self._invariant(batch, pending)
        decode = [r for r in batch.rows if len(r.token_ids) == 1 and not r.all_logits]
        chunks = [r for r in batch.rows if len(r.token_ids) > 1 or r.all_logits]
        if any(r.token_ids[-1] == PENDING for r in chunks):  # pending: only a request's last token
            raise ValueError("only decode rows may feed a pending token")
        if chunks and all(r.draft and not r.all_logits for r in chunks):
            rows = token_rows(batch.rows)  # a drafted step as decode rows, a token each
            if self.graphs.fits(rows) if self.graphs is not None else self._one_call(len(rows)) is not None:
                with torch.inference_mode():
                    return self._drafted(batch, rows, pending)
        if chunks and decode and (self.decode_in_prompt_steps or any(r.draft for r in chunks)):
            decode, chunks = [], list(batch.rows)  # one packed forward for every row (drafts: a decode step)
        logits: dict[str, torch.Tensor] = {}
        with torch.inference_mode():
            if decode:
                out = self._decode(decode, pending)  # (B, V)
                if not chunks and all(r.sample for r in decode):
                    return out  # every row sampled, in row order (a graph's buffer: read it now)
                logits |= {r.request_id: out[i] for i, r in enumerate(decode) if r.sample}
            if len(chunks) == 1:
                out = self._prefill(chunks[0])[None]  # (1, V)
            elif chunks:
                out = self._prefill_packed(chunks, pending)  # (n_chunks, V)
                if len(chunks) == len(batch.rows) and all(r.sample for r in chunks):
                    return out  # every row sampled, in row order
            for i, r in enumerate(chunks):
                if r.sample:
                    logits[r.request_id] = out[i]
            if not logits:
                return torch.empty(0, self.model.args.vocab_size, device=self.device)
            return torch.stack([logits[rid] for rid in batch.sampled])  # (n_sampled, V)

    def _one_call(self, rows: int):
        """The model's :class:`~kvtier.model.cpu_step.DecodeStep` where a decode step of ``rows``
        rows runs as one C call on the CPU (:meth:`~kvtier.model.cpu_step.DecodeStep.run_paged`,
        where the pages qualify), else ``None``."""
        if self.device.type != "cpu" or rows > ONE_CALL_TOKENS:
            return None
        step = plan_for(self.model)
        return step if step is not None and step.takes_rows(rows) else None

    def _drafted(self, batch: StepBatch, rows: Sequence[ScheduledRow], pending: PendingTokens | None) -> torch.Tensor:
        """A step of decode and drafted rows as the decode rows ``rows`` (:func:`token_rows`, one a
        token: a decode graph replays it, or on the CPU one C call): the sampled rows' logits; each
        drafted row's last ``draft + 1`` to :attr:`draft_logits` (views of a graph's buffer, as the
        logits are)."""
        out = self._decode(rows, pending)  # (N, V)
        last, end = [], 0
        for r in batch.rows:
            end += len(r.token_ids)
            if r.sample:
                last.append(end - 1)
            if r.draft:
                self.draft_logits[r.request_id] = out[end - 1 - r.draft : end]
        return out[to_device(torch.tensor(last), self.device)]  # (n_sampled, V)

    def _binding(self, rows: Sequence[ScheduledRow]) -> RowBinding:
        return RowBinding.build([r.blocks for r in rows], [r.start for r in rows], block_size=self.block_size,
                                num_blocks=self.num_blocks + 1, device=self.device)

    def _bind(self, rows: Sequence[ScheduledRow]) -> RowBinding:
        """The rows' binding, every cache bound to it (the layered forward's books)."""
        binding = self._binding(rows)
        for c in self.caches:
            c.bind(binding)
        return binding

    def _decode(self, rows: Sequence[ScheduledRow], pending: PendingTokens | None = None) -> torch.Tensor:
        """One forward ``[B, 1]`` over one step plan; logits ``[B, V]``."""
        fed, pending = fed_tokens(rows, pending)
        ids = [t[0] for t in fed]
        if self.graphs is not None and self.graphs.fits(rows):
            return self.graphs.run(rows, codes=ids if pending is not None else None, pending=pending)
        if (step := self._one_call(len(rows))) is not None:
            out = self._decode_step(step, rows, ids, pending)
            if out is not None:
                return out
        plan = decode_plan(self._bind(rows))
        tokens = fill_pending(to_device(torch.tensor(ids, dtype=torch.long), self.device), pending)[:, None]  # (B, 1)
        out = self.model(tokens, self.caches, positions=plan.write_start[:, None],
                         cache_kwargs={"plan": plan, "write_start": plan.write_start}, last_only=True)
        return out[:, -1]  # (B, V)

    def _decode_step(self, step, rows: Sequence[ScheduledRow], ids: list[int], pending: PendingTokens | None,
                     select: list[int] | None = None, invariant: bool = False) -> torch.Tensor | None:
        """A decode step in one C call on the CPU (``step``'s :meth:`~kvtier.model.cpu_step.DecodeStep.run_paged`):
        logits ``[B, V]`` (of the rows ``select`` names, if given), or ``None`` (nothing written) where
        the pages do not qualify."""
        binding = self._binding(rows)  # (the caches stay unbound: the C call reads the table itself)
        positions = torch.tensor(decode_starts(binding), dtype=torch.long)  # (checked: each row's blocks hold it)
        tokens = fill_pending(torch.tensor(ids, dtype=torch.long), pending)
        return step.run_paged(tokens, positions, binding.table, self.caches,
                              None if select is None else torch.tensor(select), invariant=invariant)

    def _invariant_unavailable(self, kv_quant: str | None) -> str | None:
        """Why this runner cannot run batch-invariant steps, or ``None`` when it can."""
        why = invariant_refusal(self.device, kv_quant, self.block_size, self.dtype, prefill_dtype_of(self.model))
        if why is not None:
            return why
        step = plan_for(self.model)
        if step is None:
            return ("the model does not take it (a float32 Llama, Mistral or Qwen2 shape with packed or float32 "
                    "projections does; Qwen3's q/k norms, tensor-parallel shards and adapters do not): serve it "
                    "without --batch-invariant")
        if step._pages(self.caches) is None:
            return f"it does not read these pages ({self.storage_mode})"
        return None

    def _invariant(self, batch: StepBatch, pending: PendingTokens | None) -> torch.Tensor:
        """``batch`` with every token computed alone: each token a row of the one-call step
        (:meth:`~kvtier.model.cpu_step.DecodeStep.run_paged` with ``invariant``), in calls of at most
        :data:`ONE_CALL_TOKENS` tokens (fewer at long contexts: :data:`INVARIANT_SCORE_BYTES`), so a
        token's logits, keys and values are the same bits whatever else the step holds, however its prompt was chunked, and whether it is decoded or
        recomputed after a preemption. The logits as :meth:`execute` returns them."""
        step = plan_for(self.model)
        fed, pending = fed_tokens(batch.rows, pending)
        tokens, ids = token_rows(batch.rows), [t for ts in fed for t in ts]  # (ids: pending ones coded)
        spans, want, at = [], [], 0  # each row's wanted positions: [first, end) in ``want`` (ascending)
        for r in batch.rows:
            n = len(r.token_ids)
            keep = n if r.all_logits else r.draft + 1 if r.draft else 1 if r.sample else 0
            spans.append((len(want), len(want) + keep))
            want.extend(range(at + n - keep, at + n))
            at += n
        furthest = max(r.start + len(r.token_ids) for r in batch.rows)
        per_call = max(1, min(ONE_CALL_TOKENS, INVARIANT_SCORE_BYTES // (4 * self.model.args.n_heads * furthest)))
        out = []
        for lo in range(0, len(tokens), per_call):
            hi = min(lo + per_call, len(tokens))
            select = [w - lo for w in want[bisect.bisect_left(want, lo) : bisect.bisect_left(want, hi)]]
            # (a call whose positions nobody reads writes its keys and values, and one logit row)
            got = self._decode_step(step, tokens[lo:hi], ids[lo:hi], pending, select or [hi - 1 - lo], invariant=True)
            if got is None:
                raise RuntimeError("the one-call step refused pages it took when the runner was built")
            if select:
                out.append(got)
        out = torch.cat(out) if out else torch.empty(0, self.model.args.vocab_size)  # (len(want), V)
        for r, (a, b) in zip(batch.rows, spans):
            if r.all_logits:
                self.prompt_logits[r.request_id] = (r.start, out[a:b])
            if r.draft:
                self.draft_logits[r.request_id] = out[b - r.draft - 1 : b]
        return out[[b - 1 for r, (_, b) in zip(batch.rows, spans) if r.sample]]  # (n_sampled, V), in row order

    def _prefill_packed(self, rows: Sequence[ScheduledRow], pending: PendingTokens | None = None) -> torch.Tensor:
        """The rows' tokens (prompt chunks, decode tokens) side by side in one forward ``[1, N]``;
        logits of each row's last position ``[len(rows), V]``."""
        plan = packed_plan(self._bind(rows), [len(r.token_ids) for r in rows])
        fed, pending = fed_tokens(rows, pending)  # decode rows may be fed from the step in flight
        ids = [t for ts in fed for t in ts]
        tokens = fill_pending(to_device(torch.tensor([ids], dtype=torch.long), self.device), pending)  # (1, N)
        select, k = plan.last, len(rows)
        pad = smallest_bucket(self.logit_buckets, k) - k
        if pad:  # the last row again as padding
            select = torch.cat([select, select[-1:].expand(pad)])
        spans, offset = [], 0  # the all_logits rows' positions and the drafts', after the last positions
        for r in rows:
            if r.all_logits or r.draft:
                n = len(r.token_ids) if r.all_logits else r.draft + 1
                spans.append((r, offset + len(r.token_ids) - n, n))
            offset += len(r.token_ids)
        if spans:
            every = torch.cat([torch.arange(o, o + n) for _, o, n in spans])
            select = torch.cat([select, to_device(every, self.device)])
        out = self.model(tokens, self.caches, positions=plan.positions, cache_kwargs={"plan": plan},
                         select=select)[0]
        at = k + pad
        for r, _, n in spans:
            if r.all_logits:
                self.prompt_logits[r.request_id] = (r.start, out[at : at + n])
            if r.draft:
                self.draft_logits[r.request_id] = out[at + n - 1 - r.draft : at + n]
            at += n
        return out[:k]  # (len(rows), V)

    def _prefill(self, row: ScheduledRow) -> torch.Tensor:
        """One forward ``[1, T]`` of a prompt chunk; logits of its last position ``[V]``."""
        T = len(row.token_ids)
        plan = chunk_plan(self._bind([row]), T)  # slots and lengths once for every layer
        tokens = to_device(torch.tensor([row.token_ids], dtype=torch.long), self.device)  # (1, T)
        positions = torch.arange(row.start, row.start + T, device=self.device)[None]  # (1, T)
        kw = {"plan": plan, "write_start": plan.write_start}
        out = self.model(tokens, self.caches, positions=positions, cache_kwargs=kw,
                         last_only=not (row.all_logits or row.draft))[0]
        if row.all_logits:
            self.prompt_logits[row.request_id] = (row.start, out)
        if row.draft:
            self.draft_logits[row.request_id] = out[-1 - row.draft:]
        return out[-1]
