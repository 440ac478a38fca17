"""The ``kvtier`` command line. It only parses arguments and calls the library.

Subcommands: ``generate``, ``info``, ``eval``, ``bench NAME``. Each benchmark
is a module ``kvtier_bench.NAME`` that offers ``add_arguments(parser)`` and
``run(args) -> int``; ``kvtier_bench`` lives in the repository's ``benchmarks/``
folder, outside the library, and is installed by ``pip install -e .`` from a checkout.

Defaults live on the library's dataclasses (:class:`~kvtier.generate.GenerationConfig`,
:class:`~kvtier.sampling.SamplingParams`, :class:`~kvtier.config.KVCacheConfig`,
:class:`~kvtier.evaluate.EvalConfig`): a flag that is not given is absent here,
and the tier settings start from the environment (``KVTIER_*``), which flags override.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import importlib
import json
import sys
import warnings

DTYPES = ("float32", "bfloat16", "float16")
# prompts longer than this get a prefill progress bar
_PROGRESS_TOKENS = 1024
_ABSENT = argparse.SUPPRESS  # a flag not given leaves no attribute: the dataclass default holds


def _bench_package():
    """The ``kvtier_bench`` package, or None where kvtier was installed without it."""
    try:
        return importlib.import_module("kvtier_bench")
    except ModuleNotFoundError as e:
        if e.name == "kvtier_bench":
            return None
        raise


def _bench_parsers(bench: argparse.ArgumentParser) -> None:
    """One subcommand per module that ``kvtier_bench.names()`` finds (help: its docstring's
    first line); without the package, ``kvtier bench NAME`` says how to install it."""
    package = _bench_package()
    if package is None:
        bench.add_argument("name", help="the benchmark (needs kvtier installed from a checkout)")
        bench.add_argument("rest", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
        bench.set_defaults(_run=_benchmarks_missing)
        return
    bsub = bench.add_subparsers(dest="bench", required=True)
    for name in package.names():
        module = importlib.import_module(f"kvtier_bench.{name}")
        help_text = (module.__doc__ or name).splitlines()[0].rstrip(".")
        p = bsub.add_parser(name, help=help_text, description=help_text)
        module.add_arguments(p)
        p.set_defaults(_run=module.run)


def _benchmarks_missing(args: argparse.Namespace) -> int:
    raise ImportError(
        f"kvtier bench {args.name}: the benchmarks (package kvtier_bench, in the repository's "
        "benchmarks/ folder) are not installed; install kvtier from a checkout: pip install -e ."
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvtier", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate text with a model over any cache tier")
    gen.add_argument("prompt", nargs="?", default=_ABSENT, help="the prompt (default: read stdin)")
    _model_flags(gen)
    _cache_flags(gen)
    gen.add_argument("--max-tokens", dest="max_tokens", type=int, default=_ABSENT)
    gen.add_argument("--temperature", type=float, default=_ABSENT, help="0 is greedy")
    gen.add_argument("--top-p", dest="top_p", type=float, default=_ABSENT)
    gen.add_argument("--top-k", dest="top_k", type=int, default=_ABSENT)
    gen.add_argument("--min-p", dest="min_p", type=float, default=_ABSENT)
    gen.add_argument("--seed", type=int, default=_ABSENT)
    gen.add_argument("--stop", action="append", default=_ABSENT, help="a stop string (repeatable)")
    mode = gen.add_mutually_exclusive_group()
    mode.add_argument("--chat", dest="chat", action="store_true", default=True,
                      help="wrap the prompt in the model's chat template (the default)")
    mode.add_argument("--raw", dest="chat", action="store_false", help="feed the prompt as it is")
    gen.add_argument("--json", action="store_true", help="print one JSON object at the end")
    gen.add_argument("--prompt-cache", dest="prompt_cache", metavar="FILE", default=_ABSENT,
                     help="reuse (and save) the prompt's keys and values in FILE")
    gen.add_argument("--speculative", metavar="DRAFTER", default=_ABSENT,
                     help="speculative decoding with exact verification: ngram, early-exit:N "
                          "(the model's first N layers) or model:PATH (same tokenizer)")
    gen.add_argument("--draft-tokens", dest="draft_tokens", type=int, default=_ABSENT,
                     help="most drafts verified per step (with --speculative)")
    graph = gen.add_mutually_exclusive_group()
    graph.add_argument("--cuda-graph", dest="cuda_graph", action="store_true", default=_ABSENT,
                       help="replay decode steps from a CUDA graph (ragged/paged tier on CUDA; the "
                            "default there when it can serve)")
    graph.add_argument("--no-cuda-graph", dest="cuda_graph", action="store_false", default=_ABSENT,
                       help="decode step by step without a CUDA graph")
    gen.add_argument("--tensor-parallel", dest="tensor_parallel", type=int, metavar="N",
                     default=_ABSENT,
                     help="shard the model over N ranks: one GPU each (NCCL) or N CPU processes "
                          "(gloo); spawns its workers, or is one of them under torchrun")
    gen.set_defaults(_run=run_generate)

    info = sub.add_parser("info", help="model, device, dtype and the resolved cache configuration")
    _model_flags(info)
    _cache_flags(info)
    info.add_argument("--json", action="store_true")
    info.set_defaults(_run=run_info)

    ev = sub.add_parser("eval", help="quality of cache modes against full precision")
    esub = ev.add_subparsers(dest="metric", required=True)
    for metric, text in (("ppl", "perplexity of each mode"),
                         ("kl", "KL divergence and top-1 agreement of each mode against fp")):
        p = esub.add_parser(metric, help=text, description=text)
        p.add_argument("--file", default=_ABSENT, help="text file (default: pydoc_data.topics)")
        p.add_argument("--context", type=int, default=_ABSENT)
        p.add_argument("--stride", type=int, default=_ABSENT)
        p.add_argument("--max-tokens", dest="max_tokens", type=int, default=_ABSENT)
        p.add_argument("--chunk", type=int, default=_ABSENT, help="tokens per forward")
        p.add_argument("--modes", default=_ABSENT,
                       help="comma-separated: fp,q8,q4,q4_g32,turboquant,turboquant:K[r],V")
        _tier_flag(p, "tier of the fp mode (quantised modes use the paged tier)")
        p.add_argument("--json", action="store_true")
        _model_flags(p)
        p.set_defaults(_run=run_eval)

    _bench_parsers(sub.add_parser("bench", help="run a benchmark and print its table"))
    from kvtier.serve.cli import add_parser as add_serve_parser

    add_serve_parser(sub)  # kvtier serve (its _run is kvtier.serve.cli.run_serve)
    return parser


def _tier_flag(p: argparse.ArgumentParser, text: str) -> None:
    """``--tier`` (``--cache``, its earlier spelling, still parses but is not shown)."""
    from kvtier.config import TIERS

    p.add_argument("--tier", choices=TIERS, default=_ABSENT, help=text)
    p.add_argument("--cache", dest="tier", choices=TIERS, default=_ABSENT, help=argparse.SUPPRESS)


def _model_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", metavar="PATH", default=_ABSENT,
                   help="GGUF file or Hugging Face folder (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--dtype", choices=DTYPES, default=_ABSENT,
                   help="weights and activations (default: bfloat16 on CUDA, float32 on CPU)")
    p.add_argument("--device", default=_ABSENT, help="cpu, cuda, cuda:1, ... (default: cuda if present)")


def _cache_flags(p: argparse.ArgumentParser) -> None:
    from kvtier.quant.modes import FULL_PRECISION, KV_QUANT_MODES

    _tier_flag(p, "cache tier (default: from KVTIER_* variables, else tail)")
    p.add_argument("--kv-quant", dest="kv_quant", choices=(FULL_PRECISION, *KV_QUANT_MODES),
                   default=_ABSENT, help=f"quantised storage of the paged tier ({FULL_PRECISION}: "
                                         "full precision; a mode implies --tier paged)")
    p.add_argument("--turboquant", metavar="K,V", default=_ABSENT,
                   help="TurboQuant key,value codes, e.g. q8_0,q3_0 or q5_0r,q4_0 (implies --tier paged)")


# -- building the library's dataclasses from flags ----------------------------------------------


def _given(args: argparse.Namespace, *names: str) -> dict:
    return {n: getattr(args, n) for n in names if hasattr(args, n)}


def cache_config_from_args(args: argparse.Namespace):
    """``KVCacheConfig.from_env()`` with the flags' changes applied."""
    from kvtier.config import KVCacheConfig
    from kvtier.quant.modes import parse_kv_quant, parse_turboquant

    given = vars(args)
    changes = {}
    if "kv_quant" in given:
        changes["kv_quant"] = parse_kv_quant(given["kv_quant"])
    if "turboquant" in given:
        changes["turboquant"] = parse_turboquant(given["turboquant"])
    quant = changes.get("kv_quant") is not None or "turboquant" in changes
    if "tier" in given:
        if quant and given["tier"] != "paged":
            raise ValueError(
                f"--kv-quant and --turboquant store keys and values in the paged tier, but --tier "
                f"is {given['tier']!r}; drop --tier or use --tier paged"
            )
        changes["tier"] = given["tier"]
    elif quant:
        changes["tier"] = "paged"
    return KVCacheConfig.from_env().replace(**changes)


