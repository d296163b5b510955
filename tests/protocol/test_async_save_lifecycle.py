"""Async saves against the process's own lifecycle calls, on real gloo ranks: the process group
destroyed under a save in flight, a staging reservation right before a save, and
CheckpointManager.close() deciding an unread background failure with every rank."""

from __future__ import annotations

import os
import threading
import time

import pytest
import torch

import distckpt
from distckpt.errors import PeerLostError, ProcessGroupDestroyedError

from ..helpers.distributed import run_ranks


def _destroyed_body(rank, world, tmp):
    import torch.distributed as dist

    import distckpt.save_async as sa
    from distckpt.commit import finish_save
    go = threading.Event()

    def held_finish(*args, **kwargs):  # the background phases start only once the group is gone
        assert go.wait(60)
        return finish_save(*args, **kwargs)

    sd = {f"w{rank}": torch.full((1 << 16,), float(rank))}
    out = {}
    # 1. The caller reads the handle.
    h = sa.async_save_in_root(sd, os.path.join(tmp, "read"), finish=held_finish)
    dist.destroy_process_group()
    go.set()
    t0 = time.monotonic()
    exc = h.exception(timeout=120)
    out["read"] = {"type": type(exc).__name__, "is_peer_lost": isinstance(exc, PeerLostError),
                   "committed": getattr(exc, "committed", "absent"), "path": getattr(exc, "path", None),
                   "cause": type(exc.__cause__).__name__, "destroyed_in_msg": "destroy" in str(exc),
                   "seconds": time.monotonic() - t0}
    # 2. Nobody reads it: the next checkpoint call raises it (no group is left to decide it on).
    dist.init_process_group("gloo", rank=rank, world_size=world, init_method=f"file://{tmp}/rdzv2",
                            timeout=__import__("datetime").timedelta(seconds=60))
    go.clear()
    h = sa.async_save_in_root(sd, os.path.join(tmp, "unread"), finish=held_finish)
    dist.destroy_process_group()
    go.set()
    assert h.wait(120)
    try:
        distckpt.save(sd, os.path.join(tmp, f"alone{rank}"))
        out["next"] = None
    except Exception as exc:  # noqa: BLE001 - reported to the test
        out["next"] = type(exc).__name__
    out["alone_exists"] = os.path.exists(os.path.join(tmp, f"alone{rank}"))
    distckpt.save(sd, os.path.join(tmp, f"alone{rank}"), overwrite=True)  # reported once; saves go on
    return out


def test_destroying_the_group_under_a_save_is_not_a_lost_peer(tmp_path):
    """destroy_process_group() while a collective async save is in flight: every rank's handle
    fails at once with ProcessGroupDestroyedError (not PeerLostError: no peer was lost), saying
    nothing is committed; an unread one is raised at the next checkpoint call. Nothing commits."""
    out = run_ranks(_destroyed_body, 2, str(tmp_path), timeout=240, env={"DISTCKPT_TIMEOUT_S": "60"})
    for o in out:
        r = o["read"]
        assert r["type"] == "ProcessGroupDestroyedError" and not r["is_peer_lost"], r
        assert r["committed"] is False and r["path"] == str(tmp_path / "read") and r["destroyed_in_msg"]
        assert r["cause"] == "PeerLostError" and r["seconds"] < 30
        assert o["next"] == "ProcessGroupDestroyedError" and o["alone_exists"] is False
    assert not (tmp_path / "read").exists() and not (tmp_path / "unread").exists()
    assert issubclass(ProcessGroupDestroyedError, distckpt.errors.DistributedEnvError)


_MIB = 1 << 20


def _weights(rank: int) -> torch.Tensor:
    return torch.arange(12 << 20, dtype=torch.float32) + rank


def _reservation_body(rank, world, tmp):
    from distckpt.staging import pool as pool_mod
    from distckpt.staging.pool import staging_pool
    pool = staging_pool()
    go = threading.Event()
    real_segment, real_take = pool_mod.Segment, pool.take

    def slow_reserved_segment(*args, **kwargs):  # a reservation's segment is made only after `go`
        if kwargs.get("prefault"):
            assert go.wait(60)
        return real_segment(*args, **kwargs)

    def take_then_go(sizes):  # the reservation finishes once the save has taken its segments
        out = real_take(sizes)
        go.set()
        return out

    pool_mod.Segment = slow_reserved_segment
    pool.take = take_then_go
    sd = {f"w{rank}": _weights(rank)}  # 48 MiB on each rank, written by that rank
    out = {}
    # 1. Reserve, then save at once (the reservation is still being prepared at the save's take).
    res = distckpt.reserve_staging_memory(sd)
    h = distckpt.async_save(sd, os.path.join(tmp, "a"))
    h.result(timeout=120)
    assert res.wait(60) and res.error is None
    out["reserved"] = res.nbytes
    out["superseded"] = res.superseded
    out["held_after_a"] = pool.held_bytes()
    out["idle_after_a"] = pool.idle_bytes()
    # 2. Reserve while a save of the same state is in flight: the save's segments count.
    go.clear()
    pool.take = real_take
    import distckpt.save_async as sa
    from distckpt.commit import finish_save
    release = threading.Event()

    def held_finish(*args, **kwargs):
        assert release.wait(60)
        return finish_save(*args, **kwargs)

    h = sa.async_save_in_root(sd, os.path.join(tmp, "b"), finish=held_finish)
    out["in_use_during_b"] = pool.in_use_bytes()
    res2 = distckpt.reserve_staging_memory(sd)
    go.set()
    release.set()
    h.result(timeout=120)
    assert res2.wait(60)
    out["reserved_during_b"] = res2.nbytes
    out["held_after_b"] = pool.held_bytes()
    pool_mod.Segment = real_segment
    return out


