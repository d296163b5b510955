"""Conversions between checkpoint formats, streaming tensor by tensor with bounded memory.

    distckpt convert SRC DST --to dcp|torch|safetensors|distckpt

SRC is a distckpt checkpoint, a torch.distributed.checkpoint (DCP) directory or a Hugging Face
safetensors directory, read through the same reader as :func:`distckpt.load` (see
:mod:`distckpt.dcp`, :mod:`distckpt.hf`), one reader per source file for the whole conversion.
Targets:

  * ``dcp``: a DCP directory written by torch's own ``FileSystemWriter`` through ``dcp.save``
    (``torch.distributed.checkpoint.load`` reads it); a tensor larger than the slice size is
    written as several row chunks (DCP reshards on load).
  * ``torch``: one ``torch.save``-format file with the original nesting, loadable with
    ``torch.load(path, weights_only=True)`` (and ``mmap=True``: records are 64-byte aligned, as
    torch writes them). It is written record by record with :mod:`zipfile`, each tensor's bytes
    streamed in slices, because ``torch.save`` itself needs every tensor in memory at once.
  * ``safetensors``: Hugging Face safetensors shards of at most ``max_shard_size`` bytes and
    ``model.safetensors.index.json`` (one ``model.safetensors`` when it fits one shard), as
    ``save_pretrained`` lays them out; ``prefix`` keeps the keys that start with it and strips it,
    ``dtype`` casts floating-point tensors. The header is written first and the data streamed in
    slices (the safetensors library's ``save_file`` needs the whole shard in memory); every shard
    is then checked by opening it with the safetensors library.
  * ``distckpt``: a distckpt checkpoint written by :func:`distckpt.save`. Each tensor is
    assembled in a memory-mapped temporary file next to DST (so anonymous memory stays bounded;
    the data lives in the page cache, which the kernel writes back and reclaims), then saved.

Memory: tensors are read in C-contiguous slices of at most ``memory_limit // 4`` bytes (a slice,
the reader's buffers for it, and a cast copy fit in the limit), so peak memory above the
interpreter's baseline stays under ``memory_limit`` whatever the checkpoint's size
(docs/BENCHMARKS.md has the measurement). Values that a target cannot hold (non-tensor values in
safetensors) are listed by name in :attr:`ConvertResult.skipped`, never dropped silently.
"""

from __future__ import annotations

import argparse
import dataclasses
import errno
import io
import json
import logging
import math
import os
import pickle
import struct
import sys
import time
import warnings
from typing import Any, Callable, Iterator

from .hf import ST_DTYPES
from .sizes import size_arg  # argparse type of the size options: the parse error's reason, exit 2

__all__ = ["convert", "ConvertResult", "FORMATS", "add_parser"]

log = logging.getLogger("distckpt")

FORMATS = ("dcp", "torch", "safetensors", "distckpt")
DEFAULT_MEMORY_LIMIT = 1 << 30
DEFAULT_SHARD_SIZE = 5 << 30

# safetensors dtype names (the format's spec) for the torch dtypes it can hold: what the reader
# (distckpt.hf) maps, the other way.
_ST_DTYPES = {torch_name: st_name for st_name, torch_name in ST_DTYPES.items()}
_DTYPE_ALIASES = {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp32": "float32",
                  "float": "float32", "fp64": "float64", "double": "float64"}


@dataclasses.dataclass(frozen=True)
class ConvertResult:
    """What a conversion wrote. ``skipped``: keys the target format cannot hold (with why)."""

    src: str
    dst: str
    to: str
    tensors: int
    bytes: int
    files: list[str]
    skipped: dict[str, str]
    seconds: float


#: The batch a conversion to a torch or safetensors file reads while the previous one is written
#: (:meth:`_Source.stream` with ``reuse``): small enough to overlap the read with the writes, large
#: enough that a read pass's fixed costs stay small beside it.
STREAM_BATCH = 8 << 20

_OPTIONS = "See `distckpt convert --help` (or distckpt.convert.convert's docstring) for the options."


def parse_size(text: str) -> int:
    """``"5GiB"``, ``"5G"``, ``"1048576"`` -> bytes: binary units, the package's one convention
    (distckpt.sizes; decimal ``500MB`` is refused as ambiguous). ValueError otherwise."""
    from .sizes import parse_size as _parse

    return _parse(text)


# ---------------------------------------------------------------------------------------------
# The source: any checkpoint distckpt reads.


def _open_source(path: str, *, allow_pickle: bool, verify: bool) -> "_Source":
    """The source of a conversion: the checkpoint at ``path``, or, for a delta of an incremental
    chain, the state it stands for (:class:`_ChainSource`). Raises the errors of
    :func:`distckpt.restore.load_manifest` and :func:`distckpt.chain.chain_of`."""
    from .chain import chain_info, chain_of
    from .restore import load_manifest

    manifest = load_manifest(os.path.abspath(path))
    info = chain_info(manifest)
    if info is not None and info.get("kind") == "delta":
        return _ChainSource(path, chain_of(path), allow_pickle=allow_pickle, verify=verify)
    return _Source(path, allow_pickle=allow_pickle, verify=verify, manifest=manifest)


