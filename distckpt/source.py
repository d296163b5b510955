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
import dataclasses
import os
from typing import Callable, Iterable, Iterator

from . import dcp, hf
from . import manifest as mf
from ._dist import ControlGroup, _portable
from .chain import ChainLink, chain_info, chain_of
from .errors import ConfigError
from .plan import Box
from .storage import Store, is_url, join, open_store
from .storage.posix.locate import check_checkpoint_dir, checkpoint_path

__all__ = ["Source", "open_source"]


@dataclasses.dataclass
class Source:
    """One checkpoint to read: ``path`` (canonical), ``store`` (its back end), ``format``
    (``"distckpt"``, ``"dcp"`` or ``"hf"``)."""

    path: str
    store: Store
    format: str

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
        return self._open(group, by_boxes=True)

    def _open(self, group: ControlGroup | None, by_boxes: bool):
        if self.format != "distckpt":
            check_checkpoint_dir(self.path)  # a save's tmp directory is no checkpoint, whatever it holds
            return dcp.load_manifest(self.path) if self.format == "dcp" else hf.load_manifest(self.path)
        name = join(self.path, mf.MANIFEST_NAME)
        if group is None or group.world_size == 1:
            if not by_boxes:
                return self.store.load_manifest(self.path)
            data = self.store.manifest_bytes(self.path)
            header = mf.decode_header(data, path=name)
            if header.format_version >= 4:  # one process: reading only what it needs always pays
                return lambda wanted: self._read_some(header, self._needed(header, wanted))
            return mf.decode(data, path=name, read_index=lambda h, i: self.store.read_index(self.path, h, i))
        payload, manifest = None, None
        if group.rank == 0:
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
        if info is None or info.get("kind") != "delta":
            return None
        if is_url(self.path):
            raise ConfigError(f"{self.path} is a delta of an incremental chain: chains are read from local "
                              f"directories only")
        return chain_of(self.path)

    def guard(self) -> contextlib.AbstractContextManager:
        """Around the reads of this checkpoint: an error that is what its removal or replacement
        mid-read looks like leaves as CheckpointRemovedError, and so does a read that succeeded
        while another checkpoint took the name (the store's ``guard_reads``)."""
        return self.store.guard_reads(self.path)

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


def open_source(path: str | os.PathLike, storage_options: dict | None = None) -> Source:
    """The source of the checkpoint at ``path``: a local path (a MANIFEST file stands for its
    directory) or an fsspec URL (``storage_options`` as :func:`distckpt.save`). Only looks at
    what the path holds; the manifest is read by :meth:`Source.manifest`.

    Raises:
        ConfigError: ``storage_options`` for a local path, or a URL scheme fsspec does not know.
    """
    path = checkpoint_path(path)
    store = open_store(path, storage_options)
    fmt = "distckpt"
    if not is_url(path):
        if dcp.is_dcp_checkpoint(path):  # torch.distributed.checkpoint's layout: its .metadata
            fmt = "dcp"
        elif hf.is_hf_checkpoint(path):  # a Hugging Face safetensors directory: its headers
            fmt = "hf"
    return Source(path, store, fmt)
