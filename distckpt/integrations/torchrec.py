"""TorchRec checkpoints: sharded embeddings + their optimizer state, saved on one plan, restored on another.

Import this module explicitly (``from distckpt.integrations import torchrec as dtr``); the core of
distckpt never imports it or torchrec.

    sd = dtr.state_dict(dmp, optimizers=[dense_opt], extra={"step": 100})
    distckpt.save(sd, "/ckpt/step_100")                     # or CheckpointManager.save(step, sd)
    ...                                                     # any world size, any sharding plan:
    dtr.load(dmp2, "/ckpt/step_100", optimizers=[dense_opt2], extra=extra)

What is saved (the *canonical* form: plan-independent wherever the math allows)::

    model.<fqn>                  dmp.state_dict() as it is: table weights as ShardedTensor or DTensor
                                 (global boxes from the local shard offsets), data-parallel tables and
                                 dense (DDP) parameters as plain replicated tensors
    optim.<param fqn>.<state>    every optimizer state tensor of every parameter, fused (TorchRec
                                 fused optimizer, collected from ``dmp.fused_optimizer``) or dense
                                 (the ``optimizers`` passed in), in one of four layouts:
        elementwise  [rows, dim], sharded exactly like the table weight (EXACT_ADAGRAD momentum1,
                     torch Adagrad ``sum`` of a table)
        rowwise      [k, rows]: one per-row value per *column block* of the table (k blocks;
                     EXACT_ROWWISE_ADAGRAD momentum1). TorchRec exposes it as a 1-D tensor of
                     [rows * k] whose size depends on the plan; here block b row r sits at (b, r)
        scalar       plain tensor (torch Adagrad ``step``), replicated
        plain        any state of a non-table parameter (MLPs), replicated
    extra.*                      the caller's ``extra`` values
    torchrec_meta                JSON string: format version, per table its rows/dim/column blocks,
                                 per parameter its optimizer kind, state layouts, hyper-parameters

Restoring (:func:`load`) builds the same canonical form for the *target* model, reconciles it with
the saved metadata and lets :func:`distckpt.load` read only the boxes each rank needs:
  * table weights and elementwise state reshard freely (table-wise, column-wise, row-wise,
    table-row-wise, table-column-wise, data-parallel; any world size);
  * rowwise state loads exactly when every target column block is a saved column block (same
    column split; any row split or rank placement; e.g. TW <-> RW <-> TWRW, CW(2) <-> TWCW(2), CW on
    2 ranks -> the same 2 column blocks on 1 rank). Otherwise it is *not* derivable bit-exactly:
    merging k blocks into one needs the per-row mean over the whole row, a weighted mean of the
    saved per-block values only in real arithmetic, and splitting a block has no exact answer at
    all; :class:`distckpt.errors.ReshardError` is raised, unless the caller opts in with
    ``approximate_rowwise=True`` (overlap-width-weighted mean of the saved blocks, in float64);
  * fused EXACT_ADAGRAD ``momentum1`` <-> dense ``torch.optim.Adagrad`` ``sum`` (data-parallel
    <-> sharded): the same accumulator, converted exactly. Dense ``step`` only feeds lr_decay: a
    dense target keeps its own step, and either direction raises ReshardError when lr_decay != 0;
  * any other change of optimizer kind, or state the target does not have room for (and the
    reverse), raises ReshardError: nothing is loaded silently wrong or dropped.

Findings this relies on (measured with torchrec 1.8.0, fbgemm-gpu-cpu 1.8.0, gloo, CPU):
  * Keys: ``<module>.embedding_bags.<t>.weight`` (EBC) / ``<module>.embeddings.<t>.weight`` (EC);
    fused state ``dmp.fused_optimizer.state_dict()["state"][W]["<t>.momentum1"]``, present only on
    ranks owning a shard of the table (a table-wise table's non-owners have no entry at all), so
    per-rank state dicts disagree on keys: every rank here learns the union by one all_gather.
  * ShardedTensor mode and DTensor mode (``ShardingEnv(..., output_dtensor=True)``) hold the same
    local shard offsets; DTensor placements are wrong for TorchRec layouts (table-wise says
    Replicate, the rowwise state says Shard(0)); only the offsets are used.
  * Rowwise state of a column-split table with k blocks: global [rows * k]; TorchRec sorts the
    shards by column offset and gives shard i the 1-D offset i * rows. Row-split tables: the 1-D
    offset is the row offset. Both split (grid): not supported (UnsupportedValueError).
  * Data-parallel tables are plain tensors (dense kernel, wrapped in DDP); an optimizer applied
    with apply_optimizer_in_backward is dropped for them, so a dense optimizer owns them: its
    state is ``sum`` [rows, dim] + ``step`` () for torch Adagrad.
  * Dense kernel (compute_kernel="dense") on a sharded table: the parameter is the local storage
    (a TableBatchedEmbeddingSlice of shape [local rows, local cols], several local shards of one
    table stacked along dim 0), and a dense optimizer's state has that local shape. Saved as a
    plain tensor it looks like a replica (DCP keeps one rank's copy); here it is split along dim 0
    by the local shards (matched by data pointer) and saved with their global offsets.
  * Fused optimizer state tensors and the model state dict's shards are views of the fbgemm
    buffers; load fills them in place.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Sequence

import torch

from ..errors import ManifestCorruptError, ReshardError, UnsupportedValueError
from ..tensorbytes import dtype_from_name
from . import hyperparams

__all__ = ["state_dict", "save", "load", "read_tables", "hand_plan", "incremental_rows", "FORMAT"]

FORMAT = "distckpt.torchrec/1"
_META = "torchrec_meta"


def _require() -> None:
    try:
        import torchrec  # noqa: F401
    except ImportError as exc:  # pragma: no cover - exercised only without torchrec
        raise ImportError("distckpt.integrations.torchrec needs torchrec (pip install torchrec "
                          "fbgemm-gpu-cpu; see docs)") from exc


# ------------------------------------------------------------------------------------------------
# Tensors -> local pieces with global boxes


def _pieces(value: torch.Tensor) -> list[tuple[tuple, tuple, torch.Tensor]]:
    """(global offsets, sizes, local tensor) for every local piece of ``value``."""
    from torch.distributed._shard.sharded_tensor import ShardedTensor
    from torch.distributed.tensor import DTensor
    if isinstance(value, ShardedTensor):
        return [(tuple(int(o) for o in s.metadata.shard_offsets), tuple(int(n) for n in s.metadata.shard_sizes),
                 s.tensor) for s in value.local_shards()]
    if isinstance(value, DTensor):
        local = value.to_local()
        if hasattr(local, "local_offsets"):  # LocalShardsWrapper: trust the offsets, not placements
            return [(tuple(int(o) for o in off), tuple(t.shape), t)
                    for off, t in zip(local.local_offsets(), local.local_shards())]
        raise UnsupportedValueError("a TorchRec state DTensor without LocalShardsWrapper is not expected here")
    return [((0,) * value.dim(), tuple(value.shape), value)]


def _sharded_md(value: torch.Tensor):
    """A ShardedTensor's metadata, or None. Its shape and dtype are read from there: ``.size()`` and
    ``.dtype`` go through ShardedTensor's deprecated ``__torch_function__``, one FutureWarning each."""
    from torch.distributed._shard.sharded_tensor import ShardedTensor
    return value.metadata() if isinstance(value, ShardedTensor) else None


