"""The prefix cache file's format, shared by its saving (:mod:`kvtier.serve.prefix_save`) and
its loading (:mod:`kvtier.serve.prefix_file`, whose docstring describes the file): the engine's
fingerprint, the header and its checks, the ranks' files and the chunks blocks are copied in."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import weakref
import zlib
from pathlib import Path

import torch
import torch.distributed as dist

from kvtier.caches.paged_shared import to_device
from kvtier.caches.persist import PREFIX_FORMAT
from kvtier.serve.offload import block_tensors

FORMAT_VERSION = 1
#: blocks of one tensor copied at a time
CHUNK = 64
#: values of each weight tensor the fingerprint's digest reads
WEIGHT_SAMPLES = 64
#: safetensors' names of the dtypes pages, sidecars and the file's own tensors take
_NAMES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.uint8: "U8",
          torch.int8: "I8", torch.int16: "I16", torch.int32: "I32", torch.int64: "I64",
          torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2"}


def _runner_of(engine):
    """``engine``'s runner (a :class:`~kvtier.parallel.serve.BroadcastRunner` under tensor
    parallelism), once its prefix cache is known to be on."""
    if not engine.block_manager.enable_prefix_caching:
        raise ValueError("prefix caching is off, so there is no prefix cache to save or load; drop "
                         "--no-prefix-caching (enable_prefix_caching=False)")
    return engine.runner


def _sharded(runner) -> bool:
    return hasattr(runner, "on_every_rank")


def _local(runner):
    """This process's :class:`~kvtier.serve.runner.ModelRunner`."""
    return runner.runner if _sharded(runner) else runner


def _world(runner) -> int:
    return dist.get_world_size() if _sharded(runner) else 1


def rank_path(path: str | os.PathLike, rank: int) -> Path:
    """The file of ``rank``'s share of the blocks: ``path`` for rank 0, else ``.rankR`` before its
    suffix (``prefixes.safetensors`` -> ``prefixes.rank1.safetensors``)."""
    path = Path(path)
    return path if rank == 0 else path.with_name(f"{path.stem}.rank{rank}{path.suffix}")


def _everywhere(runner, fn, *args) -> list:
    """``fn(local runner, rank, world size, *args)`` on every rank (one process: here, rank 0 of
    1); the results by rank, or a ``ValueError`` naming each rank whose call raised."""
    if not _sharded(runner):
        return [fn(runner, 0, 1, *args)]
    answers = runner.on_every_rank(fn, *args)
    failed = [f"rank {r}: {value}" for r, (ok, value) in enumerate(answers) if not ok]
    if failed:
        raise ValueError("; ".join(failed))
    return [value for _, value in answers]


def _pool(runner) -> list[torch.Tensor]:
    return [t for c in runner.caches for t in block_tensors(c)]


#: each model's weights digest, taken once (the saves of a server repeat it, and on CUDA each
#: tensor's sample is a device-to-host copy)
_DIGESTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def weights_digest(model) -> str:
    """SHA-256 over every state-dict tensor's name, dtype, shape and :data:`WEIGHT_SAMPLES` of its
    values; taken once per model object (weights changed in place afterwards are not seen)."""
    if model in _DIGESTS:
        return _DIGESTS[model]
    h = hashlib.sha256()
    for name, t in model.state_dict().items():
        flat = t.detach().reshape(-1)
        h.update(f"{name}|{t.dtype}|{list(t.shape)}|".encode())
        if flat.numel():
            k = min(WEIGHT_SAMPLES, flat.numel())
            idx = torch.arange(k, device=flat.device) * (flat.numel() - 1) // max(k - 1, 1)
            h.update(flat[idx].cpu().contiguous().view(torch.uint8).numpy().tobytes())
    _DIGESTS[model] = h.hexdigest()
    return _DIGESTS[model]


def _engine_fingerprint(engine) -> dict:
    config = engine.config
    return {"block_size": config.block_size, "turboquant": repr(config.turboquant),
            "batch_invariant": config.batch_invariant}


def _runner_fingerprint(runner, rank: int, world: int) -> dict:
    """The parts of a fingerprint each rank knows of its own: its shard, its pages, its place."""
    from kvtier.model.act_quant import act_quant_of
    from kvtier.model.linear import prefill_dtype_in_effect

    model = runner.model
    return {
        "model": json.loads(json.dumps(dataclasses.asdict(model.args), default=str)),
        "weights": weights_digest(model),
        "dtype": str(runner.dtype),
        "device": runner.device.type,
        "storage": runner.storage_mode,
        "tensors": [[str(t.dtype), list(t.shape[1:])] for t in _pool(runner)],
        "prefill_dtype": str(prefill_dtype_in_effect(model)),
        "act_quant": act_quant_of(model),
        "gpu": torch.cuda.get_device_name(runner.device) if runner.device.type == "cuda" else None,
        "rank": rank,
        "world_size": world,
    }


