"""TieredCheckpointManager on two real gloo ranks, each its own "node" (its own local directory),
with a directory as the remote tier: the collective paths that one process cannot reach (a
collective error carries every rank's failure). The object-store tiers: tests/s3/test_tiers_*.py."""

from __future__ import annotations

import logging
import os

import torch

from ..helpers.distributed import run_ranks


def _state(step: int, rank: int, n: int = 1 << 14) -> dict:
    g = torch.Generator().manual_seed(step * 100 + rank)
    return {f"w{rank}": torch.randn(n, generator=g), "step": step}


def _damaged_local_body(rank: int, world_size: int, tmp: str) -> dict:
    from distckpt import errors
    from distckpt.tiers import TieredCheckpointManager
    local, remote = os.path.join(tmp, f"node{rank}"), os.path.join(tmp, "remote")
    with TieredCheckpointManager(local, remote, keep_last_local=2) as mgr:
        mgr.save(1, _state(1, rank))
        assert mgr.wait_durable(1, timeout=120).durable
    torch.distributed.barrier()
    if rank == 1:  # one byte of node 1's own data file (a rank's failure, not rank 0's)
        path = os.path.join(local, "step_00000001", "rank00001.bin")
        with open(path, "r+b") as f:
            f.seek(100)
            b = f.read(1)
            f.seek(100)
            f.write(bytes([b[0] ^ 1]))
    torch.distributed.barrier()
    said: list[str] = []

    class Catch(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            said.append(record.getMessage())

    catch = Catch(level=logging.WARNING)
    logging.getLogger("distckpt").addHandler(catch)
    out = {f"w{rank}": torch.zeros(1 << 14), "step": -1}
    try:
        with TieredCheckpointManager(local, remote, keep_last_local=2) as mgr:
            try:
                result = mgr.load(out)
            except errors.ChecksumMismatchError as exc:
                return {"error": f"{type(exc).__name__}: {exc}"}
    finally:
        logging.getLogger("distckpt").removeHandler(catch)
    return {"error": None, "exact": out["step"] == 1 and torch.equal(out[f"w{rank}"], _state(1, rank)[f"w{rank}"]),
            "local_bytes": result.bytes_by_tier["local"], "remote_bytes": result.bytes_by_tier["remote"],
            "warned": [m for m in said if "is damaged" in m and "from the remote tier" in m]}


def test_a_local_file_damaged_on_one_rank_is_loaded_from_the_remote_tier_on_every_rank(tmp_path):
    """A checksum error on rank 1 reaches every rank as a collective error whose ``failures`` is
    {rank: error}: the manager must read its errors (not its rank numbers) to see that only a
    local file is damaged, then load the step from the remote tier, bit-exact, with a warning."""
    results = run_ranks(_damaged_local_body, 2, str(tmp_path), timeout=240)
    damaged = str(tmp_path / "node1" / "step_00000001" / "rank00001.bin")
    for rank, r in enumerate(results):
        assert r["error"] is None, (rank, r["error"])
        assert r["exact"] and r["local_bytes"] == 0 < r["remote_bytes"], (rank, r)
        assert any(damaged in m for m in r["warned"]), (rank, r["warned"])
