"""Restore: load into the caller's tensors (resharding on the way), and read() for one process.

How a load works on each rank:
  1. the source is opened (distckpt.source): a distckpt checkpoint (local or on an object store),
     a DCP or Hugging Face directory, or a delta of an incremental chain; rank 0 reads MANIFEST and
     broadcasts its bytes, and every rank decodes and validates it (magic, version, checksum, names
     inside the directory, offsets inside the files);
  2. the caller's state dict is flattened into wanted boxes (a plain tensor wants its whole
     box, a DTensor / ShardedTensor the boxes this rank holds) and compared with the manifest:
     missing / unexpected keys and shape / dtype mismatches are collected all at once;
  3. for every wanted box, the saved chunks that intersect it are found (plan.plan_reads) and only
     the byte range covering each intersection is read (widened to whole checksum blocks when
     verifying), cached pages with buffered reads, the rest with O_DIRECT (distckpt.fill). A
     chain's links are planned the same way: its tracked tensors from the base, every other value
     from the newest link, both read in one pass, and the deltas' newest rows (planned by
     distckpt.incremental while that pass runs) scattered in after it;
  4. each block is checked against its crc32c in a bounded bounce buffer before any of its bytes
     is copied into the caller's tensor: a load that fails never leaves a corrupt byte there,
     and its error names the tensors already filled (completely or in part) with verified bytes;
  5. every rank's outcome is exchanged, so all ranks return or all raise the same typed error.

Loading never unpickles unless the caller passes ``allow_pickle=True``.
"""

from __future__ import annotations

import bisect
import dataclasses
import logging
import os
import pickle
import re
import struct
import threading
import time
from typing import Any, Callable, Iterable

import torch

from . import manifest as mf
from . import dcp, readonce
from ._dist import ControlGroup, control_group, is_distributed
from .chain import ChainLink
from .errors import (typed_memory_error, ChainBrokenError, CheckpointCorruptError, CheckpointNotFoundError, CheckpointRemovedError,
                     ConfigError, DistCkptError, PickleNotAllowedError, ReshardError, StateDictMismatchError, fill_rank)
from .fill import Part, Task, box_tasks, fill_boxes_of, fill_parts, reading, side_reads
from .flatten import ObjectItem, TensorItem, expand_statefuls, flatten, restore_statefuls, set_leaf
from .gcpause import gc_paused
from .deltarecords import DELTA_ROOT, link_error
from .incremental import Target, plan_deltas, without_records
from .plan import Box, plan_reads
from .source import Source, open_source
from .staging.pool import wait_for_staging
from .storage import path_text
from .tensorbytes import EXACT_CASTS, dtype_from_name, dtype_name
from .values import decode_value, encode_value, value_digest

__all__ = ["LoadResult", "load", "read", "read_manifest", "load_manifest", "read_box", "read_boxes", "fill_boxes",
           "EXACT_CASTS"]

log = logging.getLogger("distckpt")

@dataclasses.dataclass(frozen=True)
class LoadResult:
    """What a load did.

    A load reads exactly the keys the caller's state dict names (DCP's meaning of ``strict``).

    Attributes:
        missing: keys of the state dict the checkpoint lacks (an error under strict=True; with
            strict=False they keep their current values).
        unexpected: keys the checkpoint holds that the state dict does not name: not read, never
            an error (a model-only load of a full checkpoint is normal).
        mismatched: {key: why} for keys whose saved shape or kind does not fit (an error under
            strict=True; left untouched with strict=False).
        not_replaced: non-tensor values that could not be put in place (only when the state dict's
            root itself is a tuple; tuples inside it are rebuilt and replaced).
        uninitialized: optimizer state in the checkpoint for an optimizer whose state dict has no
            state yet (an error under strict=True; with strict=False, these keys were not loaded).
        cast: {key: "saved->loaded dtype"} for tensors converted on load (see ``cast=``).
        bytes_by_tier: for a tiered load (distckpt.tiers.load), {"local": n, "remote": m}: the
            bytes of the caller's tensors each tier served (``bytes_read`` counts the file bytes
            read, checksum blocks and alignment included); empty for any other load.
        bytes_from_peers: the data-file bytes this rank received from other ranks instead of
            reading them: segments another rank read for it too (distckpt.readonce, counted once
            received and verified), or, for a tiered load, files its node lacked, fetched from
            other nodes before the read (distckpt.tiers.peers).
        remote_unchecked: for a TieredCheckpointManager load made while the remote tier did not
            answer, its error: the local copies loaded could not be checked against the remote
            tier (the reference when it answers). None otherwise.
        passed_over: for a manager's ``load()`` that named no step, {step: why} of the steps it
            did not take because they do not load: a step whose MANIFEST does not decode (its
            commit time unknown, so whatever its number), and on the tiers a step numbered above
            the one loaded with no complete copy, or one whose load found it incomplete. Each is
            also logged as a warning; here a resume loop can tell that it went back past them.
            Empty for a load of a named step or path (which raises instead).
    """

    path: str
    missing: list[str]
    unexpected: list[str]
    mismatched: dict[str, str]
    not_replaced: list[str]
    bytes_read: int
    seconds: float
    backend: str | None
    uninitialized: list[str] = dataclasses.field(default_factory=list)
    cast: dict[str, str] = dataclasses.field(default_factory=dict)
    bytes_by_tier: dict[str, int] = dataclasses.field(default_factory=dict)
    bytes_from_peers: int = 0
    remote_unchecked: str | None = None
    passed_over: dict[int, str] = dataclasses.field(default_factory=dict)


def load_manifest(path: str | os.PathLike, storage_options: dict | None = None) -> "mf.Manifest":
    """The decoded, validated manifest of the checkpoint at ``path`` (local, a MANIFEST file
    standing for its directory, or an fsspec URL with ``storage_options`` as
    :func:`distckpt.save`); for a DCP or Hugging Face directory, its metadata as a manifest.

    Raises:
        CheckpointNotFoundError: ``path`` does not exist, or is no checkpoint (what it is is named).
        CheckpointIncompleteError: ``path`` is a save's tmp directory or has no MANIFEST.
        ManifestCorruptError: MANIFEST is damaged or describes an impossible layout.
    """
    return open_source(path, storage_options).manifest()


def read_manifest(path: str | os.PathLike, storage_options: dict | None = None) -> dict:
    """The checkpoint's manifest as plain data (dicts, lists, ints, strs). Raises what
    :func:`load_manifest` raises."""
    return mf.to_plain(load_manifest(path, storage_options))


def _describe(entry) -> str:
    if isinstance(entry, mf.TensorEntry):
        return f"{entry.dtype}{list(entry.shape)}"
    return f"object({entry.kind})"


