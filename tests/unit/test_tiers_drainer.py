"""The drain queue's thread (distckpt.tiers.drainer) against close(): its own logic, with a drain
function the test holds (the real drains against SeaweedFS are in tests/s3/test_tiers_faults.py)."""

from __future__ import annotations

import threading

from distckpt.tiers import drainer as drainer_mod
from distckpt.tiers.drainer import Drainer


def test_a_thread_close_gave_up_on_drains_no_further_step(monkeypatch):
    """close(timeout) leaves a drain held in a request to its daemon thread and names every queued
    step not durable. When that held request then succeeds, the thread must not go on to drain
    the next queued step: close already reported it, and the local root may already belong to
    a new manager that drains it too."""
    monkeypatch.setattr(drainer_mod, "_CLOSE_GRACE_S", 0.2)
    release, drained = threading.Event(), []

    def drain(step, save_id, progress, assigned):
        if step == 1:
            assert release.wait(30)  # the request the remote tier holds
        drained.append(step)
        return 0

    d = Drainer(drain, lambda closing, queued: (closing, ()), name="test-drain")
    d.enqueue(1, "s1")
    d.enqueue(2, "s2")
    assert d.close(0.2) == [1, 2]
    release.set()  # the held request lands after close returned
    d._thread.join(30)
    assert not d.alive
    assert drained == [1], drained
    assert d.state(1).state == "committed" and d.state(2).state == "stopped"


class _Gather:
    """An all_gather among ``n`` threads standing for ranks: call k of each rank meets call k of
    the others (AssertionError when a peer never comes within 10 s)."""

    def __init__(self, n: int):
        self.n, self.cond = n, threading.Condition()
        self.calls, self.values = [0] * n, {}

    def __call__(self, rank: int, value):
        with self.cond:
            k = self.calls[rank]
            self.calls[rank] += 1
            self.values.setdefault(k, {})[rank] = value
            self.cond.notify_all()
            assert self.cond.wait_for(lambda: len(self.values[k]) == self.n, timeout=10), "a peer never voted"
            return [self.values[k][r] for r in range(self.n)]


def test_every_rank_stops_after_the_same_step(monkeypatch):
    """Two ranks' drain threads (the drain's collectives stood for by a barrier): close() gave up
    on rank 0's thread (its step-1 request held) while rank 1's close waits longer. When the
    held request lands, both threads stop after step 1 by their vote: rank 1's thread does not
    begin step 2 alone, where it would wait in the drain's collectives for a rank that stopped."""
    monkeypatch.setattr(drainer_mod, "_CLOSE_GRACE_S", 0.2)
    release = threading.Event()
    drained = {0: [], 1: []}
    collective = threading.Barrier(2, timeout=10)
    votes = _Gather(2)

    def drain_of(rank):
        def drain(step, save_id, progress, assigned):
            if step == 1 and rank == 0:
                assert release.wait(30)  # rank 0's request is held
            collective.wait()  # the drain's collectives: both ranks or neither
            drained[rank].append(step)
            return 0
        return drain

    ds = [Drainer(drain_of(r), lambda closing, queued, r=r: (any(votes(r, closing)), ()), name=f"test-drain-{r}")
          for r in (0, 1)]
    for d in ds:
        d.enqueue(1, "s1")
        d.enqueue(2, "s2")
    assert ds[0].close(0.2) == [1, 2]   # gave up on the thread: closing is set on rank 0 only
    ds[1]._queue.put(drainer_mod._STOP)  # rank 1 has not reached close's timeout yet
    release.set()
    for d in ds:
        d._thread.join(30)
        assert not d.alive
    assert drained == {0: [1], 1: [1]}, drained
    assert not collective.broken
    assert [d.state(2).state for d in ds] == ["stopped", "stopped"]


def test_a_lost_peer_stops_the_thread_and_names_every_step_it_left():
    """A drain that loses a peer stops the thread (nothing can be agreed on its channel any more):
    the step it was draining is failed with the PeerLostError, one queued after it and one queued
    once the thread is gone are ``stopped`` at once (a wait on them never hangs), and the
    manager's restart is told all three (left_by_lost_peer) together with the error (lost_peer).
    A thread stopped by close() reports no lost peer."""
    from distckpt import errors
    held = threading.Event()

    def drain(step, save_id, progress, assigned):
        if step == 1:
            assert held.wait(30)
            raise errors.PeerLostError("gather among 2 ranks failed: a peer was paused past the drain timeout")
        return 0

    d = Drainer(drain, lambda closing, queued: (closing, ()), name="test-drain")
    d.enqueue(1, "s1")
    d.enqueue(2, "s2")
    assert d.lost_peer() is None  # still running
    held.set()
    d._thread.join(30)
    late = d.enqueue(3, "s3")
    assert late.done.is_set() and late.state == "stopped" and isinstance(late.error, errors.PeerLostError)
    assert isinstance(d.lost_peer(), errors.PeerLostError)
    assert d.left_by_lost_peer() == [(1, "s1"), (2, "s2"), (3, "s3")]
    assert d.state(1).state == "failed" and d.state(2).state == "stopped"
    again = Drainer(lambda *a: 0, lambda closing, queued: (closing, ()), name="test-drain-2", history=d.states())
    assert again.state(1).state == "failed"  # the history a restart keeps until it queues the step again
    again.close(5)
    closed = Drainer(lambda *a: 0, lambda closing, queued: (closing, ()), name="test-drain-3")
    closed.close(5)
    assert closed.lost_peer() is None and closed.left_by_lost_peer() == []
