"""Read torch.distributed.checkpoint (DCP) checkpoints directly, without running code from them.

A DCP checkpoint directory holds ``.metadata`` (a pickle of
``torch.distributed.checkpoint.metadata.Metadata``) and data files ``__<rank>_<n>.distcp``. For
every tensor the metadata lists its chunks (global offsets and sizes) and, per chunk, a byte range
of a data file; that range holds a ``torch.save`` archive of the chunk (a stored, uncompressed zip)
(``FileSystemWriter``'s default ``SerializationFormat.TORCH_SAVE``; its SAFETENSORS format is
refused). Non-tensor values are byte ranges holding ``torch.save`` archives of the value.

:func:`load_manifest` turns all of that into a :class:`distckpt.manifest.Manifest` whose chunks
point at the raw tensor bytes inside the ``.distcp`` files, so ``distckpt.load`` / ``read`` (whose
source, :func:`distckpt.source.open_source`, knows the directory by :func:`is_dcp_checkpoint`)
reshard and read only the byte ranges they need, exactly as for a distckpt checkpoint. Such a manifest has
``checksum_algo == "none"``: DCP stores no checksums, so flipped bits cannot be detected (the
structure is checked: every range lies inside its file, chunks tile their tensor, zip headers and
sizes agree with the metadata).

Safety (I7, "loading never runs code from the checkpoint"):
  * ``.metadata`` is read by :class:`_RecordUnpickler`, whose ``find_class`` is an exact lookup in
    :data:`_METADATA_GLOBALS` (the DCP metadata dataclasses, ``torch.Size``, the dtype constants,
    ``torch.serialization._get_layout``, ``pathlib.PosixPath``). Each allowed name resolves to a
    *record type made for this one unpickling* (or a marker instance for a constant): calling it or
    creating it with NEWOBJ only stores its arguments, BUILD only stores the state. No torch
    function, import or attribute lookup runs, the real torch classes are never touched (so a
    hostile pickle cannot patch them), and ``persistent_load`` is refused. Any other global
    raises :class:`~distckpt.errors.PickleNotAllowedError` before anything it names is called.
    The records are then checked field by field and converted into this module's own dataclasses.
  * The ``data.pkl`` of each tensor chunk's ``torch.save`` archive goes through the same
    unpickler with :data:`_TENSOR_GLOBALS` (``torch._utils._rebuild_tensor_v2/v3``, the storage
    classes, ``collections.OrderedDict``, dtypes); only the storage's place and the tensor's
    offset, size and stride are taken from it. The bytes are then read raw by distckpt's reader.
  * Non-tensor values are decoded with ``torch.load(weights_only=True)`` (torch's own restricted
    unpickler); anything it refuses is a PickleNotAllowedError naming the key.
"""

from __future__ import annotations

import dataclasses
import errno
import io
import math
import os
import pickle
import re
import reprlib
import stat
import struct
import zipfile
import zlib
from typing import Any

from . import manifest as mf
from .errors import CheckpointCorruptError, PickleNotAllowedError, UnsupportedValueError, from_os_error
from .plan import Box, find_tiling_defect, is_dense_layout, row_major_strides
from .values import MAX_DEPTH

__all__ = ["METADATA_NAME", "is_dcp_checkpoint", "read_metadata", "load_manifest", "resolve_chunks", "DcpMetadata",
           "DcpTensor", "DcpValue", "WRITER_META_KEY", "writer_meta", "decode_writer_value"]

#: Key under the MANIFEST's user metadata where distckpt's DCP StorageWriter
#: (distckpt.integrations.dcp) keeps DCP's own metadata; its presence also says that every
#: non-tensor value of the checkpoint is DCP's ``torch.save`` bytes (:func:`decode_writer_value`).
WRITER_META_KEY = "distckpt.dcp"


def writer_meta(manifest: "mf.Manifest") -> Any:
    """DCP's metadata that distckpt's DCP StorageWriter stored in ``manifest`` (None for a
    checkpoint it did not write)."""
    user = (manifest.meta or {}).get("user")
    return user.get(WRITER_META_KEY) if isinstance(user, dict) else None


def decode_writer_value(data: Any, *, fqn: str, path: str | None, allow_pickle: bool = False) -> Any:
    """A non-tensor value of a checkpoint written through distckpt's DCP StorageWriter: DCP hands
    the writer every value as ``torch.save`` bytes, which the writer stores as they are. Decoded
    as a DCP directory's values are (:func:`_torch_load_value`); ``allow_pickle=True`` lifts
    the restricted unpickler, for a checkpoint the caller trusts.

    Raises:
        PickleNotAllowedError: the value needs more than the restricted unpickler allows.
        CheckpointCorruptError: the bytes are not a ``torch.save`` archive.
    """
    if not isinstance(data, (bytes, bytearray)):
        raise CheckpointCorruptError(f"value {fqn!r} of a checkpoint written through DCP is a "
                                     f"{type(data).__name__}, not DCP's torch.save bytes", path=path, key=fqn)
    return _torch_load_value(data, fqn, path, allow_pickle=allow_pickle,
                             remedy="If you trust this checkpoint, pass allow_pickle=True, or allow the type with "
                                    "torch.serialization.add_safe_globals.")


def _unpickler_reason(exc: BaseException) -> str:
    """What torch's restricted unpickler refused, from its long message: its "WeightsUnpickler
    error" line (which global), else its first line; terminal escapes (bold) stripped, since the
    message goes to logs and files."""
    text = re.sub(r"\x1b\[[0-9;]*m", "", str(exc))
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("WeightsUnpickler error:"):
            return line.removeprefix("WeightsUnpickler error:").strip()
    return text.splitlines()[0].strip() if text else type(exc).__name__