# TorchRec's raw fused-optimizer state of row-wise optimizers is 1-D, [rows * column blocks]: its
# global shape depends on the sharding plan, so no plan-independent box math can reshard it.
_TORCHREC_ROWWISE = re.compile(r"(^|\.)momentum\d*$")


def _optimizer_paths(state_dict: Any, path: tuple = (), depth: int = 0) -> list[tuple]:
    """Paths of dicts shaped like an optimizer state dict ({"state": {}, "param_groups": ...})
    whose ``state`` is still empty: an optimizer that has not stepped yet."""
    out = []
    if isinstance(state_dict, dict) and depth < 100:
        if isinstance(state_dict.get("state"), dict) and not state_dict["state"] and "param_groups" in state_dict:
            out.append(path)
        for k, v in state_dict.items():
            out.extend(_optimizer_paths(v, path + (k,), depth + 1))
    elif isinstance(state_dict, list) and depth < 100:
        for i, v in enumerate(state_dict):
            out.extend(_optimizer_paths(v, path + (i,), depth + 1))
    return out


def _subtree_node(tree: dict, path: tuple) -> dict | None:
    """The manifest tree node at ``path`` (dict keys by type and value, list/tuple by index)."""
    node = tree
    for key in path:
        if node["t"] == "dict":
            node = next((child for k, child in node["k"] if type(k) is type(key) and k == key), None)
        elif node["t"] in ("list", "tuple") and type(key) is int and 0 <= key < len(node["v"]):
            node = node["v"][key]
        else:
            return None
        if node is None:
            return None
    return node


def _refs(node: dict) -> list[str]:
    """The fqns of every leaf under a tree ``node``."""
    return list(mf.tree_paths(node))


def _container_entry(manifest, item: ObjectItem):
    """A value the checkpoint stored element by element (format 1 saved lists and tuples of plain
    values that way) asked for as one value: a pseudo entry that rebuilds it, or None."""
    node = _subtree_node(manifest.tree, item.path)
    # lists and tuples only: a dict the checkpoint walked key by key, asked for as one value (a
    # destination dict with None/tuple keys), is a different entry, reported as missing/unexpected
    if node is None or node["t"] not in ("list", "tuple"):
        return None
    if not all(r in manifest.objects for r in _refs(node)):
        return None
    return ("container", node)


def _overlapping_destinations(items) -> list[str]:
    """The tensors of the state dict some of whose elements share memory (stride 0 from expand(),
    or an as_strided view): a load cannot store distinct values into them, and torch's copy would
    raise an untyped RuntimeError halfway through the fill. Checked before any byte is read."""
    found = []
    for fqn, item in items.items():
        if isinstance(item, TensorItem) and any(
                isinstance(p.tensor, torch.Tensor) and p.tensor.numel() > 1
                and torch._debug_has_internal_overlap(p.tensor) == 1 for p in item.pieces):
            found.append(fqn)
    return found


