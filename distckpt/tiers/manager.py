"""TieredCheckpointManager: commit each step on node-local disks, drain it to an object store (or
any other root) in the background, restore from the fastest tier that holds a complete copy.

    mgr = TieredCheckpointManager(local="/nvme/ckpt/run7", remote="s3://bucket/run7",
                                  keep_last_local=2, keep_last_remote=20, storage_options=...)
    mgr.save(step, state_dict)            # blocked for a local save (or a staging copy: blocking=False)
    mgr.status(step)                      # per tier: local committed, remote queued/draining/committed/failed
    mgr.wait_durable(step)                # until the remote tier holds it (typed error if it cannot)
    mgr.load(state_dict)                  # newest step with a complete copy, each file from the nearest tier
    mgr.close()                           # waits for the drains; says which steps are not remote

The tiers (docs/TIERS.md):
  * local: a directory private to each node (each node passes its own path). A save commits there
    with distckpt's protocol, per node (distckpt.tiers.localcommit): every node's directory holds
    the same MANIFEST and its own ranks' data files. That commit is what the training loop waits for.
  * remote: an object-store URL (or a shared directory): each committed step is copied there byte
    for byte by a background drain (distckpt.tiers.drain, run by distckpt.tiers.drainer's thread on
    every rank), data files in parallel, checksums verified as they are read, MANIFEST last.

Invariants:
  * The only copy is never deleted: a local step goes (keep_last_local) only once the remote tier
    holds the same save (same save id); the remote tier rotates with its own keep_last_remote
    after each drain, like a CheckpointManager root.
  * A remote step is visible only complete (its MANIFEST is written last, conditionally); a drain
    that fails or is interrupted leaves nothing visible, is retried while the manager runs, and is
    resumed by the next manager start (every step complete locally and not remote is queued); a
    drain a lost peer stopped is restarted, on a new channel, by the next save.
  * A load never mixes two saves: every file comes from a copy of the same save id
    (distckpt.tiers.load).
  * Everything here that involves other ranks is collective, in the same order on every rank:
    the constructor, save, load, latest_step, close. status and wait_durable are local.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import threading
import time
import uuid
from typing import Any

from .._dist import _drop_side_group, _portable, control_group, group_destroyed, group_members
from ..config import get_config
from ..listing import _STEP_RE
from .. import commitclock
from ..commit import SaveResult
from ..errors import (CheckpointExistsError, CheckpointNotFoundError, ChecksumMismatchError, ConfigError, DistCkptError,
                      DataFileTruncatedError, DiskFullError, EndpointUnreachableError, ManifestCorruptError,
                      NotDurableError,
                      ObjectStoreError, PeerLostError, ProcessGroupDestroyedError, SaveInProgressError, StoragePermissionError, ThrottledError,
                      TierIncompleteError, TierMismatchError)
from ..sizes import format_bytes
from ..manager import CheckpointManager, check_staging_option, check_step, check_timeout, step_dirname
from ..restore import LoadResult
from ..rotation import beyond_keep_last
from ..storage import ROOT_LOCK_NAME, is_url, join, normalize_path, open_store
from ..storage.posix.guards import check_memory_room, check_save_space
from .drain import drain_step
from .drainer import Drainer, wait_for
from .load import load_tiered, step_availability
from .localcommit import save_node_local
from .nodes import node_layout
from .owner import OWNER_NAME, RemoteOwner
from .peers import remove_peer_areas
from .records import TIER_ID_NAME, TIER_RECORD_NAME, read_drained, record_drained, tier_id

__all__ = ["TieredCheckpointManager", "TierStatus"]


log = logging.getLogger("distckpt")


@dataclasses.dataclass(frozen=True)
class TierStatus:
    """Where one step stands on each tier, as this rank sees it.

    ``local``: ``committed`` (this node's directory holds the step), ``saving`` (this rank's save
    of it is in flight, e.g. an async save not yet committed), ``damaged`` (its MANIFEST there
    does not decode: a load passes this copy over) or ``absent``.
    ``remote``: ``committed`` (the remote tier holds this save), ``queued``, ``draining``,
    ``retrying`` (the last try failed with ``error``; another follows), ``failed`` (for good:
    ``error``), ``stopped`` (the manager closed first), ``absent``, or ``other`` (the remote tier
    holds another save of this step number). ``sent``/``to_send``: this rank's bytes of the
    drain in progress, ``sent`` counting what was read and handed to the upload (up to its part
    buffers ahead of what the store acknowledged; ``sent == to_send`` is not "uploaded": the
    step is on the remote tier only once ``remote`` is ``committed``). ``save_id``: the save this rank's node holds (else the remote's).
    ``replicas`` (with ``replicas=k``): ``pending``, ``replicated`` (every data file has its k
    copies on other nodes, each verified on arrival) or ``failed`` (``replica_error``); ``off``
    without replicas. Known to the manager that saved or drained the step: ``unknown`` for a step
    this manager never queued (a new manager's view of steps an earlier one drained; their replicas,
    if any, are still used by a restore)."""

    step: int
    local: str
    remote: str
    save_id: str | None = None
    sent: int = 0
    to_send: int = 0
    tries: int = 0
    error: BaseException | None = None
    replicas: str = "off"
    replica_error: BaseException | None = None

    @property
    def durable(self) -> bool:
        """True when the remote tier holds the step."""
        return self.remote == "committed"


def _notes_lost_peer(method):
    """A collective method of the manager: a PeerLostError it raises tells the local manager that
    its group lost a peer, so that close() then decides on this rank alone."""
    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        try:
            return method(self, *args, **kwargs)
        except PeerLostError:
            self._local._note_group_lost()
            raise
    return wrapper


_DRAIN_CHANNELS: dict[tuple[int, ...], int] = {}
_DRAIN_CHANNELS_LOCK = threading.Lock()


def _drain_channel(process_group: Any) -> str:
    """The control-group channel of the next tiered manager's drain on ``process_group``."""
    key = group_members(process_group)
    with _DRAIN_CHANNELS_LOCK:
        n = _DRAIN_CHANNELS[key] = _DRAIN_CHANNELS.get(key, -1) + 1
    return f"drain:{n}"


def _outage(exc: BaseException) -> bool:
    """Whether ``exc`` says the remote tier does not answer (its endpoint, throttling, a server
    error), as opposed to refusing (configuration, credentials, a missing bucket)."""
    return isinstance(exc, (EndpointUnreachableError, ThrottledError)) or (
        isinstance(exc, ObjectStoreError) and (getattr(exc, "status", None) or 0) >= 500)


def _filled_by_every_try(error: BaseException, earlier: list) -> None:
    """Set ``error``'s ``filled`` / ``partly_filled`` (the last try of a load of one save) to
    what every try of it left: a key an earlier try filled holds verified bytes of that same save
    whatever the later tries did (they write only verified bytes of it too), so it is filled; a
    key only ever partly written is partly filled. Left alone when some try cannot tell (None)."""
    tries = [e for e in [*earlier, error] if isinstance(e, DistCkptError)]
    if not tries or any(getattr(e, "filled", None) is None for e in tries):
        return
    filled = set().union(*(e.filled for e in tries))
    partly = set().union(*(e.partly_filled or () for e in tries)) - filled
    if filled != set(error.filled) or partly != set(error.partly_filled or ()):
        # Its message speaks of its own try only.
        error.add_note(f"distckpt: with the earlier tries of this load, filled with verified bytes of the save: "
                       f"{sorted(filled)[:20]}, partly: {sorted(partly)[:20]}")
    error.filled, error.partly_filled = sorted(filled), sorted(partly)
    error.details.update(filled=error.filled, partly_filled=error.partly_filled)


def _passed_over(result: LoadResult, passed: dict[int, str]) -> LoadResult:
    """``result`` with the steps a load passed over (LoadResult.passed_over)."""
    return dataclasses.replace(result, passed_over=dict(sorted(passed.items()))) if passed else result


