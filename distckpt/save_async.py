"""``distckpt.async_save``: return once the state is staged; write and commit in the background.

How an async save runs on each rank (the phases are :mod:`distckpt.coordinator`'s):

  1. caller thread: take the process-wide save gate (:data:`coordinator.SAVE_GATE`), so a second
     save -- async or sync -- waits for this one, in call order;
  2. caller thread: PLAN (flatten, all-gather of the summaries, owner assignment) on the control
     group. Non-tensor values, the tree and the metadata are encoded / copied here;
  3. caller thread: copy every piece *this rank will write* (replicas owned by another rank are not
     copied) into one arena of aligned host memory from the
     :class:`~distckpt.staging.pool.StagingPool` (pinned when CUDA is available; device tensors
     are copied with non_blocking DMA, then one synchronize). The call returns the
     :class:`AsyncSaveHandle` here;
  4. background thread (one per save, non-daemon): PREPARE, WRITE, COMMIT over the staged copies,
     on a gloo group of its own (so the caller's later loads and collectives on the control group
     cannot interleave with it), then release the arena and the gate.

Invariants:
  * Snapshot isolation: once :func:`async_save` returns, the bytes that will be saved are in
    staging memory owned by the save; changing any tensor of the state dict (in place, any size)
    does not change the checkpoint.
  * Bounded, releasable staging: one arena per save in flight, kept for the next save when it
    fits, within DISTCKPT_STAGING_POOL_BYTES (:mod:`distckpt.staging.pool`);
    :func:`~distckpt.staging.pool.release_staging_memory` (and ``CheckpointManager.close()``) frees
    it now.
  * Errors reach :meth:`AsyncSaveHandle.result` as the same typed errors a sync save raises (the
    same exception objects); a failed save commits nothing. One exception to "the same": a
    collective save whose group this process destroyed under it fails with
    :class:`~distckpt.errors.ProcessGroupDestroyedError` (not the PeerLostError its broken
    collective raised: no peer was lost).
  * A failure is never silent: an async save that fails while nobody waits on its handle (no
    ``result()`` / ``exception()`` returned its error) is raised -- the same exception object, its
    original class -- at this process's next ``save`` / ``async_save`` / CheckpointManager call
    (:func:`raise_background_failure`), and logged as an error at interpreter exit if still unseen.
    The failure of a collective save (several ranks) is decided with every rank, at the next
    collective save or load on the same ranks: it counts as seen when any rank took it from its
    handle; otherwise every rank raises it at that same call. A rank never skips a save its peers
    run (which would pair different saves across ranks).
  * Nothing is left behind: once :meth:`~AsyncSaveHandle.done` is true the worker thread has ended
    (``result()`` joins it) and every fd of the save is closed. At interpreter exit a save in
    flight is finished (its thread is non-daemon, and an exit hook says it is waiting), never left
    half-committed: the commit protocol makes a killed save invisible.
  * A forked child (DataLoader workers, multiprocessing fork) inherits none of it: not the saves in
    flight (its exit does not wait for them, their failures are not raised in it), not the save
    gate, not the staging segments; it can save on its own.
"""

from __future__ import annotations

import copy
import logging
import os
import sys
import threading
import time
import weakref
from typing import Any, Callable

from ._dist import ControlGroup, _portable, control_group, group_destroyed
from .commit import SaveResult, finish_save
from .coordinator import SAVE_GATE
from .errors import (ConfigError, DistCkptError, PeerLostError, ProcessGroupDestroyedError, StateChangedError,
                     collective_error)
from .saveplan import plan_save
from .staging.pool import reserve_staging_memory, stage, staging_ended, staging_pool, staging_started
from .storage.posix.probe import ensure_sigxfsz_ignored

# reserve_staging_memory is staging.pool's own, exported here too: distckpt.reserve_staging_memory
# resolves through this module, so reserving ahead also imports the save path (distckpt/__init__).
__all__ = ["async_save", "async_save_in_root", "AsyncSaveHandle", "raise_background_failure", "wait_for_saves",
           "reserve_staging_memory"]

log = logging.getLogger("distckpt")