def _gshape(value: torch.Tensor) -> tuple[int, ...]:
    md = _sharded_md(value)
    return tuple(int(s) for s in (md.size if md is not None else value.shape))


def _gdtype(value: torch.Tensor) -> torch.dtype:
    md = _sharded_md(value)
    return md.tensor_properties.dtype if md is not None else value.dtype


@dataclasses.dataclass
class _Table:
    fqn: str
    rows: int
    dim: int
    sharding: str
    cols: tuple[int, ...]      # column block boundaries: (0, c1, ..., dim)
    row_split: bool            # rows split over several shards (row-wise / table-row-wise)
    pieces: list               # local weight pieces


def _tables(model: torch.nn.Module, model_sd: dict) -> dict[str, _Table]:
    plan = getattr(getattr(model, "plan", None), "plan", None) or {}
    out: dict[str, _Table] = {}
    for mpath, mplan in plan.items():
        prefix = f"{mpath}." if mpath else ""
        for tname, ps in mplan.items():
            fqn = next((k for k in (f"{prefix}embedding_bags.{tname}.weight", f"{prefix}embeddings.{tname}.weight")
                        if k in model_sd), None)
            if fqn is None:
                continue
            value = model_sd[fqn]
            rows, dim = _gshape(value)
            if ps.sharding_type == "data_parallel" or ps.sharding_spec is None:
                cols, row_split = (0, dim), False
            else:
                shards = ps.sharding_spec.shards
                cols = tuple(sorted({int(s.shard_offsets[1]) for s in shards})) + (dim,)
                row_split = len({int(s.shard_offsets[0]) for s in shards}) > 1
            out[fqn] = _Table(fqn, rows, dim, ps.sharding_type, cols, row_split, _pieces(value))
    return out


# ------------------------------------------------------------------------------------------------
# Optimizers


def _join(prefix: str, key: str) -> str:
    return f"{prefix}.{key}" if prefix and key else (prefix or key)


def _fused_leaves(opt: Any, prefix: str = ""):
    """Yield (prefix, leaf optimizer) for every leaf under a (possibly nested) CombinedOptimizer."""
    subs = getattr(opt, "_optims", None)
    if isinstance(subs, list) and hasattr(opt, "optimizers"):
        for key, sub in subs:
            yield from _fused_leaves(sub, _join(prefix, key))
    else:
        yield prefix, opt


def _is_fused(opt: Any) -> bool:
    return hasattr(opt, "_emb_module")


def _fused_kind(opt: Any) -> str:
    optim = getattr(opt._emb_module, "optimizer", None)
    return "fused:" + str(getattr(optim, "name", optim))


def _dense_kind(opt: Any) -> str:
    inner = getattr(opt, "_optimizer", opt)  # KeyedOptimizerWrapper
    return f"dense:{type(inner).__module__}.{type(inner).__qualname__}"


# ------------------------------------------------------------------------------------------------
# The canonical form


@dataclasses.dataclass
class _Entry:
    """One canonical optimizer state tensor of this rank."""

    layout: str                    # elementwise | rowwise | scalar | plain | weight
    shape: tuple[int, ...]
    dtype: torch.dtype
    pieces: list                   # [(offsets, sizes, tensor)] in the canonical global box space


@dataclasses.dataclass
class _Canon:
    model_sd: dict
    tables: dict[str, _Table]
    entries: dict[str, dict[str, _Entry]]      # param fqn -> state name -> entry (this rank)
    meta: dict                                 # JSON-able, identical on every rank
    dense_opts: list                           # [(optimizer, {param fqn: param})]
    dt_model: dict[str, _Entry]                # model values that are DTensors (TorchRec DTensor mode)

    def model_for_io(self, process_group: Any) -> dict:
        """The model state dict with DTensor values replaced by ShardedTensors over the same
        local shards (views: a load still fills the live buffers)."""
        return {k: (_as_tensor(self.dt_model[k], process_group) if k in self.dt_model else v)
                for k, v in self.model_sd.items()}


def _rowwise_pieces(table: _Table, pieces, *, fused: bool) -> list:
    """Canonical [k, rows] pieces for 1-D per-row state ``pieces`` of ``table``."""
    k = len(table.cols) - 1
    if k > 1 and table.row_split:
        raise UnsupportedValueError(f"table {table.fqn!r} is split by rows and columns (grid sharding); its "
                                    f"per-row optimizer state is not supported", key=table.fqn)
    out = []
    for (off,), (n,), t in pieces:
        if k > 1:
            b, r0 = divmod(off, table.rows)
        else:
            b, r0 = 0, off
        out.append(((b, r0), (1, n), t.reshape(1, n)))
    return out