class _Source:
    def __init__(self, path: str, *, allow_pickle: bool, verify: bool, manifest: Any = None):
        from .restore import load_manifest

        self.path = os.path.abspath(path)
        self.manifest = manifest if manifest is not None else load_manifest(self.path)
        self.allow_pickle = allow_pickle
        self.verify = verify

    def order(self, fqn: str) -> tuple[int, ...] | None:
        """The dimensions of ``fqn`` outermost first as its chunks are stored, when they are not
        row-major (a DCP chunk of a transposed or channels_last tensor: its strides); None for a
        row-major tensor. Slices taken in this order are contiguous byte runs of the chunks."""
        for c in self.tensors[fqn].chunks or ():
            if c.strides is not None:
                n = len(c.strides)
                order = tuple(sorted(range(n), key=lambda d: (-c.strides[d], d)))
                return None if order == tuple(range(n)) else order
        return None

    @property
    def tensors(self):
        return self.manifest.tensors

    def metadata(self) -> dict[str, Any]:
        """The checkpoint's own metadata, which a conversion carries or lists as skipped: a
        distckpt checkpoint's user metadata (``save(..., metadata=)``), a Hugging Face
        directory's safetensors ``__metadata__`` (under ``"safetensors_metadata"``); a DCP
        checkpoint has none of its own. distckpt's two records of how the source stores its state
        (``"distckpt.chain"``: a chain link's; ``"distckpt.dcp"``: values as DCP's bytes) are left
        out: the output holds the state decoded, and they would misdescribe it."""
        meta = self.manifest.meta or {}
        if meta.get("format") == "safetensors":
            st = meta.get("safetensors_metadata") or {}
            return {"safetensors_metadata": dict(st)} if st else {}
        from .chain import META_KEY
        from .dcp import WRITER_META_KEY
        user = meta.get("user")
        return ({k: v for k, v in user.items() if k not in (META_KEY, WRITER_META_KEY)}
                if isinstance(user, dict) else {})

    def value(self, fqn: str) -> Any:
        from .errors import PickleNotAllowedError
        from .restore import _object_value

        entry = self.manifest.objects[fqn]
        if entry.kind == "pickle" and not self.allow_pickle:
            raise PickleNotAllowedError(f"the checkpoint stores {fqn!r} as a pickle", path=self.path, keys=[fqn])
        # the manifest, so a value written through distckpt's DCP StorageWriter (DCP's torch.save
        # bytes) is decoded as load() decodes it, not copied out as those bytes
        return _object_value(entry, self.manifest, fqn, self.path, self.allow_pickle)

    def raw_range(self, fqn: str) -> tuple[str, int, int] | None:
        """(data file path, byte offset, byte count) of ``fqn``'s bytes, when a plain copy of that
        range is the tensor exactly: the source keeps no checksums to check (a Hugging Face
        directory, DCP's files) and the tensor is one row-major chunk of its whole extent. None
        otherwise (distckpt's own files are checked as they are read, never copied blind)."""
        t = self.tensors[fqn]
        if self.manifest.checksum_algo != "none" or len(t.chunks or ()) != 1:
            return None
        c = t.chunks[0]
        if c.strides is not None or tuple(c.sizes) != tuple(t.shape) or any(c.offsets) or c.crcs:
            return None
        return os.path.join(self.path, self.manifest.files[c.file].name), c.offset, c.nbytes

    def read(self, fqn: str, offsets: tuple[int, ...], sizes: tuple[int, ...]):
        return self.read_boxes([(fqn, offsets, sizes)])[0]

    def read_boxes(self, requests) -> list:
        """The boxes ``(fqn, offsets, sizes)``, read into new CPU tensors in one pass."""
        from .restore import read_boxes
        return read_boxes(self.path, self.manifest, requests, verify=self.verify)

    def fill(self, requests) -> None:
        """Read the boxes ``(fqn, offsets, sizes, destination)`` into their destinations (one
        read pass). Raises the read errors of :func:`distckpt.read`."""
        from .restore import fill_boxes
        fill_boxes(self.path, self.manifest, requests, verify=self.verify)

    def stream(self, requests, budget: int, *, reuse: bool = False) -> Iterator[tuple[Any, Any]]:
        """``(key, tensor)`` for every ``(key, fqn, offsets, sizes)`` of ``requests``, in order.

        Consecutive boxes are read together, one read pass (distckpt.fill) per batch of at most
        ``budget`` bytes (a box larger than that alone), so a checkpoint of many small tensors
        costs a few passes, not one per tensor; at most one batch is held, each tensor released
        by this generator once it was handed out. Raises the read errors of :func:`distckpt.read`.

        ``reuse=True``, for a caller that is done with each tensor when it asks for the next (it
        writes it out): batches of at most ``min(budget / 2, STREAM_BATCH)`` bytes are read into two
        buffers in turn, the next batch on a thread while the caller writes this one. A tensor
        handed out is a view that the batch after next overwrites. Fresh memory for every batch
        cost a page fault per 4 KiB, as much as the read itself from the page cache, and the read
        waited for the writes (a conversion from a Hugging Face directory took 1.5x a plain
        ``load_file`` + ``save_file``).
        """
        from . import manifest as mf

        def batches(cap: int):
            batch: list = []
            size = 0
            for req in requests:
                t = self.tensors[req[1]]
                nbytes = math.prod(req[3]) * mf.DTYPE_ITEMSIZE[t.dtype]
                if batch and size + nbytes > cap:
                    yield batch
                    batch, size = [], 0
                batch.append(req)
                size += nbytes
            if batch:
                yield batch

        if not reuse:
            for batch in batches(budget):
                out = self.read_boxes([r[1:] for r in batch])
                out.reverse()
                for req in batch:
                    yield req[0], out.pop()
            return
        # Two batches are held at once: each at most half the budget, so the memory bound holds.
        yield from self._stream_reusing(batches(max(1, min(budget // 2, STREAM_BATCH))))

    def _stream_reusing(self, batches: Iterator[list]) -> Iterator[tuple[Any, Any]]:
        """:meth:`stream` with ``reuse=True``: each batch read into the buffer the batch before
        last used, on one reader thread, while the caller consumes the batch before it."""
        import concurrent.futures
        import contextvars

        import torch

        from . import manifest as mf
        from .tensorbytes import dtype_from_name

        buffers: list = [None, None]

        def read(batch: list, which: int) -> list:
            dtypes = [dtype_from_name(self.tensors[fqn].dtype, path=self.path) for _k, fqn, _o, _s in batch]
            nbytes = [math.prod(sz) * mf.DTYPE_ITEMSIZE[self.tensors[fqn].dtype] for _k, fqn, _o, sz in batch]
            starts = [0]
            for n in nbytes:
                starts.append(starts[-1] + -(-n // 64) * 64)   # 64-byte aligned views
            if buffers[which] is None or buffers[which].numel() < starts[-1]:
                buffers[which] = None   # the old one goes before the new one is allocated
                buffers[which] = torch.empty(starts[-1], dtype=torch.uint8)
            out = [buffers[which][a:a + n].view(d).view(tuple(req[3]))
                   for req, d, a, n in zip(batch, dtypes, starts, nbytes)]
            self.fill([(fqn, o, sz, t) for (_k, fqn, o, sz), t in zip(batch, out)])
            return out

        # The reader thread runs in this thread's context: the conversion's reading() session
        # (readers and slots kept open across fills) is a context variable. One fill at a time.
        pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="distckpt-convert-read")
        pending = None
        try:
            it = iter(batches)
            current = next(it, None)
            if current is not None:
                pending = pool.submit(contextvars.copy_context().run, read, current, 0)
            which = 0
            while current is not None:
                out = pending.result()
                pending = None
                following = next(it, None)
                if following is not None:   # read it into the other buffer while this one is written
                    pending = pool.submit(contextvars.copy_context().run, read, following, 1 - which)
                for req, t in zip(current, out):
                    yield req[0], t
                del out
                current, which = following, 1 - which
        finally:
            if pending is not None:   # the caller stopped early (an error): the read ends before the buffers go
                concurrent.futures.wait([pending])
            pool.shutdown(wait=True)

    def nested(self, leaf) -> Any:
        """The original nesting with every tensor replaced by ``leaf(fqn)`` and values decoded."""
        from .restore import _SKIP, _rebuild

        values = {fqn: leaf(fqn) for fqn in self.tensors}
        values.update({fqn: self.value(fqn) for fqn in self.manifest.objects})
        out = _rebuild(self.manifest.tree, values, lambda fqn: True)
        return {} if out is _SKIP else out

    def subtree(self, node) -> Any:
        """The value of one node of the manifest tree, tensors read whole."""
        from .restore import _rebuild

        if node["t"] == "ref":
            fqn = node["fqn"]
            if fqn in self.tensors:
                t = self.tensors[fqn]
                return self.read(fqn, (0,) * len(t.shape), tuple(t.shape))
            return self.value(fqn)
        refs: list[str] = []

        def collect(n):
            if n["t"] == "ref":
                refs.append(n["fqn"])
            for _k, c in n.get("k", []):
                collect(c)
            for c in n.get("v", []):
                collect(c)

        collect(node)
        values = {fqn: self.subtree({"t": "ref", "fqn": fqn}) for fqn in refs}
        return _rebuild(node, values, lambda fqn: True)


class _ChainSource(_Source):
    """A delta of an incremental chain as the one checkpoint it stands for
    (:class:`distckpt.chainview.ChainView`)."""

    def __init__(self, path: str, links: list, *, allow_pickle: bool, verify: bool):
        from .chainview import ChainView

        self.view = ChainView(links, verify=verify)
        super().__init__(path, allow_pickle=allow_pickle, verify=verify, manifest=self.view.manifest)

    def read_boxes(self, requests) -> list:
        import torch

        from .tensorbytes import dtype_from_name

        out = [torch.empty(tuple(sz), dtype=dtype_from_name(self.tensors[fqn].dtype, path=self.path))
               for fqn, _off, sz in requests]
        self.fill([(fqn, off, sz, t) for (fqn, off, sz), t in zip(requests, out)])
        return out

    def fill(self, requests) -> None:
        self.view.fill(requests)

    def raw_range(self, fqn: str) -> None:
        return None  # a chain's state is composed from several links, each checked as it is read


def _slices(shape: tuple[int, ...], itemsize: int, max_bytes: int,
            order: tuple[int, ...] | None = None) -> Iterator[tuple[tuple, tuple]]:
    """Boxes (offsets, sizes) that cover ``shape`` in row-major order, each C-contiguous inside
    the tensor (leading dims fixed, one dim ranged, trailing dims whole) and at most ``max_bytes``
    (or one element, if an element is larger). With ``order`` (the dimensions outermost first),
    the same in that order: contiguous in a layout whose strides fall in that order."""
    if order is not None:
        for o, s in _slices(tuple(shape[d] for d in order), itemsize, max_bytes):
            offsets, sizes = [0] * len(shape), [0] * len(shape)
            for i, d in enumerate(order):
                offsets[d], sizes[d] = o[i], s[i]
            yield tuple(offsets), tuple(sizes)
        return
    if math.prod(shape) == 0:
        return
    if not shape:
        yield (), ()
        return

    def rec(prefix: tuple, d: int):
        inner = math.prod(shape[d + 1:]) * itemsize
        if inner <= max_bytes or d == len(shape) - 1:
            step = max(1, max_bytes // max(inner, 1))
            for start in range(0, shape[d], step):
                n = min(step, shape[d] - start)
                yield prefix + (start,) + (0,) * (len(shape) - d - 1), (1,) * len(prefix) + (n,) + shape[d + 1:]
        else:
            for i in range(shape[d]):
                yield from rec(prefix + (i,), d + 1)

    yield from rec((), 0)


class _Progress:
    """A tqdm bar over bytes on a terminal (stderr is a tty), nothing otherwise."""

    def __init__(self, total: int, desc: str, enabled: bool | None):
        if enabled is None:
            enabled = sys.stderr.isatty()
        self.bar = None
        if enabled:
            from tqdm import tqdm
            self.bar = tqdm(total=total, desc=desc, unit="B", unit_scale=True, unit_divisor=1024, file=sys.stderr)

    def update(self, n: int) -> None:
        if self.bar is not None:
            self.bar.update(n)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _tensor_bytes(src: _Source, fqns) -> int:
    from . import manifest as mf
    return sum(math.prod(src.tensors[f].shape) * mf.DTYPE_ITEMSIZE[src.tensors[f].dtype] for f in fqns)


def _pin_mmap_threshold() -> None:
    """Keep glibc's mmap threshold at its default (128 KiB) for the rest of the process.

    glibc raises the threshold to the size of any large block that is freed, so after the first
    slice every later one comes from the heap, whose freed memory is not given back: measured,
    a DCP export with a 64 MiB limit grew by 131 MiB instead of 51 MiB. With the threshold
    pinned, each slice is its own mapping and goes back to the kernel when freed. No-op off glibc.
    """
    import ctypes

    try:
        libc = ctypes.CDLL(None)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return
    M_MMAP_THRESHOLD = -3
    mallopt(M_MMAP_THRESHOLD, 128 * 1024)


def _dtype(name: str):
    from .tensorbytes import dtype_from_name
    return dtype_from_name(name)


def _bytes_of(t) -> memoryview:
    from .tensorbytes import host_bytes
    view, keep = host_bytes(t)
    return view, keep


# ---------------------------------------------------------------------------------------------
# torch.save format, streamed.


class _TensorRef:
    """Stands for one tensor in the pickled structure of a ``--to torch`` export."""

    def __init__(self, fqn: str, key: str, dtype_name: str, shape: tuple):
        self.fqn, self.key, self.dtype_name, self.shape = fqn, key, dtype_name, shape


class _StorageRef:
    def __init__(self, ref: _TensorRef):
        self.ref = ref


# torch.save's names for the storages of these dtypes (torch.storage._dtype_to_storage_type_map);
# other dtypes are written as UntypedStorage + _rebuild_tensor_v3, as torch.save does.
_LEGACY_STORAGE = {
    "float64": "DoubleStorage", "float32": "FloatStorage", "float16": "HalfStorage",
    "bfloat16": "BFloat16Storage", "int64": "LongStorage", "int32": "IntStorage",
    "int16": "ShortStorage", "int8": "CharStorage", "uint8": "ByteStorage", "bool": "BoolStorage",
    "complex128": "ComplexDoubleStorage", "complex64": "ComplexFloatStorage",
}


def _torch_pickle(obj: Any) -> bytes:
    """data.pkl of a torch.save archive holding ``obj`` (protocol 2, as torch.save writes it)."""
    import collections

    import torch
    from torch._utils import _rebuild_tensor_v2, _rebuild_tensor_v3

    from .plan import row_major_strides

    class Pickler(pickle.Pickler):
        def persistent_id(self, o):
            if isinstance(o, _StorageRef):
                r = o.ref
                numel = math.prod(r.shape)
                if r.dtype_name in _LEGACY_STORAGE:
                    return ("storage", getattr(torch, _LEGACY_STORAGE[r.dtype_name]), r.key, "cpu", numel)
                return ("storage", torch.storage.UntypedStorage, r.key, "cpu", numel * _dtype(r.dtype_name).itemsize)
            return None

        def reducer_override(self, o):
            if isinstance(o, _TensorRef):
                args = (_StorageRef(o), 0, torch.Size(o.shape), tuple(row_major_strides(o.shape)), False,
                        collections.OrderedDict())
                if o.dtype_name in _LEGACY_STORAGE:
                    return _rebuild_tensor_v2, args
                return _rebuild_tensor_v3, args + (_dtype(o.dtype_name),)
            return NotImplemented

    buf = io.BytesIO()
    Pickler(buf, protocol=2).dump(obj)
    return buf.getvalue()


def _aligned_info(zf, name: str, size: int):
    """A ZipInfo whose data will start on a 64-byte boundary (torch's alignment, which
    torch.load(mmap=True) relies on): the local header's extra field is padded."""
    import zipfile

    zip64 = size * 1.05 > zipfile.ZIP64_LIMIT  # the rule ZipFile.open(mode="w") applies
    info = zipfile.ZipInfo(name, date_time=(1980, 1, 1, 0, 0, 0))
    info.compress_type = zipfile.ZIP_STORED
    info.file_size = size
    start = zf.fp.tell() + 30 + len(name.encode()) + (20 if zip64 else 0)
    pad = (-(start + 4)) % 64
    info.extra = struct.pack("<HH", 0x4246, pad) + b"Z" * pad  # "FB": torch's padding field id
    return info, zip64


def _to_torch(src: _Source, dst: str, slice_bytes: int, progress: _Progress, result: dict) -> None:
    import zipfile

    refs: list[_TensorRef] = []

    def leaf(fqn):
        t = src.tensors[fqn]
        refs.append(_TensorRef(fqn, str(len(refs)), t.dtype, tuple(t.shape)))
        return refs[-1]

    obj = src.nested(leaf)
    with open(dst, "wb") as f, zipfile.ZipFile(f, "w", zipfile.ZIP_STORED, allowZip64=True) as zf:
        def record(name: str, data: bytes) -> None:
            info, zip64 = _aligned_info(zf, name, len(data))
            with zf.open(info, "w", force_zip64=zip64) as out:
                out.write(data)

        record("archive/data.pkl", _torch_pickle(obj))
        record("archive/.format_version", b"1")
        record("archive/.storage_alignment", b"64")
        record("archive/byteorder", b"little")
        pieces = src.stream(((r, r.fqn, o, s) for r in refs
                             for o, s in _slices(r.shape, _dtype(r.dtype_name).itemsize, slice_bytes)), slice_bytes,
                            reuse=True)
        for r in refs:
            dtype = _dtype(r.dtype_name)
            info, zip64 = _aligned_info(zf, f"archive/data/{r.key}", math.prod(r.shape) * dtype.itemsize)
            with zf.open(info, "w", force_zip64=zip64) as out:
                left = info.file_size
                while left:
                    key, piece = next(pieces)
                    assert key is r, "pieces arrive in the order of the records"
                    view, keep = _bytes_of(piece)
                    out.write(view)
                    left -= len(view)
                    progress.update(len(view))
                    del view, keep, piece
        record("archive/version", b"3\n")
        f.flush()
        os.fsync(f.fileno())
    if not _plain(obj):  # what else the structure holds: let torch's own weights-only load judge
        _check_weights_only(dst, src.path)


def _plain(obj: Any) -> bool:
    """True when ``obj`` is made only of dicts with str/int keys, lists, tuples, str, int, float,
    bool, None and tensors (_TensorRef): types torch.load(weights_only=True) always accepts, so
    loading the file back to find out (:func:`_check_weights_only`, ~50 ms for 150 tensors) can
    only pass. Exact types: a subclass (namedtuple, OrderedDict, an IntEnum) is not plain."""
    stack = [obj]
    while stack:
        o = stack.pop()
        t = type(o)
        if t is dict:
            if not all(type(k) in (str, int) for k in o):
                return False
            stack.extend(o.values())
        elif t is list or t is tuple:
            stack.extend(o)
        elif t not in (_TensorRef, str, int, float, bool, type(None)):
            return False
    return True


def _check_weights_only(path: str, src: str) -> None:
    """Load the written file the way its users will: torch.load(weights_only=True), memory-mapped
    so no tensor byte is read. A value that needs more (an Enum, dataclass or namedtuple of the
    user's, a pickled value) is a typed error naming what torch refused, not a file that fails
    later."""
    import torch

    from .dcp import _unpickler_reason
    from .errors import UnsupportedValueError

    try:
        torch.load(path, weights_only=True, mmap=True, map_location="cpu")
    except pickle.UnpicklingError as exc:
        raise UnsupportedValueError(
            f"the export would not load with torch.load(weights_only=True): {_unpickler_reason(exc).rstrip('.')}",
            path=src, remedy="Convert to dcp or distckpt (both keep such values), or let the file's users allow "
                             "the type with torch.serialization.add_safe_globals, or load it with "
                             "weights_only=False if they trust it.") from None


# ---------------------------------------------------------------------------------------------
# Hugging Face safetensors shards.


def _safetensors_metadata(meta: dict[str, Any], result: dict) -> dict[str, str]:
    """The ``__metadata__`` of every output file: ``{"format": "pt"}`` (what transformers loads by)
    with a Hugging Face source's own entries, and a distckpt source's user metadata entries that
    are strings; the rest (not strings: safetensors metadata maps strings to strings) is listed in
    ``result["skipped"]``."""
    out = {"format": "pt"}
    for key, value in meta.items():
        if key == "safetensors_metadata" and isinstance(value, dict):   # a safetensors source's own
            for k, v in value.items():
                if k != "format" and isinstance(k, str) and isinstance(v, str):
                    out[k] = v
                elif k != "format":
                    result["skipped"][f"(metadata) safetensors_metadata.{k}"] = "not a string"
                elif v != "pt":   # the output's tensors are torch's: its format entry says so
                    result["skipped"][f"(metadata) safetensors_metadata.{k}"] = (
                        f"the source's format entry is {v!r}; the output's is 'pt'")
        elif isinstance(key, str) and isinstance(value, str) and key != "format":
            out[key] = value
        else:
            result["skipped"][f"(metadata) {key}"] = ("safetensors metadata holds strings only" if key != "format"
                                                      else "the output's format entry is 'pt'")
    return out


def _name_conflicts(src: _Source, result: dict) -> None:
    """List as skipped the safetensors metadata entries a Hugging Face source's files disagree on
    (the first file's value is the one carried)."""
    for key, per_file in ((src.manifest.meta or {}).get("safetensors_metadata_conflicts") or {}).items():
        result["skipped"][f"(metadata) safetensors_metadata.{key}"] = (
            f"the source's files disagree ({per_file}; None: a file without it); the first holder's value is kept")


def _skip_metadata(meta: dict[str, Any], to: str, result: dict) -> None:
    """List every entry of the source's metadata as skipped: ``to`` has no place for it."""
    for key in meta:
        result["skipped"][f"(metadata) {key}"] = f"a {to} file has no place for checkpoint metadata"


def _to_safetensors(src: _Source, dst: str, slice_bytes: int, progress: _Progress, result: dict, *,
                    max_shard_size: int, prefix: str | None, cast: str | None) -> None:
    from .errors import UnsupportedValueError

    names: list[tuple[str, str]] = []  # (output name, fqn)
    for fqn in src.tensors:
        if prefix is not None and not fqn.startswith(prefix):
            result["skipped"][fqn] = f"outside the prefix {prefix!r}"
            continue
        names.append((fqn[len(prefix):] if prefix else fqn, fqn))
    for fqn in src.manifest.objects:
        result["skipped"][fqn] = "not a tensor (safetensors holds tensors only)"
    if not names:
        raise UnsupportedValueError(f"no tensor of {src.path} matches the prefix {prefix!r}", path=src.path,
                                    remedy="Pass a prefix that the tensors' keys start with (`distckpt inspect` "
                                    "lists them), or none.")

    def out_dtype(t, fqn: str) -> str:
        d = t.dtype
        if cast is not None and _dtype(d).is_floating_point:
            d = cast
        if d not in _ST_DTYPES:
            raise UnsupportedValueError(f"safetensors cannot hold dtype {d} (tensor {fqn!r})", path=src.path,
                                        key=fqn, remedy="Convert to torch, dcp or distckpt" + (
                                            ", or cast the floating-point tensors with --dtype." if
                                            _dtype(d).is_floating_point else "."))
        return d

    from . import manifest as mf
    specs = []
    for name, fqn in names:
        if name == "__metadata__":
            # The header's own metadata entry: a tensor of that name makes a file the safetensors
            # library itself refuses to read.
            raise UnsupportedValueError(f"tensor {fqn!r} would be named '__metadata__' in the safetensors header, "
                                        f"the name the format reserves for its metadata", path=src.path, key=fqn,
                                        remedy="Convert with a --prefix that keeps it out, or rename the key.")
        t = src.tensors[fqn]
        d = out_dtype(t, fqn)
        specs.append((name, fqn, d, tuple(t.shape), math.prod(t.shape) * mf.DTYPE_ITEMSIZE[d]))
    # Shards in checkpoint order, each closed before it would pass the cap (a tensor larger than
    # the cap gets a shard of its own, as save_pretrained does).
    shards: list[list] = [[]]
    size = 0
    for spec in specs:
        if shards[-1] and size + spec[4] > max_shard_size:
            shards.append([])
            size = 0
        shards[-1].append(spec)
        size += spec[4]
    n = len(shards)
    files = ["model.safetensors"] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    weight_map = {}
    # A tensor kept in its dtype whose source bytes are a plain range (a Hugging Face directory's
    # safetensors): copied file to file in the kernel (copy_file_range), never through memory.
    # The same bytes as a read and write, one copy fewer (HF -> safetensors took 1.27x a plain
    # load_file + save_file with both copies; docs/BENCHMARKS.md).
    direct = {}
    for spec in specs:
        where = src.raw_range(spec[1]) if spec[2] == src.tensors[spec[1]].dtype else None
        if where is not None and where[2] == spec[4]:
            direct[spec[1]] = where
    pieces = src.stream(((spec, spec[1], o, s) for shard in shards for spec in shard if spec[1] not in direct
                         for o, s in _slices(spec[3], _dtype(src.tensors[spec[1]].dtype).itemsize, slice_bytes)),
                        slice_bytes, reuse=True)
    copier = _RangeCopier()
    st_meta = _safetensors_metadata(src.metadata(), result)
    try:
        for fname, shard in zip(files, shards):
            header: dict[str, Any] = {"__metadata__": st_meta}
            off = 0
            for name, _fqn, d, shape, nbytes in shard:
                header[name] = {"dtype": _ST_DTYPES[d], "shape": list(shape), "data_offsets": [off, off + nbytes]}
                off += nbytes
                weight_map[name] = fname
            hdr = json.dumps(header, separators=(",", ":")).encode()
            hdr += b" " * ((-len(hdr)) % 8)  # the spec allows trailing spaces; 8-byte aligned data
            path = os.path.join(dst, fname)
            with open(path + ".tmp", "wb") as f:
                f.write(struct.pack("<Q", len(hdr)) + hdr)
                for spec in shard:
                    if spec[1] in direct:
                        f.flush()
                        at = f.tell()
                        copier.copy(*direct[spec[1]], f.fileno(), at, path + ".tmp")
                        f.seek(at + spec[4])
                        progress.update(spec[4])
                        continue
                    target = _dtype(spec[2])
                    left = spec[4]
                    while left:
                        key, piece = next(pieces)
                        assert key is spec, "pieces arrive in the order of the shards' tensors"
                        if piece.dtype != target:
                            piece = piece.to(target)
                        view, keep = _bytes_of(piece)
                        f.write(view)
                        left -= len(view)
                        progress.update(len(view))
                        del view, keep, piece
                f.flush()
                os.fsync(f.fileno())
            os.replace(path + ".tmp", path)
            _check_shard(path, shard)
    finally:
        copier.close()
    if n > 1:
        index = {"metadata": {"total_size": sum(s[4] for s in specs)}, "weight_map": weight_map}
        with open(os.path.join(dst, "model.safetensors.index.json"), "w") as f:
            json.dump(index, f, indent=2, sort_keys=True)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        files = files + ["model.safetensors.index.json"]
    result["files"] = [os.path.join(dst, f) for f in files]
    result["tensors"] = len(specs)


class _RangeCopier:
    """Byte ranges of source files copied into an output file by the kernel (copy_file_range),
    the source files opened once each (regular files only, no symlink followed)."""

    # Where the kernel cannot copy between the two files (another file system on an older
    # kernel, a file system without the call): the same bytes by pread and pwrite, in pieces.
    _NOT_HERE = {errno.EXDEV, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL}

    def __init__(self) -> None:
        self._fds: dict[str, int] = {}

    def copy(self, src: str, offset: int, nbytes: int, dst_fd: int, dst_offset: int, dst: str) -> None:
        """Copy ``nbytes`` of ``src`` from ``offset`` to ``dst_fd`` (the file ``dst``) at
        ``dst_offset``. Raises DataFileTruncatedError when ``src`` ends first (it shrank since
        its header was read), DiskFullError and the storage's other typed errors."""
        from .errors import DataFileTruncatedError, from_os_error
        from .hf import _open_regular

        fd = self._fds.get(src)
        if fd is None:
            fd = self._fds[src] = _open_regular(src, "data file")
        done = 0
        while done < nbytes:
            want = min(nbytes - done, 1 << 30)
            try:
                got = os.copy_file_range(fd, dst_fd, want, offset + done, dst_offset + done)
            except OSError as exc:
                if exc.errno not in self._NOT_HERE:
                    # ENOSPC and EDQUOT are the output's; any other error is the source's read
                    full = exc.errno in (errno.ENOSPC, errno.EDQUOT)
                    raise from_os_error(exc, path=dst if full else src,
                                        operation="write" if full else "read") from exc
                got = self._plain(fd, dst_fd, min(want, 8 << 20), offset + done, dst_offset + done, src, dst)
            if got == 0:
                raise DataFileTruncatedError(f"{os.path.basename(src)} ended after {offset + done} bytes, "
                                             f"{offset + nbytes} needed", path=src, expected=offset + nbytes,
                                             found=offset + done)
            done += got

    @staticmethod
    def _plain(fd: int, dst_fd: int, n: int, offset: int, dst_offset: int, src: str, dst: str) -> int:
        from .errors import from_os_error

        try:
            data = os.pread(fd, n, offset)
        except OSError as exc:
            raise from_os_error(exc, path=src, operation="read") from exc
        view = memoryview(data)
        while view:
            try:
                wrote = os.pwrite(dst_fd, view, dst_offset + len(data) - len(view))
            except OSError as exc:
                raise from_os_error(exc, path=dst, operation="write") from exc
            view = view[wrote:]
        return len(data)

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()


def _check_shard(path: str, shard: list) -> None:
    """Open the written shard with the safetensors library: names, dtypes and shapes as meant.
    Raises StorageIOError when it reads back otherwise (the file system returned other bytes)."""
    from safetensors import safe_open

    from .errors import StorageIOError

    with safe_open(path, framework="pt") as f:
        keys = set(f.keys())
        if keys != {s[0] for s in shard}:
            raise StorageIOError(f"{path}: the shard just written reads back with keys {sorted(keys)[:5]}..., "
                                 f"not the {len(shard)} written", path=path)
        for name, _fqn, _d, shape, _nb in shard:
            if tuple(f.get_slice(name).get_shape()) != shape:
                raise StorageIOError(f"{path}: {name} reads back with another shape than written", path=path)


# ---------------------------------------------------------------------------------------------
# DCP, through torch's own writer.


def _to_dcp(src: _Source, dst: str, slice_bytes: int, progress: _Progress, result: dict) -> None:
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
    from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, MetadataIndex,
                                                       TensorProperties)
    from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType

    tensor_leaves, value_leaves = _dcp_leaves(src)
    paths = {**{fqn: p for fqn, p in tensor_leaves}, **{fqn: p for fqn, p, _ in value_leaves}}
    values = {fqn: node for fqn, _, node in value_leaves}

    class StreamingPlanner(DefaultSavePlanner):
        """Plans from the source's manifest instead of an in-memory state dict, and reads each
        chunk only when torch's writer asks for it (resolve_data), so one chunk is in memory."""

        def set_up_planner(self, state_dict, storage_meta=None, is_coordinator=False) -> None:
            self.state_dict = {}
            self._last = None
            self.is_coordinator = is_coordinator
            self.mappings = paths

        def create_local_plan(self) -> SavePlan:
            items = []
            self._chunks: dict = {}
            for fqn, _path in tensor_leaves:
                t = src.tensors[fqn]
                dtype = _dtype(t.dtype)
                props = TensorProperties(dtype=dtype)
                size = torch.Size(t.shape)
                boxes = list(_slices(tuple(t.shape), dtype.itemsize, slice_bytes)) or [((0,) * len(t.shape), tuple(t.shape))]
                for offsets, sizes in boxes:
                    idx = MetadataIndex(fqn, torch.Size(offsets))
                    self._chunks[(fqn, tuple(offsets))] = sizes
                    items.append(WriteItem(index=idx, type=WriteItemType.SHARD if len(boxes) > 1 else WriteItemType.TENSOR,
                                           tensor_data=TensorWriteData(
                                               chunk=ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes)),
                                               properties=props, size=size)))
            for fqn in values:
                items.append(WriteItem(index=MetadataIndex(fqn), type=WriteItemType.BYTE_IO))
            self.plan = SavePlan(items, planner_data=self.mappings)
            return self.plan

        def finish_plan(self, new_plan: SavePlan) -> SavePlan:
            # torch's writer (thread_count=1: one bucket, its serial loader) resolves the tensor
            # items in the final plan's order: read ahead in that order, a slice's worth at a time.
            self._order = [(wi.index.fqn, tuple(wi.index.offset)) for wi in new_plan.items
                           if wi.type != WriteItemType.BYTE_IO]
            self._pos = {k: i for i, k in enumerate(self._order)}
            self._ahead: dict = {}
            return super().finish_plan(new_plan)

        def resolve_data(self, write_item):
            fqn = write_item.index.fqn
            if write_item.type == WriteItemType.BYTE_IO:
                buf = io.BytesIO()
                torch.save(src.subtree(values[fqn]), buf)
                return buf
            # torch's FileSystemWriter keeps the last chunk of every fqn it wrote until the file
            # is closed (its tensor_dict, used only for its safetensors format), which would hold
            # a whole model; the writer is done with the previous chunk when it asks for the next
            # one (one thread, a serial loader), so its memory is released here.
            if self._last is not None:
                self._last.untyped_storage().resize_(0)
            key = (fqn, tuple(write_item.index.offset))
            t = self._ahead.pop(key, None)
            if t is None:
                # Not read ahead (the first item, or the writer took another order): what was read
                # ahead is dropped (memory stays bounded) and the items from this one on are read.
                self._ahead.clear()
                batch, size = [], 0
                for k in self._order[self._pos[key]:]:
                    nbytes = math.prod(self._chunks[k]) * _dtype(src.tensors[k[0]].dtype).itemsize
                    if batch and size + nbytes > slice_bytes:
                        break
                    batch.append((k, k[0], k[1], self._chunks[k]))
                    size += nbytes
                self._ahead = dict(src.stream(batch, slice_bytes))
                t = self._ahead.pop(key)
            progress.update(t.numel() * t.element_size())
            self._last = t
            return t

    from torch.distributed.checkpoint.api import CheckpointException

    writer = dcp.FileSystemWriter(dst, single_file_per_rank=True, sync_files=True, thread_count=1)
    try:
        with warnings.catch_warnings():
            # torch warns that it "assumes the intent is to save in a single process" even when
            # no_dist=True says so: the command line's output is its own.
            warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
            dcp.save({}, storage_writer=writer, planner=StreamingPlanner(), no_dist=True)
    except CheckpointException as exc:  # a BaseException wrapping ours: raise the typed error itself
        failures = [e for e, _tb in exc.failures.values()]
        if failures and isinstance(failures[0], Exception):
            raise failures[0] from None
        raise
    result["files"] = sorted(os.path.join(dst, f) for f in os.listdir(dst) if f != _WORK_MARK)


def _dcp_leaves(src: _Source) -> tuple[list, list]:
    """The entries DCP's own flattening (torch.distributed.checkpoint._traverse) makes of the
    source's nesting, so ``dcp.load`` into the same structure finds every key: mappings are
    walked, a list only when it holds a tensor or a mapping somewhere below, a tuple never (it is
    one value, tensors inside it included). Returns ([(fqn, path)] of streamed tensors,
    [(fqn, path, tree node)] of values written whole with torch.save)."""
    tensors, values = [], []

    def holds_tensor_or_map(node) -> bool:
        if node["t"] == "ref":
            return node["fqn"] in src.tensors
        if node["t"] == "dict":
            return True
        return node["t"] == "list" and any(holds_tensor_or_map(c) for c in node["v"])

    def walk(node, path):
        fqn = ".".join(str(p) for p in path)
        if node["t"] == "dict":
            for k, child in node["k"]:
                walk(child, path + (str(k),))
        elif node["t"] == "list" and any(holds_tensor_or_map(c) for c in node["v"]):
            for i, child in enumerate(node["v"]):
                walk(child, path + (i,))
        elif node["t"] == "ref" and node["fqn"] in src.tensors:
            if node["fqn"] != fqn:
                # Every save names a tensor by its keys joined with "."; DCP's key is that name.
                from .errors import ManifestCorruptError
                raise ManifestCorruptError(f"the MANIFEST's tree places tensor {node['fqn']!r} under the keys "
                                           f"{fqn!r}; no save writes that", path=src.path, key=fqn)
            tensors.append((fqn, path))
        else:
            values.append((fqn, path, node))

    tree = src.manifest.tree
    if tree["t"] != "dict":
        from .errors import UnsupportedValueError
        raise UnsupportedValueError(f"the checkpoint's top level is a {tree['t']}; DCP needs a dict", path=src.path)
    walk(tree, ())
    return tensors, values


# ---------------------------------------------------------------------------------------------
# distckpt, through distckpt.save.


def _to_distckpt(src: _Source, dst: str, slice_bytes: int, progress: _Progress, result: dict, *,
                 before_save: Callable[[], None]) -> None:
    import tempfile

    import torch

    from .fill import reading
    from .save_sync import save

    fd, tmp = tempfile.mkstemp(prefix=".distckpt-convert-", dir=os.path.dirname(os.path.abspath(dst)))
    try:
        # each tensor at a 64-byte aligned offset, so every dtype can view its bytes
        total = sum(-(-math.prod(t.shape) * _dtype(t.dtype).itemsize // 64) * 64 for t in src.tensors.values())
        # Allocated, not sparse: a page of a sparse mapping that the full file system cannot back
        # is a SIGBUS when touched; here it is ENOSPC now (DiskFullError, from convert()).
        os.posix_fallocate(fd, 0, max(total, 1))
        # torch's shared file mapping closes its own descriptor once mapped (a numpy memmap keeps
        # a dup of it open for as long as any view lives, one fd and the scratch file's disk
        # space per conversion when a view is kept in a reference cycle).
        flat = torch.from_file(tmp, shared=True, size=max(total, 1), dtype=torch.uint8)
        os.unlink(tmp)  # the mapping keeps the pages; nothing is left behind on a crash
        tmp = None
        tensors, at = {}, 0
        for fqn, t in src.tensors.items():
            dtype = _dtype(t.dtype)
            nbytes = math.prod(t.shape) * dtype.itemsize
            tensors[fqn] = flat[at:at + nbytes].view(dtype).view(tuple(t.shape)) if nbytes else torch.empty(tuple(t.shape), dtype=dtype)
            at += -(-nbytes // 64) * 64
        # Read straight into the mapped tensors (no copy, nothing allocated per slice): a batch of
        # slices of at most slice_bytes per read pass, for the progress bar's sake.
        batch, size = [], 0
        with reading(keep_open=True):  # the read buffers go before the save starts
            for fqn, t in src.tensors.items():
                # in the stored order: a row-major slice of a transposed tensor spans nearly all of it
                for o, sz in _slices(tuple(t.shape), _dtype(t.dtype).itemsize, slice_bytes, src.order(fqn)):
                    nbytes = math.prod(sz) * _dtype(t.dtype).itemsize
                    if batch and size + nbytes > slice_bytes:
                        src.fill(batch)
                        progress.update(size)
                        batch, size = [], 0
                    batch.append((fqn, o, sz, _narrow(tensors[fqn], o, sz)))
                    size += nbytes
            if batch:
                src.fill(batch)
                progress.update(size)

        state = src.nested(tensors.__getitem__)
        before_save()
        save(state, dst, allow_pickle=src.allow_pickle, metadata=src.metadata() or None)
        del flat, tensors, state, batch
    finally:
        os.close(fd)
        if tmp is not None:
            os.unlink(tmp)
    result["files"] = [dst]


def _narrow(t, offsets, sizes):
    """The box (offsets, sizes) of ``t`` as a view (contiguous for the row-major boxes of
    :func:`_slices`)."""
    for d, (o, n) in enumerate(zip(offsets, sizes)):
        t = t.narrow(d, o, n)
    return t


# ---------------------------------------------------------------------------------------------
# The entry point.


def convert(src: str | os.PathLike, dst: str | os.PathLike, *, to: str, max_shard_size: int = DEFAULT_SHARD_SIZE,
            prefix: str | None = None, dtype: str | None = None, memory_limit: int = DEFAULT_MEMORY_LIMIT,
            allow_pickle: bool = False, verify: bool = True, progress: bool | None = None) -> ConvertResult:
    """Convert the checkpoint at ``src`` (distckpt, DCP or Hugging Face safetensors) into format
    ``to`` at ``dst``.

    Args:
        to: ``"dcp"``, ``"torch"`` (one file), ``"safetensors"`` (a directory), ``"distckpt"``.
        max_shard_size: safetensors only: the cap on one shard's tensor bytes.
        prefix: safetensors only: keep the keys starting with it, without it (``"model."``).
        dtype: safetensors only: cast floating-point tensors to it (``"bf16"``, ``"float16"``...).
        memory_limit: bytes of working memory (tensors are streamed in slices of a quarter of it).
        allow_pickle: allow values the source stores as pickles.
        verify: check the source's checksums (a DCP source has none).
        progress: a tqdm bar on stderr; None: only when stderr is a terminal.

    Side effect: glibc's mmap threshold is pinned at its default 128 KiB for the rest of the
    process (see :func:`_pin_mmap_threshold`): without it freed slices stay in the heap and the
    memory bound does not hold.

    Raises:
        CheckpointExistsError: ``dst`` exists. DiskFullError: the destination's file system lacks
            room for the output (twice its tensor bytes for ``to="distckpt"``: a scratch copy is
            staged beside it), checked first; other OS errors of the destination as their typed
            StorageError (StoragePermissionError for a read-only one). The errors of
            :func:`distckpt.read` for the source;
        UnsupportedValueError for what the target cannot hold (a dtype safetensors lacks, a
        non-tensor value torch.load(weights_only=True) would refuse); ConfigError (a ValueError) for
        bad options and for a URL as ``src`` or ``dst`` (local paths only); for a source that is a
        delta of an incremental chain (converted as the state its chain composes), ChainBrokenError
        for a damaged or missing older link.
    """
    from .errors import CheckpointExistsError, ConfigError

    t0 = time.monotonic()
    if to not in FORMATS:
        raise ConfigError(f"unknown target format {to!r} (one of {', '.join(FORMATS)})", remedy=_OPTIONS)
    if (prefix is not None or dtype is not None) and to != "safetensors":
        raise ConfigError("prefix and dtype apply to --to safetensors only", remedy=_OPTIONS)
    if dtype is not None:
        dtype = _DTYPE_ALIASES.get(dtype, dtype)
        from . import manifest as mf
        if dtype not in mf.DTYPE_ITEMSIZE:   # (dtype_from_name blamed a MANIFEST for a typo)
            raise ConfigError(f"dtype {dtype!r} is not a dtype name (bf16, float16, float32, ...)", remedy=_OPTIONS)
        if not _dtype(dtype).is_floating_point:
            raise ConfigError(f"dtype {dtype!r} is not a floating-point dtype", remedy=_OPTIONS)
    if not isinstance(max_shard_size, int) or max_shard_size < 1:
        raise ConfigError(f"max_shard_size must be a positive number of bytes, not {max_shard_size!r}", remedy=_OPTIONS)
    if memory_limit < 1 << 20:
        raise ConfigError("memory_limit must be at least 1 MiB", remedy=_OPTIONS)
    from .storage import is_url, normalize_path
    for what, p in (("source", src), ("destination", dst)):
        if isinstance(p, str) and is_url(p):
            # A URL made abspath() a local path "./s3:/bucket/..." (written there, exit 0).
            raise ConfigError(f"convert reads and writes local paths only: the {what} {p} is a URL",
                              remedy="Convert on local disk (copy the checkpoint down first: `distckpt convert` "
                                     "streams from and to a file system), then upload the result.")
    from .storage.posix.locate import checkpoint_path
    # A MANIFEST file stands for its directory, as in load, read, inspect and verify.
    # (file:// URLs are local paths: normalize_path strips the scheme.)
    src_s, dst_s = checkpoint_path(src), normalize_path(dst)
    if os.path.lexists(dst_s):
        raise CheckpointExistsError(f"{dst_s} already exists", path=dst_s,
                                    remedy="Choose a new destination or remove the old one first.")
    _pin_mmap_threshold()
    from .storage.posix.loading import identity, raise_if_changed
    # What the source is before its manifest is read: compared again before the output is
    # published, so that a source replaced or rewritten meanwhile (a new download over a Hugging
    # Face directory) is CheckpointRemovedError, never an output mixing its two versions.
    before = identity(src_s)
    source = _open_source(src_s, allow_pickle=allow_pickle, verify=verify)
    _check_room(source, dst_s, to, prefix, dtype)
    # The work directory (DST.tmp) is claimed before any output is written: a killed conversion's
    # is removed, a live one's refused, anything else there refused (it was deleted whatever it
    # was: the source itself when named DST.tmp, an unrelated directory of the user's).
    work = None
    try:
        os.makedirs(os.path.dirname(dst_s), exist_ok=True)
        if to != "distckpt":
            work = _Work.claim(dst_s + ".tmp", src_s)
        return _convert(source, src_s, dst_s, work, t0, to=to, max_shard_size=max_shard_size, prefix=prefix,
                        dtype=dtype, memory_limit=memory_limit, progress=progress,
                        unchanged=lambda: raise_if_changed(src_s, before))
    except BaseException as exc:
        # Only what this conversion created goes: its work directory, while it is still its own
        # (DST appears only by the last rename, complete; a distckpt save commits nothing when it
        # fails).
        if work is not None:
            work.remove()
        if isinstance(exc, OSError):  # the destination's file system: typed (ENOSPC, EROFS, EACCES...)
            from .errors import from_os_error
            raise from_os_error(exc, path=os.path.dirname(dst_s), operation=f"convert --to {to}") from exc
        raise


def _check_room(source: _Source, dst_s: str, to: str, prefix: str | None, dtype: str | None) -> None:
    """DiskFullError up front when the destination's file system cannot hold the output (the
    tensor bytes it will write: for safetensors only the tensors under ``prefix``, cast to
    ``dtype``; twice the bytes for ``--to distckpt``, which stages every tensor in a scratch file
    beside the destination before saving it), instead of a failure half-way (torch's own zip
    writer reports a full disk as an unrelated RuntimeError)."""
    from . import manifest as mf
    from .storage.posix.guards import check_save_space
    needed = 0
    for fqn, t in source.tensors.items():
        d = t.dtype
        if to == "safetensors":
            if prefix is not None and not fqn.startswith(prefix):
                continue
            if dtype is not None and _dtype(d).is_floating_point:
                d = dtype
        needed += math.prod(t.shape) * mf.DTYPE_ITEMSIZE[d]
    check_save_space(os.path.dirname(dst_s), needed * (2 if to == "distckpt" else 1))


def _convert(source: _Source, src_s: str, dst_s: str, work: "_Work | None", t0: float, *, to: str,
             max_shard_size: int, prefix: str | None, dtype: str | None, memory_limit: int,
             progress: bool | None, unchanged: Callable[[], None]) -> ConvertResult:
    from .fill import reading

    slice_bytes = memory_limit // 4
    result: dict[str, Any] = {"files": [], "skipped": {}, "tensors": len(source.tensors)}
    total = _tensor_bytes(source, source.tensors)
    bar = _Progress(total, f"{os.path.basename(src_s)} -> {to}", progress)
    # Output is written in the work directory (DST.tmp) and renamed into place once complete, so
    # a conversion killed half-way never leaves a partial output under DST: a directory (dcp,
    # safetensors) is the work directory itself, a torch file is written inside it.
    try:
        if to == "distckpt":  # keeps its read buffers open only while it reads (not during the save)
            _name_conflicts(source, result)
            _to_distckpt(source, dst_s, slice_bytes, bar, result, before_save=unchanged)
        else:
            wpath = work.path
            # One reader (fd, io_uring, registered slots) per source file for the whole conversion,
            # not one per slice: a slice of a small tensor cost 30-70 ms of set-up before.
            with reading(keep_open=True):
                if to in ("torch", "dcp"):
                    _skip_metadata(source.metadata(), to, result)
                else:
                    _name_conflicts(source, result)
                if to == "torch":
                    _to_torch(source, os.path.join(wpath, _TORCH_WORK_FILE), slice_bytes, bar, result)
                elif to == "safetensors":
                    _to_safetensors(source, wpath, slice_bytes, bar, result, max_shard_size=max_shard_size,
                                    prefix=prefix, cast=dtype)
                else:
                    _to_dcp(source, wpath, slice_bytes, bar, result)
            unchanged()
            work.publish(dst_s, inner=_TORCH_WORK_FILE if to == "torch" else None)
            result["files"] = ([dst_s] if to == "torch" else
                               [os.path.join(dst_s, os.path.relpath(f, wpath)) for f in result["files"]])
    finally:
        bar.close()
    written = sum(_size_of(f) for f in result["files"])
    return ConvertResult(src_s, dst_s, to, result["tensors"], written, result["files"], result["skipped"],
                         time.monotonic() - t0)


#: The file that makes a directory a conversion's work directory: only such a one is ever removed.
_WORK_MARK = ".distckpt-convert"
#: A torch file's name inside the work directory, until it is renamed to DST.
_TORCH_WORK_FILE = "output.pt"


class _Work:
    """The work directory DST.tmp of one conversion, proven its own by an exclusive flock on its
    marker file (:data:`_WORK_MARK`) held from its creation to its publication: a second
    conversion to the same DST finds the lock taken and stops, where it deleted the first one's
    work as a killed run's and left DST partial (an outside trial)."""

    def __init__(self, path: str, fd: int) -> None:
        self.path, self._fd = path, fd

    @classmethod
    def claim(cls, work: str, src: str) -> "_Work":
        """Create ``work`` with its locked marker, first removing one a killed conversion left.

        Raises:
            ConfigError: ``work`` is the source, or holds it.
            SaveInProgressError: another conversion to the same destination is running.
            CheckpointExistsError: something else is at ``work`` (no marker: not a conversion's):
                nothing is removed.
        """
        import fcntl
        import shutil

        from .errors import CheckpointExistsError, ConfigError, SaveInProgressError
        w, s = os.path.realpath(work), os.path.realpath(src)
        if s == w or s.startswith(w + os.sep):
            raise ConfigError(f"the source {src} is the destination's work path {work}: convert writes its output "
                              f"there first", path=src, remedy="Choose another destination (or rename the source).")
        mark = os.path.join(work, _WORK_MARK)
        if os.path.lexists(work):
            if not (os.path.isdir(work) and not os.path.islink(work) and os.path.isfile(mark)
                    and not os.path.islink(mark)):
                raise CheckpointExistsError(
                    f"{work} exists and is no unfinished conversion's (it lacks {_WORK_MARK}); convert writes its "
                    f"output there first, and leaves it alone", path=work,
                    remedy="Move or remove it, or choose another destination.")
            fd = os.open(mark, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise SaveInProgressError(f"another conversion to {work[:-len('.tmp')]} is writing {work}", path=work,
                                          remedy="Wait for it to finish, or convert to another destination.") from None
            finally:
                os.close(fd)   # (a lock taken here goes with it: the directory is removed next)
            log.warning("distckpt: removing %s, left by a conversion that did not finish", work)
            shutil.rmtree(work)
        try:
            os.mkdir(work)
        except FileExistsError:
            raise SaveInProgressError(f"another conversion to {work[:-len('.tmp')]} created {work} just now",
                                      path=work, remedy="Wait for it to finish, or convert to another "
                                                        "destination.") from None
        fd = os.open(mark, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW, 0o644)
        fcntl.flock(fd, fcntl.LOCK_EX)
        os.write(fd, b"the work directory of a `distckpt convert`: removed by the next conversion to the same "
                     b"destination once this one is gone\n")
        return cls(work, fd)

    def _mine(self) -> bool:
        """Whether the marker at the work path is still the one this conversion locked."""
        try:
            st = os.lstat(os.path.join(self.path, _WORK_MARK))
        except OSError:
            return False
        own = os.fstat(self._fd)
        return (st.st_dev, st.st_ino) == (own.st_dev, own.st_ino)

    def publish(self, dst: str, inner: str | None) -> None:
        """Rename the finished work (the directory itself, or the file ``inner`` inside it) to
        ``dst``, durably, once the marker shows it is still this conversion's; release it.

        Raises SaveInProgressError when the work directory is no longer this conversion's."""
        from .errors import SaveInProgressError
        if not self._mine():
            raise SaveInProgressError(f"{self.path} is no longer this conversion's work directory (removed or "
                                      f"replaced meanwhile): nothing is published", path=self.path)
        os.unlink(os.path.join(self.path, _WORK_MARK))
        _publish(os.path.join(self.path, inner) if inner is not None else self.path, dst)
        if inner is not None:
            os.rmdir(self.path)
        os.close(self._fd)
        self._fd = -1

    def remove(self) -> None:
        """Remove the work directory if it is still this conversion's; release it. Never raises."""
        import shutil
        if self._fd < 0:
            return
        try:
            if self._mine():
                shutil.rmtree(self.path, ignore_errors=True)
        finally:
            os.close(self._fd)
            self._fd = -1


def _publish(work: str, dst: str) -> None:
    """Rename the finished ``work`` (a directory or a file, its data already fsynced) to ``dst``,
    durably."""
    if os.path.isdir(work):
        fd = os.open(work, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    os.rename(work, dst)
    fd = os.open(os.path.dirname(dst), os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _size_of(path: str) -> int:
    if os.path.isdir(path):
        return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)
    return os.path.getsize(path)


# ---------------------------------------------------------------------------------------------
# The command line (no torch import here: `distckpt --help` stays fast).


def _cmd_convert(args) -> int:
    import importlib
    # The user names these, never the checkpoint (values.py imports nothing a checkpoint names).
    # Found as `python -m distckpt` finds them: the current directory first, which the installed
    # `distckpt` command's sys.path lacks (kept for the command: such a module may import more
    # of its own later).
    if args.imports and "" not in sys.path:
        try:
            here = os.getcwd()
        except OSError as exc:
            print(f"distckpt convert: --import: the current directory is gone: {exc}", file=sys.stderr)
            return 2
        if here not in sys.path:
            sys.path.insert(0, here)
    for module in args.imports:
        try:
            importlib.import_module(module)
        except Exception as exc:  # noqa: BLE001 - any failure of the user's module is reported as such
            print(f"distckpt convert: --import {module}: {type(exc).__name__}: {exc}", file=sys.stderr)
            return 2
    from .errors import ConfigError
    try:
        res = convert(args.src, args.dst, to=args.to, max_shard_size=args.max_shard_size, prefix=args.prefix,
                      dtype=args.dtype, memory_limit=args.memory_limit, allow_pickle=args.allow_pickle,
                      progress=False if args.no_progress else None)
    except ConfigError as exc:  # a bad option: a usage error, as argparse's own
        print(f"distckpt convert: {exc.message}", file=sys.stderr)
        return 2
    from .errors import format_bytes
    print(f"{res.src} -> {res.dst} ({res.to}): {res.tensors} tensors, {format_bytes(res.bytes)} in "
          f"{len(res.files)} file(s), {res.seconds:.1f} s")
    for key, why in res.skipped.items():
        print(f"  not written: {key} ({why})")
    return 0


def add_parser(sub) -> argparse.ArgumentParser:
    """Register ``distckpt convert`` on the CLI's subparsers."""
    p = sub.add_parser("convert", help="convert a distckpt, DCP or Hugging Face safetensors checkpoint to dcp, torch, safetensors or distckpt",
                       description=__doc__.split("\n\n")[0])
    p.add_argument("src", help="a distckpt checkpoint, a torch.distributed.checkpoint directory or a Hugging Face "
                                "safetensors directory")
    p.add_argument("dst", help="the new file (torch) or directory (dcp, safetensors, distckpt)")
    p.add_argument("--to", required=True, choices=FORMATS, help="the format to write")
    p.add_argument("--max-shard-size", type=size_arg, default=DEFAULT_SHARD_SIZE, metavar="SIZE",
                   help="safetensors: largest shard, e.g. 5GiB (default)")
    p.add_argument("--prefix", help="safetensors: keep keys starting with PREFIX, stripped (e.g. 'model.')")
    p.add_argument("--dtype", help="safetensors: cast floating-point tensors (bf16, fp16, fp32)")
    p.add_argument("--memory-limit", type=size_arg, default=DEFAULT_MEMORY_LIMIT, metavar="SIZE",
                   help="working memory for the conversion (default 1GiB)")
    p.add_argument("--allow-pickle", action="store_true", help="allow values the source stores as pickles")
    p.add_argument("--import", dest="imports", action="append", default=[], metavar="MODULE",
                   help="import MODULE first (repeatable), so that values of its namedtuple, Enum and dataclass "
                        "classes can be rebuilt: distckpt never imports a module the checkpoint names")
    p.add_argument("--no-progress", action="store_true", help="no progress bar even on a terminal")
    p.set_defaults(func=_cmd_convert)
    return p