def _plan_tasks(manifest, items, strict: bool, allow_pickle: bool, path: str, cast: str = "exact",
                optimizer_paths: list[tuple] = ()):
    missing, unexpected = [], []
    shape_mm, dtype_mm, mismatched = {}, {}, {}
    tasks: list[Task] = []
    casts: list[tuple[torch.Tensor, torch.Tensor]] = []  # (buffer in the saved dtype, caller's tensor)
    cast_names: dict[str, str] = {}
    objects: list[tuple[ObjectItem, Any]] = []
    pickled = []
    reshard = []
    overlapping = _overlapping_destinations(items)
    if overlapping:
        raise ConfigError(
            f"{len(overlapping)} destination tensor(s) of the state dict have elements that share memory (an "
            f"expand()ed or as_strided view), so they cannot hold distinct saved values: {overlapping[:10]}; "
            f"nothing was read", path=path, key=overlapping[0],
            remedy="Load into tensors that own their elements (for example t.clone() or "
                   "torch.empty(shape)) and expand them after the load.")
    for fqn, item in items.items():
        saved = manifest.tensors.get(fqn) or manifest.objects.get(fqn)
        if saved is None and isinstance(item, ObjectItem):
            saved = _container_entry(manifest, item)
        if saved is None:
            missing.append(fqn)
            continue
        if isinstance(item, TensorItem):
            if not isinstance(saved, mf.TensorEntry):
                mismatched[fqn] = f"saved {_describe(saved)}, wanted tensor"
                shape_mm[fqn] = (_describe(saved), f"tensor{list(item.shape)}")
                continue
            if tuple(saved.shape) != tuple(item.shape):
                shape_mm[fqn] = (list(saved.shape), list(item.shape))
                mismatched[fqn] = f"saved shape {list(saved.shape)}, wanted {list(item.shape)}"
                if (_TORCHREC_ROWWISE.search(fqn) and len(saved.shape) == 1 and len(item.shape) == 1
                        and "tensor" not in (saved.kind, item.kind)):
                    reshard.append(fqn)
                continue
            want_dtype = dtype_name(item.dtype)
            if saved.dtype != want_dtype:
                if not (cast == "allow" or want_dtype in EXACT_CASTS.get(saved.dtype, ())):
                    # Never skipped, whatever ``strict`` says: a tensor left at its initial
                    # values is silent loss.
                    dtype_mm[fqn] = (saved.dtype, want_dtype)
                    continue
                cast_names[fqn] = f"{saved.dtype}->{want_dtype}"
            dtype = dtype_from_name(saved.dtype, path=path)
            chunks = None
            for piece in item.pieces:
                want = Box(tuple(piece.offsets), tuple(piece.sizes))
                if want.volume == 0:
                    continue
                dest = piece.tensor
                if dtype != item.dtype:
                    # Read into a buffer of the saved dtype; converted after the verified read.
                    dest = torch.empty(tuple(piece.sizes), dtype=dtype)
                    casts.append((dest, piece.tensor))
                if (len(saved.chunks) == 1 and tuple(saved.chunks[0].sizes) == want.sizes
                        and tuple(saved.chunks[0].offsets) == want.offsets):
                    # The saved sharding (the common case): plan_reads would return this one piece.
                    tasks.append(Task(fqn, saved.chunks[0], want, dest, want, dtype.itemsize, dtype))
                    continue
                if chunks is None:
                    chunks = [(Box(tuple(c.offsets), tuple(c.sizes)), c) for c in saved.chunks]
                for rp in plan_reads(chunks, want, itemsize=dtype.itemsize):
                    tasks.append(Task(fqn, rp.payload, rp.box, dest, want, dtype.itemsize, dtype))
        else:
            if isinstance(saved, mf.TensorEntry):
                mismatched[fqn] = f"saved {_describe(saved)}, wanted a plain value"
                shape_mm[fqn] = (_describe(saved), "object")
                continue
            if isinstance(saved, mf.ObjectEntry) and saved.kind == "pickle":
                pickled.append(fqn)
            objects.append((item, saved))
    uninitialized = []
    opt_prefixes = [".".join(str(k) for k in p) + ".state." if p else "state." for p in optimizer_paths]
    for fqn in list(manifest.tensors) + list(manifest.objects):
        if fqn not in items:
            unexpected.append(fqn)
            if any(fqn.startswith(pre) for pre in opt_prefixes):
                uninitialized.append(fqn)
    if reshard and strict:
        raise ReshardError(
            f"{len(reshard)} row-wise optimizer state tensor(s) changed size with the sharding plan: "
            + "; ".join(f"{k}: {mismatched[k]}" for k in reshard[:10])
            + ". TorchRec's raw form stores one value per row per column block, so a changed column split "
              "cannot be resharded exactly from it", path=path, key=reshard[0],
            remedy="Save and load TorchRec models with distckpt.integrations.torchrec (dtr.state_dict / dtr.load), "
                   "which stores row-wise state in a plan-independent form, or keep the column split.")
    # An optimizer saved keyed one way and loaded keyed the other (a raw optim.state_dict() uses
    # parameter indexes, get_state_dict / get_optimizer_state_dict parameter names): none of its
    # state can match, and "load what matches" would leave it all fresh. Say so, whatever strict says.
    keyed = _optimizer_keying(manifest, items, path) if missing else []
    if keyed and not strict:
        log.warning("distckpt: load of %s: %s", path, _keying_text(keyed))
    if dtype_mm or (strict and (missing or mismatched or uninitialized)):
        parts = []
        if dtype_mm:
            # Never skipped, whatever ``strict`` says: a tensor left at its initial values is silent loss.
            parts.append(f"{len(dtype_mm)} tensor(s) saved in another dtype, and the conversion is not exact "
                         f"(pass cast='allow' to convert them, rounding as DCP does): "
                         + "; ".join(f"{k}: saved {a}, wanted {b}" for k, (a, b) in list(dtype_mm.items())[:10]))
        if not strict:
            missing_, mismatched_ = [], {}
        else:
            missing_, mismatched_ = missing, mismatched
        if missing_:
            parts.append(f"{len(missing)} missing from the checkpoint: {missing[:10]}")
        if mismatched_:
            parts.append(f"{len(mismatched)} mismatched: " + "; ".join(f"{k}: {v}" for k, v in list(mismatched.items())[:10]))
        if uninitialized and strict:
            parts.append(f"the checkpoint holds optimizer state {uninitialized[:10]} ({len(uninitialized)} keys) "
                         f"but the state dict's optimizer has no state yet, so it would not be loaded")
        remedy = None
        if keyed and strict:
            parts.insert(0, _keying_text(keyed))
        if dtype_mm:
            remedy = ("Pass cast='allow' to load to convert them (rounding to the wanted dtype, as DCP does), or "
                      "build the state dict in the saved dtype.")
        elif keyed and strict:
            remedy = ("Load into the form that was saved: for a raw optim.state_dict() checkpoint, a raw "
                      "optim.state_dict() of an optimizer that has stepped (then optim.load_state_dict); for one "
                      "saved from get_state_dict / get_optimizer_state_dict, the same call's result (then "
                      "set_state_dict). Save new checkpoints with get_state_dict(model, optim), which names every "
                      "parameter and reshards. strict=False would not load this optimizer state at all.")
        elif uninitialized:
            remedy = ("Build the optimizer's state dict with torch.distributed.checkpoint.state_dict."
                      "get_optimizer_state_dict(model, optim) (or get_state_dict), which initializes the state, "
                      "and apply it with set_optimizer_state_dict after the load; or run one optimizer step "
                      "with zero gradients before optim.state_dict(). strict=False loads without that state.")
        raise StateDictMismatchError("state dict and checkpoint disagree: " + " | ".join(parts), path=path,
                                     missing=missing, unexpected=unexpected, shape_mismatch=shape_mm,
                                     dtype_mismatch=dtype_mm, remedy=remedy)
    if uninitialized:
        log.warning("distckpt: load of %s: optimizer state not loaded (the optimizer has no state yet): %s",
                    path, uninitialized[:20])
    if pickled and not allow_pickle:
        raise PickleNotAllowedError(f"the checkpoint stores {len(pickled)} value(s) as pickles: {pickled[:10]}",
                                    path=path, keys=pickled)
    return tasks, objects, missing, unexpected, mismatched, casts, cast_names, uninitialized


def _optimizer_keying(manifest, items: dict, path: str) -> list[tuple[str, str, str]]:
    """[(optimizer key, saved keying, wanted keying)] for every optimizer state dict whose
    ``param_groups[0]["params"]`` are parameter indexes (ints: a raw ``optim.state_dict()``) on one
    side and parameter names (strs: torch's ``get_optimizer_state_dict``) on the other."""
    def keying(params: Any) -> str | None:
        if isinstance(params, (list, tuple)) and params:
            if all(isinstance(p, int) and not isinstance(p, bool) for p in params):
                return "parameter index"
            if all(isinstance(p, str) for p in params):
                return "parameter name"
        return None

    out = []
    for fqn, entry in manifest.objects.items():
        if not (fqn == "param_groups.0.params" or fqn.endswith(".param_groups.0.params")):
            continue
        item = items.get(fqn)
        if not isinstance(item, ObjectItem):
            continue
        try:
            saved = _object_value(entry, manifest, fqn, path)
        except Exception:  # noqa: BLE001 - not decodable here: the load itself reports it
            continue
        a, b = keying(saved), keying(item.value)
        if a and b and a != b:
            out.append((fqn[:-len("param_groups.0.params")].rstrip(".") or "(top level)", a, b))
    return out


def _keying_text(keyed: list[tuple[str, str, str]]) -> str:
    return "; ".join(
        f"the optimizer state under {key!r} is keyed by {saved} in the checkpoint (as "
        f"{'a raw optim.state_dict()' if saved == 'parameter index' else 'get_optimizer_state_dict'} keys it) "
        f"and by {wanted} in the state dict being loaded (as "
        f"{'a raw optim.state_dict()' if wanted == 'parameter index' else 'get_state_dict / get_optimizer_state_dict'}"
        f" keys it), so none of its per-parameter state can match" for key, saved, wanted in keyed)


