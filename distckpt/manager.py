"""CheckpointManager: numbered steps under one root, a durable ``latest`` pointer, keep_last rotation.

Layout (docs/FORMAT.md)::

    ROOT/step_00000100/       a committed checkpoint (has MANIFEST)
    ROOT/.step_00000200.tmp-… a save in progress or crashed: never loadable; reclaimed once dead
    ROOT/.distckpt.lock       held by the manager save in flight (owner host/pid/start/save id)
    ROOT/latest               "step_00000100\\n", replaced by tmp + rename + directory fsync

Invariants:
  * ``latest`` is what ``load()`` loads: the newest committed step *by commit order* (the
    MANIFEST's commit time, then the step number), which is the step the last completed save
    committed. The ``latest`` file is written right after each commit and names the same step;
    after a crash between a commit and that write it lags, and the newer commit wins (it is
    complete and durable: I1 allows the previous or the new checkpoint). After a rollback (load
    step 200 of 100/200/300, save 250) the newest commit is 250, never 300.
  * Saving step S after this manager's load() of an older step makes every committed step
    numbered above S an *abandoned branch* (the run rolled back); without such a load they are
    kept, with a warning. A load() that named no step chose no rollback: of the steps above, only
    those committed before the step it took are the abandoned branch (an earlier rollback's),
    never one it passed over because it does not load (_kept_above). Default: they are deleted
    right after S is committed, each deletion logged as a warning with the reason;
    ``keep_abandoned=True`` keeps them (never rotated, never loaded by
    default; a later save of one of their numbers then raises CheckpointExistsError). A save whose
    number collides with a step of the abandoned branch of a rollback this manager loaded
    replaces it atomically (logged), unless keep_abandoned; so does one whose number holds a step
    with a damaged MANIFEST (it never loads: refusing would stop the run at that number).
  * Rotation runs on rank 0 inside the commit (after the new checkpoint is durable, before any rank
    returns), deletes only committed steps of the current branch (numbered at or below the step
    just saved) that are neither among its newest ``keep_last`` by number nor among its newest
    ``keep_last`` by commit time (distckpt.rotation), never the step just saved and never the step
    this manager's ``load()`` resumed from at the first save after it; a step whose commit time
    does not read is kept; each step is renamed aside before it is deleted, so a
    half-deleted step never looks committed. Deleted files are closed, so their blocks are freed.
  * Rotation never deletes a step that a kept step depends on (an earlier link of its incremental
    chain, distckpt.incremental); such a step goes at the first rotation after nothing kept needs it.
  * One manager save at a time per root, across processes and jobs: the save holds
    ``ROOT/.distckpt.lock`` (a save lock, or an object store's lease) from PREPARE to the end of its rotation; a second
    one gets SaveInProgressError and writes nothing.
  * Constructing a manager, ``steps()``, ``latest_step()`` and ``describe()`` never write. Leftovers
    of dead saves are reclaimed by saves (rank 0, before taking the lock) and by :meth:`reclaim`;
    leftovers of live saves (their lock held, by any process) are never touched.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
from typing import TYPE_CHECKING, Any, Callable

from . import chain, commitclock
from ._dist import control_group, group_members, is_distributed
from .commit import SaveResult, commit_guard
from .errors import CheckpointNotFoundError, ConfigError, DistCkptError, PeerLostError
from .restore import LoadResult, load
from .rotation import DAMAGED, beyond_keep_last
from .save_sync import save_in_root
from .storage import ROOT_LOCK_NAME, is_url, join, normalize_path, open_store
from .listing import _STEP_RE, RootListing, StepInfo, _newest_by_commit, _step_info, list_root

if TYPE_CHECKING:
    from .save_async import AsyncSaveHandle

log = logging.getLogger("distckpt")

__all__ = ["CheckpointManager"]

def check_step(step: Any, what: str = "step") -> int:
    """``step`` when it is a step number (an int >= 0, not a bool). Raises ConfigError otherwise
    (a str, a float or None raised a bare ValueError or TypeError from the directory name)."""
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise ConfigError(f"{what}={step!r} must be a non-negative int")
    return step


def check_timeout(timeout: Any, what: str = "timeout") -> float | None:
    """``timeout`` when it is None or a number of seconds (one at or below 0 waits for nothing, as
    ``threading.Event.wait`` has it: a deadline computed as ``end - now`` may come out negative).
    Raises ConfigError otherwise (a str, a bool, NaN)."""
    if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float))
                                or timeout != timeout):
        raise ConfigError(f"{what}={timeout!r} must be None or a number of seconds")
    return timeout


def step_dirname(step: int) -> str:
    """The directory name of step ``step``. Raises ConfigError for anything but a step number."""
    return f"step_{check_step(step):08d}"



def check_staging_option(blocking: bool, kwargs: dict) -> None:
    """Check ``kwargs``' ``stage_in_background`` (an async save's option) in place: a bool, and
    True only with ``blocking=False`` (refused, not ignored, where nothing is staged); its False
    is dropped from a blocking save's options. Raises ConfigError."""
    if "stage_in_background" not in kwargs:
        return
    value = kwargs["stage_in_background"]
    if not isinstance(value, bool):
        raise ConfigError(f"stage_in_background={value!r} must be True or False")
    if blocking:
        if value:
            raise ConfigError("stage_in_background=True is an option of an async save: pass blocking=False with it")
        del kwargs["stage_in_background"]


