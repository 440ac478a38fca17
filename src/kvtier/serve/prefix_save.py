"""Saving the serving engine's prefix cache to a file (:mod:`kvtier.serve.prefix_file` describes
the file and loads it), in one of two ways:

- :func:`save_prefix_cache` writes every block from the pool and the host tier while the engine
  waits: a server's last save, once its loop has stopped;
- :func:`begin_prefix_save` takes only a moment between two steps (a server's periodic saves,
  ``--prefix-cache-save-interval``): the blocks the file on disk does not hold yet are copied to
  host memory, and a thread writes the new file, taking every other block from the file itself
  (each of its tensors checked against its CRC-32 first), while the engine steps on;
  :meth:`PrefixSave.finish` renames it into place between two later steps.

The file on disk is the one this process last wrote or read at that path, known by its device,
inode, size and modification time: a file changed since by anyone else is not read from, and the
save copies every block as the first one did. A save that would hold more than
:data:`CAPTURE_SHARE` of the host's available memory is written while the engine waits, as
:func:`save_prefix_cache`. Under tensor parallelism every rank does the same with its own file,
and the files are renamed into place only once every rank has written its own.

Example (a server's loop; :func:`kvtier.serve.prefix_file.engine_lifespan` does this)::

    >>> save = begin_prefix_save(engine, "prefixes.safetensors")   # between two steps  # doctest: +SKIP
    >>> while not save.written():                                   # between later steps
    ...     engine.step()                                            # doctest: +SKIP
    >>> save.finish()                                               # doctest: +SKIP
    812
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import json
import os
import stat
import time
import weakref
import zlib
from collections.abc import Callable, Iterable
from pathlib import Path

import numpy as np
import torch
from safetensors import SafetensorError, safe_open

from kvtier.caches.persist import PREFIX_FORMAT, check_save_path, save_lock, temporary_path
from kvtier.caches.state_checks import free_bytes
from kvtier.serve.prefix_format import (
    _NAMES,
    CHUNK,
    FORMAT_VERSION,
    _bytes,
    _chunks,
    _differences,
    _engine_fingerprint,
    _everywhere,
    _gather,
    _header_crc,
    _pool,
    _runner_fingerprint,
    _runner_of,
    _sound_header,
    rank_path,
)

__all__ = ["CAPTURE_SHARE", "PrefixSave", "begin_prefix_save", "check_prefix_paths", "remember_file",
           "save_prefix_cache"]

#: the most of the host's available memory (``MemAvailable``) a save begun between two steps may
#: hold in copies of blocks; a save that would need more is written while the engine waits
CAPTURE_SHARE = 0.25
#: bytes of a tensor in the file read at a time to check its CRC-32
_CHECK_BYTES = 64 << 20


@dataclasses.dataclass(frozen=True)
class _OnDisk:
    """A file this process wrote or read: its identity, each block's row, and for each pool tensor
    the file offset of its data and its CRC-32."""

    ident: tuple[int, int, int, int] | None
    rows: dict[bytes, int]
    offsets: tuple[int, ...]
    crcs: tuple[int, ...]


@dataclasses.dataclass
class _Written:
    """This rank's file being written (:func:`_begin`, :func:`_write`) until renamed into place."""

    target: Path
    hashes: list[bytes]
    offsets: tuple[int, ...]
    future: concurrent.futures.Future


#: each local runner's files as this process last wrote or read them: ``{path: _OnDisk}``
_ON_DISK: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
#: each local runner's file being written: :class:`_Written`
_WRITING: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_WRITER: list[concurrent.futures.ThreadPoolExecutor] = []


def _writer() -> concurrent.futures.ThreadPoolExecutor:
    if not _WRITER:
        _WRITER.append(concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="kvtier-prefix-save"))
    return _WRITER[0]


def _ident(path: Path) -> tuple[int, int, int, int] | None:
    try:
        st = path.stat()
    except OSError:
        return None
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


