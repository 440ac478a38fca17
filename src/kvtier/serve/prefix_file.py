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
import hashlib
import os
import sys
import time
import weakref
import zlib
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors import SafetensorError, safe_open

from kvtier.caches.persist import PREFIX_FORMAT, check_save_path, is_cache_file
from kvtier.serve.prefix_format import (
    CHUNK,
    FORMAT_VERSION,
    PrefixFileMismatch,
    _bytes,
    _chunks,
    _differences,
    _engine_fingerprint,
    _everywhere,
    _local,
    _pool,
    _refusal,
    _runner_fingerprint,
    _runner_of,
    _sound_header,
    _world,
    data_offsets,
    fingerprint,
    rank_path,
)
from kvtier.serve.prefix_save import (
    CAPTURE_SHARE,
    begin_prefix_save,
    check_prefix_paths,
    discard_unfinished,
    file_ident,
    remember_file,
    save_prefix_cache,
)

__all__ = ["CHUNK", "FORMAT_VERSION", "PrefixFileMismatch", "check_prefix_file", "check_prefix_paths",
           "check_rank_files", "check_read_only_file", "engine_lifespan", "fingerprint", "load_prefix_cache",
           "load_prefix_file", "rank_path", "save_figures", "save_in_loop", "save_prefix_cache", "save_prefix_file"]


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
    ident = file_ident(rank_path(path, rank))
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
        if file_ident(file) == ident:  # (the file read is the file remembered: a periodic save reads it)
            remember_file(runner, file, hashes, data_offsets(file, [f"t{j}" for j in range(len(crcs) - 1)]), crcs[1:])


# -- the server's side: a line on stderr, never an exception but the ranks' own ---------------------
#: the longest wait between two tries of a periodic save that keeps failing (:func:`_save_every`)
RETRY_CAP_S = 3600.0
#: errors of the ranks' groups: a server whose ranks cannot talk stops
_DIST_ERRORS = (dist.DistError,) if hasattr(dist, "DistError") else ()


def _rank_files(engine, path) -> str:
    world = _world(engine.runner)
    return f" and {world - 1} rank files beside it" if world > 1 else ""


def check_read_only_file(path: str | os.PathLike) -> Path:
    """``path`` for ``--prefix-cache-read-only``: a prefix cache file (or a symlink to one) this
    process can read; a ``ValueError`` naming what it is and the fix otherwise."""
    path = Path(path)
    try:
        path.stat()
    except FileNotFoundError:
        raise ValueError(f"{path} does not exist; --prefix-cache-read-only reads a prefix cache file saved "
                         "before (by kvtier serve --prefix-cache-file): pass its path, or drop the flag to start "
                         "one") from None
    except OSError as e:
        raise ValueError(f"{path} cannot be inspected ({e}); pass the path of a prefix cache file this user "
                         "can read") from None
    if not path.is_file():
        raise ValueError(f"{path} is not a regular file; --prefix-cache-read-only reads a prefix cache file")
    if not os.access(path, os.R_OK):
        raise ValueError(f"{path} cannot be read by this user; make it readable, or pass another path")
    if not is_cache_file(path, PREFIX_FORMAT):
        raise ValueError(f"{path} is not a kvtier prefix cache file (kvtier serve --prefix-cache-file)")
    return path


def check_prefix_file(path: str, *, read_only: bool = False) -> None:
    """Rank 0's file of a server (``--prefix-cache-file``), before the model loads: one it may write
    when it stops (:func:`~kvtier.caches.persist.check_save_path`, whose refusal of a prefix cache
    file in a folder this user cannot write names ``--prefix-cache-read-only``), or with
    ``read_only`` one it reads (:func:`check_read_only_file`)."""
    if read_only:
        check_read_only_file(path)
    else:
        check_save_path(path, PREFIX_FORMAT)


def check_rank_files(path: str | os.PathLike, world: int, *, read_only: bool = False) -> None:
    """The files of ranks 1 .. ``world - 1`` beside ``path``, before any rank starts: each may be
    written (:func:`~kvtier.caches.persist.check_save_path`), or with ``read_only`` read
    (:func:`check_read_only_file`; rank files missing beside rank 0's are named as saved at another
    ``--tensor-parallel``); a ``ValueError`` otherwise. Rank 0's is checked by
    :class:`~kvtier.serve.api.ServerConfig`."""
    for rank in range(1, world):
        mine = rank_path(path, rank)
        if not read_only:
            check_save_path(mine, PREFIX_FORMAT)
            continue
        if not os.path.lexists(mine) and os.path.exists(path):
            raise ValueError(f"{mine} does not exist, while {path} does: the files were saved by a server of "
                             "another --tensor-parallel, and --prefix-cache-read-only reads every rank's; save "
                             "them with this --tensor-parallel")
        check_read_only_file(mine)


