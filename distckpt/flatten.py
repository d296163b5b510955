"""State dicts <-> flat items with global boxes.

A state dict is a tree of dict / list / tuple containers whose leaves are tensors (plain, DTensor,
ShardedTensor) or plain values. :func:`flatten` turns it into

  * ``tree``: the containers as plain msgpack-able data (so :func:`distckpt.read` can rebuild the
    exact nesting, int dict keys and tuples included), leaves replaced by references, and
  * ``items``: {fqn: TensorItem | ObjectItem}, where a TensorItem lists the *local pieces* this rank
    holds, each with its box (offsets, sizes) in the tensor's global index space.

The fqn of a leaf is its container path joined with "." (DCP's convention: ``model.layer.weight``,
``optim.state.0.exp_avg``); two leaves with the same fqn are an error, never a silent overwrite.

Global boxes are what make resharding possible: a plain tensor is one box covering itself; a DTensor
holds the box its placements give this rank (torch computes it); a ShardedTensor (and TorchRec's
DTensor over LocalShardsWrapper, whose placements are not trustworthy) holds one box per local shard,
taken from the shard metadata itself.
"""

from __future__ import annotations

import dataclasses
import operator
import sys
from typing import Any

import torch

from .errors import UnsupportedValueError
from .values import _I64_MIN, _U64, MAX_DEPTH, _is_stateful, _is_namedtuple, encode_value, holds_tensor

__all__ = ["Piece", "TensorItem", "ObjectItem", "LocalPieces", "flat_range_boxes", "flatten", "set_leaf",
           "object_entry", "expand_statefuls"]

_PLAIN = (bool, int, float, str, bytes, type(None))