class AsyncSaveHandle:
    """The result of :func:`distckpt.async_save` (and ``CheckpointManager.save(..., blocking=False)``).

    Attributes:
        path: the checkpoint directory being saved.
        staged_bytes: bytes this rank copied into staging memory (set once :meth:`staged`).
        blocked_seconds: how long the call blocked the caller (gate wait + plan, + staging unless
            ``stage_in_background``).
        staging_seconds: how long the copy into staging memory took, on whichever thread ran it.
    """

    def __init__(self, path: str) -> None:
        self.path = path
        self.staged_bytes = 0
        self.blocked_seconds = 0.0
        self.staging_seconds = 0.0
        self._staged = threading.Event()
        self._staged_lock = threading.Lock()
        self._staged_callbacks: list[Callable[[], None]] = []
        self._event = threading.Event()
        self._result: SaveResult | None = None
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None
        self._observed = False  # result()/exception() handed its outcome to someone
        # A save of several ranks: (the group's global ranks, its number among this process's
        # collective async saves on them), the same on every rank; None for a one-rank save.
        self._collective: tuple[tuple[int, ...], int] | None = None

    def staged(self) -> bool:
        """True once the save no longer reads the state's tensors: its copy into staging memory is
        over, or the save failed before it. From then on the caller may change them. Always true
        when :func:`async_save` has returned, unless it was called with ``stage_in_background``."""
        return self._staged.is_set()

    def wait_staged(self, timeout: float | None = None) -> bool:
        """Wait until :meth:`staged` (not for the write). Returns :meth:`staged`. A failed staging
        is not raised here: the save fails on every rank and ``result()`` raises it."""
        self._staged.wait(timeout)
        return self.staged()

    def _set_staged(self) -> None:
        """Mark the staging over (idempotent) and run the callbacks waiting for it."""
        with self._staged_lock:
            if self._staged.is_set():
                return
            self._staged.set()
            callbacks, self._staged_callbacks = self._staged_callbacks, []
        for fn in callbacks:
            try:
                fn()
            except Exception as exc:  # noqa: BLE001 - a waiter's bookkeeping must not stop the save
                log.error("distckpt: a callback on the staging of %s failed: %s: %s", self.path,
                          type(exc).__name__, exc)

    def _on_staged(self, fn: Callable[[], None]) -> None:
        """Call ``fn()`` once the staging is over (now, if it is), on the thread that ends it."""
        with self._staged_lock:
            if not self._staged.is_set():
                self._staged_callbacks.append(fn)
                return
        fn()

    def done(self) -> bool:
        """True once the save has committed or failed (its thread has no more work)."""
        return self._event.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        """Wait until the save has committed or failed, without taking its outcome (a failure
        nobody takes is still raised at the next checkpoint call). Returns :meth:`done`."""
        self._event.wait(timeout)
        return self.done()

    def result(self, timeout: float | None = None) -> SaveResult:
        """Wait for the save and return its :class:`SaveResult`.

        Raises:
            TimeoutError: not finished within ``timeout`` seconds (the save goes on).
            The typed error of the save (the same classes :func:`distckpt.save` raises).
        """
        if not self._event.wait(timeout):
            raise TimeoutError(f"async save to {self.path} did not finish within {timeout} s")
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join()
        self._mark_observed()
        if self._error is not None:
            raise self._error
        assert self._result is not None
        return self._result

    def exception(self, timeout: float | None = None) -> BaseException | None:
        """The save's error (None when it succeeded), after waiting like :meth:`result`."""
        try:
            self.result(timeout)
        except TimeoutError:
            if not self._event.is_set():
                raise
            return self._error
        except BaseException as exc:  # noqa: BLE001 - the save's own error
            return exc
        return None

    def _mark_observed(self) -> None:
        with _FAILED_LOCK:
            self._observed = True
            if self in _UNSEEN_FAILURES:
                _UNSEEN_FAILURES.remove(self)

    def _finish(self, result: SaveResult | None, error: BaseException | None) -> None:
        self._set_staged()  # (already, unless the save failed before its staging)
        self._result, self._error = result, error
        if error is not None:
            with _FAILED_LOCK:
                if self._collective is not None:
                    # Whether it was seen is decided with the other ranks (raise_background_failure),
                    # whatever this rank does with its handle.
                    _COLLECTIVE_FAILURES.append(self)
                elif not self._observed:
                    _UNSEEN_FAILURES.append(self)
        self._event.set()

    def __repr__(self) -> str:
        state = "pending" if not self.done() else ("failed" if self._error is not None else "done")
        return f"<AsyncSaveHandle {self.path} {state}>"


# In-flight handles (weak: a finished save does not keep its handle alive).
_INFLIGHT: "weakref.WeakSet[AsyncSaveHandle]" = weakref.WeakSet()
_exit_hook_registered = False
# Failed one-rank saves whose error nobody has taken yet (strong references: the caller may have
# dropped the handle; the error must still surface).
_UNSEEN_FAILURES: list[AsyncSaveHandle] = []
# Failed collective saves not yet decided with the other ranks (seen or not by this rank).
_COLLECTIVE_FAILURES: list[AsyncSaveHandle] = []
# group members -> how many collective async saves this process started on them.
_COLLECTIVE_SEQ: dict[tuple[int, ...], int] = {}
_FAILED_LOCK = threading.Lock()


def _after_fork_in_child() -> None:
    """A forked child (DataLoader worker, multiprocessing fork) forgets the parent's async saves:
    it did not start them, their threads do not exist in it (waiting for them at its exit would
    never end), and their outcome is the parent's to report. The lock may have been inherited
    held. The save gate and the staging pool reset themselves (coordinator, staging.pool)."""
    global _INFLIGHT, _FAILED_LOCK
    _INFLIGHT = weakref.WeakSet()
    _UNSEEN_FAILURES.clear()
    _COLLECTIVE_FAILURES.clear()
    _COLLECTIVE_SEQ.clear()
    _FAILED_LOCK = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def wait_for_saves() -> None:
    """Wait until no async save of this process is in flight (they finish, committed or failed)."""
    for h in list(_INFLIGHT):
        h._event.wait()


