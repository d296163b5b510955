"""Async save (issue #6): snapshot isolation, ordering, typed errors, no leaks, exit with a save in
flight, 2 real gloo ranks, and CheckpointManager.save(blocking=False) with rotation."""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch

import distckpt
from distckpt.save_async import AsyncSaveHandle
from distckpt.staging.pool import staging_pool
from distckpt.storage.posix.leftovers import TMP_RE
from distckpt.storage.posix.manifests import is_committed
from distckpt.errors import (CheckpointExistsError, DiskFullError, UnsupportedValueError)

from ..conftest import open_fds
from ..helpers.distributed import run_ranks
from ..helpers.faults import REPO_ROOT, mounts, run_python  # noqa: F401  (mounts: fixture)

BIG = 40 << 20  # int32 elements: a 160 MiB tensor (TorchSnapshot does not isolate CPU tensors >= 128 MiB)


def _state(big_elems: int = 1 << 20) -> dict:
    g = torch.Generator().manual_seed(0)
    return {
        "big": torch.arange(big_elems, dtype=torch.int32),
        "w": torch.randn(64, 33, generator=g),
        "bf": torch.randn(7, 9, generator=g).to(torch.bfloat16),
        "t": torch.randn(16, 8, generator=g).t(),  # not contiguous
        "small": [torch.full((3,), float(i)) for i in range(20)],
        "step": 7,
        "name": "run-a",
    }


def _expected(sd: dict) -> dict:
    return {k: ([t.clone() for t in v] if isinstance(v, list) else v.clone() if isinstance(v, torch.Tensor) else v)
            for k, v in sd.items()}


def _assert_same(got: dict, want: dict) -> None:
    assert set(got) == set(want)
    for k, v in want.items():
        if isinstance(v, torch.Tensor):
            assert got[k].dtype == v.dtype and torch.equal(got[k], v), k
        elif isinstance(v, list):
            assert all(torch.equal(a, b) for a, b in zip(got[k], v)), k
        else:
            assert got[k] == v, k


def _mutate(sd: dict) -> None:
    sd["big"].fill_(-1)
    sd["w"].mul_(0)
    sd["bf"].add_(1)
    sd["t"].zero_()
    for t in sd["small"]:
        t.fill_(99.0)


def _worker_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("distckpt-async-save")]


# -------------------------------------------------------------------------------------------------
# Single process


def test_snapshot_isolation_large_cpu_tensor(tmp_path):
    sd = _state(BIG)
    want = _expected(sd)
    h = distckpt.async_save(sd, tmp_path / "c")
    assert isinstance(h, AsyncSaveHandle)
    _mutate(sd)  # in place, at once, while the background thread writes
    sd["step"] = 8  # replacing a plain value after the call does not change the checkpoint either
    res = h.result(timeout=120)
    assert h.done() and res.total_bytes >= BIG * 4
    assert h.staged_bytes >= BIG * 4
    _assert_same(distckpt.read(tmp_path / "c"), want)


def test_second_async_save_waits_for_the_first_in_order(tmp_path):
    sd = _state(8 << 20)
    want1 = _expected(sd)
    h1 = distckpt.async_save(sd, tmp_path / "one")
    sd["big"].add_(5)
    want2 = _expected(sd)
    h2 = distckpt.async_save(sd, tmp_path / "two")
    assert h1.done(), "the second save must not start before the first has finished"
    sd["big"].add_(5)
    # A sync save waits for the async one in flight too (collectives stay in call order).
    res3 = distckpt.save(sd, tmp_path / "three")
    assert h2.done()
    want3 = _expected(sd)
    assert h1.result().save_id != h2.result().save_id != res3.save_id
    _assert_same(distckpt.read(tmp_path / "one"), want1)
    _assert_same(distckpt.read(tmp_path / "two"), want2)
    _assert_same(distckpt.read(tmp_path / "three"), want3)


def test_staging_pool_is_reused_for_the_same_model(tmp_path):
    sd = _state(4 << 20)
    distckpt.async_save(sd, tmp_path / "a").result()
    pool = staging_pool()
    before = pool.allocations
    idle = pool.idle_bytes()
    assert idle >= 16 << 20
    for name in ("b", "c"):
        distckpt.async_save(sd, tmp_path / name).result()
    assert pool.allocations == before and pool.idle_bytes() == idle


def _fresh_pool(monkeypatch):
    """A private pool (the process-wide one is shared by every test of this process)."""
    from distckpt.staging import pool as pool_mod
    pool = pool_mod.StagingPool()
    monkeypatch.setattr(pool_mod, "_POOL", pool)
    import distckpt.save_async as sa
    monkeypatch.setattr(sa, "staging_pool", lambda: pool)
    return pool


