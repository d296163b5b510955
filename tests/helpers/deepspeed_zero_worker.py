"""torchrun worker for tests/interop/test_deepspeed_zero.py: real DeepSpeed engines on CPU (gloo).

    torchrun --nproc_per_node N tests/helpers/deepspeed_zero_worker.py save ROOT 1:fp32 3:bf16 ...
    torchrun --nproc_per_node M tests/helpers/deepspeed_zero_worker.py load ROOT 1:fp32 3:bf16 ...
    torchrun --nproc_per_node M tests/helpers/deepspeed_zero_worker.py error:shape,stage ROOT 1:fp32

Each config STAGE:DTYPE uses ROOT/s<STAGE><DTYPE>/ckpt and .../out (OUT). ``save``: train 3 steps,
save with distckpt.integrations.deepspeed.save (and with DeepSpeed's own engine.save_checkpoint
under OUT/ds, for zero_to_fp32), train 2 more (the uninterrupted run), then write the reference: every
parameter's full fp32 master and Adam state gathered with DeepSpeed's own API
(safe_get_full_fp32_param / safe_get_full_optimizer_state; stage 0 reads its replicated tensors
directly) to OUT/ref.pt. ``load``: build the engine from a different seed, load, gather the same
way, compare bit for bit with OUT/ref.pt, train 2 more steps; every rank writes
OUT/load_M_rank<r>.json (bytes read, comparisons, losses). ``error:CASES``: load onto an engine
that differs (parameter shapes or set, ZeRO stage, optimizer, a checkpoint that is not a DeepSpeed
one) and write OUT/err_<case>_rank<r>.json: the error class, its message, and whether the
engine's weights were left untouched.
"""

from __future__ import annotations

import collections
import json
import math
import os
import sys
import time

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
        # non-persistent buffers, as a Hugging Face Llama's rotary embedding has: not in the
        # state dict, so not in a checkpoint's consolidated model either
        self.rotary = nn.Module()
        inv_freq = 1.0 / (10000 ** (torch.arange(0, 16, 2, dtype=torch.float32) / 16))
        self.rotary.register_buffer("inv_freq", inv_freq, persistent=False)
        self.rotary.register_buffer("original_inv_freq", inv_freq.clone(), persistent=False)

    def forward(self, x):
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i < len(self.layers) - 1:
                x = torch.relu(x)
        return x * self.scale.to(x.dtype)


