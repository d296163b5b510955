"""torchrun worker for tests/interop/test_dcp_storage.py: ``dcp.async_save`` in DCP's "process"
mode (a background process per rank, with its own process group) and "thread" mode through
DistCkptStorageWriter, then ``dcp.load`` through DistCkptStorageReader. It needs torchrun: DCP's
process mode starts a child process, which the test harness's daemonic ranks may not.

Usage: python -m torch.distributed.run --nproc-per-node 2 dcp_async_worker.py ROOT
Prints one line per rank: ``OK <rank> <sum of the loaded tensor> <loaded value>``."""

import os
import sys

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from distckpt.integrations.dcp import DistCkptStorageReader, DistCkptStorageWriter


def main() -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    root = sys.argv[1]
    mesh = init_device_mesh("cpu", (world,))
    state = {"w": distribute_tensor(torch.arange(40.0).view(10, 4), mesh, [Shard(0)]), "n": 5}
    for mode in ("process", "thread"):
        path = os.path.join(root, mode)
        fut = dcp.async_save(state, storage_writer=DistCkptStorageWriter(path),
                             async_checkpointer_type=AsyncCheckpointerType(mode))
        fut.result(timeout=120)
        dist.barrier()
        dst = {"w": distribute_tensor(torch.zeros(10, 4), mesh, [Shard(0)]), "n": 0}
        dcp.load(dst, storage_reader=DistCkptStorageReader(path))
        print(f"OK {mode} {rank} {dst['w'].full_tensor().sum().item()} {dst['n']}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":  # DCP's process mode spawns a child that re-imports this module
    main()
