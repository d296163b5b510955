"""The MANIFEST file: dataclasses, byte encoding (format version 3; versions 1 and 2 are read too), and validation.

Byte layout (all integers little-endian; docs/FORMAT.md is the normative description)::

    magic          8 bytes   b"DCKPTMF1"
    format_version u32       1 or 2 (the manifest's own version)
    flags          u32       0 (no flag is defined in versions 1 and 2)
    body_length    u64       number of body bytes that follow
    body           msgpack   one map with str keys (use_bin_type; no ext types; never pickle)
    checksum       u32       crc32c of every byte before it (header and body)

Version 3 moves the chunk table out of the MANIFEST: each data file ends with an *index* (magic
``DCKPTIX3``, then a msgpack array of that file's chunk records), and the MANIFEST names each
file's index by (offset, length, crc32c). The MANIFEST then grows with tensors and ranks, not
with their product: rank 0 never sees a chunk record, and a reader reads the indexes it needs.
In memory nothing changes: :func:`decode` reads the indexes (through the caller's ``read_index``)
and returns a Manifest whose tensors hold their chunks, validated as in version 2.

Invariants:
  * :func:`decode` returns only manifests that pass :func:`validate`; every way a MANIFEST can be
    damaged or hostile raises :class:`~distckpt.errors.ManifestCorruptError` naming the path and
    what was expected vs found. Nothing read from a MANIFEST is ever executed: msgpack runs no
    object hooks from the data, ext types are refused, and sizes are bounded before allocation.
  * A valid manifest can be read without escaping its directory: every data file name is a plain
    ``rankNNNNN.bin`` basename, and every chunk's bytes lie inside its file's recorded size.
    Every size and offset fits int64 (what torch and the kernel take), and so does each tensor's
    storage in bytes: a reader can allocate what a valid manifest describes without overflow.
  * The chunks of a tensor exactly tile its global shape (pairwise disjoint, union is the shape);
    chunks with a zero-size dimension hold no elements and no bytes and are allowed; a tensor with
    no elements may have no chunks at all.
  * :func:`encode` is deterministic: the same Manifest gives the same bytes (tensors and objects are
    written sorted by fqn; chunks, files, tree and meta keep their order), so golden files hold.
  * This module is the format only: it neither reads nor writes files. A local checkpoint's
    MANIFEST and indexes are read by :mod:`distckpt.storage.posix.manifests`, an object store's by
    :mod:`distckpt.storage.object.store`, both through the :class:`distckpt.storage.Store` seam.

No torch import: dtypes are names, with their item sizes in :data:`DTYPE_ITEMSIZE`.
"""

from __future__ import annotations

import bisect
import copy
import dataclasses
import math
import re
import struct
from typing import Any, Callable, Mapping

import msgpack

from .checksum import crc32c
from .errors import ChecksumMismatchError, DataFileTruncatedError, ManifestCorruptError, UnsupportedValueError
from . import where as wh
from .plan import Box, find_tiling_defect, is_dense_layout, is_row_tiling
from .values import MAX_DEPTH as _VALUE_MAX_DEPTH, check_node

__all__ = [
    "MAGIC",
    "FORMAT_VERSION",
    "SUPPORTED_VERSIONS",
    "MANIFEST_NAME",
    "MAX_MANIFEST_BYTES",
    "MAX_MANIFEST_FILE_BYTES",
    "MAX_CHECKSUM_BLOCK",
    "DTYPE_ITEMSIZE",
    "TENSOR_KINDS",
    "OBJECT_KINDS",
    "ChunkRecord",
    "TensorEntry",
    "Encoded",
    "ObjectEntry",
    "FileEntry",
    "Manifest",
    "INDEX_MAGIC",
    "block_crcs",
    "encode_index",
    "data_file_name",
    "encode",
    "encode_manifest",
    "encode_next",
    "decode",
    "decode_header",
    "parse_index",
    "check_index_bytes",
    "tree_paths",
    "with_chunks",
    "files_for",
    "validate",
    "to_plain",
    "commit_time_of_prefix",
]

MAGIC = b"DCKPTMF1"
FORMAT_VERSION = 4
SUPPORTED_VERSIONS = (1, 2, 3, 4)
#: First bytes of a version-3 data file's index.
INDEX_MAGIC = b"DCKPTIX3"
#: Upper bound on one data file's index, checked before it is read (like MAX_MANIFEST_BYTES).
MAX_INDEX_BYTES = 1 << 30
#: Upper bound on ``checksum_block``: the largest block a writer picks (DISTCKPT_CHECKSUM_BLOCK is
#: at most 1 GiB). Readers size their read buffers from the block, so a larger value is refused
#: before anything is allocated from it.
MAX_CHECKSUM_BLOCK = 1 << 30
MANIFEST_NAME = "MANIFEST"

_HEADER = struct.Struct("<8sIIQ")  # magic, format_version, flags, body_length
_TRAILER = struct.Struct("<I")  # crc32c
_OVERHEAD = _HEADER.size + _TRAILER.size  # 28 bytes around the body

#: Upper bound on a MANIFEST body. A million chunks take roughly 100 MB, so 1 GiB only rejects
#: garbage or hostile lengths, before anything of that size is allocated.
MAX_MANIFEST_BYTES = 1 << 30
#: The largest MANIFEST file: the body's bound plus its header and checksum. Readers refuse more.
MAX_MANIFEST_FILE_BYTES = MAX_MANIFEST_BYTES + _OVERHEAD
#: Bounds that keep validation and consumers' recursion safe on hostile input.
MAX_NDIM = 64
MAX_DEPTH = _VALUE_MAX_DEPTH  # value nodes and the tree nest alike

_SAVE_ID_RE = re.compile(r"[A-Za-z0-9_-]{1,128}")  # used with fullmatch; writers use uuid4().hex
_FILE_NAME_RE = re.compile(r"rank[0-9]{5}\.bin")  # ASCII digits only (\d would accept any Unicode digit)
_U64 = 1 << 64
# created_unix: a commit time, 1970-01-01 to 9999-12-31 UTC (what a date can be printed as; a
# forged 1e300 would otherwise pass as the newest checkpoint and break every listing's date).
MAX_CREATED_UNIX = 253402300800


def _is_commit_time(v: Any) -> bool:
    return type(v) in (int, float) and math.isfinite(v) and 0 <= v < MAX_CREATED_UNIX


_I64_MIN = -(1 << 63)
#: Sizes, offsets and byte counts a reader hands to torch and to the kernel are int64 / off_t:
#: every one must fit, or torch raises untyped errors (or tries to allocate absurd sizes).
_I64_LIMIT = 1 << 63

#: Bytes per element for every dtype the format can hold, by torch's name without "torch.".
#: Excluded on purpose: quantized dtypes (qint8, quint8, qint32, quint4x2, quint2x4), whose values
#: need a scale and zero point the raw bytes lack, and the sub-byte shells int1..int7 and
#: uint1..uint7, which have no storage of their own (libraries pack them into uint8 tensors).
DTYPE_ITEMSIZE: Mapping[str, int] = {
    "float64": 8,
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e4m3fnuz": 1,
    "float8_e5m2": 1,
    "float8_e5m2fnuz": 1,
    "float8_e8m0fnu": 1,
    "float4_e2m1fn_x2": 1,
    "complex128": 16,
    "complex64": 8,
    "complex32": 4,
    "int64": 8,
    "int32": 4,
    "int16": 2,
    "int8": 1,
    "uint64": 8,
    "uint32": 4,
    "uint16": 2,
    "uint8": 1,
    "bool": 1,
    "bits16": 2,
    "bits8": 1,
    "bits1x8": 1,
    "bits2x4": 1,
    "bits4x2": 1,
}

#: How a tensor was saved (informational: restore reshards from the chunks alone).
TENSOR_KINDS = frozenset({"tensor", "dtensor", "sharded_tensor"})
#: Object kinds and the Python type their value must have.
OBJECT_KINDS: Mapping[str, type] = {
    "int": int,
    "float": float,
    "bool": bool,
    "str": str,
    "bytes": bytes,
    "none": type(None),
    "pickle": bytes,
    # Format 2: a typed value node (distckpt.values), checked by values.check_node.
    "value": object,
}
#: Object kinds a format-1 manifest may hold.
_V1_OBJECT_KINDS = frozenset({"int", "float", "bool", "str", "bytes", "none", "pickle"})


def data_file_name(rank: int) -> str:
    """The data file name of ``rank``: ``rank00003.bin``."""
    return f"rank{rank:05d}.bin"


def block_crcs(data: Any, block: int) -> tuple[int, ...]:
    """crc32c of each ``block``-byte block of ``data`` (any buffer), the last one partial.

    This is the definition of :attr:`ChunkRecord.crcs`; empty data has no blocks.
    """
    mv = memoryview(data).cast("B")
    return tuple(crc32c(mv[i : i + block]) for i in range(0, len(mv), block))


