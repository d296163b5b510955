"""The local tier's commit: phases 2-4 of a save (:mod:`distckpt.coordinator`) when every node
has a directory of its own (:mod:`distckpt.tiers.nodes`), instead of one directory for the job.

Each node's directory ends up holding the same global MANIFEST (every rank's data file named in
it) and the data files of its own ranks only: a node's copy is not a loadable checkpoint by
itself; together the nodes hold the whole step (and the drain copies it to the remote tier).
``G`` is the control group; a *leader* is the lowest rank of a node.

  2. PREPARE  G.gather of each rank's bytes to rank 0, which broadcasts the save id (the same on
              every node) and the bytes each node must find room for. Every leader runs
              ``Store.prepare`` in its node's directory (its own lock, reclaim, space check for its
              node's ranks, the save area); G.gather of the outcomes, G.broadcast of every node's
              area or error. A failed node: every leader aborts its area, every rank raises.
  3. WRITE    each rank writes its data file into its node's area (``Store.write_rank``); G.gather
              of :class:`distckpt.commit.WriteOutcome` to rank 0.
  4. COMMIT   rank 0 builds the MANIFEST from every rank's outcome (``commit.manifest_bytes``);
              G.scatter of a :class:`PublishOrder`: the MANIFEST bytes to every leader, or the
              WRITE failures (every leader aborts its area, every rank raises them). Every leader
              publishes the same bytes in its own directory (the node's commit point), discards a
              replaced checkpoint and runs ``after_commit`` there; G.gather of its
              :class:`NodeOutcome`; rank 0 decides and G.broadcasts the
              :class:`distckpt.commit.Verdict`, which every rank returns or raises.

The step is committed on the local tier only when every leader published. The leaders publish in
parallel, so a publish failing on one node after another node published leaves those nodes with a
consistent copy of an incomplete step: every rank then raises the failing node's typed error with
``committed = False`` and ``published_nodes`` naming the nodes that hold it (restore and drain must
treat such a step as incomplete). A failure before any publish leaves nothing on any node.

Every wait on a peer is a collective of ``G``, bounded by DISTCKPT_TIMEOUT_S.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import time
import uuid
from typing import Any, Callable

from .._dist import ControlGroup, _portable, control_group
from ..commit import Prepared, SaveResult, Verdict, WriteOutcome, discard_replaced, manifest_bytes
from ..coordinator import SAVE_GATE
from ..errors import (CommittedButPeerLostError, ConfigError, DistCkptError, PeerLostError, collective_error,
                      fill_rank)
from ..gcpause import gc_paused
from ..saveplan import PlannedSave, plan_save
from ..storage import Store, is_url, normalize_path, open_store
from .nodes import NodeLayout

__all__ = ["finish_node_save", "save_node_local", "PublishOrder", "NodeOutcome"]

log = logging.getLogger("distckpt")

# Room a data file needs beyond its tensor bytes (its chunks' alignment and index), per chunk and
# per file, and per node's directory (MANIFEST, directory entries): the margins finish_save uses.
_PER_CHUNK = 64 * 1024
_PER_NODE = 1 << 20


# ---------------------------------------------------------------------------------------------
# The messages of the per-node protocol (beside commit's Prepared, WriteOutcome and Verdict)


@dataclasses.dataclass(frozen=True, slots=True)
class _Start:
    """PREPARE's first broadcast from rank 0: the save's id (the same on every node) and the
    bytes node n's leader must find room for (``needed[n]``)."""

    save_id: str
    needed: tuple[int, ...]


@dataclasses.dataclass(frozen=True, slots=True)
class PublishOrder:
    """COMMIT's scatter from rank 0, one per rank: ``manifest``, the MANIFEST bytes every leader
    publishes (None on the other ranks), or what stops the save: every rank's WRITE error
    (``failures[r]``) or rank 0's own ``error`` (building the MANIFEST). With either, every leader
    aborts its node's area."""

    manifest: bytes | None
    failures: list | None = None
    error: BaseException | None = None