def _object_value(entry, manifest=None, fqn: str = "", path: str | None = None, allow_pickle: bool = False) -> Any:
    """The value an object entry of ``manifest`` holds, decoded. A checkpoint written through
    distckpt's DCP StorageWriter holds DCP's torch.save bytes for every value: they are decoded as
    DCP decodes them (:func:`distckpt.dcp.decode_writer_value`), never handed back as bytes."""
    if isinstance(entry, tuple) and entry[0] == "container":  # see _container_entry
        values = {r: _object_value(manifest.objects[r], manifest, r, path, allow_pickle) for r in _refs(entry[1])}
        return _rebuild(entry[1], values, lambda f: True)
    if entry.kind == "pickle":
        return pickle.loads(entry.value)  # only reached with allow_pickle=True
    if entry.kind == "dcp":  # a DCP value: torch.load(weights_only=True) or PickleNotAllowedError
        return entry.value.load(allow_pickle=allow_pickle)
    value = decode_value(entry.kind, entry.value, fqn=fqn, path=path)
    if manifest is not None and dcp.writer_meta(manifest) is not None:
        return dcp.decode_writer_value(value, fqn=fqn, path=path, allow_pickle=allow_pickle)
    return value


def _same(a: Any, b: Any) -> bool:
    """Whether the caller's value ``a`` already is the saved value ``b`` exactly, so that it may be
    left in place: both encode to the same canonical bytes (distckpt.values: the type at every
    level, floats by their bits, a dataclass or a numpy scalar by its fields or bytes). ``==``
    left the caller's ``0.0`` for a saved ``-0.0``, ``[1.0, 2.0]`` for ``[1, 2]`` and
    ``Cfg(lr=0.0)`` for ``Cfg(lr=-0.0)`` without a word, where DCP replaces them. A value that
    only pickle could store is never the same (replaced)."""
    if type(a) is not type(b):
        return False
    if type(a) in (str, bytes, int, bool, type(None)):
        return a == b   # exact for these (and no copy of a large bytes value)
    if type(a) is float:
        return struct.pack("<d", a) == struct.pack("<d", b)   # by its bits: -0.0 is not 0.0
    try:
        return (value_digest(*encode_value("", a, allow_pickle=False))
                == value_digest(*encode_value("", b, allow_pickle=False)))
    except Exception:  # noqa: BLE001 - a value the encoding refuses: replaced, never compared
        return False


def _load_local(source: Source, manifest: "mf.Manifest | Callable[[list], mf.Manifest]", state_dict: Any,
                strict: bool, verify: bool, allow_pickle: bool, cast: str, t0: float,
                parts_for: Callable[[list[Task]], list[Part]] | None = None,
                exchange: "readonce.Exchange | None" = None) -> LoadResult:
    """Plan, read and place one rank's part of a load from ``source`` (whose manifest is
    ``manifest``): for a delta of an incremental chain, the tracked tensors from the base and the
    deltas' rows (:func:`_fill_chain`), everything else from the newest link.

    ``manifest`` may be a function of the ``(fqn, box)`` pairs this rank wants, called once the
    state dict is flattened (:meth:`Source.manifest_for_boxes`: a version-4 checkpoint then gives
    the chunks of the files holding them only; no collective).

    ``parts_for``: where the planned read tasks are read from, for a checkpoint whose data files
    are not all under ``source.path`` (a tiered load, distckpt.tiers.load: each file from the
    local or the remote copy of the same save). It gets every task (each names its data file in
    ``task.chunk.file``) and returns the fill parts that read them, all in one pass; it may raise
    (a file no copy holds) before any byte of the state dict changed. Default: one part, every
    file from ``source``. Not for a delta of a chain (ConfigError).

    ``exchange``: the load's read-once exchange (distckpt.readonce), used by the fill of a plain
    load; a chain's load leaves it to the caller to join."""
    # An async save still copying tensors off the caller's thread (stage_in_background) may be
    # copying these very tensors, and filling them moves no version counter its check would see:
    # every load that fills a state dict (distckpt.load, the tiered load) waits for it here.
    wait_for_staging()
    statefuls = expand_statefuls(state_dict)
    try:
        _tree, items = flatten(state_dict, check_objects=False)
        if callable(manifest):
            try:
                manifest = manifest([(fqn, Box(tuple(p.offsets), tuple(p.sizes))) for fqn, item in items.items()
                                     if isinstance(item, TensorItem) for p in item.pieces])
            except DistCkptError as exc:  # reading the indexes: no byte of the state dict moved yet
                exc.filled, exc.partly_filled = [], []
                exc.details.update(filled=[], partly_filled=[])
                raise
        links = source.links(manifest)
        if links is not None and parts_for is not None:
            raise ConfigError(f"{source.path} is a delta of an incremental chain: it loads from its own directory "
                              f"and its chain's only")
        tracked: dict[str, int] = {}
        if links is not None:
            if not isinstance(state_dict, dict):
                raise ConfigError("loading an incremental checkpoint needs a dict as the state dict's root")
            tracked = {f: d for f, d in links[0].tracked.items()
                       if f in items and all(isinstance(k, str) for k in items[f].path)}
        own = {f: it for f, it in items.items() if f not in tracked}
        tasks, objects, missing, unexpected, mismatched, casts, cast_names, uninitialized = _plan_tasks(
            manifest, own, strict, allow_pickle, source.path, cast, _optimizer_paths(state_dict))
        # Decoded before any byte is read: a class that cannot be rebuilt fails the load early.
        values = [(item, _object_value(entry, manifest, item.fqn, source.path, allow_pickle)) for item, entry in objects]
        parts = parts_for(tasks) if parts_for is not None else [Part(source.store, source.path, manifest, tasks)]
        try:
            if tracked:
                nbytes, backend = _fill_chain(source, links, parts, {f: items[f] for f in tracked}, strict,
                                              allow_pickle, cast, verify, casts, cast_names, mismatched)
            else:
                nbytes, backend = fill_parts(parts, verify=verify, exchange=exchange)
        except DistCkptError as exc:
            if cast_names and isinstance(getattr(exc, "filled", None), list):
                # A converted tensor is filled through a buffer in its saved dtype, copied into the
                # caller's tensor only after the whole fill (below): none of them changed.
                exc.filled = [k for k in exc.filled if k not in cast_names]
                exc.partly_filled = [k for k in exc.partly_filled or () if k not in cast_names]
                exc.details.update(filled=exc.filled, partly_filled=exc.partly_filled)
            raise
        with torch.no_grad():
            for tmp, dest in casts:
                dest.copy_(tmp)
        not_replaced = []
        for item, value in values:
            if _same(item.value, value):
                continue
            if not set_leaf(state_dict, item.path, value):
                not_replaced.append(item.fqn)
        if not_replaced and strict:
            # Found once the tensors were filled: the error says so.
            filled = sorted({t.fqn for t in tasks} | set(tracked))
            raise StateDictMismatchError(
                f"{len(not_replaced)} value(s) differ from the checkpoint but sit in a tuple at the root of the "
                f"state dict, which cannot be replaced in place: {not_replaced[:10]}; the tensors were filled "
                f"already: {filled[:10]}", path=source.path, missing=[],
                unexpected=[], shape_mismatch={}, dtype_mismatch={}, filled=filled, partly_filled=[],
                remedy="Pass a dict (or a list) as the state dict's root.")
    except BaseException:
        restore_statefuls(statefuls, load=False)
        raise
    restore_statefuls(statefuls, load=True)
    return LoadResult(path=source.path, missing=missing, unexpected=unexpected, mismatched=mismatched,
                      not_replaced=not_replaced, bytes_read=nbytes, seconds=time.monotonic() - t0, backend=backend,
                      uninitialized=uninitialized, cast=cast_names)