def raise_background_failure(group: ControlGroup | None = None, *, lost: tuple[int, ...] | None = None) -> None:
    """Raise the error of an async save of this process that failed with nobody waiting on its
    handle: the same exception object (its original class), with a note saying where it came
    from. Every such failure is reported once (the oldest is raised; the others are named in its
    note). Does nothing when there is none; does not wait for saves in flight.

    ``group`` None or of one rank: this process alone decides, and only the failures of its
    one-rank saves (``no_dist``, a one-rank group) are raised; a collective save's failure waits
    for a call with its group -- except a collective save that failed with
    :class:`~distckpt.errors.ProcessGroupDestroyedError` (this process destroyed its group under
    it) when no process group is initialized any more: it is raised here too, by this rank alone
    (no group is left to decide it on, and no collective for the ranks to disagree on).
    ``lost``: the members (:meth:`ControlGroup.members`) of a group known to have lost a peer
    (the caller met PeerLostError on it): its collective saves' unseen failures can never be
    decided with the peers either, so this rank raises its own error of them, alone.

    ``group`` of several ranks: collective (every rank of ``group`` calls it, at the same call: the
    start of a collective save or load, after this process's saves on it have finished). One
    all-gather of what each rank has unseen, then every rank takes the same decision:

      * a failed collective save on these ranks counts as seen when any rank took its error from
        its handle (nothing is raised for it); otherwise every rank raises its own error of that
        save (the same class everywhere: its verdict was broadcast);
      * a failed one-rank save of some rank: that rank raises its error, every other rank a
        collective error naming it (:func:`distckpt.errors.collective_error`), so that no rank
        goes on into a collective its peers skip.

    Called by ``save``, ``async_save`` and the CheckpointManager's calls, so a background failure
    reaches the training loop at its next checkpoint call at the latest.

    Raises:
        The failed save's own error (see above); a collective error naming the ranks whose own
        failure is raised; PeerLostError when the exchange itself fails (nothing is marked seen).
    """
    if group is None or group.world_size == 1:
        from ._dist import is_distributed
        no_group = not is_distributed()
        with _FAILED_LOCK:
            failed = list(_UNSEEN_FAILURES)
            _UNSEEN_FAILURES.clear()
            if no_group:
                # A collective save whose group this process destroyed under it can never be
                # decided with its peers (there is no group left to decide on): left pending, it
                # would surface only as a log line at exit. With no process group at all there is
                # no collective for the ranks to disagree on either, so this rank raises it alone.
                gone = [h for h in _COLLECTIVE_FAILURES
                        if isinstance(h._error, ProcessGroupDestroyedError) and not h._observed]
            else:
                gone = []
            if lost:
                # That group decides nothing more: left pending, the failure would surface only
                # as a log line at exit, and a close would return as if the save had committed.
                gone += [h for h in _COLLECTIVE_FAILURES if h not in gone and not h._observed
                         and h._collective is not None and h._collective[0] == tuple(lost)]
            if gone:
                for h in gone:
                    _COLLECTIVE_FAILURES.remove(h)
                failed += gone
            for h in failed:
                h._observed = True
        if failed:
            _raise_oldest(failed)
        return
    key = group.members()
    with _FAILED_LOCK:
        local = list(_UNSEEN_FAILURES)
        pending = [h for h in _COLLECTIVE_FAILURES if h._collective is not None and h._collective[0] == key]
    report = None  # the common case: nothing to tell (a few bytes)
    if local or pending:
        report = ({h._collective[1]: h._observed for h in pending},  # type: ignore[index]
                  _portable(local[0]._error) if local else None)
    reports = group.all_gather(report)
    with _FAILED_LOCK:  # decided: none of these is reported again
        for h in local:
            h._observed = True
            if h in _UNSEEN_FAILURES:
                _UNSEEN_FAILURES.remove(h)
        for h in pending:
            if h in _COLLECTIVE_FAILURES:
                _COLLECTIVE_FAILURES.remove(h)
    # Raised only when every rank reported the save failed and none had seen it: every rank then
    # holds an error of that save to raise, and all decide alike from the same reports.
    unseen_everywhere = [h for h in pending
                         if all(rep is not None and rep[0].get(h._collective[1]) is False  # type: ignore[index]
                                for rep in reports)]
    mine = unseen_everywhere + local
    if mine:
        _raise_oldest(mine)
    peers = {r: rep[1] for r, rep in enumerate(reports) if rep is not None and rep[1] is not None}
    if peers:
        exc = collective_error(peers, operation="an earlier async save", rank=group.rank)
        note = (f"distckpt: rank(s) {sorted(peers)} raise the error of an async save of their own that failed in "
                f"the background with nobody taking its error; every rank raises at this call, so that none "
                f"goes on into a collective its peers skip")
        if hasattr(exc, "add_note"):
            exc.add_note(note)
        log.error(note)
        raise exc


