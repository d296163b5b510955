"""distckpt as the storage layer of torch.distributed.checkpoint (DCP): a StorageWriter and a
StorageReader.

    import torch.distributed.checkpoint as dcp
    from distckpt.integrations.dcp import DistCkptStorageReader, DistCkptStorageWriter

    dcp.save(state_dict, storage_writer=DistCkptStorageWriter("/ckpt/step_100"))
    dcp.load(state_dict, storage_reader=DistCkptStorageReader("/ckpt/step_100"))

DCP's planner decides the layout (which rank writes which chunk, deduplicated replicas, resharding
on load); distckpt stores it. What the writer produces is an ordinary distckpt checkpoint (a
MANIFEST and one data file per rank, block checksums, ``distckpt verify`` / ``inspect`` / ``read``
/ ``load`` understand it), and the reader reads any whole checkpoint distckpt reads (one written by
this writer, by ``distckpt.save``, or a DCP ``FileSystemWriter`` directory; a delta of an
incremental chain is read as the state its chain composes, distckpt.chainview).

How DCP's calls map onto a distckpt save (docs/INTEROP.md):

  * ``write_data`` (every rank): the items DCP's plan gives this rank become distckpt pieces (a
    chunk of a tensor with its global box; a value DCP serialized as bytes). distckpt's own PLAN,
    PREPARE and WRITE phases run over the process group: each rank's data file is written and
    durable, but nothing is visible at the path. A failure on any rank is raised on every rank.
  * ``finish`` (the coordinator): the MANIFEST is published atomically, DCP's planner data inside
    it. This is the commit point, exactly as in ``distckpt.save``; before it the path holds no
    checkpoint, an old one at the path (``overwrite=True``) stays whole.
  * ``read_metadata`` (every rank): DCP's Metadata built from the MANIFEST and the data files'
    indexes (no pickle is read); ``read_data``: each ReadItem is a box of a stored chunk, read
    into the planner's destination with distckpt's reader (only the bytes needed, checksums
    verified).

Loading never runs code from the checkpoint: DCP's default load planner unpickles the bytes of
non-tensor values with ``torch.load(weights_only=False)``. The reader decodes them first with
``torch.load(weights_only=True)`` (torch's restricted unpickler; anything else is a
PickleNotAllowedError naming the key) and hands the planner bytes re-serialized from the decoded
value, so the planner's unpickler only ever sees data this process produced.
"""

from __future__ import annotations

import io
import os
import uuid
from typing import Any

import torch
from torch.distributed.checkpoint import StorageReader, StorageWriter
from torch.distributed.checkpoint.metadata import (BytesStorageMetadata, ChunkStorageMetadata, Metadata,
                                                   MetadataIndex, StorageMeta, TensorProperties,
                                                   TensorStorageMetadata)
from torch.distributed.checkpoint.planner import LoadItemType, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from .. import dcp as dcp_format
from .. import manifest as mf
from .._dist import ControlGroup, control_group, is_distributed
from ..commit import WrittenSave, write_uncommitted
from ..coordinator import SAVE_GATE
from ..errors import CheckpointCorruptError, ConfigError, PickleNotAllowedError
from ..fill import Part, box_tasks, fill_parts
from ..flatten import LocalPieces, Piece
from ..gcpause import gc_paused
from ..restore import _object_value, load_manifest
from ..saveplan import plan_save
from ..storage import normalize_path, open_store
from ..tensorbytes import dtype_from_name
from ..values import decode_value, encode_value

__all__ = ["DistCkptStorageWriter", "DistCkptStorageReader"]



def _checkpoint_path(checkpoint_id: str | os.PathLike | None, current: str | None) -> str:
    if checkpoint_id is not None:
        return normalize_path(checkpoint_id)
    if current is None:
        raise ConfigError("no checkpoint path: pass it to the storage writer/reader or as dcp's checkpoint_id",
                          remedy="Pass the path: DistCkptStorageWriter(path) / DistCkptStorageReader(path), or "
                                 "dcp.save(..., checkpoint_id=path) / dcp.load(..., checkpoint_id=path).")
    return current