def test_a_save_right_after_a_reservation_keeps_one_copy(tmp_path):
    """reserve_staging_memory(state) then at once async_save(state), on 2 gloo ranks of 48 MiB
    each: the pool ends holding one copy of the state's staging (48 MiB), not the reservation's
    beside the save's own overflow (96 MiB). Same when reserving while a save is in flight."""
    out = run_ranks(_reservation_body, 2, str(tmp_path), timeout=240)
    for o in out:
        assert o["reserved"] == 48 * _MIB, o
        assert o["held_after_a"] == o["idle_after_a"] and 48 * _MIB <= o["held_after_a"] <= 49 * _MIB, o
        assert o["superseded"], o
        assert o["in_use_during_b"] >= 48 * _MIB and o["reserved_during_b"] == 0, o
        assert 48 * _MIB <= o["held_after_b"] <= 49 * _MIB, o
    for name in ("a", "b"):
        got = distckpt.read(tmp_path / name)
        assert all(torch.equal(got[f"w{r}"], _weights(r)) for r in range(2))


def _outcome(call):
    t0 = time.monotonic()
    try:
        call()
        return {"type": None, "seconds": time.monotonic() - t0}
    except Exception as exc:  # noqa: BLE001 - reported to the test
        return {"type": type(exc).__name__, "failed_ranks": getattr(exc, "failed_ranks", None),
                "seconds": time.monotonic() - t0}


def _close_body(rank, world, tmp):
    from distckpt._dist import control_group
    from distckpt.tiers.localcommit import save_node_local
    from distckpt.tiers.nodes import node_layout
    mgr = distckpt.CheckpointManager(os.path.join(tmp, "root"))
    sd = {f"w{rank}": torch.full((1000,), float(rank))}
    mgr.save(1, sd)
    out = {}

    def own_failure():  # rank 1 alone: a one-rank async save that fails, its error unread
        if rank == 1:
            h = distckpt.async_save(sd, mgr.path(1), no_dist=True)  # exists: CheckpointExistsError
            assert h.wait(120)

    # 1. Only rank 1's background save failed: close() raises on both ranks.
    own_failure()
    out["own"] = _outcome(mgr.close)
    out["own_again"] = _outcome(mgr.close)  # reported once
    # 2. A collective async save failed on every rank, nobody read it: close() raises on both.
    h = mgr.save(1, sd, blocking=False)  # step 1 exists
    assert h.wait(120)
    out["collective"] = _outcome(mgr.close)
    # 3. The tiered local save's blocking path decides it with every rank too.
    layout = node_layout(control_group(), os.path.join(tmp, f"node{rank}"))
    own_failure()
    out["node_local"] = _outcome(lambda: save_node_local(sd, os.path.join(tmp, f"node{rank}", "s"),
                                                         layout=layout))
    out["node_local_exists"] = os.path.exists(os.path.join(tmp, f"node{rank}", "s"))
    return out


def test_close_decides_an_unread_failure_with_every_rank(tmp_path):
    """CheckpointManager.close() (and the tiered local save's blocking path) decide an unread
    background failure with every rank, as save/load do: when only rank 1's own async save failed,
    both ranks raise (rank 1 its error, rank 0 the collective error naming rank 1); an unread
    collective failure is raised on both; nothing waits for a timeout."""
    out = run_ranks(_close_body, 2, str(tmp_path), timeout=240,
                    env={"DISTCKPT_ARRIVAL_TIMEOUT_S": "10", "DISTCKPT_TIMEOUT_S": "20"})
    for o in out:
        for what in ("own", "collective", "node_local"):
            assert o[what]["type"] == "CheckpointExistsError", (what, out)
            assert o[what]["seconds"] < 8, (what, out)
        assert o["own_again"]["type"] is None
        assert o["node_local_exists"] is False
    assert [o["own"]["failed_ranks"] for o in out] == [[1], None]
    assert [o["node_local"]["failed_ranks"] for o in out] == [[1], None]