def remember_file(runner, target: Path, hashes: list[bytes], offsets, crcs) -> None:
    """Note that ``target`` holds ``hashes`` (row ``i``: ``hashes[i]``), each pool tensor's data at
    ``offsets`` with CRC-32 ``crcs``: a later :func:`begin_prefix_save` reads those blocks from it."""
    files = _ON_DISK.setdefault(runner, {})
    files[os.path.realpath(target)] = _OnDisk(_ident(target), {h: i for i, h in enumerate(hashes)}, tuple(offsets), tuple(crcs))


def _forget(runner, target: Path) -> None:
    _ON_DISK.get(runner, {}).pop(os.path.realpath(target), None)


# -- a save while the engine waits ------------------------------------------------------------------
def save_prefix_cache(engine, path: str | os.PathLike) -> int:
    """Write every block ``engine``'s prefix cache holds (pool and host tier) to ``path`` (and,
    under tensor parallelism, each other rank's share to :func:`rank_path`); returns how many
    (none cached: 0, and the files are left as they are). The engine must not be stepping
    meanwhile (a server's loop stopped). A ``ValueError`` names what is wrong, and no file
    changes: when a rank's path is a folder or a file of another kind, when ``path`` is a
    sound prefix cache file of another fingerprint (another configuration's blocks are never
    written over), when a save begun by :func:`begin_prefix_save` is not finished, or when a
    rank fails to write (every rank writes a temporary file first; all are renamed into place
    only once every rank has written its own)."""
    runner, bm = _runner_of(engine), engine.block_manager
    engine_fp = _engine_fingerprint(engine)
    _everywhere(runner, _check_path, str(path), engine_fp)
    if not bm.num_cached_blocks and not bm.host_figures()["host_cached_blocks"]:
        return 0  # (an empty cache does not replace a file of blocks)
    copies = bm.take_copies()  # saves to the host and loads the books count as done, but not yet run
    entries = bm.cached_entries()
    _run(runner, path, lambda: _everywhere(runner, _write, str(path), engine_fp, copies, entries))
    return len(entries)


def _run(runner, path, write: Callable[[], object]) -> None:
    """``write()`` on every rank, then every rank's file renamed into place; every temporary file
    removed if a rank fails."""
    try:
        write()
        _everywhere(runner, _commit, str(path))
    except BaseException:
        with contextlib.suppress(Exception):
            _everywhere(runner, _discard, str(path))
        raise


def check_prefix_paths(engine, path: str | os.PathLike) -> None:
    """Every rank's file of ``path`` may be written (a new, empty or prefix cache file in a
    folder that exists and is writable); a ``ValueError`` naming the rank and the fix otherwise."""
    _everywhere(_runner_of(engine), _check_writable, str(path))


def _check_writable(runner, rank: int, world: int, path: str) -> None:
    check_save_path(rank_path(path, rank), PREFIX_FORMAT)


def _check_path(runner, rank: int, world: int, path: str, engine_fp: dict) -> None:
    """This rank's file may be written; rank 0's also holds no sound file of another fingerprint
    (a damaged one, or rank files without it, are replaced); no save begun is unfinished."""
    if runner in _WRITING:
        raise ValueError("a save of the prefix cache begun by begin_prefix_save() is not finished; "
                         "finish() or discard() it first")
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


def _ready(runner, copies) -> list[torch.Tensor]:
    """The pool's tensors once the queued ``copies`` ran (the host's slots are read next)."""
    if copies:
        runner.host.apply(copies)
    if runner.host is not None and runner.host.cuda:
        torch.cuda.synchronize(runner.host.device)  # every save to the host landed
    pool = _pool(runner)
    missing = sorted({str(t.dtype) for t in pool if t.dtype not in _NAMES})
    if missing:
        raise ValueError(f"pages of dtype {missing} have no safetensors name; they cannot be saved")
    return pool


