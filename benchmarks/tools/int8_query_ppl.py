"""Perplexity of q8 pages with the int8 queries of the Triton kernel, on the CPU.

    PYTHONPATH=src python3 benchmarks/tools/int8_query_ppl.py [--context 1024] [--max-tokens 4096]

On CUDA the paged kernel scores q8 keys with each query row rounded to int8 codes
(``kvtier.kernels.triton_attention.INT8_QUERIES``); on the CPU the paged tier attends through
PyTorch. This runs ``kvtier eval ppl``'s comparison (``evaluate_modes``, the default model and
text) twice, the second time with the queries of q8 pages rounded as the kernel rounds them
(``kvtier.kernels.reference.round_queries_int8``), so the difference is the rounding alone.
"""

from __future__ import annotations

import argparse
import time


def main() -> None:
    from kvtier.caches.paged import PagedKVCache
    from kvtier.evaluate import EvalConfig, default_text, encode_text, evaluate_modes
    from kvtier.kernels.reference import round_queries_int8
    from kvtier.model import load_model
    from kvtier.quant.kv_quant import Q8Codec

    p = argparse.ArgumentParser()
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--max-tokens", type=int, default=4096)
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

    rows = []
    for label in ("q8, queries as they are", "q8, int8 queries"):
        PagedKVCache.attention = rounded if "int8" in label else plain
        t0 = time.perf_counter()
        res = {r.mode: r for r in evaluate_modes(model, tokens, cfg)}
        PagedKVCache.attention = plain
        rows.append((label, res["fp"], res["q8"], time.perf_counter() - t0))
    print(f"{len(tokens)} tokens, context {args.context}")
    print("| run | fp ppl | q8 ppl | delta vs fp | KL | top-1 |")
    print("|---|---|---|---|---|---|")
    for label, fp, q8, _ in rows:
        print(f"| {label} | {fp.ppl:.4f} | {q8.ppl:.4f} | {q8.delta_pct:+.3f}% | {q8.kl:.5f} | {100 * q8.top1:.2f}% |")


if __name__ == "__main__":
    main()
