"""The background drain of a tiered manager: one thread per rank that copies committed local steps
to the remote tier, in commit order, and retries what a server outage stopped.

Every rank runs one :class:`Drainer`. The manager queues each step once it is committed on the
local tier, in the same order on every rank (saves are serialized per process), and the drainers
run :func:`distckpt.tiers.drain.drain_step` for it together over a control group of their own
(a ``"drain:N"`` channel per manager), so the drain never interleaves with the collectives of the
training thread, nor with those of a thread an earlier manager's close left inside a held request.
After each step the ranks vote (one all_gather) on whether to go on: every rank stops after the
same step once close() gave up waiting on any of them.

Retries are collective: after a failed drain every rank holds the same typed error (the drain's
verdict), waits the same back-off, then all ranks vote (one all_gather) on whether to go on; a rank
that is closing stops them all at that point. Errors that a retry cannot cure (a local copy that
is damaged, incomplete or gone, another save already committed remotely under the step) are final for
the step: it is marked failed and the queue moves on. Errors a server outage gives (unreachable,
throttled, a 5xx, a lease held by another save) are retried with back-off until the drain succeeds
or the manager closes. A lost peer stops the drainer (nothing can be agreed any more on its
channel); the manager's next save then starts a new one on a new channel (:meth:`Drainer.lost_peer`,
:meth:`Drainer.left_by_lost_peer`).

Nothing here deletes anything: a failed or abandoned drain leaves no visible remote step (the
remote MANIFEST is written last) and its data objects are reclaimed by the next drain or save
there.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
import time
from typing import Callable

from ..errors import (CheckpointCorruptError, CheckpointExistsError, CheckpointIncompleteError,
                      CheckpointNotFoundError, ConfigError, DistCkptError, PeerLostError, ProcessGroupDestroyedError,
                      SaveInProgressError)

__all__ = ["Drainer", "DrainState", "is_retryable"]

log = logging.getLogger("distckpt")

# Back-off between tries of a drain a server outage stopped: doubling, capped.
_FIRST_BACKOFF_S = 1.0
_MAX_BACKOFF_S = 30.0
# How long close() waits, past its timeout, for the thread to leave at the vote to stop: a thread
# in its back-off wakes at once (the wait is on ``_closing``), so this covers the vote only. A
# thread still busy after it is inside a request or a collective that only its own deadline ends
# (DISTCKPT_OBJECT_REQUEST_TIMEOUT_S, 30 s by default, per request): close does not wait for it.
_CLOSE_GRACE_S = 5.0


def is_retryable(error: BaseException) -> bool:
    """Whether a later try of the same drain can succeed: False for a damaged or incomplete local
    copy, a local copy that is gone (CheckpointNotFoundError: no rank holds the step any more, e.g.
    deleted by hand; nothing brings it back, and retrying it would hold every later step's drain
    behind it), another save committed under the step remotely, a configuration error; True for the
    errors of a server or network outage, a lease held by another save, and the object store's
    refusals that someone outside may cure meanwhile: credentials refused or expired
    (ObjectStoreAccessError: refreshed, rotated back), a bucket over quota or not found."""
    if isinstance(error, SaveInProgressError):
        return True
    if isinstance(error, (CheckpointCorruptError, CheckpointIncompleteError, CheckpointExistsError,
                          CheckpointNotFoundError, ConfigError, PeerLostError, ProcessGroupDestroyedError)):
        return False
    return isinstance(error, (DistCkptError, OSError))


@dataclasses.dataclass
class DrainState:
    """Where one step's drain stands on this rank. ``state``: ``queued``, ``draining``,
    ``retrying`` (the last try failed with ``error``; another follows), ``committed`` (the remote
    tier holds the step), ``failed`` (final: ``error`` says why) or ``stopped`` (the manager closed
    before it drained). While a retry is ``draining``, ``error`` is still the previous try's.
    ``sent``/``total``: this rank's bytes sent and to send in the current try."""

    step: int
    save_id: str | None
    state: str = "queued"
    sent: int = 0
    total: int = 0
    tries: int = 0
    error: BaseException | None = None
    done: threading.Event = dataclasses.field(default_factory=threading.Event)


_STOP = object()