def _done(value: Any) -> Future:
    fut: Future = Future()
    fut.set_result(value)
    return fut


def _pieces(plan, planner) -> tuple[dict[str, Any], list[WriteResult]]:
    """This rank's items of DCP's plan as a distckpt state dict ({fqn: LocalPieces | bytes}) and
    the WriteResults DCP expects. Raises what the planner's ``resolve_data`` raises, and
    ConfigError for a resolved tensor whose shape is not its chunk's."""
    state: dict[str, Any] = {}
    results: list[WriteResult] = []
    for item in plan.items:
        fqn = item.index.fqn
        data = planner.resolve_data(item)
        if item.type == WriteItemType.BYTE_IO:
            raw = data.getvalue() if isinstance(data, io.BytesIO) else bytes(data.read())
            state[fqn] = raw
            results.append(WriteResult(index=item.index, size_in_bytes=len(raw), storage_data=None))
            continue
        td = item.tensor_data
        tensor = data.detach()
        if tuple(tensor.shape) != tuple(td.chunk.sizes):
            raise ConfigError(f"{fqn}: the planner resolved a tensor of shape {list(tensor.shape)} for a chunk "
                              f"of sizes {list(td.chunk.sizes)}")
        entry = state.setdefault(fqn, LocalPieces(tuple(td.size), td.properties.dtype, []))
        entry.pieces.append(Piece(tuple(td.chunk.offsets), tuple(td.chunk.sizes), tensor))
        results.append(WriteResult(index=item.index, size_in_bytes=tensor.numel() * tensor.element_size(),
                                   storage_data=None))
    return state, results


def _group_size(process_group: Any) -> int:
    """Ranks of ``process_group`` (the default group for None); 1 without torch.distributed."""
    if not is_distributed():
        return 1
    import torch.distributed as dist
    return dist.get_world_size(process_group)


