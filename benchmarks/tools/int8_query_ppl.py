"""Perplexity of q8 pages with the int8 queries of the Triton kernel, on the CPU.

    PYTHONPATH=src python3 benchmarks/tools/int8_query_ppl.py [--context 1024] [--max-tokens 4096]

On CUDA the paged kernel scores q8 keys with each query row rounded to int8 codes
(``kvtier.kernels.triton_attention.INT8_QUERIES``); on the CPU the paged tier attends through
PyTorch. This runs ``kvtier eval ppl``'s comparison (``evaluate_modes``, the default model and
text) twice, the second time with the queries of q8 pages rounded as the kernel rounds them
(``kvtier.kernels.reference.round_queries_int8``), so the difference is the rounding alone.
``--probs`` adds a third run with the value side of ``LaunchConfig(int8_probs=True)`` too: each
query row's weights ``p * value scale`` rounded to int8 codes per tile of 128 keys (the scale
``max / 127`` of the row in the tile), emulated in PyTorch.
"""

from __future__ import annotations

import argparse
import time

import torch


def main() -> None:
    from kvtier.caches.paged import PagedKVCache
    from kvtier.evaluate import EvalConfig, default_text, encode_text, evaluate_modes
    from kvtier.kernels.reference import round_queries_int8
    from kvtier.model import load_model
    from kvtier.quant.kv_quant import Q8Codec

    p = argparse.ArgumentParser()
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--max-tokens", type=int, default=4096)
    p.add_argument("--probs", action="store_true", help="also int8 weights against the value codes")
    args = p.parse_args()
    lm = load_model(None, progress=False)
    model = lm.model
    tokens = encode_text(lm.tokenizer, default_text(), args.max_tokens)
    cfg = EvalConfig(modes=("fp", "q8"), context=args.context, max_tokens=args.max_tokens)
    plain = PagedKVCache.attention

    def rounded(self, queries, **kw):
        if type(self.codecs.k_codec) is Q8Codec:
            queries = round_queries_int8(queries).to(queries.dtype)
        return plain(self, queries, **kw)

    def probs(self, queries, scale=None, q_start=None):
        if type(self.codecs.v_codec) is not Q8Codec:
            return plain(self, queries, scale=scale, q_start=q_start)
        return emulate_int8_probs(self, round_queries_int8(queries).to(queries.dtype), scale, q_start)

    runs = {"q8, queries as they are": plain, "q8, int8 queries": rounded}
    if args.probs:
        runs["q8, int8 queries and probabilities"] = probs
    rows = []
    for label, attend in runs.items():
        PagedKVCache.attention = attend
        t0 = time.perf_counter()
        res = {r.mode: r for r in evaluate_modes(model, tokens, cfg)}
        PagedKVCache.attention = plain
        rows.append((label, res["fp"], res["q8"], time.perf_counter() - t0))
    print(f"{len(tokens)} tokens, context {args.context}")
    print("| run | fp ppl | q8 ppl | delta vs fp | KL | top-1 |")
    print("|---|---|---|---|---|---|")
    for label, fp, q8, _ in rows:
        print(f"| {label} | {fp.ppl:.4f} | {q8.ppl:.4f} | {q8.delta_pct:+.3f}% | {q8.kl:.5f} | {100 * q8.top1:.2f}% |")


def emulate_int8_probs(cache, queries, scale, q_start, tile: int = 128):
    """Attention over ``cache``'s q8 pages as the kernel weighs the values with int8 probabilities
    (:func:`kvtier.kernels.reference.int8_probs_attention`, tiles of 128 keys as on CUDA)."""
    from kvtier.kernels.paged import gather_rows
    from kvtier.kernels.reference import int8_probs_attention

    pool = cache.pool
    B = queries.shape[0]
    qs = torch.tensor(q_start if q_start is not None else cache._write_start).reshape(-1).expand(B)
    kv_len = torch.as_tensor(cache.offset).reshape(-1).expand(B).cpu()
    L = int(kv_len.max())
    tables = pool.block_tables
    k = gather_rows(pool.key_cache, pool.k_sidecars, tables, kv_len, L, codec=cache.codecs.k_codec)
    v = gather_rows(pool.value_cache, pool.v_sidecars, tables, kv_len, L, codec=cache.codecs.v_codec).float()
    s_v = v.abs().amax(-1) / 127.0  # the codec's scale: its largest code is 127
    out = int8_probs_attention(queries, k, v, s_v, q_start=qs, kv_len=kv_len, scale=scale, tile=tile)
    return out.to(queries.dtype)


if __name__ == "__main__":
    main()
