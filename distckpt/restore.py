"""Restore: load into the caller's tensors (resharding on the way), and read() for one process.

How a load works on each rank:
  1. rank 0 reads MANIFEST and broadcasts its bytes; every rank decodes and validates it
     (magic, version, checksum, names inside the directory, offsets inside the files);
  2. the caller's state dict is flattened into wanted boxes (a plain tensor wants its whole
     box, a DTensor / ShardedTensor the boxes this rank holds) and compared with the manifest:
     missing / unexpected keys and shape / dtype mismatches are collected all at once;
  3. for every wanted box, the saved chunks that intersect it are found (plan.plan_reads) and only
     the byte range covering each intersection is read (widened to whole checksum blocks when
     verifying), cached pages with buffered reads, the rest with O_DIRECT (distckpt.fill);
  4. each block is checked against its crc32c in a bounded bounce buffer before any of its bytes
     is copied into the caller's tensor: a load that fails never leaves a corrupt byte there,
     and its error names the tensors already filled (completely or in part) with verified bytes;
  5. every rank's outcome is exchanged, so all ranks return or all raise the same typed error.

Loading never unpickles unless the caller passes ``allow_pickle=True``.
"""

from __future__ import annotations

import dataclasses
import errno
import logging
import os
import pickle
import re
import time
from typing import Any, Iterable

import torch

from . import dcp, hf
from . import manifest as mf
from ._dist import ControlGroup, _portable, control_group, is_distributed
from .coordinator import MANIFEST, TMP_RE, gc_paused
from .errors import (CheckpointCorruptError, CheckpointIncompleteError, CheckpointNotFoundError,
                     CheckpointRemovedError, ConfigError, DataFileMissingError,
                     DistCkptError, PickleNotAllowedError, ReshardError,
                     StateDictMismatchError, StorageError, fill_rank, from_os_error)
from .locate import check_checkpoint_dir, checkpoint_path
from .flatten import ObjectItem, TensorItem, expand_statefuls, flatten, restore_statefuls, set_leaf
from .values import decode_value
from .plan import Box, plan_reads
from .staging import dtype_from_name, dtype_name
from .storage import Store, is_url, open_store

__all__ = ["LoadResult", "load", "read", "read_manifest", "load_manifest", "EXACT_CASTS"]

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


def _check_committed(path: str) -> None:
    check_checkpoint_dir(path)  # names what the path is when it is not a checkpoint
    if not os.path.exists(path):
        raise CheckpointNotFoundError(f"no checkpoint at {path}", path=path)
    if TMP_RE.match(os.path.basename(path)):
        raise CheckpointIncompleteError(f"{path} is the temporary directory of an unfinished save", path=path)


