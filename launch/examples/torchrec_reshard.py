"""Resharding example: save a TorchRec DLRM on 2 ranks, resume it on 1 (or the reverse).

    torchrun --standalone --nproc-per-node 2 launch/examples/torchrec_reshard.py save   --root /tmp/rs
    torchrun --standalone --nproc-per-node 1 launch/examples/torchrec_reshard.py resume --root /tmp/rs

``save`` trains the model of launch/examples/dlrm_train.py for a few steps on its world's plan (2 ranks:
t0 column-wise, t1 table-wise, t2 row-wise, t3 data-parallel) and saves it. ``resume`` builds the
model on its own world size and plan (1 rank: t0 keeps its two column blocks, on rank 0) and
restores: tables, fused optimizer state (row-wise adagrad included), the dense MLPs and their
optimizer. It then re-saves and checks every full tensor bit for bit against the checkpoint, shows
that a plan merging t0's column blocks is refused with a typed ReshardError (its per-row state is
not exactly derivable), and trains on.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # the repository

import dlrm_train as dl  # noqa: E402

from distckpt.errors import ReshardError  # noqa: E402
from distckpt.integrations import torchrec as dtr  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("mode", choices=["save", "resume"])
    ap.add_argument("--root", required=True)
    ap.add_argument("--steps", type=int, default=5)
    args = ap.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    ckpt = os.path.join(args.root, "ckpt")
    dmp, dense = dl.build(rank, world, dl.PLANS[world])
    if args.mode == "save":
        for step in range(args.steps):
            loss = dl.train_step(dmp, dense, step, rank, world)
            if rank == 0:
                print(f"step {step} loss {loss!r}")
        res = dtr.save(dmp, ckpt, optimizers=[dense], extra={"step": args.steps}, overwrite=True)
        if rank == 0:
            print(f"saved {ckpt} on {world} rank(s): {res}")
    else:
        extra = {"step": 0}
        t0 = __import__("time").monotonic()
        dtr.load(dmp, ckpt, optimizers=[dense], extra=extra)
        took = __import__("time").monotonic() - t0
        resaved = os.path.join(args.root, f"resaved_w{world}")
        dtr.save(dmp, resaved, optimizers=[dense], overwrite=True)
        if rank == 0:
            a, b = dtr.read_tables(ckpt), dtr.read_tables(resaved)
            n = 0
            for group in ("model", "optim"):
                for k, v in a[group].items():
                    if isinstance(v, dict):
                        for s, t in v.items():
                            assert torch.equal(t, b[group][k][s]), (k, s)
                            n += 1
                    else:
                        assert torch.equal(v, b[group][k]), k
                        n += 1
            print(f"restored step {extra['step']} on {world} rank(s) in {took:.2f}s; {n} full tensors bit-identical")
        # A plan that merges t0's two column blocks into one: refused, nothing silently wrong.
        merged = dict(dl.PLANS[world], t0="table_wise:0")
        dmp2, dense2 = dl.build(rank, world, merged)
        try:
            dtr.load(dmp2, ckpt, optimizers=[dense2])
            raise SystemExit("expected a ReshardError")
        except ReshardError as exc:
            if rank == 0:
                print(f"as expected, t0 column-wise -> table-wise refused: {exc.message[:160]}...")
        for step in range(extra["step"], extra["step"] + 3):
            loss = dl.train_step(dmp, dense, step, rank, world)
            if rank == 0:
                print(f"step {step} loss {loss!r}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
