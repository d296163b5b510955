"""PREPARE, WRITE and COMMIT, phases 2-4 of a save (:mod:`distckpt.coordinator` gives the call
order), and the verdict every rank returns or raises. The one place where a checkpoint becomes
visible. Storage is reached only through the :class:`distckpt.storage.Store` seam.

  2. PREPARE   rank 0 (``Store.prepare``) reclaims the leftovers of earlier dead saves of the same
               name, takes the save lock or lease (SaveInProgressError when another live save holds
               it), refuses an existing committed checkpoint unless overwrite, checks free space for
               the bytes all ranks will write, creates the save area (POSIX: ``.NAME.tmp-SAVEID/``);
               G.broadcast of :class:`Prepared` (the area or the error).
  3. WRITE     each rank writes its data file into the area (``Store.write_rank``): chunks at aligned
               offsets, crc32c per checksum block, then the file's index (its chunk records, format
               version 3), durable on return. G.gather to rank 0 of :class:`WriteOutcome` (index
               reference, size, I/O back end) or the error.
  4. COMMIT    rank 0, only if every rank succeeded: encodes MANIFEST (msgpack; magic, version,
               crc) and publishes it (``Store.publish``: POSIX writes and fsyncs it inside the area,
               fsyncs the area, renames it to NAME (RENAME_EXCHANGE when overwriting), fsyncs the
               parent), discards a replaced old checkpoint, runs ``after_commit`` (the manager's
               ``latest`` + rotation). On any failure rank 0 aborts the area and nothing is
               committed. G.broadcast of the :class:`Verdict` (every rank's WRITE error, or the
               COMMIT error, or the data file sizes); every rank returns or raises the same typed
               error, only after that point.
               The publish is the commit point: an error after it (``after_commit``'s, or a peer
               lost during the verdict broadcast) says so: ``committed = True`` on the error, and
               a lost peer is a CommittedButPeerLostError (a PeerLostError) naming the path.

Invariants held (docs/DESIGN.md): I1 a checkpoint is loadable only once published, after every byte
it names is durable; I2 nothing outside the save area is touched before the commit, and an old
checkpoint is replaced only atomically; I3 every data file and MANIFEST is durable before the
publish; I4 every failure is typed and reaches every rank through the gather/broadcast of each
phase; I5 writers close their fds on every path; I6 leftovers of crashed saves are reclaimed at the
next save of the same name, and only of dead saves: rank 0 holds the save lock or lease from
PREPARE until its area is gone or published (:mod:`distckpt.storage.posix.savelock`).
"""

from __future__ import annotations

import contextvars
import dataclasses
import logging
import os
import time
import uuid
from typing import Callable

from . import commitclock
from . import manifest as mf
from ._dist import ControlGroup, _portable
from .errors import CommittedButPeerLostError, ConfigError, DistCkptError, PeerLostError, fill_rank
from .saveplan import GlobalPlan, PlannedSave
from .storage import Store, dirname, is_url, open_store

__all__ = ["SaveResult", "finish_save", "discard_replaced", "Prepared", "WriteOutcome", "Verdict", "WrittenSave",
           "write_uncommitted"]

log = logging.getLogger("distckpt")


@dataclasses.dataclass(frozen=True)
class SaveResult:
    """What a save did. ``bytes_per_rank[r]`` is the size of rank r's data file."""

    path: str
    world_size: int
    rank: int
    bytes_per_rank: list[int]
    total_bytes: int
    seconds: float
    backend: str
    backend_reason: str
    save_id: str
    plan_cached: bool = False   # PLAN reused the previous save's plan (same layout on every rank)
    plan_seconds: float = 0.0   # PLAN's wall time on this rank (included in ``seconds``)
    # Wall seconds of each phase on this rank: "plan", "prepare" (rank 0's reclaim, lock, space
    # check and tmp dir, which every rank waits for), "write" (this rank's data file, fsync
    # included), "commit" (waiting for the slowest rank's report, rank 0's MANIFEST, rename,
    # fsyncs and after_commit, until the verdict arrives). For a blocking save they add up to
    # ``seconds``; an async save's ``seconds`` also holds its staging, between plan and prepare.
    phase_seconds: dict = dataclasses.field(default_factory=dict)


