"""Tiered restore (distckpt.tiers.load) against the suite's real SeaweedFS server and real gloo ranks.

The tiers are built by hand here, as the local commit and the drain will leave them
(docs/TIERS.md): a step saved at 2 ranks with distckpt.save, then its MANIFEST copied
into two private "node" directories, ``n0/step_X`` with rank00000.bin and ``n1/step_X`` with
rank00001.bin, and its files uploaded byte for byte to the object store's layout of a committed
step (``step_X/<save_id>/rankNNNNN.bin``, then ``step_X/MANIFEST`` last). Each rank loads with its
own node's directory, as a job restarted on those nodes would.
"""

from __future__ import annotations

import os
import shutil

import pytest
import torch

from ..helpers.distributed import run_ranks

pytestmark = pytest.mark.timeout(300)

STEP = "step_00000007"


def _globals(seed: int = 7) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "w": torch.randn(7, 5, generator=g),                          # uneven rows over 2 and 3 ranks
        "emb": torch.randn(64, 16, generator=g).to(torch.bfloat16),
        "big": torch.randn(1 << 16, 4, generator=g),                   # 1 MiB: several checksum blocks
    }


def _state(rank: int, world: int, seed: int, zero: bool) -> dict:
    """FSDP-like state: every tensor a ShardedTensor of rows ``[rows * r // world, rows * (r + 1) //
    world)`` on rank r (no replicated box, so at the save's world size each rank's bytes are in its
    own data file), and a plain value."""
    from torch.distributed._shard.sharded_tensor import Shard, ShardMetadata, init_from_local_shards
    model = {}
    for key, full in _globals(seed).items():
        lo, hi = (full.shape[0] * r // world for r in (rank, rank + 1))
        local = torch.zeros_like(full[lo:hi]) if zero else full[lo:hi].clone()
        md = ShardMetadata(shard_offsets=[lo] + [0] * (full.dim() - 1), shard_sizes=list(local.shape),
                           placement=f"rank:{rank}/cpu")
        model[key] = init_from_local_shards([Shard(tensor=local, metadata=md)], *full.shape)
    return {"model": model, "step": 0 if zero else seed}


def _save_body(rank, world, paths):
    import distckpt
    return {seed: distckpt.save(_state(rank, world, seed, zero=False), path).save_id for seed, path in paths.items()}


def _load_body(rank, world, local_paths, remote, storage_options, seed):
    """Load with this rank's node directory; return (bytes_by_tier, bit-exact) or the typed error
    this rank raised, as (class name, files, whether the state dict is still all zeros)."""
    from distckpt.errors import DistCkptError
    from distckpt.tiers.load import load_tiered
    sd = _state(rank, world, seed, zero=True)
    shards = [(key, s) for key, st in sd["model"].items() for s in st.local_shards()]
    try:
        res = load_tiered(sd, local_path=local_paths[rank], remote_path=remote, storage_options=storage_options)
    except DistCkptError as exc:
        return {"error": type(exc).__name__, "files": getattr(exc, "files", None),
                "untouched": not any(s.tensor.any() for _, s in shards),
                "paths": sorted({str(e.path) for e in (exc.failures or {}).values()}), "message": str(exc)}
    full = _globals(seed)
    exact = all(s.tensor.dtype == full[key].dtype and torch.equal(
        s.tensor, full[key][s.metadata.shard_offsets[0]:s.metadata.shard_offsets[0] + s.metadata.shard_sizes[0]])
        for key, s in shards)
    return {"tiers": res.bytes_by_tier, "exact": exact and sd["step"] == seed, "bytes_read": res.bytes_read}


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> dict[int, tuple[str, str]]:
    """{seed: (step directory, save id)}: the step saved at 2 ranks with the values of seed 7, and
    another save of it (seed 8); once for the module (each test copies what it needs)."""
    root = tmp_path_factory.mktemp("saved")
    paths = {seed: str(root / f"seed{seed}" / STEP) for seed in (7, 8)}
    ids = run_ranks(_save_body, 2, paths)[0]
    return {seed: (paths[seed], ids[seed]) for seed in paths}


def _make_tiers(tmp_path, bucket, saved, *, seed: int = 7, upload: bool = True) -> tuple[list[str], str, str]:
    """Split the saved step into two node directories and (``upload``) commit it on the object store.
    Returns ([n0 step dir, n1 step dir], the remote step URL, the save id)."""
    src, save_id = saved[seed]
    nodes = []
    for r in range(2):
        d = tmp_path / f"n{r}" / STEP
        d.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(os.path.join(src, "MANIFEST"), d / "MANIFEST")
        shutil.copyfile(os.path.join(src, f"rank{r:05d}.bin"), d / f"rank{r:05d}.bin")
        nodes.append(str(d))
    remote = f"{bucket.url}/run{seed}/{STEP}"
    if upload:
        # The object store's layout of a committed step (distckpt/storage/object/store.py): data
        # objects under the save id, MANIFEST last.
        for r in range(2):
            bucket.fs.put_file(os.path.join(src, f"rank{r:05d}.bin"), f"{remote}/{save_id}/rank{r:05d}.bin")
        bucket.fs.put_file(os.path.join(src, "MANIFEST"), f"{remote}/MANIFEST")
    return nodes, remote, save_id


def test_both_nodes_local_reads_nothing_remote(s3_bucket, saved, tmp_path):
    nodes, remote, _ = _make_tiers(tmp_path, s3_bucket, saved)
    results = run_ranks(_load_body, 2, nodes, remote, s3_bucket.storage_options, 7)
    for res in results:
        assert res.get("exact"), res
        assert res["tiers"]["remote"] == 0 and res["tiers"]["local"] > 0, res


@pytest.mark.parametrize("world,node_of", [(2, [0, 1]), (1, [0]), (3, [0, 0, 1])])
def test_wiped_node_reads_its_files_from_remote(s3_bucket, saved, tmp_path, world, node_of):
    nodes, remote, _ = _make_tiers(tmp_path, s3_bucket, saved)
    shutil.rmtree(os.path.dirname(nodes[1]))   # node 1 replaced: its local directory is empty
    results = run_ranks(_load_body, world, [nodes[n] for n in node_of], remote, s3_bucket.storage_options, 7)
    assert all(res.get("exact") for res in results), results
    tiers = [res["tiers"] for res in results]
    for rank, n in enumerate(node_of):
        if n == 1:   # a rank on the wiped node reads everything remotely
            assert tiers[rank]["local"] == 0 and tiers[rank]["remote"] > 0, tiers
    if world == 2:   # the saved sharding: rank 0 reads only its own file, from its own disk
        assert tiers[0]["local"] > 0 and tiers[0]["remote"] == 0, tiers
    else:            # resharded: rank 0 (1 rank) or rank 1 (3 ranks) needs rows of both files
        mixed = tiers[0] if world == 1 else tiers[1]
        assert mixed["local"] > 0 and mixed["remote"] > 0, tiers
    full = sum(v.numel() * v.element_size() for v in _globals().values())
    assert sum(t["local"] + t["remote"] for t in tiers) == full


def _with_another_save_on_node_1(tmp_path, bucket, saved, *, upload: bool) -> tuple[list[str], str, str, str]:
    """The tiers of seed 7's save, except that node 1 holds another save of the same step (saved
    again there, with other values): (nodes, remote URL, the save id, node 1's save id)."""
    nodes, remote, save_id = _make_tiers(tmp_path, bucket, saved, seed=7, upload=upload)
    other, _, other_id = _make_tiers(tmp_path / "other", bucket, saved, seed=8, upload=False)
    assert other_id != save_id
    shutil.rmtree(nodes[1])
    shutil.copytree(other[1], nodes[1])
    return nodes, remote, save_id, other_id


def test_another_save_on_a_node_is_never_mixed_in(s3_bucket, saved, tmp_path):
    # The remote tier's save is the reference: node 1's copy is not read at all.
    nodes, remote, _, _ = _with_another_save_on_node_1(tmp_path, s3_bucket, saved, upload=True)
    results = run_ranks(_load_body, 2, nodes, remote, s3_bucket.storage_options, 7)
    assert all(res.get("exact") for res in results), results
    assert results[1]["tiers"]["local"] == 0 and results[1]["tiers"]["remote"] > 0, results
    assert results[0]["tiers"]["remote"] == 0, results


def test_nodes_holding_different_saves_and_no_remote_raise_tier_incomplete(s3_bucket, saved, tmp_path):
    nodes, remote, save_id, other_id = _with_another_save_on_node_1(tmp_path, s3_bucket, saved, upload=False)
    results = run_ranks(_load_body, 2, nodes, remote, s3_bucket.storage_options, 7)
    for res in results:
        assert res.get("error") == "TierIncompleteError" and res["untouched"], res
        assert save_id in res["message"] and other_id in res["message"], res


def test_local_tier_alone_is_a_complete_copy(s3_bucket, saved, tmp_path):
    nodes, remote, _ = _make_tiers(tmp_path, s3_bucket, saved, upload=False)
    results = run_ranks(_load_body, 2, nodes, remote, s3_bucket.storage_options, 7)
    assert all(res.get("exact") and res["tiers"]["remote"] == 0 for res in results), results


def test_no_tier_holds_a_file_raises_tier_incomplete(s3_bucket, saved, tmp_path):
    nodes, remote, _ = _make_tiers(tmp_path, s3_bucket, saved, upload=False)
    shutil.rmtree(nodes[1])   # node 1 replaced before its step reached the remote tier
    results = run_ranks(_load_body, 2, nodes, remote, s3_bucket.storage_options, 7)
    for res in results:
        assert res.get("error") == "TierIncompleteError", res
        assert res["files"] == ["rank00001.bin"] and res["untouched"], res
        assert STEP in res["message"] and "not committed" in res["message"], res


def test_corrupt_local_byte_raises_checksum_mismatch(s3_bucket, saved, tmp_path):
    from distckpt.restore import load_manifest
    nodes, remote, _ = _make_tiers(tmp_path, s3_bucket, saved)
    manifest = load_manifest(saved[7][0])
    chunk = next(c for c in manifest.tensors["model.big"].chunks if c.file == 0)
    path = os.path.join(nodes[0], "rank00000.bin")
    with open(path, "r+b") as f:   # a byte in the middle of rank 0's rows of "big", in node 0's copy only
        f.seek(chunk.offset + chunk.nbytes // 2)
        byte = f.read(1)
        f.seek(chunk.offset + chunk.nbytes // 2)
        f.write(bytes([byte[0] ^ 0xFF]))
    # The remote copy is intact and committed, yet the damage is reported, never read around.
    results = run_ranks(_load_body, 2, nodes, remote, s3_bucket.storage_options, 7)
    for res in results:
        assert res.get("error") == "ChecksumMismatchError", res
        assert res["paths"] == [path], res


def _availability_body(rank, world, roots, remote_root, storage_options):
    from distckpt._dist import control_group
    from distckpt.tiers.load import step_availability
    avail = step_availability(control_group(), local_root=roots[rank], remote_root=remote_root,
                              storage_options=storage_options)
    return {step: (t.remote_save_id, t.local_save_id, t.local_complete, t.reference_save_id, t.created_unix,
                   [None if c is None else sorted(c.files) for c in t.local],
                   t.missing(rank, [0, 1]), t.complete_for({0: [0], 1: [1]}), t.complete_for({0: [0, 1]}))
            for step, t in avail.items()}


def test_step_availability_across_tiers(s3_bucket, saved, tmp_path):
    # Step 7: on both nodes and committed remotely. Step 8 (seed 8's save): on both nodes only.
    # Step 9: node 0's copy only (node 1's was wiped), nothing remote.
    nodes, remote, id7 = _make_tiers(tmp_path, s3_bucket, saved, seed=7)
    other, _, id8 = _make_tiers(tmp_path / "other", s3_bucket, saved, seed=8, upload=False)
    for r in range(2):
        shutil.copytree(other[r], os.path.join(tmp_path, f"n{r}", "step_00000008"))
    shutil.copytree(other[0], os.path.join(tmp_path, "n0", "step_00000009"))
    roots = [str(tmp_path / "n0"), str(tmp_path / "n1")]
    results = run_ranks(_availability_body, 2, roots, os.path.dirname(remote), s3_bucket.storage_options)
    assert results[0].keys() == {7, 8, 9}, results
    rid, lid, complete, ref, created, files, missing, per_rank, rank0_all = results[0][7]
    assert (rid, lid, complete, ref, files, missing, per_rank, rank0_all) == (
        id7, id7, True, id7, [[0], [1]], [], True, True)
    assert created is not None
    # Local only: each rank reaches its node's file, not the other node's.
    for rank, res in enumerate(results):
        rid, lid, complete, ref, created, files, missing, per_rank, rank0_all = res[8]
        assert (rid, lid, complete, ref, files, per_rank, rank0_all) == (None, id8, True, id8, [[0], [1]], True, False)
        assert missing == [1 - rank] and created is not None
        # Node 0's copy alone holds half of the save: nothing complete, and rank 1 reaches nothing.
        rid, lid, complete, ref, created, files, missing, per_rank, rank0_all = res[9]
        assert (rid, lid, complete, files, per_rank) == (None, id8, False, [[0], None], False)
        assert missing == ([1] if rank == 0 else [0, 1])
