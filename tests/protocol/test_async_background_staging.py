"""Async saves that stage in the background (``stage_in_background=True``, torchtitan's
``async_with_pinned_mem``): the call returns before the copy, the checkpoint holds the state of
the call, a change made before the copy ended fails the save typed on every rank (never a mix of
two steps), a load waits for the copy, and the managers pass the option through."""

from __future__ import annotations

import logging
import os
import threading
import time

import pytest
import torch

import distckpt
import distckpt.save_async as sa
from distckpt.errors import ConfigError, StateChangedError
from distckpt.storage.posix.manifests import is_committed

from ..helpers.distributed import run_ranks


def _state() -> dict:
    g = torch.Generator().manual_seed(0)
    return {"big": torch.arange(4 << 20, dtype=torch.int32), "w": torch.randn(64, 33, generator=g),
            "small": [torch.full((3,), float(i)) for i in range(10)], "step": 7}


def _clone(sd: dict) -> dict:
    return {k: ([t.clone() for t in v] if isinstance(v, list) else v.clone() if isinstance(v, torch.Tensor) else v)
            for k, v in sd.items()}


def _same(got: dict, want: dict) -> bool:
    for k, v in want.items():
        if isinstance(v, torch.Tensor):
            if not torch.equal(got[k], v):
                return False
        elif isinstance(v, list):
            if not all(torch.equal(a, b) for a, b in zip(got[k], v)):
                return False
        elif got[k] != v:
            return False
    return True


class _HeldStaging:
    """Holds every staging copy until ``release()``: what the save's thread does while the
    caller's next steps run."""

    def __init__(self, monkeypatch) -> None:
        self.gate = threading.Event()
        self.entered = threading.Event()
        real = sa.stage

        def held(*args, **kwargs):
            self.entered.set()
            assert self.gate.wait(60), "the test never released the staging"
            return real(*args, **kwargs)
        monkeypatch.setattr(sa, "stage", held)

    def release(self) -> None:
        self.gate.set()


def test_the_call_returns_before_the_copy_and_the_save_holds_the_state_of_the_call(tmp_path, monkeypatch):
    held = _HeldStaging(monkeypatch)
    sd = _state()
    want = _clone(sd)
    h = distckpt.async_save(sd, tmp_path / "c", stage_in_background=True)
    assert held.entered.wait(30), "the copy runs on the save's thread"
    assert not h.staged() and not h.wait_staged(timeout=0.2), "staged before the copy ran"
    sd["step"] = 8   # a value other than a tensor is taken at the call
    held.release()
    assert h.wait_staged(timeout=60) and h.staged()
    assert h.staged_bytes >= (4 << 20) * 4 and h.staging_seconds > 0
    sd["big"].fill_(-1)   # after wait_staged the caller may change everything
    sd["w"].zero_()
    h.result(timeout=120)
    assert _same(distckpt.read(tmp_path / "c"), want)


def test_a_tensor_changed_before_its_copy_ended_fails_the_save_and_commits_nothing(tmp_path, monkeypatch):
    held = _HeldStaging(monkeypatch)
    sd = _state()
    distckpt.save(sd, tmp_path / "before")
    want_before = _clone(sd)
    h = distckpt.async_save(sd, tmp_path / "c", stage_in_background=True)
    assert held.entered.wait(30)
    sd["w"].mul_(2)            # the optimizer stepped without waiting for the staging
    sd["small"][3].add_(1)
    held.release()
    with pytest.raises(StateChangedError) as ei:
        h.result(timeout=120)
    assert set(ei.value.keys) == {"w", "small.3"}, ei.value.keys
    assert "nothing is committed" in str(ei.value) and "wait_staged" in ei.value.remedy
    assert not is_committed(str(tmp_path / "c")) and not os.path.exists(tmp_path / "c")
    assert sorted(os.listdir(tmp_path)) == ["before"], "no half-written save is left"
    assert _same(distckpt.read(tmp_path / "before"), want_before)
    # The next save of the same state goes through.
    distckpt.async_save(sd, tmp_path / "c", stage_in_background=True).result(timeout=120)
    assert _same(distckpt.read(tmp_path / "c"), sd)