# ---------------------------------------------------------------------------------------------
# The messages of phases 2-4


@dataclasses.dataclass(frozen=True, slots=True)
class Prepared:
    """PREPARE's broadcast from rank 0: the save area, or the error that stopped the save."""

    area: str | None
    error: BaseException | None


@dataclasses.dataclass(frozen=True, slots=True)
class WriteOutcome:
    """One rank's WRITE report to rank 0: its data file's index reference (offset, length,
    crc32c), its size and the I/O back end that wrote it (with the reason it was chosen), or
    ``error`` (then the other fields are None). A few numbers, whatever the number of chunks."""

    index: tuple | None
    size: int | None
    backend: str | None
    reason: str | None
    error: BaseException | None = None


@dataclasses.dataclass(frozen=True, slots=True)
class Verdict:
    """COMMIT's broadcast from rank 0: every rank's WRITE error when any rank failed
    (``failures[r]``), else the COMMIT's own ``error``, else the data file sizes of the committed
    save (``sizes[r]``)."""

    failures: list | None
    error: BaseException | None
    sizes: list[int] | None


# The guard of the save whose ``after_commit`` runs in this context (:func:`commit_guard`).
_GUARD: contextvars.ContextVar = contextvars.ContextVar("distckpt_commit_guard", default=None)


def _no_guard(operation: str) -> None:
    pass


def commit_guard() -> Callable[[str], None]:
    """For an ``after_commit`` callback (a manager's rotation, `latest`): ``guard(operation)`` proves
    that the save running it still holds its lock or lease (on an object store, one conditional
    renewal) and raises SaveInProgressError when it was taken over; call it right before each
    change. A save frozen between its commit and its rotation past its lease (a stopped process,
    a paused VM) used to delete, on waking, the steps of the job that had taken the root over.
    Outside an ``after_commit``: a guard that checks nothing."""
    return _GUARD.get() or _no_guard


def finish_save(group: ControlGroup, planned: PlannedSave, *, final_dir: str, overwrite: bool,
                metadata: dict | None, after_commit: Callable[[], None] | None = None,
                local_error: BaseException | None = None, lock_path: str | None = None,
                storage_options: dict | None = None) -> SaveResult:
    """Phases 2-4 (PREPARE, WRITE, COMMIT) on this rank, after :func:`distckpt.saveplan.plan_save`.
    Collective.

    ``local_error``: this rank failed before writing (e.g. staging an async save); it still takes
    part in every collective and reports the error at WRITE, so all ranks abort together.

    Raises what :func:`distckpt.coordinator.save_collective` raises. Every error raised before rank 0's rename means
    nothing was committed. After it, the outcome says it: an ``after_commit`` error (the manager's
    ``latest`` / rotation) is raised on every rank with ``committed = True``; a peer lost while the
    verdict is broadcast gives CommittedButPeerLostError on rank 0 (``committed``, ``path``,
    ``lost_ranks``) and on any other rank that finds this save's MANIFEST at ``final_dir``; a rank
    that cannot tell raises PeerLostError with ``committed = None`` and the ``save_id`` to look for.
    Rank 0 raises a plain PeerLostError only with ``committed = False`` (nothing was renamed), or
    with ``committed = None`` when the rename happened but its parent fsync failed and could not be
    undone (visible, durability unknown; ``after_commit_error`` holds the fsync error).

    ``lock_path``: the save lock rank 0 holds from PREPARE to the end (default ``.NAME.lock``
    beside the checkpoint; a CheckpointManager passes its root lock). It is released (unlinked,
    fd closed) on every path, after the tmp dir is gone or published. On an object store the
    lock is the save's lease object (:mod:`distckpt.storage.object.store`), and the tmp dir is the
    save's data prefix.

    ``storage_options``: for an fsspec URL ``final_dir``, passed to fsspec (:func:`distckpt.storage.open_store`).
    """
    held: list = []
    store = open_store(final_dir, storage_options)
    try:
        return _finish_save(group, planned, final_dir=final_dir, overwrite=overwrite, metadata=metadata,
                            after_commit=after_commit, local_error=local_error, lock_path=lock_path, held=held,
                            store=store)
    finally:
        for lock in held:
            lock.release()


