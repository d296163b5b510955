"""The local tier's per-node commit (distckpt.tiers.localcommit) on real gloo ranks.

Each group of ranks gets a directory of its own (tmp/node0, tmp/node1, ...), which is how a node
of the local tier looks to distckpt: node_layout finds the nodes by the directory each rank
sees, as it would find machines with their own NVMe."""

from __future__ import annotations

import errno
import os
import shutil

import pytest
import torch

from ..helpers.distributed import run_ranks

STEP = "step_00000001"


def _full() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(25)
    return {"w": torch.randn(24, 8, generator=g), "ids": torch.arange(60, dtype=torch.int64).reshape(12, 5),
            "big": torch.randn(1 << 16, 4, generator=g)}  # 1 MiB: several checksum blocks


def _state(rank: int, world: int) -> dict:
    """Rank ``rank``'s part of the job's state: every tensor row-sharded over the ranks (DTensor
    Shard(0), so each rank writes distinct bytes), a key of its own, a replica every rank holds
    (written once) and a plain value."""
    full = _full()
    if world == 1:
        model = {k: t.clone() for k, t in full.items()}
    else:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Shard, distribute_tensor
        mesh = init_device_mesh("cpu", (world,))
        model = {k: distribute_tensor(t.clone(), mesh, [Shard(0)]) for k, t in full.items()}
    return {"model": model, "step": 7, "rep": torch.arange(50.0), f"own{rank}": torch.full((9,), float(rank))}


def _node_dir(tmp: str, assign: list[int], rank: int) -> str:
    return os.path.join(tmp, f"node{assign[rank]}")


def _layout_of(tmp: str, assign: list[int], rank: int):
    from distckpt._dist import control_group
    from distckpt.tiers.nodes import node_layout
    return node_layout(control_group(), _node_dir(tmp, assign, rank))


def _fail_on(rank: int, failing: set[int], method: str, exc_factory) -> None:
    """Make the POSIX store's ``method`` raise on this rank when it is in ``failing`` (each rank
    is a process of its own: the patch stays in it)."""
    if rank not in failing:
        return
    from distckpt.storage.posix.store import PosixStore

    def fail(self, *args, **kwargs):
        raise exc_factory(args[0])

    setattr(PosixStore, method, fail)


def _save_body(rank, world, tmp, assign, blocking, step=STEP):
    from distckpt.tiers.localcommit import save_node_local
    layout = _layout_of(tmp, assign, rank)
    sd = _state(rank, world)
    out = save_node_local(sd, os.path.join(_node_dir(tmp, assign, rank), step), layout=layout, blocking=blocking)
    if not blocking:
        for t in sd["model"].values():  # the save holds a staged copy: the caller may go on
            t.to_local().zero_()
        out = out.result(timeout=120)
    return {"node_of": layout.node_of, "leaders": layout.leaders, "node": layout.node,
            "is_leader": layout.is_leader, "ranks_of_mine": layout.ranks_of(layout.node),
            "save_id": out.save_id, "path": out.path, "bytes": out.bytes_per_rank}


def _merge(tmp: str, nodes: int, step: str = STEP) -> str:
    """One directory holding every node's files of ``step`` (what restore will assemble from the
    tiers): the MANIFEST once, every rank's data file."""
    merged = os.path.join(tmp, "merged", step)
    os.makedirs(merged)
    for n in range(nodes):
        src = os.path.join(tmp, f"node{n}", step)
        for name in os.listdir(src):
            shutil.copyfile(os.path.join(src, name), os.path.join(merged, name))
    return merged


