"""The serving engine's prefix cache on disk: its cached blocks written to a file and read back
by a later engine (``kvtier serve --prefix-cache-file PATH``: read at start, written at a
graceful stop), so a restarted server answers the prompts it had cached without computing them.

:func:`save_prefix_cache` writes every cached block, of the pool and of the host tier
(:mod:`kvtier.serve.offload`), least recently used first, with the chained hash of its tokens
(:mod:`kvtier.serve.prefix`: SHA-256 over the token ids, the same in every process).
:func:`load_prefix_cache` fills an engine whose cache is empty: the most recently used blocks
go to the pool's free blocks (cached, unreferenced: the first requests to need blocks evict
them as any cached block), the next to the host tier's empty slots; what fits in neither is
left out, oldest first (a chain's tail before its head: blocks are released tail first).

A file is read only by an engine that would have computed the same blocks: its header holds
the engine's *fingerprint* (the model's shape, a digest of its weights, dtype, device type and
GPU, block size, the pages' codec and every pool tensor's dtype and shape, the prefill dtype,
int8 activations, batch invariance, rank and world size), and a file of another fingerprint is
refused, naming what differs (:class:`PrefixFileMismatch`); nor is a sound file of another
fingerprint ever written over (a damaged one is). The
weights' digest hashes 64 evenly spaced values of every tensor of the state dict (and its name,
dtype and shape): quick on any device, but two checkpoints that differ only off those values
would pass as one.

Layout: a safetensors file (``safe_open`` reads it) whose tensors are ``hashes`` (uint8 ``[n,
32]``), ``t0``, ``t1``, ... (block ``i`` of pool tensor ``j`` at row ``i`` of ``tj``: the layers'
pages, then their sidecars) and ``crc`` (int64: the CRC-32 of every other tensor's bytes,
written last); its header metadata holds ``format`` (``kvtier.prefix_cache``), ``format_version``,
``blocks``, ``fingerprint`` (JSON) and ``header_crc``. The blocks are written and read a few at
a time (:data:`CHUNK` blocks of a tensor), so neither the file nor a pool larger than the
host's memory is ever held whole. The write goes to a temporary file beside ``path`` renamed
into place under a lock (as :func:`kvtier.caches.persist.save_cache`), created readable by its
owner alone (the keys and values of every user's prompts); the read checks every
checksum before the engine's books take a block, so a damaged file changes nothing.

Tensor parallelism: each rank holds a share of every block (its KV heads), so each writes its
own file, rank 0 to ``path`` and rank ``R`` to :func:`rank_path` (``prefixes.rank1.safetensors``
beside ``prefixes.safetensors``), all of the same blocks in the same order; the books are rank
0's. A load checks every rank's file (its header and fingerprint: its shard's weights and
pages, its rank and the world size; its hashes against rank 0's) and its checksums before rank
0's books take a block. A save checks every rank's path, has every rank write a temporary file,
and renames them into place only once all have written; rank 0's file alone decides whether
the set is another configuration's.

Example::

    >>> n = save_prefix_cache(engine, "prefixes.safetensors")          # doctest: +SKIP
    >>> load_prefix_cache(new_engine, "prefixes.safetensors")           # doctest: +SKIP
    {'blocks': 812, 'pool': 812, 'host': 0, 'left_out': 0}
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import json
import os
import stat
import sys
import time
import weakref
import zlib
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors import SafetensorError, safe_open

from kvtier.caches.paged_shared import to_device
from kvtier.caches.persist import PREFIX_FORMAT, check_save_path, save_lock, temporary_path
from kvtier.serve.offload import block_tensors

__all__ = ["PrefixFileMismatch", "check_prefix_paths", "engine_lifespan", "fingerprint", "load_prefix_cache", "load_prefix_file",
           "rank_path", "save_prefix_cache", "save_prefix_file"]

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


# -- saving -----------------------------------------------------------------------------------------
def save_prefix_cache(engine, path: str | os.PathLike) -> int:
    """Write every block ``engine``'s prefix cache holds (pool and host tier) to ``path`` (and,
    under tensor parallelism, each other rank's share to :func:`rank_path`); returns how many
    (none cached: 0, and the files are left as they are). The engine must not be stepping
    meanwhile (a server's loop stopped). A ``ValueError`` names what is wrong, and no file
    changes: when a rank's path is a folder or a file of another kind, when ``path`` is a
    sound prefix cache file of another fingerprint (another configuration's blocks are never
    written over), or when a rank fails to write (every rank writes a temporary file first;
    all are renamed into place only once every rank has written its own)."""
    runner, bm = _runner_of(engine), engine.block_manager
    engine_fp = _engine_fingerprint(engine)
    _everywhere(runner, _check_path, str(path), engine_fp)
    if not bm.num_cached_blocks and not bm.host_figures()["host_cached_blocks"]:
        return 0  # (an empty cache does not replace a file of blocks)
    copies = bm.take_copies()  # saves to the host and loads the books count as done, but not yet run
    entries = bm.cached_entries()
    try:
        _everywhere(runner, _write, str(path), engine_fp, copies, entries)
    except BaseException:
        with contextlib.suppress(Exception):
            _everywhere(runner, _discard, str(path))
        raise
    _everywhere(runner, _commit, str(path))
    return len(entries)


def check_prefix_paths(engine, path: str | os.PathLike) -> None:
    """Every rank's file of ``path`` may be written (a new, empty or prefix cache file in a
    folder that exists and is writable); a ``ValueError`` naming the rank and the fix otherwise."""
    _everywhere(_runner_of(engine), _check_writable, str(path))


def _check_writable(runner, rank: int, world: int, path: str) -> None:
    check_save_path(rank_path(path, rank), PREFIX_FORMAT)


def _check_path(runner, rank: int, world: int, path: str, engine_fp: dict) -> None:
    """This rank's file may be written; rank 0's also holds no sound file of another fingerprint
    (a damaged one, or rank files without it, are replaced)."""
    target = check_save_path(rank_path(path, rank), PREFIX_FORMAT)
    if rank or not target.is_file() or not target.stat().st_size:
        return
    try:
        with safe_open(str(target), framework="pt") as f:
            saved, _ = _sound_header(f.metadata() or {}, target)
    except (ValueError, SafetensorError, OSError):
        return
    ours = engine_fp | _runner_fingerprint(runner, rank, world)
    if saved != ours:
        raise ValueError(f"{target} holds the blocks of another model or cache layout ("
                         + "; ".join(_differences(saved, ours)) + "), which saving would overwrite: pass "
                         "another path, or delete the file first")


def _write(runner, rank: int, world: int, path: str, engine_fp: dict, copies, entries) -> None:
    """This rank's share of ``entries`` (``(hash, "pool" | "host", index)``), after the queued
    ``copies``, in its temporary file (:func:`_commit` renames it into place)."""
    if copies:
        runner.host.apply(copies)
    if runner.host is not None and runner.host.cuda:
        torch.cuda.synchronize(runner.host.device)  # the host reads its slots below: every save landed
    target = check_save_path(rank_path(path, rank), PREFIX_FORMAT)
    pool = _pool(runner)
    missing = sorted({str(t.dtype) for t in pool if t.dtype not in _NAMES})
    if missing:
        raise ValueError(f"pages of dtype {missing} have no safetensors name; they cannot be saved")
    hashes = torch.tensor([list(h) for h, _, _ in entries], dtype=torch.uint8).reshape(-1, 32)
    names = ["hashes", *(f"t{j}" for j in range(len(pool)))]
    shapes = [list(hashes.shape)] + [[len(entries), *t.shape[1:]] for t in pool]
    dtypes = [torch.uint8] + [t.dtype for t in pool]
    meta = {"format": PREFIX_FORMAT, "format_version": str(FORMAT_VERSION), "blocks": str(len(entries)),
            "fingerprint": json.dumps(engine_fp | _runner_fingerprint(runner, rank, world), sort_keys=True)}
    meta["header_crc"] = _header_crc(meta)
    header, offset = {"__metadata__": meta}, 0
    for name, shape, dtype in [*zip(names, shapes, dtypes), ("crc", [len(names)], torch.int64)]:
        size = dtype.itemsize * int(torch.Size(shape).numel())
        header[name] = {"dtype": _NAMES[dtype], "shape": shape, "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    tmp = temporary_path(target)
    # the keys and values of every user's prompts: readable by the owner only, unless the file was more open
    mode = stat.S_IMODE(target.stat().st_mode) if target.exists() else 0o600
    with save_lock(target):
        try:
            tmp.unlink(missing_ok=True)
            with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode), "wb") as f:
                os.fchmod(f.fileno(), mode)  # (the umask narrowed it)
                f.write(len(raw).to_bytes(8, "little") + raw)
                crcs = [zlib.crc32(_bytes(hashes))]
                f.write(_bytes(hashes))
                chunks = _chunks([(w, i) for _, w, i in entries], runner.device)
                for j, dev in enumerate(pool):
                    crc = 0
                    for chunk in chunks:
                        rows = _gather(chunk, dev, runner.host.slots[j] if runner.host else None)
                        crc = zlib.crc32(_bytes(rows), crc)
                        f.write(_bytes(rows))
                    crcs.append(crc)
                f.write(_bytes(torch.tensor(crcs, dtype=torch.int64)))
                f.flush()
                os.fsync(f.fileno())
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise


def _commit(runner, rank: int, world: int, path: str) -> None:
    """This rank's temporary file renamed over its file (every rank has written its own)."""
    target = check_save_path(rank_path(path, rank), PREFIX_FORMAT)
    with save_lock(target):
        os.replace(temporary_path(target), target)