class DistCkptStorageWriter(StorageWriter):
    """A DCP StorageWriter that saves through distckpt (module docstring).

    Args:
        path: the checkpoint directory (local, or an fsspec URL such as ``s3://bucket/step_100``);
            ``dcp.save(..., checkpoint_id=...)`` overrides it per save.
        process_group: the group ``dcp.save`` runs on (default: the world). distckpt's collectives
            run on a gloo side group of it; DCP's coordinator must be its rank 0 (the default).
        overwrite: replace a committed checkpoint at the path atomically (default: refuse with
            CheckpointExistsError, where DCP's FileSystemWriter overwrites files in place).
        storage_options: fsspec options for a URL path (as :func:`distckpt.save`).
        metadata: plain data stored in the MANIFEST (``meta["user"]``).
    """

    def __init__(self, path: str | os.PathLike | None = None, *, process_group: Any = None,
                 overwrite: bool = False, storage_options: dict | None = None, metadata: dict | None = None):
        super().__init__()
        if metadata is not None and dcp_format.WRITER_META_KEY in metadata:
            raise ConfigError(f"metadata key {dcp_format.WRITER_META_KEY!r} is reserved for DCP's own metadata")
        self.path = normalize_path(path) if path is not None else None
        self.process_group = process_group
        self.overwrite = overwrite
        self.storage_options = storage_options
        self.metadata = metadata
        self.save_id: str | None = None
        self._use_collectives = True
        self._is_coordinator = False
        self._alone = False  # dcp.save(no_dist=True) in a job of several ranks (prepare_global_plan)
        self._written: WrittenSave | None = None

    # A writer travels to DCP's background process in its "process" async mode: only the
    # configuration is pickled, never a save in flight (its lock belongs to this process).
    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state["_written"] = None
        state["process_group"] = None  # the background process saves on its own default group
        return state

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        """True for any path string: a local directory or an fsspec URL."""
        return isinstance(checkpoint_id, (str, os.PathLike))

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        """Start a new save (DCP calls it first). A save left written but not committed by an
        earlier, failed ``dcp.save`` is removed and its lock released."""
        self._abandon()
        self._alone = False
        self.path = _checkpoint_path(checkpoint_id, self.path)
        self.save_id = uuid.uuid4().hex

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=self.path, save_id=self.save_id or "")

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        """Raises ConfigError when no path was given (DCP calls reset() only with a
        checkpoint_id); the coordinator's check is in :meth:`_group`."""
        self.path = _checkpoint_path(None, self.path)
        self._is_coordinator = is_coordinator
        self._use_collectives = kwargs.get("use_collectives", True)

    def prepare_local_plan(self, plan):
        return plan

    def prepare_global_plan(self, plans):
        # DCP calls this on its coordinator with every rank's plan. One plan while the process
        # group has several ranks is dcp.save(no_dist=True): DCP then makes every calling process
        # a coordinator of rank 0 and passes use_collectives=True all the same, so this is the one
        # place the writer can tell. It must then save alone: a collective over the group would
        # wait for ranks that are not saving until DISTCKPT_TIMEOUT_S (or, on a rank other than
        # 0, refuse it as a misplaced coordinator).
        size = _group_size(self.process_group)
        self._alone = len(plans) == 1 and size > 1
        if len(plans) > 1 and len(plans) != size:
            # dcp.save runs on a group other than the writer's: its collectives would wait for
            # ranks that are not saving until DISTCKPT_TIMEOUT_S, then blame a lost peer. Raised
            # here, on DCP's coordinator, DCP hands it to every rank of its group at once.
            raise ConfigError(f"dcp.save runs on {len(plans)} ranks, but DistCkptStorageWriter's process group has "
                              f"{size}", remedy="Pass the group dcp.save runs on to the writer too: "
                              "DistCkptStorageWriter(path, process_group=group).")
        return plans

    def _group(self) -> ControlGroup:
        if not self._use_collectives or self._alone:
            return ControlGroup(None, 0, 1)
        # The "dcp" channel only, never the control channel's arrival check: dcp.async_save runs
        # this in DCP's thread, beside the caller's own saves and loads on the control channel.
        group = control_group(self.process_group, channel="dcp", operation="dcp.save()")
        if (group.rank == 0) != self._is_coordinator:
            raise ConfigError(f"DCP's coordinator must be rank 0 of the process group (this is rank {group.rank}, "
                              f"coordinator={self._is_coordinator})")
        return group

    def write_data(self, plan, planner) -> Future:
        """Write this rank's items (DCP's plan) into its distckpt data file, durable, uncommitted.

        Collective over the process group. Raises on every rank the typed error of the rank(s)
        that failed (distckpt.save's errors before its commit point; an item this rank could not
        resolve, such as a value DCP cannot serialize, included); nothing is then visible."""
        from ..save_async import raise_background_failure, wait_for_saves
        wait_for_saves()  # distckpt's own async save in flight issues collectives too: it goes first
        group = self._group()
        raise_background_failure(group)  # with every rank of the group: all raise, or none does
        state, results, error = {}, [], None
        try:
            state, results = _pieces(plan, planner)
        except Exception as exc:  # noqa: BLE001 - reported to every rank just below
            error = exc
        # A rank that failed here must not leave the others waiting in the save's collectives
        # until their timeout: every rank learns of it first, and all raise.
        group.exchange_outcome(error, operation="dcp.save")
        with SAVE_GATE, gc_paused():
            # Every value here is bytes DCP serialized or a tensor piece: replicas were already
            # deduplicated by DCP's planner, so each key has one holder ("check" finds a planner
            # that did not dedup a value, and LocalPieces refuse overlapping tensor pieces).
            planned = plan_save(group, state_dict=state, allow_pickle=False, metadata=None, path=self.path)
            self._written = write_uncommitted(group, planned, final_dir=self.path, overwrite=self.overwrite,
                                              storage_options=self.storage_options)
        return _done(results)

    def finish(self, metadata: Metadata, results) -> None:
        """Commit (the coordinator): the MANIFEST is published atomically with DCP's planner data.

        Raises the publish errors of :func:`distckpt.save`'s commit (nothing committed unless the
        error says ``published``); UnsupportedValueError: planner data that distckpt cannot store
        without pickle (DefaultSavePlanner's is plain paths)."""
        written, self._written = self._written, None
        if written is None:
            raise ConfigError("finish() without a successful write_data() in this process")
        try:
            kind, stored = encode_value("dcp.planner_data", metadata.planner_data, allow_pickle=False)
            meta = dict(self.metadata or {})
            meta[dcp_format.WRITER_META_KEY] = {"version": metadata.version, "planner_data": [kind, stored]}
        except BaseException:
            written.abandon()
            raise
        written.commit(meta)

    def _abandon(self) -> None:
        written, self._written = self._written, None
        if written is not None:
            written.abandon()

    def __del__(self) -> None:  # a writer dropped between write_data and finish: release its lock
        try:
            self._abandon()
        except Exception:  # noqa: BLE001 - best effort at interpreter shutdown; the next save reclaims
            pass