def _finish_save(group: ControlGroup, planned: PlannedSave, *, final_dir: str, overwrite: bool,
                 metadata: dict | None, after_commit: Callable[[], None] | None,
                 local_error: BaseException | None, lock_path: str | None, held: list, store: Store) -> SaveResult:
    """The body of :func:`finish_save` (same promises and errors): every lock it takes goes into
    ``held``, which the caller releases on every path."""
    t0 = planned.t0
    rank, world = group.rank, group.world_size
    plan, mine = planned.plan, planned.mine

    # 2. PREPARE
    marks = [time.monotonic()]  # the end of each phase, for SaveResult.phase_seconds
    save_id = uuid.uuid4().hex
    tmp_dir = _prepare(group, store, plan, final_dir, save_id, overwrite, lock_path, held)
    marks.append(time.monotonic())

    # 3. WRITE
    result, error, outcomes = _write(group, store, tmp_dir, plan, mine, local_error)
    marks.append(time.monotonic())

    # 4. COMMIT
    verdict = None
    failures = None  # rank 0: every rank's WRITE error (or None), when any rank failed
    sizes = None     # rank 0: every rank's data file size
    committed = False  # rank 0: the rename happened (the commit point); every error after it says so
    if rank == 0:
        published = False
        try:
            if any(o.error is not None for o in outcomes):
                failures = [o.error for o in outcomes]
                _abort_quietly(store, tmp_dir, world, "a failed save")  # the WRITE failures are the verdict
            else:
                _publish(store, plan, outcomes, save_id, tmp_dir, final_dir, overwrite, metadata)  # the commit point
                published = True
                if after_commit is not None:
                    def guard(operation: str) -> None:  # commit_guard's: every lock this save holds
                        for lock in held:
                            lock.check(operation)

                    token = _GUARD.set(guard)
                    try:
                        after_commit()
                    finally:
                        _GUARD.reset(token)
        except Exception as exc:
            # Before the rename nothing is visible: drop the tmp dir. After it, the checkpoint is
            # committed and durable; the error (the manager's rotation) is still reported to every
            # rank. A publish whose parent fsync failed and could not be undone stays visible
            # (``published`` on the error) and its tmp name may hold the previous checkpoint.
            verdict = exc if world == 1 else _portable(exc)
            if published:  # after_commit failed: the checkpoint is committed all the same
                verdict.committed = True
                verdict.save_id = save_id  # which save it is (a tiered manager drains it all the same)
                committed = True
            published = published or getattr(exc, "published", False)
            # A commit whose outcome is unknown, or whose MANIFEST may still land (an object
            # store's PUT that lost its answer), keeps its data: the store says so (``data_kept``).
            if not published and not getattr(exc, "data_kept", False):
                _abort_quietly(store, tmp_dir, world, "a failed commit")
        else:
            committed = published
        if failures is None and verdict is None:
            sizes = [o.size for o in outcomes]
    # The verdict: the WRITE failures (every rank raises the same error: errors.collective_error), or the
    # COMMIT's error, or the data file sizes of a committed save.
    try:
        told = group.broadcast(Verdict(failures, verdict, sizes))
    except PeerLostError as lost:
        if error is not None:  # this rank's own WRITE failed: nothing can have been committed
            lost.committed = False
            raise lost from error
        raise _lost_at_verdict(lost, rank, world, final_dir, tmp_dir, committed, verdict, store) from lost
    if told.failures is not None:
        group.raise_failures(told.failures, error, operation="save")
    if told.error is not None:
        raise fill_rank(told.error, 0)  # COMMIT runs on rank 0
    marks.append(time.monotonic())
    phases = {"plan": planned.plan_seconds, "prepare": marks[1] - marks[0], "write": marks[2] - marks[1],
              "commit": marks[3] - marks[2]}
    return SaveResult(
        path=final_dir if is_url(final_dir) else os.path.abspath(final_dir), world_size=world, rank=rank,
        bytes_per_rank=told.sizes, total_bytes=sum(told.sizes),
        seconds=marks[3] - t0, backend=result.backend, backend_reason=result.reason, save_id=save_id,
        plan_cached=planned.plan_cached, plan_seconds=planned.plan_seconds, phase_seconds=phases)