def _discard(runner, rank: int, world: int, path: str) -> None:
    temporary_path(check_save_path(rank_path(path, rank), PREFIX_FORMAT)).unlink(missing_ok=True)


def _chunks(places: list, device: torch.device) -> list[tuple[int, int, list]]:
    """``places`` (row ``i``: ``("pool" | "host", index)``, or ``None`` for a row that goes
    nowhere) as chunks of :data:`CHUNK` rows, made once for every tensor: ``(first row, rows,
    [(where, positions in the chunk, indices)])``, a pool's indices on ``device``."""
    out = []
    for a in range(0, len(places), CHUNK):
        part = places[a : a + CHUNK]
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


# -- loading ----------------------------------------------------------------------------------------
def load_prefix_cache(engine, path: str | os.PathLike) -> dict[str, int]:
    """Fill ``engine``'s empty prefix cache with the blocks of ``path`` (the module docstring;
    under tensor parallelism each rank reads its :func:`rank_path`).

    Returns ``blocks`` (in the file), ``pool`` and ``host`` (where they went) and ``left_out``
    (that fitted nowhere). A ``ValueError`` when the engine serves or caches anything already,
    or a file is damaged or not this engine's (:class:`PrefixFileMismatch` when ``path`` is a
    sound file of another fingerprint), naming the rank and what; then the engine's books are
    as before."""
    runner, bm = _runner_of(engine), engine.block_manager
    if engine.has_unfinished() or bm.num_used_blocks or bm.num_cached_blocks or bm.host_figures()["host_cached_blocks"]:
        raise ValueError("load a prefix cache file into an idle engine whose prefix cache is empty "
                         "(before serving, or after its block_manager.reset_prefix_cache())")
    engine_fp = _engine_fingerprint(engine)
    with _checked_file(_local(runner), 0, _world(runner), str(path), engine_fp) as (_, _, hashes):
        pass  # rank 0's file decides what goes where
    n = len(hashes)
    free, empty = bm.free_places()
    keep = min(n, len(free) + len(empty))
    to_pool = min(keep, len(free))  # the most recently used blocks: the pool's
    first = n - keep  # row i >= first goes to places[i - first]
    places = [("host", empty[i]) for i in range(keep - to_pool)] + [("pool", free[i]) for i in range(to_pool)]
    digest = hashlib.sha256(b"".join(hashes)).hexdigest()
    _everywhere(runner, _fill, str(path), engine_fp, places, first, digest)
    kept = list(zip(hashes[first:], places))
    bm.adopt([(h, i) for h, (w, i) in kept if w == "pool"], [(h, i) for h, (w, i) in kept if w == "host"])
    return {"blocks": n, "pool": to_pool, "host": keep - to_pool, "left_out": first}