def encode_index(records: Any) -> bytes:
    """The index bytes a version-3 data file ends with: :data:`INDEX_MAGIC`, then one msgpack
    array of ``[fqn, offsets, sizes, offset, nbytes, crcs]`` per ``(fqn, ChunkRecord)`` of
    ``records`` (crcs as one bin of little-endian u32). Deterministic. A data file's layout, and
    so where its index goes, is :mod:`distckpt.datafile`'s. Raises ValueError for a chunk with
    ``strides`` (:class:`ChunkRecord`)."""
    for _fqn, c in records:
        _refuse_strided(c)
    rows = [[fqn, list(c.offsets), list(c.sizes), c.offset, c.nbytes, struct.pack(f"<{len(c.crcs)}I", *c.crcs)]
            for fqn, c in records]
    return INDEX_MAGIC + msgpack.packb(rows, use_bin_type=True)


def _decode_index(data: bytes, fi: int, name: str, path: Any) -> list[tuple[str, "ChunkRecord"]]:
    """Index bytes of file ``fi`` -> (fqn, ChunkRecord); structure only, values are left to validate()."""
    where = f"index of {name}"
    if data[: len(INDEX_MAGIC)] != INDEX_MAGIC:
        raise _corrupt(f"{where}: does not start with {INDEX_MAGIC!r}", path)
    unpacker = msgpack.Unpacker(None, raw=False, strict_map_key=True, use_list=True,
                                max_buffer_size=max(len(data), 1), ext_hook=_refuse_ext, timestamp=0)
    try:
        unpacker.feed(memoryview(data)[len(INDEX_MAGIC):])
        rows = unpacker.unpack()
        if unpacker.tell() != len(data) - len(INDEX_MAGIC):
            raise ValueError("bytes after the index's single array")
    except Exception as e:  # msgpack raises several unrelated types on garbage; all mean the same
        raise _corrupt(f"{where}: not valid msgpack ({type(e).__name__}: {e})", path) from e
    out = []
    for j, row in enumerate(_expect_list(rows, where, path)):
        if not isinstance(row, list) or len(row) != 6:
            raise _corrupt(f"{where} entry {j}: expected [fqn, offsets, sizes, offset, nbytes, crcs]", path)
        fqn, offsets, sizes, offset, nbytes, crcs = row
        if not isinstance(fqn, str) or not isinstance(crcs, bytes) or len(crcs) % 4:
            raise _corrupt(f"{where} entry {j}: fqn must be a str and crcs a bin of u32s", path)
        out.append((fqn, ChunkRecord(offsets=tuple(_expect_list(offsets, f"{where} entry {j} offsets", path)),
                                     sizes=tuple(_expect_list(sizes, f"{where} entry {j} sizes", path)),
                                     file=fi, offset=offset, nbytes=nbytes,
                                     crcs=struct.unpack(f"<{len(crcs) // 4}I", crcs))))
    return out


def _canonical(value: Any, depth: int = 0) -> Any:
    # Msgpack has one array type: store tuples as lists up front so a manifest compares equal to
    # its own decoded bytes. Past MAX_DEPTH leave it alone; validate() reports the depth.
    if depth > MAX_DEPTH:
        return value
    if isinstance(value, (list, tuple)):
        return [_canonical(v, depth + 1) for v in value]
    if isinstance(value, dict):
        return {k: _canonical(v, depth + 1) for k, v in value.items()}
    return value


@dataclasses.dataclass(frozen=True, slots=True)
class ChunkRecord:
    """One saved box of a tensor, stored C-contiguous in a data file.

    Attributes:
        offsets: Global element offsets of the box.
        sizes: Extent of the box along each dimension.
        file: Index into :attr:`Manifest.files`.
        offset: Byte offset of the chunk in that file.
        nbytes: ``prod(sizes) * itemsize``.
        crcs: crc32c of each ``checksum_block`` bytes of the chunk, the last one partial.
        strides: None: the chunk is C-contiguous (every chunk distckpt writes). Set only for a
            chunk of another format's checkpoint stored in another dense layout (a DCP chunk of
            a channels_last or transposed tensor): its element strides, a permutation of a
            row-major layout (the chunk still fills exactly ``nbytes`` bytes). Never encoded:
            :func:`encode` and :func:`encode_index` refuse such a chunk, since a MANIFEST that
            dropped the strides would describe other values.
    """

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    file: int
    offset: int
    nbytes: int
    crcs: tuple[int, ...]
    strides: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        for name in ("offsets", "sizes", "crcs", "strides"):
            value = getattr(self, name)
            if isinstance(value, list):
                object.__setattr__(self, name, tuple(value))

    @property
    def box(self) -> Box:
        """The chunk's elements as a :class:`~distckpt.plan.Box` (global coordinates)."""
        return Box(self.offsets, self.sizes)


@dataclasses.dataclass(frozen=True, slots=True)
class TensorEntry:
    """A tensor's global description and where its chunks are.

    Attributes:
        dtype: torch dtype name without ``torch.`` (a key of :data:`DTYPE_ITEMSIZE`).
        shape: Global shape.
        chunks: The saved boxes; they exactly tile ``shape``. None only in a version-3 manifest
            that a writer builds for :func:`encode` (its chunks are in the data files' indexes);
            every manifest :func:`decode` returns has them.
        kind: How it was saved: one of :data:`TENSOR_KINDS` (informational).
        where: Version 4: which data files hold its chunks (:mod:`distckpt.where`), as tuples:
            ``("grid", mesh, dims)`` or ``("ranks", ((start, stop), ...))``; None before.
    """

    dtype: str
    shape: tuple[int, ...]
    chunks: tuple[ChunkRecord, ...] | None
    kind: str = "tensor"
    where: tuple | None = None

    def __post_init__(self) -> None:
        for name in ("shape", "chunks"):
            value = getattr(self, name)
            if isinstance(value, list):
                object.__setattr__(self, name, tuple(value))

    @property
    def itemsize(self) -> int:
        """Bytes per element. Raises KeyError for an unknown dtype (validate() rejects those)."""
        return DTYPE_ITEMSIZE[self.dtype]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclasses.dataclass(frozen=True, slots=True)
class ObjectEntry:
    """A non-tensor leaf stored inline in the manifest.

    Attributes:
        kind: One of :data:`OBJECT_KINDS` (``pickle`` values are the pickled bytes; loading them
            needs the caller's explicit opt-in).
        value: The plain value, of the type :data:`OBJECT_KINDS` gives for ``kind``.
    """

    kind: str
    value: Any


@dataclasses.dataclass(frozen=True, slots=True)
class FileEntry:
    """A data file of the checkpoint.

    Attributes:
        name: Basename inside the checkpoint directory, ``rankNNNNN.bin``.
        size: Its size in bytes (every chunk and its index lie inside it).
        rank: The rank that wrote it.
        index: Version 3: ``(offset, length, crc32c)`` of the file's index (its chunk records);
            None in versions 1 and 2, whose MANIFEST lists the chunks itself.
    """

    name: str
    size: int
    rank: int
    index: tuple[int, int, int] | None = None

    def __post_init__(self) -> None:
        if isinstance(self.index, list):
            object.__setattr__(self, "index", tuple(self.index))


@dataclasses.dataclass(frozen=True)
class Manifest:
    """Everything needed to load a checkpoint, and nothing that runs code.

    Attributes:
        format_version: Format version of the bytes (1, 2 or 3; 2 adds the ``value`` object kind,
            3 moves the chunk records into per-file indexes).
        save_id: Unique id of the save that wrote the checkpoint.
        world_size: Number of ranks that saved it.
        created_unix: Commit time, seconds since the epoch.
        checksum_algo: ``"crc32c"``.
        checksum_block: Bytes per checksummed block of a chunk.
        files: The data files; chunks refer to them by index.
        tensors: ``{flat fqn: TensorEntry}``.
        objects: ``{flat fqn: ObjectEntry}``; fqns are disjoint from ``tensors``'.
        tree: The original state dict's containers (see docs/FORMAT.md): nodes
            ``{"t": "dict", "k": [[key, node], ...]}`` (keys str or int), ``{"t": "list", "v": [...]}``,
            ``{"t": "tuple", "v": [...]}`` and leaves ``{"t": "ref", "fqn": str}``; every tensor
            and object is referenced exactly once.
        meta: Plain data: io backend, distckpt version, step, user metadata.
        meshes: Version 4: the meshes grid ``where`` entries refer to, each ``(shape, ranks)``
            (a mesh shape and the writer rank at each coordinate, row-major); empty before.
        files_read: None when every data file's chunks are attached; else the indexes of the
            files whose chunks are (:func:`with_chunks` of a subset, version 4): only boxes
            whose files are all among them may be planned (:func:`files_for`).
    """

    format_version: int
    save_id: str
    world_size: int
    created_unix: float
    checksum_algo: str
    checksum_block: int
    files: tuple[FileEntry, ...]
    tensors: dict[str, TensorEntry]
    objects: dict[str, ObjectEntry]
    tree: Any
    meta: dict[str, Any]
    meshes: tuple = ()
    files_read: frozenset | None = None

    def __post_init__(self) -> None:
        if isinstance(self.files, list):
            object.__setattr__(self, "files", tuple(self.files))
        object.__setattr__(self, "tree", _canonical(self.tree))
        object.__setattr__(self, "meta", _canonical(self.meta))


