"""A prompt's forward on the CPU: kvtier's float32 and bfloat16 prefills (``--prefill-dtype``,
:mod:`kvtier.kernels.precision`) against transformers' forward of the same weights in float32
and in bfloat16, measured side by side.

    PYTHONPATH=src python3 benchmarks/tools/cpu_prefill.py [--tokens 128,512,1024,2048]
        [--tier tail] [--threads 2] [--repeats 3] [--no-hf] [--json FILE]

Each contender runs one forward of the whole prompt (the default model, its text: the first
``N`` tokens of Python's ``pydoc_data.topics``) from empty caches, the LM head on the last
position only (kvtier ``last_only``, transformers ``logits_to_keep=1``); the best of
``--repeats`` warm runs a contender, the contenders alternated. Printed per length: milliseconds,
prompt tokens a second, the speed-up over transformers' float32 forward and over kvtier's
float32 prefill, and the last position's logits against kvtier's float32 ones (the largest
difference; whether the next token is the same).
"""

from __future__ import annotations

import argparse
import json
import time

import torch


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", default="128,512,1024,2048", help="prompt lengths, comma-separated")
    p.add_argument("--tier", default="tail", help="kvtier's cache tier")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--no-hf", dest="hf", action="store_false", help="skip transformers")
    p.add_argument("--json", default=None, help="write the figures here too")
    args = p.parse_args()
    torch.set_num_threads(args.threads)

    from kvtier.config import KVCacheConfig
    from kvtier.evaluate import default_text, encode_text
    from kvtier.kernels.precision import bf16_matmuls_fast
    from kvtier.model import load_model

    lm = load_model(device="cpu", dtype=torch.float32, progress=False)
    lengths = [int(t) for t in args.tokens.split(",")]
    ids_all = encode_text(lm.tokenizer, default_text(), max(lengths))
    config = KVCacheConfig(tier=args.tier)

    def kvtier_run(dtype):
        def run(ids):
            lm.model.prefill_dtype = dtype
            return lm.model(ids, lm.model.make_caches(config), last_only=True)[0, -1]
        return run

    contenders = {"kvtier float32": kvtier_run("float32"), "kvtier bfloat16": kvtier_run("bfloat16")}
    if args.hf:
        from transformers import AutoModelForCausalLM

        path = lm.source
        for name, dtype in (("transformers float32", torch.float32), ("transformers bfloat16", torch.bfloat16)):
            hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=dtype).eval()
            contenders[name] = (lambda m: lambda ids: m(ids, logits_to_keep=1).logits[0, -1].float())(hf)
    print(f"{lm.source.name}, {args.threads} threads, torch {torch.__version__}, tier {args.tier}, "
          f"bfloat16 in hardware: {bf16_matmuls_fast()}")
    rows = []
    with torch.inference_mode():
        for n in lengths:
            ids = torch.tensor([ids_all[:n]])
            best = {name: float("inf") for name in contenders}
            logits = {}
            for _ in range(args.repeats + 1):  # the first round warms each contender up
                for name, fn in contenders.items():
                    t = time.perf_counter()
                    logits[name] = fn(ids)
                    best[name] = min(best[name], time.perf_counter() - t)
            ref = logits["kvtier float32"]
            hf32 = best.get("transformers float32")
            for name, s in best.items():
                row = {"tokens": n, "contender": name, "ms": round(s * 1e3, 1), "tok_s": round(n / s, 1),
                       "vs_kvtier_fp32": round(best["kvtier float32"] / s, 2),
                       "vs_hf_fp32": None if hf32 is None else round(hf32 / s, 2),
                       "max_logit_diff": round(float((logits[name] - ref).abs().max()), 4),
                       "same_next_token": bool(logits[name].argmax() == ref.argmax())}
                rows.append(row)
    head = f"{'tokens':>6} {'contender':<22} {'ms':>9} {'tok/s':>8} {'vs HF fp32':>10} {'vs fp32':>8} {'max |dlogit|':>12} {'same next':>9}"
    print(head)
    for r in rows:
        vs_hf = "" if r["vs_hf_fp32"] is None else f"{r['vs_hf_fp32']:.2f}x"
        print(f"{r['tokens']:>6} {r['contender']:<22} {r['ms']:>9.1f} {r['tok_s']:>8.1f} {vs_hf:>10} "
              f"{r['vs_kvtier_fp32']:>7.2f}x {r['max_logit_diff']:>12.4f} {str(r['same_next_token']):>9}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": lm.source.name, "threads": args.threads, "tier": args.tier,
                       "torch": torch.__version__, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
