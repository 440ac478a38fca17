"""Where a serving step's time goes on CUDA: per-step wall times by step kind, a torch.profiler
table of prefill-phase and decode-phase steps, and greedy agreement with transformers.

    PYTHONPATH=src:benchmarks python3 benchmarks/tools/serve_profile.py --requests 64 --out DIR
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import time
from pathlib import Path

import torch


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--arch", default="llama3-8b")
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--input-len", default="64,1024")
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--max-batched-tokens", type=int, default=8192)
    p.add_argument("--out", default=".")
    p.add_argument("--device", default="cuda")
    args = p.parse_args()
    cuda = args.device.startswith("cuda")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    from kvtier.model import build_random
    from kvtier.serve.engine import EngineConfig, LLMEngine
    from kvtier.serve.params import RequestParams

    model = build_random(args.arch, dtype=torch.bfloat16 if cuda else torch.float32, device=args.device)
    lo, hi = (int(x) for x in args.input_len.split(","))
    rng = random.Random(0)
    vocab = model.args.vocab_size
    prompts = [[rng.randrange(vocab) for _ in range(rng.randint(lo, hi))] for _ in range(args.requests)]
    need = sum(math.ceil((len(q) + args.output_len) / 16) for q in prompts) + 64
    cfg = EngineConfig(num_blocks=need, block_size=16, max_num_seqs=args.requests,
                       max_batched_tokens=args.max_batched_tokens, max_waiting=args.requests,
                       enable_prefix_caching=False)
    engine = LLMEngine(model, None, cfg)
    params = RequestParams(max_tokens=args.output_len, ignore_eos=True)
    for q in prompts[:2]:  # warm-up
        engine.add_request(q, RequestParams(max_tokens=4, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()

    ids = {engine.add_request(q, params): i for i, q in enumerate(prompts)}
    tokens = [[] for _ in prompts]
    steps, profiled = [], {"prefill": 0, "decode": 0}
    t_all = time.perf_counter()
    while engine.has_unfinished():
        sched = engine.scheduler
        prefilling = sched.waiting or any(r.num_computed < r.num_prompt_tokens for r in sched.running)
        kind = "prefill" if prefilling else "decode"
        sync()
        t0 = time.perf_counter()
        if profiled[kind] < 1 and len(steps) > 2:
            profiled[kind] += 1
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]
                                        + [torch.profiler.ProfilerActivity.CUDA] * cuda,
                                        record_shapes=True) as prof:
                outs = engine.step()
                sync()
            ka = prof.key_averages()
            by_shape = prof.key_averages(group_by_input_shape=True)
            dev_time = "self_cuda_time_total" if cuda else "self_cpu_time_total"
            (out / f"profile_{kind}.txt").write_text(
                ka.table(sort_by="cuda_time_total" if cuda else "cpu_time_total", row_limit=30) + "\n\n"
                + ka.table(sort_by="cpu_time_total", row_limit=30) + "\n\n"
                + by_shape.table(sort_by=dev_time, row_limit=40, max_name_column_width=40,
                                 max_shapes_column_width=120))
        else:
            outs = engine.step()
        sync()
        dt = time.perf_counter() - t0
        steps.append({"kind": kind, "s": dt, "outputs": len(outs)})
        for o in outs:
            tokens[ids[o.request_id]] += o.token_ids
    total = time.perf_counter() - t_all
    summary = {"requests": args.requests, "total_s": total,
               "output_tok_s": sum(map(len, tokens)) / total}
    for kind in ("prefill", "decode"):
        xs = [s["s"] for s in steps if s["kind"] == kind]
        if xs:
            summary[kind] = {"steps": len(xs), "sum_s": sum(xs), "median_ms": 1000 * statistics.median(xs),
                             "max_ms": 1000 * max(xs)}
    print(json.dumps(summary, indent=1))
    (out / "steps.json").write_text(json.dumps({"summary": summary, "steps": steps}, indent=0))

    # greedy agreement with transformers on the same weights (4 prompts, 8 tokens)
    from kvtier_bench.decode_gpu import hf_llama

    hf = hf_llama(model)
    agree = []
    for i in range(4):
        x = torch.tensor([prompts[i]], device=args.device)
        with torch.no_grad():
            logits = hf(x).logits[0, -1].float()
            g = hf.generate(x, max_new_tokens=8, do_sample=False, eos_token_id=None, pad_token_id=0)
        top2 = logits.topk(2).values
        agree.append({"kvtier": tokens[i][:8], "transformers": g[0, x.shape[1]:].tolist(),
                      "hf_top2_gap": float(top2[0] - top2[1]), "hf_logit_std": float(logits.std())})
    print(json.dumps(agree))
    (out / "agreement.json").write_text(json.dumps(agree, indent=1))


if __name__ == "__main__":
    main()