# --------------------------------------------------------------------------------------------
# Validation.


def oversized_shape(shape: tuple[int, ...] | list[int], dtype: str) -> str | None:
    """Why no tensor of ``shape`` and ``dtype`` can be made, or None when one can. torch
    computes a contiguous tensor's strides and storage size from the product of its non-zero
    dimensions (a zero dimension does not stop [2**40, 2**40, 0, 2**40] from overflowing): that
    product in bytes must fit int64, or no reader can even allocate it (torch's RuntimeError,
    or a converted file that torch.load cannot open). One rule for every format read."""
    extent = math.prod(max(s, 1) for s in shape) * DTYPE_ITEMSIZE[dtype]
    if extent < _I64_LIMIT:
        return None
    return (f"shape {list(shape)} of {dtype} is too large: the product of its non-zero dimensions is {extent} "
            f"bytes, more than a tensor can address (2**63 - 1)")


def _corrupt(message: str, path: Any) -> ManifestCorruptError:
    return ManifestCorruptError(f"MANIFEST {message}", path=path)


def _is_int(v: Any) -> bool:
    # bool is an int subclass; msgpack keeps them apart, so must we.
    return type(v) is int


def _all_u32(values: tuple) -> bool:
    """Every item an int (not a bool) in [0, 2**32): the block checksums of a chunk, checked in C
    loops (map, set, min, max) rather than one Python test per checksum, which was most of a
    MANIFEST's validation (a 6 MiB chunk has up to 384 of them)."""
    return not values or (set(map(type, values)) == {int} and min(values) >= 0 and max(values) < (1 << 32))


def _check_uint(v: Any, where: str, path: Any, *, lo: int = 0, hi: int = _U64) -> int:
    if not _is_int(v) or not lo <= v < hi:
        bound = "2**63" if hi == _I64_LIMIT else "2**64" if hi == _U64 else str(hi)
        raise _corrupt(f"{where}: expected an integer in [{lo}, {bound}), found {v!r}", path)
    return v


def _check_int_tuple(v: Any, where: str, path: Any) -> tuple[int, ...]:
    if not isinstance(v, tuple):
        raise _corrupt(f"{where}: expected a sequence of integers, found {type(v).__name__}", path)
    if len(v) > MAX_NDIM:
        raise _corrupt(f"{where}: {len(v)} dimensions, at most {MAX_NDIM} are supported", path)
    for x in v:
        _check_uint(x, where, path, hi=_I64_LIMIT)  # torch sizes and offsets are int64
    return v


def _check_plain(value: Any, where: str, path: Any) -> None:
    """Plain data only: None, bool, int (64-bit), float, str, bytes, lists, str-keyed dicts."""
    stack = [(value, 0)]
    while stack:
        v, depth = stack.pop()
        if depth > MAX_DEPTH:
            raise _corrupt(f"{where}: nested deeper than {MAX_DEPTH} levels", path)
        if v is None or isinstance(v, (bool, float, str, bytes)):
            continue
        if type(v) is int:
            if not _I64_MIN <= v < _U64:
                raise _corrupt(f"{where}: integer {v} does not fit in 64 bits", path)
        elif isinstance(v, list):
            stack.extend((x, depth + 1) for x in v)
        elif isinstance(v, dict):
            for k, x in v.items():
                if not isinstance(k, str):
                    raise _corrupt(f"{where}: dict key {k!r} is not a str", path)
                stack.append((x, depth + 1))
        else:
            raise _corrupt(f"{where}: {type(v).__name__} is not plain data", path)


def _validate_tensor(fqn: str, t: Any, m: Manifest, path: Any, file_spans: list[list],
                     header_checked: bool = False) -> None:
    """One tensor entry and its chunks. ``header_checked``: its own fields (dtype, kind, shape,
    where) are those of a header that passed these checks (with_chunks' partial read): only the
    chunks are checked."""
    where = f"tensor {fqn!r}"
    if header_checked:
        _validate_chunks(fqn, t, m, path, file_spans, t.shape)
        return
    if not isinstance(t, TensorEntry):
        raise _corrupt(f"{where}: expected a TensorEntry, found {type(t).__name__}", path)
    # isinstance first: a hostile list or map here is unhashable and must not raise TypeError.
    if not isinstance(t.dtype, str) or t.dtype not in DTYPE_ITEMSIZE:
        raise _corrupt(
            f"{where}: unknown dtype {t.dtype!r} (known: {', '.join(sorted(DTYPE_ITEMSIZE))})", path
        )
    if not isinstance(t.kind, str) or t.kind not in TENSOR_KINDS:
        raise _corrupt(f"{where}: kind {t.kind!r} is not one of {sorted(TENSOR_KINDS)}", path)
    shape = _check_int_tuple(t.shape, f"{where} shape", path)
    if t.chunks is None and m.format_version < 3:
        raise _corrupt(f"{where}: no chunks (only a version-3 manifest keeps them in the data files)", path)
    if t.chunks is not None and not isinstance(t.chunks, tuple):
        raise _corrupt(f"{where}: chunks must be a sequence, found {type(t.chunks).__name__}", path)
    itemsize = DTYPE_ITEMSIZE[t.dtype]
    too_large = oversized_shape(shape, t.dtype)
    if too_large is not None:
        raise _corrupt(f"{where}: {too_large}", path)
    if m.format_version >= 4:
        problem = wh.problem(t.where, m.meshes, shape, m.world_size)
        if problem is not None:
            raise _corrupt(f"{where}: {problem}", path)
        # Every holder has a file: a mesh's ranks are checked once (_validate_v4), a range
        # of ranks by counting the files' ranks inside it (O(log ranks) per range).
        if t.where[0] == "ranks":
            ranks = _file_ranks(m)
            for start, stop in t.where[1]:
                if bisect.bisect_left(ranks, stop) - bisect.bisect_left(ranks, start) != stop - start:
                    raise _corrupt(f"{where}: its chunks are said to be in the files of ranks [{start}, {stop}), "
                                   f"some of which the manifest does not list", path)
    elif t.where is not None:
        raise _corrupt(f"{where}: a where needs format version 4, the manifest is version {m.format_version}", path)
    _validate_chunks(fqn, t, m, path, file_spans, shape)


