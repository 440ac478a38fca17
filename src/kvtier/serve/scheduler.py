"""Which rows the next forward runs: continuous batching under a token budget, admission by free
blocks, preemption by recompute.

Every step :meth:`Scheduler.schedule` returns a :class:`StepBatch` of plain data
(picklable: tensor parallelism broadcasts it from rank 0), built in this order:

1. **Decode rows.** Each running request with one token left to compute (its last
   sampled token) feeds that token. It needs a slot for it: when its block list is
   full it takes a fresh block, and when none is free the *newest* running request
   is preempted (its blocks are freed; it goes back to the front of the waiting
   queue and is recomputed later) until the block fits or the request itself was
   the newest. Under the ``"priority"`` policy the victim is the running request of the
   highest ``priority`` value (the newest among equals), and it goes back to the waiting
   queue at its place by priority and arrival. The rows go longest context first: the attention kernel's programs
   start in row order, so no long row is left to run alone at the end of a launch
   (H200, 256 rows of 64-1,280 keys: 175 -> 162 us a layer).
2. **Prefill chunks** of running requests whose prompt is not all in yet, oldest
   first, with what is left of ``max_batched_tokens``.
3. **Admissions** from the waiting queue, first come first served (or, with the
   ``"priority"`` policy, lowest ``Request.priority`` first, then first come), while the budget
   lasts, fewer than ``max_num_seqs`` run and the head's blocks fit (no admission in
   a step that preempted). An admitted request takes references on the cached blocks
   of its prompt's longest cached prefix (:meth:`BlockManager.match_prefix`), skips
   computing them, and gets blocks for the rest of its prompt at once, so a prefill
   never runs out of blocks half way; blocks of the prefix that only the host tier still
   holds are loaded into fresh ones (the batch's ``copies``). Its first chunk runs in the
   same step.

A request that wants the logits of its prompt positions (``Request.prompt_logits``,
for prompt logprobs) is admitted without its cached prefix (every position is computed)
and runs in chunks, rows marked ``all_logits``, of at most ``max_prompt_logits`` tokens a
step for all such requests together, until the engine has its prompt's logits.

A row feeds ``token_ids`` at positions ``start ..``; it is *sampled* when its last
fed token is the request's last token (the end of the prompt, or the token sampled
the step before). :meth:`Scheduler.update` books what the forward computed, appends
the sampled tokens, hashes the newly full blocks for the prefix cache and finishes
requests that reached ``max_tokens``. A request never exceeds ``max_tokens`` new
tokens nor ``max_model_len`` tokens in all (checked at :meth:`Scheduler.add`).

Example::

    >>> from kvtier.serve.prefix import BlockManager
    >>> s = Scheduler(SchedulerConfig(max_model_len=64), BlockManager(16, 4))
    >>> s.add(Request("a", [1, 2, 3, 4, 5], max_tokens=2))
    >>> batch = s.schedule()
    >>> [(r.request_id, r.token_ids, r.start, r.sample) for r in batch.rows]
    [('a', (1, 2, 3, 4, 5), 0, True)]
    >>> s.update(batch, {"a": 9})
    []
    >>> [(r.token_ids, r.start) for r in s.schedule().rows]       # decode: the token sampled
    [((9,), 5)]
"""

from __future__ import annotations

import enum
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace

from kvtier.serve.prefix import BlockManager

__all__ = ["PENDING", "POLICIES", "QueueFull", "Request", "RequestStatus", "ScheduledRow", "Scheduler",
           "SchedulerConfig", "StepBatch"]

#: the token id booked for a sampled row whose token is still on the device (asynchronous
#: scheduling: the next step is scheduled before this one's tokens reach the host)
PENDING = -1


class QueueFull(RuntimeError):
    """The waiting queue holds ``max_waiting`` requests; try again later (HTTP 429)."""


#: the scheduling policies (:class:`SchedulerConfig`)
POLICIES = ("fcfs", "priority")


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


def _int_at_least(name: str, v, low: int) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < low:
        raise ValueError(f"{name} must be an int >= {low}, got {v!r}")
    return v


