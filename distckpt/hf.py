"""Read Hugging Face safetensors directories (``save_pretrained`` output) as checkpoints.

A directory holding ``model.safetensors``, or shards ``model-0000k-of-0000n.safetensors`` with
``model.safetensors.index.json`` (and no distckpt MANIFEST, no DCP ``.metadata``), is a load
source like any checkpoint (:func:`distckpt.source.open_source` knows it by :func:`is_hf_checkpoint`): :func:`load_manifest` turns the files' headers into a
:class:`distckpt.manifest.Manifest` with one chunk per tensor pointing at the tensor's raw bytes,
so ``distckpt.load`` reshards onto any world size (plain tensors, DTensor / FSDP2) and each rank
reads only the byte ranges of its own shards, through the same reader as every other source.
That is what torchtitan's ``initial_load_in_hf`` does with DCP's HuggingFaceStorageReader.

A safetensors file is an 8-byte little-endian header length N, N bytes of JSON
(``{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {str: str}}``) and the
data, each tensor C-contiguous little-endian at ``8 + N + begin``. The header is parsed here, not
by the ``safetensors`` library (which maps the whole file): only ``8 + N`` bytes of each file are
read before the load reads its ranges. Every field is checked before anything is allocated from
it, with the rules the safetensors library applies (``Metadata::validate``): N at most 100 MB and
inside the file; the JSON an object; dtypes from the format's list; shapes of non-negative
integers; ``end - begin`` equal to the shape's bytes; the tensors' ranges tiling the data section
exactly (no overlap, no gap, none past the end of the file). Nothing in such a directory can run
code: JSON only.

Such a manifest has ``checksum_algo == "none"``: safetensors stores no checksums, so flipped bits
in the data are not detected (its structure is checked as above).
"""

from __future__ import annotations

import json
import math
import os
import stat
import struct
from typing import Any

from . import manifest as mf
from .errors import (CheckpointCorruptError, DataFileMissingError, DataFileTruncatedError, UnsupportedValueError,
                     from_os_error)

__all__ = ["SINGLE_NAME", "INDEX_NAME", "is_hf_checkpoint", "hf_files", "read_header", "load_manifest",
           "ST_DTYPES"]

SINGLE_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
#: The safetensors library refuses headers above 100 MB (HeaderTooLarge): the same bound, checked
#: before the header is read.
MAX_HEADER_BYTES = 100_000_000
#: An index names files and keys only; 64 MiB is far above any real model's (a few MiB at most).
MAX_INDEX_BYTES = 64 << 20

#: safetensors dtype names -> distckpt's (torch's without "torch.").
ST_DTYPES = {
    "F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "I64": "int64",
    "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool", "U16": "uint16",
    "U32": "uint32", "U64": "uint64", "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2",
    "F8_E8M0": "float8_e8m0fnu", "F8_E4M3FNUZ": "float8_e4m3fnuz", "F8_E5M2FNUZ": "float8_e5m2fnuz",
    "C64": "complex64",
}
# In the format, not readable as whole-byte elements of a torch dtype (sub-byte packings).
_ST_SUBBYTE = {"F4", "F6_E2M3", "F6_E3M2"}


def hf_files(path: str | os.PathLike) -> tuple[str, list[str]] | None:
    """``("single", [name])`` or ``("index", [index name])`` when the directory ``path`` is a
    Hugging Face safetensors directory (``model.safetensors`` first, as ``from_pretrained`` looks
    for it, then ``model.safetensors.index.json``) and holds neither a distckpt MANIFEST nor a DCP
    ``.metadata``; else None. Only looks (lstat); never raises for a missing path."""
    path = os.fspath(path)
    if os.path.lexists(os.path.join(path, mf.MANIFEST_NAME)) or os.path.lexists(os.path.join(path, ".metadata")):
        return None
    if os.path.lexists(os.path.join(path, SINGLE_NAME)):
        return "single", [SINGLE_NAME]
    if os.path.lexists(os.path.join(path, INDEX_NAME)):
        return "index", [INDEX_NAME]
    return None


def is_hf_checkpoint(path: str | os.PathLike) -> bool:
    """True when ``path`` is a directory :func:`load_manifest` reads (see :func:`hf_files`)."""
    return os.path.isdir(path) and hf_files(path) is not None