def _torch_load_value(data: bytes | bytearray, fqn: str, path: str | None, *, allow_pickle: bool,
                      remedy: str) -> Any:
    """DCP's ``torch.save`` bytes of a non-tensor value, decoded as DCP's load does but with
    ``torch.load(weights_only=True)`` (torch's restricted unpickler) unless ``allow_pickle``.
    Raises PickleNotAllowedError (with ``remedy``) for what that unpickler refuses,
    CheckpointCorruptError for bytes that are not a torch.save archive."""
    import torch

    try:
        # The bytes must be one whole archive: torch.load of a range that runs into the next
        # value's archive reads one of the two.
        _whole_archive(io.BytesIO(data))
    except (_Bad, zipfile.BadZipFile, ValueError, EOFError, struct.error, OSError) as exc:
        raise CheckpointCorruptError(f"DCP value {fqn!r} is not a torch.save archive of its byte range: {exc}",
                                     path=path, key=fqn) from None
    try:
        return torch.load(io.BytesIO(data), map_location="cpu", weights_only=not allow_pickle)
    except pickle.UnpicklingError as exc:
        reason = _unpickler_reason(exc)
        raise PickleNotAllowedError(
            f"DCP value {fqn!r} needs more than torch.load(weights_only=True) allows: {reason}",
            path=path, keys=[fqn], remedy=remedy) from None
    except Exception as exc:
        raise CheckpointCorruptError(f"DCP value {fqn!r} is not a readable torch.save archive: "
                                     f"{type(exc).__name__}: {exc}", path=path, key=fqn) from None

METADATA_NAME = ".metadata"
#: Upper bound on .metadata and on a data.pkl inside a chunk archive, checked before reading.
MAX_METADATA_BYTES = 1 << 30
_MAX_PKL_BYTES = 1 << 20
# A data file name as DCP's FileSystemWriter makes it: a plain basename, never a path.
_FILE_RE = re.compile(r"[A-Za-z0-9_.\-]+")
_RANK_RE = re.compile(r"__([0-9]+)_[0-9]+\.distcp")


def is_dcp_checkpoint(path: str | os.PathLike) -> bool:
    """True when ``path`` is a directory holding DCP's ``.metadata`` and no distckpt MANIFEST."""
    path = os.fspath(path)
    return (os.path.isfile(os.path.join(path, METADATA_NAME))
            and not os.path.lexists(os.path.join(path, mf.MANIFEST_NAME)))


# ---------------------------------------------------------------------------------------------
# The restricted unpickler.


class _Record:
    """What an allowed global becomes. Calling the type records ``args``; BUILD records ``state``.

    ``__setstate__`` is defined here so that BUILD on a record *type* (rather than an instance)
    fails: the unbound function gets one argument too few. So a pickle cannot set attributes on
    the types it is given."""

    global_name = "?"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.args = args
        self.kwargs = kwargs
        self.state = None

    def __setstate__(self, state: Any) -> None:
        self.state = state


class _Const(_Record):
    """A constant (a dtype, a storage class): a marker instance, not callable."""


#: DCP .metadata: the names torch 2.x writes. Everything else is refused.
_METADATA_TYPES = {
    ("torch.distributed.checkpoint.metadata", n) for n in (
        "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
        "TensorProperties", "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING")
} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
}
_DTYPE_CONSTS = {("torch", name) for name in mf.DTYPE_ITEMSIZE}
_METADATA_GLOBALS = frozenset(_METADATA_TYPES | _DTYPE_CONSTS)

#: The legacy typed storage classes torch.save names, and their dtypes.
_STORAGE_DTYPES = {
    "DoubleStorage": "float64", "FloatStorage": "float32", "HalfStorage": "float16",
    "BFloat16Storage": "bfloat16", "LongStorage": "int64", "IntStorage": "int32",
    "ShortStorage": "int16", "CharStorage": "int8", "ByteStorage": "uint8", "BoolStorage": "bool",
    "ComplexDoubleStorage": "complex128", "ComplexFloatStorage": "complex64",
}
_TENSOR_TYPES = {("torch._utils", "_rebuild_tensor_v2"), ("torch._utils", "_rebuild_tensor_v3"),
                 ("collections", "OrderedDict")}
_TENSOR_CONSTS = {("torch", n) for n in _STORAGE_DTYPES} | {("torch.storage", "UntypedStorage")} | _DTYPE_CONSTS
_TENSOR_GLOBALS = frozenset(_TENSOR_TYPES | _TENSOR_CONSTS)


class _RecordUnpickler(pickle.Unpickler):
    """Unpickles into records only (see the module docstring). ``persistent`` makes persistent ids
    (torch.save's storage references) into records too; without it they are refused."""

    def __init__(self, data: bytes, allowed: frozenset, *, what: str, path: str, persistent: bool = False):
        super().__init__(io.BytesIO(data))
        self._allowed = allowed
        self._what = what
        self._path = path
        self._persistent = persistent
        self._made: dict[tuple[str, str], Any] = {}

    def find_class(self, module: str, name: str) -> Any:
        key = (module, name)
        if key not in self._allowed:
            raise PickleNotAllowedError(
                f"{self._what} references the Python global {module}.{name}, which distckpt does not "
                f"load (it would run code from the checkpoint); allowed are the DCP metadata types",
                path=self._path, global_name=f"{module}.{name}",
                remedy="If you trust this checkpoint, load it with torch.distributed.checkpoint.load "
                       "(or convert it with torch.distributed.checkpoint.format_utils.dcp_to_torch_save).")
        if key not in self._made:  # one fresh type (or marker) per name and per unpickling
            base = _Const if key in _DTYPE_CONSTS or key in _TENSOR_CONSTS else _Record
            made = type(name, (base,), {"global_name": f"{module}.{name}"})
            self._made[key] = made() if base is _Const else made
        return self._made[key]

    def persistent_load(self, pid: Any) -> Any:
        if not self._persistent:
            raise PickleNotAllowedError(f"{self._what} holds a persistent reference, which DCP metadata never has",
                                        path=self._path)
        rec = _Record(pid)
        rec.global_name = "persistent"
        return rec