def _prepare(group: ControlGroup, store: Store, plan: GlobalPlan, final_dir: str, save_id: str, overwrite: bool,
             lock_path: str | None, held: list) -> str:
    """PREPARE (collective): rank 0 takes the lock (into ``held``), checks space and creates the
    save area; every rank returns the area or raises rank 0's typed error."""
    prepared = None
    if group.rank == 0:
        try:
            needed = plan.total_bytes + 64 * 1024 * (plan.n_chunks + group.world_size) + (1 << 20)
            tmp, lock = store.prepare(final_dir, save_id, overwrite, needed, 0, lock_path)
            held.append(lock)
            prepared = Prepared(tmp, None)
        except Exception as exc:
            prepared = Prepared(None, exc if group.world_size == 1 else _portable(exc))
    prepared = group.broadcast(prepared)
    if prepared.error is not None:
        raise fill_rank(prepared.error, 0)  # PREPARE runs on rank 0
    return prepared.area


def _write(group: ControlGroup, store: Store, tmp_dir: str, plan: GlobalPlan, mine, local_error):
    """WRITE (collective): this rank's data file, durable on return, then a gather of every rank's
    :class:`WriteOutcome` to rank 0. Returns (this rank's outcome or None, its error or None, the
    gathered outcomes on rank 0). Never raises a write error: the verdict reports it."""
    result, error = None, local_error
    if error is None:
        try:
            index, size, backend, reason = store.write_rank(tmp_dir, group.rank, mine, plan.checksum_block)
            result = WriteOutcome(tuple(index), size, backend, reason)
        except Exception as exc:
            error = exc
    # Rank 0 alone needs every rank's index reference (for the MANIFEST): a gather, not an
    # all-gather, so what a rank other than 0 receives does not grow with the number of ranks; and
    # what each rank sends is a few numbers, whatever its number of chunks.
    outcomes = group.gather(result if error is None else WriteOutcome(None, None, None, None, _portable(error)))
    return result, error, outcomes


def _publish(store: Store, plan: GlobalPlan, outcomes: list[WriteOutcome], save_id: str, tmp_dir: str,
             final_dir: str, overwrite: bool, metadata: dict | None) -> None:
    """COMMIT on rank 0: MANIFEST built and published (the commit point), then a replaced old
    checkpoint discarded. Raises the store's publish errors (nothing committed unless the error
    says ``published``)."""
    data = manifest_bytes(plan, outcomes, save_id, len(outcomes), plan.checksum_block, metadata, final_dir)
    replaced = store.publish(tmp_dir, final_dir, data, overwrite)  # the commit point
    discard_replaced(store, replaced)


def _abort_quietly(store: Store, tmp_dir: str, world: int, why: str) -> None:
    """Remove a save area that will not be published; a failed clean-up is left to the next
    reclaim (logged), so it never hides the error that stopped the save."""
    try:
        store.abort(tmp_dir, world)
    except DistCkptError as cleanup_exc:
        log.warning("distckpt: could not remove %s after %s: %s", tmp_dir, why, cleanup_exc)