def load_prefix_file(engine, path: str | os.PathLike, *, read_only: bool = False) -> dict[str, int] | None:
    """:func:`load_prefix_cache` for ``kvtier serve``: a missing file or one that cannot be loaded
    leaves the cache empty with a line saying why (a file of another configuration is then kept
    at the stop; a damaged one is replaced; ``read_only``: the file is never written)."""
    if not os.path.exists(path):
        then = "(--prefix-cache-read-only: none is written)" if read_only else "and is written there when the server saves it"
        print(f"[kvtier] no prefix cache file {path} yet: the cache starts empty {then}", file=sys.stderr, flush=True)
        return None
    t0 = time.perf_counter()
    try:
        got = load_prefix_cache(engine, path)
    except PrefixFileMismatch as e:
        then = (" (--prefix-cache-read-only: the file is left as it is)" if read_only else ", and this server will "
                "not write over the file (pass another --prefix-cache-file to keep its cache too)")
        print(f"[kvtier] {e}; the prefix cache starts empty{then}", file=sys.stderr, flush=True)
        return None
    except Exception as e:  # (a file this code did not foresee: never a server that does not start)
        then = ("--prefix-cache-read-only: the file is left as it is" if read_only else
                "the file is replaced when the server saves it")
        print(f"[kvtier] {_why(e)}; the prefix cache starts empty ({then})", file=sys.stderr, flush=True)
        return None
    left = f", {got['left_out']} least recently used left out" if got["left_out"] else ""
    print(f"[kvtier] loaded {_blocks(got['blocks'] - got['left_out'])} from {path}{_rank_files(engine, path)} in "
          f"{time.perf_counter() - t0:.1f} s ({got['pool']} in the pool, {got['host']} in host memory{left})",
          file=sys.stderr, flush=True)
    return got


def _blocks(n: int) -> str:
    return f"{n} cached block{'' if n == 1 else 's'}"


def _saved_line(engine, path, n: int, seconds: float, how: str = "") -> None:
    files = [f for f in (rank_path(path, r) for r in range(_world(engine.runner))) if f.is_file()]  # (this host's)
    beside = _rank_files(engine, path)
    print(f"[kvtier] saved {_blocks(n)} to {path}{beside} ({sum(f.stat().st_size for f in files) / 2**20:.1f} "
          f"MiB{' in all' if beside else ''}) in {seconds:.1f} s{how}", file=sys.stderr, flush=True)


def _why(e: Exception) -> str:
    """What a line says of ``e``; the ranks' group errors are raised (a server whose ranks cannot
    talk stops)."""
    if isinstance(e, _DIST_ERRORS):
        raise e
    return str(e) if isinstance(e, ValueError) else f"{type(e).__name__}: {e}"


def _not_saved(path, e: Exception, then: str = "") -> None:
    print(f"[kvtier] the prefix cache was not saved to {path}: {_why(e)}{then}", file=sys.stderr, flush=True)


def save_prefix_file(engine, path: str | os.PathLike) -> int | None:
    """:func:`save_prefix_cache` for a server: a line saying what was written, or why nothing
    was (``None``)."""
    t0 = time.perf_counter()
    try:
        n = save_prefix_cache(engine, path)
    except Exception as e:  # (a stopping server prints why, and stops)
        _not_saved(path, e)
        return None
    if n:
        _saved_line(engine, path, n, time.perf_counter() - t0)
    else:
        print(f"[kvtier] nothing cached: {path} left as it was", file=sys.stderr, flush=True)
    return n


@contextlib.asynccontextmanager
async def engine_lifespan(engine, path: str | os.PathLike | None, interval_s: float | None = None):
    """A server's :class:`~kvtier.serve.async_engine.AsyncLLMEngine` over its lifespan: started;
    while serving, the prefix cache saved to ``path`` every ``interval_s`` seconds when a step ran
    since the last save (:func:`save_in_loop`); at the end a save under way is finished, the
    engine stopped, then the cache saved (a line says so when a step outlived the loop's wait,
    and nothing was)."""
    engine.start()
    stop = asyncio.Event()
    saving = None if path is None or interval_s is None else asyncio.create_task(_save_every(engine, path, interval_s, stop))
    try:
        yield
    finally:
        if saving is not None:
            stop.set()  # (a save under way is finished first: its last part runs in the loop)
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await saving
        stopped = engine.shutdown()
        if path is not None and stopped:
            if saving is not None:
                with contextlib.suppress(Exception):
                    discard_unfinished(engine.engine)  # (a save cut off by a cancellation: nothing steps now)
            save_prefix_file(engine.engine, path)
        elif path is not None:
            print(f"[kvtier] the prefix cache was not saved to {path}: a step was still running when the "
                  "server stopped", file=sys.stderr, flush=True)


