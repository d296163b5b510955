"""torchrun worker of tests/interop/test_deepspeed_engine.py: real DeepSpeed on CPU (gloo), distckpt installed
as its checkpoint engine. One launch runs several phases (each a fresh deepspeed.initialize) so the
test pays DeepSpeed's import and start-up a few times, not once per check.

    torchrun --nproc_per_node N tests/helpers/deepspeed_engine_worker.py OUT PHASE [PHASE ...]

Phases (results go to OUT/<phase>.rank<R>.pt, read back with torch.load(weights_only=True)):
    edges            parity with DeepSpeed's own engine at the edges (see edges())
    refusals         loads refused on every rank with the engine unchanged (see refusals())
    train:<cfg>      train 3 steps, save tag "s3" through the engine, train 2 more: losses + state
    resume:<cfg>     new processes: load "s3" (through `latest`), train the same 2 steps
    rotate           200 saves with keep_last=3 into OUT_ROTATE (a tmpfs): fds and disk use
    enospc           save "good", then a save that does not fit into OUT_ENOSPC (a small tmpfs)
    kill             save "good", then rank 1 is SIGKILLed inside the next save (after its data
                     file is written, before the commit): the launch dies there
    afterkill        load `latest` of the kill directory: must be "good", bit-exact
    reshard:<cfg>    load "s3" of train:<cfg> at this launch's world size
    native:<cfg>     DeepSpeed's own checkpoint engine and distckpt's side by side: one engine saves
                     "s3" through both, then fresh engines load each with every option set of
                     LOAD_OPTIONS; what load_checkpoint returns and every state it sets, compared
<cfg> is "<zero stage>-<fp32|bf16>".
"""

from __future__ import annotations

import collections
import json
import os
import shutil
import signal
import sys
import time

import torch

STEPS_BEFORE, STEPS_AFTER = 3, 2
# load_checkpoint options of the native:<cfg> phase (DeepSpeed's defaults first)
LOAD_OPTIONS = {
    "default": {},
    "module_only": {"load_module_only": True},
    "no_optimizer": {"load_optimizer_states": False},
    "no_optimizer_no_scheduler": {"load_optimizer_states": False, "load_lr_scheduler_states": False},
}


def _model() -> torch.nn.Module:
    torch.manual_seed(1234)

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.l1 = torch.nn.Linear(64, 96)
            self.norm = torch.nn.LayerNorm(96)
            self.l2 = torch.nn.Linear(96, 80)
            self.l3 = torch.nn.Linear(80, 8)
            self.register_buffer("calls", torch.zeros((), dtype=torch.int64))  # a persistent buffer

        def forward(self, x):
            self.calls += 1
            return self.l3(torch.relu(self.l2(self.norm(torch.relu(self.l1(x))))))

    return Net()