def test_reserved_memory_is_what_the_first_save_stages_into(tmp_path, monkeypatch):
    """reserve_staging_memory prepares the arena on a thread; the first save then allocates
    nothing (no overflow), writes the right bytes, and the memory is kept for the next save."""
    pool = _fresh_pool(monkeypatch)
    sd = _state(4 << 20)
    want = _expected(sd)
    res = distckpt.reserve_staging_memory(sd)
    assert res.wait(60) and res.error is None and res.nbytes >= (16 << 20)
    assert pool.allocations == 1 and pool.idle_bytes() == res.nbytes
    # Idle memory counts toward a second request: nothing more is reserved.
    assert distckpt.reserve_staging_memory(sd).nbytes == 0
    distckpt.async_save(sd, tmp_path / "a").result()
    assert pool.allocations == 1 and pool.idle_bytes() == res.nbytes
    _assert_same(distckpt.read(tmp_path / "a"), want)
    assert distckpt.release_staging_memory() == res.nbytes and pool.idle_bytes() == 0


def test_reserving_ahead_also_loads_the_save_path():
    """The first async_save after reserve_staging_memory must not pay for importing the save
    path (tens of ms of a 0.1 s blocked time on the CPU VM): reaching the function through
    ``distckpt`` loads it, in a fresh interpreter, before any save."""
    r = run_python("import sys\nimport distckpt\n"
                   "before = [m for m in ('distckpt.save_async', 'distckpt.saveplan', 'distckpt.commit') if m in sys.modules]\n"
                   "distckpt.reserve_staging_memory(nbytes=1 << 20).wait(60)\n"
                   "emit([before, [m in sys.modules for m in ('distckpt.save_async', 'distckpt.saveplan', 'distckpt.commit')]])")
    assert r.returncode == 0, r.stderr
    assert r.emitted == [[[], [True, True, True]]]


def test_a_grown_state_overflows_once_then_fits(tmp_path, monkeypatch):
    """A state that grows after the reservation (optimizer states created at the first step):
    the save stages what does not fit through one plain overflow allocation, which the pool keeps
    (CPU: it is already what the next save wants), so the save after that allocates nothing."""
    pool = _fresh_pool(monkeypatch)
    sd = _state(1 << 20)
    distckpt.reserve_staging_memory(sd).wait(60)
    first = pool.idle_bytes()
    sd["exp_avg"] = torch.randn(1 << 20)  # 4 MiB more
    want = _expected(sd)
    distckpt.async_save(sd, tmp_path / "a").result()
    assert pool.allocations == 2 and pool.idle_bytes() > first
    _assert_same(distckpt.read(tmp_path / "a"), want)
    distckpt.async_save(sd, tmp_path / "b").result()
    assert pool.allocations == 2
    _assert_same(distckpt.read(tmp_path / "b"), want)
    # The state shrinks back: segments the save leaves unused are freed, at most 2x + 1 MiB kept.
    del sd["exp_avg"], want["exp_avg"]
    distckpt.async_save(sd, tmp_path / "c").result()
    _assert_same(distckpt.read(tmp_path / "c"), want)
    assert pool.idle_bytes() <= 2 * first + (1 << 20)


def test_reservations_stay_within_the_pool_bound(tmp_path, monkeypatch):
    pool = _fresh_pool(monkeypatch)
    from distckpt.config import get_config
    monkeypatch.setenv("DISTCKPT_STAGING_POOL_BYTES", "0")
    get_config.cache_clear()
    try:
        res = distckpt.reserve_staging_memory(nbytes=8 << 20)
        assert res.done() and res.nbytes == 0 and pool.idle_bytes() == 0
        monkeypatch.setenv("DISTCKPT_STAGING_POOL_BYTES", str(1 << 20))
        get_config.cache_clear()
        res = distckpt.reserve_staging_memory(nbytes=8 << 20)  # one 8 MiB segment: over the bound
        assert res.done() and res.nbytes == 0 and pool.idle_bytes() == 0
        res = distckpt.reserve_staging_memory(nbytes=512 << 10)
        assert res.wait(60) and res.nbytes == 512 << 10 and pool.idle_bytes() == 512 << 10
        with pytest.raises(ValueError):
            distckpt.reserve_staging_memory()
        with pytest.raises(ValueError):
            distckpt.reserve_staging_memory({"w": torch.ones(3)}, nbytes=4)
        with pytest.raises(ValueError):
            distckpt.reserve_staging_memory(nbytes=-1)
        with pytest.raises(UnsupportedValueError):
            distckpt.reserve_staging_memory({"x": object()})
    finally:
        monkeypatch.delenv("DISTCKPT_STAGING_POOL_BYTES")
        get_config.cache_clear()
        pool.clear()


