"""Reshardable DeepSpeed ZeRO checkpoints: saved at data-parallel size N, loaded at size M, online.

DeepSpeed's own ZeRO checkpoint is one pickle per rank holding that rank's *flat* partition of
each parameter group, so it loads only at the same data-parallel size (or after the offline
universal-checkpoint conversion). Here every parameter is stored as a *global* tensor of its real
shape, and each rank contributes the element range its partition holds as boxes
(:class:`distckpt.flatten.LocalPieces`); a load builds the same pieces for the *new* partitions and
lets :func:`distckpt.load` read only the byte ranges each rank needs. No rank ever gathers a
parameter, no conversion step runs.

What is stored (keys of the checkpoint)::

    model.<param name>            master weights (fp32, or bf16 under bf16_master_weights_and_grads),
                                  full parameter shape (what zero_to_fp32.py gives); frozen
                                  (requires_grad=False) parameters and module buffers in the
                                  module's dtype
    optim.<param name>.<state>    every optimizer state tensor shaped like the master partition
                                  (Adam exp_avg, exp_avg_sq, ...), full parameter shape, in its dtype
    optim.<param name>.<scalar>   per-parameter scalar state (Adam step), one value per parameter
    deepspeed                     JSON: format, stage, dp size, dtypes, parameter order and shapes,
                                  optimizer class and param-group hyper-parameters, engine counters,
                                  where the lr-scheduler state is
    lr_scheduler                  the lr scheduler's ``state_dict()`` (typed values, no pickle; its
                                  OrderedDict / Counter / defaultdict containers rebuilt on load by
                                  :mod:`distckpt.containers`: a ``MultiStepLR``'s milestones come
                                  back as the Counter it steps by)
    client                        the caller's ``client_state`` (typed values, no pickle)

so ``distckpt.read(path, keys=["model"])["model"]`` is the consolidated master state dict, on one
process, and ``distckpt inspect`` shows a ``deepspeed`` line from the manifest's metadata.

Partition layouts this reads (DeepSpeed 0.19.8, read from its sources):
  * ZeRO 1/2 (``DeepSpeedZeroOptimizer``): per param group a flat buffer of the group's params in
    ``round_robin_bit16_groups`` order at ``round_robin_bit16_offsets`` (alignment padding between
    params and at the end); rank r owns flat elements ``[r*ps, (r+1)*ps)`` with
    ``ps = partition_size[g]``; its fp32 master is ``single_partition_of_fp32_groups[g]`` and the
    inner optimizer's state is keyed by that tensor. After a load ``update_lp_params()`` copies the
    masters into the bit16 partitions and all-gathers them (what a step does).
  * ZeRO 3 (``DeepSpeedZeroOptimizer_Stage3``): every parameter is partitioned on its own: rank r
    holds elements ``[r*pn, (r+1)*pn)`` (``pn = param.partition_numel()``, the last rank padded);
    sub-group g's fp32 master ``fp32_partitioned_groups_flat[g]`` is the concatenation of its
    params' padded partitions. After a load the masters are copied into the module partitions and
    persistent (unpartitioned) params re-gathered, as DeepSpeed's own load does.
  * Stage 0, fp32: the inner optimizer directly over the module parameters (every rank holds
    everything; a save splits each tensor so every rank writes a part).
  * Stage 0, bf16/fp16 (``FP16_Optimizer``): per group one unpadded flat fp32 master
    (``fp32_groups_flat``), replicated.
  * ZeRO-Offload (``offload_optimizer`` / ``offload_param`` on ``cpu``): the same layouts, the
    masters and optimizer state in host memory, stepped by DeepSpeedCPUAdam (whose checkpoints
    load into FusedAdam and back: ``_ADAM_KERNELS``). NVMe and partial offload are refused.

Where a load cannot be exact it raises :class:`distckpt.errors.ReshardError` before any byte is
read: another parameter set or shapes, another optimizer class (or Adam mode) or state keys,
masters or state that a load would round (saved fp32, now bf16), another ZeRO stage
(1 <-> 2 share one layout; others need ``allow_stage_change=True``), a different number of param
groups, another loss-scaler class, or parameters of one flat group whose saved scalar state (step)
differs. The loss scaler's counters (fp16 dynamic scale) are saved and restored.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
from typing import Any

import torch

from ... import containers, tensorrecords
from .. import hyperparams
from ...errors import ManifestCorruptError, ReshardError, UnsupportedValueError
from ...flatten import LocalPieces, flatten
from ...tensorbytes import EXACT_CASTS, dtype_from_name, dtype_name

__all__ = ["save", "load", "state_dict", "consolidated", "ZeroLoadResult", "FORMAT"]

FORMAT = "distckpt.deepspeed/2"
# Format 1 kept the lr-scheduler state inside the JSON metadata, which turned int dict keys into
# strings (a MultiStepLR's milestones then never matched a step again); it still loads, as it was.
_READS = ("distckpt.deepspeed/1", FORMAT)
_META = "deepspeed"


# ------------------------------------------------------------------------------------------------
# Partition layouts


@dataclasses.dataclass
class _Segment:
    """Elements [lo, hi) of parameter ``name`` sit at ``at`` in the owner's flat master."""

    name: str
    lo: int
    hi: int
    at: int


@dataclasses.dataclass
class _Owner:
    """One tensor the inner optimizer steps (a flat fp32 master partition, or a stage-0 param)."""

    group: int                 # index into the inner optimizer's param_groups
    key: torch.Tensor          # the optimizer.state key
    flat: torch.Tensor         # 1-D view of the master
    names: list[str]           # every parameter laid out in it (with or without local elements)
    segments: list[_Segment]   # the elements this rank holds


@dataclasses.dataclass
class _Layout:
    stage: int
    kind: str                  # "stage0" | "fp16_optimizer" | "zero12" | "zero3"
    dp_rank: int
    dp_size: int
    base: Any                  # the inner torch optimizer (state, param_groups)
    owners: list[_Owner]
    shapes: dict[str, tuple[int, ...]]   # every trainable parameter, in layout order
    replicated: bool           # every rank holds every element (stage 0)
    model_dtype: torch.dtype
    refresh: Any               # callable: push loaded masters into the module's weights
    wrapper: Any = None        # engine.optimizer (DeepSpeed's wrapper: loss scaler, partitions)
    master_dtype: torch.dtype = torch.float32   # fp32, or bf16 (bf16_master_weights_and_grads)


# DeepSpeed's two Adam kernels: FusedAdam (on the accelerator) and DeepSpeedCPUAdam (what
# ZeRO-Offload steps with). Their state is the same (exp_avg, exp_avg_sq shaped like the master, an
# int step) and so are their hyper-parameters, so a checkpoint of one loads exactly into the other:
# a job can turn offload on or off between runs, as DeepSpeed's own load allows (torch's
# Optimizer.load_state_dict checks no class). Adam vs AdamW is a constructor flag of both
# (adam_w_mode), recorded and checked on its own.
_ADAM_KERNELS = frozenset({"FusedAdam", "DeepSpeedCPUAdam"})


def _adam_w_mode(base) -> bool | None:
    """AdamW (decoupled weight decay) or Adam for DeepSpeed's Adam kernels; None for others (torch
    optimizers say it by their class)."""
    if type(base).__name__ not in _ADAM_KERNELS or not hasattr(base, "adam_w_mode"):
        return None
    return bool(base.adam_w_mode)


def _rank_size(group) -> tuple[int, int]:
    import torch.distributed as dist
    if not dist.is_initialized():
        return 0, 1
    return dist.get_rank(group=group), dist.get_world_size(group=group)