def _raise_oldest(failed: list[AsyncSaveHandle]) -> None:
    """Raise the first of ``failed`` (its own error object), the others named in its note."""
    first = failed[0]
    exc = first._error
    assert exc is not None
    note = (f"distckpt: the async save to {first.path} failed in the background and nobody took its error "
            f"from the handle (result()/exception()); raised at this process's next checkpoint call")
    if len(failed) > 1:
        note += "; later failed async saves: " + ", ".join(f"{h.path} ({type(h._error).__name__})" for h in failed[1:])
    if hasattr(exc, "add_note"):
        exc.add_note(note)
    log.error(note)
    raise exc


def _at_exit() -> None:
    pending = [h for h in list(_INFLIGHT) if not h.done()]
    for h in pending:
        log.warning("distckpt: waiting for the async save to %s to finish before exiting", h.path)
        h._event.wait()
    with _FAILED_LOCK:
        failed = list(_UNSEEN_FAILURES) + [h for h in _COLLECTIVE_FAILURES if not h._observed]
        _UNSEEN_FAILURES.clear()
        _COLLECTIVE_FAILURES.clear()
    for h in failed:
        log.error("distckpt: the async save to %s FAILED and its error was never retrieved (nobody called "
                  "result() on its handle, and no later checkpoint call raised it): %s: %s",
                  h.path, type(h._error).__name__, h._error)


def _register_exit_hook() -> None:
    global _exit_hook_registered
    if _exit_hook_registered:
        return
    # threading's exit hooks run before the interpreter joins non-daemon threads (and before
    # atexit): the wait is explicit and logged. The non-daemon worker is the backstop.
    register = getattr(threading, "_register_atexit", None)
    try:
        if register is not None:
            register(_at_exit)
        else:  # pragma: no cover - Python < 3.9
            import atexit
            atexit.register(_at_exit)
        _exit_hook_registered = True
    except RuntimeError:  # interpreter already shutting down
        pass


def _destroyed_group_error(error: BaseException, group: ControlGroup, final_dir: str) -> BaseException:
    """``error`` of a collective save's background phases, or a ProcessGroupDestroyedError in its
    place when this process destroyed the group under the save.

    Why: a collective over a destroyed group fails ("Group ... is not registered", or the pairs
    closed by a peer's destroy), and ControlGroup reports every failing collective as a
    PeerLostError -- which would tell the caller a peer died and send them to other ranks' logs,
    when it was their own ``destroy_process_group()`` with the save in flight. Decided on the save's
    thread right after the failure, from this process's own state only: a rank whose peer
    destroyed the group but that did not destroy it itself has really lost that peer (its
    PeerLostError stands). The commit state is the PeerLostError's (``committed`` True on a
    CommittedButPeerLostError, None where this rank cannot tell, else False: a PeerLostError
    before the commit point commits nothing)."""
    if group.world_size == 1 or not isinstance(error, PeerLostError) or not group_destroyed(group):
        return error
    committed = getattr(error, "committed", False)
    save_id = getattr(error, "save_id", None)
    state = {True: "it IS committed (rank 0 committed it before the group went away)",
             False: "nothing is committed",
             None: "this rank cannot tell whether it committed"
                   + (f" (it did if the MANIFEST at the path carries save id {save_id})" if save_id else "")
             }.get(committed, "nothing is committed")
    out = ProcessGroupDestroyedError(
        f"the process group was destroyed (torch.distributed.destroy_process_group()) while the async save to "
        f"{final_dir} was in flight: its background phases could not finish their collectives, {state}",
        path=final_dir, rank=getattr(error, "rank", None), committed=committed, save_id=save_id)
    out.__cause__ = error
    return out


def _interruption(exc: BaseException, final_dir: str) -> DistCkptError:
    """This rank's error of an async save whose staging ``exc`` (KeyboardInterrupt, SystemExit)
    interrupted: reported at WRITE, so that the other ranks fail at once naming this rank."""
    error = DistCkptError(f"staging the async save to {final_dir} was interrupted on this rank by "
                          f"{type(exc).__name__}; nothing is committed",
                          remedy="That rank's caller received the interruption; save again on every rank once "
                                 "it is handled.")
    error.__cause__ = exc
    return error


_GUARD_WARNED = False