def _check_loads(path: str, world: int) -> None:
    """distckpt.load (one process, whole tensors) of ``path`` gives back every rank's bytes."""
    import distckpt
    full = _full()
    sd = {"model": {k: torch.zeros_like(v) for k, v in full.items()}, "step": 0, "rep": torch.zeros(50)}
    sd.update({f"own{r}": torch.zeros(9) for r in range(world)})
    distckpt.load(sd, path)
    for key, t in full.items():
        assert sd["model"][key].dtype == t.dtype and torch.equal(sd["model"][key], t), key
    assert sd["step"] == 7 and torch.equal(sd["rep"], torch.arange(50.0))
    for r in range(world):
        assert torch.equal(sd[f"own{r}"], torch.full((9,), float(r))), r


def _entries(tmp: str, node: int) -> list[str]:
    return sorted(os.listdir(os.path.join(tmp, f"node{node}")))


@pytest.mark.parametrize("assign,blocking", [
    ([0, 0, 1, 1], False),  # async (the staged copy committed per node)
    ([0, 1, 1, 1], True),   # a node of one rank beside a node of three
    ([0, 0], True),         # two ranks, one node: a plain save in that directory
])
def test_save_commits_on_every_node(tmp_path, assign, blocking):
    import distckpt
    from distckpt.errors import DataFileMissingError
    tmp, world, nodes = str(tmp_path), len(assign), max(assign) + 1
    results = run_ranks(_save_body, world, tmp, assign, blocking)

    leaders = tuple(assign.index(n) for n in range(nodes))
    for r, res in enumerate(results):
        assert res["node_of"] == tuple(assign) and res["leaders"] == leaders
        assert res["node"] == assign[r] and res["is_leader"] == (r in leaders)
        assert res["ranks_of_mine"] == [q for q in range(world) if assign[q] == assign[r]]
        assert res["path"] == os.path.join(tmp, f"node{assign[r]}", STEP)
    assert len({res["save_id"] for res in results}) == 1
    assert all(res["bytes"] == results[0]["bytes"] for res in results) and all(b > 0 for b in results[0]["bytes"])

    manifests = set()
    for n in range(nodes):
        # Only the committed step: no save area, no lock file left behind.
        assert _entries(tmp, n) == [STEP]
        step = os.path.join(tmp, f"node{n}", STEP)
        mine = [f"rank{r:05d}.bin" for r in range(world) if assign[r] == n]
        assert sorted(os.listdir(step)) == sorted(["MANIFEST"] + mine)
        with open(os.path.join(step, "MANIFEST"), "rb") as f:
            manifests.add(f.read())
    assert len(manifests) == 1  # the same global MANIFEST on every node

    if nodes == 1:
        _check_loads(os.path.join(tmp, "node0", STEP), world)
        return
    # A node's copy alone is not a checkpoint: the other node's data files are missing.
    with pytest.raises(DataFileMissingError):
        distckpt.load({"model": {k: torch.zeros_like(v) for k, v in _full().items()}},
                      os.path.join(tmp, "node0", STEP))
    _check_loads(_merge(tmp, nodes), world)


def test_world_of_one_is_a_normal_save(tmp_path):
    import distckpt
    from distckpt._dist import control_group
    from distckpt.tiers.localcommit import save_node_local
    from distckpt.tiers.nodes import node_layout
    local = str(tmp_path / "local")
    layout = node_layout(control_group(), local)  # no process group: one rank, one node
    assert (layout.rank, layout.node_of, layout.leaders, layout.is_leader) == (0, (0,), (0,), True)
    res = save_node_local(_state(0, 1), os.path.join(local, STEP), layout=layout)
    plain = distckpt.save(_state(0, 1), str(tmp_path / "plain"))
    assert res.world_size == 1 and res.bytes_per_rank == plain.bytes_per_rank
    assert sorted(os.listdir(local)) == [STEP]
    assert sorted(os.listdir(os.path.join(local, STEP))) == ["MANIFEST", "rank00000.bin"]
    _check_loads(os.path.join(local, STEP), 1)


def _disk_full(area):
    from distckpt.errors import DiskFullError
    return DiskFullError("injected: no room for the data file", path=area, errno=errno.ENOSPC)