def _check_world(dp_size: int) -> None:
    import torch.distributed as dist
    world = dist.get_world_size() if dist.is_initialized() else 1
    if dp_size != world:
        raise UnsupportedValueError(
            f"the ZeRO data-parallel group has {dp_size} ranks but the job has {world}: only pure data "
            f"parallelism (one ZeRO group spanning the world) is supported", key=_META,
            remedy="Save model/pipeline-parallel DeepSpeed jobs with DeepSpeed's own checkpoints for now.")


def _names(engine) -> dict[int, str]:
    return {id(p): n for n, p in engine.module.named_parameters()}


def _name_of(names: dict[int, str], p) -> str:
    try:
        return names[id(p)]
    except KeyError:
        raise UnsupportedValueError("an optimized parameter is not a parameter of engine.module", key=_META,
                                    remedy="Pass the model's own parameters to deepspeed.initialize.") from None


def _layout(engine) -> _Layout:
    """This rank's view of the engine's optimizer partitions."""
    lay = _layout_of(engine)
    lay.wrapper = engine.optimizer
    dtypes = {owner.flat.dtype for owner in lay.owners}
    if len(dtypes) > 1:
        raise UnsupportedValueError(f"the ZeRO master partitions have several dtypes: {sorted(map(str, dtypes))}",
                                    key=_META)
    if dtypes:
        lay.master_dtype = dtypes.pop()
    return lay


def _layout_of(engine) -> _Layout:
    opt = engine.optimizer
    if opt is None:
        raise UnsupportedValueError("the DeepSpeed engine has no optimizer", key=_META,
                                    remedy="Save the module with distckpt.save({'model': engine.module.state_dict()}, path).")
    stage = int(engine.zero_optimization_stage())
    names = _names(engine)
    cls = type(opt).__name__
    check_offload(engine, opt)
    if cls == "DeepSpeedZeroOptimizer":
        return _layout_zero12(engine, opt, stage, names)
    if cls == "DeepSpeedZeroOptimizer_Stage3":
        return _layout_zero3(engine, opt, names)
    if cls == "FP16_Optimizer" and stage == 0:
        return _layout_fp16(engine, opt, names)
    if stage == 0 and isinstance(opt, torch.optim.Optimizer) and not hasattr(opt, "optimizer"):
        return _layout_stage0(engine, opt, names)
    raise UnsupportedValueError(f"DeepSpeed optimizer wrapper {cls} (ZeRO stage {stage}) is not supported",
                                key=_META, remedy="Use ZeRO stage 0-3 (DeepSpeed's ZeRO optimizers), in fp32 or bf16.")


def _offload_device(config: Any) -> str:
    """"cpu", "nvme" or "none": where a ZeRO offload section sends its tensors."""
    if config is None:
        return "none"
    device = getattr(config, "device", "none")
    return str(getattr(device, "value", device))


def check_offload(engine, opt) -> None:
    """Refuse the offload modes whose state does not sit in this process's memory as ZeRO's
    in-memory layouts describe it. CPU offload (ZeRO-Offload: ``offload_optimizer`` and, at stage
    3, ``offload_param`` on ``cpu``) only moves the same flat masters and optimizer state into
    host memory, and is read and written like the GPU-resident case.

    Raises:
        UnsupportedValueError: NVMe offload (state swapped out to files), partial offload (a share
            of the sub-groups stepped by a second optimizer) or ZenFlow.
    """
    found = []
    if _offload_device(engine.zero_offload_optimizer()) == "nvme" or getattr(opt, "swap_optimizer", False):
        found.append("offload_optimizer to NVMe (the optimizer state is swapped out to files)")
    if _offload_device(engine.zero_offload_param()) == "nvme" or getattr(opt, "params_in_nvme_and_cpu", False):
        found.append("offload_param to NVMe (the parameter partitions are swapped out to files)")
    if float(getattr(opt, "partial_offload", 1.0)) != 1.0:
        found.append(f"partial optimizer offload (ratio {opt.partial_offload}: some sub-groups are stepped by a "
                     f"second optimizer whose state this does not describe)")
    if getattr(opt, "zenflow", False):
        found.append("ZenFlow (overlapped, stale-gradient optimizer steps)")
    if found:
        raise UnsupportedValueError("DeepSpeed ZeRO " + "; ".join(found) + " is not supported", key=_META,
                                    remedy="Offload to cpu (offload_optimizer / offload_param device 'cpu', ratio "
                                    "1.0) or not at all; or save with DeepSpeed's own checkpoints.")


def _layout_zero12(engine, opt, stage: int, names) -> _Layout:
    owners, shapes = [], {}
    rank, size = _rank_size(opt.real_dp_process_group[0])
    for g in range(len(opt.round_robin_bit16_groups)):
        # every group partitioned over the whole job (an MoE expert group is not)
        _check_world(_rank_size(opt.real_dp_process_group[g])[1])
    for g, params in enumerate(opt.round_robin_bit16_groups):
        ps = int(opt.partition_size[g])
        start = rank * ps
        flat = opt.single_partition_of_fp32_groups[g]
        segs, gnames = [], []
        for p, meta, off in zip(params, opt.round_robin_bit16_meta[g], opt.round_robin_bit16_offsets[g]):
            name = _name_of(names, p)
            shapes[name] = tuple(meta.shape)
            gnames.append(name)
            lo, hi = max(off, start), min(off + meta.numel(), start + ps)
            if lo < hi:
                segs.append(_Segment(name, lo - off, hi - off, lo - start))
        owners.append(_Owner(g, flat, flat.view(-1), gnames, segs))
    def refresh(weights: bool = True):
        if weights:
            opt.update_lp_params()  # masters -> bit16 partitions, all-gathered (what a step does)
        if opt.optimizer.state:
            # DeepSpeed links each param's optimizer-state fragments (safe_get_full_optimizer_state,
            # universal checkpoints) once, lazily: relink to the state tensors as they are now.
            opt._hp_optimizer_states_linked = False
            opt._lazy_init_hp_params_optimizer_state()

    dtype = opt.bit16_groups_flat[0].dtype if opt.bit16_groups_flat else torch.float32
    return _Layout(stage, "zero12", rank, size, opt.optimizer, owners, shapes, False, dtype, refresh)


def _layout_zero3(engine, opt, names) -> _Layout:
    owners, shapes = [], {}
    rank, size = _rank_size(opt.dp_process_group)
    _check_world(size)
    for g, params in enumerate(opt.fp16_groups):
        flat = opt.fp32_partitioned_groups_flat[g]
        segs, gnames, at = [], [], 0
        for p in params:
            name = _name_of(names, p)
            numel, pn = int(p.ds_numel), int(p.partition_numel())
            shapes[name] = tuple(p.ds_shape)
            gnames.append(name)
            lo, hi = rank * pn, min((rank + 1) * pn, numel)
            if lo < hi:
                segs.append(_Segment(name, lo, hi, at))
            at += pn
        if at != flat.numel():
            raise UnsupportedValueError(f"ZeRO-3 sub-group {g}: {flat.numel()} master elements, {at} expected",
                                        key=_META)
        owners.append(_Owner(int(opt.sub_group_to_group_id.get(g, 0)), flat, flat.view(-1), gnames, segs))

    def refresh(weights: bool = True):  # (ZeRO-3's weights are always rebuilt: weights is ignored)
        # DeepSpeed's own _rigid_load_state_dict, minus the file reading.
        with torch.no_grad():
            for g, fp32 in enumerate(opt.fp32_partitioned_groups_flat):
                if fp32.numel() > 0:
                    opt.fp16_partitioned_groups_flat[g].data.copy_(fp32.data)
            for g, flat16 in enumerate(opt.fp16_partitioned_groups_flat):
                for part, q in zip(opt.fp16_partitioned_groups[g], opt.unflatten(flat16, opt.fp16_partitioned_groups[g])):
                    part.data = q.data
        # Persistent (small, never partitioned) parameters hold full copies: drop them and
        # re-gather from the partitions just written (DeepSpeed's load_state_dict, then its
        # checkpoint_event_epilogue, which also invalidates ZeRO++ secondary partitions).
        persistent = opt.persistent_parameters
        if persistent:
            persistent[0].partition(persistent)
        opt.checkpoint_event_epilogue()

    dtype = opt.fp16_partitioned_groups_flat[0].dtype if opt.fp16_partitioned_groups_flat else torch.float32
    return _Layout(3, "zero3", rank, size, opt.optimizer, owners, shapes, False, dtype, refresh)


