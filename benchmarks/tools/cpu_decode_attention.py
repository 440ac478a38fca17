"""The CPU decode attention over float32, q8 and fp8 pages: the PyTorch reference against the C kernel.

    PYTHONPATH=src python3 benchmarks/tools/cpu_decode_attention.py [--threads 2] [--calls 200]

SmolLM2's attention shape (9 query and 3 KV heads of 64, pages of 16 tokens). For each
case the rows' blocks are shuffled over the pool (a serving pool after some turnover)
or laid out in order (one sequence that took its blocks from the free list); prints the
median of five rounds of ``--calls`` calls for each path and the largest difference.
"""

from __future__ import annotations

import argparse
import functools
import random
import statistics
import time

import torch


def main() -> None:
    from kvtier.kernels.cpu_attention import paged_decode_cpu
    from kvtier.kernels.paged import paged_attention_reference
    from kvtier.quant.codec import IdentityCodec
    from kvtier.quant.fp8 import Fp8Codec
    from kvtier.quant.kv_quant import Q8Codec

    p = argparse.ArgumentParser()
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--calls", type=int, default=200)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    Hq, Hkv, D, bs = 9, 3, 64, 16
    codec = IdentityCodec(D, torch.float32)
    kw = dict(k_codec=codec, v_codec=codec, k_sidecars={}, v_sidecars={})
    rng = random.Random(0)
    serving = [rng.randint(64, 576) for _ in range(32)]
    cases = [("32 rows, 64-576 tokens, shuffled", serving, True, None),
             ("the same, q8 pages", serving, True, Q8Codec(D, torch.float32)),
             ("the same, fp8 pages", serving, True, Fp8Codec(D, torch.float32)),
             ("4 rows, 384 tokens, shuffled", [384] * 4, True, None)]
    cases += [(f"1 row, {n} tokens, in order", [n], False, None) for n in (128, 384, 1024, 2048)]
    print(f"{torch.get_num_threads()} threads, {args.calls} calls a round, median of 5 rounds")
    print(f"{'case':<36} {'reference us':>13} {'C kernel us':>12} {'speed-up':>9} {'max diff':>9}")
    for name, lengths, shuffled, coded in cases:
        need = [-(-n // bs) for n in lengths]
        ids = list(range(sum(need)))
        if shuffled:
            rng.shuffle(ids)
        tables = torch.zeros(len(lengths), max(need), dtype=torch.int32)
        at = 0
        for b, k in enumerate(need):
            tables[b, :k] = torch.tensor(ids[at : at + k], dtype=torch.int32)
            at += k
        kp, vp = torch.randn(sum(need), bs, Hkv, D), torch.randn(sum(need), bs, Hkv, D)
        q = torch.randn(len(lengths), Hq, 1, D)
        kv_len = torch.tensor(lengths)
        pages = kw
        if coded is not None:
            (kp, ks), (vp, vs) = coded.encode(kp), coded.encode(vp)
            pages = dict(k_codec=coded, v_codec=coded, k_sidecars=ks, v_sidecars=vs)
        call = (q, kp, vp, tables, kv_len - 1, kv_len)
        ref = functools.partial(paged_attention_reference, *call, **pages)
        mine = functools.partial(paged_decode_cpu, *call, **pages)
        diff = (ref() - mine()).abs().max().item()
        times = {ref: [], mine: []}
        for _ in range(5):
            for f in (ref, mine):
                f()
                t0 = time.perf_counter()
                for _ in range(args.calls):
                    f()
                times[f].append((time.perf_counter() - t0) / args.calls * 1e6)
        r, m = statistics.median(times[ref]), statistics.median(times[mine])
        print(f"{name:<36} {r:>13.1f} {m:>12.1f} {r / m:>8.2f}x {diff:>9.1e}")


if __name__ == "__main__":
    main()