@dataclass(frozen=True)
class SchedulerConfig:
    """Limits of one step and of the queue.

    ``max_num_seqs``: running requests at most (rows of a decode step);
    ``max_batched_tokens``: tokens one step feeds, decode and prefill together (at
    least ``max_num_seqs``, so every running request can decode);
    ``max_waiting``: requests queued for admission before :meth:`Scheduler.add`
    raises :class:`QueueFull`; ``max_model_len``: prompt plus generated tokens of
    one request at most; ``max_prompt_logits``: prompt tokens a step feeds, all requests
    together, whose every position's logits are wanted (prompt logprobs: the logits are
    ``tokens x vocab`` floats); ``policy``: ``"fcfs"`` (first come, first served) or
    ``"priority"`` (lowest ``Request.priority`` first, as vLLM's ``--scheduling-policy``);
    ``window``: the sliding window of a model whose every layer has one (``None``: none), the
    keys a token reads at most: a request's blocks before its window are released as it
    advances (see :meth:`Scheduler.update`).
    """

    max_model_len: int
    max_num_seqs: int = 64
    max_batched_tokens: int = 512
    max_waiting: int = 256
    max_prompt_logits: int = 512
    policy: str = "fcfs"
    window: int | None = None

    def __post_init__(self) -> None:
        # max_waiting 0 would refuse every request: each one waits at least until the next step
        for name in ("max_model_len", "max_num_seqs", "max_batched_tokens", "max_waiting", "max_prompt_logits"):
            _int_at_least(name, getattr(self, name), 1)
        if self.window is not None:
            _int_at_least("window", self.window, 1)
        if self.policy not in POLICIES:
            raise ValueError(f"scheduling policy must be one of {', '.join(POLICIES)}, got {self.policy!r}")
        if self.max_batched_tokens < self.max_num_seqs:
            raise ValueError(f"max_batched_tokens {self.max_batched_tokens} is below max_num_seqs "
                             f"{self.max_num_seqs}: a step could not decode every running request; "
                             "raise max_batched_tokens or lower max_num_seqs")


@dataclass(eq=False)
class Request:
    """One request's tokens and books. ``token_ids`` is the prompt followed by the tokens
    generated so far; ``num_computed`` of them have their keys and values in ``blocks``."""

    request_id: str
    prompt_token_ids: list[int]
    max_tokens: int
    token_ids: list[int] = field(default_factory=list)
    blocks: list[int] = field(default_factory=list)
    num_computed: int = 0
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache at the last admission
    num_preemptions: int = 0
    status: RequestStatus = RequestStatus.WAITING
    prompt_logits: bool = False  # every prompt position's logits wanted (until the engine has them)
    priority: int = 0  # under the "priority" policy: lower runs first
    arrival: int = 0  # the scheduler's count of requests added before it
    behind: list[tuple[int, bytes | None]] = field(default_factory=list)  # released behind a window: (block, hash)

    def __post_init__(self) -> None:
        if isinstance(self.priority, bool) or not isinstance(self.priority, int):
            raise ValueError(f"priority must be an int, got {self.priority!r}")
        if not isinstance(self.request_id, str) or not self.request_id:
            raise ValueError(f"request_id must be a non-empty str, got {self.request_id!r}")
        ids = self.prompt_token_ids
        if not isinstance(ids, list) or not ids or not all(
                isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids):
            raise ValueError(f"prompt_token_ids must be a non-empty list of int token ids >= 0, "
                             f"got {str(ids)[:60]}")
        _int_at_least("max_tokens", self.max_tokens, 1)
        self.token_ids = list(ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)  # read per row every step


@dataclass(frozen=True)
class ScheduledRow:
    """One row of a step: feed ``token_ids`` at positions ``start, start + 1, ...``, reading and
    writing the physical ``blocks`` (the row's whole block list); ``sample`` its last position.
    A decode row's token may be :data:`PENDING`: the step in flight samples it, and the runner
    takes it from that step's tokens on the device. ``all_logits``: the logits of every fed
    position are wanted (a chunk of a prompt whose logprobs are asked for). ``draft``: the last
    ``draft`` of ``token_ids`` are drafts (:mod:`kvtier.serve.speculate`), not yet the request's,
    and the logits of the last ``draft + 1`` positions are wanted."""

    request_id: str
    token_ids: tuple[int, ...]
    start: int
    blocks: tuple[int, ...]
    sample: bool
    all_logits: bool = False
    draft: int = 0


@dataclass(frozen=True)
class StepBatch:
    """What one step runs: decode rows first (longest first), then prefill chunks. Plain data,
    picklable."""

    rows: tuple[ScheduledRow, ...] = ()
    preempted: tuple[str, ...] = ()
    #: block copies between the pool and the host tier to run first, in order
    #: (:meth:`BlockManager.take_copies <kvtier.serve.prefix.BlockManager.take_copies>`)
    copies: tuple[tuple[str, int, int], ...] = ()

    @property
    def num_tokens(self) -> int:
        return sum(len(r.token_ids) for r in self.rows)

    @property
    def sampled(self) -> tuple[str, ...]:
        """Request ids of the sampled rows, in row order (the order of the runner's logits)."""
        return tuple(r.request_id for r in self.rows if r.sample)