def _header(runner, rank: int, world: int, engine_fp: dict, pool: list[torch.Tensor], n: int) -> tuple[bytes, tuple]:
    """The file's first bytes (its header's length, then the header) for ``n`` blocks, and the
    file offset of each pool tensor's data."""
    names = ["hashes", *(f"t{j}" for j in range(len(pool)))]
    shapes = [[n, 32]] + [[n, *t.shape[1:]] for t in pool]
    dtypes = [torch.uint8] + [t.dtype for t in pool]
    meta = {"format": PREFIX_FORMAT, "format_version": str(FORMAT_VERSION), "blocks": str(n),
            "fingerprint": json.dumps(engine_fp | _runner_fingerprint(runner, rank, world), sort_keys=True)}
    meta["header_crc"] = _header_crc(meta)
    header, offset = {"__metadata__": meta}, 0
    for name, shape, dtype in [*zip(names, shapes, dtypes), ("crc", [len(names)], torch.int64)]:
        size = dtype.itemsize * int(torch.Size(shape).numel())
        header[name] = {"dtype": _NAMES[dtype], "shape": shape, "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    start = 8 + len(raw)
    return len(raw).to_bytes(8, "little") + raw, tuple(start + header[f"t{j}"]["data_offsets"][0] for j in range(len(pool)))


def _hash_rows(entries) -> np.ndarray:
    return np.frombuffer(b"".join(h for h, _, _ in entries), dtype=np.uint8).reshape(-1, 32)


def _write_file(target: Path, head: bytes, hashes: np.ndarray, n: int,
                pieces: Callable[[int], Iterable[np.ndarray]]) -> list[int]:
    """``target``'s temporary file: ``head``, the hashes, the ``n`` pool tensors' bytes from
    ``pieces(j)``, the CRC-32s; returns the pool tensors' CRC-32s. The caller holds the save lock."""
    tmp = temporary_path(target)
    # the keys and values of every user's prompts: readable by the owner only, unless the file was more open
    mode = stat.S_IMODE(target.stat().st_mode) if target.exists() else 0o600
    try:
        tmp.unlink(missing_ok=True)
        with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode), "wb") as f:
            os.fchmod(f.fileno(), mode)  # (the umask narrowed it)
            f.write(head)
            crcs = [zlib.crc32(hashes)]
            f.write(hashes)
            for j in range(n):
                crc = 0
                for piece in pieces(j):
                    crc = zlib.crc32(piece, crc)
                    f.write(piece)
                crcs.append(crc)
            f.write(np.asarray(crcs, dtype="<i8").tobytes())
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return crcs[1:]


def _write(runner, rank: int, world: int, path: str, engine_fp: dict, copies, entries) -> None:
    """This rank's share of ``entries`` (``(hash, "pool" | "host", index)``), after the queued
    ``copies``, gathered from the pool and the host here, in its temporary file (:func:`_commit`
    renames it into place)."""
    pool = _ready(runner, copies)
    target = check_save_path(rank_path(path, rank), PREFIX_FORMAT)
    head, offsets = _header(runner, rank, world, engine_fp, pool, len(entries))
    chunks = _chunks([(w, i) for _, w, i in entries], runner.device)

    def pieces(j: int):
        host = runner.host.slots[j] if runner.host is not None else None
        return (_bytes(_gather(chunk, pool[j], host)) for chunk in chunks)

    with save_lock(target):
        crcs = _write_file(target, head, _hash_rows(entries), len(pool), pieces)
    done: concurrent.futures.Future = concurrent.futures.Future()
    done.set_result(crcs)
    _WRITING[runner] = _Written(target, [h for h, _, _ in entries], offsets, done)


def _commit(runner, rank: int, world: int, path: str) -> None:
    """This rank's temporary file renamed over its file (every rank has written its own)."""
    written = _WRITING.pop(runner, None)
    target = check_save_path(rank_path(path, rank), PREFIX_FORMAT)
    if written is None or written.target != target:
        raise ValueError(f"no save of {target} was written to commit")
    crcs = written.future.result()  # (a thread's error: raised here)
    with save_lock(target):
        os.replace(temporary_path(target), target)
        remember_file(runner, target, written.hashes, written.offsets, crcs)