def _io_error(area):
    from distckpt.errors import StorageIOError
    return StorageIOError("injected: EIO at the MANIFEST's fsync", path=area, errno=errno.EIO)


def _failing_save_body(rank, world, tmp, assign, method, failing, factory, blocking):
    """Save STEP (succeeds), then step 2 with ``method`` failing on the ``failing`` ranks; return
    what step 2 raised on this rank."""
    from distckpt.tiers.localcommit import save_node_local
    layout = _layout_of(tmp, assign, rank)
    root = _node_dir(tmp, assign, rank)
    save_node_local(_state(rank, world), os.path.join(root, STEP), layout=layout)
    _fail_on(rank, failing, method, factory)
    try:
        out = save_node_local(_state(rank, world), os.path.join(root, "step_00000002"), layout=layout,
                              blocking=blocking)
        if not blocking:
            out.result(timeout=120)
    except Exception as exc:  # noqa: BLE001 - the test inspects it
        return {"cls": type(exc).__name__, "committed": getattr(exc, "committed", "unset"),
                "published_nodes": getattr(exc, "published_nodes", "unset"),
                "failed_ranks": getattr(exc, "failed_ranks", None)}
    return None


@pytest.mark.parametrize("blocking", [True, False])
def test_write_failure_on_one_rank_aborts_every_node(tmp_path, blocking):
    tmp, assign = str(tmp_path), [0, 0, 1, 1]
    outs = run_ranks(_failing_save_body, 4, tmp, assign, "write_rank", {3}, _disk_full, blocking)
    for out in outs:  # the same typed class on every rank, naming the rank that failed
        assert out is not None and out["cls"] == "DiskFullError" and out["failed_ranks"] == [3], out
    for n in range(2):  # no step 2, no save area, no lock: only the previous step
        assert _entries(tmp, n) == [STEP]
    _check_loads(_merge(tmp, 2), 4)  # the previous step is intact


def test_prepare_failure_on_one_node_aborts_every_node(tmp_path):
    tmp, assign = str(tmp_path), [0, 0, 1, 1]
    outs = run_ranks(_failing_save_body, 4, tmp, assign, "prepare", {2}, _disk_full, True)
    for out in outs:
        assert out is not None and out["cls"] == "DiskFullError" and out["failed_ranks"] == [2], out
    for n in range(2):
        assert _entries(tmp, n) == [STEP]
    _check_loads(_merge(tmp, 2), 4)  # the previous step is intact


@pytest.mark.parametrize("failing,published", [({2}, [0]), ({0, 2}, [])])
def test_publish_failure_on_a_node(tmp_path, failing, published):
    tmp, assign = str(tmp_path), [0, 0, 1, 1]
    outs = run_ranks(_failing_save_body, 4, tmp, assign, "publish", failing, _io_error, True)
    for out in outs:  # typed, not committed, and naming the nodes that did publish
        assert out == {"cls": "StorageIOError", "committed": False, "published_nodes": published,
                       "failed_ranks": sorted(failing)}, out
    for n in range(2):
        # A node that published keeps its consistent copy; a node that failed keeps nothing of it.
        assert _entries(tmp, n) == ([STEP, "step_00000002"] if n in published else [STEP])
    if published:
        with open(os.path.join(tmp, "node0", "step_00000002", "MANIFEST"), "rb") as f:
            assert f.read()[:8] == b"DCKPTMF1"
    _check_loads(_merge(tmp, 2), 4)  # the previous step is intact