@dataclasses.dataclass(frozen=True, slots=True)
class NodeOutcome:
    """A leader's report of its publish: ``committed`` (published, durable, the replaced
    checkpoint discarded or logged), ``visible`` (the step is visible in its directory: committed,
    or renamed with a failed parent fsync), and the error of its publish or of ``after_commit``."""

    committed: bool
    visible: bool
    error: BaseException | None = None


# ---------------------------------------------------------------------------------------------


def finish_node_save(group: ControlGroup, planned: PlannedSave, *, final_dir: str, overwrite: bool,
                     metadata: dict | None, after_commit: Callable[[], None] | None = None,
                     local_error: BaseException | None = None, lock_path: str | None = None,
                     storage_options: dict | None = None, layout: NodeLayout) -> SaveResult:
    """Phases 2-4 (module docstring) on this rank, after :func:`distckpt.saveplan.plan_save`, with
    one directory per node: ``final_dir`` is this rank's path of the step in its own node's local
    directory (each node passes its own). Collective over ``group``; ``layout`` is
    :func:`distckpt.tiers.nodes.node_layout` of the same ranks. The contract is
    :func:`distckpt.commit.finish_save`'s, per node:

    ``after_commit``: run by each leader in its own directory, right after its node's publish,
    under the node's lock (the node's ``latest`` and rotation); so once per node, on its leader.
    ``lock_path``: the lock each leader holds from PREPARE to the end (a path of its own node;
    default ``.NAME.lock`` beside the step). ``local_error``: as finish_save (reported at WRITE).

    Returns the same :class:`SaveResult` on every rank but ``rank``, ``path`` (this rank's
    directory) and the I/O back end; ``save_id`` is the one in every node's MANIFEST.

    Raises (on every rank; before any publish nothing is committed on any node and every area is
    gone):
        ConfigError: ``layout`` is not a layout of ``group`` (raised at once on this rank; its
            peers then wait for it at most DISTCKPT_TIMEOUT_S).
        CheckpointExistsError, SaveInProgressError, DiskFullError, StorageError subclasses: a
            node's PREPARE or a rank's WRITE failed (errors.collective_error: the failing ranks'
            common class, else RankFailureError; ``failures`` holds each rank's error).
        The failing leaders' publish error(s), with ``committed = False`` and ``published_nodes``:
            the nodes (indices) where the step became visible nonetheless (an incomplete step;
            empty when no node published).
        The ``after_commit`` error(s) of leaders, with ``committed = True`` and
            ``published_nodes`` (every node): the step is committed on every node.
        PeerLostError: a peer died or did not answer within DISTCKPT_TIMEOUT_S. ``committed`` is
            False when this rank knows the step is not committed on every node (nothing was
            ordered to publish, or its own node did not publish), None when it cannot tell
            (``save_id`` says what to look for). CommittedButPeerLostError (a subclass): rank 0
            knows every node published, then a peer was lost.
    """
    _check_layout(group, layout)
    held: list = []
    store = open_store(final_dir, storage_options)
    try:
        return _finish_node_save(group, planned, final_dir=final_dir, overwrite=overwrite, metadata=metadata,
                                 after_commit=after_commit, local_error=local_error, lock_path=lock_path,
                                 layout=layout, held=held, store=store)
    finally:
        for lock in held:
            lock.release()