def _fill_chain(source: Source, links: list[ChainLink], parts: list[Part], tracked_items: dict, strict: bool,
                allow_pickle: bool, cast: str, verify: bool, casts: list, cast_names: dict,
                mismatched: dict) -> tuple[int, str | None]:
    """The fill of a chain's load: ``parts`` (the newest link's tasks) and the tracked tensors
    ``tracked_items`` planned from the base in one pass, then the deltas' newest rows scattered
    into the same destinations (a tensor loaded in another dtype: its buffer in the saved dtype,
    converted once afterwards). The deltas' row ids are read and their rows planned
    (:func:`distckpt.incremental.plan_deltas`) on a thread of their own while the pass runs, with
    small bounce buffers (distckpt.fill.side_reads: both stay in the load's memory budget): the
    plan's small reads and CPU work would otherwise stand before the pass's reads, and a rank
    still reading ids would wait behind the disk queue of a rank already reading its base.
    Extends ``casts``, ``cast_names`` and ``mismatched`` with the base's. Returns (bytes read,
    backend).

    Raises ChainBrokenError for a damaged or missing file of an older link (the base's error
    first), what :func:`fill_parts` raises for the newest link's."""
    untracked = {t.fqn for part in parts for t in part.tasks}
    first_pass_done = [False]
    try:
        return _fill_chain_passes(source, links, parts, tracked_items, strict, allow_pickle, cast, verify, casts,
                                  cast_names, mismatched, first_pass_done)
    except DistCkptError as exc:
        # What the caller's state dict holds, in its own keys (a delta's row records are the
        # load's own): a tracked tensor holds the base's bytes, and maybe some deltas' rows, until
        # every pass is done: partly filled; an untracked one is whole once the first pass was.
        tracked = set(tracked_items)
        cause = exc.__cause__ if isinstance(exc, ChainBrokenError) else None
        if first_pass_done[0]:
            filled, partly = untracked, tracked
        else:
            said = exc if getattr(exc, "filled", None) is not None else cause   # a link's error wraps the fill's
            own_f = set(getattr(said, "filled", None) or ())
            own_p = set(getattr(said, "partly_filled", None) or ())
            filled, partly = own_f & untracked, (own_p & (untracked | tracked)) | (own_f & tracked)
        for e in (exc, cause):
            if isinstance(e, DistCkptError):
                e.filled, e.partly_filled = sorted(filled), sorted(partly)
                e.details.update(filled=e.filled, partly_filled=e.partly_filled)
        raise


def _fill_chain_passes(source: Source, links: list[ChainLink], parts: list[Part], tracked_items: dict, strict: bool,
                       allow_pickle: bool, cast: str, verify: bool, casts: list, cast_names: dict,
                       mismatched: dict, first_pass_done: list) -> tuple[int, str | None]:
    """:func:`_fill_chain`'s passes (``first_pass_done[0]`` set once the first one completed)."""
    base = links[-1]
    tasks, _objects, _missing, _unexpected, base_mismatched, base_casts, base_names, _unin = _plan_tasks(
        base.manifest, tracked_items, strict, allow_pickle, base.path, cast)
    casts.extend(base_casts)
    cast_names.update(base_names)
    mismatched.update(base_mismatched)
    parts.append(Part(source.store, base.path, base.manifest, tasks))
    buffers = {id(dest): tmp for tmp, dest in base_casts}
    targets = {f: [Target(tuple(p.offsets), tuple(p.sizes), buffers.get(id(p.tensor), p.tensor)) for p in it.pieces]
               for f, it in tracked_items.items()}
    planned: dict[str, Any] = {}

    def plan() -> None:
        try:
            with side_reads():
                planned["v"] = plan_deltas(list(reversed(links[:-1])), targets, links[0].tracked, verify)
        except BaseException as exc:  # noqa: BLE001 - raised in the caller's thread below
            planned["e"] = exc
    try:
        with reading(), source.guard_links(links):
            th = threading.Thread(target=plan, name="distckpt-chain-plan")
            th.start()
            try:
                nbytes, backend = fill_parts(parts, verify=verify)
            finally:
                th.join()
            first_pass_done[0] = True
            if "e" in planned:
                # The deltas' records were refused after the base pass filled its tensors (the
                # plan runs beside it): _fill_chain's error says which tensors hold what.
                raise planned["e"]
            reads, id_bytes = planned["v"]
            rows = [Part(source.store, path, manifest, box_tasks(path, manifest, reqs)) for path, manifest, reqs in reads]
            return nbytes + id_bytes + fill_parts(rows, verify=verify)[0], backend
    except (CheckpointCorruptError, CheckpointNotFoundError) as exc:
        broken = _chain_error(exc, links)
        if broken is exc:
            raise
        raise broken from exc


def _chain_error(exc: BaseException, links: list[ChainLink]) -> BaseException:
    """``exc`` when it is about the newest link (or already a ChainBrokenError), else a
    ChainBrokenError naming the older link whose data file it is about."""
    where = os.fspath(getattr(exc, "path", None) or "")
    if isinstance(exc, ChainBrokenError) or where == links[0].path or where.startswith(links[0].path + os.sep):
        return exc
    return link_error(exc, [link.path for link in links[1:]], "data")