def generation_config_from_args(args: argparse.Namespace):
    from kvtier.generate import GenerationConfig
    from kvtier.sampling import SamplingParams

    sampling = SamplingParams(**_given(args, "temperature", "top_k", "top_p", "min_p", "seed"))
    extra = _given(args, "max_tokens", "cuda_graph")
    if hasattr(args, "stop"):
        extra["stop"] = tuple(args.stop)
    return GenerationConfig(sampling=sampling, **extra)


def speculative_config_from_args(args: argparse.Namespace):
    """``SpeculativeConfig`` from ``--speculative``/``--draft-tokens``; ``None`` without them."""
    if not hasattr(args, "speculative"):
        if hasattr(args, "draft_tokens"):
            raise ValueError("--draft-tokens sets the depth of speculative decoding; add "
                             "--speculative ngram|early-exit:N|model:PATH")
        return None
    from kvtier.drafters import parse_drafter_spec
    from kvtier.speculative import SpeculativeConfig

    parse_drafter_spec(args.speculative)
    return SpeculativeConfig(**_given(args, "draft_tokens"))


def _load(args: argparse.Namespace):
    import torch

    from kvtier.model import load_model

    kw = _given(args, "device")
    if hasattr(args, "dtype"):
        kw["dtype"] = getattr(torch, args.dtype)
    return load_model(getattr(args, "model", None), progress=sys.stderr.isatty(), **kw)


