"""The engine's warm-up (:meth:`LLMEngine.warm_up <kvtier.serve.engine.LLMEngine.warm_up>`):
made-up requests through each kind of step the engine takes, then forgotten.

On CUDA the first step of each kind compiles or loads its kernels (Triton's, the GEMM
library's), which would otherwise fall on the first users' requests. The requests:
random token ids, greedy, ``new_tokens`` each (fewer in a context too short for them)
with end-of-sequence ignored; a prompt longer than one step's token budget (chunked,
its second chunk over a history), shorter ones packed beside it and beside decode
rows, with prefix caching on one that starts with a cached prefix, and where xgrammar is
installed one held to a pattern (the grammars' vocabulary tables take seconds to build).
Afterwards every block is free, the prefix cache is empty (so a warm-up after serving
forgets the cached prefixes too) and the counters of :meth:`~kvtier.serve.engine.LLMEngine.stats`
(the speculative ones too) are as before; what was compiled stays.
"""

from __future__ import annotations

import importlib.util
import random
import time

from kvtier.serve.params import RequestParams
from kvtier.serve.structured import Structure

__all__ = ["warm_up"]


def warm_up(engine, new_tokens: int = 4) -> dict[str, int | float]:
    """:meth:`LLMEngine.warm_up <kvtier.serve.engine.LLMEngine.warm_up>` of ``engine`` (the module
    docstring)."""
    if engine.has_unfinished():
        raise ValueError("warm_up() runs before any request: finish or abort the live ones first")
    if isinstance(new_tokens, bool) or not isinstance(new_tokens, int) or new_tokens < 1:
        raise ValueError(f"new_tokens must be an int >= 1, got {new_tokens!r}")
    if engine.max_model_len < 2:
        raise ValueError(f"a context of {engine.max_model_len} token holds no prompt and new token; "
                         "raise max_model_len (or the pool's blocks)")
    t0, rng = time.perf_counter(), random.Random(0)
    new_tokens = min(new_tokens, engine.max_model_len - 1)  # a short context: shorter made-up requests
    room = engine.max_model_len - new_tokens
    bs, budget = engine.config.block_size, engine.scheduler.config.max_batched_tokens
    lengths = sorted({min(n, room) for n in (budget + bs + 1, 1, 3, 17, 100, 300)}, reverse=True)
    prompts = [[rng.randrange(engine.model.args.vocab_size) for _ in range(n)] for n in lengths]
    if engine.block_manager.enable_prefix_caching and len(prompts[0]) > bs:
        prompts.append(prompts[0][:bs] + prompts[-1])  # its first block is cached by then
    params = [RequestParams(max_tokens=new_tokens, ignore_eos=True)] * len(prompts)
    if engine.grammars is not None and engine.eos_ids and importlib.util.find_spec("xgrammar"):
        # a structured answer: the vocabulary's tables for grammars (seconds), the masks' kernel
        params[len(lengths) - 1] = RequestParams(max_tokens=new_tokens, structure=Structure("regex", "[^<]*"))
    bm = engine.block_manager
    spec = engine.speculator
    s = engine.scheduler
    counters = (engine.steps, engine.prompt_tokens, engine.generation_tokens, s.num_preemptions, s.released_blocks,
                bm.prefix_queries, bm.prefix_hits, bm.host_hits, bm.blocks_saved, bm.blocks_loaded)
    drafted = None if spec is None else (spec.drafts, spec.draft_tokens, spec.accepted)
    try:  # the shared prefix after its owner has run
        for group in (range(len(lengths)), range(len(lengths), len(prompts))):
            for i in group:
                engine.add_request(prompts[i], params[i], request_id=f"warm-up-{i}")
            while engine.has_unfinished():
                engine.step()
    except BaseException:
        engine.abort_all()  # no made-up request outlives a failed warm-up
        raise
    report = {"requests": len(prompts), "steps": engine.steps - counters[0],
              "prompt_tokens": sum(map(len, prompts)), "seconds": time.perf_counter() - t0}
    bm.reset_prefix_cache()
    (engine.steps, engine.prompt_tokens, engine.generation_tokens, s.num_preemptions, s.released_blocks,
     bm.prefix_queries, bm.prefix_hits, bm.host_hits, bm.blocks_saved, bm.blocks_loaded) = counters
    if spec is not None:
        spec.drafts, spec.draft_tokens, spec.accepted = drafted
    return report
