"""``kvtier serve``: the flags, and starting the server. Imports nothing heavy until it runs.

Flags left out keep the defaults of :class:`~kvtier.serve.engine.EngineConfig` and
:class:`~kvtier.serve.api.ServerConfig`.

With ``--tensor-parallel N`` the model is sharded over N ranks
(:func:`kvtier.parallel.serve.serve_sharded`): this process spawns N workers (or,
under ``torchrun``, is one of its ranks); rank 0 runs uvicorn, the engine and its
scheduler, and broadcasts each step to the others. Stopping the launcher (SIGTERM or
Ctrl-C) stops rank 0's server gracefully, which then tells the other ranks to stop;
rank 0 also stops when its launcher dies.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import sys
import threading
import warnings

_ABSENT = argparse.SUPPRESS  # a flag not given leaves no attribute: the dataclass default holds
#: the environment variable of the server's API key, where no --api-key is given
API_KEY_ENV = "KVTIER_API_KEY"
_ENGINE_FLAGS = ("num_blocks", "kv_memory_gib", "block_size", "max_num_seqs", "max_batched_tokens",
                 "max_waiting", "max_model_len", "enable_prefix_caching", "kv_quant", "cuda_graph",
                "async_scheduling", "scheduling_policy", "batch_invariant", "kv_offload_gib")


def add_parser(sub) -> argparse.ArgumentParser:
    """Register ``serve`` on the ``kvtier`` subparsers ``sub``."""
    from kvtier.quant.modes import KV_QUANT_MODES

    p = sub.add_parser("serve", help="an OpenAI-compatible server with continuous batching",
                       description="An OpenAI-compatible server (/v1/completions, /v1/chat/completions, "
                                   "/v1/responses, /v1/models, vLLM's /tokenize and /detokenize, /health, "
                                   "/metrics) over the paged tier.")
    p.add_argument("--model", metavar="PATH", default=_ABSENT,
                   help="GGUF file or Hugging Face folder (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default=_ABSENT)
    p.add_argument("--device", default=_ABSENT, help="cpu, cuda, cuda:1, ... (default: cuda if present)")
    p.add_argument("--prefill-dtype", dest="prefill_dtype", choices=("float32", "bfloat16"), default=_ABSENT,
                   help="bfloat16: a float32 model's forwards of more than 64 tokens a row (prompt chunks) "
                        "multiply in bfloat16, about twice as fast on CPUs with AMX (approximate; "
                        "default: KVTIER_PREFILL_DTYPE, else float32)")
    p.add_argument("--host", default=_ABSENT, help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=_ABSENT, help="port (default 8000)")
    p.add_argument("--served-model-name", dest="served_model_name", default=_ABSENT,
                   help="the model name the API reports and accepts (default: the model file's name)")
    p.add_argument("--kv-quant", dest="kv_quant", choices=("off",) + KV_QUANT_MODES, default=_ABSENT,
                   help="quantised pages")
    p.add_argument("--turboquant", metavar="K,V", default=_ABSENT,
                   help="TurboQuant pages: key,value codes, e.g. q8_0,q3_0 or q5_0r,q4_0 (not with --kv-quant)")
    pool = p.add_mutually_exclusive_group()
    pool.add_argument("--num-blocks", dest="num_blocks", type=int, default=_ABSENT,
                      help="blocks in the KV pool")
    pool.add_argument("--kv-memory", dest="kv_memory_gib", type=float, default=_ABSENT, metavar="GIB",
                      help="size the KV pool to this many GiB (default: 1 on CPU, 80%% of free on CUDA)")
    p.add_argument("--kv-offload-memory", dest="kv_offload_gib", type=float, default=_ABSENT, metavar="GIB",
                   help="host memory for a second tier of the prefix cache: blocks evicted from the pool are "
                        "saved there and loaded back on a later hit instead of computed (default: none)")
    p.add_argument("--prefix-cache-file", dest="prefix_cache_file", metavar="PATH", default=_ABSENT,
                   help="keep the prefix cache across restarts: its blocks are read from PATH at start (when "
                        "it exists and holds this model's blocks) and written there when the server stops")
    p.add_argument("--prefix-cache-save-interval", dest="prefix_cache_save_interval_s", type=float, metavar="S",
                   default=_ABSENT, help="also save the prefix cache file every S seconds while serving (the engine "
                   "pausing only to copy the blocks new to the file), so a server killed without a graceful stop "
                   "restarts from it")
    p.add_argument("--prefix-cache-read-only", dest="prefix_cache_read_only", action="store_true", default=_ABSENT,
                   help="read the prefix cache file at the start and never write it (a file shipped with the model "
                   "and shared by replicas; its folder may be read-only)")
    p.add_argument("--block-size", dest="block_size", type=int, default=_ABSENT)
    p.add_argument("--max-num-seqs", dest="max_num_seqs", type=int, default=_ABSENT,
                   help="running requests at most")
    p.add_argument("--max-batched-tokens", "--max-num-batched-tokens", dest="max_batched_tokens", type=int, default=_ABSENT,
                   help="tokens per step, decode and prefill chunks together (default: 2048 on CPU, "
                        "8192 on CUDA)")
    p.add_argument("--scheduling-policy", dest="scheduling_policy", choices=("fcfs", "priority"),
                   default=_ABSENT, help="fcfs (default): first come, first served; priority: requests of "
                   "lower priority values first, then first come (a request's priority field), and preempted last")
    p.add_argument("--speculative-config", dest="speculative_config", metavar="JSON", default=_ABSENT,
                   help='speculative decoding, as vLLM\'s: \'{"method": "ngram", "num_speculative_tokens": 4, '
                        '"prompt_lookup_max": 4}\': requests feed drafts looked up in their own tokens '
                        "and keep those the model agrees with (synchronous scheduling)")
    p.add_argument("--max-waiting", dest="max_waiting", type=int, default=_ABSENT,
                   help="queued requests before HTTP 429")
    p.add_argument("--max-model-len", dest="max_model_len", type=int, default=_ABSENT,
                   help="tokens of one request at most (default: the model's context)")
    p.add_argument("--max-request-mb", dest="max_request_mb", type=float, default=_ABSENT, metavar="MB",
                   help="largest request body read, in MiB (larger: HTTP 413; default 4)")
    p.add_argument("--api-key", dest="api_keys", action="append", default=_ABSENT, metavar="KEY",
                   help="a key every request but /health and /metrics must bear (Authorization: Bearer "
                        f"KEY); repeat it for several keys (default: ${API_KEY_ENV}, else none). The "
                        "variable keeps the key out of the process list")
    p.add_argument("--chat-template", dest="chat_template", metavar="FILE", default=_ABSENT,
                   help="render chats with this Jinja template (a file, or the template's text) in place "
                        "of the model's own; for a model without one")
    p.add_argument("--tool-call-parser", dest="tool_call_parser", choices=("hermes", "qwen3_coder", "llama3_json", "none"),
                   default=_ABSENT, help="the model's tool-call format, which tool_choice \"auto\" reads "
                   "(default: qwen3_coder where the chat template writes <function=, hermes where it writes "
                   "<tool_call> or ignores tools, which are then described to the model; none, so \"auto\" is "
                   "refused, where it describes them another way)")
    p.add_argument("--enable-auto-tool-choice", dest="auto_tool_choice", action="store_true", default=_ABSENT,
                   help="vLLM's flag: tool_choice \"auto\" is served whenever the server reads a call format; "
                   "with this flag a server that would read none does not start")
    p.add_argument("--reasoning-parser", dest="reasoning_parser", choices=("deepseek_r1", "qwen3"),
                   default=_ABSENT, help="the model's reasoning format: a chat answer's <think> ... </think> "
                   "goes out as the message's reasoning, the rest as its content, and structured outputs "
                   "and tool calls hold the answer from the reasoning's end (default: none)")
    p.add_argument("--shutdown-timeout", dest="shutdown_timeout_s", type=float, default=_ABSENT,
                   metavar="S", help="seconds a stopping server waits for requests in flight before "
                   "it ends them (default: until they finish)")
    p.add_argument("--no-prefix-caching", dest="enable_prefix_caching", action="store_false",
                   default=_ABSENT)
    p.add_argument("--no-cuda-graph", dest="cuda_graph", action="store_false", default=_ABSENT)
    p.add_argument("--batch-invariant", dest="batch_invariant", action="store_true", default=_ABSENT,
                   help="every answer the same bits whatever requests share its steps, however its prompt "
                        "is chunked, cached or recomputed (CPU only: each token through the one-call step; "
                        "0.82-0.88x the throughput on the default model; a long prompt 1.1-1.3x the time)")
    p.add_argument("--async-scheduling", dest="async_scheduling", action=argparse.BooleanOptionalAction,
                   default=_ABSENT, help="schedule the next step while the GPU runs this one "
                                         "(default: on CUDA only)")
    p.add_argument("--threads", type=int, default=_ABSENT,
                   help="torch CPU threads (of each rank with --tensor-parallel)")
    p.add_argument("--tensor-parallel", "--tensor-parallel-size", "-tp", dest="tensor_parallel", type=int, metavar="N", default=_ABSENT,
                   help="shard the model over N ranks: one GPU each (NCCL) or N CPU processes (gloo); "
                        "spawns its workers, or is one of them under torchrun; rank 0 serves HTTP")
    p.add_argument("--warmup", action=argparse.BooleanOptionalAction, default=_ABSENT,
                   help="run made-up requests through each kind of step before listening, so the "
                        "first users do not wait for kernels to compile (default: on CUDA only)")
    p.add_argument("--log-level", dest="log_level", default="warning",
                   choices=("critical", "error", "warning", "info", "debug"))
    p.set_defaults(_run=run_serve)
    return p


def configs_from_args(args: argparse.Namespace):
    """``(EngineConfig, ServerConfig)`` from the flags that were given."""
    from kvtier.quant.modes import parse_storage_flags
    from kvtier.serve.api import ServerConfig
    from kvtier.serve.engine import EngineConfig

    engine = {n: getattr(args, n) for n in _ENGINE_FLAGS if hasattr(args, n)}
    engine |= parse_storage_flags(getattr(args, "kv_quant", None), getattr(args, "turboquant", None))
    if hasattr(args, "speculative_config"):
        from kvtier.serve.speculate import SpeculativeConfig

        engine["speculative"] = SpeculativeConfig.parse(args.speculative_config)
    server = {n: getattr(args, n) for n in ("host", "port", "served_model_name", "warmup", "shutdown_timeout_s",
                                            "tool_call_parser", "reasoning_parser", "auto_tool_choice",
                                            "prefix_cache_file", "prefix_cache_save_interval_s",
                                            "prefix_cache_read_only")
              if hasattr(args, n)}
    if hasattr(args, "prefix_cache_file"):
        if not getattr(args, "enable_prefix_caching", True):
            raise ValueError("--prefix-cache-file keeps the prefix cache, and --no-prefix-caching turns it off; "
                             "drop one of them")
        from kvtier.serve.prefix_file import check_rank_files

        world = int(os.environ.get("WORLD_SIZE", getattr(args, "tensor_parallel", 1)))
        check_rank_files(args.prefix_cache_file, world, read_only=getattr(args, "prefix_cache_read_only", False))
    keys = getattr(args, "api_keys", None) or ([os.environ[API_KEY_ENV]] if os.environ.get(API_KEY_ENV) else [])
    if keys:
        server["api_keys"] = tuple(keys)
    if hasattr(args, "chat_template"):
        server["chat_template"] = read_chat_template(args.chat_template)
    if hasattr(args, "max_request_mb"):
        if not 0 < args.max_request_mb <= 2**20:  # (a byte count past 1 TiB overflows the conversion)
            raise ValueError(f"--max-request-mb must be a number of MiB in (0, 1048576], got {args.max_request_mb}")
        server["max_request_bytes"] = max(1, round(args.max_request_mb * 2**20))
    return EngineConfig(**engine), ServerConfig(**server)


def read_chat_template(given: str) -> str:
    """``--chat-template``'s Jinja text: the file it names, or the text itself when it holds a
    Jinja tag; checked to parse. ``ValueError`` naming the fix otherwise."""
    from pathlib import Path

    from kvtier.model.tokenizer import compile_chat_template

    path = Path(given)
    if path.is_file():
        text = path.read_text(encoding="utf-8")
    elif "{{" in given or "{%" in given:
        text = given
    else:
        raise ValueError(f"--chat-template {given!r} is neither a file nor a Jinja template; pass the path of a "
                         "template file (such as a model's chat_template.jinja) or its text")
    compile_chat_template(text)  # (a syntax error named before the model loads)
    return text


def run_serve(args: argparse.Namespace) -> int:
    import torch

    from kvtier.devices import check_threads, parse_device, warn_oversubscribed
    from kvtier.model.loading import default_device

    engine_config, server_config = configs_from_args(args)  # bad values fail before the model loads
    device = parse_device(args.device) if hasattr(args, "device") else default_device()
    threads = getattr(args, "threads", None)
    if threads is not None:
        check_threads(threads)
        # (the ranks of this host: torchrun's count where it started them, else --tensor-parallel's)
        ranks = int(os.environ.get("LOCAL_WORLD_SIZE", getattr(args, "tensor_parallel", 1)))
        if device.type == "cpu":
            warn_oversubscribed(threads, ranks)
    dtype = getattr(torch, args.dtype) if hasattr(args, "dtype") else None
    model = getattr(args, "model", None)
    from kvtier.model.linear import PREFILL_ENV_VAR, parse_prefill_dtype, prefill_dtype_warning

    if hasattr(args, "prefill_dtype"):  # the variable reaches every rank of --tensor-parallel
        os.environ[PREFILL_ENV_VAR] = args.prefill_dtype
    prefill_dtype = parse_prefill_dtype(os.environ.get(PREFILL_ENV_VAR), source=PREFILL_ENV_VAR)
    if engine_config.batch_invariant:
        _check_invariant(args, engine_config, device, dtype, prefill_dtype)
    if hasattr(args, "tensor_parallel"):
        return _run_sharded(args, engine_config, server_config, model, dtype, threads)
    from kvtier.model import load_model
    from kvtier.serve.engine import LLMEngine

    if threads is not None:
        torch.set_num_threads(threads)
    sock = _listen(server_config.host, server_config.port)  # a taken port fails before the model loads
    kw = {"device": args.device} if hasattr(args, "device") else {}

    def build():
        # on the CPU in float32 the weights stay packed (kvtier.model.packed): decode steps multiply
        # the block codes in one C call (kvtier.model.cpu_step), a prompt chunk dequantises them first
        lm = load_model(model, progress=sys.stderr.isatty(), dtype=dtype, **kw)
        note = prefill_dtype_warning(lm.model)
        if note:
            warnings.warn(note, stacklevel=2)
        return lm, LLMEngine(lm.model, lm.require_tokenizer("kvtier serve"), engine_config)

    lm, engine = in_passing_thread(build)
    return serve_http(engine, served_name(lm.source), server_config, args.log_level, sock=sock)


def _check_invariant(args, engine_config, device, dtype, prefill_dtype) -> None:
    """``--batch-invariant``'s refusals that the flags and the environment decide alone, before a
    model loads or a rank starts (the runner checks the model's shape and pages once it loads)."""
    import torch

    from kvtier.serve.runner import INVARIANT_REFUSED, invariant_refusal

    if getattr(args, "tensor_parallel", 1) > 1 or device.type == "cuda":
        raise ValueError("--batch-invariant runs every token through one process's CPU step: it does not "
                         "combine with --tensor-parallel or a CUDA device (drop one of them)")
    why = invariant_refusal(device, engine_config.kv_quant, engine_config.block_size,
                            dtype or torch.float32, prefill_dtype)
    if why is not None:
        raise ValueError(INVARIANT_REFUSED + why)


def in_passing_thread(fn):
    """``fn()`` run in a thread that then ends (its exception raised here). libgomp keeps a thread's
    OpenMP workers while the thread lives: the main thread's, beside those of the engine's thread,
    would make more OpenMP threads than CPUs, at which libgomp's barriers sleep instead of spinning
    (a 512-token prompt 17% slower in the engine's thread on the 2-core box). So the main thread,
    which then serves HTTP, runs no parallel region."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(1, thread_name_prefix="kvtier-load") as pool:
        return pool.submit(fn).result()


def served_name(source) -> str:
    """The name the API gives a model loaded from ``source`` (a ``.gguf`` file: its name without
    the suffix; a folder: the folder's name; ``None``: the embedded default)."""
    from pathlib import Path

    from kvtier.model.loading import default_model_path

    path = default_model_path() if source is None else Path(source)
    if path.is_dir() and not (path / "config.json").is_file():
        ggufs = sorted(path.glob("*.gguf"))  # a folder of one GGUF loads that file
        path = ggufs[0] if len(ggufs) == 1 else path
    return path.name.removesuffix(".gguf")


def serve_http(engine, model_name: str, server_config, log_level: str = "warning", *,
               ranks: int = 1, sock: socket.socket | None = None) -> int:
    """Serve ``engine`` over HTTP with uvicorn until it is stopped (SIGINT, SIGTERM); returns 0.

    ``model_name``: the name the API reports unless ``server_config.served_model_name``
    is set. ``ranks`` > 1: this is rank 0 of a tensor-parallel group, so a signal ends
    the server without ending the process (the other ranks still have to be told), and
    the server also stops when the process that launched this rank goes away. ``sock``: a
    socket :func:`_listen` bound already (``kvtier serve`` binds before the model loads).
    """
    import uvicorn

    from kvtier.model.linear import prefill_narrows
    from kvtier.serve.api import build_app
    from kvtier.serve.async_engine import AsyncLLMEngine
    from kvtier.serve.engine import freeze_startup_heap

    if engine.tokenizer is None:
        raise ValueError("the model has no tokenizer (tokenizer.json next to its weights); the server "
                         "needs one to read prompts and write text")
    if server_config.chat_template is not None:
        engine.tokenizer.set_chat_template(server_config.chat_template)
    name = server_config.served_model_name or model_name
    warmup = server_config.warmup
    if warmup or (warmup is None and engine.device.type == "cuda"):
        w = engine.warm_up()
        print(f"[kvtier] warmed up: {w['requests']} made-up requests, {w['steps']} steps, "
              f"{w['seconds']:.1f} s", file=sys.stderr, flush=True)
    if server_config.prefix_cache_file is not None:  # (after the warm-up, which empties the cache)
        from kvtier.serve.prefix_file import check_prefix_paths, load_prefix_file

        if not server_config.prefix_cache_read_only:
            check_prefix_paths(engine, server_config.prefix_cache_file)  # every rank's file, before serving
        load_prefix_file(engine, server_config.prefix_cache_file, read_only=server_config.prefix_cache_read_only)
    async_engine = AsyncLLMEngine(engine)
    app = build_app(async_engine, engine.tokenizer, name, server_config)
    freeze_startup_heap()  # no full collection of the start-up heap between two steps later
    timeout = server_config.shutdown_timeout_s  # uvicorn's own cut: a backstop, 5 s after ours
    config = uvicorn.Config(app, host=server_config.host, port=server_config.port, log_level=log_level,
                            timeout_graceful_shutdown=None if timeout is None else timeout + 5)
    server = uvicorn.Server(config) if ranks == 1 else _rank0_server(config)
    if sock is None:  # bound before the banner says so
        sock = _listen(server_config.host, server_config.port)
    s = engine.stats()
    narrow = prefill_narrows(engine.model)
    sharded = f", tensor parallel over {ranks} ranks (pages of rank 0)" if ranks > 1 else ""
    host = f"[{server_config.host}]" if ":" in server_config.host else server_config.host  # IPv6
    print(f"[kvtier] serving {name} on http://{host}:{sock.getsockname()[1]}/v1 | "
          f"{s['num_blocks']} blocks of {s['block_size']} ({s['kv_storage']}, "
          f"{s['kv_bytes'] / 2**30:.2f} GiB{sharded}), context {s['max_model_len']} tokens"
          + (f" | {len(server_config.api_keys)} API key(s) asked for" if server_config.api_keys else "")
          + (f" | n-gram drafts, {spec.num_speculative_tokens} a step" if (spec := engine.config.speculative) else "")
          + (" | bfloat16 prefill" if narrow else "") + (" | batch-invariant" if engine.config.batch_invariant else "")
          + (f" | blocks released behind the {w}-token sliding window" if (w := engine.scheduler.window) else "")
          + (f" | {s['host_blocks']} blocks offloaded to host memory" if s["host_blocks"] else ""),
          file=sys.stderr, flush=True)
    if ranks > 1:
        # uvicorn re-raises the signal that stopped it once it is done; ignored here, so rank 0
        # lives on to tell the other ranks to stop.
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, signal.SIG_IGN)
        threading.Thread(target=_stop_when_orphaned, args=(server, os.getppid()), daemon=True).start()
    if timeout is not None:
        threading.Thread(target=_end_requests_when_stopping, args=(server, async_engine, timeout),
                         daemon=True).start()
    server.run(sockets=[sock])
    if not server.started:
        raise ValueError(f"the server could not start on {server_config.host}:{server_config.port} "
                         "(the error is above); choose another --port or --host")
    return 0


def _rank0_server(config):
    """uvicorn's server for rank 0 of a tensor-parallel group, where every stop signal is one
    graceful stop. uvicorn forces its exit at a second SIGINT (its lifespan task then cancelled,
    logged as a traceback), but here one stop comes as several signals: the launcher's death as
    one SIGINT for each of its threads, a Ctrl-C as the terminal's SIGINT and the launcher's
    SIGTERM. A second Ctrl-C reaches the launcher, which kills the ranks
    (:func:`_forward_stop_signals`)."""
    import uvicorn

    class Rank0Server(uvicorn.Server):
        def handle_exit(self, sig, frame) -> None:
            self.should_exit = True

    return Rank0Server(config)


def _listen(host: str, port: int) -> socket.socket:
    """The server's socket, bound (``port`` 0: one the system picks); a ``ValueError`` that
    says why where it cannot be (the port taken, the host unknown)."""
    sock = None
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                          flags=socket.AI_PASSIVE)[0]
        sock = socket.socket(family, kind, proto)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
    except OSError as e:
        if sock is not None:
            sock.close()
        raise ValueError(f"cannot listen on {host}:{port} ({e.strerror or e}); choose another --port "
                         "or --host") from None
    return sock


