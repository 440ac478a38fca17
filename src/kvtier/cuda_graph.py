"""Decode steps over a shared step plan, eagerly or replayed from a captured CUDA graph.

A decode step of the whole model (every layer's write, attention and MLP, the
final norm and LM head) has the same shapes every time once the caches cannot
grow, so on CUDA it can be captured once as a CUDA graph and replayed: one launch
per step instead of hundreds, no Python in between. What makes it capturable:

- capacity frozen: every per-row cache (:class:`~kvtier.caches.base.RowKVCache`)
  ``reserve``s room for every step now (the ragged tier grows its buffers, the paged
  tier assigns the blocks) and then ``freeze``s; :func:`freeze_for_steps` does it for
  a list of layers.
- positions, lengths and slots on the device: a :class:`~kvtier.caches.step_plan.StepPlanner`
  computes them once per step for every layer, and its
  :meth:`~kvtier.caches.step_plan.StepPlanner.device_step` (captured with the
  forward) moves them on by one token, so each replay writes at the right place.
- kernels that never read the device from the host: the Triton decode kernels plan
  their split from the capacity, not the lengths (the paged reference does read
  them, so a paged graph needs the Triton backend; the ragged mask path is fine).

The replayed step does no device-to-host sync and no allocation; the budget of
steps (what the frozen capacity holds) is computed on the host before capture and
checked before every step, so a replay never writes past it.

:class:`PlannedDecoder` runs the same planned steps eagerly (any device);
:class:`CUDAGraphDecoder` captures them; :func:`make_decoder` picks one.

Example (CUDA)::

    >>> from kvtier.cuda_graph import CUDAGraphDecoder
    >>> caches = model.make_caches(KVCacheConfig(tier="paged"), batch_size=1)
    >>> model(prompt[:, :-1], caches)                       # prefill (B, L-1)
    >>> dec = CUDAGraphDecoder(model, caches, max_steps=256)
    >>> y = prompt[:, -1]                                   # (B,) int64
    >>> for _ in range(256):
    ...     y = dec.step(y)[:, -1].argmax(-1)               # logits (B, 1, V) float32
    >>> dec.close()
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Sequence

import torch

from kvtier.caches.base import CacheCapacityError, KVCache, RowKVCache
from kvtier.caches.step_plan import StepPlanner


def _device(model) -> torch.device:
    return next(model.parameters()).device


def freeze_for_steps(caches: Sequence[RowKVCache], steps: int) -> None:
    """Freeze per-layer per-row caches with room for ``steps`` more tokens in every row.

    Every layer ``reserve(steps)`` (the ragged tier grows its buffers to the longest
    row plus ``steps``, rounded up to its step; the paged tier gives every row its
    blocks now), then ``freeze()``. When a layer cannot take it (a pool that may not
    grow, a capacity frozen before), that layer's
    :class:`~kvtier.caches.base.CacheCapacityError` is raised before any layer changed.
    """
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps must be an int >= 1, got {steps!r}")
    if not caches or not all(isinstance(c, RowKVCache) for c in caches):
        names = sorted({type(c).__name__ for c in caches})
        raise ValueError(f"freeze_for_steps serves per-layer caches of a per-row tier (RowKVCache), "
                         f"got {names}")
    if any(c.empty() for c in caches):
        raise ValueError("the caches hold no tokens yet: write (prefill) at least one token first")
    for i, c in enumerate(caches):  # all layers or none: check every layer before reserving in any
        if not c.can_reserve(steps):
            c.reserve(steps)  # raises the tier's own capacity error, naming the setting to change
            raise AssertionError(f"layer {i}: can_reserve({steps}) was False but reserve() did not refuse")
    for c in caches:
        c.reserve(steps)
        c.freeze()


def device_unavailable(device: torch.device | str) -> str | None:
    """Why CUDA-graph decode cannot run on ``device`` (``None``: a CUDA device, it can)."""
    if torch.device(device).type != "cuda":
        return f"the model is on {device}; CUDA graphs need a CUDA device"
    return None


def check_graph_tier(tier: str) -> None:
    """``ValueError`` for CUDA-graph decode asked of a tier without per-row step plans (tail, block)."""
    if tier not in ("ragged", "paged"):
        raise ValueError(f"CUDA-graph decode needs the ragged or paged tier, not {tier!r}; "
                         "use --tier ragged/paged or --no-cuda-graph")


def graph_unavailable(model, caches: Sequence[KVCache], max_steps: int | None = None) -> str | None:
    """Why a :class:`CUDAGraphDecoder` cannot serve this model and these caches (``None``: it can)."""
    device = _device(model)
    if (why := device_unavailable(device)) is not None:
        return why
    if not caches or not all(isinstance(c, RowKVCache) for c in caches):
        tier = caches[0].tier if caches else None
        return f"the {tier} tier has no frozen step plan; use the ragged or paged tier"
    if any(c.empty() for c in caches):
        return "the caches hold no tokens yet (a one-token prompt); the first step needs them"
    if max_steps is None and not all(c.frozen for c in caches):
        return "the caches are not frozen; freeze them (freeze_for_steps) or give max_steps"
    return next(filter(None, (c.graph_blocker(device) for c in caches)), None)


class PlannedDecoder:
    """Eager decode steps of ``model`` over per-layer ragged or paged caches, one plan per step.

    ``lengths``: each row's length now (default read from the first cache). Each
    :meth:`step` books the step once (:class:`~kvtier.caches.step_plan.StepPlanner`)
    and runs the forward; the planner reserves capacity ahead as needed. With
    ``max_steps`` the caches are frozen for that many steps first
    (:func:`freeze_for_steps`) and ``budget`` is what the frozen capacity holds: a
    step past it raises :class:`~kvtier.caches.base.CacheCapacityError` before
    anything changes (the guard a CUDA graph relies on).
    """

    def __init__(self, model, caches: Sequence[RowKVCache], lengths: Sequence[int] | None = None, *,
                 max_steps: int | None = None):
        self.model, self.caches = model, list(caches)
        # Decoding is inference: caches filled under inference_mode hold inference
        # tensors, which may only be updated in place inside it.
        with torch.inference_mode():
            self.planner = StepPlanner(self.caches, lengths)  # checks the caches and lengths first
            if max_steps is not None:
                freeze_for_steps(self.caches, max_steps)
        self.batch_size = self.planner.batch_size
        self.device = _device(model)
        self.steps = 0
        #: steps the frozen capacity holds (computed on the host, before any step); None: grows
        self.budget: int | None = self.planner.headroom() if max_steps is not None else None

    @property
    def steps_left(self) -> int | None:
        return None if self.budget is None else self.budget - self.steps

    def _guard(self) -> None:
        if self.budget is not None and self.steps >= self.budget:
            raise CacheCapacityError(
                f"step {self.steps + 1} would write past the frozen capacity, which holds "
                f"{self.budget} decode steps; build the decoder with a larger max_steps (or "
                "freeze more capacity) before decoding further")

    def _check_tokens(self, tokens: torch.Tensor) -> None:
        if (not isinstance(tokens, torch.Tensor) or tokens.dtype != torch.long
                or tuple(tokens.shape) != (self.batch_size,) or tokens.device != self.device):
            got = (tuple(tokens.shape), tokens.dtype, tokens.device) if isinstance(tokens, torch.Tensor) \
                else type(tokens).__name__
            raise ValueError(f"tokens must be int64 [{self.batch_size}] on {self.device} (one per row), "
                             f"got {got}")

    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        """Logits ``[B, 1, vocab]`` (float32) of one decode step of ``tokens`` ``[B]`` (int64)."""
        self._check_tokens(tokens)
        self._guard()
        with torch.inference_mode():
            kw = self.planner.prepare()
            logits = self.model(tokens[:, None], self.caches, cache_kwargs=kw, last_only=True)
        self.steps += 1
        return logits

    def close(self) -> None:
        """End the plan; the caches keep what was written (and stay frozen if they were)."""
        self.planner.close()


class CUDAGraphDecoder(PlannedDecoder):
    """Decode steps captured once as a CUDA graph and replayed (see the module docstring).

    ``caches``: per-layer ragged or paged caches that hold the prompt. With
    ``max_steps`` they are frozen with room for that many steps
    (:func:`freeze_for_steps`); without, they must be frozen already. ``budget`` is
    the number of steps the frozen capacity holds; a step past it raises
    :class:`~kvtier.caches.base.CacheCapacityError` before anything runs.

    The first :meth:`step` runs eagerly (it compiles the kernels and warms the
    libraries up), the second captures the step and replays it, later ones replay.
    :meth:`step` returns the graph's own logits tensor: read it before the next step.
    While the decoder runs, the caches belong to it; a cache changed outside it
    (trim, restore, ...) makes the next step raise.

    ``torch_compile``: run the forward through ``torch.compile`` (fusing the norms, RoPE
    and the MLP's elementwise work between the cache calls, which stay outside its
    graphs) before capturing it; the first step then also compiles.
    """

    def __init__(self, model, caches: Sequence[RowKVCache], lengths: Sequence[int] | None = None, *,
                 max_steps: int | None = None, torch_compile: bool = False):
        why = graph_unavailable(model, caches, max_steps)
        if why is not None:
            raise ValueError(f"CUDA-graph decode cannot serve: {why}")
        super().__init__(model, caches, lengths, max_steps=max_steps)
        self._forward, self._layers = model, self.caches
        if torch_compile:
            self._forward, self._layers = torch.compile(model, dynamic=False), _outside_compile(self.caches)
        self.budget = self.planner.headroom()  # what the frozen capacity holds, fixed before capture
        self.graph: torch.cuda.CUDAGraph | None = None
        self.eager_reason: str | None = None  # set when the kernels fell back and capture was skipped
        self._stream = torch.cuda.Stream(self.device)
        with torch.inference_mode():
            self._tokens = torch.zeros(self.batch_size, 1, dtype=torch.long, device=self.device)
        self._logits: torch.Tensor | None = None

    @property
    def captured(self) -> bool:
        return self.graph is not None

    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        """Logits ``[B, 1, vocab]`` (float32; the graph's buffer) of one step of ``tokens`` ``[B]``."""
        self._check_tokens(tokens)
        self._guard()
        with torch.inference_mode():
            self._tokens.copy_(tokens[:, None])
            if self.eager_reason is not None:
                self._logits = super().step(tokens)
                return self._logits
            kw = self.planner.prepare(device=False)
            if self.graph is None and self._logits is None:
                self._warm_up(kw)
            elif self.graph is None:
                self._capture(kw)
            if self.graph is not None:
                self.graph.replay()
        self.steps += 1
        return self._logits

    def _warm_up(self, kw: dict) -> None:
        """The first step, eagerly on the capture stream: kernels compile, libraries set up."""
        s, main = self._stream, torch.cuda.current_stream(self.device)
        s.wait_stream(main)
        with torch.cuda.stream(s):
            self.planner.device_step()
            self._logits = self._forward(self._tokens, self._layers, cache_kwargs=kw, last_only=True)
        main.wait_stream(s)
        self._logits.record_stream(main)

    def _capture(self, kw: dict) -> None:
        """Record this step (plan advance and forward) as a graph; :meth:`step` replays it."""
        why = next(filter(None, (c.graph_blocker(self.device) for c in self.caches)), None)
        if why is not None:  # a kernel fell back during the warm-up
            self.eager_reason = why
            warnings.warn(f"kvtier: decoding without a CUDA graph: {why}", RuntimeWarning, stacklevel=3)
            self.planner.device_step()
            self._logits = self.model(self._tokens, self.caches, cache_kwargs=kw, last_only=True)
            return
        plan = self.planner.plan
        plan.bound = max(plan.ends) + self.budget - self.steps - 1  # the ragged books keep this bound
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=self._stream):
            self.planner.device_step()
            self._logits = self._forward(self._tokens, self._layers, cache_kwargs=kw, last_only=True)
        self.graph = graph

    def close(self) -> None:
        """Free the graph and end the plan; the caches keep what was written, frozen."""
        self.graph = None
        super().close()