class _StagingGuard:
    """What keeps a staging off the caller's thread from saving a mix of two states.

    * Each staged source tensor's version counter at the call (and, for a DTensor's local tensor,
      the DTensor's: a single-tensor in-place DTensor operation moves only the wrapper's),
      compared after the copies: every in-place torch operation on a plain tensor or a view of it
      moves its counter when it is dispatched, so a moved counter means the copy may hold a mix
      (:class:`~distckpt.errors.StateChangedError`).
    * A torch.optim step waits for the staging (:func:`distckpt.staging.pool._wait_before_step`):
      optimizer steps through DTensors and fused kernels move no counter.
    * A CUDA event recorded on the caller's current stream of each device holding a source: the
      copies start after the work queued before the call, on a side stream
      (:func:`distckpt.staging.pool.stage`).

    * Each staged tensor's shape, strides, offset and storage (address and size), compared before
      and after the copies (:meth:`moved_error`).

    What no counter sees (``torch._foreach_*`` in-place operations on DTensors outside an
    optimizer, writes through ``.data``, numpy or DLPack views, in-place collectives such as DDP's
    buffer broadcast, extension kernels outside torch.optim, a storage freed with
    ``untyped_storage().resize_(0)`` while its copy runs: a crash, not only a mix) is ruled out
    only by the contract: nothing changes the state before ``wait_staged()``. A state holding TorchRec's
    sharded tables (updated inside the backward by fused kernels) or an inference-mode tensor (no
    counter) is staged on the caller's thread instead. On CUDA the counter check is exact (an
    operation queued after it runs behind copies already finished); on the CPU an operation still
    running on another thread when the copies end moves the counter only when it returns."""

    def __init__(self, path: str, watched: list, events: dict, shapes: list | None = None) -> None:
        self.path = path
        self._watched = watched      # [(fqn, tensor, version at the call)]
        self.events = events         # {CUDA device: event on the caller's stream at the call}
        self._shapes = shapes or []  # [(fqn, tensor, its geometry at the call)]

    @classmethod
    def capture(cls, mine: list, path: str) -> "_StagingGuard | None":
        """The guard of ``mine`` ((fqn, Piece) pairs) at the call, or None when a piece cannot be
        guarded (see the class docstring): such a state is staged on the caller's thread."""
        global _GUARD_WARNED
        import torch
        watched, devices, shapes = [], set(), []
        for fqn, piece in mine:
            t = piece.tensor
            why = ("a TorchRec sharded table (its fused optimizer updates it inside the backward, which no "
                   "version counter shows)" if piece.unguarded else
                   "an inference-mode tensor (it has no version counter)" if t.is_inference() else None)
            if why is not None:
                if not _GUARD_WARNED:
                    _GUARD_WARNED = True
                    log.warning("distckpt: async save to %s: %r is %s; staging on the caller's thread "
                                "(stage_in_background is not used for such states)", path, fqn, why)
                return None
            watched.append((fqn, t, t._version))
            shapes.append((fqn, t, _geometry(t)))
            if piece.owner is not None:
                watched.append((fqn, piece.owner, piece.owner._version))
            if t.device.type == "cuda":
                devices.add(t.device)
        events = {}
        for dev in devices:
            ev = torch.cuda.Event()
            ev.record(torch.cuda.current_stream(dev))
            events[dev] = ev
        return cls(path, watched, events, shapes)

    def moved_error(self) -> StateChangedError | None:
        """Before and after the copies: a StateChangedError naming the tensors whose shape,
        strides, offset or storage changed since the call (``resize_``, ``set_``, ``as_strided_``:
        a copy of such a tensor failed as a bare RuntimeError, an outside trial; a storage emptied
        with ``untyped_storage().resize_(0)``, which moves no version counter), or None. A storage
        freed *while* its copy runs cannot be caught: the copy reads freed memory (the contract
        rules it out, as it does for DCP's background staging)."""
        moved = list(dict.fromkeys(fqn for fqn, t, g in self._shapes if _geometry(t) != g))
        return None if not moved else self._error(moved, "resized, re-pointed or freed")

    def changed_error(self) -> StateChangedError | None:
        """A StateChangedError naming the tensors whose counter moved since the call, or None."""
        changed = list(dict.fromkeys(fqn for fqn, t, v in self._watched if t._version != v))
        return None if not changed else self._error(changed, "changed in place")

    def _error(self, keys: list[str], how: str) -> StateChangedError:
        shown = ", ".join(repr(k) for k in keys[:8]) + (f" and {len(keys) - 8} more" if len(keys) > 8 else "")
        return StateChangedError(
            f"async save to {self.path} (stage_in_background): {len(keys)} tensor(s) of the state were {how} "
            f"before their copy into staging memory ended: {shown}; the copy may hold a mix of two "
            f"values, so nothing is committed", path=self.path, keys=keys)

    def close(self) -> None:
        """Drop the references to the caller's tensors (the staging is over)."""
        self._watched = []
        self._shapes = []
        self.events = {}


def _geometry(t: Any) -> tuple:
    """What a copy of ``t`` relies on: its shape, strides, storage offset, and its storage's address
    and size."""
    storage = t.untyped_storage()
    return tuple(t.shape), t.stride(), t.storage_offset(), storage.data_ptr(), storage.nbytes()


#: What a save's thread imports the first time it runs (its modules import these inside
#: functions, where they are needed). Imported by the caller's thread before the first save thread
#: starts: a process that forks while a thread is inside an import leaves the child that module's
#: lock, held by a thread the child does not have, and the child's first save hangs on it for ever
#: (an outside trial: a DataLoader starting its workers right after the job's first async save, its
#: workers saving). tests/protocol/test_async_save.py checks that a save's thread imports nothing.
_THREAD_MODULES = ("distckpt.datafile", "distckpt.hf", "distckpt.staging.ring", "distckpt.storage.roots",
                   "distckpt.storage.posix.store", "distckpt.storage.posix.commit", "distckpt.storage.posix.leftovers",
                   "distckpt.storage.posix.loading", "distckpt.storage.posix.locate", "distckpt.storage.posix.manifests",
                   "distckpt.storage.posix.savelock", "distckpt.storage.posix.saving")