def _dense_table_pieces(table: _Table, param: torch.Tensor, value: torch.Tensor, name: str) -> tuple[str, list]:
    """Split a dense optimizer's local state of a sharded table's local storage into global pieces."""
    if not table.pieces:
        return "elementwise", []
    # Where each local weight shard starts inside the local storage (shards are stacked on dim 0).
    starts = []
    row_bytes = param.stride(0) * param.element_size()
    for _off, sizes, t in table.pieces:
        delta = t.data_ptr() - param.data_ptr()
        if row_bytes <= 0 or delta % row_bytes or not 0 <= delta // row_bytes <= param.shape[0] - sizes[0]:
            starts = None
            break
        starts.append(delta // row_bytes)
    if starts is None:
        if sum(s[0] for _o, s, _t in table.pieces) != param.shape[0]:
            raise UnsupportedValueError(f"cannot map the local storage of {table.fqn!r} to its shards", key=table.fqn)
        acc, starts = 0, []
        for _o, s, _t in table.pieces:
            starts.append(acc)
            acc += s[0]
    if tuple(value.shape) == tuple(param.shape):
        return "elementwise", [(off, sizes, value.narrow(0, st, sizes[0]))
                               for (off, sizes, _t), st in zip(table.pieces, starts)]
    if value.dim() == 1 and value.shape[0] == param.shape[0]:
        if len(table.cols) > 2 and table.row_split:
            raise UnsupportedValueError(f"grid-sharded table {table.fqn!r} with per-row state", key=table.fqn)
        return "rowwise", [((table.cols.index(off[1]), off[0]), (1, sizes[0]),
                            value.narrow(0, st, sizes[0]).reshape(1, sizes[0]))
                           for (off, sizes, _t), st in zip(table.pieces, starts)]
    raise UnsupportedValueError(
        f"dense optimizer state {name!r} of sharded table {table.fqn!r} has shape {list(value.shape)}, "
        f"neither the local shard's {list(param.shape)} nor per-row [{param.shape[0]}]: its global layout is "
        f"unknown, and saving it as a replica would keep one rank's copy", key=table.fqn)


def _canonical(model: torch.nn.Module, optimizers: Sequence[Any], process_group: Any) -> _Canon:
    """The model's and optimizers' state in a plan-independent form, the same description on
    every rank. Collective (one all-gather over distckpt's control group, bounded by
    DISTCKPT_TIMEOUT_S). Raises UnsupportedValueError (a layout it cannot describe) or another
    rank's error on every rank: a rank that fails alone never leaves the others waiting."""
    _require()
    from .._dist import _portable, control_group

    def describe():   # this rank's part, before the exchange
        model_sd = model.state_dict()
        tables = _tables(model, model_sd)
        entries: dict[str, dict[str, _Entry]] = {}
        opt_meta: dict[str, dict] = {}

        # Fused (TorchRec) optimizer state.
        fused = getattr(model, "fused_optimizer", None)
        if fused is not None:
            for prefix, leaf in _fused_leaves(fused):
                if not _is_fused(leaf):
                    continue
                kind = _fused_kind(leaf)
                state = leaf.state_dict()["state"]
                for pkey in leaf.params:
                    fqn = _join(prefix, pkey)
                    table = tables.get(fqn)
                    if table is None:
                        raise UnsupportedValueError(f"fused optimizer parameter {fqn!r} is not a table of the plan", key=fqn)
                    opt_meta[fqn] = {"kind": kind, "hyper": {}}
                    for skey, value in state.get(pkey, {}).items():
                        name = skey.rsplit(".", 1)[-1]
                        shape = _gshape(value)
                        pieces = _pieces(value)
                        if shape == (table.rows, table.dim):
                            ent = _Entry("elementwise", shape, _gdtype(value), pieces)
                        elif len(shape) == 1 and shape[0] == table.rows * (len(table.cols) - 1 if not table.row_split else 1):
                            ent = _Entry("rowwise", (len(table.cols) - 1, table.rows), _gdtype(value),
                                         _rowwise_pieces(table, pieces, fused=True))
                        else:
                            raise UnsupportedValueError(f"fused optimizer state {skey!r} of {fqn!r} has global shape "
                                                        f"{list(shape)}: layout not supported", key=fqn)
                        entries.setdefault(fqn, {})[name] = ent

        # Dense optimizers (DDP parts, data-parallel tables, dense-kernel tables).
        names = {id(p): n for n, p in model.named_parameters()}
        dense_opts = []
        groups_meta = []
        for oi, top in enumerate(optimizers):
            leaves = [leaf for _p, leaf in _fused_leaves(top) if not _is_fused(leaf)]
            for leaf in leaves:
                kind = _dense_kind(leaf)
                keyed = getattr(leaf, "params", None)
                extra_names = {id(p): n for n, p in keyed.items()} if isinstance(keyed, dict) else {}
                pmap = {}
                hyper_of = {}
                plain = hyperparams.plain_groups(leaf.param_groups)
                for group, hyper in zip(leaf.param_groups, plain):
                    for p in group["params"]:
                        hyper_of[id(p)] = hyper
                groups_meta.append(plain)
                for p, pstate in leaf.state.items():
                    fqn = names.get(id(p)) or extra_names.get(id(p))
                    if fqn is None:
                        raise UnsupportedValueError("a dense optimizer holds state for a parameter that is not in the model",
                                                    remedy="Pass only optimizers over this model's parameters.")
                    pmap[fqn] = p
                    opt_meta[fqn] = {"kind": kind, "hyper": hyper_of.get(id(p), {})}
                    table = tables.get(fqn)
                    for name, value in pstate.items():
                        if not isinstance(value, torch.Tensor):
                            continue
                        if value.numel() == 1 and value.dim() <= 1:
                            ent = _Entry("scalar", tuple(value.shape), value.dtype, [((0,) * value.dim(), tuple(value.shape), value)])
                        elif table is not None and table.sharding != "data_parallel":
                            layout, pieces = _dense_table_pieces(table, p, value, name)
                            shape = (table.rows, table.dim) if layout == "elementwise" else (len(table.cols) - 1, table.rows)
                            ent = _Entry(layout, shape, _gdtype(value), pieces)
                        elif table is not None and value.dim() == 1 and value.shape[0] == table.rows:
                            ent = _Entry("rowwise", (1, table.rows), _gdtype(value),
                                         [((0, 0), (1, table.rows), value.reshape(1, table.rows))])
                        elif table is not None and tuple(value.shape) == (table.rows, table.dim):
                            ent = _Entry("elementwise", tuple(value.shape), value.dtype, [((0, 0), tuple(value.shape), value)])
                        else:
                            ent = _Entry("plain", tuple(value.shape), value.dtype, [((0,) * value.dim(), tuple(value.shape), value)])
                        entries.setdefault(fqn, {})[name] = ent
                dense_opts.append((leaf, pmap))

        # DTensor output mode: the core recognizes torch's LocalShardsWrapper but not TorchRec's own
        # class (torchrec.distributed.shards_wrapper.LocalShardsWrapper), and would fall back to the
        # (wrong) placements. Describe those values by their local shard offsets here instead.
        from torch.distributed.tensor import DTensor
        dt_model = {k: _Entry("weight", _gshape(v), _gdtype(v), _pieces(v))
                    for k, v in model_sd.items() if isinstance(v, DTensor)}

        # Every rank must describe the same keys: gather the description and take the union.
        # A scalar travels with its description: a rank without it takes it from one that has it.
        local = {
            "dt": {k: [(list(o), list(s)) for o, s, _t in e.pieces] for k, e in dt_model.items()},
            "opt": opt_meta,
            "ent": {f: {n: (e.layout, list(e.shape), str(e.dtype).replace("torch.", ""),
                            [(list(o), list(s)) for o, s, _t in e.pieces],
                            e.pieces[0][2].item() if e.layout == "scalar" and e.pieces else None)
                        for n, e in st.items()}
                    for f, st in entries.items()},
        }
        return model_sd, tables, entries, opt_meta, dense_opts, groups_meta, dt_model, local

    group = control_group(process_group, operation="distckpt.integrations.torchrec")
    error, described = None, None
    try:
        described = describe()
    except Exception as exc:  # noqa: BLE001 - raised on every rank after the exchange below
        error = exc
    gathered = group.all_gather((described[-1] if described else None, _portable(error)))
    group.raise_failures([e for _l, e in gathered], error, operation="distckpt.integrations.torchrec")
    model_sd, tables, entries, opt_meta, dense_opts, groups_meta, dt_model, _local = described
    world = group.world_size
    gathered = [g for g, _e in gathered]
    all_opt: dict[str, dict] = {}
    all_ent: dict[str, dict[str, list]] = {}
    for k, e in dt_model.items():
        e.boxes = [(r, g["dt"][k]) for r, g in enumerate(gathered) if g["dt"].get(k)]  # type: ignore[attr-defined]
    for r, g in enumerate(gathered):
        for fqn, om in g["opt"].items():
            prev = all_opt.setdefault(fqn, om)
            if prev["kind"] != om["kind"]:
                raise UnsupportedValueError(f"parameter {fqn!r} has optimizer {prev['kind']} on one rank and "
                                            f"{om['kind']} on rank {r}", key=fqn)
        for fqn, st in g["ent"].items():
            for name, (layout, shape, dtype, boxes, value) in st.items():
                slot = all_ent.setdefault(fqn, {}).setdefault(name, [layout, shape, dtype, [], value])
                if slot[:3] != [layout, shape, dtype]:
                    raise UnsupportedValueError(f"optimizer state {fqn}.{name} is {slot[:3]} on one rank and "
                                                f"{[layout, shape, dtype]} on rank {r}", key=fqn)
                slot[3].append((r, boxes))
    # Replicated state (a dense optimizer's non-table state) that some ranks lack: a dense
    # optimizer creates state only for parameters that had a gradient, and a rank's empty slice
    # of a table sharded table-wise has none. A scalar (Adam's step) is taken from the lowest rank
    # that holds it (it is one value per parameter, as rank 0 writes it when every rank holds it);
    # a larger value cannot be, and every rank raises that alike (the same gathered view).
    for fqn, st in sorted(all_ent.items()):
        for name, (layout, _shape, _dtype, per_rank, _value) in sorted(st.items()):
            if layout == "plain" and len(per_rank) < world:
                raise UnsupportedValueError(
                    f"optimizer state {fqn}.{name} is held by rank(s) {[r for r, _b in per_rank]} only, and it is "
                    f"not a table's (no shard of it belongs to the other ranks)", key=f"{fqn}.{name}",
                    remedy="Give every rank's optimizer that parameter's state (take one optimizer step on every "
                           "rank, or initialize it), or shard the table so that each rank holds part of it.")
    meta = {
        "format": FORMAT,
        "world": world,
        "tables": {f: {"rows": t.rows, "dim": t.dim, "sharding": t.sharding, "cols": list(t.cols)}
                   for f, t in tables.items()},
        "optim": {f: {**om, "states": {n: {"layout": s[0], "shape": s[1], "dtype": s[2]}
                                       for n, s in all_ent.get(f, {}).items()}}
                  for f, om in sorted(all_opt.items())},
        "groups": groups_meta,
    }
    # Fill in the entries this rank lacks (no local shard), with the global shard list.
    for fqn, st in all_ent.items():
        for name, (layout, shape, dtype, per_rank, value) in st.items():
            e = entries.setdefault(fqn, {}).get(name)
            if e is None:
                pieces = []
                if layout == "scalar":  # another rank's (above): saved from it, read into it
                    t = torch.tensor(value, dtype=getattr(torch, dtype)).reshape(tuple(shape))
                    pieces = [((0,) * len(shape), tuple(shape), t)]
                entries[fqn][name] = _Entry(layout, tuple(shape), getattr(torch, dtype), pieces)
            entries[fqn][name].boxes = per_rank  # type: ignore[attr-defined]
    return _Canon(model_sd, tables, entries, meta, dense_opts, dt_model)


def _as_tensor(entry: _Entry, process_group: Any) -> torch.Tensor:
    """The canonical tensor for ``entry``: a plain tensor when every rank holds all of it
    (replicated: scalars, dense parameters' state, data-parallel tables), else a ShardedTensor
    whose metadata lists every rank's boxes."""
    import torch.distributed as dist
    world = dist.get_world_size(process_group) if dist.is_available() and dist.is_initialized() else 1
    full = [[0] * len(entry.shape), list(entry.shape)]
    boxes = getattr(entry, "boxes", [])
    if entry.layout in ("scalar", "plain") or (
            len(boxes) == world and all([list(map(list, b)) for b in bx] == [full] for _r, bx in boxes)):
        if not entry.pieces:
            raise UnsupportedValueError("a replicated optimizer state is missing on this rank")
        return entry.pieces[0][2]
    import torch.distributed as dist
    from torch.distributed._shard.metadata import ShardMetadata
    from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor
    from torch.distributed._shard.sharded_tensor.metadata import ShardedTensorMetadata, TensorProperties

    metas = []
    for r, boxes in entry.boxes:
        grank = dist.get_global_rank(process_group, r) if process_group is not None else r
        for o, s in boxes:
            metas.append(ShardMetadata(shard_offsets=list(o), shard_sizes=list(s), placement=f"rank:{grank}/cpu"))
    local = [Shard(t.detach(), ShardMetadata(shard_offsets=list(o), shard_sizes=list(s),
                                             placement=f"rank:{dist.get_rank()}/cpu"))
             for o, s, t in entry.pieces]
    md = ShardedTensorMetadata(shards_metadata=metas, size=torch.Size(entry.shape),
                               tensor_properties=TensorProperties(dtype=entry.dtype, requires_grad=False))
    return ShardedTensor._init_from_local_shards_and_global_metadata(local, md, process_group=process_group)


def _build_sd(canon: _Canon, extra: dict | None, process_group: Any) -> dict:
    optim = {fqn: {name: _as_tensor(e, process_group) for name, e in st.items()}
             for fqn, st in sorted(canon.entries.items())}
    meta = dict(canon.meta, has_extra=extra is not None)
    sd = {"model": canon.model_for_io(process_group), "optim": optim, _META: json.dumps(meta, sort_keys=True)}
    if extra is not None:
        sd["extra"] = extra
    return sd


def state_dict(model: torch.nn.Module, *, optimizers: Sequence[Any] = (), extra: dict | None = None,
               process_group: Any = None) -> dict:
    """The canonical, plan-independent checkpoint state of a DistributedModelParallel model.

    Collective (one all_gather_object) over ``process_group`` (default: the world). Pass the
    result to :func:`distckpt.save` or ``CheckpointManager.save``; its tensors are views of the
    live model and optimizer state (nothing is copied).

    Args:
        model: a ``torchrec.distributed.DistributedModelParallel``. Its fused optimizer's state
            (``model.fused_optimizer``) is always included.
        optimizers: the dense optimizers (torch optimizers, KeyedOptimizerWrapper, or a
            CombinedOptimizer; fused leaves inside one are skipped: they come from the model).
        extra: plain values or tensors saved under ``extra`` (a step counter, RNG state...).

    Raises:
        UnsupportedValueError: a layout this module cannot describe exactly (grid sharding with
            per-row state; a dense optimizer state of a sharded table whose shape matches neither
            the local shard nor its rows; optimizer state of a parameter outside ``model``).
    """
    canon = _canonical(model, list(optimizers), process_group)
    return _build_sd(canon, extra, process_group)


def rank0_keys(sd: dict) -> set[str]:
    """The keys of ``sd`` (from :func:`state_dict`) whose value may differ between ranks and is
    kept from the lowest rank: the scalar optimizer state (torch Adagrad's ``step``), which each
    rank advances only for the shard it steps and which only feeds ``lr_decay`` (a dense target
    keeps its own; :func:`load` raises ReshardError when lr_decay != 0). Pass it as
    ``distckpt.save(sd, path, replicated=rank0_keys(sd))``; every other key stays checked."""
    return {f"optim.{fqn}.{name}" for fqn, st in sd["optim"].items() for name, t in st.items()
            if type(t) is torch.Tensor and t.numel() == 1 and t.dim() <= 1}


def incremental_rows(sd: dict) -> dict[str, int]:
    """The tensors of ``sd`` (from :func:`state_dict`) an incremental save tracks by rows, as
    ``{fqn: row dimension}``: every embedding table's weight (rows on dim 0) and the table's
    optimizer state, elementwise ([rows, dim], dim 0: EXACT_ADAGRAD momentum1, torch Adagrad
    ``sum``) or rowwise ([k, rows], dim 1: EXACT_ROWWISE_ADAGRAD momentum1), so a changed row is
    written with its optimizer state in the same link. Use it as the policy's ``rows``::

        IncrementalPolicy(rows=dtr.incremental_rows, full_every=8)
    """
    meta = json.loads(sd[_META])
    out = {f"model.{fqn}": 0 for fqn in meta["tables"]}
    for fqn, om in meta["optim"].items():
        if fqn not in meta["tables"]:
            continue
        for name, st in om["states"].items():
            if st["layout"] in ("elementwise", "rowwise") and name in sd["optim"].get(fqn, {}):
                out[f"optim.{fqn}.{name}"] = 0 if st["layout"] == "elementwise" else 1
    return out


def save(model: torch.nn.Module, path: str | os.PathLike, *, optimizers: Sequence[Any] = (),
         extra: dict | None = None, process_group: Any = None, **kwargs: Any):
    """``distckpt.save(state_dict(model, ...), path, replicated=rank0_keys(sd), **kwargs)``:
    collective; returns SaveResult."""
    from ..save_sync import save as _save
    sd = state_dict(model, optimizers=optimizers, extra=extra, process_group=process_group)
    kwargs.setdefault("replicated", rank0_keys(sd))
    return _save(sd, path, process_group=process_group, **kwargs)


# ------------------------------------------------------------------------------------------------
# Load


_ADAGRAD_FUSED = "fused:EXACT_ADAGRAD"
_ADAGRAD_DENSE = "dense:torch.optim.adagrad.Adagrad"


def _saved_meta(path: str, process_group: Any) -> dict:
    import torch.distributed as dist

    from ..restore import read
    dist_on = dist.is_available() and dist.is_initialized()
    payload = [None]
    if not dist_on or dist.get_rank(process_group) == 0:
        try:
            got = read(path, keys=[_META])
            meta = _checked_meta(got[_META], path)
            # The saved extra values (small by intent) stand in as scratch targets when the caller
            # passes no ``extra`` to fill.
            extra = read(path, keys=["extra"]).get("extra") if meta.get("has_extra") else None
            payload = [("ok", (got[_META], extra))]
        except Exception as exc:  # noqa: BLE001 - re-raised on every rank below
            payload = [("err", exc)]
    if dist_on and dist.get_world_size(process_group) > 1:
        src = dist.get_global_rank(process_group, 0) if process_group is not None else 0
        dist.broadcast_object_list(payload, src=src, group=process_group)
    status, value = payload[0]
    if status == "err":
        raise value
    meta = json.loads(value[0])  # checked on rank 0 (_checked_meta): every rank raised its error
    meta["_saved_extra"] = value[1]
    return meta


_LAYOUTS = ("elementwise", "rowwise", "scalar", "plain", "weight")


def _checked_meta(raw: Any, path: str) -> dict:
    """The checkpoint's ``torchrec`` metadata, decoded and checked field by field against the
    MANIFEST before a load uses it: a damaged or crafted entry is refused here, typed, instead of
    failing midway (a KeyError, a dtype looked up as any ``torch`` attribute, a scratch tensor
    allocated at a shape the checkpoint does not hold).

    Raises:
        ReshardError: not this integration's format.
        ManifestCorruptError: naming the first field that is missing or of the wrong form.
    """
    from ..restore import load_manifest

    def bad(field: str, what: str, value: Any = None) -> ManifestCorruptError:
        return ManifestCorruptError(f"the '{_META}' metadata's {field} is not {what}: {str(value)[:200]}",
                                    path=path, key=f"{_META}.{field}")

    def count(v: Any) -> bool:
        return isinstance(v, int) and not isinstance(v, bool) and v >= 0
    try:
        meta = json.loads(raw) if isinstance(raw, str) else None
    except ValueError as exc:
        raise ManifestCorruptError(f"the '{_META}' entry is not JSON: {exc}", path=path, key=_META) from None
    if not isinstance(meta, dict):
        raise bad("entry", "a JSON object", raw)
    if meta.get("format") != FORMAT:
        raise ReshardError(f"checkpoint torchrec format {meta.get('format')!r}, expected {FORMAT!r}", path=path)
    tables, optim = meta.get("tables"), meta.get("optim")
    if not isinstance(tables, dict):
        raise bad("tables", "an object", tables)
    for fqn, t in tables.items():
        cols = t.get("cols") if isinstance(t, dict) else None
        if not (isinstance(cols, list) and len(cols) >= 2 and all(map(count, cols))
                and cols == sorted(cols)):
            raise bad(f"tables.{fqn}.cols", "a list of column boundaries", cols)
    if not isinstance(optim, dict):
        raise bad("optim", "an object", optim)
    saved = load_manifest(path).tensors
    for fqn, om in optim.items():
        if not (isinstance(om, dict) and isinstance(om.get("kind"), str) and isinstance(om.get("hyper", {}), dict)
                and isinstance(om.get("states"), dict)):
            raise bad(f"optim.{fqn}", "an object of kind, hyper and states", om)
        for name, st in om["states"].items():
            where = f"optim.{fqn}.states.{name}"
            if not (isinstance(st, dict) and st.get("layout") in _LAYOUTS and isinstance(st.get("shape"), list)
                    and all(map(count, st["shape"])) and isinstance(st.get("dtype"), str)):
                raise bad(where, "an object of layout, shape and dtype", st)
            dtype_from_name(st["dtype"], path=path)
            entry = saved.get(f"optim.{fqn}.{name}")
            if entry is not None and (list(entry.shape) != st["shape"] or entry.dtype != st["dtype"]):
                raise bad(where, f"the saved tensor's shape and dtype ({list(entry.shape)}, {entry.dtype})", st)
            if st["layout"] == "rowwise" and fqn in tables and st["shape"][:1] != [len(tables[fqn]["cols"]) - 1]:
                raise bad(where, "one row per saved column block", st)
    groups = meta.get("groups", [])
    if not (isinstance(groups, list) and all(isinstance(g, list) for g in groups)):
        raise bad("groups", "a list per dense optimizer", groups)
    if not isinstance(meta.get("has_extra", False), bool):
        raise bad("has_extra", "a bool", meta.get("has_extra"))
    return meta


def _state_map(fqn: str, saved: dict | None, target: dict | None, path: str) -> dict[str, str | None]:
    """{target state name: saved state name, or None (keep the target's value)} for one parameter
    the target model has (:func:`load` skips one it no longer has)."""
    tstates = (target or {}).get("states", {})
    sstates = (saved or {}).get("states", {})
    if saved is None and target is None:
        return {}
    if saved is None:
        if not tstates:
            return {}
        raise ReshardError(f"the checkpoint has no optimizer state for {fqn!r}; the target's {target['kind']} "
                           f"has {sorted(tstates)}", path=path, key=fqn,
                           remedy="Restore with the optimizer setup the checkpoint was saved with.")
    if target is None:
        if not sstates:
            return {}
        raise ReshardError(f"the checkpoint has {saved['kind']} state {sorted(sstates)} for {fqn!r}, but no "
                           f"optimizer passed to load owns that parameter", path=path, key=fqn,
                           remedy="Pass the dense optimizer(s) that own it (optimizers=[...]).")
    skind, tkind = saved["kind"], target["kind"]
    if skind == tkind:
        if set(sstates) != set(tstates):
            raise ReshardError(f"{fqn!r}: saved {skind} state {sorted(sstates)}, target has {sorted(tstates)}",
                               path=path, key=fqn)
        return {n: n for n in tstates}
    if {skind, tkind} == {_ADAGRAD_FUSED, _ADAGRAD_DENSE}:
        # The same accumulator (sum of squared gradients) under two names.
        dense_hyper = (target if tkind == _ADAGRAD_DENSE else saved).get("hyper", {})
        lr_decay = dense_hyper.get("lr_decay", 0.0) or 0.0
        if not isinstance(lr_decay, (int, float)):
            raise ManifestCorruptError(f"{fqn!r}: the saved lr_decay {str(lr_decay)[:100]} is not a number",
                                       path=path, key=f"{_META}.optim.{fqn}.hyper")
        if lr_decay != 0.0:
            raise ReshardError(f"{fqn!r}: converting between fused EXACT_ADAGRAD and torch Adagrad with "
                               f"lr_decay={dense_hyper.get('lr_decay')} needs the per-parameter step count, "
                               f"which the fused optimizer does not keep", path=path, key=fqn)
        if tkind == _ADAGRAD_DENSE:
            return {n: ("momentum1" if n == "sum" else None) for n in tstates}
        return {"momentum1": "sum"} if "momentum1" in tstates else {}
    raise ReshardError(f"{fqn!r}: saved with optimizer {skind}, target uses {tkind}: no exact conversion of "
                       f"their state exists", path=path, key=fqn,
                       remedy="Restore with the optimizer kind the checkpoint was saved with.")


def _rowwise_plan(fqn: str, saved_cols: list[int], target_cols: list[int], approximate: bool, path: str):
    """{"exact": True} when the column split is unchanged, else {"approx": per target block
    [(saved block, overlap width)]} when ``approximate``; otherwise raise ReshardError."""
    sblocks = list(zip(saved_cols[:-1], saved_cols[1:]))
    tblocks = list(zip(target_cols[:-1], target_cols[1:]))
    if sblocks == tblocks:  # (both partition [0, dim): equal as soon as every target block was saved)
        return {"exact": True}
    if not approximate:
        raise ReshardError(
            f"{fqn!r}: per-row optimizer state was saved for column blocks {sblocks} and the target plan "
            f"needs {tblocks}. Each block keeps its own per-row mean of squared gradients; a merged block "
            f"needs the mean over the union (only approximately a weighted mean of the saved values: "
            f"not bit-exact), a split block needs values that were never recorded",
            path=path, key=fqn, saved_blocks=sblocks, target_blocks=tblocks,
            remedy="Restore onto a plan with the same column split for this table, or pass "
                   "approximate_rowwise=True to accept an overlap-weighted mean.")
    weights = []
    for a, b in tblocks:
        weights.append([(i, min(b, sb) - max(a, sa)) for i, (sa, sb) in enumerate(sblocks)
                        if min(b, sb) > max(a, sa)])
    return {"approx": weights}


def load(model: torch.nn.Module, path: str | os.PathLike, *, optimizers: Sequence[Any] = (),
         extra: dict | None = None, approximate_rowwise: bool = False, process_group: Any = None,
         verify: bool = True, strict: bool = True, cast: str = "exact"):
    """Restore a checkpoint written from :func:`state_dict` into ``model`` (any plan, any world size)
    and its optimizers, in place. Collective over ``process_group``.

    Args:
        model: the target DistributedModelParallel (its own plan and world size).
        optimizers: the target's dense optimizers (as for :func:`state_dict`).
        extra: a dict whose values are replaced/filled from the saved ``extra`` (same keys).
        approximate_rowwise: allow per-row optimizer state to be converted between different column
            splits by an overlap-width-weighted mean (documented approximation; default: raise).
        strict, cast: as for :func:`distckpt.load` (``strict=False``: model keys the checkpoint
            lacks keep their values and are listed in ``missing``; ``cast="allow"``: narrowing
            dtype conversions, rounding as DCP does).

    A dense optimizer that has not stepped yet (Adam, AdamW: their state is created at the first
    step) is given its state first, as DCP's ``set_state_dict`` does (one step with zero
    gradients and a learning rate of 0), when the checkpoint holds state for its parameters.

    Returns:
        distckpt.LoadResult.

    Raises:
        ReshardError: the saved state cannot be converted exactly onto the target (a different
            column split of per-row state without ``approximate_rowwise``, a different optimizer
            kind, optimizer state with nowhere to go, or missing state the target needs).
        StateDictMismatchError: tables or dense parameters differ (missing/unexpected/shape).
        ManifestCorruptError: the saved ``torchrec_meta`` is malformed or disagrees with the
            MANIFEST (a damaged or crafted checkpoint), before the model changes.
        and everything :func:`distckpt.load` raises.
    """
    from ..restore import load as _load
    path = os.path.abspath(os.fspath(path))
    saved = _saved_meta(path, process_group)
    _init_lazy_optimizers(model, list(optimizers), saved)
    canon = _canonical(model, list(optimizers), process_group)
    tmeta = canon.meta
    load_optim: dict[str, dict[str, Any]] = {}
    approx_jobs = []
    in_model = set(tmeta["tables"]) | {n for n, _p in model.named_parameters()}
    for fqn in sorted(set(saved["optim"]) | set(tmeta["optim"])):
        smeta, tm = saved["optim"].get(fqn), tmeta["optim"].get(fqn)
        if smeta is None and tm is not None and fqn in tmeta["tables"] and fqn not in saved["tables"]:
            # A table the checkpoint lacks altogether (a feature added since): its optimizer state
            # is asked for like its weight, so the load names both as missing (strict=True: the
            # StateDictMismatchError; strict=False: kept as they are, listed in missing).
            for tname, entry in canon.entries.get(fqn, {}).items():
                load_optim.setdefault(fqn, {})[tname] = _as_tensor(entry, process_group)
            continue
        if tm is None and fqn not in in_model:
            # The table or parameter is gone from the model: its weight and its optimizer state
            # are saved keys this load does not read, listed in LoadResult.unexpected (as DCP and
            # distckpt.load treat extra saved keys).
            continue
        mapping = _state_map(fqn, smeta, tm, path)
        used = set()
        for tname, sname in mapping.items():
            if sname is None:
                continue
            used.add(sname)
            entry = canon.entries[fqn][tname]
            sst = smeta["states"][sname]
            if sst["layout"] != entry.layout:
                raise ReshardError(f"{fqn}.{tname}: saved layout {sst['layout']}{sst['shape']}, target "
                                   f"{entry.layout}{list(entry.shape)}", path=path, key=fqn)
            if entry.layout == "rowwise":
                scols = saved["tables"][fqn]["cols"] if fqn in saved["tables"] else [0, None]
                tcols = tmeta["tables"][fqn]["cols"]
                if scols[-1] is None:
                    scols = [0, tcols[-1]]
                rp = _rowwise_plan(fqn, scols, tcols, approximate_rowwise, path)
                if "exact" in rp:
                    load_optim.setdefault(fqn, {})[sname] = _as_tensor(entry, process_group)
                else:
                    full = torch.empty(tuple(sst["shape"]), dtype=dtype_from_name(sst["dtype"], path=path))
                    load_optim.setdefault(fqn, {})[sname] = full
                    approx_jobs.append((entry, full, rp["approx"]))
            else:
                load_optim.setdefault(fqn, {})[sname] = _as_tensor(entry, process_group)
        for sname, sst in (smeta or {}).get("states", {}).items():
            if sname not in used:  # deliberately dropped (dense Adagrad step -> fused): read into a scratch
                load_optim.setdefault(fqn, {})[sname] = torch.empty(tuple(sst["shape"]),
                                                                    dtype=dtype_from_name(sst["dtype"], path=path))
    for live, sgroups in _group_pairs(canon, saved):  # before anything changes
        hyperparams.check_groups(live, sgroups, path=path, key=f"{_META}.groups")
    sd = {"model": canon.model_for_io(process_group), "optim": load_optim, _META: ""}
    if extra is not None:
        sd["extra"] = extra
    elif saved.get("has_extra"):
        sd["extra"] = saved["_saved_extra"]
    result = _load(sd, path, process_group=process_group, verify=verify, strict=strict, cast=cast)
    with torch.no_grad():
        for entry, full, weights in approx_jobs:
            for (b, r0), (_one, n), t in entry.pieces:
                acc = torch.zeros(n, dtype=torch.float64)
                width = 0
                for sb, w in weights[b]:
                    acc += full[sb, r0:r0 + n].double() * w
                    width += w
                t.copy_((acc / width).to(t.dtype).reshape(t.shape))
        # The model's state dict tensors are views of the live parameters; load_state_dict makes
        # sure of it for any module whose state_dict copies.
        model.load_state_dict(canon.model_sd)
        _restore_groups(canon, saved)
    return result


def _init_lazy_optimizers(model: torch.nn.Module, optimizers: list, saved: dict) -> None:
    """Give each dense optimizer leaf that has no state yet, while the checkpoint holds state for
    one of its parameters, the state its first step would create (torch's own
    ``_init_optim_state``, which DCP's ``set_state_dict`` uses: zero gradients, lr 0, one step):
    its state is then described and filled like any other. Same on every rank (each checks its
    own leaves against the same saved metadata)."""
    from torch.distributed.checkpoint.state_dict import _init_optim_state
    names = {id(p): n for n, p in model.named_parameters()}
    for top in optimizers:
        for _prefix, leaf in _fused_leaves(top):
            if _is_fused(leaf) or leaf.state:
                continue
            keyed = getattr(leaf, "params", None)
            extra_names = {id(p): n for n, p in keyed.items()} if isinstance(keyed, dict) else {}
            owned = {names.get(id(p)) or extra_names.get(id(p)) for g in leaf.param_groups for p in g["params"]}
            if any(saved["optim"].get(f, {}).get("states") for f in owned if f is not None):
                _init_optim_state(leaf)


def _group_pairs(canon: _Canon, saved: dict) -> list[tuple[list[dict], list]]:
    """(live param groups, saved groups) of each dense optimizer whose group structure matches the
    saved one (the others keep their hyper-parameters)."""
    groups = saved.get("groups", [])
    if len(groups) != len(canon.dense_opts):
        return []
    return [(leaf.param_groups, sgroups) for (leaf, _pmap), sgroups in zip(canon.dense_opts, groups)
            if len(sgroups) == len(leaf.param_groups)]


def _restore_groups(canon: _Canon, saved: dict) -> None:
    """Put back dense optimizers' saved hyper-parameters (lr schedules etc.) when the group
    structure matches (checked before the load by :func:`hyperparams.check_groups`)."""
    for live, sgroups in _group_pairs(canon, saved):
        hyperparams.set_groups(live, sgroups)


def read_tables(path: str | os.PathLike) -> dict:
    """One process, no process group: the saved tables and optimizer state as full tensors.

    Returns {"model": {fqn: full tensor}, "optim": {param fqn: {state: full tensor}}, "meta": dict}.
    Rowwise state is returned in the canonical [k, rows] form (``meta["tables"][fqn]["cols"]`` gives
    the k column blocks).
    """
    from ..restore import read
    data = read(path)
    meta = json.loads(data.pop(_META))
    return {"model": data.get("model", {}), "optim": data.get("optim", {}), "meta": meta,
            "extra": data.get("extra")}


# ------------------------------------------------------------------------------------------------
# Hand-built plans (CPU: the planner offers only some sharding types)


def hand_plan(modules: dict[str, torch.nn.Module], specs: dict[str, dict[str, str]], *, world_size: int,
              local_size: int | None = None, dense: bool = False):
    """A ShardingPlan from short per-table specs, for tests and examples.

    ``modules``: {module path: EmbeddingBagCollection or EmbeddingCollection (unsharded)};
    ``specs``: {module path: {table: spec}}, spec one of ``"table_wise:R"``, ``"column_wise:R0,R1,..."``,
    ``"row_wise"``, ``"table_row_wise:HOST"``, ``"table_column_wise:R0,R1,..."``, ``"data_parallel"``.
    ``dense``: compute_kernel="dense" instead of "fused" for the sharded tables.
    """
    _require()
    from torchrec.distributed.sharding_plan import (column_wise, construct_module_sharding_plan, data_parallel,
                                                    row_wise, table_row_wise, table_wise)
    from torchrec.distributed.types import ShardingPlan
    ck = "dense" if dense else "fused"

    def gen(spec: str):
        kind, _, arg = spec.partition(":")
        ranks = [int(x) for x in arg.split(",")] if arg else None
        if kind == "table_wise":
            return table_wise(rank=ranks[0] if ranks else 0, compute_kernel=ck)
        if kind == "column_wise":
            return column_wise(ranks=ranks or list(range(world_size)), compute_kernel=ck)
        if kind == "row_wise":
            return row_wise(compute_kernel=ck)
        if kind == "data_parallel":
            return data_parallel()
        if kind in ("table_row_wise", "table_column_wise"):
            inner = (table_row_wise(host_index=ranks[0] if ranks else 0) if kind == "table_row_wise"
                     else column_wise(ranks=ranks or list(range(world_size)), compute_kernel=ck))

            def g(*a, _inner=inner, _kind=kind):
                ps = _inner(*a)
                ps.sharding_type = _kind
                ps.compute_kernel = ck
                return ps
            return g
        raise ValueError(f"unknown sharding spec {spec!r}")

    plan = {}
    for mpath, tspecs in specs.items():
        plan[mpath] = construct_module_sharding_plan(modules[mpath], {t: gen(s) for t, s in tspecs.items()},
                                                     world_size=world_size, local_size=local_size or world_size,
                                                     device_type="cpu")
    return ShardingPlan(plan)