# -- kvtier generate -------------------------------------------------------------------------------


def run_generate(args: argparse.Namespace, lm=None) -> int:
    """``kvtier generate``; ``lm``: a model already loaded (one rank's shard), else the flags'."""
    from kvtier.generate import stream_generate

    gen_config = generation_config_from_args(args)  # bad flag values fail before the model loads
    cache_config = cache_config_from_args(args)
    spec = speculative_config_from_args(args)
    if lm is None and hasattr(args, "tensor_parallel"):
        return _run_tensor_parallel(args)
    prompt = args.prompt if hasattr(args, "prompt") else _read_stdin()
    lm = _load(args) if lm is None else lm
    tok = lm.tokenizer
    if args.chat:
        text = tok.apply_chat_template([{"role": "user", "content": prompt}])
        ids = tok.encode(text, add_bos=False)
    else:
        ids = tok.encode(prompt)
    caches, pc = None, None
    if hasattr(args, "prompt_cache"):
        from kvtier.prompt_cache import PromptCache

        pc = PromptCache(args.prompt_cache, model_source=str(lm.source))
        caches, _ = pc.restore(lm.model, ids, cache_config)
    else:
        caches = lm.model.make_caches(cache_config, batch_size=1)
    stream = stream_generate
    if spec is not None:
        from kvtier.drafters import make_drafter
        from kvtier.speculative import stream_speculative

        drafter = make_drafter(args.speculative, lm)
        stream = functools.partial(stream_speculative, drafter=drafter, speculative=spec)
    tokens, text, last = [], [], None
    with _PrefillProgress(len(ids) - (pc.reused if pc else 0)) as progress:
        for r in stream(lm.model, tok, ids, gen_config, caches=caches,
                        cache_config=cache_config, prompt_cache=pc, on_progress=progress):
            progress.close()
            tokens.append(r.token)
            text.append(r.text)
            if not args.json and r.text:
                sys.stdout.write(r.text)
                sys.stdout.flush()
            last = r
    stats = last.stats
    cache = cache_summary(caches)
    if args.json:
        out = {
            "prompt_tokens": ids, "tokens": tokens, "text": "".join(text),
            "finish_reason": last.finish_reason, "timings": stats.as_dict(), "cache": cache,
            "model": str(lm.source),
        }
        if spec is not None:
            out["speculative"] = last.speculative.as_dict()
        print(json.dumps(out, default=str))
    else:
        sys.stdout.write("\n")
        sys.stdout.flush()  # the text ends before the summary on a shared terminal
    print(
        f"[kvtier] prompt {stats.prompt_tokens} tokens ({stats.prompt_cache_tokens_reused} reused), "
        f"generated {stats.generation_tokens} | prefill {stats.prefill_tokens_per_s:.1f} tok/s, "
        f"decode {stats.decode_tokens_per_s:.1f} tok/s | tier {cache['tier']}, "
        f"KV {cache['nbytes'] / 2**20:.2f} MiB, grow events {cache['grow_events']}",
        file=sys.stderr,
    )
    if spec is not None:
        s = last.speculative
        print(
            f"[kvtier] speculative {args.speculative}: drafted {s.drafted}, accepted {s.accepted} "
            f"({100 * s.acceptance_rate:.1f}%), {s.tokens_per_step:.2f} tokens/step, "
            f"{1000 * s.time_per_step_s:.1f} ms/step over {s.steps} steps",
            file=sys.stderr,
        )
    return 0


