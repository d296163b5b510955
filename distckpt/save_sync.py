"""``distckpt.save``: the public entry point of a blocking (collective) save, and
:func:`save_in_root`, the same save for a caller that owns the checkpoint's root. The phases
themselves are run by :mod:`distckpt.coordinator`."""

from __future__ import annotations

import os
from typing import Any, Callable

from ._dist import ControlGroup, control_group
from .commit import SaveResult
from .coordinator import save_collective
from .storage import normalize_path

__all__ = ["save", "save_in_root"]


def save(state_dict: Any, path: str | os.PathLike, *, process_group: Any = None, overwrite: bool = False,
         allow_pickle: bool = False, metadata: dict | None = None, replicated: Any = "check",
         no_dist: bool = False, storage_options: dict | None = None) -> SaveResult:
    """Save ``state_dict`` as a checkpoint directory at ``path``, atomically.

    Collective over ``process_group`` (default: the world) when torch.distributed is initialized:
    every rank of the group must call it with its own shard of the state. Plain single-process
    otherwise, with ``no_dist=True`` (one rank of a running job saving alone, e.g. a seed
    checkpoint or an export: no collective at all, its data file is ``rank00000.bin``), or over a
    ``process_group`` of one rank.

    The checkpoint's keys are the union of every rank's keys (a per-rank key such as
    ``dataloader.dp_rank_3`` is saved from the rank that has it). A key held by several ranks
    must hold the same value on each (non-tensor values compared exactly, plain tensors by a
    crc32c digest; DTensor Replicate is trusted), unless ``replicated`` says otherwise. Returns
    only after the checkpoint is committed and durable (every data file and MANIFEST fsynced, the
    rename and the parent directory fsynced).

    Args:
        state_dict: nested dict/list/tuple of tensors (any dtype and device; plain tensors,
            DTensor, ShardedTensor), Stateful objects (saved through their ``state_dict()``) and
            values stored without pickle: int, float, bool, str, bytes, None, and lists, tuples,
            namedtuples, sets, dicts of them, torch.Size/dtype/device, Enum members, dataclasses,
            numpy scalars and arrays. Plain tensors under the same key on several ranks are
            replicas and written once.
        path: the checkpoint directory to create: a local path (``file://`` URLs too), or an
            fsspec URL such as ``s3://bucket/run7/step_100`` (docs/FORMAT.md, "Object stores": data
            objects uploaded in parallel, MANIFEST written last with a conditional create).
        overwrite: replace an existing committed checkpoint at ``path`` by an atomic exchange
            (a crash at any point leaves one complete checkpoint there). Default: refuse.
        allow_pickle: store values of other types with pickle (loading them then needs
            ``allow_pickle=True`` too).
        metadata: plain data stored in the manifest (``meta["user"]``).
        replicated: ``"check"`` (default): a key held by several ranks with different values is
            a StateDictMismatchError naming the key and the ranks; ``"rank0"``: the lowest rank
            holding the key wins, unchecked (DCP's behaviour); a set of keys: those (and keys
            under them) are rank-0-wins, every other key is checked.
        no_dist: save from this process alone, with no collective, even inside a distributed job
            (DCP's ``no_dist``); ``process_group`` is then ignored.
        storage_options: for an fsspec URL, the options fsspec passes to its file system (s3fs:
            ``key``, ``secret``, ``endpoint_url``, ``client_kwargs``, ...). Without them s3fs reads
            AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY and AWS_REGION.

    Raises:
        CheckpointExistsError: a committed checkpoint is at ``path`` and ``overwrite`` is False.
        UnsupportedValueError: a value that needs pickle, without ``allow_pickle``.
        StateDictMismatchError: ranks passed inconsistent shapes or shards, or different values
            under one key (see ``replicated``).
        DiskFullError, FileTooLargeError, StoragePermissionError, TooManyOpenFilesError,
        StorageIOError: the typed OS failures (single process), or
        RankFailureError: on every rank when ranks of a collective save failed with different
        classes (with one class, every rank raises that class; both carry ``failures``);
        PeerLostError: a peer died or hung past DISTCKPT_TIMEOUT_S;
        RanksMissingError (a PeerLostError): some ranks of the group did not call save() within
        DISTCKPT_ARRIVAL_TIMEOUT_S (every rank must call it);
        CommittedButPeerLostError: (a PeerLostError) the checkpoint at ``path`` was committed,
            then a peer was lost before every rank heard so; ``committed`` is True.
        SaveInProgressError (a CheckpointExistsError): another live save of ``path`` holds its lock.
        The error of an earlier async save of this process that failed with nobody waiting on its
        handle is raised first (its own class) and this save is not started.
        In every failure case nothing is committed and an earlier checkpoint is untouched, with
        these exceptions, all raised after the commit point and saying so:
        CommittedButPeerLostError, and a PeerLostError with ``committed = None`` on a rank that
        lost rank 0 during the commit and cannot tell.
    """
    return save_in_root(state_dict, path, process_group=process_group, overwrite=overwrite,
                        allow_pickle=allow_pickle, metadata=metadata, replicated=replicated, no_dist=no_dist,
                        storage_options=storage_options)


def save_in_root(state_dict: Any, path: str | os.PathLike, *, after_commit: Callable[[], None] | None = None,
                 lock_path: str | None = None, process_group: Any = None, overwrite: bool = False,
                 allow_pickle: bool = False, metadata: dict | None = None, replicated: Any = "check",
                 no_dist: bool = False, storage_options: dict | None = None) -> SaveResult:
    """:func:`save` for a caller that owns the checkpoint's root (CheckpointManager, the DeepSpeed
    engine): the other arguments are :func:`save`'s.

    Args:
        after_commit: run on rank 0 right after the commit point, under the save's lock (the
            root's ``latest`` update and rotation).
        lock_path: the save lock rank 0 holds from PREPARE to the end (the root's lock; default
            ``.NAME.lock`` beside the checkpoint).

    Raises:
        What :func:`save` raises; besides, an error of ``after_commit`` is raised on every rank
        with ``committed = True`` (the checkpoint is committed and durable).
    """
    from .save_async import raise_background_failure, wait_for_saves
    wait_for_saves()  # an async save still in flight may yet fail: its error comes first
    group = ControlGroup(None, 0, 1) if no_dist else control_group(process_group, operation="save()", kind="save")
    raise_background_failure(group)  # with every rank of the group: all raise, or none does
    return save_collective(group, state_dict=state_dict,
                           final_dir=normalize_path(path), overwrite=overwrite,
                           allow_pickle=allow_pickle, metadata=metadata, after_commit=after_commit,
                           lock_path=lock_path, replicated=replicated, storage_options=storage_options)
