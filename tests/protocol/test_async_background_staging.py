"""Async saves that stage in the background (``stage_in_background=True``, torchtitan's
``async_with_pinned_mem``): the call returns before the copy, the checkpoint holds the state of
the call; an optimizer step before the copy ended waits for it (fused and foreach steps, DTensor
parameters), another in-place change fails the save typed on every rank (never a mix of two
steps), loads (plain and tiered) wait for the copy, states no counter can watch are staged at the
call, an interrupt leaves nothing waiting, and the managers pass the option through."""

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


def _load_waits_for(held: _HeldStaging, load) -> None:
    """Run ``load`` on a thread while ``held``'s staging is held: it must not fill anything until
    the staging is released, then it finishes."""
    assert held.entered.wait(30)
    loaded = threading.Event()

    def run():
        load()
        loaded.set()
    t = threading.Thread(target=run)
    t.start()
    assert not loaded.wait(0.5), "the load filled tensors a staging was still copying"
    held.release()
    t.join(60)
    assert loaded.is_set()


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


_MOVES = {
    "resize": lambda t: t.resize_(0),
    "set": lambda t: t.set_(torch.zeros(7, dtype=t.dtype)),
    "as_strided": lambda t: t.as_strided_((2,), (1,)),
    # FSDP's way of freeing a parameter: no version counter moves
    "storage_freed": lambda t: t.untyped_storage().resize_(0),
}


@pytest.mark.parametrize("move", sorted(_MOVES))
def test_a_tensor_resized_or_freed_before_its_copy_is_state_changed_not_a_crash(tmp_path, monkeypatch, move):
    """A staged tensor resized, re-pointed or freed after the call: a copy of it failed as a bare
    RuntimeError ("shape '[0]' is invalid for input of size ...") or, for a freed storage, read
    freed memory and killed the process (exit 139; an outside trial). Its geometry is compared
    before the copies: StateChangedError naming it, nothing committed."""
    gate, entered = threading.Event(), threading.Event()
    real = sa._StagingGuard.moved_error
    calls = []

    def held(self):
        if not calls:
            entered.set()
            assert gate.wait(60), "the test never released the staging"
        calls.append(1)
        return real(self)

    monkeypatch.setattr(sa._StagingGuard, "moved_error", held)
    sd = _state()
    h = distckpt.async_save(sd, tmp_path / "c", stage_in_background=True)
    assert entered.wait(30)
    _MOVES[move](sd["big"])
    gate.set()
    with pytest.raises(StateChangedError, match="resized, re-pointed or freed") as ei:
        h.result(timeout=120)
    assert ei.value.keys == ["big"] and not os.path.exists(tmp_path / "c")


def test_a_tensor_resized_during_its_copy_is_state_changed(tmp_path, monkeypatch):
    """The same change once the copy has begun (held after its sizes were taken, before the
    copies): torch's own error of the copy ("shape '[3]' is invalid for input of size 2112") was
    the save's error; it is reported as the StateChangedError it is."""
    from distckpt.staging import pool as staging_pool
    gate, entered = threading.Event(), threading.Event()
    real = staging_pool.StagingPool.take

    def held(self, specs):
        entered.set()
        assert gate.wait(60), "the test never released the staging"
        return real(self, specs)

    monkeypatch.setattr(staging_pool.StagingPool, "take", held)
    sd = _state()
    h = distckpt.async_save(sd, tmp_path / "c", stage_in_background=True)
    assert entered.wait(30)
    sd["w"].resize_(3)
    gate.set()
    with pytest.raises(StateChangedError) as ei:
        h.result(timeout=120)
    assert ei.value.keys == ["w"] and not os.path.exists(tmp_path / "c")


def test_a_load_waits_for_a_staging_in_flight(tmp_path, monkeypatch):
    sd = _state()
    distckpt.save(_clone(sd), tmp_path / "old")
    sd["big"].add_(3)
    want = _clone(sd)
    held = _HeldStaging(monkeypatch)
    h = distckpt.async_save(sd, tmp_path / "new", stage_in_background=True)
    _load_waits_for(held, lambda: distckpt.load(sd, tmp_path / "old"))   # into the very tensors staged
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