@dataclasses.dataclass
class WrittenSave:
    """A save split at its commit point, for a caller that commits later from another call (the
    DCP storage writer: DCP's ``write_data`` on every rank, then ``finish`` on rank 0 alone).

    :func:`write_uncommitted` returns it on every rank once every rank's data file is durable;
    rank 0 then either :meth:`commit` s it or :meth:`abandon` s it. Until then rank 0 holds the
    save's lock (or lease), so nothing else can publish at ``final_dir`` meanwhile; both methods
    release it on every path, and calling either again does nothing."""

    store: Store
    plan: GlobalPlan
    outcomes: list | None   # rank 0: every rank's WriteOutcome
    save_id: str
    tmp_dir: str
    final_dir: str
    overwrite: bool
    held: list              # rank 0: the lock to release
    size: int               # this rank's data file size
    done: bool = False

    def commit(self, metadata: dict | None) -> None:
        """Publish the MANIFEST (rank 0 only; no collective). ``metadata`` as :func:`distckpt.save`'s.

        Raises:
            the store's publish errors (DiskFullError, StorageIOError, ...; PublishUnknownError
            on an object store whose answer was lost); before the rename nothing is committed and
            the area is removed, unless the error says ``published`` or ``data_kept``.
            ConfigError: called twice, or on a rank other than 0.
        """
        if self.done or self.outcomes is None:
            raise ConfigError("this save was already committed or abandoned, or this is not rank 0")
        try:
            _publish(self.store, self.plan, self.outcomes, self.save_id, self.tmp_dir, self.final_dir,
                     self.overwrite, metadata)
        except Exception as exc:
            if not getattr(exc, "published", False) and not getattr(exc, "data_kept", False):
                _abort_quietly(self.store, self.tmp_dir, len(self.outcomes), "a failed commit")
            raise
        finally:
            self._release()

    def abandon(self) -> None:
        """Remove the written area without committing (rank 0; elsewhere nothing to do)."""
        if self.done:
            return
        try:
            if self.outcomes is not None:
                _abort_quietly(self.store, self.tmp_dir, len(self.outcomes), "an abandoned save")
        finally:
            self._release()

    def _release(self) -> None:
        self.done = True
        while self.held:
            self.held.pop().release()


def write_uncommitted(group: ControlGroup, planned: PlannedSave, *, final_dir: str, overwrite: bool,
                      storage_options: dict | None = None) -> WrittenSave:
    """Phases 2-3 (PREPARE, WRITE) on this rank, then a broadcast of the WRITE verdict: every rank
    returns a :class:`WrittenSave` (rank 0's holds the lock and the outcomes), or every rank raises
    the same typed error and rank 0 has removed the area and released the lock. Nothing is visible
    at ``final_dir`` until rank 0 commits. Collective.

    Raises:
        What :func:`finish_save` raises before its commit point (CheckpointExistsError,
        SaveInProgressError, DiskFullError, the WRITE errors through errors.collective_error,
        PeerLostError with ``committed = False``).
    """
    held: list = []
    store = open_store(final_dir, storage_options)
    rank, world = group.rank, group.world_size
    tmp_dir = None
    try:
        save_id = uuid.uuid4().hex
        tmp_dir = _prepare(group, store, planned.plan, final_dir, save_id, overwrite, None, held)
        result, error, outcomes = _write(group, store, tmp_dir, planned.plan, planned.mine, None)
        failures = None
        if rank == 0 and any(o.error is not None for o in outcomes):
            failures = [o.error for o in outcomes]
        try:
            told = group.broadcast(failures)
        except PeerLostError as lost:
            lost.committed = False
            raise
        if told is not None:
            group.raise_failures(told, error, operation="save")
    except BaseException:
        if rank == 0 and held:
            if tmp_dir is not None:
                _abort_quietly(store, tmp_dir, world, "a failed save")
            for lock in held:
                lock.release()
        raise
    return WrittenSave(store=store, plan=planned.plan, outcomes=outcomes if rank == 0 else None, save_id=save_id,
                       tmp_dir=tmp_dir, final_dir=final_dir, overwrite=overwrite, held=held, size=result.size)