def _run_tensor_parallel(args: argparse.Namespace) -> int:
    """Every rank runs :func:`run_generate` on its shard of the model; rank 0 alone prints."""
    import torch
    import torch.distributed as dist

    from kvtier.parallel import run_sharded

    if hasattr(args, "prompt_cache"):
        raise ValueError("--prompt-cache keeps one device's keys and values; it does not combine "
                         "with --tensor-parallel (drop one of them)")
    if not hasattr(args, "prompt"):  # spawned workers have no stdin, torchrun's share one
        if dist.is_torchelastic_launched():
            raise ValueError("under torchrun, give the prompt as an argument, not on stdin")
        args.prompt = _read_stdin()
    device = getattr(args, "device", "cuda" if torch.cuda.is_available() else "cpu")
    dtype = getattr(torch, args.dtype) if hasattr(args, "dtype") else None
    return run_sharded(_generate_on_rank, args.tensor_parallel, args=(args,), device_type=device,
                       model=getattr(args, "model", None), dtype=dtype)


def _generate_on_rank(lm, args: argparse.Namespace) -> int:
    return run_generate(args, lm=lm)


def _read_stdin() -> str:
    if sys.stdin is None or sys.stdin.isatty():
        raise ValueError("no prompt: give one as an argument or pipe it to stdin")
    text = sys.stdin.read()
    if not text.strip():
        raise ValueError("the prompt read from stdin is empty")
    return text


def cache_summary(caches) -> dict:
    """Tier, KV bytes and grow events over every layer, and the first layer's own stats."""
    first = caches[0].stats()
    return {
        "tier": caches[0].tier,
        "layers": len(caches),
        "nbytes": sum(c.nbytes for c in caches),
        "grow_events": sum(int(c.stats().get("grow_events", 0)) for c in caches),
        "layer0": first,
    }