def _discard(runner, rank: int, world: int, path: str) -> None:
    written = _WRITING.pop(runner, None)
    if written is not None:
        with contextlib.suppress(BaseException):
            written.future.result()  # (a thread writing still: done before its file goes)
    temporary_path(check_save_path(rank_path(path, rank), PREFIX_FORMAT)).unlink(missing_ok=True)


# -- a save begun between two steps -----------------------------------------------------------------
@dataclasses.dataclass
class PrefixSave:
    """A save begun by :func:`begin_prefix_save`: ``blocks`` in all, ``new_blocks`` of them copied
    to host memory (``copied_bytes`` on each rank at most) in ``pause_s`` seconds; the file is
    being written by a thread (``waited``: it was written while the engine waited, more than
    :data:`CAPTURE_SHARE` of the host's memory would have been needed). Call :meth:`written` and
    :meth:`finish` (or :meth:`discard`) where the engine is not stepping, between two steps."""

    engine: object
    path: str
    blocks: int
    new_blocks: int
    copied_bytes: int
    pause_s: float
    waited: bool = False
    done: bool = False

    def written(self) -> bool:
        """Whether every rank's file is written (a ``ValueError`` naming the rank whose writing
        failed; then :meth:`discard`)."""
        return self.done or all(_everywhere(self.engine.runner, _poll, self.path))

    def finish(self) -> int:
        """Rename every rank's file into place once :meth:`written` (waiting for it otherwise);
        returns the blocks saved. Every temporary file is removed if a rank fails."""
        if not self.done:
            runner = self.engine.runner
            _run(runner, self.path, lambda: None)
            self.done = True
        return self.blocks

    def discard(self) -> None:
        """Drop the save (waiting for a thread still writing): every rank's file stays as it was."""
        if not self.done:
            self.done = True
            _everywhere(self.engine.runner, _discard, self.path)


def begin_prefix_save(engine, path: str | os.PathLike) -> PrefixSave | None:
    """Begin a save of ``engine``'s prefix cache to ``path`` (the module docstring): between two
    steps, copy the blocks the file does not hold yet and start a thread writing the new file;
    ``None`` when nothing is cached (the files are left as they are). The same refusals as
    :func:`save_prefix_cache`, before anything is copied."""
    runner, bm = _runner_of(engine), engine.block_manager
    engine_fp = _engine_fingerprint(engine)
    _everywhere(runner, _check_path, str(path), engine_fp)
    if not bm.num_cached_blocks and not bm.host_figures()["host_cached_blocks"]:
        return None
    t0 = time.perf_counter()
    copies = bm.take_copies()
    entries = bm.cached_entries()
    budget = int(CAPTURE_SHARE * (free_bytes(torch.device("cpu")) or 0))
    try:
        begun = _everywhere(runner, _begin, str(path), engine_fp, copies, entries, budget)
    except BaseException:
        with contextlib.suppress(Exception):
            _everywhere(runner, _discard, str(path))
        raise
    if any(b is None for b in begun):  # too much to hold: written now, the engine waiting
        _everywhere(runner, _discard, str(path))
        _run(runner, path, lambda: _everywhere(runner, _write, str(path), engine_fp, [], entries))
        return PrefixSave(engine, str(path), len(entries), len(entries), 0, time.perf_counter() - t0,
                          waited=True, done=True)
    new, copied = max(b[0] for b in begun), max(b[1] for b in begun)
    return PrefixSave(engine, str(path), len(entries), new, copied, time.perf_counter() - t0)