def _engine(cfg: str, *, extra: dict | None = None, freeze: str | None = None):
    import deepspeed
    stage, precision, *flags = cfg.split("-")  # "-offload": ZeRO-Offload to the CPU (DeepSpeedCPUAdam)
    config = {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-2, "torch_adam": True, "weight_decay": 0.01}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 1e-2,
                                                      "warmup_num_steps": 10}},
        "zero_optimization": {"stage": int(stage), "stage3_param_persistence_threshold": 0,
                              "reduce_bucket_size": 4096, "allgather_bucket_size": 4096},
        "bf16": {"enabled": precision == "bf16"},
        "steps_per_print": 10 ** 9,
        **(extra or {}),
    }
    if "offload" in flags:
        config["optimizer"]["params"].pop("torch_adam")
        config["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
        if int(stage) == 3:
            config["zero_optimization"]["offload_param"] = {"device": "cpu"}
    model = _model()
    if freeze is not None:  # a frozen layer (a LoRA-style base)
        getattr(model, freeze).requires_grad_(False)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    return engine


def frozen3save(out: str) -> None:
    """ZeRO-3 with a frozen layer, saved through install() at this launch's size (2), with its
    frozen partitions and without them (exclude_frozen_parameters)."""
    import distckpt.integrations.deepspeed as dsd
    e = _engine("3-fp32", freeze="l1")
    dsd.install(e)
    for s in range(1, STEPS_BEFORE + 1):
        _step(e, s)
    e.save_checkpoint(os.path.join(out, "frozen3"), "t")
    e.save_checkpoint(os.path.join(out, "frozen3ex"), "t", exclude_frozen_parameters=True)


def frozen3load(out: str) -> None:
    """The frozen3save checkpoint loaded at this launch's size (3): a typed ReshardError before the
    engine changes (DeepSpeed's module load raised torch's RuntimeError on the frozen partition)."""
    import distckpt.integrations.deepspeed as dsd
    e = _engine("3-fp32", freeze="l1")
    dsd.install(e)
    try:
        e.load_checkpoint(os.path.join(out, "frozen3"), "t")
        result = "loaded"
    except Exception as exc:  # noqa: BLE001 - the test checks which
        result = f"{type(exc).__name__}: {exc}"
    # without frozen partitions there is nothing to reshard: it loads (the frozen layer kept)
    f = _engine("3-fp32", freeze="l1")
    dsd.install(f)
    try:
        f.load_checkpoint(os.path.join(out, "frozen3ex"), "t", load_module_strict=False)
        excluded = "loaded"
    except Exception as exc:  # noqa: BLE001 - the test checks which
        excluded = f"{type(exc).__name__}: {exc}"
    _dump(out, "frozen3load", {"result": result, "excluded": excluded})


def _step(engine, step: int) -> float:
    rank = torch.distributed.get_rank()
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(4, 64, generator=g)
    y = torch.randn(4, 8, generator=g)
    if engine.bfloat16_enabled():
        x, y = x.bfloat16(), y.bfloat16()
    loss = torch.nn.functional.mse_loss(engine(x).float(), y.float())
    engine.backward(loss)
    engine.step()
    return loss.item()


def _masters_and_optim(engine) -> dict:
    """This rank's fp32 master partitions and the base optimizer's state of each (no collective)."""
    out = {}
    base = engine.optimizer
    while hasattr(base, "optimizer"):  # ZeRO / bf16 wrappers hold the torch optimizer that steps
        base = base.optimizer
    groups = [group["params"] for group in base.param_groups]
    if hasattr(engine.optimizer, "fp32_partitioned_groups_flat"):
        # ZeRO-3 takes its fp32 partitions out of the torch optimizer's param_groups between steps
        groups = [[flat] for flat in engine.optimizer.fp32_partitioned_groups_flat]
    for g, group in enumerate(groups):
        for i, p in enumerate(group):
            out[f"master.{g}.{i}"] = p.detach().clone()
            for k, v in base.state.get(p, {}).items():
                out[f"optim.{g}.{i}.{k}"] = v.detach().clone() if isinstance(v, torch.Tensor) else v
    return out


def _state(engine) -> dict:
    """Every parameter (full), this rank's fp32 master partitions and Adam state as the base
    optimizer holds them, buffers, the lr and the step counters. Collective (ZeRO-3 gathers)."""
    import deepspeed
    out = {"lr": float(engine.get_lr()[0]), "global_steps": engine.global_steps,
           "global_samples": engine.global_samples}
    params = list(engine.module.named_parameters())
    with deepspeed.zero.GatheredParameters([p for _, p in params], enabled=engine.zero_optimization_stage() == 3):
        for n, p in params:
            out[f"param.{n}"] = p.detach().clone()
    out.update(_masters_and_optim(engine))
    for n, b in engine.module.named_buffers():
        out[f"buffer.{n}"] = b.detach().clone()
    return out


def _differences(a, b, where: str = "") -> list[str]:
    """Where two values DeepSpeed returned differ: nested dicts, sequences, tensors (dtype, shape,
    bits), objects by class and attributes (loss scalers, dataclasses, enums), else ==."""
    out = []
    if type(a) is not type(b):  # an OrderedDict, Counter or defaultdict comes back as one
        return [f"{where}: {type(a).__name__} != {type(b).__name__}"]
    if isinstance(a, collections.defaultdict) and a.default_factory is not b.default_factory:
        out.append(f"{where}: default_factory {a.default_factory!r} != {b.default_factory!r}")
    if isinstance(a, collections.OrderedDict) and list(a) != list(b):  # its order is part of its value
        out.append(f"{where}: keys in another order")
    if isinstance(a, dict):
        out += [f"{where}.{k}: only in {'the first' if k in a else 'the second'}" for k in sorted(a.keys() ^ b.keys(), key=str)]
        for k in a.keys() & b.keys():
            out += _differences(a[k], b[k], f"{where}.{k}")
        return out
    if isinstance(a, (list, tuple)):
        if len(a) != len(b):
            return [f"{where}: length {len(a)} != {len(b)}"]
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in _differences(x, y, f"{where}[{i}]")]
    if isinstance(a, torch.Tensor):
        same = (a.dtype == b.dtype and a.shape == b.shape and a.requires_grad == b.requires_grad
                and torch.equal(a, b))
        return [] if same else [f"{where}: tensors differ"]
    if hasattr(a, "__dict__") and not isinstance(a, type):
        return _differences(vars(a), vars(b), f"{where}<{type(a).__name__}>")
    return [] if a == b else [f"{where}: {a!r} != {b!r}"]


def _dump(out_dir: str, phase: str, data: dict) -> None:
    rank = torch.distributed.get_rank()
    torch.save(data, os.path.join(out_dir, f"{phase.replace(':', '_')}.rank{rank}.pt"))


def _open_fds() -> dict[int, str]:
    fds = {}
    for name in os.listdir("/proc/self/fd"):
        try:
            fds[int(name)] = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            pass
    return fds


def _used(path: str) -> int:
    st = os.statvfs(path)
    return (st.f_blocks - st.f_bfree) * st.f_frsize


def train(out: str, cfg: str) -> None:
    import distckpt.integrations.deepspeed as dsd
    engine = _engine(cfg)
    dsd.install(engine, keep_last=2)
    before = [_step(engine, s) for s in range(1, STEPS_BEFORE + 1)]
    ckpt = os.path.join(out, f"ckpt_{cfg}")
    rng = torch.get_rng_state()
    engine.save_checkpoint(ckpt, "s3", client_state={"epoch": 7, "note": "s3", "sizes": (1, 2), "rng": rng})
    saved = _state(engine)
    after = [_step(engine, s) for s in range(STEPS_BEFORE + 1, STEPS_BEFORE + STEPS_AFTER + 1)]
    _dump(out, f"train:{cfg}", {"before": before, "after": after, "saved": saved, "final": _state(engine), "rng": rng,
                                "files": sorted(os.listdir(ckpt)), "tag_files": sorted(os.listdir(os.path.join(ckpt, "s3")))})


