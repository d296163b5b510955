"""The POSIX side of a save, below the commit protocol (distckpt.coordinator): what a rank writes
and what rank 0 prepares and reclaims in a local directory.

* :func:`prepare_save_dir` (PREPARE, rank 0): reclaim dead leftovers of the name, take the save
  lock, refuse a committed or foreign target, check the space, create ``.NAME.tmp-<save id>``.
* :func:`write_rank_file` (WRITE, every rank): one rank's data file, chunks at aligned offsets
  with their block crc32c, the index last (format 3), durable when it returns.
* :func:`reclaim_tmp_dirs` / :func:`is_committed`: leftovers of dead saves, and what counts as
  committed.

:class:`distckpt.storage.posix.store.PosixStore` calls these; nothing here calls back up into the
coordinator (the save's collectives live there, the file system's work here).
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
from typing import Any

import crc32c

from ... import manifest as mf
from ...config import get_config
from ...devstage import DeviceStager, needs_staging
from ...errors import CheckpointExistsError, from_os_error
from ...leftovers import ROOT_LOCK_NAME, TMP_RE, lock_file, scan_leftovers
from ...plan import assign_offsets
from ...staging import host_bytes
from . import commit as local
from . import savelock
from .guards import check_save_space, refuse_pseudo_fs
from .probe import choose_backend
from .writer import open_writer

__all__ = ["prepare_save_dir", "write_rank_file", "reclaim_tmp_dirs", "is_committed"]

log = logging.getLogger("distckpt")

MANIFEST = mf.MANIFEST_NAME


def is_committed(path: str) -> bool:
    """True when ``path`` is a committed checkpoint directory (it has its MANIFEST and is not a
    hidden tmp/del directory)."""
    return (not TMP_RE.match(os.path.basename(os.path.normpath(path)))
            and os.path.isfile(os.path.join(path, MANIFEST)))


def reclaim_tmp_dirs(parent: str, name: str | None = None, *, other_hosts: bool = False) -> list[str]:
    """Delete the leftovers of *dead* saves and deletions in ``parent`` (``.NAME.tmp-*`` /
    ``.NAME.del-*`` and stale ``.NAME.lock`` files; all names when ``name`` is None). A leftover
    whose save is alive (its lock is held, by any process) is never touched; one whose liveness
    cannot be decided (another host's, see :mod:`distckpt.storage.posix.savelock`) is left alone and
    logged as a warning unless ``other_hosts``. Committed directories are never touched.
    Returns the entries removed."""
    removed, kept = [], []
    leftovers = scan_leftovers(parent, other_hosts=other_hosts)
    with_dirs = {lo.name for lo in leftovers if lo.kind != "lock"}
    for lo in leftovers:
        if name is not None and lo.name not in (name, ""):
            continue
        if lo.state != "dead":
            kept.append(lo)
            continue
        if lo.kind == "lock":
            # Only a lock of ours (an owner record; or an empty one, of a save that died while
            # starting, beside its leftovers or at the root lock's name) whose record is unchanged
            # since the probe, under an exclusive lock.
            save_id = lo.owner.get("save_id") if lo.owner else None
            ours = save_id is not None or (lo.owner is None and (lo.entry == ROOT_LOCK_NAME or lo.name in with_dirs))
            if ours and savelock.remove_if_dead(lo.path, save_id):
                removed.append(lo.entry)
        else:
            local.delete_tree(lo.path)
            removed.append(lo.entry)
    if removed:
        log.info("distckpt: reclaimed %d leftovers of dead saves in %s: %s", len(removed), parent, removed)
    unknown = [lo for lo in kept if lo.state == "unknown"]
    if unknown:
        log.warning("distckpt: left %d leftovers in %s alone: their save's liveness cannot be decided from "
                    "host %s (owners: %s). If those saves are dead, remove them with "
                    "CheckpointManager(ROOT).reclaim(other_hosts=True) or by hand.", len(unknown), parent,
                    socket.gethostname(), sorted({f"{(lo.owner or {}).get('host', '?')}:{(lo.owner or {}).get('pid', '?')}"
                                                   for lo in unknown}))
    return removed


# PREPARE (rank 0)


def prepare_save_dir(final_dir: str, save_id: str, overwrite: bool, needed: int, rank: int,
             lock_path: str | None = None) -> tuple[str, Any]:
    """Reclaim dead leftovers of this name, take the save lock, check the target and the space,
    create the tmp dir. Returns (tmp dir, the held lock); on error the lock is released."""
    parent, name = os.path.split(os.path.abspath(final_dir))
    refuse_pseudo_fs(parent, rank=rank)
    local.make_dirs_durable(parent)
    # Reclaim before locking: while we hold our own lock every leftover of the name looks alive.
    reclaim_tmp_dirs(parent, name)
    lock = savelock.acquire(lock_path or lock_file(parent, name), save_id=save_id, what=final_dir)
    try:
        return _prepare_locked(final_dir, parent, name, save_id, overwrite, needed, rank), lock
    except BaseException:
        lock.release()
        raise


def _prepare_locked(final_dir: str, parent: str, name: str, save_id: str, overwrite: bool, needed: int,
                    rank: int) -> str:
    if os.path.lexists(final_dir):
        if not is_committed(final_dir):
            try:
                empty = os.path.isdir(final_dir) and not os.listdir(final_dir)
                if empty:
                    os.rmdir(final_dir)  # an empty directory the user made for us
            except OSError as exc:
                raise from_os_error(exc, path=final_dir, operation="replace empty directory") from exc
            if not empty:
                raise CheckpointExistsError(
                    f"{final_dir} exists and is not a distckpt checkpoint (no MANIFEST); refusing to replace it",
                    path=final_dir, rank=rank, remedy="Choose another path or remove it yourself.")
        elif not overwrite:
            raise CheckpointExistsError(f"a committed checkpoint already exists at {final_dir}",
                                        path=final_dir, rank=rank)
    if get_config().preflight:
        check_save_space(parent, needed, rank=rank)
    tmp_dir = os.path.join(parent, f".{name}.tmp-{save_id}")
    local.make_dir(tmp_dir)
    return tmp_dir


# WRITE (every rank)


def _nbytes(t) -> int:
    return t.numel() * t.element_size()


def write_rank_file(path: str, rank: int, pieces: list[tuple[str, Any]], checksum_block: int):
    """Write this rank's owned pieces into one data file, its index (the pieces' chunk records,
    format version 3) at the end. Returns ((index offset, length, crc32c), size, backend choice);
    the file is durable when this returns."""
    choice = choose_backend(os.path.dirname(path))
    records: list[tuple[str, mf.ChunkRecord]] = []
    align = choice.alignment
    # The final size is known from the plan: one fallocate up front (ext4 serializes O_DIRECT
    # writes that extend a file) and an immediate DiskFullError if it cannot fit.
    _, size_hint = assign_offsets([_nbytes(p.tensor) for _, p in pieces], alignment=align)
    size_hint += align * len(pieces)  # pad_for may place a chunk up to align - 1 bytes later
    # ... and the index after the chunks: an upper bound of its msgpack bytes per record (array,
    # fqn, offsets and sizes of at most 9 B per int, offset, nbytes, crcs bin), not a second encode:
    # fallocate only needs room, close() truncates to what was written.
    size_hint += align + len(mf.INDEX_MAGIC) + 5 + sum(
        40 + len(fqn.encode()) + 18 * len(p.sizes) + 4 * -(-_nbytes(p.tensor) // checksum_block) for fqn, p in pieces)
    tensors = [p.tensor for _, p in pieces]
    # Pieces on a GPU stream through pinned slots, copied while earlier pieces are being written.
    stager = (DeviceStager(tensors, block=checksum_block, staging_bytes=get_config().device_staging)
              if any(needs_staging(t) for t in tensors) else contextlib.nullcontext())
    with stager, open_writer(path, choice=choice, durable=True, size_hint=size_hint or None) as w:
        for i, (fqn, piece) in enumerate(pieces):
            if needs_staging(piece.tensor):
                offset = w.pad_to(align)
                crcs, nbytes = [], 0
                for view in stager.parts(i):  # parts cut at checksum-block multiples
                    crcs.extend(w.write_checksummed(view, checksum_block))
                    nbytes += len(view)
                crcs = tuple(crcs)
            else:
                view, keep = host_bytes(piece.tensor)
                offset = w.pad_for(view, align)  # aligned, or placed so that the chunk goes zero-copy
                # One write per chunk: a page-aligned source (large CPU tensors) goes to the disk
                # straight from its memory (zero-copy); anything else through the aligned staging
                # ring. The block checksums are computed in the same pass, while the writes are
                # in flight.
                crcs, nbytes = w.write_checksummed(view, checksum_block), len(view)
                del keep  # write() returns once the bytes are copied or written
            records.append((fqn, mf.ChunkRecord(offsets=tuple(piece.offsets), sizes=tuple(piece.sizes),
                                                file=rank, offset=offset, nbytes=nbytes, crcs=crcs)))
        # The index goes last, once every crc is known; close() makes it durable with the rest.
        index = mf.encode_index(records)
        index_offset = w.pad_to(align)
        w.write(index)
        size = w.close()
    return (index_offset, len(index), crc32c.crc32c(index)), size, choice
