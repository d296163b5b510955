"""Loading a DCP checkpoint with distckpt against dcp.load, whole and one key, in one run.

    torchrun --standalone --nproc-per-node 2 launch/bench/bench_dcp_source.py --dir DIR
        [--tensors 1000] [--rows 64] [--cols 256] [--repeat 5]

Every rank saves (``dcp.save``, DCP's FileSystemWriter) a state of ``--tensors`` float32 DTensors
of ``rows x cols`` sharded on dim 0 over the world (an FSDP2 layout: one chunk per rank per
tensor, each a torch.save archive inside the ``.distcp`` files), then, ``--repeat`` times and
alternating which goes first: ``distckpt.load`` and ``dcp.load`` of the whole state into the same
sharding, and of one key (``distckpt.read(keys=[...])`` on each rank against ``dcp.load`` of a
one-key state). Page cache warm (the files were just written). Prints the slowest rank's median
and min..max per case and the ratios (DCP's time / distckpt's: above 1 is faster). Removes what
it wrote.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import time
import warnings

import torch
import torch.distributed as dist


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", required=True)
    ap.add_argument("--tensors", type=int, default=1000)
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--cols", type=int, default=256)
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    warnings.simplefilter("ignore")
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    import distckpt

    mesh = init_device_mesh("cpu", (world,))
    g = torch.Generator().manual_seed(0)

    def state(fill: bool) -> dict:
        return {f"layers.{i}.weight": distribute_tensor(
            torch.randn(args.rows, args.cols, generator=g) if fill else torch.zeros(args.rows, args.cols), mesh,
            [Shard(0)]) for i in range(args.tensors)}

    path = os.path.join(args.dir, "dcp_source")
    if rank == 0:
        shutil.rmtree(path, ignore_errors=True)
    dist.barrier()
    saved = state(True)
    dcp.save(saved, checkpoint_id=path)
    one = "layers.%d.weight" % (args.tensors // 2)
    cases = {
        "whole: distckpt.load": lambda: distckpt.load(state(False), path),
        "whole: dcp.load": lambda: dcp.load(state(False), checkpoint_id=path),
        "one key: distckpt.read": lambda: distckpt.read(path, keys=[one]),
        "one key: dcp.load": lambda: dcp.load({one: state(False)[one]}, checkpoint_id=path),
    }
    times: dict[str, list[float]] = {k: [] for k in cases}
    names = list(cases)
    for r in range(args.repeat):
        for name in (names if r % 2 == 0 else names[::-1]):
            dist.barrier()
            t = time.perf_counter()
            cases[name]()
            mine = torch.tensor([time.perf_counter() - t])
            dist.all_reduce(mine, op=dist.ReduceOp.MAX)
            times[name].append(mine.item())
    if rank == 0:
        nbytes = args.tensors * args.rows * args.cols * 4
        print(f"{world} ranks, {args.tensors} tensors of {args.rows}x{args.cols} float32 sharded on dim 0 "
              f"({nbytes / 2**20:.0f} MiB, {args.tensors * world} chunks), warm, {args.repeat} rounds")
        med = {k: statistics.median(v) for k, v in times.items()}
        for k, v in times.items():
            print(f"  {k:24s} {med[k]:.3f} s ({min(v):.3f}..{max(v):.3f})")
        for what in ("whole", "one key"):
            d = [k for k in names if k.startswith(what) and "dcp" in k.split(":")[1]][0]
            o = [k for k in names if k.startswith(what) and "distckpt" in k][0]
            print(f"  {what}: DCP / distckpt = {med[d] / med[o]:.2f}x")
    dist.barrier()
    if rank == 0:
        shutil.rmtree(path, ignore_errors=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
