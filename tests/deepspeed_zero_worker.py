"""torchrun worker for tests/test_deepspeed_zero.py: real DeepSpeed engines on CPU (gloo).

    torchrun --nproc_per_node N tests/deepspeed_zero_worker.py save STAGE DTYPE CKPT OUT
    torchrun --nproc_per_node M tests/deepspeed_zero_worker.py load STAGE DTYPE CKPT OUT [EXPECT]

``save``: train 3 steps, save with distckpt.integrations.deepspeed.save (and with DeepSpeed's own
engine.save_checkpoint under OUT/ds, for zero_to_fp32), then write the reference: every
parameter's full fp32 master and Adam state gathered with DeepSpeed's own API
(safe_get_full_fp32_param / safe_get_full_optimizer_state; stage 0 reads its replicated tensors
directly) to OUT/ref.pt. ``load``: build the engine from a different seed, load, gather the same
way, compare bit for bit with OUT/ref.pt, train 2 more steps; every rank writes
OUT/load_M_rank<r>.json (bytes read, comparisons, losses). ``reshard_error``: expect a typed
ReshardError for the case named by EXPECT and write its class and message.
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.nn as nn

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import deepspeed  # noqa: E402
import torch.distributed as dist  # noqa: E402

import distckpt  # noqa: E402
from distckpt.errors import DistCkptError  # noqa: E402
from distckpt.integrations import deepspeed as dds  # noqa: E402


class Net(nn.Module):
    def __init__(self, widths=(256, 512, 300, 11)):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in zip(widths[:-1], widths[1:]))
        self.register_buffer("scale", torch.linspace(0.5, 1.5, widths[-1]))

    def forward(self, x):
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i < len(self.layers) - 1:
                x = torch.relu(x)
        return x * self.scale.to(x.dtype)


def engine_for(stage: int, dtype: str, seed: int, widths=(256, 512, 300, 11), lr: float = 1e-3):
    torch.manual_seed(seed)
    model = Net(widths)
    cfg = {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "Adam", "params": {"lr": lr, "weight_decay": 0.01}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": lr,
                                                     "warmup_num_steps": 10}},
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0,
                              "reduce_bucket_size": 1 << 16, "allgather_bucket_size": 1 << 16},
        "steps_per_print": 1 << 30,
    }
    if dtype == "bf16":
        cfg["bf16"] = {"enabled": True}
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    return engine


def train(engine, steps: int, start: int) -> list[float]:
    dtype = next(p for p in engine.module.parameters()).dtype
    losses = []
    for s in range(start, start + steps):
        g = torch.Generator().manual_seed(1000 * s + dist.get_rank())
        x = torch.randn(4, engine.module.layers[0].in_features, generator=g).to(dtype)
        y = torch.randn(4, engine.module.layers[-1].out_features, generator=g).to(dtype)
        loss = (engine(x).float() - y.float()).pow(2).mean()
        engine.backward(loss)
        engine.step()
        losses.append(float(loss))
    return losses


def gather(engine) -> dict:
    """{name: {"fp32": t, "exp_avg": t, "exp_avg_sq": t, "step": n}} through DeepSpeed's own API."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state
    out = {}
    opt = engine.optimizer
    stage = engine.zero_optimization_stage()
    if stage == 0 and type(opt).__name__ == "FP16_Optimizer":
        from torch._utils import _unflatten_dense_tensors
        names = {id(p): n for n, p in engine.module.named_parameters()}
        for g, params in enumerate(opt.fp16_groups):
            flat = opt.fp32_groups_flat[g]
            st = opt.optimizer.state[flat]
            views = {k: _unflatten_dense_tensors(v, params) for k, v in
                     [("fp32", flat), ("exp_avg", st["exp_avg"]), ("exp_avg_sq", st["exp_avg_sq"])]}
            for i, p in enumerate(params):
                out[names[id(p)]] = {k: v[i].detach().clone() for k, v in views.items()} | {"step": int(st["step"])}
        return out
    for name, p in engine.module.named_parameters():
        if stage == 0:
            st = opt.state[p]
            out[name] = {"fp32": p.detach().clone(), "exp_avg": st["exp_avg"].clone(),
                         "exp_avg_sq": st["exp_avg_sq"].clone(), "step": int(st["step"])}
            continue
        entry = {"fp32": safe_get_full_fp32_param(p).detach().clone().reshape(p.ds_shape if stage == 3 else p.shape)}
        for k in ("exp_avg", "exp_avg_sq"):
            entry[k] = safe_get_full_optimizer_state(p, k).detach().clone().reshape(entry["fp32"].shape)
        out[name] = entry
    # step: one per flat group; every parameter of a group has it
    steps = {int(st["step"]) for st in opt.optimizer.state.values()} if stage else None
    if steps is not None:
        for e in out.values():
            e["step"] = sorted(steps)
    return out