def _lost_peer_body(rank, world, tmp, blocking):
    mgr = distckpt.CheckpointManager(os.path.join(tmp, "root"))
    sd = {f"w{rank}": torch.full((1000,), float(rank))}
    mgr.save(1, sd)
    out = {}
    if blocking:
        if rank == 1:
            os._exit(9)  # a rank lost between two saves
        out["save"] = _outcome(lambda: mgr.save(2, sd))
    else:
        h = mgr.save(2, sd, blocking=False)
        if rank == 1:
            os._exit(9)  # a rank lost while the save is in flight
        assert h.wait(120)  # failed in the background; nobody reads the handle
    out["close"] = _outcome(mgr.close)
    out["close_again"] = _outcome(mgr.close)
    out["steps"] = mgr.steps()
    return out


def _only_rank0_lists_body(rank, world, tmp):
    if rank == 1:
        time.sleep(12)  # never touches the manager (a close that waited for it would take > 10 s)
        return None
    t0 = time.monotonic()
    with distckpt.CheckpointManager(os.path.join(tmp, "root")) as mgr:
        mgr.steps()
    return time.monotonic() - t0


@pytest.mark.parametrize("blocking", [True, False], ids=["blocking", "async"])
def test_close_after_a_lost_peer_decides_alone(tmp_path, blocking):
    """A rank whose save met a lost peer (PeerLostError) closes its CheckpointManager at once and
    on its own: the group can decide nothing more, and a collective close would wait
    DISTCKPT_ARRIVAL_TIMEOUT_S for the dead rank, then raise RanksMissingError. An async save
    that failed so with nobody reading its handle is raised by that close (its own error, once),
    never left to a log line at exit as if the close had nothing to say."""
    from ..helpers.distributed import RankError
    try:
        run_ranks(_lost_peer_body, 2, str(tmp_path), blocking, timeout=240,
                  env={"DISTCKPT_ARRIVAL_TIMEOUT_S": "15", "DISTCKPT_TIMEOUT_S": "15"})
        raise AssertionError("rank 1 exited: run_ranks must report it")
    except RankError as exc:
        assert sorted(exc.errors) == [1], exc
        out = exc.results[0]
    if blocking:
        assert out["save"]["type"] in ("PeerLostError", "RanksMissingError"), out
        assert out["close"]["type"] is None and out["close"]["seconds"] < 10, out
    else:
        assert out["close"]["type"] in ("PeerLostError", "RanksMissingError"), out
        assert out["close"]["seconds"] < 10, out
    assert out["close_again"]["type"] is None and out["close_again"]["seconds"] < 10, out
    assert out["steps"] == [1], out


def test_a_manager_that_only_listed_closes_alone(tmp_path):
    """A CheckpointManager one rank of a job builds to list steps (no save or load) closes at
    once: its peers never call close(), and it has nothing to decide with them."""
    out = run_ranks(_only_rank0_lists_body, 2, str(tmp_path), timeout=240,
                    env={"DISTCKPT_ARRIVAL_TIMEOUT_S": "15"})
    assert out[0] < 10, out


def _no_thread_body(rank, world, tmp):
    import distckpt.save_async as sa
    real_start = threading.Thread.start

    def start(self):  # what RLIMIT_AS / RLIMIT_NPROC give a process that is out of room
        if self.name.startswith("distckpt-async-save") and rank == 1:
            raise RuntimeError("can't start new thread")
        return real_start(self)
    sd = {f"w{rank}": torch.full((1 << 16,), float(rank) + 0.5), "step": 3}
    threading.Thread.start = start
    try:
        t0 = time.monotonic()
        h = distckpt.async_save(sd, os.path.join(tmp, "a"))
    finally:
        threading.Thread.start = real_start
    res = h.result(timeout=60)
    took = time.monotonic() - t0
    pending = [x for x in list(sa._INFLIGHT) if not x.done()]
    distckpt.save(sd, os.path.join(tmp, "b"))  # the next save neither waits for it nor fails
    got = distckpt.read(os.path.join(tmp, "a"))
    return {"path": res.path, "pending": len(pending), "took": took,
            "exact": torch.equal(got[f"w{rank}"], sd[f"w{rank}"]) and got["step"] == 3}


def test_an_async_save_whose_thread_cannot_start_runs_in_the_caller_and_nothing_waits_for_it(tmp_path):
    """`threading.Thread.start` raising "can't start new thread" (a process out of address space
    or threads; an outside trial used RLIMIT_AS) left the handle in flight forever: the next save
    and the process's exit waited for it without end, and the other rank's background phases
    waited for this rank's until DISTCKPT_TIMEOUT_S. The save's phases now run in the caller's
    thread, paired with the other ranks: it commits, the next save and the exit go on."""
    results = run_ranks(_no_thread_body, 2, str(tmp_path), timeout=120, env={"DISTCKPT_TIMEOUT_S": "30"})
    for r in results:
        assert r["pending"] == 0 and r["exact"] and r["took"] < 25, results