_OBJECT_THREAD_MODULES = ("distckpt.storage.object.store", "distckpt.storage.object.check",
                          "fsspec.implementations.chained")


def _import_thread_modules(url: bool) -> None:
    """Import :data:`_THREAD_MODULES` (and, for a save to an object store, the object store's) in
    this thread: a no-op once they are imported."""
    import importlib
    for name in _THREAD_MODULES + (_OBJECT_THREAD_MODULES if url else ()):
        if name not in sys.modules:
            importlib.import_module(name)


def _background_group(process_group: Any, fg: ControlGroup) -> ControlGroup:
    """The channel for the background phases (created once per process group; a collective the
    first time, run by every rank in the caller's thread)."""
    if fg.world_size == 1:
        return fg
    return control_group(process_group, channel="background")


def async_save(state_dict: Any, path: str | os.PathLike, *, process_group: Any = None, overwrite: bool = False,
               allow_pickle: bool = False, metadata: dict | None = None, replicated: Any = "check",
               no_dist: bool = False, storage_options: dict | None = None,
               stage_in_background: bool = False) -> AsyncSaveHandle:
    """Save ``state_dict`` at ``path`` like :func:`distckpt.save`, returning once it is staged.

    Collective like :func:`distckpt.save` (every rank calls it, in the same order as its other
    saves). Blocks the caller only for: waiting for this process's previous save still in flight,
    the PLAN exchange, and one copy of the pieces this rank writes into reusable aligned staging
    memory. After it returns the caller may change any tensor of ``state_dict`` in place: the
    checkpoint holds the values at the time of the call.

    ``stage_in_background=True`` (torchtitan's ``async_with_pinned_mem``, DCP's
    ``use_async_staging``): the call returns after the PLAN, and the copy into staging memory runs
    on the save's thread (device copies on a side stream that starts after the work queued before
    the call), so the next steps' forward and backward overlap it, and memory that is not reserved
    yet is allocated there, never on the caller's path. The caller must not change the state's
    tensors until ``handle.wait_staged()`` returns (a training loop: before its optimizer step).
    Values other than tensors are taken at the call. Guarded, not trusted: a torch.optim
    optimizer's ``step()`` waits for the staging (with a warning), a staged tensor changed in place
    by any other torch operation before its copy ended fails the save with
    :class:`~distckpt.errors.StateChangedError` on every rank (nothing committed), and
    :func:`distckpt.load` waits for it first. Writes no version counter shows (``.data``, numpy
    views, in-place collectives, ``_foreach_*`` on DTensors, extension kernels) are ruled out by
    the contract only. A state
    holding a TorchRec sharded table or an inference-mode tensor is staged on the caller's thread,
    as without the option (logged once). Best on a GPU, where the copy is DMA; on a CPU-only host
    it takes the cores training runs on (docs/BENCHMARKS.md, "The first async save").

    Args: as :func:`distckpt.save`, and ``stage_in_background`` (above).

    Returns:
        An :class:`AsyncSaveHandle`: ``result(timeout=None)`` waits and returns the SaveResult or
        raises the save's typed error; ``done()`` says whether it finished.

    Raises:
        ConfigError: ``stage_in_background`` is not a bool (before anything of the save runs).
        Nothing for a failed save: every save error (CheckpointExistsError,
        UnsupportedValueError, StateDictMismatchError, DiskFullError..., RankFailureError (ranks
        failing with different classes),
        PeerLostError) is raised by ``handle.result()``, as the same class a sync save raises;
        ProcessGroupDestroyedError when this process destroyed the process group
        (``torch.distributed.destroy_process_group()``) with the save in flight (its ``committed``
        says the commit state: False, nothing committed, where such a save stops).
        A KeyboardInterrupt (any BaseException) during staging propagates (nothing is
        committed); the other ranks' handles fail at once with a RankFailureError naming this
        rank, not after DISTCKPT_TIMEOUT_S.
        The error of an *earlier* async save that failed with nobody waiting on its handle is
        raised here (its own class; see :func:`raise_background_failure`: for a collective save,
        on every rank or on none) and this save is not started; PeerLostError when that decision's
        exchange with the other ranks fails.
    """
    return async_save_in_root(state_dict, path, process_group=process_group, overwrite=overwrite,
                              allow_pickle=allow_pickle, metadata=metadata, replicated=replicated, no_dist=no_dist,
                              storage_options=storage_options, stage_in_background=stage_in_background)


