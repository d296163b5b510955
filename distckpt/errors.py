"""The distckpt exception hierarchy.

Invariants:
  * The root, :class:`DistCkptError`, derives from :class:`Exception` (never BaseException), so
    ``except Exception`` in a training loop catches it.
  * Leaves also derive from the builtin a caller would already catch: OS-level failures are
    :class:`OSError` subclasses that keep ``errno`` (``except OSError`` keeps working), a checkpoint
    that already exists is a :class:`FileExistsError`, and so on.
  * Every instance carries ``path``, ``rank`` and ``remedy`` fields, states expected vs found in
    its message, and survives pickling (errors travel between ranks over the control group).
  * errno is mapped to a class in exactly one place: :func:`from_os_error`, called at the storage
    boundary (distckpt.storage.posix).

This module imports nothing from distckpt but the leaf distckpt.sizes.
"""

from __future__ import annotations

import errno as _errno
import os
from typing import Any, Mapping

from .sizes import format_bytes  # a leaf module: binary units, the one size convention

__all__ = [
    "DistCkptError",
    "StorageError",
    "DiskFullError",
    "FileTooLargeError",
    "StoragePermissionError",
    "TooManyOpenFilesError",
    "StorageIOError",
    "SharedMemoryError",
    "HostMemoryError",
    "DistributedEnvError",
    "IOBackendUnavailableError",
    "ObjectStoreError",
    "BucketNotFoundError",
    "ObjectNotFoundError",
    "ObjectStoreAccessError",
    "EndpointUnreachableError",
    "ResponseIncompleteError",
    "ThrottledError",
    "QuotaExceededError",
    "CheckpointExistsError",
    "SaveInProgressError",
    "CheckpointNotFoundError",
    "CheckpointRemovedError",
    "CheckpointIncompleteError",
    "TierIncompleteError",
    "NotDurableError",
    "CheckpointCorruptError",
    "ManifestCorruptError",
    "ChecksumMismatchError",
    "DataFileMissingError",
    "DataFileTruncatedError",
    "ChainBrokenError",
    "UnsupportedValueError",
    "PickleNotAllowedError",
    "StateDictMismatchError",
    "StateChangedError",
    "ReshardError",
    "RankFailureError",
    "collective_error",
    "PeerLostError",
    "CommittedButPeerLostError",
    "RanksMissingError",
    "ProcessGroupDestroyedError",
    "ConfigError",
    "TierMismatchError",
    "from_os_error",
    "typed_memory_error",
    "fill_rank",
    "format_bytes",
]


def _env_rank() -> int | None:
    value = os.environ.get("RANK")
    try:
        return int(value) if value is not None else None
    except ValueError:
        return None


def _restore(cls: type, args: tuple, state: dict, os_fields: tuple | None) -> "DistCkptError":
    obj = cls.__new__(cls, *args)
    obj.args = args
    obj.__dict__.update(state)
    if os_fields is not None:
        obj.errno, obj.strerror, obj.filename = os_fields
    return obj


