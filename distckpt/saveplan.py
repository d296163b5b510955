"""PLAN, phase 1 of a save (:mod:`distckpt.coordinator` gives the call order): which rank writes
which bytes, decided once, on rank 0, from every rank's summary.

Each rank flattens its state dict and summarizes its items (fqn, dtype, global shape, local boxes,
bytes; its encoded non-tensor values; a digest of each plain tensor) and sends it to rank 0 only
(G.gather). Rank 0 merges the summaries: the key set is the union over ranks, a key held by several
ranks must hold one value there (save's ``replicated`` option), dtype/shape agree everywhere, boxes
are disjoint and covering; then it assigns exactly one writer to every box held by several ranks
(replicated tensors, DTensor Replicate), balancing bytes per rank (plan.assign_owners), and sends
each rank only a bitmap of its own pieces to write, or the error (G.scatter). Any rank's error ->
all raise.

Compact layouts: a DTensor split evenly over its mesh (all Shard placements) is sent as one
description shared by every rank of the mesh (with the container tree, one digest per rank); rank 0
merges each distinct description once and each rank writes its own chunk of such tensors (see
:func:`plan_save`). Any doubt: a full plan.

Plan cache: when every rank's layout is unchanged since the last plan on this group, ranks send a
fingerprint and their values only, and the merged layout is reused.

The messages are the typed records below (:class:`RankLayout` inside :class:`LayoutMessage`,
:class:`SameLayoutMessage`; rank 0 answers :class:`PlanReply`, :class:`Resend`,
:class:`PlanRejected` or :class:`RanksFailed`), pickled by the gloo object collectives between the
job's own ranks.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import pickle
import time
import uuid
from typing import Any, Callable

import msgpack

from ._dist import ControlGroup, _portable
from .checksum import crc32c
from .config import get_config
from .errors import ConfigError, StateDictMismatchError, UnsupportedValueError
from .flatten import ObjectItem, TensorItem, flatten, object_entry
from . import where as wh
from .manifest import DTYPE_ITEMSIZE
from .plan import (Box, assign_owners, choose_checksum_block_counted, find_tiling_defect, grid_box,
                   grid_chunk_counts, is_row_tiling)
from .tensorbytes import dtype_name, host_bytes
from .values import value_digest

__all__ = ["GlobalPlan", "PlannedSave", "plan_save", "check_replicated_option", "tensor_digests", "replica_problems",
           "inconsistent_ranks", "RankLayout", "LayoutMessage",
           "SameLayoutMessage", "PlanReply", "Resend", "PlanRejected", "RanksFailed"]

def _nbytes(t) -> int:
    return t.numel() * t.element_size()


# ---------------------------------------------------------------------------------------------
# Each rank's summary


def check_replicated_option(replicated: Any) -> Callable[[str], bool]:
    """The ``replicated=`` option of save as a predicate "is this fqn checked across ranks".

    ``"check"`` (default): every key held by several ranks must hold the same value there (non-tensor
    values compared by their encoded bytes, plain tensors by a crc32c digest); ``"rank0"``: the lowest
    rank holding a key wins, as DCP does, and nothing is compared; a collection of fqns: those keys
    (and everything under them, ``"rng"`` covers ``"rng.cpu"``) are rank-0-wins, the rest checked.

    Raises:
        ConfigError: any other value.
    """
    if replicated == "check":
        return lambda fqn: True
    if replicated == "rank0":
        return lambda fqn: False
    if isinstance(replicated, (set, frozenset, list, tuple)) and all(isinstance(k, str) for k in replicated):
        keys = tuple(replicated)
        return lambda fqn: not any(fqn == k or fqn.startswith(k + ".") for k in keys)
    raise ConfigError(f"replicated={replicated!r}: expected 'check', 'rank0' or a collection of keys",
                      remedy="Pass replicated='check' (default), 'rank0', or a set of fqns that are rank-0-wins.")


def tensor_digests(tensors: list) -> list[int]:
    """A digest of each tensor's bytes, to tell a real replica from a tensor that only shares a key.
    CPU: crc32c of the bytes. Other devices: a position-weighted sum computed on the device (no
    copy of the whole tensor to the host), all of one device's digests read back with one
    synchronization (thousands of small GPU tensors would otherwise pay one each)."""
    out: list[int | None] = [None] * len(tensors)
    pending: list[tuple[int, Any]] = []
    for i, t in enumerate(tensors):
        if t.numel() == 0:
            out[i] = 0
        elif t.device.type == "cpu":
            view, keep = host_bytes(t)
            out[i] = crc32c(view)
            del keep
        else:
            pending.append((i, _device_digest(t)))
    if pending:
        import torch
        by_device: dict[Any, list[tuple[int, Any]]] = {}
        for i, d in pending:
            by_device.setdefault(d.device, []).append((i, d))
        for items in by_device.values():
            values = torch.stack([d for _, d in items]).tolist()  # one device-to-host sync
            for (i, _), v in zip(items, values):
                out[i] = int(v)
    return out


def _device_digest(t):
    """The digest of a tensor computed where it lives (any device), as a 0-d int64 tensor there: a
    sum of its 32-bit words (or bytes) weighted by their position modulo a prime, plus their plain
    sum; int64 arithmetic."""
    import torch
    t = t.detach()
    if t.is_conj() or t.is_neg():  # a lazy view: digest the values it stands for
        t = t.resolve_conj().resolve_neg()
    flat = t.contiguous().reshape(-1).view(torch.uint8)
    words = flat.view(torch.int32) if flat.numel() % 4 == 0 else flat
    total = torch.zeros((), dtype=torch.int64, device=t.device)
    step = 1 << 24
    for start in range(0, words.numel(), step):
        w = words[start:start + step].to(torch.int64)
        idx = torch.arange(start, start + w.numel(), device=t.device, dtype=torch.int64) % 65521 + 1
        total += (w * idx).sum() + w.sum() * 7919
    return total


def _summarize(items: dict[str, TensorItem | ObjectItem], tree: dict, rank: int, allow_pickle: bool,
               metadata: dict | None, checked: Callable[[str], bool] = lambda fqn: True,
               world_size: int = 2) -> dict:
    """This rank's PLAN summary: every tensor's (kind, dtype, shape, pieces) under ``tensors``, its
    values and replica digests, its container tree, and under ``grid`` the tensors it can describe
    compactly: ``fqn -> (kind, dtype, shape, mesh index into meshes, split dims)`` for a DTensor
    whose one piece is exactly the even-grid chunk (:func:`plan.grid_box`) at this rank's mesh
    coordinate, and for a sharded tensor without a mesh (TorchRec's row-wise tables and their
    row-wise optimizer state, a ShardedTensor split on dim 0) whose one piece is exactly this
    rank's row block of an even split over every rank of the group (the mesh ``(world,)`` of
    group ranks). Every rank of a mesh gives such a tensor the same description; a rank whose
    piece is another box does not, and rank 0 then plans every piece (_merge_compact)."""
    if rank == 0 and metadata is not None:
        try:
            msgpack.packb(metadata, use_bin_type=True, strict_types=True)
        except (TypeError, ValueError, OverflowError) as exc:
            raise UnsupportedValueError(f"metadata must be plain data (dict/list/str/int/float/bool/bytes/None): {exc}",
                                        key="metadata") from None
    tensors = {}
    objects = {}
    to_digest: list[tuple[str, Any]] = []
    grid: dict[str, tuple] = {}
    meshes: list[tuple] = []
    mesh_index: dict[int, int] = {}
    group_mesh = ((world_size,), tuple(range(world_size)))  # rows over every rank, in rank order

    def describe(fqn: str, item: TensorItem, dtype: str, mesh: tuple, dims: tuple) -> None:
        i = mesh_index.get(id(mesh))
        if i is None:
            i = mesh_index[id(mesh)] = len(meshes)
            meshes.append(mesh)
        grid[fqn] = (item.kind, dtype, tuple(item.shape), i, tuple(dims))

    for fqn, item in items.items():
        if isinstance(item, TensorItem):
            dtype = dtype_name(item.dtype)
            tensors[fqn] = (item.kind, dtype, item.shape,
                            [(p.offsets, p.sizes, _nbytes(p.tensor)) for p in item.pieces])
            # Plain tensors are the only ones whose replication is an assumption (DTensor
            # Replicate is a replica by construction; sharded pieces are disjoint). One rank has
            # no replicas to compare: no digest (it would read every byte once more).
            if item.kind == "tensor" and world_size > 1 and checked(fqn):
                to_digest.append((fqn, item.pieces[0].tensor))
            if item.grid is not None and len(item.pieces) == 1:
                mesh, dims, coord = item.grid
                p = item.pieces[0]
                try:
                    fits = (grid_box(item.shape, mesh[0], dims, coord) == (tuple(p.offsets), tuple(p.sizes))
                            and mesh[1][_mesh_position(mesh[0], coord)] == rank)
                except (ValueError, IndexError):
                    fits = False
                # ``mesh[1]`` holds global ranks, ``rank`` is this rank in the save's group: the
                # check also proves they are equal for this process, so rank 0 can read the mesh's
                # ranks as group ranks (a mesh rank no group rank confirmed is a doubt there).
                if fits:  # torch's own box is the grid's: the description is exact for this rank
                    describe(fqn, item, dtype, mesh, dims)
            elif (item.grid is None and item.kind != "tensor" and world_size > 1 and len(item.pieces) == 1
                  and len(item.shape) >= 1):
                # No mesh, but maybe a row split over the group (TorchRec row-wise: blocks of
                # ceil(rows / world) in rank order, as torch.chunk cuts). Plain tensors never:
                # their replicas are checked by digest in the full plan. Nor a piece that is the
                # whole tensor: a replica (a Replicate DTensor of one row) would be described by
                # rank 0 alone, and that doubt would send the whole save to the full plan.
                p = item.pieces[0]
                if (tuple(p.sizes) != tuple(item.shape)
                        and grid_box(item.shape, group_mesh[0], (0,), (rank,)) == (tuple(p.offsets), tuple(p.sizes))):
                    describe(fqn, item, dtype, group_mesh, (0,))
        else:
            # Every rank encodes its own values: a key may exist on some ranks only (per-rank
            # dataloader state), and values under a shared key are compared in _merge_plan.
            objects[fqn] = object_entry(fqn, item.value, allow_pickle=allow_pickle)
    digests = dict(zip((f for f, _ in to_digest), tensor_digests([t for _, t in to_digest])))
    return {"tensors": tensors, "objects": objects, "tree": tree, "digests": digests, "grid": grid,
            "meshes": meshes}


def _mesh_position(mesh_shape: tuple, coord: tuple) -> int:
    """Row-major index of ``coord`` in a mesh of ``mesh_shape``."""
    i = 0
    for m, c in zip(mesh_shape, coord):
        if not 0 <= c < m:
            raise IndexError(f"coordinate {coord} outside mesh {mesh_shape}")
        i = i * m + c
    return i


# ---------------------------------------------------------------------------------------------
# The messages of PLAN (rank r -> rank 0 -> rank r)


@dataclasses.dataclass(frozen=True, slots=True)
class RankLayout:
    """A rank's tensor layout and values, as rank 0 merges them (:func:`_plan_message`).

    ``tensors``: fqn -> (kind, dtype, shape, [(offsets, sizes, nbytes)]) of the tensors sent as
    pieces (in compact mode, the tensors not described by ``part``). ``objects``: fqn -> (kind,
    encoded value). ``digests``: fqn -> digest of a plain tensor whose replicas are checked.
    ``tree``: the container tree (None in compact mode, where it travels in ``part``).
    ``compact``: compact mode: the 16-byte digest of (grid, meshes, tree), else None. ``part``:
    that (grid, meshes, tree) itself, sent only by rank 0 and by the ranks rank 0 asked for it."""

    tensors: dict
    objects: dict
    digests: dict
    tree: dict | None = None
    compact: bytes | None = None
    part: tuple | None = None


@dataclasses.dataclass(frozen=True, slots=True)
class LayoutMessage:
    """What a rank sends when rank 0 must merge its layout: the layout (None when this rank failed
    before it had one), its fingerprint (:func:`_layout_key`) and this rank's error, if any."""

    layout: RankLayout | None
    key: bytes | None
    error: BaseException | None = None
    path: str | None = None   # where this rank saves (compared by rank 0: one checkpoint, one path)