class TieredCheckpointManager:
    """Numbered checkpoints on two tiers: node-local first, then drained to ``remote``.

    Args:
        local: this node's local directory (private to the node, e.g. its NVMe; each node may pass
            another path). Created if missing.
        remote: the durable root shared by every node: an object-store URL (``s3://bucket/run7``)
            or a directory every rank sees.
        keep_last_local: committed steps each node keeps locally (>= 1). Older ones are deleted
            only once the remote tier holds them; until then they stay, whatever this says.
        keep_last_remote: steps the remote tier keeps (None: all).
        storage_options: fsspec options of the remote tier (as :func:`distckpt.save`).
        process_group: the ranks of the job (default: the world).
        drain_timeout_s: how long :meth:`close` waits for drains in flight by default (None: no bound).
        replicas: copies of each rank's data files kept on that many OTHER nodes' local tiers
            (distckpt.tiers.peers), made by the background thread before the step's drain,
            verified on arrival. A replaced node then restores its ranks' files from its peers
            without reading the remote tier. Needs replicas + 1 nodes; 0: none.

    The constructor is collective: it finds which ranks share a local directory (a "node"),
    creates the drain's control group, checks the remote tier (endpoint, credentials, bucket,
    a removed probe object: typed errors before any save) and queues the drain of every step
    that a previous run committed locally but never drained.

    Raises:
        ConfigError: a bad argument (local is a URL, remote equals local, keep_last_local < 1).
        SaveInProgressError: another live manager uses the local tier, or owns the remote tier
            (another job's: distckpt.tiers.owner), on any node.
        The typed errors of the remote check (EndpointUnreachableError, ObjectStoreAccessError,
        BucketNotFoundError...), raised on every rank.
    """

    def __init__(self, local: str | os.PathLike, remote: str | os.PathLike, *, keep_last_local: int = 2,
                 keep_last_remote: int | None = None, storage_options: dict | None = None,
                 process_group: Any = None, drain_timeout_s: float | None = 600.0, replicas: int = 0) -> None:
        if is_url(local):
            raise ConfigError(f"local={local!r}: the local tier is a directory on this node, not a URL")
        if not isinstance(keep_last_local, int) or isinstance(keep_last_local, bool) or keep_last_local < 1:
            raise ConfigError(f"keep_last_local={keep_last_local!r} must be a positive int")
        if not isinstance(replicas, int) or isinstance(replicas, bool) or replicas < 0:
            raise ConfigError(f"replicas={replicas!r} must be a non-negative int")
        self.replicas = replicas
        if drain_timeout_s is not None and (isinstance(drain_timeout_s, bool)
                                            or not isinstance(drain_timeout_s, (int, float))
                                            or not 0 <= drain_timeout_s < float("inf")):
            raise ConfigError(f"drain_timeout_s={drain_timeout_s!r} must be a non-negative number of seconds or None")
        self.local_root = normalize_path(local)
        self.remote_root = normalize_path(remote)
        if self.local_root == self.remote_root:
            raise ConfigError(f"local and remote are the same root ({self.local_root}): a tier needs a copy elsewhere")
        self.keep_last_local = keep_last_local
        self.storage_options = storage_options
        self.process_group = process_group
        self.drain_timeout_s = drain_timeout_s
        # The local tier is read and rotated through a plain manager of this node's directory
        # (its saves are not used: a tiered save commits per node, distckpt.tiers.localcommit).
        self._local = CheckpointManager(self.local_root, process_group=process_group)
        # The remote tier is a plain manager root: its listing, `latest` and keep_last rotation.
        self._remote = CheckpointManager(self.remote_root, keep_last=keep_last_remote,
                                         storage_options=storage_options, process_group=process_group)
        self._local_store = open_store(self.local_root)
        self._remote_store = open_store(self.remote_root, storage_options)
        self._group = control_group(process_group, operation="TieredCheckpointManager()")
        self._layout = node_layout(self._group, self.local_root)
        if replicas and replicas >= len(self._layout.leaders):
            raise ConfigError(f"replicas={replicas} needs at least {replicas + 1} nodes (ranks that see different local "
                              f"directories); this job has {len(self._layout.leaders)}",
                              remedy="Lower replicas, or give each node its own local directory.")
        # step -> (state, error) of its replication: "replicated" or "failed" (the drain thread's).
        self._replication: dict[int, tuple[str, BaseException | None]] = {}
        self._owner = self._own_local_tier()
        if self._layout.is_leader:
            # What peer transfers that died left (replicas, a load's fetch): none can be in
            # flight now, with the local tier owned and no drain thread started yet.
            try:
                remove_peer_areas(self.local_root)
            except DistCkptError as exc:
                log.warning("distckpt: could not remove the areas of unfinished peer transfers under %s: %s",
                            self.local_root, exc)
        # step -> save id of what this manager knows the remote tier holds (found at construction,
        # drained since): the steps a save must not reuse (:meth:`_check_step_free`).
        self._remote_held: dict[int, str] = {}
        # Whether the remote tier's steps were listed at construction (else ``_remote_held`` may
        # lack steps it holds, which its keep_last_remote rotation counts): see _known_remote_id.
        self._remote_listed = False
        self._remote_down: str | None = None  # the remote tier's error when it last did not answer
        self._remote_down_error: BaseException | None = None  # that error itself
        # step -> save id of the local steps not drained because keep_last_remote would rotate
        # them away at once (_not_rotated_away): what wait_durable says of them; a save of the
        # same number since (another save id) drains as any other.
        self._not_sent: dict[int, str] = {}
        # Local steps queued at construction that the remote tier holds a later commit than: their
        # drain must not point the remote `latest` back at them (_not_rotated_away).
        self._late: set[int] = set()
        # The steps queued at construction while the remote tier did not answer: which of them to
        # skip (and which are late) is decided at the first drain, once it answers (_drain_one).
        self._dark_queue: list[tuple[int, str]] | None = None
        # Whether this manager checked the tiers' pairing (_pair_tiers): at construction when the
        # remote tier answers, else on the drain thread before its first drain.
        self._paired = False
        # Whether a load checks the pairing first (_check_unpaired_remote): the remote tier did not
        # answer at construction. Set and cleared on every rank alike (from collective outcomes),
        # never from _paired, which each rank's drain thread sets on its own: ranks deciding apart
        # would leave some in the check's collectives.
        self._check_before_load = False
        self._remote_owner: RemoteOwner | None = None
        try:
            remote_up = self._check_remote()
            # One live manager per remote root (distckpt.tiers.owner): taken now when the remote
            # tier answers, else by the first drain (before it writes anything there).
            self._remote_owner = RemoteOwner(self._group, self._layout, self._local_store, self.local_root,
                                             self._remote_store, self.remote_root)
            if remote_up:
                self._pair_tiers(self._group)
                self._paired = True
            self._check_before_load = not remote_up
            # The drain's own channel: its collectives never interleave with the training thread's.
            # Bounded by DISTCKPT_DRAIN_TIMEOUT_S, not DISTCKPT_TIMEOUT_S: a rank with less to upload
            # waits at the drain's gather for the slowest rank's upload, which is no lost peer.
            # A channel per manager (built collectively, so the count agrees on every rank): a drain
            # thread an earlier manager's close left inside a held request may still run collectives
            # on its own channel, and they must never pair with this manager's. exit_safe: such a
            # thread may still wait in a collective when the process exits (distckpt._dist).
            self._drain_channel: str | None = None
            self._drain_group = self._new_drain_group()
            self._closed = False
            # The local tier's room is checked once, when the first save tells a step's size.
            self._room_checked: bool | None = None
            self._saving: set[int] = set()  # steps whose local save is in flight on this rank
            # step -> the AsyncSaveHandle of its async local save, from save() until it commits (its
            # drain is then queued and the drain's state says the rest); a failed one stays, so that
            # wait_durable raises its error. Written by the caller's and the save's threads.
            self._async_saves: dict[int, Any] = {}
            self._async_lock = threading.Lock()
            self._first_async = None  # the handle of a first save made with blocking=False
            self._drainer = self._new_drainer()
            for step, save_id in self._undrained(remote_up):
                log.warning("distckpt: step %d is committed on the local tier but not on %s: draining it now",
                            step, self.remote_root)
                self._drainer.enqueue(step, save_id)
        except BaseException as exc:
            if isinstance(exc, StoragePermissionError) and str(exc.path or "").startswith(self.remote_root):
                exc.add_note(f"distckpt: a TieredCheckpointManager owns its remote tier while it lives (its owner lock "
                             f"or lease, the tier identity), so it needs {self.remote_root} writable even in a job that "
                             f"only loads. To load from a read-only copy, use distckpt.load(state_dict, "
                             f"'{self.remote_root}/step_N') or CheckpointManager('{self.remote_root}').load(...), or "
                             f"the local tier's step directory the same way.")
            # Nothing of a manager that failed to build stays behind: its drain thread, and the
            # tiers' owners (a retry in this process would find its own leaked locks held).
            drainer = getattr(self, "_drainer", None)
            if drainer is not None:
                try:
                    drainer.close(0)
                except Exception:  # noqa: BLE001 - the construction's own error is what is raised
                    pass
            self._release_owner()
            raise

    def _new_drain_group(self):
        """A control group on a new drain channel (collective: every rank builds it at the same
        point, so the channel numbers agree), remembered in ``_drain_channel``."""
        if self._group.world_size == 1:
            return self._group
        self._drain_channel = _drain_channel(self.process_group)
        return control_group(self.process_group, channel=self._drain_channel, timeout_s=get_config().drain_timeout_s,
                             exit_safe=True)

    def _new_drainer(self, history: dict | None = None) -> Drainer:
        return Drainer(self._drain_one, self._vote, name=f"distckpt-drain:{os.path.basename(self.local_root)}",
                       history=history, ahead=self._replicate_ahead)

    def _control(self, operation: str):
        """The control group for one collective call, taken anew each call (every rank calls it
        at the same point): after a peer was lost (a collective of the last call failed, and gloo
        closed the group's connections), its arrival check makes every rank build a new one
        together (distckpt._dist.control_group). A cached group would fail every later call of
        the run at once."""
        if self._group.world_size > 1:
            self._group = control_group(self.process_group, operation=operation)
        return self._group

    def _restart_lost_drain(self, reports: list) -> None:
        """Start a new drain thread on a new drain channel, on every rank, when a peer lost during
        a drain stopped the drain threads (``reports``: every rank's :meth:`_drain_report`, as
        all-gathered, so every rank decides the same): the old channel's collectives can never
        run again, and without this no step of the run would reach the remote tier (nor leave
        the local one: only drained steps are rotated away) until the job restarted. The steps
        the old threads left (every rank's, in step order) are queued first. Nothing happens
        while some rank's old thread still runs (it is still inside a collective that its
        deadline, DISTCKPT_DRAIN_TIMEOUT_S, ends): the next save decides again."""
        if not any(r[0] == "lost" for r in reports):
            return
        if any(r[0] == "running" for r in reports):
            log.warning("distckpt: a peer was lost during a drain, but the drain thread of rank(s) %s still runs "
                        "(inside a collective its deadline ends): the drain restarts at a later save",
                        [i for i, r in enumerate(reports) if r[0] == "running"])
            return
        left: dict[int, str | None] = {}
        for _, steps in reports:
            for step, save_id in steps:
                if left.get(step) is None:
                    left[step] = save_id
        old = self._drainer
        log.warning("distckpt: restarting the drain on a new channel after a lost peer (%s); draining steps %s "
                    "first", old.lost_peer(), sorted(left))
        if self._drain_channel is not None:
            _drop_side_group(self.process_group, self._drain_channel)
        self._drain_group = self._new_drain_group()
        self._drainer = self._new_drainer(history=old.states())
        for step in sorted(left):
            self._drainer.enqueue(step, left[step])

    def _drain_report(self) -> tuple[str, list]:
        """This rank's drain thread for :meth:`_restart_lost_drain`: ("lost", the steps it left)
        once a lost peer stopped it, ("stopped", []) when it stopped otherwise, else ("running", [])."""
        if self._drainer.lost_peer() is not None:
            return "lost", self._drainer.left_by_lost_peer()
        return ("running" if self._drainer.alive else "stopped"), []

    # -- paths ------------------------------------------------------------------------------------

    def local_path(self, step: int) -> str:
        """This node's directory of ``step``."""
        return join(self.local_root, step_dirname(step))

    def remote_path(self, step: int) -> str:
        """The remote tier's location of ``step``."""
        return join(self.remote_root, step_dirname(step))

    # -- saving -----------------------------------------------------------------------------------

    @_notes_lost_peer
    def save(self, step: int, state_dict: Any, *, blocking: bool = True, **kwargs: Any):
        """Save ``state_dict`` as ``step`` on the local tier (collective), then queue its drain.

        Returns the local save's SaveResult once every node committed it (``blocking=False``: an
        AsyncSaveHandle as soon as the state is staged; the drain is queued when it commits).
        Keyword arguments are :func:`distckpt.save`'s (overwrite, metadata, allow_pickle, replicated;
        with ``blocking=False`` also :func:`distckpt.async_save`'s ``stage_in_background``).

        Raises what :func:`distckpt.save` raises; a commit that only some nodes completed raises
        with ``committed = False`` and ``published_nodes`` (not a complete local copy: never
        drained, never loaded). The drain's own errors never come from here: see :meth:`status`,
        :meth:`wait_durable` and :meth:`close`.
        """
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            raise ConfigError(f"step={step!r} must be a non-negative int")
        if self._closed:
            raise ConfigError("this TieredCheckpointManager is closed")
        check_staging_option(blocking, kwargs)
        for bad in ("storage_options", "process_group", "incremental"):
            if bad in kwargs:
                raise ConfigError(f"{bad}= is not a save option of a TieredCheckpointManager (give it to the "
                                  f"manager, or not at all: incremental chains are not tiered)")
        self._control("TieredCheckpointManager.save()")
        if self._check_step_free(step) and not kwargs.get("overwrite"):
            kwargs["overwrite"] = True  # an incomplete copy that no load takes (the same on every rank)
        after = functools.partial(self._after_local_commit, step)
        lock = join(self.local_root, ROOT_LOCK_NAME)
        if self._layout.is_leader:
            # Dead leftovers of any step (a save killed mid-write leaves a .step_N.tmp-* that no
            # later save of another number would reclaim: steps only go up), never those of a
            # live save (this process's async save in flight holds the root lock). Housekeeping:
            # a failure is logged, never raised on one rank.
            try:
                # Steps' leftovers only: the records beside them (the drained record, written by
                # the drain thread without the root lock) leave temporaries of the same form.
                self._local_store.reclaim(self.local_root, only=lambda name: _STEP_RE.match(name) is not None)
            except DistCkptError as exc:
                log.warning("distckpt: could not reclaim leftovers of dead saves under %s: %s", self.local_root, exc)
        self._saving.add(step)

        outcome: dict[str, bool] = {}  # "ok": how the local save ended, once it has

        def settled(result: SaveResult | None, error: BaseException | None) -> None:
            try:
                if isinstance(error, PeerLostError):  # an async save's (the blocking one's: the decorator)
                    self._local._note_group_lost()
                if result is not None:
                    # Queued before the handle is dropped: a wait_durable that finds no handle finds
                    # the drain's state.
                    self._drainer.enqueue(step, result.save_id)
                elif getattr(error, "committed", None) is True and getattr(error, "save_id", None):
                    # Committed locally, then an error after the commit (the `latest` pointer, the
                    # local rotation): the step is on this node's disk only until it is drained.
                    self._drainer.enqueue(step, error.save_id)
                with self._async_lock:
                    outcome["ok"] = result is not None
                    if result is not None:
                        self._async_saves.pop(step, None)  # a failed earlier save of the step, too
            finally:
                # Only now: a status() in between finds the step saving or queued, never neither
                # (its replicas "pending", not "unknown").
                self._saving.discard(step)

        if self._room_checked is None and self._first_async is not None:
            # The first save was async: its outcome is known on every rank once its handle is done
            # (the verdict is collective), so every rank takes the same branch here. The next save
            # would wait for it anyway (saves are serialized per process).
            first, self._first_async = self._first_async, None
            first.wait()
            if first.exception() is None:
                self._check_local_room(first.result().bytes_per_rank)
        if not blocking:
            handle = save_node_local(state_dict, self.local_path(step), layout=self._layout,
                                     process_group=self.process_group, blocking=False, after_commit=after,
                                     lock_path=lock, on_outcome=settled, **kwargs)
            with self._async_lock:
                # The save's thread may have settled already: a committed save needs no handle here.
                if not outcome.get("ok"):
                    self._async_saves[step] = handle
            if self._room_checked is None:
                self._first_async = handle
            return handle
        try:
            result = save_node_local(state_dict, self.local_path(step), layout=self._layout,
                                     process_group=self.process_group, blocking=True, after_commit=after,
                                     lock_path=lock, **kwargs)
        except BaseException as exc:
            settled(None, exc)
            raise
        else:
            settled(result, None)
        finally:
            self._saving.discard(step)
        if self._room_checked is None:
            self._check_local_room(result.bytes_per_rank)
        return result

    def _check_owner(self, operation: str) -> None:
        """Raise SaveInProgressError on every rank when a node's leader no longer holds the local
        tier's owner lock: the directory was removed or replaced under this manager (its pairing
        record went with it), and another manager may have taken the new one, whose steps this
        one must not list or load as its own. Collective. (A save checks it in
        :meth:`_check_step_free`'s exchange.)"""
        error = None
        if self._owner is not None:
            try:
                self._owner.check(f"{operation} on the local tier {self.local_root}")
            except SaveInProgressError as exc:
                error = exc
        self._group.exchange_outcome(error, operation=operation)

    def _check_step_free(self, step: int) -> bool:
        """Refuse, on every rank (rank 0 decides; one all-gather), a step number whose drain is
        still queued or running here (its local files would change under the drain's reads) or
        that the remote tier already holds (a drain never replaces a remote step: another run's,
        or this run's before a rollback). The remote is asked only when this manager knows it
        holds the step (the steps found at construction and those drained since), so a save
        costs no request.

        The same all-gather carries each rank's :meth:`_drain_report`: a drain that a lost peer
        stopped is restarted here (:meth:`_restart_lost_drain`).

        Returns True when the nodes' local copies of the step do not make one whole save (some
        nodes hold none, or another save: a save killed between the nodes' publishes; or every
        node the same save with files missing: a node lost since, the job resumed on the others)
        and the remote tier does not hold it: no load takes such a step (it is passed over), so
        this save replaces it, with a warning, where it raised CheckpointExistsError on the nodes
        that hold a copy and stopped the resumed run at the step its load() said was free.
        Decided from the same all-gather: the same on every rank.

        Raises SaveInProgressError (a drain of the step in flight, or the local tier's owner lock
        removed or replaced: the directory wiped under this manager) or CheckpointExistsError."""
        from .load import _local_copy
        error, mine = None, None
        if self._layout.is_leader:
            try:
                if self._owner is not None:
                    # The local directory wiped or replaced under this manager (a node's disk
                    # cleaned by hand): its owner lock and its pairing record went with it, so a
                    # second manager could take the directory and pair it with another remote
                    # tier while this one goes on saving into it.
                    self._owner.check(f"TieredCheckpointManager.save() on the local tier {self.local_root}")
                mine = _local_copy(self._local_store, self.local_path(step))[0]
            except Exception as exc:  # noqa: BLE001 - raised on every rank below
                error = exc
        if self._group.rank == 0 and error is None:
            st = self._drainer.state(step)
            if st is not None and not st.done.is_set():
                error = SaveInProgressError(
                    f"step {step} is being drained to {self.remote_root} ({st.state}); a save of the same number now "
                    f"would change its files under the drain", path=self.local_path(step), owner=None,
                    remedy="Save it under another step number, or wait_durable(step) first.")
            elif step in self._remote_held:
                try:
                    there = self._remote_store.committed_save_id(self.remote_path(step))
                except Exception as exc:  # noqa: BLE001 - cannot tell: the drain refuses later if needed
                    log.warning("distckpt: cannot tell whether %s holds step %d (%s: %s)", self.remote_root, step,
                                type(exc).__name__, exc)
                    there = None
                if there is not None:
                    error = CheckpointExistsError(
                        f"step {step} is already on the remote tier {self.remote_root} (save {there}): a tiered save "
                        f"never replaces a remote step", path=self.remote_path(step),
                        remedy="Save under a new step number (after a rollback: the next number after the newest "
                               "step), or use another remote root for a new run.")
                else:
                    self._remote_held.pop(step, None)
        reports = self._group.exchange_outcome(error, operation="TieredCheckpointManager.save()",
                                               extra=(self._drain_report(), mine))
        self._restart_lost_drain([r[0] for r in reports])
        copies = [reports[leader][1] for leader in self._layout.leaders]
        held = [c.save_id if c is not None else None for c in copies]
        present = [c for c in copies if c is not None]
        whole = (present and None not in held and len(set(held)) == 1
                 and len(frozenset().union(*(c.files for c in present))) == present[0].nfiles)
        if present and not whole:
            # Not one whole save on the nodes: still loadable when the copies (replicas included)
            # hold every file of one save between them, or when the remote tier holds it
            # (collective: every rank got here from the same all-gather).
            tiers = self._availability()[0].get(step)
            if tiers is not None and (tiers.local_complete or tiers.remote_save_id is not None):
                return False
            log.warning("distckpt: replacing step %d on the local tier: the nodes' copies (saves %s, %s of its data "
                        "files) are no whole save and the remote tier does not hold it, so no load takes it (a save "
                        "interrupted between the nodes' publishes, or a node lost since)", step, held,
                        [len(c.files) if c is not None else 0 for c in copies])
            return True
        return False

    def _check_local_room(self, sizes: list[int]) -> None:
        """The local tier's pre-flight, once, after the first save told the size of a step: each
        node's leader checks that its disk has room for keep_last_local more steps of its ranks'
        bytes and of the peers' replicas it holds (the steady state holds keep_last_local steps while
        the next is written); on a tmpfs also the host's available memory. Collective, in the
        caller's thread.

        Raises DiskFullError on every rank (``committed = True``: the step just saved is committed)
        when a node's disk is too small, with the numbers and a remedy, so a run learns it at its
        first save instead of at its keep_last_local-th."""
        self._room_checked = True
        error = None
        if self._layout.is_leader:
            layout = self._layout
            node_bytes = sum(sizes[r] for r in layout.ranks_of(layout.node))
            from .peers import replica_bytes_of_node
            replica_bytes = replica_bytes_of_node(layout, sizes, self.replicas, layout.node)
            step_bytes = node_bytes + replica_bytes
            what = f"this node's {format_bytes(node_bytes)}"
            if replica_bytes:
                what += f" and {format_bytes(replica_bytes)} of its peers' replicas (replicas={self.replicas})"
            try:
                check_save_space(self.local_root, self.keep_last_local * step_bytes, rank=self._group.rank)
                # A local tier in host memory (tmpfs): its pages come out of RAM, not a disk.
                check_memory_room(self.local_root, self.keep_last_local * step_bytes, rank=self._group.rank)
            except DiskFullError as exc:
                error = DiskFullError(
                    f"{exc.message}: the local tier needs room for keep_last_local={self.keep_last_local} more steps "
                    f"of {what} each (the first is saved and committed)",
                    path=self.local_root, rank=self._group.rank, errno=exc.errno, committed=True,
                    needed=exc.details.get("needed"), free=exc.details.get("free"),
                    remedy="Free space on the local disk or lower keep_last_local (or replicas); the steps saved "
                           "so far are committed and draining.")
                log.error("distckpt: %s", error)
            except Exception as exc:  # noqa: BLE001 - a failed statvfs: the saves themselves check space
                log.warning("distckpt: could not check the room on %s: %s: %s", self.local_root, type(exc).__name__,
                            exc)
        self._group.exchange_outcome(error, operation="TieredCheckpointManager.save()")

    def _after_local_commit(self, step: int) -> None:
        """On each node's leader, inside the local commit (holding the local root lock): point
        this node's ``latest`` at ``step`` and delete its local steps beyond keep_last_local that
        the remote tier holds (the same save). A step the remote tier does not hold (yet) stays."""
        self._local_store.replace_pointer(join(self.local_root, "latest"), (step_dirname(step) + "\n").encode())
        self._rotate_local(keep=step)

    def _rotate_local(self, keep: int | None) -> list[int]:
        """Delete this node's local steps beyond keep_last_local (neither among the newest by number
        nor among the newest by commit time: distckpt.rotation) whose same save (same save id) the
        remote tier is known to hold: found there at construction or drained by this manager
        (``_remote_held``; a step drained and then dropped by the remote tier's own
        keep_last_remote rotation counts: neither tier's policy keeps it). Any other step stays,
        whatever keep_last_local says: it may be the only copy. Returns the steps deleted.

        What the remote tier holds is what this manager knows, never asked of the remote tier here:
        this runs inside the local commit, which must not wait on a remote tier that does not
        answer. A step this manager does not know to be remote stays until it does (the next
        manager start finds it)."""
        steps = self._local._steps(strict=False)  # a step it cannot look at is kept (a warning says so)
        # The newest by number and by commit time stay (distckpt.rotation: a rollback's resumed
        # branch is numbered below the abandoned one; local MANIFESTs are peeked, 4 KiB each).
        doomed, _ = beyond_keep_last(steps, self.keep_last_local, self._local._commit_time_reader())
        doomed = [s for s in doomed if s != keep]
        if not doomed:
            return []
        removed = []
        held = dict(self._remote_held)  # the drain thread adds to it
        for s in doomed:
            # No count of newer remote steps decides here: after a rollback those include steps of
            # the abandoned branch (numbered above the resumed one), which say nothing about
            # whether this branch's step ever reached the remote tier.
            try:
                local_id = self._local_store.committed_save_id(self.local_path(s))
            except Exception as exc:  # noqa: BLE001 - cannot tell: keep it
                log.warning("distckpt: keeping local step %d beyond keep_last_local=%d: its MANIFEST does not "
                            "read (%s: %s)", s, self.keep_last_local, type(exc).__name__, exc)
                continue
            if local_id is None or held.get(s) != local_id:
                log.info("distckpt: keeping local step %d beyond keep_last_local=%d: the remote tier is not known "
                         "to hold it (this save of it)", s, self.keep_last_local)
                continue
            self._local_store.remove_checkpoint(self.local_path(s))
            removed.append(s)
        return removed

    # -- the drain (the drainer's thread) ---------------------------------------------------------

    def _drain_one(self, step: int, save_id: str | None, progress, assigned) -> int:
        try:
            return self._drain_one_step(step, save_id, progress, assigned)
        except Exception as exc:
            if self._drain_group.world_size > 1 and group_destroyed(self._drain_group):
                # This process destroyed the process group with the manager open (no close()):
                # the drain's collectives fail with torch's own error ("Group ... is not
                # registered"), which said nothing of the cause. The drain thread stops on it.
                raise ProcessGroupDestroyedError(
                    f"the process group was destroyed (torch.distributed.destroy_process_group()) while the "
                    f"TieredCheckpointManager was open: the drain of step {step} cannot run its collectives; the step "
                    f"stays committed on the local tier {self.local_root}, and the next manager start drains it",
                    path=self.local_path(step), committed=False,
                    remedy="Call TieredCheckpointManager.close() (it waits for the drains) before "
                           "destroy_process_group().") from exc
            raise

    def _drain_one_step(self, step: int, save_id: str | None, progress, assigned) -> int:
        if self.replicas and step not in self._replication:
            self._replicate(step)
        if not self._paired:
            # The remote tier did not answer at construction: nothing may drain into it before
            # it is known to be the tier this node's local tier drains to. A mismatch is a
            # ConfigError: this drain, and each later one, fails for good naming it.
            self._pair_tiers(self._drain_group)
            self._paired = True
        if self._dark_queue is not None:
            # Queued at construction while the remote tier did not answer: the listing that says
            # which of them its keep_last_remote rotation would drop at once, and which are late,
            # made now that it answers (once; collective on the drain channel, where every rank's
            # thread is at this drain). It re-drained them all, and pointed `latest` back.
            avail = step_availability(self._drain_group, local_root=self.local_root, remote_root=self.remote_root,
                                      storage_options=self.storage_options, layout=self._layout)
            queued, self._dark_queue = [q for q in self._dark_queue if q[0] in avail], None
            self._not_rotated_away(queued, avail)
        if save_id is not None and self._not_sent.get(step) == save_id:
            return 0  # counted as drained and rotated away (_not_rotated_away); wait_durable says so
        hold = self._remote_owner.hold

        def after() -> None:
            # A rotation deletes steps: only while this job owns the root, proven (renewed) right
            # before each write, so an owner frozen mid-rotation past its lease stops there. A
            # late step (the remote tier holds one committed after it) leaves `latest` alone.
            self._remote.rotate_after(step, guard=hold, point=step not in self._late)
            self._late.discard(step)

        result = drain_step(self._drain_group, local_path=self.local_path(step), remote_path=self.remote_path(step),
                            remote_store=self._remote_store, lock_path=join(self.remote_root, ROOT_LOCK_NAME),
                            after_commit=after, progress=progress, storage_options=self.storage_options,
                            on_assigned=assigned, hold=hold)
        self._remote_held[step] = result.save_id
        if self._layout.is_leader:
            self._record_drained(step, result.save_id)
        if save_id is not None and result.save_id != save_id:
            # The local directory holds another save than the one queued (saved again since):
            # the drained one is what the remote tier now holds, and status says so.
            log.warning("distckpt: step %d drained save %s, not %s (the step was saved again)", step,
                        result.save_id, save_id)
        return result.bytes_uploaded

    def _record_drained(self, step: int, save_id: str) -> None:
        """Add ``step`` to this node's drained record (distckpt.tiers.records), so that a manager
        started while the remote tier does not answer does not queue it again. A record that
        cannot be written is logged: the step is then drained again by such a manager (which
        finds it there), nothing is lost."""
        try:
            tier = tier_id(self._local_store.read_pointer(join(self.local_root, TIER_RECORD_NAME)))
            present = {int(m.group(1)) for m in map(_STEP_RE.match, self._local_store.list_children(self.local_root))
                       if m}
            if tier is not None:
                record_drained(self._local_store, self.local_root, tier, self.remote_root, step, save_id, present)
        except Exception as exc:  # noqa: BLE001 - the record only spares a later drain
            log.warning("distckpt: step %d drained, but the drained record under %s was not written (%s: %s): a "
                        "manager started while the remote tier does not answer drains it again", step,
                        self.local_root, type(exc).__name__, exc)

    def _replicate(self, step: int, *, rebuild: bool = False, damaged: frozenset[str] = frozenset()) -> None:
        """Give each data file of ``step`` ``replicas`` copies on other nodes (collective, on the
        drain thread; ``rebuild``: on the training thread after a load, see
        :meth:`_rebuild_replicas`). Records "replicated" only when every copy arrived and was
        verified; a failure is recorded and logged (the step still drains; its replicas are
        incomplete), except a lost peer, which stops the thread (raised).

        Every node must hold a copy of the one save, except with ``rebuild``, where a node that
        holds none (a replaced node) gets one made around the replicas it receives (MANIFEST
        last, as a save's); a node holding another save of the step is never written to.
        ``damaged``: data file names of this rank's node found damaged, counted as absent (a
        replica is installed over them)."""
        from .. import manifest as mf
        from .load import _local_copy
        from .peers import replica_transfers, run_transfers, unreplicated
        group = self._group if rebuild else self._drain_group
        path = self.local_path(step)
        error, mine = None, (None, None)
        try:
            copy, data = _local_copy(self._local_store, path, damaged)
            mine = (copy, data if self._layout.is_leader else None)
        except Exception as exc:  # noqa: BLE001 - reported to every rank
            error = exc
        survey = group.all_gather(mine if error is None else _portable(error))
        try:
            group.raise_failures([x if isinstance(x, BaseException) else None for x in survey], error,
                                 operation="replication")
            copies = [survey[leader][0] for leader in self._layout.leaders]
            ids = {c.save_id for c in copies if c is not None}
            if (any(c is None for c in copies) and not rebuild) or len(ids) != 1:
                raise TierIncompleteError(
                    f"step {step} cannot be replicated: not every node holds the same save of it "
                    f"({[c.save_id if c else None for c in copies]})", path=path, step=step_dirname(step), files=[],
                    tiers={"local": [c.save_id if c else None for c in copies]})
            data = next(survey[leader][1] for leader, c in zip(self._layout.leaders, copies) if c is not None)
            header = mf.decode_header(data, path=path)
            held = [c.files if c is not None else frozenset() for c in copies]
            transfers = replica_transfers(self._layout, header, held, self.replicas)
            short = unreplicated(self._layout, len(header.files), held, transfers, self.replicas)
            if short:
                names = [header.files[i].name for i in short]
                raise TierIncompleteError(
                    f"step {step} cannot be replicated: data file(s) {names[:20]} are on no node "
                    f"(absent, or not the size the MANIFEST gives)", path=path, step=step_dirname(step), files=names,
                    tiers={"local": [sorted(h) for h in held]})
            if rebuild and transfers:
                log.warning("distckpt: step %d: %d data file cop%s missing from the nodes' local tiers (a replaced "
                            "node, a damaged file): replicated again from the nodes that hold them", step,
                            len(transfers), "y is" if len(transfers) == 1 else "ies are")
            run_transfers(group, transfers, layout=self._layout, store=self._local_store, step_path=path,
                          header=header, manifest=data)
        except PeerLostError:
            self._replication[step] = ("failed", None)
            raise
        except Exception as exc:  # noqa: BLE001 - the same on every rank (collective)
            log.error("distckpt: the replicas of step %d are incomplete: %s: %s", step, type(exc).__name__, exc)
            self._replication[step] = ("failed", exc)
            return
        self._replication[step] = ("replicated", None)

    def _rebuild_replicas(self, step: int, damaged: dict[int, set[str]]) -> None:
        """After a load of ``step`` (collective, on the training thread), with ``replicas=k``:
        each of its data files gets its k copies on other nodes again where nodes lost them: a
        node replaced since (its local tier empty: the load fetched only what its ranks read) or
        a damaged file read around. Without this a step saved before a node loss kept fewer
        copies until it was rotated away, and a second loss in that window lost what only the
        remote tier (or nothing, before its drain) still held. Costs one all-gather and a stat
        per data file when nothing is missing. A step this manager queued to drain is left to
        its drain, which replicates it first (the same on every rank: steps are queued on every
        rank at the same point). Failures are logged (``status(step).replicas``), never raised:
        the load succeeded; a lost peer is raised."""
        if not self.replicas or self._drainer.state(step) is not None:
            return
        self._replicate(step, rebuild=True, damaged=frozenset(damaged.get(self._layout.node, ())))

    def _vote(self, closing: bool, queued: tuple) -> tuple[bool, tuple]:
        votes = self._drain_group.all_gather((closing, queued))
        everywhere = set.intersection(*(set(q) for _, q in votes))
        return any(c for c, _ in votes), tuple(s for s in votes[0][1] if s in everywhere)

    def _replicate_ahead(self, steps: list[int]) -> None:
        """The replicas of queued ``steps`` (every rank the same list), made while an earlier
        step's drain waits to retry: with the remote tier down every drain waits, and a node lost
        meanwhile restores from the replicas only. Collective, on the drain thread. Raises
        PeerLostError (which stops the thread), as :meth:`_replicate`."""
        if not self.replicas:
            return
        for step in steps:
            if step not in self._replication:
                self._replicate(step)

    def _undrained(self, remote_up: bool) -> list[tuple[int, str]]:
        """(step, save id) of the steps every node's copy makes complete locally and the remote tier
        does not hold, oldest commit first (collective: the same list on every rank): after a
        rollback the abandoned branch's higher numbers were committed before the resumed branch's
        steps, and each drain's rotation of the remote tier (:meth:`CheckpointManager.rotate_after`)
        treats the step it drained as the newest, as a save does. ``remote_up`` False (the
        pre-flight found the remote tier dark): the remote tier is not listed, which would wait
        for a second request deadline, and every complete local step is queued (each drain asks
        the remote tier first whether it already holds the save) except those the nodes' drained
        records name (:meth:`_not_recorded_drained`)."""
        if remote_up:
            avail, self._remote_listed = self._availability()  # listing fails too: every complete local step
        else:
            avail = step_availability(self._group, local_root=self.local_root, remote_root=None, layout=self._layout)
        self._remote_held.update({s: t.remote_save_id for s, t in avail.items() if t.remote_save_id is not None})
        for t in avail.values():  # this job's local commits (rank 0 stamps them) sort after every step known
            commitclock.observe(self.local_root, t.created_unix)
        out = []
        for step in sorted(avail):
            t = avail[step]
            if t.remote_save_id is None and any(c is not None for c in t.local) and not t.local_complete:
                log.warning("distckpt: step %d is committed on the local tier but cannot be drained to %s or "
                            "loaded: %s", step, self.remote_root,
                            t.why_incomplete(remote_listed=remote_up and self._remote_listed))
                continue
            if t.local_complete and t.remote_save_id != t.local_save_id:
                if t.remote_save_id is not None:
                    log.warning("distckpt: not draining step %d: the remote tier holds another save of it (%s; "
                                "local %s)", step, t.remote_save_id, t.local_save_id)
                    continue
                out.append((step, t.local_save_id))
        # by commit time (every node's copy is the same save: one time), then number
        out.sort(key=lambda item: (avail[item[0]].created_unix or 0.0, item[0]))
        if remote_up:
            return self._not_rotated_away(out, avail)
        out = self._not_recorded_drained(out)
        self._dark_queue = list(out)
        return out

    def _not_recorded_drained(self, queued: list[tuple[int, str]]) -> list[tuple[int, str]]:
        """Of the local steps ``queued`` at a construction that found the remote tier dark, those
        no node's drained record (distckpt.tiers.records) names with the same save id for the
        remote tier its local tier is paired with. The others reached the remote tier under an
        earlier manager (a drain commits the whole step, so one node's record is enough): not
        queued, so that a restore-only job's close does not report them as not durable. They do
        not count as held there for the local rotation (``_remote_held``), which deletes only
        what a listing or this manager's own drain showed on the remote tier: a record is not
        proof that the remote tier still holds the step. Collective (one all-gather): the same
        list on every rank."""
        recorded: dict[int, str] = {}
        if self._layout.is_leader:
            try:
                tier = tier_id(self._local_store.read_pointer(join(self.local_root, TIER_RECORD_NAME)))
                recorded = read_drained(self._local_store, self.local_root, tier, self.remote_root)
            except Exception as exc:  # noqa: BLE001 - a record that does not read spares nothing
                log.warning("distckpt: the tier record under %s does not read (%s: %s): its steps are drained "
                            "again", self.local_root, type(exc).__name__, exc)
        drained: set[tuple[int, str]] = set()
        for node_record in self._group.all_gather(recorded):
            drained.update(node_record.items())
        spared = [(s, sid) for s, sid in queued if (s, sid) in drained]
        if spared:
            log.info("distckpt: the remote tier %s does not answer; steps %s are not drained again: this node's "
                     "record says an earlier manager drained these saves of them", self.remote_root,
                     [s for s, _ in spared])
        return [q for q in queued if q not in spared]

    def _not_rotated_away(self, queued: list[tuple[int, str]], avail: dict) -> list[tuple[int, str]]:
        """Of the local steps ``queued`` to drain at construction, those the remote tier's
        keep_last_remote rotation would keep once they and the steps it holds are there (the
        newest by number or by commit time: distckpt.rotation). The others were drained and then
        rotated away by an earlier manager (which knew it, this one does not), or were overtaken
        there by keep_last_remote newer saves: draining them would upload them only for the
        rotation to delete them, and point the remote ``latest`` back at an old step (every
        restart of a job with keep_last_local > keep_last_remote did both). They count as
        drained and dropped (``_remote_held``): neither tier's policy keeps them, and the local
        rotation deletes them once they are beyond keep_last_local. Also records the queued steps
        the remote tier holds a later commit than (``_late``): their drains leave ``latest``."""
        remote_times = [t.remote_created_unix for t in avail.values()
                        if t.remote_save_id is not None and t.remote_created_unix is not None]
        newest = max(remote_times, default=None)
        self._late = {s for s, _ in queued if newest is not None and (avail[s].created_unix or 0.0) < newest}
        keep = self._remote.keep_last
        if keep is None or not queued:
            return queued
        times = {s: t.remote_created_unix for s, t in avail.items() if t.remote_save_id is not None}
        times.update({s: avail[s].created_unix for s, _ in queued})
        doomed = set(beyond_keep_last(times, keep, times.get)[0])
        skipped = [(s, sid) for s, sid in queued if s in doomed]
        if skipped:
            log.warning("distckpt: not draining %s to %s: its keep_last_remote=%d rotation would delete them at "
                        "once (it holds or is sent %d newer steps, by number and by commit time); they count as "
                        "drained and rotated away, and the local rotation (keep_last_local=%d) deletes them in turn",
                        [step_dirname(s) for s, _ in skipped], self.remote_root, keep, keep, self.keep_last_local)
            self._remote_held.update(skipped)
            self._not_sent.update(skipped)
        return [item for item in queued if item[0] not in doomed]

    def _own_local_tier(self):
        """Each node's leader takes the local tier's owner lock (``LOCAL/.distckpt-tiers.owner``,
        a flock held until :meth:`close`): two managers on one local directory, in this job or
        another, would rotate and drain each other's steps into their own remote tiers.
        Collective. Returns the lock (None on other ranks).

        Raises SaveInProgressError on every rank when another live manager holds it (its host,
        pid and tiers in the message)."""
        from ..storage.posix import savelock
        lock, error = None, None
        if self._layout.is_leader:
            try:
                lock = savelock.acquire(join(self.local_root, OWNER_NAME), save_id="tiers",
                                        what=f"TieredCheckpointManager({self.local_root} -> {self.remote_root})")
            except SaveInProgressError as exc:
                other = exc.details.get("owner") or {}
                error = SaveInProgressError(
                    f"another TieredCheckpointManager uses the local tier {self.local_root}: "
                    f"{other.get('what', '?')} (host {other.get('host', '?')}, pid {other.get('pid', '?')})",
                    path=self.local_root, owner=other,
                    remedy="Close that manager first, or give this one a local directory of its own.")
            except Exception as exc:  # noqa: BLE001 - raised on every rank below
                error = exc
        try:
            self._group.exchange_outcome(error, operation="TieredCheckpointManager()")
        except BaseException:
            if lock is not None:
                lock.release()
            raise
        return lock

    def _take_remote_owner(self, group, operation: str) -> None:
        """Rank 0 takes the remote tier's owner (:class:`~distckpt.tiers.owner.RemoteOwner`).
        Collective on ``group``. At construction an outage only warns (the first drain takes it).

        Raises SaveInProgressError on every rank when another live manager owns the remote tier;
        the stores' other typed errors."""
        error = None
        if group.rank == 0:
            try:
                self._remote_owner.take()
            except Exception as exc:  # noqa: BLE001 - raised on every rank below
                if group is self._group and _outage(exc):
                    log.warning("distckpt: could not take the remote tier %s's owner (%s: %s): the first drain takes it",
                                self.remote_root, type(exc).__name__, exc)
                else:
                    error = exc
        group.exchange_outcome(error, operation=operation)

    def _release_owner(self, within: float | None = None) -> None:
        """Release the remote tier's owner, then the local tier's. ``within``: the seconds a
        close may still take; a release of the remote tier's owner that takes longer (its
        requests held) goes on in the background, where its lease is no longer renewed: it lapses
        on its own, and a restart on this node may take it over at once (distckpt.tiers.owner)."""
        remote = getattr(self, "_remote_owner", None)
        if remote is not None:
            if within is None:
                remote.release()
            else:
                releasing = threading.Thread(target=remote.release, name="distckpt-owner-release", daemon=True)
                releasing.start()
                releasing.join(max(0.0, within))
                if releasing.is_alive():
                    # An object store's owner is a lease; a directory's, a flock (docs/TIERS.md).
                    how = ("the lease, no longer renewed, lapses on its own" if is_url(self.remote_root) else
                           "the owner file's flock goes at the latest when this process exits")
                    log.warning("distckpt: the remote tier %s's owner is still being released when close's timeout "
                                "ran out: it goes on in the background (%s)", self.remote_root, how)
        lock, self._owner = getattr(self, "_owner", None), None
        if lock is not None:
            lock.release()

    def _check_remote(self) -> bool:
        """The remote tier's pre-flight on rank 0 (an object store: endpoint, credentials, bucket,
        a probe object created and removed). A configuration error (no such bucket, refused
        credentials) is raised on every rank; an outage (the endpoint does not answer, throttling,
        a server error) only warns: local saves and restores from local copies go on, and the
        drains retry until the remote tier answers. Collective. Returns whether the remote tier
        answered (the same on every rank)."""
        error, up = None, True
        if self._group.rank == 0 and is_url(self.remote_root):
            from ..storage.object.check import check_object_store
            try:
                check_object_store(self.remote_root, storage_options=self.storage_options, rank=0)
            except Exception as exc:  # noqa: BLE001 - an outage warns; anything else is raised on every rank below
                if _outage(exc):
                    log.warning("distckpt: the remote tier %s does not answer (%s: %s): saving to the local tier "
                                "only until it does (drains retry)", self.remote_root, type(exc).__name__, exc)
                    up = False
                else:
                    error = exc
        self._group.exchange_outcome(error, operation="TieredCheckpointManager()")
        return up if self._group.world_size == 1 else bool(self._group.broadcast(up))

    def _pair_tiers(self, group) -> None:
        """Check that the remote root is the remote tier each node's local tier drained to.

        A directory remote on a file system that is not mounted reads as an empty directory (or
        an absent one, which the first drain created on this machine's own disk): drains
        succeeded into it, steps were reported durable and rotated away locally, and the restart
        after the mount came back resumed from an older step, silently. So the remote tier
        carries an identity (``REMOTE/.distckpt-tier``: a random id written by the first manager
        that uses it) and each node's local tier records the one it drains to
        (``LOCAL/.distckpt-tier-remote``). Collective on ``group`` (the manager's group at
        construction, the drain channel on the drain thread). A node with no record
        (a new or replaced node) takes the remote tier's; a remote root with no identity gets one
        when no node recorded any (a new tier, or one written by a distckpt before this check).

        The remote tier's owner is taken between the check and the writes (:meth:`_take_remote_owner`).

        Raises TierMismatchError on every rank when a node recorded another tier than the remote
        root holds, or any tier while it holds none; SaveInProgressError when another live
        manager owns the remote tier; the store's typed errors."""
        operation = "TieredCheckpointManager()" if group is self._group else "the tier check before a drain"
        mine, found, _recorded = self._check_pairing(group, operation)
        self._take_remote_owner(group, operation)  # before anything is written: a refused manager writes nothing
        error, tier = None, found
        try:
            if group.rank == 0 and found is None:
                tier = uuid.uuid4().hex
                self._remote_store.make_root(self.remote_root)
                self._remote_store.replace_pointer(join(self.remote_root, TIER_ID_NAME), f"{tier}\n".encode())
                log.info("distckpt: the remote tier %s is new to distckpt's tier check: its identity is %s",
                         self.remote_root, tier)
        except Exception as exc:  # noqa: BLE001 - raised on every rank below
            error = exc
        tier = group.exchange_outcome(error, operation=operation, extra=tier)[0]
        error = None
        try:
            if self._layout.is_leader and mine is None:
                self._local_store.replace_pointer(join(self.local_root, TIER_RECORD_NAME),
                                                  f"{tier}\n{self.remote_root}\n".encode())
        except Exception as exc:  # noqa: BLE001 - raised on every rank below
            error = exc
        group.exchange_outcome(error, operation=operation)

    def _check_unpaired_remote(self) -> None:
        """Before a load by a manager whose remote tier did not answer at construction (its
        pairing waits for the first drain): the read-only pairing check, so that a remote root
        that is another tier than this job's (another job's, one not mounted) is never read as
        the reference tier. Collective. When the remote tier still does not answer, the load goes
        on as for any outage (local copies, ``remote_unchecked``).

        Raises TierMismatchError on every rank."""
        try:
            _mine, found, recorded = self._check_pairing(self._group, "TieredCheckpointManager.load()")
        except TierMismatchError:
            raise
        except Exception as exc:  # noqa: BLE001 - an outage: the load's own handling of it follows
            if not _outage(exc):
                raise
            log.warning("distckpt: the remote tier %s still does not answer (%s: %s): its identity is checked "
                        "once it does", self.remote_root, type(exc).__name__, exc)
            return
        if found is not None and len(recorded) == len(self._layout.leaders):
            # Every node records the remote root's identity (the drain paired them): later loads
            # need not look. Decided from the check's gathered outcome: the same on every rank.
            self._check_before_load = False

    def _check_pairing(self, group, operation: str) -> tuple[str | None, str | None, dict]:
        """The read-only half of :meth:`_pair_tiers` (collective on ``group``): (this node's
        recorded tier id, or None on a rank that is not its node's leader or when there is none;
        the remote root's id, or None; {node: the id its local tier records}, the same on every
        rank). Writes nothing, so it may run while the drain thread
        pairs (it sees the ids before or after that writes them, either consistent).

        Raises TierMismatchError on every rank when a node recorded another tier than the remote
        root holds, or any tier while it holds none; the stores' typed errors."""
        error, mine, found = None, None, None
        try:
            if self._layout.is_leader:
                mine = tier_id(self._local_store.read_pointer(join(self.local_root, TIER_RECORD_NAME)))
        except Exception as exc:  # noqa: BLE001 - raised on every rank below
            error = exc
        got = group.all_gather(_portable(error) if error is not None else mine)
        group.raise_failures([g if isinstance(g, BaseException) else None for g in got], error, operation=operation)
        # The remote id is read after every record was (the all-gather between): a pairing writes
        # the id before any record, so a record seen here means its id is seen too.
        error = None
        try:
            if group.rank == 0:
                found = tier_id(self._remote_store.read_pointer(join(self.remote_root, TIER_ID_NAME)))
        except Exception as exc:  # noqa: BLE001 - raised on every rank below
            error = exc
        found = group.exchange_outcome(error, operation=operation, extra=found)[0]
        recorded = {self._layout.node_of[r]: g for r, g in enumerate(got) if g is not None}
        other = {n: t for n, t in recorded.items() if t != found}
        if other:
            where = (f"holds tier {found}" if found is not None else
                     "holds no tier at all (is the file system that holds it mounted?)")
            raise TierMismatchError(
                f"the remote root {self.remote_root} {where}, but the local tier of node(s) {sorted(other)} "
                f"drained to tier {sorted(set(other.values()))} (this rank's node is node {self._layout.node}, its "
                f"local tier {self.local_root}): draining into it would report steps durable that are not on the "
                f"remote tier this job resumes from",
                path=self.remote_root, recorded=recorded, found=found)
        return mine, found, recorded

    # -- state ------------------------------------------------------------------------------------

    def _known_remote_id(self, step: int) -> str | None:
        """The save id of ``step`` that the remote tier is known to hold without asking it: this
        manager drained it (its drain committed, or found that very save there), and the remote
        tier's keep_last_remote rotation, which runs after each drain, cannot have dropped it
        since. None when that is not known (then the remote tier is asked, as for any step this
        manager did not drain).

        The rotation keeps the newest keep_last_remote steps at or below the step just drained (by
        number; by commit time too, which only keeps more).
        What the manager knows of the remote tier (``_remote_held``: listed at construction,
        drained since) is a subset of what the rotation counts, so fewer than keep_last_remote
        known steps above ``step`` proves it kept only when the remote tier was listed at
        construction (else steps the manager never saw count too); more may or may not have
        dropped it (a newer step above the one drained does not count), so that case asks. Steps
        queued or draining count as newer too: a drain rotates the remote tier before this
        manager records that it holds the drained step."""
        st = self._drainer.state(step)
        held = self._remote_held.get(step)
        if st is None or st.state != "committed" or held is None:
            return None
        keep = self._remote.keep_last
        if keep is None:
            return held  # the remote tier never rotates: what was drained stays
        if not self._remote_listed:
            return None
        known = set(list(self._remote_held)) | set(self._drainer.states())  # the drain thread adds to both
        newer = sum(1 for s in known if s > step)
        return held if newer < keep else None

    def status(self, step: int) -> TierStatus:
        """Where ``step`` stands on each tier, seen from this rank: its node's local copy, and the
        drain's state; for a step this manager drained, what it knows (the remote tier holds that
        save, unless keep_last_remote may have dropped it since: :meth:`_known_remote_id`), so the
        remote tier is not asked and a remote tier gone dark since does not make this raise; for
        any other step (found at construction, never queued, rotated away since), what the remote
        tier holds, asked. Local: reads this node's MANIFEST header, and the remote one only in
        the last case; writes nothing.

        Raises StorageError subclasses / object-store request errors for a failed look."""
        check_step(step)
        try:
            local_id, damaged = self._local_store.committed_save_id(self.local_path(step)), False
        except ManifestCorruptError as exc:
            if exc.details.get("found_version") is not None:
                raise  # a newer release's step is not damaged
            local_id, damaged = None, True  # a state to report, as a load passes it over
        st = self._drainer.state(step)
        if not self.replicas:
            replicas, replica_error = "off", None
        elif step in self._replication:
            replicas, replica_error = self._replication[step]
        else:
            # Replicated before its drain: pending while this manager saves or drains it; a step
            # it never queued (drained by an earlier manager, found at construction) may or may
            # not have replicas from the manager that saved it, which nothing here recorded.
            replicas, replica_error = ("pending" if st is not None or step in self._saving else "unknown"), None
        if st is not None and st.state != "committed":
            return TierStatus(step, "committed" if local_id else "damaged" if damaged else "absent", st.state,
                              st.save_id or local_id,
                              st.sent, st.total, st.tries, st.error, replicas, replica_error)
        remote_id = self._known_remote_id(step)
        if remote_id is None:
            remote_id = self._remote_store.committed_save_id(self.remote_path(step))
        if remote_id is None:
            remote = "absent"
        else:
            remote = "committed" if local_id in (None, remote_id) else "other"
        local = "saving" if step in self._saving else "committed" if local_id else "damaged" if damaged else "absent"
        return TierStatus(step, local, remote, local_id or remote_id,
                          st.sent if st else 0, st.total if st else 0, st.tries if st else 0, None, replicas,
                          replica_error)

    def wait_durable(self, step: int, timeout: float | None = None) -> TierStatus:
        """Wait until the remote tier holds ``step`` (its drain committed); returns its status
        (:meth:`status`: for a step this manager drained, from what it knows, without a request).

        A step whose async local save (``save(step, ..., blocking=False)``) is still in flight is
        waited for first: its drain is queued when it commits. ``timeout`` bounds both waits
        together.

        Raises:
            NotDurableError: the drain failed for good or was stopped (``error`` its cause), or
                ``timeout`` seconds passed first (the drain, or the local save, goes on).
            CheckpointNotFoundError: the step is neither queued nor on either tier.
            The local save's own error (its class, as ``handle.result()`` raises it; it then
            counts as seen) when the async local save of ``step`` failed: nothing was queued.
        """
        check_step(step)
        check_timeout(timeout)
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._async_lock:
            handle = self._async_saves.get(step)
        if handle is not None:
            if not handle.wait(None if deadline is None else max(0.0, deadline - time.monotonic())):
                raise NotDurableError(f"step {step} is not on the remote tier after {timeout} s: its local save is "
                                      f"still in flight (its drain is queued when it commits)",
                                      path=self.remote_path(step), steps=[step],
                                      remedy="Wait longer (the local save and then the drain go on).")
            error = handle.exception()  # done: returns at once; the caller is told, so it counts as seen
            if error is not None:
                raise error
            # Committed: its drain was queued before the handle reported done.
            timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
        st = self._drainer.state(step)
        if st is None:
            status = self.status(step)
            if status.remote == "committed":
                return status
            if status.local == "absent":
                raise CheckpointNotFoundError(f"step {step} is on neither tier ({self.local_root}, {self.remote_root})",
                                              path=self.local_path(step))
            if step in self._not_sent:
                raise NotDurableError(f"step {step} is not on the remote tier: its keep_last_remote="
                                      f"{self._remote.keep_last} rotation would delete it at once (newer steps are "
                                      f"there), so it was not drained again; the local tier still holds it",
                                      path=self.remote_path(step), steps=[step],
                                      remedy="Raise keep_last_remote to keep more steps on the remote tier.")
            raise NotDurableError(f"step {step} is committed locally but was never queued for draining by this "
                                  f"manager", path=self.remote_path(step), steps=[step],
                                  remedy="A new TieredCheckpointManager drains it at construction.")
        if not wait_for(st, timeout):
            raise NotDurableError(f"step {step} is not on the remote tier after {timeout} s (its drain is {st.state})",
                                  path=self.remote_path(step), steps=[step], cause=st.error,
                                  remedy="Wait longer, or check the remote tier (status(step).error).")
        if st.state != "committed":
            remedy = ("It is still committed locally; a new TieredCheckpointManager drains it at construction "
                      "once the cause is fixed." if self._held_locally(step) else
                      f"It is not on this node's local tier ({self.local_root}) either: save the state again.")
            raise NotDurableError(f"step {step} did not reach the remote tier: its drain {st.state}"
                                  f"{f' ({type(st.error).__name__}: {st.error})' if st.error else ''}",
                                  path=self.remote_path(step), steps=[step], cause=st.error, remedy=remedy)
        status = self.status(step)
        if status.remote != "committed":
            # Drained, then dropped by the remote tier's rotation (keep_last_remote): it is not
            # there now, which a caller reads "no exception" as (a fresh manager raises here too).
            where = f"drained, then rotated away from the remote tier (keep_last_remote={self._remote.keep_last})"
            if status.local == "absent":
                raise CheckpointNotFoundError(f"step {step} is on neither tier ({self.local_root}, "
                                              f"{self.remote_root}): {where}", path=self.local_path(step))
            raise NotDurableError(f"step {step} is not on the remote tier: {where}; the local tier still holds it",
                                  path=self.remote_path(step), steps=[step],
                                  remedy="Raise keep_last_remote to keep more steps on the remote tier.")
        return status

    # -- loading ----------------------------------------------------------------------------------

    @_notes_lost_peer
    def latest_step(self) -> int | None:
        """The step :meth:`load` loads by default: the newest (by commit time) with a complete
        copy on the tiers: the remote tier holds it, or every node's local copy of the same save
        does. Collective. Writes nothing. None when no tier holds one; when no local copy is
        complete and the remote tier did not answer, its typed error (it may hold steps)."""
        self._control("TieredCheckpointManager.latest_step()")
        self._check_owner("TieredCheckpointManager.latest_step()")
        candidates, remote_up, _, _ = self._candidates()
        if not candidates and not remote_up:
            self._raise_if_remote_down(None)  # None would say "no checkpoint" of a remote tier that may hold them
        return candidates[0] if candidates else None

    def _availability(self) -> tuple[dict, bool]:
        """(step_availability of both tiers, whether the remote tier answered). Collective. When the
        remote tier cannot be listed (an outage: its typed error, the same on every rank), the
        local tier alone, with a warning: a load then reads only complete local copies."""
        try:
            avail = step_availability(self._group, local_root=self.local_root, remote_root=self.remote_root,
                                      storage_options=self.storage_options, layout=self._layout)
            self._remote_down, self._remote_down_error = None, None
            return avail, True
        except ObjectStoreError as exc:
            self._remote_down, self._remote_down_error = f"{type(exc).__name__}: {exc.message}", exc
            log.warning("distckpt: the remote tier %s cannot be listed (%s): choosing among the local tier's "
                        "complete copies only, which cannot be checked against it (should it hold another save "
                        "of the same step, that one would be loaded when it answers)", self.remote_root,
                        self._remote_down)
        return step_availability(self._group, local_root=self.local_root, remote_root=None,
                                 layout=self._layout), False

    def _candidates(self) -> tuple[list[int], bool, dict, dict[int, str]]:
        """(the steps with a complete copy on a tier, newest first; whether the remote tier
        answered; the step_availability they were chosen from; {step: why} of the steps passed
        over). Every step with a higher number than the newest of them that is not complete (a
        lost local data file of a step never drained, copies of different saves) is passed over,
        named in a warning with what it lacks: a load that goes back to an older step must say
        which newer one it passed over and why, never return older state silently."""
        avail, remote_up = self._availability()
        good = [(t.created_unix or 0.0, s) for s, t in avail.items()
                if t.remote_save_id is not None or t.local_complete]
        steps = [s for _, s in sorted(good, reverse=True)]
        newest = max(steps, default=-1)
        passed = {}
        for s in sorted((s for s in avail if s > newest), reverse=True):
            why = avail[s].why_incomplete(remote_listed=remote_up)
            if why is not None:
                passed[s] = why
                log.warning("distckpt: step %d on %s / %s has no complete copy, passed over%s: %s", s,
                            self.local_root, self.remote_root,
                            f" for step {steps[0]}" if steps else "", why)
        return steps, remote_up, avail, passed

    @_notes_lost_peer
    def load(self, state_dict: Any, step: int | None = None, **kwargs: Any) -> LoadResult:
        """Load ``step`` (default: the newest step with a complete copy) into ``state_dict``
        (collective). Each rank reads each file from its node's local copy when it belongs to
        the same save, else from the remote tier (distckpt.tiers.load); resharding works as in
        :func:`distckpt.load`. With no ``step``, a newest step that turns out not to be complete
        for this job (a file on no tier a rank can reach) is skipped with a warning naming it,
        before any byte is read, and the next one is loaded. A load that finds local data files
        damaged (a checksum or truncation error in a file outside the remote tier, on any rank)
        loads the step again, each damaged file from another node's replica of it (installed
        over the damaged one) or else from the remote tier, with a warning naming the damaged
        files (only verified bytes reach the state dict either way): :meth:`_load_around_damage`.
        With ``replicas=k``, the loaded step's files then get their k copies on other nodes again
        where nodes lack them (a replaced node, a damaged file): :meth:`_rebuild_replicas`.

        When the remote tier does not answer (its typed error, on every rank), the step (the
        newest complete local one, or the ``step`` asked for) is loaded from the local tier alone,
        with a warning, and the result's ``remote_unchecked`` says why: those copies could not be
        checked against the remote tier, which is the reference when it answers (a local copy of
        another save of the same step, a stale disk, loses to it then). A step the listing found
        held remotely as another save than the nodes' copies is passed over (with no ``step``)
        when the remote tier stops answering after the listing: its local copy is known stale.

        Raises CheckpointNotFoundError when no step has a complete copy; the remote tier's own
        typed error (an ObjectStoreError, never a FileNotFoundError for a stall) instead when no
        local copy is complete and the remote tier did not answer; TierIncompleteError for a
        given ``step`` without one; and what :func:`distckpt.load` raises (a damaged local
        copy's ChecksumMismatchError when no replica and no remote copy of the file is there).
        """
        if step is not None:
            check_step(step)
            with self._async_lock:
                in_flight = self._async_saves.get(step)
            if in_flight is not None:
                # This manager's async save of the very step: its commit is collective, so every
                # rank's handle ends with it; loaded before, the step is not there yet (a "no copy"
                # error that said nothing of the save in flight). Its own error, if any, is the
                # handle's, and the load below says what it finds.
                in_flight.wait()
        if self._check_before_load:
            self._check_unpaired_remote()
        self._control("TieredCheckpointManager.load()")
        self._check_owner("TieredCheckpointManager.load()")
        if step is not None:
            steps, remote_up, avail, passed = [step], True, {}, {}
        else:
            steps, remote_up, avail, passed = self._candidates()
        if not steps:
            self._raise_if_remote_down(None)
            raise CheckpointNotFoundError(f"no step with a complete copy on {self.local_root} or {self.remote_root}",
                                          path=self.remote_root)
        last = None
        for s in steps:
            try:
                try:
                    while True:
                        if not remote_up:
                            self._refuse_stale_local(s, avail)
                        try:
                            result = load_tiered(state_dict, local_path=self.local_path(s),
                                                 remote_path=self.remote_path(s) if remote_up else None,
                                                 storage_options=self.storage_options,
                                                 process_group=self.process_group, layout=self._layout, **kwargs)
                            break
                        except ObjectStoreError as exc:
                            if not remote_up:
                                raise
                            # The remote tier went down after the listing (the same typed error on
                            # every rank): this step, and any older one tried next, is restored
                            # from the local tier, as when it was down at the listing, when its
                            # copies are complete (else TierIncompleteError) and not known stale
                            # (_refuse_stale_local, at the loop's top).
                            remote_up, self._remote_down = False, f"{type(exc).__name__}: {exc.message}"
                            self._remote_down_error = exc
                            log.warning("distckpt: step %d: the remote tier %s does not answer (%s): loading the "
                                        "local tier's copy, which cannot be checked against it", s,
                                        self.remote_root, self._remote_down)
                        except DistCkptError as exc:
                            if not remote_up:
                                if isinstance(exc, CheckpointNotFoundError):
                                    # No copy on the local tier says nothing of the remote one.
                                    self._raise_if_remote_down(exc)
                                exc.add_note(f"distckpt: the remote tier {self.remote_root} did not answer "
                                             f"({self._remote_down}): only the local tier was read")
                            raise
                    if not remote_up:
                        result = dataclasses.replace(result, remote_unchecked=self._remote_down)
                    return self._loaded(s, result, passed)
                except (ChecksumMismatchError, DataFileTruncatedError) as exc:
                    damaged = self._damaged_local_files(exc)
                    if not damaged:
                        raise
                    return self._loaded(s, self._load_around_damage(state_dict, s, exc, damaged, remote_up, kwargs),
                                        passed, damaged)
            except TierIncompleteError as exc:
                if step is not None:
                    raise
                log.warning("distckpt: step %d has no complete copy this job can read (%s); trying an older one",
                            s, exc)
                passed[s] = f"{type(exc).__name__}: {exc.message}"
                last = exc
        if not remote_up:
            self._raise_if_remote_down(last)
        raise CheckpointNotFoundError(f"no step on {self.local_root} or {self.remote_root} has a complete copy this job "
                                      f"can read (the newest failed with: {last})", path=self.remote_root)

    def _raise_if_remote_down(self, last: BaseException | None) -> None:
        """When the remote tier did not answer this call (the listing's, or a read's, typed error
        on every rank), raise that error, noted: no complete copy on the local tier says nothing
        of the remote tier, which may hold every step. A CheckpointNotFoundError (a
        FileNotFoundError) there would read as "no checkpoint" to a resume loop that then starts
        from scratch, and threw the run's progress away while a single request stalled."""
        exc = self._remote_down_error
        if exc is None:
            return
        exc.add_note(f"distckpt: no step has a complete copy on the local tier {self.local_root} alone, and the "
                     f"remote tier {self.remote_root} did not answer: it may hold the steps to load. Load again "
                     f"once it answers; this is not an empty checkpoint root.")
        raise exc from last

    def _refuse_stale_local(self, step: int, avail: dict) -> None:
        """Raise TierIncompleteError when the listing ``avail`` (the same on every rank: an
        all-gather) found the remote tier holding another save of ``step`` than the nodes'
        copies: with the remote tier not answering now, the local copy would be loaded, and it
        is known not to be the step as the tiers hold it (a stale disk). A listing made while
        the remote tier was down knows no remote save: nothing is refused then."""
        seen = avail.get(step)
        if seen is None or seen.remote_save_id is None or seen.local_save_id in (None, seen.remote_save_id):
            return
        raise TierIncompleteError(
            f"step {step}: the remote tier ({self.remote_root}) holds save {seen.remote_save_id}, the reference, but "
            f"does not answer ({self._remote_down}), and the nodes' copies are another save ({seen.local_save_id})",
            path=self.remote_path(step), step=step_dirname(step), files=[],
            tiers={"remote": f"save {seen.remote_save_id} (not answering)", "local": f"save {seen.local_save_id}"},
            remedy="Load the step once the remote tier answers, or an older step; the local copy of this one is "
                   "another save (a stale disk) and is never loaded in its place.")

    def _loaded(self, step: int, result: LoadResult, passed: dict[int, str],
                damaged: dict[int, set[str]] | None = None) -> LoadResult:
        """What load() returns for ``step``, once its replicas are whole again
        (:meth:`_rebuild_replicas`; ``damaged``: {node: data file names} found damaged there)."""
        self._rebuild_replicas(step, damaged or {})
        return _passed_over(result, passed)

    def _load_around_damage(self, state_dict: Any, step: int, exc: BaseException, damaged: dict[int, set[str]],
                            remote_up: bool, kwargs: dict) -> LoadResult:
        """Load ``step`` again after a load found the local data files ``damaged`` ({node: file
        names}, the same on every rank) failing their checksums or cut short: each such file
        from another node's copy of it (a replica, verified on both ends and installed over the
        damaged file: the node's copy is whole again) or, where no node holds one, from the
        remote tier; the rest from the local copies as before. When that fails too and the
        remote tier answers, the whole step from the remote tier alone. Collective. Verified
        bytes only ever reach the state dict; the damage is logged by name either way.

        Raises ``exc`` (the damage stands) when neither a replica nor the remote tier can serve
        the damaged files, with the retry's error noted."""
        by_rank = getattr(exc, "failures", None) or {self._group.rank: exc}
        paths = sorted({f"node {self._layout.node_of[r]}: {e.path}" for r, e in by_rank.items()})
        log.warning("distckpt: step %d: local data files are damaged (%s: %s): %s; loading them from the nodes "
                    "that hold replicas of them, else from the remote tier %s", step, type(exc).__name__,
                    exc.message, paths, self.remote_path(step) if remote_up else "(which does not answer)")
        try:
            result = load_tiered(state_dict, local_path=self.local_path(step),
                                 remote_path=self.remote_path(step) if remote_up else None,
                                 storage_options=self.storage_options, process_group=self.process_group,
                                 layout=self._layout, damaged=damaged, **kwargs)
        except (ChecksumMismatchError, DataFileTruncatedError, TierIncompleteError, CheckpointNotFoundError) as again:
            _filled_by_every_try(again, [exc])
            if not remote_up:
                exc.add_note(f"distckpt: no other node holds a verified copy of the damaged files ({type(again).__name__}: "
                             f"{getattr(again, 'message', again)}), and the remote tier did not answer")
                _filled_by_every_try(exc, [again])
                raise exc from None
            # Verified bytes only ever reached the state dict, and the remote tier holds the
            # step: read it all from there (the same save: a tiered load's reference is the
            # remote's when it committed the step).
            log.warning("distckpt: step %d: loading it from the remote tier %s alone (%s: %s)", step,
                        self.remote_path(step), type(again).__name__, getattr(again, "message", again))
            try:
                return load_tiered(state_dict, local_path=None, remote_path=self.remote_path(step),
                                   storage_options=self.storage_options, process_group=self.process_group, **kwargs)
            except (TierIncompleteError, CheckpointNotFoundError):
                _filled_by_every_try(exc, [again])
                raise exc from None  # the remote tier does not hold the step: the damage stands
            except DistCkptError as last:
                _filled_by_every_try(last, [exc, again])
                raise
        if not remote_up:
            result = dataclasses.replace(result, remote_unchecked=self._remote_down)
        return result

    def _damaged_local_files(self, exc: BaseException) -> dict[int, set[str]] | None:
        """{node: names of the local data files} a failed tiered load found damaged, when every
        failure of it (on every rank: a collective error carries them all, the same on each) is
        a checksum or truncation error of a file outside the remote tier, in its rank's node's
        copy; else None. The same answer on every rank, so every rank retries together or none
        does. By node: the nodes' local directories often have the same path."""
        # A collective error carries {rank: error}; a single rank's (a group of one) is its own.
        by_rank = getattr(exc, "failures", None) or {self._group.rank: exc}
        remote = normalize_path(self.remote_root).rstrip("/") + "/"
        out: dict[int, set[str]] = {}
        for rank, e in by_rank.items():
            path = getattr(e, "path", None)
            if not isinstance(e, (ChecksumMismatchError, DataFileTruncatedError)) or not isinstance(path, str) \
                    or path.startswith(remote) or not isinstance(rank, int) or not 0 <= rank < len(self._layout.node_of):
                return None
            out.setdefault(self._layout.node_of[rank], set()).add(os.path.basename(path))
        return out

    # -- closing ----------------------------------------------------------------------------------

    def close(self, timeout: float | None = None) -> None:
        """Wait for the local async saves and for the drains queued (at most ``timeout`` seconds,
        default ``drain_timeout_s``), then stop the drain thread and rotate the local tier.
        Collective (every rank closes). Idempotent. The drains take at most ``timeout`` plus a
        few seconds (distckpt.tiers.drainer's grace for the vote that stops retries), also while
        the remote tier holds a request of a drain unanswered: that drain is left to its daemon
        thread, which ends at the request's own deadline; its step is named below (not known to
        be remote, although the held request may still land). Before them, a local async save
        still in flight is waited for (its own collectives are bounded by DISTCKPT_TIMEOUT_S),
        and the ranks' arrival at close by DISTCKPT_ARRIVAL_TIMEOUT_S (skipped after a lost peer:
        this rank then decides alone).

        Raises:
            NotDurableError: steps not known to be on the remote tier (``steps``: their drains
                failed or did not finish in time), each still committed locally; the next manager
                start drains them (a drain whose save the remote tier already holds is a no-op).
            The error of a local async save that failed unseen (as CheckpointManager.close).
        """
        self._close(timeout, collective=True)

    def _close(self, timeout: float | None, *, collective: bool) -> None:
        if self._closed:
            return
        check_timeout(timeout)  # before anything is closed: a bad value leaves the manager open
        self._closed = True
        started = time.monotonic()
        # collective=False: a ``with`` block left by an exception (maybe on this rank only), which
        # the local manager's close decides alone.
        if any(isinstance(st.error, PeerLostError) for st in self._drainer.states().values()):
            # A drain met a lost peer: the group decides nothing more, and the local manager's
            # close would wait DISTCKPT_ARRIVAL_TIMEOUT_S for a rank that is gone.
            self._local._note_group_lost()
        try:
            try:
                # The async local saves; their drains are queued when they commit.
                self._local._close(collective=collective)
            finally:
                pending = self._drainer.close(self.drain_timeout_s if timeout is None else timeout)
            if self._layout.is_leader:
                try:
                    self._rotate_local(keep=None)
                except Exception as exc:  # noqa: BLE001 - housekeeping: the next save rotates again
                    log.warning("distckpt: rotating %s at close: %s: %s", self.local_root, type(exc).__name__, exc)
        finally:
            # Also when a close raised: the tiers are free for the next manager.
            self._release_owner(within=None if timeout is None else timeout - (time.monotonic() - started))
        if pending:
            states = self._drainer.states()
            first = next((states[s].error for s in pending if states[s].error is not None), None)
            kept = [s for s in pending if self._held_locally(s)]
            gone = [s for s in pending if s not in kept]
            where = f"{kept} stay committed locally under {self.local_root}" if kept else ""
            if gone:
                # Never claim a copy that is not there: such a step is on neither tier this manager knows.
                where += ("; " if where else "") + f"{gone} are not on this node's local tier either ({self.local_root})"
            # "Not known to be": a request the remote tier never answered may still have landed.
            raise NotDurableError(f"steps {pending} are not known to be on the remote tier {self.remote_root} "
                                  f"({', '.join(f'{s}: {states[s].state}' for s in pending)}); {where}",
                                  path=self.remote_root, steps=pending, cause=first,
                                  remedy="Start a TieredCheckpointManager on the same tiers once the remote tier "
                                         "answers: it drains the steps committed locally at construction.")

    def _held_locally(self, step: int) -> bool:
        """Whether this node's local tier holds a committed copy of ``step`` (False when it cannot
        tell: a message must not promise a copy it could not read)."""
        try:
            return self._local_store.committed_save_id(self.local_path(step)) is not None
        except Exception:  # noqa: BLE001 - unreadable: not known to be there
            return False

    def __enter__(self) -> "TieredCheckpointManager":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            try:
                self._close(None, collective=False)
            except Exception as close_exc:  # noqa: BLE001 - do not mask the error in flight
                log.error("distckpt: while closing the TieredCheckpointManager after %s: %s",
                          exc_type.__name__, close_exc)