def _unpickle(data: bytes, allowed: frozenset, *, what: str, path: str, persistent: bool = False) -> Any:
    try:
        return _RecordUnpickler(data, allowed, what=what, path=path, persistent=persistent).load()
    except PickleNotAllowedError:
        raise
    except Exception as exc:  # truncated / malformed pickle: data, not code
        raise CheckpointCorruptError(f"{what} is not a readable pickle: {type(exc).__name__}: {exc}",
                                     path=path) from None


# ---------------------------------------------------------------------------------------------
# Records -> checked plain data.


@dataclasses.dataclass(frozen=True)
class DcpStorage:
    """Where a chunk or value lives: ``length`` bytes at ``offset`` of data file ``file``."""

    file: str
    offset: int
    length: int


@dataclasses.dataclass(frozen=True)
class DcpTensor:
    dtype: str
    shape: tuple[int, ...]
    chunks: tuple[tuple[tuple[int, ...], tuple[int, ...], DcpStorage], ...]  # (offsets, sizes, storage)


@dataclasses.dataclass(frozen=True)
class DcpMetadata:
    """A DCP ``.metadata`` as checked plain data."""

    tensors: dict[str, DcpTensor]
    objects: dict[str, DcpStorage]
    paths: dict[str, tuple]   # fqn -> the key path of the original nesting (DCP's planner_data)
    version: str | None


class _Bad(Exception):
    pass


def _is(rec: Any, name: str) -> bool:
    return isinstance(rec, _Record) and rec.global_name == name


def _state(rec: Any, name: str) -> dict:
    if not _is(rec, name) or not isinstance(rec.state, dict):
        raise _Bad(f"expected a {name} object, found {getattr(rec, 'global_name', type(rec).__name__)}")
    return rec.state


def _ints(v: Any, what: str) -> tuple[int, ...]:
    if _is(v, "torch.Size"):
        if len(v.args) != 1:
            raise _Bad(f"{what}: torch.Size with {len(v.args)} arguments")
        v = v.args[0]
    if not isinstance(v, (list, tuple)) or len(v) > mf.MAX_NDIM or not all(type(x) is int and 0 <= x < 1 << 63 for x in v):
        raise _Bad(f"{what}: expected a sequence of non-negative integers, found {_show(v)}")
    return tuple(v)


def _show(v: Any) -> str:
    """``repr(v)`` for a message, bounded in depth and length: a value from a crafted
    ``.metadata`` may nest a hundred thousand levels deep (repr would raise RecursionError)."""
    return reprlib.repr(v)


def _dtype(rec: Any, what: str) -> str:
    if not isinstance(rec, _Const) or not rec.global_name.startswith("torch.") or \
            rec.global_name.removeprefix("torch.") not in mf.DTYPE_ITEMSIZE:
        raise _Bad(f"{what}: expected a torch dtype, found {_show(getattr(rec, 'global_name', rec))}")
    return rec.global_name.removeprefix("torch.")


def _storage_info(rec: Any) -> DcpStorage:
    st = _state(rec, "torch.distributed.checkpoint.filesystem._StorageInfo")
    name, off, length = st.get("relative_path"), st.get("offset"), st.get("length")
    if st.get("transform_descriptors"):
        raise _Unsupported(f"stored through the storage transforms {_show(st['transform_descriptors'])} "
                           f"(for example compression)")
    if not isinstance(name, str) or not _FILE_RE.fullmatch(name) or name in (".", ".."):
        raise _Bad(f"data file name {_show(name)} is not a plain file name inside the checkpoint")
    if type(off) is not int or type(length) is not int or off < 0 or length < 0:
        raise _Bad(f"storage range offset={_show(off)} length={_show(length)}")
    return DcpStorage(name, off, length)


class _Unsupported(Exception):
    pass