def resume(out: str, cfg: str) -> None:
    import distckpt.integrations.deepspeed as dsd
    engine = _engine(cfg)
    dsd.install(engine)
    fds = _open_fds()
    path, client = engine.load_checkpoint(os.path.join(out, f"ckpt_{cfg}"))
    new_fds = {fd: t for fd, t in _open_fds().items() if fd not in fds and "ckpt_" in t}
    loaded = _state(engine)
    after = [_step(engine, s) for s in range(STEPS_BEFORE + 1, STEPS_BEFORE + STEPS_AFTER + 1)]
    client = {k: v for k, v in client.items() if k in ("epoch", "note", "sizes", "rng")}
    _dump(out, f"resume:{cfg}", {"path": path, "client": client, "loaded": loaded, "after": after,
                                 "new_fds": json.dumps(new_fds),
                                 "final": _state(engine)})


def rotate(out: str) -> None:
    import distckpt.integrations.deepspeed as dsd
    root = os.environ["OUT_ROTATE"]
    engine = _engine("1-fp32")
    dsd.install(engine, keep_last=3)
    _step(engine, 1)
    before = _open_fds()
    plateau, grew = None, []
    for i in range(1, 201):
        engine.save_checkpoint(root, f"t{i:03d}", client_state={"i": i})
        if i == 3:
            plateau = _used(root)
        elif i > 3 and _used(root) > plateau + (64 << 10):
            grew.append((i, _used(root) - plateau))
    fds = _open_fds()
    leaked = {fd: t for fd, t in fds.items() if fd not in before and t.startswith(root)}
    deleted = [t for t in fds.values() if t.endswith("(deleted)")]
    torch.distributed.barrier()
    _dump(out, "rotate", {"listing": sorted(os.listdir(root)), "latest": open(os.path.join(root, "latest")).read(),
                          "grew": grew, "leaked": json.dumps(leaked), "deleted": deleted, "plateau": plateau})


def enospc(out: str) -> None:
    import distckpt.integrations.deepspeed as dsd
    root = os.environ["OUT_ENOSPC"]
    engine = _engine("2-fp32")
    dsd.install(engine)
    _step(engine, 1)
    engine.save_checkpoint(root, "good")
    good = _state(engine)
    ballast = torch.zeros(int(os.environ["BALLAST_ELEMS"]))  # makes the next save larger than the tmpfs
    _step(engine, 2)
    error = None
    fds_before = _open_fds()
    try:
        engine.save_checkpoint(root, "big", client_state={"ballast": ballast})
    except Exception as exc:  # noqa: BLE001 - the test checks its class
        error = exc
    fds_after = _open_fds()
    err = None if error is None else {"cls": type(error).__name__, "mro": [c.__name__ for c in type(error).__mro__],
                                      "msg": str(error)[:2000],
                                      "failures": sorted({type(f).__name__ for f in
                                                          (getattr(error, "failures", None) or {}).values()})}
    listing = sorted(os.listdir(root))
    torch.distributed.barrier()
    # Refusals, each a typed error on every rank, nothing written: an object without a plain
    # form in client_state (only rank 0 writes the model states), a tag that is not a plain name.
    refused = {}
    for what, call in (("object", lambda: engine.save_checkpoint(root, "obj", client_state={"x": object()})),
                       ("tag", lambda: engine.save_checkpoint(root, "../evil"))):
        try:
            call()
            refused[what] = None
        except Exception as exc:  # noqa: BLE001 - the test checks its class (and each rank's)
            refused[what] = [c.__name__ for c in type(exc).__mro__] + sorted(
                {type(f).__name__ for f in (getattr(exc, "failures", None) or {}).values()})
    # Restore into a fresh engine: the previous tag is what `latest` still names, bit-exact.
    engine2 = _engine("2-fp32")
    dsd.install(engine2)
    try:
        engine2.load_checkpoint(root, custom_load_fn=lambda src, dst: None)
        refused["custom_load_fn"] = None
    except Exception as exc:  # noqa: BLE001 - the test checks its class
        refused["custom_load_fn"] = [c.__name__ for c in type(exc).__mro__]
    # A rank whose checks fail alone (here rank 1 asks for a tag that does not exist) must not
    # leave the others inside DeepSpeed's collectives: every rank raises, typed, at once.
    try:
        engine2.load_checkpoint(root, "good" if torch.distributed.get_rank() == 0 else "missing")
        refused["one_rank_missing"] = None
    except Exception as exc:  # noqa: BLE001 - the test checks its class (and each rank's)
        refused["one_rank_missing"] = [c.__name__ for c in type(exc).__mro__] + sorted(
            {type(f).__name__ for f in (getattr(exc, "failures", None) or {}).values()})
    path, _ = engine2.load_checkpoint(root)
    _dump(out, "enospc", {"error": err, "listing": listing, "latest": open(os.path.join(root, "latest")).read(),
                          "refused": refused, "listing_after": sorted(os.listdir(root)),
                          "loaded_path": path, "good": good, "reloaded": _state(engine2),
                          "new_fds": json.dumps({fd: t for fd, t in fds_after.items() if fd not in fds_before})})


def kill(out: str) -> None:
    import distckpt.storage.posix.saving as coordinator  # where a rank's data file is written
    import distckpt.integrations.deepspeed as dsd
    root = os.path.join(out, "ckpt_kill")
    engine = _engine("2-bf16")
    dsd.install(engine)
    _step(engine, 1)
    engine.save_checkpoint(root, "good")
    _dump(out, "kill", {"good": _state(engine)})
    _step(engine, 2)
    if torch.distributed.get_rank() == 1:
        write = coordinator.write_rank_file

        def write_then_die(*args, **kwargs):
            result = write(*args, **kwargs)  # this rank's data file is complete in the tmp dir
            os.kill(os.getpid(), signal.SIGKILL)
            return result
        coordinator.write_rank_file = write_then_die
    engine.save_checkpoint(root, "doomed")
    raise AssertionError("unreachable: rank 1 was killed inside the save")