def engine_for(stage: int, dtype: str, seed: int, widths=(256, 512, 300, 11), lr: float = 1e-3,
               two_groups: bool = False, adam_w_mode: bool | None = None, offload_ratio: float | None = None,
               scheduler: str = "WarmupLR"):
    """A trained-from-scratch engine. ``dtype`` is fp32 or bf16 with flags: +persist, +frozen,
    +offload (ZeRO-Offload to the CPU: DeepSpeedCPUAdam; at stage 3 the parameters too),
    +bf16master (bf16 master weights and bf16 Adam states; needs +offload)."""
    dtype, *flags = dtype.split("+")
    persist, frozen, offload = "persist" in flags, "frozen" in flags, "offload" in flags
    torch.manual_seed(seed)
    model = Net(widths)
    if "tied" in flags:  # "+tied": the first weight under a second name too (tied embeddings)
        model.alias = nn.Module()
        model.alias.weight = model.layers[0].weight
    if frozen:  # "+frozen": the first weight is not trained (a frozen base model, as under LoRA)
        model.layers[0].weight.requires_grad_(False)
    cfg = {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "Adam", "params": {"lr": lr, "weight_decay": 0.01}},
        "scheduler": {"type": scheduler, "params": {"warmup_min_lr": 0, "warmup_max_lr": lr, "warmup_num_steps": 10}
                      if scheduler == "WarmupLR" else {"total_num_steps": 100, "warmup_num_steps": 10}},
        # "+persist": ZeRO-3's default persistence threshold, so small params (biases) stay whole
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 1000 if persist else 0,
                              "reduce_bucket_size": 1 << 16, "allgather_bucket_size": 1 << 16},
        "steps_per_print": 1 << 30,
    }
    if adam_w_mode is not None:  # DeepSpeed's "Adam" is AdamW (decoupled weight decay) unless this is False
        cfg["optimizer"]["params"]["adam_w_mode"] = adam_w_mode
    if offload:
        cfg["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
        if offload_ratio is not None:
            cfg["zero_optimization"]["offload_optimizer"]["ratio"] = offload_ratio
        if stage == 3:
            cfg["zero_optimization"]["offload_param"] = {"device": "cpu"}
    if dtype == "bf16":
        cfg["bf16"] = {"enabled": True}
        if "bf16master" in flags:
            cfg["bf16"].update(bf16_master_weights_and_grads=True, bf16_optimizer_states=True)
    params = model.parameters()
    if two_groups:  # biases without weight decay: two optimizer param groups
        params = [{"params": [p for n, p in model.named_parameters() if n.endswith("weight")]},
                  {"params": [p for n, p in model.named_parameters() if n.endswith("bias")], "weight_decay": 0.0}]
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=params, config=cfg)
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
    frozen = [(n, p) for n, p in engine.module.named_parameters() if not p.requires_grad]
    with deepspeed.zero.GatheredParameters([p for _, p in frozen], enabled=stage == 3 and bool(frozen)):
        for n, p in frozen:
            out[n] = {"frozen": p.detach().clone()}
    for name, p in engine.module.named_parameters():
        if not p.requires_grad:
            continue
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
            if "frozen" not in e:
                e["step"] = sorted(steps)
    return out


def _save(stage: int, dtype: str, ckpt: str, out: str) -> None:
    rank = dist.get_rank()
    engine = engine_for(stage, dtype, seed=0)
    losses = train(engine, 3, 0)
    res = dds.save(engine, ckpt, client_state={"epoch": 7, "note": "x"})
    engine.save_checkpoint(os.path.join(out, "ds"), tag="t")
    ref = gather(engine)
    cont = train(engine, 2, 3)  # the run that never stopped
    conts = [None] * dist.get_world_size()
    dist.all_gather_object(conts, cont)
    if rank == 0:
        torch.save({"ref": ref, "losses": losses, "cont": conts, "bytes": res.total_bytes}, os.path.join(out, "ref.pt"))
    dist.barrier()


def _load(stage: int, dtype: str, ckpt: str, out: str) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
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
    mism = []
    with deepspeed.zero.GatheredParameters(list(engine.module.parameters()), enabled=stage == 3):
        for name, p in engine.module.named_parameters():
            want = ref["ref"][name].get("fp32", ref["ref"][name].get("frozen"))
            if not torch.equal(p.detach(), want.to(p.dtype)):
                mism.append(name)
    cont = train(engine, 2, 3)
    doc = {"rank": rank, "world": world, "bytes_read": ld.result.bytes_read,
           "ckpt_bytes": sum(os.path.getsize(os.path.join(ckpt, f)) for f in os.listdir(ckpt) if f.endswith(".bin")),
           "bad": bad, "compared": sum(len(e) for e in ref["ref"].values()), "module_mismatch": mism, "cont": cont,
           "ref_cont": ref["cont"][rank] if rank < len(ref["cont"]) else None, "client": ld.client_state,
           "saved_dp": ld.saved_dp_size, "global_steps": engine.global_steps,
           "lr": engine.optimizer.param_groups[0]["lr"], "finite": all(map(math.isfinite, cont))}
    with open(os.path.join(out, f"load_{world}_rank{rank}.json"), "w") as f:
        json.dump(doc, f)