@contextlib.contextmanager
def _checked_file(runner, rank: int, world: int, path: str, engine_fp: dict):
    """``(open file, its path, its hashes)`` of this rank's file once its header, fingerprint,
    tensors and hashes are checked; a ``ValueError`` naming the file otherwise (the file's
    reads inside the block too)."""
    file = rank_path(path, rank)
    if file.exists() and not file.is_file():
        raise _refusal(file, "it is not a regular file")
    try:
        with safe_open(str(file), framework="pt") as f:
            saved, n = _sound_header(f.metadata() or {}, file)
            ours = engine_fp | _runner_fingerprint(runner, rank, world)
            if saved != ours:
                raise PrefixFileMismatch(f"the prefix cache file {file} cannot be loaded: it was saved by another "
                                         "model or cache layout: " + "; ".join(_differences(saved, ours)))
            yield f, file, _hashes(f, file, _pool(runner), n)
    except (SafetensorError, OSError) as e:
        raise _refusal(file, f"{type(e).__name__}: {e}") from None


def _hashes(f, path: Path, pool: list[torch.Tensor], n: int) -> list[bytes]:
    """The hashes of an open file whose tensors are ``n`` blocks of ``pool``'s, each checked."""
    names = ["hashes", *(f"t{j}" for j in range(len(pool)))]
    if set(f.keys()) != {*names, "crc"}:
        raise _refusal(path, f"its tensors {sorted(f.keys())} are not {names} and crc (the file is damaged)")
    crc = f.get_slice("crc")
    if crc.get_shape() != [len(names)] or crc.get_dtype() != "I64":
        raise _refusal(path, f"its crc tensor is {crc.get_dtype()} {crc.get_shape()}, not I64 [{len(names)}] "
                             "(the file is damaged)")
    for name, t in zip(names, [None, *pool]):
        want = [n, 32] if t is None else [n, *t.shape[1:]]
        if f.get_slice(name).get_shape() != want:
            raise _refusal(path, f"tensor {name} is {f.get_slice(name).get_shape()}, not {want} (the file is damaged)")
    hashes = f.get_tensor("hashes")
    if hashes.dtype != torch.uint8 or zlib.crc32(_bytes(hashes)) != f.get_tensor("crc")[0].item():
        raise _refusal(path, "its hashes fail their checksum (the file is damaged)")
    hashes = [bytes(h) for h in hashes.tolist()]
    if len(set(hashes)) != n:
        raise _refusal(path, "a hash comes twice (the file is damaged)")
    return hashes