def afterkill(out: str) -> None:
    import distckpt.integrations.deepspeed as dsd
    root = os.path.join(out, "ckpt_kill")
    engine = _engine("2-bf16")
    dsd.install(engine)
    path, _ = engine.load_checkpoint(root)
    listing = sorted(os.listdir(root))
    loaded = _state(engine)
    torch.distributed.barrier()
    engine.save_checkpoint(root, "again")  # reclaims the killed save's leftover (its owner is dead)
    _dump(out, "afterkill", {"path": path, "listing": listing, "loaded": loaded,
                             "listing_after_save": sorted(os.listdir(root))})


def reshard(out: str, cfg: str) -> None:
    import distckpt
    import distckpt.integrations.deepspeed as dsd
    engine = _engine(cfg)
    dsd.install(engine)
    ckpt = os.path.join(out, f"ckpt_{cfg}", "s3")
    engine.load_checkpoint(os.path.dirname(ckpt), "s3")
    loaded = {k: v for k, v in _state(engine).items() if not k.startswith(("master.", "optim."))}
    # The fp32 masters and Adam state now partitioned over this launch's ranks, written again in
    # the reshardable form and read back whole: bit-identical to what the 2-rank job saved.
    again = os.path.join(out, f"resaved_{cfg}_{torch.distributed.get_world_size()}")
    dsd.save(engine, again)
    differ = None
    if torch.distributed.get_rank() == 0:
        a = distckpt.read(ckpt, keys=["model", "optim"])
        b = distckpt.read(again, keys=["model", "optim"])
        flat_a = {f"{top}.{n}.{k}": v for top in ("model", "optim") for n, e in a[top].items()
                  for k, v in (e.items() if isinstance(e, dict) else [("", e)])}
        flat_b = {f"{top}.{n}.{k}": v for top in ("model", "optim") for n, e in b[top].items()
                  for k, v in (e.items() if isinstance(e, dict) else [("", e)])}
        differ = sorted(k for k in flat_a.keys() | flat_b.keys()
                        if k not in flat_a or k not in flat_b or not torch.equal(torch.as_tensor(flat_a[k]),
                                                                                 torch.as_tensor(flat_b[k])))
        differ = {"keys": len(flat_a), "differ": differ}
    after = [_step(engine, s) for s in range(STEPS_BEFORE + 1, STEPS_BEFORE + STEPS_AFTER + 1)]
    _dump(out, f"reshard:{cfg}", {"loaded": loaded, "after": after, "compare": differ})


def native(out: str, cfg: str) -> None:
    import distckpt.integrations.deepspeed as dsd
    engine = _engine(cfg)
    for s in range(1, STEPS_BEFORE + 1):
        _step(engine, s)
    dirs = {"native": os.path.join(out, f"native_{cfg}", "ds"), "distckpt": os.path.join(out, f"native_{cfg}", "dc")}
    client = {"epoch": 7, "note": "s3", "sizes": (1, 2), "rng": torch.get_rng_state()}
    engine.save_checkpoint(dirs["native"], "s3", client_state=client)  # DeepSpeed's own engine
    dsd.install(engine)
    engine.save_checkpoint(dirs["distckpt"], "s3", client_state=client)  # the same state, through distckpt
    saved = _state(engine)
    stage3 = engine.zero_optimization_stage() == 3
    results, fresh = {}, None
    for name, opts in LOAD_OPTIONS.items():
        got = {}
        for kind in ("native", "distckpt"):
            e = _engine(cfg)
            if fresh is None:
                fresh = _state(e)
            ds_opts = dict(opts)
            if kind == "distckpt":
                dsd.install(e)
            elif stage3 and opts.get("load_module_only"):
                # DeepSpeed's ZeRO-3 reads the weights only without optimizer states (see
                # module_only_zero3 below); distckpt's load_module_only reads them (documented)
                ds_opts["load_optimizer_states"] = False
            path, client_state = e.load_checkpoint(dirs[kind], **ds_opts)
            if ds_opts != opts:
                client_state.pop("optimizer")  # what DeepSpeed's module-only load leaves out
            got[kind] = {"path": os.path.relpath(path, dirs[kind]), "client": client_state, "state": _state(e),
                         "scheduler": e.lr_scheduler.state_dict(), "skipped_steps": e.skipped_steps,
                         "loaded_dp": e.loaded_checkpoint_dp_world_size, "loaded_mp": e.loaded_checkpoint_mp_world_size,
                         "after": [_step(e, s) for s in range(STEPS_BEFORE + 1, STEPS_BEFORE + STEPS_AFTER + 1)]}
            got[kind]["final"] = _state(e)
        ours = got["distckpt"]
        results[name] = {"differ": _differences(got["native"], ours), "path": ours["path"], "state": ours["state"],
                         "scheduler": json.dumps(ours["scheduler"]), "client_keys": sorted(ours["client"]),
                         "client": {k: ours["client"][k] for k in ("epoch", "note", "sizes")}}
    module_only_zero3 = None
    if stage3:
        # DeepSpeed's own ZeRO-3 load_module_only (optimizer states left at their default): no weight
        # is loaded, its model-states file holds placeholders
        e = _engine(cfg)
        e.load_checkpoint(dirs["native"], load_module_only=True)
        module_only_zero3 = {k: v for k, v in _state(e).items() if k.startswith("param.")}
    _dump(out, f"native:{cfg}", {"saved": saved, "fresh": fresh, "results": results,
                                 "module_only_zero3": module_only_zero3})