def save_node_local(state_dict: Any, final_dir: str | os.PathLike, *, layout: NodeLayout, process_group: Any = None,
                    blocking: bool = True, after_commit: Callable[[], None] | None = None,
                    lock_path: str | None = None, overwrite: bool = False, allow_pickle: bool = False,
                    metadata: dict | None = None, replicated: Any = "check",
                    on_outcome: Callable[[SaveResult | None, BaseException | None], None] | None = None,
                    stage_in_background: bool = False):
    """Save ``state_dict`` on the local tier: :func:`distckpt.save` (or, with ``blocking=False``,
    :func:`distckpt.async_save`) with :func:`finish_node_save` as phases 2-4. Collective over
    ``process_group`` (default: the world); ``final_dir`` is the step's path in this rank's own
    node directory; ``layout`` is :func:`distckpt.tiers.nodes.node_layout` over the same group.

    The blocking form plans and commits under :data:`distckpt.coordinator.SAVE_GATE` with the
    cyclic GC paused (as :func:`distckpt.coordinator.save_collective`), after any async save of
    this process has finished; ``blocking=False`` goes through
    :func:`distckpt.save_async.async_save_in_root` (its staging, its thread, its gate;
    ``stage_in_background`` is its option, refused by the caller for a blocking save).
    ``on_outcome(result, error)``: called with the outcome before this returns or raises (blocking)
    or before the handle reports done (async); an error it raises is logged, never hides the outcome.

    Returns:
        blocking: the :class:`SaveResult`; else an :class:`distckpt.save_async.AsyncSaveHandle`
        whose ``result()`` returns it.

    Raises (blocking; ``handle.result()`` otherwise): what :func:`finish_node_save` raises, the
    PLAN errors of :func:`distckpt.save` (StateDictMismatchError, UnsupportedValueError, ...), and
    first the error of an earlier async save that failed with nobody waiting on its handle
    (blocking: decided with every rank of the group, so every rank raises or none does, as
    :func:`distckpt.save`; see :func:`distckpt.save_async.raise_background_failure`).
    """
    from ..save_async import async_save_in_root, raise_background_failure, wait_for_saves
    path = normalize_path(final_dir)
    if not blocking:
        return async_save_in_root(state_dict, path, after_commit=after_commit, lock_path=lock_path,
                                  on_outcome=on_outcome, process_group=process_group, overwrite=overwrite,
                                  allow_pickle=allow_pickle, metadata=metadata, replicated=replicated,
                                  finish=functools.partial(finish_node_save, layout=layout), shared_path=False,
                                  stage_in_background=stage_in_background)
    wait_for_saves()  # an async save still in flight may yet fail: its error comes first
    group = control_group(process_group, operation="save()", kind="save")
    # With every rank of the group, as distckpt.save does: decided on this rank alone, a failure of
    # one rank's own save made that rank raise here while its peers went on into the save's
    # collectives and waited for it (RanksMissingError / PeerLostError after a timeout), and an
    # unread failure of a collective save was raised by no rank.
    raise_background_failure(group)
    result, error = None, None
    try:
        with SAVE_GATE, gc_paused():
            planned = plan_save(group, state_dict=state_dict, allow_pickle=allow_pickle, metadata=metadata,
                                path=path, replicated=replicated, shared_path=False)
            result = finish_node_save(group, planned, final_dir=path, overwrite=overwrite, metadata=metadata,
                                      after_commit=after_commit, lock_path=lock_path, layout=layout)
        return result
    except BaseException as exc:
        error = exc
        raise
    finally:
        if on_outcome is not None:
            try:
                on_outcome(result, error)
            except Exception as exc:  # noqa: BLE001 - bookkeeping must not hide the outcome
                log.error("distckpt: after the local save to %s: %s: %s", path, type(exc).__name__, exc)


# ---------------------------------------------------------------------------------------------


def _check_layout(group: ControlGroup, layout: NodeLayout) -> None:
    if layout.rank != group.rank or len(layout.node_of) != group.world_size:
        raise ConfigError(
            f"the node layout (rank {layout.rank} of {len(layout.node_of)}) is not one of this save's group "
            f"(rank {group.rank} of {group.world_size})", rank=group.rank,
            remedy="Compute the layout with distckpt.tiers.nodes.node_layout over the same process group.")


def _bytes_to_write(mine: list) -> int:
    """What this rank's data file needs on disk, at most: its tensor bytes plus the margins."""
    data = sum(p.tensor.numel() * p.tensor.element_size() for _, p in mine)
    return data + _PER_CHUNK * (len(mine) + 1)


def _abort_area(store: Store, area: str, world: int) -> None:
    """Delete this node's unpublished area; a failed clean-up is logged (the next save's reclaim
    finishes it), never raised over the error that made the save fail."""
    try:
        store.abort(area, world)
    except DistCkptError as cleanup_exc:
        log.warning("distckpt: could not remove %s after a failed save: %s", area, cleanup_exc)