def _fill(runner, rank: int, world: int, path: str, engine_fp: dict, places, first: int, digest: str) -> None:
    """Rows ``first ..`` of this rank's file into ``places`` (``("pool" | "host", index)``), every
    tensor's checksum checked; its hashes must be rank 0's (``digest``)."""
    with _checked_file(runner, rank, world, path, engine_fp) as (f, file, hashes):
        if hashlib.sha256(b"".join(hashes)).hexdigest() != digest:
            raise _refusal(file, "its blocks are not those of rank 0's file (the files come from different saves)")
        crcs = f.get_tensor("crc").tolist()
        chunks = _chunks([None] * first + list(places), runner.device)  # (rows before first: read, checked, left)
        for j, dev in enumerate(_pool(runner)):
            host = runner.host.slots[j] if runner.host is not None else None
            crc, sl = 0, f.get_slice(f"t{j}")
            for a, n, moves in chunks:
                rows = sl[a : a + n]
                if rows.dtype != dev.dtype:
                    raise _refusal(file, f"tensor t{j} is {rows.dtype}, not {dev.dtype} (the file is damaged)")
                crc = zlib.crc32(_bytes(rows), crc)
                for where, at, index in moves:
                    dst = dev if where == "pool" else host
                    dst.index_copy_(0, index, rows[at].to(dst.device))
            if crc != crcs[j + 1]:
                raise _refusal(file, f"tensor t{j} fails its checksum (the file is damaged)")


# -- the server's side: a line on stderr, never an exception but the ranks' own ---------------------
#: errors of the ranks' groups: a server whose ranks cannot talk stops
_DIST_ERRORS = (dist.DistError,) if hasattr(dist, "DistError") else ()


def _rank_files(engine, path) -> str:
    world = _world(engine.runner)
    return f" and {world - 1} rank files beside it" if world > 1 else ""