def _convert_metadata(root: Any) -> DcpMetadata:
    st = _state(root, "torch.distributed.checkpoint.metadata.Metadata")
    sdm = st.get("state_dict_metadata")
    storage = st.get("storage_data")
    if not isinstance(sdm, dict) or not isinstance(storage, dict):
        raise _Bad("state_dict_metadata and storage_data must be dicts")
    by_index: dict[tuple, DcpStorage] = {}
    for idx, info in storage.items():
        s = _state(idx, "torch.distributed.checkpoint.metadata.MetadataIndex")
        fqn, off = s.get("fqn"), s.get("offset")
        if not isinstance(fqn, str):
            raise _Bad(f"MetadataIndex fqn {_show(fqn)}")
        key = (fqn, None if off is None else _ints(off, f"{fqn} storage offset"))
        by_index[key] = _storage_info(info)
    tensors: dict[str, DcpTensor] = {}
    objects: dict[str, DcpStorage] = {}
    for fqn, entry in sdm.items():
        if not isinstance(fqn, str):
            raise _Bad(f"key {_show(fqn)} is not a str")
        if _is(entry, "torch.distributed.checkpoint.metadata.BytesStorageMetadata"):
            if (fqn, None) not in by_index:
                raise _Bad(f"value {fqn!r} has no storage entry")
            objects[fqn] = by_index[(fqn, None)]
            continue
        t = _state(entry, "torch.distributed.checkpoint.metadata.TensorStorageMetadata")
        props = t.get("properties")
        if not _is(props, "torch.distributed.checkpoint.metadata.TensorProperties"):
            raise _Bad(f"tensor {fqn!r}: properties missing")
        pstate = props.state
        dtype_rec = pstate[0] if isinstance(pstate, tuple) and pstate else (pstate or {}).get("dtype")
        dtype = _dtype(dtype_rec, f"tensor {fqn!r} dtype")
        layout = pstate[1] if isinstance(pstate, tuple) and len(pstate) > 1 else None
        if _is(layout, "torch.serialization._get_layout") and layout.args != ("torch.strided",):
            raise _Unsupported(f"tensor {fqn!r} has layout {_show(layout.args)}; only dense (strided) tensors are read")
        shape = _ints(t.get("size"), f"tensor {fqn!r} size")
        too_large = mf.oversized_shape(shape, dtype)
        if too_large is not None:
            raise _Bad(f"tensor {fqn!r}: {too_large}")
        chunks = []
        for c in t.get("chunks") or ():
            cs = _state(c, "torch.distributed.checkpoint.metadata.ChunkStorageMetadata")
            offsets, sizes = _ints(cs.get("offsets"), f"{fqn} chunk offsets"), _ints(cs.get("sizes"), f"{fqn} chunk sizes")
            if len(offsets) != len(shape) or len(sizes) != len(shape) or any(
                    o + s > n for o, s, n in zip(offsets, sizes, shape)):
                raise _Bad(f"tensor {fqn!r}: chunk {list(offsets)}+{list(sizes)} lies outside the shape {list(shape)}")
            if (fqn, offsets) not in by_index:
                raise _Bad(f"tensor {fqn!r}: chunk at {list(offsets)} has no storage entry")
            chunks.append((offsets, sizes, by_index[(fqn, offsets)]))
        defect = find_tiling_defect([Box(o, s) for o, s, _ in chunks], Box.full(shape))
        if defect is not None:
            raise _Bad(f"tensor {fqn!r}: its chunks do not tile the shape {list(shape)} ({defect.kind} at {defect.region})")
        tensors[fqn] = DcpTensor(dtype, shape, tuple(chunks))
    paths: dict[str, tuple] = {}
    planner = st.get("planner_data")
    if isinstance(planner, dict):
        for fqn, p in planner.items():
            if fqn in sdm and isinstance(p, tuple) and p and all(
                    isinstance(k, str) or type(k) is int for k in p):
                if len(p) > MAX_DEPTH:
                    # distckpt's trees nest at most MAX_DEPTH levels (values.MAX_DEPTH): deeper
                    # is no state dict a model makes, and rebuilding it would recurse that deep.
                    raise _Unsupported(f"the key path of {fqn!r} is {len(p)} levels deep, more than the "
                                       f"{MAX_DEPTH} distckpt nests")
                paths[fqn] = p
    version = st.get("version")
    return DcpMetadata(tensors, objects, paths, version if isinstance(version, str) else None)


def _read_file(path: str, limit: int, what: str) -> bytes:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError as exc:
        raise from_os_error(exc, path=path, operation="open") from exc
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise CheckpointCorruptError(f"{what} must be a regular file", path=path)
        if st.st_size > limit:
            raise CheckpointCorruptError(f"{what} has {st.st_size} bytes, more than the {limit} accepted",
                                         path=path, expected=limit, found=st.st_size)
        with os.fdopen(os.dup(fd), "rb") as f:
            return f.read(limit + 1)
    finally:
        os.close(fd)


def read_metadata(path: str | os.PathLike) -> DcpMetadata:
    """Read and check the ``.metadata`` of the DCP checkpoint directory ``path`` (see the module
    docstring for what the unpickler allows).

    Raises:
        PickleNotAllowedError: the pickle names a global outside the allowed set (nothing it
            names was called).
        CheckpointCorruptError: the pickle is malformed or describes an impossible layout.
        UnsupportedValueError: the checkpoint uses a DCP feature distckpt does not read
            (storage transforms such as compression, sparse layouts).
    """
    path = os.fspath(path)
    mpath = os.path.join(path, METADATA_NAME)
    data = _read_file(mpath, MAX_METADATA_BYTES, "DCP .metadata")
    root = _unpickle(data, _METADATA_GLOBALS, what="DCP .metadata", path=mpath)
    try:
        return _convert_metadata(root)
    except RecursionError:  # a crafted structure no check above foresaw: damage, said as such
        raise CheckpointCorruptError("DCP .metadata: nested too deeply to read", path=mpath) from None
    except _Bad as exc:
        raise CheckpointCorruptError(f"DCP .metadata: {exc}", path=mpath) from None
    except _Unsupported as exc:
        raise UnsupportedValueError(
            f"DCP checkpoint: {exc}", path=mpath,
            remedy="Load it with torch.distributed.checkpoint.load, or save it again without that option.") from None


# ---------------------------------------------------------------------------------------------
# Chunk archives: where a chunk's raw bytes are inside its torch.save zip.


class _Slice(io.RawIOBase):
    """[start, start + length) of an open fd as a seekable read-only file (pread: no shared
    offset), so zipfile parses one chunk's archive without reading the rest of the data file.
    The archive's first and last ``_EDGE`` bytes (its pickle and small records before the tensor's
    bytes, its central directory after) are read once, in two preads, and zipfile's many small
    reads there are served from them: the parse costs a fraction of a system call per read."""

    _EDGE = 4096

    def __init__(self, fd: int, start: int, length: int):
        self._fd, self._start, self._len, self._pos = fd, start, length, 0
        head = min(length, self._EDGE)
        self._head = os.pread(fd, head, start) if head else b""
        tail_at = max(head, length - self._EDGE)
        self._tail_at = tail_at
        self._tail = os.pread(fd, length - tail_at, start + tail_at) if length > tail_at else b""

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, pos: int, whence: int = 0) -> int:
        self._pos = max(0, {0: pos, 1: self._pos + pos, 2: self._len + pos}[whence])
        return self._pos

    def readinto(self, b) -> int:
        pos = self._pos
        n = max(0, min(len(b), self._len - pos))
        if pos + n <= len(self._head):
            data = self._head[pos:pos + n]
        elif pos >= self._tail_at and pos - self._tail_at + n <= len(self._tail):
            data = self._tail[pos - self._tail_at:pos - self._tail_at + n]
        else:
            data = os.pread(self._fd, n, self._start + pos) if n else b""
        b[:len(data)] = data
        self._pos += len(data)
        return len(data)