def _outside_compile(caches: list[RowKVCache]) -> list:
    """Per-layer stand-ins whose ``update``/``attention`` ``torch.compile`` leaves out of its
    graphs (it breaks the graph there and calls them as they are)."""
    return [_opaque_class()(c) for c in caches]


@functools.cache
def _opaque_class() -> type:
    # made on first use (the decorator imports torch._dynamo, which takes seconds) and kept,
    # so that compiled code guarding on the stand-ins' type serves every decoder
    class Opaque:
        def __init__(self, cache: RowKVCache):
            self.cache = cache

        @property
        def offset(self):
            return self.cache.offset

        @torch.compiler.disable
        def update(self, keys, values, **kwargs):
            return self.cache.update(keys, values, **kwargs)

        @torch.compiler.disable
        def attention(self, queries, **kwargs):
            return self.cache.attention(queries, **kwargs)

    return Opaque


def make_decoder(model, caches: Sequence[RowKVCache], lengths: Sequence[int] | None = None, *,
                 cuda_graph: bool | None = None, max_steps: int | None = None) -> PlannedDecoder:
    """The decoder for per-layer ragged or paged caches that hold the prompt.

    ``cuda_graph``: ``None`` (auto) captures a :class:`CUDAGraphDecoder` when
    :func:`graph_unavailable` finds nothing against it and the caches can be frozen
    for ``max_steps`` (else the eager :class:`PlannedDecoder`); ``True`` insists
    (``ValueError`` saying why not, or the capacity error); ``False`` decodes eagerly.
    """
    if cuda_graph is not None and not isinstance(cuda_graph, bool):
        raise ValueError(f"cuda_graph must be None (auto), True or False, got {cuda_graph!r}")
    why = graph_unavailable(model, caches, max_steps) if cuda_graph is not False else "off"
    if why is not None:
        if cuda_graph:
            raise ValueError(f"CUDA-graph decode cannot serve: {why}")
        return PlannedDecoder(model, caches, lengths)
    try:
        return CUDAGraphDecoder(model, caches, lengths, max_steps=max_steps)
    except CacheCapacityError as e:
        if cuda_graph:
            raise
        warnings.warn(f"kvtier: decoding without a CUDA graph ({e})", RuntimeWarning, stacklevel=2)
        return PlannedDecoder(model, caches, lengths)