@pytest.mark.parametrize("impl", ["fused", "foreach"])
def test_an_optimizer_step_before_wait_staged_waits_for_the_staging(tmp_path, monkeypatch, caplog, impl):
    """A fused step moves no version counter: without the step pre-hook this save reported
    success holding the weights after the step."""
    import distckpt.staging.pool as pool_mod
    monkeypatch.setattr(pool_mod, "_STEP_WARNED", False)
    held = _HeldStaging(monkeypatch)
    w = torch.nn.Parameter(torch.randn(256, 256))
    opt = torch.optim.SGD([w], lr=0.5, **{impl: True})
    w.grad = torch.ones_like(w)
    want = w.detach().clone()
    h = distckpt.async_save({"w": w}, tmp_path / "c", stage_in_background=True)
    assert held.entered.wait(30)
    threading.Timer(0.5, held.release).start()
    t0 = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="distckpt"):
        opt.step()   # the trainer forgot maybe_wait_for_staging(): the step waits instead
    assert time.monotonic() - t0 >= 0.4 and h.staged()
    assert "waited" in caplog.text and "wait_staged" in caplog.text
    h.result(timeout=120)
    assert torch.equal(distckpt.read(tmp_path / "c")["w"], want)
    assert torch.equal(w.detach(), want - 0.5)


def test_a_tiered_load_waits_for_a_staging_in_flight(tmp_path, monkeypatch):
    from distckpt.tiers import TieredCheckpointManager
    sd = _state()
    with TieredCheckpointManager(tmp_path / "local", tmp_path / "remote", keep_last_local=2) as tiered:
        tiered.save(1, _clone(sd))
        sd["big"].add_(3)
        want = _clone(sd)
        held = _HeldStaging(monkeypatch)
        h = tiered.save(2, sd, blocking=False, stage_in_background=True)
        _load_waits_for(held, lambda: tiered.load(sd, 1))
        h.result(timeout=120)
        got = distckpt.read(tiered.local_path(2))
    assert _same(got, want)


@pytest.mark.parametrize("where", ["registered", "before_start", "after_start"])
def test_an_interrupt_as_the_save_thread_starts_leaves_nothing_waiting(tmp_path, monkeypatch, where):
    """Ctrl-C as the save's thread is being started (right after the staging is registered, before
    the thread exists, or once it runs): the call raises it, the save's phases run exactly once
    (in the caller's thread or the save's), and no later optimizer step, load or save waits for
    it."""
    sd = _state()
    distckpt.save(sd, tmp_path / "old")
    real_start, real_started = threading.Thread.start, sa.staging_started
    finished = []
    real_finish = sa.AsyncSaveHandle._finish

    def counted_finish(self, *args):
        finished.append(threading.current_thread().name)
        return real_finish(self, *args)
    monkeypatch.setattr(sa.AsyncSaveHandle, "_finish", counted_finish)

    def interrupted_start(self):
        if self.name.startswith("distckpt-async-save"):
            if where == "after_start":
                real_start(self)
            raise KeyboardInterrupt
        return real_start(self)

    def interrupted_register(done):
        real_started(done)
        raise KeyboardInterrupt
    if where == "registered":
        monkeypatch.setattr(sa, "staging_started", interrupted_register)
    else:
        monkeypatch.setattr(threading.Thread, "start", interrupted_start)
    with pytest.raises(KeyboardInterrupt):
        distckpt.async_save(sd, tmp_path / "c", stage_in_background=True)
    monkeypatch.setattr(threading.Thread, "start", real_start)
    monkeypatch.setattr(sa, "staging_started", real_started)
    done = threading.Event()

    def after():
        w = torch.nn.Parameter(torch.ones(4))
        w.grad = torch.ones(4)
        torch.optim.SGD([w], lr=1.0).step()
        distckpt.load(sd, tmp_path / "old")
        distckpt.async_save(sd, tmp_path / "next", stage_in_background=True).result(timeout=120)
        done.set()
    t = threading.Thread(target=after, daemon=True)
    t.start()
    assert done.wait(120), "an optimizer step, load or save after the interrupted save hangs"
    assert len(finished) == 2, f"the interrupted save's phases ran {len(finished) - 1} times: {finished}"
    assert _same(distckpt.read(tmp_path / "next"), sd)
    if where != "after_start":
        assert not os.path.exists(tmp_path / "c")


def test_a_base_exception_on_the_save_thread_is_the_handles_not_the_callers(tmp_path, monkeypatch):
    def exits(*args, **kwargs):
        raise SystemExit(3)
    monkeypatch.setattr(sa, "stage", exits)
    sd = _state()
    h = distckpt.async_save(sd, tmp_path / "c", stage_in_background=True)   # returns: not raised here
    with pytest.raises(distckpt.DistCkptError, match="SystemExit"):
        h.result(timeout=120)
    monkeypatch.undo()
    distckpt.async_save(sd, tmp_path / "c", stage_in_background=True).result(timeout=120)   # the gate is free


