"""A load reads only the data-file indexes its rank needs (format version 4), on real gloo ranks.

Saved by 4 ranks: FSDP-like DTensors (Shard(0), a grid over the 4 ranks, one uneven), a 2-D
mesh's TP+FSDP DTensor, a replicated DTensor (written once, by the rank the plan picked) and a
plain value. Loaded at 4, 2 and 3 ranks: bit-exact, and every rank records which indexes it read
(``Store.read_index``): at the same world size its own file plus the replicated tensor's writer's;
resharded, the files its boxes meet. A rank whose state dict cannot be flattened still takes part
in the MANIFEST's broadcast (the collective comes first), so the others do not wait for it.
A lying ``where`` and a data file only one rank needs going missing give every rank the same
typed error, and nothing hangs (each run is bounded by run_ranks' timeout)."""

from __future__ import annotations

import os
import shutil

import msgpack
import pytest
import torch

from ..helpers.distributed import RankError, run_ranks

_PRELOAD = ["torch", "torch.distributed", "tests.helpers.distributed", "tests.protocol.test_load_indexes"]


def _globals() -> dict:
    g = torch.Generator().manual_seed(4)
    out = {f"layers.{i}.w": torch.randn(16 + 3 * i, 8, generator=g) for i in range(4)}
    out["tp.w"] = torch.randn(8, 6, generator=g)
    out["norm"] = torch.randn(8, generator=g)
    return out