class DistCkptError(Exception):
    """Root of every error distckpt raises on purpose.

    Attributes:
        message: The full message (expected vs found).
        path: The file or directory concerned, or None.
        rank: The rank where the error happened (from ``RANK`` when not given), or None.
        remedy: One sentence saying what to do about it.
    """

    default_remedy = "See docs/ERRORS.md for this error class."
    #: Set on the error a collective raises on every rank when ranks failed (see
    #: :func:`collective_error`): {rank: the error that rank raised}; None on any other error.
    failures: Mapping[int, BaseException] | None = None
    #: With ``failures``: the ranks that failed, sorted.
    failed_ranks: list[int] | None = None

    def __init__(
        self,
        message: str,
        *,
        path: str | os.PathLike | None = None,
        rank: int | None = None,
        remedy: str | None = None,
        errno: int | None = None,
        **details: Any,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.path = os.fspath(path) if path is not None else None
        self.rank = rank if rank is not None else _env_rank()
        self.remedy = remedy or self.default_remedy
        self.details = dict(details)
        for key, value in details.items():  # typed fields: e.key, e.free, e.needed ...
            if not hasattr(type(self), key):
                setattr(self, key, value)
        if isinstance(self, OSError):
            # OSError's own slots: keep errno so `except OSError as e: e.errno` keeps working.
            self.errno = errno
            self.strerror = os.strerror(errno) if errno is not None else None
            self.filename = self.path
        elif errno is not None:
            self.details["errno"] = errno

    def __str__(self) -> str:
        where = []
        if self.rank is not None:
            where.append(f"rank {self.rank}")
        if self.path is not None:
            where.append(f"path {self.path}")
        prefix = f"[{', '.join(where)}] " if where else ""
        return f"{prefix}{self.message}. Remedy: {self.remedy}"

    def __reduce__(self):
        os_fields = (self.errno, self.strerror, self.filename) if isinstance(self, OSError) else None
        return (_restore, (type(self), self.args, dict(self.__dict__), os_fields))


# --------------------------------------------------------------------------------------------
# Storage (OS-level) errors. All are OSError subclasses that keep errno.


class StorageError(DistCkptError, OSError):
    """An OS-level failure at the storage boundary that no narrower class describes."""

    default_remedy = "Check the file system's health and the error number above."


class DiskFullError(StorageError):
    """ENOSPC or EDQUOT: the file system (or the user's quota) has no room left.

    Extra fields: ``needed`` and ``free`` in bytes when known.
    """

    default_remedy = (
        "Free space on that file system (delete old checkpoints or lower keep_last), "
        "raise the quota, or save to a larger volume."
    )


class FileTooLargeError(StorageError):
    """EFBIG: the file exceeds RLIMIT_FSIZE or the file system's maximum file size."""

    default_remedy = "Raise the file-size limit (`ulimit -f unlimited`) or use a file system that allows larger files."


class StoragePermissionError(StorageError, PermissionError):
    """EACCES, EPERM or EROFS: the process may not create or write that file."""

    default_remedy = (
        "Make the checkpoint directory writable by this user (and the mount read-write), "
        "or choose another directory."
    )


class TooManyOpenFilesError(StorageError):
    """EMFILE or ENFILE: the per-process or system-wide fd table is full."""

    default_remedy = "Raise the open-file limit (`ulimit -n 65536`) or close files the job keeps open."


class StorageIOError(StorageError):
    """EIO (at write, read or fsync). Never retried: after a failed fsync the page cache may
    already have dropped the data, so the only safe answer is to fail the save."""

    default_remedy = ("The device reported an I/O error: check dmesg and the disk. A save that raised it was not "
                      "committed; a read that raised it left the checkpoint as it was.")


class SharedMemoryError(DistCkptError, OSError):
    """/dev/shm is too small for what the job needs (NCCL's shared-memory transport, workers)."""

    default_remedy = (
        "Give the container more shared memory (docker --shm-size=8g, a larger /dev/shm mount) "
        "or set NCCL_SHM_DISABLE=1."
    )


class HostMemoryError(StorageError, MemoryError):
    """This process ran out of host memory or address space for something a save or load needs
    (ENOMEM from mmap or open, a MemoryError): a staging arena of an async save, a read buffer, a
    MANIFEST. Also a MemoryError. Field ``needed``: the bytes asked for, when known."""

    default_remedy = ("Free host memory or raise this process's limit (the container's memory limit, `ulimit -v`); "
                      "for async saves, lower DISTCKPT_STAGING_POOL_BYTES, call release_staging_memory(), or save "
                      "synchronously. A save that raised it committed nothing; a load that raised it left the "
                      "checkpoint as it was.")


class IOBackendUnavailableError(DistCkptError, OSError):
    """A forced io backend (DISTCKPT_IO_BACKEND) cannot run here: io_uring refused by the kernel
    or a seccomp filter, or O_DIRECT refused by the file system."""

    default_remedy = "Set DISTCKPT_IO_BACKEND=auto to let distckpt choose a backend that works here."


# --------------------------------------------------------------------------------------------
# Object stores (S3 and the other fsspec stores). Translated from botocore / aiobotocore / s3fs
# exceptions in one place: distckpt.storage.object.errors.translate. ``path`` is the object's URL.


class ObjectStoreError(StorageError):
    """A request to an object store failed and no narrower class describes it (a server-side
    InternalError, a malformed response, an unknown error code).

    Fields: ``url`` (the object or prefix), ``operation`` (what distckpt was doing, e.g.
    ``upload part``), ``code`` (the store's error code, e.g. ``InternalError``, or the client
    exception's name), ``status`` (the HTTP status, or None without a response), ``endpoint``.
    """

    default_remedy = ("Check the object store's health and the error code above, then retry. A failed read "
                      "changed nothing; a failed save committed nothing unless its error says the outcome is "
                      "unknown (commit_unknown).")


class BucketNotFoundError(ObjectStoreError, FileNotFoundError):
    """The bucket in the URL does not exist (NoSuchBucket) on the endpoint that was asked."""

    default_remedy = ("Create the bucket (distckpt never creates one), or fix the bucket name or the endpoint "
                      "(AWS_ENDPOINT_URL / storage_options client_kwargs endpoint_url).")


class ObjectNotFoundError(ObjectStoreError, FileNotFoundError):
    """An object that was expected is not in the bucket (NoSuchKey / 404 outside a checkpoint's
    own files, which raise DataFileMissingError or CheckpointNotFoundError)."""

    default_remedy = "Check the URL; list what is there with `distckpt ls` on its parent prefix."


class ObjectStoreAccessError(ObjectStoreError, PermissionError):
    """The store refused the request (403: AccessDenied, InvalidAccessKeyId, SignatureDoesNotMatch,
    ExpiredToken, RequestTimeTooSkewed) or no credentials could be found at all.

    Field ``code`` tells which: a wrong key or secret (``InvalidAccessKeyId`` /
    ``SignatureDoesNotMatch``), missing credentials (``NoCredentialsError``), or valid credentials
    without the permission (``AccessDenied``)."""

    default_remedy = ("Check the credentials (AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY, AWS_PROFILE, or "
                      "storage_options key/secret) and that they may read, write, list and delete in this "
                      "bucket; a skewed clock also fails signatures.")


class EndpointUnreachableError(ObjectStoreError, ConnectionError):
    """No answer from the endpoint: connection refused or reset, a DNS failure, or a connect /
    read timeout, after the client's own retries."""

    default_remedy = ("Check that the endpoint URL is right and the server is up and reachable from this node "
                      "(AWS_ENDPOINT_URL / storage_options client_kwargs endpoint_url; proxies, firewalls).")


class ResponseIncompleteError(EndpointUnreachableError):
    """The endpoint answered, but the answer's body arrived short (the connection closed or was
    reset before its end) or did not match the checksum the store sent with it, through every
    retry. The stored object is not known to be damaged: this is the network between this node
    and the store (a proxy, a load balancer, a reset), not the checkpoint."""

    default_remedy = ("Retry; the stored object is not known to be damaged. If it persists, check what sits "
                      "between this node and the store (proxies, load balancers, TLS terminators).")


class ThrottledError(ObjectStoreError):
    """The store kept answering "slow down" (SlowDown, 503, 429, Throttling...) through every retry
    of distckpt's bounded exponential backoff. Fields: ``attempts``, ``waited_s``."""

    default_remedy = ("The store is rate-limiting this job: spread the keys over more prefixes, run fewer "
                      "requests at once, or ask the store's operator for a higher request rate.")


class QuotaExceededError(ObjectStoreError, DiskFullError):
    """The store refused a write because a quota or its capacity is exhausted (QuotaExceeded,
    XMinioStorageFull, HTTP 507 Insufficient Storage). Also a DiskFullError."""

    default_remedy = ("Free space in the bucket (delete old checkpoints or lower keep_last), raise the bucket's "
                      "quota, or save to another bucket.")


# --------------------------------------------------------------------------------------------
# Environment and configuration.


class DistributedEnvError(DistCkptError, RuntimeError):
    """The torchrun / NCCL / Gloo environment is missing or inconsistent.

    Extra field: ``variable``, the environment variable at fault, when there is one.
    """

    default_remedy = "Launch with torchrun (or set RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT consistently)."


class ConfigError(DistCkptError, ValueError):
    """A DISTCKPT_* variable or an option holds an invalid value."""

    default_remedy = "Fix the value named above (allowed values: the Configuration section of README.md)."


class TierMismatchError(ConfigError):
    """The remote tier a TieredCheckpointManager was given is not the one a node's local tier
    drained to before (distckpt.tiers): its root holds another tier's identity, or none at all (a
    file system that is not mounted reads as an empty directory). Nothing was read or written.
    Fields: ``recorded`` ({node: the tier id its local tier drained to}), ``found`` (the remote
    root's tier id, or None)."""

    default_remedy = ("Mount the file system that holds the remote tier (or pass its right path / URL); if the "
                      "remote tier was moved or replaced on purpose, delete the LOCAL/.distckpt-tier-remote file of "
                      "each node named.")


# --------------------------------------------------------------------------------------------
# Checkpoint state on disk.


class CheckpointExistsError(DistCkptError, FileExistsError):
    """A committed checkpoint already exists at the path; distckpt never overwrites in place."""

    default_remedy = "Pass overwrite=True to replace it atomically, or save to a new path."


class SaveInProgressError(CheckpointExistsError):
    """Another live save holds the lock of this checkpoint (or of this CheckpointManager root):
    two saves of one path, or two managers saving into one root at once. Nothing was written.

    Fields: ``owner``: the other save's owner record (host, pid, started_unix, save_id, what)."""

    default_remedy = ("Only one job may save into a checkpoint root at a time: give each job its own root, "
                      "or wait for the other save to finish (`distckpt ls ROOT` shows it).")


class CheckpointNotFoundError(DistCkptError, FileNotFoundError):
    """No checkpoint (or no committed step) at the path."""

    default_remedy = "Check the path; list committed steps with `distckpt ls ROOT`."


class CheckpointRemovedError(CheckpointNotFoundError):
    """The checkpoint was removed (or replaced) while it was being read: rotation (a manager's
    ``keep_last``), an overwrite, or a deletion got to it between reading its MANIFEST and opening
    its data files. It was not damaged; it is gone.

    Fields: ``renamed_to`` (the hidden ``.NAME.del-*`` / ``.NAME.tmp-*`` name it was moved to on
    its way out, when it was still there to be seen, else None), ``replaced`` (True when another
    directory now has its name).
    """

    default_remedy = (
        "Load a newer step (CheckpointManager.latest_step()); to read a step while saves go on, keep "
        "it out of rotation (a larger keep_last) and do not overwrite or delete a step being read."
    )


class CheckpointIncompleteError(DistCkptError, FileNotFoundError):
    """The directory is not a committed checkpoint: no MANIFEST, or a save's temporary directory."""

    default_remedy = "Load a committed checkpoint instead; this one was never finished and is never loadable."


class TierIncompleteError(CheckpointIncompleteError):
    """A tiered checkpoint (distckpt.tiers) has no complete copy of one save that the ranks can
    read: a data file is on no tier a rank that needs it can reach (not in its node's local copy
    of the save, and the remote tier has not committed it), or, for a drain to the remote tier,
    on no node of the local tier (or the nodes hold different saves of the step); nothing was
    loaded or drained. Fields: ``step`` (the step's directory name), ``files`` (the data files
    missing), ``tiers`` (what each tier holds)."""

    default_remedy = ("Wait for the step's drain to the remote tier to finish (or restart on the nodes that hold "
                      "it), or load an older step that the remote tier holds.")


class NotDurableError(DistCkptError, RuntimeError):
    """A step of a tiered manager (distckpt.tiers) did not reach the remote tier: its drain failed
    for good, was stopped by ``close()``, or a wait for it timed out. The step stays committed on
    the local tier; nothing partial is visible remotely.

    Fields: ``steps`` (the step numbers not remote), ``cause`` (the drain's last error, or None)."""

    default_remedy = ("The steps stay committed locally: fix the cause (status(step).error), then start a "
                      "TieredCheckpointManager on the same tiers, which drains them at construction.")


class CheckpointCorruptError(DistCkptError, ValueError):
    """The checkpoint's bytes do not match what its MANIFEST promises."""

    default_remedy = "Restore from an older checkpoint (or a replica); this one is damaged."


class ManifestCorruptError(CheckpointCorruptError):
    """MANIFEST is damaged: bad magic, unknown version, checksum mismatch, or invalid values
    (a file name that escapes the directory, offsets outside a file)."""


class ChecksumMismatchError(CheckpointCorruptError):
    """A data block's checksum differs from the MANIFEST's. Fields: ``file``, ``key``, ``offset``;
    raised by a load also ``filled`` / ``partly_filled`` (keys whose tensors received verified
    bytes, completely / in part; no other byte of the state dict changed)."""


class DataFileMissingError(CheckpointCorruptError):
    """A data file the MANIFEST lists does not exist."""


class DataFileTruncatedError(CheckpointCorruptError):
    """A data file is shorter than the MANIFEST says. Fields: ``expected``, ``found``."""


# --------------------------------------------------------------------------------------------
# State dicts.


class ChainBrokenError(CheckpointCorruptError):
    """An incremental checkpoint's chain (docs/INCREMENTAL.md) cannot be composed: a link it
    depends on is missing, not committed, replaced by another save, damaged, or names a different
    chain. Raised before any byte of the chain is read when the chain's structure is wrong, and
    instead of a partial restore when a link's data turns out damaged.

    Fields: ``link`` (the path of the link at fault), ``reason`` (what is wrong with it).
    """

    default_remedy = ("Load an older full checkpoint or another step whose chain is complete "
                      "(`distckpt ls ROOT` shows each step's chain, `distckpt verify PATH` checks one).")


class UnsupportedValueError(DistCkptError, TypeError):
    """A state dict value distckpt cannot save without pickle. Field: ``key``."""

    default_remedy = "Convert the value to a tensor or a plain int/float/bool/str/bytes/None, or pass allow_pickle=True."


class PickleNotAllowedError(DistCkptError, TypeError):
    """The checkpoint holds pickled objects and the caller did not opt in. Field: ``keys``."""

    default_remedy = "Pass allow_pickle=True only if you trust where this checkpoint came from."


class StateDictMismatchError(DistCkptError, KeyError):
    """The caller's state dict and the checkpoint disagree. Every disagreement is listed at once.

    Fields: ``missing`` (keys the caller wants that the checkpoint lacks), ``unexpected`` (keys in
    the checkpoint the caller lacks), ``shape_mismatch`` and ``dtype_mismatch`` ({key: (saved, wanted)}).
    """

    default_remedy = "Pass strict=False to load what matches (the result lists what did not), or fix the model definition."

    def __str__(self) -> str:  # KeyError would quote the message; keep it readable.
        return DistCkptError.__str__(self)


class StateChangedError(DistCkptError, RuntimeError):
    """An async save staging in the background (``stage_in_background=True``) found tensors of its
    state (or their DTensors) changed in place by a torch operation before their copy ended (their
    version counters moved): what it would write is not the state of the call. Nothing is
    committed. Field: ``keys`` (the changed tensors' keys)."""

    default_remedy = ("Call handle.wait_staged() (torchtitan: maybe_wait_for_staging()) before anything "
                      "changes the state's tensors, or save with stage_in_background=False when something "
                      "changes them during the step (e.g. BatchNorm's running statistics in forward).")


class ReshardError(DistCkptError, ValueError):
    """A saved layout cannot be converted exactly onto the requested one."""

    default_remedy = "Load onto a layout whose state can be reconstructed exactly (see docs for supported conversions)."


# --------------------------------------------------------------------------------------------
# Collective failures.


class RankFailureError(DistCkptError, RuntimeError):
    """One or more ranks failed during a collective save or load; raised on every rank.

    Fields: ``failures``: {rank: the typed error that rank raised}. Nothing was committed.
    """

    default_remedy = "Fix the cause reported for each failed rank; the previous checkpoint is intact."

    def __init__(self, failures: Mapping[int, BaseException], *, operation: str = "save", **kw: Any) -> None:
        self.failures = dict(failures)
        self.failed_ranks = sorted(self.failures)
        self.operation = operation
        if kw.get("remedy") is None:
            # each typed failure's own remedy, once per class (the causes in the message omit them)
            own = {}
            for r, e in sorted(self.failures.items()):
                if isinstance(e, DistCkptError) and not getattr(e, "original_class", None) \
                        and e.remedy != DistCkptError.default_remedy:
                    own.setdefault(type(e).__name__, (r, e.remedy))
            kw["remedy"] = " ".join([self.default_remedy] + [f"Rank {r} ({name}): {remedy}"
                                                             for name, (r, remedy) in own.items()])
        super().__init__(_failures_message(self.failures, operation), **kw)


def _failures_message(failures: Mapping[int, BaseException], operation: str) -> str:
    # A cause's text may end in a period; the message adds its own (". Remedy: ...").
    causes = "; ".join(f"rank {r}: {_cause(e).rstrip('.')}" for r, e in sorted(failures.items()))
    return f"{operation} failed on rank(s) {sorted(failures)}: {causes}"


def _cause(e: BaseException) -> str:
    """``Class: message`` of one rank's failure: a typed error's message without its rank prefix
    and remedy (the collective error has its own), an error of another class that crossed ranks
    (``original_class``, see ``_dist._portable``) under its own class name."""
    if not isinstance(e, DistCkptError):
        return f"{type(e).__name__}: {e}"
    if getattr(e, "original_class", None):
        return e.message   # already "RuntimeError: ..."
    return f"{type(e).__name__}: {e.message}"


def collective_error(failures: Mapping[int, BaseException], *, operation: str, rank: int | None) -> DistCkptError:
    """The error every rank of a collective raises when ranks failed (``failures``: {rank: the
    error that rank raised}, non-empty), so that a caller catches the class it expects.

    When every failing rank raised the same typed class (a subclass of DistCkptError: a missing
    tag's CheckpointNotFoundError, a full disk's DiskFullError), it is an instance of that class,
    so ``except CheckpointNotFoundError`` (or ``except FileNotFoundError``) catches it on every
    rank: a copy of the lowest failing rank's error (its typed fields and ``rank``), whose message
    names every failing rank and its error. Otherwise (different classes, or errors that were not
    typed) it is a :class:`RankFailureError` (``rank``: the raising rank). Both carry
    ``failures``, ``failed_ranks`` and ``operation``. (One class cannot serve both: RankFailureError
    is a RuntimeError, and OSError-derived classes cannot share a subclass with it.)
    """
    failures = dict(failures)
    if not failures:
        raise ValueError("collective_error needs at least one failure")
    classes = {type(e) for e in failures.values()}
    cls = next(iter(classes))
    if len(classes) > 1 or not issubclass(cls, DistCkptError) or cls in (DistCkptError, RankFailureError):
        return RankFailureError(failures, operation=operation, rank=rank)
    first = min(failures)
    err = _restore(*failures[first].__reduce__()[1])  # a copy: the failure itself stays in ``failures``
    err.message = _failures_message(failures, operation)
    os_fields = (err.errno, err.strerror, err.filename) if isinstance(err, OSError) else None
    err.args = (err.message,)
    if os_fields is not None:  # assigning args resets OSError's own fields
        err.errno, err.strerror, err.filename = os_fields
    err.failures, err.failed_ranks, err.operation = failures, sorted(failures), operation
    return err


class PeerLostError(DistCkptError, RuntimeError):
    """A peer rank died or stopped answering during a collective (bounded by DISTCKPT_TIMEOUT_S).

    Raised by a save before its commit point, nothing was committed. Lost while the commit verdict
    was being sent (the last step of a save), the checkpoint may be committed: rank 0 then raises
    :class:`CommittedButPeerLostError`, and so does another rank that finds the commit on the
    shared file system; a plain PeerLostError at that point has ``committed = None`` (this rank
    cannot tell) and ``save_id`` (the save whose MANIFEST would be at ``path`` if it committed).
    ``lost_ranks``: the group ranks that never reached the collective that failed (each rank
    records its progress in the job's store), when the store could tell; the message names them.
    """

    default_remedy = "Check the other ranks' logs; restart the job from the newest committed checkpoint."


class CommittedButPeerLostError(PeerLostError):
    """A save committed its checkpoint, then a peer was lost before every rank heard the verdict.

    The checkpoint at ``path`` is complete and durable (and the manager's ``latest`` and rotation
    ran); what failed is the job, not the save. Fields: ``committed`` (always True), ``path``,
    ``lost_ranks`` (the rank(s) that stopped answering, when they can be told apart: the other rank
    of a two-rank job, or rank 0 as seen by the others; else every rank that may be the one),
    ``after_commit_error`` (an error of the manager's ``latest`` update / rotation, or None).
    A subclass of PeerLostError, so handlers of a lost peer still catch it.
    """

    default_remedy = ("The checkpoint at the path above is committed: restart the job from it (check the lost "
                      "rank's logs for why it died).")


class RanksMissingError(PeerLostError):
    """Some ranks of the group did not enter the same distckpt collective within
    DISTCKPT_ARRIVAL_TIMEOUT_S (e.g. ``save()`` called on rank 0 only).

    Fields: ``missing``: the group ranks that did not arrive; ``operation``: what was called."""

    default_remedy = ("Look at the missing ranks' logs: a rank that died or is stuck is the cause; otherwise "
                      "every rank of the process group must call it (each with its own shard), and to save "
                      "from one process inside a job, pass no_dist=True (a single-process save).")


class ProcessGroupDestroyedError(DistributedEnvError):
    """This process destroyed the process group (``torch.distributed.destroy_process_group()``)
    while a collective async save on it was still in flight; its background phases could not run
    their collectives.

    Not a :class:`PeerLostError`: no peer died, the group was taken away under the save (a
    subclass of :class:`DistributedEnvError`: the distributed environment the save ran in is
    gone). Fields: ``committed`` (False: nothing was committed, the save stopped before its commit
    point; True: rank 0 had committed before the group went away; None: this rank cannot tell,
    ``save_id`` is the id the MANIFEST at ``path`` carries if it committed), ``path``, ``save_id``
    (when known). The :class:`PeerLostError` the broken collective raised is ``__cause__``.
    """

    default_remedy = ("Wait for every async save (handle.result(), CheckpointManager.close()) before "
                      "destroy_process_group(); save again once a process group is initialized.")


def fill_rank(exc: BaseException, rank: int | None) -> BaseException:
    """Record ``rank`` on a typed error that does not know its rank yet; returns ``exc``.

    The storage layer (distckpt.storage.posix) raises without knowing which rank it runs
    on; RANK is only in the environment under torchrun. The collective code that caught the error
    knows its group rank, so it fills the field in before the error is raised or exchanged: a
    single-process save reports rank 0 instead of None, and a rank of a sub-group its group rank.
    """
    if isinstance(exc, DistCkptError) and exc.rank is None and rank is not None:
        exc.rank = rank
    return exc


# --------------------------------------------------------------------------------------------
# errno mapping: the one place.

_ERRNO_CLASS: dict[int, type[StorageError]] = {
    _errno.ENOSPC: DiskFullError,
    _errno.EDQUOT: DiskFullError,
    _errno.EFBIG: FileTooLargeError,
    _errno.EACCES: StoragePermissionError,
    _errno.EPERM: StoragePermissionError,
    _errno.EROFS: StoragePermissionError,
    _errno.EMFILE: TooManyOpenFilesError,
    _errno.ENFILE: TooManyOpenFilesError,
    _errno.EIO: StorageIOError,
    # distckpt's own deadline on one O_DIRECT request (DISTCKPT_IO_TIMEOUT_S), or a soft network
    # mount's: the storage stopped answering.
    _errno.ETIMEDOUT: StorageIOError,
    _errno.ENOMEM: HostMemoryError,
}


# errnos that mean "this path cannot be used", not "the storage is unhealthy": for any operation,
# and for operations that create something (where ENOENT/EEXIST are about the path, while for a read
# a missing file is another story, told by the caller).
_PATH_ERRNOS_ANY_OP = {_errno.ENOTDIR, _errno.ENAMETOOLONG}
_PATH_ERRNOS_CREATE = {_errno.EEXIST, _errno.ENOENT, _errno.EISDIR}
_CREATE_OPS = {"mkdir", "probe", "create probe file"}


def _path_problem(code: int, path: str, message: str) -> tuple[str, str]:
    """(message, remedy) naming the part of ``path`` that makes ``code`` happen."""
    probe = path
    while probe and not os.path.lexists(probe) and os.path.dirname(probe) != probe:
        probe = os.path.dirname(probe)  # the deepest part of the path that exists
    if code == _errno.ENOTDIR:
        blocker = probe if os.path.lexists(probe) and not os.path.isdir(probe) else None
        if blocker is None:  # stat could not tell: name the parent
            blocker = os.path.dirname(path)
        parent = os.path.dirname(blocker)
        if os.path.basename(blocker) == "MANIFEST" or os.path.isfile(os.path.join(parent, "MANIFEST")):
            # A file of a committed checkpoint: moving it would un-commit the checkpoint.
            return (f"{message}: {blocker} is a file of the checkpoint {parent}, not a directory",
                    f"Pass the checkpoint directory {parent} itself, not a path under one of its files.")
        return (f"{message}: {blocker} is a file, not a directory, so nothing can exist under it",
                f"Choose a path whose every parent is a directory (or move the file {blocker} away).")
    if code == _errno.EEXIST:
        kind = "a file" if os.path.isfile(path) else "a symlink" if os.path.islink(path) else "something"
        parent = os.path.dirname(path)
        if os.path.basename(path) == "MANIFEST" or os.path.isfile(os.path.join(parent, "MANIFEST")):
            # A file of a committed checkpoint: removing it would un-commit (or damage) the checkpoint.
            return (f"{message}: {path} already exists and is {kind} of the checkpoint {parent}",
                    f"Choose a path outside the checkpoint {parent}.")
        return (f"{message}: {path} already exists and is {kind}, not a directory",
                f"Choose another path, or remove {path} if it is not needed.")
    if code == _errno.ENOENT:
        what = "it" if probe == path else os.path.relpath(path, probe)
        return (f"{message}: {probe} exists but {what} cannot be created there",
                "Check the path: a pseudo file system such as /proc or /sys refuses new files, and a "
                "directory removed meanwhile loses them; save to a directory on a real file system.")
    if code == _errno.ENAMETOOLONG:
        return message, "Shorten the path (each name must be at most 255 bytes, the whole path 4096)."
    return message, f"{path} is a directory where a file was expected: choose another path."


def _free_space(path: str) -> tuple[int, int | None] | None:
    """(free bytes, free inodes) of the file system holding ``path``, the inodes None where it
    keeps no inode count (btrfs, tmpfs with nr_inodes=0, some network ones: f_files 0); None when
    statvfs fails."""
    probe = path
    while probe and not os.path.isdir(probe):
        parent = os.path.dirname(probe)
        if parent == probe:
            break
        probe = parent
    try:
        st = os.statvfs(probe or ".")
    except OSError:
        return None
    return st.f_bavail * st.f_frsize, (st.f_favail if st.f_files > 0 else None)


def typed_memory_error(exc: BaseException) -> BaseException:
    """``exc`` itself, unless it is Python's bare MemoryError or torch's failed host allocation
    (a RuntimeError, "DefaultCPUAllocator: can't allocate memory"): then a :class:`HostMemoryError`
    (also a MemoryError) saying so, with ``exc`` as its cause."""
    torch_cpu = type(exc) is RuntimeError and "DefaultCPUAllocator: can't allocate memory" in str(exc)
    if not (isinstance(exc, MemoryError) or torch_cpu) or isinstance(exc, DistCkptError):
        return exc
    out = HostMemoryError(f"out of host memory: {type(exc).__name__}{': ' + str(exc) if str(exc) else ''}",
                          errno=_errno.ENOMEM)
    out.__cause__ = exc
    return out


def from_os_error(
    exc: OSError,
    *,
    path: str | os.PathLike | None = None,
    rank: int | None = None,
    operation: str = "write",
    needed: int | None = None,
) -> DistCkptError:
    """Translate an OSError raised at the storage boundary into the typed class for its errno.

    Returns the error (the caller raises it ``from exc``). Errors that already are DistCkptError
    are returned unchanged. The message names the operation, the path, and for ENOSPC/EDQUOT the
    free bytes and inodes left on that file system.
    """
    if isinstance(exc, DistCkptError):
        return exc
    path = os.fspath(path) if path is not None else exc.filename
    code = exc.errno
    cls = _ERRNO_CLASS.get(code, StorageError)
    reason = os.strerror(code) if code is not None else str(exc)
    message = f"{operation} failed: [Errno {code}] {reason}"
    details: dict[str, Any] = {"operation": operation}
    if cls is DiskFullError and path is not None:
        free = _free_space(os.fspath(path))
        if free is not None:
            details["free"], details["free_inodes"] = free
            inodes = "no inode limit" if free[1] is None else f"{free[1]} inodes free"
            message += f"; {format_bytes(free[0])} and {inodes} on that file system"
        if needed is not None:
            details["needed"] = needed
            message += f", {format_bytes(needed)} needed"
    if code == _errno.EROFS:
        remedy = "The file system is mounted read-only: remount it read-write or save elsewhere."
    elif path is not None and (code in _PATH_ERRNOS_ANY_OP
                               or (code in _PATH_ERRNOS_CREATE and operation in _CREATE_OPS)):
        # The path is at fault, not the file system: say which part of it.
        message, remedy = _path_problem(code, os.fspath(path), message)
    elif code == _errno.EDQUOT:
        # the file system may have room: it is this user's (or group's, project's) share that is spent
        remedy = ("A disk quota is exhausted (bytes or files) for this user, group or project: delete old "
                  "checkpoints you own or lower keep_last, ask for a larger quota (`quota -s` shows it), "
                  "or save elsewhere.")
    elif code == _errno.ENOSPC and details.get("free_inodes") == 0 and details["free"] > 0:
        remedy = ("Free inodes (files) on that file system: it has bytes left but no inodes; delete old "
                  "checkpoints or lower keep_last, or save to a file system with more inodes.")
    elif code == _errno.EIO and operation == "fsync":
        remedy = ("fsync reported an I/O error: the data may be lost from the page cache, so the save "
                  "was failed, not retried; check dmesg and the disk.")
    elif code == _errno.ETIMEDOUT:
        message = (f"{operation} failed: [Errno {code}] the storage did not complete a request within the "
                   f"deadline")
        remedy = ("A read or write of this file got no answer in time: within DISTCKPT_IO_TIMEOUT_S (distckpt's "
                  "bound on any one O_DIRECT request, default 300 s) or a soft network mount's own timeout. "
                  "The device or the file system is stuck: check dmesg, the disk and the mount. A save that "
                  "raised it was not committed; a read that raised it left the checkpoint as it was. "
                  "Raise DISTCKPT_IO_TIMEOUT_S only for storage known to stall that long and recover.")
    elif cls is StoragePermissionError and _is_read(operation):
        # the class's remedy is a writer's ("make it writable"): a read needs read permission
        remedy = ("Make the checkpoint readable by this user: read permission on its files and search (x) "
                  "permission on every directory down to it; or run as the user that can read it.")
    else:
        remedy = None
    return cls(message, path=path, rank=rank, remedy=remedy, errno=code, **details)


def _is_read(operation: str) -> bool:
    """Whether a from_os_error ``operation`` only reads ("open" alone may be a writer's open)."""
    return operation.split(" ", 1)[0] in ("read", "stat", "lstat", "list") or operation in (
        "open MANIFEST", "open data file")
