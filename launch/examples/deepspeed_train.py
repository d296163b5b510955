"""A DeepSpeed training job whose checkpoints go through distckpt: the user's code is DeepSpeed's,
plus one line (``install``). Resumes from ``latest`` when there is one, on any number of ranks.

    DS_ACCELERATOR=cpu torchrun --standalone --nproc-per-node 2 launch/examples/deepspeed_train.py \
        --ckpt /tmp/ds_ckpt --steps 12 --save-every 3 --stage 2 [--bf16] [--kill-at 8]

Each rank trains on its own deterministic batches (seeded by step and rank); rank 0 prints one
line per step and ``resumed ...`` after a load. ``--kill-at N`` SIGKILLs rank 0 at step N
(between checkpoints), like a node failure: launch/examples/deepspeed_resume.sh restarts the job from the
last checkpoint on another number of ranks.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # the repository
# DeepSpeed JIT-compiles its CPU ops at start-up: into this interpreter's venv unless told otherwise,
# not into the user-wide cache that every venv of the machine rebuilds with its own flags.
os.environ.setdefault("TORCH_EXTENSIONS_DIR", os.path.join(sys.prefix, "torch_extensions"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ckpt", required=True)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--save-every", type=int, default=3)
    ap.add_argument("--stage", type=int, default=2)
    ap.add_argument("--bf16", action="store_true")
    ap.add_argument("--keep-last", type=int, default=2)
    ap.add_argument("--kill-at", type=int, default=None)
    args = ap.parse_args()

    import deepspeed
    import torch.distributed as dist
    import distckpt.integrations.deepspeed as dsd

    deepspeed.init_distributed(dist_backend="gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256),
                                torch.nn.ReLU(), torch.nn.Linear(256, 4))
    config = {
        "train_micro_batch_size_per_gpu": 8,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "torch_adam": True}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": 1e-3, "warmup_num_steps": 5}},
        "zero_optimization": {"stage": args.stage, "stage3_param_persistence_threshold": 0},
        "bf16": {"enabled": args.bf16},
        "steps_per_print": 10 ** 9,
    }
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)

    dsd.install(engine, keep_last=args.keep_last)  # <- the one line distckpt adds

    # (path of the model-states file loaded, client_state), as DeepSpeed's; None, None on a fresh start
    path, client = engine.load_checkpoint(args.ckpt)
    start = 0
    if path is not None:
        start = client["step"]
        if rank == 0:
            print(f"resumed from {os.path.dirname(path)} at step {start} (saved by {client['world']} ranks, "
                  f"now {world})", flush=True)
    for step in range(start + 1, args.steps + 1):
        if args.kill_at == step and rank == 0:
            print(f"killing rank 0 at step {step}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        g = torch.Generator().manual_seed(1000 * step + rank)
        x, y = torch.randn(8, 32, generator=g), torch.randn(8, 4, generator=g)
        if args.bf16:
            x, y = x.bfloat16(), y.bfloat16()
        loss = torch.nn.functional.mse_loss(engine(x).float(), y.float())
        engine.backward(loss)
        engine.step()
        if rank == 0:
            print(f"step {step} loss {loss.item():.6f} lr {engine.get_lr()[0]:.6g}", flush=True)
        if step % args.save_every == 0:
            engine.save_checkpoint(args.ckpt, f"step{step}", client_state={"step": step, "world": world})
            if rank == 0:
                print(f"saved {os.path.join(args.ckpt, f'step{step}')}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
