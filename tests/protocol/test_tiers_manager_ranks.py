"""TieredCheckpointManager on two real gloo ranks, each its own "node" (its own local directory),
with a directory as the remote tier: the collective paths that one process cannot reach (a
collective error carries every rank's failure). The object-store tiers: tests/s3/test_tiers_*.py."""

from __future__ import annotations

import logging
import os

import pytest
import torch

from ..helpers.distributed import run_ranks
from ..helpers.faults import mounts  # noqa: F401  (pytest fixture)


def _state(step: int, rank: int, n: int = 1 << 14) -> dict:
    g = torch.Generator().manual_seed(step * 100 + rank)
    return {f"w{rank}": torch.randn(n, generator=g), "step": step}


def _step_one_on_every_tier(rank: int, tmp: str, keep_last_local: int, replicas: int = 0) -> tuple[str, str]:
    """(this rank's node directory, the remote directory) once every rank saved step 1 there and it
    drained (collective: ends at a barrier)."""
    from distckpt.tiers import TieredCheckpointManager
    local, remote = os.path.join(tmp, f"node{rank}"), os.path.join(tmp, "remote")
    with TieredCheckpointManager(local, remote, keep_last_local=keep_last_local, replicas=replicas) as mgr:
        mgr.save(1, _state(1, rank))
        assert mgr.wait_durable(1, timeout=120).durable
        if replicas:
            assert mgr.status(1).replicas == "replicated"
    torch.distributed.barrier()
    return local, remote


