"""Benchmark: torchtitan's save through distckpt's manager vs torchtitan's own DCP manager, one run.

    torchrun --standalone --nproc-per-node 2 launch/bench/bench_torchtitan.py \
        --dir /var/tmp/bench_tt --layers 8 --width 2048 --repeats 3

Same objects, same ranks: torchtitan's ModelWrapper (an MLP of ``--layers`` Linear(width, width)
sharded with FSDP2 ``fully_shard``), its OptimizersContainer (AdamW, so 3x the weights' bytes),
LRSchedulersContainer, ParallelAwareDataloader and a train_state (tests/helpers/torchtitan_worker.py),
after one training step. For each ``async_mode`` ("disabled", "async", "async_with_pinned_mem")
both managers are built from their Config as the Trainer builds them (interval=1, keep_latest_k=2)
and, per repeat, alternately:
  * the blocked time of ``save(step)`` plus ``maybe_wait_for_staging()`` (what the Trainer waits
    for before its next optimizer step): for "disabled" the whole durable save;
  * then, for the async modes, ``maybe_wait_for_saving()`` timed apart (the background part).
Each mode's first save of each manager is a warm-up, reported apart (``first_s``): DCP's pinned
mode starts its saver process and pins its buffers then, distckpt allocates its staging arena.
Rank 0 prints one JSON line: medians, every sample, and the ratios DCP / distckpt.
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

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # the repository
from launch.bench.bench import dir_bytes  # noqa: E402  (the repository root is on sys.path now)
from tests.helpers import torchtitan_worker as tw  # noqa: E402

MODES = ("disabled", "async", "async_with_pinned_mem")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dir", required=True)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--width", type=int, default=2048)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--modes", default=",".join(MODES))
    args = ap.parse_args()

    import torch.distributed as dist
    from torchtitan.components.checkpointer import CheckpointManager

    from distckpt.integrations.torchtitan import DistckptCheckpointManager

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.set_num_threads(1)
    objs = tw.build(dim=args.width, depth=args.layers)
    tw.train_step(objs, [])  # the optimizer's states exist from here on
    if rank == 0:
        shutil.rmtree(args.dir, ignore_errors=True)
        os.makedirs(args.dir)
    dist.barrier()

    def timed(fn) -> float:
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        dist.barrier()
        return time.perf_counter() - t0

    out: dict[str, dict] = {}
    step = 0
    for mode in args.modes.split(","):
        mgrs = {}
        for name, cls in (("dcp", CheckpointManager), ("distckpt", DistckptCheckpointManager)):
            cfg = cls.Config(enable=True, folder=os.path.join(args.dir, mode, name), interval=1, keep_latest_k=2,
                             async_mode=mode)
            mgrs[name] = cfg.build(**tw.manager_kwargs(objs))
        res: dict[str, list[float]] = {f"{n}_{k}": [] for n in mgrs for k in ("blocked", "background")}
        first: dict[str, float] = {}
        error: dict[str, str] = {}
        for rep in range(args.repeats + 1):
            for name, mgr in mgrs.items():
                if name in error:
                    continue
                step += 1
                try:
                    blocked = timed(lambda: (mgr.save(step), mgr.maybe_wait_for_staging()))
                    background = timed(mgr.maybe_wait_for_saving)
                except Exception as exc:  # noqa: BLE001 - a mode one manager cannot run is reported
                    error[name] = f"{type(exc).__name__}: {exc}"[:300]
                    continue
                if rep == 0:
                    first[name] = round(blocked + background, 3)
                else:
                    res[f"{name}_blocked"].append(blocked)
                    res[f"{name}_background"].append(background)
        for mgr in mgrs.values():
            mgr.close()
        med = {k: statistics.median(v) for k, v in res.items() if v}
        entry = {"median_s": {k: round(v, 3) for k, v in med.items()},
                 "all_s": {k: [round(x, 3) for x in v] for k, v in res.items()}, "first_s": first}
        if "dcp_blocked" in med and "distckpt_blocked" in med:
            entry["blocked_ratio_dcp_over_distckpt"] = round(med["dcp_blocked"] / med["distckpt_blocked"], 2)
        if error:
            entry["error"] = error
        if rank == 0:
            entry["bytes_per_checkpoint"] = {}
            for n in mgrs:
                root = os.path.join(args.dir, mode, n)
                steps = sorted(d for d in os.listdir(root) if os.path.isdir(os.path.join(root, d))
                               and d.startswith("step")) if os.path.isdir(root) else []
                if steps:
                    entry["bytes_per_checkpoint"][n] = dir_bytes(os.path.join(root, steps[-1]))
        out[mode] = entry
        dist.barrier()
        if rank == 0:
            shutil.rmtree(os.path.join(args.dir, mode), ignore_errors=True)
    if rank == 0:
        params = sum(p.numel() for p in objs["model"].parameters())
        print(json.dumps({"ranks": dist.get_world_size(), "params": params, "repeats": args.repeats,
                          "state_mb": round(params * 4 * 3 / 2 ** 20), "modes": out}))
        shutil.rmtree(args.dir, ignore_errors=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