def _expect_error(stage: int, dtype: str, ckpt: str, out: str, case: str) -> None:
    """Load the checkpoint onto an engine that differs in ``case``; record what was raised."""
    if case == "shape":
        engine = engine_for(stage, dtype, seed=1, widths=(256, 512, 301, 11))
    elif case == "params":
        engine = engine_for(stage, dtype, seed=1, widths=(256, 512, 300, 11, 3))
    elif case == "groups":
        engine = engine_for(stage, dtype, seed=1, two_groups=True)
    elif case == "stage":
        engine = engine_for(3 if stage != 3 else 1, dtype, seed=1)
    elif case == "adam_l2":  # DeepSpeed's Adam kernel in Adam (L2) mode; the saved one ran AdamW
        engine = engine_for(stage, dtype, seed=1, adam_w_mode=False)
    elif case == "partial":  # a share of the sub-groups stepped by a second optimizer
        engine = engine_for(stage, dtype, seed=1, offload_ratio=0.5)
    elif case == "sched_class":  # another lr scheduler: its state would not fit
        engine = engine_for(stage, dtype, seed=1, scheduler="WarmupCosineLR")
    elif case == "master_bf16":  # saved with fp32 masters, loaded onto bf16 ones: would round them
        engine = engine_for(stage, dtype + "+bf16master", seed=1)
    elif case == "optimizer":
        torch.manual_seed(1)
        model = Net()
        cfg = {"train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": stage},
               "zero_allow_untested_optimizer": True}
        if dtype == "bf16":
            cfg["bf16"] = {"enabled": True}
        engine, _, _, _ = deepspeed.initialize(model=model, config=cfg,
                                               optimizer=torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    elif case == "client_adamw":
        # not an error: a client torch.optim.AdamW (its step is a 0-d tensor), saved and loaded
        # into a fresh engine, every state tensor and hyper-parameter back exactly
        def make(seed):
            torch.manual_seed(seed)
            model = Net()
            cfg = {"train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": stage},
                   "zero_allow_untested_optimizer": True}
            if dtype == "bf16":
                cfg["bf16"] = {"enabled": True}
            opt = torch.optim.AdamW(model.parameters(), lr=0.01, betas=(0.8, 0.95))
            return deepspeed.initialize(model=model, config=cfg, optimizer=opt)[0]
        engine = make(0)
        train(engine, 2, 0)
        path = os.path.join(out, "adamw")
        dds.save(engine, path)
        fresh = make(5)
        dds.load(fresh, path)
        a, b = engine.optimizer.optimizer, fresh.optimizer.optimizer
        same = len(a.state) == len(b.state) > 0
        for (ka, sa), (kb, sb) in zip(a.state.items(), b.state.items()):
            same = same and torch.equal(ka, kb) and sorted(sa) == sorted(sb)
            same = same and all(torch.equal(sa[k], sb[k]) and sa[k].dtype == sb[k].dtype for k in sa)
        same = same and a.param_groups[0]["betas"] == b.param_groups[0]["betas"] == (0.8, 0.95)
        with open(os.path.join(out, f"err_{case}_rank{dist.get_rank()}.json"), "w") as f:
            json.dump({"raised": None, "same": bool(same), "untouched": True}, f)
        return
    elif case == "client_one_rank":
        # a client_state value only rank 1 cannot store (a dict subclass): every rank raises it at
        # once (rank 0 waited for rank 1 in the save's collective until DISTCKPT_TIMEOUT_S)
        engine = engine_for(stage, dtype, seed=1)

        class MyDict(dict):
            pass

        client = {"a": 1, "d": MyDict(x=1) if dist.get_rank() == 1 else {"x": 1}}
        t0 = time.monotonic()
        try:
            dds.save(engine, os.path.join(out, "client_one_rank"), client_state=client)
            raised = None
        except DistCkptError as exc:
            raised = {"class": type(exc).__name__, "message": str(exc), "remedy": exc.remedy}
        with open(os.path.join(out, f"err_{case}_rank{dist.get_rank()}.json"), "w") as f:
            json.dump({"raised": raised, "seconds": time.monotonic() - t0,
                       "written": os.path.exists(os.path.join(out, "client_one_rank"))}, f)
        return
    elif case == "client_rank":
        # client_state that differs per rank: StateDictMismatchError naming it, and the remedy
        # it gives (replicated="rank0", which save now takes) keeps rank 0's, as the engine does
        engine = engine_for(stage, dtype, seed=1)
        client = {"rank": dist.get_rank(), "same": 1}
        try:
            dds.save(engine, os.path.join(out, "client_rank"), client_state=client)
            raised = None
        except DistCkptError as exc:
            raised = {"class": type(exc).__name__, "message": str(exc), "remedy": exc.remedy}
        client["od"] = collections.OrderedDict([("b", 1), ("a", 2)])
        client["odd"] = {None: 1, (1, 2): "x"}  # one value, kept exactly (its keys are not the root's)
        client["param"] = torch.nn.Parameter(torch.ones(2))  # torch.save keeps a Parameter, and one
        client["param_again"] = client["param"]              # object under two keys as one
        dds.save(engine, os.path.join(out, "client_rank0"), client_state=client, replicated="rank0")
        got = dds.load(engine, os.path.join(out, "client_rank0")).client_state
        # a client_state that is itself a dict with such keys (recorded as the root, it was refused)
        dds.save(engine, os.path.join(out, "client_odd"), client_state={None: 1, (1, 2): "x"})
        whole = dds.load(engine, os.path.join(out, "client_odd")).client_state
        # an empty client_state, a dict and an OrderedDict (it came back as None: no key to read)
        empty = []
        for value in ({}, collections.OrderedDict()):
            dds.save(engine, os.path.join(out, "client_empty"), client_state=value, overwrite=True)
            back = dds.load(engine, os.path.join(out, "client_empty")).client_state
            empty.append(type(back).__name__ if back == {} else repr(back))
        kept = {"types": [type(got["od"]).__name__, list(got["od"])], "rank": got["rank"], "same": got["same"],
                "empty": empty,
                "odd": got["odd"] == {None: 1, (1, 2): "x"} and whole == {None: 1, (1, 2): "x"},
                "param": [type(got["param"]).__name__, got["param"].requires_grad, got["param_again"] is got["param"]]}
        with open(os.path.join(out, f"err_{case}_rank{dist.get_rank()}.json"), "w") as f:
            json.dump({"raised": raised, "kept": kept, "same": True, "untouched": True}, f)
        return
    elif case in ("stage2", "stage3_allowed", "rollback", "offload_on", "offload_off", "master_fp32"):
        # not an error: stage 1 -> 2 (one layout) always, stage 1 -> 3 when asked for; a rollback
        # into an engine that has trained (its optimizer state exists and is filled in place);
        # ZeRO-Offload turned on or off (FusedAdam <-> DeepSpeedCPUAdam); bf16 masters and Adam
        # states loaded onto fp32 ones (widened exactly: every value equal, in float32)
        target = {"offload_on": dtype + "+offload", "offload_off": dtype.replace("+offload", ""),
                  "master_fp32": dtype.replace("+bf16master", "")}.get(case, dtype)
        engine = engine_for({"stage2": 2, "stage3_allowed": 3}.get(case, stage), target, seed=1)
        if case == "rollback":
            train(engine, 4, 10)
        dds.load(engine, ckpt, allow_stage_change=case == "stage3_allowed")
        got = gather(engine)
        ref = torch.load(os.path.join(out, "ref.pt"), weights_only=True)["ref"]
        if case == "master_fp32":
            same = all(got[n][k].dtype == torch.float32 and torch.equal(got[n][k], v.float())
                       if torch.is_tensor(v) and k != "frozen" else got[n][k] == v
                       for n, e in ref.items() for k, v in e.items())
        else:
            same = all(torch.equal(got[n][k], v) if torch.is_tensor(v) else got[n][k] == v
                       for n, e in ref.items() for k, v in e.items())
        with open(os.path.join(out, f"err_{case}_rank{dist.get_rank()}.json"), "w") as f:
            json.dump({"raised": None, "same": bool(same), "untouched": True}, f)
        return
    elif case == "offloaded_states":
        # engine.offload_states() (RLHF frees accelerator memory between phases): a load is refused
        # before it changes anything (it wrote masters, then failed on a bare IndexError); after
        # reload_states() it loads, and a save holds no offload scratch buffers as Adam state
        engine = engine_for(stage, dtype, seed=1)
        train(engine, 1, 0)
        engine.offload_states()
        before = [t.detach().clone() for t in _masters(engine)]
        try:
            dds.load(engine, ckpt)
            raised = None
        except DistCkptError as exc:
            raised = {"class": type(exc).__name__, "message": str(exc)}
        untouched = all(torch.equal(a, b) for a, b in zip(before, _masters(engine)))
        engine.reload_states()
        dds.load(engine, ckpt)
        ref = torch.load(os.path.join(out, "ref.pt"), weights_only=True)["ref"]
        got = gather(engine)
        same = all(torch.equal(got[n][k], v) if torch.is_tensor(v) else got[n][k] == v
                   for n, e in ref.items() for k, v in e.items())
        again = os.path.join(out, "after_offload_cycle")
        dds.save(engine, again, overwrite=True)
        trained = next(n for n, e in ref.items() if "frozen" not in e)
        keys = sorted(distckpt.read(again, keys=["optim"])["optim"][trained])
        with open(os.path.join(out, f"err_{case}_rank{dist.get_rank()}.json"), "w") as f:
            json.dump({"raised": raised, "untouched": untouched, "same": bool(same), "keys": keys}, f)
        return
    elif case == "tied":
        # a parameter under two names (tied embeddings) is saved once; dds.consolidated gives it
        # under both, one tensor, as zero_to_fp32 does, and the model loads it strictly
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
        engine = engine_for(stage, dtype + "+tied", seed=1)
        train(engine, 1, 0)
        path = os.path.join(out, "tied")
        dds.save(engine, path, overwrite=True)
        engine.save_checkpoint(os.path.join(out, "tied_ds"), tag="t")
        dist.barrier()
        ours = dds.consolidated(path)
        theirs = get_fp32_state_dict_from_zero_checkpoint(os.path.join(out, "tied_ds"), tag="t")
        model = Net()
        model.alias = nn.Module()
        model.alias.weight = model.layers[0].weight
        model.load_state_dict(ours, strict=True)
        same = sorted(ours) == sorted(theirs) and all(torch.equal(ours[k], theirs[k]) for k in theirs) \
            and ours["alias.weight"] is ours["layers.0.weight"] \
            and "alias.weight" not in distckpt.read(path, keys=["model"])["model"]
        with open(os.path.join(out, f"err_{case}_rank{dist.get_rank()}.json"), "w") as f:
            json.dump({"raised": None, "same": bool(same), "untouched": True}, f)
        return
    elif case == "rollback_prestep":
        # a checkpoint saved before the first optimizer step, loaded into an engine that has trained
        # (it was a ReshardError: "state keys differ"): the state is none again, as it was saved,
        # and the same next steps follow as from the saved engine
        fresh = engine_for(stage, dtype, seed=3)
        path = os.path.join(out, "prestep")
        dds.save(fresh, path, overwrite=True)
        want = train(fresh, 2, 50)
        engine = engine_for(stage, dtype, seed=4)
        train(engine, 3, 0)
        dds.load(engine, path)
        empty = all(not engine.optimizer.optimizer.state.get(o.key) for o in zero_layout(engine).owners)
        got = train(engine, 2, 50)
        with open(os.path.join(out, f"err_{case}_rank{dist.get_rank()}.json"), "w") as f:
            json.dump({"raised": None, "same": empty and got == want, "untouched": True}, f)
        return
    elif case == "install_refused":
        # through install(): DeepSpeed's own load restores the module, counters and scheduler
        # before the ZeRO load refuses (Adam mode): every refusal now comes first
        src = engine_for(stage, dtype, seed=1)
        dds.install(src)
        train(src, 2, 0)
        src.save_checkpoint(os.path.join(out, "installed"), tag="t")
        engine = engine_for(stage, dtype, seed=2, adam_w_mode=False)
        dds.install(engine)
        train(engine, 1, 0)
        weights = [p.detach().clone() for p in engine.module.parameters()]
        state = (engine.global_steps, json.dumps(engine.lr_scheduler.state_dict(), sort_keys=True))
        try:
            engine.load_checkpoint(os.path.join(out, "installed"), tag="t")
            raised = None
        except DistCkptError as exc:
            raised = {"class": type(exc).__name__, "message": str(exc)}
        untouched = all(torch.equal(a, p.detach()) for a, p in zip(weights, engine.module.parameters())) and \
            state == (engine.global_steps, json.dumps(engine.lr_scheduler.state_dict(), sort_keys=True))
        with open(os.path.join(out, f"err_{case}_rank{dist.get_rank()}.json"), "w") as f:
            json.dump({"raised": raised, "untouched": bool(untouched)}, f)
        return
    elif case == "hostile":
        _hostile(stage, dtype, ckpt, out)
        return
    elif case == "not_deepspeed":
        engine = engine_for(stage, dtype, seed=1)
        ckpt = os.path.join(out, "plain")
    else:
        raise SystemExit(f"unknown case {case}")
    before = [p.detach().clone() for p in engine.module.parameters()]
    try:
        dds.load(engine, ckpt)
        doc = {"raised": None}
    except DistCkptError as exc:
        doc = {"raised": type(exc).__name__, "message": str(exc)}
    doc["untouched"] = all(torch.equal(a, p.detach()) for a, p in zip(before, engine.module.parameters()))
    with open(os.path.join(out, f"err_{case}_rank{dist.get_rank()}.json"), "w") as f:
        json.dump(doc, f)