def _after_commit_body(rank, world, tmp, assign, failing_leader):
    from distckpt.errors import StorageIOError
    from distckpt.tiers.localcommit import save_node_local
    layout = _layout_of(tmp, assign, rank)
    root = _node_dir(tmp, assign, rank)
    final = os.path.join(root, STEP)

    def after():
        # Runs in this node's directory right after its publish: the step is visible there.
        assert os.path.isfile(os.path.join(final, "MANIFEST"))
        with open(os.path.join(root, "after_commit.log"), "a") as f:
            f.write(f"{rank}\n")
        if rank == failing_leader:
            raise StorageIOError("injected: the rotation failed", path=root, errno=errno.EIO)

    try:
        res = save_node_local(_state(rank, world), final, layout=layout, after_commit=after)
    except Exception as exc:  # noqa: BLE001 - the test inspects it
        return {"cls": type(exc).__name__, "committed": getattr(exc, "committed", "unset"),
                "published_nodes": getattr(exc, "published_nodes", "unset")}
    return res.save_id


def test_after_commit_runs_once_per_node_leader(tmp_path):
    tmp, assign = str(tmp_path), [0, 0, 0, 1, 1]
    outs = run_ranks(_after_commit_body, 5, tmp, assign, None)
    assert len(set(outs)) == 1 and isinstance(outs[0], str)  # committed, one save id
    for n, leader in enumerate([0, 3]):
        with open(os.path.join(tmp, f"node{n}", "after_commit.log")) as f:
            assert f.read() == f"{leader}\n"
    _check_loads(_merge(tmp, 2), 5)


def test_after_commit_error_is_raised_everywhere_with_committed(tmp_path):
    tmp, assign = str(tmp_path), [0, 0, 1, 1]
    outs = run_ranks(_after_commit_body, 4, tmp, assign, 2)
    for out in outs:
        assert out == {"cls": "StorageIOError", "committed": True, "published_nodes": [0, 1]}, out
    for n in range(2):
        assert os.path.isfile(os.path.join(tmp, f"node{n}", STEP, "MANIFEST"))
    _check_loads(_merge(tmp, 2), 4)


def _peer_dies_body(rank, world, tmp, assign):
    """Save STEP, then step 2 during which rank 3 dies at WRITE; each survivor records what it
    raised in a file (run_ranks reports only the failure of the dead rank)."""
    import json

    from distckpt.tiers.localcommit import save_node_local
    layout = _layout_of(tmp, assign, rank)
    root = _node_dir(tmp, assign, rank)
    save_node_local(_state(rank, world), os.path.join(root, STEP), layout=layout)
    if rank == 3:
        from distckpt.storage.posix.store import PosixStore
        PosixStore.write_rank = lambda self, *a, **k: os._exit(9)  # killed in the middle of the save
    try:
        save_node_local(_state(rank, world), os.path.join(root, "step_00000002"), layout=layout)
        out = {"cls": None}
    except Exception as exc:  # noqa: BLE001 - the test inspects it
        out = {"cls": type(exc).__name__, "committed": getattr(exc, "committed", "unset")}
    with open(os.path.join(tmp, f"out{rank}.json"), "w") as f:
        json.dump(out, f)


def test_a_rank_dying_mid_save_commits_nothing_anywhere(tmp_path):
    import json

    from ..helpers.distributed import RankError
    tmp, assign = str(tmp_path), [0, 0, 1, 1]
    with pytest.raises(RankError) as info:
        run_ranks(_peer_dies_body, 4, tmp, assign, env={"DISTCKPT_TIMEOUT_S": "10"})
    assert sorted(info.value.errors) == [3]  # only the killed rank failed to report
    outs = {}
    for r in range(3):
        with open(os.path.join(tmp, f"out{r}.json")) as f:
            outs[r] = json.load(f)
    assert all(o["cls"] == "PeerLostError" for o in outs.values()), outs
    # Rank 0 never ordered a publish and rank 2's node did not publish: both know nothing is
    # committed; rank 1 (not a leader) cannot tell from its own view, and says so.
    assert outs[0]["committed"] is False and outs[2]["committed"] is False, outs
    assert outs[1]["committed"] is None, outs
    for n in range(2):  # each surviving leader removed its area: only the previous step is left
        assert _entries(tmp, n) == [STEP]
    _check_loads(_merge(tmp, 2), 4)