def _edge_engine(stage: int, *, tied: bool = False, frozen_seed: int | None = None):
    """A small engine with what the native phases do not have: a torch MultiStepLR (its
    milestones are a Counter), and either tied weights (an embedding and the head sharing one
    parameter: DeepSpeed's ``shared_params``) or a frozen first layer whose value is set by
    ``frozen_seed`` (a LoRA-style base)."""
    import deepspeed
    torch.manual_seed(99)

    class Tied(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(32, 16)
            self.mid = torch.nn.Linear(16, 16)
            self.head = torch.nn.Linear(16, 32, bias=False)
            self.head.weight = self.emb.weight

        def forward(self, x):
            return self.head(torch.relu(self.mid(x @ self.emb.weight.t() @ self.emb.weight)))

    if tied:
        model = Tied()
    else:
        model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Linear(16, 32))
        with torch.no_grad():
            model[0].weight.copy_(torch.randn(16, 16, generator=torch.Generator().manual_seed(frozen_seed)))
        model[0].weight.requires_grad_(False)
    params = [p for p in model.parameters() if p.requires_grad]
    optim = torch.optim.Adam(params, lr=1e-2)
    sched = torch.optim.lr_scheduler.MultiStepLR(optim, milestones=[2, 4], gamma=0.1)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optim, lr_scheduler=sched, config={
        "train_micro_batch_size_per_gpu": 4, "steps_per_print": 10 ** 9,
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0}})
    return engine


def _edge_step(engine, step: int) -> float:
    g = torch.Generator().manual_seed(1000 * step + torch.distributed.get_rank())
    loss = engine(torch.randn(4, 16, generator=g)).pow(2).mean()
    engine.backward(loss)
    engine.step()
    return loss.item()