def zero_layout(engine):
    from distckpt.integrations.deepspeed import zero
    return zero._layout(engine)


def _masters(engine) -> list:
    opt = engine.optimizer
    return list(getattr(opt, "fp32_partitioned_groups_flat", None) or opt.single_partition_of_fp32_groups)


def _hostile(stage: int, dtype: str, ckpt: str, out: str) -> None:
    """Copies of the checkpoint whose ``deepspeed`` metadata (or a step value) was damaged or
    crafted, each loaded into one engine: record, per variant, the error class and whether the
    engine (weights, masters, Adam state, counters, lr) was left exactly as it was."""
    full = distckpt.read(ckpt)
    meta = json.loads(full["deepspeed"])
    group = meta["param_groups"][0]
    variants = {
        "not_json": "{not json", "a_list": [1, 2],
        "no_params": {k: v for k, v in meta.items() if k != "params"},
        "params_form": {**meta, "params": [["x"]]},
        "state_keys_form": {**meta, "state_keys": 5},
        "counters_form": {**meta, "engine": {"global_steps": "x", "global_samples": [], "skipped_steps": None}},
        "lr_form": {**meta, "param_groups": [{**group, "lr": "abc"}]},
        "betas_form": {**meta, "param_groups": [{**group, "betas": [0.9, 0.99, 0.5]}]},
        "scaler_form": {**meta, "loss_scaler": {"class": (meta["loss_scaler"] or {}).get("class", "LossScaler"),
                                                 "state": {"cur_scale": "big"}}},
        "group_of_form": {**meta, "group_of": [1]},
        "group_of_unknown_name": {**meta, "group_of": {**meta["group_of"], "no.such.param": 0}},
        "group_of_past_the_groups": {**meta, "group_of": {name: 7 for name in meta["group_of"]}},
        "layout_form": {**meta, "layout": "zero9"},
        "scheduler_form": {**meta, "lr_scheduler": 7},
        "stage_form": {**meta, "stage": "two"},
        "client_records_form": {**meta, "client_containers": {"x": 1}},
        "step_form": "step",
    }
    engine = engine_for(stage, dtype, seed=1)
    train(engine, 1, 0)
    before = gather(engine) | {"counters": [engine.global_steps, engine.global_samples],
                               "lr": engine.optimizer.param_groups[0]["lr"]}
    results = {}
    for name, value in variants.items():
        sd = dict(full)
        if value == "step":
            sd["optim"] = {p: {**st, "step": "x"} for p, st in full["optim"].items()}
        else:
            sd["deepspeed"] = value if isinstance(value, str) else json.dumps(value)
        path = os.path.join(out, f"hostile_{name}")
        if dist.get_rank() == 0:
            distckpt.save(sd, path, overwrite=True, no_dist=True)
        dist.barrier()
        try:
            dds.load(engine, path)
            raised = None
        except Exception as exc:  # noqa: BLE001 - the class is what is recorded
            raised = f"{type(exc).__module__}.{type(exc).__name__}: {str(exc)[:200]}"
        now = gather(engine) | {"counters": [engine.global_steps, engine.global_samples],
                                "lr": engine.optimizer.param_groups[0]["lr"]}
        same = before.keys() == now.keys() and all(
            all(torch.equal(a, b) if torch.is_tensor(a) else a == b for a, b in
                zip(before[k].values(), now[k].values())) if isinstance(before[k], dict) else before[k] == now[k]
            for k in before)
        results[name] = {"raised": raised, "untouched": bool(same)}
    with open(os.path.join(out, f"err_hostile_rank{dist.get_rank()}.json"), "w") as f:
        json.dump(results, f)