def fingerprint(engine) -> dict:
    """What must match for ``engine`` to use another engine's blocks (the module docstring); of
    rank 0's share under tensor parallelism."""
    runner = _runner_of(engine)
    return _engine_fingerprint(engine) | _runner_fingerprint(_local(runner), 0, _world(runner))


def _header_crc(meta: dict[str, str]) -> str:
    return str(zlib.crc32(json.dumps({k: v for k, v in meta.items() if k != "header_crc"}, sort_keys=True).encode()))


def _bytes(t: torch.Tensor):
    return t.contiguous().reshape(-1).view(torch.uint8).numpy()


class PrefixFileMismatch(ValueError):
    """A sound prefix cache file of another fingerprint: blocks another configuration computed."""


def _refusal(path: Path, why: str) -> ValueError:
    return ValueError(f"the prefix cache file {path} cannot be loaded: {why}")


def _differences(saved: dict, ours: dict) -> list[str]:
    """What differs, key by key; long values (the pool's tensors, the model's shape) only named."""
    out = []
    for k in sorted(set(saved) | set(ours)):
        a, b = json.dumps(saved.get(k), sort_keys=True), json.dumps(ours.get(k), sort_keys=True)
        if a != b:
            out.append(f"{k} {a} (this engine: {b})" if len(a) + len(b) < 120 else f"{k} differ")
    return out


def _sound_header(meta: dict, path: Path) -> tuple[dict, int]:
    """``(fingerprint, blocks)`` of a header of this format and version that passes its checksum."""
    if meta.get("format") != PREFIX_FORMAT:
        raise _refusal(path, f"its format is {meta.get('format')!r}, not {PREFIX_FORMAT!r}")
    if meta.get("format_version") != str(FORMAT_VERSION):
        raise _refusal(path, f"format version {meta.get('format_version')}; this kvtier reads {FORMAT_VERSION}")
    if set(meta) != {"format", "format_version", "blocks", "fingerprint", "header_crc"} or meta["header_crc"] != _header_crc(meta):
        raise _refusal(path, "its header fails its checksum (the file is damaged)")
    try:
        saved, n = json.loads(meta["fingerprint"]), int(meta["blocks"])
    except (ValueError, RecursionError) as e:  # (RecursionError: JSON nested too deeply)
        raise _refusal(path, f"its header is damaged ({type(e).__name__})") from None
    if not isinstance(saved, dict) or n < 0:
        raise _refusal(path, "its header is damaged (a fingerprint that is no JSON object, or blocks < 0)")
    return saved, n


def _chunks(places: list, device: torch.device, size: int = CHUNK) -> list[tuple[int, int, list]]:
    """``places`` (row ``i``: ``("pool" | "host", index)``, or ``None`` for a row that goes
    nowhere) as chunks of :data:`CHUNK` rows, made once for every tensor: ``(first row, rows,
    [(where, positions in the chunk, indices)])``, a pool's indices on ``device``."""
    out = []
    for a in range(0, len(places), size):
        part = places[a : a + size]
        moves = []
        for where in ("pool", "host"):
            at = [i for i, p in enumerate(part) if p is not None and p[0] == where]
            if at:
                index = torch.tensor([part[i][1] for i in at])
                moves.append((where, torch.tensor(at), to_device(index, device) if where == "pool" else index))
        out.append((a, len(part), moves))
    return out


def _gather(chunk, dev: torch.Tensor, host: torch.Tensor | None) -> torch.Tensor:
    """A chunk's rows (:func:`_chunks`) of one pool tensor and its host slots, on the CPU."""
    _, n, moves = chunk
    rows = torch.empty((n, *dev.shape[1:]), dtype=dev.dtype)
    for where, at, index in moves:
        rows[at] = (dev if where == "pool" else host).index_select(0, index).cpu()
    return rows


def data_offsets(path: str | os.PathLike, names: list[str]) -> tuple[int, ...]:
    """The file offsets where the data of the tensors ``names`` of a safetensors file begin."""
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(n))
    return tuple(8 + n + header[name]["data_offsets"][0] for name in names)
