"""Compact layouts at PLAN: DTensors split evenly over their mesh (all ``Shard`` placements) are
described once per distinct description instead of once per rank, and rank 0 plans them without
seeing any rank's box (saveplan._merge_compact). Any doubt falls back to the full plan.

The unit tests drive rank 0's ``_coordinate_plan`` with the messages ranks send; the last test
saves and loads real DTensor layouts on 4 gloo ranks (about 10 s, most of it process start-up)."""

from __future__ import annotations

import itertools

import pytest
import torch

from distckpt import saveplan as co
from distckpt.errors import StateDictMismatchError
from distckpt.saveplan import LayoutMessage, PlanRejected, PlanReply, Resend
from distckpt.plan import Box, find_tiling_defect, grid_box, grid_chunk_counts, grid_part
from tests.helpers.distributed import run_ranks


class _Group:
    def __init__(self, world: int) -> None:
        self.pg, self.rank, self.world_size = object(), 0, world


def _summary(rank: int, world: int, keys: dict[str, tuple], mesh=None) -> dict:
    """A rank's summary (saveplan._summarize's format) of row-split float32 tensors
    ``{fqn: (rows, cols)}`` over ``mesh`` (default: every rank)."""
    mesh = mesh or ((world,), tuple(range(world)))
    tensors, grid = {}, {}
    for fqn, shape in keys.items():
        if rank in mesh[1]:
            o, s = grid_box(shape, mesh[0], (0,), (mesh[1].index(rank),))
            tensors[fqn] = ("dtensor", "float32", shape, [(o, s, 4 * s[0] * s[1])])
            grid[fqn] = ("dtensor", "float32", shape, 0, (0,))
        else:
            tensors[fqn] = ("dtensor", "float32", shape, [])
    tree = {"t": "dict", "k": [[k, {"t": "ref", "fqn": k}] for k in keys]}
    return {"tensors": tensors, "objects": {}, "tree": tree, "digests": {}, "grid": grid,
            "meshes": [mesh] if grid else []}


def _plan(summaries, group=None, *, compact=True, asked=()):
    group = group or _Group(len(summaries))
    msgs = [LayoutMessage(co._plan_message(s, compact=compact, with_part=r == 0 or r in asked), co._layout_key(s))
            for r, s in enumerate(summaries)]
    return co._coordinate_plan(group, msgs, lambda fqn: True)


def test_grid_box_matches_dtensor_and_tiles():
    from torch.distributed.tensor.placement_types import Shard
    for n, parts in itertools.product(range(0, 12), range(1, 7)):
        for i in range(parts):
            size, start = Shard.local_shard_size_and_offset(n, parts, i)
            assert grid_part(n, parts, i) == (start, size), (n, parts, i)
    for shape, mesh, dims in [((7, 5), (3, 2), (0, 1)), ((2, 9), (4,), (0,)), ((5, 0, 3), (2, 2), (2, 0))]:
        boxes = [grid_box(shape, mesh, dims, c) for c in itertools.product(*(range(m) for m in mesh))]
        assert find_tiling_defect([Box(o, s) for o, s in boxes], Box.full(shape)) is None
        counts: dict[int, int] = {}
        for _, s in boxes:
            n = 1
            for d in s:
                n *= d
            counts[n] = counts.get(n, 0) + 1
        assert grid_chunk_counts(shape, mesh, dims) == counts
    with pytest.raises(ValueError):
        grid_box((4, 4), (2, 2), (0, 0), (0, 0))  # one dimension split twice is not a grid


