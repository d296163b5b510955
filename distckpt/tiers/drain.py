"""The drain: a step committed on the local tier, copied to the remote tier byte for byte and
committed there with the remote store's own protocol (docs/TIERS.md).

:func:`drain_step` is collective over the control group it is given (the manager's own channel,
"drain", so that it never interleaves with the training thread's collectives):

  1. HOLDINGS  every rank reads its node's local copy: the MANIFEST's save id and the data files of
               the MANIFEST that are there with the MANIFEST's size (all-gathered: a few ints per
               rank). Rank 0 decides: the remote step committed with the same save id -> nothing
               to do (``already_remote``); with another -> CheckpointExistsError; a data file
               that no rank holds, or nodes that hold different saves -> TierIncompleteError.
               Each data file goes to one rank that holds it: its writer rank when that rank
               holds it (each rank sends its own file, in parallel), else the least-loaded holder.
  2. PREPARE   rank 0: ``remote_store.prepare`` with the LOCAL save id (the remote MANIFEST is
               the local one verbatim, so its data must live under that id), taking the lease or
               lock; the plan is broadcast.
  3. COPY      each rank streams its files: bounded reads of the local file, every chunk's block
               crc32c (from the file's index) and the index's own crc32c (from the MANIFEST's
               ``files[i].index``) checked as the bytes pass, each piece handed to
               ``Store.copy_data_file`` (a multipart upload). A mismatch is a
               ChecksumMismatchError naming the local file; the upload is aborted.
  4. COMMIT    gathered to rank 0: when every copy succeeded, the local MANIFEST's bytes are
               published verbatim (``Store.publish``, MANIFEST last, conditional create), then
               ``after_commit`` runs; otherwise the area is aborted and nothing is visible.
  5. VERDICT   broadcast: every rank returns the same DrainResult or raises the same typed error
               (:func:`distckpt.errors.collective_error`), as a save does.

The area's save id is the local save's, not a fresh one, so a drain retried after a failed one
writes into the same prefix (on an object store ``STEP/<save id>/``) as the failed one, and the
prefix of a committed step is the committed data itself: an area is given up only when the remote
MANIFEST does not name its save id, and then only as a retry may write it again (:func:`_abort_area`). Two drains of one step at once must use
the same ``lock_path`` (the manager passes its remote root's lock), so that the lease keeps one of
them out.

Memory, per rank: one read piece (:data:`distckpt.tiers.verified.READ_PIECE`, 8 MiB, or the file's size if smaller) and
one upload's part buffers (at most ``DISTCKPT_OBJECT_PARTS_IN_FLIGHT + 1`` parts of
``DISTCKPT_OBJECT_PART_SIZE``, plus a copy of the last partial part: with the defaults 4 + 1 + 1
parts of 16 MiB, about 104 MiB in all), whatever the size of the step; a rank copies its files
one after another. Plus the local MANIFEST and one file's chunk records (its index) at a time. I/O:
each byte of a copied file is read once (through the local store's readers: O_DIRECT where the
file system allows it, so a drain does not fill the page cache of a training node) and sent once.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any, Callable

from .. import manifest as mf
from .._dist import ControlGroup, _portable
from ..checksum import crc32c
from ..commit import _lost_at_verdict
from ..errors import (CheckpointExistsError, CheckpointIncompleteError, CheckpointNotFoundError, DistCkptError,
                      ManifestCorruptError, PeerLostError, TierIncompleteError, fill_rank)
from ..storage import Store, basename, join, normalize_path, open_store
from .verified import stream_verified

__all__ = ["DrainResult", "drain_step"]

log = logging.getLogger("distckpt")



@dataclasses.dataclass(frozen=True)
class DrainResult:
    """What :func:`drain_step` did, the same on every rank but ``bytes_uploaded`` and ``seconds``.

    Attributes:
        step_path_remote: The remote step's path (its URL).
        save_id: The save now committed there (the local MANIFEST's).
        bytes_uploaded: Bytes of data files this rank sent (0 when ``already_remote``).
        seconds: Wall time of the drain on this rank.
        already_remote: The remote tier already held this save of the step: nothing was sent,
            nothing published, ``after_commit`` not run.
    """

    step_path_remote: str
    save_id: str
    bytes_uploaded: int
    seconds: float
    already_remote: bool


# ---------------------------------------------------------------------------------------------
# The messages between ranks (pickled by the gloo object collectives, as in distckpt.commit)


@dataclasses.dataclass(frozen=True, slots=True)
class _Holding:
    """One rank's report of its node's local copy: the save id of its MANIFEST (None when there is
    no committed copy), the crc32c of the MANIFEST's bytes (nodes must hold the same bytes), the
    indexes of the data files present with the MANIFEST's size, descriptions of files present with
    another size; or ``error`` (the local copy could not be read)."""

    save_id: str | None
    manifest_crc: int | None
    held: tuple[int, ...]
    wrong: tuple[str, ...]
    error: BaseException | None = None


@dataclasses.dataclass(frozen=True, slots=True)
class _Plan:
    """Rank 0's decision: ``failures`` (every rank's HOLDINGS error, when any rank failed), or
    ``error``, or ``already_remote``, or the save id, the remote area and the files each rank
    copies (``assigned[r]``: indexes into the MANIFEST's files)."""

    failures: list | None = None
    error: BaseException | None = None
    already_remote: bool = False
    save_id: str | None = None
    area: str | None = None
    assigned: tuple[tuple[int, ...], ...] | None = None


@dataclasses.dataclass(frozen=True, slots=True)
class _Copied:
    """One rank's COPY report: bytes sent, or its error."""

    nbytes: int
    error: BaseException | None = None


@dataclasses.dataclass(frozen=True, slots=True)
class _Verdict:
    """COMMIT's broadcast: every rank's COPY error when any failed, else the COMMIT's error, else
    success."""

    failures: list | None
    error: BaseException | None


# ---------------------------------------------------------------------------------------------
# The local copy


@dataclasses.dataclass(frozen=True)
class _LocalStep:
    """This rank's node-local committed step: its MANIFEST's bytes and header."""

    manifest: bytes
    header: mf.Manifest


def _read_local(store: Store, path: str) -> _LocalStep | None:
    """The committed step at ``path``, or None when there is none (nothing there, or never
    committed: another node may hold what is needed). Raises ManifestCorruptError and the
    store's other typed errors for a copy that is there but unreadable."""
    try:
        data = store.manifest_bytes(path)
    except (CheckpointNotFoundError, CheckpointIncompleteError):
        return None
    return _LocalStep(data, mf.decode_header(data, path=join(path, mf.MANIFEST_NAME)))


def _holding(store: Store, path: str, local: _LocalStep | None) -> _Holding:
    """This rank's HOLDINGS report (one stat per data file of the MANIFEST)."""
    if local is None:
        return _Holding(None, None, (), ())
    held, wrong = [], []
    for i, entry in enumerate(local.header.files):
        _, size, problem = store.data_file_stat(path, local.header, i)
        if problem is None and size == entry.size:
            held.append(i)
        elif size is not None:
            wrong.append(f"{entry.name} ({size} bytes, the MANIFEST says {entry.size})")
        elif not problem.startswith("missing"):
            # A missing file is the rule for other nodes' files; anything else (a symlink, a
            # directory) is worth naming if no node turns out to hold the file.
            wrong.append(f"{entry.name} ({problem})")
    return _Holding(local.header.save_id, crc32c(local.manifest), tuple(held), tuple(wrong))


# ---------------------------------------------------------------------------------------------
# The drain


def drain_step(group: ControlGroup, *, local_path: str, remote_path: str, remote_store: Store | None = None,
               lock_path: str | None = None, after_commit: Callable[[], None] | None = None,
               progress: Callable[[int], None] | None = None,
               storage_options: dict | None = None,
               on_assigned: Callable[[int], None] | None = None,
               hold: Callable[[str], None] | None = None) -> DrainResult:
    """Copy the step committed at ``local_path`` (this rank's node-local step directory) to
    ``remote_path`` and commit it there; collective over ``group`` (see the module docstring).

    ``remote_store``: the remote tier's Store (default ``open_store(remote_path,
    storage_options)``). ``lock_path``: the lease or lock the drain holds from PREPARE to its end
    (default one beside the remote step). ``after_commit``: run by rank 0 once the remote MANIFEST
    is published (the manager's remote ``latest`` and rotation); not run when the step was already
    remote. ``progress(n)``: called on this rank with each ``n`` bytes handed to the upload (an
    increment; the upload holds at most its part buffers before they are sent).
    ``on_assigned(total)``: called on this rank once the files it copies are known, with their bytes.
    ``hold(operation)``: called by rank 0 before the drain prepares and before it publishes; what
    it raises stops the drain there (the tiered manager's proof that it owns the remote root).

    Returns the same DrainResult on every rank (``bytes_uploaded`` and ``seconds`` are this rank's).

    Raises, the same on every rank (a failure on some ranks is
    :func:`distckpt.errors.collective_error` of theirs): nothing is committed remotely unless the
    error says ``committed = True`` (``after_commit`` failed after the publish) or it is a
    CommittedButPeerLostError.
        CheckpointNotFoundError: no rank found a committed local step.
        TierIncompleteError: a data file of the MANIFEST is on no node (``files``), or the nodes
            hold different saves of the step.
        CheckpointExistsError: the remote step is committed with another save id.
        SaveInProgressError: another save or drain holds the remote lease or lock, or ``hold`` refused.
        ChecksumMismatchError: a local file's block or index differs from its checksum.
        ManifestCorruptError: a local MANIFEST or index does not decode, or the nodes' MANIFEST
            bytes differ.
        DataFileMissingError, DataFileTruncatedError, CheckpointRemovedError: a local file went
            away or changed while it was read.
        StorageError subclasses and the object-store request errors (EndpointUnreachableError
            within the request deadlines, QuotaExceededError, ...); PeerLostError.
    """
    t0 = time.monotonic()
    local_path, remote_path = normalize_path(local_path), normalize_path(remote_path)
    local_store = open_store(local_path)
    if remote_store is None:
        remote_store = open_store(remote_path, storage_options)
    held: list = []  # rank 0's remote lease or lock, released on every path
    try:
        return _drain(group, local_store, local_path, remote_store, remote_path, lock_path, after_commit, progress,
                      held, t0, on_assigned, hold)
    finally:
        for lock in held:
            lock.release()


def _drain(group: ControlGroup, local_store: Store, local_path: str, remote_store: Store, remote_path: str,
           lock_path: str | None, after_commit: Callable[[], None] | None, progress: Callable[[int], None] | None,
           held: list, t0: float, on_assigned: Callable[[int], None] | None = None,
           hold: Callable[[str], None] | None = None) -> DrainResult:
    """The body of :func:`drain_step` (same promises and errors); the lock rank 0 takes goes into
    ``held``, which the caller releases."""
    rank, world = group.rank, group.world_size

    # 1. HOLDINGS
    local = None
    try:
        local = _read_local(local_store, local_path)
        report = _holding(local_store, local_path, local)
    except Exception as exc:
        report = _Holding(None, None, (), (), exc if world == 1 else _portable(exc))
    reports = group.all_gather(report)
    # Rank 0 decides with the MANIFEST; when its node has none, the lowest rank that has one sends
    # it (every rank computes the same source from the reports, so every rank joins the gather).
    source = _manifest_source(reports)
    manifest = local.manifest if local is not None else None
    if source not in (None, 0):
        got = group.gather(manifest if rank == source else None)
        if rank == 0:
            manifest = got[source]

    # 2. PREPARE (rank 0)
    plan = None
    if rank == 0:
        try:
            if hold is not None:
                hold("prepare a drain")
            plan = _plan(reports, manifest, local_path, remote_store, remote_path, lock_path, world, held)
        except Exception as exc:
            plan = _Plan(error=exc if world == 1 else _portable(exc))
    plan = group.broadcast(plan)
    if plan.failures is not None:
        group.raise_failures(plan.failures, report.error, operation="drain")
    if plan.error is not None:
        raise fill_rank(plan.error, 0)
    if plan.already_remote:
        return DrainResult(remote_path, plan.save_id, 0, time.monotonic() - t0, True)

    # 3. COPY (every rank its assigned files)
    sent, error = 0, None
    try:
        if on_assigned is not None:
            on_assigned(sum(local.header.files[i].size for i in plan.assigned[rank]) if local is not None else 0)
        if plan.assigned[rank]:
            with local_store.guard_reads(local_path):
                for i in plan.assigned[rank]:
                    sent += _copy_file(local_store, local_path, local.header, i, remote_store, plan.area, progress)
    except Exception as exc:
        error = exc
    outcomes = group.gather(_Copied(sent, error if error is None or world == 1 else _portable(error)))

    # 4. COMMIT (rank 0)
    failures, commit_error, committed = None, None, False
    if rank == 0:
        n_files = len(mf.decode_header(manifest).files)
        if any(o.error is not None for o in outcomes):
            failures = [o.error for o in outcomes]
            _abort_area(remote_store, plan.area, remote_path, plan.save_id, n_files)
        else:
            try:
                if hold is not None:
                    hold("publish a drain")
                remote_store.publish(plan.area, remote_path, manifest, False)  # the commit point
                committed = True
                if after_commit is not None:
                    after_commit()
            except Exception as exc:
                commit_error = exc if world == 1 else _portable(exc)
                if committed:  # after_commit failed: the remote step is committed all the same
                    commit_error.committed = True
                elif getattr(exc, "published", False):
                    committed = True
                elif not getattr(exc, "data_kept", False):  # the store says when a MANIFEST may still land
                    _abort_area(remote_store, plan.area, remote_path, plan.save_id, n_files)

    # 5. VERDICT
    try:
        told = group.broadcast(_Verdict(failures, commit_error))
    except PeerLostError as lost:
        if error is not None:  # this rank's own copy failed: nothing can have been committed
            lost.committed = False
            raise lost from error
        raise _lost_at_verdict(lost, rank, world, remote_path, plan.area, committed, commit_error,
                               remote_store) from lost
    if told.failures is not None:
        group.raise_failures(told.failures, error, operation="drain")
    if told.error is not None:
        raise fill_rank(told.error, 0)
    return DrainResult(remote_path, plan.save_id, sent, time.monotonic() - t0, False)


def _manifest_source(reports: list[_Holding]) -> int | None:
    """The rank whose MANIFEST rank 0 decides with: 0 when rank 0's node has the step, else the
    lowest rank that has it; None when no decision needs one (an error, no copy, or conflicting
    saves: rank 0 raises without it)."""
    if any(r.error is not None for r in reports) or len({r.save_id for r in reports} - {None}) != 1:
        return None
    return min(i for i, r in enumerate(reports) if r.save_id is not None)


def _plan(reports: list[_Holding], manifest: bytes | None, local_path: str, remote_store: Store, remote_path: str,
          lock_path: str | None, world: int, held: list) -> _Plan:
    """Rank 0's decision and PREPARE (the lock goes into ``held``). Raises the typed errors of
    :func:`drain_step`'s first two phases."""
    if any(r.error is not None for r in reports):
        return _Plan(failures=[r.error for r in reports])
    ids = sorted({r.save_id for r in reports} - {None})
    if not ids:
        raise CheckpointNotFoundError(f"no rank found a committed step at its local path (rank 0's: {local_path}): "
                                      f"nothing to drain", path=local_path)
    if len(ids) > 1:
        by_id = {i: [r for r, rep in enumerate(reports) if rep.save_id == i] for i in ids}
        raise TierIncompleteError(
            f"the nodes' local copies of {local_path} come from different saves ({by_id}: ranks holding each): "
            f"no one save is complete on the local tier; nothing was drained", path=local_path,
            step=basename(local_path), files=[], tiers={"local": {i: f"ranks {r}" for i, r in by_id.items()}},
            remedy=_INCOMPLETE_REMEDY)
    save_id = ids[0]
    if len({r.manifest_crc for r in reports if r.save_id is not None}) > 1:
        raise ManifestCorruptError(f"the nodes hold different MANIFEST bytes for save {save_id} of {local_path}: "
                                   f"a node's copy is damaged", path=join(local_path, mf.MANIFEST_NAME))
    header = mf.decode_header(manifest, path=join(local_path, mf.MANIFEST_NAME))
    there = remote_store.committed_save_id(remote_path)
    if there == save_id:
        return _Plan(already_remote=True, save_id=save_id)
    if there is not None:
        raise _exists(remote_path, there, save_id)
    assigned = _assign(header, reports, world, local_path)
    needed = sum(f.size for f in header.files) + len(manifest)
    try:
        area, lock = remote_store.prepare(remote_path, save_id, False, needed, 0, lock_path)
    except CheckpointExistsError:
        # Another drain may have committed this very save meanwhile (it took the lease first).
        if remote_store.committed_save_id(remote_path) == save_id:
            return _Plan(already_remote=True, save_id=save_id)
        raise
    held.append(lock)
    return _Plan(save_id=save_id, area=area, assigned=assigned)


_INCOMPLETE_REMEDY = ("The local tier lost part of this step (a node wiped or replaced, a file deleted): it cannot be "
                      "drained; the step is durable only if another copy holds it. Save a new step.")


def _exists(remote_path: str, there: str, save_id: str) -> CheckpointExistsError:
    return CheckpointExistsError(
        f"the remote tier already holds another save of this step ({remote_path}: save {there}; the local copy "
        f"is save {save_id}): not replaced", path=remote_path,
        remedy="The step was saved again after it drained, or another job writes the same remote root: give each "
               "job its own root; to replace the remote step, remove it first (nothing was sent).")


def _assign(header: mf.Manifest, reports: list[_Holding], world: int, local_path: str) -> tuple[tuple[int, ...], ...]:
    """Each data file of ``header`` to one rank that holds it: its writer rank when that rank holds
    it, else the holder with the fewest bytes assigned so far (largest files first). Returns the
    file indexes of every rank.

    Raises:
        TierIncompleteError: files that no rank holds (``files``), with the sizes found of those
            present with another size.
    """
    holders: dict[int, list[int]] = {}
    for r, rep in enumerate(reports):
        for i in rep.held:
            holders.setdefault(i, []).append(r)
    owner: dict[int, int] = {}
    load = [0] * world
    for i, f in enumerate(header.files):
        if f.rank in holders.get(i, ()):
            owner[i] = f.rank
            load[f.rank] += f.size
    missing = []
    for i in sorted(range(len(header.files)), key=lambda i: -header.files[i].size):
        if i in owner:
            continue
        if not holders.get(i):
            missing.append(header.files[i].name)
            continue
        r = min(holders[i], key=lambda r: (load[r], r))
        owner[i] = r
        load[r] += header.files[i].size
    if missing:
        wrong = sorted({w for rep in reports for w in rep.wrong})
        also = f"; present with another size or kind: {', '.join(wrong)}" if wrong else ""
        n = len(header.files)
        raise TierIncompleteError(
            f"{len(missing)} data file(s) of step {local_path} (save {header.save_id}) are on no node of the local "
            f"tier: {', '.join(sorted(missing))}{also}; nothing was drained", path=local_path,
            step=basename(local_path), files=sorted(missing),
            tiers={"local": f"save {header.save_id}: {n - len(missing)} of {n} data files"}, remedy=_INCOMPLETE_REMEDY)
    return tuple(tuple(sorted(i for i, r in owner.items() if r == rank)) for rank in range(world))


def _abort_area(store: Store, area: str, remote_path: str, save_id: str, n_files: int) -> None:
    """Give up on the remote area of a failed drain (``Store.abort_for_retry``: the next try
    writes the same area, since a drain's area reuses the local save id; on an object store the
    completed objects stay for it), unless the remote MANIFEST names its save id: then the area
    is that committed step's data. A failure is logged: a reclaim removes a dead area."""
    try:
        if store.committed_save_id(remote_path) == save_id:
            return
        store.abort_for_retry(area, n_files)
    except DistCkptError as exc:
        log.warning("distckpt: could not remove %s after a failed drain: %s", area, exc)


# ---------------------------------------------------------------------------------------------
# One data file, verified while it streams


def _copy_file(local_store: Store, local_path: str, header: mf.Manifest, i: int, remote_store: Store, area: str,
               progress: Callable[[int], None] | None) -> int:
    """Stream data file ``i`` of the local step into the remote area, checking every checksummed
    range as it passes (distckpt.tiers.verified); returns its size. Nothing of it stays remotely
    on error.

    Raises:
        ChecksumMismatchError: a chunk's block or the index differs from its crc32c.
        ManifestCorruptError: the index does not decode or places chunks outside the file.
        DataFileMissingError, DataFileTruncatedError, CheckpointCorruptError: the local file is
            gone or has another size; the local and remote stores' typed errors.
    """
    entry = header.files[i]

    def feed(sink: Any) -> None:
        def consume(_pos: int, piece: memoryview) -> None:
            sink.write(piece)  # copied into the upload's part buffer: the piece is free again
            if progress is not None:
                progress(len(piece))

        stream_verified(local_store, local_path, header, i, consume)

    return remote_store.copy_data_file(area, _file_rank(entry.name), entry.size, feed)


def _file_rank(name: str) -> int:
    """The number in a data file's name (``rank00003.bin`` -> 3): the seam names files by it."""
    return int(name[len("rank"):-len(".bin")])