@dataclasses.dataclass(frozen=True, slots=True)
class SameLayoutMessage:
    """What a rank sends when its layout equals its layout at the cached plan ``plan_id``: the
    fingerprint and its values only (``objects``, ``digests``: as in :class:`RankLayout`)."""

    key: bytes
    plan_id: str
    objects: dict
    digests: dict
    path: str | None = None


@dataclasses.dataclass(frozen=True, slots=True)
class PlanReply:
    """Rank 0's answer when the plan is made: its id, which of the receiving rank's pieces it writes
    (``bits``, one per piece sent as pieces; None: the bitmap this rank kept at the cached plan),
    the checksum block, whether the cached plan was reused and whether it was planned compactly."""

    plan_id: str
    bits: bytes | None
    checksum_block: int
    cached: bool
    compact: bool


@dataclasses.dataclass(frozen=True, slots=True)
class Resend:
    """Rank 0 asks for another round: ``what`` is ``"layout"`` (the rank's layout, compact when it
    was), ``"part"`` (the layout with its compact part) or ``"full"`` (every tensor as pieces)."""

    what: str


@dataclasses.dataclass(frozen=True, slots=True)
class PlanRejected:
    """The merge failed (StateDictMismatchError): the same error for every rank."""

    error: BaseException


@dataclasses.dataclass(frozen=True, slots=True)
class RanksFailed:
    """Some ranks failed before PLAN could merge: ``errors[r]`` is rank r's error or None."""

    errors: list