def test_compact_plan_equals_the_full_plan():
    world, keys = 8, {f"l{i}.w": (10 + i, 3) for i in range(6)}  # uneven splits, empty chunks
    summaries = [_summary(r, world, keys) for r in range(world)]
    replies, plan = _plan(summaries)
    assert isinstance(replies[0], PlanReply) and plan.compact and plan.owners == {}
    full_replies, full = _plan(summaries, compact=False)
    assert isinstance(full_replies[0], PlanReply) and not full.compact
    assert (plan.total_bytes, plan.checksum_block, plan.tensors, plan.tree) == \
           (full.total_bytes, full.checksum_block, full.tensors, full.tree)
    # The same chunks, except that empty ones are not written (the full plan writes one per key).
    empty_keys = sum(1 for rows, _ in keys.values() if -(-rows // world) * (world - 1) >= rows)
    assert plan.n_chunks == full.n_chunks - empty_keys == sum(
        1 for s in summaries for t in s["tensors"].values() for p in t[3] if p[2])
    # Every rank holds exactly its own chunk of each key: nothing left for a bitmap.
    assert all(r.bits == b"" for r in replies) and all(r.compact for r in replies)
    # What a rank other than 0 sends does not grow with the ranks or its keys.
    msg = co._plan_message(summaries[3], compact=True, with_part=False)
    assert msg.tensors == {} and msg.part is None and len(msg.compact) == 16


def test_unknown_parts_are_asked_from_one_rank_each():
    world = 4
    stage0, stage1 = ((2,), (0, 1)), ((2,), (2, 3))  # two pipeline stages, one mesh each
    summaries = [_summary(r, world, {"a": (5, 2)}, stage0) for r in range(world)]
    for r in range(world):
        other = _summary(r, world, {"b": (3, 2)}, stage1)
        summaries[r]["tensors"].update(other["tensors"])
        summaries[r]["tree"]["k"] += other["tree"]["k"]
        if other["grid"]:
            summaries[r]["grid"], summaries[r]["meshes"] = other["grid"], other["meshes"]
    group = _Group(world)
    replies, plan = _plan(summaries, group)
    assert plan is None and replies == [Resend("layout")] * 2 + [Resend("part"), Resend("layout")]
    replies, plan = _plan(summaries, group, asked={2})
    assert isinstance(replies[0], PlanReply) and plan.compact and plan.n_chunks == 4
    assert set(plan.tensors) == {"a", "b"}


@pytest.mark.parametrize("case", ["missing_on_a_mesh_rank", "two_meshes", "mixed_modes"])
def test_doubt_falls_back_to_the_full_plan(case):
    world, keys = 4, {"w": (8, 2)}
    summaries = [_summary(r, world, keys) for r in range(world)]
    compact = [True] * world
    if case == "missing_on_a_mesh_rank":
        # Rank 3 could not confirm the description (it sends its piece instead): the others' grid
        # promises a chunk on rank 3 that rank 0 cannot see.
        summaries[3]["grid"], summaries[3]["meshes"] = {}, []
    elif case == "two_meshes":
        # Ranks 2 and 3 describe "w" over another mesh: both meshes' chunks would overlap.
        for r in (2, 3):
            summaries[r] = _summary(r, world, keys, ((2,), (2, 3)))
    group = _Group(world)
    msgs = [LayoutMessage(co._plan_message(s, compact=c, with_part=True), co._layout_key(s))
            for s, c in zip(summaries, compact)]
    if case == "mixed_modes":
        msgs[1] = LayoutMessage(co._plan_message(summaries[1], compact=False, with_part=True), msgs[1].key)
    replies, plan = co._coordinate_plan(group, msgs, lambda fqn: True)
    assert plan is None and all(r == Resend("full") for r in replies)
    replies, plan = _plan(summaries, group, compact=False)
    if case == "two_meshes":  # the full plan names the overlap, as it always did
        assert isinstance(replies[0], PlanRejected) and isinstance(replies[0].error, StateDictMismatchError)
        assert "must cover it exactly once" in str(replies[0].error)
    else:
        assert isinstance(replies[0], PlanReply) and not plan.compact


def test_row_split_sharded_tensors_without_a_mesh_are_described_as_grids():
    """TorchRec's row-wise tables (and a ShardedTensor split on dim 0) carry no DeviceMesh: a
    piece that is exactly this rank's row block of an even split over the group is described as
    a grid over every rank, so rank 0 plans it without seeing any rank's box. A replica, a plain
    tensor or any other box is not, and a key that some rank cannot describe sends the save to
    the full plan."""
    from distckpt.flatten import Piece, TensorItem
    world = 4

    def items(rank, rows=10, box=None, kind="sharded_tensor"):
        o, s = box(rank) if box else grid_box((rows, 3), (world,), (0,), (rank,))
        t = torch.zeros(s)
        return {"emb": TensorItem("emb", kind, torch.float32, (rows, 3), [Piece(o, s, t)], ("emb",))}

    tree = {"t": "dict", "k": [["emb", {"t": "ref", "fqn": "emb"}]]}
    summaries = [co._summarize(items(r), tree, r, False, None, world_size=world) for r in range(world)]
    assert all(s["grid"] == {"emb": ("sharded_tensor", "float32", (10, 3), 0, (0,))} for s in summaries)
    assert summaries[1]["meshes"] == [((4,), (0, 1, 2, 3))]
    replies, plan = _plan(summaries)
    assert isinstance(replies[0], PlanReply) and plan.compact and plan.owners == {} and plan.n_chunks == 4
    full_replies, full = _plan(summaries, compact=False)
    assert isinstance(full_replies[0], PlanReply)
    assert (plan.total_bytes, plan.tensors) == (full.total_bytes, full.tensors)
    # Not described: a replica (the whole tensor), a plain tensor, rows in another order.
    for kw in ({"box": lambda r: ((0, 0), (10, 3))}, {"kind": "tensor"},
               {"box": lambda r: grid_box((10, 3), (world,), (0,), (world - 1 - r,))}):
        assert all(co._summarize(items(r, **kw), tree, r, False, None, world_size=world)["grid"] == {}
                   for r in range(world))
    # One rank whose rows are another block: the others' descriptions are doubted, full plan.
    odd = [co._summarize(items(r, box=(lambda r: ((0, 0), (3, 3))) if r == 2 else None), tree, r, False, None,
                         world_size=world) for r in range(world)]
    assert odd[2]["grid"] == {} and odd[0]["grid"]
    replies, plan = _plan(odd, asked={2})  # rank 2's part (without "emb") is known to rank 0
    assert plan is None and all(r == Resend("full") for r in replies)
    replies, plan = _plan(odd, compact=False)  # and the full plan names the overlap, as always
    assert isinstance(replies[0], PlanRejected) and "emb" in str(replies[0].error)


def _body(rank, world, root):
    import distckpt
    from torch.distributed.tensor import DeviceMesh, Replicate, Shard, distribute_tensor
    from distckpt import errors, saveplan

    mesh = DeviceMesh("cpu", list(range(world)))
    mesh2 = DeviceMesh("cpu", torch.arange(world).reshape(2, 2))
    stage = DeviceMesh("cpu", [0, 1])  # ranks 2 and 3 are outside it (a pipeline stage)
    torch.manual_seed(0)
    full = {"fsdp": torch.randn(7, 3), "tiny": torch.randn(2, 5), "col": torch.randn(3, 6),
            "tp2d": torch.randn(5, 4), "rep": torch.randn(4), "stage": torch.randn(6, 2), "plain": torch.ones(3),
            "empty": torch.zeros(0, 3)}
    sd = {"fsdp": distribute_tensor(full["fsdp"], mesh, [Shard(0)]),     # 2, 2, 2, 1 rows
          "tiny": distribute_tensor(full["tiny"], mesh, [Shard(0)]),     # ranks 2 and 3 hold nothing
          "col": distribute_tensor(full["col"], mesh, [Shard(1)]),
          "tp2d": distribute_tensor(full["tp2d"], mesh2, [Shard(0), Shard(1)]),
          "rep": distribute_tensor(full["rep"], mesh, [Replicate()]),   # not a grid: general path
          "stage": distribute_tensor(full["stage"], stage, [Shard(0)]),
          "empty": distribute_tensor(full["empty"], mesh, [Shard(0)]),  # no element: no chunk at all
          "plain": full["plain"], "step": 3}
    # A ShardedTensor split on rows as TorchRec's row-wise sharding does (blocks of ceil(10 / 4)):
    # no mesh, described as a grid over every rank all the same.
    from torch.distributed._shard.sharded_tensor import Shard as STShard
    from torch.distributed._shard.sharded_tensor import ShardMetadata, init_from_local_shards
    full["rows"] = torch.randn(10, 3)

    def rows_st(src):
        o, sz = grid_box((10, 3), (world,), (0,), (rank,))
        md = ShardMetadata(shard_offsets=list(o), shard_sizes=list(sz), placement=f"rank:{rank}/cpu")
        return init_from_local_shards([STShard(tensor=src[o[0]:o[0] + sz[0]].clone(), metadata=md)], 10, 3)

    sd["rows"] = rows_st(full["rows"])
    from distckpt.flatten import flatten
    tree_, items_ = flatten(sd, check_objects=False)
    assert "rows" in saveplan._summarize(items_, tree_, rank, False, None, world_size=world)["grid"]
    out = []
    for i in range(2):
        res = distckpt.save(sd, f"{root}/s{i}")
        out.append((res.plan_cached, saveplan._PLAN_CACHE[next(iter(saveplan._PLAN_CACHE))].layout.compact
                    if rank == 0 else None))
        back = distckpt.read(f"{root}/s{i}")
        for k, v in full.items():
            assert torch.equal(back[k], v), k
        # Loading into the same layout on every rank (each rank reads its own chunks).
        target = {k: (torch.zeros_like(v) if not hasattr(v, "device_mesh") else
                      distribute_tensor(torch.zeros_like(full[k]), v.device_mesh, v.placements))
                  for k, v in sd.items() if k not in ("step", "rows")}
        target["step"], target["rows"] = 0, rows_st(torch.zeros(10, 3))
        distckpt.load(target, f"{root}/s{i}")
        assert torch.equal(target["rows"].local_shards()[0].tensor, sd["rows"].local_shards()[0].tensor)
        for k, v in sd.items():
            if k not in ("step", "rows"):
                assert torch.equal(target[k].to_local() if hasattr(target[k], "to_local") else target[k],
                                   v.to_local() if hasattr(v, "to_local") else v), k
        assert target["step"] == 3
    # A rank whose DTensor has another shape under the same key: the same typed error as before.
    bad = dict(sd, fsdp=distribute_tensor(torch.zeros(8 if rank == 1 else 7, 3), mesh, [Shard(0)]))
    with pytest.raises(errors.StateDictMismatchError, match="fsdp"):
        distckpt.save(bad, f"{root}/bad")
    return out


def test_real_dtensor_layouts_save_compact_and_load(tmp_path):
    results = run_ranks(_body, 4, str(tmp_path))
    assert all(r == results[0] or [c for c, _ in r] == [c for c, _ in results[0]] for r in results)
    # The first save plans (compactly: ranks 2 and 3 send a different part, asked for once), the
    # second reuses the plan.
    assert results[0] == [(False, True), (True, True)]
