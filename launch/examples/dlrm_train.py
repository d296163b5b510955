"""A small DLRM-style TorchRec training job that checkpoints through distckpt and resumes exactly.

    torchrun --standalone --nproc-per-node 2 launch/examples/dlrm_train.py --root /tmp/dlrm --steps 40 --every 5
    # kill it at any time (or pass --crash-at-step 23: SIGKILL on every rank), then run the same
    # command again: it restores the newest committed step and continues; every loss after the
    # restore equals the uninterrupted run's (see launch/examples/dlrm_resume_check.sh).

The model: an EmbeddingBagCollection (fused EXACT_ROWWISE_ADAGRAD / EXACT_ADAGRAD tables, sharded
by a hand-built plan: column-wise, table-wise, row-wise and data-parallel on 2 ranks), a bottom MLP
and a top MLP (DDP-wrapped by DistributedModelParallel, torch Adagrad). The batch of step s is a
function of s only, so a resumed run sees exactly the data the uninterrupted run saw.
Losses go to ROOT/losses.txt ("step loss" with the float's repr; a resumed run appends, the last
line of a step wins).

Checkpoint = model + fused optimizer state + dense optimizer + step, in distckpt's TorchRec
canonical form (distckpt.integrations.torchrec), so it can also be restored on another world size
or plan (see launch/examples/torchrec_reshard.py).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # the repository

import distckpt  # noqa: E402
from distckpt.integrations import torchrec as dtr  # noqa: E402

TABLES = {"t0": (2000, 16, "rowwise"), "t1": (1500, 16, "adagrad"), "t2": (3000, 16, "rowwise"),
          "t3": (500, 16, "adagrad")}
DENSE_IN = 13
GLOBAL_BATCH = 64
PLANS = {
    2: {"t0": "column_wise:0,1", "t1": "table_wise:1", "t2": "row_wise", "t3": "data_parallel"},
    1: {"t0": "column_wise:0,0", "t1": "table_wise:0", "t2": "row_wise", "t3": "data_parallel"},
}


class DLRM(torch.nn.Module):
    def __init__(self):
        super().__init__()
        from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
        self.sparse = EmbeddingBagCollection(tables=[
            EmbeddingBagConfig(name=t, num_embeddings=r, embedding_dim=d, feature_names=[f"f_{t}"])
            for t, (r, d, _o) in TABLES.items()], device=torch.device("meta"))
        dim = 16
        self.bottom = torch.nn.Sequential(torch.nn.Linear(DENSE_IN, 32), torch.nn.ReLU(), torch.nn.Linear(32, dim))
        self.top = torch.nn.Sequential(torch.nn.Linear(dim * (len(TABLES) + 1), 32), torch.nn.ReLU(),
                                       torch.nn.Linear(32, 1))

    def forward(self, dense_x, kjt):
        emb = self.sparse(kjt).values()
        return self.top(torch.cat([self.bottom(dense_x), emb], dim=1)).squeeze(1)


def build(rank: int, world: int, plan_spec: dict, *, dtensor: bool = False):
    import torchrec.optim as tro
    from torchrec.distributed import DistributedModelParallel
    from torchrec.distributed.types import ShardingEnv
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
    from torchrec.optim.keyed import KeyedOptimizerWrapper
    from torchrec.optim.optimizers import in_backward_optimizer_filter
    torch.manual_seed(0)
    model = DLRM()
    for t, (_r, _d, opt) in TABLES.items():
        cls = tro.RowWiseAdagrad if opt == "rowwise" else torch.optim.Adagrad
        apply_optimizer_in_backward(cls, [model.sparse.embedding_bags[t].weight], {"lr": 0.05, "eps": 1e-8})
    plan = dtr.hand_plan({"sparse": model.sparse}, {"sparse": plan_spec}, world_size=world)
    pg = dist.group.WORLD
    env = ShardingEnv(world, rank, pg, output_dtensor=True) if dtensor else ShardingEnv.from_process_group(pg)
    dmp = DistributedModelParallel(model, env=env, plan=plan, device=torch.device("cpu"))
    dense = KeyedOptimizerWrapper(dict(in_backward_optimizer_filter(dmp.named_parameters())),
                                  lambda ps: torch.optim.Adagrad(ps, lr=0.05, eps=1e-8))
    return dmp, dense


def batch(step: int, rank: int, world: int):
    """This rank's slice of the global batch of ``step`` (a function of ``step`` only)."""
    from torchrec import KeyedJaggedTensor
    g = torch.Generator().manual_seed(12345 + step)
    dense_x = torch.randn(GLOBAL_BATCH, DENSE_IN, generator=g)
    lengths = torch.randint(0, 4, (len(TABLES), GLOBAL_BATCH), generator=g)
    values = [torch.randint(0, r, (int(lengths[i].sum()),), generator=g) for i, (r, _d, _o) in enumerate(TABLES.values())]
    labels = (torch.rand(GLOBAL_BATCH, generator=g) < 0.3).float()
    per = GLOBAL_BATCH // world
    lo, hi = rank * per, (rank + 1) * per
    vals, lens = [], []
    for i in range(len(TABLES)):
        offs = torch.cat([torch.zeros(1, dtype=torch.int64), lengths[i].cumsum(0)])
        vals.append(values[i][offs[lo]:offs[hi]])
        lens.append(lengths[i][lo:hi])
    kjt = KeyedJaggedTensor.from_lengths_sync(keys=[f"f_{t}" for t in TABLES], values=torch.cat(vals),
                                              lengths=torch.cat(lens))
    return dense_x[lo:hi], kjt, labels[lo:hi]