def _plan_message(summary: dict | None, *, compact: bool, with_part: bool) -> RankLayout | None:
    """What a rank sends rank 0 for a full plan. ``compact``: the tensors of ``summary["grid"]``
    and the container tree travel as one digest of (grid, meshes, tree) (the *compact part*),
    whose content only rank 0's own message and the ranks rank 0 asks for (``with_part``) carry;
    the other tensors go as pieces. Not ``compact``: every tensor's pieces and the tree, as
    before compact layouts existed."""
    if summary is None:
        return None
    if not compact:
        return RankLayout(summary["tensors"], summary["objects"], summary["digests"], tree=summary["tree"])
    grid = summary["grid"]
    part = (grid, summary["meshes"], summary["tree"])
    digest = summary.get("_compact_digest")
    if digest is None:
        digest = summary["_compact_digest"] = hashlib.blake2b(pickle.dumps(part, protocol=4), digest_size=16).digest()
    general = {fqn: t for fqn, t in summary["tensors"].items() if fqn not in grid}
    return RankLayout(general, summary["objects"], summary["digests"], compact=digest,
                      part=part if with_part else None)


# ---------------------------------------------------------------------------------------------
# Rank 0's merge


@dataclasses.dataclass
class GlobalPlan:
    """The merged plan of a save, as rank 0 holds it (other ranks keep only ``checksum_block``):
    what PREPARE sizes and the MANIFEST describes."""

    tensors: dict[str, tuple[str, str, tuple]]  # fqn -> (kind, dtype, shape)
    owners: dict[tuple, int]                      # (fqn, offsets, sizes) -> writer rank (general tensors)
    total_bytes: int                              # bytes of every chunk written, all ranks together
    objects: dict[str, tuple[str, Any]]         # fqn -> (kind, encoded value), the lowest rank's
    tree: dict
    checksum_block: int = 1 << 20
    n_chunks: int = 0   # distinct boxes written; ``owners`` is empty when a cached plan was reused
    compact: bool = False  # grid tensors (the ranks' ``grid``) were planned from their descriptions
    # Which ranks' files hold each tensor's chunks, as the MANIFEST says (distckpt.where, format
    # version 4), and the meshes grid entries refer to: kept with a cached plan (O(keys + ranks)).
    where: dict = dataclasses.field(default_factory=dict)
    meshes: tuple = ()


