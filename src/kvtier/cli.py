"""The ``kvtier`` command line. It only parses arguments and calls the library.

The parser is here; what ``generate``, ``info`` and ``eval`` do with the flags is in
:mod:`kvtier.cli_run`.

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
import os
import sys
import warnings
from pathlib import Path

from kvtier import cli_run

DTYPES = ("float32", "bfloat16", "float16")
_ABSENT = argparse.SUPPRESS  # a flag not given leaves no attribute: the dataclass default holds


def default_of(cls: type, name: str) -> str:
    """``"(default: X)"`` for the field ``name`` of the dataclass ``cls``: help text reads the
    default where it lives instead of restating it."""
    field = next(f for f in dataclasses.fields(cls) if f.name == name)
    value = field.default_factory() if field.default is dataclasses.MISSING else field.default
    if isinstance(value, tuple):
        value = ",".join(map(str, value))
    elif value is None:
        value = "none"
    return f"(default: {value})"


def _version() -> str:
    """``kvtier X.Y.Z (torch A.B.C)`` from the installed package's metadata."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        mine = version("kvtier")
    except PackageNotFoundError:  # run from a source tree that was never installed
        mine = "unknown (not installed)"
    try:
        torch_version = version("torch")
    except PackageNotFoundError:
        torch_version = "not installed"
    return f"kvtier {mine} (torch {torch_version})"


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
        p.set_defaults(_run=functools.partial(_run_bench, module.run))


#: flags several benchmarks share, with their least value: checked before any of them runs
_BENCH_COUNTS = (("threads", 1), ("repeats", 1), ("warmup", 0), ("max_tokens", 1))


def _run_bench(run, args: argparse.Namespace) -> int:
    """A benchmark's ``run(args)``, after the flags they share are checked: counts in range,
    ``--plot`` and ``--json FILE`` in a folder that exists (``.png`` added to a plot's name
    without a suffix), ``--device`` a device torch knows (each one's own flags are checked in
    its ``run``)."""
    for name, least in _BENCH_COUNTS:
        v = getattr(args, name, None)
        if v is not None and v < least:
            raise ValueError(f"--{name.replace('_', '-')} must be at least {least}, got {v}")
    if getattr(args, "plot", None):  # checked before measuring; the PNG's name as it is written
        plot = Path(args.plot) if Path(args.plot).suffix else Path(args.plot).with_suffix(".png")
        if plot.suffix.lower() not in (".png", ".pdf", ".svg", ".jpg", ".jpeg"):
            raise ValueError(f"--plot {args.plot}: write a .png (or .pdf, .svg, .jpg) file")
        _check_folder("--plot", args.plot, plot, ' ("" for no plot)')
        args.plot = str(plot)
    json_path = getattr(args, "json", None)
    if isinstance(json_path, str):  # (a benchmark's --json FILE): checked before measuring too
        if Path(json_path).is_dir():
            raise ValueError(f"--json {json_path} is a folder; give a file path such as results.json")
        _check_folder("--json", json_path, Path(json_path))
    device = getattr(args, "device", None)
    if device not in (None, "auto"):
        import torch

        try:
            torch.device(device)
        except RuntimeError:
            raise ValueError(f"--device {device!r} is not a device; use cpu or cuda (cuda:N)") from None
    return run(args)


def _check_folder(flag: str, given: str, path: Path, alternative: str = "") -> None:
    """``ValueError`` where the folder an output file ``path`` (``flag given``) goes to is missing."""
    if not path.parent.is_dir():
        raise ValueError(f"{flag} {given}: its folder {path.parent} does not exist; create it first, or pass "
                         f"another path{alternative}")


def _benchmarks_missing(args: argparse.Namespace) -> int:
    raise ImportError(
        f"kvtier bench {args.name}: the benchmarks (package kvtier_bench, in the repository's "
        "benchmarks/ folder) are not installed; install kvtier from a checkout: pip install -e ."
    )