class Scheduler:
    """Waiting queue, running list and the step policy of the module docstring over one
    :class:`~kvtier.serve.prefix.BlockManager`."""

    def __init__(self, config: SchedulerConfig, block_manager: BlockManager):
        if not isinstance(config, SchedulerConfig):
            raise ValueError(f"config must be a SchedulerConfig, got {type(config).__name__}")
        room = block_manager.num_blocks * block_manager.block_size
        if config.max_model_len > room:
            raise ValueError(f"max_model_len {config.max_model_len} exceeds the {room} tokens the "
                             f"{block_manager.num_blocks} blocks hold: a lone request could never "
                             "fit; give more blocks or lower max_model_len")
        self.config, self.blocks = config, block_manager
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # in admission order: the last is the newest
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0
        self._arrivals = 0
        # blocks behind a window are released only where it is wider than a block (_release)
        w = config.window
        self.window = w if w is not None and w > block_manager.block_size else None
        self.released_blocks = 0  # blocks released behind a sliding window so far (``window``; None: none)

    # -- requests -----------------------------------------------------------------------------
    def add(self, request: Request) -> None:
        """Queue ``request``. ``ValueError`` for a duplicate id or a request longer than
        ``max_model_len``; :class:`QueueFull` when ``max_waiting`` requests wait."""
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use; ids must be unique")
        total = request.num_prompt_tokens + request.max_tokens
        if total > self.config.max_model_len:
            raise ValueError(f"the prompt's {request.num_prompt_tokens} tokens plus max_tokens "
                             f"{request.max_tokens} exceed the context of {self.config.max_model_len} "
                             "tokens; shorten the prompt or lower max_tokens")
        if request.priority and self.config.policy != "priority":
            raise ValueError(f"priority {request.priority} needs the priority scheduling policy (kvtier serve "
                             "--scheduling-policy priority, EngineConfig(scheduling_policy=\"priority\")); first "
                             "come, first served would ignore it")
        if len(self.waiting) >= self.config.max_waiting:
            raise QueueFull(f"{len(self.waiting)} requests are waiting (max_waiting "
                            f"{self.config.max_waiting}); retry later")
        self.requests[request.request_id] = request
        request.arrival, self._arrivals = self._arrivals, self._arrivals + 1
        self._queue(request)

    def finish(self, request_id: str) -> bool:
        """End a request (a stop, an abort): its blocks are freed. False if it was not live."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return False
        if req.status is RequestStatus.RUNNING:
            self.running.remove(req)
            self._free(req)
        else:
            self.waiting.remove(req)
        req.blocks, req.status = [], RequestStatus.FINISHED
        return True

    abort = finish

    def forget(self, batch: StepBatch) -> None:
        """A step that raised: its copies may not have run (:meth:`BlockManager.forget
        <kvtier.serve.prefix.BlockManager.forget>`), so the requests that were to load blocks go
        back to the waiting queue, to load or compute them again; the other rows are fed again by
        the next step as they stand."""
        loaded = {b for kind, _, b in batch.copies if kind == "load"}
        self.blocks.forget(batch.copies)
        for req in [r for r in self.running if loaded.intersection(r.blocks)]:
            self._preempt(req)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    # -- one step ------------------------------------------------------------------------------
    def schedule(self, drafts: Callable[[Request, int], Sequence[int]] | None = None) -> StepBatch:
        """The rows of the next forward (see the module docstring); books blocks, not tokens.
        ``drafts(request, k)``: up to ``k`` draft tokens for a decode row (:meth:`_add_drafts`)."""
        budget = self.config.max_batched_tokens
        rows: list[ScheduledRow] = []
        preempted: list[str] = []
        for req in list(self.running):  # 1. decode rows, oldest first
            if req.status is not RequestStatus.RUNNING or self._left(req) != 1:
                continue
            while not self._make_room(req):
                victim = self.running[-1] if self.config.policy == "fcfs" else max(self.running, key=_rank)
                self._preempt(victim)
                preempted.append(victim.request_id)
                if any(r.request_id == victim.request_id for r in rows):  # (scheduled before it: taken back)
                    rows = [r for r in rows if r.request_id != victim.request_id]
                    budget += 1
                if victim is req:
                    break
            if req.status is RequestStatus.RUNNING:
                rows.append(self._row(req, 1))
                budget -= 1
        if drafts is not None:
            budget = self._add_drafts(rows, budget, drafts)
        rows.sort(key=lambda r: -r.start)  # longest first (stable: oldest first among equals)
        logits = self.config.max_prompt_logits  # all_logits tokens left to this step
        for req in self.running:  # 2. prefill chunks of running requests
            if budget > 0 and self._left(req) > 1 and (logits > 0 or not req.prompt_logits):
                n = self._chunk(req, budget, logits)
                rows.append(self._row(req, n))
                budget -= n
                logits -= n if req.prompt_logits else 0
        while (self.waiting and budget > 0 and not preempted  # 3. admissions
               and len(self.running) < self.config.max_num_seqs
               and (logits > 0 or not self.waiting[0].prompt_logits) and self._admit(self.waiting[0])):
            req = self.waiting.popleft()
            n = self._chunk(req, budget, logits)
            rows.append(self._row(req, n))
            budget -= n
            logits -= n if req.prompt_logits else 0
        return StepBatch(tuple(rows), tuple(preempted), tuple(self.blocks.take_copies()))

    def update(self, batch: StepBatch, sampled: Mapping[str, int | tuple[int, ...]]) -> list[Request]:
        """Book the step: each row's tokens are computed, sampled rows get ``sampled[id]``
        (:data:`PENDING` while it is on the device: :meth:`set_token` fills it in later). A row
        with drafts gets the tuple of the tokens it gives (:meth:`Speculator.accept
        <kvtier.serve.speculate.Speculator.accept>`: the drafts kept, then the next token); the
        drafts not kept are not computed.

        Returns the requests finished by length (``max_tokens``), whose blocks are
        freed. Rows of requests that ended since :meth:`schedule` are skipped.
        """
        finished = []
        for row in batch.rows:
            req = self.requests.get(row.request_id)
            if req is None or req.status is not RequestStatus.RUNNING:
                continue
            assert row.start == req.num_computed, "a row must continue where its request stands"
            if row.draft:  # the drafts kept (their keys and values stand) and the token after them
                given = sampled[row.request_id]
                kept = len(given) - 1
                assert tuple(given[:kept]) == row.token_ids[len(row.token_ids) - row.draft:][:kept], "kept drafts differ"
                req.num_computed = row.start + len(row.token_ids) - row.draft + kept
                req.token_ids.extend(int(t) for t in given)
            else:
                req.num_computed = row.start + len(row.token_ids)
            self.blocks.cache_full_blocks(req.blocks, req.token_ids, req.num_computed)
            if self.window is not None:
                self._release(req)
            if not row.sample:
                continue
            if not row.draft:
                assert req.num_computed == len(req.token_ids), "only a request's last token is sampled"
                req.token_ids.append(int(sampled[row.request_id]))
            if req.num_output_tokens >= req.max_tokens:
                self.finish(req.request_id)
                finished.append(req)
        return finished

    @staticmethod
    def set_token(request: Request, token: int) -> None:
        """Fill in ``request``'s last token, :data:`PENDING`, once it is on the host (the engine
        does it before it books the step that fed the token, so that block hashes never see a
        placeholder)."""
        assert request.token_ids[-1] == PENDING and token >= 0, (request.request_id, token)
        request.token_ids[-1] = token

    # -- internals -------------------------------------------------------------------------------
    @staticmethod
    def _left(req: Request) -> int:
        """Tokens of the request not yet computed (1 while it decodes)."""
        return len(req.token_ids) - req.num_computed

    def _chunk(self, req: Request, budget: int, logits: int) -> int:
        """Tokens of ``req`` the step feeds: what is left, within the budget (and, while its
        prompt's logits are wanted, within the ``logits`` tokens left of ``max_prompt_logits``)."""
        n = min(self._left(req), budget)
        return min(n, logits) if req.prompt_logits else n

    def _row(self, req: Request, n: int) -> ScheduledRow:
        start = req.num_computed
        assert req.num_output_tokens < req.max_tokens and start + n <= self.config.max_model_len
        return ScheduledRow(req.request_id, tuple(req.token_ids[start : start + n]), start,
                            tuple(req.blocks), start + n == len(req.token_ids),
                            req.prompt_logits and start < req.num_prompt_tokens - 1)

    def _add_drafts(self, rows: list[ScheduledRow], budget: int,
                    drafts: Callable[[Request, int], Sequence[int]]) -> int:
        """Give the decode ``rows`` (in order, while ``budget`` tokens are left) the drafts
        ``drafts`` proposes, within the request's ``max_tokens`` (the token after the drafts
        counts too), the context and the room of its blocks: never a preemption, and fresh
        blocks only while more stay free than requests run. Returns the budget left."""
        for i, row in enumerate(rows):
            req = self.requests[row.request_id]
            k = min(budget, req.max_tokens - req.num_output_tokens - 1,
                    self.config.max_model_len - len(req.token_ids))
            if k <= 0 or req.token_ids[-1] == PENDING:
                continue
            d = list(drafts(req, k))[:k]
            room = len(req.blocks) * self.blocks.block_size - len(req.token_ids)
            if len(d) > room:
                spare = self.blocks.num_free_blocks - len(self.running)
                more = min(max(spare, 0), self.blocks.blocks_for(len(req.token_ids) + len(d)) - len(req.blocks))
                if more > 0:
                    self.blocks.grow(req.blocks, (len(req.blocks) + more) * self.blocks.block_size)
                d = d[: len(req.blocks) * self.blocks.block_size - len(req.token_ids)]
            if d:
                rows[i] = replace(row, token_ids=row.token_ids + tuple(d), blocks=tuple(req.blocks), draft=len(d))
                budget -= len(d)
        return budget

    def _release(self, req: Request) -> None:
        """Release ``req``'s blocks that lie wholly before the window of its next token: no later
        token reads them (its tokens only advance; a preemption recomputes from the start). Their
        places in ``req.blocks`` name the runner's scratch block (id ``num_blocks``), which no
        kernel reads there. After :meth:`BlockManager.cache_full_blocks`: with a window wider than
        a block the newest hashed block, whose hash the next full block chains on, stays."""
        n, k = (req.num_computed - self.window + 1) // self.blocks.block_size, len(req.behind)
        if n > k:
            req.behind += self.blocks.release(req.blocks[k:n])
            req.blocks[k:n] = [self.blocks.num_blocks] * (n - k)
            self.released_blocks += n - k

    def _free(self, req: Request) -> None:
        """Free the blocks ``req`` holds; those it released before go to the recent end of the
        prefix cache's LRU after them (its chain is then evicted tail first)."""
        self.blocks.free(req.blocks[len(req.behind) :])
        self.blocks.refresh(req.behind)

    def _make_room(self, req: Request) -> bool:
        """Give ``req`` the block its next token needs; False when none is free."""
        if self.blocks.blocks_for(len(req.token_ids)) <= len(req.blocks):
            return True
        if self.blocks.num_free_blocks < 1:
            return False
        self.blocks.grow(req.blocks, len(req.token_ids))
        return True

    def _admit(self, req: Request) -> bool:
        """Start ``req`` if the blocks of its whole prompt fit: the cached prefix by reference,
        the rest fresh. At least its last token is computed (it is sampled). A request whose
        prompt's logits are wanted computes every position: no prefix."""
        prefix = [] if req.prompt_logits else self.blocks.match_prefix(req.token_ids[:-1])
        if not self.blocks.can_allocate(len(req.token_ids), prefix):
            return False
        load = [] if req.prompt_logits else self.blocks.match_offloaded(req.token_ids[:-1], prefix)
        req.blocks = self.blocks.allocate(len(req.token_ids), prefix, load)
        req.num_computed = req.num_cached_tokens = (len(prefix) + len(load)) * self.blocks.block_size
        req.status = RequestStatus.RUNNING
        self.running.append(req)
        return True

    def _preempt(self, req: Request) -> None:
        """Free ``req``'s blocks and queue it first, to be recomputed from its tokens so far."""
        self.running.remove(req)
        self._free(req)
        req.blocks, req.num_computed, req.behind = [], 0, []
        req.status = RequestStatus.WAITING
        req.num_preemptions += 1
        self.num_preemptions += 1
        self._queue(req, first=True)

    def _queue(self, req: Request, first: bool = False) -> None:
        """Put ``req`` in the waiting queue: at the back (``first``: the front), or under the
        priority policy at its place by priority and arrival."""
        if self.config.policy == "priority":
            at = next((k for k, w in enumerate(self.waiting) if _rank(w) > _rank(req)), len(self.waiting))
            self.waiting.insert(at, req)
        elif first:
            self.waiting.appendleft(req)
        else:
            self.waiting.append(req)


def _rank(req: Request) -> tuple[int, int]:
    """A request's place under the priority policy: lower priority values first, then arrival."""
    return req.priority, req.arrival