def _merge_trees(trees: list[dict], problems: list[str]) -> dict:
    """The union of the ranks' container trees: dict keys are united (a key held by some ranks
    only is kept), lists and tuples must agree in length. Identical trees are merged once."""
    distinct: dict[bytes, dict] = {}
    for tree in trees:
        distinct.setdefault(msgpack.packb(tree, use_bin_type=True), tree)
    it = iter(distinct.values())
    merged = next(it)

    def merge(a: dict, b: dict, where: str) -> dict:
        if a["t"] != b["t"]:
            problems.append(f"{where or '<root>'!r} is a {a['t']} on one rank and a {b['t']} on another")
            return a
        if a["t"] == "ref":
            return a
        if a["t"] == "dict":
            index = {(type(k), k): i for i, (k, _) in enumerate(a["k"])}
            out = [list(p) for p in a["k"]]
            for k, child in b["k"]:
                i = index.get((type(k), k))
                if i is None:
                    out.append([k, child])
                else:
                    out[i][1] = merge(out[i][1], child, f"{where}.{k}".lstrip("."))
            return {"t": "dict", "k": out}
        if len(a["v"]) != len(b["v"]):
            problems.append(f"the {a['t']} at {where or '<root>'!r} has {len(a['v'])} entries on one rank and "
                            f"{len(b['v'])} on another")
            return a
        return {"t": a["t"], "v": [merge(x, y, f"{where}.{i}".lstrip("."))
                                   for i, (x, y) in enumerate(zip(a["v"], b["v"]))]}

    for tree in it:
        merged = merge(merged, tree, "")
    return merged


def _ranks_text(groups: dict[Any, list[int]]) -> str:
    return " vs ".join(f"ranks {rs}" if len(rs) > 1 else f"rank {rs[0]}" for rs in groups.values())


@dataclasses.dataclass
class _Layout:
    """The part of a plan that depends only on the ranks' tensor layouts and container trees (what
    a training loop keeps constant from one save to the next), so a save with the same layouts on
    every rank can reuse it (see :func:`plan_save`). ``early``/``late`` are the problems found,
    in the order _merge_plan reports them around the value checks."""

    tensors: dict[str, tuple[str, str, tuple]]
    owners: dict[tuple, int]
    total_bytes: int
    tree: dict
    checksum_block: int
    early: list[str]
    late: list[str]
    n_chunks: int = 0   # distinct boxes written (len(owners) when the owners are kept)
    compact: bool = False  # merged from compact descriptions (see _merge_compact)
    where: dict = dataclasses.field(default_factory=dict)  # as GlobalPlan's
    meshes: tuple = ()


def _merge_layout(summaries: list[RankLayout], parts: dict[bytes, tuple] | None = None) -> _Layout | None:
    """Merge the ranks' tensor layouts: one dtype and shape per key, boxes that tile each tensor,
    one writer per distinct box (balancing bytes), the union of the container trees.

    ``parts``: compact mode (:func:`_plan_message`): ``{digest: (grid, meshes, tree)}`` holding
    the compact part of every digest some rank sent; each layout's ``tensors`` then hold only
    its other tensors. Returns None when the compact descriptions cannot be trusted to tile their
    tensors by construction (see :func:`_merge_compact`): the caller then asks for full layouts."""
    early: list[str] = []
    meta: dict[str, tuple[str, str, tuple]] = {}
    grid_keys: set[str] = set()
    grid_counts: dict[int, int] = {}  # chunk bytes -> number of chunks, over the grid tensors
    total = n_grid = 0
    where: dict[str, tuple] = {}
    meshes: tuple = ()
    if parts is not None:
        merged = _merge_compact(summaries, parts, meta, early)
        if merged is None:
            return None
        grid_keys, grid_counts, total, n_grid, where, meshes = merged
    candidates: dict[tuple, list[tuple[int, int]]] = {}
    for r, s in enumerate(summaries):
        for fqn, (kind, dtype, shape, pieces) in s.tensors.items():
            shape = tuple(shape)
            seen = meta.setdefault(fqn, (kind, dtype, shape))
            if seen[1:] != (dtype, shape):
                early.append(f"{fqn!r} is {seen[1]}{list(seen[2])} on one rank and {dtype}{list(shape)} on rank {r}")
                continue
            if fqn in grid_keys:
                if pieces:  # a rank outside the grid's mesh holds a piece: not provably a tiling
                    return None
                continue
            for offsets, sizes, nbytes in pieces:
                candidates.setdefault((fqn, tuple(offsets), tuple(sizes)), []).append((r, nbytes))
    # Distinct boxes of one tensor must tile its global shape: disjoint and covering. Identical
    # boxes on several ranks are replicas (one writer is chosen, so they count once here).
    late: list[str] = []
    pieces_by_fqn: dict[str, list[tuple]] = {}
    for fqn, offsets, sizes in candidates:
        pieces_by_fqn.setdefault(fqn, []).append((offsets, sizes))
    for fqn, (kind, dtype, shape) in meta.items():
        if fqn in grid_keys:
            continue  # an even grid over its whole mesh tiles its shape by construction
        pieces = pieces_by_fqn.get(fqn, [])
        if is_row_tiling(pieces, shape):  # the common case, proven without Box objects
            continue
        try:
            defect = find_tiling_defect([Box(o, s) for o, s in pieces], Box.full(shape))
        except ValueError as exc:
            late.append(f"pieces of {fqn!r} do not fit its shape {list(shape)}: {exc}")
            continue
        if defect is not None:
            late.append(f"the ranks' pieces of {fqn!r} (shape {list(shape)}) must cover it exactly once: "
                        f"{defect.kind} at {defect.region}")
    trees = [s.tree for s in summaries] if parts is None else [part[2] for part in parts.values()]
    tree = _merge_trees(trees, late)
    if early or late:
        return _Layout(meta, {}, 0, tree, 0, early, late)
    # The grids' bytes (``total`` so far) are written evenly by every rank: they size the groups
    # small replicated tensors are written in.
    owners = assign_owners(candidates, other_bytes=total, world=len(summaries))
    counts = dict(grid_counts)
    holders: dict[str, set[int]] = {fqn: set() for fqn in meta if fqn not in grid_keys}
    for key, r in owners.items():
        n = candidates[key][0][1]  # one box, one dtype: every holder's bytes are equal
        total += n
        counts[n] = counts.get(n, 0) + 1
        holders[key[0]].add(r)
    for fqn, ranks in holders.items():
        where[fqn] = ("ranks", wh.ranges(ranks))
    # The checksum block follows the chunk sizes (plan.choose_checksum_block): small chunks get
    # small blocks, so a resharding load reads little more than it needs.
    block = choose_checksum_block_counted(counts, get_config().checksum_block)
    return _Layout(meta, owners, total, tree, block, early, late, n_chunks=len(owners) + n_grid,
                   compact=parts is not None, where=where, meshes=meshes)