def load(state_dict: Any, path: str | os.PathLike, *, process_group: Any = None, strict: bool = True,
         verify: bool = True, allow_pickle: bool = False, cast: str = "exact", no_dist: bool = False,
         storage_options: dict | None = None) -> LoadResult:
    """Fill ``state_dict``'s tensors in place from the checkpoint at ``path``; replace its other values.

    Collective over ``process_group`` when torch.distributed is initialized. Each rank reads only
    the byte ranges its own (possibly differently sharded) tensors need.

    Args:
        state_dict: nested dict/list/tuple of pre-allocated tensors (any device; plain, DTensor,
            ShardedTensor) and plain values.
        path: a committed checkpoint directory, local or an fsspec URL (``s3://...``; each rank
            then reads its byte ranges with ranged GETs). A delta of an incremental chain
            (distckpt.incremental) is composed with its base and earlier deltas.
        storage_options: for an fsspec URL, the fsspec options (as :func:`distckpt.save`).
        strict: when True, a key of the state dict the checkpoint lacks, a shape mismatch, or
            saved optimizer state for an optimizer without state yet raises before a byte is read;
            when False, what matches is loaded and the result lists the rest. Keys the checkpoint
            holds beyond the state dict's are never read and never an error (as in DCP).
        verify: check the crc32c of every block read.
        cast: a tensor saved in another dtype is converted when the conversion is exact
            (``"exact"``, the default: bf16 -> fp32, int32 -> int64, ...; see EXACT_CASTS);
            ``"allow"`` converts any dtype, rounding as ``Tensor.copy_`` does (DCP's behaviour). A
            dtype that may not be converted always raises, whatever ``strict`` says.
        no_dist: load in this process alone, with no collective, even inside a distributed job
            (DCP's ``no_dist``).
        Stateful values (objects with ``state_dict()``/``load_state_dict()``: modules, optimizers,
        dataloaders, as in DCP) are loaded into their ``state_dict()`` and handed back through
        ``load_state_dict()``; non-tensor values are replaced (in tuples too, which are rebuilt).
        allow_pickle: allow unpickling values the checkpoint stored as pickles (only for trusted
            checkpoints: unpickling runs code).

    Raises:
        CheckpointNotFoundError, CheckpointIncompleteError, ManifestCorruptError,
        CheckpointRemovedError (a CheckpointNotFoundError: the step was rotated away, overwritten
        or deleted while this load read it), DataFileMissingError, DataFileTruncatedError, ChecksumMismatchError,
        StateDictMismatchError, PickleNotAllowedError, StorageError subclasses; ChainBrokenError
        (a delta whose chain has a link missing, replaced or damaged: the link is named);
        When several ranks take part and some failed, every rank raises the class they raised
        (``failures``: each rank's error), or RankFailureError when their classes differ.
        A failed load never leaves an unverified byte in the state dict's tensors: each byte is
        either as it was or the checkpoint's; a ChecksumMismatchError (and a read error) lists the
        keys already filled in ``filled`` (completely) and ``partly_filled``. Only a normal
        return means every tensor holds the checkpoint.
    """
    t0 = time.monotonic()
    if cast not in ("exact", "allow"):
        raise ConfigError(f"cast={cast!r}: expected 'exact' or 'allow'")
    group = ControlGroup(None, 0, 1) if no_dist else control_group(process_group, operation="load()")
    result, error, exchange = None, None, None
    try:
        # Collectives first, before anything of this rank's own can fail (flattening its state).
        exchange = readonce.for_load(group, path_text(path))
        source = open_source(path, storage_options)
        with source.guard(), gc_paused():
            manifest = source.manifest_for_boxes(group)
            result = _load_local(source, manifest, state_dict, strict, verify, allow_pickle, cast, t0,
                                 exchange=exchange)
    except readonce.Aborted:
        pass   # another rank failed before any byte moved: its error is raised below
    except Exception as exc:
        # its rank is recorded by raise_failures
        error = typed_memory_error(exc)
        if result is not None and isinstance(exc, CheckpointRemovedError):
            _filled_before_removal(exc, state_dict, result, checked=source.format == "distckpt")
    if exchange is not None:
        try:
            exchange.finish(error)
        except Exception as exc:  # noqa: BLE001 - a peer lost while joining: reported below
            error = error or exc
    exchange_load_outcome(group, error, result, state_dict)
    if result is not None and exchange is not None:
        result = dataclasses.replace(result, bytes_from_peers=exchange.received)
    return result


def exchange_load_outcome(group: Any, error: BaseException | None, result: "LoadResult | None",
                          state_dict: Any) -> None:
    """A load's outcome exchange (collective): raises on every rank when any rank failed, the
    error's ``filled`` / ``partly_filled`` saying what *this rank's* state dict holds. The error
    every rank raises is a copy of the lowest failing rank's, whose lists name that rank's keys:
    a rank whose own load succeeded filled every key its result does not name as skipped, one
    that failed has its own error's lists, and one that cannot tell says nothing (None), never
    another rank's lists."""
    try:
        group.exchange_outcome(error, operation="load")
    except DistCkptError as exc:
        if error is not None and getattr(error, "filled", None) is not None:
            filled, partly = error.filled, getattr(error, "partly_filled", None)
        elif result is not None:
            # This rank's load finished (its error, if any, came after: a peer lost while the
            # read-once exchange was joined): every key it was asked for is filled.
            filled, partly = _filled_keys(state_dict, result), []
        elif error is None:
            filled, partly = [], []   # this rank's load stopped before a byte moved (another rank's failure)
        elif exc is error:
            raise                     # one rank, its own error: as it was raised
        else:
            filled = partly = None    # this rank cannot tell (never another rank's lists)
        exc.filled, exc.partly_filled = filled, partly
        exc.details.update(filled=filled, partly_filled=partly)
        raise


def _filled_before_removal(exc: CheckpointRemovedError, state_dict: Any, result: LoadResult, *,
                           checked: bool) -> None:
    """The load had finished when the checkpoint was found removed or replaced (the guard's last
    look). ``checked`` (distckpt's own files, every block verified against the MANIFEST read at
    the start): every key it was asked for holds the checkpoint as it was when the load began:
    ``filled``. Otherwise (a DCP or Hugging Face checkpoint, no checksums, its files rewritten in
    place) each key holds bytes read from the files as they were at some point of the load,
    perhaps some of each version: ``partly_filled``, never called the checkpoint's. Either way
    the caller learns that its state dict changed."""
    keys = _filled_keys(state_dict, result)
    filled, partly = (keys, []) if checked else ([], keys)
    exc.filled, exc.partly_filled = filled, partly
    exc.details.update(filled=filled, partly_filled=partly)
    if checked:
        said = (f"{len(keys)} key(s) {keys[:10]} hold verified bytes of the checkpoint as it was when the load "
                f"began (non-tensor values put in place)")
    else:
        said = (f"{len(keys)} key(s) {keys[:10]} changed, each holding what its files held when read, which may "
                f"mix the checkpoint's versions (it has no checksums to tell): partly filled")
    exc.message = f"{exc.message}; the load had finished before this was seen: {said}"
    exc.args = (exc.message,)


