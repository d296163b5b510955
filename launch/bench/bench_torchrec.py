"""Benchmark: sharded TorchRec embeddings (a few hundred MB) on 2 ranks, distckpt vs DCP, one run.

    torchrun --standalone --nproc-per-node 2 launch/bench/bench_torchrec.py --dir /var/tmp/bench_trec \
        --rows 600000 --dim 32 --tables 4 --repeats 3 [--drop-caches]

Model: an EmbeddingBagCollection of ``--tables`` tables (rows x dim float32) with fused
EXACT_ROWWISE_ADAGRAD, sharded column-wise / table-wise / row-wise / table-wise over 2 ranks.
For each repeat: distckpt save (TorchRec canonical form, via distckpt.integrations.torchrec),
DCP save (torch.distributed.checkpoint.save of the DMP state dict + fused optimizer state dict),
then both loads into the same model. ``--drop-caches`` drops the page cache before every load
(root only; machine-wide, so only where nobody else measures). Rank 0 prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # the repository

from distckpt.integrations import torchrec as dtr  # noqa: E402


def build(rank, world, tables, rows, dim):
    import torchrec.optim as tro
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
    from torchrec.distributed import DistributedModelParallel
    from torchrec.distributed.types import ShardingEnv
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
    ebc = EmbeddingBagCollection(tables=[EmbeddingBagConfig(name=f"t{i}", num_embeddings=rows, embedding_dim=dim,
                                                            feature_names=[f"f{i}"]) for i in range(tables)],
                                 device=torch.device("meta"))
    apply_optimizer_in_backward(tro.RowWiseAdagrad, ebc.embedding_bags.parameters(), {"lr": 0.05})
    kinds = ["column_wise:0,1", "table_wise:0", "row_wise", "table_wise:1"]
    spec = {f"t{i}": kinds[i % len(kinds)] for i in range(tables)}
    plan = dtr.hand_plan({"": ebc}, {"": spec}, world_size=world)
    return DistributedModelParallel(ebc, env=ShardingEnv.from_process_group(dist.group.WORLD), plan=plan,
                                    device=torch.device("cpu"))


def drop_caches():
    os.sync()
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("3\n")


def timed(fn):
    dist.barrier()
    t0 = time.perf_counter()
    fn()
    dist.barrier()
    return time.perf_counter() - t0


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", required=True)
    ap.add_argument("--rows", type=int, default=600_000)
    ap.add_argument("--dim", type=int, default=32)
    ap.add_argument("--tables", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--drop-caches", action="store_true")
    args = ap.parse_args()
    import torch.distributed.checkpoint as dcp
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    dmp = build(rank, world, args.tables, args.rows, args.dim)
    nbytes = args.tables * args.rows * args.dim * 4
    res = {"distckpt_save": [], "dcp_save": [], "distckpt_load": [], "dcp_load": []}
    for r in range(args.repeats):
        d_path, c_path = os.path.join(args.dir, f"distckpt_{r}"), os.path.join(args.dir, f"dcp_{r}")
        if rank == 0:
            for p in (d_path, c_path):
                shutil.rmtree(p, ignore_errors=True)
        dist.barrier()
        res["distckpt_save"].append(timed(lambda: dtr.save(dmp, d_path)))
        res["dcp_save"].append(timed(lambda: dcp.save({"model": dmp.state_dict(),
                                                      "optim": dmp.fused_optimizer.state_dict()},
                                                     checkpoint_id=c_path)))
        for name, fn in (("distckpt_load", lambda: dtr.load(dmp, d_path)),
                         ("dcp_load", lambda: dcp.load({"model": dmp.state_dict(),
                                                        "optim": dmp.fused_optimizer.state_dict()},
                                                       checkpoint_id=c_path))):
            if args.drop_caches and rank == 0:
                drop_caches()
            res[name].append(timed(fn))
        if rank == 0:
            for p in (d_path, c_path):
                shutil.rmtree(p, ignore_errors=True)
    if rank == 0:
        out = {"world": world, "table_bytes": nbytes, "tables": args.tables, "rows": args.rows, "dim": args.dim,
               "drop_caches": args.drop_caches, "repeats": args.repeats}
        for k, v in res.items():
            out[k + "_median_s"] = round(statistics.median(v), 3)
            out[k + "_all_s"] = [round(x, 3) for x in v]
            out[k + "_GBps"] = round(nbytes / statistics.median(v) / 1e9, 3)
        print(json.dumps(out), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