def _damaged_local_body(rank: int, world_size: int, tmp: str, replicas: int, remote_step: bool) -> dict:
    import shutil

    from distckpt import errors
    from distckpt.tiers import TieredCheckpointManager
    local, remote = _step_one_on_every_tier(rank, tmp, keep_last_local=2, replicas=replicas)
    path = os.path.join(local, "step_00000001", "rank00001.bin")
    if rank == 1:  # one byte of node 1's own data file (a rank's failure, not rank 0's)
        with open(path, "r+b") as f:
            f.seek(100)
            b = f.read(1)
            f.seek(100)
            f.write(bytes([b[0] ^ 1]))
    if rank == 0 and not remote_step:
        shutil.rmtree(os.path.join(remote, "step_00000001"))
    torch.distributed.barrier()
    said: list[str] = []

    class Catch(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            said.append(record.getMessage())

    catch = Catch(level=logging.WARNING)
    logging.getLogger("distckpt").addHandler(catch)
    out = {f"w{rank}": torch.zeros(1 << 14), "step": -1}
    mgr = TieredCheckpointManager(local, remote, keep_last_local=2, replicas=replicas)
    try:
        try:
            result = mgr.load(out)
        except errors.ChecksumMismatchError as exc:
            return {"error": f"{type(exc).__name__}: {exc}"}
    finally:
        logging.getLogger("distckpt").removeHandler(catch)
        try:
            mgr.close()
        except errors.NotDurableError as exc:
            # With its remote copy gone, the step was queued to drain again at construction, and
            # the drain met the damaged file first (checked as read: failed, nothing uploaded).
            assert not remote_step and exc.steps == [1], exc
    again = good = None
    if rank == 1 and replicas:  # node 1's file now, and node 0's replica of it
        with open(path, "rb") as f:
            again = f.read()
        with open(os.path.join(tmp, "node0", "step_00000001", "rank00001.bin"), "rb") as f:
            good = f.read()
    return {"error": None, "exact": out["step"] == 1 and torch.equal(out[f"w{rank}"], _state(1, rank)[f"w{rank}"]),
            "local_bytes": result.bytes_by_tier["local"], "remote_bytes": result.bytes_by_tier["remote"],
            "from_peers": result.bytes_from_peers, "repaired": good is not None and again == good,
            "warned": [m for m in said if "are damaged" in m and "replicas" in m]}


@pytest.mark.parametrize("replicas, remote_step", [(0, True), (1, True), (1, False)],
                         ids=["remote-tier", "replica", "replica-only"])
def test_a_local_file_damaged_on_one_rank_is_loaded_from_a_replica_or_the_remote_tier_on_every_rank(
        tmp_path, replicas, remote_step):
    """A checksum error on rank 1 reaches every rank as a collective error whose ``failures`` is
    {rank: error}: the manager reads its errors to see that only a local file of node 1 is
    damaged, then loads the step again, bit-exact, with a warning naming it: that file from the
    node that holds a replica of it (verified on both ends, installed over the damaged file, so
    node 1's copy is whole again), else from the remote tier; every other file from its node's
    own copy as before. The whole step used to be read from the remote tier, and with no remote
    copy (replica-only: the remote step is gone) the load failed although node 0 held a verified
    replica."""
    results = run_ranks(_damaged_local_body, 2, str(tmp_path), replicas, remote_step, timeout=240)
    for rank, r in enumerate(results):
        assert r["error"] is None, (rank, r["error"])
        assert r["exact"] and any("rank00001.bin" in m for m in r["warned"]), (rank, r)
    assert results[0]["remote_bytes"] == 0 < results[0]["local_bytes"], results[0]
    if replicas:
        assert results[1]["remote_bytes"] == 0 < results[1]["from_peers"] and results[1]["repaired"], results[1]
    else:
        assert results[1]["local_bytes"] == 0 < results[1]["remote_bytes"], results[1]


def _flip(path: str, at: int = -20) -> bytes:
    """Flip one bit of ``path`` at byte ``at``; returns the bytes it held."""
    with open(path, "rb") as f:
        raw = f.read()
    bad = bytearray(raw)
    bad[at] ^= 1
    with open(path, "wb") as f:
        f.write(bytes(bad))
    return raw


def _other_copies_body(rank: int, world_size: int, tmp: str) -> dict:
    import shutil

    from distckpt.tiers import TieredCheckpointManager
    local, remote = os.path.join(tmp, f"node{rank}"), os.path.join(tmp, "remote")
    said: list[str] = []

    class Catch(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            said.append(record.getMessage())

    logging.getLogger("distckpt").addHandler(Catch(level=logging.WARNING))
    barrier = torch.distributed.barrier
    with TieredCheckpointManager(local, remote, keep_last_local=3) as mgr:
        for s in (1, 2, 3):
            mgr.save(s, _state(s, rank))
            assert mgr.wait_durable(s, timeout=120).durable
    out: dict = {}

    def load(keys: list[int]):
        from distckpt.errors import NotDurableError
        sd = {**{f"w{r}": torch.zeros(1 << 14) for r in keys}, "step": -1}
        mgr = TieredCheckpointManager(local, remote, keep_last_local=3)
        result = mgr.load(sd)
        closed = None
        try:
            mgr.close()
        except NotDurableError as exc:  # the drain the manager starts met the damaged remote copy
            closed = exc.steps
        exact = all(torch.equal(sd[f"w{r}"], _state(3, r)[f"w{r}"]) for r in keys)
        return {"step": sd["step"], "exact": exact, "tiers": result.bytes_by_tier,
                "unchecked": result.remote_unchecked, "not_durable": closed}

    def load_damaged(manifest: str, by: int) -> dict:
        """load([rank]) while rank ``by`` has one bit of ``manifest`` flipped, then mended."""
        kept = _flip(manifest) if rank == by else None
        barrier()
        got = load([rank])
        barrier()
        if kept is not None:
            with open(manifest, "wb") as f:
                f.write(kept)
        return got

    # 1. Node 1's MANIFEST of step 3 damaged: passed over, its rank reads the step remotely.
    out["local_damaged"] = load_damaged(os.path.join(tmp, "node1", "step_00000003", "MANIFEST"), 1)
    # 2. The remote MANIFEST damaged: the nodes' complete copies load, said unchecked.
    out["remote_damaged"] = load_damaged(os.path.join(remote, "step_00000003", "MANIFEST"), 0)
    # 3. Node 1 holds another save of step 3 (a stale disk), and rank 1 wants rank 0's file too:
    # no fetch into the stale copy (TierIncompleteError, then an older step before), the remote's.
    with TieredCheckpointManager(local + "_b", os.path.join(tmp, "remote_b"), keep_last_local=3) as mgr:
        mgr.save(3, _state(33, rank))
        assert mgr.wait_durable(3, timeout=120).durable
    barrier()
    if rank == 1:
        shutil.rmtree(os.path.join(local, "step_00000003"))
        shutil.copytree(os.path.join(local + "_b", "step_00000003"), os.path.join(local, "step_00000003"))
    barrier()
    out["stale_node"] = load([0, 1] if rank == 1 else [0])
    # 4. Ranks placed on each other's node at a restart: an undrained step's replicas come from
    # the node that holds each file (status "replicated" said so before, with nothing sent).
    # Step 5 is kept off `remote` by saving it through a manager that drains elsewhere: each
    # switch of the remote tier is on purpose (TierMismatchError's remedy: the record removed).
    record = os.path.join(local, ".distckpt-tier-remote")
    os.remove(record)
    with TieredCheckpointManager(local, os.path.join(tmp, "remote_c"), keep_last_local=3) as mgr:
        mgr.save(5, _state(5, rank))
        assert mgr.wait_durable(5, timeout=120).durable
    os.remove(record)
    barrier()
    swapped = os.path.join(tmp, f"node{1 - rank}")
    with TieredCheckpointManager(swapped, remote, keep_last_local=3, replicas=1) as mgr:
        assert mgr.wait_durable(5, timeout=120).durable
        status = mgr.status(5)
    out["swapped"] = {"replicas": status.replicas, "files": sorted(os.listdir(os.path.join(swapped, "step_00000005")))}
    out["said"] = said
    return out


def test_copies_a_load_or_replication_cannot_use_are_passed_over_by_name(tmp_path):
    """A step with one tier's MANIFEST damaged loads from the other tier (the damaged copy counts
    as absent, as in step_availability); a node that holds another save of the step gets no
    peer fetch (it would be refused there, and load() fell back to an older step) and reads the
    remote tier; replicas of files held off their writer's node are sent from where they are."""
    results = run_ranks(_other_copies_body, 2, str(tmp_path), timeout=300)
    for rank, r in enumerate(results):
        for case in ("local_damaged", "remote_damaged", "stale_node"):
            assert r[case]["step"] == 3 and r[case]["exact"], (rank, case, r[case])
        assert r["remote_damaged"]["tiers"]["remote"] == 0 and "does not decode" in r["remote_damaged"]["unchecked"]
        # nothing replaces a remote copy it cannot read: the drain of step 3 fails, by name
        assert r["remote_damaged"]["not_durable"] == [3] and r["local_damaged"]["not_durable"] is None
        assert r["local_damaged"]["unchecked"] is None and r["stale_node"]["unchecked"] is None
        assert r["swapped"] == {"replicas": "replicated",
                                "files": ["MANIFEST", "rank00000.bin", "rank00001.bin"]}, (rank, r["swapped"])
    assert results[1]["local_damaged"]["tiers"]["local"] == 0 < results[1]["local_damaged"]["tiers"]["remote"]
    assert results[1]["stale_node"]["tiers"]["local"] == 0 < results[1]["stale_node"]["tiers"]["remote"]
    assert any("is passed over, its MANIFEST does not decode" in m for m in results[1]["said"])
    assert any("the remote tier's copy of step_00000003 is passed over" in m for m in results[0]["said"])


def _damaged_beside_a_fetch_body(rank: int, world_size: int, tmp: str) -> dict:
    from distckpt.tiers import TieredCheckpointManager
    local, remote = _step_one_on_every_tier(rank, tmp, keep_last_local=3)
    if rank == 0:
        _flip(os.path.join(local, "step_00000001", "MANIFEST"))
    torch.distributed.barrier()
    keys = [1, 2] if rank == 1 else [rank]  # node 1 fetches rank 2's file from node 2
    sd = {**{f"w{r}": torch.zeros(1 << 14) for r in keys}, "step": -1}
    with TieredCheckpointManager(local, remote, keep_last_local=3) as mgr:
        result = mgr.load(sd)
    return {"exact": sd["step"] == 1 and all(torch.equal(sd[f"w{r}"], _state(1, r)[f"w{r}"]) for r in keys),
            "tiers": result.bytes_by_tier, "peers": result.bytes_from_peers}


def test_a_damaged_copy_is_passed_over_while_another_node_fetches_from_its_peers(tmp_path):
    """Three nodes: node 0's MANIFEST of the step does not decode, node 1 fetches a file from node
    2. Every node's copy is surveyed again after the transfers, and node 0's failed there (the
    first survey had passed it over): ManifestCorruptError on every rank. Now only a node that
    gained files is surveyed again; node 0 reads the remote tier."""
    results = run_ranks(_damaged_beside_a_fetch_body, 3, str(tmp_path), timeout=300)
    assert all(r["exact"] for r in results), results
    assert results[0]["tiers"]["local"] == 0 < results[0]["tiers"]["remote"]
    assert results[1]["peers"] > 0 and results[1]["tiers"]["remote"] == 0


def _lost_peer_then_go_on_body(rank: int, world_size: int, tmp: str, where: str) -> dict:
    """Rank 1 stalls once past the bound of the channel named by ``where`` ("save": the local
    save's write, past DISTCKPT_TIMEOUT_S; "drain": step 1's drain, past
    DISTCKPT_DRAIN_TIMEOUT_S); the same manager then saves again and must go on working."""
    import time

    import distckpt.storage.posix.saving as saving
    import distckpt.tiers.drain as drain
    from distckpt import errors
    from distckpt.tiers import TieredCheckpointManager
    local, remote = os.path.join(tmp, f"node{rank}"), os.path.join(tmp, "remote")
    module, name = (saving, "write_rank_file") if where == "save" else (drain, "_copy_file")
    real = getattr(module, name)
    if rank == 1:
        def stuck(*a, **k):
            setattr(module, name, real)  # once
            time.sleep(10)  # past the channel's bound: the other rank gives up, gloo closes the group
            return real(*a, **k)
        setattr(module, name, stuck)
    out: dict = {}
    mgr = TieredCheckpointManager(local, remote, keep_last_local=2)
    try:
        mgr.save(1, _state(1, rank))
        if where == "save":
            out["first"] = "saved"
    except errors.PeerLostError as exc:
        out["first"] = type(exc).__name__
    if where == "drain":
        try:
            mgr.wait_durable(1, timeout=60)
            out["first"] = "durable"
        except errors.NotDurableError as exc:
            out["first"] = f"{type(exc).__name__}: {type(exc.cause).__name__}"
    mgr.save(2, _state(2, rank))  # the same manager: a new control group, a new drain channel
    out["durable"] = [s for s in (1, 2) if mgr.wait_durable(s, timeout=120).durable] if where == "drain" else \
        [s for s in (2,) if mgr.wait_durable(s, timeout=120).durable]
    sd = {f"w{rank}": torch.zeros(1 << 14), "step": -1}
    mgr.load(sd)
    out["exact"] = sd["step"] == 2 and torch.equal(sd[f"w{rank}"], _state(2, rank)[f"w{rank}"])
    mgr.close()
    out["remote"] = sorted(os.listdir(remote))
    return out


@pytest.mark.slow  # a peer stalled past the collective timeout, then the job goes on
def test_after_a_peer_stalled_in_a_save_the_same_manager_saves_loads_and_drains_again(tmp_path):
    """One rank stalled past DISTCKPT_TIMEOUT_S in a local save: that save fails on both ranks,
    and gloo closes the control group's connections. The manager kept that group: every later
    save, load and listing of the run failed at once ("pair closure") although both ranks were
    back. Now each collective call takes the control group anew, and the arrival check rebuilds
    a lost one on every rank together."""
    results = run_ranks(_lost_peer_then_go_on_body, 2, str(tmp_path), "save", timeout=240,
                        env={"DISTCKPT_TIMEOUT_S": "4"})
    for rank, r in enumerate(results):
        assert r["first"] == "PeerLostError" and r["durable"] == [2] and r["exact"], (rank, r)
        assert "step_00000002" in r["remote"] and "step_00000001" not in r["remote"], (rank, r)


@pytest.mark.slow  # a peer stalled past the collective timeout, then the job goes on
def test_after_a_peer_stalled_in_a_drain_the_next_save_restarts_the_drain_and_drains_what_it_left(tmp_path):
    """One rank's drain stalled past DISTCKPT_DRAIN_TIMEOUT_S: the drain threads of both ranks
    stop (a lost peer on the drain's channel), step 1 is not durable. Every later step then
    stayed on the local tier only, never drained (and never rotated away locally: the disk
    filled) until the job restarted. Now the next save, once every rank's drain thread has
    stopped, builds a new drain channel and thread on every rank, queues the steps the old one
    left (step 1) before the new one, and both reach the remote tier."""
    results = run_ranks(_lost_peer_then_go_on_body, 2, str(tmp_path), "drain", timeout=240,
                        env={"DISTCKPT_DRAIN_TIMEOUT_S": "4"})
    for rank, r in enumerate(results):
        assert r["first"] == "NotDurableError: PeerLostError", (rank, r)
        assert r["durable"] == [1, 2] and r["exact"], (rank, r)
        assert {"step_00000001", "step_00000002"} <= set(r["remote"]), (rank, r)


def _left_in_a_collective_body(rank: int, world_size: int, tmp: str, where: str) -> dict:
    import atexit
    import time

    from distckpt.errors import NotDurableError
    from distckpt.tiers import TieredCheckpointManager, drain, drainer, peers
    finalizing = os.path.join(tmp, "rank0-finalizing")
    if rank == 0:
        # Registered before distckpt's exit hooks (the manager registers them), so it runs after
        # them, as the last thing before the interpreter finalizes: rank 1 exits then.
        atexit.register(lambda: open(finalizing, "w").close())
    drainer._CLOSE_GRACE_S = 0.5
    if rank == 1 and where == "upload":  # its upload held by the remote tier, unanswered: rank 0 waits at the drain's gather
        drain._copy_file = lambda *args, **kwargs: time.sleep(600)
    if rank == 1 and where == "replica":  # its read for the replica held: rank 0 waits for the piece
        peers.stream_verified = lambda *args, **kwargs: time.sleep(600)
    local, remote = os.path.join(tmp, f"node{rank}"), os.path.join(tmp, "remote")
    mgr = TieredCheckpointManager(local, remote, replicas=1 if where == "replica" else 0)
    mgr.save(1, _state(1, rank))
    try:
        mgr.close(timeout=0.5)
        not_durable = None
    except NotDurableError as exc:
        not_durable = exc.steps
    if rank == 1:
        def exit_while_rank0_finalizes() -> None:  # registered last: the first exit hook to run
            deadline = time.monotonic() + 60
            while not os.path.exists(finalizing) and time.monotonic() < deadline:
                time.sleep(0.001)
            os._exit(0)  # its connections close now, ending rank 0's collective in its finalization
        atexit.register(exit_while_rank0_finalizes)
    return {"not_durable": not_durable, "left_behind": mgr._drainer.alive}


@pytest.mark.parametrize("where", ["upload", "replica"])
def test_a_drain_thread_left_inside_a_collective_does_not_abort_the_exit(tmp_path, where):
    """close() leaves a drain thread inside a collective (its peer's upload is held, or its
    peer's read of the file it sends this node for a replica); when the peer exits while this
    process finalizes, the collective ends then. Such a thread used to be ended inside torch's C++
    (pthread_exit through pybind11's ~gil_scoped_release): "terminate called without an active
    exception", SIGABRT, a job that had succeeded exiting -6 (for the replica, a point-to-point
    receive, which gloo completes only inside a blocking wait). Both ranks now exit 0 (run_ranks
    checks exit codes), and close still names the step not durable."""
    results = run_ranks(_left_in_a_collective_body, 2, str(tmp_path), where, timeout=120, check_exit=True)
    assert results == [{"not_durable": [1], "left_behind": True}] * 2, results


def _step_for_transfers(rank: int, world_size: int, tmp: str, n: int):
    """Step 1 saved by a tiered manager (node r's local tier ``tmp/node{r}``, ``n`` float32 per
    rank), drained, and its replica transfers planned (one copy on every other node): (group,
    store, local root, step path, decoded MANIFEST, its bytes, transfers)."""
    from distckpt import manifest as mf
    from distckpt._dist import control_group
    from distckpt.storage import open_store
    from distckpt.tiers import TieredCheckpointManager
    from distckpt.tiers.load import _local_copy
    from distckpt.tiers.nodes import node_layout
    from distckpt.tiers.peers import replica_transfers
    local, remote = os.path.join(tmp, f"node{rank}"), os.path.join(tmp, "remote")
    with TieredCheckpointManager(local, remote) as mgr:
        mgr.save(1, _state(1, rank, n=n))
        assert mgr.wait_durable(1, timeout=120).durable
    group = control_group()
    layout, store = node_layout(group, local), open_store(local)
    path = os.path.join(local, "step_00000001")
    copy, data = _local_copy(store, path)
    header = mf.decode_header(data, path=path)
    transfers = replica_transfers(layout, header, group.all_gather(copy.files), world_size - 1)
    return group, layout, store, local, path, header, data, transfers


def _timed_transfers(expected: type, group, layout, store, path, header, data, transfers) -> tuple[str | None, float]:
    """run_transfers of ``transfers``: (None, or "Class failures=[ranks]" for an ``expected``
    error, or "Class: message" for another; its seconds)."""
    import time

    from distckpt.tiers.peers import run_transfers
    t0 = time.monotonic()
    try:
        run_transfers(group, transfers, layout=layout, store=store, step_path=path, header=header, manifest=data)
        error = None
    except expected as exc:
        error = f"{type(exc).__name__} failures={sorted(getattr(exc, 'failures', {}) or {})}"
    except Exception as exc:  # noqa: BLE001 - reported
        error = f"{type(exc).__name__}: {exc}"
    return error, time.monotonic() - t0


def _failed_at_once_installing_nothing(results: list, error: str) -> None:
    """Every rank raised ``error`` (as _timed_transfers words it) well before the group's
    deadline (60 s), with nothing installed and no receiving area left behind."""
    for rank, r in enumerate(results):
        assert r["error"] == error, (rank, r)
        assert r["seconds"] < 30, (rank, r)
        assert r["files"] == ["MANIFEST", f"rank{rank:05d}.bin"], (rank, r)
        assert not [n for n in r["left"] if ".tmp-" in n or ".peer-" in n], (rank, r)


def _receiver_disk_full_body(rank: int, world_size: int, tmp: str) -> dict:
    from distckpt.errors import DiskFullError
    group, layout, store, local, path, header, data, transfers = _step_for_transfers(rank, world_size, tmp, 1 << 23)
    if rank == 1:  # node 1's disk fills after the save (32 MiB per rank): room for 1 MiB of the 32 it is sent
        with open(os.path.join(local, "filler"), "wb") as f:
            f.write(b"\0" * (os.statvfs(local).f_bavail * os.statvfs(local).f_frsize - (1 << 20)))
    error, seconds = _timed_transfers(DiskFullError, group, layout, store, path, header, data, transfers)
    return {"error": error, "seconds": seconds, "left": sorted(os.listdir(local)),
            "files": sorted(os.listdir(path))}


@pytest.mark.parametrize("world", [2, 3])
def test_a_receiver_whose_disk_fills_mid_file_fails_the_transfer_typed_at_once(tmp_path, mounts, world):
    """A replica's receiver whose disk fills mid-file (a real ENOSPC: node 1's local tier is a small
    tmpfs) used to leave the round at its failed write, while its sender waited for that rank to
    take the next piece: PeerLostError on every rank after the group's deadline, and the group
    lost. The failed rank now goes on to the last round (with 3 nodes and 2 replicas, two rounds:
    it still sends its own file, so no other rank's copy fails its check) and every rank raises
    that DiskFullError alone at once; nothing is installed, no receiving area is left behind."""
    mounts.tmpfs(tmp_path / "node1", size="104m")
    results = run_ranks(_receiver_disk_full_body, world, str(tmp_path), timeout=240,
                        env={"DISTCKPT_TIMEOUT_S": "60"})
    _failed_at_once_installing_nothing(results, "DiskFullError failures=[1]")


def _damaged_sender_with_a_full_disk_body(rank: int, world_size: int, tmp: str) -> dict:
    from distckpt.tiers.peers import run_transfers
    group, layout, store, local, path, header, data, transfers = _step_for_transfers(rank, world_size, tmp, 1 << 20)
    if rank == 1:
        with open(os.path.join(path, "rank00001.bin"), "r+b") as f:  # one byte of its own copy rots
            f.seek(1000)
            b = f.read(1)
            f.seek(1000)
            f.write(bytes([b[0] ^ 1]))
        os.mkdir(os.path.join(local, "inodes"))
        try:  # and its file system has no inode left: its receiving area cannot be made (ENOSPC)
            for i in range(100000):
                open(os.path.join(local, "inodes", str(i)), "w").close()
        except OSError:
            pass
    try:
        run_transfers(group, transfers, layout=layout, store=store, step_path=path, header=header, manifest=data)
        return {"error": None}
    except Exception as exc:  # noqa: BLE001 - reported
        return {"error": type(exc).__name__, "failures": {r: type(e).__name__ for r, e in exc.failures.items()}}


def test_a_damaged_sender_whose_disk_is_full_is_reported_by_its_receiver(tmp_path, mounts):
    """Rank 1's own copy has a damaged byte and its disk has no inode left. Its first error is its
    receiving area's (DiskFullError), and its read of the damaged file fails after (zeros are
    sent). Its receiver's failed check of those zeros was dropped as "the sender's error
    reported already" although the sender reported only its full disk: nothing named the damaged
    copy. The receiver's ChecksumMismatchError is kept unless the read's error is the one the
    sender reports."""
    mounts.tmpfs(tmp_path / "node1", size="64m", options=["nr_inodes=400"])
    results = run_ranks(_damaged_sender_with_a_full_disk_body, 2, str(tmp_path), timeout=240,
                        env={"DISTCKPT_TIMEOUT_S": "60"})
    for r in results:
        assert r == {"error": "RankFailureError",
                     "failures": {0: "ChecksumMismatchError", 1: "DiskFullError"}}, results


def _sender_out_of_memory_body(rank: int, world_size: int, tmp: str, where: str) -> dict:
    import resource

    from distckpt.errors import HostMemoryError
    # 32 MiB per rank: four pieces, 8 MiB buffers
    group, layout, store, local, path, header, data, transfers = _step_for_transfers(rank, world_size, tmp, 1 << 23)
    limit = resource.getrlimit(resource.RLIMIT_AS)
    held_back: list = []
    if rank == 1:  # a real out-of-memory: 1 MiB of address space left (the transfer's buffers are 8 MiB)
        with open("/proc/self/statm") as f:
            size = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
        resource.setrlimit(resource.RLIMIT_AS, (size + (1 << 20), limit[1]))
        if where == "buffers":
            # glibc serves an 8 MiB request from heap space that earlier allocations left mapped
            # when it can: take every such space first, so that the buffers need new memory.
            while True:
                try:
                    held_back.append(bytearray(8 << 20))
                except MemoryError:
                    break
    try:
        error, seconds = _timed_transfers(HostMemoryError, group, layout, store, path, header, data, transfers)
    finally:
        resource.setrlimit(resource.RLIMIT_AS, limit)
        held_back.clear()
    group.all_gather(rank)  # the group still works: no rank left inside an exchange
    return {"error": error, "seconds": seconds, "left": sorted(os.listdir(local)), "files": sorted(os.listdir(path))}


@pytest.mark.parametrize("where", ["buffers", "pieces"])
def test_a_rank_out_of_memory_in_a_peer_transfer_fails_every_rank_typed_at_once(tmp_path, where):
    """A rank out of memory in a peer transfer (a real RLIMIT_AS: 1 MiB of address space left).
    ``buffers``: its transfer buffers could not be made, which happened inside the round, before
    its first exchange, while its partner waited in that exchange: PeerLostError after the group's
    deadline, and the group lost. The buffers are now made before the first round and the
    outcome exchanged. ``pieces``: glibc serves the buffers from freed heap space and its reader
    fails instead: a bare MemoryError, beside its receiver's ChecksumMismatchError for the zeros
    it was sent (a RankFailureError naming two faults). The reader's error is typed now, and a
    receiver's failed check of zeros is reported as its sender's error alone. Either way every
    rank raises rank 1's HostMemoryError at once, and the group goes on."""
    results = run_ranks(_sender_out_of_memory_body, 2, str(tmp_path), where, timeout=240,
                        env={"DISTCKPT_TIMEOUT_S": "60"})
    _failed_at_once_installing_nothing(results, "HostMemoryError failures=[1]")


def _replicas_while_the_remote_is_down_body(rank: int, world_size: int, tmp: str) -> dict:
    import subprocess
    import time

    from distckpt.tiers import TieredCheckpointManager
    local, remote = os.path.join(tmp, f"node{rank}"), os.path.join(tmp, "remote")
    mgr = TieredCheckpointManager(local, remote, replicas=1)
    torch.distributed.barrier()
    if rank == 0:  # the remote tier goes read-only: every drain fails and retries (EROFS)
        subprocess.run(["mount", "--bind", remote, remote], check=True, capture_output=True, timeout=60)
        subprocess.run(["mount", "-o", "remount,bind,ro", remote], check=True, capture_output=True, timeout=60)
    torch.distributed.barrier()
    try:
        for step in (1, 2, 3):
            mgr.save(step, _state(step, rank))
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline and mgr.status(3).replicas != "replicated":
            time.sleep(0.2)
        seen = {s: (mgr.status(s).remote, mgr.status(s).replicas) for s in (1, 2, 3)}
        held = sorted(os.listdir(os.path.join(local, "step_00000003")))
        torch.distributed.barrier()
    finally:
        if rank == 0:
            subprocess.run(["umount", "-l", remote], capture_output=True, timeout=60)
    torch.distributed.barrier()
    durable = mgr.wait_durable(3, timeout=120).durable
    mgr.close()
    # A new manager never queued these drained steps: what their replicas are is not known to
    # it ("pending" before, which nothing would ever settle).
    with TieredCheckpointManager(local, remote, replicas=1) as again:
        later = again.status(3).replicas
    return {"seen": seen, "held": held, "durable": durable, "later": later}


def test_replicas_are_made_while_the_remote_tier_is_down(tmp_path):
    """Each step was replicated right before its drain, on the drain thread: with the remote tier
    down, the first step's drain retried and no later step got a replica, so a node lost during
    the outage (when the replicas are all there is) restored from the step before it, several
    steps back. The replicas of the steps queued behind now are made at each retry's vote: with
    the remote tier read-only, step 3 is replicated on both nodes while step 1 still retries, and
    every step drains once it is writable again."""
    results = run_ranks(_replicas_while_the_remote_is_down_body, 2, str(tmp_path), timeout=300)
    for rank, r in enumerate(results):
        assert r["seen"][3][1] == "replicated" and r["seen"][2][1] == "replicated", (rank, r)
        assert r["seen"][1][0] in ("retrying", "draining"), (rank, r)  # the outage was still on
        assert r["held"] == ["MANIFEST", "rank00000.bin", "rank00001.bin"], (rank, r)
        assert r["durable"] and r["later"] == "unknown", (rank, r)


def _partial_step_body(rank: int, world_size: int, tmp: str, lost_node: bool) -> dict:
    """Steps 1 and 2 durable, then a step 3 that no load takes: node 0's copy alone. Without
    ``lost_node``: a save killed after node 0 published step 3 and before node 1 did. With it:
    step 3 committed on both nodes and node 1 lost before it drained (node 0's copy, its own
    rank's file and the MANIFEST, is all there is of it), the job resumed on node 0 alone. Then
    the resumed run loads (step 3 passed over), saves step 3 and loads it again."""
    import shutil

    from distckpt.tiers import TieredCheckpointManager
    local, remote = os.path.join(tmp, f"node{rank}"), os.path.join(tmp, "remote")
    with TieredCheckpointManager(local, remote, keep_last_local=3) as mgr:
        for step in (1, 2):
            mgr.save(step, _state(step, rank))
        mgr.wait_durable(2, timeout=120)
    torch.distributed.barrier()
    if rank == 0:
        shutil.copytree(os.path.join(local, "step_00000002"), os.path.join(local, "step_00000003"))
        if lost_node:
            shutil.rmtree(os.path.join(tmp, "node1"))
    torch.distributed.barrier()
    if lost_node:
        local = os.path.join(tmp, "node0")  # both ranks on the surviving node
    out = {}
    with TieredCheckpointManager(local, remote, keep_last_local=3) as mgr:
        target = _state(0, rank)
        result = mgr.load(target)
        out["loaded"] = os.path.basename(result.path)   # step 3 is passed over, and said so
        out["passed"] = sorted(result.passed_over)
        mgr.save(3, _state(3, rank))                               # the resumed run's next save
        mgr.wait_durable(3, timeout=120)
        target = _state(0, rank)
        result = mgr.load(target)
        out["again"], out["passed_again"] = os.path.basename(result.path), sorted(result.passed_over)
        out["exact"] = all(torch.equal(target[k], v) for k, v in _state(3, rank).items() if torch.is_tensor(v))
    return out


def test_a_step_some_nodes_published_before_a_kill_is_replaced_by_the_resumed_runs_save(tmp_path):
    """A save killed between the nodes' local publishes leaves a copy of the step on some nodes
    only: load() passes it over (no complete copy) and resumes from the step before, but the
    resumed run's save of that step raised CheckpointExistsError on the nodes holding a copy (an
    outside trial), stopping a loop that saves the step after the one it loaded. The save
    replaces such a copy now, decided with every node, and the step loads bit-exact."""
    results = run_ranks(_partial_step_body, 2, str(tmp_path), False, timeout=300)
    for rank, r in enumerate(results):
        assert r == {"loaded": "step_00000002", "passed": [3], "again": "step_00000003", "passed_again": [],
                     "exact": True}, (rank, r)


def test_a_step_a_lost_node_held_half_of_is_replaced_by_the_resumed_runs_save(tmp_path):
    """A step committed on every node and not yet drained, then a node lost: the job resumed on
    the survivors, whose copies are all of one save but lack the lost node's files. load() passed
    it over and resumed from the step before, but the save of that step raised
    CheckpointExistsError (the copies agreed on one save, so the step counted as present; an
    outside trial). The save replaces it now, and the step loads bit-exact."""
    results = run_ranks(_partial_step_body, 2, str(tmp_path), True, timeout=300)
    for rank, r in enumerate(results):
        assert r == {"loaded": "step_00000002", "passed": [3], "again": "step_00000003", "passed_again": [],
                     "exact": True}, (rank, r)


def _damaged_manifest_no_remote_body(rank: int, world_size: int, tmp: str) -> dict:
    import shutil

    from distckpt import errors
    from distckpt.tiers import TieredCheckpointManager
    local, remote = os.path.join(tmp, f"node{rank}"), os.path.join(tmp, "remote")
    with TieredCheckpointManager(local, remote, keep_last_local=3, replicas=1) as mgr:
        mgr.save(1, _state(1, rank))
        assert mgr.wait_durable(1, timeout=120).durable
    torch.distributed.barrier()
    if rank == 0:  # only the nodes hold step 1 now; node 1's MANIFEST of it does not decode
        shutil.rmtree(os.path.join(remote, "step_00000001"))
    if rank == 1:
        _flip(os.path.join(local, "step_00000001", "MANIFEST"))
    torch.distributed.barrier()
    sd = {f"w{rank}": torch.zeros(1 << 14), "step": -1}
    mgr = TieredCheckpointManager(local, remote, keep_last_local=3, replicas=1)
    try:
        mgr.load(sd, step=1)
        out = {"error": None}
    except errors.TierIncompleteError as exc:
        out = {"error": str(exc), "remedy": exc.remedy}
    finally:
        try:
            mgr.close(timeout=30)
        except errors.NotDurableError:
            pass   # its drain meets the damaged copy too
    return out


def test_a_node_copy_whose_manifest_is_damaged_names_it_and_the_peers_holding_its_files(tmp_path):
    """A step only the nodes hold, node 1's MANIFEST damaged, node 0 holding a verified replica of
    node 1's file: load(step=) said node 1's directory "does not hold rank00001.bin" (it does;
    only the MANIFEST is damaged) and nothing about the replica (an outside trial). It names the
    damaged copy, the nodes that hold the files, and the way out: move the copy aside, and the
    node fetches the files from its peers."""
    results = run_ranks(_damaged_manifest_no_remote_body, 2, str(tmp_path), timeout=300)
    damaged = str(tmp_path / "node1" / "step_00000001")
    msg, remedy = results[1]["error"], results[1]["remedy"]
    assert msg is not None and "cannot be used (its MANIFEST does not decode" in msg and damaged in msg, results
    assert "the nodes of ranks [0] hold verified copies" in msg and f"Move {damaged} aside" in remedy, results


def _one_step_body(rank: int, world_size: int, tmp: str) -> None:
    _step_one_on_every_tier(rank, tmp, 2)


def test_verify_of_a_nodes_copy_checks_its_files_and_names_the_others_not_damage(tmp_path, capsys):
    """An outside trial: `distckpt verify` of a healthy node's copy of a tiered step said DAMAGED
    (exit 1), every other node's data file "missing (listed in MANIFEST)": by design a node holds
    its own ranks' files. verify knows a tiered local root by its pairing record now: the files
    present are checked, the absent ones listed as held by other nodes (NOT HERE), exit 0; damage
    in a file present is still DAMAGED, and a missing file of a plain checkpoint still a problem."""
    import shutil

    from distckpt.cli import main as cli
    from distckpt.verify import verify
    run_ranks(_one_step_body, 2, str(tmp_path), timeout=240)
    node0 = tmp_path / "node0" / "step_00000001"
    present = sorted(n for n in os.listdir(node0) if n.endswith(".bin"))
    assert present and len(present) < 2, present   # this layout: each node holds its own rank's file
    capsys.readouterr()
    assert cli(["verify", str(node0)]) == 0
    out = capsys.readouterr().out
    assert "NOT HERE" in out and "rank00001.bin" in out and "OK, every checksum of this node's 1" in out, out
    assert cli(["verify", str(tmp_path / "remote" / "step_00000001")]) == 0   # the whole step
    assert "NOT HERE" not in capsys.readouterr().out
    # a file present and damaged is damage, as ever
    _flip(str(node0 / present[0]))
    assert cli(["verify", str(node0)]) == 1
    assert "DAMAGED" in capsys.readouterr().out
    # outside a tiered local root, a missing data file is a problem
    plain = tmp_path / "plain"
    shutil.copytree(tmp_path / "remote" / "step_00000001", plain)
    os.unlink(plain / "rank00001.bin")
    report = verify(str(plain))
    assert not report.ok and report.not_here == [] and "missing" in str(report.file_problems[0]), report


def _replaced_node_body(rank: int, world_size: int, tmp: str) -> dict:
    import shutil

    from distckpt.tiers import TieredCheckpointManager
    local, remote = _step_one_on_every_tier(rank, tmp, keep_last_local=2, replicas=1)
    step_dir = os.path.join(local, "step_00000001")
    before = sorted(os.listdir(step_dir))
    if rank == 1:  # node 1 replaced: its local disk is empty
        shutil.rmtree(local)
    torch.distributed.barrier()
    out = {f"w{rank}": torch.zeros(1 << 14), "step": -1}
    with TieredCheckpointManager(local, remote, keep_last_local=2, replicas=1) as mgr:
        result = mgr.load(out)
        replicas = mgr.status(1).replicas
    torch.distributed.barrier()
    return {"exact": out["step"] == 1 and torch.equal(out[f"w{rank}"], _state(1, rank)[f"w{rank}"]),
            "from_peers": result.bytes_from_peers, "remote_bytes": result.bytes_by_tier["remote"],
            "before": before, "after": sorted(os.listdir(step_dir)), "replicas": replicas}


def test_a_load_onto_a_replaced_node_gives_the_step_its_replicas_again(tmp_path):
    """Two nodes, replicas=1: each holds both data files of step 1. Node 1 is replaced (its local
    tier empty). The load fetched what node 1's rank reads from node 0 (verified), but node 0's
    file had then no replica left until the step was rotated away: a second node loss in that
    window had only the remote tier. After the load the step has its replicas again: node 1
    holds both files, and status says replicated."""
    results = run_ranks(_replaced_node_body, 2, str(tmp_path), timeout=240)
    for rank, r in enumerate(results):
        assert r["exact"] and r["before"] == ["MANIFEST", "rank00000.bin", "rank00001.bin"], (rank, r)
        assert r["after"] == r["before"] and r["replicas"] == "replicated", (rank, r)
    assert results[1]["from_peers"] > 0 and results[1]["remote_bytes"] == 0, results[1]
    for name in ("rank00000.bin", "rank00001.bin"):
        a, b = (open(tmp_path / f"node{n}" / "step_00000001" / name, "rb").read() for n in (0, 1))
        assert a == b, name


def _destroyed_group_body(rank: int, world_size: int, tmp: str) -> dict:
    import time

    import torch.distributed as dist

    from distckpt.tiers import TieredCheckpointManager, manager
    real = manager.drain_step

    def later(*args, **kwargs):   # the drain runs once the job has destroyed its group
        time.sleep(1.0)
        return real(*args, **kwargs)
    manager.drain_step = later
    local, remote = os.path.join(tmp, f"node{rank}"), os.path.join(tmp, "remote")
    mgr = TieredCheckpointManager(local, remote)
    mgr.save(1, _state(1, rank))
    dist.destroy_process_group()   # without close(): the drain is still queued
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and mgr._drainer.state(1).state in ("queued", "draining"):
        time.sleep(0.05)
    st = mgr._drainer.state(1)
    return {"state": st.state, "error": type(st.error).__name__, "alive": mgr._drainer.alive,
            "remedy": getattr(st.error, "remedy", "")}


def test_a_drain_after_the_job_destroyed_its_group_fails_as_a_destroyed_group(tmp_path):
    """A job that calls destroy_process_group() with the manager open (no close()): the queued
    drain's collectives failed with torch's own ValueError ("Group ... is not registered"), logged
    as a failure for good that said nothing of the cause (an outside trial). It is now
    ProcessGroupDestroyedError (as an async save in flight gets), its remedy close() first, and
    the drain thread stops; the step stays committed locally."""
    results = run_ranks(_destroyed_group_body, 2, str(tmp_path), timeout=180)
    for rank, r in enumerate(results):
        assert r["state"] == "failed" and r["error"] == "ProcessGroupDestroyedError", (rank, r)
        assert not r["alive"] and "close()" in r["remedy"], (rank, r)
        assert os.path.exists(tmp_path / f"node{rank}" / "step_00000001" / "MANIFEST")


def _step_path_not_a_directory_body(rank: int, world_size: int, tmp: str, what: str) -> dict:
    import shutil

    from distckpt.tiers import TieredCheckpointManager
    local, remote = _step_one_on_every_tier(rank, tmp, keep_last_local=2, replicas=1)
    if rank == 1:   # node 1's step directory replaced by a regular file, or emptied
        shutil.rmtree(os.path.join(local, "step_00000001"))
        if what == "file":
            with open(os.path.join(local, "step_00000001"), "w") as f:
                f.write("not a directory")
        else:
            os.mkdir(os.path.join(local, "step_00000001"))
    torch.distributed.barrier()
    out = {f"w{rank}": torch.zeros(1 << 14), "step": -1}
    with TieredCheckpointManager(local, remote, keep_last_local=2, replicas=1) as mgr:
        result = mgr.load(out)
    return {"exact": out["step"] == 1 and torch.equal(out[f"w{rank}"], _state(1, rank)[f"w{rank}"]),
            "remote_bytes": result.bytes_by_tier["remote"]}


@pytest.mark.parametrize("what", ["file", "empty-dir"])
def test_a_node_whose_step_path_cannot_take_the_fetched_files_reads_them_from_the_remote_tier(tmp_path, what):
    """Node 1's step path is a regular file: the files its rank fetched from node 0's replicas
    could not be installed (ENOTDIR), and the whole load failed on every rank although the
    remote tier held the step (an outside trial). Such a failure of the fetch is now logged and
    what the node lacks is read from the remote tier; the load is exact. An empty directory
    there: the install replaced it (a copy made around the fetched files), which the load's
    guard took for a removal mid-read, failing a load that had filled every tensor (a re-trial);
    a directory without a MANIFEST is not guarded now, and the node ends with a copy."""
    results = run_ranks(_step_path_not_a_directory_body, 2, str(tmp_path), what, timeout=240)
    assert all(r["exact"] for r in results), results
    assert results[0]["remote_bytes"] == 0, results
    if what == "file":
        assert results[1]["remote_bytes"] > 0, results
    else:
        assert (tmp_path / "node1" / "step_00000001" / "MANIFEST").exists()