#: each served engine's periodic saves, for its metrics (:func:`save_figures`)
_FIGURES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def save_figures(engine) -> dict[str, float]:
    """The saves :func:`save_in_loop` made of a served :class:`~kvtier.serve.async_engine.AsyncLLMEngine`
    so far: ``prefix_file_saves`` (those that wrote the file), ``prefix_file_save_failures`` (tries
    that failed), and of the last save ``prefix_file_last_save_seconds``,
    ``prefix_file_last_pause_seconds`` and ``prefix_file_blocks``; empty before any."""
    return dict(_FIGURES.get(engine, {}))


async def _save_every(engine, path, interval_s: float, stop: asyncio.Event) -> None:
    """Save every ``interval_s`` seconds when a step ran since the last save, until ``stop``. After
    a save that fails (another process saving to the file at that moment, a folder not writable
    for a while, the file another configuration's) the next try comes twice as late as the one
    before, up to an hour, with a line; a save that works again returns to ``interval_s``."""
    _figures(engine)  # (the metrics shown from the start)
    saved_at = engine.stats["steps"]
    wait = interval_s
    while True:
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(stop.wait(), wait)
        if stop.is_set():
            return
        steps = engine.stats["steps"]
        if steps == saved_at:
            continue
        if await save_in_loop(engine, path):
            saved_at, wait = steps, interval_s
        else:
            wait = min(2 * wait, max(interval_s, RETRY_CAP_S))
            print(f"[kvtier] the periodic save of the prefix cache failed; the next is tried in {wait:g} s (and "
                  "the cache is saved when the server stops)", file=sys.stderr, flush=True)


async def save_in_loop(engine, path: str | os.PathLike) -> bool:
    """Save the prefix cache of a running :class:`~kvtier.serve.async_engine.AsyncLLMEngine` to
    ``path`` without stopping its steps for long: :func:`~kvtier.serve.prefix_save.begin_prefix_save`,
    the file written by a thread while the engine steps, then renamed into place, each part run in
    the loop between two steps. A save that fails once begun is dropped and made once more at once
    (the file on disk no longer read from, every block copied). A line says what was saved, or
    why not (then ``False``). A task cancelled meanwhile leaves the save begun, for
    :func:`~kvtier.serve.prefix_save.discard_unfinished` once the loop has stopped."""
    for again in (False, True):
        saved, begun = await _save_once(engine, path, again)
        if saved or not begun or again:
            return saved
    return False


async def _save_once(engine, path, again: bool) -> tuple[bool, bool]:
    """One try of :func:`save_in_loop`: ``(saved, whether it was begun)``."""
    def in_loop(fn):
        return asyncio.wrap_future(engine.call(fn))

    t0, save = time.perf_counter(), None
    try:
        save = await in_loop(lambda e: begin_prefix_save(e, path))
        if save is None:
            return True, False
        while not await in_loop(lambda e: save.written()):
            await asyncio.sleep(0.05)
        n = await in_loop(lambda e: save.finish())
    except Exception as e:
        if save is not None:
            with contextlib.suppress(Exception):
                await in_loop(lambda e: save.discard())
        _not_saved(path, e, "" if save is None or again else "; saving again at once, copying every block")
        _count(engine, "prefix_file_save_failures")
        return False, save is not None
    if save.unchanged:  # (nothing written: not a save to count)
        return True, True
    seconds = time.perf_counter() - t0
    _count(engine, "prefix_file_saves", prefix_file_last_save_seconds=seconds,
           prefix_file_last_pause_seconds=save.pause_s, prefix_file_blocks=n)
    if save.waited:
        how = (f", the engine waiting {save.pause_s:.1f} s (copies of the blocks would have taken over "
               f"{CAPTURE_SHARE:.0%} of the host's available memory)")
    else:
        how = (f", the engine pausing {1e3 * save.pause_s:.0f} ms between two steps to copy {save.new_blocks} "
               f"block{'' if save.new_blocks == 1 else 's'} new to the file ({save.copied_bytes / 2**20:.1f} MiB)")
    _saved_line(engine.engine, path, n, seconds, how)
    return True, True


def _figures(engine) -> dict:
    return _FIGURES.setdefault(engine, {"prefix_file_saves": 0, "prefix_file_save_failures": 0})


def _count(engine, key: str, **last: float) -> None:
    figures = _figures(engine)
    figures[key] += 1
    figures |= last