def _merge_compact(summaries: list[RankLayout], parts: dict[bytes, tuple], meta: dict, early: list[str]):
    """The grid tensors of a compact-mode plan, in time proportional to the distinct compact parts
    times their keys plus the ranks (never ranks x keys).

    A key described as a grid (mesh, split dims) is taken as tiled by construction only when
    every rank of its mesh sent a compact part giving that key the same description, and no
    compact part describes the key differently: each of those ranks checked its own piece against
    the description (:func:`_summarize`), so together their pieces are the grid's chunks, each
    held by exactly one rank, which writes it. Fills ``meta`` (and ``early`` with dtype/shape
    conflicts) and returns ``(grid keys, {chunk bytes: count}, total bytes, chunks, where,
    meshes)`` (each grid key's ``("grid", mesh, dims)`` and the meshes as ``(shape, ranks)``, for
    the MANIFEST), or None when a description is not confirmed (then a full plan decides, as
    without compact layouts)."""
    rank_part = [s.compact for s in summaries]
    # Meshes by content: parts number them separately. mesh id -> the parts its ranks sent.
    mesh_ids: dict[tuple, int] = {}
    mesh_parts: list[set[bytes]] = []
    described: dict[str, tuple] = {}  # fqn -> (kind, dtype, shape, mesh id, dims): one per key
    holders: dict[str, set[bytes]] = {}
    for digest, (grid, meshes, _tree) in parts.items():
        ids = []
        for shape_, ranks in meshes:
            i = mesh_ids.get((shape_, ranks))
            if i is None:
                i = mesh_ids[(shape_, ranks)] = len(mesh_parts)
                if any(not 0 <= r < len(summaries) for r in ranks):
                    return None
                mesh_parts.append({rank_part[r] for r in ranks})
            ids.append(i)
        for fqn, (kind, dtype, shape, mi, dims) in grid.items():
            desc = (kind, dtype, shape, ids[mi], dims)
            if described.setdefault(fqn, desc) != desc:
                return None  # two meshes or layouts for one key: a full plan names the conflict
            holders.setdefault(fqn, set()).add(digest)
    counts: dict[int, int] = {}
    total = n_chunks = 0
    by_layout: dict[tuple, int] = {}
    for fqn, (kind, dtype, shape, mi, dims) in described.items():
        if not mesh_parts[mi] <= holders[fqn]:
            return None  # some rank of the mesh did not describe it so
        meta[fqn] = (kind, dtype, shape)
        key = (shape, mi, dims, DTYPE_ITEMSIZE.get(dtype, 0))
        by_layout[key] = by_layout.get(key, 0) + 1
    mesh_shapes = {i: shape_ for (shape_, _), i in mesh_ids.items()}
    for (shape, mi, dims, itemsize), n in by_layout.items():
        if itemsize == 0:
            return None  # a dtype the format cannot store: the full plan's error names it
        for elements, c in grid_chunk_counts(shape, mesh_shapes[mi], dims).items():
            if elements:  # empty chunks are not written (plan_save)
                counts[elements * itemsize] = counts.get(elements * itemsize, 0) + c * n
                total += elements * itemsize * c * n
                n_chunks += c * n
    where = {fqn: ("grid", mi, tuple(dims)) for fqn, (_k, _d, _s, mi, dims) in described.items()}
    meshes = tuple((tuple(shape_), tuple(ranks)) for (shape_, ranks), _i in sorted(mesh_ids.items(), key=lambda kv: kv[1]))
    return set(described), counts, total, n_chunks, where, meshes