def _dir_identity(path: str) -> tuple[int, int] | None:
    """(st_dev, st_ino) of the checkpoint directory, or None when nothing is at ``path``."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino


def _removed_while_reading(path: str, identity: tuple[int, int] | None,
                           exc: BaseException | None) -> BaseException | None:
    """``exc``, or a CheckpointRemovedError when ``exc`` is what a step vanishing mid-load looks like
    (``exc`` None: a load that succeeded, failed only if another directory took the name).

    A rotation (or an overwrite, or a deletion) renames the directory away and deletes it; a load
    that read MANIFEST before that and opens a data file after it meets a missing file (or a
    missing MANIFEST, or another directory's files under the same name). That is not damage, and
    "restore from an older checkpoint" is the wrong remedy: the directory is checked again and the
    error says what happened. ``identity`` is the directory's (st_dev, st_ino) when the load began.
    """
    suspect = exc is None or isinstance(exc, (CheckpointIncompleteError, CheckpointCorruptError)) or (
        isinstance(exc, StorageError) and exc.errno == errno.ENOENT)
    if not suspect or isinstance(exc, CheckpointNotFoundError):
        return exc
    now = _dir_identity(path)
    if now is not None and (identity is None or now == identity):
        return exc  # still the same directory: the error (or success) stands as it is
    if exc is None and now is None:
        return None  # read in full, then removed: every byte came from the one checkpoint
    parent, name = os.path.split(path)
    renamed_to = None
    if identity is not None:
        try:
            with os.scandir(parent) as it:
                for entry in it:
                    m = TMP_RE.match(entry.name)
                    if m and m.group("name") == name:
                        st = entry.stat(follow_symlinks=False)
                        if (st.st_dev, st.st_ino) == identity:
                            renamed_to = entry.path
                            break
        except OSError:
            pass
    if now is not None:
        how = "another directory now has its name (it was overwritten, or rotated away and saved again)"
    elif renamed_to is not None:
        how = f"it was renamed to {os.path.basename(renamed_to)} to be deleted (rotation by a manager's keep_last, or an overwrite)"
    else:
        how = "the directory no longer exists (rotated away or deleted)"
    if exc is None:  # every read succeeded, but not necessarily all from one checkpoint
        failed = ("its files may have been read partly from the one that replaced it, so the load is "
                  "failed rather than mixing two checkpoints")
    else:
        failed = f"the read failed with {type(exc).__name__}: {getattr(exc, 'message', exc)}"
    removed = CheckpointRemovedError(
        f"the checkpoint at {path} was removed while it was being read: {how}; {failed}",
        path=path, rank=getattr(exc, "rank", None), renamed_to=renamed_to, replaced=now is not None)
    removed.__cause__ = exc
    return removed


def _check_unmoved(path: str, identity: tuple[int, int] | None) -> None:
    """After a load or read that succeeded: the directory it began with still has its name. Data
    files are opened by path, one after another; if another checkpoint took the name meanwhile
    (an overwrite, or rotation and a new save of that name), some of them may be the new one's,
    which checksums catch unless the bytes agree or ``verify=False``: fail instead."""
    error = _removed_while_reading(path, identity, None)
    if error is not None:
        raise error


def _manifest_bytes(path: str) -> bytes:
    """The raw MANIFEST of the checkpoint directory ``path``, after checking that the directory is
    a committed checkpoint (exists, is not a tmp dir, has a MANIFEST that is a regular file)."""
    _check_committed(path)
    return mf.read_manifest_bytes(os.path.join(path, MANIFEST))


def load_manifest(path: str, storage_options: dict | None = None) -> "mf.Manifest":
    """Read, decode and validate ``path``/MANIFEST (``path`` local or an fsspec URL, see
    :func:`distckpt.save` for ``storage_options``).

    Raises:
        CheckpointNotFoundError: ``path`` does not exist.
        CheckpointIncompleteError: ``path`` is a save's tmp directory or has no MANIFEST.
        ManifestCorruptError: MANIFEST is damaged or describes an impossible layout.
    """
    path = checkpoint_path(path)  # normalized; a MANIFEST file stands for its directory
    if is_url(path):
        return open_store(path, storage_options).load_manifest(path)
    _check_committed(path)
    if dcp.is_dcp_checkpoint(path):  # torch.distributed.checkpoint's layout: read it directly
        return dcp.load_manifest(path)
    if hf.is_hf_checkpoint(path):  # a Hugging Face safetensors directory: its headers as a manifest
        return hf.load_manifest(path)
    # decode validates: magic, version, checksum, names inside the directory, offsets, tiling, tree
    return mf.load_manifest(path)


def read_manifest(path: str, storage_options: dict | None = None) -> dict:
    """The checkpoint's manifest as plain data (dicts, lists, ints, strs)."""
    return mf.to_plain(load_manifest(path, storage_options))


def _check_data_file(ckpt: str, entry: "mf.FileEntry") -> str:
    fpath = os.path.join(ckpt, entry.name)
    try:
        # lstat, not stat: a data file must be a regular file inside the checkpoint (I7), never
        # followed through a symlink; refused before any open or read.
        st = os.lstat(fpath)
    except FileNotFoundError:
        raise DataFileMissingError(f"data file {entry.name} listed in MANIFEST is missing", path=fpath) from None
    except OSError as exc:
        raise from_os_error(exc, path=fpath, operation="stat") from exc
    mf.check_data_file_stat(entry, fpath, st)
    return fpath


@dataclasses.dataclass
class _Task:
    fqn: str
    chunk: Any            # mf.ChunkRecord
    inter: Box            # global box to copy
    dest: torch.Tensor    # the caller's tensor holding dest_box
    dest_box: Box
    itemsize: int
    dtype: torch.dtype
    after: str | None = None   # fill copies this task only after every task of that fqn (distckpt.fill)


def _narrow(t: torch.Tensor, offsets, sizes) -> torch.Tensor:
    for d, (o, s) in enumerate(zip(offsets, sizes)):
        t = t.narrow(d, o, s)
    return t


def _check_files(ckpt: str, manifest: "mf.Manifest", indexes, store: Store | None) -> None:
    """Every data file in ``indexes`` exists with its MANIFEST size (before any byte is read)."""
    indexes = sorted(indexes)
    if store is not None:
        store.data_readers(ckpt, manifest, indexes)
        return
    for fi in indexes:
        _check_data_file(ckpt, manifest.files[fi])


def _fill(ckpt: str, manifest: "mf.Manifest", tasks: list[_Task], verify: bool,
          store: Store | None = None) -> tuple[int, str | None]:
    """Read every task's bytes, verify them, copy them into place (distckpt.fill: verified in
    bounded bounce buffers before any byte reaches the caller). Returns (bytes read, backend)."""
    from .fill import READ_PIECE, fill
    from .storage.posix import choose_backend, open_reader

    if not tasks:
        return 0, None
    verify = verify and manifest.checksum_algo == "crc32c"  # a DCP checkpoint has no checksums
    by_file: dict[int, list[_Task]] = {}
    for t in tasks:
        by_file.setdefault(t.chunk.file, []).append(t)
    if store is not None:  # an object store: ranged GETs, several in flight (fill's workers)
        paths, open_obj, align, backend = store.data_readers(ckpt, manifest, sorted(by_file))
        stats = fill(paths, by_file, block=manifest.checksum_block, verify=verify, align=align, open_reader=open_obj)
        return stats.bytes_read, backend
    choice = choose_backend(ckpt, read_only=True)  # a load never writes into the checkpoint
    paths = {i: _check_data_file(ckpt, manifest.files[i]) for i in by_file}
    align = choice.offset_align
    nbytes = fill(paths, by_file, block=manifest.checksum_block, verify=verify, align=align,
                  open_reader=lambda p: open_reader(p, choice=choice, block_size=READ_PIECE)).bytes_read
    return nbytes, choice.name


def _describe(entry) -> str:
    if isinstance(entry, mf.TensorEntry):
        return f"{entry.dtype}{list(entry.shape)}"
    return f"object({entry.kind})"


#: Saved dtype -> dtypes that hold every one of its values exactly: load converts these without
#: being asked (``cast="exact"``, the default). Anything else needs ``cast="allow"``.
EXACT_CASTS: dict[str, frozenset[str]] = {
    "float16": frozenset({"float32", "float64"}),
    "bfloat16": frozenset({"float32", "float64"}),
    "float32": frozenset({"float64"}),
    "float8_e4m3fn": frozenset({"float16", "bfloat16", "float32", "float64"}),
    "float8_e5m2": frozenset({"float16", "bfloat16", "float32", "float64"}),
    "complex64": frozenset({"complex128"}),
    "bool": frozenset({"uint8", "int8", "int16", "int32", "int64", "float16", "bfloat16", "float32", "float64"}),
    "uint8": frozenset({"int16", "int32", "int64", "uint16", "uint32", "uint64", "float16", "bfloat16",
                        "float32", "float64"}),
    "int8": frozenset({"int16", "int32", "int64", "float16", "bfloat16", "float32", "float64"}),
    "int16": frozenset({"int32", "int64", "float32", "float64"}),
    "uint16": frozenset({"int32", "int64", "uint32", "uint64", "float32", "float64"}),
    "int32": frozenset({"int64", "float64"}),
    "uint32": frozenset({"int64", "uint64", "float64"}),
}

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
    out, stack = [], [node]
    while stack:
        n = stack.pop()
        if n["t"] == "ref":
            out.append(n["fqn"])
        elif n["t"] == "dict":
            stack.extend(child for _, child in n["k"])
        else:
            stack.extend(n["v"])
    return out


def _container_entry(manifest, item: ObjectItem):
    """A value the checkpoint stored element by element (format 1 saved lists and tuples of plain
    values that way) asked for as one value: a pseudo entry that rebuilds it, or None."""
    node = _subtree_node(manifest.tree, item.path)
    if node is None or node["t"] == "ref":
        return None
    if not all(r in manifest.objects for r in _refs(node)):
        return None
    return ("container", node)


def _plan_tasks(manifest, items, strict: bool, allow_pickle: bool, path: str, cast: str = "exact",
                optimizer_paths: list[tuple] = ()):
    missing, unexpected = [], []
    shape_mm, dtype_mm, mismatched = {}, {}, {}
    tasks: list[_Task] = []
    casts: list[tuple[torch.Tensor, torch.Tensor]] = []  # (buffer in the saved dtype, caller's tensor)
    cast_names: dict[str, str] = {}
    objects: list[tuple[ObjectItem, Any]] = []
    pickled = []
    reshard = []
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
                    tasks.append(_Task(fqn, saved.chunks[0], want, dest, want, dtype.itemsize, dtype))
                    continue
                if chunks is None:
                    chunks = [(Box(tuple(c.offsets), tuple(c.sizes)), c) for c in saved.chunks]
                for rp in plan_reads(chunks, want, itemsize=dtype.itemsize):
                    tasks.append(_Task(fqn, rp.payload, rp.box, dest, want, dtype.itemsize, dtype))
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


def _object_value(entry, manifest=None, fqn: str = "", path: str | None = None) -> Any:
    if isinstance(entry, tuple) and entry[0] == "container":  # see _container_entry
        values = {r: _object_value(manifest.objects[r], manifest, r, path) for r in _refs(entry[1])}
        return _rebuild(entry[1], values, lambda f: True)
    if entry.kind == "pickle":
        return pickle.loads(entry.value)  # only reached with allow_pickle=True
    if entry.kind == "dcp":  # a DCP value: torch.load(weights_only=True) or PickleNotAllowedError
        return entry.value.load()
    return decode_value(entry.kind, entry.value, fqn=fqn, path=path)


def _same(a: Any, b: Any) -> bool:
    try:
        return type(a) is type(b) and bool(a == b)
    except Exception:  # e.g. numpy arrays compare elementwise
        return False


def _load_local(manifest, path: str, state_dict: Any, strict: bool, verify: bool, allow_pickle: bool, t0: float,
                cast: str = "exact", store: Store | None = None) -> LoadResult:
    """Plan, read and place one rank's part of a load."""
    statefuls = expand_statefuls(state_dict)
    try:
        _tree, items = flatten(state_dict, check_objects=False)
        tasks, objects, missing, unexpected, mismatched, casts, cast_names, uninitialized = _plan_tasks(
            manifest, items, strict, allow_pickle, path, cast, _optimizer_paths(state_dict))
        # Decoded before any byte is read: a class that cannot be rebuilt fails the load early.
        values = [(item, _object_value(entry, manifest, item.fqn, path)) for item, entry in objects]
        # Every data file this rank reads has its MANIFEST size before the first byte lands in the
        # caller's tensors: a truncated or missing file fails the load with them untouched.
        _check_files(path, manifest, {t.chunk.file for t in tasks}, store)
        nbytes, backend = _fill(path, manifest, tasks, verify, store)
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
            raise StateDictMismatchError(
                f"{len(not_replaced)} value(s) differ from the checkpoint but sit in a tuple at the root of the "
                f"state dict, which cannot be replaced in place: {not_replaced[:10]}", path=path, missing=[],
                unexpected=[], shape_mismatch={}, dtype_mismatch={},
                remedy="Pass a dict (or a list) as the state dict's root.")
    except BaseException:
        restore_statefuls(statefuls, load=False)
        raise
    restore_statefuls(statefuls, load=True)
    return LoadResult(path=path, missing=missing, unexpected=unexpected, mismatched=mismatched,
                      not_replaced=not_replaced, bytes_read=nbytes, seconds=time.monotonic() - t0, backend=backend,
                      uninitialized=uninitialized, cast=cast_names)


def _manifest_collective(group: ControlGroup, path: str, store: Store | None = None) -> "mf.Manifest":
    """Rank 0 reads MANIFEST once and broadcasts its bytes (or its typed error); every rank
    decodes and validates them itself (a shared file system need not be hit N times)."""
    # DCP / safetensors: every rank reads .metadata / the headers itself (a few KiB per file)
    if store is None and (group.world_size == 1 or dcp.is_dcp_checkpoint(path) or hf.is_hf_checkpoint(path)):
        return load_manifest(path)
    payload, manifest = None, None
    if group.rank == 0:
        try:
            data = store.manifest_bytes(path) if store is not None else _manifest_bytes(path)
            indexes: dict[int, bytes] = {}

            def read_index(header: "mf.Manifest", i: int) -> bytes:
                raw = (store.read_index(path, header, i) if store is not None
                       else mf.read_local_index(path, header.files[i]))
                indexes[i] = raw
                return raw

            manifest = mf.decode(data, path=os.path.join(path, MANIFEST), read_index=read_index)
            payload = (data, indexes, None)
        except Exception as exc:
            payload = (None, None, _portable(exc))
    # The data files' indexes (format version 3) travel with the MANIFEST: every rank needs every
    # chunk record to plan, and the storage is read once, not once per rank.
    data, indexes, error = group.broadcast(payload)
    if error is not None:
        raise error
    if manifest is not None:
        return manifest
    return mf.decode(data, path=os.path.join(path, MANIFEST), read_index=lambda header, i: indexes[i])


def load(state_dict: Any, path: str | os.PathLike, *, process_group: Any = None, strict: bool = True,
         verify: bool = True, allow_pickle: bool = False, cast: str = "exact", no_dist: bool = False,
         storage_options: dict | None = None, _follow_chain: bool = True) -> LoadResult:
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
        StateDictMismatchError, PickleNotAllowedError, StorageError subclasses;
        When several ranks take part and some failed, every rank raises the class they raised
        (``failures``: each rank's error), or RankFailureError when their classes differ.
        A failed load never leaves an unverified byte in the state dict's tensors: each byte is
        either as it was or the checkpoint's; a ChecksumMismatchError (and a read error) lists the
        keys already filled in ``filled`` (completely) and ``partly_filled``. Only a normal
        return means every tensor holds the checkpoint.
    """
    t0 = time.monotonic()
    path = checkpoint_path(path)  # normalized; a MANIFEST file stands for its directory
    if cast not in ("exact", "allow"):
        raise ConfigError(f"cast={cast!r}: expected 'exact' or 'allow'")
    group = ControlGroup(None, 0, 1) if no_dist else control_group(process_group)
    result, error, delta = None, None, False
    store, identity = None, None
    try:
        if is_url(path):
            store = open_store(path, storage_options)
        else:
            identity = _dir_identity(path)
        with gc_paused():
            manifest = _manifest_collective(group, path, store)
            delta = _follow_chain and _is_delta(manifest)
            if delta and store is not None:
                raise ConfigError(f"{path} is a delta of an incremental chain: chains are read from local "
                                  f"directories only")
            if not delta:
                result = _load_local(manifest, path, state_dict, strict, verify, allow_pickle, t0, cast, store)
                _check_unmoved(path, identity)
    except Exception as exc:
        # its rank is recorded by raise_failures
        error = _removed_while_reading(path, identity, exc) if store is None else _replaced_on_store(store, path, exc)
    group.exchange_outcome(error, operation="load")
    if delta:  # an incremental link: base + deltas (distckpt.incremental)
        from .incremental import load_chain
        return load_chain(state_dict, path, process_group=process_group, no_dist=no_dist, verify=verify,
                          strict=strict, allow_pickle=allow_pickle, cast=cast)
    return result


def _is_delta(manifest: "mf.Manifest") -> bool:
    from .chain import chain_info
    info = chain_info(manifest)
    return info is not None and info.get("kind") == "delta"


def _rebuild(node: dict, values: dict[str, Any], keep) -> Any:
    kind = node["t"]
    if kind == "ref":
        return values[node["fqn"]] if keep(node["fqn"]) else _SKIP
    if kind == "dict":
        out = {}
        for key, child in node["k"]:
            v = _rebuild(child, values, keep)
            if v is not _SKIP:
                out[key] = v
        return out if out or not node["k"] else _SKIP
    children = [_rebuild(c, values, keep) for c in node["v"]]
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
    ``path`` may be an fsspec URL (``storage_options`` as :func:`distckpt.save`).
    """
    path = checkpoint_path(path)  # normalized; a MANIFEST file stands for its directory
    if is_url(path):
        store = open_store(path, storage_options)
        try:
            return _read(path, keys, verify, allow_pickle, store)
        except DistCkptError as exc:
            raise _replaced_on_store(store, path, exc) from None
    identity = _dir_identity(path)
    try:
        try:
            out = _read(path, keys, verify, allow_pickle)
            _check_unmoved(path, identity)
            return out
        except CheckpointRemovedError:
            raise
        except DistCkptError as exc:
            removed = _removed_while_reading(path, identity, exc)
            if removed is not exc:
                raise removed from exc
            raise
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


def _replaced_on_store(store: Store, path: str, exc: BaseException) -> BaseException:
    """A data object missing on an object store because the checkpoint was overwritten or
    deleted while it was read: CheckpointRemovedError, as on a local file system."""
    if not isinstance(exc, DataFileMissingError):
        return exc
    try:
        now = store.committed_save_id(path)
    except Exception:  # noqa: BLE001 - the original error says enough
        return exc
    seen = os.path.basename(os.path.dirname(exc.path or ""))
    if now == seen:
        return exc  # the same save's object is missing: damage, not a replacement
    err = CheckpointRemovedError(
        f"{path} was {'replaced by another save' if now else 'deleted'} while it was read ({exc.message})",
        path=path, renamed_to=None, replaced=now is not None)
    err.__cause__ = exc
    return err


def _read(path: str, keys: Iterable[str] | None, verify: bool, allow_pickle: bool, store: Store | None = None, *,
          follow_chain: bool = True) -> dict:
    manifest = load_manifest(path) if store is None else store.load_manifest(path)
    if follow_chain and _is_delta(manifest):  # an incremental link: base + deltas composed
        if store is not None:
            raise ConfigError(f"{path} is a delta of an incremental chain: chains are read from local "
                              f"directories only")
        from .incremental import read_chain
        return read_chain(path, keys, verify, allow_pickle)
    all_keys = list(manifest.tensors) + list(manifest.objects)
    if keys is None:
        def keep(fqn):
            return True
    else:
        wanted = list(keys)
        unknown = [k for k in wanted if not any(f == k or f.startswith(k + ".") for f in all_keys)]
        if unknown:
            raise StateDictMismatchError(f"keys not in the checkpoint: {unknown}{_close_keys(unknown, all_keys)}",
                                         path=path, missing=unknown, unexpected=[], shape_mismatch={},
                                         dtype_mismatch={}, remedy="Pass keys the checkpoint has (a key "
                                         "selects itself and every key under it); `distckpt inspect "
                                         f"{path}` lists them, keys=None reads everything.")

        def keep(fqn):
            return any(fqn == k or fqn.startswith(k + ".") for k in wanted)
    values: dict[str, Any] = {}
    tasks: list[_Task] = []
    pickled = []
    # Before anything is allocated: every data file the selected tensors read from has the size
    # its MANIFEST claims. A damaged or hostile MANIFEST that describes terabytes in a file of a
    # few KiB must fail as the truncated file it is, not as an allocation of terabytes.
    _check_files(path, manifest, {c.file for fqn, entry in manifest.tensors.items() if keep(fqn)
                                  for c in entry.chunks if c.nbytes}, store)
    for fqn, entry in manifest.tensors.items():
        if not keep(fqn):
            continue
        dtype = dtype_from_name(entry.dtype, path=path)
        out = torch.empty(tuple(entry.shape), dtype=dtype)
        values[fqn] = out
        want = Box((0,) * len(entry.shape), tuple(entry.shape))
        if want.volume == 0:
            continue
        chunks = [(Box(tuple(c.offsets), tuple(c.sizes)), c) for c in entry.chunks]
        for rp in plan_reads(chunks, want, itemsize=dtype.itemsize):
            tasks.append(_Task(fqn, rp.payload, rp.box, out, want, dtype.itemsize, dtype))
    for fqn, entry in manifest.objects.items():
        if keep(fqn):
            if entry.kind == "pickle":
                pickled.append(fqn)
            values[fqn] = entry
    if pickled and not allow_pickle:
        raise PickleNotAllowedError(f"the checkpoint stores {len(pickled)} value(s) as pickles: {pickled[:10]}",
                                    path=path, keys=pickled)
    _fill(path, manifest, tasks, verify, store)
    for fqn in list(values):
        if isinstance(values[fqn], mf.ObjectEntry):
            values[fqn] = _object_value(values[fqn], manifest, fqn, path)
    result = _rebuild(manifest.tree, values, keep)
    return {} if result is _SKIP else result


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
    """:func:`read_box` for several (fqn, offsets, sizes) at once, in one pass over the files
    (incremental chains read many small records per link this way)."""
    outs = [torch.empty(tuple(sizes), dtype=dtype_from_name(manifest.tensors[fqn].dtype, path=path))
            for fqn, _offsets, sizes in requests]
    fill_boxes(path, manifest, [(f, o, s, out) for (f, o, s), out in zip(requests, outs)], verify=verify)
    return outs


def fill_boxes(path: str, manifest: "mf.Manifest", requests: list[tuple[str, tuple, tuple, Any]], *,
               verify: bool = True) -> None:
    """Read the boxes (fqn, offsets, sizes) into the given destinations, in one pass over the
    files. A destination is a tensor of the box's shape, or an object with the tensor methods the
    fill uses on a destination (``dtype``, ``is_contiguous()``, ``narrow()``, ``copy_()``):
    distckpt.incremental scatters delta rows straight from the read buffers into a table that way."""
    fill_boxes_of([(path, manifest, requests)], verify=verify)


def fill_boxes_of(checkpoints: list[tuple[str, "mf.Manifest", list[tuple]]], *,
                  verify: bool = True) -> int:
    """:func:`fill_boxes` for several checkpoints (path, manifest, requests) in one read pass
    (each file verified with its own checkpoint's checksum block; DCP checkpoints, which have
    none, in passes of their own): the read pipeline's fixed costs are paid once, not per
    checkpoint. A request is (fqn, offsets, sizes, destination[, after]): with ``after``, an fqn
    of another request of the pass, it is copied only once that one's boxes are (distckpt.fill).
    Returns the bytes read. Raises the read errors of :func:`load`; their ``path`` names the data
    file."""
    choices: dict[str, Any] = {}
    groups, dcp_passes = _box_tasks(checkpoints, choices=choices)
    nbytes = 0
    for path, manifest, tasks in dcp_passes:   # a DCP checkpoint: no checksums, its own pass
        nbytes += _fill(path, manifest, tasks, verify)[0]
    return nbytes + _fill_groups(groups, choices, verify)


def _box_tasks(checkpoints: list[tuple[str, "mf.Manifest", list[tuple]]], *,
               choices: dict[str, Any]) -> tuple[dict[int, tuple[dict, dict]], list]:
    """The fill tasks of box requests, grouped by checksum block size: ({block: (paths, by_file)},
    [(path, manifest, tasks) of DCP checkpoints]). File keys are ``i << 32 | file`` for the i-th
    checkpoint, unique across them (and in the order of ``checkpoints``). Every data file is checked to exist with its MANIFEST size; ``choices`` gets
    the I/O backend of each path."""
    from .storage.posix import choose_backend

    groups: dict[int, tuple[dict, dict]] = {}   # checksum block -> (paths, by_file)
    dcp_passes = []
    for ci, (path, manifest, requests) in enumerate(checkpoints):
        tasks = []
        for req in requests:
            fqn, offsets, sizes, out = req[:4]
            after = req[4] if len(req) > 4 else None
            entry = manifest.tensors[fqn]
            dtype = dtype_from_name(entry.dtype, path=path)
            want = Box(tuple(offsets), tuple(sizes))
            if want.volume:
                chunks = [(Box(tuple(c.offsets), tuple(c.sizes)), c) for c in entry.chunks]
                tasks.extend(_Task(fqn, rp.payload, rp.box, out, want, dtype.itemsize, dtype, after)
                             for rp in plan_reads(chunks, want, itemsize=dtype.itemsize))
        if not tasks:
            continue
        if manifest.checksum_algo != "crc32c":
            dcp_passes.append((path, manifest, tasks))
            continue
        choice = choose_backend(path, read_only=True)
        paths, by_file = groups.setdefault(manifest.checksum_block, ({}, {}))
        for t in tasks:
            key = (ci << 32) | t.chunk.file
            if key not in paths:
                paths[key] = _check_data_file(path, manifest.files[t.chunk.file])
                choices[paths[key]] = choice
            by_file.setdefault(key, []).append(t)
    return groups, dcp_passes


def _fill_groups(groups: dict[int, tuple[dict, dict]], choices: dict[str, Any], verify: bool) -> int:
    """One fill of every group's files, each with its checksum block; returns the bytes read."""
    from .fill import READ_PIECE, fill
    from .storage.posix import open_reader
    paths: dict = {}
    by_file: dict = {}
    blocks: dict = {}
    for block, (gpaths, gtasks) in groups.items():
        paths.update(gpaths)
        by_file.update(gtasks)
        blocks.update(dict.fromkeys(gtasks, block))
    if not by_file:
        return 0
    align = max(choices[p].offset_align for p in paths.values())
    return fill(paths, by_file, block=blocks, verify=verify, align=align,
                open_reader=lambda p: open_reader(p, choice=choices[p], block_size=READ_PIECE)).bytes_read