def _layout_fp16(engine, opt, names) -> _Layout:
    from torch._utils import _unflatten_dense_tensors
    owners, shapes = [], {}
    rank, size = _rank_size(None)
    for g, params in enumerate(opt.fp16_groups):
        flat = opt.fp32_groups_flat[g]
        segs, gnames, at = [], [], 0
        for p in params:
            name = _name_of(names, p)
            shapes[name] = tuple(p.shape)
            gnames.append(name)
            if p.numel():
                segs.append(_Segment(name, 0, p.numel(), at))
            at += p.numel()
        owners.append(_Owner(g, flat, flat.view(-1), gnames, segs))

    def refresh(weights: bool = True):  # (weights is ignored: always rebuilt)
        with torch.no_grad():
            for g, params in enumerate(opt.fp16_groups):
                for p, q in zip(params, _unflatten_dense_tensors(opt.fp32_groups_flat[g], params)):
                    p.data.copy_(q.data)

    dtype = opt.fp16_groups[0][0].dtype if opt.fp16_groups and opt.fp16_groups[0] else torch.float32
    return _Layout(0, "fp16_optimizer", rank, size, opt.optimizer, owners, shapes, True, dtype, refresh)


def _layout_stage0(engine, opt, names) -> _Layout:
    owners, shapes = [], {}
    rank, size = _rank_size(None)
    dtype = torch.float32
    for g, group in enumerate(opt.param_groups):
        for p in group["params"]:
            name = _name_of(names, p)
            if not p.requires_grad:
                continue  # never stepped: saved with the frozen parameters (_frozen)
            if p.dtype != torch.float32:
                raise UnsupportedValueError(f"stage-0 parameter {name} is {p.dtype}, with no fp32 master", key=name,
                                            remedy="Enable bf16/fp16 in the DeepSpeed config (fp32 masters) or train in fp32.")
            shapes[name] = tuple(p.shape)
            owners.append(_Owner(g, p, p.data.view(-1), [name], [_Segment(name, 0, p.numel(), 0)] if p.numel() else []))
    return _Layout(0, "stage0", rank, size, opt, owners, shapes, True, dtype, lambda weights=True: None)


# ------------------------------------------------------------------------------------------------
# Layout -> state dict of LocalPieces


def _split(seg: _Segment, rank: int, size: int) -> _Segment | None:
    """The part of a replicated segment this rank writes (so every rank writes 1/size of it)."""
    n = seg.hi - seg.lo
    a, b = seg.lo + n * rank // size, seg.lo + n * (rank + 1) // size
    return _Segment(seg.name, a, b, seg.at + a - seg.lo) if a < b else None


# DeepSpeed's offload_states() keeps a host copy of each Adam state under "<key>_offload_buffer"
# (deepspeed.runtime.zero.offload_states) in the optimizer's state, for good: scratch, not state.
_SCRATCH_SUFFIX = "_offload_buffer"


def _flat_keys(lay: _Layout, state: dict, owner: _Owner) -> tuple[list[str], list[str]]:
    """(state keys shaped like the master, scalar state keys) of one owner's optimizer state."""
    flat, scalar = [], []
    for k, v in state.items():
        if isinstance(k, str) and k.endswith(_SCRATCH_SUFFIX) and k[:-len(_SCRATCH_SUFFIX)] in state:
            continue
        if torch.is_tensor(v) and v.dim() > 0 and v.shape == owner.key.shape:
            flat.append(k)
        elif (torch.is_tensor(v) and v.dim() == 0) or isinstance(v, (int, float)) and not isinstance(v, bool):
            scalar.append(k)
        else:
            raise UnsupportedValueError(f"optimizer state {k!r} of {type(lay.base).__name__} is neither shaped like "
                                        f"the master weights nor a scalar", key=f"optim.{owner.names[0]}.{k}")
    return sorted(flat), sorted(scalar)


def _pieces_for(lay: _Layout, *, writing: bool) -> dict[str, list[tuple[_Owner, _Segment]]]:
    """{param name: [(owner, segment)]} of the elements this rank writes (``writing``) or needs."""
    out: dict[str, list] = {name: [] for name in lay.shapes}
    for owner in lay.owners:
        for seg in owner.segments:
            if writing and lay.replicated:
                seg = _split(seg, lay.dp_rank, lay.dp_size)
                if seg is None:
                    continue
            out[seg.name].append((owner, seg))
    return out


def _leaf(shape, dtype, parts, tensor_of) -> LocalPieces:
    return LocalPieces.from_flat(shape, dtype, [(seg.lo, tensor_of(owner).narrow(0, seg.at, seg.hi - seg.lo))
                                               for owner, seg in parts])


def _meta(engine, lay: _Layout, flat_keys, scalar_keys) -> dict:
    # (a group's DeepSpeed bookkeeping objects are left out: not hyper-parameters a restart needs)
    groups = hyperparams.plain_groups(lay.base.param_groups)
    return {
        "format": FORMAT,
        "stage": lay.stage,
        "layout": lay.kind,
        "dp_size": lay.dp_size,
        "model_dtype": str(lay.model_dtype).replace("torch.", ""),
        "master_dtype": dtype_name(lay.master_dtype),
        "state_dtypes": {k: dtype_name(d) for k, d in _state_dtypes(lay, flat_keys).items()},
        "optimizer": type(lay.base).__name__,
        "adam_w_mode": _adam_w_mode(lay.base),
        "params": [[name, list(shape)] for name, shape in lay.shapes.items()],
        "state_keys": flat_keys,
        "scalar_keys": scalar_keys,
        "param_groups": groups,
        "group_of": {name: owner.group for owner in lay.owners for name in owner.names},
        "engine": {"global_steps": int(engine.global_steps), "global_samples": int(engine.global_samples),
                   "skipped_steps": int(getattr(engine, "skipped_steps", 0))},
        "lr_scheduler": None,  # state_dict() sets where the scheduler's state is
        "loss_scaler": _scaler_state(engine.optimizer),
    }


def _scaler_state(opt) -> dict | None:
    """The loss scaler's plain attributes (fp16's dynamic scale, its iteration and hysteresis
    counters; a constant 1.0 for fp32/bf16), so a load does not silently reset them."""
    scaler = getattr(opt, "loss_scaler", None)
    if scaler is None:
        return None
    state = {k: v for k, v in vars(scaler).items() if v is None or isinstance(v, (bool, int, float, str))}
    return {"class": type(scaler).__name__, "state": state}


def _set_scaler(opt, saved: dict | None, path: str) -> None:
    """Set the scaler's plain attributes that it has now (checked by :func:`_check_restorable`);
    a saved attribute this DeepSpeed's scaler does not have is not created."""
    scaler = getattr(opt, "loss_scaler", None)
    if saved is None or scaler is None:
        return
    now = vars(scaler)
    for k, v in saved["state"].items():
        if k in now:
            setattr(scaler, k, v)