def _one_error(failures: dict[int, BaseException], world: int, rank: int) -> BaseException:
    """The one error every rank raises for ``failures`` ({rank: error}, non-empty): the error
    itself in a one-rank group, else errors.collective_error (the common class, or RankFailureError)."""
    if world == 1:
        return next(iter(failures.values()))
    return collective_error(failures, operation="save", rank=rank)


@dataclasses.dataclass
class _State:
    """How far this rank got, for the clean-up and the truthful error of a lost peer."""

    write_failed: bool = False   # this rank's own WRITE (or staging) failed
    ordered: bool = False        # rank 0: it sent the leaders the MANIFEST to publish
    node_visible: bool = False   # leader: the step became visible in its node's directory
    data_kept: bool = False      # leader: its publish failed but the store says the area must stay
    area_gone: bool = False      # leader: its area was already aborted
    outcomes: list | None = None  # rank 0: every node's NodeOutcome, once gathered


def _finish_node_save(group: ControlGroup, planned: PlannedSave, *, final_dir: str, overwrite: bool,
                      metadata: dict | None, after_commit: Callable[[], None] | None,
                      local_error: BaseException | None, lock_path: str | None, layout: NodeLayout, held: list,
                      store: Store) -> SaveResult:
    """The body of :func:`finish_node_save` (same promises and errors): every lock it takes goes
    into ``held``, which the caller releases on every path."""
    t0 = planned.t0
    rank, world = group.rank, group.world_size
    mine = planned.mine
    leaders = layout.leaders
    marks = [time.monotonic()]  # the end of each phase, for SaveResult.phase_seconds

    def portable(exc: BaseException) -> BaseException:
        # A one-rank save keeps its exception object; between ranks it must unpickle anywhere.
        return exc if world == 1 else _portable(exc)

    # 2. PREPARE. Rank 0 alone knows the plan; the bytes of each node come from its ranks.
    counts = group.gather(_bytes_to_write(mine))
    start = None
    if rank == 0:
        needed = [_PER_NODE] * len(leaders)
        for r, n in enumerate(counts):
            needed[layout.node_of[r]] += n
        start = _Start(uuid.uuid4().hex, tuple(needed))
    start = group.broadcast(start)
    save_id = start.save_id
    mine_prepared = None
    if layout.is_leader:
        try:
            area, lock = store.prepare(final_dir, save_id, overwrite, start.needed[layout.node], rank, lock_path)
            held.append(lock)
            mine_prepared = Prepared(area, None)
        except Exception as exc:
            mine_prepared = Prepared(None, portable(fill_rank(exc, rank)))
    own_area = mine_prepared.area if mine_prepared is not None else None  # to publish or abort
    try:
        # Rank 0 gathers the leaders' outcomes and sends back one per node: what a rank receives
        # grows with the nodes, not the ranks.
        reports = group.gather(mine_prepared)
        by_node = tuple(reports[leader] for leader in leaders) if rank == 0 else None
        by_node = group.broadcast(by_node)
    except BaseException as exc:
        if own_area is not None:
            _abort_area(store, own_area, world)
        if isinstance(exc, PeerLostError):
            exc.committed = False  # nothing is published before every node has prepared
        raise
    area = by_node[layout.node].area
    failed = {leaders[n]: p.error for n, p in enumerate(by_node) if p.error is not None}
    if failed:
        if own_area is not None:
            _abort_area(store, own_area, world)
        group.raise_failures([failed.get(r) for r in range(world)],
                             mine_prepared.error if mine_prepared is not None else None, operation="save")
    marks.append(time.monotonic())

    # From here this leader holds an area: any way out before its publish removes it, so a failed
    # save leaves nothing on any node (a leader that lost its peers included).
    state = _State()
    try:
        return _write_and_commit(group, planned, final_dir=final_dir, overwrite=overwrite, metadata=metadata,
                                 after_commit=after_commit, local_error=local_error, layout=layout, store=store,
                                 save_id=save_id, area=area, marks=marks, t0=t0, portable=portable, state=state)
    except BaseException as exc:
        if own_area is not None and not (state.node_visible or state.data_kept or state.area_gone):
            _abort_area(store, own_area, world)
        if isinstance(exc, PeerLostError):
            told = _lost(exc, rank=rank, world=world, layout=layout, final_dir=final_dir, save_id=save_id,
                         state=state, store=store)
            if told is not exc:
                raise told from exc
        raise