def _whole_archive(f: Any) -> zipfile.ZipFile:
    """The zip archive that is exactly the seekable file ``f`` (a range of a DCP data file).

    zipfile finds the last end-of-directory record and, when its archive starts past 0, takes
    what precedes it for prepended data: a range that runs into the next chunk's archive would be
    parsed as that archive, and its bytes loaded silently. torch.save writes its first record at
    0 and its end record, with no comment, last: anything else raises _Bad (zipfile's own errors
    pass through)."""
    zf = zipfile.ZipFile(f)
    f.seek(-22, 2)
    end = f.read(22)
    if end[:4] != b"PK\x05\x06" or end[-2:] != b"\x00\x00" \
            or min((i.header_offset for i in zf.infolist()), default=-1) != 0:
        raise _Bad("the archive does not span exactly the metadata's byte range")
    return zf


def _record_at(archive: _Slice, info: zipfile.ZipInfo) -> int:
    """Where the data of record ``info`` starts in ``archive``, from its local zip header (read
    through the archive's cached first 4 KiB, where torch.save puts its headers). The header must
    name the central directory's record (as zipfile.open checks) and its extra field must be
    whole records that fill exactly its length: the two lengths place the data, and the central
    directory does not repeat them. Raises _Bad."""
    archive.seek(info.header_offset)
    header = archive.read(30)
    if len(header) != 30 or header[:4] != b"PK\x03\x04":
        raise _Bad("bad local zip header")
    name_len, extra_len = struct.unpack("<HH", header[26:30])
    rest = archive.read(name_len + extra_len)
    if len(rest) != name_len + extra_len or rest[:name_len] != info.filename.encode("utf-8"):
        raise _Bad("the local zip header names another record than the directory")
    pos = 0
    while pos + 4 <= extra_len:
        pos += 4 + struct.unpack_from("<H", rest, name_len + pos + 2)[0]
    if pos != extra_len:
        raise _Bad("the local zip header's extra field does not fill its length")
    return info.header_offset + 30 + name_len + extra_len


def _record_bytes(archive: _Slice, info: zipfile.ZipInfo) -> bytes:
    """The bytes of stored (uncompressed: checked by the caller) record ``info``, their crc32
    checked as zipfile's read does, without its per-record file objects (a third of the parse of
    a chunk went there). Raises _Bad."""
    archive.seek(_record_at(archive, info))
    data = archive.read(info.file_size)
    if len(data) != info.file_size or zlib.crc32(data) != info.CRC:
        raise _Bad(f"record {info.filename} does not match its size and crc32")
    return data


