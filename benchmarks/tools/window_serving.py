"""Serving long requests of a model with a sliding window in a small pool: the blocks behind the
window released as requests advance, against the same engine keeping every block.

The default model is given a window of ``--window`` keys in every layer (as Mistral 7B v0.1 has
4,096); ``--requests`` requests of ``--prompt`` random tokens each generate ``--tokens`` tokens
(``ignore_eos``) through one :class:`~kvtier.serve.engine.LLMEngine` over a pool of ``--blocks``
blocks of ``--block-size`` tokens, step by step. Printed per run: the wall time, output tokens a
second, preemptions, blocks released and the most blocks in use at once; as JSON with ``--json``.

    PYTHONPATH=src:benchmarks python3 benchmarks/tools/window_serving.py --json window_serving.json
"""

from __future__ import annotations

import argparse
import time

import torch
from window_steps import set_window, write_json  # (this folder: the script's own)


def _run(model, args, release: bool) -> dict:
    from kvtier.serve.engine import EngineConfig, LLMEngine
    from kvtier.serve.params import RequestParams

    config = EngineConfig(num_blocks=args.blocks, block_size=args.block_size, max_num_seqs=args.requests,
                          max_model_len=args.prompt + args.tokens)
    engine = LLMEngine(model, None, config)
    if not release:
        engine.scheduler.window = None  # the same engine, keeping every block
    gen = torch.Generator().manual_seed(0)
    params = RequestParams(max_tokens=args.tokens, ignore_eos=True)
    for _ in range(args.requests):
        engine.add_request(torch.randint(10, model.args.vocab_size - 10, (args.prompt,), generator=gen).tolist(),
                           params)
    peak, t0 = 0, time.perf_counter()
    while engine.has_unfinished():
        engine.step()
        peak = max(peak, engine.block_manager.num_used_blocks)
    wall = time.perf_counter() - t0
    s = engine.stats()
    return {"wall_s": wall, "output_tok_s": args.requests * args.tokens / wall, "preemptions": s["preemptions"],
            "released_blocks": s["released_blocks"], "peak_used_blocks": peak}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--window", type=int, default=256)
    parser.add_argument("--requests", type=int, default=4)
    parser.add_argument("--prompt", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--blocks", type=int, default=96)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()

    from kvtier.model import load_model

    model = load_model(device=args.device, dtype=torch.float32, progress=False).model
    set_window(model, model.args, args.window)
    out = {"model": "default model (SmolLM2-135M-Instruct, float32), a window in every layer",
           "args": vars(args), "runs": {}}
    for name, release in (("every block kept", False), ("released behind the window", True)):
        r = out["runs"][name] = _run(model, args, release)
        print(f"{name:27s} {r['wall_s']:7.1f} s  {r['output_tok_s']:7.1f} tok/s  preemptions {r['preemptions']:3d}  "
              f"released {r['released_blocks']:4d}  peak blocks {r['peak_used_blocks']}", flush=True)
    write_json(out, args.json)


if __name__ == "__main__":
    main()