def _filled_keys(state_dict: Any, result: LoadResult) -> list[str]:
    """The keys of ``state_dict`` a load that returned ``result`` filled: its tensors, and its
    non-tensor values, which it put in place (or found equal to the checkpoint's)."""
    skipped = (set(result.missing) | set(result.mismatched) | set(result.uninitialized)
               | set(result.not_replaced))
    _, items = flatten(state_dict, check_objects=False)
    return sorted(f for f in items if f not in skipped)


def _rebuild(node: dict, values: dict[str, Any], keep, empty=None, path: tuple = ()) -> Any:
    """The container tree ``node`` with the values of the leaves ``keep(fqn)`` accepts; a
    container with none of them left out. An empty dict of the tree (saved empty, or a delta's
    container whose tracked tensors live in its base) is kept when ``empty(fqn)`` says so, or
    always when ``empty`` is None (every key read); its fqn is named as flatten names it (its
    path's keys joined with ".": a "" key counts)."""
    kind = node["t"]
    if kind == "ref":
        return values[node["fqn"]] if keep(node["fqn"]) else _SKIP
    if kind == "dict":
        out = {}
        for key, child in node["k"]:
            v = _rebuild(child, values, keep, empty, (*path, key))
            if v is not _SKIP:
                out[key] = v
        if out:
            return out
        return out if not node["k"] and (empty is None or empty(".".join(str(p) for p in path))) else _SKIP
    children = [_rebuild(c, values, keep, empty, (*path, i)) for i, c in enumerate(node["v"])]
    if any(c is _SKIP for c in children):
        kept = [c for c in children if c is not _SKIP]
        if not kept:
            return _SKIP
        children = kept
    return tuple(children) if kind == "tuple" else children


_SKIP = object()


def read(path: str | os.PathLike, keys: Iterable[str] | None = None, *, verify: bool = True,
         allow_pickle: bool = False, storage_options: dict | None = None) -> dict:
    """Materialize a checkpoint (or the given keys) as full tensors in this process, with the
    original nesting. No process group is used or needed.

    ``keys``: fqns; a key selects itself and everything under it (``"model"`` selects
    ``"model.layer.weight"``). Raises the errors of :func:`load`, and KeyError-compatible
    StateDictMismatchError for a key the checkpoint lacks. Every size in the MANIFEST is
    validated (int64 bounds) and every data file read from is checked against the size the
    MANIFEST gives before any tensor is allocated: a damaged or hostile MANIFEST raises
    ManifestCorruptError / DataFileTruncatedError, never an allocation of its claimed size.
    ``path`` may be an fsspec URL (``storage_options`` as :func:`distckpt.save`). A delta of an
    incremental chain is read composed: its base's tracked tensors with every delta's rows.
    """
    try:
        if keys is not None:
            keys = _key_list(keys)
        source = open_source(path, storage_options)
        with source.guard():
            try:
                return _read(source, keys, verify, allow_pickle)
            except (MemoryError, RuntimeError) as exc:  # a tensor larger than the host's memory
                typed = typed_memory_error(exc)
                if typed is exc:
                    raise
                raise typed from exc
    except DistCkptError as exc:
        # read() runs in one process without a group: its rank is the process's rank, if any.
        if is_distributed():
            import torch.distributed as dist
            fill_rank(exc, dist.get_rank())
        else:
            fill_rank(exc, 0)
        raise


def _close_keys(unknown: list[str], fqns: list[str]) -> str:
    """" (for 'modle' did you mean 'model'?)" for mistyped keys (any prefix of a saved fqn is a valid key)."""
    import difflib

    valid = {".".join(f.split(".")[:i]) for f in fqns for i in range(1, f.count(".") + 2)}
    hints = []
    for key in unknown[:5]:
        close = difflib.get_close_matches(key, sorted(valid), n=2, cutoff=0.6)
        if close:
            hints.append(f"for {key!r} did you mean {' or '.join(map(repr, close))}?")
    return f" ({'; '.join(hints)})" if hints else ""


def _selects(fqn: str, keys: list[str]) -> bool:
    return any(fqn == k or fqn.startswith(k + ".") for k in keys)


def _selected(names: list[str], key: str) -> set[str]:
    """The names of the sorted list ``names`` that ``key`` selects: itself and every name under it
    at a dot (:func:`read`). By bisection, so a read of a few hundred keys of a checkpoint of
    thousands of names costs O(keys x log names), not keys x names: the names under ``key`` are
    exactly those in ``[key + ".", key + "/")`` ("/" is the code point after ".")."""
    i = bisect.bisect_left(names, key)
    out = {key} if i < len(names) and names[i] == key else set()
    lo, hi = bisect.bisect_left(names, key + "."), bisect.bisect_left(names, key + "/")
    out.update(names[lo:hi])
    return out


def _key_list(keys: Iterable[str]) -> list[str]:
    """``read``'s ``keys`` as a list of str. Raises ConfigError for a bare str (it would select
    its characters) or a key that is not a str."""
    if isinstance(keys, (str, bytes)):
        # keys are str: a bytes key is suggested decoded ([b'w'] would be refused next)
        one = keys if isinstance(keys, str) else keys.decode("utf-8", "replace")
        raise ConfigError(f"keys={keys!r} is one string; keys takes a list of keys",
                          remedy=f"Pass keys=[{one!r}].")
    try:
        out = list(keys)
    except TypeError:
        raise ConfigError(f"keys={keys!r} is not a list of keys", remedy="Pass a list of str keys, or None.") from None
    bad = [k for k in out if not isinstance(k, str)]
    if bad:
        raise ConfigError(f"keys {bad[:5]!r} are not str: keys are the checkpoint's dotted names",
                          remedy="Pass str keys ('model.layer.weight', '0.weight'); `distckpt inspect PATH` lists them.")
    return out