def test_the_managers_pass_the_option_and_refuse_it_on_a_blocking_save(tmp_path):
    sd = _state()
    mgr = distckpt.CheckpointManager(tmp_path / "root", keep_last=2)
    with pytest.raises(ConfigError, match="blocking=False"):
        mgr.save(1, sd, stage_in_background=True)
    with pytest.raises(ConfigError, match="True or False"):
        mgr.save(1, sd, blocking=False, stage_in_background="no")
    with pytest.raises(ConfigError, match="True or False"):
        distckpt.async_save(sd, tmp_path / "x", stage_in_background=1)
    mgr.save(1, sd, stage_in_background=False)   # a blocking save with the option off
    for step in (2, 3, 4):
        h = mgr.save(step, sd, blocking=False, stage_in_background=True)
        h.wait_staged()
        sd["big"].add_(1)
    h.result(timeout=120)
    mgr.close()
    assert mgr.steps() == [3, 4]
    got = distckpt.read(mgr.path(4))
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


def _hold_stagings() -> threading.Event:
    """In a rank's process: every staging copy waits until the returned event is set."""
    real = sa.stage
    gate = threading.Event()

    def held(*args, **kwargs):
        assert gate.wait(60)
        return real(*args, **kwargs)
    sa.stage = held
    return gate


def _two_ranks_one_changes(rank, world, tmp):
    gate = _hold_stagings()
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
    return {"err": err, "blocked": blocked}


def test_a_change_on_one_rank_fails_the_save_on_every_rank(tmp_path):
    out = run_ranks(_two_ranks_one_changes, 2, str(tmp_path), timeout=240)
    assert [o["err"] for o in out] == [("StateChangedError", [1])] * 2, out
    assert not os.path.exists(tmp_path / "c")


def _dtensor_body(rank, world, tmp):
    """FSDP2's layout: DTensor parameters. An optimizer step through DTensors moves no version
    counter of the local tensors the save stages (foreach: not even the DTensor's), so the step
    must wait; a direct in-place DTensor operation moves the DTensor's counter. A ShardedTensor
    (TorchRec's tables) cannot be guarded: staged before the call returns."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    gate = _hold_stagings()
    mesh = init_device_mesh("cpu", (world,))
    w = torch.nn.Parameter(distribute_tensor(torch.arange(64 * 32, dtype=torch.float32).reshape(64, 32), mesh,
                                             [Shard(0)]))
    opt = torch.optim.SGD([w], lr=1.0, foreach=True)
    w.grad = distribute_tensor(torch.ones(64, 32), mesh, [Shard(0)])
    want = w.full_tensor().clone()
    h = distckpt.async_save({"w": w}, os.path.join(tmp, "step"), stage_in_background=True)
    threading.Timer(0.5, gate.set).start()
    opt.step()   # before wait_staged(): waits for the staging
    stepped = h.staged()
    h.result(timeout=120)
    saved = distckpt.read(os.path.join(tmp, "step"))["w"]

    gate.clear()
    h = distckpt.async_save({"w": w}, os.path.join(tmp, "direct"), stage_in_background=True)
    with torch.no_grad():
        w.mul_(2)   # an in-place DTensor operation: the DTensor's counter moves
    gate.set()
    try:
        h.result(timeout=120)
        direct = None
    except distckpt.DistCkptError as exc:
        direct = type(exc).__name__

    from torch.distributed._shard.sharded_tensor import Shard as STShard, ShardMetadata, init_from_local_shards
    local = torch.full((4, 8), float(rank))
    st = init_from_local_shards([STShard(local, ShardMetadata([4 * rank, 0], [4, 8], f"rank:{rank}/cpu"))],
                                [4 * world, 8])
    gate.clear()
    threading.Timer(0.5, gate.set).start()
    h = distckpt.async_save({"table": st}, os.path.join(tmp, "table"), stage_in_background=True)
    table_staged_at_return = h.staged()
    local.fill_(-1.0)
    h.result(timeout=120)
    table = distckpt.read(os.path.join(tmp, "table"))["table"]
    return {"stepped_after_staging": stepped, "saved_ok": bool(torch.equal(saved, want)), "direct": direct,
            "table_staged_at_return": table_staged_at_return,
            "table_ok": bool(torch.equal(table, torch.arange(world).repeat_interleave(4)[:, None].expand(-1, 8)
                                         .float()))}


def test_dtensor_steps_wait_direct_changes_fail_and_sharded_tables_stage_at_the_call(tmp_path):
    out = run_ranks(_dtensor_body, 2, str(tmp_path), timeout=240)
    for o in out:
        assert o == {"stepped_after_staging": True, "saved_ok": True, "direct": "StateChangedError",
                     "table_staged_at_return": True, "table_ok": True}, out