def _state_keys(lay: _Layout) -> tuple[list[str], list[str]]:
    """The optimizer's state keys, the same for every owner (an empty state before the first step)."""
    seen = None
    for owner in lay.owners:
        state = lay.base.state.get(owner.key, {})
        keys = _flat_keys(lay, state, owner)
        if seen is None:
            seen = keys
        elif keys != seen:
            raise UnsupportedValueError(f"optimizer state keys differ between parameter groups: {seen} and {keys}",
                                        key=_META)
    return seen or ([], [])


def _state_dtypes(lay: _Layout, flat_keys: list[str]) -> dict[str, torch.dtype]:
    """{state key: dtype} of the optimizer's per-element state (fp32, or bf16 under DeepSpeed's
    ``bf16_optimizer_states``), the same for every owner."""
    out: dict[str, torch.dtype] = {}
    for k in flat_keys:
        dtypes = {lay.base.state[owner.key][k].dtype for owner in lay.owners if k in lay.base.state.get(owner.key, {})}
        if len(dtypes) > 1:
            raise UnsupportedValueError(f"optimizer state {k!r} has several dtypes: {sorted(map(str, dtypes))}",
                                        key=_META)
        out[k] = dtypes.pop() if dtypes else _fresh_state_dtype(lay)
    return out


def _fresh_state_dtype(lay: _Layout) -> torch.dtype:
    """The dtype the optimizer gives per-element state it creates at its first step: the master's
    (``zeros_like``), except DeepSpeedCPUAdam's fp32 states over bf16 masters
    (``fp32_optimizer_states``, its default)."""
    if getattr(lay.base, "fp32_optimizer_states", False):
        return torch.float32
    return lay.master_dtype


def _module_buffers(engine) -> dict[str, torch.Tensor]:
    """{name: buffer} of the module's persistent buffers: those its ``state_dict()`` holds, as
    DeepSpeed's ``zero_to_fp32`` gives them. Non-persistent buffers
    (``register_buffer(..., persistent=False)``, e.g. a rotary embedding's ``inv_freq``) are left
    out at every stage: a strict ``load_state_dict`` of the consolidated model rejects them."""
    module = engine.module
    non_persistent = {f"{prefix}.{name}" if prefix else name
                      for prefix, mod in module.named_modules(remove_duplicate=False)
                      for name in mod._non_persistent_buffers_set}
    # Below stage 3 the state dict also drops what a module's own state-dict hooks leave out; at
    # stage 3 it is not built (its parameters are partitioned placeholders).
    sd_keys = set(module.state_dict().keys()) if engine.zero_optimization_stage() < 3 else None
    out = {}
    for name, buf in module.named_buffers():
        if name not in non_persistent and (sd_keys is None or name in sd_keys):
            out[name] = buf
    return out


def _frozen(engine, lay: _Layout) -> dict[str, Any]:
    """{name: leaf} of the parameters no optimizer steps (requires_grad=False: a frozen base model
    under LoRA), in the module's own dtype (as zero_to_fp32.py gives them). Stage 0-2 hold them
    whole on every rank (a replicated plain tensor, written once); stage 3 partitions them like
    every other parameter (``ds_tensor``: elements [r*pn, (r+1)*pn) on rank r)."""
    out: dict[str, Any] = {}
    for name, p in engine.module.named_parameters():
        if name in lay.shapes:
            continue
        if not hasattr(p, "ds_tensor"):
            out[name] = p.data
            continue
        numel, pn = int(p.ds_numel), int(p.ds_tensor.ds_numel)
        lo, hi = lay.dp_rank * pn, min((lay.dp_rank + 1) * pn, numel)
        ranges = [(lo, p.ds_tensor.data.view(-1).narrow(0, 0, hi - lo))] if lo < hi else []
        out[name] = LocalPieces.from_flat(tuple(p.ds_shape), p.ds_tensor.dtype, ranges)
    return out


def _aliases(engine, saved: set[str]) -> list[list[str]]:
    """[[alias, name]] of the module's parameters registered under several names (tied
    embeddings: ``lm_head.weight`` is ``embed_tokens.weight``); each is saved once, under the first
    name ``named_parameters`` gives. ``zero_to_fp32`` gives both: :func:`consolidated` does too."""
    first: dict[int, str] = {}
    out = []
    for name, p in engine.module.named_parameters(remove_duplicate=False):
        if id(p) not in first:
            first[id(p)] = name
        elif first[id(p)] in saved:
            out.append([name, first[id(p)]])
    return out


