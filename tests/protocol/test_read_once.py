"""Read-once loads (distckpt.readonce) on real gloo ranks: each byte several ranks need is read
from storage by one of them and sent to the others, verified on arrival.

Checked: bit-exact loads of replicated state (DDP: every rank the whole model) at 2, 3 and 4
ranks, and of a 4-rank FSDP save loaded as HSDP (2 replicas x 2 shards, resharded); the bytes read
from storage across all ranks against the checkpoint's size, with the switch on and off; a corrupt
block on the reading rank gives every rank a ChecksumMismatchError and no corrupt byte in any
tensor; a rank killed while it serves bytes gives every survivor a PeerLostError within the
timeout, nothing hangs; a rank failing before the moves stops everyone before a byte is read."""

from __future__ import annotations

import os

import pytest
import torch

from ..helpers.distributed import RankError, run_ranks

_PRELOAD = ["torch", "torch.distributed", "tests.helpers.distributed", "tests.protocol.test_read_once"]
_ON = {"DISTCKPT_READ_ONCE": "on", "DISTCKPT_TIMEOUT_S": "30"}


def _model() -> dict:
    g = torch.Generator().manual_seed(7)
    out = {f"big.{i}": torch.randn(3 << 18, generator=g) for i in range(3)}   # 3 MiB each
    out.update({f"small.{i}": torch.randn(100 + i, generator=g) for i in range(20)})
    out["emb"] = torch.randn(4096, 64, generator=g)   # 1 MiB, sharded in the HSDP case
    return out


def _zeros() -> dict:
    return {k: torch.zeros_like(v) for k, v in _model().items()}


def _save_replicated(rank, world, path):
    import distckpt
    distckpt.save(_model(), path)   # every rank the same tensors: each written once


def _save_fsdp(rank, world, path):
    import distckpt
    from torch.distributed.tensor import DeviceMesh, Shard, distribute_tensor
    mesh = DeviceMesh("cpu", list(range(world)))
    sd = {k: distribute_tensor(v, mesh, [Shard(0)]) for k, v in _model().items()}
    distckpt.save(sd, path)


def _load_replicated(rank, world, path):
    import distckpt
    sd = _zeros()
    res = distckpt.load(sd, path)
    for k, v in _model().items():
        assert torch.equal(sd[k], v), k
    return res.bytes_read, res.bytes_from_peers


def _load_hsdp(rank, world, path):
    import distckpt
    from torch.distributed.tensor import DeviceMesh, Replicate, Shard, distribute_tensor
    mesh = DeviceMesh("cpu", torch.arange(world).reshape(2, world // 2))
    sd = {k: distribute_tensor(torch.zeros_like(v), mesh, [Replicate(), Shard(0)]) for k, v in _model().items()}
    res = distckpt.load(sd, path)
    for k, v in _model().items():
        assert torch.equal(sd[k].full_tensor(), v), k
    return res.bytes_read, res.bytes_from_peers


def _data_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path) if f.endswith(".bin"))


@pytest.fixture(scope="module")
def replicated(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("ro") / "ddp")
    run_ranks(_save_replicated, 4, path, preload=_PRELOAD)
    return path


@pytest.fixture(scope="module")
def fsdp(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("ro") / "fsdp")
    run_ranks(_save_fsdp, 4, path, preload=_PRELOAD)
    return path


@pytest.mark.parametrize("world", [2, 3, 4])
def test_replicated_state_is_read_once_in_the_job_and_loads_bit_exact(replicated, world):
    size = _data_bytes(replicated)
    got = run_ranks(_load_replicated, world, replicated, env=_ON, preload=_PRELOAD)
    read = sum(r for r, _ in got)
    assert read <= 1.05 * size, (read, size, got)
    assert all(p > 0 for _, p in got), got   # every rank received a share from the others
    if world == 4:
        # Off: every rank reads everything itself.
        off = run_ranks(_load_replicated, world, replicated, env={"DISTCKPT_READ_ONCE": "off"}, preload=_PRELOAD)
        assert sum(r for r, _ in off) >= 0.95 * world * size, off
        assert all(p == 0 for _, p in off), off


def test_hsdp_replicas_read_each_shard_once(fsdp):
    size = _data_bytes(fsdp)
    got = run_ranks(_load_hsdp, 4, fsdp, env=_ON, preload=_PRELOAD)
    read = sum(r for r, _ in got)
    assert read <= 1.05 * size, (read, size, got)
    assert sum(p for _, p in got) > 0, got


def _load_expecting_checksum(rank, world, path):
    import distckpt
    from distckpt import errors
    sd = _zeros()
    try:
        distckpt.load(sd, path)
    except errors.ChecksumMismatchError as exc:
        # No byte of the corrupt block reached a tensor: big.1 is not equal to the saved one
        # only where it still holds zeros.
        bad = sd["big.1"]
        good = _model()["big.1"]
        assert torch.all((bad == good) | (bad == 0)), "a corrupt byte reached the state dict"
        own = exc.failures[rank]
        assert "big.1" not in own.filled and "big.0" in own.filled + own.partly_filled, (own.filled, own.partly_filled)
        # Every rank names the same bad block: the reader found it, its receivers were told where.
        return type(exc).__name__, sorted(exc.failed_ranks or []), (own.key, own.offset)
    raise AssertionError(f"rank {rank}: the load did not raise")