def load_prefix_file(engine, path: str | os.PathLike) -> dict[str, int] | None:
    """:func:`load_prefix_cache` for ``kvtier serve``: a missing file or one that cannot be loaded
    leaves the cache empty with a line saying why (a file of another configuration is then kept
    at the stop; a damaged one is replaced)."""
    if not os.path.exists(path):
        print(f"[kvtier] no prefix cache file {path} yet: the cache starts empty and is written there "
              "when the server saves it", file=sys.stderr, flush=True)
        return None
    t0 = time.perf_counter()
    try:
        got = load_prefix_cache(engine, path)
    except PrefixFileMismatch as e:
        print(f"[kvtier] {e}; the prefix cache starts empty, and this server will not write over the file "
              "(pass another --prefix-cache-file to keep its cache too)", file=sys.stderr, flush=True)
        return None
    except Exception as e:  # (a file this code did not foresee: never a server that does not start)
        if isinstance(e, _DIST_ERRORS):
            raise
        why = str(e) if isinstance(e, ValueError) else f"{type(e).__name__}: {e}"
        print(f"[kvtier] {why}; the prefix cache starts empty (the file is replaced when the server saves it)",
              file=sys.stderr, flush=True)
        return None
    left = f", {got['left_out']} least recently used left out" if got["left_out"] else ""
    print(f"[kvtier] loaded {_blocks(got['blocks'] - got['left_out'])} from {path}{_rank_files(engine, path)} in "
          f"{time.perf_counter() - t0:.1f} s ({got['pool']} in the pool, {got['host']} in host memory{left})",
          file=sys.stderr, flush=True)
    return got


def _blocks(n: int) -> str:
    return f"{n} cached block{'' if n == 1 else 's'}"


def save_prefix_file(engine, path: str | os.PathLike, *, quiet: bool = False) -> int | None:
    """:func:`save_prefix_cache` for a server: a line saying what was written, or why nothing
    was (``None``; ``quiet``: no line when nothing was cached)."""
    t0 = time.perf_counter()
    try:
        n = save_prefix_cache(engine, path)
    except Exception as e:  # (a stopping server prints why, and stops)
        if isinstance(e, _DIST_ERRORS):
            raise
        why = str(e) if isinstance(e, ValueError) else f"{type(e).__name__}: {e}"
        print(f"[kvtier] the prefix cache was not saved to {path}: {why}", file=sys.stderr, flush=True)
        return None
    if n:
        files = [f for f in (rank_path(path, r) for r in range(_world(engine.runner))) if f.is_file()]  # (this host's)
        beside = _rank_files(engine, path)
        print(f"[kvtier] saved {_blocks(n)} to {path}{beside} ({sum(f.stat().st_size for f in files) / 2**20:.1f} "
              f"MiB{' in all' if beside else ''}) in {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
    elif not quiet:
        print(f"[kvtier] nothing cached: {path} left as it was", file=sys.stderr, flush=True)
    return n


@contextlib.asynccontextmanager
async def engine_lifespan(engine, path: str | os.PathLike | None, interval_s: float | None = None):
    """A server's :class:`~kvtier.serve.async_engine.AsyncLLMEngine` over its lifespan: started;
    while serving, the prefix cache saved to ``path`` every ``interval_s`` seconds (in the loop,
    between two steps, when a step ran since the last save); at the end a save under way is
    waited for, the engine stopped, then the cache saved (a line says so when a step outlived
    the loop's wait, and nothing was)."""
    engine.start()
    running: list = []  # the periodic save posted to the loop, if any
    saving = None if path is None or interval_s is None else asyncio.create_task(_save_every(engine, path, interval_s, running))
    try:
        yield
    finally:
        if saving is not None:
            saving.cancel()  # (a save posted but not started is dropped; one under way runs on)
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await saving
            while running and not running[0].done():  # the loop's wait below must not cut it short
                await asyncio.sleep(0.05)
        stopped = engine.shutdown()
        if path is not None and stopped:
            save_prefix_file(engine.engine, path)
        elif path is not None:
            print(f"[kvtier] the prefix cache was not saved to {path}: a step was still running when the "
                  "server stopped", file=sys.stderr, flush=True)


async def _save_every(engine, path, interval_s: float, running: list) -> None:
    """Save every ``interval_s`` seconds when a step ran since the last save; a save that fails
    (or finds the file another configuration's) ends the periodic saves with a line."""
    saved_at = engine.stats["steps"]
    while True:
        await asyncio.sleep(interval_s)
        if engine.stats["steps"] == saved_at:
            continue
        saved_at = engine.stats["steps"]
        running[:] = [engine.call(lambda e: save_prefix_file(e, path, quiet=True))]
        try:
            saved = await asyncio.wrap_future(running[0]) is not None  # (None: the save said why not)
        except Exception as e:  # (a rank's group error: the steps will say more)
            print(f"[kvtier] the prefix cache was not saved to {path}: {type(e).__name__}: {e}", file=sys.stderr,
                  flush=True)
            saved = False
        if not saved:
            print("[kvtier] the periodic saves of the prefix cache stop (the save failed); it is saved again "
                  "when the server stops", file=sys.stderr, flush=True)
            return