def _open_regular(fpath: str, what: str) -> int:
    """An O_NOFOLLOW fd of the regular file ``fpath``; typed errors otherwise."""
    try:
        fd = os.open(fpath, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
    except FileNotFoundError:
        raise DataFileMissingError(f"{what} {os.path.basename(fpath)} is missing", path=fpath) from None
    except OSError as exc:
        if os.path.islink(fpath):
            raise _symlink(fpath, what) from None
        raise from_os_error(exc, path=fpath, operation="open") from exc
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise CheckpointCorruptError(f"{what} {os.path.basename(fpath)} is not a regular file", path=fpath)
    return fd


def _symlink(fpath: str, what: str) -> UnsupportedValueError:
    return UnsupportedValueError(
        f"{what} {os.path.basename(fpath)} is a symlink (the Hugging Face hub cache's layout); distckpt reads "
        f"only regular files inside the checkpoint directory", path=fpath,
        remedy="Download the model into a plain directory (`hf download REPO --local-dir DIR`), or copy the "
               "snapshot with symlinks dereferenced (`cp -rL`).")


def _pread_exact(fd: int, n: int, offset: int, fpath: str) -> bytes:
    data = b""
    while len(data) < n:
        try:
            got = os.pread(fd, n - len(data), offset + len(data))
        except OSError as exc:   # EIO and the like: the storage's typed error, not a bare OSError
            raise from_os_error(exc, path=fpath, operation="read") from exc
        if not got:
            break
        data += got
    if len(data) != n:
        raise DataFileTruncatedError(f"{os.path.basename(fpath)} ended after {offset + len(data)} bytes, "
                                     f"{offset + n} needed", path=fpath, expected=offset + n, found=offset + len(data))
    return data


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict:
    out: dict = {}
    for k, v in pairs:
        if k in out:
            raise ValueError(f"key {k!r} appears twice")
        for text in (k, v) if isinstance(v, str) else (k,):
            # JSON's \ud800 escapes decode to lone surrogates, which are no Unicode text: the
            # safetensors library refuses them, and they failed later as raw UnicodeEncodeErrors
            # (printing the name, writing it to another file).
            try:
                text.encode("utf-8")
            except UnicodeEncodeError:
                raise ValueError(f"{text!r} holds a lone surrogate (\\ud800-\\udfff): not Unicode text") from None
        out[k] = v
    return out


def _json(data: bytes, what: str, fpath: str) -> Any:
    try:
        return json.loads(data.decode("utf-8"), object_pairs_hook=_no_duplicates)
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise CheckpointCorruptError(f"{what} is not valid JSON: {exc}", path=fpath) from None


def read_header(fd: int, fpath: str, size: int) -> tuple[dict[str, tuple[str, tuple[int, ...], int, int]], dict]:
    """Parse and check the safetensors header of the open file ``fd`` (``size`` bytes).

    Returns ``({name: (dtype, shape, file offset, nbytes)}, __metadata__)``, offsets absolute in
    the file, in the file's order.

    Raises:
        CheckpointCorruptError: the header length, JSON or an entry is malformed, a dtype is not
            one of the format's, tensors' ranges overlap or leave a gap in the data section.
        DataFileTruncatedError: the header or a tensor's range lies past the end of the file.
        UnsupportedValueError: a sub-byte dtype of the format (F4, F6_*), which distckpt cannot hold.
    """
    name = os.path.basename(fpath)
    if size < 8:
        raise DataFileTruncatedError(f"{name} has {size} bytes: too short for a safetensors header length",
                                     path=fpath, expected=8, found=size)
    (n,) = struct.unpack("<Q", _pread_exact(fd, 8, 0, fpath))
    if n > MAX_HEADER_BYTES:
        raise CheckpointCorruptError(f"{name}: header length {n} is above the {MAX_HEADER_BYTES} bytes the "
                                     f"safetensors format allows", path=fpath, expected=MAX_HEADER_BYTES, found=n)
    if 8 + n > size:
        raise DataFileTruncatedError(f"{name}: header of {n} bytes, but the file has {size}", path=fpath,
                                     expected=8 + n, found=size)
    raw = _pread_exact(fd, n, 8, fpath)
    if not raw.lstrip(b" \t\r\n").startswith(b"{"):  # JSON's whitespace first: the safetensors library reads it
        raise CheckpointCorruptError(f"{name}: the header is not a JSON object", path=fpath)
    header = _json(raw, f"{name}'s header", fpath)
    if not isinstance(header, dict):
        raise CheckpointCorruptError(f"{name}: the header is not a JSON object", path=fpath)
    meta = header.pop("__metadata__", None)   # absent or null: none (as the safetensors library reads it)
    meta = {} if meta is None else meta       # anything but an object of strings is refused
    if not isinstance(meta, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in meta.items()):
        raise CheckpointCorruptError(f"{name}: __metadata__ must map strings to strings", path=fpath)
    data_start = 8 + n
    entries = []
    for key, e in header.items():
        where = f"{name}: tensor {key!r}"
        if not isinstance(e, dict) or set(e) != {"dtype", "shape", "data_offsets"}:
            raise CheckpointCorruptError(f"{where}: expected exactly dtype, shape and data_offsets", path=fpath, key=key)
        st_dtype, shape, offs = e["dtype"], e["shape"], e["data_offsets"]
        if not isinstance(st_dtype, str):  # a list or object is unhashable: checked before the lookups
            raise CheckpointCorruptError(f"{where}: dtype {st_dtype!r} is not a safetensors dtype (a string)",
                                         path=fpath, key=key)
        if st_dtype in _ST_SUBBYTE:
            raise UnsupportedValueError(f"{where} has the sub-byte dtype {st_dtype}, which distckpt does not read",
                                        path=fpath, key=key, remedy="Load it with the safetensors library.")
        if st_dtype not in ST_DTYPES:
            raise CheckpointCorruptError(f"{where}: dtype {st_dtype!r} is not a safetensors dtype", path=fpath, key=key)
        if isinstance(shape, list) and len(shape) > mf.MAX_NDIM:
            raise UnsupportedValueError(f"{where} has {len(shape)} dimensions, more than the {mf.MAX_NDIM} distckpt "
                                        f"reads", path=fpath, key=key, remedy="Load it with the safetensors library.")
        if not isinstance(shape, list) or not all(type(x) is int and 0 <= x < 1 << 63 for x in shape):
            raise CheckpointCorruptError(f"{where}: shape {shape!r} is not a list of non-negative integers",
                                         path=fpath, key=key)
        if not isinstance(offs, list) or len(offs) != 2 or not all(type(x) is int and x >= 0 for x in offs) \
                or offs[0] > offs[1]:
            raise CheckpointCorruptError(f"{where}: data_offsets {offs!r} is not [begin, end] with begin <= end",
                                         path=fpath, key=key)
        dtype = ST_DTYPES[st_dtype]
        # [0, 2**62, 2**62] holds no byte and still cannot be made (the MANIFEST's rule)
        too_large = mf.oversized_shape(shape, dtype)
        if too_large is not None:
            raise CheckpointCorruptError(f"{where}: {too_large}", path=fpath, key=key)
        nbytes = math.prod(shape) * mf.DTYPE_ITEMSIZE[dtype]
        if offs[1] - offs[0] != nbytes:
            raise CheckpointCorruptError(f"{where}: data_offsets {offs} hold {offs[1] - offs[0]} bytes, its shape "
                                         f"{shape} of {st_dtype} needs {nbytes}", path=fpath, key=key)
        if data_start + offs[1] > size:
            raise DataFileTruncatedError(f"{where}: its bytes end at {data_start + offs[1]}, past the end of the "
                                         f"file ({size} bytes)", path=fpath, key=key, expected=data_start + offs[1],
                                         found=size)
        entries.append((offs[0], offs[1], key, dtype, tuple(shape)))
    entries.sort()
    at = 0
    for begin, end, key, _d, _s in entries:
        if begin != at:
            what = "overlaps the tensor before it" if begin < at else f"leaves a gap of {begin - at} bytes before it"
            raise CheckpointCorruptError(f"{name}: tensor {key!r} at data_offsets [{begin}, {end}] {what}",
                                         path=fpath, key=key)
        at = end
    if data_start + at != size:
        raise CheckpointCorruptError(f"{name}: {size - data_start - at} bytes after the last tensor belong to no "
                                     f"tensor", path=fpath, expected=data_start + at, found=size)
    tensors = {key: (dtype, shape, data_start + begin, end - begin) for begin, end, key, dtype, shape in entries}
    return tensors, meta


def _read_index(path: str, name: str) -> list[tuple[str, str]]:
    """The index's (tensor name, file name) pairs, checked: a JSON object whose ``weight_map``
    maps names to plain file names inside the directory."""
    ipath = os.path.join(path, name)
    fd = _open_regular(ipath, "index")
    try:
        size = os.fstat(fd).st_size
        if size > MAX_INDEX_BYTES:
            raise CheckpointCorruptError(f"{name} has {size} bytes, more than the {MAX_INDEX_BYTES} accepted",
                                         path=ipath, expected=MAX_INDEX_BYTES, found=size)
        doc = _json(_pread_exact(fd, size, 0, ipath), name, ipath)
    finally:
        os.close(fd)
    wm = doc.get("weight_map") if isinstance(doc, dict) else None
    if not isinstance(wm, dict) or not wm:
        raise CheckpointCorruptError(f"{name} has " + ("an empty weight_map" if isinstance(wm, dict) else
                                                       "no weight_map object"), path=ipath)
    for key, fname in wm.items():
        # A plain basename inside the directory, never a path (any other character is a legal
        # name the safetensors library reads: spaces, '+', '@', non-ASCII letters).
        if not isinstance(fname, str) or not fname or "/" in fname or "\0" in fname or fname in (".", ".."):
            raise CheckpointCorruptError(f"{name}: {key!r} names {fname!r}, which is not a plain file name inside "
                                         f"the directory", path=ipath, key=key)
    return list(wm.items())


def load_manifest(path: str | os.PathLike) -> "mf.Manifest":
    """A :class:`~distckpt.manifest.Manifest` for the Hugging Face safetensors directory ``path``:
    one chunk per tensor at its raw bytes (``crcs`` empty, ``checksum_algo`` ``"none"``), the
    tensors flat under their safetensors names, in file order. Reads the index (if any) and each
    file's header, nothing else.

    Raises:
        CheckpointNotFoundError: ``path`` is not such a directory.
        DataFileMissingError: a file the index names is missing.
        CheckpointCorruptError: the index or a header is malformed (see :func:`read_header`), the
            index names a tensor its file lacks, or one name is in two files.
        DataFileTruncatedError: a header or a tensor lies past the end of its file.
        UnsupportedValueError: a symlinked file (the hub cache), a sub-byte dtype.
    """
    from .errors import CheckpointNotFoundError

    path = os.path.abspath(os.fspath(path))
    found = hf_files(path) if os.path.isdir(path) else None
    if found is None:
        raise CheckpointNotFoundError(f"{path} is not a Hugging Face safetensors directory (no {SINGLE_NAME} or "
                                      f"{INDEX_NAME})", path=path)
    kind, (name,) = found
    pairs = _read_index(path, name) if kind == "index" else []
    names = list(dict.fromkeys(f for _k, f in pairs)) if kind == "index" else [name]
    files: list[mf.FileEntry] = []
    tensors: dict[str, mf.TensorEntry] = {}
    where: dict[str, str] = {}
    meta: dict = {}
    conflicts: dict[str, dict[str, str | None]] = {}
    per_file: list[tuple[str, dict]] = []
    for i, fname in enumerate(names):
        fpath = os.path.join(path, fname)
        fd = _open_regular(fpath, "safetensors file")
        try:
            size = os.fstat(fd).st_size
            header, fmeta = read_header(fd, fpath, size)
        finally:
            os.close(fd)
        if "DCP_SHARDING_INFO" in fmeta:
            # torch's HuggingFaceStorageWriter without consolidation: pieces of one tensor in
            # several files, placed by this metadata; not the save_pretrained layout read here.
            raise UnsupportedValueError(
                f"{fname} holds pieces of sharded tensors (DCP_SHARDING_INFO, written by torch's "
                f"HuggingFaceStorageWriter without consolidation)", path=fpath,
                remedy="Consolidate it (torch.distributed.checkpoint's consolidate_safetensors_files) or load "
                       "it with torch.distributed.checkpoint.HuggingFaceStorageReader.")
        per_file.append((fname, fmeta))
        files.append(mf.FileEntry(fname, size, 0))
        for key, (dtype, shape, offset, nbytes) in header.items():
            if key in where:
                raise CheckpointCorruptError(f"tensor {key!r} is in both {where[key]} and {fname}", path=fpath, key=key)
            where[key] = fname
            chunk = mf.ChunkRecord((0,) * len(shape), shape, i, offset, nbytes, ())
            tensors[key] = mf.TensorEntry(dtype, shape, (chunk,), "tensor")
    for key, fname in pairs:
        if where.get(key) != fname:
            raise CheckpointCorruptError(
                f"{name} puts {key!r} in {fname}, but " + (f"it is in {where[key]}" if key in where else "no file has it"),
                path=os.path.join(path, name), key=key)
    # Every file's entries (save_pretrained writes the same in each shard); an entry the files
    # disagree on, or that some files lack (None), is kept as the first holder's value, and the
    # files' values are named beside it.
    for fname, fmeta in per_file:
        for k, v in fmeta.items():
            meta.setdefault(k, v)
    for k in meta:
        values = {fname: fmeta.get(k) for fname, fmeta in per_file}
        if len(set(values.values())) > 1:
            conflicts[k] = values
    tree = {"t": "dict", "k": [[key, {"t": "ref", "fqn": key}] for key in tensors]}
    return mf.Manifest(
        format_version=1, save_id="", world_size=1, created_unix=0.0, checksum_algo="none",
        checksum_block=1 << 20, files=tuple(files), tensors=tensors, objects={}, tree=tree,
        meta={"format": "safetensors", "safetensors_metadata": meta,
              **({"safetensors_metadata_conflicts": conflicts} if conflicts else {})})