# How many list places DCP's planner data may leave without a key, all lists together (see
# DistCkptStorageReader._check_planner_data): set_element pads them with None, 8 bytes each.
_LIST_PADDING = 1 << 22


class DistCkptStorageReader(StorageReader):
    """A DCP StorageReader over any whole checkpoint distckpt reads (module docstring).

    Args:
        path: the checkpoint (local or fsspec URL); ``dcp.load(..., checkpoint_id=...)`` overrides it.
        storage_options: fsspec options for a URL path.
        verify: check the crc32c of every block read (default True).
        allow_pickle: let DCP's planner unpickle non-tensor values torch's restricted unpickler
            refuses (only for trusted checkpoints).
    """

    def __init__(self, path: str | os.PathLike | None = None, *, storage_options: dict | None = None,
                 verify: bool = True, allow_pickle: bool = False):
        super().__init__()
        self.path = normalize_path(path) if path is not None else None
        self.storage_options = storage_options
        self.verify = verify
        self.allow_pickle = allow_pickle
        self._manifest: mf.Manifest | None = None
        self._chain = None  # a delta's ChainView (_loaded)
        self.load_id: str | None = None

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state["_manifest"], state["_chain"] = None, None
        return state

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return isinstance(checkpoint_id, (str, os.PathLike))

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        self.path = _checkpoint_path(checkpoint_id, self.path)
        self._manifest, self._chain = None, None
        self.load_id = uuid.uuid4().hex

    def _loaded(self) -> "mf.Manifest":
        if self._manifest is None:
            from ..chain import chain_info, chain_of
            path = _checkpoint_path(None, self.path)
            manifest = load_manifest(path, self.storage_options)
            info = chain_info(manifest)
            if info is not None and info.get("kind") == "delta":
                # A delta holds only the rows that changed: DCP is shown the state its chain
                # composes, as distckpt.read gives it (it used to get the delta's own records).
                from ..chainview import ChainView
                self._chain = ChainView(chain_of(path), verify=self.verify)
                manifest = self._chain.manifest
            self._manifest = manifest
        return self._manifest

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """DCP's Metadata of the checkpoint, from its MANIFEST and data file indexes.

        Raises: what :func:`distckpt.load` raises before reading data (CheckpointNotFoundError,
        CheckpointIncompleteError, ManifestCorruptError, DataFileMissingError, ...), and for a
        delta of an incremental chain (shown as the state its chain composes) ChainBrokenError."""
        manifest = self._loaded()
        md: dict[str, Any] = {}
        storage: dict[MetadataIndex, Any] = {}
        for fqn, entry in manifest.tensors.items():
            chunks = [ChunkStorageMetadata(offsets=torch.Size(c.offsets), sizes=torch.Size(c.sizes))
                      for c in entry.chunks]
            md[fqn] = TensorStorageMetadata(properties=TensorProperties(dtype=dtype_from_name(entry.dtype, path=self.path)),
                                            size=torch.Size(entry.shape), chunks=chunks)
            for c in entry.chunks:
                storage[MetadataIndex(fqn, torch.Size(c.offsets))] = None
        for fqn in manifest.objects:
            md[fqn] = BytesStorageMetadata()
            storage[MetadataIndex(fqn)] = None
        dcp_meta = dcp_format.writer_meta(manifest)
        # A checkpoint DCP did not write (distckpt.save's, a FileSystemWriter directory's, whose
        # .metadata paths are the MANIFEST's tree): DCP's planner_data from the tree, so a load
        # planner that rebuilds the state dict from the metadata (_EmptyStateDictLoadPlanner,
        # behind dcp's load-everything helpers) nests it as FileSystemReader does, not flat. DCP
        # names every dict key by str(key) (its traversal's rule); an int key kept as an int would
        # make set_element build a list (a dict {0: .., 1: ..} silently became a list, and
        # {1: .., 3: ..} or {0: .., "a": ..} failed untyped).
        planner_data = {f: p for f, p in mf.tree_paths(manifest.tree, dict_key=str).items() if f in md} or None
        version = None
        if dcp_meta is not None:
            try:
                version = dcp_meta.get("version")
                kind, stored = dcp_meta["planner_data"]
                if kind == "pickle":
                    raise TypeError("planner data stored as a pickle")
                planner_data = decode_value(kind, stored, fqn="dcp.planner_data", path=self.path)
            except (AttributeError, KeyError, TypeError, ValueError) as exc:
                raise CheckpointCorruptError(f"the MANIFEST's DCP planner data is malformed: {exc!r}",
                                             path=self.path) from exc
        self._check_planner_data(planner_data)
        # In the saved order (DCP's planner data, else the MANIFEST's tree), as FileSystemReader's
        # metadata is: a planner that builds the state dict from it (_EmptyStateDictLoadPlanner)
        # returns its keys in that order (tensors then values, otherwise).
        order = list(planner_data) if isinstance(planner_data, dict) else []
        md = {**{f: md[f] for f in order if f in md}, **md}
        return Metadata(state_dict_metadata=md, planner_data=planner_data, storage_data=storage,
                        storage_meta=StorageMeta(checkpoint_id=self.path, load_id=self.load_id or ""),
                        version=version)

    def _check_planner_data(self, planner_data: Any) -> None:
        """DCP's planner data maps each key to its path in the nested state dict, and DCP's
        planners nest and flatten by it (``set_element``): each path must be a non-empty sequence
        of str / int keys, a str first, that joins back to its key (DCP's own flattening), or keys
        go missing (a path "xyz" nests as x.y.z) or two keys land on one place and one is silently
        lost. The paths together must also form one tree that ``set_element`` can build: no key
        both a value and a container, no container reached by str keys (a dict) and by int ones (a
        list), and every int a non-negative list position, the places left without a key in all
        lists together at most _LIST_PADDING (``set_element`` pads a list with None up to its
        position: a hostile 10**12 would exhaust memory, a negative one fail untyped). Places
        without a key are legitimate: a list's empty dicts have none (a DCP save of 1,100 empty
        dicts before an entry was refused with 1,024 places per list).

        Raises:
            CheckpointCorruptError: naming the first key whose path is not of that form.
        """
        if planner_data is None:
            return
        if not isinstance(planner_data, dict):
            raise CheckpointCorruptError(f"the MANIFEST's DCP planner data is a {type(planner_data).__name__}, not a "
                                         f"dict", path=self.path)
        leaves: set[tuple] = set()
        kinds: dict[tuple, type] = {}  # a container's prefix -> the type of its keys (str: dict, int: list)
        lists: dict[tuple, list] = {}  # a list's prefix -> [keys within it, its largest position, that key]

        def bad(fqn: str, obj_path: Any) -> CheckpointCorruptError:
            return CheckpointCorruptError(f"the MANIFEST's DCP planner data gives {fqn!r} the path {str(obj_path)[:200]}, "
                                          f"which does not lead to it (or collides with another key's)",
                                          path=self.path, key=fqn)

        for fqn, obj_path in planner_data.items():
            if not (isinstance(obj_path, (list, tuple)) and obj_path and isinstance(obj_path[0], str)
                    and all(type(k) is str or (type(k) is int and k >= 0) for k in obj_path)
                    and ".".join(map(str, obj_path)) == fqn):
                raise bad(fqn, obj_path)
            obj_path = tuple(obj_path)
            if obj_path in kinds or any(obj_path[:i] in leaves for i in range(1, len(obj_path))):
                raise bad(fqn, obj_path)
            for i in range(1, len(obj_path)):
                key, prefix = obj_path[i], obj_path[:i]
                if kinds.setdefault(prefix, type(key)) is not type(key):
                    raise bad(fqn, obj_path)
                if type(key) is int:
                    seen = lists.setdefault(prefix, [0, -1, fqn])
                    seen[0] += 1
                    if key > seen[1]:
                        seen[1:] = [key, fqn]
            leaves.add(obj_path)
        padding = 0
        for prefix, (count, largest, fqn) in lists.items():
            padding += max(0, largest + 1 - count)
            if padding > _LIST_PADDING:
                raise bad(fqn, planner_data[fqn])

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        pass

    def prepare_local_plan(self, plan):
        return plan

    def prepare_global_plan(self, plans):
        return plans

    def _object_bytes(self, manifest: "mf.Manifest", fqn: str) -> io.BytesIO:
        """The bytes DCP's planner will ``torch.load``: the value decoded by distckpt (a value this
        writer stored, DCP's own bytes, by torch's restricted unpickler: distckpt.dcp's
        decode_writer_value) and re-serialized."""
        entry = manifest.objects[fqn]
        if entry.kind == "pickle" and not self.allow_pickle:
            raise PickleNotAllowedError(f"{fqn} was saved as a pickle; loading it would run code from the checkpoint",
                                        path=self.path, keys=[fqn],
                                        remedy="Pass allow_pickle=True to DistCkptStorageReader for a checkpoint you trust.")
        value = _object_value(entry, manifest, fqn, self.path, self.allow_pickle)
        out = io.BytesIO()
        torch.save(value, out)
        out.seek(0)
        return out

    def read_data(self, plan, planner) -> Future:
        """Fill every ReadItem of this rank: tensors in place (only the bytes needed, checksums
        verified), values through the planner. No collective.

        Raises the read errors of :func:`distckpt.load` (ChecksumMismatchError, DataFileMissingError,
        DataFileTruncatedError, StorageError subclasses) and PickleNotAllowedError."""
        manifest = self._loaded()
        requests, targets, casts = [], [], []
        for item in plan.items:
            fqn = item.storage_index.fqn
            if item.type == LoadItemType.BYTE_IO:
                planner.load_bytes(item, self._object_bytes(manifest, fqn))
                continue
            target = planner.resolve_tensor(item).detach()
            base = item.storage_index.offset or ()
            offsets = tuple(int(b) + int(o) for b, o in zip(base, item.storage_offsets))
            dest = target
            stored = dtype_from_name(manifest.tensors[fqn].dtype, path=self.path)
            if target.dtype != stored:
                # DCP's semantics: a stored dtype other than the destination's is converted by
                # copy_ (FileSystemReader does the same); read into the stored dtype first.
                dest = torch.empty(tuple(target.shape), dtype=stored)
                casts.append((dest, target))
            requests.append((fqn, offsets, tuple(int(n) for n in item.lengths), dest))
            targets.append((item, target))
        if requests:
            with gc_paused():
                if self._chain is not None:
                    self._chain.fill(requests)
                else:
                    fill_parts([Part(open_store(self.path, self.storage_options), self.path, manifest,
                                     box_tasks(self.path, manifest, requests))], verify=self.verify)
        with torch.no_grad():
            for tmp, target in casts:
                target.copy_(tmp)
        for item, target in targets:
            planner.commit_tensor(item, target)
        return _done(None)