def _ended_before_staging(handle: "AsyncSaveHandle", exc: BaseException, on_outcome, t_call: float
                          ) -> "AsyncSaveHandle":
    """The handle of an async save that failed before its staging (its group, its plan): done
    with ``exc``, and ``on_outcome`` told, as the save thread tells it of every other outcome (a
    tiered manager's status said 'saving' for good otherwise)."""
    handle._finish(None, exc)
    handle.blocked_seconds = time.perf_counter() - t_call
    if on_outcome is not None:
        try:
            on_outcome(None, exc)
        except Exception as bookkeeping:  # noqa: BLE001 - bookkeeping must not hide the outcome
            log.error("distckpt: after the async save to %s: %s: %s", handle.path, type(bookkeeping).__name__,
                      bookkeeping)
    return handle


def async_save_in_root(state_dict: Any, path: str | os.PathLike, *, after_commit: Callable[[], None] | None = None,
                       lock_path: str | None = None,
                       on_outcome: Callable[[SaveResult | None, BaseException | None], None] | None = None,
                       process_group: Any = None, overwrite: bool = False, allow_pickle: bool = False,
                       metadata: dict | None = None, replicated: Any = "check", no_dist: bool = False,
                       storage_options: dict | None = None,
                       finish: Callable[..., SaveResult] = finish_save, shared_path: bool = True,
                       stage_in_background: bool = False) -> AsyncSaveHandle:
    """:func:`async_save` for a caller that owns the checkpoint's root (CheckpointManager, an
    IncrementalSaver): the other arguments are :func:`async_save`'s.

    Args:
        after_commit, lock_path: as :func:`distckpt.save_sync.save_in_root`.
        on_outcome: ``on_outcome(result, error)`` is called on this rank's save thread with the
            outcome, before the handle reports done (an error it raises is logged, never hides
            the outcome).
        finish: phases 2-4 (PREPARE, WRITE, COMMIT), run on the save's thread over the staged
            copies as ``finish(group, planned, final_dir=, overwrite=, metadata=, after_commit=,
            local_error=, lock_path=, storage_options=)`` with the contract of
            :func:`distckpt.commit.finish_save` (the default). A caller with another commit
            protocol binds its extra arguments itself (the tiered save passes
            ``functools.partial(distckpt.tiers.localcommit.finish_node_save, layout=...)``), so the
            staging and the thread are not duplicated.
        shared_path: as :func:`distckpt.saveplan.plan_save` (False for a tiered save's node-local
            directories).
        stage_in_background: as :func:`async_save`.

    Returns and raises what :func:`async_save` does.
    """
    t_call = time.perf_counter()
    if not isinstance(stage_in_background, bool):
        raise ConfigError(f"stage_in_background={stage_in_background!r} must be True or False")
    from .storage import is_url, normalize_path
    final_dir = normalize_path(path)
    _import_thread_modules(is_url(final_dir))
    handle = AsyncSaveHandle(final_dir)
    _register_exit_hook()
    SAVE_GATE.acquire()  # released by the worker thread, or below if no worker starts
    started = False
    try:
        # This call's part of the save, on the caller's thread: a save started here meanwhile (a
        # signal handler's) is refused instead of waiting for this one (coordinator._SaveGate).
        with SAVE_GATE.inside():
            try:
                fg = ControlGroup(None, 0, 1) if no_dist else control_group(process_group, operation="async_save()", kind="async_save")
            except Exception as exc:
                return _ended_before_staging(handle, exc, on_outcome, t_call)
            # The previous save has finished (the gate is ours): its failure, if unseen, is raised
            # here, decided with every rank of fg (they all raise, or none does).
            raise_background_failure(fg)
            if fg.world_size > 1:
                key = fg.members()
                _COLLECTIVE_SEQ[key] = _COLLECTIVE_SEQ.get(key, 0) + 1
                handle._collective = (key, _COLLECTIVE_SEQ[key])
            try:
                bg = _background_group(process_group, fg)
                metadata = copy.deepcopy(metadata)
                # The writers run on the worker thread, where SIGXFSZ cannot be set: do it here.
                ensure_sigxfsz_ignored()
                planned = plan_save(fg, state_dict=state_dict, allow_pickle=allow_pickle, metadata=metadata,
                                    path=final_dir, replicated=replicated, shared_path=shared_path)
            except Exception as exc:
                return _ended_before_staging(handle, exc, on_outcome, t_call)
            arena, stage_error, interrupted, guard = None, None, None, None
            t_stage = time.perf_counter()
            try:
                guard = _StagingGuard.capture(planned.mine, final_dir) if stage_in_background else None
                if guard is None:
                    arena, handle.staged_bytes = stage(planned.mine, staging_pool())
            except Exception as exc:  # e.g. out of memory: report it at WRITE, with every rank
                stage_error = exc
            except BaseException as exc:  # noqa: BLE001 - KeyboardInterrupt, SystemExit: re-raised below
                # This rank stops here, but its peers are already in this save: the background save
                # still runs to report it at WRITE (they fail at once, naming this rank, instead of
                # waiting DISTCKPT_TIMEOUT_S for a rank that left), then the caller gets ``exc``.
                interrupted, stage_error, guard = exc, _interruption(exc, final_dir), None
                # This rank's caller is told (``exc``), so the failure counts as seen: no rank raises
                # it again at the next checkpoint call.
                handle._observed = True
            if guard is None:
                handle.staging_seconds = time.perf_counter() - t_stage
                handle._set_staged()

            def work() -> None:
                nonlocal arena, stage_error, interrupted
                result, error = None, None
                if guard is not None:
                    t0 = time.perf_counter()
                    try:
                        stage_error = guard.moved_error()
                        if stage_error is None:
                            arena, handle.staged_bytes = stage(planned.mine, staging_pool(), after=guard.events)
                            stage_error = guard.moved_error() or guard.changed_error()
                    except Exception as exc:  # noqa: BLE001 - reported at WRITE, with every rank
                        # A tensor changed under the copy fails it in torch's own words: say so.
                        stage_error = guard.moved_error() or guard.changed_error() or exc
                    except BaseException as exc:  # noqa: BLE001 - an interrupt: only where work() runs in the caller's thread
                        if threading.current_thread() is caller:
                            interrupted, stage_error = exc, _interruption(exc, final_dir)
                            handle._observed = True
                        else:  # the caller's thread returns the handle, which reports it
                            stage_error = DistCkptError(f"staging the async save to {final_dir} raised "
                                                        f"{type(exc).__name__} on the save's thread: {exc}; nothing is "
                                                        f"committed")
                            stage_error.__cause__ = exc
                    finally:
                        guard.close()
                        handle.staging_seconds = time.perf_counter() - t0
                        handle._set_staged()
                        staging_ended(handle._staged)
                try:
                    result = finish(bg, planned, final_dir=final_dir, overwrite=overwrite, metadata=metadata,
                                    after_commit=after_commit, local_error=stage_error, lock_path=lock_path,
                                    storage_options=storage_options)
                except BaseException as exc:  # noqa: BLE001 - every error goes to the handle
                    error = _destroyed_group_error(exc, bg, final_dir)
                finally:
                    # Drop the views into the arena before it is reused or freed: the pieces may sit in
                    # reference cycles of the flattened state (freed only by a later gc pass), and a
                    # view would keep the whole arena's memory alive until then.
                    for _fqn, piece in planned.mine:
                        piece.tensor = None
                    planned.mine.clear()
                    staging_pool().release(arena)
                    if on_outcome is not None:
                        try:
                            on_outcome(result, error)
                        except Exception as exc:  # noqa: BLE001 - bookkeeping must not hide the outcome
                            log.error("distckpt: after the async save to %s: %s: %s", final_dir, type(exc).__name__, exc)
                    # Recorded before the gate opens: the next save (which takes the gate) finds the
                    # failure on every rank, whichever thread runs first.
                    handle._finish(result, error)
                    SAVE_GATE.release()

            # work() runs once: on the save's thread, or in this one when that thread cannot start
            # (whoever takes ``claim`` first). Why a claim and not thread.ident: an interrupt can land
            # after the OS thread exists but before start() returns, and the thread then runs work()
            # too (two WRITE and COMMIT rounds on one group, the gate released twice).
            claim = threading.Lock()

            def run() -> None:
                if claim.acquire(blocking=False):
                    work()

            caller = threading.current_thread()
            thread = None
            try:
                thread = threading.Thread(target=run, name=f"distckpt-async-save:{os.path.basename(final_dir)}",
                                          daemon=False)
                handle._thread = thread
                _INFLIGHT.add(handle)
                if guard is not None:
                    staging_started(handle._staged)  # ended by work(), wherever it runs
                thread.start()
            except BaseException as exc:  # noqa: BLE001 - re-raised below unless the thread runs
                if not claim.acquire(blocking=False):  # the thread took the save: it finishes it
                    started = True
                    raise
                # "can't start new thread" (out of memory, threads or address space), or an interrupt
                # before the thread could take the save. Raising here would leave this handle in
                # flight forever (every later save, load and the exit would wait for it) and the other
                # ranks' background phases waiting for this rank's until DISTCKPT_TIMEOUT_S. The
                # save's remaining phases run in this thread instead, paired with the other ranks;
                # its outcome is the handle's, as always (an interrupt: this rank's error, then raised).
                if isinstance(exc, Exception):
                    log.warning("distckpt: async save to %s: cannot start its background thread (%s); its write and "
                                "commit run in the caller's thread, which blocks until they end", final_dir, exc)
                elif interrupted is None:
                    interrupted, stage_error = exc, _interruption(exc, final_dir)
                    handle._observed = True
                    if guard is not None:  # nothing of it is staged: the save fails at WRITE
                        guard.close()
                        handle._set_staged()
                        staging_ended(handle._staged)
                        guard = None
                _INFLIGHT.add(handle)
                handle._thread = None
                started = True
                work()
            started = True
            if interrupted is not None:
                raise interrupted
    finally:
        if not started:
            SAVE_GATE.release()
    handle.blocked_seconds = time.perf_counter() - t_call
    return handle
