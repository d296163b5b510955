"""The load source: what a load or a read reads from, whatever is at the path.

:func:`open_source` returns one :class:`Source` for every kind of checkpoint distckpt reads:

  * a distckpt checkpoint, local or on an object store: its MANIFEST (and the data files' indexes)
    and data files through the :class:`distckpt.storage.Store` seam's read side;
  * a torch.distributed.checkpoint directory (distckpt.dcp) or a Hugging Face safetensors
    directory (distckpt.hf), local only: their metadata as a manifest, their files through the
    local store;
  * a delta of an incremental chain (distckpt.chain): the links it needs, newest first, each a
    committed local checkpoint of its own.

The caller plans and fills from it (distckpt.restore); a source reads metadata only, never a
tensor's bytes.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import errno
import os
from typing import Callable, Iterable, Iterator

from . import dcp, hf
from . import manifest as mf
from ._dist import ControlGroup, _portable
from .chain import ChainLink, chain_info, chain_of
from .errors import (ChainBrokenError, CheckpointCorruptError, CheckpointIncompleteError, CheckpointNotFoundError,
                     CheckpointRemovedError, ConfigError, StorageError)
from .plan import Box
from .storage import Store, is_url, join, open_store
from .storage.posix.locate import check_checkpoint_dir, checkpoint_path

__all__ = ["Source", "open_source", "pinned"]


@dataclasses.dataclass
class Source:
    """One checkpoint to read: ``path`` (canonical), ``store`` (its back end), ``format``
    (``"distckpt"``, ``"dcp"`` or ``"hf"``)."""

    path: str
    store: Store
    format: str
    # Set by pinned(): the MANIFEST's bytes, the indexes read with them, and their decoding.
    _pin: "tuple[bytes, dict[int, bytes], mf.Manifest] | None" = dataclasses.field(default=None, repr=False)

    def manifest(self, group: ControlGroup | None = None) -> "mf.Manifest":
        """The decoded, validated manifest of the checkpoint, every tensor's chunks included.

        With a ``group`` of several ranks (collective then), rank 0 reads a distckpt MANIFEST and
        its data files' indexes once and broadcasts the bytes (or its typed error); every rank
        decodes and validates them itself, so a shared file system is not hit once per rank. A
        DCP or Hugging Face directory is read by every rank (a few KiB per file).

        Raises:
            CheckpointNotFoundError, CheckpointIncompleteError: no committed checkpoint at the path.
            ManifestCorruptError, ChecksumMismatchError: a MANIFEST that does not decode.
            DataFileMissingError, DataFileTruncatedError, CheckpointCorruptError: a data file whose
                index cannot be read; and the errors of :func:`distckpt.dcp.load_manifest` /
                :func:`distckpt.hf.load_manifest`, StorageError subclasses.
        """
        return self._open(group, by_boxes=False)

    def manifest_for_boxes(self, group: ControlGroup | None = None
                           ) -> "mf.Manifest | Callable[[Iterable[tuple[str, Box]]], mf.Manifest]":
        """For a load: :meth:`manifest`, or, for a format-4 checkpoint, a function of the
        ``(fqn, box)`` pairs this rank wants that reads and checks the indexes of the data files
        holding them only (:func:`distckpt.manifest.files_for`) and returns the manifest with
        their chunks (``files_read``; every wanted box exactly covered). The function is this
        rank's alone (no collective): a failure in it is this rank's, which the load's outcome
        exchange gives to every rank.

        Collective like :meth:`manifest` (rank 0 reads the MANIFEST and broadcasts it): every
        rank calls it before any step of its own that may fail. The whole manifest comes back
        instead, every index read once by rank 0 and broadcast as before format 4, when a
        tensor's chunks are spread over more than half of the data files without a grid (ZeRO's
        flat partitions, shards listed by ranks): then most ranks would read most indexes, and
        the storage would serve each of them to every rank.

        Raises: as :meth:`manifest` (the function: its index errors).
        """
        if self._pin is not None:
            return self._open(group, by_boxes=False)  # decoded whole already: nothing left to save
        return self._open(group, by_boxes=True)

    def _decode_whole(self) -> "tuple[bytes, dict[int, bytes], mf.Manifest]":
        """(MANIFEST bytes, every data file's index bytes, the manifest they decode to)."""
        data = self.store.manifest_bytes(self.path)
        indexes: dict[int, bytes] = {}

        def read_index(header: "mf.Manifest", i: int) -> bytes:
            indexes[i] = self.store.read_index(self.path, header, i)
            return indexes[i]

        return data, indexes, mf.decode(data, path=join(self.path, mf.MANIFEST_NAME), read_index=read_index)

    def _open(self, group: ControlGroup | None, by_boxes: bool):
        if self.format != "distckpt":
            check_checkpoint_dir(self.path)  # a save's tmp directory is no checkpoint, whatever it holds
            return dcp.load_manifest(self.path) if self.format == "dcp" else hf.load_manifest(self.path)
        name = join(self.path, mf.MANIFEST_NAME)
        if self._pin is not None and (group is None or group.world_size == 1):
            return self._pin[2]
        if group is None or group.world_size == 1:
            if not by_boxes:
                return self.store.load_manifest(self.path)
            data = self.store.manifest_bytes(self.path)
            header = mf.decode_header(data, path=name)
            if header.format_version >= 4:  # one process: reading only what it needs always pays
                return lambda wanted: self._read_some(header, self._needed(header, wanted))
            return mf.decode(data, path=name, read_index=lambda h, i: self.store.read_index(self.path, h, i))
        payload, manifest = None, None
        if group.rank == 0 and self._pin is not None:
            payload = (self._pin[0], self._pin[1], None)  # what this rank decoded: nothing read again
        elif group.rank == 0:
            try:
                data = self.store.manifest_bytes(self.path)
                if by_boxes and _by_boxes(mf.decode_header(data, path=name)):
                    payload = (data, None, None)  # each rank reads the indexes it needs
                else:
                    indexes: dict[int, bytes] = {}

                    def read_index(header: "mf.Manifest", i: int) -> bytes:
                        indexes[i] = self.store.read_index(self.path, header, i)
                        return indexes[i]

                    manifest = mf.decode(data, path=name, read_index=read_index)
                    payload = (data, indexes, None)
            except Exception as exc:  # noqa: BLE001 - every rank raises it, below
                payload = (None, None, _portable(exc))
        # Unless each rank reads its own (format 4), the data files' indexes travel with the
        # MANIFEST: every rank needs every chunk record to plan, and the storage is read once.
        data, indexes, error, rank0_path = group.broadcast(None if payload is None else (*payload, self.path))
        if error is not None:
            raise error
        if rank0_path != self.path:
            # Rank 0's MANIFEST with this rank's data files would be a checksum error that blames
            # healthy checkpoints (or a "removed while read" for a path that never existed).
            raise ConfigError(f"the ranks of one load passed different paths: rank 0 {rank0_path!r}, rank "
                              f"{group.rank} {self.path!r}", path=self.path,
                              remedy="Pass every rank the same checkpoint path.")
        if self._pin is not None:
            if data != self._pin[0]:  # the MANIFEST holds its indexes' checksums: its bytes say it all
                # This rank's other reads of the block used its own copy: rank 0's would mix two saves.
                raise CheckpointRemovedError(
                    f"the checkpoint at {self.path} changed between the ranks' first reads of it (rank 0 read "
                    f"another MANIFEST than rank {group.rank}): it was overwritten while it was being loaded",
                    path=self.path, renamed_to=None, replaced=True)
            return self._pin[2]
        if indexes is None:
            header = mf.decode_header(data, path=name)  # the same bytes: the same outcome on every rank
            return lambda wanted: self._read_some(header, self._needed(header, wanted))
        if manifest is not None:
            return manifest
        return mf.decode(data, path=name, read_index=lambda header, i: indexes[i])

    def _needed(self, header: "mf.Manifest", wanted: Iterable[tuple[str, Box]]) -> set[int]:
        """The data files holding the ``wanted`` boxes (by :func:`distckpt.manifest.files_for`)."""
        files: set[int] = set()
        for fqn, box in wanted:
            t = header.tensors.get(fqn)
            # A key the checkpoint lacks, or a box that does not fit it, is the planner's error
            # to report (missing key, shape mismatch): no file is needed for it here.
            if t is not None and len(box.offsets) == len(t.shape) and all(
                    o + s <= n for o, s, n in zip(box.offsets, box.sizes, t.shape)):
                files.update(mf.files_for(header, fqn, box))
        return files

    def _read_some(self, header: "mf.Manifest", files: set[int]) -> "mf.Manifest":
        """``header`` (version 4) with the chunks of data files ``files`` attached and checked."""
        name = join(self.path, mf.MANIFEST_NAME)
        records = {i: mf.parse_index(header, i, self.store.read_index(self.path, header, i), name)
                   for i in sorted(files)}
        return mf.with_chunks(header, records, name, partial=True)

    def links(self, manifest: "mf.Manifest") -> list[ChainLink] | None:
        """For a delta of an incremental chain whose manifest is ``manifest``: every link it needs,
        newest (this checkpoint) first, base last, each with its manifest (every rank reads its
        own). None for any other checkpoint (a full link loads as a plain checkpoint).

        Raises:
            ChainBrokenError: a link is missing, replaced, damaged or of another chain.
            ConfigError: the delta is on an object store (chains are local).
        """
        info = chain_info(manifest)
        if info is not None and info.get("kind") not in ("full", "delta"):
            # (a link of a kind this version does not know is not read as a plain checkpoint)
            raise ChainBrokenError(f"incremental chain broken at {self.path}: its kind is {info.get('kind')!r}, not "
                                   f"'full' or 'delta'", path=self.path, link=self.path,
                                   reason=f"unknown kind {info.get('kind')!r}")
        if info is None or info.get("kind") != "delta":
            return None
        if is_url(self.path):
            raise ConfigError(f"{self.path} is a delta of an incremental chain: chains are read from local "
                              f"directories only")
        return chain_of(self.path)

    def guard(self) -> contextlib.AbstractContextManager:
        """Around the reads of this checkpoint: an error that is what its removal or replacement
        mid-read looks like leaves as CheckpointRemovedError, and so does a read that succeeded
        while another checkpoint took the name (the store's ``guard_reads``). For a pinned
        source, replaced means since the pin: its reads use the MANIFEST read then."""
        if self._pin is None:
            return self.store.guard_reads(self.path)
        return self._pinned_guard()

    @contextlib.contextmanager
    def _pinned_guard(self) -> Iterator[None]:
        # The store's guard compares with what the name held when this read began; a pinned
        # read may begin after another save took the name, and then reads that save's data
        # files with the pin's MANIFEST: its checksum errors are the replacement, not damage.
        with self.store.guard_reads(self.path):
            try:
                yield
            except (CheckpointCorruptError, CheckpointIncompleteError, StorageError) as exc:
                # What a replacement looks like (the other save's files: sizes, checksums, a file
                # gone); an outage (EIO, a timeout) is not, and says so itself.
                if isinstance(exc, StorageError) and not isinstance(exc, CheckpointIncompleteError) \
                        and exc.errno not in (errno.ENOENT, errno.ESTALE):
                    raise
                try:
                    now = self.store.manifest_bytes(self.path)
                except (CheckpointNotFoundError, CheckpointIncompleteError):
                    now = None  # no MANIFEST there any more: removed
                except Exception:  # noqa: BLE001 - cannot tell now: the read's own error stands
                    raise exc from None
                if now == self._pin[0]:
                    raise
                raise CheckpointRemovedError(
                    f"the checkpoint at {self.path} was {'replaced by another save' if now else 'removed'} "
                    f"after its MANIFEST was read for this block of reads; the read failed with "
                    f"{type(exc).__name__}: {getattr(exc, 'message', exc)}", path=self.path,
                    rank=getattr(exc, "rank", None), renamed_to=None, replaced=now is not None) from exc

    @contextlib.contextmanager
    def guard_links(self, links: list[ChainLink]) -> Iterator[None]:
        """:meth:`guard` for the older links of a chain (``links`` as :meth:`links` returns them)."""
        with contextlib.ExitStack() as stack:
            for link in links[1:]:
                stack.enter_context(self.store.guard_reads(link.path))
            yield


def _by_boxes(header: "mf.Manifest") -> bool:
    """Whether the ranks of a load read the indexes their boxes need themselves: format 4, and no
    tensor spread over more than half of the data files without a grid."""
    if header.format_version < 4:
        return False
    half = len(header.files) / 2
    return all(t.where[0] == "grid" or sum(stop - start for start, stop in t.where[1]) <= half
               for t in header.tensors.values())


# The sources pinned by pinned() in this context, by canonical path.
_PINNED: contextvars.ContextVar[dict[str, Source]] = contextvars.ContextVar("distckpt_pinned", default={})


@contextlib.contextmanager
def pinned(path: str | os.PathLike, storage_options: dict | None = None) -> Iterator[Source]:
    """Several reads and loads of one checkpoint as one: inside the block, :func:`open_source` of
    ``path`` gives one source whose MANIFEST (and every data file's index) was read and decoded
    once, on entry, so a caller that reads a checkpoint key by key (DeepSpeed's engine loads its
    files one after another) decodes it once, not once per call. The block is guarded as a whole
    (:meth:`Source.guard`): if another save takes the name between two of its reads, the block
    raises CheckpointRemovedError instead of returning state from two checkpoints. A load with a
    group still exchanges the MANIFEST's bytes from rank 0 (from its pin, if it pinned): a rank
    that did not pin uses them as always, and a pinned rank whose copy differs raises
    CheckpointRemovedError. Nested for the same path, the outer pin is used. A DCP or Hugging
    Face directory is not pinned (its metadata is read per call, as before).

    Raises: on entry, the errors of :meth:`Source.manifest`; CheckpointRemovedError as above.
    """
    source = open_source(path, storage_options)
    pins = _PINNED.get()
    if source.path in pins or source.format != "distckpt":
        yield pins.get(source.path, source)
        return
    with source.guard():
        source._pin = source._decode_whole()
        token = _PINNED.set({**pins, source.path: source})
        try:
            yield source
        finally:
            _PINNED.reset(token)
            source._pin = None  # kept after the block, its MANIFEST could meet another save's files


def open_source(path: str | os.PathLike, storage_options: dict | None = None) -> Source:
    """The source of the checkpoint at ``path``: a local path (a MANIFEST file stands for its
    directory) or an fsspec URL (``storage_options`` as :func:`distckpt.save`). Only looks at
    what the path holds; the manifest is read by :meth:`Source.manifest`. Inside :func:`pinned`
    of the same path, its pinned source.

    Raises:
        ConfigError: ``storage_options`` for a local path, or a URL scheme fsspec does not know.
    """
    path = checkpoint_path(path)
    store = open_store(path, storage_options)
    pin = _PINNED.get().get(path)
    if pin is not None:
        return pin
    fmt = "distckpt"
    if not is_url(path):
        if dcp.is_dcp_checkpoint(path):  # torch.distributed.checkpoint's layout: its .metadata
            fmt = "dcp"
        elif hf.is_hf_checkpoint(path):  # a Hugging Face safetensors directory: its headers
            fmt = "hf"
    return Source(path, store, fmt)