def discard_replaced(store: Store, replaced: str | None) -> None:
    """Delete what a publish returned (a replaced checkpoint, no longer reachable under its name).
    Housekeeping: the next save's reclaim finishes it, so a failure is logged, never raised (it
    must not turn a committed save into a reported failure)."""
    if replaced is None:
        return
    try:
        store.discard(replaced)
    except DistCkptError as cleanup_exc:
        log.warning("distckpt: could not remove the replaced checkpoint %s: %s", replaced, cleanup_exc)


def _lost_at_verdict(lost: PeerLostError, rank: int, world: int, final_dir: str, tmp_dir: str,
                     committed: bool, after_error: BaseException | None, store: Store) -> PeerLostError:
    """The truthful error for a peer lost while the COMMIT verdict was broadcast.

    Rank 0 knows whether it renamed the tmp dir. Another rank does not: it looks for this save's
    MANIFEST (rank 0's save id is the tmp dir's suffix) at ``final_dir`` on the shared file system;
    finding it proves the commit, not finding it proves nothing (rank 0 may be slow, not dead).
    """
    # The ranks that never reached the verdict's broadcast, when the control group could tell.
    others = getattr(lost, "lost_ranks", None) or [r for r in range(world) if r != rank]
    who = f"rank {others[0]} was" if len(others) == 1 else f"one or more of ranks {others} were"
    if rank == 0:
        if not committed and getattr(after_error, "published", False):
            # The rename happened but the parent's fsync failed and could not be undone: the
            # checkpoint is visible, its durability unknown. Neither "committed" nor "nothing
            # committed" is the truth; say which error made it so.
            return PeerLostError(
                f"{lost.message}; {who} lost after {final_dir} was published but its commit failed "
                f"({type(after_error).__name__}: {after_error}): it is visible and may not survive a power "
                f"loss", path=final_dir, rank=rank, committed=None, lost_ranks=others, after_commit_error=after_error)
        if not committed:
            if after_error is not None:  # the commit failed, then the peer was lost: say both
                lost.add_note(f"distckpt: nothing was committed at {final_dir}: {type(after_error).__name__}: "
                              f"{after_error}")
            lost.committed = False
            return lost  # the commit did not happen: "nothing committed" is the truth
        also = f"; after the commit: {type(after_error).__name__}: {after_error}" if after_error is not None else ""
        return CommittedButPeerLostError(
            f"the checkpoint at {final_dir} is committed (complete and durable), but {who} lost "
            f"before hearing the verdict ({lost.message}){also}",
            path=final_dir, rank=rank, committed=True, lost_ranks=others, after_commit_error=after_error)
    save_id = store.save_id_of_area(tmp_dir)
    try:
        found = store.committed_save_id(final_dir) == save_id
    except Exception:  # noqa: BLE001 - absent or unreadable: the commit is not proven
        found = False
    if found:
        return CommittedButPeerLostError(
            f"the checkpoint at {final_dir} is committed (its MANIFEST carries this save's id {save_id}), but "
            f"{who} lost before this rank heard the verdict ({lost.message})",
            path=final_dir, rank=rank, committed=True, lost_ranks=others, after_commit_error=None)
    return PeerLostError(
        f"{lost.message}; lost while rank 0 committed {final_dir}: this rank cannot tell whether the "
        f"checkpoint was committed (if it was, its MANIFEST carries save_id {save_id})",
        path=final_dir, rank=rank, committed=None, save_id=save_id, lost_ranks=getattr(lost, "lost_ranks", None))


def _backends(outcomes: list[WriteOutcome]) -> str | None:
    """The io backend the ranks wrote with: one name, or, when ranks differ (one rank under a
    seccomp profile that refuses io_uring), each name with its ranks: "pwrite (ranks [1]), uring
    (ranks [0])"."""
    by_name: dict = {}
    for r, o in enumerate(outcomes):
        by_name.setdefault(o.backend, []).append(r)
    if len(by_name) <= 1:
        return outcomes[0].backend if outcomes else None
    return ", ".join(f"{name} (ranks {ranks})" for name, ranks in sorted(by_name.items(), key=lambda kv: str(kv[0])))