def consolidated(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """The consolidated model of a checkpoint written by :func:`save`, as DeepSpeed's
    ``zero_to_fp32`` gives it: every master weight in its parameter's full shape, the frozen
    parameters and persistent buffers, and each tied parameter under every name it has (one
    tensor object, as ``zero_to_fp32`` shares it), so the model loads it with
    ``load_state_dict(strict=True)``. One process, no DeepSpeed needed. (``distckpt.read(path,
    keys=["model"])["model"]`` is the same without the aliases.)

    Raises:
        ReshardError: not such a checkpoint. ManifestCorruptError: its metadata is malformed.
        The errors of :func:`distckpt.read`.
    """
    from ...restore import read
    path = os.path.abspath(os.fspath(path))
    meta = _saved_meta(path)
    model = read(path, keys=["model"])["model"]
    for alias, name in meta.get("aliases", []):
        if name not in model:
            raise ManifestCorruptError(f"the '{_META}' metadata ties {alias!r} to {name!r}, which the checkpoint "
                                       f"does not hold", path=path, key=f"{_META}.aliases")
        model[alias] = model[name]
    return model


def _leaf_shape(leaf: Any) -> list[int]:
    return list(leaf.shape)


def state_dict(engine, *, client_state: Any = None, lr_scheduler: bool = True,
               exclude_frozen_parameters: bool = False) -> tuple[dict, dict]:
    """(state dict for :func:`distckpt.save`, plain ``deepspeed`` metadata) of this rank's ZeRO state.

    The state dict's tensors are views of the engine's own buffers (nothing is copied).
    ``lr_scheduler``: include the engine's lr scheduler state (key ``lr_scheduler``; DeepSpeed's
    checkpoint engine stores it in DeepSpeed's own model-states entry instead).
    ``exclude_frozen_parameters``: leave the parameters no optimizer steps out, as DeepSpeed's
    ``save_checkpoint`` option does (a load then keeps the engine's own frozen weights).
    Collective only in what :func:`distckpt.save` does with it.

    Raises:
        UnsupportedValueError: a container of the scheduler's state that would not load back as
            its own type (:func:`distckpt.containers.record`); an engine layout this cannot describe.
    """
    lay = _layout(engine)
    frozen = {} if exclude_frozen_parameters else _frozen(engine, lay)
    flat_keys, scalar_keys = _state_keys(lay)
    parts = _pieces_for(lay, writing=True)
    owner_of = {name: owner for owner in lay.owners for name in owner.names}
    model: dict[str, Any] = {}
    optim: dict[str, Any] = {}
    state_dtypes = _state_dtypes(lay, flat_keys)
    for name, shape in lay.shapes.items():
        model[name] = _leaf(shape, lay.master_dtype, parts[name], lambda o: o.flat)
        entry = {}
        for k in flat_keys:
            entry[k] = _leaf(shape, state_dtypes[k], parts[name], lambda o, k=k: lay.base.state[o.key][k].view(-1))
        for k in scalar_keys:
            v = lay.base.state[owner_of[name].key][k]
            entry[k] = v.detach().clone() if torch.is_tensor(v) else v
        optim[name] = entry
    model.update(frozen)
    for name, buf in _module_buffers(engine).items():
        model[name] = buf
    meta = _meta(engine, lay, flat_keys, scalar_keys)
    meta["frozen"] = [[name, _leaf_shape(leaf)] for name, leaf in frozen.items()]
    meta["aliases"] = _aliases(engine, set(model))
    meta["frozen_excluded"] = bool(exclude_frozen_parameters)
    sd = {"model": model, "optim": optim}
    sched = getattr(engine, "lr_scheduler", None)
    if lr_scheduler and sched is not None and hasattr(sched, "state_dict"):
        state = sched.state_dict()
        meta["lr_scheduler"] = {"key": "lr_scheduler", "containers": containers.record(state),
                                "class": type(sched).__name__}
        if flatten(state, check_objects=False)[1]:
            sd["lr_scheduler"] = state
        else:  # nothing but (nested) empty dicts: no key to read back, so kept here as JSON
            meta["lr_scheduler"] = {"key": None, "json": state, "containers": meta["lr_scheduler"]["containers"],
                                    "class": type(sched).__name__}
    if client_state is not None:
        # a client_state with no value in it ({}) has no key to read back: this says it was given
        meta["client_saved"] = True
        # its OrderedDicts, Counters and defaultdicts come back as such (load rebuilds them), as
        # from engine.save_checkpoint
        # (recorded under the "client" key it is saved at: its own keys are not the root's)
        meta["client_containers"] = containers.record({"client": client_state})
        # and its nn.Parameters and shared tensors too, as torch.save keeps them
        meta["client_tensors"] = tensorrecords.record({"client": client_state})
    try:
        sd[_META] = json.dumps(meta, sort_keys=True)
    except (TypeError, ValueError) as exc:  # a leafless scheduler state, or records, JSON cannot hold
        raise UnsupportedValueError(f"the DeepSpeed metadata is not plain JSON data: {exc}", key=_META) from None
    if client_state is not None:
        sd["client"] = client_state
    return sd, meta


def save(engine, path: str | os.PathLike, *, client_state: Any = None, overwrite: bool = False,
         metadata: dict | None = None, exclude_frozen_parameters: bool = False, replicated: Any = "check"):
    """Save the engine's fp32 master weights, optimizer state and counters to ``path``, reshardable.

    Collective: every rank of the job calls it. Every rank writes only the elements its ZeRO
    partition holds (stage 0: a 1/N slice of each replicated tensor); rank 0 commits atomically
    (:func:`distckpt.save`'s protocol and guarantees).

    Args:
        engine: a ``deepspeed.DeepSpeedEngine`` (ZeRO stage 0-3, fp32 or bf16, optimizer and
            parameters on the accelerator or offloaded to the CPU, one
            data-parallel group spanning the job).
        path: the checkpoint directory to create.
        client_state: plain values and tensors saved under ``client``. A value that differs
            between ranks is a StateDictMismatchError naming it, unless ``replicated="rank0"``
            (rank 0's kept: what ``engine.save_checkpoint`` does, DeepSpeed's and distckpt's
            engine alike, since rank 0 alone writes it there).
        replicated: as :func:`distckpt.save` (``"check"``, ``"rank0"``, or keys of the saved
            tree: a client_state entry ``k`` is ``"client.k"``).
        exclude_frozen_parameters: leave out the parameters no optimizer steps (DeepSpeed's
            option of that name); a load keeps the engine's own.
        overwrite, metadata: as :func:`distckpt.save` (``metadata["deepspeed"]`` is set here).

    Returns:
        :class:`distckpt.SaveResult`.

    Raises:
        UnsupportedValueError: an engine layout this cannot describe (NVMe or partial offload, model/pipeline
            parallel groups, an optimizer state that is neither per element nor
            scalar). The errors of :func:`distckpt.save`.
    """
    from ... import save as _save
    from ..._dist import control_group
    # A state one rank cannot describe (a client_state value only it holds) fails every rank here,
    # not only that one while the others wait at the save's first collective.
    sd = meta = error = None
    try:
        sd, meta = state_dict(engine, client_state=client_state, exclude_frozen_parameters=exclude_frozen_parameters)
    except Exception as exc:  # noqa: BLE001 - raised on every rank just below
        error = exc
    control_group(operation="deepspeed.save()").exchange_outcome(error, operation="deepspeed.save")
    md = dict(metadata or {})
    md["deepspeed"] = {"format": FORMAT, "stage": meta["stage"], "dp_size": meta["dp_size"],
                       "model_dtype": meta["model_dtype"], "master_dtype": meta["master_dtype"],
                       "optimizer": meta["optimizer"],
                       "params": len(meta["params"])}
    return _save(sd, path, overwrite=overwrite, metadata=md, replicated=replicated)


# ------------------------------------------------------------------------------------------------
# Load


@dataclasses.dataclass
class ZeroLoadResult:
    """What :func:`load` did: ``result`` is the :class:`distckpt.LoadResult` (``bytes_read`` is
    what this rank read), ``client_state`` the saved ``client_state`` (or None), ``saved_dp_size``
    and ``saved_stage`` the saving job's."""

    result: Any
    client_state: Any
    saved_dp_size: int
    saved_stage: int


def _saved_meta(path: str) -> dict:
    from ...restore import read
    try:
        raw = read(path, keys=[_META])[_META]
    except KeyError:
        raw = None
    except Exception as exc:
        from ...errors import StateDictMismatchError
        if isinstance(exc, StateDictMismatchError):
            raw = None
        else:
            raise
    if not isinstance(raw, str):
        raise ReshardError("the checkpoint is not a distckpt DeepSpeed ZeRO checkpoint (no 'deepspeed' entry)",
                           path=path, key=_META, remedy="Load it with distckpt.load/read, or save with "
                           "distckpt.integrations.deepspeed.save.")
    try:
        meta = json.loads(raw)
    except ValueError as exc:
        raise ManifestCorruptError(f"the '{_META}' entry is not JSON: {exc}", path=path, key=_META) from None
    if not isinstance(meta, dict):
        raise ManifestCorruptError(f"the '{_META}' entry is a JSON {type(meta).__name__}, not an object",
                                   path=path, key=_META)
    if meta.get("format") not in _READS:
        raise ReshardError(f"checkpoint format {meta.get('format')!r}, this reads {list(_READS)}", path=path, key=_META)
    _check_meta(meta, path)
    return meta


def _is_int(v: Any, low: int = 0) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= low


def _is_shapes(v: Any) -> bool:
    """[[name, [dim, ...]], ...]"""
    return isinstance(v, list) and all(
        isinstance(e, list) and len(e) == 2 and isinstance(e[0], str) and isinstance(e[1], list)
        and all(_is_int(d) for d in e[1]) for e in v)


def _is_strs(v: Any) -> bool:
    return isinstance(v, list) and all(isinstance(e, str) for e in v)


def _check_meta(meta: dict, path: str) -> None:
    """Check the saved metadata's form, field by field, before anything uses it: a damaged or
    crafted entry is refused here, typed, with the engine untouched, instead of failing midway as
    a KeyError or setting the engine's step counter to a string.

    Raises:
        ManifestCorruptError: naming the first field that is missing or of the wrong form.
    """
    checks = {  # field: (required, test, what it must be)
        "stage": (True, lambda v: _is_int(v) and v <= 3, "a ZeRO stage 0-3"),
        "dp_size": (True, lambda v: _is_int(v, 1), "a positive int"),
        "optimizer": (True, lambda v: isinstance(v, str), "a class name"),
        "params": (True, _is_shapes, "a list of [name, shape]"),
        "state_keys": (True, _is_strs, "a list of str"),
        "scalar_keys": (True, _is_strs, "a list of str"),
        "param_groups": (True, lambda v: isinstance(v, list) and all(isinstance(g, dict) for g in v),
                         "a list of objects"),
        "engine": (True, lambda v: isinstance(v, dict) and all(
            _is_int(v.get(k)) for k in ("global_steps", "global_samples", "skipped_steps")),
            "an object of three counts (global_steps, global_samples, skipped_steps)"),
        "master_dtype": (False, lambda v: isinstance(v, str), "a dtype name"),
        "state_dtypes": (False, lambda v: isinstance(v, dict) and all(isinstance(x, str) for x in v.values()),
                         "an object of dtype names"),
        "adam_w_mode": (False, lambda v: v is None or isinstance(v, bool), "a bool"),
        "group_of": (False, lambda v: isinstance(v, dict) and all(_is_int(x) for x in v.values()),
                     "an object of group indexes"),
        "layout": (False, lambda v: v in ("stage0", "fp16_optimizer", "zero12", "zero3"),
                   "one of stage0, fp16_optimizer, zero12, zero3"),
        "frozen": (False, _is_shapes, "a list of [name, shape]"),
        "aliases": (False, lambda v: isinstance(v, list) and all(
            isinstance(e, list) and len(e) == 2 and all(isinstance(x, str) for x in e) for e in v),
            "a list of [alias, name]"),
        "frozen_excluded": (False, lambda v: isinstance(v, bool), "a bool"),
        "client_saved": (False, lambda v: isinstance(v, bool), "a bool"),
        "loss_scaler": (False, lambda v: v is None or (isinstance(v, dict) and isinstance(v.get("class"), str)
                                                       and isinstance(v.get("state"), dict)),
                        "null or an object of a class name and a state object"),
        "lr_scheduler": (False, lambda v: v is None or isinstance(v, dict) and (
            meta["format"] == "distckpt.deepspeed/1"
            or ((v.get("key") is None or isinstance(v.get("key"), str)) and "containers" in v
                and (v.get("key") is not None or isinstance(v.get("json"), dict)))),
            "null or an object naming where the scheduler's state is"),
    }
    for field, (required, test, what) in checks.items():
        if field not in meta:
            if required:
                raise ManifestCorruptError(f"the '{_META}' metadata has no {field!r}", path=path,
                                           key=f"{_META}.{field}")
            continue
        if not test(meta[field]):
            raise ManifestCorruptError(f"the '{_META}' metadata's {field!r} is not {what}: "
                                       f"{str(meta[field])[:200]}", path=path, key=f"{_META}.{field}")
    # group_of names the saved parameters' groups: a name no parameter has, or a group past the
    # saved ones, is no metadata a save writes.
    named = ({p[0] for p in meta["params"]} | {p[0] for p in meta.get("frozen") or ()}
             | {a[0] for a in meta.get("aliases") or ()})
    for name, group in (meta.get("group_of") or {}).items():
        if name not in named or group >= len(meta["param_groups"]):
            raise ManifestCorruptError(f"the '{_META}' metadata's 'group_of' puts {name!r} in group {group}: "
                                       + ("no saved parameter has that name" if name not in named else
                                          f"only {len(meta['param_groups'])} param groups were saved"),
                                       path=path, key=f"{_META}.group_of")


def _reconcile(path: str, meta: dict, lay: _Layout, allow_stage_change: bool, frozen_now: dict | None = None,
               check_state: bool = True) -> None:
    """Raise ReshardError for every way the target differs from the saved job such that the load
    would not be exact."""
    saved = {name: tuple(shape) for name, shape in meta["params"]}
    problems = []
    missing = [n for n in lay.shapes if n not in saved]
    extra = [n for n in saved if n not in lay.shapes]
    reshaped = [f"{n}: saved {list(saved[n])}, now {list(s)}" for n, s in lay.shapes.items()
                if n in saved and saved[n] != s]
    saved_frozen = {name: tuple(shape) for name, shape in meta.get("frozen", [])}
    frozen = {name: tuple(leaf.shape) for name, leaf in (frozen_now or {}).items()}
    if saved_frozen != frozen:
        problems.append(f"frozen (requires_grad=False) parameters differ: saved {sorted(saved_frozen)[:5]}, "
                        f"now {sorted(frozen)[:5]}" if set(saved_frozen) != set(frozen) else
                        f"frozen parameters changed shape: saved {saved_frozen}, now {frozen}")
    if missing:
        problems.append(f"{len(missing)} parameter(s) not in the checkpoint: {missing[:5]}")
    if extra:
        problems.append(f"{len(extra)} saved parameter(s) the model does not have: {extra[:5]}")
    if reshaped:
        problems.append(f"{len(reshaped)} parameter(s) changed shape: {reshaped[:5]}")
    now_opt = type(lay.base).__name__
    if meta["optimizer"] != now_opt and not {meta["optimizer"], now_opt} <= _ADAM_KERNELS:
        problems.append(f"saved optimizer {meta['optimizer']}, now {now_opt} (its state "
                        f"does not carry over exactly)")
    saved_mode, mode = meta.get("adam_w_mode"), _adam_w_mode(lay.base)
    if saved_mode is not None and mode is not None and saved_mode != mode:
        problems.append(f"saved with {'AdamW' if saved_mode else 'Adam'} (adam_w_mode={saved_mode}), this optimizer "
                        f"is {'AdamW' if mode else 'Adam'}: the mode is the kernel's, a load cannot change it")
    if len(meta["param_groups"]) != len(lay.base.param_groups):
        problems.append(f"saved {len(meta['param_groups'])} optimizer param group(s), now {len(lay.base.param_groups)}")
    else:
        # hyper-parameters are restored group by group: each parameter must sit in the same group
        now = {name: owner.group for owner in lay.owners for name in owner.names}
        moved = [f"{n}: group {g} -> {now[n]}" for n, g in meta.get("group_of", {}).items() if n in now and now[n] != g]
        if moved:
            problems.append(f"{len(moved)} parameter(s) in another optimizer param group: {moved[:5]}")
    # Masters and state may widen exactly (bf16 saved, fp32 now: bf16_master_weights_and_grads
    # turned off); narrowing would round them.
    saved_master = meta.get("master_dtype", "float32")
    if not _widens(saved_master, dtype_name(lay.master_dtype)):
        problems.append(f"saved master weights in {saved_master}, this engine's are {dtype_name(lay.master_dtype)} "
                        f"(bf16_master_weights_and_grads differs; a load would round them)")
    if check_state:
        saved_states = meta.get("state_dtypes") or {k: "float32" for k in meta["state_keys"]}
        have = _state_keys(lay)[0]
        now_states = {k: dtype_name(d) for k, d in _state_dtypes(lay, have).items()}
        if not have:  # no state yet: what the optimizer's first step would create
            now_states = {k: dtype_name(_fresh_state_dtype(lay)) for k in saved_states}
        changed = [f"{k}: saved {v}, now {now_states[k]}" for k, v in sorted(saved_states.items())
                   if k in now_states and not _widens(v, now_states[k])]
        if changed:
            problems.append(f"optimizer state in a narrower dtype ({'; '.join(changed)}: fp32_optimizer_states or "
                            f"bf16_optimizer_states differs; a load would round it)")
    saved_scaler = (meta.get("loss_scaler") or {}).get("class")
    scaler = getattr(lay.wrapper, "loss_scaler", None)
    if saved_scaler and scaler is not None and saved_scaler != type(scaler).__name__:
        problems.append(f"saved loss scaler {saved_scaler}, now {type(scaler).__name__} (another precision setting)")
    stages = {meta["stage"], lay.stage}
    if len(stages) > 1 and stages != {1, 2} and not allow_stage_change:
        problems.append(f"saved at ZeRO stage {meta['stage']}, loading at stage {lay.stage} (stages 1 and 2 share one "
                        f"layout; any other change must be asked for: the per-parameter values carry over exactly, "
                        f"but the stages count optimizer steps differently, e.g. stage 0 with bf16 takes one "
                        f"warm-up step at start)")
    if problems:
        raise ReshardError("DeepSpeed checkpoint cannot be loaded exactly onto this engine: " + "; ".join(problems),
                           path=path, key=_META, remedy="Build the engine with the saved model, optimizer and "
                           "ZeRO stage (pass allow_stage_change=True to change only the stage).")


def _saved_tensors(path: str) -> dict:
    """The checkpoint's tensor entries, decoded once per load (a stage-0 engine asks once per
    parameter), keyed on the MANIFEST's identity so a checkpoint replaced in place is re-read."""
    st = os.stat(os.path.join(path, "MANIFEST"))
    return _saved_tensors_of(path, (st.st_ino, st.st_size, st.st_mtime_ns))


@functools.lru_cache(maxsize=1)
def _saved_tensors_of(path: str, identity: tuple) -> dict:
    from ...restore import load_manifest
    return load_manifest(path).tensors


def _scalar_slot(path: str, name: str, key: str) -> Any:
    """Where a fresh optimizer receives saved scalar state ``key``: a tensor of the saved dtype and
    shape when it was saved as a tensor (torch Adam's ``step``), else a plain value."""
    entry = _saved_tensors(path).get(f"optim.{name}.{key}")
    if entry is None:
        return 0
    return torch.zeros(tuple(entry.shape), dtype=dtype_from_name(entry.dtype, path=path))


def _widens(saved: str, now: str) -> bool:
    """Whether values saved in dtype ``saved`` load exactly into dtype ``now``."""
    return saved == now or now in EXACT_CASTS.get(saved, ())


def _ensure_state(lay: _Layout, meta: dict, path: str) -> None:
    """Give every owner the saved state keys (an optimizer that has not stepped has none yet)."""
    flat_keys, scalar_keys = meta["state_keys"], meta["scalar_keys"]
    have_flat, have_scalar = _state_keys(lay)
    if not flat_keys and not scalar_keys:
        # Saved before the optimizer's first step: its state is none at all (the next step creates
        # it afresh, as it did in the saved job), whatever this engine has stepped since.
        for owner in lay.owners:
            lay.base.state.pop(owner.key, None)
        return
    if not have_flat and not have_scalar:
        for owner in lay.owners:
            st = lay.base.state[owner.key]
            for k in flat_keys:
                st[k] = torch.zeros_like(owner.key, dtype=_fresh_state_dtype(lay))
            for k in scalar_keys:
                st[k] = _scalar_slot(path, owner.names[0], k)  # replaced below by the loaded value
        return
    if (have_flat, have_scalar) != (flat_keys, scalar_keys):
        raise ReshardError(f"optimizer state keys differ: saved {flat_keys + scalar_keys}, now {have_flat + have_scalar}",
                           path=path, key=_META, remedy="Use the saved optimizer (class and options such as amsgrad).")


def load(engine, path: str | os.PathLike, *, load_optimizer_states: bool = True,
         load_lr_scheduler_states: bool = True, allow_stage_change: bool = False,
         verify: bool = True, keep_module_weights: bool = False) -> ZeroLoadResult:
    """Load a checkpoint written by :func:`save` into ``engine``, at any data-parallel size.

    Collective: every rank calls it. Each rank reads only the byte ranges its own partition needs
    (stage 0: everything, it is replicated), then the module weights are rebuilt from the
    masters the way a DeepSpeed step does. The masters and optimizer state are bit-identical to
    the saved ones (or widened exactly: bf16 saved, fp32 now); the engine's step counters, param-group hyper-parameters (lr, betas, ...)
    and lr-scheduler state are restored.

    ``keep_module_weights`` (stage 1/2): keep the module weights the engine holds instead of
    rebuilding them from the masters: the checkpoint engine (:mod:`.engine`) has just set them
    from the checkpoint's own copy, as DeepSpeed's load does.

    Raises:
        ReshardError: the checkpoint is not such a checkpoint, or cannot be loaded exactly onto
            this engine (other parameters or shapes, frozen parameters, optimizer class, Adam
            mode or state keys, masters or state a load would round, another number of param groups or a parameter in another group, another loss
            scaler, another ZeRO stage without ``allow_stage_change`` (1 <-> 2 always loads),
            scalar state such as Adam's step that differs between parameters that now share one
            flat group). Raised on every rank before the engine changes.
        ManifestCorruptError: the ``deepspeed`` metadata, a hyper-parameter, a loss-scaler
            attribute or a scalar state of the wrong form (a damaged or crafted checkpoint), before
            the engine changes.
        UnsupportedValueError: as :func:`save`. The errors of :func:`distckpt.load`.
    """
    from ...source import pinned
    path = os.path.abspath(os.fspath(path))
    # Its reads (metadata, scalars, tensors, client state) decode the MANIFEST once and all come
    # from one checkpoint, or the load raises CheckpointRemovedError.
    with pinned(path):
        return _load_pinned(engine, path, load_optimizer_states=load_optimizer_states,
                            load_lr_scheduler_states=load_lr_scheduler_states,
                            allow_stage_change=allow_stage_change, verify=verify,
                            keep_module_weights=keep_module_weights)


def _check_resident(lay: _Layout, path: str) -> None:
    """Refuse a load into an engine whose states DeepSpeed's ``offload_states()`` moved away: its
    partitions are not where the layout reads and writes them until ``reload_states()``.

    Raises:
        UnsupportedValueError: naming the offloaded states, before the engine changes.
    """
    away = getattr(lay.wrapper, "offloaded_states", None)
    if away:
        names = sorted(str(getattr(s, "value", s)) for s in away)
        raise UnsupportedValueError(f"the engine's {names} are offloaded (engine.offload_states()): a load would "
                                    f"write partitions that are not in place", key=_META, path=path,
                                    remedy="Call engine.reload_states() before loading.")


def _checked_target(engine, path: str, load_optimizer_states: bool, allow_stage_change: bool):
    """(saved metadata, the engine's layout, its frozen parameters to load) once the engine's
    states are in place and the checkpoint loads onto it exactly (:func:`_reconcile`). Frozen
    parameters left out at save (exclude_frozen_parameters) keep the engine's own values."""
    meta = _saved_meta(path)
    lay = _layout(engine)
    _check_resident(lay, path)
    frozen = {} if meta.get("frozen_excluded") else _frozen(engine, lay)
    _reconcile(path, meta, lay, allow_stage_change, frozen, check_state=load_optimizer_states)
    return meta, lay, frozen


def check_loadable(engine, path: str, *, load_optimizer_states: bool = True, allow_stage_change: bool = False) -> None:
    """Every check :func:`load` makes before it changes the engine, changing nothing: for a caller
    (the checkpoint engine of :mod:`.engine`) that restores other state before it calls
    :func:`load`. ``path`` is absolute, and pinned by the caller.

    Raises:
        What :func:`load` raises before the engine changes (ReshardError, ManifestCorruptError,
        UnsupportedValueError).
    """
    meta, lay, _frozen_now = _checked_target(engine, path, load_optimizer_states, allow_stage_change)
    if load_optimizer_states:
        _check_restorable(lay, meta, path)
        try:
            _owner_scalars(lay, meta, path)
        finally:
            _saved_tensors_of.cache_clear()


def _load_pinned(engine, path: str, *, load_optimizer_states: bool, load_lr_scheduler_states: bool,
                 allow_stage_change: bool, verify: bool, keep_module_weights: bool) -> ZeroLoadResult:
    """:func:`load` inside its pin of ``path`` (an absolute path)."""
    from ...restore import load as _load
    meta, lay, frozen = _checked_target(engine, path, load_optimizer_states, allow_stage_change)
    sched = getattr(engine, "lr_scheduler", None)
    sched_state = None
    if load_optimizer_states and load_lr_scheduler_states and sched is not None \
            and meta.get("lr_scheduler") is not None:
        saved_class = meta["lr_scheduler"].get("class") if isinstance(meta["lr_scheduler"], dict) else None
        if saved_class is not None and saved_class != type(sched).__name__:
            # Its state would not fit (a KeyError midway) or would silently lose the position.
            raise ReshardError(f"saved with lr scheduler {saved_class}, this engine's is {type(sched).__name__}",
                               path=path, key=f"{_META}.lr_scheduler",
                               remedy="Build the engine with the saved scheduler, or load with "
                                      "load_lr_scheduler_states=False.")
        sched_state = _scheduler_state(path, meta)  # read before anything in the engine changes
    # the client state, read and rebuilt before anything in the engine changes
    client = _client_state(path, meta)
    if load_optimizer_states:
        _check_restorable(lay, meta, path)
        # scalar state (step) first: checked before anything in the engine changes
        scalars = _owner_scalars(lay, meta, path)
        try:
            _ensure_state(lay, meta, path)
        finally:
            _saved_tensors_of.cache_clear()  # keep no manifest after the load
    parts = _pieces_for(lay, writing=False)
    model: dict[str, Any] = {}
    optim: dict[str, Any] = {}
    # the dtypes this engine holds (the saved ones widen into them exactly: _reconcile)
    state_dtypes = _state_dtypes(lay, meta["state_keys"]) if load_optimizer_states else {}
    for name, shape in lay.shapes.items():
        model[name] = _leaf(shape, lay.master_dtype, parts[name], lambda o: o.flat)
        if load_optimizer_states:
            optim[name] = {k: _leaf(shape, state_dtypes[k], parts[name],
                                    lambda o, k=k: lay.base.state[o.key][k].view(-1)) for k in meta["state_keys"]}
    model.update(frozen)
    for name, buf in _module_buffers(engine).items():
        model[name] = buf
    sd: dict[str, Any] = {"model": model}
    if load_optimizer_states:
        sd["optim"] = optim
    with torch.no_grad():
        res = _load(sd, path, verify=verify)
    if load_optimizer_states:
        for owner, values in scalars:
            st = lay.base.state[owner.key]
            for k, v in values.items():
                if torch.is_tensor(st.get(k)) and torch.is_tensor(v):
                    st[k].copy_(v)
                else:
                    st[k] = v
        hyperparams.set_groups(lay.base.param_groups, meta["param_groups"])
        _set_scaler(engine.optimizer, meta.get("loss_scaler"), path)
        engine.global_steps = meta["engine"]["global_steps"]
        engine.global_samples = meta["engine"]["global_samples"]
        engine.skipped_steps = meta["engine"]["skipped_steps"]
        if sched_state is not None:
            sched.load_state_dict(sched_state)
    lay.refresh(weights=not keep_module_weights)
    return ZeroLoadResult(res, client, meta["dp_size"], meta["stage"])


def _client_state(path: str, meta: dict) -> Any:
    """The saved ``client_state`` with its containers and tensor records rebuilt, or None."""
    client = None
    if _has_key(path, "client"):
        from ...restore import read
        client = read(path, keys=["client"])["client"]
    elif meta.get("client_saved"):
        client = {}  # saved with no value in it (it came back as None)
    if client is not None:
        if meta.get("client_containers"):
            client = containers.rebuild({"client": client}, meta["client_containers"],
                                        where=f"{_META}.client_containers", path=path)["client"]
        if meta.get("client_tensors"):
            client = tensorrecords.restore({"client": client}, meta["client_tensors"],
                                           where=f"{_META}.client_tensors", path=path)["client"]
    return client


def _scheduler_state(path: str, meta: dict) -> dict:
    """The saved lr scheduler state, with its containers' types (format 1: the JSON copy)."""
    saved = meta["lr_scheduler"]
    if meta["format"] == "distckpt.deepspeed/1":
        return saved
    from ...restore import read
    key = saved["key"]
    state = saved["json"] if key is None else read(path, keys=[key])[key]
    return containers.rebuild(state, saved["containers"], where=f"{_META}.lr_scheduler.containers", path=path)


def _has_key(path: str, key: str) -> bool:
    from ...restore import load_manifest
    m = load_manifest(path)
    return any(f == key or f.startswith(key + ".") for f in list(m.tensors) + list(m.objects))


def _owner_scalars(lay: _Layout, meta: dict, path: str) -> list[tuple[_Owner, dict[str, Any]]]:
    """[(owner, {key: saved value})]: the saved per-parameter scalar state (Adam's step) of each
    owner's parameters, which must agree where they now share one flat group.

    Raises:
        ReshardError: parameters of one owner saved different values.
        ManifestCorruptError: a saved value that is not a number.
    """
    from ...restore import read
    keys = meta["scalar_keys"]
    if not keys:
        return [(owner, {}) for owner in lay.owners]
    saved = read(path, keys=[f"optim.{name}.{k}" for name in lay.shapes for k in keys])["optim"]
    out = []
    for owner in lay.owners:
        values = {}
        for k in keys:
            per_param = {name: saved[name][k] for name in owner.names}
            for name, v in per_param.items():
                if not (torch.is_tensor(v) and v.dim() == 0 and not v.dtype.is_complex
                        or isinstance(v, (int, float)) and not isinstance(v, bool)):
                    raise ManifestCorruptError(f"saved optimizer state {k!r} of {name} is {str(v)[:100]}, not a "
                                               f"number", path=path, key=f"optim.{name}.{k}")
            distinct = {(v.item() if torch.is_tensor(v) else v) for v in per_param.values()}
            if len(distinct) > 1:
                raise ReshardError(f"optimizer state {k!r} differs between parameters that share one flat "
                                   f"optimizer group here: {dict(list(per_param.items())[:5])}", path=path,
                                   key=f"optim.{owner.names[0]}.{k}",
                                   remedy="Load with the saved ZeRO stage and param groups.")
            if per_param:
                values[k] = next(iter(per_param.values()))
        out.append((owner, values))
    return out


def _check_restorable(lay: _Layout, meta: dict, path: str) -> None:
    """Check, before the engine changes, that every saved hyper-parameter and loss-scaler value
    the load will set (param groups, :func:`_set_scaler`) has the form of the value it replaces.

    Raises:
        ManifestCorruptError: naming the first that does not (a learning rate that is a string,
            betas of three values).
    """
    hyperparams.check_groups(lay.base.param_groups, meta["param_groups"], path=path, key=f"{_META}.param_groups")
    scaler = getattr(lay.wrapper, "loss_scaler", None)
    saved = meta.get("loss_scaler")
    if scaler is not None and saved is not None:
        now = vars(scaler)
        for k, v in saved["state"].items():
            if k in now and not hyperparams.fits(v, now[k]):
                raise ManifestCorruptError(f"saved loss-scaler attribute {k!r} is {str(v)[:100]}, which cannot "
                                           f"stand for this scaler's {now[k]!r}", path=path,
                                           key=f"{_META}.loss_scaler")
