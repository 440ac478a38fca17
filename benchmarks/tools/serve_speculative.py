"""The serving engine with n-gram drafts (``kvtier serve --speculative-config``) against the same
engine without them, on the same requests in the same run: output tokens a second, steps,
drafts kept, and whether every request's tokens are the same.

The requests ask SmolLM2 (the default model) to copy text it was given: a paragraph of this
repository's docs, or a function of its source, each given whole and started on ("Copy:"
followed by its first line), greedy, ``--output-len`` tokens at most. ``--concurrency``
requests run at once, each a row of the engine's steps. ``--mix`` adds as many plain chat
questions, whose answers repeat little.

    python benchmarks/tools/serve_speculative.py [--requests 8] [--concurrency 1,8] [--k 2,4,8] [--mix] [--temperature T]

``--arch llama3-8b --device cuda`` bounds what drafts can give a model of that shape (random
bf16 weights, random prompts, whose greedy answers copy nothing): the same engine with drafts
that are all right (each request's tokens from the run without drafts) and all wrong (each
such token plus one), against no drafts.

    python benchmarks/tools/serve_speculative.py --arch llama3-8b --device cuda --concurrency 1,8,32 --k 4

In bf16 a row's logits in a graph of several rows differ from those of one row by rounding, and at a
near tie the greedy tokens part, after which the "right" drafts (the plain run's tokens) no longer
are; ``--dtype float32`` parts them far less often.
"""

from __future__ import annotations

import argparse
import re
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
GRAPHS = {"on": None}  # --no-cuda-graph: False
QUESTIONS = ("What is the capital of France?", "Name three colours.", "Why is the sky blue?",
             "What is 12 times 7?", "Give me a tip for sleeping well.", "What do bees make?",
             "Which planet is the largest?", "How many days are in a leap year?")


def texts(n: int) -> list[str]:
    """``n`` passages to copy: docs paragraphs and source functions of 200-700 characters."""
    paras = [p for p in (ROOT / "docs" / "serving.md").read_text().split("\n\n")
             if 200 <= len(p) <= 700 and not p.startswith(("|", "```"))]
    funcs = [m.group(0) for m in re.finditer(r"\ndef [\s\S]+?(?=\n\S)", (ROOT / "src/kvtier/drafters.py").read_text())
             if 200 <= len(m.group(0)) <= 700]
    both = [t for pair in zip(paras, funcs) for t in pair]
    return [both[i % len(both)].strip() for i in range(n)]


def prompts(tok, n: int, mix: bool) -> list[list[int]]:
    out = []
    for t in texts(n):
        msg = f"Copy this text exactly.\n\n{t}\n\nCopy:\n"
        out.append(tok.encode(tok.apply_chat_template([{"role": "user", "content": msg}]), add_bos=False)
                   + tok.encode(t.splitlines()[0] + "\n", add_bos=False))
    for q in QUESTIONS[:n] if mix else ():
        out.append(tok.encode(tok.apply_chat_template([{"role": "user", "content": q}]), add_bos=False))
    return out