def _read(source: Source, keys: Iterable[str] | None, verify: bool, allow_pickle: bool) -> dict:
    """:func:`read` of an opened source: plan every link's tensors, check their data files, then
    allocate and fill them (a chain's deltas' rows after its base's tensors)."""
    manifest = source.manifest()
    links = source.links(manifest)
    saved = list(manifest.tensors) + list(manifest.objects)
    tracked: dict[str, int] = {}
    if links is not None:   # the delta's own records are no state of its own
        saved = [f for f in saved if not _selects(f, [DELTA_ROOT])]
        tracked = links[0].tracked
    own, base_own, unknown = set(saved), set(tracked), []
    if keys is not None:
        by_name, tracked_names = sorted(saved), sorted(tracked)
        own, base_own = set(), set()
        for k in dict.fromkeys(keys):
            mine, theirs = _selected(by_name, k), _selected(tracked_names, k)
            if not mine and not theirs:
                unknown.append(k)
            own |= mine
            base_own |= theirs
        if unknown:
            names = saved + list(tracked)
            raise StateDictMismatchError(f"keys not in the checkpoint: {unknown}{_close_keys(unknown, names)}",
                                         path=source.path, missing=unknown, unexpected=[], shape_mismatch={},
                                         dtype_mismatch={}, remedy="Pass keys the checkpoint has (a key "
                                         "selects itself and every key under it); `distckpt inspect "
                                         f"{source.path}` lists them, keys=None reads everything.")
    plans = [(source.path, manifest, own)]
    if links is not None:
        base = links[-1]
        plans.append((base.path, base.manifest, base_own))
    pickled = [f for f in own if f in manifest.objects and manifest.objects[f].kind == "pickle"]
    # Before anything is allocated: every data file the selected tensors read from has the size
    # its MANIFEST claims. A damaged or hostile MANIFEST that describes terabytes in a file of a
    # few KiB must fail as the truncated file it is, not as an allocation of terabytes.
    try:
        for path, m, keep in plans:
            files = {c.file for fqn in keep if fqn in m.tensors for c in m.tensors[fqn].chunks if c.nbytes}
            source.store.data_readers(path, m, sorted(files))
    except (CheckpointCorruptError, CheckpointNotFoundError) as exc:
        broken = _chain_error(exc, links) if links else exc
        if broken is exc:
            raise
        raise broken from exc
    if pickled and not allow_pickle:
        raise PickleNotAllowedError(f"the checkpoint stores {len(pickled)} value(s) as pickles: {pickled[:10]}",
                                    path=source.path, keys=pickled)
    parts, values = [], []
    for path, m, keep in plans:
        vals: dict[str, Any] = {}
        tasks: list[Task] = []
        for fqn, entry in m.tensors.items():
            if fqn not in keep:
                continue
            dtype = dtype_from_name(entry.dtype, path=path)
            out = vals[fqn] = torch.empty(tuple(entry.shape), dtype=dtype)
            tasks.extend(box_tasks(path, m, [(fqn, (0,) * out.dim(), tuple(entry.shape), out)]))
        parts.append(Part(source.store, path, m, tasks))
        values.append(vals)
    if links is None:
        fill_parts(parts, verify=verify)
    else:
        _fill_read_chain(source, links, parts, values[1], verify)
    trees = []
    for (path, m, keep), vals in zip(plans, values):
        vals.update({fqn: _object_value(entry, m, fqn, path, allow_pickle) for fqn, entry in m.objects.items()
                     if fqn in keep})
        # With keys, an empty container is part of the result only when a key selects it (a
        # delta's containers of tracked tensors are empty in its own tree).
        empty = None if keys is None else (lambda f, ks=list(dict.fromkeys(keys)): _selects(f, ks))
        node = without_records(m.tree) if links is not None and path == source.path else m.tree
        tree = _rebuild(node, vals, keep.__contains__, empty)
        trees.append({} if tree is _SKIP else tree)
    for tree in trees[1:]:   # a chain's base tensors into its newest link's state (a dict: a saver's rule)
        _merge(trees[0], tree)
    return trees[0]


def _fill_read_chain(source: Source, links: list[ChainLink], parts: list[Part], base_values: dict,
                     verify: bool) -> None:
    """:func:`read`'s fill of a chain: ``parts`` (the newest link's and the base's) in one pass,
    then every delta's newest rows scattered into the base's tensors ``base_values``. Raises
    ChainBrokenError for a damaged or missing file of an older link."""
    try:
        with reading(), source.guard_links(links):
            fill_parts(parts, verify=verify)
            targets = {f: [Target((0,) * t.dim(), tuple(t.shape), t)] for f, t in base_values.items()}
            reads, _ids = plan_deltas(list(reversed(links[:-1])), targets, links[0].tracked, verify)
            fill_parts([Part(source.store, path, m, box_tasks(path, m, reqs)) for path, m, reqs in reads],
                       verify=verify)
    except (CheckpointCorruptError, CheckpointNotFoundError) as exc:
        broken = _chain_error(exc, links)
        if broken is exc:
            raise
        raise broken from exc


def _merge(dst: dict, src: dict) -> None:
    """Merge the nested dicts ``src`` into ``dst`` (a chain's base tensors into its newest link's state)."""
    for k, v in src.items():
        if isinstance(v, dict) and isinstance(dst.get(k), dict):
            _merge(dst[k], v)
        else:
            dst[k] = v


def read_box(path: str, manifest: "mf.Manifest", fqn: str, offsets: tuple[int, ...], sizes: tuple[int, ...], *,
             verify: bool = True) -> torch.Tensor:
    """The box (``offsets``, ``sizes``) of tensor ``fqn`` of the checkpoint at ``path`` (whose
    manifest :func:`load_manifest` returned), read into a new CPU tensor in this process.

    Reads only the byte ranges the box needs (checked against their checksums when ``verify``);
    the streaming conversions (distckpt.convert) read a tensor slice by slice through it.
    Raises the read errors of :func:`load`.
    """
    return read_boxes(path, manifest, [(fqn, offsets, sizes)], verify=verify)[0]


def read_boxes(path: str, manifest: "mf.Manifest", requests: list[tuple[str, tuple, tuple]], *,
               verify: bool = True) -> list[torch.Tensor]:
    """:func:`read_box` for several (fqn, offsets, sizes) at once, in one pass over the files."""
    outs = [torch.empty(tuple(sizes), dtype=dtype_from_name(manifest.tensors[fqn].dtype, path=path))
            for fqn, _offsets, sizes in requests]
    fill_boxes(path, manifest, [(f, o, s, out) for (f, o, s), out in zip(requests, outs)], verify=verify)
    return outs


def fill_boxes(path: str, manifest: "mf.Manifest", requests: list[tuple[str, tuple, tuple, Any]], *,
               verify: bool = True) -> None:
    """Read the boxes (fqn, offsets, sizes) into the given destinations, in one pass over the
    files (distckpt.fill.fill_boxes_of: a destination is a tensor of the box's shape, or an
    object with the tensor methods a fill uses on one). Raises the read errors of :func:`load`."""
    fill_boxes_of([(path, manifest, requests)], verify=verify)