def _end_requests_when_stopping(server, engine, timeout_s: float, poll_s: float = 0.2) -> None:
    """Once ``server`` is stopping, give the requests in flight ``timeout_s`` seconds, then end
    them: each stream sends its error chunk and ``[DONE]``, each waiting client a 503."""
    while not server.should_exit:
        threading.Event().wait(poll_s)
    threading.Event().wait(timeout_s)
    engine.end_all(f"the server is shutting down (--shutdown-timeout {timeout_s:g} s passed)")


def _stop_when_orphaned(server, parent: int, poll_s: float = 0.5) -> None:
    """Stop ``server`` once this process's parent (the launcher) has gone."""
    while not server.should_exit:
        if os.getppid() != parent:
            server.should_exit = True
            return
        threading.Event().wait(poll_s)


def _run_sharded(args, engine_config, server_config, model, dtype, threads) -> int:
    """``kvtier serve --tensor-parallel N``: rank 0 serves HTTP, the other ranks follow its steps."""
    import torch
    import torch.distributed as dist

    from kvtier.parallel.serve import serve_sharded

    device = getattr(args, "device", "cuda" if torch.cuda.is_available() else "cpu")
    sock = None
    if not dist.is_torchelastic_launched():
        # bound here and handed to rank 0: a taken port fails at once, not after every rank has
        # loaded the model, and no other process can take it while they load
        sock = _listen(server_config.host, server_config.port)
        _forward_stop_signals()
    try:
        result = serve_sharded(_serve_on_rank0, args.tensor_parallel,
                               args=(served_name(model), server_config, args.log_level,
                                     args.tensor_parallel, sock),
                               config=engine_config, model=model, device_type=device, dtype=dtype,
                               threads=threads)
    finally:
        if sock is not None:
            sock.close()
    return 0 if result is None else result


def _serve_on_rank0(engine, model_name, server_config, log_level, ranks, sock) -> int:
    return serve_http(engine, model_name, server_config, log_level, ranks=ranks, sock=sock)


def _forward_stop_signals() -> None:
    """In the launcher: the first SIGINT or SIGTERM is passed on to the workers as SIGTERM (rank 0
    stops its server, then the others); a second one kills them."""
    import multiprocessing

    received = []

    def forward(signum, frame) -> None:
        received.append(signum)
        for child in multiprocessing.active_children():  # the spawned ranks
            os.kill(child.pid, signal.SIGTERM if len(received) == 1 else signal.SIGKILL)

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, forward)