def _chunk_data(fd: int, fpath: str, fqn: str, dtype: str, sizes: tuple[int, ...],
                st: DcpStorage) -> tuple[int, tuple[int, ...] | None]:
    """(the file offset of the chunk's raw bytes, their element strides: None when C-contiguous).
    FileSystemWriter ``torch.save``s each chunk as the tensor is laid out, so a chunk of a
    channels_last or transposed tensor keeps that layout; any dense layout (a permutation of
    row-major, :func:`distckpt.plan.is_dense_layout`) is read, through its strides.

    Raises:
        CheckpointCorruptError: the archive does not hold exactly that tensor.
        UnsupportedValueError: it holds it in a layout distckpt does not read (overlapping or
            with gaps), or big-endian, or as SAFETENSORS.
    """
    itemsize = mf.DTYPE_ITEMSIZE[dtype]
    nbytes = math.prod(sizes) * itemsize
    where = f"chunk of {fqn!r} at bytes [{st.offset}, {st.offset + st.length}) of {os.path.basename(fpath)}"
    try:
        if st.length <= nbytes:
            # No room for a torch.save archive: FileSystemWriter's SerializationFormat.SAFETENSORS,
            # whose recorded offsets do not point at the bytes (it appends a safetensors blob at
            # the end of the file). Reading them raw would return wrong values: refuse.
            raise _Unsupported("a chunk stored without a torch.save archive (SerializationFormat.SAFETENSORS)")
        archive = _Slice(fd, st.offset, st.length)
        zf = _whole_archive(archive)
        infos = {i.filename: i for i in zf.infolist()}
        pkls = [n for n in infos if n.endswith("/data.pkl") and n.count("/") == 1]
        if len(pkls) != 1:
            raise _Bad("no data.pkl")
        prefix = pkls[0][: -len("data.pkl")]
        order = infos.get(prefix + "byteorder")
        aligned = infos.get(prefix + ".storage_alignment")
        for rec_info, limit in ((infos[pkls[0]], _MAX_PKL_BYTES), (order, 16), (aligned, 16)):
            # torch.save stores every record uncompressed: anything else (a deflate stream, which
            # could inflate to gigabytes from a chunk of a few KiB, another method, encryption) is
            # not its archive, refused before zipfile decodes it; the declared size bounds the rest.
            if rec_info is None:
                continue
            if rec_info.compress_type != zipfile.ZIP_STORED or rec_info.flag_bits & 0x1:
                raise _Bad(f"record {rec_info.filename} is compressed or encrypted (torch.save stores them plain)")
            if rec_info.file_size > limit:
                raise _Bad(f"{rec_info.filename.rsplit('/', 1)[-1]} record of {rec_info.file_size} bytes")
        if order is not None and _record_bytes(archive, order) != b"little":
            raise _Unsupported("big-endian")
        # Where torch.save aligns each storage's bytes in the archive (64 before the record said).
        alignment = int(_record_bytes(archive, aligned)) if aligned is not None else 64
        if alignment < 1 or alignment > 1 << 20:
            raise _Bad(f"storage alignment {alignment}")
        rec = _unpickle(_record_bytes(archive, infos[pkls[0]]), _TENSOR_GLOBALS, what=f"data.pkl of the {where}",
                        path=fpath, persistent=True)
        if not (_is(rec, "torch._utils._rebuild_tensor_v2") or _is(rec, "torch._utils._rebuild_tensor_v3")) \
                or len(rec.args) < 4:
            raise _Bad("data.pkl is not a single tensor")
        storage, storage_offset, size, stride = rec.args[:4]
        # torch.save records a lazy conjugate or negative view (x.conj(), torch._neg_view) as its
        # unresolved storage plus a flag in this dict ({'conj': True}): the bytes are not the
        # values. Reading them raw would return them silently wrong: refuse any such flag.
        flags_at = 7 if _is(rec, "torch._utils._rebuild_tensor_v3") else 6
        flags = rec.args[flags_at] if len(rec.args) > flags_at else None
        if flags is not None:
            if not isinstance(flags, dict):
                raise _Bad("tensor metadata is not a dict")
            lazy = sorted(str(k) for k, v in flags.items() if v)
            if lazy:
                raise _Unsupported(f"a chunk stored as a lazy view with {lazy} set (torch.save keeps the view's "
                                   f"flag, not its values)")
        if not _is(storage, "persistent") or not isinstance(storage.args[0], tuple) or len(storage.args[0]) != 5:
            raise _Bad("storage reference")
        kind, stype, key, _location, numel = storage.args[0]
        sname = getattr(stype, "global_name", "")
        if sname == "torch.storage.UntypedStorage" and _is(rec, "torch._utils._rebuild_tensor_v3"):
            saved_dtype, storage_bytes = _dtype(rec.args[6] if len(rec.args) > 6 else None, "dtype"), numel
        elif sname.removeprefix("torch.") in _STORAGE_DTYPES:
            saved_dtype = _STORAGE_DTYPES[sname.removeprefix("torch.")]
            storage_bytes = numel * itemsize if type(numel) is int else -1
        else:
            raise _Bad(f"storage type {sname!r}")
        if kind != "storage" or not isinstance(key, str) or type(numel) is not int or type(storage_offset) is not int:
            raise _Bad("storage reference")
        if saved_dtype != dtype:
            raise _Bad(f"holds {saved_dtype}, the metadata says {dtype}")
        if _ints(size, "size") != tuple(sizes):
            raise _Bad(f"holds shape {list(size)}, the metadata says {list(sizes)}")
        strides: tuple[int, ...] | None = _ints(stride, "stride")
        if len(strides) != len(sizes):
            raise _Bad(f"stride {list(strides)} does not match shape {list(sizes)}")
        if all(a == b for a, b, n in zip(strides, row_major_strides(sizes), sizes) if n > 1):
            strides = None  # row-major (a dimension of size 1 may have any stride)
        else:
            if not is_dense_layout(sizes, strides):
                # Overlapping elements or gaps (torch.save of a view DCP did not clone): its bytes
                # are not the chunk's nbytes, and no such chunk has been seen from FileSystemWriter.
                raise _Unsupported(f"a chunk with strides {list(strides)} that are not a dense layout of "
                                   f"shape {list(sizes)}")
        info = infos.get(f"{prefix}data/{key}")
        if info is None or info.compress_type != zipfile.ZIP_STORED or info.file_size != storage_bytes:
            raise _Bad("storage record missing, compressed or of the wrong size")
        data_at = _record_at(archive, info)
        if data_at % alignment:
            # torch.save pads each storage record to the alignment with its extra field: a local
            # header whose lengths put the data elsewhere was altered (a flipped bit).
            raise _Bad(f"storage record's bytes at {data_at}, not aligned to {alignment} as torch.save writes them")
        start = data_at + storage_offset * itemsize
        if storage_offset < 0 or start + nbytes > st.length or storage_offset * itemsize + nbytes > storage_bytes:
            raise _Bad("tensor bytes lie outside the archive")
        return st.offset + start, strides
    except _Unsupported as exc:
        raise UnsupportedValueError(f"DCP {where}: {exc} is not read by distckpt", path=fpath, key=fqn,
                                    remedy="Load it with torch.distributed.checkpoint.load.") from None
    except (_Bad, zipfile.BadZipFile, KeyError, ValueError, EOFError, struct.error, zlib.error,
            NotImplementedError, RuntimeError) as exc:  # the last three: zipfile's, for what slips past _Bad
        raise CheckpointCorruptError(f"DCP {where} is not a torch.save archive of that chunk: {exc}",
                                     path=fpath, key=fqn) from None


# ---------------------------------------------------------------------------------------------
# Non-tensor values.


@dataclasses.dataclass(frozen=True)
class DcpValue:
    """A DCP non-tensor value, read and decoded on demand by :meth:`load`."""

    ckpt: str
    fqn: str
    storage: DcpStorage

    def load(self, allow_pickle: bool = False) -> Any:
        """The value, decoded with ``torch.load(weights_only=True)``; with ``allow_pickle`` (a
        checkpoint the caller trusts: unpickling runs code) with the full unpickler, as DCP does.

        Raises:
            PickleNotAllowedError: the value needs more than torch's weights-only unpickler allows.
            DataFileTruncatedError / CheckpointCorruptError: its bytes are missing or unreadable.
        """
        fpath = os.path.join(self.ckpt, self.storage.file)
        return _torch_load_value(_read_range(fpath, self.storage, self.fqn), self.fqn, fpath,
                                 allow_pickle=allow_pickle,
                                 remedy="If you trust this checkpoint, pass allow_pickle=True, or allow the type "
                                        "with torch.serialization.add_safe_globals.")

    def __str__(self) -> str:
        return f"<DCP value in {self.storage.file} at {self.storage.offset}+{self.storage.length}>"