def test_a_failed_reservation_is_reported_not_raised(monkeypatch):
    pool = _fresh_pool(monkeypatch)
    from distckpt.staging import pool as pool_mod

    def boom(*a, **k):
        raise MemoryError("no memory for the test")
    monkeypatch.setattr(pool_mod, "Segment", boom)
    res = distckpt.reserve_staging_memory(nbytes=1 << 20)
    assert res.wait(60) and isinstance(res.error, MemoryError)
    assert pool.idle_bytes() == 0 and pool.pending_bytes() == 0 and "failed" in repr(res)


def test_errors_are_the_typed_errors_of_a_sync_save(tmp_path):
    sd = _state()
    distckpt.save(sd, tmp_path / "c")
    with pytest.raises(CheckpointExistsError) as sync_info:
        distckpt.save(sd, tmp_path / "c")
    h = distckpt.async_save(sd, tmp_path / "c")
    with pytest.raises(CheckpointExistsError) as info:
        h.result(timeout=60)
    assert type(info.value) is type(sync_info.value) and info.value.path == str(tmp_path / "c")
    assert isinstance(h.exception(), CheckpointExistsError)
    # An error of the PLAN phase comes from result() too, not from the call.
    h = distckpt.async_save({"x": object()}, tmp_path / "d")
    with pytest.raises(UnsupportedValueError):
        h.result(timeout=60)
    assert not os.path.exists(tmp_path / "d")
    # The gate was released on both failure paths: a later save runs.
    distckpt.async_save(sd, tmp_path / "c", overwrite=True).result(timeout=60)


@pytest.mark.parametrize("preflight", ["1", "0"])
def test_disk_full_on_a_real_tmpfs(mounts, tmp_path, monkeypatch, preflight):
    """ENOSPC: with pre-flight on, PREPARE refuses; with it off, the kernel's ENOSPC at write."""
    from distckpt.config import get_config
    monkeypatch.setenv("DISTCKPT_PREFLIGHT", preflight)
    get_config.cache_clear()
    mnt = mounts.tmpfs(tmp_path / "small", size="16m")
    sd = {"x": torch.ones(8 << 20, dtype=torch.int32)}  # 32 MiB
    fds = open_fds()
    h = distckpt.async_save(sd, mnt / "c")
    with pytest.raises(DiskFullError) as info:
        h.result(timeout=60)
    assert info.value.errno == errno.ENOSPC
    assert os.listdir(mnt) == []  # nothing committed, the tmp dir removed
    assert open_fds() == fds and _worker_threads() == []


def test_no_thread_or_fd_left_behind(tmp_path):
    sd = _state(4 << 20)
    distckpt.save(sd, tmp_path / "warm")  # backend probe and imports happen once per process
    fds = open_fds()
    h = distckpt.async_save(sd, tmp_path / "ok")
    h.result(timeout=60)
    assert _worker_threads() == [] and open_fds() == fds
    h = distckpt.async_save(sd, tmp_path / "ok")  # fails: exists
    with pytest.raises(CheckpointExistsError):
        h.result(timeout=60)
    assert _worker_threads() == [] and open_fds() == fds
    h = distckpt.async_save(sd, tmp_path / "p")
    while not h.done():
        time.sleep(0.01)
    h.result()
    assert _worker_threads() == [] and open_fds() == fds


def test_result_timeout_does_not_cancel(tmp_path):
    sd = {"x": torch.ones(64 << 20, dtype=torch.int32)}
    h = distckpt.async_save(sd, tmp_path / "c")
    with pytest.raises(TimeoutError):  # 256 MiB cannot be written in 0.1 ms
        h.result(timeout=0.0001)
    assert h.result(timeout=60).total_bytes >= 256 << 20


_EXIT_CHILD = """
import os, sys, torch, distckpt
path = sys.argv[1] if len(sys.argv) > 1 else {path!r}
sd = {{"a": torch.arange(64 << 20, dtype=torch.int32), "b": torch.ones(1000)}}
h = distckpt.async_save(sd, path)
sd["a"].zero_()
emit({{"returned": True}})
{how}
"""