def _per_save(plan: GlobalPlan, outcomes: list[WriteOutcome], metadata: dict | None) -> tuple[list, dict, dict]:
    """The MANIFEST fields that change from one save of a layout to the next: each data file's
    entry, the values, and meta."""
    files = [mf.FileEntry(name=mf.data_file_name(r), size=o.size, rank=r, index=o.index)
             for r, o in enumerate(outcomes)]
    objects = {fqn: mf.ObjectEntry(kind=kind, value=value) for fqn, (kind, value) in plan.objects.items()}
    from . import __version__
    meta = {"distckpt_version": __version__, "io_backend": _backends(outcomes)}
    if metadata:
        meta["user"] = metadata
    return files, objects, meta


def _build_manifest(plan: GlobalPlan, outcomes: list[WriteOutcome], save_id: str, world: int, checksum_block: int,
                    metadata: dict | None, created: float) -> "mf.Manifest":
    """The version-4 MANIFEST of a save: tensors, objects, tree, each data file's index reference,
    and where each tensor's chunks are (the plan's grid descriptions, or the ranks that wrote its
    pieces). No chunk record: each rank wrote its own into its data file's index, so what rank 0
    receives and writes grows with the ranks plus the tensors, not with their product."""
    files, objects, meta = _per_save(plan, outcomes, metadata)
    tensors = {fqn: mf.TensorEntry(dtype=dtype, shape=tuple(shape), kind=kind, chunks=None, where=plan.where[fqn])
               for fqn, (kind, dtype, shape) in plan.tensors.items()}
    return mf.Manifest(format_version=mf.FORMAT_VERSION, save_id=save_id, world_size=world,
                       created_unix=created, checksum_algo="crc32c", checksum_block=checksum_block,
                       files=tuple(files), tensors=tensors, objects=objects, tree=plan.tree, meta=meta,
                       meshes=plan.meshes)


# Rank 0's last encoded MANIFEST and the plan objects it was built from. A training loop's saves
# reuse one plan layout (the plan cache hands back the same tensors, where, tree and meshes
# objects), so the next save re-encodes only what changes per save (mf.encode_next): for 2,000
# tensors the commit's build, validation and packing went from about 18 ms to 1 ms. One entry:
# it holds the layout, which the plan cache holds anyway, and that manifest's tensor entries.
_last: "tuple[tuple, mf.Encoded] | None" = None


def manifest_bytes(plan: GlobalPlan, outcomes: list[WriteOutcome], save_id: str, world: int, checksum_block: int,
                   metadata: dict | None, final_dir: str) -> bytes:
    """The MANIFEST bytes of a save into ``final_dir`` (:func:`_build_manifest`, then ``mf.encode``),
    reusing the previous save's encoded layout when ``plan`` carries the same layout objects. Its
    commit time: :func:`distckpt.commitclock.stamp` of ``final_dir``'s parent (the root of a
    manager's steps).

    Raises: what ``mf.encode`` raises (ValueError for an invalid manifest, UnsupportedValueError
    for one too large to read)."""
    global _last
    created = commitclock.stamp(dirname(final_dir))
    layout = (plan.tensors, plan.where, plan.tree, plan.meshes)
    last = _last  # one read: another thread's commit may replace it meanwhile
    if (last is not None and all(a is b for a, b in zip(last[0], layout)) and last[1].manifest.world_size == world
            and last[1].manifest.checksum_block == checksum_block):
        files, objects, meta = _per_save(plan, outcomes, metadata)
        encoded = mf.encode_next(last[1], save_id=save_id, created_unix=created, files=tuple(files),
                                 objects=objects, meta=meta)
    else:
        encoded = mf.encode_manifest(_build_manifest(plan, outcomes, save_id, world, checksum_block, metadata,
                                                     created))
    _last = (layout, encoded)
    return encoded.data
