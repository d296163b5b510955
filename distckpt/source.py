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
from typing import Iterable, Iterator

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

    def manifest(self, group: ControlGroup | None = None,
                 wanted: Iterable[tuple[str, Box]] | None = None) -> "mf.Manifest":
        """The decoded, validated manifest of the checkpoint (chunks included).

        With a ``group`` of several ranks (collective then), rank 0 reads a distckpt MANIFEST once
        and broadcasts its bytes (or its typed error); every rank decodes and validates it
        itself, so a shared file system is not hit once per rank. A DCP or Hugging Face
        directory is read by every rank (a few KiB per file).

        Chunk records: format version 4 says which data files hold which boxes, so with
        ``wanted`` (the ``(fqn, box)`` pairs this rank will read) each rank reads and checks
        only the indexes of the files holding them (:func:`distckpt.manifest.files_for`), and
        the manifest carries only their chunks (``files_read``; every wanted box is exactly
        covered); when some rank needs more than half of the files, rank 0 reads every index
        once and broadcasts them instead (one all_gather of a count per rank decides). Without
        ``wanted``, and before version 4, every index is read: by rank 0, broadcast with the
        MANIFEST.

        Raises:
            CheckpointNotFoundError, CheckpointIncompleteError: no committed checkpoint at the path.
            ManifestCorruptError, ChecksumMismatchError: a MANIFEST that does not decode.
            DataFileMissingError, DataFileTruncatedError, CheckpointCorruptError: a data file whose
                index cannot be read; and the errors of :func:`distckpt.dcp.load_manifest` /
                :func:`distckpt.hf.load_manifest`, StorageError subclasses.
        """
        if self.format != "distckpt":
            check_checkpoint_dir(self.path)  # a save's tmp directory is no checkpoint, whatever it holds
            return dcp.load_manifest(self.path) if self.format == "dcp" else hf.load_manifest(self.path)
        name = join(self.path, mf.MANIFEST_NAME)
        if group is None or group.world_size == 1:
            if wanted is None:
                return self.store.load_manifest(self.path)
            return self._partial(mf.decode_header(self.store.manifest_bytes(self.path), path=name), wanted)
        payload, manifest = None, None
        if group.rank == 0:
            try:
                data = self.store.manifest_bytes(self.path)
                if wanted is not None and mf.decode_header(data, path=name).format_version >= 4:
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
        # Before version 4 the data files' indexes travel with the MANIFEST: every rank needs
        # every chunk record to plan, and the storage is read once, not once per rank.
        data, indexes, error = group.broadcast(payload)
        if error is not None:
            raise error
        if indexes is not None:
            return manifest if manifest is not None else \
                mf.decode(data, path=name, read_index=lambda header, i: indexes[i])
        # Version 4: every rank decodes the MANIFEST (the same bytes: a corrupt one fails
        # everywhere, before the collective below) and finds the files its boxes need.
        header = mf.decode_header(data, path=name)
        files = self._needed(header, wanted)
        # Each rank reads its own files' indexes, unless some rank needs more than half of them
        # (layouts listed by ranks that every rank holds: ZeRO partitions, non-grid shards):
        # then rank 0 reads every index once and broadcasts them, as before version 4, rather
        # than the storage serving every index to every rank.
        if 2 * max(group.all_gather(len(files))) <= len(header.files):
            # A failure here is this rank's; the load's outcome exchange gives it to every rank.
            return self._read_some(header, files)
        payload = None
        if group.rank == 0:
            try:
                payload = ({i: self.store.read_index(self.path, header, i) for i in range(len(header.files))}, None)
            except Exception as exc:  # noqa: BLE001 - every rank raises it, below
                payload = (None, _portable(exc))
        indexes, error = group.broadcast(payload)
        if error is not None:
            raise error
        return mf.decode(data, path=name, read_index=lambda h, i: indexes[i])

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

    def _partial(self, header: "mf.Manifest", wanted: Iterable[tuple[str, Box]]) -> "mf.Manifest":
        """One process: ``header`` with the chunks of the data files that hold the ``wanted``
        boxes (version 4; before it, every file's)."""
        if header.format_version < 4:
            return mf.decode(self.store.manifest_bytes(self.path), path=join(self.path, mf.MANIFEST_NAME),
                             read_index=lambda h, i: self.store.read_index(self.path, h, i))
        return self._read_some(header, self._needed(header, wanted))

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