def _without_shm_op() -> None:
    """Skip DeepSpeed's shared-memory all-reduce op, which its CPU backend JIT-compiles (or, built,
    re-checks under a lock shared by every process of the machine) at start-up: every collective
    of these tests runs over gloo. DeepSpeed 0.19.8 builds it only when its table of compatible
    ops (deepspeed.ops.__compatible_ops__, probed once per process) says it can."""
    from deepspeed.ops.op_builder.cpu import ShareMemCommBuilder
    deepspeed.ops.__compatible_ops__[ShareMemCommBuilder.NAME] = False


def main() -> None:
    """argv: MODE ROOT CONFIG... where CONFIG is STAGE:DTYPE (checkpoint ROOT/s<STAGE><DTYPE>/ckpt,
    outputs in ROOT/s<STAGE><DTYPE>/); MODE "error:CASE[,CASE]" runs those cases (a config
    STAGE:DTYPE:CASES runs its own)."""
    mode, root, configs = sys.argv[1], sys.argv[2], sys.argv[3:]
    _without_shm_op()
    deepspeed.init_distributed(dist_backend="gloo")
    for cfg in configs:
        stage_s, dtype, *own_cases = cfg.split(":")
        stage = int(stage_s)
        base = os.path.join(root, f"s{stage}{dtype}")
        ckpt, out = os.path.join(base, "ckpt"), os.path.join(base, "out")
        if mode == "save":
            _save(stage, dtype, ckpt, out)
        elif mode == "load":
            _load(stage, dtype, ckpt, out)
        elif mode.startswith("error:"):
            for case in (own_cases[0] if own_cases else mode.split(":", 1)[1]).split(","):
                _expect_error(stage, dtype, ckpt, out, case)
        else:
            raise SystemExit(f"unknown mode {mode}")
        dist.barrier()
    dist.destroy_process_group()
    # Leave without interpreter finalization: gloo's worker threads can still hold work objects
    # whose teardown then aborts the process ("terminate called without an active exception",
    # a known torch/gloo exit race), which torchrun would report as this rank failing.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
