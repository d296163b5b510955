"""A collective save, top-down: the call order of its four phases, and the gate that keeps one save
at a time per process. Every rank runs :func:`save_collective`; ``G`` is the gloo control group.

  1. PLAN      (:mod:`distckpt.saveplan`) each rank sends rank 0 a summary of its state dict; rank 0
               merges them, checks that they describe one checkpoint and picks one writer for every
               box; each rank learns which of its pieces it writes (or the error every rank raises).
  2. PREPARE   (:mod:`distckpt.commit`) rank 0 takes the save lock or lease, checks space and
               creates the save area through the storage seam; G.broadcast of the area or the error.
  3. WRITE     each rank writes its own data file into the area, durable on return; G.gather.
  4. COMMIT    rank 0, only if every rank succeeded: MANIFEST last, published atomically (the
               commit point), then ``after_commit``; G.broadcast of the verdict, which every rank
               returns or raises.

An async save (:mod:`distckpt.save_async`) runs the same phases: PLAN in the caller's thread, then
its staging, then phases 2-4 on a thread of its own, holding :data:`SAVE_GATE` throughout.
"""

from __future__ import annotations

import contextlib
import os
import threading
from typing import Any, Callable, Iterator

from ._dist import ControlGroup
from .commit import SaveResult, finish_save
from .gcpause import gc_paused
from .saveplan import plan_save

__all__ = ["SAVE_GATE", "save_collective"]

class _SaveGate:
    """A lock (``acquire``/``release``, or ``with``) that a forked child gets fresh.

    Why not a plain Lock: a child forked while an async save holds the gate (a DataLoader
    worker, a multiprocessing fork) would inherit it held, with no thread left in the child to
    release it, and a save in the child would wait forever. The child did not start the
    parent's save, so it starts with the gate free (``os.register_at_fork`` below). Modules bind
    the name ``SAVE_GATE`` at import, so the object stays and only its lock is replaced."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._here = threading.local()  # .inside: this thread runs a save's gated part now

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        """Take the gate (waiting for a save of another thread, or an async save's background
        part). Raises SaveInProgressError at once when this thread is itself inside a save's
        gated part: a save started from a signal handler (a "save on preemption" handler that
        runs while the main thread saves) would otherwise wait for ever for the save it
        interrupted, which cannot go on until the handler returns."""
        if getattr(self._here, "inside", False):
            from .errors import SaveInProgressError
            raise SaveInProgressError(
                "a save was started on a thread that is itself inside a save (a signal handler that saves "
                "while the save it interrupted runs?): it would wait for ever for that save; nothing was written",
                owner=None, remedy="In the handler, set a flag and save from the training loop once the running "
                                   "save returned (or call the save after it, not inside it).")
        return self._lock.acquire(blocking, timeout)

    def release(self) -> None:
        self._lock.release()

    def locked(self) -> bool:
        return self._lock.locked()

    @contextlib.contextmanager
    def inside(self) -> Iterator[None]:
        """Mark this thread as inside a save's gated part for the block (``with SAVE_GATE`` does;
        an async save's caller marks its own part, before the background thread takes over)."""
        self._here.inside = True
        try:
            yield
        finally:
            self._here.inside = False

    def __enter__(self) -> "_SaveGate":
        self.acquire()
        self._here.inside = True
        return self

    def __exit__(self, *exc: Any) -> None:
        self._here.inside = False
        self._lock.release()

    def _reset_in_child(self) -> None:
        self._lock = threading.Lock()
        self._here = threading.local()


# One save at a time per process: a save issues collectives on the control group, and every rank
# must issue them in the same order. An async save holds the gate from its PLAN until its verdict
# (released by its background thread), so a later save, sync or async, waits for it.
SAVE_GATE = _SaveGate()
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=SAVE_GATE._reset_in_child)


def save_collective(
    group: ControlGroup,
    *,
    state_dict: Any,
    final_dir: str,
    overwrite: bool,
    allow_pickle: bool,
    metadata: dict | None,
    after_commit: Callable[[], None] | None = None,
    replicated: Any = "check",
    lock_path: str | None = None,
    storage_options: dict | None = None,
) -> SaveResult:
    """Run phases 1-4 (module docstring) on this rank. Returns only after the commit verdict.
    Waits first for an async save of this process still in flight (:data:`SAVE_GATE`).

    Raises:
        CheckpointExistsError: a committed checkpoint is at ``final_dir`` and not ``overwrite``.
        DistCkptError subclasses: the typed error itself (one rank), or, when ranks failed, the
            class every failing rank raised, else RankFailureError; ``failures`` holds each
            rank's error (errors.collective_error).
        PeerLostError: a peer died or did not answer within DISTCKPT_TIMEOUT_S; before the commit
            point nothing is committed. CommittedButPeerLostError (a subclass): the checkpoint
            at ``final_dir`` is committed, then a peer was lost (see :func:`distckpt.commit.finish_save`).
    """
    with SAVE_GATE, gc_paused():
        planned = plan_save(group, state_dict=state_dict, allow_pickle=allow_pickle, metadata=metadata,
                            path=final_dir, replicated=replicated)
        return finish_save(group, planned, final_dir=final_dir, overwrite=overwrite, metadata=metadata,
                           after_commit=after_commit, lock_path=lock_path, storage_options=storage_options)