class WholeNamesParser(argparse.ArgumentParser):
    """Flags by their whole names only (``--prompt`` is not ``--prompt-cache``); subcommands'
    parsers are of their parent's class, so every ``kvtier`` command takes this."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, allow_abbrev=False, **kwargs)


def build_parser() -> argparse.ArgumentParser:
    from kvtier.evaluate import EvalConfig
    from kvtier.generate import GenerationConfig
    from kvtier.sampling import SamplingParams
    from kvtier.speculative import SpeculativeConfig

    parser = WholeNamesParser(prog="kvtier", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=_version())
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate text with a model over any cache tier")
    gen.add_argument("prompt", nargs="?", default=_ABSENT, help="the prompt (default: read stdin)")
    gen.add_argument("-p", "--prompt", dest="prompt_option", metavar="TEXT", default=_ABSENT,
                     help="the prompt, as a flag (in place of the argument)")
    _model_flags(gen)
    _cache_flags(gen)
    gen.add_argument("--max-tokens", dest="max_tokens", type=int, default=_ABSENT,
                     help=f"tokens to generate at most {default_of(GenerationConfig, 'max_tokens')}")
    sampling = {name: default_of(SamplingParams, name)
                for name in ("temperature", "top_p", "top_k", "min_p", "seed")}
    gen.add_argument("--temperature", type=float, default=_ABSENT,
                     help=f"0 is greedy {sampling['temperature']}")
    gen.add_argument("--top-p", dest="top_p", type=float, default=_ABSENT,
                     help=f"nucleus sampling, 1 is off {sampling['top_p']}")
    gen.add_argument("--top-k", dest="top_k", type=int, default=_ABSENT,
                     help=f"sample among the k likeliest tokens, 0 is off {sampling['top_k']}")
    gen.add_argument("--min-p", dest="min_p", type=float, default=_ABSENT,
                     help=f"drop tokens below min-p x the top probability, 0 is off {sampling['min_p']}")
    gen.add_argument("--seed", type=int, default=_ABSENT,
                     help=f"makes sampling repeat {sampling['seed']}")
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
                     help="most drafts verified per step (with --speculative) "
                          f"{default_of(SpeculativeConfig, 'draft_tokens')}")
    gen.add_argument("--fixed-depth", dest="fixed_depth", action="store_true", default=_ABSENT,
                     help="always draft --draft-tokens (with --speculative; the default adapts "
                          "the depth to each row's recent acceptance)")
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
    gen.set_defaults(_run=cli_run.run_generate)

    info = sub.add_parser("info", help="model, device, dtype and the resolved cache configuration")
    _model_flags(info)
    _cache_flags(info)
    info.add_argument("--json", action="store_true")
    info.set_defaults(_run=cli_run.run_info)

    ev = sub.add_parser("eval", help="quality of cache modes against full precision")
    esub = ev.add_subparsers(dest="metric", required=True)
    for metric, text in (("ppl", "perplexity of each mode"),
                         ("kl", "KL divergence and top-1 agreement of each mode against fp")):
        p = esub.add_parser(metric, help=text, description=text)
        p.add_argument("--file", default=_ABSENT,
                       help="UTF-8 text file (default: Python's pydoc_data.topics)")
        p.add_argument("--context", type=int, default=_ABSENT,
                       help=f"tokens per window {default_of(EvalConfig, 'context')}")
        p.add_argument("--stride", type=int, default=_ABSENT,
                       help="tokens between window starts (default: --context, no overlap)")
        p.add_argument("--max-tokens", dest="max_tokens", type=int, default=_ABSENT,
                       help=f"tokens of text evaluated at most {default_of(EvalConfig, 'max_tokens')}")
        p.add_argument("--chunk", type=int, default=_ABSENT,
                       help=f"tokens per forward {default_of(EvalConfig, 'chunk')}")
        p.add_argument("--modes", default=_ABSENT,
                       help="comma-separated: fp,q8,q4,fp8,q4_g32,turboquant,turboquant:K[r],V "
                            f"{default_of(EvalConfig, 'modes')}")
        _tier_flag(p, "tier of the fp mode (quantised modes use the paged tier) "
                      f"{default_of(EvalConfig, 'tier')}")
        p.add_argument("--json", action="store_true", help="print one JSON object (no table, no progress bar)")
        _model_flags(p)
        p.set_defaults(_run=cli_run.run_eval)

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
    p.add_argument("--act-quant", dest="act_quant", choices=("none", "q8"), default=_ABSENT,
                   help="q8: the CPU decode step multiplies packed weights by int8 codes of the "
                        "activations (faster, approximate; default: KVTIER_ACT_QUANT, else none)")
    p.add_argument("--prefill-dtype", dest="prefill_dtype", choices=("float32", "bfloat16"), default=_ABSENT,
                   help="bfloat16: a float32 model's forwards of more than 64 tokens a row (prompts) multiply "
                        "in bfloat16, about twice as fast on CPUs with AMX (approximate; default: "
                        "KVTIER_PREFILL_DTYPE, else float32)")


def _cache_flags(p: argparse.ArgumentParser) -> None:
    from kvtier.quant.modes import FULL_PRECISION, KV_QUANT_MODES

    _tier_flag(p, "cache tier (default: from KVTIER_* variables, else tail)")
    p.add_argument("--kv-quant", dest="kv_quant", choices=(FULL_PRECISION, *KV_QUANT_MODES),
                   default=_ABSENT, help=f"quantised storage of the paged tier ({FULL_PRECISION}: "
                                         "full precision; a mode implies --tier paged)")
    p.add_argument("--turboquant", metavar="K,V", default=_ABSENT,
                   help="TurboQuant key,value codes, e.g. q8_0,q3_0 or q5_0r,q4_0 (implies --tier "
                        "paged; not with --kv-quant)")
    p.add_argument("--num-blocks", dest="num_blocks", type=int, metavar="N", default=_ABSENT,
                   help="blocks in the paged pool (implies --tier paged; default: "
                        "KVTIER_PAGED_NUM_BLOCKS, else enough for the prompt and --max-tokens)")
    p.add_argument("--dynamic", action="store_true", default=_ABSENT,
                   help="let the paged pool grow (about 1.5x at a time) instead of refusing a "
                        "write that does not fit (implies --tier paged)")
    p.add_argument("--kv-dtype", dest="kv_dtype", choices=("float16", "bfloat16"), default=_ABSENT,
                   help="store the tail tier's keys and values narrower than the model computes "
                        "them (half the bytes a step reads at long contexts; default: "
                        "KVTIER_OWNED_ATTN_KV_DTYPE, else the model's dtype)")


# -- entry point ----------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if hasattr(sys.stdout, "reconfigure"):  # text a terminal's encoding lacks is replaced, not fatal
        sys.stdout.reconfigure(errors="replace")
    with warnings.catch_warnings():  # restores showwarning on the way out
        warnings.showwarning = _show_warning
        try:
            return int(args._run(args) or 0)
        except BrokenPipeError:  # the reader went away (| head): quiet, as Unix tools are
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no error at exit's flush
            return 141
        except (ValueError, OSError, MemoryError, ImportError) as e:
            # a caller's mistake (bad value, missing or unwritable file, missing package): the
            # message says what to do
            print(f"kvtier: error: {str(e) or type(e).__name__}", file=sys.stderr)  # (a bare MemoryError)
            return 2
        except KeyboardInterrupt:
            return 130
        except RuntimeError as e:
            from kvtier.parallel.launch import TensorParallelError

            if not isinstance(e, TensorParallelError):
                raise
            # a rank failed or died and the others were stopped: what and where, in one line
            # (a rank's own traceback follows the first line of the message, for the API); on a
            # terminal a line of its own, as rank 0 may have been stopped mid-line
            if sys.stdout.isatty() and sys.stderr.isatty():
                print(flush=True)
            print(f"kvtier: error: {str(e).splitlines()[0]}", file=sys.stderr)
            return 1


def _show_warning(message, category, filename, lineno, file=None, line=None) -> None:
    print(f"kvtier: warning: {message}", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