def _write_and_commit(group: ControlGroup, planned: PlannedSave, *, final_dir: str, overwrite: bool,
                      metadata: dict | None, after_commit: Callable[[], None] | None,
                      local_error: BaseException | None, layout: NodeLayout, store: Store, save_id: str,
                      area: str, marks: list, t0: float, portable: Callable, state: _State) -> SaveResult:
    """Phases 3 and 4 (module docstring) into this node's ``area``; records its progress in
    ``state``. Returns or raises what :func:`finish_node_save` does."""
    rank, world = group.rank, group.world_size
    plan, mine = planned.plan, planned.mine
    leaders = layout.leaders

    # 3. WRITE
    result, error = None, local_error
    if error is None:
        try:
            index, size, backend, reason = store.write_rank(area, rank, mine, plan.checksum_block)
            result = WriteOutcome(tuple(index), size, backend, reason)
        except Exception as exc:
            error = exc
    state.write_failed = error is not None
    marks.append(time.monotonic())
    outcomes = group.gather(result if error is None else WriteOutcome(None, None, None, None, _portable(error)))

    # 4. COMMIT: rank 0 orders every leader to publish the MANIFEST, or every leader to abort.
    orders = None
    sizes = None
    if rank == 0:
        stop = None
        if any(o.error is not None for o in outcomes):
            stop = PublishOrder(None, failures=[o.error for o in outcomes])
        else:
            try:
                manifest = manifest_bytes(plan, outcomes, save_id, world, plan.checksum_block, metadata, final_dir)
                sizes = [o.size for o in outcomes]
            except Exception as exc:
                stop = PublishOrder(None, error=portable(fill_rank(exc, 0)))
        if stop is not None:
            orders = [stop] * world
        else:
            leader_set = set(leaders)
            orders = [PublishOrder(manifest if r in leader_set else None) for r in range(world)]
            state.ordered = True
    order = group.scatter(orders)
    if order.failures is not None or order.error is not None:
        if layout.is_leader:
            _abort_area(store, area, world)
            state.area_gone = True
        if order.failures is not None:
            group.raise_failures(order.failures, error, operation="save")
        raise fill_rank(order.error, 0)  # rank 0 built the MANIFEST

    mine_outcome = None
    if layout.is_leader:
        mine_outcome = _publish_node(store, area, final_dir, order.manifest, overwrite, after_commit, world, rank,
                                     portable, state)
    reports = group.gather(mine_outcome)
    verdict = None
    if rank == 0:
        state.outcomes = [reports[leader] for leader in leaders]
        verdict = _verdict(state.outcomes, leaders, world, sizes, save_id)
    told = group.broadcast(verdict)
    if told.error is not None:
        raise told.error
    marks.append(time.monotonic())
    phases = {"plan": planned.plan_seconds, "prepare": marks[1] - marks[0], "write": marks[2] - marks[1],
              "commit": marks[3] - marks[2]}
    return SaveResult(
        path=final_dir if is_url(final_dir) else os.path.abspath(final_dir), world_size=world, rank=rank,
        bytes_per_rank=told.sizes, total_bytes=sum(told.sizes), seconds=marks[3] - t0, backend=result.backend, backend_reason=result.reason,
        save_id=save_id, plan_cached=planned.plan_cached, plan_seconds=planned.plan_seconds, phase_seconds=phases)