# The slots' own descriptors: a chunk resolved late stores its place in them.
_OFFSET, _STRIDES = mf.ChunkRecord.offset, mf.ChunkRecord.strides


class _ArchiveChunk(mf.ChunkRecord):
    """A DCP tensor chunk whose raw bytes' place inside its ``torch.save`` archive (``offset``,
    ``strides``) is found on first use, by parsing that one archive (:func:`_chunk_data`): a load
    parses only the chunks its rank reads (at 0.1-0.2 ms each, parsing every chunk of a
    checkpoint on every rank cost more than a small load's reads, and grows with ranks times
    chunks). Reading ``offset`` or ``strides`` (or comparing, hashing, printing, pickling: they
    read them) resolves it, so no caller can see the archive's start in place of the bytes';
    :func:`resolve_chunks` resolves many with one open per data file. A copy is a plain
    ChunkRecord (``dataclasses.replace`` does not apply: copy it first). Resolving raises what
    :func:`_chunk_data` raises (CheckpointCorruptError, UnsupportedValueError) or the open's
    StorageError."""

    __slots__ = ("_where",)  # (data file path, fqn, dtype, DcpStorage) until resolved, then None

    def __init__(self, offsets: tuple[int, ...], sizes: tuple[int, ...], file: int, nbytes: int, fpath: str,
                 fqn: str, dtype: str, storage: DcpStorage) -> None:
        object.__setattr__(self, "_where", (fpath, fqn, dtype, storage))
        super().__init__(tuple(offsets), tuple(sizes), file, storage.offset, nbytes, (), None)

    def __post_init__(self) -> None:  # the base's reads ``strides``, which would resolve it here
        pass

    def _resolve(self, fd: int | None = None) -> None:
        where = self._where
        if where is None:
            return
        fpath, fqn, dtype, storage = where
        own = fd is None
        if own:
            fd = _open_data_file(fpath)
        try:
            start, strides = _chunk_data(fd, fpath, fqn, dtype, self.sizes, storage)
        finally:
            if own:
                os.close(fd)
        # Two threads may resolve at once: both store the same values; the place before the mark.
        _OFFSET.__set__(self, start)
        _STRIDES.__set__(self, strides)
        object.__setattr__(self, "_where", None)

    def _get_offset(self) -> int:
        self._resolve()
        return _OFFSET.__get__(self)

    def _get_strides(self) -> tuple[int, ...] | None:
        self._resolve()
        return _STRIDES.__get__(self)

    def _set_offset(self, value: int) -> None:  # the dataclass __init__ only
        _OFFSET.__set__(self, value)

    def _set_strides(self, value: Any) -> None:  # the dataclass __init__ only
        _STRIDES.__set__(self, value)

    offset = property(_get_offset, _set_offset)
    strides = property(_get_strides, _set_strides)

    def _plain(self) -> mf.ChunkRecord:
        return mf.ChunkRecord(self.offsets, self.sizes, self.file, self.offset, self.nbytes, self.crcs, self.strides)

    def __reduce__(self):  # resolved first: a copy (pickle, copy.copy) is a plain record
        return self._plain().__reduce__()

    # Equal to the plain record of the same values (its copy), either way round.
    def __eq__(self, other: object) -> bool:
        return self._plain() == (other._plain() if isinstance(other, _ArchiveChunk) else other)

    def __hash__(self) -> int:
        return hash(self._plain())


def resolve_chunks(chunks: "list[mf.ChunkRecord]") -> None:
    """Resolve every DCP chunk of ``chunks`` that is not yet (others are left alone), opening each
    data file once: a load calls it for the chunks its rank reads before any byte of the state
    dict moves, so a malformed archive fails the load with nothing filled.

    Raises what :class:`_ArchiveChunk` resolution raises."""
    by_file: dict[str, list[_ArchiveChunk]] = {}
    for c in chunks:
        if isinstance(c, _ArchiveChunk) and c._where is not None:
            by_file.setdefault(c._where[0], []).append(c)
    for fpath, group in by_file.items():
        fd = _open_data_file(fpath)
        try:
            for c in group:
                c._resolve(fd)
        finally:
            os.close(fd)