class _PrefillProgress:
    """A rich progress bar on stderr for long prompts; a no-op otherwise."""

    def __init__(self, n_tokens: int):
        self.bar = None
        if n_tokens > _PROGRESS_TOKENS and sys.stderr.isatty():
            from rich.progress import Progress

            self.bar = Progress(transient=True, console=_stderr_console())
            self.task = self.bar.add_task("prefill", total=n_tokens)

    def __enter__(self):
        if self.bar is not None:
            self.bar.start()
        return self

    def __call__(self, done: int, total: int) -> None:
        if self.bar is not None:
            self.bar.update(self.task, completed=done, total=total)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()
            self.bar = None

    def __exit__(self, *exc) -> None:
        self.close()


def _stderr_console():
    from rich.console import Console

    return Console(stderr=True)


# -- kvtier info ------------------------------------------------------------------------------------


def run_info(args: argparse.Namespace) -> int:
    import torch

    cache_config = cache_config_from_args(args)
    lm = _load(args)
    param = next(lm.model.parameters())
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    out = {
        "model": str(lm.source),
        "model_args": lm.args.to_dict(),
        "parameters": sum(p.numel() for p in lm.model.parameters()),
        "device": str(param.device),
        "dtype": str(param.dtype).removeprefix("torch."),
        "load_seconds": round(lm.load_seconds, 3),
        "from_cache": lm.from_cache,
        "tier": cache_config.tier,
        "cache_config": dataclasses.asdict(cache_config),
        "torch": torch.__version__,
        "triton": triton_version,
        "cuda": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "threads": torch.get_num_threads(),
    }
    if args.json:
        print(json.dumps(out, default=str))
        return 0
    width = max(map(len, out))
    for k, v in out.items():
        print(f"{k:<{width}}  {v}")
    return 0


# -- kvtier eval -------------------------------------------------------------------------------------


def run_eval(args: argparse.Namespace) -> int:
    from pathlib import Path

    from kvtier.evaluate import EvalConfig, default_text, encode_text, evaluate_modes, parse_modes

    fields = _given(args, "context", "stride", "max_tokens", "chunk", "tier")
    if hasattr(args, "modes"):
        fields["modes"] = parse_modes(args.modes)
    config = EvalConfig(**fields)
    if hasattr(args, "file"):
        path = Path(args.file)
        if not path.is_file():
            raise FileNotFoundError(f"--file {path}: no such file")
        text = path.read_text(encoding="utf-8", errors="replace")
    else:
        text = default_text()
    lm = _load(args)
    tokens = encode_text(lm.tokenizer, text, config.max_tokens)
    results = evaluate_modes(lm.model, tokens, config, base=cache_config_from_args(args))
    if args.json:
        keys = ("mode", "ppl", "delta_pct", "bits_per_element") + (
            ("kl", "top1") if args.metric == "kl" else ()
        )
        print(json.dumps({"modes": [{k: r.as_dict()[k] for k in keys} for r in results],
                          "tokens": results[0].tokens, "context": config.context}))
        return 0
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"{args.metric}: {results[0].tokens} tokens, context {config.context}")
    for col in ("mode", "ppl", "Δ vs fp", "bits/elem", "KL (nats)", "top-1"):
        table.add_column(col, justify="left" if col == "mode" else "right")
    for r in results:
        table.add_row(r.mode, f"{r.ppl:.4f}", f"{r.delta_pct:+.2f}%", f"{r.bits_per_element:.2f}",
                      f"{r.kl:.5f}", f"{100 * r.top1:.2f}%")
    Console().print(table)
    return 0


# -- entry point ----------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    with warnings.catch_warnings():  # restores showwarning on the way out
        warnings.showwarning = _show_warning
        try:
            return int(args._run(args) or 0)
        except (ValueError, FileNotFoundError, MemoryError, ImportError) as e:
            # a caller's mistake (bad value, missing file or package): the message says what to do
            print(f"kvtier: error: {e}", file=sys.stderr)
            return 2
        except KeyboardInterrupt:
            return 130


def _show_warning(message, category, filename, lineno, file=None, line=None) -> None:
    print(f"kvtier: warning: {message}", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