def _publish_node(store: Store, area: str, final_dir: str, manifest: bytes, overwrite: bool,
                  after_commit: Callable[[], None] | None, world: int, rank: int, portable: Callable,
                  state: _State) -> NodeOutcome:
    """A leader's COMMIT in its node's directory, as finish_save's rank 0 does it: publish (the
    node's commit point), discard a replaced checkpoint, ``after_commit``. Never raises: the
    outcome is reported to rank 0. Before the publish, a failure aborts the area (unless the store
    says its data must stay)."""
    try:
        replaced = store.publish(area, final_dir, manifest, overwrite)
    except Exception as exc:
        visible = bool(getattr(exc, "published", False))  # renamed, then the parent fsync failed
        state.node_visible = visible
        state.data_kept = bool(getattr(exc, "data_kept", False))
        if not visible and not state.data_kept:
            _abort_area(store, area, world)
            state.area_gone = True
        return NodeOutcome(committed=False, visible=visible, error=portable(fill_rank(exc, rank)))
    state.node_visible = True
    discard_replaced(store, replaced)  # housekeeping: never turns a committed node into a failed one
    if after_commit is not None:
        try:
            after_commit()
        except Exception as exc:
            return NodeOutcome(committed=True, visible=True, error=portable(fill_rank(exc, rank)))
    return NodeOutcome(committed=True, visible=True)


def _verdict(outcomes: list[NodeOutcome], leaders: tuple[int, ...], world: int, sizes: list[int],
             save_id: str) -> Verdict:
    """Rank 0's decision from every node's outcome: committed only when every node committed
    (an ``after_commit`` error then says ``committed`` and the ``save_id``, which its drain needs)."""
    visible = [n for n, o in enumerate(outcomes) if o.visible]
    if all(o.committed for o in outcomes):
        errors = {leaders[n]: o.error for n, o in enumerate(outcomes) if o.error is not None}
        if not errors:
            return Verdict(None, None, sizes)
        err = _one_error(errors, world, 0)  # after_commit failed: the step is committed all the same
        err.committed, err.published_nodes, err.save_id = True, visible, save_id
        return Verdict(None, err, None)
    errors = {leaders[n]: o.error for n, o in enumerate(outcomes) if not o.committed}
    err = _one_error(errors, world, 0)
    err.committed, err.published_nodes = False, visible
    if visible:
        failed = [n for n, o in enumerate(outcomes) if not o.committed]
        note = (f"distckpt: the step is NOT committed on the local tier: node(s) {failed} failed to publish it, "
                f"while node(s) {visible} published it (a consistent copy of an incomplete step: not loadable "
                f"from the local tier alone)")
        err.add_note(note)
        log.error(note)
    return Verdict(None, err, None)


def _lost(lost: PeerLostError, *, rank: int, world: int, layout: NodeLayout, final_dir: str, save_id: str,
          state: _State, store: Store) -> PeerLostError:
    """The truthful error for a peer lost after PREPARE (see :func:`finish_node_save`)."""
    others = [r for r in range(world) if r != rank]
    if state.outcomes is not None:  # rank 0 heard every node: it knows the outcome
        visible = [n for n, o in enumerate(state.outcomes) if o.visible]
        if all(o.committed for o in state.outcomes):
            return CommittedButPeerLostError(
                f"the step {save_id} is committed on every node's local directory, but a peer was lost before "
                f"every rank heard the verdict ({lost.message})", path=final_dir, rank=rank, committed=True,
                lost_ranks=others, after_commit_error=None, published_nodes=visible)
        lost.committed, lost.published_nodes = False, visible
        return lost
    if state.write_failed or (rank == 0 and not state.ordered) or (layout.is_leader and not state.node_visible):
        # No publish was ordered, or this node has no copy: the step is not committed on every node.
        lost.committed = False
        return lost
    try:
        here = store.committed_save_id(final_dir) == save_id
    except Exception:  # noqa: BLE001 - absent or unreadable: this node's copy is not proven
        here = False
    lost.committed, lost.save_id = None, save_id
    lost.add_note(f"distckpt: this rank cannot tell whether every node published the step (save_id {save_id}); "
                  f"this node's directory {'holds' if here else 'does not hold'} it at {final_dir}")
    return lost