class Drainer:
    """The drain queue and thread of one rank.

    ``drain(step, save_id, progress, assigned)`` runs one collective drain of ``step`` (calling
    ``assigned(total)`` with this rank's bytes to send, ``progress(n)`` as they go) and returns
    the number of bytes this rank sent, or raises its typed error (every rank the same);
    ``vote(closing, queued)`` runs one collective vote and returns (whether any rank is closing,
    the steps of ``queued`` that every rank has queued, in this order); ``ahead(steps)`` (optional,
    collective) is the work on steps still queued that must not wait for the drain before them
    (the replicas of a step: a remote tier down holds every drain, and the replicas are what a
    lost node then restores from): run after each failed try, on the steps every rank queued.
    All three are the manager's, so that this class holds only the queue, the retries and the
    states."""

    def __init__(self, drain: Callable[[int, str | None, Callable[[int], None], Callable[[int], None]], int],
                 vote: Callable[[bool, tuple], tuple], *, name: str, history: dict[int, DrainState] | None = None,
                 ahead: Callable[[list[int]], None] | None = None) -> None:
        self._drain = drain
        self._vote = vote
        self._ahead = ahead
        self._queue: queue.Queue = queue.Queue()
        # ``history``: the states of a drainer this one replaces (a lost peer stopped it), so that
        # status() and wait_durable() still know the steps it finished.
        self._states: dict[int, DrainState] = dict(history or {})
        self._lock = threading.Lock()
        self._closing = threading.Event()
        # Set (under the lock) once the thread has left its loop: a step queued later would never
        # be drained, so enqueue finishes it at once instead. ``_stop_cause``: the error that
        # stopped the thread (a lost peer), None when the manager closed it.
        self._stopped = False
        self._stop_cause: BaseException | None = None
        # The error of the peer lost on this drainer's channel, when that is what stopped it.
        self._lost: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    # -- what the manager calls (any thread) ------------------------------------------------------

    def enqueue(self, step: int, save_id: str | None) -> DrainState:
        """Queue ``step`` (committed locally with ``save_id``) for draining. Must be called in the
        same order on every rank. A step queued again (saved again) gets a fresh state.

        Once the drain thread has stopped (a peer lost during a drain: nothing can be agreed on
        that channel any more), the step is ``stopped`` at once with that error as its cause, and
        a warning says so: a wait on it returns at once instead of waiting for a thread that is
        gone. It stays committed locally; the manager's next save restarts the drain on a new
        channel and queues it again (TieredCheckpointManager._restart_lost_drain), else the next
        manager start drains it."""
        st = DrainState(step, save_id)
        with self._lock:
            self._states[step] = st
            if not self._stopped:
                self._queue.put(st)
                return st
            cause = self._stop_cause
        log.warning("distckpt: step %d will not be drained by this manager: its drain thread stopped (%s); the "
                    "step stays committed locally; the next save restarts the drain after a lost peer, or the next "
                    "manager start drains it", step,
                    f"{type(cause).__name__}: {cause}" if cause is not None else "closed")
        self._finish(st, "stopped", cause)
        return st

    def state(self, step: int) -> DrainState | None:
        with self._lock:
            return self._states.get(step)

    def states(self) -> dict[int, DrainState]:
        with self._lock:
            return dict(self._states)

    def close(self, timeout: float | None) -> list[int]:
        """Let the queue drain (at most ``timeout`` seconds, None: no bound), then stop the
        thread: retries stop at the next collective vote. Must be called on every rank. Returns
        within ``timeout`` plus a few seconds (:data:`_CLOSE_GRACE_S`) the steps whose drain did
        not commit (failed, stopped, or still running at the timeout).

        A thread still busy then is inside a request that the remote tier holds unanswered (or a
        collective waiting for a peer in one): it is not waited for. It is a daemon; its try ends
        at that request's own deadline, and it stops at the next vote (after a try that failed)
        or at the end of the queue. Its step is returned here, so it is never reported durable
        by close, although the held request may still land (the next manager finds it there)."""
        self._queue.put(_STOP)
        self._thread.join(timeout)
        if self._thread.is_alive():
            # Stop retrying: every rank's thread leaves at the same vote.
            self._closing.set()
            # Not "until the thread leaves": it may be inside a request held up to its deadline
            # (the join used to wait 35 s for it, far past the caller's timeout).
            self._thread.join(_CLOSE_GRACE_S)
            if self._thread.is_alive():
                log.warning("distckpt: the drain thread is still inside a request or a collective at close; "
                            "not waiting for it (it stops when its request's deadline ends it)")
        with self._lock:
            return sorted(s for s, st in self._states.items() if st.state != "committed")

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def lost_peer(self) -> BaseException | None:
        """The error of the peer lost on this drainer's channel once that stopped its thread for
        good (the thread has left; None while it runs, or when something else stopped it). Its
        channel's collectives can never run again (gloo closed the connections): only a new
        drainer on a new channel drains anything more."""
        with self._lock:
            if not self._stopped or self._lost is None:
                return None
        # Past its loop the thread only marks what was still queued: it ends at once (bounded all
        # the same; still alive, it counts as running and the restart waits for a later save).
        self._thread.join(_CLOSE_GRACE_S)
        return None if self._thread.is_alive() else self._lost

    def left_by_lost_peer(self) -> list[tuple[int, str | None]]:
        """(step, save id) of each step this drainer did not drain because a peer was lost: the
        step it was draining and every one queued after it (``stopped``). Call it once
        :meth:`lost_peer` says so."""
        with self._lock:
            return sorted((s, st.save_id) for s, st in self._states.items()
                          if st.state == "stopped" or (st.state == "failed" and isinstance(st.error, PeerLostError)))

    # -- the thread -------------------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is _STOP:
                break
            if not self._drain_with_retries(item):
                self._stop_cause = item.error   # a lost peer (or the error of the try before a vote to stop)
                if self._lost is None and isinstance(item.error, PeerLostError):
                    self._lost = item.error
                break
            if self._stop_after_step(item):
                break
        with self._lock:   # no enqueue puts a step on the queue after this
            self._stopped = True
        # Whatever is still queued did not drain: say so (the next manager start resumes it).
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                break
            if item is not _STOP:
                self._finish(item, "stopped", self._stop_cause)

    def _stop_after_step(self, st: DrainState) -> bool:
        """Whether to drain nothing more after ``st`` (its drain ended): when close() gave up on
        some rank's thread (a request held past its timeout), it has already named the queued
        steps not durable there and may have released the local root to a new manager, which
        drains them. Decided by a collective vote (every rank's thread reaches it after the same
        step), never by this rank's own flag alone: a rank that stopped while a peer began the
        next step's drain would leave that peer waiting in its collectives for
        DISTCKPT_DRAIN_TIMEOUT_S. Always voted (one all-gather of a bool per step, the ranks are
        in step after the drain's collectives): whether more is queued differs between ranks
        whose training threads enqueue at slightly different times."""
        try:
            return self._vote(self._closing.is_set(), ())[0]
        except Exception as exc:  # noqa: BLE001 - a peer lost during the vote
            log.error("distckpt: the drain thread stopped after step %d: %s", st.step, exc)
            self._stop_cause = self._lost = exc
            return True

    def _drain_with_retries(self, st: DrainState) -> bool:
        """One step, tried until it commits, fails for good, or the ranks vote to stop. Returns
        False when the thread must stop (a vote to stop, or a peer lost)."""
        backoff = _FIRST_BACKOFF_S
        while True:
            st.tries += 1
            # ``error`` stays the previous try's until this one ends: a wait that times out during
            # a retry (NotDurableError.cause) and status() still say why the step is not remote.
            st.state, st.sent = "draining", 0

            def progress(n: int, st=st) -> None:
                st.sent += n

            def assigned(total: int, st=st) -> None:
                st.total = total

            try:
                self._drain(st.step, st.save_id, progress, assigned)
            except Exception as exc:  # noqa: BLE001 - typed by the drain; classified below
                if isinstance(exc, PeerLostError):
                    log.error("distckpt: the drain of step %d stopped: a peer was lost (%s); the next save restarts "
                              "the drain (or the next manager start drains it again)", st.step, exc)
                    self._finish(st, "failed", exc)
                    return False
                if isinstance(exc, ProcessGroupDestroyedError):
                    log.error("distckpt: the drain of step %d stopped: %s", st.step, exc)
                    self._finish(st, "failed", exc)
                    return False
                if not is_retryable(exc):
                    log.error("distckpt: the drain of step %d to the remote tier failed for good: %s: %s",
                              st.step, type(exc).__name__, exc)
                    self._finish(st, "failed", exc)
                    return True
                st.state, st.error = "retrying", exc
                log.warning("distckpt: the drain of step %d to the remote tier failed (try %d): %s: %s; retrying "
                            "in %.0f s (training goes on; the step is committed locally)",
                            st.step, st.tries, type(exc).__name__, exc, backoff)
                self._closing.wait(backoff)
                backoff = min(backoff * 2, _MAX_BACKOFF_S)
                try:
                    stop, queued = self._vote(self._closing.is_set(), self._queued())
                    if not stop and queued and self._ahead is not None:
                        self._ahead(list(queued))
                except Exception as vote_exc:  # noqa: BLE001 - a peer lost during the vote or the work ahead
                    log.error("distckpt: the drain of step %d stopped: %s", st.step, vote_exc)
                    self._lost = vote_exc
                    self._finish(st, "stopped", exc)
                    return False
                if stop:
                    self._finish(st, "stopped", exc)
                    return False
                continue
            self._finish(st, "committed", None)
            return True

    def _queued(self) -> tuple[int, ...]:
        """The steps waiting in this rank's queue, in order."""
        with self._queue.mutex:
            return tuple(item.step for item in self._queue.queue if item is not _STOP)

    def _finish(self, st: DrainState, state: str, error: BaseException | None) -> None:
        st.state, st.error = state, error
        st.done.set()


def wait_for(st: DrainState, timeout: float | None) -> bool:
    """Wait until ``st`` reaches a final state (committed, failed, stopped); False on timeout."""
    deadline = None if timeout is None else time.monotonic() + timeout
    return st.done.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))