@dataclasses.dataclass
class Piece:
    """A local tensor holding the global box ``offsets``/``sizes`` of its item.

    For an async save that stages in the background (which checks that nothing changed the
    tensor before its copy ended): ``owner`` is the DTensor whose local tensor this is (an
    in-place DTensor operation moves the wrapper's version counter, not the local tensor's);
    ``unguarded`` says that the tensor can change with no counter moving (TorchRec's sharded
    tables, which its fused optimizer updates inside the backward kernels)."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    tensor: torch.Tensor
    owner: Any = None
    unguarded: bool = False


def flat_range_boxes(shape: tuple[int, ...], start: int, stop: int) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """Boxes (offsets, sizes) whose elements are exactly the row-major flat elements [start, stop)
    of a tensor of ``shape``, in flat order.

    Each box is itself contiguous in row-major order (fixed leading indices, one range, then whole
    trailing dimensions), so box ``k`` is ``flat[a_k:b_k].view(sizes_k)`` with the a_k increasing:
    at most ``2 * ndim - 1`` boxes. This is what turns "elements [start, stop) of a flattened
    parameter" (a ZeRO partition) into global boxes of the parameter's real shape.
    """
    if not 0 <= start <= stop <= _numel(shape):
        raise ValueError(f"flat range [{start}, {stop}) outside a tensor of shape {list(shape)}")
    if start == stop:
        return []
    if len(shape) == 0:
        return [((), ())]
    if len(shape) == 1:
        return [((start,), (stop - start,))]
    inner = _numel(shape[1:])
    rest = tuple(shape[1:])
    r0, c0 = divmod(start, inner)
    r1, c1 = divmod(stop, inner)
    out: list[tuple[tuple[int, ...], tuple[int, ...]]] = []
    if c0:  # a partial first row
        end = stop - r0 * inner if r1 == r0 else inner
        out += [((r0,) + off, (1,) + sz) for off, sz in flat_range_boxes(rest, c0, end)]
        if r1 == r0:
            return out
        r0 += 1
    if r1 > r0:  # whole rows
        out.append(((r0,) + (0,) * len(rest), (r1 - r0,) + rest))
    if c1:  # a partial last row
        out += [((r1,) + off, (1,) + sz) for off, sz in flat_range_boxes(rest, 0, c1)]
    return out


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


@dataclasses.dataclass
class LocalPieces:
    """A state-dict leaf: this rank holds these pieces (global boxes) of a global tensor.

    For layouts torch has no tensor type for, such as a ZeRO partition that holds a flat range of
    a parameter: the pieces of all ranks together must tile ``shape`` exactly once (the save
    checks it). On load each piece is filled in place, so pieces that are views of a larger
    buffer (a flat optimizer partition) fill that buffer.
    """

    shape: tuple[int, ...]
    dtype: torch.dtype
    pieces: list[Piece]

    @classmethod
    def from_flat(cls, shape: tuple[int, ...], dtype: torch.dtype,
                  ranges: list[tuple[int, torch.Tensor]]) -> "LocalPieces":
        """Pieces for flat ranges: each ``(start, t)`` says that the 1-D tensor ``t`` holds the
        row-major flat elements ``[start, start + t.numel())`` of the global tensor."""
        shape = tuple(int(d) for d in shape)
        pieces = []
        for start, flat in ranges:
            if flat.dim() != 1:
                raise ValueError(f"a flat range must be a 1-D tensor, got shape {list(flat.shape)}")
            at = 0
            for offsets, sizes in flat_range_boxes(shape, start, start + flat.numel()):
                n = _numel(sizes)
                pieces.append(Piece(offsets, sizes, flat.narrow(0, at, n).view(sizes)))
                at += n
        return cls(shape, dtype, pieces)


@dataclasses.dataclass
class TensorItem:
    fqn: str
    kind: str  # "tensor" | "dtensor" | "sharded_tensor" (ShardedTensor and LocalPieces)
    dtype: torch.dtype
    shape: tuple[int, ...]
    pieces: list[Piece]
    path: tuple
    #: For a DTensor whose placements are all ``Shard`` on distinct dimensions (FSDP, TP, 2-D
    #: TP+FSDP): ``(mesh, dims, coordinate)``, where ``mesh`` is ``(mesh shape, ranks in row-major
    #: mesh order)`` (one shared tuple per DeviceMesh), ``dims[i]`` the tensor dimension split
    #: over mesh dimension ``i`` and ``coordinate`` this rank's place in the mesh. Every rank of
    #: the mesh describes the tensor the same way except for its coordinate, which is what lets
    #: a save plan it without gathering every rank's box (saveplan, "compact layouts").
    grid: tuple | None = None


@dataclasses.dataclass
class ObjectItem:
    fqn: str
    value: Any
    path: tuple


def _dtensor_type():
    # Not imported yet: no DTensor can exist, and importing it costs 1-1.5 s (sympy) on the first
    # save or load of a job that never uses one.
    if "torch.distributed.tensor" not in sys.modules:
        return None
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # torch built without distributed
        return None
    return DTensor


def _sharded_tensor_type():
    if "torch.distributed._shard.sharded_tensor" not in sys.modules:
        return None  # not imported: none exists (as for DTensor above)
    try:
        from torch.distributed._shard.sharded_tensor import ShardedTensor
    except ImportError:
        return None
    return ShardedTensor


def _mesh_key(mesh, cache: dict | None) -> tuple:
    """``(mesh shape, ranks in row-major order)`` of a DeviceMesh, computed once per mesh object
    per :func:`flatten` (a mesh of thousands of ranks is shared by thousands of tensors)."""
    if cache is not None:
        hit = cache.get(id(mesh))
        if hit is not None and hit[0] is mesh:
            return hit[1]
    grid = mesh.mesh
    key = (tuple(int(n) for n in grid.shape), tuple(int(r) for r in grid.flatten().tolist()))
    if cache is not None:
        cache[id(mesh)] = (mesh, key)  # the mesh itself is kept so its id cannot be reused meanwhile
    return key


def tensor_item(fqn: str, value: torch.Tensor, path: tuple, mesh_cache: dict | None = None) -> TensorItem:
    """Describe one tensor leaf by its global shape and the local pieces this rank holds.
    ``mesh_cache``: a dict kept across the leaves of one state dict (see :func:`_mesh_key`).

    Raises:
        UnsupportedValueError: a piece that is not a dense tensor of elements in memory (see
            :func:`_check_dense`), for a save and for a load's destination alike.
    """
    if isinstance(value, torch.nn.parameter.UninitializedTensorMixin):
        # a lazy module's parameter before its first forward: asking its shape is torch's RuntimeError
        raise UnsupportedValueError(
            f"tensor {fqn!r} is an uninitialized parameter or buffer of a lazy module (torch.nn.Lazy*): it has "
            f"no shape yet", key=fqn,
            remedy="Run one forward pass (or module.initialize_parameters(...)) before saving or loading it.")
    if isinstance(value, torch.Tensor) and _is_nested(value):
        _check_dense(fqn, value)  # before its shape is asked for: torch raises an internal error
    item = _tensor_item(fqn, value, path, mesh_cache)
    for piece in item.pieces:
        if isinstance(piece.tensor, torch.Tensor):
            _check_dense(fqn, piece.tensor)
    return item


def _is_nested(t: torch.Tensor) -> bool:
    ShardedTensor = _sharded_tensor_type()
    if ShardedTensor is not None and isinstance(t, ShardedTensor):
        return False  # its attribute goes through a deprecated __torch_function__ (a FutureWarning per call)
    try:
        return bool(t.is_nested)
    except Exception:  # noqa: BLE001 - a wrapper subclass that refuses the attribute is not nested
        return False


def _check_dense(fqn: str, t: torch.Tensor) -> None:
    """Refuse what has no row-major elements to write or to fill: a meta tensor with elements (a
    model built on the meta device and not materialized: a load into it would return with nothing
    filled; an empty one has nothing to miss), a sparse, mkldnn, nested or quantized tensor
    (torch's own untyped errors midway otherwise)."""
    if t.is_meta and t.numel() > 0:
        raise UnsupportedValueError(
            f"tensor {fqn!r} is on the meta device: it has no elements to save or to load into", key=fqn,
            remedy="Materialize the model first (module.to_empty(device=...), then initialize it or load).")
    kind = ("nested" if t.is_nested else "quantized" if t.is_quantized
            else None if t.layout == torch.strided else f"{t.layout}")
    if kind is not None:
        raise UnsupportedValueError(
            f"tensor {fqn!r} is a {kind} tensor; only dense (strided) tensors are saved and loaded", key=fqn,
            remedy={"nested": "Store its components (t.unbind()) as a list of tensors.",
                    "quantized": "Store t.int_repr() with its scale and zero point (t.q_scale(), "
                                 "t.q_zero_point()) as plain values."}.get(
                kind, "Store t.to_dense() (or its indices and values as tensors)."))


def _checked_pieces(fqn: str, dtype: torch.dtype, shape: tuple[int, ...], pieces: list[Piece]) -> list[Piece]:
    """``pieces`` as given, once each is a tensor of ``dtype`` whose shape is its box and whose box
    lies inside ``shape``. Pieces the caller assembles (LocalPieces, a ShardedTensor's or TorchRec's
    local shards) are trusted for nothing else: a piece of another dtype would be written as raw
    bytes under the declared one (an int32 piece read back as float32 garbage) or give a chunk
    whose byte count the MANIFEST's reader refuses, after the save has committed it.

    Raises:
        UnsupportedValueError: naming the leaf and the first piece that does not fit.
    """
    if not isinstance(dtype, torch.dtype):
        raise UnsupportedValueError(f"{fqn!r}: the declared dtype {dtype!r} is not a torch.dtype", key=fqn,
                                    remedy="Declare the dtype as torch.float32 (not a string).")
    for i, p in enumerate(pieces):
        t = p.tensor
        problem = None
        try:  # numpy integers and the like as Python ints (the MANIFEST stores plain ints)
            p.offsets, p.sizes = tuple(operator.index(o) for o in p.offsets), tuple(operator.index(n) for n in p.sizes)
            ints = True
        except TypeError:
            ints = False
        if not ints:
            problem = f"has a box whose offsets {p.offsets!r} or sizes {p.sizes!r} are not integers"
        elif not isinstance(t, torch.Tensor):
            problem = f"is a {type(t).__name__}, not a tensor"
        elif t.dtype != dtype:
            problem = f"is {t.dtype}, the tensor is declared {dtype}"
        elif len(p.offsets) != len(shape) or len(p.sizes) != len(shape):
            problem = f"has a box of {len(p.offsets)}/{len(p.sizes)} dimensions, the tensor {len(shape)}"
        elif tuple(t.shape) != tuple(p.sizes):
            problem = f"has shape {tuple(t.shape)}, its box sizes are {tuple(p.sizes)}"
        elif any(o < 0 or n < 0 or o + n > d for o, n, d in zip(p.offsets, p.sizes, shape)):
            problem = f"box at {tuple(p.offsets)} of sizes {tuple(p.sizes)} lies outside the shape {shape}"
        if problem is not None:
            raise UnsupportedValueError(f"{fqn!r}: local piece {i} {problem}", key=fqn,
                                        remedy="Give each local piece a tensor of the declared dtype whose "
                                        "shape is its box (offsets + sizes inside the global shape).")
    return pieces


def _tensor_item(fqn: str, value: torch.Tensor, path: tuple, mesh_cache: dict | None) -> TensorItem:
    if isinstance(value, LocalPieces):
        # Explicit disjoint pieces, exactly like a ShardedTensor's local shards.
        shape = tuple(int(d) for d in value.shape)
        return TensorItem(fqn, "sharded_tensor", value.dtype, shape,
                          _checked_pieces(fqn, value.dtype, shape, list(value.pieces)), path)
    DTensor = _dtensor_type()
    ShardedTensor = _sharded_tensor_type()
    if ShardedTensor is not None and isinstance(value, ShardedTensor):
        pieces = [
            Piece(tuple(int(o) for o in s.metadata.shard_offsets), tuple(int(n) for n in s.metadata.shard_sizes),
                  s.tensor, unguarded=True)
            for s in value.local_shards()
        ]
        # shape and dtype from the metadata: value.dtype / value.size() go through ShardedTensor's
        # deprecated __torch_function__ and warn on every call (a FutureWarning per tensor saved).
        md = value.metadata()
        shape = tuple(int(n) for n in md.size)
        return TensorItem(fqn, "sharded_tensor", md.tensor_properties.dtype, shape,
                          _checked_pieces(fqn, md.tensor_properties.dtype, shape, pieces), path)
    if DTensor is not None and isinstance(value, DTensor):
        local = value.to_local()
        shape = tuple(value.shape)
        # torch's LocalShardsWrapper and TorchRec's own class of the same shape (duck-typed, so
        # the core never imports torchrec).
        if hasattr(local, "local_shards") and hasattr(local, "local_offsets"):
            # TorchRec layouts: the placements can be wrong (table-wise says Replicate); the local
            # shard offsets are right, so they are the only thing trusted here.
            pieces = [Piece(tuple(int(o) for o in off), tuple(t.shape), t, unguarded=True)
                      for off, t in zip(local.local_offsets(), local.local_shards())]
            return TensorItem(fqn, "dtensor", value.dtype, shape, _checked_pieces(fqn, value.dtype, shape, pieces),
                              path)
        from torch.distributed.tensor import Partial
        if any(isinstance(p, Partial) for p in value.placements):
            raise UnsupportedValueError(
                f"DTensor {fqn!r} has a Partial placement (a pending reduction); its global value "
                f"is not held by any rank", key=fqn,
                remedy="Redistribute it to Shard or Replicate (dt.redistribute(...)) before saving.")
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
        if value.device_mesh.get_coordinate() is None:  # this rank is not in the mesh
            return TensorItem(fqn, "dtensor", value.dtype, shape, [], path)
        local_shape, offsets = compute_local_shape_and_global_offset(shape, value.device_mesh, value.placements)
        if tuple(local.shape) != tuple(local_shape):
            # from_local(..., shape=) trusts the caller: a local tensor that is not the box its
            # placements give would be written under the wrong offsets (or fail at commit).
            raise UnsupportedValueError(
                f"DTensor {fqn!r}: the local tensor has shape {tuple(local.shape)}, but its placements "
                f"{tuple(value.placements)} over a mesh of shape {tuple(value.device_mesh.shape)} give this "
                f"rank the box at offsets {tuple(offsets)} of shape {tuple(local_shape)} (global shape {shape})",
                key=fqn, remedy="Build the DTensor so that each rank's local tensor is torch.chunk's share "
                "of the global shape (DTensor.from_local without shape=, or distribute_tensor).")
        from torch.distributed.tensor import Shard
        grid = None
        dims = tuple(p.dim for p in value.placements if type(p) is Shard)  # not _StridedShard
        if len(dims) == len(value.placements) and len(set(dims)) == len(dims):
            grid = (_mesh_key(value.device_mesh, mesh_cache), dims,
                    tuple(int(c) for c in value.device_mesh.get_coordinate()))
        return TensorItem(fqn, "dtensor", value.dtype, shape,
                          [Piece(tuple(int(o) for o in offsets), tuple(int(n) for n in local_shape), local,
                                 owner=value)], path, grid)
    shape = tuple(value.shape)
    return TensorItem(fqn, "tensor", value.dtype, shape, [Piece((0,) * len(shape), shape, value)], path)


def object_entry(fqn: str, value: Any, *, allow_pickle: bool) -> tuple[str, Any]:
    """(kind, stored value) for a non-tensor leaf (see :mod:`distckpt.values`). Raises
    UnsupportedValueError for a value that needs pickle when ``allow_pickle`` is False."""
    return encode_value(fqn, value, allow_pickle=allow_pickle)


def _holds_dict(values: list, depth: int = 0) -> bool:
    """DCP's test for walking a list (``_traverse._is_terminal``): a dict in it, or in a list in it."""
    return depth < 100 and any(isinstance(v, dict) or (type(v) is list and _holds_dict(v, depth + 1)) for v in values)


def _fqn(path: tuple) -> str:
    return ".".join(str(p) for p in path)


def flatten(state_dict: Any, *, allow_pickle: bool = False, check_objects: bool = True,
            root: tuple = ()) -> tuple[dict, dict[str, TensorItem | ObjectItem]]:
    """Flatten ``state_dict`` into (tree, items). ``check_objects=False`` (for load, where the
    caller's non-tensor values are only replaced) skips the saveability check of plain values.

    What is a leaf (DCP's rule, so that keys match DCP's): dicts are always walked; a list is
    walked when it holds a dict (directly or through nested lists: ``param_groups``) or a tensor;
    any other list, and a tuple (namedtuple, torch.Size) or set holding no tensor, is *one* value,
    replaced whole on load (``"buffer": []`` loads the saved ``[1, 2, 3]``). Unlike DCP, which
    pickles a tuple whole, a tuple holding tensors is walked so its tensors are sharded like any
    other (a set holding tensors is refused: it has no order). A Stateful object (``state_dict()`` +
    ``load_state_dict()``, not a tensor or dict) is walked through its ``state_dict()``.

    Raises:
        UnsupportedValueError: a leaf that is neither a tensor nor a plain value (unless
            ``allow_pickle``), a dict key that is not str or int, two leaves with the same fqn, or
            a whole state dict that is a single tensor or plain value.
    """
    if root == () and (isinstance(state_dict, torch.Tensor) or isinstance(state_dict, _PLAIN)):
        # Its fqn would be "" and a later load would report the whole checkpoint as missing [''].
        kind = "a torch.Tensor" if isinstance(state_dict, torch.Tensor) else f"a {type(state_dict).__name__}"
        raise UnsupportedValueError(
            f"the state dict is {kind}, not a dict (or list/tuple) of values; entries are found by key",
            key="", remedy="Wrap it in a dict, the same way for save and load: "
                           "distckpt.save({'weight': t}, path), distckpt.load({'weight': t}, path).")
    items: dict[str, TensorItem | ObjectItem] = {}
    meshes: dict = {}

    def walk(obj: Any, path: tuple) -> dict:
        if len(path) > MAX_DEPTH:
            # The MANIFEST's tree holds at most MAX_DEPTH levels (and Python's recursion would
            # end first for a container that holds itself).
            raise UnsupportedValueError(
                f"the state dict is nested more than {MAX_DEPTH} levels deep under {_fqn(path[:3])!r}... "
                f"(a dict or list that contains itself?)", key=_fqn(path[:3]),
                remedy=f"Store at most {MAX_DEPTH} levels of dicts and lists, and no container inside itself.")
        odd = odd_keys(obj, path)
        if isinstance(obj, dict) and not odd:
            for key in obj:
                _check_utf8_key(key, path)
            entries = [[key, walk(value, path + (key,))] for key, value in obj.items()]
            return {"t": "dict", "k": entries}
        if _is_stateful(obj):
            return walk(obj.state_dict(), path)
        if isinstance(obj, (list, tuple)) and (holds_tensor(obj) or (type(obj) is list and _holds_dict(obj))):
            children = [walk(v, path + (i,)) for i, v in enumerate(obj)]
            return {"t": "tuple" if isinstance(obj, tuple) else "list", "v": children}
        fqn = _fqn(path)
        if fqn in items:
            raise UnsupportedValueError(f"two state dict entries flatten to the same key {fqn!r}", key=fqn,
                                        remedy="Rename one of them: keys are joined with '.'.")
        if isinstance(obj, (torch.Tensor, LocalPieces)):
            items[fqn] = tensor_item(fqn, obj, path, meshes)
        elif isinstance(obj, (set, frozenset)) and holds_tensor(obj):
            raise UnsupportedValueError(f"the set at {fqn!r} holds tensors; a set has no order to save them in",
                                        key=fqn, remedy="Use a list or a dict instead of the set.")
        else:
            if check_objects:
                object_entry(fqn, obj, allow_pickle=allow_pickle)  # type check now, before any byte is written
            items[fqn] = ObjectItem(fqn, obj, path)
        return {"t": "ref", "fqn": fqn}

    try:
        tree = walk(state_dict, root)
    finally:
        # walk is a closure over itself: left alone, the cycle keeps ``items`` (every tensor of
        # the state dict) alive until the cyclic garbage collector runs (a deleted scratch mapping
        # of convert held its disk space until then), after an error as after a return.
        walk = None  # noqa: F841 - breaks the cycle (see above)
    return tree, items


def _check_utf8_key(key: Any, path: tuple) -> None:
    """A str key names an entry in the MANIFEST, stored as UTF-8: one holding a lone surrogate (a
    file name decoded with surrogateescape) failed the save later with an error naming no key.

    Raises:
        UnsupportedValueError: naming the key and where it is."""
    if type(key) is str and not key.isascii():
        try:
            key.encode("utf-8")
        except UnicodeEncodeError:
            raise UnsupportedValueError(
                f"dict key {key!r} under {_fqn(path) or '<root>'!r} holds a character UTF-8 cannot encode (a lone "
                f"surrogate, such as a file name decoded with surrogateescape); entries are named by their keys, "
                f"stored as UTF-8", key=_fqn(path),
                remedy="Use a key UTF-8 encodes (os.fsencode(name).decode('utf-8', 'backslashreplace')).") from None


def odd_keys(obj: Any, path: tuple) -> list:
    """The keys of the dict ``obj`` that are not exactly str or int (a bool, an IntEnum or another
    subclass, whose type an entry's key would not keep, and an int beyond the 64 bits an entry's
    key is stored in): such a dict of plain values is one value, stored with its keys exactly; []
    for a dict walked key by key (or not a dict). Save and load's destination alike
    (:func:`flatten`, :func:`expand_statefuls`).

    Raises:
        UnsupportedValueError: such keys in the root dict or in one holding tensors or Stateful
            objects: entries are named by their keys joined with '.', which a tuple, None, float
            or bool key cannot do."""
    if not isinstance(obj, dict):
        return []
    odd = [k for k in obj if type(k) not in (str, int) or (type(k) is int and not _I64_MIN <= k < _U64)]
    if odd and (not path or holds_tensor(obj)):
        what = "at the root" if not path else "holding tensors or Stateful objects"
        raise UnsupportedValueError(
            f"dict key {odd[0]!r} under {_fqn(path) or '<root>'!r} is a {type(odd[0]).__name__}"
            f"{' beyond 64 bits' if type(odd[0]) is int else ''}; a dict {what} "
            f"takes only str and 64-bit int keys (they name the checkpoint's entries)", key=_fqn(path),
            remedy=("Use str or int keys at the root (str(key))" if not path else
                    "Use str or int keys (str(key)), or keep the tensors and Stateful objects apart from that dict "
                    "(a dict of plain values with any keys is stored as one value)")
            + "; allow_pickle does not change this.")
    return odd


def set_leaf(state_dict: Any, path: tuple, value: Any) -> bool:
    """Replace the leaf at ``path`` in place. A tuple on the way (immutable) is rebuilt with the
    new element, with its own type (namedtuple, torch.Size), and put back into its parent.
    Returns False only when the root itself is a tuple that would have to change."""
    if not path:
        return False
    chain = [state_dict]
    for key in path[:-1]:
        chain.append(chain[-1][key])
    for depth in range(len(path) - 1, -1, -1):
        container, key = chain[depth], path[depth]
        if not isinstance(container, tuple):
            container[key] = value
            return True
        items = list(container)
        items[key] = value
        value = tuple.__new__(type(container), items) if _is_namedtuple(container) else type(container)(items)
    return False


def expand_statefuls(state_dict: Any) -> list[tuple[Any, Any, Any]]:
    """For load: replace every Stateful object reachable through dicts and lists by its
    ``state_dict()``, in place. Returns [(container, key, stateful)], for :func:`restore_statefuls`.

    Raises:
        UnsupportedValueError: a Stateful inside a tuple (it cannot be swapped in place).
    """
    found: list[tuple[Any, Any, Any]] = []

    def walk(obj: Any, where: str, path: tuple) -> None:
        if odd_keys(obj, path):  # one value, as flatten stores it (raises where that cannot be)
            return
        if isinstance(obj, (dict, list)):
            pairs = list(obj.items()) if isinstance(obj, dict) else list(enumerate(obj))
            for key, value in pairs:
                if _is_stateful(value):
                    sd = value.state_dict()
                    obj[key] = sd
                    found.append((obj, key, value))
                else:
                    walk(value, f"{where}.{key}", path + (key,))
        elif isinstance(obj, tuple):
            for i, value in enumerate(obj):
                if _is_stateful(value):
                    raise UnsupportedValueError(f"a Stateful object sits inside a tuple at {where}.{i}",
                                                key=f"{where}.{i}".lstrip("."),
                                                remedy="Put it in a dict or a list.")
                walk(value, f"{where}.{i}", path + (i,))

    try:
        walk(state_dict, "", ())
    finally:
        walk = None  # noqa: F841 - a closure over itself: the cycle would keep the state dict alive
    return found


def restore_statefuls(found: list[tuple[Any, Any, Any]], *, load: bool) -> None:
    """Put the Stateful objects back where :func:`expand_statefuls` found them; with ``load``,
    first hand each its (now filled) state dict through ``load_state_dict``."""
    for container, key, obj in found:
        sd = container[key]
        container[key] = obj
        if load:
            obj.load_state_dict(sd)