def test_a_load_waits_for_a_staging_in_flight(tmp_path, monkeypatch):
    sd = _state()
    distckpt.save(_clone(sd), tmp_path / "old")
    sd["big"].add_(3)
    want = _clone(sd)
    held = _HeldStaging(monkeypatch)
    h = distckpt.async_save(sd, tmp_path / "new", stage_in_background=True)
    assert held.entered.wait(30)
    loaded = threading.Event()

    def load_old():
        distckpt.load(sd, tmp_path / "old")   # into the very tensors being staged
        loaded.set()
    t = threading.Thread(target=load_old)
    t.start()
    assert not loaded.wait(0.5), "the load filled tensors a staging was still copying"
    held.release()
    t.join(60)
    assert loaded.is_set()
    h.result(timeout=120)   # not a StateChangedError: the load waited
    assert _same(distckpt.read(tmp_path / "new"), want)
    assert torch.equal(sd["big"], torch.arange(4 << 20, dtype=torch.int32))


def test_an_inference_tensor_is_staged_on_the_callers_thread(tmp_path, caplog, monkeypatch):
    monkeypatch.setattr(sa, "_GUARD_WARNED", False)
    with torch.inference_mode():
        sd = {"w": torch.ones(1000), "b": torch.zeros(10)}
    with caplog.at_level(logging.WARNING, logger="distckpt"):
        h = distckpt.async_save(sd, tmp_path / "c", stage_in_background=True)
    assert h.staged(), "an inference tensor has no version counter: staged before the call returned"
    assert "inference-mode tensor" in caplog.text
    h.result(timeout=120)
    assert torch.equal(distckpt.read(tmp_path / "c")["w"], torch.ones(1000))


def test_the_managers_pass_the_option_and_refuse_it_on_a_blocking_save(tmp_path):
    sd = _state()
    mgr = distckpt.CheckpointManager(tmp_path / "root", keep_last=2)
    with pytest.raises(ConfigError, match="blocking=False"):
        mgr.save(1, sd, stage_in_background=True)
    for step in (1, 2, 3):
        h = mgr.save(step, sd, blocking=False, stage_in_background=True)
        h.wait_staged()
        sd["big"].add_(1)
    h.result(timeout=120)
    mgr.close()
    assert mgr.steps() == [2, 3]
    got = distckpt.read(mgr.path(3))
    assert torch.equal(got["big"], sd["big"] - 1)

    from distckpt.tiers import TieredCheckpointManager
    want = _clone(sd)
    with TieredCheckpointManager(tmp_path / "local", tmp_path / "remote", keep_last_local=1) as tiered:
        with pytest.raises(ConfigError, match="blocking=False"):
            tiered.save(1, sd, stage_in_background=True)
        h = tiered.save(1, sd, blocking=False, stage_in_background=True)
        h.wait_staged()
        sd["big"].zero_()
        h.result(timeout=120)
        tiered.wait_durable(1, timeout=120)
        remote_step = [n for n in os.listdir(tmp_path / "remote") if n.startswith("step_")]
    assert len(remote_step) == 1
    assert _same(distckpt.read(tmp_path / "remote" / remote_step[0]), want)


def _two_ranks_one_changes(rank, world, tmp):
    import distckpt.save_async as sa_rank
    real = sa_rank.stage
    gate = threading.Event()

    def held(*args, **kwargs):
        assert gate.wait(60)
        return real(*args, **kwargs)
    sa_rank.stage = held
    sd = {f"r{rank}": torch.full((1 << 16,), float(rank)), "shared_step": 3}
    t0 = time.monotonic()
    h = distckpt.async_save(sd, os.path.join(tmp, "c"), stage_in_background=True)
    blocked = time.monotonic() - t0
    if rank == 1:
        sd["r1"].add_(1)   # this rank alone did not wait
    gate.set()
    try:
        h.result(timeout=120)
        err = None
    except distckpt.DistCkptError as exc:
        err = (type(exc).__name__, sorted(getattr(exc, "failed_ranks", None) or []))
    sa_rank.stage = real
    return {"err": err, "blocked": blocked}


def test_a_change_on_one_rank_fails_the_save_on_every_rank(tmp_path):
    out = run_ranks(_two_ranks_one_changes, 2, str(tmp_path), timeout=240)
    assert [o["err"] for o in out] == [("StateChangedError", [1])] * 2, out
    assert not os.path.exists(tmp_path / "c")