def edges(out: str) -> None:
    """Parity with DeepSpeed's own engine where the native:<cfg> phases do not look:
    a MultiStepLR's Counter milestones and client_state containers (OrderedDict, Counter,
    defaultdict) through install() and through the standalone zero.save/zero.load; a save with
    exclude_frozen_parameters=True loaded onto a new frozen base; a ZeRO-3 model with tied
    weights loaded without optimizer states. Every comparison is made here (_differences) and
    the lists of differences are dumped."""
    import deepspeed
    import distckpt.integrations.deepspeed as dsd
    root = os.path.join(out, "edges")
    client = {"od": collections.OrderedDict([("b", 1), ("a", 2)]), "cnt": collections.Counter({3: 2, 7: 1}),
              "counts": collections.defaultdict(int, {"seen": 3})}
    client["param"] = torch.nn.Parameter(torch.ones(2))  # torch.save keeps a Parameter, and one object
    client["param_again"] = client["param"]              # under two keys as one
    report = {}
    # 1. MultiStepLR + client containers, through install() and through zero.save / zero.load.
    e = _edge_engine(2, frozen_seed=1)
    for s in range(1, 4):  # past the first milestone
        _edge_step(e, s)
    e.save_checkpoint(os.path.join(root, "ds"), "t", client_state=client)
    e.save_checkpoint(os.path.join(root, "ds_ex"), "t", exclude_frozen_parameters=True)
    dsd.zero.save(e, os.path.join(root, "zero"))
    dsd.install(e)
    e.save_checkpoint(os.path.join(root, "dc"), "t", client_state=client)
    e.save_checkpoint(os.path.join(root, "dc_ex"), "t", exclude_frozen_parameters=True)
    got = {}
    for kind in ("ds", "dc", "zero"):
        f = _edge_engine(2, frozen_seed=1)
        if kind == "dc":
            dsd.install(f)
        if kind == "zero":
            dsd.zero.load(f, os.path.join(root, "zero"))
            cs = None
        else:
            _, cs = f.load_checkpoint(os.path.join(root, kind), "t")
            cs = {k: cs[k] for k in client}
            cs["one_object"] = cs["param_again"] is cs["param"]
        milestones = f.lr_scheduler.milestones
        lrs = []
        for s in range(4, 7):  # across the second milestone
            _edge_step(f, s)
            lrs.append(f.get_lr()[0])
        got[kind] = {"client": cs, "milestones": milestones, "lrs": lrs}
    report["scheduler_and_client"] = _differences(got["ds"], got["dc"])
    report["zero_scheduler"] = _differences({k: got["ds"][k] for k in ("milestones", "lrs")},
                                            {k: got["zero"][k] for k in ("milestones", "lrs")})
    report["milestones_type"] = type(got["dc"]["milestones"]).__name__
    # 2. exclude_frozen_parameters=True: a load keeps the new engine's own frozen weights, a strict
    #    load fails on the missing key as DeepSpeed's does.
    frozen = {}
    for kind in ("ds", "dc"):
        f = _edge_engine(2, frozen_seed=2)
        live = f.module[0].weight.detach().clone()
        if kind == "dc":
            dsd.install(f)
        f.load_checkpoint(os.path.join(root, f"{kind}_ex"), "t", load_module_strict=False)
        frozen[kind] = torch.equal(f.module[0].weight, live)
        try:
            g = _edge_engine(2, frozen_seed=2)
            if kind == "dc":
                dsd.install(g)
            g.load_checkpoint(os.path.join(root, f"{kind}_ex"), "t")
            frozen[f"{kind}_strict"] = "loaded"
        except RuntimeError as exc:
            frozen[f"{kind}_strict"] = "Missing key" in str(exc)
    report["frozen"] = frozen
    # 3. ZeRO-3, tied weights, load_optimizer_states=False (and load_module_only): the weights.
    t = _edge_engine(3, tied=True)
    for s in range(1, 3):
        _edge_step(t, s)
    t.save_checkpoint(os.path.join(root, "ds3"), "t")
    dsd.install(t)
    t.save_checkpoint(os.path.join(root, "dc3"), "t")
    tied = {}
    for opts in ({"load_optimizer_states": False}, {"load_optimizer_states": False, "load_module_only": True}):
        weights = {}
        for kind in ("ds3", "dc3"):
            f = _edge_engine(3, tied=True)
            if kind == "dc3":
                dsd.install(f)
            f.load_checkpoint(os.path.join(root, kind), "t", **opts)
            params = list(f.module.named_parameters())
            with deepspeed.zero.GatheredParameters([p for _, p in params]):
                weights[kind] = {n: p.detach().clone() for n, p in params}
        tied[json.dumps(opts)] = _differences(weights["ds3"], weights["dc3"])
    report["tied_zero3"] = tied
    # 4. A scheduler state with no value in it (nested empty dicts): zero.save/zero.load round-trip.

    class NoState:
        def state_dict(self):
            return {"inner": {}}

        def load_state_dict(self, sd):
            self.loaded = sd

    f = _edge_engine(2, frozen_seed=1)
    f.lr_scheduler = NoState()
    dsd.zero.save(f, os.path.join(root, "zero_empty"))
    g = _edge_engine(2, frozen_seed=1)
    g.lr_scheduler = NoState()
    dsd.zero.load(g, os.path.join(root, "zero_empty"))
    report["empty_scheduler"] = getattr(g.lr_scheduler, "loaded", None)
    # 5. ZeRO 1/2: module weights changed after the last step (a weight constraint) and
    #    zero_optimization.load_from_fp32_weights=False. DeepSpeed's load gives back the saved
    #    module weights (and builds the masters from them under that option); distckpt rebuilt
    #    them from the masters (silently other weights, another next loss).
    edited = {}
    for cfg, from_fp32 in (("2-fp32", True), ("1-bf16", False)):
        zero_cfg = {"zero_optimization": {"stage": int(cfg[0]), "reduce_bucket_size": 4096,
                                          "allgather_bucket_size": 4096, "load_from_fp32_weights": from_fp32}}
        e = _engine(cfg, extra=zero_cfg)
        for s in range(1, 4):
            _step(e, s)
        with torch.no_grad():
            e.module.l2.weight.clamp_(-0.05, 0.05)
        e.save_checkpoint(os.path.join(root, f"w_ds_{cfg}"), "t")
        dsd.install(e)
        e.save_checkpoint(os.path.join(root, f"w_dc_{cfg}"), "t")
        for opts in ({}, {"load_module_only": True}):
            got = {}
            for kind in ("ds", "dc"):
                f = _engine(cfg, extra=zero_cfg)
                if kind == "dc":
                    dsd.install(f)
                f.load_checkpoint(os.path.join(root, f"w_{kind}_{cfg}"), "t", **opts)
                got[kind] = {"state": _state(f), "next": [_step(f, s) for s in (4, 5)]}
            edited[f"{cfg} {json.dumps(opts)}"] = _differences(got["ds"], got["dc"])
    report["edited_weights"] = edited
    # 6. save_16bit_model after install(): DeepSpeed's export (rank 0 writes pytorch_model.bin
    #    through the checkpoint engine) is written as DeepSpeed's own engine writes it (it was a
    #    ConfigError on rank 0 while rank 1 waited in the commit's collective).
    e = _engine("2-fp32")
    _step(e, 1)
    native = e.save_16bit_model(os.path.join(root, "w16_ds"))
    dsd.install(e)
    t0 = time.monotonic()
    ours = e.save_16bit_model(os.path.join(root, "w16_dc"))
    seconds = time.monotonic() - t0
    same = None
    if torch.distributed.get_rank() == 0:
        a = torch.load(os.path.join(root, "w16_ds", "pytorch_model.bin"), weights_only=True)
        b = torch.load(os.path.join(root, "w16_dc", "pytorch_model.bin"), weights_only=True)
        modes = [os.stat(os.path.join(root, d, "pytorch_model.bin")).st_mode & 0o777 for d in ("w16_ds", "w16_dc")]
        same = (_differences(a, b) == [] and list(a) == list(b) and modes[0] == modes[1]
                and sorted(os.listdir(os.path.join(root, "w16_dc"))) == ["pytorch_model.bin"])
    report["save_16bit_model"] = {"returned": [native, ours], "same_file": same, "fast": seconds < 20}
    # 7. DeepSpeed's own checkpoint loaded through install(): says what it is (it said "no
    #    committed checkpoint", remedy "check the path").
    f = _edge_engine(2, frozen_seed=1)
    dsd.install(f)
    try:
        f.load_checkpoint(os.path.join(root, "ds"), "t")
        report["native_through_install"] = "loaded"
    except Exception as exc:  # noqa: BLE001 - the test checks which
        report["native_through_install"] = f"{type(exc).__name__}: {exc}"
    # 8a. Each file of the tag is read once per load_checkpoint: DeepSpeed asks for the
    #     model-states file twice (SDLoader's check_ckpt_list, then its load), and the second got
    #     a second read and check of the same bytes.
    import distckpt.integrations.deepspeed.engine as dse
    counted = _edge_engine(2, frozen_seed=1)
    dsd.install(counted)
    real_read, reads = dse.read, []

    def counting_read(path, keys=None, **kwargs):
        reads.append(tuple(keys or ()))
        return real_read(path, keys=keys, **kwargs)

    dse.read = counting_read
    try:
        counted.load_checkpoint(os.path.join(root, "dc"), "t")
    finally:
        dse.read = real_read
    report["engine_reads"] = [k for ks in reads for k in ks if k.startswith("files.")]
    # 8. The tag overwritten by another save between DeepSpeed's reads of its files (another job
    #    saving under the same tag): the load fails as CheckpointRemovedError on every rank. Each
    #    file was read by a read of its own, so the later files came from the other save.
    a = _edge_engine(2, frozen_seed=1)
    dsd.install(a)
    _edge_step(a, 1)
    a.save_checkpoint(os.path.join(root, "mid_a"), "t")
    _edge_step(a, 2)
    a.save_checkpoint(os.path.join(root, "mid_b"), "t")
    g = _edge_engine(2, frozen_seed=1)
    ce = dsd.install(g)
    first_read = ce.load
    swapped = []

    def load_then_swap(path, map_location=None):
        got = first_read(path, map_location)
        if not swapped:
            swapped.append(path)
            torch.distributed.barrier()
            if torch.distributed.get_rank() == 0:
                tag_dir = os.path.join(root, "mid_a", "t")
                os.rename(tag_dir, tag_dir + ".replaced")
                shutil.copytree(os.path.join(root, "mid_b", "t"), tag_dir)
            torch.distributed.barrier()
        return got

    ce.load = load_then_swap
    try:
        g.load_checkpoint(os.path.join(root, "mid_a"), "t")
        report["overwritten_mid_load"] = "loaded"
    except Exception as exc:  # noqa: BLE001 - the test checks which
        report["overwritten_mid_load"] = f"{type(exc).__name__}: {exc}"
    # 8b. The pin's last look fails on rank 1 alone (another save took the name as the load
    #     ended, seen by one rank): every rank raises it (rank 0 returned and trained on).
    import contextlib as _contextlib
    real_pinned = dse.pinned

    @_contextlib.contextmanager
    def pinned_then_replaced(path, *args, **kwargs):
        with real_pinned(path, *args, **kwargs) as source:
            yield source
        if torch.distributed.get_rank() == 1:
            from distckpt.errors import CheckpointRemovedError
            raise CheckpointRemovedError(f"{path} was replaced as the load ended", path=path,
                                         renamed_to=None, replaced=True)

    h = _edge_engine(2, frozen_seed=1)
    dsd.install(h)
    dse.pinned = pinned_then_replaced
    try:
        h.load_checkpoint(os.path.join(root, "dc"), "t")
        report["replaced_at_the_end"] = "loaded"
    except Exception as exc:  # noqa: BLE001 - the test checks which
        report["replaced_at_the_end"] = type(exc).__name__
    finally:
        dse.pinned = real_pinned
    # 9. ZeRO-3: a parameter frozen now that was trained when saved. DeepSpeed's module load looks
    #    it up in the saved frozen fragments (a bare KeyError in DeepSpeed 0.19.8, its own engine
    #    too): a typed error before the engine changes.
    z = _engine("3-fp32")
    dsd.install(z)
    _step(z, 1)
    z.save_checkpoint(os.path.join(root, "frozen_now"), "t")
    f = _engine("3-fp32", freeze="l1")
    dsd.install(f)
    before = {n: p.ds_tensor.detach().clone() for n, p in f.module.named_parameters()}
    try:
        f.load_checkpoint(os.path.join(root, "frozen_now"), "t")
        report["frozen_now"] = "loaded"
    except Exception as exc:  # noqa: BLE001 - the test checks which
        report["frozen_now"] = f"{type(exc).__name__}: {exc}"
    report["frozen_now_unchanged"] = all(torch.equal(p.ds_tensor, before[n]) for n, p in f.module.named_parameters())
    _dump(out, "edges", report)


