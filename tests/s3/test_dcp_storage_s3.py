"""DCP's save and load with distckpt's storage layer on an object store (the real S3 server):
dcp.save with DistCkptStorageWriter("s3://...") at 2 ranks, dcp.load in one process, bit-exact; the
objects are a distckpt checkpoint (MANIFEST last)."""

from __future__ import annotations

import torch
import torch.distributed.checkpoint as dcp

from distckpt.integrations.dcp import DistCkptStorageReader, DistCkptStorageWriter
from tests.helpers.distributed import run_ranks


def _state(world: int, seed: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    mesh = init_device_mesh("cpu", (world,))
    full = torch.randn(64, 33, generator=torch.Generator().manual_seed(seed))
    return {"w": distribute_tensor(full, mesh, [Shard(0)]), "step": seed}


def _save(rank, world, url, options):
    state = _state(world, 3)
    dcp.save(state, storage_writer=DistCkptStorageWriter(url, storage_options=options))
    return state["w"].full_tensor()


def test_dcp_save_and_load_through_distckpt_on_s3(s3_bucket):
    url = f"{s3_bucket.url}/run/step_1"
    saved = run_ranks(_save, 2, url, s3_bucket.storage_options, timeout=240)[0]
    assert sorted(k.rsplit("/", 1)[-1] for k in s3_bucket.keys("run/step_1/")) == \
        ["MANIFEST", "rank00000.bin", "rank00001.bin"]
    # Loaded by this one process (DCP without a process group) into a plain tensor: resharded.
    state = {"w": torch.zeros(64, 33), "step": 0}
    dcp.load(state, storage_reader=DistCkptStorageReader(url, storage_options=s3_bucket.storage_options))
    assert torch.equal(state["w"], saved) and state["step"] == 3