def _check_all_or_nothing(path: str, expect_committed: bool | None) -> bool:
    parent = os.path.dirname(path)
    committed = is_committed(path)
    if expect_committed is not None:
        assert committed == expect_committed
    if committed:
        full = distckpt.read(path)  # every checksum verified
        assert torch.equal(full["a"], torch.arange(64 << 20, dtype=torch.int32))
        assert torch.equal(full["b"], torch.ones(1000))
    else:
        assert not os.path.exists(path)
    if committed:  # a finished save leaves no tmp dir
        assert not [e for e in os.listdir(parent) if TMP_RE.match(e)]
    return committed


@pytest.mark.parametrize("how", ["", "sys.exit(0)", "raise SystemExit(3)", "raise RuntimeError('boom')"])
def test_exit_with_a_save_in_flight_finishes_it(tmp_path, how):
    path = str(tmp_path / "c")
    r = run_python(_EXIT_CHILD.format(path=path, how=how), timeout=120)
    assert r.data == {"returned": True}
    assert r.signal is None
    _check_all_or_nothing(path, expect_committed=True)
    if not how:
        r.check()
        assert "waiting for the async save" in r.stderr


@pytest.mark.parametrize("delay", [0.0, 0.3, 0.8, 1.5])
def test_killed_with_a_save_in_flight_is_all_or_nothing(tmp_path, delay):
    """SIGKILL at some point of the background save: a complete checkpoint or none, and the next
    save of the same name reclaims the leftovers."""
    path = str(tmp_path / "c")
    code = "from tests.helpers.faults import _PRELUDE; exec(_PRELUDE)\n" + _EXIT_CHILD.format(
        path=path, how="import time; time.sleep(60)")
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT))
    proc = subprocess.Popen([sys.executable, "-c", code], env=env, cwd=str(REPO_ROOT),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert "returned" in line, proc.stderr.read()
        time.sleep(delay)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.stdout.close()
        proc.stderr.close()
    committed = _check_all_or_nothing(path, expect_committed=None)
    if not committed:
        # The leftover tmp dir (if any) is never loadable and is reclaimed by the next save.
        distckpt.save({"a": torch.arange(64 << 20, dtype=torch.int32), "b": torch.ones(1000)}, path)
        _check_all_or_nothing(path, expect_committed=True)


_FORK_CHILD = """
import json, os, sys, threading, time, multiprocessing as mp
import torch, distckpt
import distckpt.save_async as sa
from distckpt.commit import finish_save
from distckpt.staging.pool import staging_pool
root = {root!r}
distckpt.async_save({{"w": torch.arange(1 << 16)}}, root + "/warm", no_dist=True).result()  # the pool keeps segments
release = threading.Event()

def slow_finish(*args, **kwargs):  # the parent's save stays in flight (gate held) until released
    assert release.wait(120)
    return finish_save(*args, **kwargs)

h = sa.async_save_in_root({{"w": torch.arange(1 << 16)}}, root + "/parent", finish=slow_finish, no_dist=True)

def child_saves(name):  # small tensors: a forked child must not use the parent's OpenMP pool
    info = {{"idle": staging_pool().idle_bytes()}}
    distckpt.async_save({{"c": torch.ones(1000)}}, root + "/" + name + "_async", no_dist=True).result(timeout=60)
    distckpt.save({{"c": torch.ones(10)}}, root + "/" + name, no_dist=True)
    with open(root + "/" + name + ".json", "w") as f:
        json.dump(info, f)

def wait_child(pid):
    t0 = time.monotonic()
    while time.monotonic() - t0 < 30:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.05)
    os.kill(pid, 9)
    os.waitpid(pid, 0)
    return "hung"

pid = os.fork()
if pid == 0:
    try:
        child_saves("fork")
    except BaseException:
        os._exit(2)
    sys.exit(0)  # a normal interpreter exit: runs the exit hooks
fork_rc = wait_child(pid)
p = mp.get_context("fork").Process(target=child_saves, args=("mp",))
p.start()
mp_rc = wait_child(p.pid)
emit({{"fork": fork_rc, "mp": mp_rc, "parent_done": h.done()}})
release.set()
h.result(timeout=60)
"""


def test_a_forked_child_does_not_inherit_saves_in_flight(tmp_path):
    """A child forked while an async save is in flight (DataLoader workers, multiprocessing fork,
    os.fork) exits at once (its exit hook does not wait for the parent's save), can save itself
    (the save gate and the staging pool are not inherited held or shared), and the parent's save
    still commits."""
    root = str(tmp_path)
    r = run_python(_FORK_CHILD.format(root=root), timeout=150)
    r.check()
    assert r.data == {"fork": 0, "mp": 0, "parent_done": False}
    for name in ("fork", "mp"):
        with open(os.path.join(root, name + ".json")) as f:
            assert json.load(f) == {"idle": 0}  # the parent's idle segments are not the child's
        assert torch.equal(distckpt.read(os.path.join(root, name))["c"], torch.ones(10))
        assert torch.equal(distckpt.read(os.path.join(root, name + "_async"))["c"], torch.ones(1000))
    assert torch.equal(distckpt.read(os.path.join(root, "parent"))["w"], torch.arange(1 << 16))


# -------------------------------------------------------------------------------------------------
# CheckpointManager


def test_manager_blocking_false_rotation(tmp_path):
    mgr = distckpt.CheckpointManager(tmp_path, keep_last=2)
    sd = _state(4 << 20)
    handles, wants = [], {}
    for step in range(5):
        sd["big"].fill_(step)
        sd["step"] = step
        wants[step] = _expected(sd)
        handles.append(mgr.save(step, sd, blocking=False))  # back to back, never waiting
        sd["big"].fill_(-1)  # the training step after the save call
    results = [h.result(timeout=120) for h in handles]
    assert [os.path.basename(r.path) for r in results] == [f"step_{s:08d}" for s in range(5)]
    assert mgr.steps() == [3, 4]
    assert open(tmp_path / "latest").read() == "step_00000004\n"
    for step in (3, 4):
        _assert_same(distckpt.read(mgr.path(step)), wants[step])
    assert not [e for e in os.listdir(tmp_path) if TMP_RE.match(e)]
    # blocking=True (default) still returns a SaveResult
    res = mgr.save(5, sd)
    assert isinstance(res, distckpt.SaveResult) and mgr.steps() == [4, 5]


# -------------------------------------------------------------------------------------------------
# Two real gloo ranks


def _two_rank_body(rank, world, tmp):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    full = torch.arange(8 << 20, dtype=torch.int32).reshape(1 << 12, -1)  # 32 MiB, sharded on dim 0
    rep = torch.arange(1 << 20, dtype=torch.float32)                        # replicated: written once
    sd = {"shard": distribute_tensor(full.clone(), mesh, [Shard(0)]), "rep": rep.clone(), "n": 1}
    distckpt.save(sd, os.path.join(tmp, "first"))
    h = distckpt.async_save(sd, os.path.join(tmp, "second"))
    staged = h.staged_bytes
    sd["shard"].to_local().fill_(-7)
    sd["rep"].zero_()
    # A load on the control group while the save runs in the background: the background phases use
    # their own gloo group, so the two protocols cannot interleave their collectives.
    back = {"shard": distribute_tensor(torch.zeros_like(full), mesh, [Shard(0)]), "rep": torch.zeros_like(rep),
            "n": 0}
    distckpt.load(back, os.path.join(tmp, "first"))
    assert torch.equal(back["shard"].full_tensor(), full) and torch.equal(back["rep"], rep)
    res = h.result(timeout=120)
    h2 = distckpt.async_save(sd, os.path.join(tmp, "second"))  # exists: same typed error on all ranks
    try:
        h2.result(timeout=120)
        raise AssertionError("expected an error")
    except distckpt.DistCkptError as exc:
        err = type(exc).__name__
    dist.barrier()
    return {"staged": staged, "bytes_per_rank": res.bytes_per_rank, "err": err,
            "threads": [t.name for t in _worker_threads()]}


def test_two_ranks_async_save(tmp_path):
    out = run_ranks(_two_rank_body, 2, str(tmp_path), timeout=240)
    full = torch.arange(8 << 20, dtype=torch.int32).reshape(1 << 12, -1)
    got = distckpt.read(tmp_path / "second")
    assert torch.equal(got["shard"], full) and torch.equal(got["rep"], torch.arange(1 << 20, dtype=torch.float32))
    assert got["n"] == 1
    # Only owned pieces are staged: the 16 MiB shard on each rank, the 4 MiB replica on one rank.
    assert sorted(o["staged"] for o in out) == [16 << 20, (16 << 20) + (4 << 20)]
    assert all(o["threads"] == [] for o in out)
    # PREPARE's error is rank 0's, broadcast: every rank raises exactly it
    assert {o["err"] for o in out} == {"CheckpointExistsError"}


def _unread_failure_body(rank, world, tmp):
    """A collective async save fails on every rank; what each rank then does with its handle
    differs, and every rank makes the same next call."""
    mgr = distckpt.CheckpointManager(os.path.join(tmp, "root"), keep_last=5)
    sd = {f"w{rank}": torch.full((1000,), float(rank))}
    distckpt.save(sd, mgr.path(2))  # step 2 taken outside the manager: its save fails at PREPARE
    out = {}
    # 1. Rank 0 takes the error from the handle, rank 1 only waits (a logging pattern): the failure
    #    counts as seen, and no rank raises it at the next save (rank 1 used to, alone, and then
    #    paired its step 4 with rank 0's step 3).
    h = mgr.save(2, sd, blocking=False)
    if rank == 0:
        out["read"] = type(h.exception(timeout=120)).__name__
    else:
        h.wait(120)
    try:
        out["next"] = os.path.basename(mgr.save(3, sd, blocking=False).result(timeout=120).path)
    except Exception as exc:  # noqa: BLE001 - reported to the test
        out["next"] = type(exc).__name__
    # 2. Nobody reads it: every rank raises it at the same next call (sync save), none saves.
    h = distckpt.async_save(sd, mgr.path(2))
    h.wait(120)
    try:
        distckpt.save(sd, os.path.join(tmp, "after"))
        out["unread"] = None
    except Exception as exc:  # noqa: BLE001
        out["unread"] = type(exc).__name__
    out["after_exists"] = os.path.exists(os.path.join(tmp, "after"))
    distckpt.save(sd, os.path.join(tmp, "after"))  # reported once; saves go on
    return out


def test_an_unread_collective_failure_is_decided_by_every_rank_alike(tmp_path):
    out = run_ranks(_unread_failure_body, 2, str(tmp_path), timeout=240,
                    env={"DISTCKPT_ARRIVAL_TIMEOUT_S": "15", "DISTCKPT_TIMEOUT_S": "30"})
    assert out[0]["read"] == "CheckpointExistsError"
    assert [o["next"] for o in out] == ["step_00000003"] * 2
    assert [o["unread"] for o in out] == ["CheckpointExistsError"] * 2
    assert [o["after_exists"] for o in out] == [False, False]
    got = distckpt.read(tmp_path / "root" / "step_00000003")
    assert torch.equal(got["w0"], torch.zeros(1000)) and torch.equal(got["w1"], torch.ones(1000))


def _interrupted_staging_body(rank, world, tmp):
    import distckpt.save_async as sa
    sd = {f"w{rank}": torch.full((1 << 16,), float(rank))}
    real_stage = sa.stage
    if rank == 1:
        def interrupted(*args, **kwargs):
            raise KeyboardInterrupt()
        sa.stage = interrupted
    out = {}
    t0 = time.monotonic()
    try:
        h = distckpt.async_save(sd, os.path.join(tmp, "s1"))
        exc = h.exception(timeout=120)
        out["s1"] = {"type": type(exc).__name__, "failed_ranks": getattr(exc, "failed_ranks", None)}
    except KeyboardInterrupt:
        out["s1"] = "KeyboardInterrupt"
    out["s1_seconds"] = time.monotonic() - t0
    sa.stage = real_stage
    # The next save runs on both ranks (rank 1's caller was told; rank 0 read the error).
    out["s2"] = os.path.basename(distckpt.async_save(sd, os.path.join(tmp, "s2")).result(timeout=120).path)
    out["threads"] = [t.name for t in _worker_threads()]
    return out


def test_an_interrupt_during_staging_is_reported_to_the_peers(tmp_path):
    """KeyboardInterrupt while one rank stages: that rank's caller gets it, and the peer's handle
    fails at once with a typed error naming the rank (not PeerLostError after DISTCKPT_TIMEOUT_S)."""
    out = run_ranks(_interrupted_staging_body, 2, str(tmp_path), timeout=240,
                    env={"DISTCKPT_TIMEOUT_S": "30"})
    assert out[1]["s1"] == "KeyboardInterrupt"
    assert out[0]["s1"] == {"type": "RankFailureError", "failed_ranks": [1]}
    assert out[0]["s1_seconds"] < 15
    assert not os.path.exists(tmp_path / "s1")
    assert [o["s2"] for o in out] == ["s2", "s2"] and all(o["threads"] == [] for o in out)


def test_release_frees_a_reservation_still_being_prepared(monkeypatch):
    """release_staging_memory() (CheckpointManager.close()) while reserve_staging_memory() still
    prepares segments: the reservation is superseded; nothing it makes stays in the pool."""
    pool = _fresh_pool(monkeypatch)
    from distckpt.staging import pool as pool_mod
    monkeypatch.setattr(pool_mod, "_CHUNK", 1 << 20)  # 3 segments of 1 MiB
    go, made = threading.Event(), []
    real_segment = pool_mod.Segment

    def held_segment(*args, **kwargs):  # the reservation is in flight until `go`
        assert go.wait(60)
        seg = real_segment(*args, **kwargs)
        made.append(seg)
        return seg
    monkeypatch.setattr(pool_mod, "Segment", held_segment)
    res = distckpt.reserve_staging_memory(nbytes=3 << 20)
    assert not res.done() and pool.pending_bytes() == 3 << 20
    assert distckpt.release_staging_memory() == 0
    assert pool.pending_bytes() == 0
    go.set()
    assert res.wait(60) and res.error is None and res.superseded and "superseded" in repr(res)
    assert pool.idle_bytes() == 0 and pool.pending_bytes() == 0
    assert len(made) == 1 and made[0].buf is None  # the segment in the making was freed, no other made
    # A reservation after the release is a normal one.
    res = distckpt.reserve_staging_memory(nbytes=2 << 20)
    assert res.wait(60) and not res.superseded and pool.idle_bytes() == 2 << 20
    pool.clear()


class _FailingStateful:
    def __init__(self, exc: BaseException) -> None:
        self.exc = exc

    def state_dict(self):
        raise self.exc

    def load_state_dict(self, sd) -> None:
        pass


def _stateful_class_body(rank, world, tmp):
    from distckpt import errors
    out = {}

    def outcome(exc):
        return {"type": type(exc).__name__, "failed_ranks": getattr(exc, "failed_ranks", None),
                "is_rank_failure": isinstance(exc, errors.RankFailureError)}

    every = {"w": torch.ones(4), "bad": _FailingStateful(RuntimeError(f"boom on {rank}"))}
    try:
        distckpt.save(every, os.path.join(tmp, "sync"))
    except Exception as exc:  # noqa: BLE001
        out["sync"] = outcome(exc)
        out["sync_own"] = str(exc) == f"boom on {rank}"
    out["async"] = outcome(distckpt.async_save(every, os.path.join(tmp, "async")).exception(timeout=120))
    # One rank fails, or the classes differ: RankFailureError on every rank (no one class to raise).
    one = {"w": torch.ones(4), "bad": _FailingStateful(RuntimeError("boom"))} if rank == 1 else {"w": torch.ones(4)}
    out["one"] = outcome(distckpt.async_save(one, os.path.join(tmp, "one")).exception(timeout=120))
    mixed = {"w": torch.ones(4), "bad": _FailingStateful(RuntimeError("x") if rank == 0 else ValueError("y"))}
    out["mixed"] = outcome(distckpt.async_save(mixed, os.path.join(tmp, "mixed")).exception(timeout=120))
    return out


def test_every_rank_failing_with_one_class_raises_that_class(tmp_path):
    """docs/SEMANTICS.md ("Errors in a job"): when every rank raised the same class -- here a
    Stateful's RuntimeError, not a distckpt error -- a save raises that class on every rank (the
    rank's own error), sync or async, with every rank's error in ``failures``."""
    out = run_ranks(_stateful_class_body, 2, str(tmp_path), timeout=240)
    for o in out:
        assert o["sync"] == {"type": "RuntimeError", "failed_ranks": [0, 1], "is_rank_failure": False}
        assert o["sync_own"] and o["async"] == o["sync"]
        assert o["one"] == {"type": "RankFailureError", "failed_ranks": [1], "is_rank_failure": True}
        assert o["mixed"] == {"type": "RankFailureError", "failed_ranks": [0, 1], "is_rank_failure": True}
    assert not [n for n in ("sync", "async", "one", "mixed") if os.path.exists(tmp_path / n)]


_REENTRANT_CHILD = r"""
import os, signal
import torch
import distckpt
from distckpt.errors import SaveInProgressError

root = {root!r}
# distckpt's functions import their modules on first use: a handler running inside that import
# would find it half done (Python's own rule for any module), so they are imported first.
distckpt.save, distckpt.async_save, distckpt.read
state = {{f"t{{i}}": torch.full((8 << 20,), float(i)) for i in range(8)}}  # 256 MiB
seen = []

def handler(signum, frame):
    if "refused" in seen:
        return
    try:
        distckpt.save({{"x": torch.ones(3)}}, os.path.join(root, "inner"), overwrite=True)
        seen.append("saved")
    except SaveInProgressError:
        seen.append("refused")

signal.signal(signal.SIGALRM, handler)
for mode in ("sync", "async"):
    seen.clear()
    signal.setitimer(signal.ITIMER_REAL, 0.005, 0.005)
    if mode == "sync":
        distckpt.save(state, os.path.join(root, mode))
    else:
        h = distckpt.async_save(state, os.path.join(root, mode))
        signal.setitimer(signal.ITIMER_REAL, 0)
        h.result()
    signal.setitimer(signal.ITIMER_REAL, 0)
    got = distckpt.read(os.path.join(root, mode))
    emit({{"mode": mode, "seen": seen, "exact": all(torch.equal(got[k], v) for k, v in state.items())}})
"""


def test_a_signal_handler_that_saves_during_a_save_is_refused_not_deadlocked(tmp_path):
    """The "save on preemption" pattern: a signal handler calls distckpt.save while the main
    thread is inside a save (sync, or an async save's staging on the caller's thread). The handler
    ran on the thread that holds the process's save gate and waited for it for ever (the outer
    save cannot go on until the handler returns): the process hung. Now the inner save raises
    SaveInProgressError at once, and the outer save completes bit-exact."""
    r = run_python(_REENTRANT_CHILD.format(root=str(tmp_path)), timeout=120).check()
    by_mode = {e["mode"]: e for e in r.emitted}
    assert set(by_mode) == {"sync", "async"}, r.emitted
    for mode, e in by_mode.items():
        assert e["exact"], (mode, e)
    assert "refused" in by_mode["sync"]["seen"], by_mode["sync"]


_NO_THREAD_IMPORTS = r"""
import sys, threading, tempfile, shutil
import torch
import distckpt
seen = []

def hook(event, args):
    if event == "import" and threading.current_thread() is not threading.main_thread():
        seen.append((threading.current_thread().name, args[0]))

sys.addaudithook(hook)
d = tempfile.mkdtemp(dir=sys.argv[1])
state = {"w": torch.ones(1000), "s": 3}
distckpt.async_save(state, d + "/a", no_dist=True).result()
distckpt.async_save(state, d + "/b", no_dist=True, stage_in_background=True).result()
distckpt.CheckpointManager(d + "/root").save(1, state, blocking=False).result()
print("THREAD_IMPORTS", sorted(set(seen)))
"""


def test_a_save_thread_imports_nothing(tmp_path):
    """A save's thread imported modules on its first use (the store's, the data file layout's...):
    a DataLoader forking its workers right after a job's first async save could fork while that
    thread held a module's import lock, and a worker's own save then hung on it for ever (an
    outside trial, seen with gdb). The caller's thread imports them first (a fresh interpreter
    here: nothing of distckpt's save path imported before the first call)."""
    proc = subprocess.run([sys.executable, "-c", _NO_THREAD_IMPORTS, str(tmp_path)], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "THREAD_IMPORTS []" in proc.stdout, proc.stdout


def _mixed_kinds(rank: int, world: int, root: str, how: str) -> tuple:
    import torch

    import distckpt
    state = {"w": torch.full((4,), float(rank))}
    t0 = time.monotonic()
    try:
        if how == "save_vs_async":
            if rank == 0:
                distckpt.save(state, root + "/c")
            else:
                distckpt.async_save(state, root + "/c").result()
        else:  # a manager whose ranks disagree on blocking
            out = distckpt.CheckpointManager(root + "/m").save(1, state, blocking=rank == 0)
            if rank == 1:
                out.result()   # blocking=False: the handle holds the error
    except Exception as exc:  # noqa: BLE001 - the test looks at the class
        return type(exc).__name__, str(exc), time.monotonic() - t0
    return "ok", "", time.monotonic() - t0


@pytest.mark.parametrize("how", ["save_vs_async", "manager_blocking"])
def test_ranks_mixing_a_blocking_and_an_async_save_fail_together_at_once(tmp_path, how):
    """One rank's blocking save met another's async save of the same checkpoint: each waited at its
    own collective for DISTCKPT_TIMEOUT_S (300 s by default), then raised PeerLostError saying a
    peer had not called it, though every rank had (an outside trial; DCP lets the two mix). The
    arrival check compares the kind of save: ConfigError on every rank, within seconds, nothing
    committed."""
    from tests.helpers.distributed import run_ranks
    out = run_ranks(_mixed_kinds, 2, str(tmp_path), how, timeout=240, env={"DISTCKPT_TIMEOUT_S": "120"})
    for kind, _message, _seconds in out:   # (the old code: PeerLostError after DISTCKPT_TIMEOUT_S)
        assert kind in ("ConfigError", "RankFailureError"), out
    assert any("same kind of save" in m for _k, m, _s in out), out
    assert not os.path.exists(tmp_path / "c" / "MANIFEST") and not os.path.exists(tmp_path / "m" / "step_00000001")
