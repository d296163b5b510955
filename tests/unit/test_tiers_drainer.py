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

    d = Drainer(drain, lambda closing: closing, name="test-drain")
    d.enqueue(1, "s1")
    d.enqueue(2, "s2")
    assert d.close(0.2) == [1, 2]
    release.set()  # the held request lands after close returned
    d._thread.join(30)
    assert not d.alive
    assert drained == [1], drained
    assert d.state(1).state == "committed" and d.state(2).state == "stopped"