def _state(world: int, zeros: bool) -> dict:
    from torch.distributed.tensor import DeviceMesh, Replicate, Shard, distribute_tensor
    mesh = DeviceMesh("cpu", list(range(world)))
    full = _globals()
    sd = {}
    for k, v in full.items():
        v = torch.zeros_like(v) if zeros else v
        if k == "norm":
            sd[k] = distribute_tensor(v, mesh, [Replicate()])
        elif k == "tp.w" and world % 2 == 0:
            mesh2 = DeviceMesh("cpu", torch.arange(world).reshape(2, world // 2))
            sd[k] = distribute_tensor(v, mesh2, [Shard(0), Shard(1)])
        else:
            sd[k] = distribute_tensor(v, mesh, [Shard(0)])
    sd["step"] = 0 if zeros else 42
    return sd


def _save(rank, world, path):
    import distckpt
    distckpt.save(_state(world, zeros=False), path)


def _load(rank, world, path):
    import distckpt
    from distckpt.storage import open_store
    Store = type(open_store(path))  # the back end's own read_index
    read = []
    orig = Store.read_index

    def spy(self, p, header, i):
        read.append(i)
        return orig(self, p, header, i)

    Store.read_index = spy
    try:
        sd = _state(world, zeros=True)
        distckpt.load(sd, path)
    finally:
        Store.read_index = orig
    full = _globals()
    for k, v in full.items():
        assert torch.equal(sd[k].full_tensor(), v), k
    assert sd["step"] == 42
    # The files whose saved chunks meet this rank's boxes, from every index (the oracle).
    from distckpt.flatten import TensorItem, flatten
    from distckpt.plan import Box, intersect
    from distckpt.storage.posix.manifests import load_manifest
    m = load_manifest(path)
    need = set()
    for fqn, item in flatten(sd)[1].items():
        if isinstance(item, TensorItem):
            for p in item.pieces:
                want = Box(tuple(p.offsets), tuple(p.sizes))
                need |= {c.file for c in m.tensors[fqn].chunks if want.volume and intersect(c.box, want)}
    return sorted(read), sorted(need)


def _load_expecting(rank, world, path, cls_name):
    import distckpt
    from distckpt import errors
    try:
        distckpt.load(_state(world, zeros=True), path)
    except getattr(errors, cls_name) as exc:
        return type(exc).__name__
    raise AssertionError(f"rank {rank}: the load did not raise {cls_name}")


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("v4") / "step")
    run_ranks(_save, 4, path, preload=_PRELOAD)
    return path


def test_a_version_4_save_says_where_each_tensor_is(saved):
    from distckpt.storage.posix.manifests import load_manifest
    m = load_manifest(saved)
    assert m.format_version == 4
    assert m.meshes == (((4,), (0, 1, 2, 3)), ((2, 2), (0, 1, 2, 3)))
    assert m.tensors["layers.0.w"].where == ("grid", 0, (0,))
    assert m.tensors["tp.w"].where == ("grid", 1, (0, 1))
    kind, ranges = m.tensors["norm"].where
    assert kind == "ranks" and len(ranges) == 1 and ranges[0][1] - ranges[0][0] == 1  # one writer


def test_each_rank_reads_only_the_indexes_it_needs_and_loads_bit_exact(saved):
    from distckpt.storage.posix.manifests import load_manifest
    writer = load_manifest(saved).tensors["norm"].where[1][0][0]
    got = run_ranks(_load, 4, saved, preload=_PRELOAD)
    # Same world size: its own file, and the replicated tensor's writer's.
    assert [read for read, _ in got] == [sorted({r, writer}) for r in range(4)], got
    # Resharded onto 2 and 3 ranks: exactly the files whose chunks its new boxes meet (a rank of
    # 2 needs all 4 here: the tensors' uneven rows cross the old cells).
    for world in (2, 3):
        got = run_ranks(_load, world, saved, preload=_PRELOAD)
        assert all(read == need for read, need in got), (world, got)
        assert any(len(read) < 4 for read, _ in got), (world, got)

def _rewrap(path: str, edit) -> None:
    from distckpt import manifest as mf
    from tests.golden.make_golden import wrap
    p = os.path.join(path, "MANIFEST")
    data = open(p, "rb").read()
    body = msgpack.unpackb(data[24:-4], raw=False, strict_map_key=False)
    edit(body)
    with open(p, "wb") as f:
        f.write(wrap(msgpack.packb(body, use_bin_type=True), version=mf.FORMAT_VERSION))


def test_a_lying_where_or_a_file_one_rank_needs_gives_every_rank_the_typed_error(saved, tmp_path):
    # The grid said to cut dimension 1: the chunks every rank reads leave their cells.
    lying = str(tmp_path / "lying")
    shutil.copytree(saved, lying)
    _rewrap(lying, lambda b: b["tensors"]["layers.1.w"].__setitem__("where", ["grid", 0, [1]]))
    assert run_ranks(_load_expecting, 4, lying, "ManifestCorruptError", preload=_PRELOAD) == \
        ["ManifestCorruptError"] * 4
    # Rank 3's own data file is gone: only rank 3 reads its index, and every rank raises.
    missing = str(tmp_path / "missing")
    shutil.copytree(saved, missing)
    os.unlink(os.path.join(missing, "rank00003.bin"))
    with pytest.raises(RankError):
        run_ranks(_load, 4, missing, preload=_PRELOAD)
    assert run_ranks(_load_expecting, 4, missing, "DataFileMissingError", preload=_PRELOAD) == \
        ["DataFileMissingError"] * 4


def _load_bad_on_rank1(rank, world, path):
    import distckpt
    from distckpt import errors
    sd = _state(world, zeros=True)  # every rank builds its meshes (a collective) first
    if rank == 1:
        sd = torch.zeros(4)  # not a container: flatten refuses it, on this rank only
    try:
        distckpt.load(sd, path)
    except errors.DistCkptError as exc:
        return type(exc).__name__, sorted(exc.failed_ranks)
    raise AssertionError("the load did not raise")


def test_a_rank_failing_before_it_knows_its_boxes_does_not_hang_the_others(saved):
    got = run_ranks(_load_bad_on_rank1, 4, saved, timeout=120, preload=_PRELOAD)
    assert got == [("UnsupportedValueError", [1])] * 4, got