def train_step(dmp, dense, step: int, rank: int, world: int) -> float:
    dense_x, kjt, labels = batch(step, rank, world)
    logits = dmp(dense_x, kjt)
    loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, labels, reduction="sum")
    (loss * world / GLOBAL_BATCH).backward()  # gradients of the global mean loss, whatever the world
    dense.step()
    dense.zero_grad()
    total = loss.detach().clone()
    dist.all_reduce(total)
    return float(total) / GLOBAL_BATCH


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--root", required=True)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--every", type=int, default=5, help="checkpoint every K steps")
    ap.add_argument("--keep-last", type=int, default=2)
    ap.add_argument("--crash-at-step", type=int, default=None, help="SIGKILL every rank after this step")
    ap.add_argument("--dtensor", action="store_true", help="ShardingEnv(output_dtensor=True)")
    ap.add_argument("--approximate-rowwise", action="store_true")
    args = ap.parse_args()

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    dmp, dense = build(rank, world, PLANS[world], dtensor=args.dtensor)
    mgr = distckpt.CheckpointManager(os.path.join(args.root, "ckpt"), keep_last=args.keep_last)
    start = 0
    latest = mgr.latest_step()
    if latest is not None:
        extra = {"step": 0}
        dtr.load(dmp, mgr.path(latest), optimizers=[dense], extra=extra,
                 approximate_rowwise=args.approximate_rowwise)
        start = extra["step"]
        if rank == 0:
            print(f"resumed from {mgr.path(latest)} at step {start} on {world} rank(s)", flush=True)
    log = open(os.path.join(args.root, "losses.txt"), "a") if rank == 0 else None
    for step in range(start, args.steps):
        loss = train_step(dmp, dense, step, rank, world)
        if log:
            log.write(f"{step} {loss!r}\n")
            log.flush()
        done = step + 1
        if done % args.every == 0 or done == args.steps:
            sd = dtr.state_dict(dmp, optimizers=[dense], extra={"step": done})
            mgr.save(done, sd, replicated=dtr.rank0_keys(sd))  # per-rank dense ``step`` counters
        if args.crash_at_step is not None and done == args.crash_at_step:
            os.kill(os.getpid(), signal.SIGKILL)
    if log:
        log.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