def _merge_plan(summaries: list[RankLayout | SameLayoutMessage], checked: Callable[[str], bool] = lambda fqn: True,
                layout: _Layout | None = None) -> GlobalPlan:
    """Merge every rank's layout and values (a :class:`RankLayout`, or a :class:`SameLayoutMessage`
    with ``layout``). Pure and deterministic.

    The checkpoint's key set is the union of the ranks' keys (as in DCP). A key held by several
    ranks must mean one value: non-tensor values must encode to the same bytes, plain tensors must
    have the same digest (when the ``replicated`` option checks that key; ranks not checking send
    no digest), else StateDictMismatchError naming the key and which ranks hold which value.

    ``layout``: a :class:`_Layout` merged earlier from these same tensor layouts and trees (a
    cached plan); only the values (objects, digests) are merged and checked again."""
    if layout is None:
        layout = _merge_layout(summaries)
    meta = layout.tensors
    problems = list(layout.early)
    # Plain tensors under one key on several ranks are written once: they must be real replicas.
    problems += replica_problems([s.digests for s in summaries])
    objects: dict[str, tuple[str, Any]] = {}
    values: dict[str, dict[bytes, list[int]]] = {}
    for r, s in enumerate(summaries):
        for fqn, (kind, value) in s.objects.items():
            if fqn in meta:
                problems.append(f"{fqn!r} is a tensor on some ranks and a {kind} value on rank {r}")
                continue
            objects.setdefault(fqn, (kind, value))  # the lowest rank holding the key
            values.setdefault(fqn, {}).setdefault(value_digest(kind, value), []).append(r)
    for fqn, groups in sorted(values.items()):
        if len(groups) > 1 and checked(fqn):
            problems.append(f"value {fqn!r} differs between ranks ({_ranks_text(groups)})")
    problems += layout.late
    if problems:
        raise inconsistent_ranks(problems)
    return GlobalPlan(meta, layout.owners, layout.total_bytes, objects, layout.tree, layout.checksum_block,
                       n_chunks=layout.n_chunks, compact=layout.compact, where=layout.where, meshes=layout.meshes)


def replica_problems(digests: list[dict[str, int]]) -> list[str]:
    """The plain tensors whose digests (one {fqn: digest} per rank, ranks not holding or not
    checking a key leave it out) differ between ranks, each as a problem naming the ranks."""
    by_fqn: dict[str, dict[int, list[int]]] = {}
    for r, d in enumerate(digests):
        for fqn, v in d.items():
            by_fqn.setdefault(fqn, {}).setdefault(v, []).append(r)
    return [f"plain tensor {fqn!r} differs between ranks ({_ranks_text(groups)}), so it is not a replica"
            for fqn, groups in sorted(by_fqn.items()) if len(groups) > 1]


def inconsistent_ranks(problems: list[str]) -> StateDictMismatchError:
    """The error of a save whose ranks' state dicts do not describe one checkpoint."""
    differ = any("differs between ranks" in p for p in problems)
    return StateDictMismatchError(
        "the ranks' state dicts do not describe one consistent checkpoint: " + "; ".join(problems[:10]),
        remedy=("A value that is legitimately different per rank needs a per-rank key (e.g. "
                "f'rng.rank_{rank}'); to keep the lowest rank's value as DCP does, pass "
                "replicated='rank0' or replicated={'key', ...} to save." if differ else
                "Sharded tensors must tile their global shape; a key must be a tensor on every rank "
                "that holds it, with one dtype and shape."))


@dataclasses.dataclass
class PlannedSave:
    """Phase 1's outcome on this rank: the merged global plan and the pieces this rank writes
    (``mine``: (fqn, Piece) in write order). Object values and the tree are already encoded in
    ``plan`` (a snapshot); tensor bytes are read from ``Piece.tensor`` only in phase 3."""

    plan: "GlobalPlan"   # the whole plan on rank 0; on other ranks only its checksum_block
    mine: list
    t0: float
    plan_cached: bool = False   # the plan cache was hit (see plan_save)
    plan_seconds: float = 0.0   # PLAN's wall time on this rank


@dataclasses.dataclass
class _PlanCache:
    """What a rank remembers of the last plan it took part in on one control group.

    Every rank: the plan's id, its own layout key and which of its pieces it writes. Rank 0 also:
    every rank's layout key and the merged :class:`_Layout` without its owners (its size is the
    job's keys, not its pieces)."""

    plan_id: str
    key: bytes
    bits: bytes
    keys: list[bytes] | None = None
    layout: _Layout | None = None


# control group (its gloo side group; None for one process) -> _PlanCache. One entry per group:
# a save with another layout replaces it. Strong references, like _dist's side groups.
_PLAN_CACHE: dict[Any, _PlanCache] = {}


def _layout_key(summary: dict) -> bytes:
    """A fingerprint of what the cacheable part of a plan depends on: the tensors' keys, kinds,
    dtypes, shapes and local boxes, the container tree, and which tensors it describes as grids
    over which meshes (what decides the pieces its bitmap counts). Equal layouts give equal keys;
    a different layout gives a different key (blake2b, 128 bits)."""
    return hashlib.blake2b(pickle.dumps((summary["tensors"], summary["tree"], summary["grid"], summary["meshes"]),
                                        protocol=4), digest_size=16).digest()