def _raised(call) -> str:
    """"loaded" when ``call()`` returned ("returned (None, None)" for DeepSpeed's "no checkpoint
    yet"), else "<class>: <message>" of what it raised."""
    try:
        got = call()
        return "returned (None, None)" if got == (None, None) else "loaded"
    except Exception as exc:  # noqa: BLE001 - the test checks which
        return f"{type(exc).__name__}: {exc}"


def _local_state(engine) -> dict:
    """This rank's own tensors, without a collective: its ZeRO-3 partitions (or the parameters),
    the master partitions, the optimizer state, the step counters and the lr scheduler's state."""
    out = {"global_steps": engine.global_steps, "global_samples": engine.global_samples,
           "sched": json.dumps(engine.lr_scheduler.state_dict(), default=str)}
    for n, p in engine.module.named_parameters():
        out[f"param.{n}"] = getattr(p, "ds_tensor", p).detach().clone()
    out.update(_masters_and_optim(engine))
    return out


def refusals(out: str) -> None:
    """Loads distckpt refuses, each on every rank at once with one typed error, the engine left as
    it was (every parameter, master, optimizer state, step counter and the lr compared before and
    after): an empty or blank `latest` (DeepSpeed asserts; it was "no checkpoint yet", a restart
    from step 0) and keep_last deleting nothing while `latest` names nothing; ranks passing
    different tags or options; a ZeRO checkpoint saved in another precision (fp32 <-> bf16:
    DeepSpeed raises FileNotFoundError after a partial load); and, last, a failure only rank 1
    sees in the files DeepSpeed's own load reads (a flipped byte of its ZeRO-3 frozen partition:
    rank 0 went through DeepSpeed's load and waited for rank 1 until the arrival timeout)."""
    import distckpt
    import distckpt.integrations.deepspeed as dsd
    rank = torch.distributed.get_rank()
    root = os.path.join(out, "refusals")
    report = {}

    def refused(name, engine, call):
        before = _state(engine)
        report[name] = _raised(call)
        report[f"{name} unchanged"] = _differences(before, _state(engine))

    # 1. `latest` empty or blank, and rotation while it is so.
    e = _engine("1-fp32")
    ce = dsd.install(e, keep_last=1)
    _step(e, 1)
    ckpt = os.path.join(root, "latest")
    e.save_checkpoint(ckpt, "t1")
    for text in ("", " \n"):
        torch.distributed.barrier()
        if rank == 0:
            with open(os.path.join(ckpt, "latest"), "w") as f:
                f.write(text)
        torch.distributed.barrier()
        f = _engine("1-fp32")
        dsd.install(f)
        refused(f"latest {text!r}", f, lambda: f.load_checkpoint(ckpt))
    _step(e, 2)
    e.save_checkpoint(ckpt, "t2", save_latest=False)  # keep_last=1, `latest` blank: t1 must stay
    report["listing after rotation"] = sorted(os.listdir(ckpt))
    # 2. Different tags on the ranks, then the same tag with different options.
    ce.keep_last = None
    e.save_checkpoint(ckpt, "t3")
    f = _engine("1-fp32")
    dsd.install(f)
    refused("tags", f, lambda: f.load_checkpoint(ckpt, "t2" if rank == 0 else "t3"))
    refused("options", f, lambda: f.load_checkpoint(ckpt, "t3", load_module_strict=rank == 0))
    # 3. A precision switch: fp32 -> bf16 at ZeRO-1, bf16 -> fp32 at ZeRO-3.
    for saved, now in (("1-fp32", "1-bf16"), ("3-bf16", "3-fp32")):
        e = _engine(saved)
        dsd.install(e)
        _step(e, 1)
        e.save_checkpoint(os.path.join(root, f"prec_{saved}"), "t")
        f = _engine(now)
        dsd.install(f)
        refused(f"precision {saved} -> {now}", f, lambda: f.load_checkpoint(os.path.join(root, f"prec_{saved}")))
        if saved == "1-fp32":  # the remedy the error gives: the weights alone load
            report["precision weights only"] = _raised(lambda: f.load_checkpoint(
                os.path.join(root, f"prec_{saved}"), load_optimizer_states=False))
    _dump(out, "refusals", report)
    # 4. Last (before the fix it left the ranks out of step): ZeRO-3 with a frozen layer, one
    #    byte of rank 1's frozen partition flipped. Nothing collective between the load and the
    #    dump below: rank 1 failed at once while rank 0 waited inside the load.
    e = _engine("3-fp32", freeze="l1")
    dsd.install(e)
    _step(e, 1)
    ckpt = os.path.join(root, "rank1")
    e.save_checkpoint(ckpt, "t")
    torch.distributed.barrier()
    if rank == 0:
        man = distckpt.read_manifest(os.path.join(ckpt, "t"))
        key = next(k for k in man["tensors"] if "zero_pp_rank_1" in k and "frozen_param_fragments" in k)
        chunk = man["tensors"][key]["chunks"][0]
        entry = man["files"][chunk["file"]]
        with open(os.path.join(ckpt, "t", entry["name"] if isinstance(entry, dict) else entry), "r+b") as fh:
            fh.seek(chunk["offset"] + 8)
            byte = fh.read(1)
            fh.seek(chunk["offset"] + 8)
            fh.write(bytes([byte[0] ^ 0xFF]))
    torch.distributed.barrier()
    f = _engine("3-fp32", freeze="l1")
    dsd.install(f)
    before = _local_state(f)
    t0 = time.monotonic()
    report["rank 1 damage"] = _raised(lambda: f.load_checkpoint(ckpt, "t"))
    report["rank 1 damage seconds"] = time.monotonic() - t0
    report["rank 1 damage unchanged"] = _differences(before, _local_state(f))
    _dump(out, "refusals", report)


def _without_shm_op() -> None:
    """Skip DeepSpeed's shared-memory all-reduce op, which its CPU backend JIT-compiles (or, built,
    re-checks under a lock shared by every process of the machine) at start-up: every collective
    of these tests runs over gloo. DeepSpeed 0.19.8 builds it only when its table of compatible
    ops (deepspeed.ops.__compatible_ops__, probed once per process) says it can."""
    import deepspeed.ops
    from deepspeed.ops.op_builder.cpu import ShareMemCommBuilder
    deepspeed.ops.__compatible_ops__[ShareMemCommBuilder.NAME] = False


def main() -> None:
    import deepspeed
    out, phases = sys.argv[1], sys.argv[2:]
    _without_shm_op()
    deepspeed.init_distributed(dist_backend="gloo")
    torch.set_num_threads(1)
    for phase in phases:
        name, _, arg = phase.partition(":")
        fn = globals()[name]
        fn(out, arg) if arg else fn(out)
        torch.distributed.barrier()
    torch.distributed.destroy_process_group()
    # Leave without interpreter finalization: gloo's worker threads can still hold work objects
    # whose teardown then aborts the process ("terminate called without an active exception",
    # a known torch/gloo exit race), which torchrun would report as this rank failing.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