def _begin(runner, rank: int, world: int, path: str, engine_fp: dict, copies, entries, budget: int):
    """This rank's blocks new to its file copied to host memory and a thread writing the file;
    ``(blocks copied, bytes)``, or ``None`` (nothing begun) when they would take over ``budget`` bytes."""
    pool = _ready(runner, copies)
    target = check_save_path(rank_path(path, rank), PREFIX_FORMAT)
    disk = _ON_DISK.get(runner, {}).get(os.path.realpath(target))
    if disk is not None and _ident(target) != disk.ident:
        disk = None  # (changed since this process wrote or read it)
    rows = np.array([-1 if disk is None else disk.rows.get(h, -1) for h, _, _ in entries], dtype=np.int64)
    new = [entries[i] for i in np.flatnonzero(rows < 0)]
    row_bytes = [t[0].numel() * t.element_size() for t in pool]
    if len(new) * sum(row_bytes) > budget:
        return None
    copied = _copy(runner, pool, [(w, i) for _, w, i in new], row_bytes)
    head, offsets = _header(runner, rank, world, engine_fp, pool, len(entries))
    job = (target, head, _hash_rows(entries), rows, copied, disk, row_bytes)
    future = _writer().submit(_write_in_thread, *job)
    _WRITING[runner] = _Written(target, [h for h, _, _ in entries], offsets, future)
    return len(new), sum(c.nbytes for c in copied)


def _copy(runner, pool: list[torch.Tensor], places: list, row_bytes: list[int]) -> list[np.ndarray]:
    """The blocks at ``places`` (``("pool" | "host", index)``) of every pool tensor, copied to host
    memory as rows of bytes, :data:`CHUNK` blocks at a time."""
    chunks, out = _chunks(places, runner.device), []
    for j, t in enumerate(pool):
        host = runner.host.slots[j] if runner.host is not None else None
        rows = np.empty((len(places), row_bytes[j]), dtype=np.uint8)
        for chunk in chunks:
            rows[chunk[0] : chunk[0] + chunk[1]] = _bytes(_gather(chunk, t, host)).reshape(chunk[1], -1)
        out.append(rows)
    return out


def _write_in_thread(target: Path, head: bytes, hashes: np.ndarray, rows: np.ndarray, copied: list[np.ndarray],
                     disk: _OnDisk | None, row_bytes: list[int]) -> list[int]:
    """The writer thread's part of :func:`_begin`: rows ``>= 0`` from the file on disk (each of its
    tensors checked first), the others from ``copied`` in order; the pool tensors' CRC-32s."""
    from_file = rows >= 0
    take = np.cumsum(~from_file) - 1  # row i's index in copied, where it is no file row
    with save_lock(target):
        old = _old_tensors(target, disk, row_bytes) if from_file.any() else None

        def pieces(j: int):
            for a in range(0, len(rows), CHUNK):
                f, r, k = from_file[a : a + CHUNK], rows[a : a + CHUNK], take[a : a + CHUNK]
                out = np.empty((len(f), row_bytes[j]), dtype=np.uint8)
                if old is not None:
                    out[f] = old[j][r[f]]
                out[~f] = copied[j][k[~f]]
                yield out

        return _write_file(target, head, hashes, len(row_bytes), pieces)


def _old_tensors(target: Path, disk: _OnDisk, row_bytes: list[int]) -> list[np.ndarray]:
    """Each pool tensor of the file on disk as rows of bytes, once it is the file this process
    knows and every tensor passes its CRC-32; a ``ValueError`` otherwise."""
    if _ident(target) != disk.ident:
        raise ValueError(f"{target} changed since this server last wrote or read it; the next save "
                         "writes every block anew")
    mm = np.memmap(target, dtype=np.uint8, mode="r")
    n, out = len(disk.rows), []
    for off, rb, crc in zip(disk.offsets, row_bytes, disk.crcs):
        view = mm[off : off + n * rb]
        got = 0
        for a in range(0, view.size, _CHECK_BYTES):
            got = zlib.crc32(view[a : a + _CHECK_BYTES], got)
        if view.size != n * rb or got != crc:
            raise ValueError(f"{target} fails its checksum since this server last wrote or read it; the "
                             "next save writes every block anew")
        out.append(view.reshape(n, rb))
    return out


def _poll(runner, rank: int, world: int, path: str) -> bool:
    """Whether this rank's file is written; its writing's error, if it failed (the file on disk
    then no longer read from: the next save copies every block)."""
    written = _WRITING.get(runner)
    if written is None:
        raise ValueError(f"no save of {rank_path(path, rank)} was begun")
    if not written.future.done():
        return False
    if written.future.exception() is not None:
        _forget(runner, written.target)
        raise written.future.exception()
    return True