class CheckpointManager:
    """Save numbered checkpoints under ``root`` and keep the newest ``keep_last`` of them.

    ``latest`` and ``load()`` (no step) are the newest step by commit order: the one the last
    completed save committed (also after a rollback: load 200 of 100/200/300 and save 250, and
    250 is what load() gives and what ``latest`` names). Saving step S after a load() of an older step
    treats committed steps numbered above S as an abandoned branch (without such a load they are
    kept, with a warning, as are those a load() without a step number passed over because they do
    not load): deleted right after S commits, each deletion logged
    as a warning with its reason (``keep_abandoned=True`` keeps them). The step ``load()`` resumed
    from is never rotated away by the first save after it. One manager save at a time per root
    (across processes: SaveInProgressError for the second). Leftovers of dead saves are reclaimed by
    saves and :meth:`reclaim`; nothing here ever deletes a save in flight. See docs/FORMAT.md.

    Constructing a manager writes nothing (the root is created by the first save).
    Use it as a context manager (or call :meth:`close`) to wait for its async saves, surface their
    errors and give back the async staging memory (collective in a job, like save and load).

    Args:
        root: directory holding the steps (created by the first save if missing).
        keep_last: how many committed steps of the current branch to keep (None: all): the newest
            by number and the newest by commit time are kept (after a rollback they differ).
        keep_abandoned: keep steps numbered above a newly saved step instead of deleting them.
        process_group: the group save/load run over (default: the world).
        storage_options: for an fsspec URL root (``s3://bucket/run7``), the fsspec options (as
            :func:`distckpt.save`); every save and load of this manager passes them on.
        incremental: an :class:`~distckpt.incremental.IncrementalPolicy`: saves write only the
            rows of the tracked tensors that changed since the previous step (a chain of deltas
            on a full step, docs/INCREMENTAL.md); to a local root only, blocking or not. Rotation
            never deletes a step that a kept step depends on, with or without this option.
    """

    def __init__(self, root: str | os.PathLike, *, keep_last: int | None = None, keep_abandoned: bool = False,
                 process_group: Any = None, storage_options: dict | None = None, incremental: Any = None) -> None:
        if keep_last is not None and (not isinstance(keep_last, int) or keep_last < 1):
            raise ConfigError(f"keep_last={keep_last!r} must be a positive int or None")
        self.root = normalize_path(root)
        self.storage_options = storage_options
        # The root's back end: its listing, ``latest``, rotation and leftovers.
        self._store = open_store(self.root, storage_options)
        # Read-only (no directory is created here): a root the back end can never use (under /proc
        # or /sys) is the wrong place, said now rather than at the first save hours into the run.
        self._store.check_root(self.root)
        self.keep_last = keep_last
        self.keep_abandoned = bool(keep_abandoned)
        self.process_group = process_group
        # The step load() resumed from: protected from rotation at the first save committed after
        # the load, and the reference of the abandoned-branch policy. Cleared by _settle on every
        # rank once a save started after that load is known to be committed. The generation
        # counts loads, so a save that commits in the background after a newer load() does not
        # clear that newer load's protection. Guarded by _lock (async saves settle on their thread).
        self._lock = threading.Lock()
        self._resumed_from: int | None = None
        self._resume_chosen = False  # whether the caller named the step it resumed from
        self._resume_gen = 0
        self._clock_read = False  # rank 0: the root's commit times made known (commitclock), before a save
        self._saver = None
        # Whether close() decides unread background failures with every rank, as save()/load() do
        # (collective unless ``no_dist``): True until this manager's only calls were no_dist ones
        # (a manager that one process of a job uses alone closes alone; its peers never call it).
        self._collective_calls = 0
        self._no_dist_calls = 0
        # Set once a collective of this manager met a lost peer (PeerLostError, RanksMissingError):
        # the group can decide nothing more, so close() decides on this rank alone instead of
        # waiting DISTCKPT_ARRIVAL_TIMEOUT_S for a rank that is gone.
        self._group_lost = False
        # Chains are read and written in local directories only (distckpt.incremental).
        if incremental is not None and is_url(self.root):
            raise ConfigError(f"incremental=: incremental chains are written to local roots only, not to "
                              f"{self.root} (an object store)")
        if incremental is not None:
            from .incremental import IncrementalPolicy, IncrementalSaver
            if not isinstance(incremental, IncrementalPolicy):
                raise ConfigError(f"incremental={incremental!r}: expected a distckpt.incremental.IncrementalPolicy")
            self._saver = IncrementalSaver(incremental)

    def _rank(self) -> int:
        if not is_distributed():
            return 0
        import torch.distributed as dist
        return dist.get_rank(self.process_group) if self.process_group is not None else dist.get_rank()

    def path(self, step: int) -> str:
        return join(self.root, step_dirname(step))

    def steps(self) -> list[int]:
        """Committed steps, ascending by number: those whose MANIFEST is there (not decoded: one
        whose MANIFEST is damaged is listed too; load() skips it with a warning, and
        :meth:`describe` shows it ``broken``). Never writes. Raises the store's typed error
        (StoragePermissionError, StorageIOError, ...) when a step's directory cannot be looked
        at: a step it cannot see may be the newest (a save after a load without it would delete
        it as an abandoned branch)."""
        return self._steps(strict=True)

    def _steps(self, *, strict: bool) -> list[int]:
        """:meth:`steps`; with ``strict=False`` (rotation) a step that cannot be looked at is left
        out with a warning instead: rotation never deletes what it does not list, and counting it
        or not changes no other step's fate but its own (it is kept either way), while raising
        would fail every save after its commit and stop rotation until the disk fills."""
        out = []
        steps = [int(m.group(1)) for m in map(_STEP_RE.match, self._store.list_children(self.root)) if m]
        for step, committed in zip(steps, self._store.for_each(self._store.is_committed, [self.path(s) for s in steps])):
            if isinstance(committed, Exception):
                if strict or not isinstance(committed, DistCkptError):
                    raise committed
                log.warning("distckpt: %s cannot be looked at (%s): left out of rotation, never deleted by it",
                            self.path(step), committed.message)
                continue
            if committed:
                out.append(step)
        return sorted(out)

    def _numbered_above(self, step: int) -> bool:
        """Whether a name in the root is a step directory numbered above ``step`` (committed or
        not: one listing, no request per step)."""
        return any(int(m.group(1)) > step for m in map(_STEP_RE.match, self._store.list_children(self.root)) if m)

    def latest_step(self) -> int | None:
        """The step ``load()`` loads: the newest committed step by commit order (MANIFEST commit
        time, then number), or None. A step whose MANIFEST does not decode is skipped with a
        warning naming it. Never writes.

        Cost: one directory listing, the first 4 KiB of each step's MANIFEST (its commit time, for
        the order) and a full decode (checksum and validation) of the newest candidates only, newest
        first, until one is valid, and of the steps numbered above it (a rollback's abandoned
        branch): usually one. A peek that disagrees with its MANIFEST (an overwrite since, or bytes
        changed in transit: nothing checks the first 4 KiB alone) decodes every step. Not covered:
        a peek read wrong of a step numbered below the one chosen (a rollback's resumed branch). The ``latest`` file cannot replace the listing: it
        lags after a crash between a commit and its update, so it is not consulted here.

        Raises the store's typed error when a MANIFEST cannot be read for a reason other than its
        content (a timeout, a reset, no permission): that step's state is unknown, and skipping it
        would load an older step, after which the next save would delete it as an abandoned
        branch."""
        return self._latest()[0]

    def _latest(self) -> tuple[int | None, dict[int, str]]:
        """(:meth:`latest_step`, {step: why} of the steps found not to decode on the way)."""
        infos: dict[int, StepInfo] = {}
        step = self._latest_of(infos)
        return step, {s: info.problem or info.status for s, info in sorted(infos.items())
                      if info.status not in ("committed", "gone")}

    def _latest_of(self, infos: dict) -> int | None:
        """:meth:`latest_step`, filling ``infos`` with the full decode of every step it decoded."""
        timed, untimed = [], []
        steps = self.steps()
        # The first 4 KiB of each MANIFEST (a local file's, or one ranged GET); when they do not
        # tell, the decode below.
        for step, t in zip(steps, self._peeked_commit_times(steps)):
            (untimed if t is None else timed).append((t, step))
        # A MANIFEST whose first bytes do not tell its time: decode it whole now (damaged, usually).
        for _, step in untimed:
            info = infos[step] = self._checked_info(step)
            if info.status == "committed":
                timed.append((info.created_unix, step))
        peeked = {s: pt for pt, s in timed}
        for t, step in sorted(timed, reverse=True):
            info = infos.get(step) or self._checked_info(step)
            if info.status != "committed":
                continue
            # The steps numbered above it are older by their peeks (a rollback's abandoned branch;
            # none in a run that only moves forward): decoded whole too, since a peek is not
            # checksummed, and a bit flipped in transit in one's commit time passed over the
            # newest step for an older one, silently.
            above_ok = True
            for higher in sorted(s for s in peeked if s > step):
                infos[higher] = infos.get(higher) or self._checked_info(higher)
                if infos[higher].status == "committed" and infos[higher].created_unix != peeked[higher]:
                    above_ok = False
                    break
            if info.created_unix == t and above_ok:
                return step
            # Its MANIFEST was replaced between the peek and the decode (an overwrite), or a peek
            # read wrong: the order is stale, so decode every candidate (rare).
            for _, s in timed:
                infos[s] = infos.get(s) or self._checked_info(s)
            newest = _newest_by_commit([infos[s] for _, s in timed if infos[s].status == "committed"])
            return newest.step if newest is not None else None
        return None

    def _peeked_commit_times(self, steps: list[int]) -> list[float | None]:
        """The commit time each step's MANIFEST claims in its first bytes (None when they do not
        tell), asked concurrently on an object store (Store.for_each). Raises the first step's
        error, in order."""
        out = self._store.for_each(self._store.peek_commit_time, [self.path(s) for s in steps])
        for t in out:
            if isinstance(t, Exception):
                raise t
        return out

    def _checked_info(self, step: int) -> StepInfo:
        info = _step_info(self.path(step), step_dirname(step), self._store)
        if info.status != "committed" and not self._store.is_committed(self.path(step)):
            # Gone since the listing (another process's rotation deleted it): no damage, and no
            # step passed over (an outside trial saw a warning of a damaged MANIFEST at every
            # rotation while readers listed).
            log.debug("distckpt: %s was removed since the listing", info.path)
            return dataclasses.replace(info, status="gone", problem="removed since the listing")
        if info.status != "committed":
            log.warning("distckpt: %s looks committed but its MANIFEST is damaged (%s); not a candidate "
                        "for latest", info.path, info.problem)
        return info

    def describe(self, *, other_hosts: bool = False) -> RootListing:
        """:func:`list_root` of this root (what ``distckpt ls ROOT`` prints). Never writes."""
        return list_root(self.root, other_hosts=other_hosts, storage_options=self.storage_options)

    def reclaim(self, *, other_hosts: bool = False) -> list[str]:
        """Delete the leftovers of dead saves under the root (never of a live one, whichever
        process runs it). ``other_hosts=True`` also trusts free locks of other hosts (only on a
        file system whose flock is coherent across hosts). Returns the entries removed. On an object
        store a save's leftovers are dead when no live lease names them (``other_hosts`` is moot)."""
        return self._store.reclaim(self.root, other_hosts=other_hosts)

    def save(self, step: int, state_dict: Any, *, blocking: bool = True, rotate: bool = True,
             **kwargs: Any) -> "SaveResult | AsyncSaveHandle":
        """Save ``state_dict`` as step ``step`` (collective), then point ``latest`` at it and rotate.

        Keyword arguments go to :func:`distckpt.save` (with ``blocking=False`` also
        ``stage_in_background``: :func:`distckpt.async_save`). ``rotate=False`` deletes no older step
        after this one (an export beside the newest ``keep_last`` steps: torchtitan's last-step
        save); the next rotating save counts it like any other step. With ``blocking=False`` this is
        :func:`distckpt.async_save`: it returns an :class:`~distckpt.save_async.AsyncSaveHandle` as
        soon as the state is staged; ``latest``, the abandoned-branch policy and the rotation happen
        inside that save's commit, in the background. Saves are serialized per process (a later
        save waits for an earlier one still in flight) and per root across processes (the root
        lock), and rotation deletes only committed steps, so it never touches a step being written.

        Raises what :func:`distckpt.save` raises (for ``blocking=False``: ``handle.result()`` does),
        including SaveInProgressError when another manager is saving into this root, and first the
        error of an earlier async save of this process that nobody waited for. Rotation errors are
        raised too, after the new step is committed.
        """
        check_step(step)
        check_staging_option(blocking, kwargs)
        self._count_call(kwargs)
        try:
            return self._save(step, state_dict, blocking, rotate, kwargs)
        except PeerLostError:
            self._note_group_lost()
            raise

    def _save(self, step: int, state_dict: Any, blocking: bool, rotate: bool,
              kwargs: dict) -> "SaveResult | AsyncSaveHandle":
        from .save_async import raise_background_failure, wait_for_saves
        # Decided with every rank before anything of this save runs (all raise, or none does),
        # once the save still in flight has finished: it may yet fail.
        wait_for_saves()
        raise_background_failure(None if kwargs.get("no_dist") else
                                 control_group(self.process_group, operation="CheckpointManager.save()"))
        if self.storage_options is not None:
            kwargs["storage_options"] = self.storage_options
        # Rank 0 alone, before the save's collective: nothing here may raise on one rank only (the
        # others would wait at the collective for a rank that already left). Reclaim is
        # housekeeping: when the store does not answer, the save's own first request on rank 0
        # fails and every rank raises it. The abandoned-branch overwrite is rank 0's to decide
        # (only rank 0 prepares and publishes).
        reclaim_error = None
        if self._rank() == 0:
            try:
                # Dead leftovers of any step (never those of a live save), before our lock is taken.
                self._store.reclaim(self.root)
            except DistCkptError as exc:
                from .errors import BucketNotFoundError, ObjectStoreAccessError
                if isinstance(exc, (BucketNotFoundError, ObjectStoreAccessError)):
                    # A missing bucket or refused credentials: the save's first request most
                    # likely raises the same error (a warning now would say it twice). Should
                    # the save commit all the same (a policy that refuses deletes only), its
                    # commit says it, below.
                    reclaim_error = exc
                    log.debug("distckpt: could not reclaim leftovers under %s before saving step %d: %s",
                              self.root, step, exc)
                else:
                    log.warning("distckpt: could not reclaim leftovers under %s before saving step %d: %s",
                                self.root, step, exc)
        if self._rank() == 0 and not self._clock_read:
            self._clock_read = self._learn_commit_times()
        with self._lock:
            protect, chosen, gen = self._resumed_from, self._resume_chosen, self._resume_gen
        if (self._rank() == 0 and not self.keep_abandoned and not kwargs.get("overwrite")
                and self._committed_quietly(step)):
            why = self._replaceable(step, protect, chosen)
            if why is not None:
                log.warning("distckpt: replacing %s: %s; pass keep_abandoned=True to refuse instead",
                            self.path(step), why)
                kwargs["overwrite"] = True
        if self._saver is not None:
            # After the abandoned-branch decision: replacing an abandoned step that a kept step's
            # chain depends on (a delta saved against it) would leave that step unloadable, as an
            # explicit overwrite=True would.
            self._refuse_replacing_a_needed_link(step, kwargs)

        def after() -> None:
            if reclaim_error is not None:  # the save went through: the reclaim's error was its own
                log.warning("distckpt: could not reclaim leftovers under %s before saving step %d: %s",
                            self.root, step, reclaim_error)
            self._after_commit(step, protect, rotate, chosen=chosen)

        lock = join(self.root, ROOT_LOCK_NAME)
        if self._saver is not None:
            if not blocking:   # staged before it returns: the changed rows, then everything to write
                return self._saver.async_save(
                    state_dict, self.path(step), process_group=self.process_group, after_commit=after,
                    lock_path=lock, on_outcome=lambda result, error: self._settle(gen, result, error), **kwargs)
            try:
                result = self._saver.save(state_dict, self.path(step), process_group=self.process_group,
                                          after_commit=after, lock_path=lock, **kwargs)
            except BaseException as exc:
                self._settle(gen, None, exc)
                raise
            self._settle(gen, result, None)
            return result
        if not blocking:
            from .save_async import async_save_in_root
            # Settled on every rank by the save's own thread, before its handle reports done.
            return async_save_in_root(state_dict, self.path(step), process_group=self.process_group,
                                      after_commit=after, lock_path=lock,
                                      on_outcome=lambda result, error: self._settle(gen, result, error), **kwargs)
        try:
            result = save_in_root(state_dict, self.path(step), process_group=self.process_group, after_commit=after,
                                  lock_path=lock, **kwargs)
        except BaseException as exc:
            self._settle(gen, None, exc)
            raise
        self._settle(gen, result, None)
        return result

    def _refuse_replacing_a_needed_link(self, step: int, kwargs: dict) -> None:
        """An incremental manager's ``save(step, overwrite=True)`` of a step that another
        committed step's chain depends on (a link of it) would leave that step unloadable for
        good: CheckpointExistsError on every rank, before anything is written. Rank 0 decides
        (from its own ``overwrite``, as its prepare alone acts on it), and every rank learns the
        outcome in one exchange on every incremental save (unless ``no_dist``), so that ranks
        passing different ``overwrite`` never pair this exchange with another collective. A chain
        that cannot be read to its base, or a step that cannot be looked at, refuses too: it may
        depend on the step (as rotation assumes), and its error is raised."""
        from .errors import CheckpointExistsError
        error = None
        if (self._rank() == 0 or kwargs.get("no_dist")) and kwargs.get("overwrite") and not is_url(self.root):
            try:
                if self._store.is_committed(self.path(step)):
                    name, needing, unknown = step_dirname(step), [], []
                    for s in self._steps(strict=True):
                        deps = chain.dependencies(self.path(s)) if s != step else []
                        if deps is None:
                            unknown.append(s)
                        elif name in deps:
                            needing.append(s)
                    if needing or unknown:
                        error = CheckpointExistsError(
                            f"{self.path(step)} is a link of the incremental chain of "
                            f"{[step_dirname(s) for s in needing]}" + (
                                f", and the chains of {[step_dirname(s) for s in unknown]} cannot be read to their "
                                f"base (they may depend on it)" if unknown else "") +
                            ": replacing it (overwrite=True) would leave them unloadable", path=self.path(step),
                            remedy="Save under a new step number, or delete the steps that depend on it first "
                                   "(`distckpt verify` names a chain that does not read).")
            except DistCkptError as exc:  # the look failed: nothing is replaced on a guess
                error = exc
        if kwargs.get("no_dist"):
            if error is not None:
                raise error
            return
        control_group(self.process_group, operation="CheckpointManager.save()").exchange_outcome(
            error, operation="CheckpointManager.save()")

    def _replaceable(self, step: int, resumed: int | None, chosen: bool) -> str | None:
        """Why a save of ``step`` may replace the committed step of that number (rank 0, before
        the save), or None (the save then raises CheckpointExistsError): it belongs to the
        abandoned branch of the rollback this manager loaded (``resumed``: a step the caller
        chose, or the newest loadable one when ``step`` was committed before it), or its MANIFEST
        is damaged (it never loads; load() passed over it: blocking every later save of its
        number would stop the run there). A MANIFEST that cannot be read (no permission, a
        timeout) is no damage: that step is not replaced."""
        if resumed is not None and step > resumed and (chosen or self._kept_above([step], resumed, quiet=True)):
            return f"it belongs to the abandoned branch (this manager resumed from step {resumed} and saves step " \
                   f"{step} again)"
        info = _step_info(self.path(step), step_dirname(step), self._store, strict=False)
        if info.status == "broken":
            return f"its MANIFEST is damaged, so it never loads ({info.problem})"
        return None

    def _committed_quietly(self, step: int) -> bool:
        """Whether ``step`` is committed; False (with a warning) when the store cannot tell: the
        save then refuses an existing step itself (CheckpointExistsError, on every rank)."""
        try:
            return self._store.is_committed(self.path(step))
        except DistCkptError as exc:
            log.warning("distckpt: cannot tell whether %s is committed: %s", self.path(step), exc)
            return False

    def _settle(self, gen: int, result: "SaveResult | None", error: BaseException | None) -> None:
        """Every rank, once a save's outcome is known: a committed save (it returned, or its error
        says ``committed = True``: CommittedButPeerLostError, a failed ``latest`` update or
        rotation) ends the protection of the step load() resumed from, unless a newer load()
        happened since the save started (``gen``). An uncommitted save, or one whose outcome this
        rank cannot tell (``committed = None``), keeps the protection for the next save."""
        if isinstance(error, PeerLostError):  # an async save's too (its thread settles it)
            self._note_group_lost()
        committed = result is not None or (error is not None and getattr(error, "committed", None) is True)
        if not committed:
            return
        with self._lock:
            if self._resume_gen == gen:
                self._resumed_from = None

    def rotate_after(self, step: int, *, guard: Callable[[str], None] | None = None, point: bool = True) -> None:
        """What a manager save of ``step`` runs on rank 0 once it is committed, for a caller that
        commits steps into this root by other means (a tiered manager's drain,
        distckpt.tiers): point ``latest`` at ``step``, then keep_last rotation (steps numbered
        above ``step`` are kept, with a warning). The caller holds the root's lock or lease.

        A drain may commit a step after newer ones (by commit time) reached the root: rotation
        keeps the newest keep_last by commit time as well as by number (distckpt.rotation), so
        the steps committed after ``step`` (a rollback's resumed branch, numbered below the
        abandoned one) are not rotated away by its late drain, nor is one whose commit time
        cannot be read.

        ``guard(operation)``: called right before each write (the ``latest`` pointer, each
        deletion); what it raises stops the rotation there (a tiered manager's proof, renewed
        before each, that it still owns the root). ``point=False``: ``latest`` is left as it is
        (a caller that knows a step committed after ``step`` is there: ``latest`` names the
        newest by commit order, and a late drain must not point it back).

        Raises the store's typed errors (the step itself stays committed)."""
        self._after_commit(step, None, guard=guard, point=point)

    def _learn_commit_times(self) -> bool:
        """Rank 0, before this manager's first save: make the newest commit time under the root
        known (:mod:`distckpt.commitclock`), so that this job's steps sort after every step already
        there although this host's clock may run behind the one that committed them (a restart
        on another host). One peek (4 KiB) per step, once per manager. Returns False when the root
        could not be listed (the next save tries again; this one is stamped by the clock alone,
        as the root's own save would fail the same way). Never raises."""
        try:
            steps = [int(m.group(1)) for m in map(_STEP_RE.match, self._store.list_children(self.root)) if m]
            for t in self._peeked_commit_times(steps):
                commitclock.observe(self.root, t)
        except Exception as exc:  # noqa: BLE001 - rank 0 alone: it must not raise before the collective
            log.warning("distckpt: could not read the commit times under %s before saving (%s: %s): this save's "
                        "commit time is this host's clock alone", self.root, type(exc).__name__, exc)
            return False
        return True

    def _kept_above(self, above: list[int], resumed: int, *, quiet: bool = False) -> list[int]:
        """Of ``above`` (steps numbered above the one just saved, after a load that took the newest
        loadable step, not one the caller chose), those that are an abandoned branch: committed
        before the step resumed from (a rollback of an earlier run whose deletion did not happen).
        The others are kept with a warning: a step load() passed over because its MANIFEST is
        damaged or unreadable (or committed later, by another writer) is no branch the caller
        abandoned, and may be all there is of that step."""
        created = self._commit_time_reader()
        base = created(resumed)
        older = [s for s in above if base is not None and base != DAMAGED
                 and (t := created(s)) is not None and t != DAMAGED and t < base]
        kept = [s for s in above if s not in older]
        if kept and not quiet:
            log.warning("distckpt: keeping %s under %s: numbered above the step just saved, but not known to "
                        "be an abandoned branch (load() took step %d as the newest loadable step, not a step the "
                        "caller chose; these do not load, or were committed after it). Load one by number to "
                        "resume from it, or remove it", [step_dirname(s) for s in kept], self.root, resumed)
        return older

    def _commit_time_reader(self) -> Callable[[int], float | None]:
        """``commit_time`` for :func:`distckpt.rotation.beyond_keep_last`: a step's MANIFEST commit
        time, peeked where the store can (a local file's first 4 KiB), else decoded
        (:func:`distckpt.listing._step_info`, as ``distckpt ls`` reads it); None when it does not
        read, :data:`distckpt.rotation.DAMAGED` for a MANIFEST known damaged (it never loads). After
        the first read that fails (a timeout, a refusal) nothing more is read: a root gone dark
        would make each read wait out its own deadline while rotation holds the root's lock or
        lease."""
        failed = False

        def created(s: int) -> float | None:
            nonlocal failed
            if failed:
                return None
            try:
                t = self._store.peek_commit_time(self.path(s))
            except Exception as exc:  # noqa: BLE001 - a failed request: keep it, look no further
                failed = True
                log.warning("distckpt: keeping %s and the steps not yet looked at: the commit time of %s does "
                            "not read (%s: %s)", self.path(s), step_dirname(s), type(exc).__name__, exc)
                return None
            if t is not None:
                return t
            info = _step_info(self.path(s), step_dirname(s), self._store, strict=False)
            if info.status == "broken":
                return DAMAGED  # it never loads: its number alone decides, as for any step
            if info.status != "committed":
                failed = True
                log.warning("distckpt: keeping %s and the steps not yet looked at: the commit time of %s does "
                            "not read (%s)", self.path(s), step_dirname(s), info.problem)
                return None
            return info.created_unix
        return created

    def _after_commit(self, step: int, protect: int | None, rotate: bool = True, *, chosen: bool = True,
                      guard: Callable[[str], None] | None = None, point: bool = True) -> None:
        # Runs on rank 0 inside the commit, holding the root lock, after `step` is durable.
        # ``chosen``: the caller named the step it resumed from (load(step=N)); else the manager
        # took the newest loadable one. ``guard``: rotate_after's.
        # Without the caller's guard (a save's own rotation): the save's lock or lease, proven
        # before each change (distckpt.commit.commit_guard).
        guard = guard or commit_guard()
        if point:
            pointer = (step_dirname(step) + "\n").encode()
            guard(f"point {self.root}/latest at {step_dirname(step)}")
            self._store.replace_pointer(join(self.root, "latest"), pointer)
        if (self.keep_last is None or not rotate) and not self._numbered_above(step):
            # Nothing to rotate and no step above: the committed steps below need not be looked
            # at (on an object store, a HEAD each, on rank 0 inside every commit of a run that
            # keeps all its steps: thousands of requests per save after thousands of saves).
            return
        steps = self._steps(strict=False)
        above = [s for s in steps if s > step]
        if above and protect is not None and not chosen and not self.keep_abandoned:
            above = self._kept_above(above, protect)
        if above and protect is None:
            # Steps above this one are an abandoned branch only after a rollback through this
            # manager's load(); otherwise (a fresh job, another manager, a plain load) nothing
            # says they are abandoned, and deleting them could destroy the newest work: keep them.
            # (A late drain, point=False, keeps them quietly: they were committed after it.)
            if point:
                log.warning("distckpt: keeping %s under %s: numbered above the step just saved (%d), but this "
                            "manager did not resume from an older step, so they are not treated as an abandoned "
                            "branch; `latest` and load() now name step %d (newest by commit order)",
                            [step_dirname(s) for s in above], self.root, step, step)
            above_doomed: list[int] = []
        else:
            above_doomed = [] if self.keep_abandoned else above
        if above and protect is not None and self.keep_abandoned:
            log.warning("distckpt: keeping %s under %s: numbered above the step just saved (%d), they are an "
                        "abandoned branch (keep_abandoned=True): never rotated, not loaded by default",
                        [step_dirname(s) for s in above], self.root, step)
        # Steps a surviving step depends on (the links of its incremental chain) are never deleted:
        # their space is freed by the first rotation after no kept step needs them.
        if above_doomed:
            above_doomed = self._unneeded(above_doomed, [s for s in steps if s not in above_doomed])
        for old in above_doomed:
            log.warning("distckpt: deleting %s: abandoned branch -- step %d was just saved after a rollback, and "
                        "%s holds a later step of the run that was rolled back (keep_abandoned=True keeps such "
                        "steps)", self.path(old), step, step_dirname(old))
            guard(f"delete {self.path(old)}")
            self._store.remove_checkpoint(self.path(old))
        # The protection of the resumed-from step lasts one save: _settle ends it on every rank.
        if self.keep_last is None or not rotate:
            return
        branch = [s for s in steps if s <= step]
        # Keep the newest keep_last steps by number and by commit time (distckpt.rotation: after a
        # rollback the resumed branch is numbered below the abandoned one); the one just committed
        # and the step the job resumed from (for the first save after the resume) are always kept.
        doomed, by_time = beyond_keep_last(branch, self.keep_last, self._commit_time_reader())
        if by_time:
            log.warning("distckpt: keeping %s under %s beyond keep_last=%d by number: among the newest %d by "
                        "commit time (a rollback's resumed branch, or a step drained late)",
                        [step_dirname(s) for s in by_time], self.root, self.keep_last, self.keep_last)
        doomed = [s for s in doomed if s not in (step, protect)]
        if doomed:
            doomed = self._unneeded(doomed, [s for s in steps if s not in doomed and s not in above_doomed])
        for old in doomed:
            guard(f"delete {self.path(old)}")
            self._store.remove_checkpoint(self.path(old))

    def _unneeded(self, doomed: list[int], kept: list[int]) -> list[int]:
        """The steps of ``doomed`` that no step of ``kept`` depends on (the links of its incremental
        chain). When a kept step's chain cannot be read to its base, none: deleting a link that is
        unreadable only for a moment would break a chain for good, so rotation waits."""
        if is_url(self.root):  # chains are local only: incremental= is refused on object stores
            return doomed
        needed: set[str] = set()
        for s in kept:
            deps = chain.dependencies(self.path(s))
            if deps is None:
                log.warning("distckpt: not deleting %s: the incremental chain of %s cannot be read to its base, "
                            "so they may still be needed (verify it: distckpt verify %s)",
                            [step_dirname(d) for d in doomed], self.path(s), self.path(s))
                return []
            needed.update(deps)
        return [s for s in doomed if step_dirname(s) not in needed]

    def load(self, state_dict: Any, step: int | None = None, **kwargs: Any) -> LoadResult:
        """Load step ``step`` (default: :meth:`latest_step`, the newest by commit order) into
        ``state_dict`` (collective). The step loaded is remembered: the first save after it never
        rotates it away, and steps numbered above a later save are the abandoned branch.

        Raises CheckpointNotFoundError when there is no committed step, plus what
        :func:`distckpt.load` raises, and first the error of an earlier async save of this process
        that nobody waited for; ConfigError for a ``step`` that is neither None nor a step number."""
        if step is not None:
            check_step(step)
        self._count_call(kwargs)
        try:
            return self._load(state_dict, step, kwargs)
        except PeerLostError:
            self._note_group_lost()
            raise

    def _load(self, state_dict: Any, step: int | None, kwargs: dict) -> LoadResult:
        from .save_async import raise_background_failure
        raise_background_failure(None if kwargs.get("no_dist") else
                                 control_group(self.process_group, operation="CheckpointManager.load()"))
        chosen = step is not None
        passed: dict[int, str] = {}
        if step is None:
            step, passed = self._agreed_latest_step()
        if self.storage_options is not None:
            kwargs["storage_options"] = self.storage_options
        result = load(state_dict, self.path(step), process_group=self.process_group, **kwargs)
        if passed:
            result = dataclasses.replace(result, passed_over=passed)
        if self._saver is not None:  # the next save may be a delta against the step just loaded
            self._saver.resume(state_dict, self.path(step), process_group=self.process_group)
        self._note_resumed(step, chosen)
        return result

    def _note_resumed(self, step: int, chosen: bool) -> None:
        """Record that the job resumed from ``step`` (``chosen``: the caller named it): the next
        save protects it from rotation, and steps numbered above it are the abandoned branch.
        Also for a step an integration loaded from another format beside this root (torchtitan's
        DCP ``step-N`` folders), which this manager's own load() never sees."""
        with self._lock:
            self._resumed_from = step
            self._resume_chosen = chosen
            self._resume_gen += 1

    def _agreed_latest_step(self) -> tuple[int, dict[int, str]]:
        """:meth:`latest_step` as rank 0 finds it, with the steps it found not to decode, on every
        rank (one listing, not one per rank: ranks listing on their own could see a save commit in
        between, or fail alone and leave the others waiting at the load's collective). Collective.

        Raises CheckpointNotFoundError (no committed step) or the listing's error, on every rank."""
        group = control_group(self.process_group, operation="CheckpointManager.load()")
        found, error = None, None
        if group.rank == 0:
            try:
                found = self._latest()
                if found[0] is None:
                    raise CheckpointNotFoundError(f"no committed checkpoint under {self.root}", path=self.root)
            except Exception as exc:  # noqa: BLE001 - raised on every rank below
                error = exc
        group.exchange_outcome(error, operation="CheckpointManager.load()")
        return found if group.world_size == 1 else group.broadcast(found)

    def _count_call(self, kwargs: dict) -> None:
        with self._lock:
            if kwargs.get("no_dist"):
                self._no_dist_calls += 1
            else:
                self._collective_calls += 1

    def _note_group_lost(self) -> None:
        """Remember that a peer of ``process_group`` was lost (a PeerLostError of this manager's
        collectives, or of a caller that shares its group: distckpt.tiers' drain)."""
        with self._lock:
            self._group_lost = True

    def _closes_collectively(self) -> bool:
        """Whether :meth:`close` is collective: in a job (an initialized process group), once
        this manager made a collective save or load (not only ``no_dist=True`` ones, or none),
        unless a peer was lost since (the group can no longer decide anything; waiting for the
        lost rank would only time out)."""
        with self._lock:
            if self._group_lost:
                return False
            # No collective call yet (a manager only listed steps, or used on one rank to
            # inspect): nothing of it to decide with the peers, who may never call close().
            alone = self._collective_calls == 0
        return not alone and is_distributed()

    def close(self) -> None:
        """Wait for the async saves of this process still in flight (this manager's among them;
        saves are serialized per process, and the staging memory is the process's), raise the
        error of any that failed unseen (its own class), and free the async staging memory
        (:func:`distckpt.release_staging_memory`). Idempotent; the manager stays usable.

        Collective in a job, like :meth:`save` and :meth:`load` (every rank of ``process_group``
        calls it) once this manager made a collective save or load (not for one that only
        listed steps, or passed ``no_dist=True`` to every call): the unread
        failures are decided with every rank (:func:`distckpt.save_async.raise_background_failure`),
        so every rank raises or none does -- an unread failure of a collective save on every rank
        (the same class), a failed one-rank save of one rank on that rank (its own error) and a
        collective error naming it on the others. Used as a context manager, a ``with`` block left
        by an exception decides on this rank alone (its peers may not be closing; the exception in
        flight is not masked); so does a close after a collective of this manager raised
        PeerLostError (the lost rank will never close), which also raises this rank's own error
        of a collective async save on that group that nobody read.

        Raises:
            The error of an async save that failed unseen (above); RanksMissingError /
            PeerLostError when some ranks do not close (bounded by DISTCKPT_ARRIVAL_TIMEOUT_S) or
            the exchange fails.
        """
        self._close(collective=True)

    def _close(self, *, collective: bool) -> None:
        from .save_async import raise_background_failure, wait_for_saves
        from .staging.pool import release_staging_memory
        try:
            wait_for_saves()  # the one registry of saves in flight (distckpt.async_save)
            # With the group, as save()/load() do: decided on this rank alone, a failure of one
            # rank's own save made only that rank raise here (its peers went on as if nothing
            # failed), and an unread collective failure was raised by no rank at all.
            group = (control_group(self.process_group, operation="CheckpointManager.close()")
                     if collective and self._closes_collectively() else None)
            with self._lock:
                lost = self._group_lost
            # A group that lost a peer decides nothing more: this rank's own error of a collective
            # save on it that nobody read is raised here, alone (else close would return as if
            # that save had committed, and the error would surface only as a log line at exit).
            raise_background_failure(group, lost=group_members(self.process_group) if lost else None)
        except PeerLostError:
            self._note_group_lost()  # a second close() decides alone, at once
            raise
        finally:
            release_staging_memory()

    def __enter__(self) -> "CheckpointManager":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:  # do not mask the error in flight; still wait and free the memory
            try:
                # On this rank alone: an exception may have left this block on some ranks only,
                # and a collective here would wait for peers that are not closing.
                self._close(collective=False)
            except Exception as close_exc:  # noqa: BLE001
                log.error("distckpt: while closing the CheckpointManager after %s: %s", exc_type.__name__, close_exc)
