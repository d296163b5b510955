"""Benchmark: DeepSpeed's own checkpoint engine (torch.save) vs distckpt's (install()), one run.

    DS_ACCELERATOR=cpu torchrun --standalone --nproc-per-node 2 launch/bench/bench_deepspeed.py \
        --dir /var/tmp/bench_ds --layers 12 --width 2048 --stage 2 --repeats 3 [--drop-caches] [--offload]

Same engine, same ranks, same tags: a DeepSpeed engine (an MLP of ``--layers`` Linear(width,
width) layers, Adam, ZeRO ``--stage``, fp32 or ``--bf16``; ``--offload``: ZeRO-Offload of the
optimizer to the CPU, DeepSpeedCPUAdam, and at stage 3 of the parameters too) trains one step; then per repeat
  * DeepSpeed default: ``engine.save_checkpoint(dir_ds, tag)`` with its TorchCheckpointEngine
    (torch.save of every file; it does not fsync), then ``os.sync()`` timed apart so the durable
    cost shows too, then ``engine.load_checkpoint(dir_ds, tag)``;
  * distckpt: the same calls with distckpt's engine installed (durable when it returns).
``--drop-caches`` drops the page cache before every load (root only; machine-wide). Bytes written
is the size of the tag directory's files. Rank 0 prints one JSON line with medians and ratios.
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
from launch.bench.bench import dir_bytes, drop_caches  # noqa: E402  (the repository root is on sys.path now)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dir", required=True)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--width", type=int, default=2048)
    ap.add_argument("--stage", type=int, default=2)
    ap.add_argument("--bf16", action="store_true")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--drop-caches", action="store_true")
    ap.add_argument("--offload", action="store_true")
    args = ap.parse_args()

    import deepspeed
    import torch.distributed as dist
    import distckpt.integrations.deepspeed as dsd

    deepspeed.init_distributed(dist_backend="gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(args.width, args.width) for _ in range(args.layers)])
    cfg = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "Adam", "params": {"lr": 1e-4, "torch_adam": True}},
           "zero_optimization": {"stage": args.stage, "stage3_param_persistence_threshold": 0},
           "bf16": {"enabled": args.bf16}, "steps_per_print": 10 ** 9}
    if args.offload:  # DeepSpeedCPUAdam steps the offloaded state (torch_adam would step it on the CPU too)
        cfg["optimizer"]["params"].pop("torch_adam")
        cfg["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
        if args.stage == 3:
            cfg["zero_optimization"]["offload_param"] = {"device": "cpu"}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    x = torch.randn(2, args.width)
    loss = engine(x.bfloat16() if args.bf16 else x).float().pow(2).mean()
    engine.backward(loss)
    engine.step()

    default_ce = engine.checkpoint_engine
    ce = dsd.install(engine)
    cls = type(engine)

    def timed(fn) -> float:
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        dist.barrier()
        return time.perf_counter() - t0

    def with_default(fn):
        # DeepSpeed's own engine and methods, on the same engine object
        def run():
            engine.checkpoint_engine = default_ce
            try:
                fn()
            finally:
                engine.checkpoint_engine = ce
        return run

    roots = {"deepspeed": os.path.join(args.dir, "ds"), "distckpt": os.path.join(args.dir, "dc")}
    if rank == 0:
        for r in roots.values():
            shutil.rmtree(r, ignore_errors=True)
            os.makedirs(r)
    dropped = False
    res: dict[str, list[float]] = {k: [] for k in ("ds_save", "ds_sync", "ds_load", "dc_save", "dc_load")}
    sizes = {}
    for rep in range(args.repeats):
        tag = f"r{rep}"
        res["ds_save"].append(timed(with_default(lambda: cls.save_checkpoint(engine, roots["deepspeed"], tag))))
        res["ds_sync"].append(timed(os.sync))
        res["dc_save"].append(timed(lambda: engine.save_checkpoint(roots["distckpt"], tag)))
        if rank == 0:
            sizes = {k: dir_bytes(os.path.join(r, tag)) for k, r in roots.items()}
        if args.drop_caches:
            dist.barrier()
            dropped = drop_caches() if rank == 0 else dropped
        res["ds_load"].append(timed(with_default(lambda: cls.load_checkpoint(engine, roots["deepspeed"], tag))))
        if args.drop_caches:
            dist.barrier()
            if rank == 0:
                drop_caches()
        res["dc_load"].append(timed(lambda: engine.load_checkpoint(roots["distckpt"], tag)))
        if rank == 0:  # keep one tag of each on disk at a time
            for r in roots.values():
                for name in os.listdir(r):
                    if name not in (tag, "latest") and not name.startswith("."):
                        p = os.path.join(r, name)
                        shutil.rmtree(p) if os.path.isdir(p) else os.remove(p)
    if rank == 0:
        med = {k: statistics.median(v) for k, v in res.items()}
        params = sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters())  # (ZeRO-3: partitioned)
        print(json.dumps({
            "ranks": dist.get_world_size(), "stage": args.stage, "dtype": "bf16" if args.bf16 else "fp32",
            "offload": args.offload,
            "params": params, "repeats": args.repeats, "cold_loads": bool(args.drop_caches and dropped),
            "bytes_written": {"deepspeed": sizes["deepspeed"], "distckpt": sizes["distckpt"]},
            "median_s": {k: round(v, 3) for k, v in med.items()},
            "all_s": {k: [round(x, 3) for x in v] for k, v in res.items()},
            "save_speedup": round(med["ds_save"] / med["dc_save"], 2),
            "save_speedup_vs_durable": round((med["ds_save"] + med["ds_sync"]) / med["dc_save"], 2),
            "load_speedup": round(med["ds_load"] / med["dc_load"], 2),
            "backend": ce.last_result.backend if ce.last_result else None,
        }))
    dist.barrier()
    if rank == 0:
        shutil.rmtree(args.dir, ignore_errors=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