def test_a_corrupt_block_on_the_reading_rank_is_a_checksum_error_on_every_rank(replicated, tmp_path):
    import shutil

    from distckpt.storage.posix.manifests import load_manifest
    bad = str(tmp_path / "bad")
    shutil.copytree(replicated, bad)
    m = load_manifest(bad)
    chunk = m.tensors["big.1"].chunks[0]
    with open(os.path.join(bad, m.files[chunk.file].name), "r+b") as f:
        f.seek(chunk.offset + 12345)
        b = f.read(1)
        f.seek(chunk.offset + 12345)
        f.write(bytes([b[0] ^ 0xFF]))
    got = run_ranks(_load_expecting_checksum, 4, bad, env=_ON, preload=_PRELOAD)
    block = m.checksum_block
    at = chunk.offset + 12345 // block * block
    assert got == [("ChecksumMismatchError", [0, 1, 2, 3], ("big.1", at))] * 4, got


def _dying_reader(rank, world, path, where):
    import time

    import distckpt
    from distckpt import errors, readonce
    if rank == 1:
        orig = getattr(readonce.Exchange, where)
        calls = [0]

        def die(self, m, *a, **k):
            calls[0] += 1
            # _send: as the reader of its first segment, the other moves going on around it;
            # _forward: the first time it relays a segment another rank read (a tree's inner
            # node, with a child waiting on it).
            if (where == "_send" and calls[0] == 1) or (where == "_forward" and m.reader != rank and m.dst):
                os._exit(3)   # killed while it serves its group, without a word
            return orig(self, m, *a, **k)
        setattr(readonce.Exchange, where, die)
    t0 = time.monotonic()
    try:
        distckpt.load(_zeros(), path)
    except (errors.PeerLostError, errors.RankFailureError) as exc:
        elapsed = time.monotonic() - t0
        assert elapsed < 60, f"rank {rank} waited {elapsed:.1f} s for a dead peer"
        # A rank whose own part failed keeps it (the outcome exchange lost the dead rank too):
        # what it had filled, and which peer it lost.
        own = (exc.failures or {}).get(rank)
        return type(exc).__name__, own is not None and "rank 1," in str(own), getattr(exc, "filled", None) is not None
    raise AssertionError(f"rank {rank}: the load must fail when a serving rank dies")


@pytest.mark.parametrize("where", ["_send", "_forward"])
def test_a_rank_dying_while_it_serves_bytes_is_a_typed_error_on_the_others(replicated, where):
    with pytest.raises(RankError) as ei:
        run_ranks(_dying_reader, 4, replicated, where, env={**_ON, "DISTCKPT_TIMEOUT_S": "15"}, timeout=150,
                  preload=_PRELOAD)
    assert set(ei.value.errors) == {1}, "only the killed rank may be missing: the others must return"
    got = ei.value.results
    assert sorted(got) == [0, 2, 3] and all(cls == "PeerLostError" for cls, _, _ in got.values()), got
    assert any(named and filled for _cls, named, filled in got.values()), got


def _mismatch_on_rank2(rank, world, path):
    import distckpt
    from distckpt import errors, readonce
    sd = _zeros()
    if rank == 2:
        sd["big.0"] = torch.zeros(5)   # a shape that does not match, on this rank only
    moved = []
    orig = readonce.Exchange._moves
    readonce.Exchange._moves = lambda self, *a, **k: moved.append(1) or orig(self, *a, **k)
    try:
        distckpt.load(sd, path)
    except errors.StateDictMismatchError as exc:
        untouched = all(not torch.any(v) for k, v in sd.items())
        return sorted(exc.failed_ranks), untouched, moved
    raise AssertionError("the load did not raise")


def test_a_rank_failing_before_the_moves_stops_everyone_before_a_byte_is_read(replicated):
    got = run_ranks(_mismatch_on_rank2, 4, replicated, env=_ON, timeout=120, preload=_PRELOAD)
    assert got == [([2], True, [])] * 4, got


def _load_on_hosts(rank, world, path, hosts):
    import socket

    import distckpt
    # Two machines cannot run here: each rank answers the host name it would have on its node.
    socket.gethostname = lambda: f"node{rank * hosts // world}"
    sd = _zeros()
    res = distckpt.load(sd, path)
    for k, v in _model().items():
        assert torch.equal(sd[k], v), k
    return res.bytes_read, res.bytes_from_peers


def test_auto_shares_across_hosts_and_leaves_one_host_to_its_page_cache(replicated):
    size = _data_bytes(replicated)
    two = run_ranks(_load_on_hosts, 4, replicated, 2, env={"DISTCKPT_TIMEOUT_S": "30"}, preload=_PRELOAD)
    assert sum(r for r, _ in two) <= 1.05 * size and all(p > 0 for _, p in two), two
    one = run_ranks(_load_on_hosts, 4, replicated, 1, env={"DISTCKPT_TIMEOUT_S": "30"}, preload=_PRELOAD)
    assert all(p == 0 for _, p in one) and sum(r for r, _ in one) >= 0.95 * 4 * size, one
