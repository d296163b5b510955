"""One rank of the simulated multi-node job of tests/s3/test_s3_multinode.py, started by torchrun.

Usage: torchrun ... tests/helpers/s3_node_worker.py URL. The S3 endpoint and keys come from the standard
AWS variables only (no storage_options): what a job on a cluster without a shared file system does.
Saves a state dict of DTensors sharded over every rank plus one key per rank, then prints one
JSON line describing where this rank ran (its HOME, TMPDIR and working directory).
"""

import json
import os
import sys

import torch
import torch.distributed as dist


def expected() -> dict[str, torch.Tensor]:
    """The full (unsharded) values; the test rebuilds them to check the restore bit for bit."""
    g = torch.Generator().manual_seed(2024)
    return {
        "w": torch.randn(37, 11, generator=g),                       # uneven over 2 ranks
        "emb": torch.randn(300, 64, generator=g).to(torch.bfloat16),
        "big": torch.randn(1 << 19, 4, generator=g),                 # 8 MiB: a multipart upload per rank
    }


def main() -> None:
    url = sys.argv[1]
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    import distckpt

    mesh = init_device_mesh("cpu", (world,))
    sd = {"model": {k: distribute_tensor(v, mesh, [Shard(0)]) for k, v in expected().items()},
          "per_rank": {f"rank{rank}": torch.full((5,), rank, dtype=torch.int64)},
          "step": 42}
    result = distckpt.save(sd, url)
    # One write per line (print writes the newline apart): ranks share torchrun's stdout.
    sys.stdout.write(json.dumps({"rank": rank, "world": world, "node_rank": int(os.environ.get("GROUP_RANK", -1)),
                                 "home": os.environ["HOME"], "tmpdir": os.environ["TMPDIR"], "cwd": os.getcwd(),
                                 "bytes": result.bytes_per_rank}) + "\n")
    sys.stdout.flush()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