def _open_data_file(fpath: str) -> int:
    """An fd of the DCP data file ``fpath`` for reading (never through a symlink).

    Raises DataFileMissingError (absent), CheckpointCorruptError (a symlink, not a regular
    file), StorageError subclasses (the open's other errors)."""
    from .errors import DataFileMissingError

    name = os.path.basename(fpath)
    try:
        fd = os.open(fpath, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
    except FileNotFoundError:
        raise DataFileMissingError(f"DCP data file {name} named in .metadata is missing", path=fpath) from None
    except OSError as exc:
        if exc.errno == errno.ELOOP:  # O_NOFOLLOW met a symlink: refused, not a broken disk
            raise CheckpointCorruptError(
                f"DCP data file {name} is a symlink; distckpt reads only regular files inside the "
                f"checkpoint directory (a link could point anywhere)", path=fpath,
                remedy="Copy the checkpoint with its links dereferenced (`cp -rL`), then load the copy.") from None
        raise from_os_error(exc, path=fpath, operation="open") from exc
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise CheckpointCorruptError(f"DCP data file {name} is not a regular file", path=fpath)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _read_range(fpath: str, st: DcpStorage, fqn: str) -> bytes:
    try:
        fd = os.open(fpath, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError as exc:
        raise from_os_error(exc, path=fpath, operation="open") from exc
    try:
        data = os.pread(fd, st.length, st.offset)
    finally:
        os.close(fd)
    if len(data) != st.length:
        raise CheckpointCorruptError(f"DCP value {fqn!r}: {len(data)} of {st.length} bytes at {st.offset}",
                                     path=fpath, key=fqn)
    return data


# ---------------------------------------------------------------------------------------------
# The manifest.


def _tree(meta: DcpMetadata) -> dict:
    """The original nesting (DCP's planner_data paths; int keys make lists, as DCP's unflatten
    does) as a manifest tree; keys without a usable path sit flat at the root."""
    root: dict = {}
    flat: list[str] = []
    # in the saved order (planner_data's, which is the state dict's), as DCP's own unflatten nests it
    for fqn in [*meta.paths, *(f for f in [*meta.tensors, *meta.objects] if f not in meta.paths)]:
        p = meta.paths.get(fqn)
        if p is None:
            flat.append(fqn)
            continue
        if ".".join(map(str, p)) != fqn:
            # DCP's flatten names each value by its path joined with dots; a path that does not
            # join back to its own key would put the value where another key's belongs (and
            # push that one out to the root): a state rearranged without a word.
            raise CheckpointCorruptError(f"DCP .metadata: the path {list(p)[:8]!r} of key {fqn!r} does not name it "
                                         f"(DCP names a value by its path joined with dots)")
        node = root
        ok = True
        for k in p[:-1]:
            child = node.setdefault(k, {})
            if not isinstance(child, dict):
                ok = False
                break
            node = child
        if not ok or p[-1] in node:
            flat.append(fqn)
            continue
        node[p[-1]] = fqn
    for fqn in flat:
        if fqn in root:
            raise CheckpointCorruptError(f"DCP .metadata: key {fqn!r} collides with a nested path")
        root[fqn] = fqn

    def node_of(v: Any) -> dict:
        if isinstance(v, str):
            return {"t": "ref", "fqn": v}
        keys = list(v)
        if keys and all(type(k) is int for k in keys) and sorted(keys) == list(range(len(keys))):
            return {"t": "list", "v": [node_of(v[i]) for i in range(len(keys))]}
        return {"t": "dict", "k": [[k, node_of(c)] for k, c in v.items()]}

    return node_of(root)


def load_manifest(path: str | os.PathLike) -> "mf.Manifest":
    """A :class:`~distckpt.manifest.Manifest` for the DCP checkpoint at ``path``: chunks point at
    the raw tensor bytes inside the ``.distcp`` files (``crcs`` empty, ``checksum_algo`` ``"none"``),
    objects are ``kind="dcp"`` entries whose value is a :class:`DcpValue`.

    Each chunk's place inside its ``torch.save`` archive is found when the chunk is first read
    (:class:`_ArchiveChunk`): a load parses the archives of the chunks its rank reads only, and a
    malformed archive raises then (CheckpointCorruptError, UnsupportedValueError), before any
    byte of the load moves (:func:`resolve_chunks`).

    Raises:
        the errors of :func:`read_metadata`; DataFileMissingError, DataFileTruncatedError and
        CheckpointCorruptError for data files that are missing, shorter than the metadata says,
        symlinks or not regular files.
    """
    from .errors import DataFileTruncatedError

    path = os.path.abspath(os.fspath(path))
    meta = read_metadata(path)
    names = sorted({c[2].file for t in meta.tensors.values() for c in t.chunks} | {s.file for s in meta.objects.values()})
    files, index = [], {}
    for name in names:
        fpath = os.path.join(path, name)
        fd = _open_data_file(fpath)
        try:
            size = os.fstat(fd).st_size
        finally:
            os.close(fd)
        m = _RANK_RE.fullmatch(name)
        index[name] = len(files)
        files.append(mf.FileEntry(name, size, int(m.group(1)) if m else 0))
    for s in [c[2] for t in meta.tensors.values() for c in t.chunks] + list(meta.objects.values()):
        size = files[index[s.file]].size
        if s.offset + s.length > size:
            raise DataFileTruncatedError(
                f"DCP data file {s.file} has {size} bytes; .metadata needs bytes up to {s.offset + s.length}",
                path=os.path.join(path, s.file), expected=s.offset + s.length, found=size)
    tensors = {}
    for fqn, t in meta.tensors.items():
        chunks = []
        for offsets, sizes, s in t.chunks:
            nbytes = math.prod(sizes) * mf.DTYPE_ITEMSIZE[t.dtype]
            # Where the bytes lie inside the chunk's archive is found when the chunk is read
            # (_ArchiveChunk); an empty chunk has no bytes to find.
            chunks.append(_ArchiveChunk(offsets, sizes, index[s.file], nbytes, os.path.join(path, s.file), fqn,
                                        t.dtype, s) if nbytes else
                          mf.ChunkRecord(offsets, sizes, index[s.file], s.offset, 0, (), None))
        tensors[fqn] = mf.TensorEntry(t.dtype, t.shape, tuple(chunks), "tensor")
    objects = {fqn: mf.ObjectEntry("dcp", DcpValue(path, fqn, s)) for fqn, s in meta.objects.items()}
    ranks = [f.rank for f in files]
    return mf.Manifest(
        format_version=1, save_id="", world_size=max(ranks) + 1 if ranks else 1, created_unix=0.0,
        checksum_algo="none", checksum_block=1 << 20, files=tuple(files), tensors=tensors, objects=objects,
        tree=_tree(meta), meta={"format": "torch.distributed.checkpoint", "dcp_version": meta.version})