def _validate_chunks(fqn: str, t: TensorEntry, m: Manifest, path: Any, file_spans: list[list],
                     shape: tuple[int, ...]) -> None:
    """A tensor's chunks (its own fields already checked): inside its shape and their files,
    their sizes and checksums, against its ``where``, and tiling what they must tile."""
    where = f"tensor {fqn!r}"
    if t.chunks is None:  # a writer's version-3 manifest: the chunks are in the files' indexes
        return
    itemsize = DTYPE_ITEMSIZE[t.dtype]
    cells: dict[int, Box | None] = {}   # writer rank -> its cell of a grid tensor, computed once
    block = m.checksum_block
    nd = len(shape)
    boxes = []
    for j, c in enumerate(t.chunks):
        cw = f"{where} chunk {j}"
        if not isinstance(c, ChunkRecord):
            raise _corrupt(f"{cw}: expected a ChunkRecord, found {type(c).__name__}", path)
        offsets = _check_int_tuple(c.offsets, f"{cw} offsets", path)
        sizes = _check_int_tuple(c.sizes, f"{cw} sizes", path)
        if len(offsets) != nd or len(sizes) != nd:
            raise _corrupt(
                f"{cw}: offsets {list(offsets)} and sizes {list(sizes)} must both have {nd} entries (shape {list(shape)})",
                path,
            )
        for d in range(nd):
            if offsets[d] + sizes[d] > shape[d]:
                raise _corrupt(
                    f"{cw}: box {Box(offsets, sizes)} lies outside the shape {list(shape)} on dimension {d}", path
                )
        fi = c.file
        if not _is_int(fi) or not 0 <= fi < len(m.files):
            raise _corrupt(f"{cw}: file index {fi!r} is out of range (the manifest lists {len(m.files)} files)", path)
        off = _check_uint(c.offset, f"{cw} offset", path, hi=_I64_LIMIT)
        nbytes = _check_uint(c.nbytes, f"{cw} nbytes", path, hi=_I64_LIMIT)
        numel = math.prod(sizes)
        if nbytes != numel * itemsize:
            raise _corrupt(
                f"{cw}: nbytes is {nbytes}, expected {numel * itemsize} ({numel} elements x {itemsize} bytes of {t.dtype})",
                path,
            )
        f = m.files[fi]
        if off + nbytes > f.size:
            raise _corrupt(
                f"{cw}: bytes [{off}, {off + nbytes}) lie beyond the end of {f.name} (size {f.size})", path
            )
        if c.strides is not None and not (isinstance(c.strides, tuple) and is_dense_layout(sizes, c.strides)):
            raise _corrupt(f"{cw}: strides {c.strides!r} do not lay sizes {list(sizes)} out densely", path)
        if not isinstance(c.crcs, tuple):
            raise _corrupt(f"{cw}: crcs must be a sequence, found {type(c.crcs).__name__}", path)
        want_crcs = -(-nbytes // block)
        if len(c.crcs) != want_crcs:
            raise _corrupt(
                f"{cw}: {len(c.crcs)} checksums, expected {want_crcs} (ceil({nbytes} / checksum_block {block}))", path
            )
        if not _all_u32(c.crcs):
            for crc in c.crcs:  # the first offender, for the message
                if not _is_int(crc) or not 0 <= crc < (1 << 32):
                    raise _corrupt(f"{cw}: checksum {crc!r} is not a 32-bit unsigned integer", path)
        if nbytes:
            file_spans[fi].append((off, off + nbytes, fqn, j))
        if t.where is not None:
            problem = wh.chunk_problem(t.where, m.meshes, shape, f.rank, Box(offsets, sizes), _positions(m), cells)
            if problem is not None:
                raise _corrupt(f"{cw} (in {f.name}): {problem}", path)
        boxes.append((offsets, sizes))
    if m.files_read is None:
        _check_tiling(where, boxes, Box.full(shape), lambda: f"the shape {list(shape)}", path)
        return
    # Only some files' chunks are attached (version 4): each read file's chunks of a grid tensor
    # must tile its rank's cell exactly; a tensor listed by ranks is checked whole once every one
    # of its holders' files is among them (a load reads them all before planning it).
    if t.where[0] == "grid":
        by_file: dict[int, list] = {fi: [] for fi in m.files_read}
        for c, box in zip(t.chunks, boxes):
            by_file[c.file].append(box)
        for fi, got in by_file.items():
            rank = m.files[fi].rank
            cell = cells[rank] if rank in cells else wh.rank_cell(t.where, m.meshes, shape, rank, _positions(m))
            if cell is not None and cell.volume:
                _check_tiling(f"{where} in {m.files[fi].name}", got, cell, lambda c=cell: f"its cell {c}", path)
    elif all(_rank_files(m)[r] in m.files_read for r in wh.holders(t.where, m.meshes)):
        _check_tiling(where, boxes, Box.full(shape), lambda: f"the shape {list(shape)}", path)


def _check_tiling(where: str, boxes: list, full: Box, what: str | Callable[[], str], path: Any) -> None:
    """``boxes`` ((offsets, sizes) pairs) tile ``full`` (``what``, for the message, or a function
    making it only when it is needed) exactly, else ManifestCorruptError."""
    if full.offsets == (0,) * len(full.offsets) and is_row_tiling(boxes, full.sizes):
        return  # row slabs: proven exact without the general sweep
    if len(boxes) == 1 and tuple(boxes[0][0]) == full.offsets and tuple(boxes[0][1]) == full.sizes:
        return
    boxes = [Box(tuple(o), tuple(s)) for o, s in boxes]
    if not boxes and full.volume == 0:
        return
    defect = find_tiling_defect(boxes, full)
    if defect is not None:
        if defect.kind == "overlap":
            a, b = defect.indices
            raise _corrupt(
                f"{where}: chunks {a} {boxes[a]} and {b} {boxes[b]} overlap (both hold {defect.region})", path
            )
        raise _corrupt(
            f"{where}: chunks do not cover {what() if callable(what) else what}: no chunk holds region "
            f"{defect.region}", path
        )


def _derived(m: Manifest, name: str, build: Callable[[Manifest], Any]) -> Any:
    """``build(m)``, computed once per manifest and kept on it: lookups the per-tensor checks make
    (rank -> file, mesh positions) would otherwise cost O(files) for every tensor. ``m.files``
    and ``m.meshes`` never change after construction (a copy carries the same values)."""
    got = m.__dict__.get(name)
    if got is None:
        got = build(m)
        object.__setattr__(m, name, got)
    return got


def _positions(m: Manifest) -> list[dict[int, int]]:
    """:func:`distckpt.where.positions` of ``m.meshes``."""
    return _derived(m, "_positions", lambda m: wh.positions(m.meshes))


def _file_ranks(m: Manifest) -> list[int]:
    """The files' writer ranks, sorted."""
    return _derived(m, "_file_ranks", lambda m: sorted(f.rank for f in m.files))


def _rank_files(m: Manifest) -> dict[int, int]:
    """Writer rank -> file index (version 4: one file per rank, checked by _validate_v4)."""
    return _derived(m, "_rank_files", lambda m: {f.rank: i for i, f in enumerate(m.files)})


def _validate_files(m: Manifest, path: Any) -> None:
    """The header fields and the file entries (names, sizes, ranks, index references)."""
    if m.format_version not in SUPPORTED_VERSIONS:
        raise _corrupt(
            f"format version {m.format_version!r} is not supported (supported: {list(SUPPORTED_VERSIONS)})", path
        )
    if not isinstance(m.save_id, str):
        raise _corrupt(f"save_id: expected a str, found {type(m.save_id).__name__}", path)
    if not _SAVE_ID_RE.fullmatch(m.save_id):
        # On an object store the save id is part of every data object's name (C/<save_id>/...):
        # "..", "/" or "" there would have a hostile MANIFEST choose what a load reads.
        raise _corrupt(f"save_id: {m.save_id[:80]!r} is not a plain id (1 to 128 ASCII letters, digits, '_' "
                       f"or '-'; a writer uses 32 hex digits)", path)
    _check_uint(m.world_size, "world_size", path, lo=1)
    if not _is_commit_time(m.created_unix):
        raise _corrupt(f"created_unix: expected seconds since 1970 before the year 10000 (0 <= t < "
                       f"{MAX_CREATED_UNIX}), found {m.created_unix!r}", path)
    if m.checksum_algo != "crc32c":
        raise _corrupt(f"checksum_algo: expected 'crc32c', found {m.checksum_algo!r}", path)
    if not _is_int(m.checksum_block) or not 1 <= m.checksum_block <= MAX_CHECKSUM_BLOCK:
        raise _corrupt(f"checksum_block: expected an integer in [1, 2**30] (the largest block a writer uses), "
                       f"found {m.checksum_block!r}", path)
    if not isinstance(m.files, tuple):
        raise _corrupt(f"files: expected a sequence, found {type(m.files).__name__}", path)
    names = set()
    for i, f in enumerate(m.files):
        if not isinstance(f, FileEntry):
            raise _corrupt(f"files[{i}]: expected a FileEntry, found {type(f).__name__}", path)
        # fullmatch on a fixed ASCII pattern rules out "/", "..", absolute paths and NUL at once.
        if not isinstance(f.name, str) or not _FILE_NAME_RE.fullmatch(f.name):
            raise _corrupt(
                f"files[{i}]: name {f.name!r} is not a plain data file name 'rankNNNNN.bin' "
                "(a path in a manifest must not leave the checkpoint directory)",
                path,
            )
        if f.name in names:
            raise _corrupt(f"files[{i}]: {f.name!r} is listed twice", path)
        names.add(f.name)
        _check_uint(f.size, f"files[{i}] ({f.name}) size", path, hi=_I64_LIMIT)  # an off_t
        if not _is_int(f.rank) or not 0 <= f.rank < m.world_size:
            raise _corrupt(f"files[{i}] ({f.name}): rank {f.rank!r} is not in [0, world_size={m.world_size})", path)
        _validate_index_ref(i, f, m.format_version, path)


def _validate_tensors(m: Manifest, path: Any, header_checked: bool = False) -> None:
    """Every tensor entry and its chunks, and no two byte ranges of a file overlapping
    (``header_checked``: see :func:`_validate_tensor`)."""
    # The index of a version-3 file takes bytes of it too: no chunk may overlap them.
    file_spans: list[list] = [[(f.index[0], f.index[0] + f.index[1], None, None)] if f.index else []
                              for f in m.files]
    for fqn, t in m.tensors.items():
        if not isinstance(fqn, str):
            raise _corrupt(f"tensors: key {fqn!r} is not a str", path)
        _validate_tensor(fqn, t, m, path, file_spans, header_checked)

    def what(k, j):
        return "its index" if k is None else f"tensor {k!r} chunk {j}"

    for fi, spans in enumerate(file_spans):
        spans.sort(key=lambda span: span[:2])
        for (s0, e0, k0, j0), (s1, e1, k1, j1) in zip(spans, spans[1:]):
            if s1 < e0:
                raise _corrupt(
                    f"{m.files[fi].name}: bytes of {what(k0, j0)} [{s0}, {e0}) and {what(k1, j1)} "
                    f"[{s1}, {e1}) overlap",
                    path,
                )


def _validate_v4(m: Manifest, path: Any) -> None:
    """Version 4's own fields: one file per writer rank, the meshes grid tensors refer to, and a
    partial read's ``files_read``; before version 4 none of them."""
    if m.format_version < 4:
        if m.meshes != () or m.files_read is not None:
            raise _corrupt(f"meshes and a partial read need format version 4, the manifest is version "
                           f"{m.format_version}", path)
        return
    if len({f.rank for f in m.files}) != len(m.files):
        raise _corrupt("files: two files of one rank (version 4 has one file per writer rank)", path)
    if not isinstance(m.meshes, tuple) or len(m.meshes) > wh.MAX_RANGES:
        raise _corrupt(f"meshes: expected at most {wh.MAX_RANGES} [shape, ranks] pairs", path)
    for i, mesh in enumerate(m.meshes):
        problem = wh.mesh_problem(mesh, m.world_size)
        if problem is not None:
            raise _corrupt(f"meshes[{i}]: {problem}", path)
        missing = [r for r in mesh[1] if r not in _rank_files(m)]
        if missing:
            raise _corrupt(f"meshes[{i}]: ranks {missing[:5]} have no data file in the manifest", path)
    if m.files_read is not None and not (isinstance(m.files_read, frozenset)
                                         and all(_is_int(i) and 0 <= i < len(m.files) for i in m.files_read)):
        raise _corrupt("files_read must be a set of file indexes", path)


def _validate_index_ref(i: int, f: FileEntry, version: int, path: Any) -> None:
    where = f"files[{i}] ({f.name})"
    if version < 3:
        if f.index is not None:
            raise _corrupt(f"{where}: an index reference needs format version 3, the manifest is version {version}", path)
        return
    if not isinstance(f.index, tuple) or len(f.index) != 3:
        raise _corrupt(f"{where}: index must be [offset, length, crc32c], found {f.index!r}", path)
    off = _check_uint(f.index[0], f"{where} index offset", path, hi=_I64_LIMIT)
    length = _check_uint(f.index[1], f"{where} index length", path, lo=len(INDEX_MAGIC), hi=MAX_INDEX_BYTES + 1)
    _check_uint(f.index[2], f"{where} index crc32c", path, hi=1 << 32)
    if off + length > f.size:
        raise _corrupt(f"{where}: index bytes [{off}, {off + length}) lie beyond the end of the file (size {f.size})",
                       path)


def _validate_tree(m: Manifest, path: Any) -> None:
    seen: set[str] = set()
    stack: list[tuple[Any, int, str]] = [(m.tree, 0, "tree")]
    while stack:
        node, depth, where = stack.pop()
        if depth > MAX_DEPTH:
            raise _corrupt(f"{where}: nested deeper than {MAX_DEPTH} levels", path)
        if not isinstance(node, dict) or not isinstance(node.get("t"), str):
            raise _corrupt(f"{where}: expected a node {{'t': ...}}, found {type(node).__name__}", path)
        t = node["t"]
        want = {"ref": {"t", "fqn"}, "dict": {"t", "k"}, "list": {"t", "v"}, "tuple": {"t", "v"}}.get(t)
        if want is None:
            raise _corrupt(f"{where}: unknown node type {t!r} (expected ref, dict, list or tuple)", path)
        if set(node) != want:
            raise _corrupt(f"{where}: a {t!r} node has keys {sorted(node)}, expected {sorted(want)}", path)
        if t == "ref":
            fqn = node["fqn"]
            if not isinstance(fqn, str) or (fqn not in m.tensors and fqn not in m.objects):
                raise _corrupt(f"{where}: refers to {fqn!r}, which is neither a tensor nor an object", path)
            if fqn in seen:
                raise _corrupt(f"{where}: {fqn!r} is referenced more than once", path)
            seen.add(fqn)
        elif t == "dict":
            items = node["k"]
            if not isinstance(items, list):
                raise _corrupt(f"{where}: 'k' must be a list of [key, node] pairs", path)
            keys = set()
            for i, pair in enumerate(items):
                if not isinstance(pair, list) or len(pair) != 2:
                    raise _corrupt(f"{where}.k[{i}]: expected a [key, node] pair", path)
                key = pair[0]
                if not (isinstance(key, str) or type(key) is int):
                    raise _corrupt(f"{where}.k[{i}]: dict key {key!r} must be a str or an int", path)
                # (type, value): the int 1 and the str "1" are different keys.
                if (type(key), key) in keys:
                    raise _corrupt(f"{where}.k[{i}]: duplicate dict key {key!r}", path)
                keys.add((type(key), key))
                stack.append((pair[1], depth + 1, f"{where}[{key!r}]"))
        else:
            items = node["v"]
            if not isinstance(items, list):
                raise _corrupt(f"{where}: 'v' must be a list of nodes", path)
            stack.extend((v, depth + 1, f"{where}[{i}]") for i, v in enumerate(items))
    missing = [k for k in (*m.tensors, *m.objects) if k not in seen]
    if missing:
        raise _corrupt(f"tree: {len(missing)} entries are not referenced, e.g. {missing[:5]}", path)


def validate(m: Manifest, *, path: Any = None) -> None:
    """Check every promise the format makes about a manifest (see the module docstring).

    Checks: header fields, file names (plain ``rankNNNNN.bin`` basenames, unique), chunk file
    indices, offsets and sizes inside their files, chunks not overlapping inside a file,
    ``nbytes == prod(sizes) * itemsize``, ``len(crcs) == ceil(nbytes / checksum_block)``, chunk
    boxes inside the shape and exactly tiling it, known dtypes and kinds, object values of their
    kind's type, plain ``meta``, a tree that references every tensor and object exactly once, and
    int64 bounds: dimensions, chunk offsets/sizes/nbytes, file sizes, and each tensor's storage
    (the product of its non-zero dimensions times the item size).

    Raises:
        ManifestCorruptError: the first violation found, with ``path`` and expected vs found.
    """
    _validate_files(m, path)
    _validate_v4(m, path)
    if not isinstance(m.tensors, dict) or not isinstance(m.objects, dict):
        raise _corrupt("tensors and objects must be dicts", path)
    _validate_tensors(m, path)
    _validate_values(m, path)
    _validate_tree(m, path)


def _validate_values(m: Manifest, path: Any) -> None:
    """The objects (kinds, values of their kind's type, no fqn of a tensor) and ``meta``."""
    for fqn, o in m.objects.items():
        where = f"object {fqn!r}"
        if not isinstance(fqn, str):
            raise _corrupt(f"objects: key {fqn!r} is not a str", path)
        if fqn in m.tensors:
            raise _corrupt(f"{where}: the fqn is also a tensor's", path)
        if not isinstance(o, ObjectEntry):
            raise _corrupt(f"{where}: expected an ObjectEntry, found {type(o).__name__}", path)
        if not isinstance(o.kind, str) or o.kind not in OBJECT_KINDS:
            raise _corrupt(f"{where}: kind {o.kind!r} is not one of {sorted(OBJECT_KINDS)}", path)
        if o.kind not in _V1_OBJECT_KINDS and m.format_version < 2:
            raise _corrupt(f"{where}: kind {o.kind!r} needs format version 2, the manifest is version {m.format_version}",
                           path)
        if o.kind == "value":
            problem = check_node(o.value, where)
            if problem is not None:
                raise _corrupt(problem, path)
        elif type(o.value) is not OBJECT_KINDS[o.kind]:
            raise _corrupt(
                f"{where}: a {o.kind!r} object needs a {OBJECT_KINDS[o.kind].__name__} value, found {type(o.value).__name__}",
                path,
            )
        _check_plain(o.value, where, path)
    if not isinstance(m.meta, dict):
        raise _corrupt(f"meta: expected a dict, found {type(m.meta).__name__}", path)
    _check_plain(m.meta, "meta", path)


# --------------------------------------------------------------------------------------------
# Encoding.

_BODY_KEYS = ("save_id", "world_size", "created_unix", "checksum_algo", "checksum_block", "files", "tensors", "objects", "tree", "meta")
_FILE_KEYS = ("name", "size", "rank")
_FILE_KEYS_V3 = ("name", "size", "rank", "index")
_TENSOR_KEYS = ("dtype", "shape", "kind", "chunks")
_TENSOR_KEYS_V3 = ("dtype", "shape", "kind")
_BODY_KEYS_V4 = _BODY_KEYS + ("meshes",)
_TENSOR_KEYS_V4 = _TENSOR_KEYS_V3 + ("where",)
_CHUNK_KEYS = ("offsets", "sizes", "file", "offset", "nbytes", "crcs")
_OBJECT_KEYS = ("kind", "value")


def _refuse_strided(c: ChunkRecord) -> None:
    if c.strides is not None:
        raise ValueError("a chunk stored in a strided layout (read from another format's checkpoint) cannot be "
                         "written into a distckpt MANIFEST, whose chunks are C-contiguous")


def _chunk_maps(t: TensorEntry, *, plain: bool = False) -> list[dict[str, Any]]:
    """The chunks of ``t`` as maps; a strided chunk shows its ``strides`` in the ``plain`` view
    and is refused (ValueError) otherwise."""
    out = []
    for c in t.chunks:
        if not plain:
            _refuse_strided(c)
        out.append({"offsets": list(c.offsets), "sizes": list(c.sizes), "file": c.file, "offset": c.offset,
                    "nbytes": c.nbytes, "crcs": list(c.crcs),
                    **({"strides": list(c.strides)} if c.strides is not None else {})})
    return out


def _to_body(m: Manifest, *, plain: bool = False, layout: bool = True) -> dict[str, Any]:
    """The body map of ``m``. Version 3 lists no chunks (they are in the files' indexes) unless
    ``plain`` (the logical view of :func:`to_plain`, which shows them where it has them).
    ``layout=False``: the :data:`_LAYOUT_SECTIONS` (tensors, tree, meshes) are None, for a caller
    that has them packed already (:func:`encode_next`); the keys and their order are the same."""
    v3 = m.format_version >= 3
    v4 = m.format_version >= 4
    body = {
        "save_id": m.save_id,
        "world_size": m.world_size,
        # Always a float64 on disk, so an int timestamp and its float encode to the same bytes.
        "created_unix": float(m.created_unix),
        "checksum_algo": m.checksum_algo,
        "checksum_block": m.checksum_block,
        "files": [{"name": f.name, "size": f.size, "rank": f.rank, **({"index": list(f.index)} if v3 else {})}
                  for f in m.files],
        "tensors": None if not layout else {
            fqn: {
                "dtype": t.dtype,
                "shape": list(t.shape),
                "kind": t.kind,
                **({"where": _plain_tuple(t.where)} if v4 else {}),
                **({"chunks": _chunk_maps(t, plain=plain)} if not v3 or (plain and t.chunks is not None) else {}),
            }
            for fqn, t in sorted(m.tensors.items())
        },
        "objects": {fqn: {"kind": o.kind, "value": o.value} for fqn, o in sorted(m.objects.items())},
        "tree": m.tree if layout else None,  # canonical already: Manifest.__post_init__
        "meta": m.meta,
    }
    if v4:
        body["meshes"] = _plain_tuple(m.meshes) if layout else None
    return body


def _plain_tuple(v: Any) -> Any:
    """Nested tuples as lists (what msgpack writes; a where or the meshes)."""
    return [_plain_tuple(x) for x in v] if isinstance(v, (tuple, list)) else v


def _tuples(v: Any, depth: int = 0) -> Any:
    """Nested lists as tuples (a decoded where or mesh), at most 3 levels; anything else as it is
    (validate() rejects what does not fit the schema)."""
    if isinstance(v, list) and depth < 3:
        return tuple(_tuples(x, depth + 1) for x in v)
    return v


#: Body sections that depend only on a save's layout (its plan): a later save whose plan reuses
#: the same layout objects writes them again byte for byte (:func:`encode_next`).
_LAYOUT_SECTIONS = ("tensors", "tree", "meshes")


@dataclasses.dataclass(frozen=True, eq=False)
class Encoded:
    """A validated manifest and its MANIFEST bytes (:func:`encode_manifest`), with the packed
    :data:`_LAYOUT_SECTIONS` of its body, which :func:`encode_next` reuses."""

    manifest: Manifest
    data: bytes
    sections: Mapping[str, bytes]


def _pack(body: dict[str, Any], sections: Mapping[str, bytes]) -> bytes:
    """``msgpack.packb(body)``, with each value of ``sections`` packed already: the same bytes,
    since a map is its header and then each key's and value's bytes in order."""
    packer = msgpack.Packer(use_bin_type=True, strict_types=False, datetime=False)
    out = [packer.pack_map_header(len(body))]
    for key, value in body.items():
        out.append(packer.pack(key))
        out.append(sections[key] if key in sections else packer.pack(value))
    return b"".join(out)


def _frame(m: Manifest, body: bytes) -> bytes:
    """The MANIFEST bytes of ``m`` around its packed ``body``; refuses a body no reader accepts."""
    if len(body) > MAX_MANIFEST_BYTES:
        chunks = sum(len(t.chunks or ()) for t in m.tensors.values())
        raise UnsupportedValueError(
            f"the MANIFEST of this checkpoint would be {len(body)} bytes ({chunks} chunks in "
            f"{len(m.tensors)} tensors, {len(m.objects)} values), more than the {MAX_MANIFEST_BYTES} bytes "
            f"every reader accepts: it could be committed but never loaded", key=None,
            remedy="Save fewer, larger chunks (shard each tensor over fewer ranks, or group small tensors), "
                   "or split the state dict over several checkpoints.")
    head = _HEADER.pack(MAGIC, m.format_version, 0, len(body)) + body
    return head + _TRAILER.pack(crc32c(head))


def encode(m: Manifest) -> bytes:
    """The MANIFEST bytes of ``m`` (header, msgpack body, crc32c).

    Raises:
        ValueError: ``m`` fails :func:`validate` (a bug in the writer: an invalid manifest is
            never written). The ManifestCorruptError is chained as the cause.
        UnsupportedValueError: the body would exceed :data:`MAX_MANIFEST_BYTES`, which every
            reader refuses: such a MANIFEST would commit a checkpoint nobody can load.
    """
    return encode_manifest(m).data


def encode_manifest(m: Manifest) -> Encoded:
    """:func:`encode`, keeping what :func:`encode_next` reuses. Raises like :func:`encode`."""
    try:
        validate(m)
    except ManifestCorruptError as e:
        raise ValueError(f"refusing to encode an invalid manifest: {e.message}") from e
    body = _to_body(m)
    packer = msgpack.Packer(use_bin_type=True, strict_types=False, datetime=False)
    sections = {key: packer.pack(body[key]) for key in _LAYOUT_SECTIONS if key in body}
    return Encoded(m, _frame(m, _pack(body, sections)), sections)


def encode_next(prev: Encoded, *, save_id: str, created_unix: float, files: tuple[FileEntry, ...],
                objects: dict[str, ObjectEntry], meta: dict[str, Any]) -> Encoded:
    """The MANIFEST of ``prev.manifest`` with these per-save fields in place of its own: what a
    save whose plan reuses the previous save's layout commits (the plan cache of a training loop's
    saves). The same bytes as :func:`encode` of that manifest.

    The tensors, tree and meshes are ``prev``'s objects, validated and packed when ``prev`` was:
    only the fields given are validated and packed again, as :func:`validate` checks them (the
    header and files, the version-4 ranks and meshes against the files, the objects and meta),
    which cuts the commit of a 2,000-tensor save from about 18 ms to 1. Objects whose keys differ
    from ``prev``'s (so the tree's references change) take the whole :func:`encode_manifest`.

    Raises like :func:`encode`.
    """
    m = copy.copy(prev.manifest)
    fields = {f.name for f in dataclasses.fields(Manifest)}
    for name in [n for n in m.__dict__ if n not in fields]:  # derived from the old files (_derived)
        del m.__dict__[name]
    for name, value in (("save_id", save_id), ("created_unix", created_unix), ("files", tuple(files)),
                        ("objects", objects), ("meta", _canonical(meta))):
        object.__setattr__(m, name, value)
    if objects.keys() != prev.manifest.objects.keys():
        return encode_manifest(m)
    try:
        _validate_files(m, None)
        _validate_v4(m, None)
        if not isinstance(m.objects, dict):
            raise _corrupt("tensors and objects must be dicts", None)
        _validate_values(m, None)
    except ManifestCorruptError as e:
        raise ValueError(f"refusing to encode an invalid manifest: {e.message}") from e
    return Encoded(m, _frame(m, _pack(_to_body(m, layout=False), prev.sections)), prev.sections)


def to_plain(m: Manifest) -> dict[str, Any]:
    """The manifest as plain data (dicts, lists, str, int, float, bool, bytes, None): the decoded
    body plus ``format_version``; a version-3 manifest shows its chunks too (read from the
    indexes) and each file's ``index``. Backs ``distckpt.read_manifest(path)`` and the CLI."""
    return {"format_version": m.format_version, **_to_body(m, plain=True)}


# --------------------------------------------------------------------------------------------
# Decoding.


def _no_duplicate_keys(pairs: list[tuple[Any, Any]]) -> dict:
    # msgpack would keep the last of two equal keys silently; a manifest with two entries for
    # one fqn is damaged, not something to guess about.
    out = dict(pairs)
    if len(out) != len(pairs):
        seen = set()
        for k, _ in pairs:
            if k in seen:
                raise ValueError(f"duplicate map key {k!r}")
            seen.add(k)
    return out


def _refuse_ext(code: int, data: bytes) -> Any:
    raise ValueError(f"msgpack ext type {code} is not allowed in a MANIFEST")


def _expect_map(v: Any, keys: tuple[str, ...], where: str, path: Any) -> dict:
    if not isinstance(v, dict):
        raise _corrupt(f"{where}: expected a map, found {type(v).__name__}", path)
    if set(v) != set(keys):
        missing = sorted(set(keys) - set(v))
        extra = sorted(set(v) - set(keys), key=repr)
        raise _corrupt(f"{where}: missing keys {missing}, unexpected keys {extra}", path)
    return v


def _expect_list(v: Any, where: str, path: Any) -> list:
    if not isinstance(v, list):
        raise _corrupt(f"{where}: expected an array, found {type(v).__name__}", path)
    return v


def _from_body(body: Any, version: int, path: Any) -> Manifest:
    """Structure of the body -> dataclasses; value checks are left to validate(). A version-3
    body gives tensors without chunks (None) and files with their index references."""
    v3 = version >= 3
    v4 = version >= 4
    _expect_map(body, _BODY_KEYS_V4 if v4 else _BODY_KEYS, "body", path)
    files = []
    for i, f in enumerate(_expect_list(body["files"], "files", path)):
        _expect_map(f, _FILE_KEYS_V3 if v3 else _FILE_KEYS, f"files[{i}]", path)
        index = tuple(_expect_list(f["index"], f"files[{i}] index", path)) if v3 else None
        files.append(FileEntry(f["name"], f["size"], f["rank"], index))
    tensors_raw = body["tensors"]
    if not isinstance(tensors_raw, dict):
        raise _corrupt(f"tensors: expected a map, found {type(tensors_raw).__name__}", path)
    tensors = {}
    for fqn, t in tensors_raw.items():
        where = f"tensor {fqn!r}"
        _expect_map(t, _TENSOR_KEYS_V4 if v4 else _TENSOR_KEYS_V3 if v3 else _TENSOR_KEYS, where, path)
        shape = tuple(_expect_list(t["shape"], f"{where} shape", path))
        if v3:
            tensors[fqn] = TensorEntry(dtype=t["dtype"], shape=shape, chunks=None, kind=t["kind"],
                                       where=_tuples(t["where"]) if v4 else None)
            continue
        chunks = []
        for j, c in enumerate(_expect_list(t["chunks"], f"{where} chunks", path)):
            cw = f"{where} chunk {j}"
            _expect_map(c, _CHUNK_KEYS, cw, path)
            chunks.append(
                ChunkRecord(
                    offsets=tuple(_expect_list(c["offsets"], f"{cw} offsets", path)),
                    sizes=tuple(_expect_list(c["sizes"], f"{cw} sizes", path)),
                    file=c["file"],
                    offset=c["offset"],
                    nbytes=c["nbytes"],
                    crcs=tuple(_expect_list(c["crcs"], f"{cw} crcs", path)),
                )
            )
        tensors[fqn] = TensorEntry(dtype=t["dtype"], shape=shape, chunks=tuple(chunks), kind=t["kind"])
    objects_raw = body["objects"]
    if not isinstance(objects_raw, dict):
        raise _corrupt(f"objects: expected a map, found {type(objects_raw).__name__}", path)
    objects = {}
    for fqn, o in objects_raw.items():
        _expect_map(o, _OBJECT_KEYS, f"object {fqn!r}", path)
        objects[fqn] = ObjectEntry(o["kind"], o["value"])
    return Manifest(
        format_version=version,
        save_id=body["save_id"],
        world_size=body["world_size"],
        created_unix=body["created_unix"],
        checksum_algo=body["checksum_algo"],
        checksum_block=body["checksum_block"],
        files=tuple(files),
        tensors=tensors,
        objects=objects,
        tree=body["tree"],
        meta=body["meta"],
        meshes=_tuples(_expect_list(body["meshes"], "meshes", path)) if v4 else (),
    )


def decode(data: bytes | bytearray | memoryview, *, path: Any = None,
           read_index: Callable[[Manifest, int], bytes] | None = None) -> Manifest:
    """Parse and validate MANIFEST bytes (and, for version 3, the data files' indexes).

    Args:
        data: The whole file.
        path: Where the bytes came from, for error messages.
        read_index: Version 3 only, required there: ``read_index(header, i)`` returns the bytes
            ``header.files[i].index`` locates (offset, length) in data file ``i``, raising the
            storage's typed errors (missing, truncated or unreadable file). ``header`` is the
            manifest without chunks. Each index is checked against its crc32c before it is parsed.

    Returns:
        A Manifest that passes :func:`validate`, every tensor with its chunks.

    Raises:
        ManifestCorruptError: bad magic, unsupported version (the message says which was found
            and which are supported), nonzero flags, a body length over the limit, truncated or
            extra bytes, checksum mismatch, invalid msgpack, or any schema violation (of the
            MANIFEST or of an index: entries for unknown tensors included).
        ChecksumMismatchError: a data file's index differs from its crc32c in the MANIFEST.
        DataFileMissingError, DataFileTruncatedError, StorageError: from ``read_index``.
        TypeError: a version-3 MANIFEST and no ``read_index`` (a caller's bug).
    """
    m = _decode_bytes(data, path)
    if m.format_version < 3:
        validate(m, path=path)
        return m
    if read_index is None:
        raise TypeError("a version-3 MANIFEST keeps its chunks in the data files: decode() needs read_index")
    # The file entries are checked before any index is read (their offsets and lengths drive the
    # reads); everything else once, after the chunks are attached.
    _validate_files(m, path)
    return _attach_indexes(m, read_index, path)


def decode_header(data: bytes | bytearray | memoryview, *, path: Any = None) -> Manifest:
    """Parse and validate MANIFEST bytes without reading any data file: for the fields of the
    MANIFEST itself (save_id, files, created_unix, meta, the tree). A version-3 manifest comes
    back with ``chunks`` None on every tensor (they are in the data files' indexes): never load
    from it, use :func:`decode`. Versions 1 and 2 come back whole, as from :func:`decode`.

    Raises:
        ManifestCorruptError: as :func:`decode`, for the MANIFEST's own bytes.
    """
    m = _decode_bytes(data, path)
    validate(m, path=path)
    return m


def _decode_bytes(data: bytes | bytearray | memoryview, path: Any) -> Manifest:
    """MANIFEST bytes -> Manifest, every byte-level and structural check done; values unchecked."""
    data = bytes(data)
    n = len(data)
    if n < len(MAGIC) or data[: len(MAGIC)] != MAGIC:
        # The bytes found are not quoted: a file that is not a MANIFEST may hold anything (secrets
        # included), and an error message ends up in logs.
        raise _corrupt(f"bad magic: expected {MAGIC!r}, found a {n}-byte file that does not start with it "
                       "(not a distckpt MANIFEST)", path)
    if n < _OVERHEAD:
        raise _corrupt(f"truncated: {n} bytes, shorter than the {_OVERHEAD}-byte header and checksum", path)
    _, version, flags, body_length = _HEADER.unpack_from(data)
    if version not in SUPPORTED_VERSIONS:
        raise ManifestCorruptError(
            f"MANIFEST format version {version} is not supported by this reader (supported: "
            f"{', '.join(map(str, SUPPORTED_VERSIONS))})",
            path=path,
            remedy="Read it with the distckpt release that wrote it (or a newer one).",
            found_version=version,
        )
    if flags != 0:
        raise _corrupt(f"flags are 0x{flags:08x}, expected 0 (format version 1 defines no flags)", path)
    if body_length > MAX_MANIFEST_BYTES:
        raise _corrupt(f"body length {body_length} exceeds the limit of {MAX_MANIFEST_BYTES} bytes", path)
    total = _OVERHEAD + body_length
    if n < total:
        raise _corrupt(f"truncated: the header declares a {body_length}-byte body ({total} bytes in all), found {n} bytes", path)
    if n > total:
        raise _corrupt(f"{n - total} unexpected bytes after the checksum (expected {total} bytes in all, found {n})", path)
    (stored,) = _TRAILER.unpack_from(data, total - _TRAILER.size)
    computed = crc32c(memoryview(data)[: total - _TRAILER.size])
    if stored != computed:
        raise _corrupt(f"checksum mismatch: stored crc32c 0x{stored:08x}, computed 0x{computed:08x}", path)
    body_bytes = memoryview(data)[_HEADER.size : total - _TRAILER.size]
    unpacker = msgpack.Unpacker(
        None,
        raw=False,
        strict_map_key=True,  # map keys must be str (or bytes, which the schema then rejects)
        use_list=True,
        max_buffer_size=max(body_length, 1),  # also bounds every str/bin/array/map length
        object_pairs_hook=_no_duplicate_keys,
        ext_hook=_refuse_ext,
        timestamp=0,  # a timestamp ext decodes to msgpack.Timestamp, which validation rejects
    )
    try:
        unpacker.feed(body_bytes)
        body = unpacker.unpack()
        if unpacker.tell() != body_length:
            raise ValueError(f"{body_length - unpacker.tell()} bytes after the body's single map")
    except Exception as e:  # msgpack raises several unrelated types on garbage; all mean the same
        detail = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
        raise _corrupt(f"body is not valid msgpack ({detail})", path) from e
    return _from_body(body, version, path)


def _attach_indexes(m: Manifest, read_index: Callable[[Manifest, int], bytes], path: Any) -> Manifest:
    """``m`` (version 3, no chunks) with every tensor's chunks read from the files' indexes."""
    return with_chunks(m, {i: parse_index(m, i, read_index(m, i), path) for i in range(len(m.files))}, path)


def parse_index(header: Manifest, i: int, data: bytes | bytearray | memoryview, path: Any = None
                ) -> list[tuple[str, ChunkRecord]]:
    """The chunk records in data file ``i``'s index bytes ``data`` (version 3), checked against
    the index's length and crc32c in ``header`` and for structure; values are checked when they
    are attached (:func:`with_chunks`).

    Raises:
        DataFileTruncatedError: ``data`` is shorter than the index.
        ChecksumMismatchError: its crc32c differs from the MANIFEST's.
        ManifestCorruptError: it is not an index (magic, msgpack, entry shape).
    """
    data = bytes(data)
    check_index_bytes(header, i, data, _sibling(path, header.files[i].name))
    return _decode_index(data, i, header.files[i].name, path)


def check_index_bytes(header: Manifest, i: int, data: bytes | bytearray | memoryview, location: Any) -> None:
    """Check data file ``i``'s index bytes ``data`` against the length and crc32c ``header``
    gives; ``location`` is where the data file is (its path or URL), named by the errors. A store
    calls it where it reads an index, so an error names the copy that was read (a tiered load
    reads each index from one of two tiers); :func:`parse_index` calls it again.

    Raises:
        DataFileTruncatedError: ``data`` is not the index's length.
        ChecksumMismatchError: its crc32c differs from the MANIFEST's."""
    f = header.files[i]
    off, length, crc = f.index
    if len(data) != length:  # a reader's contract; a short read is a truncated file
        raise DataFileTruncatedError(f"index of {f.name}: read {len(data)} bytes, expected {length}",
                                     path=location, expected=length, found=len(data))
    found = crc32c(data)
    if found != crc:
        raise ChecksumMismatchError(
            f"index of {f.name} (bytes [{off}, {off + length})): crc32c 0x{found:08x}, the MANIFEST says "
            f"0x{crc:08x}", path=location, file=f.name, key=None, offset=off,
            expected=crc, found=found)


def with_chunks(header: Manifest, records: Mapping[int, list], path: Any = None, *, check: bool = True,
                partial: bool = False) -> Manifest:
    """``header`` (version 3 or 4) with the chunk records of ``records`` ({file index: (fqn,
    ChunkRecord) from :func:`parse_index`}) attached, each tensor's chunks sorted by their offsets
    (a version-2 writer's order). With ``check`` (the default) the result is validated: every
    file's records must be given, and they must tile every tensor. ``check=False`` is for
    ``distckpt verify``, which checks the bytes of the files whose index it could read and
    reports the others.

    ``partial`` (version 4, with ``check``; ``header`` as :func:`decode_header` returns it,
    already validated): ``records`` may cover some files only, typically those
    :func:`files_for` names for the boxes a rank wants. The result's ``files_read`` says which;
    its tensors and chunks are validated as far as those files tell: every record against its
    tensor's ``where``, each read file's chunks of a grid tensor tiling that file's cell exactly,
    and a tensor listed by ranks whole once all its holders' files are read. Every box whose
    :func:`files_for` are among them is then exactly covered by the attached chunks.

    Raises:
        ManifestCorruptError: a record names a tensor the MANIFEST does not list, or (``check``)
            any rule of :func:`validate`.
        ValueError: ``partial`` for a manifest before version 4 (a caller's bug).
    """
    chunks: dict[str, list] = {fqn: [] for fqn in header.tensors}
    for i in sorted(records):
        for fqn, rec in records[i]:
            if fqn not in chunks:
                raise _corrupt(f"index of {header.files[i].name}: a chunk of {fqn!r}, which is not a tensor of the "
                               "MANIFEST", path)
            chunks[fqn].append(rec)
    tensors = {fqn: TensorEntry(t.dtype, t.shape, tuple(sorted(chunks[fqn], key=_chunk_order)), t.kind, t.where)
               for fqn, t in header.tensors.items()}
    m = copy.copy(header)  # not dataclasses.replace: its __post_init__ would canonicalize the tree again
    object.__setattr__(m, "tensors", tensors)
    if partial:
        if header.format_version < 4:
            raise ValueError("with_chunks(partial=True) needs a version-4 manifest (its where entries)")
        object.__setattr__(m, "files_read", frozenset(records))
        if check:
            # The header's other parts (tree, objects, meta, files) and every tensor's own fields
            # were checked by decode_header: only the chunks now attached are.
            _validate_v4(m, path)
            _validate_tensors(m, path, header_checked=True)
        return m
    if check:
        missing = [header.files[i].name for i in range(len(header.files)) if i not in records]
        if missing:
            raise ValueError(f"with_chunks(check=True) needs every file's records; missing {missing}")
        validate(m, path=path)
    return m


def files_for(m: Manifest, fqn: str, box: Box) -> list[int]:
    """The indexes of the data files that may hold elements of ``box`` of tensor ``fqn``, sorted:
    from its ``where`` in version 4 (a grid: only the cells ``box`` intersects), every file
    before. ``m`` must have passed :func:`validate` (any decoded or header manifest has)."""
    if m.format_version < 4:
        return list(range(len(m.files)))
    t = m.tensors[fqn]
    rank_files = _rank_files(m)
    return sorted(rank_files[r] for r in wh.ranks_for(t.where, m.meshes, t.shape, box))


def _chunk_order(c: ChunkRecord) -> Any:
    # A hostile index may give offsets that are not ints: order them by their repr rather than
    # raise TypeError here; validate() names the field.
    return (0, c.offsets) if all(_is_int(o) for o in c.offsets) else (1, repr(c.offsets))


def _sibling(path: Any, name: str) -> Any:
    """The path of data file ``name`` next to the MANIFEST at ``path`` (for error messages)."""
    if isinstance(path, str) and path.endswith(MANIFEST_NAME):
        return path[: -len(MANIFEST_NAME)] + name
    return path


def tree_paths(tree: Any, dict_key: Any = None) -> dict[str, tuple]:
    """{fqn: its key path} for every leaf of a validated MANIFEST ``tree``, in the saved order: dict keys as they
    are (or ``dict_key(key)``: ``str`` gives DCP's planner_data, whose dict keys are always str and
    whose ints are list positions, so a checkpoint DCP did not write can be rebuilt with its
    nesting by DCP's load planners), list and tuple positions as ints. Empty for a manifest
    without a tree."""
    out: dict[str, tuple] = {}
    stack = [(tree, ())] if isinstance(tree, dict) else []
    while stack:
        node, path = stack.pop()
        if node["t"] == "ref":
            out[node["fqn"]] = path
        elif node["t"] == "dict":  # pushed last first: the leaves come out in the saved order
            stack.extend(reversed([(child, path + (key if dict_key is None else dict_key(key),))
                                   for key, child in node["k"]]))
        else:  # list, tuple
            stack.extend(reversed([(child, path + (i,)) for i, child in enumerate(node["v"])]))
    return out


def commit_time_of_prefix(data: bytes | bytearray | memoryview) -> float | None:
    """The commit time (``created_unix``) a MANIFEST claims, from its first bytes ``data`` only: no
    checksum check, no validation. For ordering candidates cheaply (the CheckpointManager's
    ``latest_step``); a caller must still decode the one it picks. Returns None when the bytes do
    not tell (too short, a bad header, the key not within them): then only a full decode can.
    Never raises."""
    if len(data) < _HEADER.size:
        return None
    magic, version, flags, body_length = _HEADER.unpack_from(data)
    if magic != MAGIC or version not in SUPPORTED_VERSIONS or flags != 0 or body_length > MAX_MANIFEST_BYTES:
        return None
    body = data[_HEADER.size : _HEADER.size + body_length]
    unpacker = msgpack.Unpacker(None, raw=False, strict_map_key=True, max_buffer_size=max(len(body), 1),
                                ext_hook=_refuse_ext, timestamp=0)
    unpacker.feed(body)
    try:
        for _ in range(unpacker.read_map_header()):
            key = unpacker.unpack()
            if key == "created_unix":
                value = unpacker.unpack()
                return float(value) if _is_commit_time(value) else None
            unpacker.skip()
    except Exception:  # noqa: BLE001 - out of data or garbage: the prefix does not tell
        return None
    return None