def run(lm, reqs, concurrency: int, output_len: int, spec, drafts=None, temperature: float = 0.0) -> dict:
    from kvtier.sampling import SamplingParams
    from kvtier.serve.engine import EngineConfig, LLMEngine
    from kvtier.serve.params import RequestParams

    engine = LLMEngine(lm.model, lm.tokenizer, EngineConfig(num_blocks=1024 if lm.model.args.vocab_size < 60000 else 4096,
                                                            max_num_seqs=concurrency, speculative=spec,
                                                            cuda_graph=GRAPHS["on"], async_scheduling=False))
    engine.generate(reqs[:1], RequestParams(max_tokens=4, ignore_eos=True))  # warm
    if drafts is not None:
        engine.speculator.propose = drafts
    steps0 = engine.steps
    t = time.perf_counter()
    sampling = [SamplingParams(temperature=temperature, seed=i) for i in range(len(reqs))]
    outs = engine.generate(reqs, [RequestParams(max_tokens=output_len, ignore_eos=lm.tokenizer is None, sampling=s)
                                  for s in sampling])
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    dt = time.perf_counter() - t
    tokens = sum(len(o.token_ids) for o in outs)
    s = engine.stats()
    return {"seconds": dt, "tok_s": tokens / dt, "tokens": [o.token_ids for o in outs], "steps": engine.steps - steps0,
            "drafted": s.get("spec_draft_tokens", 0), "kept": s.get("spec_accepted_tokens", 0)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=8, help="copy requests")
    p.add_argument("--concurrency", default="1,8", help="requests at once (a list)")
    p.add_argument("--k", default="2,4,8", help="num_speculative_tokens (a list)")
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--mix", action="store_true", help="add as many chat questions")
    p.add_argument("--temperature", type=float, default=0.0, help="sample (seeded) instead of greedy decoding")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--arch", default=None, help="random weights of this shape: the bounds of right and wrong drafts")
    p.add_argument("--device", default="cuda")
    p.add_argument("--no-cuda-graph", action="store_true", help="every engine decodes eagerly")
    p.add_argument("--dtype", default=None, choices=("bfloat16", "float32"),
                   help="the random weights' dtype (default: bfloat16 on CUDA; float32 keeps a drafted "
                        "step's greedy tokens those of plain decoding more often)")
    args = p.parse_args()
    GRAPHS["on"] = False if args.no_cuda_graph else None
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.arch is not None:
        return bounds(args)
    from kvtier.model import load_model
    from kvtier.serve.speculate import SpeculativeConfig

    lm = load_model(progress=False)
    reqs = prompts(lm.tokenizer, args.requests, args.mix)
    how = f"sampled at temperature {args.temperature} (seeded)" if args.temperature else "greedy"
    print(f"{len(reqs)} requests ({args.requests} copies{', ' + str(len(reqs) - args.requests) + ' questions' if args.mix else ''}), "
          f"prompts {min(map(len, reqs))}-{max(map(len, reqs))} tokens, up to {args.output_len} new, {how}; "
          f"{torch.get_num_threads()} threads, torch {torch.__version__}")
    print("| concurrency | drafts a step (k) | output tok/s | vs no drafts | steps | drafts kept | same tokens |")
    print("|---|---|---|---|---|---|---|")
    for c in (int(x) for x in args.concurrency.split(",")):
        base = run(lm, reqs, c, args.output_len, None, temperature=args.temperature)
        print(f"| {c} | none | {base['tok_s']:.1f} | 1.00x | {base['steps']} | | |")
        for k in (int(x) for x in args.k.split(",")):
            r = run(lm, reqs, c, args.output_len, SpeculativeConfig(num_speculative_tokens=k), temperature=args.temperature)
            same = (f"{sum(a == b for a, b in zip(r['tokens'], base['tokens']))}/{len(reqs)}" if not args.temperature
                    else "(sampled)")
            rate = r["kept"] / r["drafted"] if r["drafted"] else 0.0
            print(f"| {c} | {k} | {r['tok_s']:.1f} | {r['tok_s'] / base['tok_s']:.2f}x | {r['steps']} | "
                  f"{r['kept']} of {r['drafted']} ({rate:.0%}) | {same} |", flush=True)


def bounds(args) -> None:
    """Right and wrong drafts on random weights (the module docstring)."""
    import random
    from types import SimpleNamespace

    from kvtier.model import build_random
    from kvtier.serve.speculate import SpeculativeConfig

    dtype = getattr(torch, args.dtype) if args.dtype else torch.bfloat16 if args.device == "cuda" else torch.float32
    model = build_random(args.arch, dtype=dtype, device=args.device)
    lm = SimpleNamespace(model=model, tokenizer=None)
    rng = random.Random(0)
    vocab = model.args.vocab_size
    print(f"{args.arch} (random {str(dtype)[6:]} weights) on {torch.cuda.get_device_name() if args.device == 'cuda' else 'cpu'}, "
          f"prompts of 512 random tokens, {args.output_len} new each, torch {torch.__version__}")
    print("| concurrency | drafts a step (k) | drafts | output tok/s | vs no drafts | steps | same tokens |")
    print("|---|---|---|---|---|---|---|")
    for c in (int(x) for x in args.concurrency.split(",")):
        reqs = [[rng.randrange(vocab) for _ in range(512)] for _ in range(c)]
        base = run(lm, reqs, c, args.output_len, None)
        print(f"| {c} | none | | {base['tok_s']:.1f} | 1.00x | {base['steps']} | |", flush=True)
        truth = {tuple(q): list(q) + list(t) for q, t in zip(reqs, base["tokens"])}
        for k in (int(x) for x in args.k.split(",")):
            for kind in ("all right", "all wrong"):
                def drafts(live, n, running=1, kind=kind, truth=truth, k=k):
                    req = live.request
                    full = truth[tuple(req.prompt_token_ids)]
                    d = full[len(req.token_ids): len(req.token_ids) + min(n, k)]
                    return d if kind == "all right" else [(t + 1) % vocab for t in d]
                r = run(lm, reqs, c, args.output_len, SpeculativeConfig(num_speculative_tokens=k), drafts)
                same = sum(a == b for a, b in zip(r["tokens"], base["tokens"]))
                print(f"| {c} | {k} | {kind} | {r['tok_s']:.1f} | {r['tok_s'] / base['tok_s']:.2f}x | {r['steps']} | "
                      f"{same}/{len(reqs)} |", flush=True)


if __name__ == "__main__":
    main()