def main() -> None:
    mode, stage, dtype, ckpt, out = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5]
    deepspeed.init_distributed(dist_backend="gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if mode == "save":
        engine = engine_for(stage, dtype, seed=0)
        losses = train(engine, 3, 0)
        res = dds.save(engine, ckpt, client_state={"epoch": 7, "note": "x"})
        engine.save_checkpoint(os.path.join(out, "ds"), tag="t")
        ref = gather(engine)
        cont = train(engine, 2, 3)  # the run that never stopped
        if rank == 0:
            torch.save({"ref": ref, "losses": losses, "cont": cont, "bytes": res.total_bytes}, os.path.join(out, "ref.pt"))
        dist.barrier()
    elif mode == "load":
        engine = engine_for(stage, dtype, seed=123)
        ld = dds.load(engine, ckpt)
        got = gather(engine)
        ref = torch.load(os.path.join(out, "ref.pt"), weights_only=True)
        bad = []
        for name, entry in ref["ref"].items():
            for k, v in entry.items():
                g = got[name][k]
                same = (g == v) if not torch.is_tensor(v) else (g.dtype == v.dtype and g.shape == v.shape
                                                                and torch.equal(g, v))
                if not same:
                    bad.append(f"{name}.{k}")
        # the module's (bf16 or fp32) weights were rebuilt from the masters
        dtype_ = next(p for p in engine.module.parameters()).dtype
        mism = []
        if stage < 3:
            for name, p in engine.module.named_parameters():
                if not torch.equal(p.detach(), ref["ref"][name]["fp32"].to(dtype_)):
                    mism.append(name)
        cont = train(engine, 2, 3)
        doc = {"rank": rank, "world": world, "bytes_read": ld.result.bytes_read,
               "ckpt_bytes": sum(os.path.getsize(os.path.join(ckpt, f)) for f in os.listdir(ckpt) if f.endswith(".bin")),
               "bad": bad, "module_mismatch": mism, "cont": cont, "ref_cont": ref["cont"],
               "client": ld.client_state, "saved_dp": ld.saved_dp_size, "global_steps": engine.global_steps,
               "lr": engine.optimizer.param_groups[0]["lr"] if stage else engine.optimizer.param_groups[0]["lr"]}
        with open(os.path.join(out, f"load_{world}_rank{rank}.json"), "w") as f:
            json.dump(doc, f)
    elif mode == "reshard_error":
        expect = sys.argv[6]
        if expect == "shape":
            engine = engine_for(stage, dtype, seed=1, widths=(256, 512, 301, 11))
        elif expect == "stage":
            engine = engine_for(3 if stage != 3 else 1, dtype, seed=1)
        else:
            raise SystemExit(f"unknown case {expect}")
        try:
            dds.load(engine, ckpt)
            doc = {"raised": None}
        except DistCkptError as exc:
            doc = {"raised": type(exc).__name__, "message": str(exc)}
        with open(os.path.join(out, f"err_{expect}_rank{rank}.json"), "w") as f:
            json.dump(doc, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