def _owned_bits(layout: RankLayout, owners: dict[tuple, int], rank: int) -> bytes:
    """One bit per piece of ``layout`` (in its order): 1 where ``rank`` writes that piece."""
    flags = [owners.get((fqn, tuple(o), tuple(sz))) == rank
             for fqn, (_k, _d, _s, pieces) in layout.tensors.items() for o, sz, _n in pieces]
    out = bytearray((len(flags) + 7) // 8)
    for i, f in enumerate(flags):
        if f:
            out[i >> 3] |= 1 << (i & 7)
    return bytes(out)


def _coordinate_plan(group: ControlGroup, gathered: list[LayoutMessage | SameLayoutMessage],
                     checked: Callable[[str], bool]) -> tuple[list, GlobalPlan | None]:
    """Rank 0's part of PLAN: merge (or reuse) the plan from the gathered messages. Returns each
    rank's reply (:class:`PlanReply`, :class:`Resend`, :class:`PlanRejected` or
    :class:`RanksFailed`) and the whole plan (None unless every reply is a PlanReply). Never
    raises: a failure is the reply.

    Rank 0 keeps no rank's layout between saves (that would hold every piece of the job in its
    memory for the whole run): the plan is reused only when every rank sent the cached plan's id
    and its cached fingerprint. When some ranks sent only a fingerprint and others their layout
    (a layout changed, or a rank's memory of the last plan is not rank 0's), every rank is asked to
    send its layout, once, and the plan is merged anew.

    Compact layouts (:func:`_plan_message`): ranks send their grid tensors and tree as a digest
    of their compact part. Rank 0 asks one rank per digest it has not seen for that part
    (``Resend("part")``), and asks every rank for full layouts (``Resend("full")``) when
    the ranks' messages mix both modes or a grid description is not confirmed by every rank of
    its mesh (:func:`_merge_compact`): any doubt gives the plan as merged from every piece."""
    world = group.world_size
    errors = [m.error if isinstance(m, LayoutMessage) else None for m in gathered]
    if any(e is not None for e in errors):
        return [RanksFailed(errors)] * world, None
    paths = [m.path for m in gathered]
    if len(set(paths)) > 1:
        # Rank 0's path decides where every rank's data goes: a rank that named another one would
        # be told its save succeeded at a path that holds nothing.
        by_path: dict = {}
        for r, p in enumerate(paths):
            by_path.setdefault(p, []).append(r)
        said = "; ".join(f"ranks {rs[:8]}{' ...' if len(rs) > 8 else ''}: {p!r}" for p, rs in by_path.items())
        return [PlanRejected(ConfigError(f"the ranks of one save passed different paths ({said})",
                                         remedy="Pass every rank the same checkpoint path (one checkpoint is one "
                                                "directory or URL; each rank writes its own file in it)."))] * world, None
    cache = _PLAN_CACHE.get(group.pg)
    full = [isinstance(m, LayoutMessage) for m in gathered]
    keys = [m.key for m in gathered]
    reuse = not any(full)
    if reuse and (cache is None or keys != cache.keys or any(m.plan_id != cache.plan_id for m in gathered)):
        return [Resend("layout")] * world, None
    if not reuse and not all(full):
        return [Resend("layout")] * world, None
    parts = None
    if reuse:
        summaries = gathered  # values only: objects and replica digests
    else:
        summaries = [m.layout for m in gathered]
        compact = [s.compact is not None for s in summaries]
        if any(compact) and not all(compact):
            return [Resend("full")] * world, None
        if all(compact):
            parts = {}
            for s in summaries:
                if s.part is not None:
                    parts.setdefault(s.compact, s.part)
            ask: dict[bytes, int] = {}
            for r, s in enumerate(summaries):
                if s.compact not in parts:
                    ask.setdefault(s.compact, r)
            if ask:
                wanted = set(ask.values())
                return [Resend("part" if r in wanted else "layout") for r in range(world)], None
    try:
        layout = cache.layout if reuse else _merge_layout(summaries, parts)
        if layout is None:
            return [Resend("full")] * world, None
        plan = _merge_plan(summaries, checked, layout)
    except Exception as exc:  # StateDictMismatchError: the same error on every rank
        return [PlanRejected(_portable(exc))] * world, None
    if reuse:
        bits = [None] * world  # every rank writes the pieces it wrote at the cached plan
        plan_id = cache.plan_id
    else:
        bits = [_owned_bits(summaries[r], plan.owners, r) for r in range(world)]
        plan_id = uuid.uuid4().hex
        # The cached layout drops the owners (one entry per piece of the job): a reuse needs only
        # the keys' metadata, the total bytes, the tree, the checksum block and the count.
        layout = _Layout(plan.tensors, {}, plan.total_bytes, plan.tree, plan.checksum_block, [], [],
                         n_chunks=plan.n_chunks, compact=plan.compact, where=plan.where, meshes=plan.meshes)
        _PLAN_CACHE[group.pg] = _PlanCache(plan_id, keys[0], bits[0], keys, layout)
    return [PlanReply(plan_id, bits[r], plan.checksum_block, reuse, plan.compact) for r in range(world)], plan


def plan_save(group: ControlGroup, *, state_dict: Any, allow_pickle: bool, metadata: dict | None,
              path: str | None = None, replicated: Any = "check", shared_path: bool = True) -> PlannedSave:
    """Phase 1 (PLAN) on this rank. Collective; raises the same typed error on every rank.

    Control plane (what scales with ranks): each rank sends its summary to rank 0 only (a gather),
    rank 0 merges once and sends each rank only which of its own pieces it writes (a scatter of a
    bitmap), so what a rank other than 0 sends and receives does not grow with the number of ranks.
    Compact layouts: a DTensor split evenly over its mesh (all ``Shard`` placements) is described
    by every rank of the mesh the same way; such tensors and the container tree travel as one
    digest per rank, rank 0 compares digests and merges each distinct description once, and each
    rank writes its own chunk of them (the only holder), so rank 0's work grows with ranks plus
    keys, not ranks times keys. Other tensors travel as pieces and get one bit each.
    Plan cache: a rank whose layout (tensor keys, dtypes, shapes, boxes, container tree) equals its
    layout at the last plan on this group sends only a fingerprint and its values; when every rank
    did, rank 0 skips the layout merge and every rank reuses its bitmap. Values (non-tensor
    objects, replica digests) are merged and checked at every save. Any difference, or any doubt
    (a collective of the last plan failed midway), gives a full plan, never a stale one.
    ``shared_path`` (default): ``path`` names the one checkpoint every rank saves, and ranks
    that passed different paths get a ConfigError (rank 0's path would silently win); False for a
    tiered save's node-local directories, which may differ from node to node."""
    t0 = time.monotonic()
    rank = group.rank
    summary, error, items, checked, key = None, None, {}, None, None
    try:
        checked = check_replicated_option(replicated)
        if get_config().preflight:
            # Cheap per-rank check before any byte is written: the writer, its ring, the reader
            # probes and directory fsyncs need a handful of fds. (Free space is checked by rank 0
            # in PREPARE with every rank's bytes; permissions by the tmp-dir mkdir there.)
            from .storage.posix.guards import SAVE_FDS, check_fd_limit
            check_fd_limit(SAVE_FDS, rank=rank, path=path)
        # check_objects=False: _summarize encodes (and so checks) every value right below.
        tree, items = flatten(state_dict, allow_pickle=allow_pickle, check_objects=False)
        summary = _summarize(items, tree, rank, allow_pickle, metadata, checked, group.world_size)
        key = _layout_key(summary)
    except Exception as exc:
        error = exc
    mine_cache = _PLAN_CACHE.get(group.pg)
    compact = True
    msg: LayoutMessage | SameLayoutMessage
    said_path = os.fspath(path) if shared_path and path is not None else None
    if summary is not None and mine_cache is not None and mine_cache.key == key:
        msg = SameLayoutMessage(key, mine_cache.plan_id, summary["objects"], summary["digests"], said_path)
    else:
        msg = LayoutMessage(_plan_message(summary, compact=True, with_part=rank == 0), key, _portable(error),
                            said_path)
    # Rounds: at most "same" -> layouts -> compact parts asked for -> full layouts; rank 0 asks
    # for full layouts at most once and never for anything after them.
    for _round in range(4):
        gathered = group.gather(msg)
        replies, plan = _coordinate_plan(group, gathered, checked) if rank == 0 else (None, None)
        reply = group.scatter(replies)
        if not isinstance(reply, Resend):
            break
        compact = compact and reply.what != "full"
        msg = LayoutMessage(_plan_message(summary, compact=compact, with_part=rank == 0 or reply.what == "part"), key,
                            path=said_path)
    if isinstance(reply, RanksFailed):
        group.raise_failures(reply.errors, error, operation="save")
    if isinstance(reply, PlanRejected):
        raise reply.error
    plan_id, bits, checksum_block, cached, compact = (reply.plan_id, reply.bits, reply.checksum_block, reply.cached,
                                                      reply.compact)
    if bits is None:  # rank 0 reused the plan and this rank's bitmap is the one it kept
        bits = mine_cache.bits
    if rank != 0:
        _PLAN_CACHE[group.pg] = _PlanCache(plan_id, key, bits)
        plan = GlobalPlan({}, {}, 0, {}, {}, checksum_block)  # rank 0 alone holds the whole plan
    else:  # rank 0 keeps the whole plan: PREPARE and the MANIFEST need it
        _PLAN_CACHE[group.pg].bits = bits
    # Which pieces this rank writes: every piece of a grid tensor (a compact plan: this rank is
    # its only holder) and, for the other pieces in order, those whose bit is set.
    grid = summary["grid"] if compact else {}
    mine = []
    i = 0
    for fqn, item in items.items():
        if isinstance(item, TensorItem):
            if fqn in grid:
                # An empty chunk holds no byte and tiles nothing: not written (the format allows a
                # tensor's empty boxes to be absent), so a tensor split over more ranks than it
                # has rows does not fill the MANIFEST with empty records.
                mine.extend((fqn, piece) for piece in item.pieces if _nbytes(piece.tensor))
                continue
            for piece in item.pieces:
                if bits[i >> 3] >> (i & 7) & 1:
                    mine.append((fqn, piece))
                i += 1
    return PlannedSave(plan, mine, t0, plan_cached=cached, plan_seconds=time.monotonic() - t0)

